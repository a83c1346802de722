// The Hopper dQ kernel (sm_90a) of the head-dim-256 backward: one thread block per (query tile of
// 128 rows, q head, sequence), in core::TileOrder, warp-specialised like the forward. The backward
// kernel computes dK and dV by key tiles; this one dQ by query tiles, so that neither adds partial
// sums into memory: a key-stationary dQ at head dim 256 (blocks of 64 keys, as dK and dV need)
// moved 64 KB of fp32 atomics per item, and the L2's reductions bounded the whole backward.
//
//   - Warpgroup 0 is the producer: one thread loads Q and dO once, then K and V of each key tile
//     by TMA: K in two stages, V in one (shared memory: Q and dO 128 KB, K 64 KB, V 32 KB). V is
//     freed as soon as dP is in, K once dQ's product of its tile is.
//   - Warpgroups 1 and 2 are the consumers, 64 query rows each. Per key tile of 64:
//       dP = dO V^T and S = Q K^T    (wgmma m64n64k16, both operands from shared memory)
//       P and dS                     (element_gradient: mask, softcap, ALiBi, as every backward)
//       dQ += dS K                   (dS from registers, K read MN-major)
//     dQ's product of tile i runs on while tile i + 1's dP and S are issued; dQ stays in registers
//     and is written (or, in accumulate mode, added) once, scaled.
//
// Packed batches: K's rows past the sequence's end in its last tile are zeroed in shared memory
// before dQ = dS K (a zero dS would not cancel a NaN there); the mask hides the rest.
#pragma once

#include <cuda.h>

#include "../backward.cuh"
#include "forward.cuh"
#include "ptx.h"

namespace ringflash::cuda::sm90 {

// q and dout with boxes of the dQ kernel's query tile, k and v of its key tile (see Maps).
struct DqMaps {
  CUtensorMap q, dout, k, v;
};

template <typename T, int kHeadDim>
struct BackwardDq {
  static_assert(kHeadDim == 256, "the dQ kernel serves head dim 256");
  static constexpr int kConsumers = 2, kBlockM = 64 * kConsumers, kBlockN = 64, kKStages = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1), kConsumerWarps = 4 * kConsumers;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(fits_block_registers(kThreads, kProducerRegs, kConsumerRegs), "within the block's registers");
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKVBytes = kBlockN * kHeadDim * 2;
  // Q, dO; K's stages, V; + room to align to 1024.
  static constexpr int kSmemBytes = 2 * kQBytes + (kKStages + 1) * kKVBytes + 1024;
  static constexpr int kNT = kBlockN / 8;
  static_assert(kSmemBytes <= 227 * 1024, "within sm_90's shared memory per block");

  static __device__ void run(const Params& p, const DqMaps& maps, const core::TileOrder& order) {
    extern __shared__ unsigned char raw[];
    T* sq = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    T* sdo = sq + kBlockM * kHeadDim;
    T* sk = sdo + kBlockM * kHeadDim;  // kKStages tiles
    T* sv = sk + kKStages * kBlockN * kHeadDim;
    __shared__ uint64_t q_full, k_full[kKStages], k_empty[kKStages], v_full, v_empty;

    const core::AttentionArgs& a = p.a;
    const core::Mask mask = p.mask();
    const auto [b, q0, n_begin, h, rows, tiles, seq] =
        query_tile<kBlockM, kBlockN>(p, order, mask, blockIdx.y, blockIdx.x);
    if (rows == 0) return;
    const int tid = threadIdx.x, group = __shfl_sync(~0u, tid / 128, 0), lane = tid % 32;  // see the forward

    if (tid == 0) {
      mbarrier_init(&q_full, 1);
      for (int s = 0; s < kKStages; ++s) {
        mbarrier_init(&k_full[s], 1);
        mbarrier_init(&k_empty[s], kConsumerWarps);
      }
      mbarrier_init(&v_full, 1);
      mbarrier_init(&v_empty, kConsumerWarps);
      fence_barrier_init();
    }
    __syncthreads();

    if (group == 0) {
      setmaxnreg_dec<kProducerRegs>();
      if (tid == 0 && tiles > 0) {
        const int hk = h / p.group;
        const int64_t tb = a.cu_seqlens_q ? 0 : b;  // the maps' batch coordinate
        mbarrier_arrive_expect(&q_full, 2 * kQBytes);
        load_tile<kBlockM, kHeadDim>(sq, &maps.q, &q_full, seq.row_q + q0, h, tb);
        load_tile<kBlockM, kHeadDim>(sdo, &maps.dout, &q_full, seq.row_q + q0, h, tb);
        for (int i = 0; i < tiles; ++i) {
          const int stage = i % kKStages;
          const int64_t row = seq.row_k + (n_begin + i) * kBlockN;
          if (i >= kKStages) mbarrier_wait(&k_empty[stage], static_cast<uint32_t>(i / kKStages - 1) & 1u);
          mbarrier_arrive_expect(&k_full[stage], kKVBytes);
          load_tile<kBlockN, kHeadDim>(sk + stage * kBlockN * kHeadDim, &maps.k, &k_full[stage], row, hk, tb);
          if (i >= 1) mbarrier_wait(&v_empty, static_cast<uint32_t>(i - 1) & 1u);
          mbarrier_arrive_expect(&v_full, kKVBytes);
          load_tile<kBlockN, kHeadDim>(sv, &maps.v, &v_full, row, hk, tb);
        }
      }
    } else {
      setmaxnreg_inc<kConsumerRegs>();
      consume(p, b, h, seq, q0, rows, mask, n_begin, tiles, sq, sdo, sk, sv, q_full, k_full, k_empty, v_full, v_empty,
              group - 1, lane);
    }
  }

  static __device__ __forceinline__ void consume(const Params& p, int64_t b, int h, const core::Sequence& seq,
                                                 int64_t q0, int rows, const core::Mask& mask, int64_t n_begin,
                                                 int tiles, T* sq, T* sdo, T* sk, T* sv, uint64_t& q_full,
                                                 uint64_t (&k_full)[kKStages], uint64_t (&k_empty)[kKStages],
                                                 uint64_t& v_full, uint64_t& v_empty, int consumer, int lane) {
    const core::AttentionArgs& a = p.a;
    const int warp_row0 = consumer * 64 + (threadIdx.x % 128) / 32 * 16;
    const ScoreTransform f = p.score_transform(b, h);
    const bool alibi = a.alibi_slopes != nullptr;
    const bool plain = !alibi && p.softcap_log2 == 0.0f;
    const bool packed = a.cu_seqlens_k != nullptr;
    // This thread's two rows' statistics; the mask hides rows past the sequence.
    float lse2[2], dsum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row0 + lane / 4 + half * 8;
      const int64_t at = p.stat_index(b, h, seq.row_q + q0 + r);
      lse2[half] = r < rows ? p.lse2[at] : 0.0f;
      dsum[half] = r < rows ? p.dsum[at] : 0.0f;
    }
    float dq[kHeadDim / 2] = {};
    float s[kNT][4], dp[kNT][4];
    auto& s_flat = reinterpret_cast<float(&)[kNT * 4]>(s);
    auto& dp_flat = reinterpret_cast<float(&)[kNT * 4]>(dp);
    uint32_t da[kBlockN / 16][4];
    // This consumer's rows of Q and dO (operands A), K and V of stage 0 (operands B: K-major for S
    // and dP, K MN-major for dQ); a stage of K is kKVBytes further on.
    const uint64_t q_desc = k_major_desc(smem_u32(sq) + consumer * 64 * 128);
    const uint64_t do_desc = k_major_desc(smem_u32(sdo) + consumer * 64 * 128);
    const uint64_t k_desc = k_major_desc(smem_u32(sk)), v_desc = k_major_desc(smem_u32(sv));
    const uint64_t k_mn = mn_major_desc(smem_u32(sk), kBlockN * 128);

    if (tiles > 0) mbarrier_wait(&q_full, 0);
    for (int i = 0; i < tiles; ++i) {
      const int stage = i % kKStages;
      const int64_t n0 = (n_begin + i) * kBlockN;
      const int valid_n = tile_rows(seq.len_k, n0, kBlockN);
      mbarrier_wait(&k_full[stage], static_cast<uint32_t>(i / kKStages) & 1u);
      mbarrier_wait(&v_full, static_cast<uint32_t>(i) & 1u);
      if (packed && valid_n < kBlockN) {  // the sequence's last tile: K's rows past it, for dQ
        zero_rows<kBlockN, kHeadDim>(sk + stage * kBlockN * kHeadDim, valid_n, threadIdx.x - 128, 128 * kConsumers);
        named_barrier_sync(kZeroed, 128 * kConsumers);
      }
      keep(dq);
      keep(da);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, kBlockN>::template ss<0, 0>(dp_flat, k_step(do_desc, kBlockM, ks), k_step(v_desc, kBlockN, ks),
                                             ks > 0);
      wgmma_commit();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, kBlockN>::template ss<0, 0>(s_flat, k_step(q_desc, kBlockM, ks),
                                             k_step(advance(k_desc, stage * kKVBytes), kBlockN, ks), ks > 0);
      wgmma_commit();
      wgmma_wait<1>();  // dQ of tile i - 1, and dP
      keep(dp_flat);
      keep(dq);
      keep(da);
      if (lane == 0) {
        mbarrier_arrive(&v_empty);                                 // V(i) is free
        if (i > 0) mbarrier_arrive(&k_empty[(i - 1) % kKStages]);  // K(i - 1) is free
      }
      wgmma_wait<0>();  // S
      keep(s_flat);

      int tile_lane = lane;  // opaque, as in the forward
      asm volatile("" : "+r"(tile_lane));
      const TileMask tile(mask, seq.pos_k + n0 - (seq.pos_q + q0), rows, valid_n);
      with_tile_kind(!tile.whole(kBlockM, kBlockN), plain, [&](auto masked, auto plain_scores) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = warp_row0 + tile_lane / 4 + (e / 2) * 8, col = nt * 8 + (tile_lane % 4) * 2 + e % 2;
            element_gradient<decltype(masked)::value, decltype(plain_scores)::value>(
                f, tile, alibi, r, col, lse2[e / 2], dsum[e / 2], s[nt][e], dp[nt][e]);
          }
      });
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) accumulators_to_a<T>(da[ks], dp[2 * ks], dp[2 * ks + 1]);

      // dQ += dS K: 16 keys (two 8-row atoms of 1024 bytes) per step, K's column blocks kBlockN
      // rows apart.
      keep(dq);
      keep(da);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks)
        Wgmma<T, kHeadDim>::template rs<1>(dq, da[ks], advance(k_mn, stage * kKVBytes + ks * 2 * 1024), true);
      wgmma_commit();
    }
    wgmma_wait<0>();
    keep(dq);

    const float scale = p.softmax_scale;
    const int head_dim = static_cast<int>(a.head_dim);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row0 + lane / 4 + half * 8;
      if (r >= rows) continue;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        if (j * 8 >= head_dim) break;
        store_grad_pair<T>(a, a.dq, b, seq.row_q + q0 + r, h, j * 8 + (lane % 4) * 2, dq[4 * j + 2 * half] * scale,
                           dq[4 * j + 2 * half + 1] * scale);
      }
    }
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(BackwardDq<T, kHeadDim>::kThreads, 1)
    backward_dq_kernel(const __grid_constant__ Params p, const __grid_constant__ DqMaps maps, const core::TileOrder order) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  BackwardDq<T, kHeadDim>::run(p, maps, order);
#endif
}

}  // namespace ringflash::cuda::sm90
