// psync engine: worker threads running the retrying transfer loops.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "fastpersist/engine.hpp"
#include "fastpersist/sys.hpp"

namespace fastpersist {

namespace {

IoDone transfer(const IoReq& r);

class PsyncEngine final : public Engine {
 public:
  explicit PsyncEngine(unsigned threads) {
    if (threads == 0) threads = 1;
    try {
      for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
    } catch (...) {  // no thread left joinable when workers_ goes (thread_pool.cpp)
      stop_and_join();
      throw;
    }
  }
  ~PsyncEngine() override { stop_and_join(); }
  const char* name() const override { return "psync"; }

  void submit(const IoReq& r) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(r);
      ++in_flight_;
    }
    cv_work_.notify_one();
  }

  size_t reap(std::vector<IoDone>& out, size_t min_nr) override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return done_.size() >= min_nr || in_flight_ == 0; });
    size_t n = done_.size();
    for (auto& d : done_) out.push_back(d);
    done_.clear();
    return n;
  }

  size_t in_flight() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return in_flight_;
  }

 private:
  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }
  void run() {
    for (;;) {
      IoReq r;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        r = queue_.front();
        queue_.pop_front();
      }
      IoDone d = transfer(r);
      {
        std::lock_guard<std::mutex> lk(mu_);
        done_.push_back(d);
        --in_flight_;
      }
      cv_done_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<IoReq> queue_;
  std::vector<IoDone> done_;
  size_t in_flight_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

IoDone transfer(const IoReq& r) {
  IoDone d;
  d.tag = r.tag;
  size_t done = 0;
  int dfd = r.align > 1 ? r.fd : -1;
  int bfd = r.align > 1 ? (r.fallback_fd >= 0 ? r.fallback_fd : r.fd) : r.fd;
  int rc = r.write ? sys::full_pwrite(bfd, dfd, r.align, r.buf, r.len, r.off, &done)
                   : sys::full_pread(bfd, dfd, r.align, r.buf, r.len, r.off, &done);
  d.res = rc < 0 ? rc : static_cast<int64_t>(done);
  d.err_off = r.off + done;
  return d;
}

class InlineEngine final : public Engine {
 public:
  const char* name() const override { return "psync"; }
  void submit(const IoReq& r) override { done_.push_back(transfer(r)); }
  size_t reap(std::vector<IoDone>& out, size_t /*min_nr*/) override {
    size_t n = done_.size();
    for (auto& d : done_) out.push_back(d);
    done_.clear();
    return n;
  }
  size_t in_flight() const override { return 0; }

 private:
  std::vector<IoDone> done_;
};

}  // namespace

std::unique_ptr<Engine> make_inline_engine() { return std::make_unique<InlineEngine>(); }

std::unique_ptr<Engine> make_psync_engine(unsigned threads) {
  return std::make_unique<PsyncEngine>(threads);
}

}  // namespace fastpersist
