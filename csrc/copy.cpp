#include "copy.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

#ifdef HETERO_CUDA
#include <cuda_runtime.h>
#endif

namespace hetero {

enum class CopyKind { kH2H, kH2D, kD2H, kD2D };

struct CopyShared {
  std::mutex mu;
  std::condition_variable done_cv;  // some CPU request finished
};

struct CopyRequest {
  std::shared_ptr<CopyShared> shared;
  at::Tensor dst, src;  // kept alive until the copy is complete; guarded by shared->mu
  char* dst_ptr = nullptr;
  const char* src_ptr = nullptr;
  int64_t nbytes = 0;
  CopyKind kind = CopyKind::kH2H;
  // CPU copies (and zero-byte ones), guarded by shared->mu:
  int pending = 0;     // pieces not finished
  bool done = false;   // every piece finished
  std::string error;   // why it failed (only an after_stream event can fail)
  // CUDA handles as void* so that this struct is the same in every build (cudaEvent_t).
  void* event = nullptr;  // CUDA copies: recorded after the copy on the engine's stream
  void* order = nullptr;  // CPU copies with after_stream: recorded on that stream at submit

  ~CopyRequest();
};

namespace {

const char* kind_name(CopyKind k) {
  switch (k) {
    case CopyKind::kH2H: return "h2h";
    case CopyKind::kH2D: return "h2d";
    case CopyKind::kD2H: return "d2h";
    case CopyKind::kD2D: return "d2d";
  }
  return "?";
}

void check_tensor(const at::Tensor& t, const char* name) {
  const std::string n(name);
  if (!t.defined()) throw std::invalid_argument(n + " is an undefined tensor");
  if (t.layout() != at::kStrided)
    throw std::invalid_argument(n + " has layout " + c10::toString(t.layout()) +
                                "; the copy engine copies strided (dense) tensors");
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument(n + " is on device " + t.device().str() +
                                "; the copy engine copies between the CPU and CUDA devices");
  if (t.device().is_cuda() && !CopyEngine::has_cuda())
    throw std::invalid_argument(n + " is on " + t.device().str() +
                                " but hetero._C was built without CUDA (HETERO_CUDA); rebuild "
                                "it with torch with CUDA and a CUDA toolkit");
  if (!t.is_contiguous())
    throw std::invalid_argument(n + " is not contiguous; the copy engine moves one flat byte "
                                "range (pass a contiguous tensor or view)");
}

#ifdef HETERO_CUDA

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Throws std::runtime_error for a failed call, after clearing the error so that torch's next
// cudaGetLastError check does not blame its own kernel for it.
void check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error("copy engine: " + what + " failed (" + cuda_text(e) + ")");
}

cudaStream_t as_stream(int64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(s)); }

class DeviceGuard {  // makes `device` current for the scope
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && cudaSetDevice(prev_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;  // device to restore, -1 if unchanged
};

// An event recorded on `stream` now: it completes when the work queued there so far has. It is
// created on the stream's own device (an event must be); `device` is that device where the CUDA
// runtime cannot tell (before 12.8), i.e. the caller's assumption.
cudaEvent_t record_on(int64_t stream, int device) {
#if CUDART_VERSION >= 12080
  cudaError_t e = cudaStreamGetDevice(as_stream(stream), &device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::invalid_argument("after_stream=" + std::to_string(stream) +
                                " is not a CUDA stream (" + cuda_text(e) + ")");
  }
#endif
  DeviceGuard guard(device);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cudaError_t e2 = cudaEventRecord(ev, as_stream(stream));
  if (e2 != cudaSuccess) {
    (void)cudaGetLastError();
    cudaEventDestroy(ev);
    throw std::invalid_argument("after_stream=" + std::to_string(stream) +
                                " cannot be waited on: it must be a live CUDA stream of cuda:" +
                                std::to_string(device) + " (" + cuda_text(e2) + ")");
  }
  return ev;
}

int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

#endif  // HETERO_CUDA

}  // namespace

CopyRequest::~CopyRequest() {
#ifdef HETERO_CUDA
  // Destroying an event whose work is pending is allowed (released once it completes). At
  // interpreter exit the runtime may already be unloading: ignore failures.
  for (void* ev : {event, order})
    if (ev && cudaEventDestroy(static_cast<cudaEvent_t>(ev)) != cudaSuccess)
      (void)cudaGetLastError();
#endif
}

// ---- CopyHandle

bool CopyHandle::done() const {
#ifdef HETERO_CUDA
  if (r_->event) {
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(r_->event));
    if (e == cudaSuccess) return true;
    (void)cudaGetLastError();
    return e != cudaErrorNotReady;  // failed: done, and wait() reports it
  }
#endif
  std::lock_guard<std::mutex> lk(r_->shared->mu);
  return r_->done;
}

void CopyHandle::wait() {
  std::string error;
#ifdef HETERO_CUDA
  if (r_->event) {
    cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(r_->event));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      error = std::string(kind_name(r_->kind)) + " copy of " + std::to_string(r_->nbytes) +
              " bytes failed on the GPU (" + cuda_text(e) + ")";
    }
  }
#endif
  at::Tensor dst, src;  // released after the lock, on this (calling) thread
  {
    std::unique_lock<std::mutex> lk(r_->shared->mu);
    if (!r_->event) {
      r_->shared->done_cv.wait(lk, [&] { return r_->done; });
      error = r_->error;
    }
    dst = std::move(r_->dst);
    src = std::move(r_->src);
  }
  if (!error.empty()) throw std::runtime_error(error);
}

void CopyHandle::wait_on_stream(int64_t stream) {
#ifdef HETERO_CUDA
  if (r_->event) {
    check(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(r_->event), 0),
          "cudaStreamWaitEvent on stream " + std::to_string(stream));
    return;
  }
  wait();  // a CPU copy: the host is the only place to wait for it
#else
  (void)stream;
  throw std::invalid_argument("wait_on_stream needs CUDA, but hetero._C was built without it");
#endif
}

int64_t CopyHandle::nbytes() const { return r_->nbytes; }

std::string CopyHandle::kind() const { return kind_name(r_->kind); }

// ---- CopyEngine

bool CopyEngine::has_cuda() {
#ifdef HETERO_CUDA
  return true;
#else
  return false;
#endif
}

CopyEngine::CopyEngine(int num_threads, int64_t inline_bytes)
    : num_threads_(num_threads),
      inline_bytes_(inline_bytes < 0 ? kInlineBytes : inline_bytes),
      shared_(std::make_shared<CopyShared>()) {
  if (num_threads < 1)
    throw std::invalid_argument("CopyEngine needs num_threads >= 1, got " +
                                std::to_string(num_threads));
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker(); });
}

CopyEngine::~CopyEngine() {
  try {
    shutdown();
  } catch (...) {  // never throw from a destructor; shutdown only fails if CUDA is gone
  }
}

CopyHandle CopyEngine::copy(const at::Tensor& dst, const at::Tensor& src,
                            std::optional<int64_t> after_stream) {
  check_tensor(dst, "dst");
  check_tensor(src, "src");
  if (dst.scalar_type() != src.scalar_type())
    throw std::invalid_argument(std::string("dst has dtype ") + c10::toString(dst.scalar_type()) +
                                " but src has dtype " + c10::toString(src.scalar_type()) +
                                "; the copy engine does not convert");
  if (dst.numel() != src.numel())
    throw std::invalid_argument("dst has " + std::to_string(dst.numel()) + " elements but src has " +
                                std::to_string(src.numel()));
  if (after_stream) {
    if (!has_cuda())
      throw std::invalid_argument("after_stream needs CUDA, but hetero._C was built without it");
    if (*after_stream < 0)
      throw std::invalid_argument("after_stream must be a cudaStream_t as a non-negative integer, "
                                  "got " + std::to_string(*after_stream));
  }
  auto r = std::make_shared<CopyRequest>();
  r->shared = shared_;
  r->nbytes = static_cast<int64_t>(dst.nbytes());
  const bool dcuda = dst.device().is_cuda(), scuda = src.device().is_cuda();
  r->kind = dcuda ? (scuda ? CopyKind::kD2D : CopyKind::kH2D)
                  : (scuda ? CopyKind::kD2H : CopyKind::kH2H);
  if (r->nbytes > 0) {
    r->dst_ptr = static_cast<char*>(dst.data_ptr());
    r->src_ptr = static_cast<const char*>(src.data_ptr());
    const auto d = reinterpret_cast<uintptr_t>(r->dst_ptr);
    const auto s = reinterpret_cast<uintptr_t>(r->src_ptr);
    const auto n = static_cast<uintptr_t>(r->nbytes);
    if (dst.device() == src.device() && d < s + n && s < d + n)
      throw std::invalid_argument("dst and src overlap in memory");
  }
  r->dst = dst;
  r->src = src;
  reap();
  const bool inline_copy =
      r->nbytes == 0 || (r->kind == CopyKind::kH2H && r->nbytes <= inline_bytes_ && !after_stream);
  if (inline_copy) {  // nothing to move, or cheaper than a hand-off; the engine must be running
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      if (stopping_) throw std::runtime_error("CopyEngine is shut down");
    }
    if (r->nbytes > 0) std::memcpy(r->dst_ptr, r->src_ptr, r->nbytes);
    r->done = true;  // not shared yet: no lock needed
    r->dst = at::Tensor();
    r->src = at::Tensor();
    return CopyHandle(std::move(r));
  }
  return r->kind == CopyKind::kH2H ? copy_cpu(std::move(r), after_stream)
                                   : copy_cuda(std::move(r), after_stream);
}

CopyHandle CopyEngine::copy_cpu(std::shared_ptr<CopyRequest> r,
                                std::optional<int64_t> after_stream) {
#ifdef HETERO_CUDA
  if (after_stream) r->order = record_on(*after_stream, current_device());
#else
  (void)after_stream;  // rejected in copy() for this build
#endif
  // Split only copies large enough that each piece amortizes a thread hand-off, in page-aligned
  // pieces (one per worker at most).
  int64_t pieces = 1;
  if (r->nbytes > 2 * kSplitBytes)
    pieces = std::min<int64_t>(num_threads_, r->nbytes / kSplitBytes);
  int64_t step = (r->nbytes + pieces - 1) / pieces;
  step = (step + 4095) / 4096 * 4096;
  CopyHandle handle(r);
  int queued = 0;
  {
    std::lock_guard<std::mutex> lk(shared_->mu);
    if (stopping_) throw std::runtime_error("CopyEngine is shut down");
    for (int64_t off = 0; off < r->nbytes; off += step, ++queued)
      queue_.push_back(Piece{r, off, std::min(step, r->nbytes - off)});
    r->pending = queued;
  }
  if (queued > 1) work_cv_.notify_all();
  else work_cv_.notify_one();
  return handle;
}

CopyHandle CopyEngine::copy_cuda(std::shared_ptr<CopyRequest> r,
                                 std::optional<int64_t> after_stream) {
#ifdef HETERO_CUDA
  const int dev = r->kind == CopyKind::kH2D ? r->dst.device().index() : r->src.device().index();
  std::lock_guard<std::mutex> cuda_lock(cuda_mu_);
  {
    std::lock_guard<std::mutex> lk(shared_->mu);
    if (stopping_) throw std::runtime_error("CopyEngine is shut down");
  }
  DeviceGuard guard(dev);
  const int k = r->kind == CopyKind::kH2D ? 0 : r->kind == CopyKind::kD2H ? 1 : 2;
  const size_t slot = static_cast<size_t>(dev) * 3 + k;
  if (streams_.size() <= slot) streams_.resize(slot + 1, nullptr);
  if (!streams_[slot]) {
    cudaStream_t s = nullptr;
    // Non-blocking: no implicit synchronization with the legacy default stream, which torch
    // uses as its default compute stream.
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams_[slot] = s;
  }
  auto stream = static_cast<cudaStream_t>(streams_[slot]);
  if (after_stream) {
    cudaEvent_t order = record_on(*after_stream, dev);
    cudaError_t e = cudaStreamWaitEvent(stream, order, 0);
    cudaEventDestroy(order);  // the wait captured it
    check(e, "cudaStreamWaitEvent");
  }
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  r->event = ev;  // destroyed with the request, also if the copy below fails
  const std::string what = std::string(kind_name(r->kind)) + " cudaMemcpyAsync of " +
                           std::to_string(r->nbytes) + " bytes";
  switch (r->kind) {
    case CopyKind::kH2D:
      check(cudaMemcpyAsync(r->dst_ptr, r->src_ptr, r->nbytes, cudaMemcpyHostToDevice, stream),
            what);
      break;
    case CopyKind::kD2H:
      check(cudaMemcpyAsync(r->dst_ptr, r->src_ptr, r->nbytes, cudaMemcpyDeviceToHost, stream),
            what);
      break;
    case CopyKind::kD2D: {
      const int ddev = r->dst.device().index();
      if (ddev == dev)
        check(cudaMemcpyAsync(r->dst_ptr, r->src_ptr, r->nbytes, cudaMemcpyDeviceToDevice,
                              stream), what);
      else
        check(cudaMemcpyPeerAsync(r->dst_ptr, ddev, r->src_ptr, dev, r->nbytes, stream), what);
      break;
    }
    case CopyKind::kH2H: throw std::logic_error("host copy on the CUDA path");
  }
  check(cudaEventRecord(ev, stream), "cudaEventRecord");
  CopyHandle handle(r);
  std::lock_guard<std::mutex> lk(shared_->mu);
  in_flight_cuda_.push_back(std::move(r));
  return handle;
#else
  (void)r;
  (void)after_stream;
  throw std::logic_error("CUDA copy in a build without CUDA");  // rejected by check_tensor
#endif
}

void CopyEngine::reap() {
  std::vector<std::shared_ptr<CopyRequest>> drop;  // destroyed at return, outside the lock
  std::lock_guard<std::mutex> lk(shared_->mu);
  drop.swap(finished_);
#ifdef HETERO_CUDA
  auto keep = in_flight_cuda_.begin();
  for (auto& r : in_flight_cuda_) {
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(r->event));
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e == cudaErrorNotReady) *keep++ = std::move(r);
    else drop.push_back(std::move(r));
  }
  in_flight_cuda_.erase(keep, in_flight_cuda_.end());
#endif
}

void CopyEngine::shutdown() {
  std::lock_guard<std::mutex> once(shutdown_mu_);  // two threads must not join the same workers
  {
    std::lock_guard<std::mutex> lk(shared_->mu);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
#ifdef HETERO_CUDA
  {
    std::lock_guard<std::mutex> cuda_lock(cuda_mu_);  // lets a submission in progress finish
    std::vector<std::shared_ptr<CopyRequest>> in_flight;
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      in_flight.swap(in_flight_cuda_);
    }
    // The tensors must outlive the copies: wait for them before releasing anything.
    for (auto& r : in_flight)
      if (cudaEventSynchronize(static_cast<cudaEvent_t>(r->event)) != cudaSuccess)
        (void)cudaGetLastError();
    for (void* s : streams_)  // work still queued on a destroyed stream completes normally
      if (s && cudaStreamDestroy(static_cast<cudaStream_t>(s)) != cudaSuccess)
        (void)cudaGetLastError();
    streams_.clear();
  }
#endif
  reap();
}

void CopyEngine::worker() {
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lk(shared_->mu);
      work_cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and the queue is drained
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
#ifdef HETERO_CUDA
    if (p.r->order) {
      cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(p.r->order));
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        error = "h2h copy of " + std::to_string(p.r->nbytes) +
                " bytes: waiting for after_stream failed (" + cuda_text(e) + ")";
      }
    }
#endif
    if (error.empty()) std::memcpy(p.r->dst_ptr + p.offset, p.r->src_ptr + p.offset, p.length);
    bool finished;
    {
      // Drop our reference under the lock: finished_ (or a piece still queued) holds another,
      // so the request and its tensors are never released on a worker.
      std::lock_guard<std::mutex> lk(shared_->mu);
      if (!error.empty() && p.r->error.empty()) p.r->error = error;
      finished = --p.r->pending == 0;
      if (finished) {
        p.r->done = true;
        finished_.push_back(p.r);
      }
      p.r.reset();
    }
    if (finished) shared_->done_cv.notify_all();
  }
}

at::Tensor pinned_empty(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("pinned_empty needs nbytes >= 0");
#ifdef HETERO_CUDA
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = std::max<size_t>(page, (static_cast<size_t>(nbytes) + page - 1) / page * page);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::ostringstream msg;
    msg << "pinned_empty: mmap of " << len << " bytes failed: " << std::strerror(errno);
    throw std::runtime_error(msg.str());
  }
  cudaError_t err = cudaHostRegister(p, len, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();  // (clear it: the failure is reported here, not at the next CUDA call)
    munmap(p, len);
    std::ostringstream msg;
    msg << "pinned_empty: cudaHostRegister of " << len << " bytes failed: " << cudaGetErrorString(err);
    throw std::runtime_error(msg.str());
  }
  return at::from_blob(
      p, {nbytes},
      [len](void* ptr) {
        cudaHostUnregister(ptr);
        munmap(ptr, len);
      },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
#else
  throw std::runtime_error("pinned_empty: hetero._C was built without CUDA (HETERO_CUDA)");
#endif
}

}  // namespace hetero
