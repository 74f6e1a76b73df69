// An I/O handle: engine settings, a worker pool, reusable staging buffers,
// and a queue of asynchronous operations. Fork-safe: see fork.hpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fastpersist/executor.hpp"
#include "fastpersist/fork.hpp"

namespace fastpersist {

struct Target {
  std::string path;  // used when fd < 0
  int fd = -1;
};

struct OpSpec {
  bool write = true;
  Target target;
  std::vector<Extent> extents;
  std::vector<Patch> patches;
  int nslots = 0;
  bool truncate = true;
  bool fsync = false;
};

class Handle {
 public:
  Handle(std::string engine, size_t chunk_size, unsigned queue_depth, unsigned threads,
         bool direct, unsigned max_async, bool stage_reads = false);
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  std::vector<uint32_t> run(const OpSpec& op);  // synchronous
  uint64_t submit(OpSpec op);                   // asynchronous
  std::vector<std::pair<uint64_t, std::vector<uint32_t>>> wait();
  size_t pending();
  // CRC-32 of each (ptr, len) host range, spread over the worker pool.
  std::vector<uint32_t> crc32_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

  const std::string& engine() const { return opt_.engine; }
  size_t chunk_size() const { return opt_.chunk_size; }
  unsigned queue_depth() const { return opt_.queue_depth; }
  unsigned threads() const { return opt_.threads; }
  bool direct() const { return opt_.direct; }
  bool stage_reads() const { return opt_.stage_reads; }
  std::string last_engine();

 private:
  struct AsyncOp {
    uint64_t id = 0;
    OpSpec spec;
    std::vector<uint32_t> crcs;
    std::exception_ptr err;
    bool done = false;
  };
  // Everything that belongs to one process: threads, locks, queues, staging
  // buffers. Built by the constructor, and again by the first use in a forked
  // child; the parent's copy is then leaked, never touched (fork.hpp).
  struct State {
    State(Handle* h, unsigned threads, size_t chunk_size, unsigned max_async, uint64_t gen);
    ~State();  // stops and joins the workers: only in the generation that built it
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    void worker();

    Handle* owner;
    const uint64_t gen;  // fork_generation() of the process that built it
    ThreadPool pool;
    BufferCache cache;
    std::mutex mu;
    std::condition_variable cv_work, cv_done;
    std::deque<std::shared_ptr<AsyncOp>> queue;   // not started
    std::vector<std::shared_ptr<AsyncOp>> ops;    // submitted, not collected
    std::atomic<size_t> uncollected{0};           // ops.size(), readable without mu after fork
    size_t orphaned = 0;  // ops a parent submitted and had not collected when it forked us
    uint64_t orphaned_pid = 0;
    bool stop = false;
    std::string last_engine = "none";
    std::vector<std::thread> workers;  // last member: started once the rest exists
  };
  // This process's State: rebuilt on the first call after a fork.
  State& state();
  std::vector<uint32_t> run_cufile(const OpSpec& op, State& s);

  ExecOptions opt_;
  unsigned max_async_;
  std::atomic<uint64_t> next_id_{1};  // unique across forks: a child's ids never repeat its parent's
  std::atomic<State*> st_{nullptr};
};

// Page-aligned host memory, mlock'ed when possible, optionally CUDA-registered.
class PinnedBuffer {
 public:
  PinnedBuffer(size_t nbytes, size_t alignment, bool lock);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* data() const { return ptr_; }
  size_t size() const { return n_; }
  bool locked() const { return locked_; }
  bool cuda_registered() const { return cuda_ && gen_ == fork_generation(); }
  bool cuda_register();

 private:
  static constexpr size_t kHuge = size_t(2) << 20;
  static constexpr size_t kHugeMin = size_t(4) << 20;
  char* ptr_ = nullptr;
  char* map_ = nullptr;  // mmap'ed region (large buffers), else posix_memalign
  size_t map_len_ = 0;
  size_t n_ = 0;
  size_t cap_ = 0;
  bool locked_ = false;
  bool cuda_ = false;
  uint64_t gen_ = 0;  // fork_generation() that allocated it (and registered it with CUDA)
};

}  // namespace fastpersist
