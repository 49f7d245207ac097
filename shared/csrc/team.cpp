// pdserve.engine._cpu_kernels: the kernel team, threads that share one call's output rows.
//
// A one-row decode step streams its weights from memory, and one thread keeps too few bytes in
// flight to read them at the memory's speed (about half of it, measured). A GEMM's output rows
// are independent, so the team splits them into parts: each part a contiguous range computed in
// the order and with the instructions one thread would (the result is the same bits whatever
// the number of threads, and whoever computes a part). The parts are claimed, not assigned: the
// caller and the threads started once (`set_team_threads`) each take the next part left until
// none is. A team thread that the OS has not run yet (another process on its core, or asleep
// between steps) leaves its share to the caller instead of making it wait; the caller waits
// only for parts a thread has begun. The threads spin briefly between calls of one step and
// sleep between steps.
#include "common.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace pdserve {
namespace {

// NOTE: a worker spins this long for the next call before it sleeps on the condition variable.
// The calls of one step come tens of microseconds apart, and a worker that sleeps has its parts
// taken by the caller. Spinning longer (200 us) kept a core from the gateway and the client on a
// 2-core host: served one-user ITL 34-42 ms against 25-29 ms at 20 us (docs/BENCHMARKS.md).
constexpr auto kSpin = std::chrono::microseconds(20);
// NOTE: parts per member of the team: a late member's share is left to the others in pieces.
constexpr int kPartsPerThread = 4;

thread_local bool in_team = false;

// A call's ticket: its generation (bits 24 and up), its number of parts (bits 12-23) and the
// next part to claim (bits 0-11). One atomic word, so a claim (compare-and-swap of next) can
// only succeed for the call it was read for.
constexpr uint64_t kIndexBits = 12;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
uint64_t generation_of(uint64_t ticket) { return ticket >> (2 * kIndexBits); }
int parts_of(uint64_t ticket) { return static_cast<int>((ticket >> kIndexBits) & kIndexMask); }
int next_of(uint64_t ticket) { return static_cast<int>(ticket & kIndexMask); }
uint64_t ticket_for(uint64_t generation, int parts) {
  return (generation << (2 * kIndexBits)) | (static_cast<uint64_t>(parts) << kIndexBits);
}

class Team {
 public:
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  int max_rows() const { return max_rows_.load(std::memory_order_relaxed); }
  void set_max_rows(int rows) { max_rows_.store(rows, std::memory_order_relaxed); }
  // Parts the team's threads (not the callers) computed since the process began (counted by
  // each call once it is whole).
  uint64_t shared_parts() const { return shared_parts_.load(std::memory_order_relaxed); }

  void resize(int threads) {
    std::lock_guard<std::mutex> busy(busy_);
    if (threads == size()) return;  // NOTE: its threads kept (a setting made again each round)
    if (!workers_.empty()) {
      stop_.store(true, std::memory_order_relaxed);
      publish(0);
      for (auto& worker : workers_) worker.join();
      workers_.clear();
      stop_.store(false, std::memory_order_relaxed);
    }
    // NOTE: a worker starts from the generation of now: a call made before its thread runs
    // is still one it takes.
    const uint64_t now = generation_of(ticket_.load(std::memory_order_acquire));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, now] { work(now); });
  }

  // In a child forked while the team had threads: the child has none of them, so their handles
  // are let go (never joined: that would wait forever) and the team is this thread alone.
  void forget_threads() {
    new std::vector<std::thread>(std::move(workers_));  // NOTE: leaked on purpose
    workers_.clear();
  }

  // Runs part(context, i, parts) for every i in [0, parts), some of them on the team's threads;
  // alone (parts 1) for a call of more than `max_rows` input rows, when the team is busy with
  // another caller's call, or from one of its own threads.
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
    const int parts = size() * kPartsPerThread;
    part_ = part;
    context_ = context;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = publish(parts);
    in_team = true;
    const int mine = take(generation);
    in_team = false;
    // NOTE: only parts a team thread claimed are left; it may have lost its core meanwhile.
    for (int polls = 1; done_.load(std::memory_order_acquire) != parts; ++polls) {
      _mm_pause();
      if (polls % 256 == 0) sched_yield();
    }
    shared_parts_.fetch_add(parts - mine, std::memory_order_relaxed);
  }

 private:
  // A new call of `parts` parts (0: none, the workers stop if asked to); its generation.
  uint64_t publish(int parts) {
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation = generation_of(ticket_.load(std::memory_order_relaxed)) + 1;
      ticket_.store(ticket_for(generation, parts), std::memory_order_release);
    }
    wake_.notify_all();
    return generation;
  }

  // Claims and computes the parts of call `generation` until none is left (or a later call has
  // begun); how many it computed. A claim's success means that call waits for the part: its
  // fields stay as they are.
  int take(uint64_t generation) {
    int taken = 0;
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (generation_of(ticket) == generation && next_of(ticket) < parts_of(ticket)) {
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      part_(context_, next_of(ticket), parts_of(ticket));
      ++taken;
      done_.fetch_add(1, std::memory_order_acq_rel);
      ticket = ticket_.load(std::memory_order_acquire);
    }
    return taken;
  }

  void work(uint64_t seen) {
    in_team = true;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int polls = 0;
      auto current = [&] { return generation_of(ticket_.load(std::memory_order_acquire)); };
      while (current() == seen) {
        _mm_pause();
        if (++polls % 64 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return current() != seen; });
        }
      }
      seen = current();
      if (stop_.load(std::memory_order_relaxed)) return;
      take(seen);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller of `run` (and by `resize`)
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> max_rows_{1};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> shared_parts_{0};
  PartFn part_ = nullptr;
  void* context_ = nullptr;
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
  return Py_BuildValue("iiK", team().size(), team().max_rows(),
                       static_cast<unsigned long long>(team().shared_parts()));
}

}  // namespace pdserve
