// Pieces shared by the CPU forward and backward kernels: sequence geometry, operand access,
// packing, and the score transform (scale, softcap, ALiBi, mask) on a tile of scores.
//
// Score tiles are stored transposed, S^T (keys x queries) with kBlockM query columns, so every
// softmax statistic is per column and vectorises across queries with no horizontal reductions.
// Scores are kept in log2 units (multiplied by log2(e)) so the kernels call exp2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "../common/mask.h"
#include "../../core/thread_pool.h"
#include "../common/params.h"
#include "../common/sequence.h"
#include "gemm.h"
#include "vec.h"

namespace ringflash::cpu {

using core::AttentionArgs;
using core::Sequence;
using core::sequence;

// Queries per tile: one register tile of columns, so S^T = K Q^T is a single column strip.
inline constexpr int64_t kBlockM = kNR;
inline constexpr int64_t kColumnVecs = kBlockM / kVecWidth;
static_assert(kBlockM % kVecWidth == 0, "query tile must be whole vectors");

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Element (b, row, h, 0) of an operand; `row` counts from the start of the packed tensor.
template <typename T>
inline T* row_ptr(const AttentionArgs::Operand& o, int64_t b, int64_t row, int64_t h) {
  return static_cast<T*>(o.data) + b * o.batch_stride + row * o.row_stride + h * o.head_stride;
}

// Writes n floats to row `row` of head h of an operand stored as fp32 or as T, or adds them to it.
template <typename T>
inline void store_operand_row(const float* src, int64_t n, bool add, DType dtype, const AttentionArgs::Operand& o,
                              int64_t b, int64_t row, int64_t h) {
  if (dtype == DType::kFloat32)
    store_row(src, n, add, row_ptr<float>(o, b, row, h));
  else
    store_row(src, n, add, row_ptr<T>(o, b, row, h));
}

inline float* lse_ptr(const AttentionArgs& a, int64_t b, int64_t row, int64_t h) {
  return a.lse + b * a.lse_batch_stride + h * a.lse_head_stride + row;
}

inline core::Mask mask_of(const AttentionArgs& a) { return core::Mask{a.window_left, a.window_right}; }

// Buffers kept by each thread for its next call: repeated calls then reuse warm pages instead of
// allocating, zeroing and faulting in fresh ones. The packed operands belong to the calling thread;
// the tile scratch (kWorkerTiles) to whichever thread runs the work item. Contents are not
// preserved between uses.
enum class Buffer {
  kKeysByKey, kKeysByDim, kValuesByKey, kValuesByDim,              // KeyTiles
  kQueryT, kQuery, kDoutT, kDout, kDelta, kLse2, kDqAccumulator,  // backward query tiles and dQ
  kWorkerTiles,
  kCount
};

inline float* workspace(Buffer slot, size_t n) {
  struct Cached {
    std::unique_ptr<float[]> data;
    size_t size = 0;
  };
  thread_local Cached cache[static_cast<int>(Buffer::kCount)];
  Cached& c = cache[static_cast<int>(slot)];
  if (c.size < n) {
    c.data.reset();
    c.data.reset(new float[n]);
    c.size = n;
  }
  return c.data.get();
}

// dst[d * ld + r] = scale * (row r of src)[d] for r < rows, and 0 for rows <= r < width: rows
// transposed into columns, a kVecWidth x kVecWidth block at a time in registers.
template <typename T>
inline void transpose_rows(const T* src, int64_t row_stride, int64_t rows, int64_t width, int64_t head_dim,
                           float scale, float* dst, int64_t ld) {
  for (int64_t r0 = 0; r0 < width; r0 += kVecWidth) {
    const int64_t chunk = std::min<int64_t>(kVecWidth, width - r0);
    const int64_t valid = std::clamp<int64_t>(rows - r0, 0, chunk);
    for (int64_t d0 = 0; d0 < head_dim; d0 += kVecWidth) {
      const int64_t dims = std::min<int64_t>(kVecWidth, head_dim - d0);
      Vec block[kVecWidth];
      for (int64_t r = 0; r < kVecWidth; ++r)
        block[r] = r < valid ? load_partial(src + (r0 + r) * row_stride + d0, dims) : Vec{};
      transpose_block(block);
      for (int64_t d = 0; d < dims; ++d) store_partial(dst + (d0 + d) * ld + r0, block[d] * scale, chunk);
    }
  }
}

// dst (head_dim x kBlockM) = scale * rows^T, columns past `rows` zero.
template <typename T>
inline void pack_transposed(const T* src, int64_t row_stride, int64_t rows, int64_t head_dim, float scale,
                            float* dst) {
  transpose_rows(src, row_stride, rows, kBlockM, head_dim, scale, dst, kBlockM);
}

// Keys per tile, in forward and backward alike.
inline constexpr int64_t kBlockN = 128;
// Rows of A per register tile of the products that read packed K and V.
inline constexpr int64_t kPanelRows = UnitStrideTile::kMR;

// The A operand of a tile product, laid out for gemm<..., UnitStrideTile>.
struct PanelOperand {
  const float* a;
  int64_t a_rs, a_cs;
};

// One operand (k or v) copied to fp32 in tiles of kBlockN keys, per head, each tile cut into the
// panels a register tile reads as its A operand: kPanelRows rows of A side by side for every step
// of the product, so each register tile's A is one sequential stream that the hardware
// prefetchers follow from L3. Two panel shapes, by which index is A's row:
//   kByKey: A(key, dim), for S^T = K Q^T and dP^T = V dO^T
//   kByDim: A(dim, key), for O^T += V^T P^T and dQ^T += K^T dS^T
// Tiles are numbered per head and start at every sequence's first key: sequence b's tile t is
// index(b, h, t). (Gathering tiles straight from the (S, H, D) input instead would touch one page
// per row, H * D elements apart, for every query tile; one pass up front reads each page once.)
class KeyTiles {
 public:
  enum class Layout { kByKey, kByDim };

  template <typename T>
  void pack(const AttentionArgs& a, const AttentionArgs::Operand& o, Layout layout, Buffer slot) {
    d_ = a.head_dim;
    layout_ = layout;
    depth_ = layout == Layout::kByKey ? d_ : kBlockN;  // steps of the product per panel
    const int64_t rows = layout == Layout::kByKey ? kBlockN : d_;
    tile_size_ = round_up(rows, kPanelRows) * depth_;
    first_tile_.assign(static_cast<size_t>(a.batch + 1), 0);
    for (int64_t b = 0; b < a.batch; ++b)
      first_tile_[b + 1] = first_tile_[b] + (sequence(a, b).len_k + kBlockN - 1) / kBlockN;
    data_ = workspace(slot, static_cast<size_t>(a.heads_kv * tiles() * tile_size_));
    // One item per tile of every sequence, all heads at once: the heads of a key row are adjacent
    // in memory, so each row's page is read once.
    core::parallel_for(tiles(), a.num_threads, [&](int64_t g, int) {
      const int64_t b = std::upper_bound(first_tile_.begin(), first_tile_.end(), g) - first_tile_.begin() - 1;
      const int64_t t = g - first_tile_[b];
      const Sequence s = sequence(a, b);
      const int64_t n = std::min(kBlockN, s.len_k - t * kBlockN);
      for (int64_t k0 = 0; k0 < n; k0 += kPanelRows)
        for (int64_t h = 0; h < a.heads_kv; ++h)
          pack_panel_rows<T>(o, b, s.row_k + t * kBlockN + k0, h, k0, std::min(kPanelRows, n - k0),
                          data_ + index(b, h, t) * tile_size_);
    });
  }

  int64_t tiles() const { return first_tile_.back(); }
  int64_t index(int64_t b, int64_t h, int64_t t) const { return h * tiles() + first_tile_[b] + t; }

  // Tile g as the A operand of a product (rows of A are keys for kByKey, dims for kByDim).
  PanelOperand operand(int64_t g) const {
    // A register tile starting at row m0 (a multiple of kPanelRows) begins at m0 * depth_; within
    // it, row m of step k is at k * kPanelRows + m.
    return {data_ + g * tile_size_, depth_, kPanelRows};
  }

 private:
  // Keys [k0, k0 + rows) of a tile (rows <= kPanelRows), one head, into their places in the
  // tile's panels.
  template <typename T>
  void pack_panel_rows(const AttentionArgs::Operand& o, int64_t b, int64_t row, int64_t h, int64_t k0, int64_t rows,
                       float* tile) const {
    if (layout_ == Layout::kByKey) {
      // Panel k0 / kPanelRows holds these keys: (key r, dim d) at d * kPanelRows + r.
      transpose_rows(row_ptr<const T>(o, b, row, h), o.row_stride, rows, rows, d_, 1.0f, tile + k0 * depth_,
                     kPanelRows);
      return;
    }
    // Panel p holds dims [p * kPanelRows, ...): (key, dim r of the panel) at key * kPanelRows + r.
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = row_ptr<const T>(o, b, row + r, h);
      for (int64_t d0 = 0; d0 < d_; d0 += kPanelRows) {
        float* out = tile + d0 * depth_ + (k0 + r) * kPanelRows;
        const int64_t width = std::min(kPanelRows, d_ - d0);
        for (int64_t x = 0; x < width; x += kVecWidth) {
          const int64_t n = std::min<int64_t>(kVecWidth, width - x);
          store_partial(out + x, load_partial(in + d0 + x, n), n);
        }
      }
    }
  }

  float* data_ = nullptr;
  int64_t d_ = 0, depth_ = 0, tile_size_ = 0;
  Layout layout_ = Layout::kByKey;
  std::vector<int64_t> first_tile_;
};

// Calls fn(row) for every row of a packed tensor of `rows` rows that lies outside
// [cu_seqlens[0], cu_seqlens[B]), i.e. in no sequence. Padded batches (cu_seqlens null) have none.
template <typename Fn>
inline void for_unused_rows(const AttentionArgs& a, const int32_t* cu_seqlens, int64_t rows, Fn&& fn) {
  if (!cu_seqlens) return;
  for (int64_t r = 0; r < rows; ++r)
    if (r < cu_seqlens[0] || r >= cu_seqlens[a.batch]) fn(r);
}

// What turns q.k into a log2-unit score. Q is packed pre-multiplied by `q_scale`, so the tile
// holds x = q_scale * q.k and the score is
//   s2 = x                                  (no softcap; q_scale = scale * log2e)
//   s2 = cap_log2e * tanh(x)                (softcap; q_scale = scale / softcap)
// minus alibi_log2e * |pq - pk|, with masked entries -inf.
struct ScoreTransform {
  float q_scale;
  float cap_log2e;
  bool softcap;
  core::Mask mask;

  static ScoreTransform make(const AttentionArgs& a) {
    ScoreTransform t;
    t.softcap = a.softcap > 0.0f;
    t.q_scale = t.softcap ? a.scale / a.softcap : a.scale * kLog2e;
    t.cap_log2e = a.softcap * kLog2e;
    t.mask = mask_of(a);
    return t;
  }
};

// Transforms tile rows [0, rows) of S^T in place: row r holds key position pk0 + r, column c
// query position pq0 + c. With `tanh_out`, also stores 1 - tanh^2 (the softcap derivative).
// Returns nothing; masking is applied only when `partial`.
inline void transform_scores(const ScoreTransform& t, float alibi_log2e, bool partial, int64_t pq0, int64_t pk0,
                             int64_t rows, float* st, float* tanh_grad) {
  const bool alibi = alibi_log2e != 0.0f;
  if (!t.softcap && !alibi && !partial) return;
  // Relative offsets d = pk - pq fit easily in fp32 (|d| < 2^24) within a tile; the window
  // bounds are clamped to a range that keeps the comparison exact.
  constexpr float kBig = 1 << 24;
  const float lo = t.mask.left >= static_cast<int64_t>(kBig) ? -kBig : -static_cast<float>(t.mask.left);
  const float hi = t.mask.right >= static_cast<int64_t>(kBig) ? kBig : static_cast<float>(t.mask.right);
  Vec lane;
  for (int i = 0; i < kVecWidth; ++i) lane[i] = static_cast<float>(i);
  const float d0 = static_cast<float>(pk0 - pq0);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = st + r * kBlockM;
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      Vec x = load(row + c * kVecWidth);
      if (t.softcap) {
        const Vec th = tanh(x);
        if (tanh_grad) store(tanh_grad + r * kBlockM + c * kVecWidth, 1.0f - th * th);
        x = th * t.cap_log2e;
      }
      if (alibi || partial) {
        const Vec d = (d0 + static_cast<float>(r - c * kVecWidth)) - lane;  // pk - pq
        if (alibi) x -= alibi_log2e * (d < 0.0f ? -d : d);
        if (partial) x = (d >= lo && d <= hi) ? x : splat(-kInf);
      }
      store(row + c * kVecWidth, x);
    }
  }
}

}  // namespace ringflash::cpu
