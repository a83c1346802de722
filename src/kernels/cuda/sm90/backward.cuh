// The Hopper backward kernel (sm_90a): one thread block per (key tile of 128 keys, 64 at head dim
// 256, k/v head, sequence), in core::TileOrder, warp-specialised like the forward. dsum, lse2, dq's
// conversion and the rows of no sequence are the sm_80 backward's passes (../backward.cuh); this
// kernel replaces its main one.
//
//   - Warpgroup 0 is the producer (24 registers): one thread loads K and V once, then for each
//     item (a query tile of 64 rows, 128 at head dim 64, for each q head of the group in turn) Q
//     and dO, and the rows' lse2 and dsum, into stages (three at head dim 128, two otherwise) by
//     TMA on mbarriers.
//   - Warpgroups 1 and 2 are the consumers (240 registers), 64 keys each. Per item, with wgmma:
//       S^T = K Q^T and dP^T = V dO^T      (64 keys x the tile's queries, both operands K-major)
//       P^T, dS^T                          (the sm_80 backward's element_gradient: mask, softcap, ALiBi)
//       dV += P^T dO                       (P^T from registers, dO read MN-major)
//       a 64 x 64 block of dQ = dS K       (over all 128 keys: dS^T of both consumers through
//                                          shared memory, read transposed; see kDq)
//       dK += dS^T Q                       (dS^T from registers, at head dim 128 from shared
//                                          memory; Q read MN-major)
//     and adds its part of dQ to the fp32 accumulator by TMA reduce-adds from shared memory, one
//     bulk copy per 32 columns instead of an atomic per element pair. dS^T is converted and
//     stored under dV's products, dQ under dK's; at head dim 128 the next item's S^T is issued
//     under dK's products too (kPipelined).
//   - dK and dV stay in registers over every item and are written once at the end: a whole key
//     tile's by TMA from shared memory (dV through the consumer's own rows of V, dK through a tile
//     of the stage the last item left), a partial one or fp32 accumulators from registers.
//   - Head dim 256 splits the work between the consumers differently (consume_wide): by columns
//     for dK and dV, by queries for S^T and dP^T, with P^T and dS^T in shared memory. Its dQ is
//     the dQ kernel's (dq.cuh), by query tiles: nothing goes to the accumulator.
//
// Packed batches, as in the forward: rows past a sequence in a tile are zeroed in shared memory
// where a zero probability or dS would meet them in a product (K's rows for dQ = dS K, Q's and dO's
// for dK and dV); the mask hides them in S^T and dP^T.
#pragma once

#include <cuda.h>

#include <utility>

#include "../backward.cuh"
#include "forward.cuh"
#include "ptx.h"

namespace ringflash::cuda::sm90 {

// The backward's operands as tensor maps: q and dout with boxes of a query tile's rows, k and v of
// 128; lse2 and dsum (the workspace's fp32 row statistics, a multiple of 4 rows per head and
// sequence) as 2-D maps (rows, heads x sequences) with boxes of a query tile's rows plus 4: a TMA
// copy starts at a 16-byte boundary, so a tile's statistics are loaded from the multiple of 4 at
// or before its first row (a packed sequence starts at any row).
struct BackwardMaps {
  CUtensorMap q, dout, k, v, lse2, dsum;
  CUtensorMap dq;  // the fp32 accumulator (head dim, heads, rows, batch), boxes of 32 x 1 x kDq x 1
  // dk and dv as the operands' maps with boxes of a consumer's 64 keys, set where `store_grads`:
  // they are in the input dtype (no accumulate mode) and the consumers hold whole rows (not head dim
  // 256).
  CUtensorMap dk, dv;
  bool store_grads;
};

template <typename T, int kHeadDim>
struct Backward {
  // At head dim 64 a query tile of 128 rows: the same work per item as head dim 128 at 64 rows,
  // so the fixed costs of an item (its waits, the softmax's row loads) are shared by twice the
  // products. At head dim 256 (kWide) a block of 64 keys: dK and dV of 64 keys x 256 columns do
  // not fit one consumer's registers, so the consumers split their columns instead (consume_wide).
  static constexpr bool kWide = kHeadDim == 256;
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64, kBlockN = kWide ? 64 : 128;
  // Stages of Q, dO and their statistics: three at head dim 128 (on an H100 the backward ran
  // 0.5-0.8 % faster than with two, bench/NOTES.md h50); the other head dims' tiles leave room for two.
  static constexpr int kStages = kHeadDim == 128 ? 3 : 2;
  static constexpr int kConsumers = 2;  // warpgroups; each counts itself in p.dq_done (finish_dq)
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(fits_block_registers(kThreads, kProducerRegs, kConsumerRegs), "within the block's registers");
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKBytes = kBlockN * kHeadDim * 2;
  // The statistics' box: a query tile's rows plus 4; each in a slot of whole 128-byte lines (a TMA
  // copy's destination is 128-byte aligned).
  static constexpr int kStatRows = kBlockM + 4, kStatBytes = kStatRows * 4, kStatSlot = kBlockM + 32;
  // A consumer's part of an item's dQ = dS K (kBlockM x kHeadDim) is one 64 x 64 block of it (its
  // 64 query rows at head dim 64, its 64 columns at 128) over all 128 keys: it reads both
  // consumers' dS^T, so they meet at a named barrier in every item. (Each consumer over its own
  // 64 keys, the whole of dQ, needs no barrier but moves twice the bytes in reduce-adds: on an
  // H100 its backward ran 5-20% slower at head dim 128, and 2% slower on average at 64.)
  static constexpr int kDq = 64;
  // At head dim 128 each item's S^T is issued under the last item's dK and dQ reduce-adds, so the
  // tensor cores go on from item to item (on an H100 the kernel ran 2 % faster). At head dim 64
  // (query tiles of 128) S^T's 64 registers beside dK's and dV's make ptxas serialise the wgmma.
  static constexpr bool kPipelined = kHeadDim == 128;
  // dS^T, [key][query], in column blocks of 64 queries (128 bytes a row); at head dim 256 P^T and
  // dS^T together.
  static constexpr int kSBytes = kBlockN * kBlockM * 2 * (kWide ? 2 : 1);
  // A consumer's part of dQ in fp32, kDq x kDq in column blocks of 32 (128 bytes a row, 128-byte
  // swizzle), the source of its TMA reduce-adds.
  static constexpr int kDqBytes = kWide ? 0 : kDq * kDq * 4;  // head dim 256: the dQ kernel's (dq.cuh)
  // The block's shared memory, all of it dynamic: K, V; per stage Q and dO; two dS^T buffers, or
  // two of P^T and dS^T (one item's products read the one the next item does not write); two dQ
  // parts; then the statistics of each stage and the barriers. With no static shared memory the
  // dynamic buffer starts at the window's 1024-byte boundary, which the tiles' 128-byte swizzle
  // needs, so no room is kept to align it (three stages at head dim 128 fit only so).
  static constexpr int kTileBytes = 2 * kKBytes + 2 * kStages * kQBytes + 2 * kSBytes + 2 * kDqBytes;
  static constexpr int kStatsBytes = kStages * 2 * kStatSlot * 4;
  static constexpr int kSmemBytes = kTileBytes + kStatsBytes + (1 + 2 * kStages) * 8;
  static_assert(kTileBytes % 1024 == 0, "the tiles end on a 1024-byte boundary, where the statistics' TMA copies land");
  static constexpr int kDT = kHeadDim / 8;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "whole column blocks");
  static_assert(kSmemBytes <= 227 * 1024, "within sm_90's shared memory per block");
  using STile = Tile<kBlockN, 64>;  // one column block: the 128-byte swizzle of TMA and wgmma at a 1024-byte boundary

  static __device__ void run(const Params& p, const BackwardMaps& maps, const core::TileOrder& order) {
    extern __shared__ unsigned char raw[];
    if (smem_u32(raw) % 1024 != 0) __trap();  // see kSmemBytes: the swizzled tiles would be read wrong
    T* sk = reinterpret_cast<T*>(raw);
    T* sv = sk + kBlockN * kHeadDim;
    T* sq = sv + kBlockN * kHeadDim;            // kStages tiles
    T* sdo = sq + kStages * kBlockM * kHeadDim;  // kStages tiles
    T* sds = sdo + kStages * kBlockM * kHeadDim;                        // two tiles
    float* sdq = reinterpret_cast<float*>(sds + 2 * kBlockN * kBlockM);  // two parts
    unsigned char* tail = raw + kTileBytes;
    auto& stats = *reinterpret_cast<float(*)[kStages][2][kStatSlot]>(tail);  // lse2, dsum
    uint64_t* barriers = reinterpret_cast<uint64_t*>(tail + kStatsBytes);
    uint64_t& kv_full = barriers[0];
    auto& full = *reinterpret_cast<uint64_t(*)[kStages]>(barriers + 1);
    auto& empty = *reinterpret_cast<uint64_t(*)[kStages]>(barriers + 1 + kStages);

    const core::AttentionArgs& a = p.a;
    const int64_t b = blockIdx.y;
    int hk, rank;
    order.item(blockIdx.x, &hk, &rank);
    const core::Sequence seq = core::sequence(a, b);
    launch_dependents();  // dQ's conversion (launch_convert_dq)
    // Rank 0 is the first key tile: under a causal mask every query sees it.
    const int64_t n0 = static_cast<int64_t>(rank) * kBlockN;
    if (n0 >= seq.len_k) {
      if (threadIdx.x == 0) {
        wait_prerequisites();  // so that the kernel ends after the dsum pass in any case
        if (p.dq_done) count_done(dq_done(p, b, hk), kConsumers);
      }
      return;
    }
    const int valid_n = tile_rows(seq.len_k, n0, kBlockN);
    const core::Mask mask = p.mask();
    int m_begin, m_end;
    query_tiles<kBlockM>(mask, seq, n0, valid_n, &m_begin, &m_end);
    // Items: query tiles [m_begin, m_end) of each q head of the group in turn.
    const Items items{hk * p.group, m_begin, m_end - m_begin, p.group * (m_end - m_begin)};
    const int tid = threadIdx.x, group = __shfl_sync(~0u, tid / 128, 0), lane = tid % 32;  // see the forward

    if (tid == 0) {
      mbarrier_init(&kv_full, 1);
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(&full[s], 1);
        mbarrier_init(&empty[s], kConsumerWarps);
      }
      fence_barrier_init();
    }
    __syncthreads();

    if (group == 0) {
      setmaxnreg_dec<kProducerRegs>();
      if (tid == 0) {
        const int64_t tb = a.cu_seqlens_q ? 0 : b;  // the maps' batch coordinate
        if (items.count > 0) {
          mbarrier_arrive_expect(&kv_full, 2 * kKBytes);
          load_tile<kBlockN, kHeadDim>(sk, &maps.k, &kv_full, seq.row_k + n0, hk, tb);
          load_tile<kBlockN, kHeadDim>(sv, &maps.v, &kv_full, seq.row_k + n0, hk, tb);
        }
        // The dsum pass before this kernel (launch_overlapped) writes the statistics loaded below
        // and zeroes the dq accumulator that the consumers add into once they have them; every
        // block waits for it, so that the kernel ends after it.
        wait_prerequisites();
        for (auto [i, at] = std::pair{0, items.first()}; i < items.count; ++i, items.next(at)) {
          const int stage = i % kStages;
          if (i >= kStages) mbarrier_wait(&empty[stage], static_cast<uint32_t>(i / kStages - 1) & 1u);
          const int h = at.head;
          const int64_t row = seq.row_q + at.tile * int64_t{kBlockM};
          mbarrier_arrive_expect(&full[stage], 2 * kQBytes + 2 * kStatBytes);
          load_tile<kBlockM, kHeadDim>(sq + stage * kBlockM * kHeadDim, &maps.q, &full[stage], row, h, tb);
          load_tile<kBlockM, kHeadDim>(sdo + stage * kBlockM * kHeadDim, &maps.dout, &full[stage], row, h, tb);
          // From the multiple of 4 at or before the tile's first row; the mask hides rows past the
          // sequence.
          const int stat_column = static_cast<int>(tb * a.heads_q + h);
          const int stat_row = static_cast<int>(row & ~int64_t{3});
          tma_load_2d(stats[stage][0], &maps.lse2, &full[stage], stat_row, stat_column);
          tma_load_2d(stats[stage][1], &maps.dsum, &full[stage], stat_row, stat_column);
        }
      }
    } else {
      setmaxnreg_inc<kConsumerRegs>();
      if constexpr (kWide)
        consume_wide(p, b, hk, seq, n0, valid_n, mask, items, sk, sv, sq, sdo, sds, stats, kv_full, full, empty,
                     group - 1, lane);
      else
        consume(p, maps, b, hk, seq, n0, valid_n, mask, items, sk, sv, sq, sdo, sds, sdq + (group - 1) * kDq * kDq,
                stats, kv_full, full, empty, group - 1, lane);
    }
  }

  // The count of the block's sequence and k/v head in p.dq_done (run_backward).
  static __device__ __forceinline__ int* dq_done(const Params& p, int64_t b, int hk) {
    return p.dq_done + (p.a.cu_seqlens_q ? 0 : b) * p.a.heads_kv + hk;
  }

  // By the thread that issued a consumer's reduce-adds, at its end: they have read their source
  // before the block's shared memory goes, and, with p.dq_done, are complete before the consumer
  // counts itself, after the dsum pass has zeroed the count (a consumer with no items has not
  // waited for the pass before).
  static __device__ __forceinline__ void finish_dq(const Params& p, int64_t b, int hk) {
    if (!p.dq_done) {
      bulk_wait_read();
      return;
    }
    bulk_wait();
    wait_prerequisites();
    count_done(dq_done(p, b, hk), 1);
  }

  struct Items {
    int head0, m_begin, tiles, count;
    // Where item i is (its q head and query tile), walked one item after another.
    struct At {
      int head, tile;
    };
    __device__ __forceinline__ At first() const { return {head0, m_begin}; }
    __device__ __forceinline__ void next(At& at) const {
      if (++at.tile == m_begin + tiles) at = {at.head + 1, m_begin};
    }
  };

  // Item i (at `at`): its stage, q head, first query row and rows, and the shared-memory addresses
  // of its Q and dO tiles.
  struct ItemTiles {
    int stage, h;
    int64_t q0;
    int rows;
    uint32_t q_tile, do_tile;
  };
  static __device__ __forceinline__ ItemTiles item_tiles(int i, const typename Items::At& at,
                                                         const core::Sequence& seq, T* sq, T* sdo) {
    const int stage = i % kStages;
    const int64_t q0 = at.tile * int64_t{kBlockM};
    return {stage, at.head, q0, tile_rows(seq.len_q, q0, kBlockM), smem_u32(sq + stage * kBlockM * kHeadDim),
            smem_u32(sdo + stage * kBlockM * kHeadDim)};
  }

  // Waits for K and V; in a packed batch, zeroes K's rows past the sequence (for dQ = dS K), with a
  // barrier of the consumers.
  static __device__ __forceinline__ void wait_kv(uint64_t& kv_full, const Items& items, bool packed, int valid_n,
                                                 T* sk) {
    if (items.count > 0) mbarrier_wait(&kv_full, 0);
    if (items.count > 0 && packed && valid_n < kBlockN) {
      zero_rows<kBlockN, kHeadDim>(sk, valid_n, threadIdx.x - 128, 256);
      named_barrier_sync(kZeroed, 256);
    }
  }

  // Waits for item i's stage; in a packed batch, zeroes Q's and dO's rows past the sequence (for
  // dK and dV), with a barrier of the consumers.
  static __device__ __forceinline__ void wait_stage(uint64_t (&full)[kStages], int i, bool packed, int rows, T* sq,
                                                    T* sdo) {
    const int stage = i % kStages;
    mbarrier_wait(&full[stage], static_cast<uint32_t>(i / kStages) & 1u);
    if (packed && rows < kBlockM) {
      zero_rows<kBlockM, kHeadDim>(sq + stage * kBlockM * kHeadDim, rows, threadIdx.x - 128, 256);
      zero_rows<kBlockM, kHeadDim>(sdo + stage * kBlockM * kHeadDim, rows, threadIdx.x - 128, 256);
      named_barrier_sync(kZeroed, 256);
    }
  }

  // P^T and dS^T in place of S^T and dP^T (a warp's fragments of 16 keys from key0 and kN / 2
  // queries from query0): element (j, e) is key key0 + lane / 4 + 8 (e / 2), query query0 + 8 j +
  // 2 (lane % 4) + e % 2. `stat` holds the item's lse2 and dsum; `plain`: no softcap, no ALiBi.
  template <int kN>
  static __device__ __forceinline__ void gradients(const Params& p, int64_t b, int h, const core::Sequence& seq,
                                                   int64_t n0, int64_t q0, int rows, int valid_n,
                                                   const core::Mask& mask, const float (&stat)[2][kStatSlot],
                                                   bool alibi, bool plain, int key0, int query0, int lane,
                                                   float (&st)[kN], float (&dpt)[kN]) {
    const ScoreTransform f = p.score_transform(b, h);
    const TileMask tile(mask, seq.pos_k + n0 - (seq.pos_q + q0), rows, valid_n);  // rows are queries
    const int shift = static_cast<int>((seq.row_q + q0) & 3);  // the statistics start at row & ~3
    const float* lse2 = stat[0] + shift;
    const float* dsum = stat[1] + shift;
    with_tile_kind(!tile.whole(kBlockM, kBlockN), plain, [&](auto masked, auto plain_scores) {
#pragma unroll
      for (int j = 0; j < kN / 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + lane / 4 + (e / 2) * 8;
          const int query = query0 + j * 8 + (lane % 4) * 2 + e % 2;
          element_gradient<decltype(masked)::value, decltype(plain_scores)::value>(
              f, tile, alibi, query, key, lse2[query], dsum[query], st[4 * j + e], dpt[4 * j + e]);
        }
    });
  }

  static __device__ __forceinline__ void consume(const Params& p, const BackwardMaps& maps, int64_t b, int hk,
                                                 const core::Sequence& seq, int64_t n0, int valid_n,
                                                 const core::Mask& mask, const Items& items, T* sk, T* sv, T* sq,
                                                 T* sdo, T* sds, float* sdq,
                                                 float (&stats)[kStages][2][kStatSlot], uint64_t& kv_full,
                                                 uint64_t (&full)[kStages], uint64_t (&empty)[kStages], int consumer,
                                                 int lane) {
    const core::AttentionArgs& a = p.a;
    const int warp = (threadIdx.x % 128) / 32;
    const int key0 = consumer * 64 + warp * 16;  // this warp's first key in the tile
    float dk[kDT * 4] = {}, dv[kDT * 4] = {};
    float st[kBlockM / 2], dpt[kBlockM / 2];  // S^T, dP^T: 64 keys x kBlockM queries
    float dq[kDq / 2];                        // this consumer's part of dQ
    const bool elected = threadIdx.x % 128 == 0;  // issues this consumer's reduce-adds
    // The dQ part's first row and column in the item's dQ.
    const int dq_row0 = kHeadDim == 64 ? consumer * 64 : 0;
    const int dq_col0 = kHeadDim == 128 ? consumer * 64 : 0;
    const uint32_t k_tile = smem_u32(sk);
    // K's and V's rows of this consumer, the operands A of S^T and dP^T.
    const uint64_t k_desc = k_major_desc(k_tile + consumer * 64 * 128);
    const uint64_t v_desc = k_major_desc(smem_u32(sv) + consumer * 64 * 128);

    const bool alibi = a.alibi_slopes != nullptr;
    const bool plain = !alibi && p.softcap_log2 == 0.0f;
    const bool packed = a.cu_seqlens_q != nullptr;
    wait_kv(kv_full, items, packed, valid_n, sk);
    // Waits for item i's stage and issues its S^T = K Q^T (Q as operand B, K-major). With
    // kPipelined, the next item's is issued under this item's dK and dQ reduce-adds.
    const auto issue_s = [&](int i, const typename Items::At& at) {
      const ItemTiles t = item_tiles(i, at, seq, sq, sdo);
      wait_stage(full, i, packed, t.rows, sq, sdo);
      const uint64_t q_desc = k_major_desc(t.q_tile);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, kBlockM>::template ss<0, 0>(st, k_step(k_desc, kBlockN, ks), k_step(q_desc, kBlockM, ks), ks > 0);
      wgmma_commit();
    };
    for (auto [i, at] = std::pair{0, items.first()}; i < items.count; ++i) {
      const auto [stage, h, q0, rows, q_tile, do_tile] = item_tiles(i, at, seq, sq, sdo);
      // Q and dO as operands B, MN-major (column blocks kBlockM rows apart), for dK and dV.
      const uint64_t q_mn = mn_major_desc(q_tile, kBlockM * 128), do_mn = mn_major_desc(do_tile, kBlockM * 128);
      T* ds_tile = sds + (i % 2) * kBlockN * kBlockM;

      // S^T (unless the last item issued it) and dP^T = V dO^T (dO as operand B, K-major) for
      // this consumer's 64 keys.
      if (!kPipelined || i == 0) issue_s(i, at);
      const uint64_t do_desc = k_major_desc(do_tile);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, kBlockM>::template ss<0, 0>(dpt, k_step(v_desc, kBlockN, ks), k_step(do_desc, kBlockM, ks), ks > 0);
      wgmma_commit();
      wgmma_wait<0>();
      keep(st);
      keep(dpt);

      // The lane, opaque to the compiler in each item: otherwise it computes every element's
      // key and query offsets once, before the loop, and spills them.
      int item_lane = lane;
      asm volatile("" : "+r"(item_lane));
      gradients(p, b, h, seq, n0, q0, rows, valid_n, mask, stats[stage], alibi, plain, key0, 0, item_lane, st, dpt);

      // dV += P^T dO, under which dS^T is converted and stored: 16 queries (two 8-row atoms) per
      // step, dO's column blocks kBlockM rows apart.
      uint32_t pa[kBlockM / 16][4], da[kBlockM / 16][4];
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        accumulators_to_a<T>(pa[kq], reinterpret_cast<const float(&)[4]>(st[8 * kq]),
                             reinterpret_cast<const float(&)[4]>(st[8 * kq + 4]));
      keep(dv);
      keep(pa);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        Wgmma<T, kHeadDim>::template rs<1>(dv, pa[kq], advance(do_mn, kq * 2048), true);
      wgmma_commit();
      // The last item's reduce-add has read its dQ part before this item writes it (below, after
      // the barrier of the two consumers).
      if (elected) bulk_wait_read();
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq) {
        accumulators_to_a<T>(da[kq], reinterpret_cast<const float(&)[4]>(dpt[8 * kq]),
                             reinterpret_cast<const float(&)[4]>(dpt[8 * kq + 4]));
        store_a<STile>(ds_tile + kq / 4 * kBlockN * 64, key0, kq % 4 * 16, da[kq], lane);  // dS^T for dQ
      }
      fence_proxy_async();
      named_barrier_sync(kDsStored, 256);  // both consumers' dS^T rows are in shared memory

      // The dQ part = dS K over all keys (dS^T's column block of the part's 64 queries and K's
      // column block of its 64 columns, column blocks kBlockN rows apart), then dK += dS^T Q: dQ
      // goes out while dK's products run. With kPipelined, dK's dS^T is this consumer's rows in
      // shared memory (operand A, K-major), so that no register holds it under the next S^T.
      const uint64_t ds_mn = mn_major_desc(smem_u32(ds_tile) + dq_row0 / 64 * kBlockN * 128, kBlockN * 128);
      const uint64_t k_mn = mn_major_desc(k_tile + dq_col0 / 64 * kBlockN * 128, kBlockN * 128);
      keep(dk);
      keep(da);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks)
        Wgmma<T, kDq>::template ss<1, 1>(dq, advance(ds_mn, ks * 2048), advance(k_mn, ks * 2048), ks > 0);
      wgmma_commit();
      if constexpr (kPipelined) {
        const uint64_t ds_desc = k_major_desc(smem_u32(ds_tile) + consumer * 64 * 128);
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq)
          Wgmma<T, kHeadDim>::template ss<0, 1>(dk, k_step(ds_desc, kBlockN, kq), advance(q_mn, kq * 2048), true);
      } else {
#pragma unroll
        for (int kq = 0; kq < kBlockM / 16; ++kq)
          Wgmma<T, kHeadDim>::template rs<1>(dk, da[kq], advance(q_mn, kq * 2048), true);
      }
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ
      keep(dq);
      keep(dv);
      keep(pa);

      store_dq(smem_u32(sdq), dq, p.softmax_scale, warp, item_lane);
      fence_proxy_async();
      items.next(at);
      if (kPipelined && i + 1 < items.count) issue_s(i + 1, at);
      named_barrier_sync(kDqStored + consumer, 128);  // the dQ part is in shared memory
      if (elected) {
#pragma unroll
        for (int cb = 0; cb < kDq / 32; ++cb)
          tma_reduce_add_4d(&maps.dq, sdq + cb * kDq * 32, dq_col0 + cb * 32, h,
                            static_cast<int>(seq.row_q + q0 + dq_row0), packed ? 0 : static_cast<int>(b));
        bulk_commit();
      }
      wgmma_wait<0>();  // dK (and the next item's S^T)
      keep(dk);
      keep(st);
      if constexpr (!kPipelined) keep(da);
      if (lane == 0) mbarrier_arrive(&empty[stage]);  // Q, dO and the statistics of the stage are free
    }
    if (maps.store_grads && valid_n == kBlockN) {
      // dV into this consumer's rows of V (only its own dP^T products read them), dK into a tile of
      // the stage the last item left (both consumers are past its products): consumer 0 takes its
      // Q tile, consumer 1 its dO tile. Neither waits for the last reduce-add.
      T* sdk = (consumer == 0 ? sq : sdo) + items.count % kStages * kBlockM * kHeadDim;
      T* sdv = sv + consumer * 64 * 64;
      constexpr int kDkBlock = kBlockM * 64, kDvBlock = kBlockN * 64;  // column blocks apart, elements
      const float dk_scale[2] = {p.softmax_scale, p.softmax_scale}, dv_scale[2] = {1.0f, 1.0f};
      stage_rows<T, kDT>(smem_u32(sdk), kDkBlock * 2, warp * 16, dk, dk_scale, lane);
      stage_rows<T, kDT>(smem_u32(sdv), kDvBlock * 2, warp * 16, dv, dv_scale, lane);
      fence_proxy_async();
      named_barrier_sync(kOutStaged + consumer, 128);
      // Another thread than the reduce-adds' issues the stores, so that the count (below) waits
      // for none of them.
      if (threadIdx.x % 128 == 32) {
        const int row = static_cast<int>(seq.row_k + n0 + consumer * 64), tb = packed ? 0 : static_cast<int>(b);
#pragma unroll
        for (int c = 0; c < kHeadDim / 64; ++c) {
          tma_store_4d(&maps.dk, sdk + c * kDkBlock, c * 64, hk, row, tb);
          tma_store_4d(&maps.dv, sdv + c * kDvBlock, c * 64, hk, row, tb);
        }
        bulk_commit();
        bulk_wait_read();  // the block's shared memory outlives the reads of these copies
      }
      if (elected) finish_dq(p, b, hk);
      return;
    }
    if (elected) finish_dq(p, b, hk);
    write_dkdv<kDT>(p, b, hk, seq.row_k + n0, valid_n, key0, 0, dk, dv, lane);
  }

  // The consumers at head dim 256 (a block of 64 keys; query tiles of 64). Per item, consumer c:
  //   S^T and dP^T for all 64 keys and its 32 queries (wgmma m64n32, both operands K-major);
  //   P^T and dS^T of them, stored to shared memory (two buffers by item parity: the barrier of
  //   item i + 1 means both consumers are done with item i's), then a barrier of the two;
  //   dV and dK of all 64 keys and its 128 columns: += P^T dO and dS^T Q, A from shared memory.
  // dQ is the dQ kernel's (dq.cuh).
  // Element (j, e) of a warp's S^T fragment is key 16 warp + lane / 4 + 8 (e / 2), query
  // 32 c + 8 j + 2 (lane % 4) + e % 2.
  static __device__ __forceinline__ void consume_wide(const Params& p, int64_t b, int hk, const core::Sequence& seq,
                                                      int64_t n0, int valid_n, const core::Mask& mask,
                                                      const Items& items, T* sk, T* sv, T* sq, T* sdo, T* sp,
                                                      float (&stats)[kStages][2][kStatSlot], uint64_t& kv_full,
                                                      uint64_t (&full)[kStages], uint64_t (&empty)[kStages],
                                                      int consumer, int lane) {
    constexpr int kCols = kHeadDim / 2;  // a consumer's columns of dK and dV
    const core::AttentionArgs& a = p.a;
    const int warp = (threadIdx.x % 128) / 32;
    const int key0 = warp * 16, query0 = consumer * 32, col0 = consumer * kCols;
    float dk[kCols / 2] = {}, dv[kCols / 2] = {};
    float st[16], dpt[16];  // S^T, dP^T: 64 keys x this consumer's 32 queries
    constexpr int kTile = kBlockN * kBlockM;  // elements of P^T or dS^T
    const uint32_t k_tile = smem_u32(sk);
    const uint64_t k_desc = k_major_desc(k_tile), v_desc = k_major_desc(smem_u32(sv));

    const bool alibi = a.alibi_slopes != nullptr;
    const bool plain = !alibi && p.softcap_log2 == 0.0f;
    const bool packed = a.cu_seqlens_q != nullptr;
    wait_kv(kv_full, items, packed, valid_n, sk);
    for (auto [i, at] = std::pair{0, items.first()}; i < items.count; ++i, items.next(at)) {
      const auto [stage, h, q0, rows, q_tile, do_tile] = item_tiles(i, at, seq, sq, sdo);
      // Q's and dO's rows of this consumer as operands B (K-major) of S^T and dP^T; their column
      // blocks of its columns, MN-major, as operands B of dK and dV.
      const uint64_t q_desc = k_major_desc(q_tile + query0 * 128), do_desc = k_major_desc(do_tile + query0 * 128);
      const uint64_t q_mn = mn_major_desc(q_tile + col0 / 64 * kBlockM * 128, kBlockM * 128);
      const uint64_t do_mn = mn_major_desc(do_tile + col0 / 64 * kBlockM * 128, kBlockM * 128);
      wait_stage(full, i, packed, rows, sq, sdo);

      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, 32>::template ss<0, 0>(st, k_step(k_desc, kBlockN, ks), k_step(q_desc, kBlockM, ks), ks > 0);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, 32>::template ss<0, 0>(dpt, k_step(v_desc, kBlockN, ks), k_step(do_desc, kBlockM, ks), ks > 0);
      wgmma_commit();
      wgmma_wait<0>();
      keep(st);
      keep(dpt);

      int item_lane = lane;  // opaque, as in consume
      asm volatile("" : "+r"(item_lane));
      gradients(p, b, h, seq, n0, q0, rows, valid_n, mask, stats[stage], alibi, plain, key0, query0, item_lane, st,
                dpt);
      uint32_t pa[2][4], da[2][4];
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        accumulators_to_a<T>(pa[kq], reinterpret_cast<const float(&)[4]>(st[8 * kq]),
                             reinterpret_cast<const float(&)[4]>(st[8 * kq + 4]));
        accumulators_to_a<T>(da[kq], reinterpret_cast<const float(&)[4]>(dpt[8 * kq]),
                             reinterpret_cast<const float(&)[4]>(dpt[8 * kq + 4]));
      }
      T* ps = sp + (i % 2) * 2 * kTile;  // this item's P^T, then dS^T
      T* ds = ps + kTile;
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        store_a<STile>(ps, key0, query0 + kq * 16, pa[kq], lane);
        store_a<STile>(ds, key0, query0 + kq * 16, da[kq], lane);
      }
      fence_proxy_async();
      named_barrier_sync(kDsStored, 256);  // both consumers' halves of P^T and dS^T are in

      // dV += P^T dO and dK += dS^T Q (P^T, dS^T as operands A, K-major; 16 queries, two 8-row
      // atoms, per step).
      const uint64_t p_desc = k_major_desc(smem_u32(ps)), ds_desc = k_major_desc(smem_u32(ds));
      keep(dv);
      keep(dk);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        Wgmma<T, kCols>::template ss<0, 1>(dv, k_step(p_desc, kBlockN, kq), advance(do_mn, kq * 2048), true);
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        Wgmma<T, kCols>::template ss<0, 1>(dk, k_step(ds_desc, kBlockN, kq), advance(q_mn, kq * 2048), true);
      wgmma_commit();
      wgmma_wait<0>();
      keep(dv);
      keep(dk);
      if (lane == 0) mbarrier_arrive(&empty[stage]);  // Q, dO and the statistics of the stage are free
    }
    write_dkdv<kCols / 8>(p, b, hk, seq.row_k + n0, valid_n, key0, col0, dk, dv, lane);
  }

  // Writes scale * dq (warp w: rows 16 w onwards) at shared-memory address `dst`: kDq rows in
  // column blocks of 32 floats, 128 bytes a row with the 128-byte swizzle (16-byte chunk c of row r
  // at c ^ (r % 8)), as the TMA reduce-add reads it. A 64-bit store goes to the banks a half-warp
  // at a time, and rows r and r ^ 1 of the same 8 columns would meet in the same two chunks; so
  // odd rows write the columns of j ^ 2 when even ones write those of j, and the half-warp's four
  // rows each fill their own quarter of the banks.
  static __device__ __forceinline__ void store_dq(uint32_t dst, const float (&dq)[kDq / 2], float scale, int warp,
                                                  int lane) {
    static_assert(kDq % 32 == 0, "j ^ 2 stays in j's column block");
    const int g = lane / 4;  // the row in its 8-row half, r % 8
    const bool odd = g % 2 != 0;
    // Column group j's chunk (of 8 columns, two chunks) in row r: 2 (j % 4) ^ z.
    const int z = ((lane % 4) / 2) ^ g ^ (odd ? 4 : 0);
    const uint32_t row = dst + (warp * 16 + g) * 128 + (lane % 2) * 8;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < kDq / 8; ++j) {
        const int e = 4 * j + 2 * half, e2 = 4 * (j ^ 2) + 2 * half;
        st_shared_v2(row + half * 8 * 128 + j / 4 * kDq * 128 + ((2 * (j % 4)) ^ z) * 16,
                     (odd ? dq[e2] : dq[e]) * scale, (odd ? dq[e2 + 1] : dq[e + 1]) * scale);
      }
  }

  // Writes (or, in accumulate mode, adds unless overwrite_dkdv) this warp's 16 keys of dK and dV:
  // kN n-tiles of 8 columns from col0.
  template <int kN>
  static __device__ __forceinline__ void write_dkdv(const Params& p, int64_t b, int hk, int64_t row0, int valid_n,
                                                    int key0, int col0, const float (&dk)[kN * 4],
                                                    const float (&dv)[kN * 4], int lane) {
    const core::AttentionArgs& a = p.a;
    const int head_dim = static_cast<int>(a.head_dim);
    const float scale = p.softmax_scale;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key0 + lane / 4 + half * 8;
      if (key >= valid_n) continue;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (col0 + j * 8 >= head_dim) break;
        const int col = col0 + j * 8 + (lane % 4) * 2;
        const int e = 4 * j + 2 * half;
        store_grad_pair<T>(a, a.dk, b, row0 + key, hk, col, dk[e] * scale, dk[e + 1] * scale, !a.overwrite_dkdv);
        store_grad_pair<T>(a, a.dv, b, row0 + key, hk, col, dv[e], dv[e + 1], !a.overwrite_dkdv);
      }
    }
  }
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Backward<T, kHeadDim>::kThreads, 1)
    backward_kernel(const __grid_constant__ Params p, const __grid_constant__ BackwardMaps maps,
                    const core::TileOrder order) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  Backward<T, kHeadDim>::run(p, maps, order);
#endif
}

}  // namespace ringflash::cuda::sm90
