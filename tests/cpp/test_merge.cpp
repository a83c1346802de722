// kernels/common/merge.h: the one formula that merges partial attention results.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/common/merge.h"

namespace ringflash::test {
namespace {

using core::merge_weights;
using core::MergeWeights;

constexpr float kInf = std::numeric_limits<float>::infinity();

// log(exp(a) + exp(b)) in float64.
double log_add(double a, double b) {
  const double hi = std::max(a, b), lo = std::min(a, b);
  return hi + std::log1p(std::exp(lo - hi));
}

// The weights are exp(lse_x - lse) of an lse rounded to fp32, so their error grows with |lse|:
// half an ulp of lse, plus a few ulps of 1.
double weight_tolerance(double lse) {
  constexpr double kEps = 1.1920928955078125e-07;  // 2^-23
  return kEps * (0.5 * (1.0 + std::fabs(lse)) + 4.0);
}

void expect_matches_float64(float a, float b) {
  const MergeWeights w = merge_weights(a, b);
  const double lse = log_add(a, b), tol = weight_tolerance(lse);
  EXPECT_NEAR(w.lse, lse, 2e-7 * std::max(1.0, std::fabs(lse))) << "lse_acc " << a << ", lse_blk " << b;
  EXPECT_NEAR(w.w_acc, std::exp(a - lse), tol) << "lse_acc " << a << ", lse_blk " << b;
  EXPECT_NEAR(w.w_blk, std::exp(b - lse), tol) << "lse_acc " << a << ", lse_blk " << b;
  EXPECT_NEAR(w.w_acc + w.w_blk, 1.0, 2 * tol);
}

TEST(Merge, MatchesFloat64Formula) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-60.0f, 60.0f);
  for (int i = 0; i < 2000; ++i) expect_matches_float64(uniform(rng), uniform(rng));
}

TEST(Merge, EdgeValues) {
  expect_matches_float64(0.0f, 0.0f);             // equal
  expect_matches_float64(3.5f, 3.5f);
  expect_matches_float64(1e-30f, -1e-30f);
  expect_matches_float64(80.0f, -80.0f);          // one weight underflows
  expect_matches_float64(-200.0f, 200.0f);
  expect_matches_float64(88.0f, 88.0f);           // exp(88) alone would overflow fp32 sums
  expect_matches_float64(-1000.0f, -1000.5f);
}

TEST(Merge, BothEmptyStaysEmptyWithoutNaN) {
  const MergeWeights w = merge_weights(-kInf, -kInf);
  EXPECT_EQ(w.lse, -kInf);
  EXPECT_EQ(w.w_acc, 0.0f);
  EXPECT_EQ(w.w_blk, 0.0f);
}

TEST(Merge, OneSideEmpty) {
  for (float x : {-30.0f, 0.0f, 2.25f, 70.0f}) {
    const MergeWeights a = merge_weights(-kInf, x);
    EXPECT_EQ(a.lse, x);
    EXPECT_EQ(a.w_acc, 0.0f);
    EXPECT_EQ(a.w_blk, 1.0f);
    const MergeWeights b = merge_weights(x, -kInf);
    EXPECT_EQ(b.lse, x);
    EXPECT_EQ(b.w_acc, 1.0f);
    EXPECT_EQ(b.w_blk, 0.0f);
  }
}

// Merging softmax results over two disjoint key sets gives softmax over their union.
TEST(Merge, PartialSoftmaxesMergeToTheWhole) {
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 3.0);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 2 + trial, split = 1 + trial / 2;
    std::vector<double> s(n), v(n);
    for (int j = 0; j < n; ++j) {
      s[j] = normal(rng);
      v[j] = normal(rng);
    }
    auto partial = [&](int begin, int end, float& o, float& lse) {
      double m = -INFINITY, l = 0, acc = 0;
      for (int j = begin; j < end; ++j) m = std::max(m, s[j]);
      for (int j = begin; j < end; ++j) {
        l += std::exp(s[j] - m);
        acc += std::exp(s[j] - m) * v[j];
      }
      o = static_cast<float>(acc / l);
      lse = static_cast<float>(m + std::log(l));
    };
    float o_a, lse_a, o_b, lse_b, o_all, lse_all;
    partial(0, split, o_a, lse_a);
    partial(split, n, o_b, lse_b);
    partial(0, n, o_all, lse_all);
    const MergeWeights w = merge_weights(lse_a, lse_b);
    EXPECT_NEAR(w.w_acc * o_a + w.w_blk * o_b, o_all, 1e-5 * (1 + std::fabs(o_all)));
    EXPECT_NEAR(w.lse, lse_all, 1e-5 * (1 + std::fabs(lse_all)));
  }
}

}  // namespace
}  // namespace ringflash::test
