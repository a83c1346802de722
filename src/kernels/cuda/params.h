// What a CUDA attention kernel receives, by value: the validated AttentionArgs plus the constants
// the host derives from them once.
#pragma once

#include <cstdint>

#include "../common/mask.h"
#include "../common/params.h"
#include "ptx.h"

namespace ringflash::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The mask of one tile as int32 bounds on (column - row): element (row, col) of a tile whose
// element (0, 0) has pk - pq = d0 is visible iff lo <= col - row <= hi, row < rows and col < cols.
// Branch-free, and exact for tiles the mask leaves whole too (their bounds cover every offset).
struct TileMask {
  int lo, hi, rows, cols;
  float d0;  // for ALiBi

  __device__ __forceinline__ TileMask(const core::Mask& mask, int64_t d0, int rows, int cols)
      : lo(clamp(-mask.left - d0)), hi(clamp(mask.right - d0)), rows(rows), cols(cols), d0(static_cast<float>(d0)) {}
  __device__ __forceinline__ bool visible(int row, int col) const {
    const int d = col - row;
    return (row < rows) & (col < cols) & (d >= lo) & (d <= hi);
  }
  // The visible columns of `row`: [*first, *last], empty (*last < *first) past the tile's rows.
  __device__ __forceinline__ void columns(int row, int* first, int* last) const {
    *first = row + lo;
    *last = row < rows ? min(row + hi, cols - 1) : -1;
  }
  // Whether every element of a kRows x kCols tile is visible.
  __device__ __forceinline__ bool whole(int max_rows, int max_cols) const {
    return rows == max_rows && cols == max_cols && lo <= 1 - max_rows && hi >= max_cols - 1;
  }
  // |pk - pq| of an element, for ALiBi.
  __device__ __forceinline__ float distance(int row, int col) const {
    return fabsf(d0 + static_cast<float>(col - row));
  }
  static __device__ __forceinline__ int clamp(int64_t x) {
    constexpr int64_t kLimit = 1 << 30;  // beyond any offset inside a tile
    return static_cast<int>(x < -kLimit ? -kLimit : x > kLimit ? kLimit : x);
  }
};

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): two special-function instructions instead of tanhf's
// long sequence (which, unrolled over a tile, filled the instruction cache). Absolute error about
// 1e-7; the exponent is capped where tanh is 1 in fp32 anyway.
__device__ __forceinline__ float tanh_exp2(float x) {
  constexpr float kTwoLog2e = 2.0f * 1.4426950408889634f, kMaxExponent = 64.0f;
  const float e = exp2_ftz(fminf(x * kTwoLog2e, kMaxExponent));
  return 1.0f - __fdividef(2.0f, e + 1.0f);
}

// The score of one element in log2 units and, for the backward, its derivative.
struct ScoreTransform {
  float qk_scale, softcap_log2, alibi_log2;

  __device__ __forceinline__ float operator()(float qk) const {
    return softcap_log2 != 0.0f ? softcap_log2 * tanh_exp2(qk * qk_scale) : qk * qk_scale;
  }
  __device__ __forceinline__ float alibi(float s2, float distance) const { return s2 - alibi_log2 * distance; }
  // p = exp2(s2 - lse2) and dS = p (dp - dsum) d(score)/d(qk) for one visible element, with dS
  // short of the softmax scale (a factor of every element, which the kernels apply to dQ and dK).
  // kPlain: no softcap and no ALiBi.
  template <bool kPlain>
  __device__ __forceinline__ void gradient(float qk, float dp, float lse2, float dsum, bool alibi, float distance,
                                           float* p, float* ds) const {
    if (kPlain) {
      *p = exp2_ftz(fmaf(qk, qk_scale, -lse2));
      *ds = *p * (dp - dsum);
      return;
    }
    float s2, slope = 1.0f;
    if (softcap_log2 != 0.0f) {
      const float th = tanh_exp2(qk * qk_scale);
      s2 = softcap_log2 * th;
      slope = 1.0f - th * th;
    } else {
      s2 = qk * qk_scale;
    }
    if (alibi) s2 = this->alibi(s2, distance);
    *p = exp2_ftz(s2 - lse2);
    *ds = *p * (dp - dsum) * slope;
  }
};

// Rows of the tile that starts at row `start` of a sequence of `len` rows.
__device__ __forceinline__ int tile_rows(int64_t len, int64_t start, int block) {
  return static_cast<int>(len - start < block ? len - start : block);
}

// Element (b, row, h, 0) of an operand; `row` counts from the start of the (packed) tensor.
template <typename T>
__device__ __forceinline__ T* row_ptr(const core::AttentionArgs::Operand& o, int64_t b, int64_t row, int64_t h) {
  return static_cast<T*>(o.data) + b * o.batch_stride + row * o.row_stride + h * o.head_stride;
}

struct Params {
  core::AttentionArgs a;
  int group = 1;           // q heads per k/v head
  int64_t max_rows_q = 0;  // upper bounds of a sequence's length (grid sizes)
  int64_t max_rows_k = 0;

  // Scores in log2 units: s2 = qk * qk_scale, or softcap_log2 * tanh(qk * qk_scale) with softcap.
  float qk_scale = 0.0f;
  float softcap_log2 = 0.0f;  // softcap * log2(e); 0 when off
  // d(score)/d(qk) without the softcap factor: the softmax scale.
  float softmax_scale = 0.0f;

  // Backward. dq is accumulated in fp32 with atomics into dq_accum (which is dq itself when dq is
  // fp32), laid out with the strides below. Per query row, at stat_index(b, h, row):
  // dsum = rowsum(dout * out) and lse2, the lse in log2 units (+inf where it is -inf, so that P is 0).
  float* dq_accum = nullptr;
  int64_t dq_accum_batch_stride = 0, dq_accum_row_stride = 0, dq_accum_head_stride = 0;
  // With dq_accum from the workspace: per (sequence, k/v head), zeroed with it by the dsum pass (a
  // packed batch is one sequence). The Hopper backward adds each block's count there once its part
  // of dQ is in dq_accum, so that the conversion pass can start on a head before the kernel has ended.
  int* dq_done = nullptr;
  float* dsum = nullptr;
  float* lse2 = nullptr;
  int64_t stat_batch_stride = 0, stat_head_stride = 0;

  __host__ __device__ core::Mask mask() const { return {a.window_left, a.window_right}; }
  __device__ ScoreTransform score_transform(int64_t b, int64_t h) const {
    const float slope = a.alibi_slopes ? a.alibi_slopes[b * a.alibi_batch_stride + h] * kLog2e : 0.0f;
    return {qk_scale, softcap_log2, slope};
  }
  __host__ __device__ int64_t lse_index(int64_t b, int64_t h, int64_t row_in_tensor) const {
    return b * a.lse_batch_stride + h * a.lse_head_stride + row_in_tensor;
  }
  __host__ __device__ int64_t stat_index(int64_t b, int64_t h, int64_t row_in_tensor) const {
    return b * stat_batch_stride + h * stat_head_stride + row_in_tensor;
  }
  // dQ is added straight into the caller's fp32 dq: no accumulator and no conversion pass.
  __host__ __device__ bool dq_in_place() const { return a.accumulate && !a.deterministic; }
};

}  // namespace ringflash::cuda
