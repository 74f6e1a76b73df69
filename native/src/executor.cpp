#include "fastpersist/executor.hpp"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <new>

#include "fastpersist/copy.hpp"
#include "fastpersist/crc32.hpp"
#include "fastpersist/engine.hpp"
#include "fastpersist/error.hpp"
#include "fastpersist/sys.hpp"

namespace fastpersist {

namespace {

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
uint64_t align_down(uint64_t v, uint64_t a) { return v / a * a; }

char* alloc_aligned(size_t n) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, n ? align_up(n, 4096) : 4096) != 0) throw std::bad_alloc();
  return static_cast<char*>(p);
}

struct Piece {
  uint64_t off;
  uint64_t len;
  uint32_t crc;
  int32_t slot;
};

// nchunks: the op's transfers. The psync engine starts one thread per transfer it can
// have in flight (at most queue_depth): a 1 MiB load starts one thread, not sixteen,
// which on a busy machine cost more than the read itself.
std::unique_ptr<Engine> pick_engine(const ExecOptions& opt, bool direct, size_t nchunks, std::string& used) {
  std::string e = opt.engine;
  // auto: the thread pool. On the reference VM it matched or beat Linux AIO in every
  // interleaved comparison (loads by up to 1.2x): each pread/pwrite thread faults in
  // its own destination pages, where one io_submit thread faults them all in turn.
  if (e == "auto") e = "psync";
  if (e == "aio") {
    used = direct ? "aio" : "aio-buffered";
    return make_aio_engine(opt.queue_depth);
  }
  if (e == "psync") {
    used = direct ? "psync" : "psync-buffered";
    if (nchunks <= 1) return make_inline_engine();
    const size_t want = std::min<size_t>(std::max(opt.queue_depth, 1u), std::max<size_t>(nchunks, 1));
    return make_psync_engine(static_cast<unsigned>(want));
  }
  throw ArgError("unknown engine '" + opt.engine + "' (expected auto, aio or psync)");
}

void check_slots(const std::vector<Extent>& ext, int nslots) {
  if (nslots < 0) throw ArgError("nslots must be >= 0");
  for (const auto& e : ext) {
    if (e.slot < -1 || e.slot >= nslots) {
      throw ArgError("extent at offset " + std::to_string(e.off) + " has crc slot " +
                     std::to_string(e.slot) + " outside [-1, " + std::to_string(nslots) + ")");
    }
  }
}

void encode_patch(const Patch& p, uint32_t crc, unsigned char out[8], size_t& width) {
  if (p.kind == 0) {
    width = 4;
    for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>((crc >> (8 * i)) & 0xFF);
  } else {
    width = 8;
    static const char* hex = "0123456789abcdef";
    for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(hex[(crc >> (28 - 4 * i)) & 0xF]);
  }
}

// Index of the chunk holding byte `b` (chunks sorted by offset, contiguous per run).
template <class C>
size_t chunk_of(const std::vector<C>& chunks, uint64_t b) {
  auto it = std::upper_bound(chunks.begin(), chunks.end(), b,
                             [](uint64_t v, const C& c) { return v < c.off; });
  return static_cast<size_t>(it - chunks.begin()) - 1;
}

}  // namespace

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
bool huge_backed(size_t n) { return n % kHugePage == 0; }
std::atomic<bool> g_staging_huge{true};  // set_staging_huge_pages

// Staging buffers that are whole 2 MiB multiples come from mmap with
// transparent huge pages: the kernel pins them for O_DIRECT 512 times
// cheaper than 4 KiB pages.
char* alloc_staging(size_t n) {
  if (!huge_backed(n)) return alloc_aligned(n);
  void* m = ::mmap(nullptr, n + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  uintptr_t base = reinterpret_cast<uintptr_t>(m);
  uintptr_t a = (base + kHugePage - 1) / kHugePage * kHugePage;
  // Return the unaligned head and tail to the kernel so only [a, a+n) stays mapped.
  if (a > base) ::munmap(m, a - base);
  if (base + n + kHugePage > a + n) ::munmap(reinterpret_cast<void*>(a + n), base + n + kHugePage - (a + n));
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  ::madvise(reinterpret_cast<void*>(a), n, g_staging_huge.load(std::memory_order_relaxed) ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
  return reinterpret_cast<char*>(a);
}

void free_staging(char* p, size_t n) {
  if (!p) return;
  if (huge_backed(n)) {
    ::munmap(p, n);
  } else {
    std::free(p);
  }
}
}  // namespace

void set_staging_huge_pages(bool huge) { g_staging_huge.store(huge); }
bool staging_huge_pages() { return g_staging_huge.load(); }

BufferCache::~BufferCache() {
  for (char* p : free_) free_staging(p, size_);
}

char* BufferCache::acquire() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      return p;
    }
  }
  return alloc_staging(size_);
}

void BufferCache::trim(size_t keep) {
  std::lock_guard<std::mutex> lk(mu_);
  while (free_.size() > keep) {
    free_staging(free_.back(), size_);
    free_.pop_back();
  }
}

void BufferCache::release(char* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.size() < 64) {
    free_.push_back(p);
  } else {
    free_staging(p, size_);
  }
}

// ---------------------------------------------------------------- write ----

namespace {

struct WChunk {
  uint64_t off = 0;
  size_t len = 0;
  bool direct = false;
  size_t ext_begin = 0;
  bool zero_copy = false;
  std::vector<size_t> patches;
  char* data = nullptr;
  char* ring = nullptr;
  char* held = nullptr;
  bool filled = false;
  std::vector<Piece> pieces;
};

// Stores the CRCs the patches of chunk `c` ask for into its bytes at `data` (the chunk's
// copy in a staging buffer).
void apply_patches(const WChunk& c, char* data, const std::vector<Patch>& patches, const std::vector<uint32_t>& crc) {
  for (size_t pi : c.patches) {
    const Patch& p = patches[pi];
    unsigned char bytes[8];
    size_t w = 0;
    encode_patch(p, crc[p.slot], bytes, w);
    uint64_t lo = std::max(p.off, c.off), hi = std::min(p.off + w, c.off + c.len);
    for (uint64_t x = lo; x < hi; ++x) data[x - c.off] = static_cast<char>(bytes[x - p.off]);
  }
}

// Writes of at most this many bytes run on the calling thread, chunk after chunk through
// one staging buffer: no engine threads started, no hand-off to the pool (on a busy
// machine each hand-off waits for a core), no staging buffer beyond the one a pooled
// handle keeps. What the ring's overlap of copies and writes would gain at these sizes
// is less than that (docs/benchmarks.md, "Small saves").
constexpr uint64_t kInlineWriteMax = uint64_t(32) << 20;

bool inline_write(const ExecOptions& opt, size_t nchunks, uint64_t S, uint64_t E) {
  return nchunks >= 2 && E - S <= kInlineWriteMax && (opt.engine == "auto" || opt.engine == "psync");
}

// The inline write: the CRC of every slot first (a pass over the source, far cheaper than
// the copy), so that every patch is known before any chunk is written and no chunk is held
// back; then each chunk in file order, straight from the caller's memory when it can be
// (zero_copy), else copied into the one staging buffer with its patches applied; its
// aligned chunks with O_DIRECT, the unaligned head and tail through the page cache.
void write_inline(const File& f, std::vector<WChunk>& chunks, const std::vector<Extent>& extents,
                  const std::vector<Patch>& patches, size_t a, BufferCache& cache, std::vector<uint32_t>& crc) {
  for (const Extent& e : extents) {
    if (e.slot >= 0 && e.len) {
      crc[e.slot] = crc32_combine(crc[e.slot], crc32(0, reinterpret_cast<const char*>(e.ptr), e.len), e.len);
    }
  }
  struct Lease {
    BufferCache& cache;
    char* p = nullptr;
    ~Lease() { cache.release(p); }
  } lease{cache};
  for (WChunk& c : chunks) {
    const char* data = c.data;
    if (!c.zero_copy) {
      if (!lease.p) lease.p = cache.acquire();
      char* buf = lease.p;
      for (size_t k = c.ext_begin; k < extents.size() && extents[k].off < c.off + c.len; ++k) {
        const Extent& e = extents[k];
        uint64_t lo = std::max(e.off, c.off), hi = std::min(e.off + e.len, c.off + c.len);
        if (lo < hi) copy_crc(buf + (lo - c.off), reinterpret_cast<const char*>(e.ptr) + (lo - e.off), hi - lo, false);
      }
      apply_patches(c, buf, patches, crc);
      data = buf;
    }
    size_t done = 0;
    int r = sys::full_pwrite(f.fd(), c.direct ? f.dfd() : -1, c.direct ? a : 1, data, c.len, c.off, &done);
    if (r < 0) throw IoError(-r, "pwrite", f.path(), c.off + done, c.len - done);
  }
}

}  // namespace

ExecResult execute_write(const File& f, const std::vector<Extent>& extents,
                         const std::vector<Patch>& patches, int nslots, const ExecOptions& opt,
                         ThreadPool& pool, BufferCache& cache) {
  ExecResult result;
  result.crcs.assign(static_cast<size_t>(nslots), 0);
  check_slots(extents, nslots);
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].off != extents[i - 1].off + extents[i - 1].len) {
      throw ArgError("write extents must be sorted and contiguous: extent " + std::to_string(i) +
                     " starts at " + std::to_string(extents[i].off) + ", previous ends at " +
                     std::to_string(extents[i - 1].off + extents[i - 1].len));
    }
  }
  for (const auto& e : extents) {
    if (e.len && !e.ptr) throw ArgError("write extent at offset " + std::to_string(e.off) + " has a null pointer");
  }
  const uint64_t S = extents.empty() ? 0 : extents.front().off;
  const uint64_t E = extents.empty() ? 0 : extents.back().off + extents.back().len;
  for (const auto& p : patches) {
    size_t w = p.kind == 0 ? 4 : 8;
    if (p.kind != 0 && p.kind != 1) throw ArgError("patch kind must be 0 (u32le) or 1 (hex8)");
    if (p.slot < 0 || p.slot >= nslots) throw ArgError("patch slot " + std::to_string(p.slot) + " out of range");
    if (p.off < S || p.off + w > E) {
      throw ArgError("patch at offset " + std::to_string(p.off) + " lies outside the written range [" +
                     std::to_string(S) + ", " + std::to_string(E) + ")");
    }
  }

  const bool direct = opt.direct && f.direct();
  const size_t a = direct ? f.align() : 1;
  const size_t cs = cache.size();
  if (cs % a) {
    throw ArgError("chunk_size " + std::to_string(cs) + " is not a multiple of the device alignment " +
                   std::to_string(a) + " of '" + f.path() + "'");
  }

  // Plan the chunks: buffered unaligned head, aligned O_DIRECT middle, buffered tail.
  std::vector<WChunk> chunks;
  auto add = [&](uint64_t lo, uint64_t hi, bool d) {
    for (uint64_t o = lo; o < hi; o += cs) {
      WChunk c;
      c.off = o;
      c.len = static_cast<size_t>(std::min<uint64_t>(cs, hi - o));
      c.direct = d;
      chunks.push_back(std::move(c));
    }
  };
  if (E > S) {
    if (direct) {
      uint64_t m0 = align_up(S, a), m1 = align_down(E, a);
      if (m0 >= m1) {
        add(S, E, false);
      } else {
        if (S < m0) add(S, m0, false);
        add(m0, m1, true);
        if (m1 < E) add(m1, E, false);
      }
    } else {
      add(S, E, false);
    }
  }
  const size_t n = chunks.size();
  {
    size_t k = 0;
    for (auto& c : chunks) {
      while (k < extents.size() && extents[k].off + extents[k].len <= c.off) ++k;
      c.ext_begin = k;
    }
  }
  for (size_t i = 0; i < patches.size(); ++i) {
    size_t w = patches[i].kind == 0 ? 4 : 8;
    size_t c0 = chunk_of(chunks, patches[i].off), c1 = chunk_of(chunks, patches[i].off + w - 1);
    for (size_t c = c0; c <= c1; ++c) chunks[c].patches.push_back(i);
  }
  std::vector<long> slot_last(static_cast<size_t>(nslots), -1);
  for (const auto& e : extents) {
    if (e.slot >= 0 && e.len) {
      long c = static_cast<long>(chunk_of(chunks, e.off + e.len - 1));
      slot_last[e.slot] = std::max(slot_last[e.slot], c);
    }
  }
  for (auto& c : chunks) {
    const Extent& e = extents[c.ext_begin];
    if (c.patches.empty() && e.off <= c.off && c.off + c.len <= e.off + e.len) {
      uintptr_t src = static_cast<uintptr_t>(e.ptr + (c.off - e.off));
      c.zero_copy = !c.direct || sys::aligned(src, a);
      if (c.zero_copy) c.data = reinterpret_cast<char*>(src);
    }
  }

  if (opt.preallocate && E > S) {
    // Reserve the written range up front: ENOSPC before any byte is written, and
    // one allocation for the range instead of one per concurrent O_DIRECT write.
    // Without it, the threads' writes allocated blocks in completion order and a
    // streamed 2 GiB checkpoint came out as ~90 extents in scrambled physical
    // order, so the load's "sequential" read was not sequential on the device.
    int r = ::fallocate(f.fd(), 0, static_cast<off_t>(S), static_cast<off_t>(E - S));
    if (r != 0 && errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) {
      throw IoError(errno, "fallocate", f.path(), S, E - S);
    }
  }

  if (inline_write(opt, n, S, E)) {
    result.engine = direct ? "psync" : "psync-buffered";
    write_inline(f, chunks, extents, patches, a, cache, result.crcs);
    if (opt.fsync) f.sync();
    return result;
  }

  std::string used;
  std::unique_ptr<Engine> engine = n ? pick_engine(opt, direct, n, used) : nullptr;
  result.engine = n ? used : "none";

  std::mutex mu;
  std::condition_variable cv;
  TaskGroup tasks;
  std::exception_ptr err;
  const size_t K = std::max(opt.queue_depth, 1u);
  size_t next_fill = 0, next_ready = 0, completed = 0, inflight = 0;
  std::deque<size_t> held;
  std::vector<uint32_t>& crc = result.crcs;
  std::vector<IoDone> dones;

  auto fill = [&](size_t ci) {
    WChunk& c = chunks[ci];
    std::vector<Piece> pieces;
    try {
      if (c.zero_copy) {
        const Extent& e = extents[c.ext_begin];
        if (e.slot >= 0) pieces.push_back({c.off, c.len, crc32(0, c.data, c.len), e.slot});
      } else {
        for (size_t k = c.ext_begin; k < extents.size() && extents[k].off < c.off + c.len; ++k) {
          const Extent& e = extents[k];
          uint64_t lo = std::max(e.off, c.off), hi = std::min(e.off + e.len, c.off + c.len);
          if (lo >= hi) continue;
          char* dst = c.ring + (lo - c.off);
          uint32_t piece_crc =
              copy_crc(dst, reinterpret_cast<const char*>(e.ptr) + (lo - e.off), hi - lo, e.slot >= 0);
          if (e.slot >= 0) pieces.push_back({lo, hi - lo, piece_crc, e.slot});
        }
        c.data = c.ring;
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu);
      if (!err) err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      c.pieces = std::move(pieces);
      c.filled = true;
    }
    cv.notify_all();
  };

  auto slot_done = [&](int32_t s) { return slot_last[s] < static_cast<long>(next_ready); };
  auto patches_ready = [&](const WChunk& c) {
    for (size_t pi : c.patches) {
      if (!slot_done(patches[pi].slot)) return false;
    }
    return true;
  };
  auto apply_and_submit = [&](size_t ci) {
    WChunk& c = chunks[ci];
    apply_patches(c, c.data, patches, crc);
    IoReq r;
    r.fd = c.direct ? f.dfd() : f.fd();
    r.fallback_fd = f.fd();
    r.align = c.direct ? a : 1;
    r.buf = c.data;
    r.len = c.len;
    r.off = c.off;
    r.write = true;
    r.tag = ci;
    engine->submit(r);
    ++inflight;
  };
  auto on_done = [&](const IoDone& d) {
    WChunk& c = chunks[d.tag];
    --inflight;
    ++completed;
    if (d.res < 0 || static_cast<size_t>(d.res) != c.len) {
      int e = d.res < 0 ? static_cast<int>(-d.res) : EIO;
      // `err` is shared with the fill tasks on the pool: only under `mu`.
      std::lock_guard<std::mutex> lk(mu);
      if (!err) {
        err = std::make_exception_ptr(
            IoError(e, "pwrite", f.path(), d.err_off, c.len - (d.err_off - c.off)));
      }
    }
    cache.release(c.ring);
    c.ring = nullptr;
    std::free(c.held);
    c.held = nullptr;
  };
  auto reap = [&](size_t min_nr) {
    dones.clear();
    engine->reap(dones, min_nr);
    for (const auto& d : dones) on_done(d);
  };

  try {
    while (true) {
      bool failed;
      {
        std::lock_guard<std::mutex> lk(mu);
        failed = static_cast<bool>(err);
      }
      while (!failed && next_fill < n && next_fill - completed - held.size() < K) {
        WChunk& c = chunks[next_fill];
        size_t ci = next_fill++;
        if (!c.zero_copy) c.ring = cache.acquire();
        if (c.zero_copy && extents[c.ext_begin].slot < 0) {
          c.filled = true;  // nothing to copy or checksum
          continue;
        }
        if (n == 1) {  // one chunk: nothing to overlap, no handoff to the pool
          fill(ci);
          continue;
        }
        tasks.add();
        pool.submit([&, ci] {
          fill(ci);
          tasks.done();
        });
      }
      if (!failed && next_ready < next_fill) {
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return chunks[next_ready].filled; });
          if (err) continue;
        }
        WChunk& c = chunks[next_ready];
        for (const Piece& p : c.pieces) crc[p.slot] = crc32_combine(crc[p.slot], p.crc, p.len);
        c.pieces.clear();
        size_t ci = next_ready++;
        if (patches_ready(c)) {
          apply_and_submit(ci);
        } else {
          // Keep it aside (own copy) so the ring keeps moving.
          c.held = alloc_aligned(c.len);
          std::memcpy(c.held, c.data, c.len);
          cache.release(c.ring);
          c.ring = nullptr;
          c.data = c.held;
          held.push_back(ci);
        }
        for (auto it = held.begin(); it != held.end();) {
          if (patches_ready(chunks[*it])) {
            apply_and_submit(*it);
            it = held.erase(it);
          } else {
            ++it;
          }
        }
        if (inflight) reap(0);
        continue;
      }
      if (inflight) {
        reap(1);
        continue;
      }
      break;
    }
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu);
    if (!err) err = std::current_exception();
  }
  // Always: let fills finish and I/O drain before any buffer goes away.
  tasks.wait_all();
  try {
    while (inflight) reap(1);
  } catch (...) {
  }
  for (auto& c : chunks) {
    cache.release(c.ring);
    std::free(c.held);
    c.ring = c.held = nullptr;
  }
  {
    // No fill task runs any more (wait_all above), but read `err` under `mu`
    // like everywhere else so the rule needs no exception.
    std::unique_lock<std::mutex> lk(mu);
    if (err) std::rethrow_exception(err);
  }
  if (opt.fsync) f.sync();
  return result;
}

// ----------------------------------------------------------------- read ----

namespace {

struct RChunk {
  uint64_t off = 0;
  size_t len = 0;
  uint64_t need_end = 0;
  size_t ext_begin = 0;
  bool zero_copy = false;
  char* ring = nullptr;
};

constexpr uint64_t kMaxGap = 1u << 20;  // read through gaps up to this size

// Whether [lo, hi) is covered, without gaps, by extents starting at index k
// whose memory is one contiguous range (ptr - off constant): then the file
// bytes can land directly in the destination, even across extent (record)
// boundaries.
bool maps_contiguously(const std::vector<Extent>& ext, size_t k, uint64_t lo, uint64_t hi) {
  if (k >= ext.size() || ext[k].off > lo || !ext[k].ptr) return false;
  const uint64_t delta = ext[k].ptr - ext[k].off;
  uint64_t covered = ext[k].off + ext[k].len;
  for (size_t i = k + 1; covered < hi; ++i) {
    if (i >= ext.size() || ext[i].off != covered || !ext[i].ptr || ext[i].ptr - ext[i].off != delta) return false;
    covered += ext[i].len;
  }
  return true;
}

}  // namespace

ExecResult execute_read(const File& f, const std::vector<Extent>& extents, int nslots,
                        const ExecOptions& opt, ThreadPool& pool, BufferCache& cache) {
  ExecResult result;
  result.crcs.assign(static_cast<size_t>(nslots), 0);
  check_slots(extents, nslots);
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].off < extents[i - 1].off + extents[i - 1].len) {
      throw ArgError("read extents must be sorted and must not overlap (extent " + std::to_string(i) +
                     " at offset " + std::to_string(extents[i].off) + ")");
    }
  }
  const bool direct = opt.direct && f.direct();
  const size_t a = direct ? f.align() : 1;
  const size_t cs = cache.size();
  if (cs % a) throw ArgError("chunk_size is not a multiple of the device alignment of '" + f.path() + "'");

  std::vector<RChunk> chunks;
  size_t i = 0;
  while (i < extents.size()) {
    if (extents[i].len == 0) {
      ++i;
      continue;
    }
    uint64_t rs = extents[i].off, re = extents[i].off + extents[i].len;
    size_t j = i + 1;
    while (j < extents.size() && (extents[j].len == 0 || extents[j].off - re <= kMaxGap)) {
      if (extents[j].len) re = extents[j].off + extents[j].len;
      ++j;
    }
    uint64_t lo = direct ? align_down(rs, a) : rs, hi = direct ? align_up(re, a) : re;
    size_t k = i;
    for (uint64_t o = lo; o < hi; o += cs) {
      RChunk c;
      c.off = o;
      c.len = static_cast<size_t>(std::min<uint64_t>(cs, hi - o));
      c.need_end = std::min<uint64_t>(o + c.len, re);
      while (k < j && extents[k].off + extents[k].len <= o) ++k;
      c.ext_begin = k;
      c.zero_copy = !(opt.stage_reads && direct) && maps_contiguously(extents, k, o, o + c.len) &&
                    sys::aligned(extents[k].ptr + (o - extents[k].off), a);
      chunks.push_back(c);
    }
    i = j;
  }
  const size_t n = chunks.size();
  std::string used;
  std::unique_ptr<Engine> engine = n ? pick_engine(opt, direct, n, used) : nullptr;
  result.engine = n ? used : "none";

  std::mutex mu;
  std::condition_variable cv;
  TaskGroup tasks;
  std::exception_ptr err;
  std::vector<Piece> pieces;
  const size_t K = std::max(opt.queue_depth, 1u);
  size_t next = 0, inflight = 0, active = 0;
  std::vector<IoDone> dones;

  auto scatter = [&](size_t ci) {
    RChunk& c = chunks[ci];
    std::vector<Piece> local;
    for (size_t k = c.ext_begin; k < extents.size() && extents[k].off < c.off + c.len; ++k) {
      const Extent& e = extents[k];
      uint64_t lo = std::max(e.off, c.off), hi = std::min(e.off + e.len, c.off + c.len);
      if (lo >= hi) continue;
      const char* src = c.zero_copy ? reinterpret_cast<const char*>(e.ptr) + (lo - e.off)
                                    : c.ring + (lo - c.off);
      if (!c.zero_copy && e.ptr) {
        // Copy out and checksum in one pass over memory (copy.hpp).
        char* dst = reinterpret_cast<char*>(e.ptr) + (lo - e.off);
        uint32_t crc = copy_crc(dst, src, static_cast<size_t>(hi - lo), e.slot >= 0);
        if (e.slot >= 0) local.push_back({lo, hi - lo, crc, e.slot});
        continue;
      }
      if (e.slot >= 0) local.push_back({lo, hi - lo, crc32(0, src, hi - lo), e.slot});
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      pieces.insert(pieces.end(), local.begin(), local.end());
      if (!c.zero_copy) {  // a zero-copy chunk gave its I/O slot back when its read completed
        cache.release(c.ring);
        c.ring = nullptr;
        --active;
      }
    }
    cv.notify_all();
  };

  auto on_done = [&](const IoDone& d) {
    RChunk& c = chunks[d.tag];
    --inflight;
    bool bad = false;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (d.res < 0) {
        if (!err) {
          err = std::make_exception_ptr(
              IoError(static_cast<int>(-d.res), "pread", f.path(), d.err_off, c.len - (d.err_off - c.off)));
        }
        bad = true;
      } else if (c.off + static_cast<uint64_t>(d.res) < c.need_end) {
        if (!err) err = std::make_exception_ptr(EofError(f.path(), c.off + d.res, c.need_end));
        bad = true;
      }
      if (bad || err) {
        cache.release(c.ring);
        c.ring = nullptr;
        --active;
        return;
      }
      // The bytes of a zero-copy chunk are in their destination: its I/O slot is free
      // now, so the next read goes out while the pool checksums this one. (Holding the
      // slot until the CRC was done kept fewer reads in flight than the queue depth.)
      if (c.zero_copy) --active;
    }
    if (n == 1) {  // one chunk: nothing to overlap, no handoff to the pool
      scatter(d.tag);
      return;
    }
    tasks.add();
    pool.submit([&, ci = d.tag] {
      scatter(ci);
      tasks.done();
    });
  };

  try {
    while (true) {
      bool failed;
      {
        std::lock_guard<std::mutex> lk(mu);
        failed = static_cast<bool>(err);
      }
      bool submitted = false;
      while (!failed && next < n) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (active >= K) break;
          ++active;
        }
        RChunk& c = chunks[next];
        const Extent& e = extents[c.ext_begin];
        if (!c.zero_copy) c.ring = cache.acquire();
        IoReq r;
        r.fd = direct ? f.dfd() : f.fd();
        r.fallback_fd = f.fd();
        r.align = a;
        r.buf = c.zero_copy ? reinterpret_cast<char*>(e.ptr) + (c.off - e.off) : c.ring;
        r.len = c.len;
        r.off = c.off;
        r.write = false;
        r.tag = next++;
        engine->submit(r);
        ++inflight;
        submitted = true;
      }
      if (inflight) {
        dones.clear();
        engine->reap(dones, submitted ? 0 : 1);
        for (const auto& d : dones) on_done(d);
        continue;
      }
      std::unique_lock<std::mutex> lk(mu);
      if (active == 0 && (next == n || err)) break;
      if (next < n && !err && active < K) continue;
      const size_t before = active;
      cv.wait(lk, [&] { return active < before; });
    }
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu);
    if (!err) err = std::current_exception();
  }
  tasks.wait_all();
  try {
    while (inflight) {
      dones.clear();
      engine->reap(dones, 1);
      for (const auto& d : dones) {
        --inflight;
        cache.release(chunks[d.tag].ring);
        chunks[d.tag].ring = nullptr;
      }
    }
  } catch (...) {
  }
  tasks.wait_all();
  for (auto& c : chunks) cache.release(c.ring);
  {
    std::unique_lock<std::mutex> lk(mu);  // see execute_write: `err` only under `mu`
    if (err) std::rethrow_exception(err);
  }

  std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
    return x.slot != y.slot ? x.slot < y.slot : x.off < y.off;
  });
  for (const Piece& p : pieces) {
    result.crcs[p.slot] = crc32_combine(result.crcs[p.slot], p.crc, p.len);
  }
  return result;
}

}  // namespace fastpersist
