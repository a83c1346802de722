// Times ringflash::attention_forward and attention_backward through the C++ API on the CPU.
//
//   attention_bench [--dtypes fp32,bf16,fp16] [--seqlens 1024,4096] [--hdims 64,128] [--causal 0,1]
//                   [--batch 1] [--heads 8] [--kv-heads 8] [--iters 10] [--warmup 2] [--sets 3]
//                   [--threads 0]
//
// Each case is warmed up, then timed `iters` times, rotating over `sets` preallocated input sets;
// the table shows medians. FLOPs are counted as FlashAttention counts them: forward 4*B*S^2*H*D,
// halved when causal; backward 2.5 x forward. The comparison with torch is bench/cpu_bench.py.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ringflash/ringflash.h"

namespace {

using namespace bench;

constexpr double kBackwardFlopsFactor = 2.5;  // backward FLOPs per forward FLOP (FlashAttention)

struct Options {
  std::vector<std::string> dtypes{"fp32", "bf16"};
  std::vector<int64_t> seqlens{1024, 4096};
  std::vector<int64_t> hdims{64, 128};
  std::vector<int64_t> causal{0, 1};
  int64_t batch = 1, heads = 8, kv_heads = 0;  // kv_heads 0: same as heads
  int iters = 10, warmup = 2, sets = 3, threads = 0;
};

constexpr const char* kUsage =
    "usage: attention_bench [--dtypes fp32,bf16,fp16] [--seqlens 1024,4096] [--hdims 64,128]\n"
    "       [--causal 0,1] [--batch 1] [--heads 8] [--kv-heads H] [--iters 10] [--warmup 2]\n"
    "       [--sets 3] [--threads 0 (every core)]\n";

Options parse(int argc, char** argv) {
  Options o;
  read_flags(argc, argv, kUsage, {}, [&](const std::string& flag, const std::string& value) {
    if (flag == "--dtypes") o.dtypes = split(value);
    else if (flag == "--seqlens") o.seqlens = split_ints(value);
    else if (flag == "--hdims") o.hdims = split_ints(value);
    else if (flag == "--causal") o.causal = split_ints(value);
    else if (flag == "--batch") o.batch = std::stoll(value);
    else if (flag == "--heads") o.heads = std::stoll(value);
    else if (flag == "--kv-heads") o.kv_heads = std::stoll(value);
    else if (flag == "--iters") o.iters = std::stoi(value);
    else if (flag == "--warmup") o.warmup = std::stoi(value);
    else if (flag == "--sets") o.sets = std::stoi(value);
    else if (flag == "--threads") o.threads = std::stoi(value);
    else throw std::invalid_argument("unknown flag " + flag);
  });
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  if (o.iters < 1 || o.warmup < 0 || o.sets < 1) throw std::invalid_argument("need iters >= 1, warmup >= 0, sets >= 1");
  return o;
}

// Times one case and prints its row. Returns false when ringflash reported an error.
bool run_case(const Options& o, const std::string& dtype_name, int64_t seqlen, int64_t hdim, bool causal) {
  const DType dtype = parse_dtype(dtype_name);
  const int64_t b = o.batch, s = seqlen, hq = o.heads, hkv = o.kv_heads, d = hdim;
  std::mt19937 rng(static_cast<unsigned>(s * 131 + d));
  struct Set {
    Buffer q, k, v, dout, out, lse;
  };
  std::vector<Set> sets;
  sets.reserve(static_cast<size_t>(o.sets));
  for (int i = 0; i < o.sets; ++i)
    sets.push_back(Set{Buffer(dtype, {b, s, hq, d}, rng, true), Buffer(dtype, {b, s, hkv, d}, rng, true),
                       Buffer(dtype, {b, s, hkv, d}, rng, true), Buffer(dtype, {b, s, hq, d}, rng, true),
                       Buffer(dtype, {b, s, hq, d}, rng, false), Buffer(DType::kFloat32, {b, hq, s}, rng, false)});
  Buffer dq(dtype, {b, s, hq, d}, rng, false), dk(dtype, {b, s, hkv, d}, rng, false),
      dv(dtype, {b, s, hkv, d}, rng, false);

  ringflash::AttentionParams params;
  params.causal = causal;
  params.num_threads = o.threads;
  const double flops = 4.0 * b * s * s * hq * d * (causal ? 0.5 : 1.0);
  std::printf("%-5s %5lld %6lld %-6s", dtype_name.c_str(), static_cast<long long>(d), static_cast<long long>(s),
              causal ? "yes" : "no");
  std::fflush(stdout);
  try {
    const double fwd = median_ms(o.warmup, o.iters, [&](int i) {
      const Set& x = sets[i % sets.size()];
      ringflash::attention_forward(x.q.view, x.k.view, x.v.view, x.out.view, x.lse.view, params);
    });
    // Every set's out and lse now hold its forward result, which its backward reads.
    const double bwd = median_ms(o.warmup, o.iters, [&](int i) {
      const Set& x = sets[i % sets.size()];
      ringflash::attention_backward(x.q.view, x.k.view, x.v.view, x.out.view, x.dout.view, x.lse.view, dq.view,
                                    dk.view, dv.view, params);
    });
    std::printf(" %10.2f %10.2f %10.1f %10.1f\n", fwd, bwd, flops / fwd / 1e6,
                kBackwardFlopsFactor * flops / bwd / 1e6);
    return true;
  } catch (const ringflash::Error& e) {
    std::printf("  error: %s\n", e.what());
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("attention_bench", argc, argv, parse, [](const Options& o) {
    std::printf("%s", ringflash::build_info().c_str());
    std::printf(
        "batch %lld, heads %lld, kv heads %lld, iters %d, warmup %d, input sets %d, threads %d (0: every core)\n\n",
        static_cast<long long>(o.batch), static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads), o.iters,
        o.warmup, o.sets, o.threads);
    std::printf("%-5s %5s %6s %-6s %10s %10s %10s %10s\n", "dtype", "D", "S", "causal", "fwd ms", "bwd ms",
                "fwd GF/s", "bwd GF/s");
    bool ok = true;
    for (const std::string& dtype : o.dtypes)
      for (int64_t d : o.hdims)
        for (int64_t s : o.seqlens)
          for (int64_t causal : o.causal) ok = run_case(o, dtype, s, d, causal != 0) && ok;
    return ok ? 0 : 1;
  });
}
