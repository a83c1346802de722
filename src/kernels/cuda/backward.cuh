// The backward kernels.
//
//   dot_do_o   dsum = rowsum(dout * out), once per query row.
//   Backward   one thread block per (key tile, k/v head, sequence): K and V stay in shared memory,
//              and the block walks every query tile that sees its keys, for every q head of its
//              group, so dK and dV are summed in registers and written once (GQA needs no
//              expanded buffers and dK/dV are deterministic). dQ = dS K goes to an fp32
//              accumulator with atomics, unless the backward is deterministic.
//   DqKernel   deterministic dQ: one thread block per query tile walks the key tiles.
//   convert_dq dq = dq_accum, rounded to dq's dtype.
//
// Each warp of Backward owns 16 keys: S^T = K Q^T and dP^T = V dO^T stay in registers, and P^T and
// dS^T feed dV += P^T dO and dK += dS^T Q as A fragments. dS^T also goes to shared memory for dQ.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "../common/sequence.h"
#include "config.h"
#include "forward.cuh"
#include "params.h"
#include "tile.h"

namespace ringflash::cuda {

// Thread i of the grid: query row i / heads of the tensor (over every sequence of a padded batch),
// head i % heads.
template <typename T, typename TOut, int kHeadDim>
__global__ void dot_do_o_kernel(const Params p, int64_t total_rows) {
  const core::AttentionArgs& a = p.a;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total_rows * a.heads_q) return;
  const int64_t r = i / a.heads_q, h = i % a.heads_q;
  const int64_t b = r / a.rows_q, row = r % a.rows_q;
  const T* dout = row_ptr<const T>(a.dout, b, row, h);
  const TOut* out = row_ptr<const TOut>(a.out, b, row, h);
  float sum = 0.0f;
#pragma unroll 8
  for (int d = 0; d < a.head_dim; ++d) sum += static_cast<float>(dout[d]) * static_cast<float>(out[d]);
  p.dsum[b * p.dsum_batch_stride + h * p.dsum_head_stride + row] = sum;
}

template <typename T, int kHeadDim>
__global__ void convert_dq_kernel(const Params p, int64_t total_rows) {
  const core::AttentionArgs& a = p.a;
  constexpr int kVec = 8;
  const int64_t vecs = a.head_dim / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total_rows * a.heads_q * vecs) return;
  const int64_t d = i % vecs * kVec, rh = i / vecs;
  const int64_t r = rh / a.heads_q, h = rh % a.heads_q;
  const int64_t b = r / a.rows_q, row = r % a.rows_q;
  const float* src = p.dq_accum + b * p.dq_accum_batch_stride + row * p.dq_accum_row_stride +
                     h * p.dq_accum_head_stride + d;
  T* dst = row_ptr<T>(a.dq, b, row, h) + d;
  const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
  uint4 packed;
  packed.x = Mma<T>::pack(lo.x, lo.y);
  packed.y = Mma<T>::pack(lo.z, lo.w);
  packed.z = Mma<T>::pack(hi.x, hi.y);
  packed.w = Mma<T>::pack(hi.z, hi.w);
  *reinterpret_cast<uint4*>(dst) = packed;
}

// Rows of a packed tensor outside [cu_seqlens[0], cu_seqlens[B]) belong to no sequence and no
// kernel visits them; without accumulate they are still written: zeros, and lse = -inf when an lse
// is given. Thread i: row i / heads, head i % heads.
template <typename T>
__global__ void clear_unused_rows_kernel(core::AttentionArgs::Operand o, float* lse, int64_t lse_head_stride,
                                         const int32_t* cu_seqlens, int64_t batch, int64_t rows, int64_t heads,
                                         int head_dim) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads) return;
  const int64_t r = i / heads, h = i % heads;
  if (r >= cu_seqlens[0] && r < cu_seqlens[batch]) return;
  T* row = static_cast<T*>(o.data) + r * o.row_stride + h * o.head_stride;
  for (int d = 0; d < head_dim; ++d) row[d] = T(0.0f);
  if (lse) lse[h * lse_head_stride + r] = -INFINITY;
}

// Atomically adds (x, y) to dst[0..1] (8-byte aligned): one vector reduction on sm_90.
__device__ __forceinline__ void add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// Elements col, col + 1 of a gradient row: rounded to T, or added to the fp32 gradient in
// accumulate mode.
template <typename T>
__device__ __forceinline__ void store_grad_pair(const core::AttentionArgs& a, const core::AttentionArgs::Operand& o,
                                                int64_t b, int64_t row, int64_t h, int col, float x, float y) {
  if (!a.accumulate) {
    *reinterpret_cast<uint32_t*>(row_ptr<T>(o, b, row, h) + col) = Mma<T>::pack(x, y);
  } else {
    float2* g = reinterpret_cast<float2*>(row_ptr<float>(o, b, row, h) + col);
    const float2 old = *g;
    *g = make_float2(old.x + x, old.y + y);
  }
}

// lse in log2 units for P = exp2(s2 - lse2): +inf for rows that see nothing or lie past the
// sequence, so that their P is 0 rather than NaN.
__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

template <typename T, int kHeadDim>
struct Backward {
  static constexpr BackwardTiles kTiles = backward_tiles(kHeadDim);
  static constexpr int kBlockM = kTiles.block_m, kBlockN = kTiles.block_n, kWarps = kTiles.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kTiles.stages;
  static constexpr int kPartDim = kHeadDim / kTiles.dim_parts;  // dK/dV columns of one block
  static constexpr int kQT = kBlockM / 8;                       // n-tiles of S^T (queries)
  static constexpr int kDT = kPartDim / 8;                      // n-tiles of dK, dV
  static constexpr int kDqMT = kBlockM / 16;                    // m-tiles of dQ, one per warp row
  static constexpr int kDqParts = kWarps / kDqMT;               // warps across dQ's columns
  static constexpr int kDqDim = kPartDim / kDqParts;
  static_assert(kBlockN == 16 * kWarps, "each warp owns 16 keys");
  static_assert(kWarps % kDqMT == 0 && kPartDim % (16 * kDqParts) == 0, "dQ tiles split evenly over warps");
  using KTile = Tile<kBlockN, kHeadDim>;
  using QTile = Tile<kBlockM, kHeadDim>;
  using STile = Tile<kBlockN, kBlockM>;  // dS^T, [key][query]
  // Tiles, then per stage the lse (log2 units) and dsum of the tile's query rows.
  static constexpr int kSmemBytes =
      (2 * KTile::kElements + 2 * kStages * QTile::kElements + STile::kElements) * 2 + 2 * kStages * kBlockM * 4;

  static __device__ void run(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    T* sk = reinterpret_cast<T*>(smem);
    T* sv = sk + KTile::kElements;
    T* sq = sv + KTile::kElements;               // kStages tiles
    T* sdo = sq + kStages * QTile::kElements;    // kStages tiles
    T* sds = sdo + kStages * QTile::kElements;
    float* srow = reinterpret_cast<float*>(sds + STile::kElements);  // [stage][lse2 | dsum][kBlockM]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, key_row0 = warp * 16;
    const auto k_lanes = KTile::a_lanes(smem_address(sk), lane);
    const auto v_lanes = KTile::a_lanes(smem_address(sv), lane);
    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int hk = blockIdx.y;
    const int part = blockIdx.x % kTiles.dim_parts;
    const int part0 = part * kPartDim;
    const core::Sequence seq = core::sequence(a, b);
    const int64_t n0 = static_cast<int64_t>(blockIdx.x / kTiles.dim_parts) * kBlockN;
    if (n0 >= seq.len_k) return;
    const int valid_n = static_cast<int>(seq.len_k - n0 < kBlockN ? seq.len_k - n0 : kBlockN);

    const core::Mask mask = p.mask();
    const int64_t pk0 = seq.pos_k + n0;
    int64_t first, last;
    mask.query_span(pk0, pk0 + valid_n, seq.pos_q, seq.pos_q + seq.len_q, &first, &last);
    const int64_t m_begin = (first - seq.pos_q) / kBlockM;
    const int64_t m_tiles = last > first ? (last - seq.pos_q + kBlockM - 1) / kBlockM - m_begin : 0;
    const int64_t items = m_tiles * p.group;

    const T* k = row_ptr<const T>(a.k, b, seq.row_k + n0, hk);
    const T* v = row_ptr<const T>(a.v, b, seq.row_k + n0, hk);
    // Item i: q head hk * group + i / m_tiles, query tile m_begin + i % m_tiles.
    const auto item_head = [&](int64_t i) { return static_cast<int>(hk * p.group + i / m_tiles); };
    const auto item_q0 = [&](int64_t i) { return (m_begin + i % m_tiles) * kBlockM; };
    const auto load_item = [&](int64_t i, int stage) {
      const int h = item_head(i);
      const int64_t q0 = item_q0(i);
      const int rows = static_cast<int>(seq.len_q - q0 < kBlockM ? seq.len_q - q0 : kBlockM);
      const T* q = row_ptr<const T>(a.q, b, seq.row_q + q0, h);
      const T* dout = row_ptr<const T>(a.dout, b, seq.row_q + q0, h);
      QTile::template load<kThreads>(sq + stage * QTile::kElements, q, a.q.row_stride, rows, a.head_dim);
      QTile::template load<kThreads>(sdo + stage * QTile::kElements, dout, a.dout.row_stride, rows, a.head_dim);
      // Rows past the sequence get lse2 = +inf and dsum = 0, so their P and dS are 0.
      for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
        const int64_t row = seq.row_q + q0 + r;
        const bool valid = r < rows;
        srow[stage * 2 * kBlockM + r] = valid ? lse_log2(a.lse[p.lse_index(b, h, row)]) : INFINITY;
        srow[stage * 2 * kBlockM + kBlockM + r] =
            valid ? p.dsum[b * p.dsum_batch_stride + h * p.dsum_head_stride + row] : 0.0f;
      }
    };

    float dk[kDT][4] = {}, dv[kDT][4] = {};
    if (items > 0) {
      KTile::template load<kThreads>(sk, k, a.k.row_stride, valid_n, a.head_dim);
      KTile::template load<kThreads>(sv, v, a.v.row_stride, valid_n, a.head_dim);
      load_item(0, 0);
      cp_async_commit();
    }

    for (int64_t item = 0; item < items; ++item) {
      const int stage = kStages == 2 ? static_cast<int>(item % 2) : 0;
      cp_async_wait<0>();
      __syncthreads();  // this item's tiles have landed; every warp is done with the last dS^T
      if (kStages == 2 && item + 1 < items) {
        load_item(item + 1, 1 - stage);
        cp_async_commit();
      }
      const uint32_t stage_bytes = stage * QTile::kElements * 2;
      const auto q_lanes = QTile::b_lanes(smem_address(sq) + stage_bytes, lane);
      const auto do_lanes = QTile::b_lanes(smem_address(sdo) + stage_bytes, lane);
      const auto q_trans = QTile::b_trans_lanes(smem_address(sq) + stage_bytes, lane);
      const auto do_trans = QTile::b_trans_lanes(smem_address(sdo) + stage_bytes, lane);
      const int h = item_head(item);
      const int64_t q0 = item_q0(item);
      const int rows = static_cast<int>(seq.len_q - q0 < kBlockM ? seq.len_q - q0 : kBlockM);

      const float* lse2 = srow + stage * 2 * kBlockM;
      const float* dsum = lse2 + kBlockM;

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
      float st[kQT][4] = {}, dpt[kQT][4] = {};
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t ka[4], va[4];
        ldmatrix_x4(ka, k_lanes.at(key_row0, ks * 16));
        ldmatrix_x4(va, v_lanes.at(key_row0, ks * 16));
#pragma unroll
        for (int qp = 0; qp < kQT / 2; ++qp) {
          uint32_t qb[4], ob[4];
          ldmatrix_x4(qb, q_lanes.at(qp * 16, ks * 16));
          ldmatrix_x4(ob, do_lanes.at(qp * 16, ks * 16));
          Mma<T>::run(st[2 * qp], ka, qb[0], qb[1]);
          Mma<T>::run(st[2 * qp + 1], ka, qb[2], qb[3]);
          Mma<T>::run(dpt[2 * qp], va, ob[0], ob[1]);
          Mma<T>::run(dpt[2 * qp + 1], va, ob[2], ob[3]);
        }
      }

      // P^T and dS^T, rounded to T as the A fragments of the next products (half the registers
      // of fp32). Element (qt, i) is key key_row0 + lane / 4 + 8 (i / 2), query
      // 8 qt + 2 (lane % 4) + i % 2.
      const ScoreTransform f = p.score_transform(b, h);
      const bool alibi = a.alibi_slopes != nullptr;
      const int64_t pq0 = seq.pos_q + q0, d0 = pk0 - pq0;
      const bool partial = valid_n < kBlockN || rows < kBlockM ||
                           mask.classify(pq0, pq0 + rows, pk0, pk0 + valid_n) != core::BlockKind::kFull;
#pragma unroll
      for (int qt = 0; qt < kQT; ++qt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key_row0 + lane / 4 + (i / 2) * 8, col = qt * 8 + (lane % 4) * 2 + i % 2;
          const int64_t d = d0 + key - col;
          const bool visible = !partial || (key < valid_n && col < rows && d >= -mask.left && d <= mask.right);
          float pv, ds;
          f.gradient(st[qt][i], dpt[qt][i], lse2[col], dsum[col], alibi, d, &pv, &ds);
          st[qt][i] = visible ? pv : 0.0f;
          dpt[qt][i] = visible ? ds : 0.0f;
        }
      uint32_t pa[kBlockM / 16][4], da[kBlockM / 16][4];
#pragma unroll
      for (int qs = 0; qs < kBlockM / 16; ++qs) {
        accumulators_to_a<T>(pa[qs], st[2 * qs], st[2 * qs + 1]);
        accumulators_to_a<T>(da[qs], dpt[2 * qs], dpt[2 * qs + 1]);
      }

      // dV += P^T dO and dK += dS^T Q over this block's columns.
#pragma unroll
      for (int qs = 0; qs < kBlockM / 16; ++qs) {
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          uint32_t ob[4], qb[4];
          ldmatrix_x4_trans(ob, do_trans.at(qs * 16, part0 + dp * 16));
          ldmatrix_x4_trans(qb, q_trans.at(qs * 16, part0 + dp * 16));
          Mma<T>::run(dv[2 * dp], pa[qs], ob[0], ob[1]);
          Mma<T>::run(dv[2 * dp + 1], pa[qs], ob[2], ob[3]);
          Mma<T>::run(dk[2 * dp], da[qs], qb[0], qb[1]);
          Mma<T>::run(dk[2 * dp + 1], da[qs], qb[2], qb[3]);
        }
      }

      // dS^T to shared memory for dQ: da[qs] holds (key g, queries 16 qs + 2t..), (g + 8, same),
      // (g, 16 qs + 8 + 2t..), (g + 8, same).
      if (!p.deterministic) {
#pragma unroll
        for (int qs = 0; qs < kBlockM / 16; ++qs)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int key = key_row0 + lane / 4 + (j % 2) * 8, col = qs * 16 + (j / 2) * 8 + (lane % 4) * 2;
            *reinterpret_cast<uint32_t*>(sds + STile::offset(key, col)) = da[qs][j];
          }
      }
      __syncthreads();  // dS^T is in shared memory; every warp is done with this item's q and dout
      if (kStages == 1 && item + 1 < items) {
        load_item(item + 1, 0);
        cp_async_commit();
      }
      if (!p.deterministic) accumulate_dq(p, b, h, seq.row_q + q0, rows, part0, smem_address(sds), smem_address(sk), lane, warp);
    }

    write_dkdv(p, b, hk, seq.row_k + n0, valid_n, part0, dk, dv, lane, key_row0);
  }

  // dQ += dS K for one query tile, added with atomics to the fp32 accumulator. Warp w owns
  // m-tile w % kDqMT and columns part0 + (w / kDqMT) * kDqDim onwards.
  static __device__ __forceinline__ void accumulate_dq(const Params& p, int64_t b, int h, int64_t row0, int rows,
                                                       int part0, uint32_t sds_addr, uint32_t sk_addr, int lane,
                                                       int warp) {
    const int mt = warp % kDqMT, col0 = part0 + warp / kDqMT * kDqDim;
    const auto ds_lanes = STile::a_trans_lanes(sds_addr, lane);
    const auto k_lanes = KTile::b_trans_lanes(sk_addr, lane);
    // Two accumulator sets, for even and odd k-steps: twice the independent products in flight,
    // since each chain waits for the previous product's result. Wide dQ tiles (head dim 256)
    // already have enough, and no registers to spare.
    constexpr int kChains = kDqDim <= 64 ? 2 : 1;
    static_assert((kBlockN / 16) % kChains == 0, "k-steps split evenly over the chains");
    float dq[kChains][kDqDim / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t sa[4];
      ldmatrix_x4_trans(sa, ds_lanes.at(ks * 16, mt * 16));
#pragma unroll
      for (int dp = 0; dp < kDqDim / 16; ++dp) {
        uint32_t kb[4];
        ldmatrix_x4_trans(kb, k_lanes.at(ks * 16, col0 + dp * 16));
        Mma<T>::run(dq[ks % kChains][2 * dp], sa, kb[0], kb[1]);
        Mma<T>::run(dq[ks % kChains][2 * dp + 1], sa, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int c = 1; c < kChains; ++c)
#pragma unroll
      for (int dt = 0; dt < kDqDim / 8; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) dq[0][dt][i] += dq[c][dt][i];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + lane / 4 + half * 8;
      if (r >= rows) continue;
      float* dst = p.dq_accum + b * p.dq_accum_batch_stride + (row0 + r) * p.dq_accum_row_stride +
                   h * p.dq_accum_head_stride + col0 + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < kDqDim / 8; ++dt) {
        if (col0 + dt * 8 >= p.a.head_dim) break;
        add_pair(dst + dt * 8, dq[0][dt][2 * half], dq[0][dt][2 * half + 1]);
      }
    }
  }

  // Writes (or, in accumulate mode, adds) this warp's rows of dK and dV; dK, dV are zero for
  // keys that no query sees.
  static __device__ __forceinline__ void write_dkdv(const Params& p, int64_t b, int hk, int64_t row0, int valid_n,
                                                    int part0, const float (&dk)[kDT][4], const float (&dv)[kDT][4],
                                                    int lane, int key_row0) {
    const core::AttentionArgs& a = p.a;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key_row0 + lane / 4 + half * 8;
      if (key >= valid_n) continue;
      const int64_t row = row0 + key;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if (part0 + dt * 8 >= a.head_dim) break;
        const int col = part0 + dt * 8 + (lane % 4) * 2;
        store_grad_pair<T>(a, a.dk, b, row, hk, col, dk[dt][2 * half], dk[dt][2 * half + 1]);
        store_grad_pair<T>(a, a.dv, b, row, hk, col, dv[dt][2 * half], dv[dt][2 * half + 1]);
      }
    }
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Backward<T, kHeadDim>::kThreads, 1) backward_kernel(const Params p) {
  Backward<T, kHeadDim>::run(p);
}

// Deterministic dQ: one thread block per (query tile, q head, sequence); each warp owns 16 query
// rows and walks the visible key tiles, so every dQ element is summed in one fixed order.
template <typename T, int kHeadDim>
struct DqPass {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarps = 4, kThreads = kWarps * 32;
  static constexpr int kNT = kBlockN / 8, kDT = kHeadDim / 8;
  using QTile = Tile<kBlockM, kHeadDim>;
  using KTile = Tile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = (2 * QTile::kElements + 2 * KTile::kElements) * 2;

  static __device__ void run(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    T* sq = reinterpret_cast<T*>(smem);
    T* sdo = sq + QTile::kElements;
    T* sk = sdo + QTile::kElements;
    T* sv = sk + KTile::kElements;

    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int h = blockIdx.y;
    const core::Sequence seq = core::sequence(a, b);
    const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
    if (q0 >= seq.len_q) return;
    const int rows = static_cast<int>(seq.len_q - q0 < kBlockM ? seq.len_q - q0 : kBlockM);
    const int lane = threadIdx.x % 32, row0 = threadIdx.x / 32 * 16;
    const auto q_lanes = QTile::a_lanes(smem_address(sq), lane);
    const auto do_lanes = QTile::a_lanes(smem_address(sdo), lane);
    const auto k_lanes = KTile::b_lanes(smem_address(sk), lane);
    const auto v_lanes = KTile::b_lanes(smem_address(sv), lane);
    const auto k_trans = KTile::b_trans_lanes(smem_address(sk), lane);
    const core::Mask mask = p.mask();
    int64_t n_begin, n_end;
    key_tiles<kBlockN>(mask, seq, q0, rows, &n_begin, &n_end);

    const int64_t hk = h / p.group;
    const T* q = row_ptr<const T>(a.q, b, seq.row_q + q0, h);
    const T* dout = row_ptr<const T>(a.dout, b, seq.row_q + q0, h);
    const T* k = row_ptr<const T>(a.k, b, seq.row_k, hk);
    const T* v = row_ptr<const T>(a.v, b, seq.row_k, hk);
    const auto valid_keys = [&](int64_t n) {
      const int64_t left = seq.len_k - n * kBlockN;
      return static_cast<int>(left < kBlockN ? left : kBlockN);
    };
    const auto load_keys = [&](int64_t n) {
      KTile::template load<kThreads>(sk, k + n * kBlockN * a.k.row_stride, a.k.row_stride, valid_keys(n), a.head_dim);
      KTile::template load<kThreads>(sv, v + n * kBlockN * a.v.row_stride, a.v.row_stride, valid_keys(n), a.head_dim);
    };
    if (n_begin < n_end) {
      QTile::template load<kThreads>(sq, q, a.q.row_stride, rows, a.head_dim);
      QTile::template load<kThreads>(sdo, dout, a.dout.row_stride, rows, a.head_dim);
      load_keys(n_begin);
      cp_async_commit();
    }

    float lse2[2], dsum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + lane / 4 + half * 8;
      const int64_t row = seq.row_q + q0 + r;
      lse2[half] = r < rows ? lse_log2(a.lse[p.lse_index(b, h, row)]) : INFINITY;
      dsum[half] = r < rows ? p.dsum[b * p.dsum_batch_stride + h * p.dsum_head_stride + row] : 0.0f;
    }
    const ScoreTransform f = p.score_transform(b, h);
    const bool alibi = a.alibi_slopes != nullptr;
    float dq[kDT][4] = {};
    for (int64_t n = n_begin; n < n_end; ++n) {
      cp_async_wait<0>();
      __syncthreads();
      float s[kNT][4] = {}, dp[kNT][4] = {};
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t qa[4], oa[4];
        ldmatrix_x4(qa, q_lanes.at(row0, ks * 16));
        ldmatrix_x4(oa, do_lanes.at(row0, ks * 16));
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t kb[4], vb[4];
          ldmatrix_x4(kb, k_lanes.at(np * 16, ks * 16));
          ldmatrix_x4(vb, v_lanes.at(np * 16, ks * 16));
          Mma<T>::run(s[2 * np], qa, kb[0], kb[1]);
          Mma<T>::run(s[2 * np + 1], qa, kb[2], kb[3]);
          Mma<T>::run(dp[2 * np], oa, vb[0], vb[1]);
          Mma<T>::run(dp[2 * np + 1], oa, vb[2], vb[3]);
        }
      }
      const int valid_n = valid_keys(n);
      const int64_t pk0 = seq.pos_k + n * kBlockN, pq0 = seq.pos_q + q0, d0 = pk0 - pq0;
      const bool partial = valid_n < kBlockN || rows < kBlockM ||
                           mask.classify(pq0, pq0 + rows, pk0, pk0 + valid_n) != core::BlockKind::kFull;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = row0 + lane / 4 + (i / 2) * 8, col = nt * 8 + (lane % 4) * 2 + i % 2;
          const int64_t d = d0 + col - r;
          const bool visible = !partial || (col < valid_n && r < rows && d >= -mask.left && d <= mask.right);
          float pv, ds;
          f.gradient(s[nt][i], dp[nt][i], lse2[i / 2], dsum[i / 2], alibi, d, &pv, &ds);
          s[nt][i] = visible ? ds : 0.0f;
        }
      // dQ += dS K.
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t sa[4];
        accumulators_to_a<T>(sa, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
        for (int dp2 = 0; dp2 < kDT / 2; ++dp2) {
          uint32_t kb[4];
          ldmatrix_x4_trans(kb, k_trans.at(ks * 16, dp2 * 16));
          Mma<T>::run(dq[2 * dp2], sa, kb[0], kb[1]);
          Mma<T>::run(dq[2 * dp2 + 1], sa, kb[2], kb[3]);
        }
      }
      __syncthreads();  // every warp is done with K(n), V(n)
      if (n + 1 < n_end) {
        load_keys(n + 1);
        cp_async_commit();
      }
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + lane / 4 + half * 8;
      if (r >= rows) continue;
      const int64_t row = seq.row_q + q0 + r;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if (dt * 8 >= a.head_dim) break;
        store_grad_pair<T>(a, a.dq, b, row, h, dt * 8 + (lane % 4) * 2, dq[dt][2 * half], dq[dt][2 * half + 1]);
      }
    }
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(DqPass<T, kHeadDim>::kThreads, 1) dq_kernel(const Params p) {
  DqPass<T, kHeadDim>::run(p);
}

}  // namespace ringflash::cuda
