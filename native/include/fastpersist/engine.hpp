// I/O engines. An engine takes requests (one contiguous transfer each) and
// reports completions. Engines finish every request completely or fail it:
// EINTR and short transfers are retried inside the engine, so a completion's
// `res` is the full length, a short count only for reads that reached end of
// file, or -errno.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fastpersist {

struct IoReq {
  int fd = -1;        // descriptor to use (direct or buffered)
  int fallback_fd = -1;  // buffered twin, for unaligned remainders after a short transfer
  size_t align = 1;   // alignment the direct descriptor needs (1 for buffered)
  char* buf = nullptr;
  size_t len = 0;
  uint64_t off = 0;
  bool write = true;
  uint64_t tag = 0;
};

struct IoDone {
  uint64_t tag = 0;
  int64_t res = 0;       // bytes transferred, or -errno
  uint64_t err_off = 0;  // file offset where the failure happened
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const char* name() const = 0;
  // Queue one request. Never blocks for long; the caller bounds in-flight work.
  virtual void submit(const IoReq& r) = 0;
  // Append at least `min_nr` completions to `out` (blocking), plus any others
  // already available. Returns how many were appended.
  virtual size_t reap(std::vector<IoDone>& out, size_t min_nr) = 0;
  virtual size_t in_flight() const = 0;
};

// Linux kernel AIO (io_setup/io_submit/io_getevents through syscall(2): no libaio).
// Throws IoError if the kernel refuses io_setup.
std::unique_ptr<Engine> make_aio_engine(unsigned queue_depth);
// A pool of `threads` threads doing pread/pwrite.
std::unique_ptr<Engine> make_psync_engine(unsigned threads);
// No thread: submit() does the transfer in the calling thread (same retrying loops as
// psync), reap() hands back what was done. For ops of one transfer, where a thread
// handoff costs more than it overlaps (on a busy machine, a scheduling delay each way).
std::unique_ptr<Engine> make_inline_engine();
// Whether this kernel offers AIO at all (io_setup succeeds).
bool aio_available();

}  // namespace fastpersist
