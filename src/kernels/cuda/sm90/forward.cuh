// The Hopper forward kernel (sm_90a), first version: one thread block of two warpgroups per
// (query tile of 128 rows, head, sequence), each warpgroup owning 64 rows.
//
//   - Q, and K and V in two stages, arrive by TMA (128-byte-swizzled column blocks of 64 elements)
//     on mbarriers; thread 0 issues the copies of key tile n + 2 once both warpgroups are done with
//     tile n.
//   - S = Q K^T is wgmma m64n128k16 with both operands in shared memory; the online softmax is the
//     sm_80 kernel's (its fragments have the same layout); O += P V is wgmma with P in registers
//     and V read transposed from shared memory.
//   - The epilogue is the sm_80 kernel's write_output (accumulate mode included).
//
// Not yet: warp-specialised producers with setmaxnreg, ping-pong of the two warpgroups, softmax
// overlapped with the next S, a persistent scheduler; packed batches (a TMA box cannot stop at a
// sequence's end, and the rows after it may hold anything), softcap and ALiBi (the sm_80 kernel
// runs those).
#pragma once

#include <cuda.h>

#include "../forward.cuh"
#include "ptx.h"

namespace ringflash::cuda::sm90 {

// q, k and v as 4-D tensor maps (head dim, heads, rows, batch), boxes of 64 columns x 1 head x
// 128 rows x 1, 128-byte swizzle; columns past the head dim and rows past the tensor read as 0.
struct Maps {
  CUtensorMap q, k, v;
};

template <typename T, int kHeadDim>
struct Forward {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr int kThreads = 256;  // two warpgroups of 64 rows
  static constexpr int kColumnBlock = 64;  // elements in a 128-byte swizzled row
  static constexpr int kColumnBlocks = kHeadDim / kColumnBlock;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;  // + room to align to 1024
  static constexpr int kNT = kBlockN / 8, kDT = kHeadDim / 8;
  static_assert(kHeadDim % kColumnBlock == 0 && kHeadDim <= 256, "whole column blocks");

  // Loads rows [row, row + rows of the box) of head h, sequence b into kColumnBlocks blocks.
  static __device__ __forceinline__ void load(T* dst, const CUtensorMap* map, uint64_t* bar, int64_t row, int h,
                                              int64_t b, int rows) {
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c)
      tma_load_4d(dst + c * rows * kColumnBlock, map, bar, c * kColumnBlock, h, static_cast<int>(row),
                  static_cast<int>(b));
  }

  static __device__ void run(const Params& p, const Maps& maps) {
    extern __shared__ unsigned char raw[];
    T* sq = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    T* sk = sq + kBlockM * kHeadDim;            // kStages tiles
    T* sv = sk + kStages * kBlockN * kHeadDim;  // kStages tiles
    __shared__ uint64_t q_full, k_full[kStages], v_full[kStages];

    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int h = blockIdx.y;
    const core::Sequence seq = core::sequence(a, b);
    // The last query tiles first, as in the sm_80 kernel.
    const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kBlockM;
    if (q0 >= seq.len_q) return;
    const int rows = tile_rows(seq.len_q, q0, kBlockM);
    const int tid = threadIdx.x, group = tid / 128, lane = tid % 32;
    const int warp_row0 = group * 64 + (tid % 128) / 32 * 16;

    const core::Mask mask = p.mask();
    int64_t n_begin, n_end;
    key_tiles<kBlockN>(mask, seq, q0, rows, &n_begin, &n_end);
    const int64_t tiles = n_end - n_begin;
    const int hk = h / p.group;
    const auto issue = [&](int stage, int64_t n) {
      mbarrier_arrive_expect(&k_full[stage], kKVBytes);
      load(sk + stage * kBlockN * kHeadDim, &maps.k, &k_full[stage], seq.row_k + n * kBlockN, hk, b, kBlockN);
      mbarrier_arrive_expect(&v_full[stage], kKVBytes);
      load(sv + stage * kBlockN * kHeadDim, &maps.v, &v_full[stage], seq.row_k + n * kBlockN, hk, b, kBlockN);
    };
    if (tid == 0) {
      mbarrier_init(&q_full, 1);
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(&k_full[s], 1);
        mbarrier_init(&v_full[s], 1);
      }
      fence_barrier_init();
    }
    __syncthreads();
    if (tid == 0 && tiles > 0) {
      mbarrier_arrive_expect(&q_full, kQBytes);
      load(sq, &maps.q, &q_full, seq.row_q + q0, h, b, kBlockM);
      for (int s = 0; s < kStages && s < tiles; ++s) issue(s, n_begin + s);
    }

    const ScoreTransform f = p.score_transform(b, h);
    const bool plain = p.softcap_log2 == 0.0f && p.qk_scale > 0.0f;
    float o[1][kDT][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {};
    auto& o_flat = reinterpret_cast<float(&)[kDT * 4]>(o);
    // This warpgroup's 64 rows of Q: 64 rows x 128 bytes further into each column block.
    const uint32_t q_base = smem_u32(sq) + group * 64 * 128;

    if (tiles > 0) mbarrier_wait(&q_full, 0);
    for (int64_t i = 0; i < tiles; ++i) {
      const int stage = static_cast<int>(i % kStages);
      const uint32_t phase = static_cast<uint32_t>(i / kStages) & 1u;
      const int64_t n = n_begin + i;
      const uint32_t k_base = smem_u32(sk + stage * kBlockN * kHeadDim);
      const uint32_t v_base = smem_u32(sv + stage * kBlockN * kHeadDim);

      mbarrier_wait(&k_full[stage], phase);
      float s[1][kNT][4];
      auto& s_flat = reinterpret_cast<float(&)[kNT * 4]>(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        // Column block ks / 4, then 32 bytes (16 elements) per k-step inside the 128-byte rows.
        const uint32_t column = (ks % 4) * 32;
        const uint64_t qd = k_major_desc(q_base + (ks / 4) * kBlockM * 128 + column);
        const uint64_t kd = k_major_desc(k_base + (ks / 4) * kBlockN * 128 + column);
        Wgmma<T, kBlockN>::template ss<0>(s_flat, qd, kd, ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      keep(s_flat);

      const int valid_n = tile_rows(seq.len_k, n * kBlockN, kBlockN);
      const int64_t pk0 = seq.pos_k + n * kBlockN, pq0 = seq.pos_q + q0;
      const bool partial = valid_n < kBlockN ||
                           mask.classify(pq0, pq0 + rows, pk0, pk0 + valid_n) != core::BlockKind::kFull;
      const bool raw_scores = !partial && plain;
      if (!raw_scores)
        transform_scores(s, f, false, partial, TileMask(mask, pk0 - pq0, kBlockM, valid_n), warp_row0, lane);
      online_softmax(s, o, row_max, row_sum, raw_scores ? p.qk_scale : 1.0f);

      uint32_t pa[kBlockN / 16][4];
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) accumulators_to_a<T>(pa[ps], s[0][2 * ps], s[0][2 * ps + 1]);

      mbarrier_wait(&v_full[stage], phase);
      keep(o_flat);
      keep(pa);
      wgmma_fence();
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) {
        // 16 keys = two 8-row atoms of 1024 bytes; the column blocks of V are kBlockN rows apart.
        const uint64_t vd = mn_major_desc(v_base + ps * 2 * 1024, kBlockN * 128);
        Wgmma<T, kHeadDim>::template rs<1>(o_flat, pa[ps], vd, true);
      }
      wgmma_commit();
      wgmma_wait<0>();
      keep(o_flat);

      __syncthreads();  // both warpgroups are done with this stage's K and V
      if (tid == 0 && i + kStages < tiles) issue(stage, n + kStages);
    }

    write_output<T>(p, b, h, seq, q0, rows, o, row_max, row_sum, lane, warp_row0);
  }
};

// Second version: warp-specialised. Warpgroup 0 is the producer (one thread issues every TMA
// copy; the warpgroup gives its registers up), warpgroups 1 and 2 the consumers of 64 rows each
// (240 registers). A consumer overlaps the softmax of key tile i with the P V product of tile
// i - 1: it issues S(i) = Q K(i)^T and O += P(i - 1) V(i - 1), waits for S(i), computes P(i) while
// the tensor cores run P V, then waits for that, rescales O and frees the stage of tile i - 1
// (an mbarrier that each consumer warp arrives on, which the producer waits for before reusing
// the stage). The two consumer warpgroups never wait for each other, so one's softmax runs under
// the other's products.
template <typename T, int kHeadDim>
struct ForwardWs {
  using Base = Forward<T, kHeadDim>;
  static constexpr int kBlockM = Base::kBlockM, kBlockN = Base::kBlockN;
  // A stage is freed when P V of its tile is done, one tile after its Q K^T: with three, the load
  // of tile i + 2 runs during all of tile i + 1 (with two it would wait at every tile).
  static constexpr int kStages = 3;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerWarps = 8;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kSmemBytes = Base::kQBytes + 2 * kStages * Base::kKVBytes + 1024;
  static constexpr int kNT = Base::kNT, kDT = Base::kDT;
  static_assert(kSmemBytes <= 227 * 1024, "within sm_90's shared memory per block");

  static __device__ void run(const Params& p, const Maps& maps) {
    extern __shared__ unsigned char raw[];
    T* sq = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    T* sk = sq + kBlockM * kHeadDim;
    T* sv = sk + kStages * kBlockN * kHeadDim;
    __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], empty[kStages];

    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.z;
    const int h = blockIdx.y;
    const core::Sequence seq = core::sequence(a, b);
    const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kBlockM;
    if (q0 >= seq.len_q) return;
    const int rows = tile_rows(seq.len_q, q0, kBlockM);
    const int tid = threadIdx.x, group = tid / 128, lane = tid % 32;
    const core::Mask mask = p.mask();
    int64_t n_begin, n_end;
    key_tiles<kBlockN>(mask, seq, q0, rows, &n_begin, &n_end);
    const int64_t tiles = n_end - n_begin;

    if (tid == 0) {
      mbarrier_init(&q_full, 1);
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(&k_full[s], 1);
        mbarrier_init(&v_full[s], 1);
        mbarrier_init(&empty[s], kConsumerWarps);
      }
      fence_barrier_init();
    }
    __syncthreads();

    if (group == 0) {
      setmaxnreg_dec<kProducerRegs>();
      if (tid == 0 && tiles > 0) {
        const int hk = h / p.group;
        mbarrier_arrive_expect(&q_full, Base::kQBytes);
        Base::load(sq, &maps.q, &q_full, seq.row_q + q0, h, b, kBlockM);
        for (int64_t i = 0; i < tiles; ++i) {
          const int stage = static_cast<int>(i % kStages);
          if (i >= kStages) mbarrier_wait(&empty[stage], static_cast<uint32_t>(i / kStages - 1) & 1u);
          const int64_t row = seq.row_k + (n_begin + i) * kBlockN;
          mbarrier_arrive_expect(&k_full[stage], Base::kKVBytes);
          Base::load(sk + stage * kBlockN * kHeadDim, &maps.k, &k_full[stage], row, hk, b, kBlockN);
          mbarrier_arrive_expect(&v_full[stage], Base::kKVBytes);
          Base::load(sv + stage * kBlockN * kHeadDim, &maps.v, &v_full[stage], row, hk, b, kBlockN);
        }
      }
    } else {
      setmaxnreg_inc<kConsumerRegs>();
      consume(p, b, h, seq, q0, rows, mask, n_begin, tiles, sq, sk, sv, q_full, k_full, v_full, empty, group - 1,
              lane);
    }
  }

  static __device__ __forceinline__ void consume(const Params& p, int64_t b, int h, const core::Sequence& seq,
                                                 int64_t q0, int rows, const core::Mask& mask, int64_t n_begin,
                                                 int64_t tiles, T* sq, T* sk, T* sv, uint64_t& q_full,
                                                 uint64_t (&k_full)[kStages], uint64_t (&v_full)[kStages],
                                                 uint64_t (&empty)[kStages], int consumer, int lane) {
    const int warp_row0 = consumer * 64 + (threadIdx.x % 128) / 32 * 16;
    const ScoreTransform f = p.score_transform(b, h);
    const bool plain = p.softcap_log2 == 0.0f && p.qk_scale > 0.0f;
    float o[1][kDT][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {};
    auto& o_flat = reinterpret_cast<float(&)[kDT * 4]>(o);
    float s[1][kNT][4];
    auto& s_flat = reinterpret_cast<float(&)[kNT * 4]>(s);
    uint32_t pa[kBlockN / 16][4];
    const uint32_t q_base = smem_u32(sq) + consumer * 64 * 128;
    const auto stage_of = [](int64_t i) { return static_cast<int>(i % kStages); };
    const auto phase_of = [](int64_t i) { return static_cast<uint32_t>(i / kStages) & 1u; };

    // S(i) = Q K(i)^T, issued and committed as one group.
    const auto issue_qk = [&](int64_t i) {
      const uint32_t k_base = smem_u32(sk + stage_of(i) * kBlockN * kHeadDim);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint32_t column = (ks % 4) * 32;
        const uint64_t qd = k_major_desc(q_base + (ks / 4) * kBlockM * 128 + column);
        const uint64_t kd = k_major_desc(k_base + (ks / 4) * kBlockN * 128 + column);
        Wgmma<T, kBlockN>::template ss<0>(s_flat, qd, kd, ks > 0);
      }
      wgmma_commit();
    };
    // O += P(i) V(i), issued and committed as one group.
    const auto issue_pv = [&](int64_t i) {
      const uint32_t v_base = smem_u32(sv + stage_of(i) * kBlockN * kHeadDim);
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps)
        Wgmma<T, kHeadDim>::template rs<1>(o_flat, pa[ps], mn_major_desc(v_base + ps * 2 * 1024, kBlockN * 128), true);
      wgmma_commit();
    };
    // The mask and softmax of S(i) into P(i) (in s); the correction O needs once P(i - 1) V is in.
    const auto softmax = [&](int64_t i, float (&correction)[1][2]) {
      const int64_t n = n_begin + i;
      const int valid_n = tile_rows(seq.len_k, n * kBlockN, kBlockN);
      const int64_t pk0 = seq.pos_k + n * kBlockN, pq0 = seq.pos_q + q0;
      const bool partial = valid_n < kBlockN ||
                           mask.classify(pq0, pq0 + rows, pk0, pk0 + valid_n) != core::BlockKind::kFull;
      const bool raw_scores = !partial && plain;
      if (!raw_scores)
        transform_scores(s, f, false, partial, TileMask(mask, pk0 - pq0, kBlockM, valid_n), warp_row0, lane);
      return softmax_tile(s, row_max, row_sum, raw_scores ? p.qk_scale : 1.0f, correction);
    };
    const auto to_a = [&] {
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) accumulators_to_a<T>(pa[ps], s[0][2 * ps], s[0][2 * ps + 1]);
    };

    if (tiles > 0) {
      mbarrier_wait(&q_full, 0);
      mbarrier_wait(&k_full[0], 0);
      wgmma_fence();
      issue_qk(0);
      wgmma_wait<0>();
      keep(s_flat);
      float correction[1][2];
      softmax(0, correction);  // O is still zero: nothing to rescale
      to_a();
    }
    for (int64_t i = 1; i < tiles; ++i) {
      mbarrier_wait(&k_full[stage_of(i)], phase_of(i));
      mbarrier_wait(&v_full[stage_of(i - 1)], phase_of(i - 1));
      keep(o_flat);
      keep(pa);
      wgmma_fence();
      issue_qk(i);
      issue_pv(i - 1);
      wgmma_wait<1>();  // S(i) is in; P(i - 1) V runs on
      keep(s_flat);
      float correction[1][2];
      const bool moved = softmax(i, correction);
      wgmma_wait<0>();
      keep(o_flat);
      keep(pa);
      if (lane == 0) mbarrier_arrive(&empty[stage_of(i - 1)]);  // K(i - 1) and V(i - 1) are free
      if (moved) rescale(o, correction);
      to_a();
    }
    if (tiles > 0) {
      mbarrier_wait(&v_full[stage_of(tiles - 1)], phase_of(tiles - 1));
      keep(o_flat);
      keep(pa);
      wgmma_fence();
      issue_pv(tiles - 1);
      wgmma_wait<0>();
      keep(o_flat);
    }
    write_output<T>(p, b, h, seq, q0, rows, o, row_max, row_sum, lane, warp_row0);
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Forward<T, kHeadDim>::kThreads, 1)
    forward_kernel(const __grid_constant__ Params p, const __grid_constant__ Maps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  Forward<T, kHeadDim>::run(p, maps);
#endif
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(ForwardWs<T, kHeadDim>::kThreads, 1)
    forward_ws_kernel(const __grid_constant__ Params p, const __grid_constant__ Maps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  ForwardWs<T, kHeadDim>::run(p, maps);
#endif
}

}  // namespace ringflash::cuda::sm90
