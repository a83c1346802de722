// How a global sequence is split among ranks, for every strategy. The strategies, the tests and
// the benchmarks all shard and unshard through these functions.
//
// A rank's shard is a list of pieces; its local rows are the pieces' positions in order. A piece
// covers global positions start, start + stride, ..., start + (count - 1) * stride.
//
//   kContiguous (ring, allgather, ulysses): S is cut into P parts in order; the first S % P ranks
//       get one row more than the others.
//   kZigzag: S is cut into 2P chunks the same way; rank r holds chunk r, then chunk 2P - 1 - r,
//       which balances causal work.
//   kStripe: rank r holds positions r, r + P, r + 2P, ... (one piece of stride P).
//   hybrid (ulysses x ring): the ring layout over the ring group gives each ring position a shard;
//       its rows are then cut contiguously among the ulysses group (hybrid_shard).
//
// Packed batches shard every sequence on its own by the same rule; the local tensor holds
// sequence 0's shard, then sequence 1's, and so on (local_cu_seqlens). No length has to divide
// by P or 2P, and a shard may be empty.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringflash {

struct Piece {
  int64_t start = 0;
  int64_t count = 0;
  int64_t stride = 1;
  int64_t position(int64_t i) const { return start + i * stride; }
};
using Shard = std::vector<Piece>;

enum class Layout { kContiguous, kZigzag, kStripe };
const char* layout_name(Layout layout);

// Rank `rank` of `world`'s shard of a sequence of `seqlen` positions.
Shard shard_of(Layout layout, int64_t seqlen, int rank, int world);

// Rank (ring_rank, ulysses_rank)'s shard in the hybrid layout: the ring layout over ring_world
// ranks, each ring shard's rows then cut contiguously among ulysses_world ranks.
Shard hybrid_shard(Layout ring_layout, int64_t seqlen, int ring_rank, int ring_world, int ulysses_rank,
                   int ulysses_world);

// Rows [first, first + rows) of a shard's local rows, as a shard.
Shard sub_shard(const Shard& shard, int64_t first, int64_t rows);

// Number of local rows.
int64_t shard_rows(const Shard& shard);

// Global position of every local row, in order.
std::vector<int64_t> shard_positions(const Shard& shard);

// Cumulative local lengths (int32, B + 1) of a packed batch with global `cu_seqlens`, where
// every sequence is sharded by `shard(seqlen)`; also returns each sequence's shard.
template <typename ShardFn>
std::vector<int32_t> local_cu_seqlens(const std::vector<int32_t>& cu_seqlens, ShardFn&& shard,
                                      std::vector<Shard>* shards = nullptr) {
  std::vector<int32_t> local(cu_seqlens.size(), 0);
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    Shard s = shard(static_cast<int64_t>(cu_seqlens[b + 1] - cu_seqlens[b]));
    local[b + 1] = local[b] + static_cast<int32_t>(shard_rows(s));
    if (shards) shards->push_back(std::move(s));
  }
  return local;
}

}  // namespace ringflash
