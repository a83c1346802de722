// Shard arithmetic for every layout (layout.h).
//
// Pieces with no rows are left out, so every piece of a shard has count >= 1 and an empty shard
// is an empty list.
#include "ringflash/layout.h"

#include <algorithm>
#include <utility>

#include "../core/check.h"

namespace ringflash {
namespace {

// Part `part` of `parts` when `length` items are cut in order, the first length % parts parts one
// item longer: returns {first item, item count}.
std::pair<int64_t, int64_t> even_split(int64_t length, int64_t part, int64_t parts) {
  const int64_t base = length / parts, extra = length % parts;
  return {part * base + std::min(part, extra), base + (part < extra ? 1 : 0)};
}

void add_piece(Shard& shard, int64_t start, int64_t count, int64_t stride) {
  if (count > 0) shard.push_back(Piece{start, count, stride});
}

void check_rank(const char* op, const char* name, int64_t seqlen, int rank, int world) {
  RINGFLASH_CHECK(seqlen >= 0, InvalidArgument, "[", op, "] seqlen must be >= 0, got ", seqlen);
  RINGFLASH_CHECK(world >= 1, InvalidArgument, "[", op, "] ", name, "world must be >= 1, got ", world);
  RINGFLASH_CHECK(rank >= 0 && rank < world, InvalidArgument, "[", op, "] ", name, "rank must be in [0, ", world,
                  "), got ", rank);
}

}  // namespace

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kZigzag: return "zigzag";
    case Layout::kStripe: return "stripe";
  }
  return "unknown";
}

Shard shard_of(Layout layout, int64_t seqlen, int rank, int world) {
  check_rank("shard_of", "", seqlen, rank, world);
  Shard shard;
  switch (layout) {
    case Layout::kContiguous: {
      const auto [start, count] = even_split(seqlen, rank, world);
      add_piece(shard, start, count, 1);
      return shard;
    }
    case Layout::kZigzag: {  // chunks r and 2P - 1 - r of 2P
      const auto [first_start, first_count] = even_split(seqlen, rank, 2 * int64_t{world});
      const auto [second_start, second_count] = even_split(seqlen, 2 * int64_t{world} - 1 - rank, 2 * int64_t{world});
      add_piece(shard, first_start, first_count, 1);
      add_piece(shard, second_start, second_count, 1);
      return shard;
    }
    case Layout::kStripe: {  // positions r, r + P, ... below seqlen
      const int64_t count = seqlen > rank ? (seqlen - rank + world - 1) / world : 0;
      add_piece(shard, rank, count, world);
      return shard;
    }
  }
  throw InvalidArgument(core::str_cat("[shard_of] unknown layout ", static_cast<int>(layout)));
}

Shard hybrid_shard(Layout ring_layout, int64_t seqlen, int ring_rank, int ring_world, int ulysses_rank,
                   int ulysses_world) {
  check_rank("hybrid_shard", "ring_", seqlen, ring_rank, ring_world);
  check_rank("hybrid_shard", "ulysses_", seqlen, ulysses_rank, ulysses_world);
  const Shard ring = shard_of(ring_layout, seqlen, ring_rank, ring_world);
  const auto [first, rows] = even_split(shard_rows(ring), ulysses_rank, ulysses_world);
  return sub_shard(ring, first, rows);
}

Shard sub_shard(const Shard& shard, int64_t first, int64_t rows) {
  const int64_t total = shard_rows(shard);
  RINGFLASH_CHECK(first >= 0 && rows >= 0 && first <= total && rows <= total - first, InvalidArgument,
                  "[sub_shard] rows [", first, ", ", first, " + ", rows, ") must lie within the shard's ", total,
                  " rows");
  Shard sub;
  int64_t row = 0;  // local row of the current piece's first position
  for (const Piece& piece : shard) {
    const int64_t begin = std::max(first, row), end = std::min(first + rows, row + piece.count);
    if (begin < end) add_piece(sub, piece.position(begin - row), end - begin, piece.stride);
    row += piece.count;
  }
  return sub;
}

int64_t shard_rows(const Shard& shard) {
  int64_t rows = 0;
  for (const Piece& piece : shard) rows += piece.count;
  return rows;
}

std::vector<int64_t> shard_positions(const Shard& shard) {
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(shard_rows(shard)));
  for (const Piece& piece : shard)
    for (int64_t i = 0; i < piece.count; ++i) positions.push_back(piece.position(i));
  return positions;
}

}  // namespace ringflash
