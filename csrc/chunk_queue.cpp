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

std::vector<Chunk> ChunkQueue::remove(const ReadRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Chunk> removed;
  std::deque<Chunk> kept;
  for (auto& chunk : chunks_) {
    if (chunk.request.get() == &request) removed.push_back(std::move(chunk));
    else kept.push_back(std::move(chunk));
  }
  chunks_ = std::move(kept);
  return removed;
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
