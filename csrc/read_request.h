// What travels between the engine and its backends: a request (one submit) split into chunks
// (one read syscall's worth each), and what became of a chunk.
#pragma once

#include <atomic>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace zerolite {

// An error the OS reported for a file, carrying what a person needs to find the cause.
class IoError : public std::runtime_error {
 public:
  IoError(int error_number, const std::string& path, const std::string& message)
      : std::runtime_error(message), error_number_(error_number), path_(path) {}
  int error_number() const { return error_number_; }
  const std::string& path() const { return path_; }

 private:
  int error_number_;
  std::string path_;
};

// The file ended before the bytes asked for: a truncated file or a read past its end.
class ShortReadError : public IoError {
 public:
  using IoError::IoError;
};

struct ReadRequest {
  std::string path;
  int fd = -1;
  std::uint64_t file_offset = 0;
  std::size_t nbytes = 0;
  std::atomic<std::size_t> chunks_left{0};
  bool done = false;      // guarded by the engine's mutex
  double finished_s = 0;  // CLOCK_MONOTONIC seconds when the last chunk landed (Python's perf_counter clock)

  // The failure nearest the start of the request is reported; later chunks often fail for the same cause.
  std::mutex error_mutex;
  std::exception_ptr error;  // an IoError or ShortReadError
  std::uint64_t error_at = 0;  // the file offset the error names
};

struct Chunk {
  std::shared_ptr<ReadRequest> request;
  char* dst = nullptr;
  std::uint64_t file_offset = 0;
  std::size_t nbytes = 0;
};

struct ChunkOutcome {
  int error_number = 0;        // errno of a failed read, 0 if none
  bool end_of_file = false;    // the file ended inside the chunk
  std::uint64_t at_offset = 0; // where the read stopped, for the message
};

using ChunkDone = std::function<void(const Chunk&, const ChunkOutcome&)>;

// Whether a read that returned fewer bytes than asked hit the end of the file (then it will never
// complete) rather than being cut short for another reason (then reading on is right).
bool reached_end_of_file(int fd, std::uint64_t offset);

}  // namespace zerolite
