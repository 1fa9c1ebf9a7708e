#include "work_pool.h"

#include <chrono>

namespace zerolite {

namespace {
// How long an idle thread watches for the next call before it sleeps: long enough to bridge the
// gaps between a decode step's matmuls, short enough to sleep while a step waits on reads. At
// batch 1 the gaps (the Python and torch ops between two matmuls) were 180 us at the median, 98%
// under 1 ms (2-core VM, int4 model of 16 layers); a worker woken from its sleep joined a call
// about 100 us late, which left a 2048 x 2048 int4 call at nearly one thread's time (155-175 us
// against 90 watching, 190 on one thread). It watches with yields, not pauses: a thread the
// machine has waiting for a core (the I/O engine's, torch's, another process's) takes it first.
constexpr auto WATCH = std::chrono::milliseconds(1);

template <typename Done>
void spin_until(Done done) {
  auto until = std::chrono::steady_clock::now() + WATCH;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
}
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
    int index = static_cast<int>(workers_.size());
    int64_t seen = generation_.load();
    workers_.emplace_back([this, index, seen] { work(index, seen); });
  }
}

void WorkPool::take_tasks(Call& call) {
  for (int64_t i = call.next.fetch_add(1); i < call.tasks; i = call.next.fetch_add(1)) {
    (*call.task)(i);
    if (call.finished.fetch_add(1) + 1 == call.tasks) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_all();
    }
  }
}

void WorkPool::run(int threads, int64_t tasks, const std::function<void(int64_t)>& task) {
  if (tasks <= 0) return;
  int workers = static_cast<int>(std::min<int64_t>(threads, tasks)) - 1;
  if (workers <= 0) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> one_call(call_mutex_);
  grow(workers);
  Call call;
  call.task = &task;
  call.tasks = tasks;
  call.workers = workers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    call_ = &call;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  take_tasks(call);
  spin_until([&] { return call.finished.load() == tasks; });
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return call.finished.load() == tasks; });
  call_ = nullptr;  // no worker joins from here on; those inside are leaving
  done_.wait(lock, [&] { return call.inside == 0; });
}

void WorkPool::work(int index, int64_t seen) {
  while (true) {
    spin_until([&] { return generation_.load() != seen; });
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    seen = generation_.load();
    if (stopping_) return;
    Call* call = call_;
    if (call == nullptr || index >= call->workers) continue;  // over already, or wants fewer threads
    ++call->inside;
    lock.unlock();
    take_tasks(*call);
    lock.lock();
    if (--call->inside == 0) done_.notify_all();
  }
}

}  // namespace zerolite
