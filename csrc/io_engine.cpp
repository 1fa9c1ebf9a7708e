#include "io_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <ctime>
#include <cstring>
#include <vector>

#include "backend.h"

namespace zerolite {
namespace {

// The clock Python's time.perf_counter() reads on Linux, so completion times line up with its.
double monotonic_seconds() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

std::string describe(const std::string& path, std::uint64_t offset) {
  return path + " at offset " + std::to_string(offset);
}

void check_alignment(const std::string& path, const void* dst, std::size_t nbytes,
                     std::uint64_t offset) {
  const char* what = nullptr;
  if (reinterpret_cast<std::uintptr_t>(dst) % kAlignment) what = "destination address";
  else if (offset % kAlignment) what = "file offset";
  else if (nbytes % kAlignment) what = "length";
  if (what) {
    throw std::invalid_argument("misaligned read of " + std::to_string(nbytes) + " bytes from " +
                                describe(path, offset) + ": the " + what +
                                " must be a multiple of 4096 (use zerolite.io.aligned_empty)");
  }
}

// O_DIRECT bypasses the page cache; file systems without it (tmpfs) reject the flag with EINVAL,
// and there buffered reads are the only kind there is.
int open_for_reading(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0 && errno == EINVAL) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    throw IoError(err, path, "cannot open for reading: " + std::string(std::strerror(err)));
  }
  return fd;
}

std::unique_ptr<Backend> make_backend(const EngineOptions& options, ChunkDone done) {
  const unsigned threads = options.threads ? options.threads : options.queue_depth;
  if (options.backend == "pread") return make_pread_backend(threads, std::move(done));
  if (options.backend == "io_uring") return make_uring_backend(options.queue_depth, std::move(done));
  if (options.backend != "auto") {
    throw std::invalid_argument("unknown I/O backend '" + options.backend +
                                "': choose auto, io_uring or pread");
  }
  try {
    return make_uring_backend(options.queue_depth, done);
  } catch (const IoError&) {
    return make_pread_backend(threads, std::move(done));  // io_uring refused: the fallback
  }
}

}  // namespace

IoEngine::IoEngine(const EngineOptions& options) : options_(options) {
  if (options_.queue_depth == 0 || options_.queue_depth > 4096) {
    throw std::invalid_argument("queue_depth must be between 1 and 4096");
  }
  if (!options_.fault.empty() && options_.fault != "eio" && options_.fault != "short") {
    throw std::invalid_argument("fault must be \"eio\" or \"short\"");
  }
  if (options_.chunk_bytes == 0 || options_.chunk_bytes % kAlignment ||
      options_.chunk_bytes > (1u << 30)) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096, at most 1 GiB");
  }
  backend_ = make_backend(options_, [this](const Chunk& c, const ChunkOutcome& o) {
    on_chunk_done(c, o);
  });
}

// Destroying the backend first drains every queued read: no read may land in memory that the
// caller believes is free again.
IoEngine::~IoEngine() { backend_.reset(); }

const char* IoEngine::backend_name() const { return backend_->name(); }

std::uint64_t IoEngine::submit(const std::string& path, void* dst, std::size_t nbytes,
                               std::uint64_t file_offset) {
  check_alignment(path, dst, nbytes, file_offset);
  auto request = std::make_shared<ReadRequest>();
  request->path = path;
  request->file_offset = file_offset;
  request->nbytes = nbytes;
  request->fd = open_for_reading(path);

  std::vector<Chunk> chunks;
  for (std::size_t done = 0; done < nbytes; done += options_.chunk_bytes) {
    const std::size_t len = std::min(options_.chunk_bytes, nbytes - done);
    chunks.push_back(Chunk{request, static_cast<char*>(dst) + done, file_offset + done, len});
  }
  request->chunks_left = chunks.size();

  std::lock_guard<std::mutex> lock(mutex_);
  const std::uint64_t ticket = next_ticket_++;
  requests_[ticket] = request;
  if (chunks.empty()) {
    close(request->fd);
    request->finished_s = monotonic_seconds();
    request->done = true;
  } else {
    backend_->enqueue(std::move(chunks));
  }
  return ticket;
}

void IoEngine::on_chunk_done(const Chunk& chunk, ChunkOutcome outcome) {
  ReadRequest& request = *chunk.request;
  if (!options_.fault.empty() && chunks_completed_.fetch_add(1) + 1 == options_.fault_at) {
    if (options_.fault == "eio") outcome.error_number = EIO;
    else outcome.end_of_file = true;
    outcome.at_offset = chunk.file_offset;
  }
  if (outcome.error_number || outcome.end_of_file) {
    std::lock_guard<std::mutex> lock(request.error_mutex);
    // Chunks finish in any order: report the failure nearest the start (where a file ends,
    // every later chunk fails too, at its own offset).
    if (!request.error || outcome.at_offset < request.error_at) {
      request.error_at = outcome.at_offset;
      if (outcome.end_of_file) {
        // No errno means "the file ended"; ENODATA ("no data available") is the closest.
        request.error = std::make_exception_ptr(ShortReadError(
            ENODATA, request.path,
            "short read: " + request.path + " ends at offset " + std::to_string(outcome.at_offset) +
                ", before the " + std::to_string(request.nbytes) + " bytes asked for at offset " +
                std::to_string(request.file_offset) + " (file truncated or read past its end)"));
      } else {
        request.error = std::make_exception_ptr(IoError(
            outcome.error_number, request.path,
            "read failed: " + describe(request.path, outcome.at_offset) + ": " +
                std::strerror(outcome.error_number)));
      }
    }
  }
  if (request.chunks_left.fetch_sub(1) == 1) finish(request);
}

// The request's last chunk is done (read, failed or cancelled): whoever counted it down to none.
void IoEngine::finish(ReadRequest& request) {
  close(request.fd);
  double now = monotonic_seconds();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    request.finished_s = now;
    request.done = true;
  }
  done_.notify_all();
}

std::size_t IoEngine::cancel(std::uint64_t ticket) {
  std::shared_ptr<ReadRequest> request;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(ticket);
    if (it == requests_.end()) {
      throw std::invalid_argument("unknown ticket " + std::to_string(ticket) +
                                  " (never submitted, or already waited for)");
    }
    request = it->second;
  }
  std::vector<Chunk> withdrawn = backend_->withdraw(*request);
  std::size_t spared = 0;
  for (const Chunk& chunk : withdrawn) spared += chunk.nbytes;
  if (!withdrawn.empty() && request->chunks_left.fetch_sub(withdrawn.size()) == withdrawn.size()) {
    finish(*request);
  }
  return spared;
}

std::optional<double> IoEngine::wait(std::uint64_t ticket, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(ticket);
  if (it == requests_.end()) {
    throw std::invalid_argument("unknown ticket " + std::to_string(ticket) +
                                " (never submitted, or already waited for)");
  }
  std::shared_ptr<ReadRequest> request = it->second;
  auto is_done = [&] { return request->done; };
  if (timeout_s < 0) {
    done_.wait(lock, is_done);
  } else if (!done_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done)) {
    return std::nullopt;
  }
  requests_.erase(ticket);
  lock.unlock();
  if (request->error) std::rethrow_exception(request->error);
  return request->finished_s;
}

}  // namespace zerolite
