// Sequence-parallel strategies: the layouts, every strategy against the float64 reference on
// inproc ranks (or on MPI ranks under mpiexec), bad input on some ranks, and failing ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_error.h"
#include "parallel_harness.h"
#include "ringflash/errors.h"

namespace ringflash::test {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr Strategy kStrategies[] = {Strategy::kRing,      Strategy::kZigzag,  Strategy::kStripe,
                                    Strategy::kAllGather, Strategy::kUlysses, Strategy::kHybrid};
constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStripe};
constexpr int kWorlds[] = {1, 2, 3, 4, 8};

// Under mpiexec the strategy cases run over MPI ranks (those whose world size is the job's) and the
// inproc-only tests skip.
bool under_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

// The size of the MPI job, or 0 when not under mpiexec.
int mpi_size() {
  static const int size = under_mpi() ? mpi_world()->size() : 0;
  return size;
}

// A fresh communicator over the MPI job: its own failure domain, so a case that fails its
// communicators leaves the next cases unharmed.
std::unique_ptr<Communicator> fresh_mpi_world() {
  std::unique_ptr<Communicator> world = mpi_world();
  world->set_timeout(seconds(60));
  return world;
}

#define SKIP_UNDER_MPI() \
  if (mpi_size() > 0) GTEST_SKIP() << "inproc only"

// ---- layouts --------------------------------------------------------------------------------

TEST(Layout, Names) {
  EXPECT_STREQ(layout_name(Layout::kContiguous), "contiguous");
  EXPECT_STREQ(layout_name(Layout::kZigzag), "zigzag");
  EXPECT_STREQ(layout_name(Layout::kStripe), "stripe");
}

TEST(Layout, EveryPositionExactlyOnce) {
  for (Layout layout : kLayouts)
    for (int64_t seqlen : {0, 1, 2, 5, 7, 17, 203, 1013, 4097})
      for (int world : {1, 2, 3, 4, 5, 7, 8, 16}) {
        std::vector<int> seen(static_cast<size_t>(seqlen), 0);
        int64_t rows = 0;
        for (int r = 0; r < world; ++r) {
          const Shard shard = shard_of(layout, seqlen, r, world);
          for (const Piece& piece : shard) EXPECT_GT(piece.count, 0) << "pieces are never empty";
          const std::vector<int64_t> positions = shard_positions(shard);
          ASSERT_EQ(static_cast<int64_t>(positions.size()), shard_rows(shard));
          rows += shard_rows(shard);
          for (int64_t p : positions) {
            ASSERT_GE(p, 0);
            ASSERT_LT(p, seqlen);
            ++seen[p];
          }
        }
        EXPECT_EQ(rows, seqlen);
        for (int64_t p = 0; p < seqlen; ++p)
          ASSERT_EQ(seen[p], 1) << layout_name(layout) << " S=" << seqlen << " P=" << world << " position " << p;
      }
}

TEST(Layout, ContiguousGivesTheFirstRanksOneRowMore) {
  for (int64_t seqlen : {0, 3, 203, 1013})
    for (int world : {1, 2, 3, 4, 8}) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const Shard shard = shard_of(Layout::kContiguous, seqlen, r, world);
        const int64_t want = seqlen / world + (r < seqlen % world ? 1 : 0);
        EXPECT_EQ(shard_rows(shard), want) << "S=" << seqlen << " P=" << world << " rank " << r;
        if (want == 0) {
          EXPECT_TRUE(shard.empty());
          continue;
        }
        ASSERT_EQ(shard.size(), 1u);
        EXPECT_EQ(shard[0].start, next);
        EXPECT_EQ(shard[0].stride, 1);
        next += want;
      }
    }
}

TEST(Layout, ZigzagHoldsChunksRAnd2PMinus1MinusR) {
  // S = 10 over 2P = 4 chunks of 3, 3, 2, 2 positions.
  const Shard r0 = shard_of(Layout::kZigzag, 10, 0, 2), r1 = shard_of(Layout::kZigzag, 10, 1, 2);
  EXPECT_EQ(shard_positions(r0), (std::vector<int64_t>{0, 1, 2, 8, 9}));
  EXPECT_EQ(shard_positions(r1), (std::vector<int64_t>{3, 4, 5, 6, 7}));
  // S = 1013 over 2P = 8 chunks: the first 5 of 127 positions, the last 3 of 126.
  const Shard r3 = shard_of(Layout::kZigzag, 1013, 3, 4), z0 = shard_of(Layout::kZigzag, 1013, 0, 4);
  ASSERT_EQ(r3.size(), 2u);
  EXPECT_EQ(r3[0].start, 3 * 127);
  EXPECT_EQ(r3[0].count, 127);
  EXPECT_EQ(r3[1].start, 4 * 127);
  EXPECT_EQ(r3[1].count, 127);
  ASSERT_EQ(z0.size(), 2u);
  EXPECT_EQ(z0[1].start, 5 * 127 + 2 * 126);
  EXPECT_EQ(z0[1].count, 126);
  // Shorter than 2P: the last ranks hold nothing, rank 0 holds chunk 0 only.
  EXPECT_EQ(shard_positions(shard_of(Layout::kZigzag, 3, 0, 4)), (std::vector<int64_t>{0}));
  EXPECT_TRUE(shard_of(Layout::kZigzag, 3, 3, 4).empty());
}

TEST(Layout, StripeIsOnePieceOfStrideP) {
  const Shard s = shard_of(Layout::kStripe, 10, 1, 4);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].stride, 4);
  EXPECT_EQ(shard_positions(s), (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(shard_positions(shard_of(Layout::kStripe, 10, 3, 4)), (std::vector<int64_t>{3, 7}));
  EXPECT_TRUE(shard_of(Layout::kStripe, 2, 3, 4).empty());
}

TEST(Layout, HybridCutsEachRingShardAmongTheUlyssesRanks) {
  for (Layout layout : kLayouts)
    for (int64_t seqlen : {0, 5, 203, 1013})
      for (auto [ring, uly] : {std::pair{4, 1}, {2, 2}, {1, 4}, {4, 2}, {2, 4}, {3, 3}}) {
        std::vector<int> seen(static_cast<size_t>(seqlen), 0);
        for (int r = 0; r < ring; ++r) {
          const std::vector<int64_t> ring_positions = shard_positions(shard_of(layout, seqlen, r, ring));
          std::vector<int64_t> joined;
          for (int u = 0; u < uly; ++u) {
            const std::vector<int64_t> part = shard_positions(hybrid_shard(layout, seqlen, r, ring, u, uly));
            const int64_t n = static_cast<int64_t>(ring_positions.size());
            EXPECT_EQ(static_cast<int64_t>(part.size()), n / uly + (u < n % uly ? 1 : 0));
            joined.insert(joined.end(), part.begin(), part.end());
            for (int64_t p : part) ++seen[p];
          }
          EXPECT_EQ(joined, ring_positions) << "the ulysses parts, in order, make up the ring shard";
        }
        for (int64_t p = 0; p < seqlen; ++p) ASSERT_EQ(seen[p], 1);
      }
}

TEST(Layout, SubShardSplitsPieces) {
  const Shard zig = shard_of(Layout::kZigzag, 20, 1, 2);  // positions 5..9 and 10..14
  const Shard sub = sub_shard(zig, 3, 4);
  EXPECT_EQ(shard_positions(sub), (std::vector<int64_t>{8, 9, 10, 11}));
  EXPECT_EQ(sub.size(), 2u);
  EXPECT_TRUE(sub_shard(zig, 10, 0).empty());
  const Shard stripe = sub_shard(shard_of(Layout::kStripe, 20, 2, 4), 1, 3);
  ASSERT_EQ(stripe.size(), 1u);
  EXPECT_EQ(stripe[0].stride, 4);
  EXPECT_EQ(shard_positions(stripe), (std::vector<int64_t>{6, 10, 14}));
  EXPECT_RINGFLASH_ERROR(InvalidArgument, sub_shard(zig, 8, 3), "sub_shard", "10 rows");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, sub_shard(zig, -1, 1), "sub_shard");
}

TEST(Layout, RejectsBadRanks) {
  EXPECT_RINGFLASH_ERROR(InvalidArgument, shard_of(Layout::kZigzag, 10, 2, 2), "shard_of", "rank", "got 2");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, shard_of(Layout::kContiguous, 10, 0, 0), "shard_of", "world", "got 0");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, shard_of(Layout::kStripe, -1, 0, 1), "shard_of", "seqlen", "got -1");
  EXPECT_RINGFLASH_ERROR(InvalidArgument, hybrid_shard(Layout::kZigzag, 10, 0, 2, 3, 2), "hybrid_shard",
                         "ulysses_rank");
}

TEST(Layout, LocalCuSeqlensSkipsEmptyDocuments) {
  const std::vector<int32_t> cu{0, 57, 57, 187, 188, 205};  // documents of 57, 0, 130, 1, 17
  std::vector<Shard> shards;
  const std::vector<int32_t> local =
      local_cu_seqlens(cu, [](int64_t n) { return shard_of(Layout::kZigzag, n, 1, 3); }, &shards);
  ASSERT_EQ(shards.size(), 5u);
  std::vector<int32_t> want{0};
  for (size_t b = 0; b < shards.size(); ++b) {
    EXPECT_EQ(shard_rows(shards[b]), shard_rows(shard_of(Layout::kZigzag, cu[b + 1] - cu[b], 1, 3)));
    want.push_back(want.back() + static_cast<int32_t>(shard_rows(shards[b])));
  }
  EXPECT_EQ(local, want);
  EXPECT_TRUE(shards[1].empty());
}

// ---- every strategy against the reference --------------------------------------------------

// A packed batch with an empty document and one of length 1.
std::vector<int64_t> packed_docs() { return {57, 0, 130, 1, 17}; }

// Ulysses ranks per group for hybrid in the main matrix (every factorisation of 4 and 8 runs in
// HybridFactorisations).
int default_ulysses(int world) { return world == 2 || world == 4 || world == 8 ? 2 : 1; }

ParallelCase make_case(Strategy strategy, bool backward, MaskKind mask, int64_t heads_q, int64_t heads_kv, int world) {
  ParallelCase c;
  c.strategy = strategy;
  c.backward = backward;
  c.mask = mask;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.world = world;
  c.ulysses = strategy == Strategy::kHybrid ? default_ulysses(world) : 1;
  return c;
}

struct Heads {
  int64_t q, kv;
};
constexpr Heads kHeads[] = {{4, 4}, {8, 2}, {4, 1}};  // MHA, GQA 4:1, MQA

// Strategy x direction x {causal, none, window} x {MHA, GQA 4:1, MQA} x world sizes, fp32, a
// padded batch of 2 x 203 positions (uneven for every world size). The problem varies slowest, so
// its reference is computed once for all strategies and world sizes.
std::vector<ParallelCase> matrix_cases() {
  std::vector<ParallelCase> cases;
  for (bool backward : {false, true})
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone, MaskKind::kWindow})
      for (Heads h : kHeads)
        for (Strategy strategy : kStrategies)
          for (int world : kWorlds) cases.push_back(make_case(strategy, backward, mask, h.q, h.kv, world));
  return cases;
}

// Shapes that break things: lengths 1013 and 4097 (cheap: 2 q heads, 1 k/v head, D = 8), lengths
// below the world size (empty shards), a packed batch with an empty document and one of length 1.
std::vector<ParallelCase> shape_cases() {
  std::vector<ParallelCase> cases;
  for (bool backward : {false, true}) {
    for (auto [seqlen, worlds] : {std::pair{int64_t{1013}, std::vector<int>{3, 8}}, {int64_t{4097}, {4}}})
      for (Strategy strategy : kStrategies)
        for (int world : worlds) {
          ParallelCase c = make_case(strategy, backward, MaskKind::kCausal, 2, 1, world);
          c.head_dim = 8;
          c.batch = 1;
          c.seqlen = seqlen;
          cases.push_back(c);
        }
    for (auto [seqlen, world] : {std::pair{int64_t{5}, 8}, {int64_t{1}, 3}})
      for (Strategy strategy : kStrategies) {
        ParallelCase c = make_case(strategy, backward, MaskKind::kCausal, 4, 1, world);
        c.seqlen = seqlen;
        cases.push_back(c);
      }
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kWindow})
      for (Strategy strategy : kStrategies)
        for (int world : {3, 4}) {
          ParallelCase c = make_case(strategy, backward, mask, 4, 1, world);
          c.docs = packed_docs();
          cases.push_back(c);
        }
  }
  return cases;
}

// A causal sliding window narrower than a shard: ring stops after the steps it needs.
std::vector<ParallelCase> sliding_window_cases() {
  std::vector<ParallelCase> cases;
  for (bool backward : {false, true})
    for (Strategy strategy : kStrategies)
      for (int world : {2, 4, 8}) {
        ParallelCase c = make_case(strategy, backward, MaskKind::kCausalWindow, 4, 1, world);
        c.window_left = 20;
        cases.push_back(c);
      }
  return cases;
}

// Options, one bf16 variant and strided tensors per strategy; allgather in slices of heads.
std::vector<ParallelCase> option_cases() {
  std::vector<ParallelCase> cases;
  for (bool backward : {false, true})
    for (Strategy strategy : kStrategies) {
      ParallelCase o = make_case(strategy, backward, MaskKind::kCausal, 4, 2, 3);
      o.softcap = 5.0f;
      o.softmax_scale = 0.3f;
      o.alibi = strategy != Strategy::kStripe;  // stripe refuses ALiBi (StripeRefusesAlibi)
      cases.push_back(o);
      ParallelCase bf16 = make_case(strategy, backward, MaskKind::kCausal, 8, 2, 4);
      bf16.dtype = DType::kBFloat16;
      cases.push_back(bf16);
      ParallelCase strided = make_case(strategy, backward, MaskKind::kCausal, 4, 4, 4);
      strided.strided = true;
      cases.push_back(strided);
    }
  for (bool backward : {false, true})
    for (Strategy strategy : kStrategies)
      if (strategy != Strategy::kStripe) {  // a packed batch with slopes per sequence
        ParallelCase c = make_case(strategy, backward, MaskKind::kCausal, 4, 2, 3);
        c.docs = packed_docs();
        c.alibi = c.alibi_per_sequence = true;
        cases.push_back(c);
      }
  // Three KV heads on two ranks: ulysses gives each rank two, the middle one to both, whose
  // gradients come back from each and are summed into a slice of dk and dv's heads.
  for (bool backward : {false, true})
    for (Strategy strategy : kStrategies) cases.push_back(make_case(strategy, backward, MaskKind::kCausal, 6, 3, 2));
  for (bool backward : {false, true})
    for (bool packed : {false, true}) {
      ParallelCase c = make_case(Strategy::kAllGather, backward, MaskKind::kCausal, 8, 2, 3);
      c.options.kv_heads_per_gather = 1;
      if (packed) c.docs = packed_docs();
      cases.push_back(c);
    }
  return cases;
}

// Hybrid over every factorisation of P = 4 and P = 8, and each ring layout.
std::vector<ParallelCase> hybrid_cases() {
  std::vector<ParallelCase> cases;
  for (bool backward : {false, true}) {
    for (auto [world, uly] : {std::pair{4, 1}, {4, 2}, {4, 4}, {8, 1}, {8, 2}, {8, 4}, {8, 8}}) {
      ParallelCase c = make_case(Strategy::kHybrid, backward, MaskKind::kCausal, 8, 2, world);
      c.ulysses = uly;
      cases.push_back(c);
    }
    for (Layout layout : {Layout::kContiguous, Layout::kStripe}) {
      ParallelCase c = make_case(Strategy::kHybrid, backward, MaskKind::kCausal, 8, 2, 4);
      c.options.hybrid_ring_layout = layout;
      cases.push_back(c);
    }
  }
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<ParallelCase>& info) { return info.param.name(); }

class Strategies : public ::testing::TestWithParam<ParallelCase> {};

TEST_P(Strategies, MatchReference) {
  const ParallelCase& c = GetParam();
  if (mpi_size() > 0) {
    if (c.world != mpi_size()) GTEST_SKIP() << "world size " << c.world << ", the MPI job has " << mpi_size();
    const std::unique_ptr<Communicator> work = fresh_mpi_world(), verdict = fresh_mpi_world();
    run_parallel_case(*work, c, verdict.get());
  } else {
    run_inproc_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, Strategies, ::testing::ValuesIn(matrix_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Shapes, Strategies, ::testing::ValuesIn(shape_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(SlidingWindow, Strategies, ::testing::ValuesIn(sliding_window_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Options, Strategies, ::testing::ValuesIn(option_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(HybridFactorisations, Strategies, ::testing::ValuesIn(hybrid_cases()), case_name);

// ---- bad input on some ranks: the same error on every rank, no hang -------------------------

constexpr milliseconds kShortDeadline = seconds(5);

// Runs `call(rank, comm)` on `world` inproc ranks with a short deadline and expects every rank to
// throw ErrorType with every substring in its message.
template <typename ErrorType, typename Fn>
void expect_on_every_rank(int world, Fn&& call, std::initializer_list<std::string> substrings) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::exception_ptr> errors =
      run_inproc_collect(world, [&](Communicator& comm) { call(comm.rank(), comm); }, kShortDeadline);
  EXPECT_LT(std::chrono::steady_clock::now() - start, kShortDeadline) << "the ranks waited out the deadline";
  ASSERT_EQ(errors.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_error<ErrorType>([&] { if (errors[r]) std::rethrow_exception(errors[r]); }, substrings, __FILE__, __LINE__);
  }
}

ParallelCase small_case(Strategy strategy = Strategy::kRing) {
  ParallelCase c = make_case(strategy, false, MaskKind::kCausal, 4, 2, 3);
  c.seqlen = 40;
  return c;
}

// Rank `rank`'s call of case `c` on `comm` (its own shard of the reference inputs).
void call_case(const ParallelCase& c, Communicator& comm) {
  const ParallelGroup group{&comm};
  RankProblem problem(c, group, *expected_for(c));
  problem.run();
}

TEST(ParallelErrors, HeadsDifferOnOneRank) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      3,
      [](int rank, Communicator& comm) {
        ParallelCase c = small_case();
        if (rank == 1) c.heads_q = 8;
        call_case(c, comm);
      },
      {"[ring]", "number of q heads differs across ranks", "rank 0 has 4", "rank 1 has 8"});
}

// Hybrid agrees in three rounds (ulysses, ring, ulysses): a rank that differs reaches every rank.
TEST(ParallelErrors, HybridHeadsDifferOnOneRank) {
  SKIP_UNDER_MPI();
  for (int odd = 0; odd < 4; ++odd) {
    SCOPED_TRACE("rank " + std::to_string(odd) + " differs");
    expect_on_every_rank<InvalidArgument>(
        4,
        [odd](int rank, Communicator& comm) {
          ParallelCase c = small_case(Strategy::kHybrid);
          c.world = 4;
          c.ulysses = 2;
          if (rank == odd) c.heads_kv = 4;
          const CaseGroup group(comm, c);
          RankProblem problem(c, group.group, *expected_for(c));
          problem.run();
        },
        {"[hybrid]", "number of k/v heads differs across ranks"});
  }
}

TEST(ParallelErrors, HybridRowsDoNotMatchTheLayout) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      4,
      [](int rank, Communicator& comm) {
        ParallelCase c = small_case(Strategy::kHybrid);
        c.world = 4;
        c.ulysses = 2;
        if (rank == 1) c.seqlen = 47;
        const CaseGroup group(comm, c);
        RankProblem problem(c, group.group, *expected_for(c));
        problem.run();
      },
      {"[hybrid]", "rows", "zigzag layout of"});
}

TEST(ParallelErrors, OptionDiffersOnOneRank) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      4,
      [](int rank, Communicator& comm) {
        ParallelCase c = small_case(Strategy::kZigzag);
        if (rank == 3) c.mask = MaskKind::kNone;
        call_case(c, comm);
      },
      {"[zigzag]", "causal differs across ranks", "rank 3 has 0"});
}

TEST(ParallelErrors, RowsDoNotMatchTheLayout) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      3,
      [](int rank, Communicator& comm) {
        ParallelCase c = small_case(Strategy::kStripe);
        if (rank == 2) c.seqlen = 43;  // one row more than the stripe layout of 40 gives rank 2
        call_case(c, comm);
      },
      {"[stripe]", "rows", "stripe layout of 41 positions"});
}

TEST(ParallelErrors, LocalErrorOnOneRankReachesEveryRank) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      3,
      [](int rank, Communicator& comm) {
        const ParallelCase c = small_case();
        RankProblem problem(c, ParallelGroup{&comm}, *expected_for(c));
        if (rank == 2) problem.lse = HostTensor::empty(DType::kFloat16, problem.lse.shape());
        problem.run();
      },
      {"[ring] lse must have dtype float32, got float16", "(on rank 2 of 3)"});
}

TEST(ParallelErrors, PositionsComeFromTheLayout) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      2,
      [](int, Communicator& comm) {
        const ParallelCase c = small_case();
        RankProblem problem(c, ParallelGroup{&comm}, *expected_for(c));
        AttentionParams p = problem.params();
        p.q_offset = 5;
        parallel_attention_forward(Strategy::kRing, ParallelGroup{&comm}, problem.q.view(), problem.k.view(),
                                   problem.v.view(), problem.out.view(), problem.lse.view(), p);
      },
      {"[ring]", "q_offset", "must be left unset"});
}

TEST(ParallelErrors, StripeRefusesAlibi) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<NotSupported>(
      2,
      [](int, Communicator& comm) {
        ParallelCase c = small_case(Strategy::kStripe);
        c.alibi = true;
        call_case(c, comm);
      },
      {"[stripe]", "alibi_slopes", "stripe"});
}

TEST(ParallelErrors, PackedCuSeqlensKMustEqualQ) {
  SKIP_UNDER_MPI();
  expect_on_every_rank<InvalidArgument>(
      2,
      [](int, Communicator& comm) {
        ParallelCase c = small_case(Strategy::kZigzag);
        c.docs = std::vector<int64_t>{20, 0, 13};
        RankProblem problem(c, ParallelGroup{&comm}, *expected_for(c));
        AttentionParams p = problem.params();
        std::vector<int32_t> other{0, 20, 21, 33};
        p.cu_seqlens_k = TensorView(other.data(), DType::kInt32, Device{}, {4});
        parallel_attention_forward(Strategy::kZigzag, ParallelGroup{&comm}, problem.q.view(), problem.k.view(),
                                   problem.v.view(), problem.out.view(), problem.lse.view(), p);
      },
      {"[zigzag]", "cu_seqlens_k must be unset or equal to cu_seqlens_q"});
}

// ---- failing ranks ------------------------------------------------------------------------

TEST(ParallelFaults, RankThrowsBeforeItsFirstSend) {
  SKIP_UNDER_MPI();
  const ParallelCase c = small_case(Strategy::kZigzag);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::exception_ptr> errors = run_inproc_collect(
      4,
      [&](Communicator& comm) {
        if (comm.rank() == 1) throw std::runtime_error("rank 1 gives up");
        call_case(c, comm);
      },
      kShortDeadline);
  EXPECT_LT(std::chrono::steady_clock::now() - start, kShortDeadline);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(errors[r]);
    if (r != 1) {
      expect_error<CommError>([&] { std::rethrow_exception(errors[r]); }, {}, __FILE__, __LINE__);
      continue;
    }
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "rank 1 gives up");
    }
  }
}

// Forwards to another communicator, except that one rank's first send_recv throws: a rank that
// fails inside the strategy, after the validation.
class FailingSend : public Communicator {
 public:
  FailingSend(Communicator& inner, int failing_rank) : inner_(inner), failing_(failing_rank) {
    set_timeout(inner.timeout());
  }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string transport() const override { return inner_.transport(); }
  std::unique_ptr<Communicator> split(int color, int key) override { return inner_.split(color, key); }
  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override {
    if (rank() == failing_) throw CommError("[send_recv] injected failure");
    return inner_.send_recv(ops);
  }
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* recv, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets) override {
    inner_.all_to_all(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
  }
  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    inner_.all_gather(send, recv, bytes);
  }
  void reduce_scatter(const float* send, float* recv, const std::vector<size_t>& counts) override {
    inner_.reduce_scatter(send, recv, counts);
  }
  void barrier() override { inner_.barrier(); }
  void fail(const std::string& reason) override { inner_.fail(reason); }

 private:
  Communicator& inner_;
  int failing_;
};

TEST(ParallelFaults, RankFailsInsideTheRing) {
  SKIP_UNDER_MPI();
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    ParallelCase c = small_case(Strategy::kRing);
    c.backward = backward;
    const auto start = std::chrono::steady_clock::now();
    const std::vector<std::exception_ptr> errors = run_inproc_collect(
        3,
        [&](Communicator& comm) {
          FailingSend failing(comm, 2);
          call_case(c, failing);
        },
        kShortDeadline);
    EXPECT_LT(std::chrono::steady_clock::now() - start, kShortDeadline);
    for (int r = 0; r < 3; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_TRUE(errors[r]);
      expect_error<CommError>([&] { std::rethrow_exception(errors[r]); }, {r == 2 ? "injected" : ""}, __FILE__,
                              __LINE__);
    }
  }
}

// ---- the K/V that a ring of two steps keeps from its forward for its backward ---------------

// Elements of a kept_kv buffer that is large enough for any of the case's ranks: K and V of all of
// its rows.
int64_t kept_elements(const ParallelCase& c) {
  int64_t rows = 0;
  for (int64_t b = 0; b < c.num_seqs(); ++b) rows += c.length(b);
  return 2 * rows * c.heads_kv * c.head_dim;
}

// The forward of a backward problem's q, k and v (its out and lse thrown away), given its options:
// what fills their kept_kv.
void forward_of(RankProblem& backward, const ParallelGroup& group) {
  const HostTensor out = HostTensor::empty(backward.out.dtype(), backward.out.shape());
  const HostTensor lse = HostTensor::empty(DType::kFloat32, backward.lse.shape());
  const ParallelCase& c = backward.spec();
  parallel_attention_forward(c.strategy, group, backward.q.view(), backward.k.view(), backward.v.view(), out.view(),
                             lse.view(), backward.params(), c.options);
}

// On 2 ranks, a forward given kept_kv, and the backward given the K/V that the forward of its inputs
// kept (in a buffer of NaNs, so that rows it did not receive would show), pass by the same rule as
// those that receive them again.
TEST(ParallelKeptKeyValues, BackwardMatchesTheReference) {
  SKIP_UNDER_MPI();
  for (Strategy strategy : {Strategy::kRing, Strategy::kZigzag, Strategy::kStripe})
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kCausalWindow})
      for (bool packed : {false, true})
        for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          ParallelCase c = make_case(strategy, true, mask, 4, 2, 2);
          c.dtype = dtype;
          if (packed) c.docs = packed_docs();
          run_inproc(2, [&](Communicator& comm) {
            const HostTensor kept =
                HostTensor::empty(c.dtype, {kept_elements(c)}, std::numeric_limits<double>::quiet_NaN());
            ParallelCase forward = c;  // its own inputs: checked on its own
            forward.backward = false;
            forward.options.kept_kv = kept.view();
            run_parallel_case(comm, forward);
            ParallelCase call = c;
            call.options.kept_kv = kept.view();
            const std::shared_ptr<const Expected> expected = expected_for(call);
            RankProblem problem(call, ParallelGroup{&comm}, *expected);
            forward_of(problem, ParallelGroup{&comm});
            problem.run();
            const std::vector<std::string> failures = problem.check(*expected);
            std::string all;
            for (const std::string& f : failures) all += f + "\n";
            EXPECT_EQ(sum_over_ranks(comm, static_cast<int64_t>(failures.size())), 0)
                << c.name() << ", rank " << comm.rank() << ":\n" << all;
          });
        }
}

TEST(ParallelKeptKeyValues, BadBuffersAreRefused) {
  SKIP_UNDER_MPI();
  const auto call_with = [](Strategy strategy, DType dtype, int64_t elements, bool backward = false) {
    return [=](int, Communicator& comm) {
      ParallelCase c = small_case(strategy);
      c.backward = backward;
      c.world = 2;
      const HostTensor buffer = HostTensor::empty(dtype, {elements});
      c.options.kept_kv = buffer.view();
      call_case(c, comm);
    };
  };
  const int64_t enough = kept_elements(small_case());
  expect_on_every_rank<InvalidArgument>(2, call_with(Strategy::kAllGather, DType::kFloat32, enough),
                                        {"[allgather]", "options.kept_kv is for ring, zigzag and stripe"});
  expect_on_every_rank<InvalidArgument>(2, call_with(Strategy::kZigzag, DType::kFloat16, enough),
                                        {"[zigzag]", "options.kept_kv must have k's dtype float32, got float16"});
  expect_on_every_rank<InvalidArgument>(2, call_with(Strategy::kZigzag, DType::kFloat32, 16),
                                        {"[zigzag]", "options.kept_kv must hold", "got 16"});
  expect_on_every_rank<InvalidArgument>(2, call_with(Strategy::kZigzag, DType::kFloat32, 16, true),
                                        {"[zigzag backward]", "options.kept_kv must hold", "got 16"});
}

// ---- transfers that a window makes unnecessary are skipped --------------------------------

// Bytes `rank` sends in one call of `strategy` over `world` ranks of S = 100 x world (100 rows
// each), fp32, 2 KV heads of 16.
// With `kept`, a forward first fills options.kept_kv, and the counted call is given it too.
uint64_t bytes_sent(Strategy strategy, bool backward, MaskKind mask, int world = 4, int rank = 0, bool kept = false) {
  ParallelCase c = make_case(strategy, backward, mask, 4, 2, world);
  c.seqlen = 100 * world;
  c.batch = 1;
  c.window_left = 10;
  uint64_t bytes = 0;
  run_inproc(world, [&](Communicator& comm) {
    ParallelCase call = c;
    const HostTensor buffer = HostTensor::empty(c.dtype, {kept_elements(c)});
    if (kept) call.options.kept_kv = buffer.view();
    RankProblem problem(call, ParallelGroup{&comm}, *expected_for(call));
    if (kept && backward) forward_of(problem, ParallelGroup{&comm});
    comm.reset_stats();
    problem.run();
    if (comm.rank() == rank) bytes = comm.stats().bytes_sent;
  });
  return bytes;
}

constexpr uint64_t kBlockBytes = 100 * 2 * 16 * sizeof(float);  // one rank's K, V, dK or dV

TEST(ParallelTransfers, WindowSkipsFartherSteps) {
  SKIP_UNDER_MPI();
  const uint64_t none = bytes_sent(Strategy::kRing, false, MaskKind::kNone);
  const uint64_t causal = bytes_sent(Strategy::kRing, false, MaskKind::kCausal);
  const uint64_t sliding = bytes_sent(Strategy::kRing, false, MaskKind::kCausalWindow);
  // Without a mask rank 0 passes on K and V at each of three steps. Under a causal mask only its
  // own travel (ranks 1-3 read them); the blocks of ranks 3 and 2 that it holds next are read by
  // no rank after it. A window of 10 behind each query reads only the last 10 rows of rank 0's.
  EXPECT_EQ(none - causal, 2 * 2 * kBlockBytes) << "no mask " << none << " bytes, causal " << causal;
  EXPECT_EQ(causal - sliding, 2 * kBlockBytes * 9 / 10) << "causal " << causal << " bytes, sliding window " << sliding;
}

// Zigzag on 2 ranks of 100 rows (chunks of 50): rank 1's queries (chunks 1 and 2) read chunk 0 of
// rank 0's keys, not chunk 3, so rank 0 sends half its K/V; rank 0's queries of chunk 3 read all of
// rank 1's. The backward moves the K/V as the forward does, and each rank's dK/dV partial (fp32,
// two tensors) of the rows it read: rank 0's of 100 rows, rank 1's of 50.
TEST(ParallelTransfers, OnlyTheRowsThatARankReadsTravel) {
  SKIP_UNDER_MPI();
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const uint64_t none = bytes_sent(Strategy::kZigzag, false, MaskKind::kNone, 2, rank);
    const uint64_t causal = bytes_sent(Strategy::kZigzag, false, MaskKind::kCausal, 2, rank);
    EXPECT_EQ(none - causal, rank == 0 ? kBlockBytes : 0) << "no mask " << none << " bytes, causal " << causal;
    const uint64_t backward = bytes_sent(Strategy::kZigzag, true, MaskKind::kCausal, 2, rank);
    EXPECT_EQ(backward - causal, rank == 0 ? 2 * kBlockBytes : kBlockBytes)
        << "forward " << causal << ", backward " << backward;
  }
}

// With the K/V kept from the forward, zigzag's backward on 2 ranks sends none: only its partial.
TEST(ParallelTransfers, KeptKeyValuesDoNotTravelAgain) {
  SKIP_UNDER_MPI();
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const uint64_t backward = bytes_sent(Strategy::kZigzag, true, MaskKind::kCausal, 2, rank);
    const uint64_t kept = bytes_sent(Strategy::kZigzag, true, MaskKind::kCausal, 2, rank, true);
    EXPECT_EQ(backward - kept, rank == 0 ? kBlockBytes : 2 * kBlockBytes) << "received again " << backward
                                                                             << " bytes, kept " << kept;
    EXPECT_EQ(bytes_sent(Strategy::kZigzag, false, MaskKind::kCausal, 2, rank, true),
              bytes_sent(Strategy::kZigzag, false, MaskKind::kCausal, 2, rank));
  }
}

// Backward moves the K/V as forward does, and dK/dV partials as far: P - 1 hops, since a block's
// partial starts on the rank after its home and its last hop lands at home. (The cross-rank
// validation of a call sends the same bytes in both directions.)
TEST(ParallelTransfers, BackwardPartialsTravelAsFarAsTheKeyValues) {
  SKIP_UNDER_MPI();
  for (Strategy strategy : {Strategy::kRing, Strategy::kZigzag, Strategy::kStripe}) {
    const uint64_t forward = bytes_sent(strategy, false, MaskKind::kCausal);
    const uint64_t backward = bytes_sent(strategy, true, MaskKind::kCausal);
    EXPECT_EQ(backward - forward, 3 * 2 * kBlockBytes)
        << strategy_name(strategy) << ": forward " << forward << " bytes, backward " << backward;
  }
}

}  // namespace
}  // namespace ringflash::test
