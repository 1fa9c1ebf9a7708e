// The I/O engine: reads byte ranges of files into caller-owned memory, O_DIRECT where the file
// system allows it, split into chunks with many in flight. No Python and no torch in here: the
// binding file (bindings.cpp) is the only place that knows about either.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "read_request.h"

namespace zerolite {

// O_DIRECT wants buffer address, file offset and length aligned to the logical block size of the
// device; 4 KiB covers every device we care about and is what the layout aligns extents to.
constexpr std::size_t kAlignment = 4096;

struct EngineOptions {
  std::string backend = "auto";        // "auto", "io_uring" or "pread"
  unsigned queue_depth = 32;           // reads in flight at once
  std::size_t chunk_bytes = 1 << 20;   // a request is split into reads of this size
  unsigned threads = 0;                // pread workers; 0 means queue_depth
  // For tests of the error paths: the fault_at-th chunk read to complete (counting from 1) fails
  // with EIO ("eio") or ends as if the file did ("short"); "" injects nothing.
  std::string fault;
  std::uint64_t fault_at = 0;
};

class Backend;

class IoEngine {
 public:
  explicit IoEngine(const EngineOptions& options);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Starts reading nbytes at file_offset of path into dst and returns at once with a ticket.
  // dst must stay valid until wait() has returned for that ticket.
  std::uint64_t submit(const std::string& path, void* dst, std::size_t nbytes,
                       std::uint64_t file_offset);

  // Blocks until every byte of the ticket's request has arrived, and returns when that was
  // (CLOCK_MONOTONIC seconds), or until timeout_s has passed (nullopt; the ticket stays valid).
  // A negative timeout waits for ever. Throws IoError or ShortReadError if the request failed;
  // the ticket is spent either way once it is done.
  std::optional<double> wait(std::uint64_t ticket, double timeout_s);

  // Gives up the ticket's reads that have not started: their bytes never land in dst. Returns
  // how many bytes that spares. The ticket must still be waited for (reads under way finish).
  std::size_t cancel(std::uint64_t ticket);

  const char* backend_name() const;
  const EngineOptions& options() const { return options_; }

 private:
  void on_chunk_done(const Chunk& chunk, ChunkOutcome outcome);
  void finish(ReadRequest& request);

  EngineOptions options_;
  std::mutex mutex_;
  std::condition_variable done_;
  std::unordered_map<std::uint64_t, std::shared_ptr<ReadRequest>> requests_;
  std::uint64_t next_ticket_ = 1;
  std::atomic<std::uint64_t> chunks_completed_{0};
  std::unique_ptr<Backend> backend_;  // last: its threads stop before the state above goes
};

}  // namespace zerolite
