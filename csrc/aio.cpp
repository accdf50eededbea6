#include "aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <system_error>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define HETERO_X86 1
#endif

#ifdef HETERO_HAVE_LIBURING
#include <liburing.h>
#include <sys/eventfd.h>
#endif

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

// ---- CRC32C: hardware (SSE4.2 crc32 instruction) where the CPU has it, else slicing-by-8.

struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

uint32_t crc32c_soft(uint32_t crc, const uint8_t* p, size_t n) {
  static const Crc32cTable tab;
  const auto& t = tab.t;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;  // little-endian hosts (x86-64, aarch64) only build this project
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
          t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#ifdef HETERO_X86
// One crc32 chain, 8 bytes per instruction: ~8 GB/s, an order of magnitude above the disks it
// guards, so the interleaved multi-chain variant is not worth its complexity here.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#ifdef HETERO_X86
  if (cpu_has_sse42()) return ~crc32c_hw(crc, p, n);
#endif
  return ~crc32c_soft(crc, p, n);
}

Fault parse_fault(const std::string& kind) {
  if (kind == "none") return Fault::kNone;
  if (kind == "eio") return Fault::kEIO;
  if (kind == "enospc") return Fault::kENOSPC;
  if (kind == "short") return Fault::kShort;
  if (kind == "corrupt") return Fault::kCorrupt;
  throw std::invalid_argument("unknown fault kind '" + kind +
                              "' (expected none, eio, enospc, short or corrupt)");
}

// ---------------------------------------------------------------------------------------------
// io_uring backend state

#ifdef HETERO_HAVE_LIBURING
namespace {
constexpr uint64_t kWakeTag = ~uint64_t(0);  // user_data of the eventfd read in the ring
constexpr unsigned kRingEntries = 2 * kMaxQueueDepth;  // chunks + the eventfd read, pow2
}  // namespace

struct IOEngine::Uring {
  io_uring ring{};
  int efd = -1;
  uint64_t efd_buf = 0;
  std::thread thread;
  std::vector<Chunk> slots = std::vector<Chunk>(kMaxQueueDepth);
  std::vector<int> free_slots;
  std::vector<int> retry;     // slots whose short transfer must be resubmitted
  std::vector<int> to_issue;  // slots filled under the lock, issued after it
  int inflight = 0;           // slots in use
};

bool io_uring_available(std::string* why) {
  static std::once_flag once;
  static int result = 0;
  std::call_once(once, [] {
    io_uring ring;
    result = io_uring_queue_init(8, &ring, 0);
    if (result == 0) io_uring_queue_exit(&ring);
  });
  if (result != 0 && why) *why = "io_uring_queue_init: " + errno_text(-result);
  return result == 0;
}
#else
bool io_uring_available(std::string* why) {
  if (why) *why = "hetero._C was built without liburing";
  return false;
}
#endif

// ---------------------------------------------------------------------------------------------

IOEngine::IOEngine(int num_threads, const std::string& backend, int64_t block_size,
                   int queue_depth, bool checksum)
    : num_threads_(num_threads),
      kind_(Kind::kThreads),
      checksum_(checksum),
      block_size_(block_size),
      queue_depth_(queue_depth) {
  if (num_threads < 1) throw std::invalid_argument("IOEngine needs num_threads >= 1");
  check_tuning(block_size, queue_depth);
  if (backend != "auto" && backend != "io_uring" && backend != "threads")
    throw std::invalid_argument("unknown I/O backend '" + backend +
                                "' (expected auto, io_uring or threads)");
#ifdef HETERO_HAVE_LIBURING
  if (backend != "threads") {
    auto u = std::make_unique<Uring>();
    int ret = io_uring_queue_init(kRingEntries, &u->ring, 0);
    if (ret == 0) {
      u->efd = ::eventfd(0, EFD_CLOEXEC);  // blocking: io_uring polls it instead of failing EAGAIN
      if (u->efd < 0) {
        ret = -errno;
        io_uring_queue_exit(&u->ring);
      }
    }
    if (ret == 0) {
      for (int i = kMaxQueueDepth - 1; i >= 0; --i) u->free_slots.push_back(i);
      uring_ = std::move(u);
      kind_ = Kind::kIOUring;
      uring_->thread = std::thread([this] { uring_loop(); });
    } else {
      backend_note_ = "io_uring_queue_init: " + errno_text(-ret);
      if (backend == "io_uring")
        throw IOFailure(-ret, "the io_uring backend is unavailable (" + backend_note_ + ")");
    }
  }
#else
  if (backend == "io_uring")
    throw IOFailure(ENOSYS, "the io_uring backend is unavailable (hetero._C was built without "
                            "liburing)");
  if (backend == "auto") backend_note_ = "hetero._C was built without liburing";
#endif
  if (kind_ == Kind::kThreads) grow_workers(std::max(num_threads, queue_depth));
  backend_name_ = kind_ == Kind::kIOUring ? "io_uring" : "threads";
}

IOEngine::~IOEngine() {
  shutdown();
#ifdef HETERO_HAVE_LIBURING
  if (uring_) {
    io_uring_queue_exit(&uring_->ring);  // cancels the eventfd read still in the ring
    ::close(uring_->efd);
  }
#endif
}

void IOEngine::check_tuning(int64_t block_size, int queue_depth) const {
  if (block_size < kDirectAlignment || block_size > kMaxBlockSize ||
      block_size % kDirectAlignment != 0)
    throw std::invalid_argument("block_size must be a multiple of 4096 between 4096 and " +
                                std::to_string(kMaxBlockSize) + ", got " +
                                std::to_string(block_size));
  if (queue_depth < 1 || queue_depth > kMaxQueueDepth)
    throw std::invalid_argument("queue_depth must be between 1 and " +
                                std::to_string(kMaxQueueDepth) + ", got " +
                                std::to_string(queue_depth));
}

void IOEngine::set_tuning(int64_t block_size, int queue_depth) {
  check_tuning(block_size, queue_depth);
  {
    std::lock_guard<std::mutex> lk(mu_);
    block_size_ = block_size;
    queue_depth_ = queue_depth;
  }
  if (kind_ == Kind::kThreads) {
    grow_workers(std::max(num_threads_, queue_depth));
    work_cv_.notify_all();  // a deeper queue may admit more chunks now
  }
#ifdef HETERO_HAVE_LIBURING
  if (uring_) uring_wake();
#endif
}

int64_t IOEngine::block_size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return block_size_;
}

int IOEngine::queue_depth() const {
  std::lock_guard<std::mutex> lk(mu_);
  return queue_depth_;
}

// ---------------------------------------------------------------------------------------------
// Files

int IOEngine::open(const std::string& path, int64_t size, bool direct, bool preallocate,
                   std::string* note) {
  if (size < 0) throw std::invalid_argument("swap file size must be >= 0");
  struct stat st;
  const bool existed = ::stat(path.c_str(), &st) == 0;
  // Undoes what this call did to the file system before a failure is reported.
  auto undo = [&](int fd, int64_t old_size) {
    if (!existed) {
      ::unlink(path.c_str());
    } else if (fd >= 0 && old_size >= 0) {
      if (::ftruncate(fd, old_size) != 0) { /* best effort: the error being reported matters */ }
    }
    if (fd >= 0) ::close(fd);
  };
  int flags = O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd;
  do fd = ::open(path.c_str(), flags, 0600); while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    if (!existed && err != ENOENT) undo(-1, -1);  // some file systems create, then refuse O_DIRECT
    if (direct && err == EINVAL) return -1;       // file system without O_DIRECT: caller falls back
    throw IOFailure(err, "open: " + errno_text(err));
  }
  const char* step = nullptr;
  if (::fchmod(fd, 0600) != 0) step = "fchmod";  // the file may predate us with a wider mode
  else if (::fstat(fd, &st) != 0) step = "fstat";
  if (step) {
    int err = errno;
    undo(fd, -1);
    throw IOFailure(err, std::string(step) + ": " + errno_text(err));
  }
  const int64_t old_size = st.st_size;
  if (preallocate && size > 0) {
    // Mode 0 allocates blocks for [0, size) and raises the file size to `size` if smaller.
    int rc;
    do rc = ::fallocate(fd, 0, 0, size); while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      int err = errno;
      if (err == EOPNOTSUPP || err == ENOSYS) {
        if (note) *note = "the file system cannot reserve space (fallocate unsupported); the swap "
                          "file is sparse and a full disk will only show in a later write";
      } else {
        undo(fd, old_size);
        throw IOFailure(err, "cannot reserve " + std::to_string(size) +
                                 " bytes (fallocate): " + errno_text(err));
      }
    }
  }
  if (old_size < size && (::fstat(fd, &st) != 0 || st.st_size < size) &&
      ::ftruncate(fd, size) != 0) {
    int err = errno;
    undo(fd, old_size);
    throw IOFailure(err, "ftruncate: " + errno_text(err));
  }
  if (checksum_) {
    std::lock_guard<std::mutex> lk(csum_mu_);
    csums_.erase(fd);  // a reused descriptor number: earlier records were about another file
  }
  return fd;
}

void IOEngine::close(int fd) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = fd_busy_.find(fd);
    if (it != fd_busy_.end() && it->second > 0)
      throw IOFailure(EBUSY, "close: " + std::to_string(it->second) +
                                 " request(s) on this file are still in flight");
  }
  if (checksum_) {
    std::lock_guard<std::mutex> lk(csum_mu_);
    csums_.erase(fd);
  }
  // Linux releases the descriptor even when close reports EINTR/EIO, so never retry.
  if (::close(fd) != 0) {
    int err = errno;
    throw IOFailure(err, "close: " + errno_text(err));
  }
}

// ---------------------------------------------------------------------------------------------
// Requests

int64_t IOEngine::submit(bool write, int fd, const at::Tensor& tensor, int64_t offset,
                         Fault fault) {
  if (!tensor.defined() || !tensor.device().is_cpu())
    throw std::invalid_argument("swap I/O needs a CPU tensor");
  if (!tensor.is_contiguous()) throw std::invalid_argument("swap I/O needs a contiguous tensor");
  if (offset < 0) throw std::invalid_argument("swap I/O offset must be >= 0");
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw std::invalid_argument("bad file descriptor " + std::to_string(fd));
  const auto nbytes = static_cast<int64_t>(tensor.nbytes());
  if (flags & O_DIRECT) {
    auto ptr = reinterpret_cast<uintptr_t>(tensor.data_ptr());
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
  r->base = static_cast<char*>(tensor.data_ptr());
  r->offset = offset;
  r->nbytes = nbytes;
  r->fault = fault;
  r->limit = fault == Fault::kShort ? (nbytes / 2) & ~(kDirectAlignment - 1) : nbytes;
  if (write && checksum_) csum_forget(fd, offset, nbytes);  // the old bytes are going away
  int64_t h;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw std::runtime_error("IOEngine is shut down");
    r->block = block_size_;
    h = next_handle_++;
    requests_.emplace(h, r);
    if (nbytes == 0) {
      r->done = true;
      return h;
    }
    ++fd_busy_[fd];
    pending_.push_back(std::move(r));
  }
  if (kind_ == Kind::kThreads) work_cv_.notify_one();
#ifdef HETERO_HAVE_LIBURING
  else uring_wake();
#endif
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

bool IOEngine::wait_for(int64_t handle, double timeout_s) {
  std::shared_ptr<Request> r;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = requests_.find(handle);
    if (it == requests_.end())
      throw std::invalid_argument("unknown or already waited I/O handle " + std::to_string(handle));
    r = it->second;
    auto timeout = std::chrono::duration<double>(std::max(0.0, timeout_s));
    if (!done_cv_.wait_for(lk, timeout, [&] { return r->done; })) return false;
    requests_.erase(handle);
  }
  if (r->err) throw IOFailure(r->err, r->message);
  return true;
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
  {
    std::lock_guard<std::mutex> lk(threads_mu_);
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }
#ifdef HETERO_HAVE_LIBURING
  if (uring_ && uring_->thread.joinable()) {
    uring_wake();
    uring_->thread.join();
  }
#endif
}

void IOEngine::next_chunk(Chunk& c) {
  Request& r = *pending_.front();
  c = Chunk{};
  c.req = &r;
  c.off = r.next;
  if (r.fault == Fault::kEIO || r.fault == Fault::kENOSPC) {
    c.len = r.nbytes - r.next;  // the device refuses the whole request
    c.injected = true;
    c.inject_res = r.fault == Fault::kEIO ? -EIO : -ENOSPC;
  } else if (r.next < r.limit) {
    c.len = std::min(r.block, r.limit - r.next);
  } else {
    c.len = r.nbytes - r.next;  // kShort: the tail makes no progress
    c.injected = true;
    c.inject_res = 0;
  }
  r.next += c.len;
  r.outstanding++;
  if (r.next >= r.nbytes) pending_.pop_front();  // not the last reference: requests_ or a waiter
}

void IOEngine::prepare_chunk(Chunk& c) {
  Request& r = *c.req;
  if (r.fault == Fault::kCorrupt && r.write && c.off == 0 && !c.injected) {
    r.base[0] ^= 0x5a;  // the request owns the buffer until waited; restored when the chunk ends
    c.flipped = true;
  }
}

void IOEngine::chunk_succeeded(Chunk& c) {
  Request& r = *c.req;
  if (r.write) {
    if (checksum_) csum_record(r.fd, r.offset + c.off, c.len, crc32c(r.base + c.off, c.len));
  } else if (r.fault == Fault::kCorrupt && c.off == 0) {
    r.base[0] ^= 0x5a;  // the bytes arrived damaged
  }
}

void IOEngine::finish_chunk(Chunk& c, int err) {
  Request& r = *c.req;
  if (c.flipped) r.base[0] ^= 0x5a;  // before the checksum: it records what was meant
  std::string why;
  if (err) {
    why = c.injected ? "injected: " + errno_text(err) : errno_text(err);
  } else if (c.moved < c.len) {
    err = EIO;
    why = c.injected   ? "injected short transfer"
          : r.write    ? "write made no progress"
                       : "unexpected end of file";
  } else {
    chunk_succeeded(c);
  }
  bool last;
  {
    std::lock_guard<std::mutex> lk(mu_);
    r.transferred += c.moved;
    if (err && !r.err) {
      r.err = err;
      r.why = std::move(why);
    }
    last = --r.outstanding == 0 && r.next >= r.nbytes;
  }
  if (last) finish_request(r);
}

void IOEngine::finish_request(Request& r) {
  // Only this thread touches r until `done` is published under the lock.
  if (!r.err && !r.write && checksum_) {
    std::string bad = csum_verify(r.fd, r.offset, r.nbytes, r.base);
    if (!bad.empty()) {
      r.err = EIO;
      r.why = std::move(bad);
    }
  }
  if (r.err)
    r.message = transfer_failure(r.write ? "pwrite" : "pread", r.nbytes, r.offset,
                                 r.transferred, r.why);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (--fd_busy_[r.fd] == 0) fd_busy_.erase(r.fd);
    r.done = true;
  }
  done_cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// threads backend

void IOEngine::grow_workers(int n) {
  std::lock_guard<std::mutex> lk(threads_mu_);
  {
    std::lock_guard<std::mutex> lk2(mu_);
    if (stopping_) return;
  }
  while (static_cast<int>(threads_.size()) < n) threads_.emplace_back([this] { worker(); });
}

void IOEngine::worker() {
  for (;;) {
    Chunk c;
    bool more;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] {
        return pending_.empty() ? stopping_ : busy_ < queue_depth_;
      });
      if (pending_.empty()) {
        // Stopping and drained. Wake every other idle worker: they went to sleep while there
        // was still work, and no notification would otherwise tell them it is gone.
        lk.unlock();
        work_cv_.notify_all();
        return;
      }
      next_chunk(c);
      ++busy_;
      more = !pending_.empty() && busy_ < queue_depth_;
    }
    if (more) work_cv_.notify_one();  // submit woke one worker: fan out the rest of the work
    prepare_chunk(c);
    finish_chunk(c, c.injected ? -c.inject_res : run_sync(c));
    {
      std::lock_guard<std::mutex> lk(mu_);
      --busy_;
    }
    work_cv_.notify_one();  // a slot is free for a worker held back by queue_depth
  }
}

int IOEngine::run_sync(Chunk& c) {
  Request& r = *c.req;
  char* p = r.base + c.off;
  const int64_t pos = r.offset + c.off;
  while (c.moved < c.len) {
    ssize_t k = r.write ? ::pwrite(r.fd, p + c.moved, c.len - c.moved, pos + c.moved)
                        : ::pread(r.fd, p + c.moved, c.len - c.moved, pos + c.moved);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (k == 0) break;  // EOF on read; a write that cannot progress (finish_chunk reports it)
    c.moved += k;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// io_uring backend

#ifdef HETERO_HAVE_LIBURING
void IOEngine::uring_wake() {
  uint64_t one = 1;
  // Blocking only if the counter would overflow (2^64 - 1 wakeups unread): never.
  while (::write(uring_->efd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void IOEngine::uring_loop() {
  Uring& u = *uring_;
  bool wake_armed = false;
  bool warned = false;
  auto issue = [&](int slot) {
    Chunk& c = u.slots[slot];
    io_uring_sqe* sqe = io_uring_get_sqe(&u.ring);  // never null: the ring holds every slot
    Request& r = *c.req;
    if (c.injected) {
      io_uring_prep_nop(sqe);  // the completion path applies inject_res
    } else {
      char* p = r.base + c.off + c.moved;
      auto n = static_cast<unsigned>(c.len - c.moved);
      auto pos = static_cast<uint64_t>(r.offset + c.off + c.moved);
      if (r.write) io_uring_prep_write(sqe, r.fd, p, n, pos);
      else io_uring_prep_read(sqe, r.fd, p, n, pos);
    }
    io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(slot)));
  };
  auto release = [&](int slot) {
    u.free_slots.push_back(slot);
    u.inflight--;
  };
  for (;;) {
    if (!wake_armed) {
      io_uring_sqe* sqe = io_uring_get_sqe(&u.ring);
      io_uring_prep_read(sqe, u.efd, &u.efd_buf, sizeof u.efd_buf, 0);
      io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(kWakeTag)));
      wake_armed = true;
    }
    for (int slot : u.retry) issue(slot);
    u.retry.clear();
    bool exit_now;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (u.inflight < queue_depth_ && !pending_.empty()) {
        int slot = u.free_slots.back();
        u.free_slots.pop_back();
        u.inflight++;
        next_chunk(u.slots[slot]);
        u.to_issue.push_back(slot);
      }
      exit_now = stopping_ && pending_.empty() && u.inflight == 0;
    }
    if (exit_now) break;
    for (int slot : u.to_issue) {
      prepare_chunk(u.slots[slot]);
      issue(slot);
    }
    u.to_issue.clear();
    int ret = io_uring_submit_and_wait(&u.ring, 1);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
      // Not expected from a valid ring; the SQEs stay queued and the next round retries them.
      if (!warned) {
        std::fprintf(stderr, "hetero: io_uring_submit_and_wait failed: %s; retrying\n",
                     errno_text(-ret).c_str());
        warned = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    unsigned head, seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&u.ring, head, cqe) {
      ++seen;
      auto tag = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqe)));
      if (tag == kWakeTag) {
        wake_armed = false;  // re-armed at the top of the loop, after taking the new work
        continue;
      }
      int slot = static_cast<int>(tag);
      Chunk& c = u.slots[slot];
      int res = cqe->res;
      if (c.injected) {
        finish_chunk(c, -c.inject_res);
        release(slot);
      } else if (res < 0) {
        if (res == -EINTR || res == -EAGAIN) {
          u.retry.push_back(slot);
        } else {
          finish_chunk(c, -res);
          release(slot);
        }
      } else if (res == 0) {
        finish_chunk(c, 0);  // no progress: EOF on read, a stuck write
        release(slot);
      } else {
        c.moved += res;
        if (c.moved < c.len) {
          u.retry.push_back(slot);  // short transfer: issue the rest
        } else {
          finish_chunk(c, 0);
          release(slot);
        }
      }
    }
    io_uring_cq_advance(&u.ring, seen);
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// checksums

void IOEngine::csum_forget(int fd, int64_t off, int64_t len) {
  std::lock_guard<std::mutex> lk(csum_mu_);
  auto f = csums_.find(fd);
  if (f == csums_.end()) return;
  auto& m = f->second;
  auto it = m.lower_bound(off);
  if (it != m.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.len > off) it = prev;
  }
  while (it != m.end() && it->first < off + len) it = m.erase(it);
}

void IOEngine::csum_record(int fd, int64_t off, int64_t len, uint32_t crc) {
  csum_forget(fd, off, len);
  std::lock_guard<std::mutex> lk(csum_mu_);
  csums_[fd][off] = Csum{len, crc};
}

std::string IOEngine::csum_verify(int fd, int64_t off, int64_t len, const char* data) {
  std::vector<std::pair<int64_t, Csum>> inside;
  {
    std::lock_guard<std::mutex> lk(csum_mu_);
    auto f = csums_.find(fd);
    if (f == csums_.end()) return {};
    // Records never overlap, so they are sorted by end too: stop at the first that ends past.
    for (auto it = f->second.lower_bound(off);
         it != f->second.end() && it->first + it->second.len <= off + len; ++it)
      inside.emplace_back(*it);
  }
  for (const auto& [pos, rec] : inside) {
    uint32_t got = crc32c(data + (pos - off), rec.len);
    if (got != rec.crc) {
      char buf[200];
      std::snprintf(buf, sizeof buf,
                    "checksum mismatch in the %lld bytes at file offset %lld: written with "
                    "crc32c 0x%08x, read back 0x%08x",
                    static_cast<long long>(rec.len), static_cast<long long>(pos), rec.crc, got);
      return buf;
    }
  }
  return {};
}

}  // namespace hetero
