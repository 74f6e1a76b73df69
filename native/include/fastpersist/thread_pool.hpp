// A fixed pool of worker threads running small tasks (buffer fills, copies, CRCs).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fastpersist {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  // Tasks must not throw (wrap their bodies); the pool never loses a task.
  void submit(std::function<void()> task);
  unsigned size() const { return static_cast<unsigned>(workers_.size()); }

 private:
  void run();
  void stop_and_join();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// Counts outstanding tasks of one operation so it can wait for all of them
// (also on error paths, before its buffers go away).
class TaskGroup {
 public:
  void add() {
    std::lock_guard<std::mutex> lk(mu_);
    ++pending_;
  }
  void done() {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_;
    cv_.notify_all();
  }
  void wait_all() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return pending_ == 0; });
  }
  size_t pending() {
    std::lock_guard<std::mutex> lk(mu_);
    return pending_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 0;
};

}  // namespace fastpersist
