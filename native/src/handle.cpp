#include "fastpersist/handle.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "fastpersist/copy.hpp"
#include "fastpersist/crc32.hpp"
#include "fastpersist/cuda_rt.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/fork.hpp"

namespace fastpersist {

namespace {

size_t round_chunk(size_t cs) {
  if (cs == 0) throw ArgError("chunk_size must be > 0");
  return (cs + 4095) / 4096 * 4096;
}

File open_target(const Target& t, bool write, bool truncate, bool direct) {
  File::Mode m = write ? File::Mode::Write : File::Mode::Read;
  if (t.fd >= 0) return File::from_fd(t.fd, m, direct);
  return File::open(t.path, m, truncate, direct);
}

}  // namespace

Handle::Handle(std::string engine, size_t chunk_size, unsigned queue_depth, unsigned threads,
               bool direct, unsigned max_async, bool stage_reads, std::string read_mode)
    : max_async_(std::max(max_async, 1u)) {
  if (read_mode != "auto" && read_mode != "direct" && read_mode != "buffered") {
    throw ArgError("read_mode must be 'auto', 'direct' or 'buffered', not '" + read_mode + "'");
  }
  read_mode_ = std::move(read_mode);
  opt_.chunk_size = round_chunk(chunk_size);
  if (engine != "auto" && engine != "aio" && engine != "psync" && engine != "cufile") {
    throw ArgError("engine must be 'auto', 'aio', 'psync' or 'cufile', not '" + engine + "'");
  }
  if (queue_depth == 0) throw ArgError("queue_depth must be >= 1");
  opt_.engine = std::move(engine);
  opt_.queue_depth = queue_depth;
  opt_.threads = std::max(threads, 1u);
  opt_.direct = direct;
  opt_.stage_reads = stage_reads;
  st_.store(new State(this, opt_.threads, opt_.chunk_size, max_async_, fork_generation()));
}

Handle::~Handle() {
  State* s = st_.load();
  // A State built before a fork belongs to the parent: its mutexes may be held and
  // its condition variables waited on by threads that don't exist in this process,
  // so stopping/joining/destroying it would hang. Leak it (fork.hpp).
  if (s->gen == fork_generation()) delete s;
}

Handle::State::State(Handle* h, unsigned threads, size_t chunk_size, unsigned max_async, uint64_t g)
    : owner(h), gen(g), pool(threads), cache(chunk_size) {
  try {
    for (unsigned i = 0; i < max_async; ++i) workers.emplace_back([this] { worker(); });
  } catch (...) {  // no thread left joinable when `workers` goes (thread_pool.cpp)
    stop_and_join();
    throw;
  }
}

Handle::State::~State() { stop_and_join(); }

void Handle::State::stop_and_join() {
  {
    std::lock_guard<std::mutex> lk(mu);
    stop = true;
  }
  cv_work.notify_all();
  for (auto& t : workers) {
    if (t.joinable()) t.join();
  }
}

Handle::State& Handle::state() {
  const uint64_t gen = fork_generation();
  State* s = st_.load(std::memory_order_acquire);
  while (s->gen != gen) {
    // First use in a forked child. Read only what is safe to read of the parent's
    // State without its lock (immutable fields and atomics) and build a new one.
    auto* fresh = new State(this, opt_.threads, opt_.chunk_size, max_async_, gen);
    fresh->orphaned = s->uncollected.load();
    fresh->orphaned_pid = static_cast<uint64_t>(::getppid());
    if (st_.compare_exchange_strong(s, fresh, std::memory_order_acq_rel)) return *fresh;  // old one leaked
    delete fresh;  // another thread of this child was first; s is now its State
  }
  return *s;
}

std::vector<uint32_t> Handle::run(const OpSpec& op) {
  State& s = state();
  if (opt_.engine == "cufile") return run_cufile(op, s);
  File f = open_target(op.target, op.write, op.truncate, opt_.direct);
  ExecOptions o = opt_;
  o.fsync = op.fsync;
  o.preallocate = op.write && op.target.fd < 0;
  ExecResult r = op.write ? execute_write(f, op.extents, op.patches, op.nslots, o, s.pool, s.cache)
                          : execute_read(f, op.extents, op.nslots, o, s.pool, s.cache);
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.last_engine = r.engine;
  }
  return std::move(r.crcs);
}

std::vector<uint32_t> Handle::run_cufile(const OpSpec& op, State& s) {
  if (op.nslots > 0 || !op.patches.empty()) {
    throw ArgError("the cufile engine moves device memory directly: checksums and patches need host bytes");
  }
  File f = open_target(op.target, op.write, op.truncate, true);
  if (!f.direct()) throw IoError(EINVAL, "open(O_DIRECT) for cuFile", f.path(), 0, 0);
  std::unique_ptr<CufileFile> reg;  // the file is registered once for the whole op
  for (const Extent& e : op.extents) {
    if (e.len) {
      if (!reg) reg = std::make_unique<CufileFile>(f.dfd(), f.path());
      reg->transfer(op.write, reinterpret_cast<void*>(e.ptr), e.len, e.off, opt_.chunk_size);
    }
  }
  if (op.write && op.fsync) f.sync();
  std::lock_guard<std::mutex> lk(s.mu);
  s.last_engine = "cufile";
  return {};
}

// ---------------------------------------------------------------- async ----

bool AsyncOp::wait_for(double timeout_s) {
  if (done.load()) return true;
  if (gen != fork_generation()) {
    // Its worker is a thread of the parent: it never completes here, and its lock may be held.
    throw std::runtime_error("asynchronous operation " + std::to_string(id) +
                             " was submitted before this process was forked; it runs in the parent only "
                             "and cannot be waited for here");
  }
  std::unique_lock<std::mutex> lk(mu);
  if (timeout_s < 0) {
    cv.wait(lk, [&] { return done.load(); });
    return true;
  }
  return cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done.load(); });
}

std::vector<uint32_t> AsyncOp::result() const {
  if (err) std::rethrow_exception(err);
  return crcs;
}

bool Future::done() const { return op_->done.load(); }

std::vector<uint32_t> Future::result(double timeout_s) {
  if (!op_->wait_for(timeout_s)) {
    throw WaitTimeout("operation " + std::to_string(op_->id) + " not finished within the timeout");
  }
  return op_->result();
}

std::shared_ptr<AsyncOp> Handle::enqueue(OpSpec op, bool tracked) {
  State& s = state();
  auto a = std::make_shared<AsyncOp>();
  a->spec = std::move(op);
  a->gen = s.gen;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    a->id = next_id_.fetch_add(1);
    if (tracked) {
      s.ops.push_back(a);
      s.uncollected.store(s.ops.size());
    }
    s.queue.push_back(a);
  }
  s.cv_work.notify_one();
  return a;
}

uint64_t Handle::submit(OpSpec op) { return enqueue(std::move(op), true)->id; }

Future Handle::submit_future(OpSpec op) { return Future(enqueue(std::move(op), false)); }

void Handle::State::worker() {
  for (;;) {
    std::shared_ptr<AsyncOp> a;
    {
      std::unique_lock<std::mutex> lk(mu);
      cv_work.wait(lk, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      a = queue.front();
      queue.pop_front();
    }
    std::vector<uint32_t> crcs;
    std::exception_ptr err;
    try {
      crcs = owner->run(a->spec);
    } catch (...) {
      err = std::current_exception();
    }
    a->spec.extents = {};  // the caller's memory is no longer referenced
    a->spec.patches = {};
    {
      std::lock_guard<std::mutex> lk(a->mu);
      a->crcs = std::move(crcs);
      a->err = err;
      a->done.store(true);
    }
    a->cv.notify_all();
    {
      // wait() checks `done` under mu: taking it here means a waiter is either
      // before its check (and sees done) or asleep (and gets the notification).
      std::lock_guard<std::mutex> lk(mu);
    }
    cv_done.notify_all();
  }
}

std::vector<std::pair<uint64_t, std::vector<uint32_t>>> Handle::wait() {
  State& s = state();
  std::vector<std::shared_ptr<AsyncOp>> ops;
  size_t orphaned = 0;
  uint64_t parent = 0;
  {
    std::unique_lock<std::mutex> lk(s.mu);
    s.cv_done.wait(lk, [&] {
      return std::all_of(s.ops.begin(), s.ops.end(), [](const auto& a) { return a->done.load(); });
    });
    ops.swap(s.ops);
    s.uncollected.store(s.ops.size());
    std::swap(orphaned, s.orphaned);
    parent = s.orphaned_pid;
  }
  if (orphaned) {
    throw std::runtime_error(
        "wait(): " + std::to_string(orphaned) + " asynchronous operation(s) submitted before this process "
        "was forked from pid " + std::to_string(parent) + " were not collected there; they run in the "
        "parent only (reads land in the parent's memory, not this process's), so their results are "
        "undefined here and are dropped. Collect them with wait() before fork().");
  }
  std::vector<std::pair<uint64_t, std::vector<uint32_t>>> out;
  for (auto& a : ops) {
    if (a->err) std::rethrow_exception(a->err);
    out.emplace_back(a->id, std::move(a->crcs));
  }
  return out;
}

std::shared_ptr<AsyncOp> Handle::find_pending(State& s, uint64_t id) {
  std::lock_guard<std::mutex> lk(s.mu);
  for (const auto& a : s.ops) {
    if (a->id == id) return a;
  }
  throw ArgError("operation " + std::to_string(id) +
                 " is not pending on this handle (unknown id, or collected already by wait()/wait_op())");
}

std::vector<uint32_t> Handle::wait_op(uint64_t id, double timeout_s) {
  State& s = state();
  std::shared_ptr<AsyncOp> a = find_pending(s, id);
  if (!a->wait_for(timeout_s)) {
    throw WaitTimeout("operation " + std::to_string(id) + " not finished within the timeout");
  }
  {
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = std::find(s.ops.begin(), s.ops.end(), a);
    if (it != s.ops.end()) s.ops.erase(it);
    s.uncollected.store(s.ops.size());
  }
  return a->result();
}

bool Handle::done(uint64_t id) { return find_pending(state(), id)->done.load(); }

std::vector<uint32_t> Handle::copy_ranges(const std::vector<std::array<uint64_t, 3>>& ranges, bool want_crc) {
  // Pieces of at most 4 MiB, each copied with its CRC in one pass (copy.hpp).
  constexpr uint64_t kPiece = 4u << 20;
  struct Piece {
    size_t range;
    uint64_t off, len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i][2] && (!ranges[i][0] || !ranges[i][1])) throw ArgError("copy_ranges: null pointer");
    for (uint64_t o = 0; o < ranges[i][2]; o += kPiece) {
      pieces.push_back({i, o, std::min(kPiece, ranges[i][2] - o), 0});
    }
  }
  ThreadPool& pool = state().pool;
  TaskGroup tasks;
  const size_t nt = std::max<size_t>(1, std::min<size_t>(pool.size(), pieces.size()));
  for (size_t t = 0; t < nt; ++t) {
    tasks.add();
    pool.submit([&, t] {
      for (size_t k = t; k < pieces.size(); k += nt) {
        Piece& p = pieces[k];
        char* dst = reinterpret_cast<char*>(ranges[p.range][0]) + p.off;
        const char* src = reinterpret_cast<const char*>(ranges[p.range][1]) + p.off;
        p.crc = copy_crc(dst, src, static_cast<size_t>(p.len), want_crc);
      }
      tasks.done();
    });
  }
  tasks.wait_all();
  std::vector<uint32_t> out(ranges.size(), 0);
  if (want_crc) {
    for (const Piece& p : pieces) out[p.range] = crc32_combine(out[p.range], p.crc, p.len);
  }
  return out;
}

std::vector<uint32_t> Handle::crc32_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  // Pieces of at most 4 MiB so large ranges spread over the threads too.
  constexpr uint64_t kPiece = 4u << 20;
  struct Piece {
    size_t range;
    uint64_t off, len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (uint64_t o = 0; o < ranges[i].second; o += kPiece) {
      pieces.push_back({i, o, std::min(kPiece, ranges[i].second - o), 0});
    }
  }
  ThreadPool& pool = state().pool;
  TaskGroup tasks;
  const size_t nt = std::max<size_t>(1, pool.size());
  for (size_t t = 0; t < nt; ++t) {
    tasks.add();
    pool.submit([&, t] {
      for (size_t k = t; k < pieces.size(); k += nt) {
        Piece& p = pieces[k];
        p.crc = crc32(0, reinterpret_cast<const char*>(ranges[p.range].first) + p.off, p.len);
      }
      tasks.done();
    });
  }
  tasks.wait_all();
  std::vector<uint32_t> out(ranges.size(), 0);
  for (const Piece& p : pieces) out[p.range] = crc32_combine(out[p.range], p.crc, p.len);
  return out;
}

size_t Handle::pending() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.ops.size() + s.orphaned;
}

void Handle::trim_buffers(size_t keep) { state().cache.trim(keep); }

std::string Handle::last_engine() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.last_engine;
}

// ---------------------------------------------------------------- pinned ----

PinnedBuffer::PinnedBuffer(size_t nbytes, size_t alignment, bool lock) : n_(nbytes), gen_(fork_generation()) {
  if (alignment < 64 || (alignment & (alignment - 1))) {
    throw ArgError("alignment must be a power of two >= 64");
  }
  cap_ = (std::max<size_t>(nbytes, 1) + alignment - 1) / alignment * alignment;
  if (cap_ >= kHugeMin && alignment <= kHuge) {
    // Large buffers: anonymous mmap at 2 MiB alignment with transparent huge
    // pages, so first touch (an O_DIRECT read landing in fresh memory) faults
    // and zeroes 2 MiB at a time instead of 4 KiB.
    cap_ = (cap_ + kHuge - 1) / kHuge * kHuge;
    map_len_ = cap_ + kHuge;
    void* m = ::mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    map_ = static_cast<char*>(m);
    uintptr_t a = (reinterpret_cast<uintptr_t>(map_) + kHuge - 1) / kHuge * kHuge;
    ptr_ = reinterpret_cast<char*>(a);
#ifdef MADV_HUGEPAGE
    ::madvise(ptr_, cap_, MADV_HUGEPAGE);
#endif
  } else {
    void* p = nullptr;
    if (::posix_memalign(&p, alignment, cap_) != 0) throw std::bad_alloc();
    ptr_ = static_cast<char*>(p);
  }
  if (lock) locked_ = ::mlock(ptr_, cap_) == 0;
}

PinnedBuffer::~PinnedBuffer() {
  // A forked child must not call CUDA for its parent's registration (fork.hpp);
  // mlock is not inherited by a child, munlock is then a harmless no-op.
  if (cuda_ && gen_ == fork_generation()) cuda_host_unregister(ptr_);
  if (locked_) ::munlock(ptr_, cap_);
  if (map_) {
    ::munmap(map_, map_len_);
  } else {
    std::free(ptr_);
  }
}

bool PinnedBuffer::cuda_register() {
  if (cuda_ && gen_ != fork_generation()) return false;  // the parent's registration, not usable here
  if (!cuda_) {
    cuda_ = cuda_host_register(ptr_, cap_);
    gen_ = fork_generation();
  }
  return cuda_;
}

}  // namespace fastpersist
