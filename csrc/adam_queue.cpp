#include "adam_queue.h"

#include <chrono>
#include <exception>
#include <stdexcept>

#include <unistd.h>

namespace hetero {

struct AdamJobState {
  std::vector<AdamCall> calls;  // released once they ran (no tensor references: see the header)
  std::atomic<bool> done{false};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;  // set before done
};

bool AdamJob::done() const { return s_->done.load(std::memory_order_acquire); }

void AdamJob::wait() const {
  if (!s_->done.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [&] { return s_->done.load(std::memory_order_acquire); });
  }
  if (s_->error) std::rethrow_exception(s_->error);
}

AdamQueue::AdamQueue()
    : sh_(std::make_unique<Shared>()),
      owner_(getpid()),
      thread_(std::make_unique<std::thread>([this] { loop(); })) {}

AdamQueue::~AdamQueue() { shutdown(); }

AdamJob AdamQueue::submit(std::vector<AdamCall> calls) {
  if (getpid() != owner_) throw std::runtime_error("this Adam queue belongs to the parent process");
  auto s = std::make_shared<AdamJobState>();
  s->calls = std::move(calls);
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
    (void)sh_.release();      // a waiter the child cannot see would block the cv's destructor
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
  delay_us_.store(static_cast<int64_t>(delay_s * 1e6));
  fail_at_.store(fail_call > 0 ? calls_.load() + fail_call : 0);
}

void AdamQueue::run_call(const AdamCall& c) {
  const int64_t n = calls_.fetch_add(1) + 1;
  if (const int64_t us = delay_us_.load(); us > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  if (n == fail_at_.load()) throw std::runtime_error("injected kernel failure");
  run_prepared_adam(*c);
}

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
    try {
      for (const AdamCall& c : s->calls) run_call(c);
    } catch (...) {
      s->error = std::current_exception();
    }
    s->calls.clear();
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->done.store(true, std::memory_order_release);
    }
    s->cv.notify_all();
  }
}

}  // namespace hetero
