#include "thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

namespace ringflash::core {
namespace {

thread_local bool tls_inside_pool = false;

class ThreadPool {
 public:
  explicit ThreadPool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { loop(i + 1); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  void run(int64_t n, int num_threads, const std::function<void(int64_t, int)>& fn) {
    std::lock_guard<std::mutex> turn(submit_mutex_);  // one job at a time
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      helpers_ = num_threads - 1;
      active_ = helpers_;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop(int worker) {
    tls_inside_pool = true;
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        if (worker > helpers_) continue;  // this job wants fewer threads
      }
      work(worker);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  void work(int worker) {
    const bool was_inside = tls_inside_pool;
    tls_inside_pool = true;
    try {
      for (int64_t item = next_.fetch_add(1); item < n_; item = next_.fetch_add(1)) (*fn_)(item, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_);  // stop handing out items
    }
    tls_inside_pool = was_inside;
  }

  std::vector<std::thread> threads_;
  std::mutex submit_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int helpers_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool instance(hardware_threads() - 1);
  return instance;
}

}  // namespace

int hardware_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int resolve_threads(int requested) { return requested > 0 ? requested : hardware_threads(); }

void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  int threads = resolve_threads(num_threads);
  if (tls_inside_pool) threads = 1;
  if (threads > 1) {
    ThreadPool& p = pool();
    if (threads > p.workers() + 1) threads = p.workers() + 1;
    if (static_cast<int64_t>(threads) > n) threads = static_cast<int>(n);
    if (threads > 1) return p.run(n, threads, fn);
  }
  for (int64_t item = 0; item < n; ++item) fn(item, 0);
}

}  // namespace ringflash::core
