// The syscall layer. Every read, write, fsync and open of the engines goes
// through here so that tests can inject faults (EIO, ENOSPC, short transfers,
// EINTR) at the Nth call. Functions return the byte count or -errno, like
// liburing; the transfer loops (full_pwrite/full_pread) retry EINTR, retry
// EAGAIN a bounded number of times with backoff (EagainBackoff), and continue
// after short transfers.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpersist::sys {

enum class Op { Write, Read, Fsync, Open, Rename };

// What an injected fault does to one call.
struct Fault {
  enum Kind { None, Errno, Short, Eintr } kind = None;
  int err = 0;
};

// Configure / clear the global fault; parse "op:nth:action[:count]".
void set_fault(const std::string& op, long nth, const std::string& action, long count);
void set_fault_from_spec(const std::string& spec);
void clear_faults();
long fault_hits();
// Count one call of `op` and return the fault to apply to it (usually None).
Fault check_fault(Op op);
// For system calls made outside the native core (Python's os.fsync, os.open,
// os.rename in the commit steps): counts the call as one of `op` ("write", "read",
// "fsync", "open", "rename") and returns the errno an active fault assigns it, else 0
// ("short" and "eintr" faults: 0, the caller's retrying call is the real one).
int fault_errno(const std::string& op);

ssize_t pwrite(int fd, const void* buf, size_t n, uint64_t off);
ssize_t pread(int fd, void* buf, size_t n, uint64_t off);
int fsync(int fd);
int open(const char* path, int flags, unsigned mode);

// Write all `n` bytes at `off`. Uses `dfd` (O_DIRECT, may be -1) while the
// remaining piece is aligned to `align`, else the buffered `fd`. Returns 0 or
// -errno; *done receives the bytes written before a failure.
int full_pwrite(int fd, int dfd, size_t align, const char* buf, size_t n, uint64_t off,
                size_t* done);
// Read up to `n` bytes at `off`, stopping early only at end of file.
// Returns 0 or -errno; *done receives the bytes read.
int full_pread(int fd, int dfd, size_t align, char* buf, size_t n, uint64_t off, size_t* done);

inline bool aligned(uint64_t v, size_t a) { return a <= 1 || v % a == 0; }

// Bounded retry of EAGAIN. A transfer that keeps failing with EAGAIN must not
// spin forever (a psync thread at 100% CPU): each wait() sleeps a little longer
// (50 us, doubling, at most 200 ms per sleep) until about kEagainBudgetUs of
// sleeping without progress; then it returns false and the caller fails the
// transfer with EAGAIN (reported as an IoError naming op, path and offset).
// reset() after any progress: the budget is for consecutive failures.
inline constexpr uint64_t kEagainBudgetUs = 1000000;
class EagainBackoff {
 public:
  bool wait();
  void reset() { slept_us_ = 0; next_us_ = kFirstUs; }
  uint64_t slept_us() const { return slept_us_; }

 private:
  static constexpr uint64_t kFirstUs = 50;
  static constexpr uint64_t kMaxUs = 200000;
  uint64_t slept_us_ = 0;
  uint64_t next_us_ = kFirstUs;
};

}  // namespace fastpersist::sys
