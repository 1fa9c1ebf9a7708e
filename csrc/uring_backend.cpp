// io_uring through its raw system calls, so that neither building nor running needs liburing.
// One driver thread owns the ring: it moves chunks from the queue into submission entries while
// fewer than queue_depth are in flight, then sleeps in io_uring_enter until one completes.
#include "backend.h"

#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

namespace zerolite {
namespace {

int io_uring_setup(unsigned entries, io_uring_params* params) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, params));
}

int io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

// The three shared mappings of one ring and the pointers into them.
class Ring {
 public:
  explicit Ring(unsigned entries) {
    io_uring_params params{};
    fd_ = io_uring_setup(entries, &params);
    if (fd_ < 0) throw IoError(errno, "", std::string("io_uring_setup: ") + std::strerror(errno));
    // IORING_OP_READ and this feature flag arrived together (Linux 5.6).
    if (!(params.features & IORING_FEAT_RW_CUR_POS)) {
      close(fd_);
      throw IoError(ENOSYS, "", "io_uring: kernel too old for IORING_OP_READ");
    }
    sq_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    const bool single_mmap = params.features & IORING_FEAT_SINGLE_MMAP;
    if (single_mmap) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_map_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_map_ = single_mmap ? sq_map_ : map(cq_bytes_, IORING_OFF_CQ_RING);
    sqe_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqe_bytes_, IORING_OFF_SQES));

    auto* sq = static_cast<char*>(sq_map_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + params.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + params.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + params.sq_off.array);
    auto* cq = static_cast<char*>(cq_map_);
    cq_head_ = reinterpret_cast<unsigned*>(cq + params.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + params.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + params.cq_off.cqes);
  }

  ~Ring() {
    munmap(sqes_, sqe_bytes_);
    if (cq_map_ != sq_map_) munmap(cq_map_, cq_bytes_);
    munmap(sq_map_, sq_bytes_);
    close(fd_);
  }

  // Queues a read; the kernel sees it at the next enter().
  void prepare_read(int fd, char* dst, std::size_t nbytes, std::uint64_t offset,
                    std::uint64_t user_data) {
    const unsigned tail = *sq_tail_;  // only this thread writes the tail
    const unsigned index = tail & sq_mask_;
    io_uring_sqe& sqe = sqes_[index];
    std::memset(&sqe, 0, sizeof(sqe));
    sqe.opcode = IORING_OP_READ;
    sqe.fd = fd;
    sqe.addr = reinterpret_cast<std::uint64_t>(dst);
    sqe.len = static_cast<unsigned>(nbytes);
    sqe.off = offset;
    sqe.user_data = user_data;
    sq_array_[index] = index;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++unsubmitted_;
  }

  // Hands queued reads to the kernel and, with wait_for_one, sleeps until at least one completes.
  void enter(bool wait_for_one) {
    for (;;) {
      const int n = io_uring_enter(fd_, unsubmitted_, wait_for_one ? 1 : 0,
                                   wait_for_one ? IORING_ENTER_GETEVENTS : 0);
      if (n >= 0) {
        unsubmitted_ -= static_cast<unsigned>(n);
        if (unsubmitted_ == 0 || !wait_for_one) return;
        continue;
      }
      if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
      throw IoError(errno, "", std::string("io_uring_enter: ") + std::strerror(errno));
    }
  }

  // Calls visit(user_data, result) for every completion waiting and consumes them.
  template <typename Visit>
  void reap(Visit visit) {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    for (; head != tail; ++head) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      visit(cqe.user_data, cqe.res);
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  }

 private:
  void* map(std::size_t bytes, off_t what) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (p == MAP_FAILED) throw IoError(errno, "", std::string("io_uring mmap: ") + std::strerror(errno));
    return p;
  }

  int fd_ = -1;
  void* sq_map_ = nullptr;
  void* cq_map_ = nullptr;
  std::size_t sq_bytes_ = 0, cq_bytes_ = 0, sqe_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned unsubmitted_ = 0;
};

// A chunk in flight and how many of its bytes have arrived (reads can come back short).
struct InFlight {
  Chunk chunk;
  std::size_t got = 0;
};

class UringBackend final : public Backend {
 public:
  UringBackend(unsigned queue_depth, ChunkDone done)
      : ring_(queue_depth), depth_(queue_depth), done_(std::move(done)), slots_(queue_depth) {
    for (unsigned i = 0; i < queue_depth; ++i) free_slots_.push_back(queue_depth - 1 - i);
    driver_ = std::thread([this] { drive(); });
  }

  ~UringBackend() override {
    queue_.close();
    driver_.join();
  }

  void enqueue(std::vector<Chunk> chunks) override { queue_.push(std::move(chunks)); }
  std::vector<Chunk> withdraw(const ReadRequest& request) override { return queue_.remove(request); }
  const char* name() const override { return "io_uring"; }

 private:
  void drive() {
    /* 1. take as many queued chunks as there are free slots (sleep only if nothing is in flight)
       2. hand them to the kernel and sleep until at least one read completes
       3. finish completed chunks; read on where a read came back short */
    for (;;) {
      const bool idle = free_slots_.size() == depth_;
      auto chunks = queue_.take(free_slots_.size(), /*wait=*/idle);
      if (idle && chunks.empty()) return;  // closed and drained
      for (auto& chunk : chunks) {
        const unsigned slot = free_slots_.back();
        free_slots_.pop_back();
        slots_[slot] = InFlight{std::move(chunk), 0};
        submit(slot);
      }
      try {
        ring_.enter(/*wait_for_one=*/true);
      } catch (const IoError& e) {
        fail_all_in_flight(e.error_number());
        continue;
      }
      ring_.reap([this](std::uint64_t slot, int result) { complete(slot, result); });
    }
  }

  void submit(unsigned slot) {
    InFlight& f = slots_[slot];
    ring_.prepare_read(f.chunk.request->fd, f.chunk.dst + f.got, f.chunk.nbytes - f.got,
                       f.chunk.file_offset + f.got, slot);
  }

  void complete(std::uint64_t slot, int result) {
    InFlight& f = slots_[slot];
    const std::uint64_t at = f.chunk.file_offset + f.got;
    if (result == -EINTR || result == -EAGAIN) return submit(slot);
    if (result < 0) return finish(slot, {-result, false, at});
    f.got += static_cast<std::size_t>(result);
    if (f.got == f.chunk.nbytes) return finish(slot, {});
    if (result == 0 || reached_end_of_file(f.chunk.request->fd, at + result)) {
      return finish(slot, {0, true, at + result});
    }
    submit(slot);
  }

  void finish(std::uint64_t slot, const ChunkOutcome& outcome) {
    Chunk chunk = std::move(slots_[slot].chunk);
    free_slots_.push_back(static_cast<unsigned>(slot));
    done_(chunk, outcome);
  }

  // io_uring_enter itself failed: nothing in flight can be trusted to complete.
  void fail_all_in_flight(int error_number) {
    std::vector<bool> is_free(depth_, false);
    for (unsigned slot : free_slots_) is_free[slot] = true;
    for (unsigned slot = 0; slot < depth_; ++slot) {
      if (!is_free[slot]) finish(slot, {error_number, false, slots_[slot].chunk.file_offset});
    }
  }

  Ring ring_;
  const unsigned depth_;
  ChunkDone done_;
  ChunkQueue queue_;
  std::vector<InFlight> slots_;
  std::vector<unsigned> free_slots_;  // only the driver thread touches slots
  std::thread driver_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth, ChunkDone done) {
  return std::make_unique<UringBackend>(queue_depth, std::move(done));
}

}  // namespace zerolite

#else  // kernel headers without io_uring: only the pread backend exists

#include <cerrno>

namespace zerolite {

std::unique_ptr<Backend> make_uring_backend(unsigned, ChunkDone) {
  throw IoError(ENOSYS, "", "io_uring: built without <linux/io_uring.h>");
}

}  // namespace zerolite

#endif
