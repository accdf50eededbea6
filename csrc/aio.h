// Swap-file I/O engine of the NVMe tier: positional reads/writes of whole CPU tensors.
//
// A request (all bytes of one tensor at one file offset) is split into sub-requests ("chunks") of
// the engine's block size, and up to `queue_depth` chunks are in flight at once, across requests.
// Two backends, chosen at construction:
//   io_uring  one ring (liburing) owned by one completion thread, which submits chunks, reaps
//             their completions and resubmits short transfers; submitters wake it via an eventfd
//             whose read sits in the ring. Built only with -DHETERO_HAVE_LIBURING.
//   threads   a pool of max(num_threads, queue_depth) workers doing blocking pread/pwrite of one
//             chunk each, at most queue_depth of them busy at once.
// Workers never touch Python; the bindings release the GIL while waiting.
//
// Optional checksums: with `checksum` on, every chunk written gets a CRC32C recorded under
// (fd, file offset, length); a read verifies every recorded extent that lies inside it and fails
// with EIO ("checksum mismatch") when the bytes differ. Overwrites and close() forget the records.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
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
// Upper bound of queue_depth (the io_uring ring is sized for it once).
constexpr int kMaxQueueDepth = 256;
// Block sizes the engine accepts: multiples of kDirectAlignment in [4 KiB, 64 MiB].
constexpr int64_t kMaxBlockSize = int64_t(64) << 20;

// A failed system call or transfer; the bindings turn it into OSError(err, what()).
class IOFailure : public std::runtime_error {
 public:
  IOFailure(int err, const std::string& msg) : std::runtime_error(msg), err(err) {}
  int err;
};

// Test-only simulated disk faults, applied to one request:
//   kEIO / kENOSPC  the device fails every sub-request with that errno (nothing transferred);
//   kShort          only the first half (page aligned) is transferred, the rest makes no progress;
//   kCorrupt        the bytes are transferred but one is flipped on the way (on disk for a write,
//                   in the destination for a read): silent corruption, caught by checksums.
enum class Fault { kNone, kEIO, kENOSPC, kShort, kCorrupt };
Fault parse_fault(const std::string& kind);  // throws std::invalid_argument

// CRC32C (Castagnoli) of `n` bytes, continuing from `crc` (0 to start); SSE4.2 when available.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// Whether this build has the io_uring backend and, if so, whether this kernel lets us create a
// ring; `why` gets the reason when not.
bool io_uring_available(std::string* why = nullptr);

class IOEngine {
 public:
  // backend: "auto" (io_uring when a ring can be created, else threads), "io_uring" (throws
  // IOFailure when unavailable) or "threads". block_size: multiple of 4096 in [4 KiB, 64 MiB];
  // queue_depth in [1, kMaxQueueDepth]. Bad arguments throw std::invalid_argument.
  IOEngine(int num_threads, const std::string& backend = "auto",
           int64_t block_size = int64_t(1) << 20, int queue_depth = 32, bool checksum = false);
  ~IOEngine();
  IOEngine(const IOEngine&) = delete;
  IOEngine& operator=(const IOEngine&) = delete;

  // Opens (creating, mode 0600) `path` read-write. With `preallocate`, reserves the first `size`
  // bytes on disk (fallocate) so a full disk fails here, with ENOSPC, rather than in a later
  // write; the file grows to `size` if smaller and is never shrunk. Where the file system cannot
  // reserve space (EOPNOTSUPP) the file is only grown (sparse) and `note` says so. Returns -1
  // when `direct` was asked and the file system rejects O_DIRECT (EINVAL), so the caller can
  // retry buffered; any other failure throws IOFailure (a file this call created is removed).
  int open(const std::string& path, int64_t size, bool direct, bool preallocate = true,
           std::string* note = nullptr);
  // Throws IOFailure(EBUSY) while requests on `fd` are not done: workers would otherwise
  // pread/pwrite a closed descriptor, or whatever file reuses its number.
  void close(int fd);

  // Queue a pwrite/pread of all of `tensor`'s bytes at `offset`; returns a handle for wait/poll.
  // Argument errors (non-CPU or non-contiguous tensor, O_DIRECT misalignment) throw
  // std::invalid_argument in the calling thread. `fault` is the test-only fault hook.
  int64_t submit(bool write, int fd, const at::Tensor& tensor, int64_t offset,
                 Fault fault = Fault::kNone);

  // Blocks until the request is done and forgets the handle; throws IOFailure if it failed and
  // std::invalid_argument for an unknown (or already waited) handle. Call without the GIL.
  void wait(int64_t handle);
  // As wait, but gives up after `timeout_s` seconds: false (handle kept) if not done by then.
  bool wait_for(int64_t handle, double timeout_s);
  bool poll(int64_t handle);

  // Finishes the queued requests and stops the backend; their handles can still be waited
  // (results are kept until the engine is destroyed). Later submits throw. Idempotent.
  void shutdown();

  // Changes the sub-request size and the chunks in flight for requests submitted from now on.
  void set_tuning(int64_t block_size, int queue_depth);

  const std::string& backend() const { return backend_name_; }
  // Why "auto" did not get io_uring (empty when it did, or when threads was asked for).
  const std::string& backend_note() const { return backend_note_; }
  int num_threads() const { return num_threads_; }
  int64_t block_size() const;
  int queue_depth() const;
  bool checksum() const { return checksum_; }

 private:
  enum class Kind { kIOUring, kThreads };

  struct Request {
    bool write;
    int fd;
    at::Tensor tensor;  // keeps the buffer alive until the request is waited
    char* base;
    int64_t offset;
    int64_t nbytes;
    int64_t block;  // sub-request size, fixed at submit
    Fault fault;
    int64_t limit;  // bytes transferred for real (nbytes, or half for kShort)
    int64_t next = 0;  // first byte not yet handed to a chunk
    int outstanding = 0;  // chunks handed out and not finished
    int64_t transferred = 0;
    bool done = false;
    int err = 0;
    std::string why;  // cause of the first failure
    std::string message;
  };

  // One sub-request in flight: [off, off + len) of its request, `moved` bytes of it done.
  struct Chunk {
    Request* req = nullptr;  // kept alive by requests_ / the waiter until req->done
    int64_t off = 0;
    int64_t len = 0;
    int64_t moved = 0;
    bool injected = false;  // simulated: no real I/O, result `inject_res`
    int inject_res = 0;     // -errno, or 0 (no progress)
    bool flipped = false;   // kCorrupt write: byte flipped in the source while in flight
  };

  void check_tuning(int64_t block_size, int queue_depth) const;
  // Under mu_: hands out the next chunk of the first pending request (pending_ must be non-empty).
  void next_chunk(Chunk& c);
  // Before issuing a chunk (no lock): applies a kCorrupt write's flip.
  void prepare_chunk(Chunk& c);
  // A chunk is over: `err` (0 = ok) and c.moved bytes moved. Finishes the request when it was
  // the last one. Called without mu_.
  void finish_chunk(Chunk& c, int err);
  void finish_request(Request& r);
  // Chunk done with all bytes moved: the checksum bookkeeping / corruption of a finished chunk.
  void chunk_succeeded(Chunk& c);

  void worker();  // threads backend
  void grow_workers(int n);  // threads backend: at least n workers (never shrinks)
  // Blocking transfer of the chunk's remaining bytes; 0 or the errno (c.moved = progress).
  static int run_sync(Chunk& c);

  // Checksum records: per fd, file offset -> (length, crc32c).
  struct Csum {
    int64_t len;
    uint32_t crc;
  };
  void csum_forget(int fd, int64_t off, int64_t len);  // drops records overlapping the range
  void csum_record(int fd, int64_t off, int64_t len, uint32_t crc);
  // Verifies every record inside [off, off + len) against `data`; empty string when all match.
  std::string csum_verify(int fd, int64_t off, int64_t len, const char* data);

  const int num_threads_;
  Kind kind_;
  std::string backend_name_;
  std::string backend_note_;
  const bool checksum_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // threads: work, a free slot (busy_ fell) or stopping_
  std::condition_variable done_cv_;  // some request finished
  std::deque<std::shared_ptr<Request>> pending_;  // requests with chunks not yet handed out
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_handle_ = 1;
  int64_t block_size_;
  int queue_depth_;
  bool stopping_ = false;
  bool stopped_ = false;
  int busy_ = 0;  // threads: chunks being transferred
  std::unordered_map<int, int> fd_busy_;  // fd -> requests submitted on it and not done
  std::mutex threads_mu_;  // guards threads_
  std::vector<std::thread> threads_;

  std::mutex csum_mu_;
  std::unordered_map<int, std::map<int64_t, Csum>> csums_;

#ifdef HETERO_HAVE_LIBURING
  struct Uring;  // the ring, its eventfd and the completion thread's state (aio.cpp)
  std::unique_ptr<Uring> uring_;
  void uring_loop();
  void uring_wake();
#endif
};

}  // namespace hetero
