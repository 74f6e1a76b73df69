// Linux kernel AIO engine, talking to the kernel through syscall(2) so that
// neither libaio nor its headers are needed at build or run time. Requests
// stay in a slot until fully transferred: short completions are resubmitted
// for the remainder (through the buffered twin when the remainder is no longer
// aligned), EINTR is retried, EAGAIN is retried with a bounded backoff (one
// budget for the engine, reset by any progress: see sys::EagainBackoff), every
// result is checked.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/sys.hpp"

namespace fastpersist {

namespace {

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return ::syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return ::syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** cbs) {
  return ::syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* ev) {
  return ::syscall(SYS_io_getevents, ctx, min_nr, nr, ev, nullptr);
}

class AioEngine final : public Engine {
 public:
  explicit AioEngine(unsigned depth) : depth_(depth ? depth : 1), slots_(depth_), events_(depth_) {
    if (sys_io_setup(depth_, &ctx_) < 0) {
      throw IoError(errno, "io_setup", "(kernel AIO)", 0, depth_);
    }
    for (unsigned i = 0; i < depth_; ++i) free_.push_back(depth_ - 1 - i);
  }
  ~AioEngine() override {
    // Drain whatever is still in flight before the buffers go away.
    while (in_flight_ > 0) {
      long n = sys_io_getevents(ctx_, 1, depth_, events_.data());
      if (n < 0 && errno != EINTR) break;
      if (n > 0) in_flight_ -= static_cast<size_t>(n) <= in_flight_ ? static_cast<size_t>(n) : in_flight_;
    }
    sys_io_destroy(ctx_);
  }
  const char* name() const override { return "aio"; }

  void submit(const IoReq& r) override {
    while (free_.empty()) pump(1);
    unsigned i = free_.back();
    free_.pop_back();
    slots_[i].req = r;
    slots_[i].done = 0;
    ++in_flight_;
    launch(i);
  }

  size_t reap(std::vector<IoDone>& out, size_t min_nr) override {
    while (ready_.size() < min_nr && in_flight_ > 0) pump(1);
    if (ready_.empty() && in_flight_ > 0) pump(0);
    size_t n = ready_.size();
    out.insert(out.end(), ready_.begin(), ready_.end());
    ready_.clear();
    return n;
  }

  size_t in_flight() const override { return in_flight_ + ready_.size(); }

 private:
  struct Slot {
    IoReq req;
    size_t done = 0;
    struct iocb cb {};
  };

  void finish(unsigned i, int64_t res) {
    Slot& s = slots_[i];
    IoDone d;
    d.tag = s.req.tag;
    d.res = res;
    d.err_off = s.req.off + s.done;
    ready_.push_back(d);
    free_.push_back(i);
    --in_flight_;
  }

  // Submit the remainder of slot i (or finish it synchronously when the
  // remainder can't go through O_DIRECT any more).
  void launch(unsigned i) {
    Slot& s = slots_[i];
    const IoReq& r = s.req;
    char* p = r.buf + s.done;
    size_t left = r.len - s.done;
    uint64_t off = r.off + s.done;
    if (r.align > 1 && !(sys::aligned(reinterpret_cast<uintptr_t>(p), r.align) &&
                         sys::aligned(off, r.align) && sys::aligned(left, r.align))) {
      size_t more = 0;
      int bfd = r.fallback_fd >= 0 ? r.fallback_fd : r.fd;
      int rc = r.write ? sys::full_pwrite(bfd, -1, 1, p, left, off, &more)
                       : sys::full_pread(bfd, -1, 1, p, left, off, &more);
      s.done += more;
      finish(i, rc < 0 ? rc : static_cast<int64_t>(s.done));
      return;
    }
    std::memset(&s.cb, 0, sizeof(s.cb));
    s.cb.aio_data = i;
    s.cb.aio_lio_opcode = r.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    s.cb.aio_fildes = static_cast<uint32_t>(r.fd);
    s.cb.aio_buf = reinterpret_cast<uint64_t>(p);
    s.cb.aio_nbytes = left;
    s.cb.aio_offset = static_cast<int64_t>(off);
    struct iocb* cbp = &s.cb;
    for (;;) {
      long n = sys_io_submit(ctx_, 1, &cbp);
      if (n == 1) return;
      int e = n < 0 ? errno : EAGAIN;
      if (e == EINTR) continue;
      if (e == EAGAIN && in_flight_ > 1) {
        pump(1);  // make room, then try again
        continue;
      }
      if (e == EAGAIN && backoff_.wait()) continue;  // nothing of ours to wait for
      finish(i, -e);
      return;
    }
  }

  // Collect at least min_nr kernel completions and process them.
  void pump(long min_nr) {
    long n;
    for (;;) {
      n = sys_io_getevents(ctx_, min_nr, depth_, events_.data());
      if (n >= 0) break;
      if (errno != EINTR) {
        // The context is unusable; fail everything still in flight.
        int e = errno;
        for (unsigned i = 0; i < depth_; ++i) {
          if (!is_free(i)) finish(i, -e);
        }
        return;
      }
    }
    for (long k = 0; k < n; ++k) {
      unsigned i = static_cast<unsigned>(events_[k].data);
      Slot& s = slots_[i];
      int64_t res = events_[k].res;
      sys::Fault f = sys::check_fault(s.req.write ? sys::Op::Write : sys::Op::Read);
      if (f.kind == sys::Fault::Errno) res = -f.err;
      if (f.kind == sys::Fault::Eintr) res = -EINTR;
      if (f.kind == sys::Fault::Short && res > 1) res /= 2;
      if (res == -EINTR) {
        launch(i);
      } else if (res == -EAGAIN) {
        // Bounded: a completion that keeps failing with EAGAIN fails the request
        // after about a second of backoff without progress, instead of looping.
        if (backoff_.wait()) {
          launch(i);
        } else {
          finish(i, res);
        }
      } else if (res < 0) {
        finish(i, res);
      } else if (res == 0) {
        if (s.req.write) {
          finish(i, -EIO);  // no progress: never loop forever
        } else {
          finish(i, static_cast<int64_t>(s.done));  // end of file
        }
      } else {
        backoff_.reset();
        s.done += static_cast<size_t>(res);
        if (s.done < s.req.len) {
          launch(i);
        } else {
          finish(i, static_cast<int64_t>(s.done));
        }
      }
    }
  }

  bool is_free(unsigned i) const {
    for (unsigned f : free_) {
      if (f == i) return true;
    }
    return false;
  }

  unsigned depth_;
  aio_context_t ctx_ = 0;
  std::vector<Slot> slots_;
  std::vector<struct io_event> events_;
  std::vector<unsigned> free_;
  std::vector<IoDone> ready_;
  size_t in_flight_ = 0;
  sys::EagainBackoff backoff_;
};

}  // namespace

std::unique_ptr<Engine> make_aio_engine(unsigned queue_depth) {
  return std::make_unique<AioEngine>(queue_depth);
}

bool aio_available() {
  aio_context_t ctx = 0;
  if (sys_io_setup(1, &ctx) < 0) return false;
  sys_io_destroy(ctx);
  return true;
}

}  // namespace fastpersist
