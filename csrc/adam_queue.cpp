#include "adam_queue.h"

#include <chrono>
#include <exception>
#include <stdexcept>

#include <unistd.h>

namespace hetero {

struct AdamJobState {
  std::vector<AdamCall> calls;  // released once they ran (no tensor references: see the header)
  std::shared_ptr<AdamQueue::Shared> queue;  // its counters and test hook
  std::atomic<bool> started{false};          // claimed by the thread that runs it
  std::atomic<bool> done{false};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;  // set before done
};

namespace {

void run_call(AdamQueue::Shared& q, const AdamCall& c) {
  const int64_t n = q.calls.fetch_add(1) + 1;
  if (const int64_t us = q.delay_us.load(); us > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  if (n == q.fail_at.load()) throw std::runtime_error("injected kernel failure");
  run_prepared_adam(*c);
}

// Runs the job in this thread unless another thread has started it; false if one had.
bool run_if_unstarted(AdamJobState& s) {
  if (s.started.exchange(true, std::memory_order_acq_rel)) return false;
  try {
    for (const AdamCall& c : s.calls) run_call(*s.queue, c);
  } catch (...) {
    s.error = std::current_exception();
  }
  s.calls.clear();
  s.queue.reset();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.done.store(true, std::memory_order_release);
  }
  s.cv.notify_all();
  return true;
}

}  // namespace

bool AdamJob::done() const { return s_->done.load(std::memory_order_acquire); }

void AdamJob::run_or_wait() const {
  run_if_unstarted(*s_);
  wait();
}

void AdamJob::wait() const {
  if (!s_->done.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [&] { return s_->done.load(std::memory_order_acquire); });
  }
  if (s_->error) std::rethrow_exception(s_->error);
}

AdamQueue::AdamQueue()
    : sh_(std::make_shared<Shared>()),
      owner_(getpid()),
      thread_(std::make_unique<std::thread>([this] { loop(); })) {}

AdamQueue::~AdamQueue() { shutdown(); }

AdamJob AdamQueue::submit(std::vector<AdamCall> calls) {
  if (getpid() != owner_) throw std::runtime_error("this Adam queue belongs to the parent process");
  auto s = std::make_shared<AdamJobState>();
  s->calls = std::move(calls);
  s->queue = sh_;
  {
    std::lock_guard<std::mutex> lock(sh_->mu);
    if (sh_->stopping) throw std::runtime_error("the Adam queue is shut down");
    sh_->queue.push_back(s);
  }
  sh_->cv.notify_one();
  return AdamJob(std::move(s));
}

void AdamQueue::shutdown() {
  if (!thread_) return;
  if (getpid() != owner_) {  // a forked child: see the header; leaked on purpose
    (void)thread_.release();  // joining a thread that is not here is undefined
    // A waiter the child cannot see would block the cv's destructor: a reference is leaked so
    // that the shared state (which queued jobs also hold) is never destroyed.
    (void)new std::shared_ptr<Shared>(sh_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(sh_->mu);
    sh_->stopping = true;
  }
  sh_->cv.notify_one();
  thread_->join();
  thread_.reset();
}

void AdamQueue::set_test_hook(double delay_s, int64_t fail_call) {
  sh_->delay_us.store(static_cast<int64_t>(delay_s * 1e6));
  sh_->fail_at.store(fail_call > 0 ? sh_->calls.load() + fail_call : 0);
}

int64_t AdamQueue::calls() const { return sh_->calls.load(); }

void AdamQueue::loop() {
  for (;;) {
    std::shared_ptr<AdamJobState> s;
    {
      std::unique_lock<std::mutex> lock(sh_->mu);
      sh_->cv.wait(lock, [&] { return sh_->stopping || !sh_->queue.empty(); });
      if (sh_->queue.empty()) return;  // stopping, and everything queued ran
      s = std::move(sh_->queue.front());
      sh_->queue.pop_front();
    }
    run_if_unstarted(*s);  // (skipped where a waiter ran it: run_or_wait)
  }
}

}  // namespace hetero
