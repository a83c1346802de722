// Zigzag ring attention over MPI ranks, checked against single-device attention:
//   mpiexec -n 4 build/example-cpp/zigzag_example
//
// Every rank builds the same global q, k, v, dout from a seed, keeps the rows that the zigzag
// layout gives it (chunks r and 2P - 1 - r of 2P), runs the causal forward and backward over the
// ranks, and compares its rows of out, dq, dk and dv with a single-device computation of the whole
// sequence. The ranks agree on the verdict; the exit status is 0 only if every rank passed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ringflash/parallel.h"
#include "ringflash/ringflash.h"

namespace {

constexpr int64_t kSeqlen = 4099, kHeadsQ = 8, kHeadsKV = 2, kHeadDim = 64;  // GQA 4:1, uneven shards
constexpr float kTolerance = 2e-4f;  // fp32: both sides accumulate in fp32, in different orders

using ringflash::DType;
using ringflash::TensorView;

struct Rows {
  int64_t heads;
  std::vector<float> data;  // (S, heads, D)
  float* row(int64_t i) { return data.data() + i * heads * kHeadDim; }
};

Rows random_rows(int64_t rows, int64_t heads, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Rows r{heads, std::vector<float>(static_cast<size_t>(rows * heads * kHeadDim))};
  for (float& x : r.data) x = normal(rng);
  return r;
}

// The rows of `global` at `positions`.
Rows take(Rows& global, const std::vector<int64_t>& positions) {
  Rows local{global.heads, std::vector<float>(positions.size() * global.heads * kHeadDim)};
  for (size_t i = 0; i < positions.size(); ++i)
    std::memcpy(local.row(static_cast<int64_t>(i)), global.row(positions[i]), global.heads * kHeadDim * sizeof(float));
  return local;
}

TensorView view(Rows& r) {
  return TensorView(r.data.data(), DType::kFloat32, ringflash::Device{},
                    {1, static_cast<int64_t>(r.data.size()) / (r.heads * kHeadDim), r.heads, kHeadDim});
}

float max_diff(Rows& global, const std::vector<int64_t>& positions, Rows& local) {
  float worst = 0.0f;
  for (size_t i = 0; i < positions.size(); ++i)
    for (int64_t j = 0; j < global.heads * kHeadDim; ++j)
      worst = std::max(worst, std::fabs(local.row(static_cast<int64_t>(i))[j] - global.row(positions[i])[j]));
  return worst;
}

}  // namespace

int main() {
  try {
    std::unique_ptr<ringflash::Communicator> world = ringflash::mpi_world();
    const int rank = world->rank(), size = world->size();

    std::mt19937 rng(2024);  // the same global problem on every rank
    Rows q = random_rows(kSeqlen, kHeadsQ, rng), k = random_rows(kSeqlen, kHeadsKV, rng);
    Rows v = random_rows(kSeqlen, kHeadsKV, rng), dout = random_rows(kSeqlen, kHeadsQ, rng);

    ringflash::AttentionParams params;
    params.causal = true;
    params.num_threads = 1;

    // Single device: the whole sequence.
    Rows out{kHeadsQ, std::vector<float>(q.data.size())}, dq = out, dk{kHeadsKV, std::vector<float>(k.data.size())},
         dv = dk;
    std::vector<float> lse(kHeadsQ * kSeqlen);
    const TensorView lse_view(lse.data(), DType::kFloat32, ringflash::Device{}, {1, kHeadsQ, kSeqlen});
    ringflash::attention_forward(view(q), view(k), view(v), view(out), lse_view, params);
    ringflash::attention_backward(view(q), view(k), view(v), view(out), view(dout), lse_view, view(dq), view(dk),
                                  view(dv), params);

    // This rank's zigzag shard: (1, S_r, H, D).
    const std::vector<int64_t> mine =
        ringflash::shard_positions(ringflash::shard_of(ringflash::Layout::kZigzag, kSeqlen, rank, size));
    const int64_t rows = static_cast<int64_t>(mine.size());
    Rows q_r = take(q, mine), k_r = take(k, mine), v_r = take(v, mine), dout_r = take(dout, mine);
    Rows out_r{kHeadsQ, std::vector<float>(q_r.data.size())}, dq_r = out_r,
         dk_r{kHeadsKV, std::vector<float>(k_r.data.size())}, dv_r = dk_r;
    std::vector<float> lse_r(kHeadsQ * rows);
    const TensorView lse_r_view(lse_r.data(), DType::kFloat32, ringflash::Device{}, {1, kHeadsQ, rows});
    ringflash::zigzag_attention_forward(*world, view(q_r), view(k_r), view(v_r), view(out_r), lse_r_view, params);
    ringflash::zigzag_attention_backward(*world, view(q_r), view(k_r), view(v_r), view(out_r), view(dout_r),
                                         lse_r_view, view(dq_r), view(dk_r), view(dv_r), params);

    const float diff = std::max({max_diff(out, mine, out_r), max_diff(dq, mine, dq_r), max_diff(dk, mine, dk_r),
                                 max_diff(dv, mine, dv_r)});
    std::vector<float> diffs(static_cast<size_t>(size));
    world->all_gather(&diff, diffs.data(), std::vector<size_t>(diffs.size(), sizeof(float)));
    const float worst = *std::max_element(diffs.begin(), diffs.end());
    const bool passed = worst <= kTolerance;
    if (rank == 0)
      std::printf("zigzag over %d MPI ranks, S=%lld (uneven shards), H=%lld, H_kv=%lld, D=%lld, causal fp32: "
                  "largest difference from one device %.2e -> %s\n",
                  size, static_cast<long long>(kSeqlen), static_cast<long long>(kHeadsQ),
                  static_cast<long long>(kHeadsKV), static_cast<long long>(kHeadDim), worst, passed ? "ok" : "FAIL");
    return passed ? 0 : 1;
  } catch (const ringflash::Error& e) {
    std::fprintf(stderr, "zigzag_example: %s\n", e.what());
    return 1;
  }
}
