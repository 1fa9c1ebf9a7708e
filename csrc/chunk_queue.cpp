#include <sys/stat.h>

#include "backend.h"

namespace zerolite {

void ChunkQueue::push(std::vector<Chunk> chunks) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& chunk : chunks) chunks_.push_back(std::move(chunk));
  }
  ready_.notify_all();
}

std::vector<Chunk> ChunkQueue::take(std::size_t max_chunks, bool wait) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (wait) ready_.wait(lock, [this] { return closed_ || !chunks_.empty(); });
  std::vector<Chunk> taken;
  while (taken.size() < max_chunks && !chunks_.empty()) {
    taken.push_back(std::move(chunks_.front()));
    chunks_.pop_front();
  }
  return taken;
}

void ChunkQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  ready_.notify_all();
}

bool reached_end_of_file(int fd, std::uint64_t offset) {
  struct stat st {};
  return fstat(fd, &st) == 0 && offset >= static_cast<std::uint64_t>(st.st_size);
}

}  // namespace zerolite
