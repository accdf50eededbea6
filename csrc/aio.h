// Swap-file I/O engine of the NVMe tier: positional reads/writes of whole CPU tensors on a fixed
// pool of worker threads. Workers never touch Python; the bindings release the GIL while waiting.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hetero {

// O_DIRECT transfers need buffer address, file offset and length aligned to this.
constexpr int64_t kDirectAlignment = 4096;

// A failed system call or transfer; the bindings turn it into OSError(err, what()).
class IOFailure : public std::runtime_error {
 public:
  IOFailure(int err, const std::string& msg) : std::runtime_error(msg), err(err) {}
  int err;
};

// Test-only simulated disk faults, applied to one request.
enum class Fault { kNone, kEIO, kENOSPC, kShort };
Fault parse_fault(const std::string& kind);  // throws std::invalid_argument

class IOEngine {
 public:
  explicit IOEngine(int num_threads);
  ~IOEngine();
  IOEngine(const IOEngine&) = delete;
  IOEngine& operator=(const IOEngine&) = delete;

  // Opens (creating, mode 0600) `path` read-write and grows it to `size` bytes if smaller.
  // Returns -1 when `direct` was asked and the file system rejects O_DIRECT (EINVAL), so the
  // caller can retry buffered; any other failure throws IOFailure.
  int open(const std::string& path, int64_t size, bool direct);
  void close(int fd);

  // Queue a pwrite/pread of all of `tensor`'s bytes at `offset`; returns a handle for wait/poll.
  // Argument errors (non-CPU or non-contiguous tensor, O_DIRECT misalignment) throw
  // std::invalid_argument in the calling thread. `fault` is the test-only fault hook.
  int64_t submit(bool write, int fd, const at::Tensor& tensor, int64_t offset,
                 Fault fault = Fault::kNone);

  // Blocks until the request is done and forgets the handle; throws IOFailure if it failed and
  // std::invalid_argument for an unknown (or already waited) handle. Call without the GIL.
  void wait(int64_t handle);
  bool poll(int64_t handle);

  // Finishes the queued requests and joins the workers; their handles can still be waited
  // (results are kept until the engine is destroyed). Later submits throw. Idempotent.
  void shutdown();
  int num_threads() const { return num_threads_; }

 private:
  struct Request {
    bool write;
    int fd;
    at::Tensor tensor;  // keeps the buffer alive until the request is waited
    int64_t offset;
    Fault fault;
    bool done = false;
    int err = 0;
    std::string message;
  };

  void worker();
  static void execute(Request& r);

  const int num_threads_;
  std::mutex mu_;
  std::condition_variable work_cv_;  // queue_ gained an item, or stopping_
  std::condition_variable done_cv_;  // some request finished
  std::deque<std::shared_ptr<Request>> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_handle_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace hetero
