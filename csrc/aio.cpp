#include "aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <system_error>

namespace hetero {
namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string transfer_failure(const char* op, int64_t nbytes, int64_t offset, int64_t done,
                             const std::string& why) {
  std::ostringstream s;
  s << op << " of " << nbytes << " bytes at offset " << offset << " failed: " << done << " of "
    << nbytes << " bytes transferred (" << why << ")";
  return s.str();
}

}  // namespace

Fault parse_fault(const std::string& kind) {
  if (kind == "none") return Fault::kNone;
  if (kind == "eio") return Fault::kEIO;
  if (kind == "enospc") return Fault::kENOSPC;
  if (kind == "short") return Fault::kShort;
  throw std::invalid_argument("unknown fault kind '" + kind +
                              "' (expected none, eio, enospc or short)");
}

IOEngine::IOEngine(int num_threads) : num_threads_(num_threads) {
  if (num_threads < 1) throw std::invalid_argument("IOEngine needs num_threads >= 1");
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker(); });
}

IOEngine::~IOEngine() { shutdown(); }

int IOEngine::open(const std::string& path, int64_t size, bool direct) {
  if (size < 0) throw std::invalid_argument("swap file size must be >= 0");
  int flags = O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd;
  do fd = ::open(path.c_str(), flags, 0600); while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    if (direct && err == EINVAL) return -1;  // file system without O_DIRECT: caller falls back
    throw IOFailure(err, "open: " + errno_text(err));
  }
  struct stat st;
  const char* step = nullptr;
  if (::fchmod(fd, 0600) != 0) step = "fchmod";  // the file may predate us with a wider mode
  else if (::fstat(fd, &st) != 0) step = "fstat";
  else if (st.st_size < size && ::ftruncate(fd, size) != 0) step = "ftruncate";
  if (step) {
    int err = errno;
    ::close(fd);
    throw IOFailure(err, std::string(step) + ": " + errno_text(err));
  }
  return fd;
}

void IOEngine::close(int fd) {
  // Linux releases the descriptor even when close reports EINTR/EIO, so never retry.
  if (::close(fd) != 0) {
    int err = errno;
    throw IOFailure(err, "close: " + errno_text(err));
  }
}

int64_t IOEngine::submit(bool write, int fd, const at::Tensor& tensor, int64_t offset,
                         Fault fault) {
  if (!tensor.defined() || !tensor.device().is_cpu())
    throw std::invalid_argument("swap I/O needs a CPU tensor");
  if (!tensor.is_contiguous()) throw std::invalid_argument("swap I/O needs a contiguous tensor");
  if (offset < 0) throw std::invalid_argument("swap I/O offset must be >= 0");
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw std::invalid_argument("bad file descriptor " + std::to_string(fd));
  if (flags & O_DIRECT) {
    auto ptr = reinterpret_cast<uintptr_t>(tensor.data_ptr());
    auto nbytes = static_cast<int64_t>(tensor.nbytes());
    std::ostringstream bad;
    if (ptr % kDirectAlignment) bad << " data_ptr (0x" << std::hex << ptr << std::dec << ")";
    if (offset % kDirectAlignment) bad << " offset (" << offset << ")";
    if (nbytes % kDirectAlignment) bad << " nbytes (" << nbytes << ")";
    if (!bad.str().empty())
      throw std::invalid_argument("O_DIRECT swap I/O needs 4096-byte alignment; misaligned:" +
                                  bad.str());
  }
  auto r = std::make_shared<Request>();
  r->write = write;
  r->fd = fd;
  r->tensor = tensor;
  r->offset = offset;
  r->fault = fault;
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) throw std::runtime_error("IOEngine is shut down");
  int64_t h = next_handle_++;
  requests_.emplace(h, r);
  queue_.push_back(std::move(r));
  work_cv_.notify_one();
  return h;
}

void IOEngine::wait(int64_t handle) {
  std::shared_ptr<Request> r;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = requests_.find(handle);
    if (it == requests_.end())
      throw std::invalid_argument("unknown or already waited I/O handle " + std::to_string(handle));
    r = std::move(it->second);
    requests_.erase(it);
    done_cv_.wait(lk, [&] { return r->done; });
  }
  if (r->err) throw IOFailure(r->err, r->message);
}

bool IOEngine::poll(int64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(handle);
  if (it == requests_.end())
    throw std::invalid_argument("unknown or already waited I/O handle " + std::to_string(handle));
  return it->second->done;
}

void IOEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void IOEngine::worker() {
  for (;;) {
    std::shared_ptr<Request> r;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and the queue is drained
      r = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(*r);
    {
      // Drop our reference under the lock, before the waiter can see `done`: the last reference
      // (and with it the tensor) is then always released by a waiter or shutdown, never here.
      std::lock_guard<std::mutex> lk(mu_);
      r->done = true;
      r.reset();
    }
    done_cv_.notify_all();
  }
}

void IOEngine::execute(Request& r) {
  const char* op = r.write ? "pwrite" : "pread";
  auto* base = static_cast<char*>(r.tensor.data_ptr());
  const int64_t n = static_cast<int64_t>(r.tensor.nbytes());
  int64_t limit = n;  // bytes we will attempt; less than n only for the simulated short transfer
  switch (r.fault) {
    case Fault::kNone: break;
    case Fault::kEIO:
    case Fault::kENOSPC:
      r.err = r.fault == Fault::kEIO ? EIO : ENOSPC;
      r.message = transfer_failure(op, n, r.offset, 0, "injected: " + errno_text(r.err));
      return;
    case Fault::kShort: limit = (n / 2) & ~(kDirectAlignment - 1); break;
  }
  int64_t done = 0;
  while (done < limit) {
    ssize_t k = r.write ? ::pwrite(r.fd, base + done, limit - done, r.offset + done)
                        : ::pread(r.fd, base + done, limit - done, r.offset + done);
    if (k < 0) {
      if (errno == EINTR) continue;
      r.err = errno;
      r.message = transfer_failure(op, n, r.offset, done, errno_text(r.err));
      return;
    }
    if (k == 0) break;  // EOF on read; a write that cannot progress
    done += k;
  }
  if (done < n) {
    r.err = EIO;
    const char* why = r.fault == Fault::kShort ? "injected short transfer"
                      : r.write                ? "write made no progress"
                                               : "unexpected end of file";
    r.message = transfer_failure(op, n, r.offset, done, why);
  }
}

}  // namespace hetero
