// The forward kernel: one thread block per (query tile, head, sequence), online softmax over the
// key tiles that the mask leaves, fp32 log-sum-exp out, and in accumulate mode an exact merge into
// the fp32 (out, lse) accumulator in the epilogue.
//
// Each warp owns block_m / warps query rows. The scores of a key tile stay in registers: their C
// fragments become the A fragments of P V. K and V tiles are loaded with cp.async so that the load
// of V overlaps Q K^T and the load of the next K overlaps P V.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "../common/merge.h"
#include "../common/sequence.h"
#include "config.h"
#include "params.h"
#include "tile.h"

namespace ringflash::cuda {

// Maximum and sum over the four lanes that share a row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The key tiles [*begin, *end) of sequence `s` that queries [q0, q0 + rows) can see; tiles start at
// the sequence's first key.
template <int kBlockN>
__device__ __forceinline__ void key_tiles(const core::Mask& mask, const core::Sequence& s, int64_t q0, int rows,
                                          int64_t* begin, int64_t* end) {
  int64_t first, last;
  mask.key_span(s.pos_q + q0, s.pos_q + q0 + rows, s.pos_k, s.pos_k + s.len_k, &first, &last);
  *begin = (first - s.pos_k) / kBlockN;
  *end = last > first ? (last - s.pos_k + kBlockN - 1) / kBlockN : *begin;
}

// The query tiles [*begin, *end) of sequence `s` that see any of keys [n0, n0 + keys); tiles start
// at the sequence's first query.
template <int kBlockM>
__device__ __forceinline__ void query_tiles(const core::Mask& mask, const core::Sequence& s, int64_t n0, int keys,
                                            int* begin, int* end) {
  int64_t first, last;
  mask.query_span(s.pos_k + n0, s.pos_k + n0 + keys, s.pos_q, s.pos_q + s.len_q, &first, &last);
  *begin = static_cast<int>((first - s.pos_q) / kBlockM);
  *end = last > first ? static_cast<int>((last - s.pos_q + kBlockM - 1) / kBlockM) : *begin;
}

// Scores of one key tile, for the rows a warp owns: scale, softcap, ALiBi, then the mask where
// the tile is only partly visible (or runs past the sequence's last key). Element (mt, nt, i) is
// row row0 + 16 mt + lane / 4 + 8 (i / 2) and column 8 nt + 2 (lane % 4) + i % 2. kRaw: plain
// scores stay raw (their scale goes into the exponent) and only the mask applies.
template <bool kRaw = false, int kMT, int kNT>
__device__ __forceinline__ void transform_scores(float (&s)[kMT][kNT][4], const ScoreTransform& f, bool alibi,
                                                 bool partial, const TileMask& tile, int row0, int lane) {
  const int col0 = (lane % 4) * 2;  // the lane's first column
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + lane / 4 + half * 8;
      // The row's visible columns less the lane's first, [first, last]: an element's test is then
      // two compares of these against a constant.
      int first, last;
      tile.columns(row, &first, &last);
      first -= col0;
      last -= col0;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = 2 * half + j, k = nt * 8 + j;
          float x = kRaw ? s[mt][nt][i] : f(s[mt][nt][i]);
          if (!kRaw && alibi) x = f.alibi(x, tile.distance(row, col0 + k));
          if (partial && !((k >= first) & (k <= last))) x = -INFINITY;
          s[mt][nt][i] = x;
        }
    }
}

// Online softmax over one key tile of a warp's rows: s (scores in log2 units, times `scale`)
// becomes P and the row max and sum move on; correction[mt][half] is what the row's output
// accumulators must be multiplied by. Returns whether any of the warp's rows' max moved (when none
// did, the correction is 1 everywhere: late key tiles, mostly). A row that has seen no key yet
// keeps max -inf; exponents are then taken against 0 so that exp2(-inf - -inf) never makes a NaN.
// Element (mt, nt, i) is as in transform_scores.
//
// TP (the type P is rounded to for P V; void: none of this): the max lags. It moves only when a
// row's new max passes the old by more than kMaxLag (log2 units), so that weights reach
// 2^kMaxLag and the rescale of O is skipped on all but the first tiles. A lagging largest weight
// is no longer exactly 1, and its rounding to TP would then show in the output of a sharp softmax
// (the row sum is of unrounded weights): so row_fix adds, for each thread's largest weight of the
// tile, its value rounded to TP less its fp32 value, and the output is normalised by row_sum +
// row_fix. The lse takes row_sum alone (bench/NOTES.md h55). row_fix is required with TP.
//
// kInTurn: each row half's max starts from a -inf that ptxas cannot see through (an FFMA of the
// last half's first probability by 0), so that it cannot hoist a half's max above the last half's
// exponents. In the sm_90a forward the first exponent then comes 54 instructions after the wait
// for S rather than 75, or 108 in other builds of the same loop (bench/NOTES.md h30, h44).
constexpr float kMaxLag = 8.0f;

template <bool kInTurn = false, typename TP = void, int kMT, int kNT>
__device__ __forceinline__ bool softmax_tile(float (&s)[kMT][kNT][4], float (&row_max)[kMT][2],
                                             float (&row_sum)[kMT][2], float scale, float (&correction)[kMT][2],
                                             float (*row_fix)[2] = nullptr) {
  constexpr bool kLag = !std::is_void_v<TP>;
  bool moved = false;
  float start = -INFINITY;  // of each half's max
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = start;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      const float own = mx;  // this thread's largest score of the row half
      const float old = row_max[mt][half];
      mx = fmaxf(old, quad_max(mx) * scale);
      if constexpr (kLag) mx = mx > old + kMaxLag ? mx : old;
      const float base = mx == -INFINITY ? 0.0f : mx;
      correction[mt][half] = exp2_ftz(old - base);
      moved |= mx != old;
      row_max[mt][half] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 2 * half; i < 2 * half + 2; ++i) {
          s[mt][nt][i] = exp2_ftz(fmaf(s[mt][nt][i], scale, -base));
          sum += s[mt][nt][i];
        }
      if constexpr (kLag) {  // the same exponent as that element's above
        const float top = exp2_ftz(fmaf(own, scale, -base));
        row_fix[mt][half] = row_fix[mt][half] * correction[mt][half] + (Mma<TP>::round(top) - top);
      }
      row_sum[mt][half] = row_sum[mt][half] * correction[mt][half] + sum;
      // -inf, or NaN where P is not finite, which fmaxf passes over.
      if constexpr (kInTurn) start = fmaf(s[mt][0][2 * half], 0.0f, -INFINITY);
    }
  return __any_sync(0xffffffffu, moved);
}

template <int kMT, int kDT>
__device__ __forceinline__ void rescale(float (&o)[kMT][kDT][4], const float (&correction)[kMT][2]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][dt][i] *= correction[mt][i / 2];
}

// softmax_tile, then the rescale of the output accumulators where a row's max moved.
template <int kMT, int kNT, int kDT>
__device__ __forceinline__ void online_softmax(float (&s)[kMT][kNT][4], float (&o)[kMT][kDT][4],
                                               float (&row_max)[kMT][2], float (&row_sum)[kMT][2], float scale) {
  float correction[kMT][2];
  if (softmax_tile(s, row_max, row_sum, scale, correction)) rescale(o, correction);
}

// A row's lse (natural log) from its running max (log2 units) and its summed probabilities, and
// the factor that normalises its output: a row that sees no key (sum 0) has lse -inf and out 0.
__device__ __forceinline__ float row_lse(float row_max, float sum) {
  return sum > 0.0f ? (row_max + log2f(sum)) * kLn2 : -INFINITY;
}
__device__ __forceinline__ float row_inverse(float sum) { return sum > 0.0f ? 1.0f / sum : 0.0f; }

// Where a forward's output row goes in T: out without accumulate, final_out with write_final;
// null where it goes to the fp32 out.
template <typename T>
__device__ __forceinline__ T* t_row(const core::AttentionArgs& a, int64_t b, int64_t row, int h) {
  if (!a.accumulate) return row_ptr<T>(a.out, b, row, h);
  return a.write_final ? row_ptr<T>(a.final_out, b, row, h) : nullptr;
}

// Stores the pair (x, y) at column c of a row: packed into T at `t_out` when it is set, else in
// fp32 at `f_out`.
template <typename T>
__device__ __forceinline__ void store_pair(T* t_out, float* f_out, int c, float x, float y) {
  if (t_out) *reinterpret_cast<uint32_t*>(t_out + c) = Mma<T>::pack(x, y);
  else *reinterpret_cast<float2*>(f_out + c) = make_float2(x, y);
}

// Normalises a warp's output rows and writes them with their lse (in fp32 with overwrite_out), or
// merges them into the fp32 accumulator; with write_final the rows go to final_out in T instead
// of out. Rows past the sequence's end are dropped. Element (mt, dt, i) of o is row
// warp_row0 + 16 mt + lane / 4 + 8 (i / 2), column 8 dt + 2 (lane % 4) + i % 2.
//
// The merge loads the old values of its rows before it stores any of them, so that the loads are in
// flight together: loads between stores (and head-dim checks) wait for memory one after another,
// which cost the sm_90a forward 6-8 % in accumulate mode at 4k-16k rows (docs/decisions.md).
template <typename T, int kMT, int kDT>
__device__ __forceinline__ void write_output(const Params& p, int64_t b, int h, const core::Sequence& seq,
                                             int64_t q0, int rows, const float (&o)[kMT][kDT][4],
                                             const float (&row_max)[kMT][2], const float (&row_sum)[kMT][2],
                                             int lane, int warp_row0, const float (*row_fix)[2] = nullptr) {
  const core::AttentionArgs& a = p.a;
  const int col = (lane % 4) * 2;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    float lse[2], inv[2];
    int64_t row[2];
    bool live[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = quad_sum(row_sum[mt][half]);
      lse[half] = row_lse(row_max[mt][half], sum);
      inv[half] = row_inverse(row_fix ? sum + quad_sum(row_fix[mt][half]) : sum);
      const int r = warp_row0 + mt * 16 + lane / 4 + half * 8;
      live[half] = r < rows;
      row[half] = seq.row_q + q0 + r;
    }
    if (!a.accumulate || a.overwrite_out) {  // written as they are: in T, or in fp32 unless write_final
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!live[half]) continue;
        T* t_out = t_row<T>(a, b, row[half], h);
        float* f_out = t_out ? nullptr : row_ptr<float>(a.out, b, row[half], h);
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          if (dt * 8 < a.head_dim)
            store_pair(t_out, f_out, col + dt * 8, o[mt][dt][2 * half] * inv[half],
                       o[mt][dt][2 * half + 1] * inv[half]);
        if (lane % 4 == 0) a.lse[p.lse_index(b, h, row[half])] = lse[half];
      }
      continue;
    }
    // Both halves' old values together where they fit in registers beside o (head dim <= 128).
    constexpr int kTogether = kDT <= 16 ? 2 : 1;
#pragma unroll
    for (int first = 0; first < 2; first += kTogether) {
      float old_lse[kTogether] = {};
      float2 old[kTogether][kDT] = {};
#pragma unroll
      for (int i = 0; i < kTogether; ++i) {
        const int half = first + i;
        if (!live[half]) continue;
        old_lse[i] = a.lse[p.lse_index(b, h, row[half])];
        const float* out = row_ptr<float>(a.out, b, row[half], h) + col;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          if (dt * 8 < a.head_dim) old[i][dt] = *reinterpret_cast<const float2*>(out + dt * 8);
      }
      __syncwarp();  // each quad has read its rows' old lse before its lane 0 replaces it
#pragma unroll
      for (int i = 0; i < kTogether; ++i) {
        const int half = first + i;
        if (!live[half]) continue;
        const core::MergeWeights w = core::merge_weights(old_lse[i], lse[half]);
        const float w_blk = w.w_blk * inv[half];
        T* t_out = t_row<T>(a, b, row[half], h);
        float* f_out = t_out ? nullptr : row_ptr<float>(a.out, b, row[half], h);
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          if (dt * 8 < a.head_dim)
            store_pair(t_out, f_out, col + dt * 8, w.w_acc * old[i][dt].x + w_blk * o[mt][dt][2 * half],
                       w.w_acc * old[i][dt].y + w_blk * o[mt][dt][2 * half + 1]);
        if (lane % 4 == 0) a.lse[p.lse_index(b, h, row[half])] = w.lse;
      }
    }
  }
}

template <typename T, int kHeadDim>
struct Forward {
  static constexpr ForwardTiles kTiles = forward_tiles(kHeadDim);
  static constexpr int kBlockM = kTiles.block_m, kBlockN = kTiles.block_n;
  static constexpr int kThreads = kTiles.warps * 32;
  static constexpr int kMT = kBlockM / kTiles.warps / 16;  // 16-row m-tiles per warp
  static constexpr int kNT = kBlockN / 8;                  // 8-column n-tiles of a score tile
  static constexpr int kDT = kHeadDim / 8;                 // 8-column n-tiles of the output
  static_assert(kBlockM % (16 * kTiles.warps) == 0, "each warp owns whole m-tiles");
  using QTile = Tile<kBlockM, kHeadDim>;
  using KTile = Tile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = (QTile::kElements + 2 * KTile::kElements) * 2;

  static __device__ void run(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem);
    T* sk = sq + QTile::kElements;
    T* sv = sk + KTile::kElements;

    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int h = blockIdx.y;
    const core::Sequence seq = core::sequence(a, b);
    // The last query tiles first: under a causal mask they see the most keys, so the longest
    // blocks start early and the short ones fill the tail.
    const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kBlockM;
    if (q0 >= seq.len_q) return;
    const int rows = tile_rows(seq.len_q, q0, kBlockM);
    const int lane = threadIdx.x % 32, warp_row0 = threadIdx.x / 32 * kMT * 16;
    const auto q_lanes = QTile::a_lanes(smem_address(sq), lane);
    const auto k_lanes = KTile::b_lanes(smem_address(sk), lane);
    const auto v_lanes = KTile::b_trans_lanes(smem_address(sv), lane);

    const core::Mask mask = p.mask();
    int64_t n_begin, n_end;
    key_tiles<kBlockN>(mask, seq, q0, rows, &n_begin, &n_end);

    const T* q = row_ptr<const T>(a.q, b, seq.row_q + q0, h);
    const int64_t hk = h / p.group;
    const T* k = row_ptr<const T>(a.k, b, seq.row_k, hk);
    const T* v = row_ptr<const T>(a.v, b, seq.row_k, hk);
    const auto valid_keys = [&](int64_t n) { return tile_rows(seq.len_k, n * kBlockN, kBlockN); };

    if (n_begin < n_end) {
      QTile::template load<kThreads>(sq, q, a.q.row_stride, rows, a.head_dim);
      KTile::template load<kThreads>(sk, k + n_begin * kBlockN * a.k.row_stride, a.k.row_stride, valid_keys(n_begin),
                                     a.head_dim);
      cp_async_commit();
    }

    const ScoreTransform f = p.score_transform(b, h);
    const bool alibi = a.alibi_slopes != nullptr;
    const bool plain = p.softcap_log2 == 0.0f && p.qk_scale > 0.0f;
    float o[kMT][kDT][4] = {};
    float row_max[kMT][2], row_sum[kMT][2] = {};
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;

    for (int64_t n = n_begin; n < n_end; ++n) {
      cp_async_wait<0>();
      __syncthreads();  // K(n) has landed; every warp is done with V(n - 1)
      const int valid_n = valid_keys(n);
      KTile::template load<kThreads>(sv, v + n * kBlockN * a.v.row_stride, a.v.row_stride, valid_n, a.head_dim);
      cp_async_commit();

      float s[kMT][kNT][4] = {};
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t qa[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(qa[mt], q_lanes.at(warp_row0 + mt * 16, ks * 16));
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k_lanes.at(np * 16, ks * 16));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            Mma<T>::run(s[mt][2 * np], qa[mt], kb[0], kb[1]);
            Mma<T>::run(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
          }
        }
      }

      const int64_t pk0 = seq.pos_k + n * kBlockN, pq0 = seq.pos_q + q0;
      const bool partial = valid_n < kBlockN ||
                           mask.classify(pq0, pq0 + rows, pk0, pk0 + valid_n) != core::BlockKind::kFull;
      // Plain scores (no softcap, ALiBi or mask, positive scale) stay raw: the scale goes into the
      // exponent, exp2(s * scale - max * scale), one fused multiply-add per element.
      const bool raw = !partial && !alibi && plain;
      if (!raw) transform_scores(s, f, alibi, partial, TileMask(mask, pk0 - pq0, kBlockM, valid_n), warp_row0, lane);
      const float scale = raw ? p.qk_scale : 1.0f;

      online_softmax(s, o, row_max, row_sum, scale);

      uint32_t pa[kMT][kBlockN / 16][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int ps = 0; ps < kBlockN / 16; ++ps) accumulators_to_a<T>(pa[mt][ps], s[mt][2 * ps], s[mt][2 * ps + 1]);

      cp_async_wait<0>();
      __syncthreads();  // V(n) has landed; every warp is done with K(n)
      if (n + 1 < n_end) {
        KTile::template load<kThreads>(sk, k + (n + 1) * kBlockN * a.k.row_stride, a.k.row_stride,
                                       valid_keys(n + 1), a.head_dim);
        cp_async_commit();
      }

#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) {
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, v_lanes.at(ps * 16, dp * 16));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            Mma<T>::run(o[mt][2 * dp], pa[mt][ps], vb[0], vb[1]);
            Mma<T>::run(o[mt][2 * dp + 1], pa[mt][ps], vb[2], vb[3]);
          }
        }
      }
    }

    write_output<T>(p, b, h, seq, q0, rows, o, row_max, row_sum, lane, warp_row0);
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Forward<T, kHeadDim>::kThreads, 1) forward_kernel(const Params p) {
  Forward<T, kHeadDim>::run(p);
}

}  // namespace ringflash::cuda
