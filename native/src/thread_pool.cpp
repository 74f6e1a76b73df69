#include "fastpersist/thread_pool.hpp"

namespace fastpersist {

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) threads = 1;
  try {
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  } catch (...) {
    // A thread that cannot be created (EAGAIN: the process or system thread limit)
    // throws std::system_error; the threads already started must be stopped and joined
    // before workers_ is destroyed, or ~std::thread of a joinable thread calls
    // std::terminate ("terminate called without an active exception").
    stop_and_join();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace fastpersist
