// Merging two partial attention results over disjoint key sets.
//
// A partial result over a key set K is (o, lse): o is softmax-normalised over K and
// lse = log(sum over K of exp(s)). For disjoint key sets A and B,
//   lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b.
// This header is the single place that formula lives: the CPU kernel, the CUDA kernel, the
// strategies and the tests all use it.
#pragma once

#include <cmath>
#include <limits>

#include "host_device.h"

namespace ringflash::core {

struct MergeWeights {
  float lse;    // log-sum-exp over both key sets
  float w_acc;  // weight of the accumulated output
  float w_blk;  // weight of the block's output
};

// Weights to merge a block (lse_blk) into an accumulator (lse_acc). An empty side has
// lse = -inf and weight 0; when both are empty the result stays empty (lse = -inf, weights 0)
// rather than NaN, which a naive exp(-inf - -inf) would give.
RINGFLASH_HOST_DEVICE MergeWeights merge_weights(float lse_acc, float lse_blk) {
  const float hi = lse_acc > lse_blk ? lse_acc : lse_blk;
  if (hi == -std::numeric_limits<float>::infinity()) return {hi, 0.0f, 0.0f};
  const float lo = lse_acc > lse_blk ? lse_blk : lse_acc;
  // With e = exp(lo - hi) <= 1: lse = hi + log1p(e), and the weights are 1 / (1 + e) and
  // e / (1 + e). Formed from the difference alone, their error does not grow with |lse|, as
  // exp(lse_x - lse) of a rounded lse would.
  const float e = expf(lo - hi);
  const float w_hi = 1.0f / (1.0f + e);
  const float w_lo = e * w_hi;
  const bool acc_is_hi = lse_acc >= lse_blk;
  return {hi + log1pf(e), acc_is_hi ? w_hi : w_lo, acc_is_hi ? w_lo : w_hi};
}

}  // namespace ringflash::core
