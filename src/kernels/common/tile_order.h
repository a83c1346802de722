// The order in which a launch's blocks take their (head, tile) items.
//
// Blocks start in blockIdx order as SMs free up. Heads are taken in sections, and a section's tiles
// rank by rank across its heads, rank 0 being the tile with the most work under a causal mask. So
// the longest tiles go first and a causal launch's last wave is made of short ones; head by head,
// it ended on one head's long tiles. A section is as many heads as share about a third of the L2,
// so that the blocks in flight read operands that stay there. Without a causal mask every tile has
// the same work, and a section is the heads that share k and v (head by head read best).
#pragma once

#include <algorithm>
#include <cstdint>

#include "host_device.h"
#include "mask.h"
#include "params.h"

namespace ringflash::core {

struct TileOrder {
  int heads;    // of the launch (per sequence)
  int tiles;    // per head
  int section;  // heads per section, a multiple of the heads that share k and v

  // Block `block`'s head and tile rank; blocks [0, heads * tiles) take every pair once.
  RINGFLASH_HOST_DEVICE void item(int block, int* head, int* rank) const {
    const int first = block / (section * tiles) * section;
    const int width = heads - first < section ? heads - first : section;
    const int at = block - first * tiles;
    *head = first + at % width;
    *rank = at / width;
  }
};

// The order of `heads` heads of `tiles` tiles each under `mask`, where `group` heads at a time share
// what their blocks read, `shared_bytes` of it per group.
inline TileOrder tile_order(const Mask& mask, int heads, int tiles, int group, int64_t shared_bytes) {
  constexpr int64_t kL2Share = int64_t{16} << 20;  // about a third of an H100's L2
  constexpr int64_t kUnbounded = AttentionArgs::kUnbounded;
  const bool uneven = (mask.left == kUnbounded) != (mask.right == kUnbounded);
  const int64_t groups = uneven ? std::max<int64_t>(1, kL2Share / std::max<int64_t>(1, shared_bytes)) : 1;
  return {heads, tiles, static_cast<int>(std::min<int64_t>(heads, groups * group))};
}

}  // namespace ringflash::core
