// The threads the CPU matmul kernels split their work over: a small pool of its own, so the
// kernels neither need OpenMP nor leave threads spinning between calls, which would take the
// cores from the I/O engine's reads. The calling thread takes a share of every call's work;
// the others wait a few microseconds for the next call (a decode step makes hundreds, back to
// back) and then sleep on a condition variable.
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
  void grow(int workers);
  void work(int index, int64_t generation_seen);
  void take_tasks();

  std::mutex call_mutex_;   // one call at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  std::atomic<int64_t> generation_{0};
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> busy_{0};
  int64_t tasks_ = 0;
  int active_workers_ = 0;   // how many workers this call may use
  const std::function<void(int64_t)>* task_ = nullptr;
  bool stopping_ = false;
};

WorkPool& kernel_pool();

}  // namespace zerolite
