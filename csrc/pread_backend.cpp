// The backend that always works: worker threads, each doing one blocking pread at a time, so the
// number of threads is the queue depth the device sees.
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "backend.h"

namespace zerolite {
namespace {

ChunkOutcome read_fully(const Chunk& chunk) {
  const int fd = chunk.request->fd;
  std::size_t got = 0;
  while (got < chunk.nbytes) {
    const ssize_t n = pread(fd, chunk.dst + got, chunk.nbytes - got, chunk.file_offset + got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return {errno, false, chunk.file_offset + got};
    got += static_cast<std::size_t>(n);
    if (n == 0 || (got < chunk.nbytes && reached_end_of_file(fd, chunk.file_offset + got))) {
      return {0, true, chunk.file_offset + got};
    }
  }
  return {};
}

class PreadBackend final : public Backend {
 public:
  PreadBackend(unsigned threads, ChunkDone done) : done_(std::move(done)) {
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  ~PreadBackend() override {
    queue_.close();
    for (auto& worker : workers_) worker.join();
  }

  void enqueue(std::vector<Chunk> chunks) override { queue_.push(std::move(chunks)); }
  std::vector<Chunk> withdraw(const ReadRequest& request) override { return queue_.remove(request); }
  const char* name() const override { return "pread"; }

 private:
  void work() {
    for (;;) {
      auto chunks = queue_.take(1, /*wait=*/true);
      if (chunks.empty()) return;
      done_(chunks.front(), read_fully(chunks.front()));
    }
  }

  ChunkDone done_;
  ChunkQueue queue_;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_pread_backend(unsigned threads, ChunkDone done) {
  return std::make_unique<PreadBackend>(threads, std::move(done));
}

}  // namespace zerolite
