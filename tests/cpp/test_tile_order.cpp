// kernels/common/tile_order.h: the order in which the Hopper kernels' blocks take their tiles.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/common/tile_order.h"

namespace ringflash::test {
namespace {

using core::AttentionArgs;
using core::Mask;
using core::TileOrder;

constexpr int64_t kUnbounded = AttentionArgs::kUnbounded;
constexpr Mask kCausal{kUnbounded, 0}, kNone{kUnbounded, kUnbounded}, kWindow{128, 0};

// Every (head, rank) once; within a section the heads take turns and ranks never go down.
void expect_order(const TileOrder& order) {
  std::vector<int> seen(static_cast<size_t>(order.heads) * order.tiles, 0);
  int last_rank = -1, last_first = -1;
  for (int block = 0; block < order.heads * order.tiles; ++block) {
    int head = -1, rank = -1;
    order.item(block, &head, &rank);
    ASSERT_GE(head, 0);
    ASSERT_LT(head, order.heads);
    ASSERT_GE(rank, 0);
    ASSERT_LT(rank, order.tiles);
    ++seen[static_cast<size_t>(head) * order.tiles + rank];
    const int first = head / order.section * order.section;
    if (first == last_first) EXPECT_GE(rank, last_rank) << "block " << block;
    else EXPECT_EQ(rank, 0) << "block " << block << " starts the section of head " << first;
    last_first = first;
    last_rank = rank;
  }
  for (size_t i = 0; i < seen.size(); ++i)
    EXPECT_EQ(seen[i], 1) << "head " << i / order.tiles << ", rank " << i % order.tiles;
}

TEST(TileOrder, TakesEveryTileOnceLongestFirstInEachSection) {
  for (int heads : {1, 3, 8, 32})
    for (int tiles : {1, 2, 7, 64})
      for (int section : {1, 2, 4, 5, 32}) {
        SCOPED_TRACE(testing::Message() << heads << " heads, " << tiles << " tiles, sections of " << section);
        expect_order({heads, tiles, section < heads ? section : heads});
      }
}

TEST(TileOrder, TheFirstBlocksTakeTheFirstRankOfEverySectionHead) {
  const TileOrder order{8, 16, 4};
  for (int block = 0; block < 4; ++block) {
    int head = -1, rank = -1;
    order.item(block, &head, &rank);
    EXPECT_EQ(head, block);
    EXPECT_EQ(rank, 0);
  }
}

TEST(TileOrder, SectionsOnlyUnderAMaskWithOneUnboundedSide) {
  // 4 MiB per group of 2 heads: 4 groups share 16 MiB.
  constexpr int64_t kMiB = int64_t{1} << 20;
  EXPECT_EQ(core::tile_order(kCausal, 32, 64, 2, 4 * kMiB).section, 8);
  EXPECT_EQ(core::tile_order(kCausal, 6, 64, 2, 4 * kMiB).section, 6);   // no more than the heads
  EXPECT_EQ(core::tile_order(kCausal, 32, 64, 2, 64 * kMiB).section, 2);  // at least one group
  EXPECT_EQ(core::tile_order(Mask{0, kUnbounded}, 32, 64, 1, 4 * kMiB).section, 4);
  EXPECT_EQ(core::tile_order(kNone, 32, 64, 2, 4 * kMiB).section, 2);
  EXPECT_EQ(core::tile_order(kWindow, 32, 64, 2, 4 * kMiB).section, 2);
}

}  // namespace
}  // namespace ringflash::test
