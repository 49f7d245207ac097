// pdserve.engine._cpu_kernels: the kernel team, threads that share one call's output rows.
//
// A one-row decode step streams its weights from memory, and one thread keeps too few bytes in
// flight to read them at the memory's speed (about half of it, measured). A GEMM's output rows
// are independent, so the team splits them: each thread computes a contiguous range, in the
// order and with the instructions one thread would (the result is the same bits whatever the
// number of threads). The caller computes the first range; the others run on threads started
// once (`set_team_threads`), which spin briefly between calls of one step and sleep between steps.
#include "common.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace pdserve {
namespace {

// NOTE: a worker spins this long for the next call before it sleeps on the condition variable:
// the calls of one step come tens of microseconds apart, the steps milliseconds apart.
constexpr auto kSpin = std::chrono::microseconds(200);

thread_local bool in_team = false;

class Team {
 public:
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  int max_rows() const { return max_rows_.load(std::memory_order_relaxed); }
  void set_max_rows(int rows) { max_rows_.store(rows, std::memory_order_relaxed); }

  void resize(int threads) {
    std::lock_guard<std::mutex> busy(busy_);
    if (threads == size()) return;  // NOTE: its threads kept (a setting made again each round)
    if (!workers_.empty()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
        generation_.fetch_add(1, std::memory_order_release);
      }
      wake_.notify_all();
      for (auto& worker : workers_) worker.join();
      workers_.clear();
      stop_ = false;
    }
    // NOTE: a worker starts from the generation of now: a call made before its thread runs
    // is still one it takes.
    const uint64_t now = generation_.load(std::memory_order_acquire);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i, now] { work(i, now); });
  }

  // In a child forked while the team had threads: the child has none of them, so their handles
  // are let go (never joined: that would wait forever) and the team is this thread alone.
  void forget_threads() {
    new std::vector<std::thread>(std::move(workers_));  // NOTE: leaked on purpose
    workers_.clear();
  }

  // Runs part(context, i, parts) for i in [0, parts) (0 on this thread); alone (parts 1) for a
  // call of more than `max_rows` input rows, when the team is busy with another caller's call,
  // or from one of its own threads.
  void run(PartFn part, void* context, int rows) {
    if (in_team || rows > max_rows()) {
      part(context, 0, 1);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty()) {
      part(context, 0, 1);
      return;
    }
    const int parts = size();
    parts_ = parts;
    part_ = part;
    context_ = context;
    remaining_.store(parts - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    in_team = true;
    part(context, 0, parts);
    in_team = false;
    while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  void work(int index, uint64_t seen) {
    in_team = true;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int polls = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++polls % 64 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      part_(context_, index, parts_);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller of `run` (and by `resize`)
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> max_rows_{1};
  PartFn part_ = nullptr;
  int parts_ = 1;
  void* context_ = nullptr;
  bool stop_ = false;
};

Team& team() {
  static Team* instance = [] {
    pthread_atfork(nullptr, nullptr, [] { team().forget_threads(); });
    return new Team();  // never destroyed: its threads may outlive the module
  }();
  return *instance;
}

}  // namespace

void team_run(PartFn part, void* context, int rows) { team().run(part, context, rows); }

PyObject* py_set_team_threads(PyObject*, PyObject* args) {
  int threads, max_rows;
  if (!PyArg_ParseTuple(args, "ii", &threads, &max_rows)) return nullptr;
  if (threads < 1 || threads > 64 || max_rows < 1) {
    PyErr_SetString(PyExc_ValueError, "threads must be between 1 and 64, max_rows at least 1");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  team().resize(threads);
  Py_END_ALLOW_THREADS
  team().set_max_rows(max_rows);
  Py_RETURN_NONE;
}

PyObject* py_team_threads(PyObject*, PyObject*) {
  return Py_BuildValue("ii", team().size(), team().max_rows());
}

}  // namespace pdserve
