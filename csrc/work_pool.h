// The threads the CPU matmul kernels split their work over: a small pool of its own, so the
// kernels neither need OpenMP nor leave threads spinning on cores the I/O engine's reads need. The calling thread takes tasks too, and a call ends when its
// tasks are done: a worker the OS has not run yet (the machine's cores are busy elsewhere) is not
// waited for, and finds nothing left when it wakes. Idle workers watch for the next call up to a
// millisecond (a decode step makes hundreds, a few hundred microseconds apart), yielding the core
// to any thread that wants it, then sleep on a condition variable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zerolite {

class WorkPool {
 public:
  ~WorkPool();

  // Runs task(0 .. tasks - 1) on up to `threads` threads (the caller's included) and returns
  // when every task has finished. Calls are serialised: one runs at a time.
  void run(int threads, int64_t tasks, const std::function<void(int64_t)>& task);

 private:
  struct Call {
    const std::function<void(int64_t)>* task;
    int64_t tasks;
    int workers;                        // how many of the pool's workers may join
    std::atomic<int64_t> next{0};       // the next task to take
    std::atomic<int64_t> finished{0};
    int inside = 0;                     // workers taking its tasks (under mutex_)
  };

  void grow(int workers);
  void work(int index, int64_t generation_seen);
  void take_tasks(Call& call);

  std::mutex call_mutex_;   // one call at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  std::atomic<int64_t> generation_{0};
  Call* call_ = nullptr;    // the call workers may join (under mutex_)
  bool stopping_ = false;
};

WorkPool& kernel_pool();

}  // namespace zerolite
