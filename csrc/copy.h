// Copy engine: asynchronous tensor copies between the host and the device (or host to host), issued
// from C++ so that a prefetch of the next unit's blocks really runs while the current unit computes.
//
// Why: the runtime moves blocks between tiers while compute runs. On a GPU the copy must run on a
// stream other than the compute stream (or it serializes with the kernels); on the CPU it must run
// on a thread that does not hold the GIL (or it serializes with the Python that drives compute).
//
// Contract of CopyEngine::copy(dst, src, after_stream) (checked at submit; violations throw
// std::invalid_argument, which the bindings raise as ValueError):
//  - dst and src: defined, contiguous, same dtype, same numel, each on the CPU or a CUDA device;
//    shapes may differ (it is a flat byte copy of nbytes, autograd is not involved). Same-device
//    copies must not overlap in memory. A CUDA tensor needs a build with HETERO_CUDA.
//  - CPU -> CPU: memcpy on the engine's worker threads (a copy of more than 2 x kSplitBytes is
//    split into up to num_threads pieces that run in parallel). A copy of at most inline_bytes
//    (kInlineBytes unless the constructor says otherwise; without after_stream) is done in the
//    calling thread, as it takes less time than waking a worker; its handle is complete on return.
//  - Involving a CUDA tensor: cudaMemcpyAsync (cudaMemcpyPeerAsync across devices) on a stream the
//    engine owns, created non-blocking (no implicit sync with the legacy default stream): one
//    stream per device and direction (H2D, D2H, D2D; the stream of the CUDA tensor's device, of
//    src's for D2D), with an event recorded after the copy. Copies in one direction on one device
//    run in submission order. Host memory should be pinned: from pageable memory the CUDA runtime
//    stages the copy and the submitting thread blocks until the source has been read.
//  - after_stream (a cudaStream_t as an integer; 0 is the legacy default stream): the copy first
//    waits for the work already queued on that stream when copy() is called. For CUDA copies the
//    wait is on the GPU (cudaStreamWaitEvent), so the host does not block; for CPU copies the
//    worker synchronizes an event before its memcpy. Needs HETERO_CUDA.
//  - The engine keeps dst and src alive until the copy completed (and was waited or reaped), so a
//    tensor freed by its caller mid-copy is not handed to another allocation. The caller must not
//    touch dst (nor write src) before the copy is complete.
// Workers never run Python and never drop the last reference to a tensor (that could need the
// GIL): finished requests are released on a calling thread (the next copy(), a wait(), shutdown).
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace hetero {

struct CopyRequest;  // defined in copy.cpp (holds CUDA handles in a HETERO_CUDA build)
struct CopyShared;   // mutex and condition variables shared by an engine and its handles

// One queued copy. Copyable (shares the request); stays valid after the engine is shut down or
// destroyed.
class CopyHandle {
 public:
  explicit CopyHandle(std::shared_ptr<CopyRequest> r) : r_(std::move(r)) {}
  // Whether the copy is complete (or failed; wait() then throws). Never blocks.
  bool done() const;
  // Blocks until the copy is complete (CUDA: its event synchronized), then releases the engine's
  // references to dst and src. Throws std::runtime_error if the copy failed. Call without the GIL.
  void wait();
  // Makes `stream` (a cudaStream_t as an integer) wait on the GPU for this copy, without blocking
  // the host: the compute stream can then use an H2D copy's destination. For a copy that ran on
  // the CPU workers this is wait(). Throws std::invalid_argument without HETERO_CUDA.
  void wait_on_stream(int64_t stream);
  int64_t nbytes() const;
  // "h2h", "h2d", "d2h" or "d2d".
  std::string kind() const;

 private:
  std::shared_ptr<CopyRequest> r_;
};

class CopyEngine {
 public:
  // CPU copies larger than 2x this are split across worker threads.
  static constexpr int64_t kSplitBytes = int64_t(4) << 20;
  // CPU copies up to this size are done in the calling thread (by default).
  static constexpr int64_t kInlineBytes = int64_t(64) << 10;

  // inline_bytes < 0: kInlineBytes. Tests pass 0 so that every host copy is asynchronous.
  explicit CopyEngine(int num_threads, int64_t inline_bytes = -1);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues dst <- src (see the contract above) and returns at once. Throws std::invalid_argument
  // for bad arguments, std::runtime_error after shutdown() or when CUDA refuses the copy.
  CopyHandle copy(const at::Tensor& dst, const at::Tensor& src,
                  std::optional<int64_t> after_stream = std::nullopt);

  // Finishes the queued copies (CPU copies run, CUDA copies synchronized), joins the workers and
  // releases the engine's streams. Handles stay waitable; later copies throw. Idempotent.
  void shutdown();

  int num_threads() const { return num_threads_; }
  // Whether this build has the CUDA path (compiled with HETERO_CUDA).
  static bool has_cuda();

 private:
  struct Piece {  // a byte range of one CPU request, run by one worker
    std::shared_ptr<CopyRequest> r;
    int64_t offset;
    int64_t length;
  };

  void worker();
  void reap();  // drops the references to finished requests; on a calling thread only
  CopyHandle copy_cpu(std::shared_ptr<CopyRequest> r, std::optional<int64_t> after_stream);
  CopyHandle copy_cuda(std::shared_ptr<CopyRequest> r, std::optional<int64_t> after_stream);

  const int num_threads_;
  const int64_t inline_bytes_;
  std::shared_ptr<CopyShared> shared_;  // its mutex guards everything below
  std::condition_variable work_cv_;     // queue_ gained pieces, or stopping_
  std::deque<Piece> queue_;
  std::vector<std::shared_ptr<CopyRequest>> finished_;  // completed CPU copies, to release
  std::vector<std::shared_ptr<CopyRequest>> in_flight_cuda_;  // CUDA copies, until complete
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::mutex shutdown_mu_;   // serializes shutdown() calls
  std::mutex cuda_mu_;       // serializes CUDA submission and stream creation with shutdown
  std::vector<void*> streams_;  // cudaStream_t, 3 per device (h2d, d2h, d2d), created lazily
};

// A uint8 CPU tensor of nbytes, page-aligned and page-locked (cudaHostRegister over an anonymous
// mapping), for the host arena: exactly the bytes asked for, where torch's pinned allocator rounds
// each request up to a power of two (a 40 GiB arena would lock 64 GiB) and keeps the memory locked
// in its cache after the tensor is freed. The memory is unregistered and unmapped when the tensor's
// storage is freed. Throws std::runtime_error if the mapping or the registration fails (or the
// build has no CUDA).
at::Tensor pinned_empty(int64_t nbytes);

}  // namespace hetero
