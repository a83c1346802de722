// Attention masks in global positions, shared by every kernel.
//
// Query at position pq sees key at pk iff  -left <= pk - pq <= right. Causal is right = 0;
// unbounded sides hold a large value (AttentionArgs::kUnbounded), so no arithmetic here overflows.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace ringflash::core {

enum class BlockKind { kEmpty, kPartial, kFull };

struct Mask {
  int64_t left;
  int64_t right;

  RINGFLASH_HOST_DEVICE bool visible(int64_t pq, int64_t pk) const {
    const int64_t d = pk - pq;
    return d >= -left && d <= right;
  }

  // Queries at positions [q_lo, q_hi) against keys at [k_lo, k_hi), both non-empty: does the
  // mask remove every pair (skip the tile), none (no per-element test), or some?
  RINGFLASH_HOST_DEVICE BlockKind classify(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi) const {
    const int64_t d_min = k_lo - (q_hi - 1);
    const int64_t d_max = (k_hi - 1) - q_lo;
    if (d_max < -left || d_min > right) return BlockKind::kEmpty;
    if (d_min >= -left && d_max <= right) return BlockKind::kFull;
    return BlockKind::kPartial;
  }

  // Keys visible to any query in [q_lo, q_hi), clipped to [k_lo, k_hi): [*first, *last).
  RINGFLASH_HOST_DEVICE void key_span(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int64_t* first,
                                      int64_t* last) const {
    int64_t lo = q_lo - left, hi = (q_hi - 1) + right + 1;
    lo = lo > k_lo ? lo : k_lo;
    hi = hi < k_hi ? hi : k_hi;
    *first = lo;
    *last = hi > lo ? hi : lo;
  }

  // Queries that see any key in [k_lo, k_hi), clipped to [q_lo, q_hi): [*first, *last).
  RINGFLASH_HOST_DEVICE void query_span(int64_t k_lo, int64_t k_hi, int64_t q_lo, int64_t q_hi, int64_t* first,
                                        int64_t* last) const {
    int64_t lo = k_lo - right, hi = (k_hi - 1) + left + 1;
    lo = lo > q_lo ? lo : q_lo;
    hi = hi < q_hi ? hi : q_hi;
    *first = lo;
    *last = hi > lo ? hi : lo;
  }
};

}  // namespace ringflash::core
