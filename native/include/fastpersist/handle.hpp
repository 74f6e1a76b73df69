// An I/O handle: engine settings, a worker pool, reusable staging buffers,
// and a queue of asynchronous operations. Fork-safe: see fork.hpp.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
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

// Completion of one asynchronous operation, shared by the worker that runs it,
// the Handle's bookkeeping and any Future the caller holds. Self-contained
// (its own lock and condition variable), so a Future may outlive its Handle.
struct AsyncOp {
  uint64_t id = 0;
  uint64_t gen = 0;  // fork_generation() of the process that submitted it
  OpSpec spec;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  std::vector<uint32_t> crcs;  // valid once done
  std::exception_ptr err;      // valid once done

  // Wait until done; timeout_s < 0: no limit. Returns whether it is done.
  // Throws std::runtime_error for an op submitted before this process was
  // forked (it runs in the parent only and never completes here).
  bool wait_for(double timeout_s);
  // The result once done: the CRCs, or the op's own error rethrown.
  std::vector<uint32_t> result() const;
};

// What the caller holds for an op from Handle::submit_future: done(), wait(), result().
class Future {
 public:
  explicit Future(std::shared_ptr<AsyncOp> op) : op_(std::move(op)) {}
  uint64_t id() const { return op_->id; }
  bool done() const;
  bool wait(double timeout_s) { return op_->wait_for(timeout_s); }
  std::vector<uint32_t> result(double timeout_s);  // throws TimeoutError-like std::runtime_error on timeout

 private:
  std::shared_ptr<AsyncOp> op_;
};

// Raised by wait_op/Future::result when the timeout expires first.
struct WaitTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Handle {
 public:
  Handle(std::string engine, size_t chunk_size, unsigned queue_depth, unsigned threads,
         bool direct, unsigned max_async, bool stage_reads = false, std::string read_mode = "direct");
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  std::vector<uint32_t> run(const OpSpec& op);  // synchronous
  uint64_t submit(OpSpec op);                   // asynchronous, collected by wait() or wait_op()
  // Asynchronous, collected through the Future only: wait() and pending() don't see it,
  // so callers sharing one handle never collect each other's ops.
  Future submit_future(OpSpec op);
  std::vector<std::pair<uint64_t, std::vector<uint32_t>>> wait();
  // One op from submit(): wait for it (timeout_s < 0: no limit), forget it, return its
  // CRCs or rethrow its own error. WaitTimeout if not done in time (it stays pending);
  // ArgError if the id is not pending (unknown, or collected already).
  std::vector<uint32_t> wait_op(uint64_t id, double timeout_s);
  bool done(uint64_t id);  // ArgError if the id is not pending
  size_t pending();
  // Frees the idle staging buffers the reads and writes keep for their next operation,
  // all but ``keep`` of them (a handle kept idle in a pool then holds little of a past load).
  void trim_buffers(size_t keep);
  // Copy each (dst, src, len) host range and return the CRC-32 of each when
  // want_crc (else zeros), spread over the worker pool.
  std::vector<uint32_t> copy_ranges(const std::vector<std::array<uint64_t, 3>>& ranges, bool want_crc);
  // CRC-32 of each (ptr, len) host range, spread over the worker pool.
  std::vector<uint32_t> crc32_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

  const std::string& engine() const { return opt_.engine; }
  size_t chunk_size() const { return opt_.chunk_size; }
  unsigned queue_depth() const { return opt_.queue_depth; }
  unsigned threads() const { return opt_.threads; }
  bool direct() const { return opt_.direct; }
  bool stage_reads() const { return opt_.stage_reads; }
  // How the loaders built on this handle read a file: "direct" (O_DIRECT, staged
  // per stage_reads), "buffered" (through the page cache), or "auto" (they choose
  // per file from what they measured; fastpersist/io.py, plan_read). The handle
  // itself only carries the setting: its read()/submit_read() follow `direct`.
  const std::string& read_mode() const { return read_mode_; }
  std::string last_engine();

 private:
  // Everything that belongs to one process: threads, locks, queues, staging
  // buffers. Built by the constructor, and again by the first use in a forked
  // child; the parent's copy is then leaked, never touched (fork.hpp).
  struct State {
    State(Handle* h, unsigned threads, size_t chunk_size, unsigned max_async, uint64_t gen);
    ~State();  // stops and joins the workers: only in the generation that built it
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    void worker();
    void stop_and_join();

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
  std::shared_ptr<AsyncOp> enqueue(OpSpec op, bool tracked);
  std::shared_ptr<AsyncOp> find_pending(State& s, uint64_t id);

  ExecOptions opt_;
  std::string read_mode_;
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
