// A small persistent thread pool for the CPU kernels.
#pragma once

#include <cstdint>
#include <functional>

namespace ringflash::core {

// Cores this process may use.
int hardware_threads();
// `requested` threads, or every core when it is 0 or less.
int resolve_threads(int requested);

// Runs fn(item, worker) for every item in [0, n) on up to `num_threads` threads, the caller's
// included. Items are handed out in order, one at a time, so expensive items should come first.
// `worker` is in [0, num_threads) and unique among the threads running at once, so it can index
// per-thread scratch. The first exception thrown by fn is rethrown here after all threads stop.
// Calls from inside fn run inline; concurrent calls from different threads take turns.
void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t item, int worker)>& fn);

}  // namespace ringflash::core
