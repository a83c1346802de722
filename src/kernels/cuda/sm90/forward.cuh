// The Hopper forward kernel (sm_90a), warp-specialised. Its items are (query tile of 64 rows per
// consumer, head, sequence), in core::TileOrder: at head dims 128 and 256 a thread block per item;
// at head dim 64 a block per SM takes items in turn from a counter (persistent), and the K/V
// stages and the consumers' turns run on from item to item.
//
//   - Warpgroup 0 is the producer: it gives its registers up (setmaxnreg), and one thread issues
//     the TMA copies of K and V of each key tile into stages, each completing on an mbarrier. A
//     stage of K (of V) is reused once every consumer warp has arrived on its `k_empty`
//     (`v_empty`) barrier: K's as soon as S is in, V's once P V is. Q: a block per item, the
//     producer loads the tile once; persistent, the producer hands each item to the consumers in
//     shared memory and each consumer loads its own rows of Q once its last output is out of them,
//     so that the producer's K and V never wait for a consumer's epilogue.
//   - The other warpgroups are the consumers, 64 query rows each: two at 240 registers, or three
//     at 160 for head dim 64. S = Q K^T is wgmma m64n128k16 with both operands in shared memory
//     (128-byte-swizzled column blocks of 64 elements, as TMA writes them); O += P V is wgmma with
//     P in registers and V read MN-major.
//   - A consumer overlaps the softmax of key tile i with the P V product of tile i - 1: it issues
//     S(i) and O += P(i - 1) V(i - 1), waits for S(i) alone, computes P(i) while the tensor cores
//     run P V (`ahead_of_wait` keeps ptxas from sinking it below the next wait), then waits for
//     that, frees the stage of tile i - 1 and rescales O.
//   - Ping-pong: the consumers issue their products in turn (a named barrier each), so that one's
//     softmax runs while the tensor cores work through the others' products.
//   - A consumer whose rows see fewer key tiles than the block's (the first consumers, under a
//     causal mask) computes only its own and takes its remaining turns without products; where
//     they see only the first half of their last tile (the first consumer's diagonal tile), that
//     tile's S and P V run over those keys alone.
//   - The softmax (scale, softcap, ALiBi, mask) is the sm_80 kernel's: a wgmma accumulator holds,
//     per warp, the fragments of mma.sync m16n8k16. A whole query tile's output goes out by TMA
//     from shared memory (each consumer's rows into its rows of the Q tile, which its products no
//     longer read); partial tiles and accumulate mode take the sm_80 epilogue, from registers.
//
// Packed batches: a TMA box does not stop at a sequence's end, so the last key tile of a sequence
// may hold rows of the next one (or rows of no sequence), which may hold anything, NaN included.
// The mask hides them in S; V's rows past the end are zeroed in shared memory before P V, where a
// zero probability would not cancel a NaN. Q rows past the end are computed and not written.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "../../common/tile_order.h"
#include "../forward.cuh"
#include "ptx.h"

namespace ringflash::cuda::sm90 {

// q, k and v as 4-D tensor maps (head dim, heads, rows, batch), 128-byte swizzle, boxes of 64
// columns x 1 head x the kernel's tile rows x 1; columns past the head dim and rows past the tensor
// read as 0. A packed batch is one sequence of the maps (batch 1). `out` likewise with boxes of 64
// rows (a consumer's), set where `store_out`: the output is in the input dtype (no accumulate mode).
struct Maps {
  CUtensorMap q, k, v, out;
  bool store_out;
};

// Loads rows [row, row + kRows) of head h, sequence b of a (kHeadDim-column) operand into
// kHeadDim / 64 column blocks of kRows x 128 bytes each, completing on bar.
template <int kRows, int kHeadDim, typename T>
__device__ __forceinline__ void load_tile(T* dst, const CUtensorMap* map, uint64_t* bar, int64_t row, int h,
                                          int64_t b) {
#pragma unroll
  for (int c = 0; c < kHeadDim / 64; ++c)
    tma_load_4d(dst + c * kRows * 64, map, bar, c * 64, h, static_cast<int>(row), static_cast<int>(b));
}

// The descriptor of 16 columns (k-step ks) of a K-major operand tile of column blocks that are
// block_rows x 128 bytes each, from the descriptor of its first (`desc`, k_major_desc of the
// address of the first row used, a multiple of 8).
__device__ __forceinline__ uint64_t k_step(uint64_t desc, int block_rows, int ks) {
  return advance(desc, (ks / 4) * block_rows * 128 + (ks % 4) * 32);
}

// Zeroes rows [from, kRows) of a tile of kHeadDim / 64 column blocks of kRows x 128 bytes, with
// `threads` threads (this one is `thread`), then fences them for the async proxy; the caller's
// barrier publishes them.
template <int kRows, int kHeadDim, typename T>
__device__ __forceinline__ void zero_rows(T* tile, int from, int thread, int threads) {
  constexpr int kChunksPerRow = 8;  // 16 bytes each
  const int chunks = (kRows - from) * kChunksPerRow;
  for (int i = thread; i < chunks * (kHeadDim / 64); i += threads) {
    const int block = i / chunks, at = i % chunks;
    char* row = reinterpret_cast<char*>(tile) + block * kRows * 128 + (from + at / kChunksPerRow) * 128;
    *reinterpret_cast<uint4*>(row + at % kChunksPerRow * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
}

// A block's query tile in core::TileOrder (rank 0 is the last tile: under a causal mask it has the
// most keys) and the key tiles [n_begin, n_begin + tiles) that its rows see; rows = 0 when the tile
// starts past its sequence, and the block has nothing to do.
struct QueryTile {
  int64_t b, q0, n_begin;
  int h, rows, tiles;
  core::Sequence seq;
};

template <int kBlockM, int kBlockN>
__device__ __forceinline__ QueryTile query_tile(const Params& p, const core::TileOrder& order, const core::Mask& mask,
                                                int64_t b, int block) {
  QueryTile t{};
  t.b = b;
  int rank;
  order.item(block, &t.h, &rank);
  t.seq = core::sequence(p.a, t.b);
  t.q0 = static_cast<int64_t>(order.tiles - 1 - rank) * kBlockM;
  if (t.q0 >= t.seq.len_q) return t;
  t.rows = tile_rows(t.seq.len_q, t.q0, kBlockM);
  int64_t n_end;
  key_tiles<kBlockN>(mask, t.seq, t.q0, t.rows, &t.n_begin, &n_end);
  t.tiles = static_cast<int>(n_end - t.n_begin);
  return t;
}

// The items of a persistent launch: (sequence, query tile) pairs [0, items), sequence by sequence,
// each sequence's in core::TileOrder. Block x takes item x first, then the next one not yet taken:
// gridDim.x + the count at `taken` (zeroed before the launch).
struct Schedule {
  int* taken;
  int items;
  __device__ __forceinline__ int next() const { return static_cast<int>(gridDim.x) + atomicAdd(taken, 1); }
};

// A stage of a ring of kStages and the parity of its current use, walked along a stream of tiles.
template <int kStages>
struct Slot {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) stage = 0, phase ^= 1u;
  }
};

// Writes a warp's 16 rows of a wgmma accumulator of kN n-tiles (element 4 j + i is row row0 +
// lane / 4 + 8 (i / 2), column 8 j + 2 (lane % 4) + i % 2), row half h scaled by scale[h], in T at
// shared-memory address `tile`: column blocks of 64 columns in 128-byte rows, `block_bytes` apart,
// with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), as a TMA store reads them.
// A warp's store writes 8 rows x 4 words, one word per bank.
template <typename T, int kN>
__device__ __forceinline__ void stage_rows(uint32_t tile, int block_bytes, int row0, const float (&x)[kN * 4],
                                           const float (&scale)[2], int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + lane / 4 + half * 8;
    const uint32_t row = tile + r * 128 + (lane % 4) * 4;
#pragma unroll
    for (int j = 0; j < kN; ++j)
      st_shared_b32(row + (j / 8) * block_bytes + (((j % 8) ^ (r % 8)) * 16),
                    Mma<T>::pack(x[4 * j + 2 * half] * scale[half], x[4 * j + 2 * half + 1] * scale[half]));
  }
}

// Barrier ids of the sm_90a kernels (0 is __syncthreads).
// kDqStored + c: the backward's consumer c has stored its part of dQ; kTurn + c: the forward's
// consumer c's turn to issue.
// kOutStaged + c: consumer c (forward or backward) has put its rows of the output in shared
// memory, or (forward, persistent) every warp of it is past its products.
enum NamedBarrier : int { kZeroed = 1, kDsStored = 2, kDqStored = 3, kTurn = 5, kOutStaged = 8 };

// kPlain: plain scores (no softcap, no ALiBi, a positive scale), which need only the mask; the
// others take their own instance, so that the plain kernel carries none of their code.
template <typename T, int kHeadDim, bool kPlain>
struct Forward {
  // Head dim 256: key tiles of 64 (O alone takes 128 of a consumer's registers) in two stages
  // (shared memory: Q 64 KB, a stage of K and V 64 KB). Head dim 64: three consumers, as its
  // products are half as long as head dim 128's for the same softmax; two would leave the tensor
  // cores idle while both are in their softmax. They fit in 160 registers each.
  static constexpr int kConsumers = kHeadDim == 64 ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumers, kBlockN = kHeadDim == 256 ? 64 : 128;
  // A stage of K is freed once S of its tile is in, V's once P V is (a tile later), so that the
  // producer, which loads K and V in turn, starts each load about kStages - 0.5 tiles before its
  // use: with K and V freed together, two stages left less than a tile, and every tile waited.
  static constexpr int kStages = kHeadDim == 256 ? 2 : 3;
  static constexpr int kThreads = 128 * (kConsumers + 1), kConsumerThreads = 128 * kConsumers;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumers == 3 ? 160 : 240;
  static_assert(fits_block_registers(kThreads, kProducerRegs, kConsumerRegs), "within the block's registers");
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;  // + room to align to 1024
  static constexpr int kNT = kBlockN / 8, kDT = kHeadDim / 8;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "whole column blocks");
  static_assert(kSmemBytes <= 227 * 1024, "within sm_90's shared memory per block");

  // Head dim 64 runs persistent: a block per SM takes items from a Schedule, so that an item's
  // start (its tile, Q and K(0) in) overlaps the last item's end. Head dims 128 and 256 run a
  // block per item: persistent, head dim 128 ran 0.93-0.98x at 8k-16k (bench/NOTES.md, h29).
  // launch_forward gives the persistent instance its item counter, from the call's scratch.
  static constexpr bool kPersistent = kHeadDim == 64;
  // The softmax takes its row halves in turn (softmax_tile's kInTurn) at head dim 128, where the
  // forward ran 0.7-1.6 % faster so; at 64 it ran the same, at 256 up to 0.8 % slower (h44).
  static constexpr bool kHalvesInTurn = kHeadDim == 128;

  static __device__ void run(const Params& p, const Maps& maps, const core::TileOrder& order, const Schedule& work) {
    extern __shared__ unsigned char raw[];
    T* sq = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    T* sk = sq + kBlockM * kHeadDim;
    T* sv = sk + kStages * kBlockN * kHeadDim;
    // q_full[c]: consumer c's rows of Q are in (a block per item: q_full[0], the whole tile).
    __shared__ uint64_t q_full[kConsumers];
    __shared__ uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
    // Persistent: the producer hands items to the consumers through two slots, each complete
    // (item_full) once written and free (item_empty) once every consumer warp has read it; rows 0
    // says that none is left.
    __shared__ uint64_t item_full[2], item_empty[2];
    __shared__ alignas(QueryTile) unsigned char items_storage[2 * sizeof(QueryTile)];
    auto& items = *reinterpret_cast<QueryTile(*)[2]>(items_storage);

    const core::Mask mask = p.mask();
    const int per_sequence = order.heads * order.tiles;
    const auto tile_of = [&](int item) {
      return query_tile<kBlockM, kBlockN>(p, order, mask, item / per_sequence, item % per_sequence);
    };
    QueryTile own{};  // a block per item: its one
    if constexpr (!kPersistent) {
      own = query_tile<kBlockM, kBlockN>(p, order, mask, blockIdx.y, blockIdx.x);
      if (own.rows == 0) return;
    }
    // The warpgroup, broadcast from lane 0 so that the compiler knows it is the same in every
    // lane (what derives from it, such as descriptors, then lives in uniform registers).
    const int tid = threadIdx.x, group = __shfl_sync(~0u, tid / 128, 0), lane = tid % 32;

    if (tid == 0) {
      prefetch_tensormap(&maps.q);
      prefetch_tensormap(&maps.k);
      prefetch_tensormap(&maps.v);
      if (maps.store_out) prefetch_tensormap(&maps.out);
      for (int c = 0; c < kConsumers; ++c) mbarrier_init(&q_full[c], 1);
      for (int j = 0; j < 2; ++j) {
        mbarrier_init(&item_full[j], 1);
        mbarrier_init(&item_empty[j], kConsumerWarps);
      }
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(&k_full[s], 1);
        mbarrier_init(&v_full[s], 1);
        mbarrier_init(&k_empty[s], kConsumerWarps);
        mbarrier_init(&v_empty[s], kConsumerWarps);
      }
      fence_barrier_init();
    }
    __syncthreads();

    if (group == 0) {
      setmaxnreg_dec<kProducerRegs>();
      if (tid != 0) return;
      Slot<kStages> slot;
      if constexpr (kPersistent) {
        // A wait on the parity before a barrier's first phase returns at once (the slots' and the
        // stages' first use).
        int n = 0;  // items handed over
        const auto hand_over = [&](const QueryTile& t) {
          const int j = n % 2;
          mbarrier_wait(&item_empty[j], ((n / 2) & 1) ^ 1);
          items[j] = t;
          mbarrier_arrive(&item_full[j]);
          ++n;
        };
        for (int item = blockIdx.x;; item = work.next()) {
          QueryTile t{};
          while (item < work.items && (t = tile_of(item)).rows == 0) item = work.next();
          if (item >= work.items) break;
          hand_over(t);
          load_kv(p, maps, t, n == 1, sk, sv, k_full, v_full, k_empty, v_empty, slot);
        }
        hand_over(QueryTile{});  // no more items
      } else if (own.tiles > 0) {
        mbarrier_arrive_expect(&q_full[0], kQBytes);
        load_q(p, maps, own, 0, kConsumers, sq, q_full[0]);
        load_kv(p, maps, own, true, sk, sv, k_full, v_full, k_empty, v_empty, slot);
      }
      return;
    }
    setmaxnreg_inc<kConsumerRegs>();
    const int consumer = group - 1;
    // Ping-pong: the consumers issue their products in turn, each handing the turn to the next (a
    // named barrier per consumer), from item to item, so that one's softmax runs while the tensor
    // cores work through the others' products. The last consumer lets consumer 0 go first, and
    // consumer 0 takes the turn it is handed after the last products.
    if (consumer == kConsumers - 1) named_barrier_arrive(kTurn, 256);
    Slot<kStages> slot;
    if constexpr (kPersistent) {
      // Each consumer loads its own rows of an item's Q, once its output of the last one is out
      // of them.
      uint32_t q_loads = 0;
      for (int n = 0;; ++n) {
        const int j = n % 2;
        mbarrier_wait(&item_full[j], (n / 2) & 1);
        const QueryTile t = items[j];
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&item_empty[j]);
        if (t.rows == 0) break;
        if (t.tiles > 0) {
          if (threadIdx.x % 128 == 0) {
            mbarrier_arrive_expect(&q_full[consumer], kQBytes / kConsumers);
            load_q(p, maps, t, consumer, 1, sq, q_full[consumer]);
          }
          ++q_loads;
        }
        consume(p, maps, t, mask, sq, sk, sv, q_full[consumer], (q_loads - 1) & 1u, true, k_full, v_full, k_empty,
                v_empty, slot, consumer, lane);
      }
    } else {
      consume(p, maps, own, mask, sq, sk, sv, q_full[0], 0, false, k_full, v_full, k_empty, v_empty, slot, consumer,
              lane);
    }
    if (consumer == 0) named_barrier_sync(kTurn, 256);
  }

  // Rows [64 c0, 64 (c0 + consumers)) of item t's Q tile, completing on q_full (the caller
  // expects their bytes).
  static __device__ __forceinline__ void load_q(const Params& p, const Maps& maps, const QueryTile& t, int c0,
                                                int consumers, T* sq, uint64_t& q_full) {
    const int tb = p.a.cu_seqlens_q ? 0 : static_cast<int>(t.b);  // the maps' batch coordinate
    for (int c = c0; c < c0 + consumers; ++c)
#pragma unroll
      for (int cb = 0; cb < kHeadDim / 64; ++cb)
        tma_load_4d(sq + cb * kBlockM * 64 + c * 64 * 64, &maps.q, &q_full, cb * 64, t.h,
                    static_cast<int>(t.seq.row_q + t.q0 + c * 64), tb);
  }

  // K and V of item t's key tiles, each into the next stage of the ring once its last use has
  // freed it. On the block's first item the others wait until K(0) is in, rather than share the
  // SM's bandwidth with it.
  static __device__ __forceinline__ void load_kv(const Params& p, const Maps& maps, const QueryTile& t, bool first,
                                                 T* sk, T* sv,
                                                 uint64_t (&k_full)[kStages], uint64_t (&v_full)[kStages],
                                                 uint64_t (&k_empty)[kStages], uint64_t (&v_empty)[kStages],
                                                 Slot<kStages>& slot) {
    const int hk = t.h / p.group;
    const int tb = p.a.cu_seqlens_q ? 0 : static_cast<int>(t.b);  // the maps' batch coordinate
    const int64_t key_row0 = t.seq.row_k + t.n_begin * kBlockN;
#pragma unroll 1
    for (int i = 0; i < t.tiles; ++i, slot.next()) {
      const int stage = slot.stage;
      const int row = static_cast<int>(key_row0 + i * kBlockN);
      mbarrier_wait(&k_empty[stage], slot.phase ^ 1u);
      mbarrier_arrive_expect(&k_full[stage], kKVBytes);
      load_tile<kBlockN, kHeadDim>(sk + stage * kBlockN * kHeadDim, &maps.k, &k_full[stage], row, hk, tb);
      if (first && i == 0) mbarrier_wait(&k_full[stage], slot.phase);
      mbarrier_wait(&v_empty[stage], slot.phase ^ 1u);
      mbarrier_arrive_expect(&v_full[stage], kKVBytes);
      load_tile<kBlockN, kHeadDim>(sv + stage * kBlockN * kHeadDim, &maps.v, &v_full[stage], row, hk, tb);
    }
  }

  // Query tile t for this consumer's 64 rows: S = Q K^T and O += P V over its key tiles, which
  // arrive in the stages from `slot` on (left after them), then the output. Q is in once q_full
  // completes its phase of parity q_phase. own_q: the consumer loads its own rows of Q
  // (persistent), so it waits for its products' last reads of them before it returns.
  static __device__ __forceinline__ void consume(const Params& p, const Maps& maps, const QueryTile& t,
                                                 const core::Mask& mask, T* sq, T* sk, T* sv, uint64_t& q_full,
                                                 uint32_t q_phase, bool own_q, uint64_t (&k_full)[kStages],
                                                 uint64_t (&v_full)[kStages], uint64_t (&k_empty)[kStages],
                                                 uint64_t (&v_empty)[kStages], Slot<kStages>& slot, int consumer,
                                                 int lane) {
    const int64_t b = t.b, q0 = t.q0, n_begin = t.n_begin;
    const int h = t.h, rows = t.rows, tiles = t.tiles;
    const core::Sequence& seq = t.seq;
    const int warp_row0 = consumer * 64 + (threadIdx.x % 128) / 32 * 16;
    const ScoreTransform f = p.score_transform(b, h);
    const bool alibi = p.a.alibi_slopes != nullptr;
    float o[1][kDT][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {}, row_fix[1][2] = {};
    auto& o_flat = reinterpret_cast<float(&)[kDT * 4]>(o);
    float s[1][kNT][4];
    auto& s_flat = reinterpret_cast<float(&)[kNT * 4]>(s);
    uint32_t pa[kBlockN / 16][4];
    // Descriptors of this consumer's rows of Q, and of stage 0's K (K-major) and V (MN-major);
    // a stage is kKVBytes further on.
    const uint64_t q_desc = k_major_desc(smem_u32(sq) + consumer * 64 * 128);
    const uint64_t k_desc = k_major_desc(smem_u32(sk)), v_desc = mn_major_desc(smem_u32(sv), kBlockN * 128);
    const auto at_stage = [](uint64_t desc, int stage) { return advance(desc, stage * kKVBytes); };

    // S = Q K^T of the tile in `stage` for this consumer's 64 rows, issued and committed as one
    // group; with `half` (kHalf) over the tile's first kBlockN / 2 keys only, into s_low (the first
    // half of S's accumulators in the whole tile's shape).
    float s_low[kNT * 2];
    const auto issue_qk = [&](int stage, auto half) {
      constexpr int kN = decltype(half)::value ? kBlockN / 2 : kBlockN;
      auto& d = *reinterpret_cast<float(*)[kN / 2]>(decltype(half)::value ? s_low : s_flat);
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        Wgmma<T, kN>::template ss<0, 0>(d, k_step(q_desc, kBlockM, ks), k_step(at_stage(k_desc, stage), kBlockN, ks),
                                        ks > 0);
      wgmma_commit();
    };
    // O += P V of the tile in `stage`, issued and committed as one group: 16 keys (two 8-row atoms
    // of 1024 bytes) per step, V's column blocks kBlockN rows apart; with `half`, the first
    // kBlockN / 2 keys.
    const auto issue_pv = [&](int stage, auto half) {
      constexpr int kSteps = (decltype(half)::value ? kBlockN / 2 : kBlockN) / 16;
#pragma unroll
      for (int ps = 0; ps < kSteps; ++ps)
        Wgmma<T, kHeadDim>::template rs<1>(o_flat, pa[ps], advance(at_stage(v_desc, stage), ps * 2 * 1024), true);
      wgmma_commit();
    };
    constexpr std::false_type kWhole{};
    constexpr std::true_type kHalf{};
    // Key tile i's mask against `mask_rows` query rows.
    const int64_t pq0 = seq.pos_q + q0;
    const auto tile_mask = [&](int i, int mask_rows) {
      const int64_t n = n_begin + i;
      return TileMask(mask, seq.pos_k + n * kBlockN - pq0, mask_rows, tile_rows(seq.len_k, n * kBlockN, kBlockN));
    };
    // Whether key tile i needs the mask (or runs past the sequence's last key). A mask's fully
    // visible tiles are one run of them, [full_begin, full_end), found once here: the loop then
    // tests two ints instead of every tile's bounds.
    const auto partial_at = [&](int i) { return !tile_mask(i, rows).whole(rows, kBlockN); };
    int full_begin = 0, full_end = tiles;
    while (full_begin < tiles && partial_at(full_begin)) ++full_begin;
    while (full_end > full_begin && partial_at(full_end - 1)) --full_end;
    // The scores and softmax of S(i) into P(i) (in s); the correction O needs once P(i - 1) V is in.
    const auto softmax = [&](int i, float (&correction)[1][2]) {
      const bool partial = i < full_begin || i >= full_end;
      // The lane, opaque to the compiler in each tile: otherwise it computes every element's row
      // and column once, before the loop, and holds them in some 50 registers throughout (the
      // kernel spilled).
      int tile_lane = lane;
      asm volatile("" : "+r"(tile_lane));
      const TileMask tile = tile_mask(i, kBlockM);
      if constexpr (kPlain) {  // the scores stay raw: the scale goes into the exponent
        if (partial) transform_scores<true>(s, f, false, true, tile, warp_row0, tile_lane);
        return softmax_tile<kHalvesInTurn, T>(s, row_max, row_sum, p.qk_scale, correction, row_fix);
      } else {
        transform_scores(s, f, alibi, partial, tile, warp_row0, tile_lane);
        return softmax_tile<kHalvesInTurn, T>(s, row_max, row_sum, 1.0f, correction, row_fix);
      }
    };
    const auto to_a = [&] {
#pragma unroll
      for (int ps = 0; ps < kBlockN / 16; ++ps) accumulators_to_a<T>(pa[ps], s[0][2 * ps], s[0][2 * ps + 1]);
    };
    // The ping-pong's turns (see run).
    const auto my_turn = [&] { named_barrier_sync(kTurn + consumer, 256); };
    const auto pass_turn = [&] { named_barrier_arrive(kTurn + (consumer + 1) % kConsumers, 256); };
    // Under a causal mask the first consumers' rows end before the block's last key tiles: a
    // consumer computes its first `mine` tiles only, then frees the rest as they arrive and takes
    // its turns in the ring without issuing (every consumer takes tiles + 1 turns).
    int mine = 0;
    bool half_last = false;
    if (const int own_rows = min(rows - consumer * 64, 64); own_rows > 0) {
      int64_t first, end;
      key_tiles<kBlockN>(mask, seq, q0 + consumer * 64, own_rows, &first, &end);
      mine = static_cast<int>(end - n_begin < tiles ? (end > n_begin ? end - n_begin : 0) : tiles);
      // Whether its rows see only the first half of their last tile (the first consumer's diagonal
      // tile under a causal mask): that tile's products then run over those keys alone.
      if (kBlockN == 128 && mine >= 2 && n_begin + mine == end) {
        key_tiles<kBlockN / 2>(mask, seq, q0 + consumer * 64, own_rows, &first, &end);
        half_last = end == 2 * (n_begin + mine) - 1;
      }
    }
    // Only the last key tile can run past the sequence. In a packed batch its V rows past the
    // sequence are zeroed before P V (every consumer, then a barrier of them); in a padded one
    // they are past the tensor and read as zeros.
    const auto clean_last_v = [&](int stage) {
      const int valid_n = tile_rows(seq.len_k, (n_begin + tiles - 1) * kBlockN, kBlockN);
      if (!p.a.cu_seqlens_k || valid_n == kBlockN) return;
      zero_rows<kBlockN, kHeadDim>(sv + stage * kBlockN * kHeadDim, valid_n, threadIdx.x - 128, kConsumerThreads);
      named_barrier_sync(kZeroed, kConsumerThreads);
    };

    Slot<kStages> cur = slot, prev = slot;  // tile i's, and tile i - 1's
    // The correction of O that P(i - 1) V waits for (the row max moved with tile i - 1). It is
    // applied between the issue of S(i) and that of P(i - 1) V, where the tensor cores are busy,
    // rather than after P(i - 1)'s softmax, where it would hold up the next issue.
    float correction[1][2];
    bool moved = false;
    __shared__ float scratch[kConsumerThreads];  // ahead_of_wait's, a word per thread
    const auto rescale_pending = [&] {
      keep(o_flat);
      if (moved) rescale(o, correction);
      keep(o_flat);
      wgmma_fence();
    };
    if (mine > 0) {
      mbarrier_wait(&q_full, q_phase);
      mbarrier_wait(&k_full[cur.stage], cur.phase);
      my_turn();
      wgmma_fence();
      issue_qk(cur.stage, kWhole);
      pass_turn();
      wgmma_wait<0>();
      keep(s_flat);
      if (lane == 0) mbarrier_arrive(&k_empty[cur.stage]);  // K(0) is free
      softmax(0, correction);  // O is still zero: nothing to rescale
      to_a();
      cur.next();
    }
    // Tile i's S and P(i - 1) V, then P(i); `half` as issue_qk's, for tile i.
    const auto step = [&](int i, auto half) {
      mbarrier_wait(&k_full[cur.stage], cur.phase);
      mbarrier_wait(&v_full[prev.stage], prev.phase);
      keep(o_flat);
      keep(pa);
      my_turn();
      wgmma_fence();
      issue_qk(cur.stage, half);
      rescale_pending();
      issue_pv(prev.stage, kWhole);
      pass_turn();
      wgmma_wait<1>();  // S(i) is in; P(i - 1) V runs on
      if constexpr (decltype(half)::value) {
        keep(s_low);
#pragma unroll
        for (int e = 0; e < kNT * 4; ++e) s_flat[e] = e < kNT * 2 ? s_low[e] : -INFINITY;  // none sees the rest
      } else {
        keep(s_flat);
      }
      if (lane == 0) mbarrier_arrive(&k_empty[cur.stage]);  // K(i) is free
      moved = softmax(i, correction);
      ahead_of_wait(smem_u32(&scratch[threadIdx.x - 128]), row_sum[0][0] + row_sum[0][1]);  // P(i) under P(i - 1) V
      wgmma_wait<0>();
      keep(o_flat);
      keep(pa);
      if (lane == 0) mbarrier_arrive(&v_empty[prev.stage]);  // V(i - 1) is free
      to_a();
      cur.next();
      prev.next();
    };
    for (int i = 1; i < (half_last ? mine - 1 : mine); ++i) step(i, kWhole);
    if (half_last) step(mine - 1, kHalf);
    // P V of the last tile (each way with its own wait, so that no product is in flight where the
    // two meet).
    const auto last_pv = [&](auto half) {
      mbarrier_wait(&v_full[prev.stage], prev.phase);
      if (mine == tiles) clean_last_v(prev.stage);  // the last tile's
      keep(o_flat);
      keep(pa);
      my_turn();
      rescale_pending();
      issue_pv(prev.stage, half);
      pass_turn();
      wgmma_wait<0>();
      keep(o_flat);
      if (lane == 0) mbarrier_arrive(&v_empty[prev.stage]);  // V(mine - 1) is free
    };
    if (half_last) last_pv(kHalf);
    else if (mine > 0) last_pv(kWhole);
    if (mine < tiles) {  // tiles [mine, tiles): turns without products
      if (mine == 0) {
        my_turn();
        pass_turn();
      }
      for (int i = mine; i < tiles; ++i, cur.next()) {
        mbarrier_wait(&k_full[cur.stage], cur.phase);
        if (lane == 0) mbarrier_arrive(&k_empty[cur.stage]);
        mbarrier_wait(&v_full[cur.stage], cur.phase);
        if (i == tiles - 1) clean_last_v(cur.stage);
        if (lane == 0) mbarrier_arrive(&v_empty[cur.stage]);
        my_turn();
        pass_turn();
      }
    }
    slot = cur;
    if (maps.store_out && rows == kBlockM) {
      // The consumer's rows of Q are free once its products are in; with no products of its own
      // (mine == 0), once Q has arrived, so that the copy does not land on the output.
      if (mine == 0 && tiles > 0) mbarrier_wait(&q_full, q_phase);
      store_output(p, maps, b, h, seq, q0, o, row_max, row_sum, row_fix, sq, consumer, lane, warp_row0);
    } else {
      write_output<T>(p, b, h, seq, q0, rows, o, row_max, row_sum, lane, warp_row0, row_fix);
      if (own_q) named_barrier_sync(kOutStaged + consumer, 128);  // every warp is past its products
      // Persistent, a consumer loads its own rows of Q: with no products of its own it has not
      // waited for them, and its copy must land before the next one goes to the same barrier (a
      // second arrival in one phase) or the block ends (a copy into freed shared memory).
      if constexpr (kPersistent)
        if (mine == 0 && tiles > 0) mbarrier_wait(&q_full, q_phase);
    }
  }

  // Normalises this consumer's 64 rows of O into its rows of the Q tile (as TMA lays a tile out:
  // 128-byte swizzle) and stores them by TMA; writes their lse. Every row is the sequence's.
  static __device__ __forceinline__ void store_output(const Params& p, const Maps& maps, int64_t b, int h,
                                                      const core::Sequence& seq, int64_t q0,
                                                      const float (&o)[1][kDT][4], const float (&row_max)[1][2],
                                                      const float (&row_sum)[1][2], const float (&row_fix)[1][2],
                                                      T* sq, int consumer, int lane,
                                                      int warp_row0) {
    const core::AttentionArgs& a = p.a;
    // The rows' lse is computed and written while the copy runs.
    float sum[2], inv[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      sum[half] = quad_sum(row_sum[0][half]);
      inv[half] = row_inverse(sum[half] + quad_sum(row_fix[0][half]));
    }
    stage_rows<T, kDT>(smem_u32(sq), kBlockM * 128, warp_row0,
                       *reinterpret_cast<const float(*)[kDT * 4]>(&o[0][0][0]), inv, lane);
    fence_proxy_async();
    named_barrier_sync(kOutStaged + consumer, 128);
    const bool issuer = threadIdx.x % 128 == 0;
    if (issuer) {
      const int64_t tb = a.cu_seqlens_q ? 0 : b;
#pragma unroll
      for (int c = 0; c < kHeadDim / 64; ++c)
        tma_store_4d(&maps.out, sq + c * kBlockM * 64 + consumer * 64 * 64, c * 64, h,
                     static_cast<int>(seq.row_q + q0 + consumer * 64), static_cast<int>(tb));
      bulk_commit();
    }
    if (lane % 4 == 0)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        a.lse[p.lse_index(b, h, seq.row_q + q0 + warp_row0 + lane / 4 + half * 8)] =
            row_lse(row_max[0][half], sum[half]);
    if (issuer) bulk_wait_read();  // the block's shared memory outlives the copy's reads of it
  }
};

template <typename T, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(Forward<T, kHeadDim, kPlain>::kThreads, 1)
    forward_kernel(const __grid_constant__ Params p, const __grid_constant__ Maps maps, const core::TileOrder order,
                   const Schedule work) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  Forward<T, kHeadDim, kPlain>::run(p, maps, order, work);
#endif
}

}  // namespace ringflash::cuda::sm90
