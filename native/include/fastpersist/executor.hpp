// The gather-write / scatter-read executor: streams a list of memory extents
// to or from a byte range of a file through a ring of aligned staging
// buffers, with several I/Os in flight and the fills/copies spread over a
// thread pool. Aligned chunks go through O_DIRECT; only an unaligned head or
// tail goes through the page cache. See _native.pyi for the contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fastpersist/file.hpp"
#include "fastpersist/thread_pool.hpp"

namespace fastpersist {

struct Extent {
  uint64_t off = 0;
  uint64_t ptr = 0;  // host address; 0 = discard (reads only)
  uint64_t len = 0;
  int32_t slot = -1;
};

struct Patch {
  uint64_t off = 0;
  int32_t slot = 0;
  int32_t kind = 0;  // 0: u32 little-endian, 1: 8 lowercase hex chars
};

struct ExecOptions {
  std::string engine = "auto";  // auto | aio | psync
  size_t chunk_size = 8u << 20;
  unsigned queue_depth = 8;
  unsigned threads = 2;
  bool direct = true;
  bool fsync = false;
  bool preallocate = false;  // fallocate the written range first (writes to a path)
  // Reads: land every chunk in a staging buffer of the ring and copy it out, even
  // when it could go straight to its destination. On the reference VM (virtio
  // disk) loads ran 1.4-1.6x faster this way than with O_DIRECT straight into a
  // multi-GiB destination (docs/benchmarks.md, "Staged reads"). Only O_DIRECT
  // reads are staged: a buffered read is a copy out of the page cache already.
  bool stage_reads = false;
};

struct ExecResult {
  std::vector<uint32_t> crcs;
  std::string engine;  // what actually ran: aio | psync | psync-buffered
};

// Whether staging buffers allocated from now on (whole 2 MiB multiples, their own
// mapping) ask for transparent huge pages (MADV_HUGEPAGE; the default) or refuse them
// (MADV_NOHUGEPAGE: where a fresh huge page faults in on the host 4 KiB at a time,
// fastpersist/prefault.py). Process-wide; buffers already allocated keep their advice.
void set_staging_huge_pages(bool huge);
bool staging_huge_pages();

// Aligned staging buffers of one size, reused across operations.
class BufferCache {
 public:
  explicit BufferCache(size_t size) : size_(size) {}
  ~BufferCache();
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;
  char* acquire();
  void release(char* p);
  // Frees the idle buffers beyond the first ``keep`` (those in use come back to the cache later).
  void trim(size_t keep);
  size_t size() const { return size_; }

 private:
  size_t size_;
  std::mutex mu_;
  std::vector<char*> free_;
};

ExecResult execute_write(const File& f, const std::vector<Extent>& extents,
                         const std::vector<Patch>& patches, int nslots, const ExecOptions& opt,
                         ThreadPool& pool, BufferCache& cache);

ExecResult execute_read(const File& f, const std::vector<Extent>& extents, int nslots,
                        const ExecOptions& opt, ThreadPool& pool, BufferCache& cache);

}  // namespace fastpersist
