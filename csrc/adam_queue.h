// A thread of its own that runs CPU Adam updates (cpu_adam.h) in the order they were submitted.
//
// Why: the optimizer defers a host chunk's update (hetero.optim.adam), so step() returns at once
// and the next forward waits only for the chunks it uses. Run from a Python thread, every update
// first needs the GIL, which the training loop's Python code keeps for up to the interpreter's
// switch interval (5 ms) at a time: for chunks of a few MiB that wait, not the arithmetic, is what
// the forward ends up waiting for. This thread never takes the GIL.
//
// Contract:
//  - submit(calls) queues one job: adam_step calls prepared by prepare_adam_step (cpu_adam.h), so
//    their arguments were checked at submit. Jobs run one at a time, in order, on the queue's
//    thread. A prepared call holds raw pointers: the caller keeps its tensors alive, and leaves
//    them alone, until the job is done (hetero.optim.queue.AdamQueue does; the runtime's compute
//    ops keep everything else off them).
//  - AdamJob::done() never blocks. wait() blocks until the job ran (call it without the GIL) and
//    throws what the job threw, at every wait. A job after a failed one still runs.
//  - shutdown() lets the queued jobs run, then joins the thread; submit() after it throws
//    std::runtime_error. The destructor shuts down. In a child forked from the process that made
//    the queue the thread does not exist, and its lock and condition variable may show a holder
//    or a waiter forever (destroying them could block): there shutdown() and the destructor leak
//    the thread and those (a few hundred bytes), and submit() throws.
//  - set_test_hook(delay_s, fail_call), tests only: from now on every call first sleeps delay_s,
//    and the fail_call-th call (1-based, counted from this setting; 0: none) throws
//    std::runtime_error("injected kernel failure") instead of running. calls() counts the calls
//    started since the queue was made.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "cpu_adam.h"

namespace hetero {

using AdamCall = std::shared_ptr<const PreparedAdam>;

struct AdamJobState;

class AdamJob {
 public:
  explicit AdamJob(std::shared_ptr<AdamJobState> s) : s_(std::move(s)) {}
  bool done() const;
  void wait() const;

 private:
  std::shared_ptr<AdamJobState> s_;
};

class AdamQueue {
 public:
  AdamQueue();
  ~AdamQueue();
  AdamQueue(const AdamQueue&) = delete;
  AdamQueue& operator=(const AdamQueue&) = delete;

  AdamJob submit(std::vector<AdamCall> calls);
  void shutdown();
  void set_test_hook(double delay_s, int64_t fail_call);
  int64_t calls() const { return calls_.load(); }

 private:
  void loop();
  void run_call(const AdamCall& call);

  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<AdamJobState>> queue;  // guarded by mu
    bool stopping = false;                            // guarded by mu
  };
  std::unique_ptr<Shared> sh_;  // leaked in a forked child (see fork above)
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> delay_us_{0};
  std::atomic<int64_t> fail_at_{0};  // calls_ value whose call fails (0: none)
  pid_t owner_;                      // the process whose thread this is (see fork above)
  std::unique_ptr<std::thread> thread_;
};

}  // namespace hetero
