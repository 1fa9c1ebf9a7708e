// A backend performs chunk reads and reports each one finished through a ChunkDone callback.
// Two exist: io_uring through raw syscalls (no liburing needed to build or run) and a pool of
// threads calling pread, which works everywhere.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "read_request.h"

namespace zerolite {

// Chunks waiting for a backend to take them. Closing it lets consumers drain what is left and stop.
class ChunkQueue {
 public:
  void push(std::vector<Chunk> chunks);
  // Takes up to max_chunks. With wait set, blocks until there is one or the queue is closed;
  // an empty result with wait set means closed and drained.
  std::vector<Chunk> take(std::size_t max_chunks, bool wait);
  // Takes out the request's chunks that no backend has taken yet: they will never be read.
  std::vector<Chunk> remove(const ReadRequest& request);
  void close();

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Chunk> chunks_;
  bool closed_ = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Thread-safe; the chunks' completions arrive on the backend's own threads.
  virtual void enqueue(std::vector<Chunk> chunks) = 0;
  // The request's chunks not yet handed to the kernel (or a worker), taken out of the queue.
  virtual std::vector<Chunk> withdraw(const ReadRequest& request) = 0;
  virtual const char* name() const = 0;
};

std::unique_ptr<Backend> make_pread_backend(unsigned threads, ChunkDone done);

// Throws IoError when the kernel refuses io_uring (too old, disabled by sysctl or seccomp).
std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth, ChunkDone done);

}  // namespace zerolite
