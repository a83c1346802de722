// The test machinery itself: fp16/bf16 conversions and the float64 reference (its mask, its
// special cases, and its analytic gradients against finite differences).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "half.h"
#include "reference.h"

namespace ringflash::test {
namespace {

TEST(Half, KnownValues) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(0.0f), 0x0000);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);           // largest finite
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);           // rounds down
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);           // tie rounds to even: infinity
  EXPECT_EQ(float_to_half(1e9f), 0x7c00);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_half(std::ldexp(3.0f, -25)), 0x0002);  // tie to even: up
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even: down
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie to even: up
  EXPECT_EQ(float_to_half(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_half(-INFINITY), 0xfc00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(NAN))));
  EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);

  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie to even: down
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);  // tie to even: up
  EXPECT_EQ(float_to_bf16(-INFINITY), 0xff80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
}

TEST(Half, EveryValueRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
    const float g = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(g)) continue;
    ASSERT_EQ(float_to_bf16(g), h) << std::hex << h;
  }
}

// Rounding goes to the nearest representable value (checked against both neighbours).
TEST(Half, RoundsToNearest) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int n = 0; n < 200000; ++n) {
    const float f = bits_float(bits(rng));
    if (!std::isfinite(f)) continue;
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      const bool half = dtype == DType::kFloat16;
      const uint16_t r = half ? float_to_half(f) : float_to_bf16(f);
      const float x = half ? half_to_float(r) : bf16_to_float(r);
      if (std::isinf(x)) continue;
      for (int step : {-1, 1}) {
        const uint16_t nb = static_cast<uint16_t>(r + step);
        const float y = half ? half_to_float(nb) : bf16_to_float(nb);
        if (!std::isfinite(y) || (std::signbit(y) != std::signbit(x) && x != 0)) continue;
        ASSERT_LE(std::fabs(static_cast<double>(x) - f), std::fabs(static_cast<double>(y) - f))
            << dtype_name(dtype) << " of " << f;
      }
    }
  }
}

TEST(Reference, Mask) {
  RefOptions o;
  EXPECT_TRUE(visible(o, 0, 1000));
  o.causal = true;
  EXPECT_TRUE(visible(o, 5, 5));
  EXPECT_FALSE(visible(o, 5, 6));
  o.window_left = 2;
  EXPECT_TRUE(visible(o, 5, 3));
  EXPECT_FALSE(visible(o, 5, 2));
  o.causal = false;
  o.window_right = 1;
  EXPECT_TRUE(visible(o, 5, 6));
  EXPECT_FALSE(visible(o, 5, 7));
  o.window_left = -1;
  EXPECT_TRUE(visible(o, 5, -100));
  o.window_left = 0;
  o.window_right = 0;
  EXPECT_TRUE(visible(o, -7, -7));
  EXPECT_FALSE(visible(o, -7, -6));
}

RefSequence random_sequence(const RefOptions& o, int64_t len_q, int64_t len_k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  RefSequence s;
  s.len_q = len_q;
  s.len_k = len_k;
  s.q_pos = len_k - len_q;
  auto fill = [&](std::vector<double>& x, int64_t n) {
    x.resize(n);
    for (double& e : x) e = normal(rng);
  };
  fill(s.q, len_q * o.heads_q * o.head_dim);
  fill(s.k, len_k * o.heads_kv * o.head_dim);
  fill(s.v, len_k * o.heads_kv * o.head_dim);
  fill(s.dout, len_q * o.heads_q * o.head_dim);
  return s;
}

TEST(Reference, OneVisibleKeyCopiesIt) {
  RefOptions o;
  o.heads_q = o.heads_kv = 1;
  o.head_dim = 5;
  o.scale = 0.7;
  o.window_left = o.window_right = 0;  // query i sees key i only
  RefSequence s = random_sequence(o, 4, 4, 1);
  const RefForward f = reference_forward(o, s);
  for (int64_t i = 0; i < 4; ++i) {
    double dot = 0;
    for (int64_t d = 0; d < 5; ++d) {
      EXPECT_DOUBLE_EQ(f.out[i * 5 + d], s.v[i * 5 + d]);
      dot += s.q[i * 5 + d] * s.k[i * 5 + d];
    }
    EXPECT_NEAR(f.lse[i], 0.7 * dot, 1e-12);
  }
}

TEST(Reference, RowWithoutKeysIsZeroAndMinusInfinity) {
  RefOptions o;
  o.heads_q = 2;
  o.heads_kv = 1;
  o.head_dim = 3;
  o.causal = true;
  RefSequence s = random_sequence(o, 3, 4, 2);
  s.q_pos = -2;  // rows 0 and 1 come before every key
  s.k_pos = 0;
  const RefForward f = reference_forward(o, s);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(f.lse[h * 3 + 0], -INFINITY);
    EXPECT_EQ(f.lse[h * 3 + 1], -INFINITY);
    EXPECT_TRUE(std::isfinite(f.lse[h * 3 + 2]));
  }
  for (int64_t e = 0; e < 2 * 2 * 3; ++e) EXPECT_EQ(f.out[e], 0.0);
  const RefGrads g = reference_backward(o, s, f.out, f.lse);
  for (int64_t e = 0; e < 2 * 2 * 3; ++e) EXPECT_EQ(g.dq[e], 0.0);
  for (int64_t e = 1 * 3; e < 4 * 3; ++e) EXPECT_EQ(g.dk[e], 0.0);  // keys 1..3 unseen
}

TEST(Reference, ConstantValuesAverageToThemselves) {
  RefOptions o;
  o.heads_q = o.heads_kv = 1;
  o.head_dim = 4;
  o.softcap = 2.0;
  RefSequence s = random_sequence(o, 6, 9, 3);
  for (double& x : s.v) x = 1.5;
  s.slopes = {0.3};
  const RefForward f = reference_forward(o, s);
  for (double x : f.out) EXPECT_NEAR(x, 1.5, 1e-14);
}

// loss = sum(out * dout); the analytic gradients must match central differences.
void check_gradients(const RefOptions& o, RefSequence s) {
  const RefForward f = reference_forward(o, s);
  const RefGrads g = reference_backward(o, s, f.out, f.lse);
  auto loss = [&](const RefSequence& t) {
    const RefForward r = reference_forward(o, t);
    double l = 0;
    for (size_t e = 0; e < r.out.size(); ++e) l += r.out[e] * t.dout[e];
    return l;
  };
  constexpr double kStep = 1e-6;
  for (auto [member, grad, name] : {std::tuple{&RefSequence::q, &g.dq, "dq"}, {&RefSequence::k, &g.dk, "dk"},
                                    {&RefSequence::v, &g.dv, "dv"}}) {
    ASSERT_EQ((s.*member).size(), grad->size());
    for (size_t e = 0; e < grad->size(); ++e) {
      const double x = (s.*member)[e];
      (s.*member)[e] = x + kStep;
      const double up = loss(s);
      (s.*member)[e] = x - kStep;
      const double down = loss(s);
      (s.*member)[e] = x;
      EXPECT_NEAR((*grad)[e], (up - down) / (2 * kStep), 1e-6) << name << "[" << e << "]";
    }
  }
}

TEST(Reference, GradientsMatchFiniteDifferences) {
  RefOptions o;
  o.heads_q = 4;
  o.heads_kv = 2;
  o.head_dim = 3;
  o.scale = 0.6;
  check_gradients(o, random_sequence(o, 5, 7, 4));
}

TEST(Reference, GradientsMatchFiniteDifferencesWithEveryOption) {
  RefOptions o;
  o.heads_q = 4;
  o.heads_kv = 1;
  o.head_dim = 3;
  o.scale = 0.9;
  o.softcap = 1.3;
  o.causal = true;
  o.window_left = 3;
  RefSequence s = random_sequence(o, 6, 8, 5);
  s.q_pos = 1;  // row 0 sees keys at 0 and 1 only; the last keys are seen by nobody
  s.k_pos = 0;
  s.slopes = {0.5, 0.25, 0.125, 0.0625};
  check_gradients(o, s);
}

TEST(Reference, NaiveInDtypeIsCloseButNotExact) {
  RefOptions o;
  o.heads_q = 2;
  o.heads_kv = 2;
  o.head_dim = 64;
  o.scale = 0.125;
  RefSequence s = random_sequence(o, 33, 70, 6);
  for (auto* x : {&s.q, &s.k, &s.v, &s.dout})
    for (double& e : *x) e = round_to(DType::kBFloat16, e);
  const RefForward exact = reference_forward(o, s);
  const RefGrads exact_g = reference_backward(o, s, exact.out, exact.lse);
  for (auto [dtype, bound] : {std::pair{DType::kFloat32, 1e-5}, {DType::kFloat16, 1e-2}, {DType::kBFloat16, 5e-2}}) {
    const RefForward naive = reference_forward(o, s, Precision::naive(dtype, dtype, dtype));
    const RefGrads naive_g = reference_backward(o, s, naive.out, naive.lse, Precision::naive(dtype, dtype, dtype));
    double err = 0, grad_err = 0;
    for (size_t e = 0; e < exact.out.size(); ++e) err = std::max(err, std::fabs(naive.out[e] - exact.out[e]));
    for (size_t e = 0; e < exact_g.dq.size(); ++e)
      grad_err = std::max(grad_err, std::fabs(naive_g.dq[e] - exact_g.dq[e]));
    EXPECT_GT(err, 0.0) << dtype_name(dtype);
    EXPECT_LT(err, bound) << dtype_name(dtype);
    EXPECT_GT(grad_err, 0.0) << dtype_name(dtype);
    EXPECT_LT(grad_err, 10 * bound) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace ringflash::test
