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
//    their arguments were checked at submit. The queue's thread starts jobs one at a time, in the
//    order submitted. A prepared call holds raw pointers: the caller keeps its tensors alive, and
//    leaves them alone, until the job is done (hetero.optim.queue.AdamQueue does; the runtime's
//    compute ops keep everything else off them). So jobs are independent: a job that needs
//    another's result is submitted after that one is done.
//  - AdamJob::done() never blocks. wait() blocks until the job ran (call it without the GIL) and
//    throws what the job threw, at every wait. A job after a failed one still runs.
//  - AdamJob::run_or_wait() runs the job in the calling thread if no thread has started it yet
//    (the queue's thread then skips it), else waits; then as wait(). Why: the caller needs it
//    now (the forward needs the chunk), and the queue's thread may be busy with earlier jobs or
//    asleep; waiting would add those jobs, or the thread's wake-up, to the caller's wait.
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
  void run_or_wait() const;

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
  int64_t calls() const;

  // What the queue's thread and the jobs (which may run in another thread) share.
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<AdamJobState>> queue;  // guarded by mu
    bool stopping = false;                            // guarded by mu
    std::atomic<int64_t> calls{0};
    std::atomic<int64_t> delay_us{0};
    std::atomic<int64_t> fail_at{0};  // calls value whose call fails (0: none)
  };

 private:
  void loop();

  std::shared_ptr<Shared> sh_;  // leaked in a forked child (see fork above)
  pid_t owner_;                 // the process whose thread this is (see fork above)
  std::unique_ptr<std::thread> thread_;
};

}  // namespace hetero
