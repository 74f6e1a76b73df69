#include "fastpersist/handle.hpp"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#include "fastpersist/crc32.hpp"
#include "fastpersist/cuda_rt.hpp"
#include "fastpersist/error.hpp"

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
               bool direct, unsigned max_async, bool stage_reads)
    : pool_(std::max(threads, 1u)), cache_(round_chunk(chunk_size)) {
  if (engine != "auto" && engine != "aio" && engine != "psync" && engine != "cufile") {
    throw ArgError("engine must be 'auto', 'aio', 'psync' or 'cufile', not '" + engine + "'");
  }
  if (queue_depth == 0) throw ArgError("queue_depth must be >= 1");
  opt_.engine = std::move(engine);
  opt_.chunk_size = cache_.size();
  opt_.queue_depth = queue_depth;
  opt_.threads = std::max(threads, 1u);
  opt_.direct = direct;
  opt_.stage_reads = stage_reads;
  for (unsigned i = 0; i < std::max(max_async, 1u); ++i) workers_.emplace_back([this] { worker(); });
}

Handle::~Handle() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

std::vector<uint32_t> Handle::run(const OpSpec& op) {
  if (opt_.engine == "cufile") return run_cufile(op);
  File f = open_target(op.target, op.write, op.truncate, opt_.direct);
  ExecOptions o = opt_;
  o.fsync = op.fsync;
  o.preallocate = op.write && op.target.fd < 0;
  ExecResult r = op.write ? execute_write(f, op.extents, op.patches, op.nslots, o, pool_, cache_)
                          : execute_read(f, op.extents, op.nslots, o, pool_, cache_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    last_engine_ = r.engine;
  }
  return std::move(r.crcs);
}

std::vector<uint32_t> Handle::run_cufile(const OpSpec& op) {
  if (op.nslots > 0 || !op.patches.empty()) {
    throw ArgError("the cufile engine moves device memory directly: checksums and patches need host bytes");
  }
  File f = open_target(op.target, op.write, op.truncate, true);
  if (!f.direct()) throw IoError(EINVAL, "open(O_DIRECT) for cuFile", f.path(), 0, 0);
  for (const Extent& e : op.extents) {
    if (e.len) {
      cufile_transfer(f.dfd(), f.path(), op.write, reinterpret_cast<void*>(e.ptr), e.len, e.off,
                      opt_.chunk_size);
    }
  }
  if (op.write && op.fsync) f.sync();
  std::lock_guard<std::mutex> lk(mu_);
  last_engine_ = "cufile";
  return {};
}

uint64_t Handle::submit(OpSpec op) {
  auto a = std::make_shared<AsyncOp>();
  a->spec = std::move(op);
  {
    std::lock_guard<std::mutex> lk(mu_);
    a->id = next_id_++;
    ops_.push_back(a);
    queue_.push_back(a);
  }
  cv_work_.notify_one();
  return a->id;
}

void Handle::worker() {
  for (;;) {
    std::shared_ptr<AsyncOp> a;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      a = queue_.front();
      queue_.pop_front();
    }
    std::vector<uint32_t> crcs;
    std::exception_ptr err;
    try {
      crcs = run(a->spec);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      a->crcs = std::move(crcs);
      a->err = err;
      a->done = true;
    }
    cv_done_.notify_all();
  }
}

std::vector<std::pair<uint64_t, std::vector<uint32_t>>> Handle::wait() {
  std::vector<std::shared_ptr<AsyncOp>> ops;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] {
      return std::all_of(ops_.begin(), ops_.end(), [](const auto& a) { return a->done; });
    });
    ops.swap(ops_);
  }
  std::vector<std::pair<uint64_t, std::vector<uint32_t>>> out;
  for (auto& a : ops) {
    if (a->err) std::rethrow_exception(a->err);
    out.emplace_back(a->id, std::move(a->crcs));
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
  TaskGroup tasks;
  const size_t nt = std::max<size_t>(1, pool_.size());
  for (size_t t = 0; t < nt; ++t) {
    tasks.add();
    pool_.submit([&, t] {
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
  std::lock_guard<std::mutex> lk(mu_);
  return ops_.size();
}

std::string Handle::last_engine() {
  std::lock_guard<std::mutex> lk(mu_);
  return last_engine_;
}

// ---------------------------------------------------------------- pinned ----

PinnedBuffer::PinnedBuffer(size_t nbytes, size_t alignment, bool lock) : n_(nbytes) {
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
  if (cuda_) cuda_host_unregister(ptr_);
  if (locked_) ::munlock(ptr_, cap_);
  if (map_) {
    ::munmap(map_, map_len_);
  } else {
    std::free(ptr_);
  }
}

bool PinnedBuffer::cuda_register() {
  if (!cuda_) cuda_ = cuda_host_register(ptr_, cap_);
  return cuda_;
}

}  // namespace fastpersist
