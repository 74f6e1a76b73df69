#include "fastpersist/sys.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "fastpersist/error.hpp"

namespace fastpersist::sys {

namespace {

struct FaultState {
  std::mutex mu;
  std::atomic<bool> active{false};
  int op_mask = 0;  // bit per Op; all bits for "any"
  long nth = 0;
  long count = 0;
  long seen = 0;
  long hits = 0;
  Fault action;
};

FaultState& state() {
  static FaultState s;
  return s;
}

int op_bit(Op op) { return 1 << static_cast<int>(op); }

int parse_op(const std::string& op) {
  if (op == "write") return op_bit(Op::Write);
  if (op == "read") return op_bit(Op::Read);
  if (op == "fsync") return op_bit(Op::Fsync);
  if (op == "open") return op_bit(Op::Open);
  if (op == "rename") return op_bit(Op::Rename);
  if (op == "any") return 0x1F;
  throw ArgError("fault op must be write, read, fsync, open, rename or any, not '" + op + "'");
}

struct ErrnoName {
  const char* name;
  int value;
};

const ErrnoName kErrnos[] = {
    {"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EROFS", EROFS},
    {"EACCES", EACCES}, {"EPERM", EPERM},   {"ENOENT", ENOENT}, {"EINVAL", EINVAL},
    {"EBADF", EBADF},   {"EFBIG", EFBIG},   {"ENOMEM", ENOMEM}, {"EAGAIN", EAGAIN},
    {"EFAULT", EFAULT}, {"EMFILE", EMFILE}, {"ESTALE", ESTALE}, {"ETIMEDOUT", ETIMEDOUT},
};

Fault parse_action(const std::string& a) {
  Fault f;
  if (a == "short") {
    f.kind = Fault::Short;
  } else if (a == "eintr" || a == "EINTR") {
    f.kind = Fault::Eintr;
  } else {
    f.kind = Fault::Errno;
    for (const auto& e : kErrnos) {
      if (a == e.name) f.err = e.value;
    }
    if (f.err == 0) {
      char* end = nullptr;
      long v = std::strtol(a.c_str(), &end, 10);
      if (end && *end == '\0' && v > 0) f.err = static_cast<int>(v);
    }
    if (f.err == 0) {
      throw ArgError("fault action must be 'short', 'eintr', an errno name (EIO, ENOSPC, ...) "
                     "or number, not '" + a + "'");
    }
  }
  return f;
}

// Reads FASTPERSIST_FAULT once when the library is loaded.
struct EnvFault {
  EnvFault() {
    const char* spec = std::getenv("FASTPERSIST_FAULT");
    if (spec && *spec) {
      try {
        set_fault_from_spec(spec);
      } catch (const std::exception&) {
        // A bad spec is reported when Python imports the module (see bindings).
      }
    }
  }
};
EnvFault g_env_fault;

// Fork safety (see fork.hpp): a worker thread may hold the fault lock at the
// moment another thread forks; the child would then find it locked forever.
// The forking thread takes it first (held only for a few instructions by
// anyone), so the child's copy of the state is consistent, and both sides
// release it afterwards (the child's only thread is the replica of the one
// that took it).
void fault_lock() { state().mu.lock(); }
void fault_unlock() { state().mu.unlock(); }
struct FaultForkHandlers {
  FaultForkHandlers() { ::pthread_atfork(&fault_lock, &fault_unlock, &fault_unlock); }
};
FaultForkHandlers g_fault_fork_handlers;

}  // namespace

void set_fault(const std::string& op, long nth, const std::string& action, long count) {
  if (nth < 1) throw ArgError("fault nth must be >= 1 (1 = the first matching call)");
  if (count < 1) throw ArgError("fault count must be >= 1");
  int mask = parse_op(op);
  Fault f = parse_action(action);
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  s.op_mask = mask;
  s.nth = nth;
  s.count = count;
  s.seen = 0;
  s.hits = 0;
  s.action = f;
  s.active.store(true);
}

void set_fault_from_spec(const std::string& spec) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t p = spec.find(':', start);
    parts.push_back(spec.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  if (parts.size() < 3 || parts.size() > 4) {
    throw ArgError("FASTPERSIST_FAULT must look like 'op:nth:action[:count]' (e.g. write:3:EIO), "
                   "not '" + spec + "'");
  }
  auto number = [&](const std::string& txt, const char* what) {
    char* end = nullptr;
    long v = std::strtol(txt.c_str(), &end, 10);
    if (txt.empty() || !end || *end != '\0') {
      throw ArgError(std::string("fault spec '") + spec + "': " + what + " must be a number, not '" + txt + "'");
    }
    return v;
  };
  long nth = number(parts[1], "nth");
  long count = parts.size() == 4 ? number(parts[3], "count") : 1;
  set_fault(parts[0], nth, parts[2], count);
}

void clear_faults() {
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  s.active.store(false);
  s.seen = 0;
  s.hits = 0;
}

long fault_hits() {
  auto& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.hits;
}

Fault check_fault(Op op) {
  auto& s = state();
  if (!s.active.load(std::memory_order_relaxed)) return {};
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.active.load() || !(s.op_mask & op_bit(op))) return {};
  ++s.seen;
  if (s.seen >= s.nth && s.seen < s.nth + s.count) {
    ++s.hits;
    return s.action;
  }
  return {};
}

int fault_errno(const std::string& op) {
  Op o;
  if (op == "write") o = Op::Write;
  else if (op == "read") o = Op::Read;
  else if (op == "fsync") o = Op::Fsync;
  else if (op == "open") o = Op::Open;
  else if (op == "rename") o = Op::Rename;
  else throw ArgError("fault_errno op must be write, read, fsync, open or rename, not '" + op + "'");
  Fault f = check_fault(o);
  return f.kind == Fault::Errno ? f.err : 0;
}

ssize_t pwrite(int fd, const void* buf, size_t n, uint64_t off) {
  Fault f = check_fault(Op::Write);
  if (f.kind == Fault::Errno) return -f.err;
  if (f.kind == Fault::Eintr) return -EINTR;
  if (f.kind == Fault::Short && n > 1) n /= 2;
  ssize_t r = ::pwrite(fd, buf, n, static_cast<off_t>(off));
  return r < 0 ? -errno : r;
}

ssize_t pread(int fd, void* buf, size_t n, uint64_t off) {
  Fault f = check_fault(Op::Read);
  if (f.kind == Fault::Errno) return -f.err;
  if (f.kind == Fault::Eintr) return -EINTR;
  if (f.kind == Fault::Short && n > 1) n /= 2;
  ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(off));
  return r < 0 ? -errno : r;
}

int fsync(int fd) {
  Fault f = check_fault(Op::Fsync);
  if (f.kind == Fault::Errno) return -f.err;
  for (;;) {
    if (f.kind == Fault::Eintr) {
      f.kind = Fault::None;  // the retry below is the real call
      continue;
    }
    int r = ::fsync(fd);
    if (r == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}

int open(const char* path, int flags, unsigned mode) {
  Fault f = check_fault(Op::Open);
  if (f.kind == Fault::Errno) return -f.err;
  for (;;) {
    int fd = ::open(path, flags, mode);
    if (fd >= 0) return fd;
    if (errno != EINTR) return -errno;
  }
}

bool EagainBackoff::wait() {
  if (slept_us_ >= kEagainBudgetUs) return false;
  const uint64_t us = std::min({next_us_, kMaxUs, kEagainBudgetUs - slept_us_});
  std::this_thread::sleep_for(std::chrono::microseconds(us));
  slept_us_ += us;
  next_us_ = std::min(next_us_ * 2, kMaxUs);
  return true;
}

int full_pwrite(int fd, int dfd, size_t align, const char* buf, size_t n, uint64_t off,
                size_t* done) {
  size_t d = 0;
  EagainBackoff backoff;
  while (d < n) {
    const char* p = buf + d;
    size_t left = n - d;
    uint64_t o = off + d;
    bool direct = dfd >= 0 && aligned(reinterpret_cast<uintptr_t>(p), align) &&
                  aligned(o, align) && aligned(left, align);
    ssize_t r = sys::pwrite(direct ? dfd : fd, p, left, o);
    if (r == -EINTR) continue;
    if (r == -EAGAIN && backoff.wait()) continue;
    if (r < 0) {
      *done = d;
      return static_cast<int>(r);
    }
    if (r == 0) {  // a write that makes no progress would loop forever
      *done = d;
      return -EIO;
    }
    backoff.reset();
    d += static_cast<size_t>(r);
  }
  *done = d;
  return 0;
}

int full_pread(int fd, int dfd, size_t align, char* buf, size_t n, uint64_t off, size_t* done) {
  size_t d = 0;
  EagainBackoff backoff;
  while (d < n) {
    char* p = buf + d;
    size_t left = n - d;
    uint64_t o = off + d;
    bool direct = dfd >= 0 && aligned(reinterpret_cast<uintptr_t>(p), align) &&
                  aligned(o, align) && aligned(left, align);
    ssize_t r = sys::pread(direct ? dfd : fd, p, left, o);
    if (r == -EINTR) continue;
    if (r == -EAGAIN && backoff.wait()) continue;
    if (r < 0) {
      *done = d;
      return static_cast<int>(r);
    }
    if (r == 0) break;  // end of file
    backoff.reset();
    d += static_cast<size_t>(r);
  }
  *done = d;
  return 0;
}

}  // namespace fastpersist::sys
