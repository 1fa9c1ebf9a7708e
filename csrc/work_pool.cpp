#include "work_pool.h"

#include <chrono>

namespace zerolite {

namespace {
// How long an idle worker watches for the next call before it sleeps: long enough to bridge the
// gap between one layer's matmul and the next within a step, far too short to hold a core from
// the reads while the step waits on them.
constexpr auto SPIN = std::chrono::microseconds(50);
}  // namespace

WorkPool& kernel_pool() {
  static WorkPool pool;
  return pool;
}

WorkPool::~WorkPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void WorkPool::grow(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    int64_t seen = generation_.load();
    int index = static_cast<int>(workers_.size());
    workers_.emplace_back([this, seen, index] { work(index, seen); });
  }
}

void WorkPool::take_tasks() {
  for (int64_t i = next_task_.fetch_add(1); i < tasks_; i = next_task_.fetch_add(1)) (*task_)(i);
}

void WorkPool::run(int threads, int64_t tasks, const std::function<void(int64_t)>& task) {
  if (tasks <= 0) return;
  int workers = static_cast<int>(std::min<int64_t>(threads, tasks)) - 1;
  if (workers <= 0) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> call(call_mutex_);
  grow(workers);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &task;
    tasks_ = tasks;
    next_task_.store(0);
    active_workers_ = workers;
    busy_.store(workers);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  take_tasks();
  if (busy_.load() > 0) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_.load() == 0; });
  }
}

void WorkPool::work(int index, int64_t seen) {
  while (true) {
    auto spin_until = std::chrono::steady_clock::now() + SPIN;
    while (generation_.load() == seen && std::chrono::steady_clock::now() < spin_until) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    seen = generation_.load();
    if (stopping_) return;
    if (index >= active_workers_) continue;  // this call wants fewer threads
    lock.unlock();
    take_tasks();
    if (busy_.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> done_lock(mutex_);
      done_.notify_one();
    }
  }
}

}  // namespace zerolite
