// The backward kernels.
//
//   dot_do_o   dsum = rowsum(dout * out) and the lse in log2 units, once per query row; zeros in
//              the workspace's dq accumulator.
//   Backward   one thread block per (key tile, k/v head, sequence): K and V stay in shared memory,
//              and the block walks every query tile that sees its keys, for every q head of its
//              group, so dK and dV are summed in registers and written once (GQA needs no
//              expanded buffers and dK/dV are deterministic). dQ = dS K goes to an fp32
//              accumulator with atomics, unless the backward is deterministic.
//   DqPass     deterministic dQ: one thread block per query tile walks the key tiles.
//   convert_dq dq = dq_accum, rounded to dq's dtype.
//
// Backward computes S^T = K Q^T and dP^T = V dO^T with each warp on 32 keys x half the query tile,
// so P^T and dS^T come out as A fragments of dV += P^T dO and dK += dS^T Q. Through shared memory
// the warp with the same keys and the other query half gets them too, and splits dK/dV's columns
// with it; dQ = dS K reads dS^T from there as well.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "../common/sequence.h"
#include "config.h"
#include "forward.cuh"
#include "params.h"
#include "tile.h"

namespace ringflash::cuda {

// lse in log2 units for P = exp2(s2 - lse2): +inf for rows that see nothing, so that their P is
// 0 rather than NaN.
__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// p and dS (short of the softmax scale) of one element of a tile, in place of its q.k and dp;
// 0 where the mask hides the element when kMasked.
template <bool kMasked, bool kPlain>
__device__ __forceinline__ void element_gradient(const ScoreTransform& f, const TileMask& tile, bool alibi, int query,
                                                 int key, float lse2, float dsum, float& s, float& dp) {
  float pv, ds;
  f.gradient<kPlain>(s, dp, lse2, dsum, alibi, kPlain ? 0.0f : tile.distance(query, key), &pv, &ds);
  const bool visible = !kMasked || tile.visible(query, key);
  s = visible ? pv : 0.0f;
  dp = visible ? ds : 0.0f;
}

// Calls body(std::integral_constant<bool, kMasked>, std::integral_constant<bool, kPlain>) with the
// constants of this tile, so that whole tiles and plain scores take their own unrolled code.
template <typename Body>
__device__ __forceinline__ void with_tile_kind(bool masked, bool plain, Body&& body) {
  using std::integral_constant;
  if (masked) {
    if (plain) body(integral_constant<bool, true>(), integral_constant<bool, true>());
    else body(integral_constant<bool, true>(), integral_constant<bool, false>());
  } else {
    if (plain) body(integral_constant<bool, false>(), integral_constant<bool, true>());
    else body(integral_constant<bool, false>(), integral_constant<bool, false>());
  }
}

// Eight consecutive elements of T as loaded (16-byte aligned), read as floats only once used, so
// that a thread's loads are all in flight before it waits for the first.
template <typename T>
struct Chunk8 {
  uint4 raw[sizeof(T) / 2];
  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int i = 0; i < sizeof(T) / 2; ++i) raw[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  __device__ __forceinline__ float operator[](int i) const {
    return static_cast<float>(reinterpret_cast<const T*>(raw)[i]);
  }
};

// dsum and lse2 of kDotRows consecutive query rows of one head per group of kDotLanes threads,
// each of which reads eight columns of each row in 16-byte loads, every load of the group's rows
// issued before the first sum. The grid is (rows / kDotRowsPerBlock, heads, sequences; a packed
// batch is one sequence of rows_q rows), so that no thread divides, neighbouring groups read and
// write neighbouring entries of lse and of the statistics, and a warp writes 32 bytes of each.
// (With one row per group, two loads per thread and the row and head from 64-bit divisions of the
// thread's index, the pass took 51 us where this one takes 42 on an H200: bench/NOTES.md h59.) Its
// blocks let the Hopper backward kernel, launched after it with programmatic stream serialization,
// start on the SMs that its last blocks leave idle.
template <int kHeadDim>
constexpr int kDotLanes = kHeadDim / 8 < 16 ? kHeadDim / 8 : 16;
template <int kHeadDim>
constexpr int kDotRows = 4 * kDotLanes<kHeadDim> * 8 / kHeadDim;
constexpr int kDotThreads = 256;
template <int kHeadDim>
constexpr int kDotRowsPerBlock = kDotThreads / kDotLanes<kHeadDim> * kDotRows<kHeadDim>;

template <typename T, typename TOut, int kHeadDim>
__global__ void __launch_bounds__(kDotThreads) dot_do_o_kernel(const Params p) {
  launch_dependents();
  constexpr int kLanes = kDotLanes<kHeadDim>, kRows = kDotRows<kHeadDim>, kSteps = kHeadDim / (kLanes * 8);
  static_assert(32 % kLanes == 0, "a group of lanes stays inside a warp");
  static_assert(kRows <= kLanes, "a lane writes each row");
  const core::AttentionArgs& a = p.a;
  const int lane = threadIdx.x % kLanes;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * (kDotThreads / kLanes) + threadIdx.x / kLanes) * kRows;
  // The first of the eight columns that this lane reads in step s, and whether it is inside the
  // head dim. Rows past the sequence read its row 0 and write nothing; columns past the head dim
  // read column 0 and add nothing.
  int col[kSteps];
  bool inside[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    col[s] = (s * kLanes + lane) * 8;
    inside[s] = col[s] < a.head_dim;
  }
  Chunk8<T> x[kRows][kSteps];
  Chunk8<TOut> y[kRows][kSteps];
  const T* dout = row_ptr<const T>(a.dout, b, 0, h);
  const TOut* out = row_ptr<const TOut>(a.out, b, 0, h);
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const int64_t row = row0 + j < a.rows_q ? row0 + j : 0;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int d = inside[s] ? col[s] : 0;
      x[j][s].load(dout + row * a.dout.row_stride + d);
      y[j][s].load(out + row * a.out.row_stride + d);
    }
  }
  // Lane j writes row j's statistics; its lse is loaded with the rows.
  const int64_t own_row = row0 + lane;
  const bool writes = lane < kRows && own_row < a.rows_q;
  const float lse = a.lse[p.lse_index(b, h, writes ? own_row : 0)];
  // The workspace's dq accumulator (p.dq_done set): zeros in this group's rows, the columns each
  // lane reads, while its loads are in flight; blocks (0, h < heads_kv, b) zero the counts.
  if (p.dq_done) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (row0 + j >= a.rows_q) continue;
      float* acc = p.dq_accum + b * p.dq_accum_batch_stride + (row0 + j) * p.dq_accum_row_stride +
                   h * p.dq_accum_head_stride;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        if (!inside[s]) continue;
        reinterpret_cast<float4*>(acc + col[s])[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        reinterpret_cast<float4*>(acc + col[s])[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && h < a.heads_kv) p.dq_done[b * a.heads_kv + h] = 0;
  }
  float sum[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    sum[j] = 0.0f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      float part = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) part = fmaf(x[j][s][e], y[j][s][e], part);
      // A select, not a branch: under a branch the compiler sinks the loads to their use.
      sum[j] += inside[s] ? part : 0.0f;
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], offset);
  }
  float own_sum = sum[0];
#pragma unroll
  for (int j = 1; j < kRows; ++j) own_sum = lane == j ? sum[j] : own_sum;
  if (writes) {
    p.dsum[p.stat_index(b, h, own_row)] = own_sum;
    p.lse2[p.stat_index(b, h, own_row)] = lse_log2(lse);
  }
}

// Rows of dq's fp32 accumulator per block of the conversion pass.
constexpr int kConvertRows = 64;

// dq from its fp32 accumulator: a block per kConvertRows rows, in the order (sequence, q head,
// rows); a packed batch is one sequence of rows_q rows. With `done` (Params::dq_done), the pass
// overlaps the end of the Hopper backward kernel (launch_convert_dq): each block first waits until
// the count of its sequence and k/v head is `expected`, and block 0 ends only once that kernel
// has, so that the pass is done only when the kernel's dK and dV are in too.
template <typename T, int kHeadDim>
__global__ void convert_dq_kernel(const Params p, const int* done, int expected) {
  const core::AttentionArgs& a = p.a;
  const int64_t chunks = (a.rows_q + kConvertRows - 1) / kConvertRows, block = blockIdx.x;
  const int64_t chunk = block % chunks, h = block / chunks % a.heads_q, s = block / chunks / a.heads_q;
  if (done) {
    if (threadIdx.x == 0) {
      const int* count = done + s * a.heads_kv + h / p.group;
      for (int seen = 0;; __nanosleep(256)) {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
        if (seen >= expected) break;
      }
    }
    __syncthreads();
  }
  constexpr int kVec = 8;
  const int64_t vecs = a.head_dim / kVec, row0 = chunk * kConvertRows;
  const int64_t n = (a.rows_q - row0 < kConvertRows ? a.rows_q - row0 : kConvertRows) * vecs;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t row = row0 + i / vecs, d = i % vecs * kVec;
    const float* src = p.dq_accum + s * p.dq_accum_batch_stride + row * p.dq_accum_row_stride +
                       h * p.dq_accum_head_stride + d;
    const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
    uint4 packed;
    packed.x = Mma<T>::pack(lo.x, lo.y);
    packed.y = Mma<T>::pack(lo.z, lo.w);
    packed.z = Mma<T>::pack(hi.x, hi.y);
    packed.w = Mma<T>::pack(hi.z, hi.w);
    *reinterpret_cast<uint4*>(row_ptr<T>(a.dq, s, row, h) + d) = packed;
  }
  if (done && block == 0) wait_prerequisites();
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

// Adds scale * c, a 16 x 8 accumulator fragment (lane (g, t) holds rows g and g + 8, columns 2t and
// 2t + 1), to the fp32 tile at dst. (Lane pairs that swap halves over a shuffle to add four floats
// at once measured slower on an H100: the shuffles and selects cost more than the reductions.)
__device__ __forceinline__ void add_tile_16x8(float* dst, int row_stride, const float (&c)[4], float scale, int lane) {
  float* at = dst + (lane / 4) * row_stride + (lane % 4) * 2;
  add_pair(at, c[0] * scale, c[1] * scale);
  add_pair(at + 8 * row_stride, c[2] * scale, c[3] * scale);
}

// Elements col, col + 1 of a gradient row: rounded to T, or in accumulate mode added to the fp32
// gradient (written instead where `add` is false: dK and dV with overwrite_dkdv).
template <typename T>
__device__ __forceinline__ void store_grad_pair(const core::AttentionArgs& a, const core::AttentionArgs::Operand& o,
                                                int64_t b, int64_t row, int64_t h, int col, float x, float y,
                                                bool add = true) {
  if (!a.accumulate) {
    *reinterpret_cast<uint32_t*>(row_ptr<T>(o, b, row, h) + col) = Mma<T>::pack(x, y);
  } else if (!add) {
    *reinterpret_cast<float2*>(row_ptr<float>(o, b, row, h) + col) = make_float2(x, y);
  } else {
    float2* g = reinterpret_cast<float2*>(row_ptr<float>(o, b, row, h) + col);
    const float2 old = *g;
    *g = make_float2(old.x + x, old.y + y);
  }
}

template <typename T, int kHeadDim>
struct Backward {
  static constexpr BackwardTiles kTiles = backward_tiles(kHeadDim);
  static constexpr int kBlockM = kTiles.block_m, kBlockN = kTiles.block_n, kWarps = kTiles.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = kTiles.stages;
  static constexpr int kPartDim = kHeadDim / kTiles.dim_parts;  // dK/dV columns of one block
  // Warp w owns keys 32 (w % kKeyWarps) onwards. For S^T and dP^T it takes the query half
  // w / kKeyWarps of the tile, for dK and dV the same half of the block's columns.
  static constexpr int kKeyWarps = kBlockN / 32;
  static constexpr int kWarpQueries = kBlockM / 2;
  static constexpr int kWarpDim = kPartDim / 2;
  static constexpr int kQT = kWarpQueries / 8;  // n-tiles of a warp's S^T
  static constexpr int kQS = kWarpQueries / 16;  // its 16-query k-steps
  static constexpr int kDT = kWarpDim / 8;      // n-tiles of a warp's dK, dV
  // dQ: warp w owns query half w % 2 and columns kDqDim (w / 2) onwards of the part.
  static constexpr int kDqMT = kBlockM / 2 / 16;
  static constexpr int kDqDim = kPartDim / (kWarps / 2);
  static_assert(kWarps == 2 * kKeyWarps, "two warps per 32 keys");
  static_assert(kWarpQueries % 16 == 0 && kWarpDim % 16 == 0 && kDqDim % 16 == 0, "whole fragments per warp");
  using KTile = Tile<kBlockN, kHeadDim>;
  using QTile = Tile<kBlockM, kHeadDim>;
  using STile = Tile<kBlockN, kBlockM>;  // P^T and dS^T, [key][query]
  // Tiles, then per stage the lse (log2 units) and dsum of the tile's query rows.
  static constexpr int kSmemBytes =
      (2 * KTile::kElements + 2 * kStages * QTile::kElements + 2 * STile::kElements) * 2 + 2 * kStages * kBlockM * 4;

  // A fragments of P^T and dS^T for a warp's two 16-key m-tiles over one 16-query k-step.
  struct Fragments {
    uint32_t p[2][4], ds[2][4];
  };

  static __device__ void run(const Params& p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    T* sk = reinterpret_cast<T*>(smem);
    T* sv = sk + KTile::kElements;
    T* sq = sv + KTile::kElements;               // kStages tiles
    T* sdo = sq + kStages * QTile::kElements;    // kStages tiles
    T* sp = sdo + kStages * QTile::kElements;
    T* sds = sp + STile::kElements;
    float* srow = reinterpret_cast<float*>(sds + STile::kElements);  // [stage][lse2 | dsum][kBlockM]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int key0 = warp % kKeyWarps * 32, half = warp / kKeyWarps;
    const int query0 = half * kWarpQueries, other_query0 = (1 - half) * kWarpQueries;
    // V follows K, dout follows q (kStages tiles on) and dS^T follows P^T in shared memory: each
    // pair shares its lane addresses, the second a constant further on.
    constexpr uint32_t kVOffset = KTile::kBytes, kDoutOffset = kStages * QTile::kBytes, kDsOffset = STile::kBytes;
    const auto k_lanes = KTile::a_lanes(smem_address(sk), lane);
    const auto p_lanes = STile::a_lanes(smem_address(sp), lane);
    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int hk = blockIdx.y;
    const int part0 = blockIdx.x % kTiles.dim_parts * kPartDim;
    const int col0 = part0 + half * kWarpDim;  // this warp's dK/dV columns
    const core::Sequence seq = core::sequence(a, b);
    const int64_t n0 = static_cast<int64_t>(blockIdx.x / kTiles.dim_parts) * kBlockN;
    if (n0 >= seq.len_k) return;
    const int valid_n = tile_rows(seq.len_k, n0, kBlockN);

    const core::Mask mask = p.mask();
    const int64_t pk0 = seq.pos_k + n0;
    int m_begin, m_end;
    query_tiles<kBlockM>(mask, seq, n0, valid_n, &m_begin, &m_end);
    const int h_end = (hk + 1) * p.group;

    const T* k = row_ptr<const T>(a.k, b, seq.row_k + n0, hk);
    const T* v = row_ptr<const T>(a.v, b, seq.row_k + n0, hk);
    // The block's items: query tiles [m_begin, m_end) of each q head of the group in turn.
    struct Item {
      int h, m;  // q head, query tile
    };
    const auto next = [&](Item i) { return i.m + 1 < m_end ? Item{i.h, i.m + 1} : Item{i.h + 1, m_begin}; };
    const auto load_item = [&](Item i, int stage) {
      const int h = i.h;
      const int64_t q0 = static_cast<int64_t>(i.m) * kBlockM;
      const int rows = tile_rows(seq.len_q, q0, kBlockM);
      const T* q = row_ptr<const T>(a.q, b, seq.row_q + q0, h);
      const T* dout = row_ptr<const T>(a.dout, b, seq.row_q + q0, h);
      QTile::template load<kThreads>(sq + stage * QTile::kElements, q, a.q.row_stride, rows, a.head_dim);
      QTile::template load<kThreads>(sdo + stage * QTile::kElements, dout, a.dout.row_stride, rows, a.head_dim);
      // Thread i < kBlockM copies lse2 of row i, the next kBlockM threads dsum; rows past the
      // sequence read as 0 and the tile's mask hides them.
      static_assert(kThreads >= 2 * kBlockM, "one row statistic per thread");
      const int t = threadIdx.x;
      if (t < 2 * kBlockM) {
        const int r = t % kBlockM;
        const bool valid = r < rows;
        const float* src = (t < kBlockM ? p.lse2 : p.dsum) + p.stat_index(b, h, seq.row_q + q0 + (valid ? r : 0));
        cp_async_4(smem_address(srow + stage * 2 * kBlockM + t), src, valid);
      }
    };

    float dk[2][kDT][4] = {}, dv[2][kDT][4] = {};
    Item item{hk * p.group, m_begin};
    if (m_begin == m_end) item.h = h_end;  // no query sees these keys
    if (item.h < h_end) {
      KTile::template load<kThreads>(sk, k, a.k.row_stride, valid_n, a.head_dim);
      KTile::template load<kThreads>(sv, v, a.v.row_stride, valid_n, a.head_dim);
      load_item(item, 0);
      cp_async_commit();
    }

    for (int stage = 0; item.h < h_end; item = next(item), stage = kStages == 2 ? stage ^ 1 : 0) {
      const Item following = next(item);
      cp_async_wait<0>();
      __syncthreads();  // this item's tiles have landed; every warp is done with the last P^T, dS^T
      if (kStages == 2 && following.h < h_end) {
        load_item(following, stage ^ 1);
        cp_async_commit();
      }
      const uint32_t stage_bytes = stage * QTile::kElements * 2;
      const auto q_lanes = QTile::b_lanes(smem_address(sq) + stage_bytes, lane);
      const int h = item.h;
      const int64_t q0 = static_cast<int64_t>(item.m) * kBlockM;
      const int rows = tile_rows(seq.len_q, q0, kBlockM);
      const float* lse2 = srow + stage * 2 * kBlockM;
      const float* dsum = lse2 + kBlockM;

      // S^T = K Q^T and dP^T = V dO^T for this warp's 32 keys and 32 queries.
      float st[2][kQT][4] = {}, dpt[2][kQT][4] = {};
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        uint32_t qb[kQS][4], ob[kQS][4];
#pragma unroll
        for (int qs = 0; qs < kQS; ++qs) {
          ldmatrix_x4(qb[qs], q_lanes.at_column_first(query0 + qs * 16, ks * 16));
          ldmatrix_x4(ob[qs], q_lanes.at_column_first(query0 + qs * 16, ks * 16) + kDoutOffset);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t ka[4], va[4];
          ldmatrix_x4(ka, k_lanes.at_column_first(key0 + mt * 16, ks * 16));
          ldmatrix_x4(va, k_lanes.at_column_first(key0 + mt * 16, ks * 16) + kVOffset);
#pragma unroll
          for (int qs = 0; qs < kQS; ++qs) {
            Mma<T>::run(st[mt][2 * qs], ka, qb[qs][0], qb[qs][1]);
            Mma<T>::run(st[mt][2 * qs + 1], ka, qb[qs][2], qb[qs][3]);
            Mma<T>::run(dpt[mt][2 * qs], va, ob[qs][0], ob[qs][1]);
            Mma<T>::run(dpt[mt][2 * qs + 1], va, ob[qs][2], ob[qs][3]);
          }
        }
      }

      // P^T and dS^T, rounded to T as A fragments (half the registers of fp32). Element
      // (mt, qt, i) is key key0 + 16 mt + lane / 4 + 8 (i / 2), query query0 + 8 qt + 2 (lane % 4) + i % 2.
      const ScoreTransform f = p.score_transform(b, h);
      const bool alibi = a.alibi_slopes != nullptr;
      const TileMask tile(mask, pk0 - (seq.pos_q + q0), rows, valid_n);  // rows are queries
      with_tile_kind(!tile.whole(kBlockM, kBlockN), !alibi && f.softcap_log2 == 0.0f, [&](auto masked, auto plain) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int qt = 0; qt < kQT; ++qt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int key = key0 + mt * 16 + lane / 4 + (i / 2) * 8;
              const int query = query0 + qt * 8 + (lane % 4) * 2 + i % 2;
              element_gradient<decltype(masked)::value, decltype(plain)::value>(
                  f, tile, alibi, query, key, lse2[query], dsum[query], st[mt][qt][i], dpt[mt][qt][i]);
            }
      });
      Fragments own[kQS];
#pragma unroll
      for (int qs = 0; qs < kQS; ++qs)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          accumulators_to_a<T>(own[qs].p[mt], st[mt][2 * qs], st[mt][2 * qs + 1]);
          accumulators_to_a<T>(own[qs].ds[mt], dpt[mt][2 * qs], dpt[mt][2 * qs + 1]);
        }

      // dV += P^T dO and dK += dS^T Q. This warp's own queries first, from registers: that needs
      // no other warp, so it overlaps the stores below and the wait for the slowest warp.
      const auto q_trans = QTile::b_trans_lanes(smem_address(sq) + stage_bytes, lane);
      const auto accumulate_kv = [&](const Fragments& fr, int query) {
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          uint32_t ob[4], qb[4];
          ldmatrix_x4_trans(ob, q_trans.at_column_first(query, col0 + dp * 16) + kDoutOffset);
          ldmatrix_x4_trans(qb, q_trans.at_column_first(query, col0 + dp * 16));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma<T>::run(dv[mt][2 * dp], fr.p[mt], ob[0], ob[1]);
            Mma<T>::run(dv[mt][2 * dp + 1], fr.p[mt], ob[2], ob[3]);
            Mma<T>::run(dk[mt][2 * dp], fr.ds[mt], qb[0], qb[1]);
            Mma<T>::run(dk[mt][2 * dp + 1], fr.ds[mt], qb[2], qb[3]);
          }
        }
      };

      // P^T and dS^T to shared memory: the warp with the other query half needs them for dK and
      // dV, every warp needs dS^T for dQ.
#pragma unroll
      for (int qs = 0; qs < kQS; ++qs) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          store_a<STile>(sp, key0 + mt * 16, query0 + qs * 16, own[qs].p[mt], lane);
          store_a<STile>(sds, key0 + mt * 16, query0 + qs * 16, own[qs].ds[mt], lane);
        }
        accumulate_kv(own[qs], query0 + qs * 16);
      }
      __syncthreads();  // P^T and dS^T are in shared memory

      // The other query half, from shared memory.
#pragma unroll
      for (int qs = 0; qs < kQS; ++qs) {
        const int query = other_query0 + qs * 16;
        Fragments other;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          ldmatrix_x4(other.p[mt], p_lanes.at_column_first(key0 + mt * 16, query));
          ldmatrix_x4(other.ds[mt], p_lanes.at_column_first(key0 + mt * 16, query) + kDsOffset);
        }
        accumulate_kv(other, query);
      }

      if (kStages == 1 && following.h < h_end) {
        __syncthreads();  // every warp is done with this item's q and dout
        load_item(following, 0);
        cp_async_commit();
      }
      if (!a.deterministic) accumulate_dq(p, b, h, seq.row_q + q0, rows, part0, smem_address(sds), smem_address(sk), lane, warp);
    }

    write_dkdv(p, b, hk, seq.row_k + n0, valid_n, col0, dk, dv, lane, key0);
  }

  // dQ += dS K for one query tile, added with atomics to the fp32 accumulator. Warp w owns query
  // rows kBlockM / 2 (w % 2) onwards and columns part0 + kDqDim (w / 2) onwards.
  static __device__ __forceinline__ void accumulate_dq(const Params& p, int64_t b, int h, int64_t row0, int rows,
                                                       int part0, uint32_t sds_addr, uint32_t sk_addr, int lane,
                                                       int warp) {
    const int m0 = warp % 2 * (kBlockM / 2), c0 = part0 + warp / 2 * kDqDim;
    const int head_dim = static_cast<int>(p.a.head_dim);
    const float scale = p.softmax_scale;
    const auto ds_lanes = STile::a_trans_lanes(sds_addr, lane);
    const auto k_lanes = KTile::b_trans_lanes(sk_addr, lane);
    float dq[kDqMT][kDqDim / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t sa[kDqMT][4];
#pragma unroll
      for (int mt = 0; mt < kDqMT; ++mt) ldmatrix_x4_trans(sa[mt], ds_lanes.at_column_first(ks * 16, m0 + mt * 16));
#pragma unroll
      for (int dp = 0; dp < kDqDim / 16; ++dp) {
        uint32_t kb[4];
        ldmatrix_x4_trans(kb, k_lanes.at_column_first(ks * 16, c0 + dp * 16));
#pragma unroll
        for (int mt = 0; mt < kDqMT; ++mt) {
          Mma<T>::run(dq[mt][2 * dp], sa[mt], kb[0], kb[1]);
          Mma<T>::run(dq[mt][2 * dp + 1], sa[mt], kb[2], kb[3]);
        }
      }
    }
    // One 64-bit address per tile, 32-bit offsets inside it (a tile's rows span far less than 2^31
    // elements).
    float* tile = p.dq_accum + b * p.dq_accum_batch_stride + row0 * p.dq_accum_row_stride +
                  h * p.dq_accum_head_stride + c0;
    const int row_stride = static_cast<int>(p.dq_accum_row_stride);
    if (rows == kBlockM && c0 + kDqDim <= head_dim) {
#pragma unroll
      for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
        for (int dt = 0; dt < kDqDim / 8; ++dt)
          add_tile_16x8(tile + (m0 + mt * 16) * row_stride + dt * 8, row_stride, dq[mt][dt], scale, lane);
      return;
    }
    // A tile that runs past the sequence or the head dim: element pairs, each checked.
#pragma unroll
    for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + mt * 16 + lane / 4 + half * 8;
        float* dst = tile + r * row_stride + (lane % 4) * 2;
#pragma unroll
        for (int dt = 0; dt < kDqDim / 8; ++dt)
          if (r < rows && c0 + dt * 8 < head_dim)
            add_pair(dst + dt * 8, dq[mt][dt][2 * half] * scale, dq[mt][dt][2 * half + 1] * scale);
      }
  }

  // Writes (or, in accumulate mode, adds unless overwrite_dkdv) this warp's part of dK and dV;
  // dK, dV are zero for keys that no query sees.
  static __device__ __forceinline__ void write_dkdv(const Params& p, int64_t b, int hk, int64_t row0, int valid_n,
                                                    int col0, const float (&dk)[2][kDT][4],
                                                    const float (&dv)[2][kDT][4], int lane, int key0) {
    const core::AttentionArgs& a = p.a;
    const int head_dim = static_cast<int>(a.head_dim);
    const float scale = p.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = key0 + mt * 16 + lane / 4 + half * 8;
        if (key >= valid_n) continue;
        const int64_t row = row0 + key;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          if (col0 + dt * 8 >= head_dim) break;
          const int col = col0 + dt * 8 + (lane % 4) * 2;
          store_grad_pair<T>(a, a.dk, b, row, hk, col, dk[mt][dt][2 * half] * scale, dk[mt][dt][2 * half + 1] * scale,
                             !a.overwrite_dkdv);
          store_grad_pair<T>(a, a.dv, b, row, hk, col, dv[mt][dt][2 * half], dv[mt][dt][2 * half + 1],
                             !a.overwrite_dkdv);
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
    const int rows = tile_rows(seq.len_q, q0, kBlockM);
    const int lane = threadIdx.x % 32, row0 = threadIdx.x / 32 * 16;
    // dout follows q and V follows K in shared memory: each pair shares its lane addresses.
    const auto q_lanes = QTile::a_lanes(smem_address(sq), lane);
    const auto k_lanes = KTile::b_lanes(smem_address(sk), lane);
    const auto k_trans = KTile::b_trans_lanes(smem_address(sk), lane);
    const core::Mask mask = p.mask();
    int64_t n_begin, n_end;
    key_tiles<kBlockN>(mask, seq, q0, rows, &n_begin, &n_end);

    const int64_t hk = h / p.group;
    const T* q = row_ptr<const T>(a.q, b, seq.row_q + q0, h);
    const T* dout = row_ptr<const T>(a.dout, b, seq.row_q + q0, h);
    const T* k = row_ptr<const T>(a.k, b, seq.row_k, hk);
    const T* v = row_ptr<const T>(a.v, b, seq.row_k, hk);
    const auto valid_keys = [&](int64_t n) { return tile_rows(seq.len_k, n * kBlockN, kBlockN); };
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
      lse2[half] = r < rows ? p.lse2[p.stat_index(b, h, row)] : 0.0f;  // the mask hides rows past the end
      dsum[half] = r < rows ? p.dsum[p.stat_index(b, h, row)] : 0.0f;
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
        ldmatrix_x4(qa, q_lanes.at_column_first(row0, ks * 16));
        ldmatrix_x4(oa, q_lanes.at_column_first(row0, ks * 16) + QTile::kBytes);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t kb[4], vb[4];
          ldmatrix_x4(kb, k_lanes.at_column_first(np * 16, ks * 16));
          ldmatrix_x4(vb, k_lanes.at_column_first(np * 16, ks * 16) + KTile::kBytes);
          Mma<T>::run(s[2 * np], qa, kb[0], kb[1]);
          Mma<T>::run(s[2 * np + 1], qa, kb[2], kb[3]);
          Mma<T>::run(dp[2 * np], oa, vb[0], vb[1]);
          Mma<T>::run(dp[2 * np + 1], oa, vb[2], vb[3]);
        }
      }
      const TileMask tile(mask, seq.pos_k + n * kBlockN - (seq.pos_q + q0), rows, valid_keys(n));
      with_tile_kind(!tile.whole(kBlockM, kBlockN), !alibi && f.softcap_log2 == 0.0f, [&](auto masked, auto plain) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = row0 + lane / 4 + (i / 2) * 8, col = nt * 8 + (lane % 4) * 2 + i % 2;
            element_gradient<decltype(masked)::value, decltype(plain)::value>(f, tile, alibi, r, col, lse2[i / 2],
                                                                               dsum[i / 2], s[nt][i], dp[nt][i]);
          }
      });
      // dQ += dS K (dS is in dp).
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t sa[4];
        accumulators_to_a<T>(sa, dp[2 * ks], dp[2 * ks + 1]);
#pragma unroll
        for (int dp2 = 0; dp2 < kDT / 2; ++dp2) {
          uint32_t kb[4];
          ldmatrix_x4_trans(kb, k_trans.at_column_first(ks * 16, dp2 * 16));
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
        store_grad_pair<T>(a, a.dq, b, row, h, dt * 8 + (lane % 4) * 2, dq[dt][2 * half] * p.softmax_scale,
                           dq[dt][2 * half + 1] * p.softmax_scale);
      }
    }
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(DqPass<T, kHeadDim>::kThreads, 1) dq_kernel(const Params p) {
  DqPass<T, kHeadDim>::run(p);
}

}  // namespace ringflash::cuda
