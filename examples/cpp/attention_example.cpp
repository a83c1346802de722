// Causal attention on small fp32 data through the C++ API.
//
// q, k, v are (B, S, H, D) arrays in ordinary host memory; TensorView describes them without
// copying. The forward writes out (B, S, H, D) and the log-sum-exp lse (B, H, S), fp32.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "ringflash/ringflash.h"

int main() {
  constexpr int64_t kBatch = 2, kSeqlen = 100, kHeadsQ = 4, kHeadsKV = 2, kHeadDim = 64;  // GQA: 2 q heads per k/v head
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  auto random_vector = [&](size_t n) {
    std::vector<float> x(n);
    for (float& value : x) value = normal(rng);
    return x;
  };
  std::vector<float> q = random_vector(kBatch * kSeqlen * kHeadsQ * kHeadDim);
  std::vector<float> k = random_vector(kBatch * kSeqlen * kHeadsKV * kHeadDim);
  std::vector<float> v = random_vector(kBatch * kSeqlen * kHeadsKV * kHeadDim);
  std::vector<float> out(q.size());
  std::vector<float> lse(kBatch * kHeadsQ * kSeqlen);

  using ringflash::DType;
  using ringflash::TensorView;
  const ringflash::Device cpu{};
  TensorView q_view(q.data(), DType::kFloat32, cpu, {kBatch, kSeqlen, kHeadsQ, kHeadDim});
  TensorView k_view(k.data(), DType::kFloat32, cpu, {kBatch, kSeqlen, kHeadsKV, kHeadDim});
  TensorView v_view(v.data(), DType::kFloat32, cpu, {kBatch, kSeqlen, kHeadsKV, kHeadDim});
  TensorView out_view(out.data(), DType::kFloat32, cpu, {kBatch, kSeqlen, kHeadsQ, kHeadDim});
  TensorView lse_view(lse.data(), DType::kFloat32, cpu, {kBatch, kHeadsQ, kSeqlen});

  ringflash::AttentionParams params;
  params.causal = true;
  try {
    ringflash::attention_forward(q_view, k_view, v_view, out_view, lse_view, params);
  } catch (const ringflash::Error& e) {
    std::fprintf(stderr, "attention_forward failed: %s\n", e.what());
    return 1;
  }

  double checksum = 0.0;
  for (float value : out) checksum += value;
  const auto [lse_min, lse_max] = std::minmax_element(lse.begin(), lse.end());
  const bool finite = std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); });
  std::printf("ringflash %s\n", ringflash::version());
  std::printf("out (%lld, %lld, %lld, %lld) checksum %.6f, all finite: %s\n", static_cast<long long>(kBatch),
              static_cast<long long>(kSeqlen), static_cast<long long>(kHeadsQ), static_cast<long long>(kHeadDim),
              checksum, finite ? "yes" : "no");
  // Causal, Sq == Sk: query 0 sees only key 0, so its lse is its one score; later rows see more keys.
  std::printf("lse range [%.4f, %.4f]\n", *lse_min, *lse_max);
  return finite ? 0 : 1;
}
