// ringflash-bench: times the sequence-parallel strategies against the single-device kernel on the
// same problem, over inproc ranks (threads) or MPI ranks (processes under mpiexec).
//
//   ringflash-bench [--strategies ring,zigzag,stripe,allgather,ulysses,hybrid] [--world 4]
//                   [--transport inproc|mpi] [--seqlen 16384] [--heads 8] [--kv-heads 8] [--hdim 64]
//                   [--dtype fp32] [--causal 1] [--window -1] [--threads-per-rank 1]
//                   [--hybrid-ulysses 2] [--iters 5] [--warmup 1] [--no-check] [--json PATH]
//
// For each strategy it reports the median time of a forward and of a forward + backward call
// (the slowest rank's time per iteration), the share of that time the ranks spent waiting on
// communication, the scaling efficiency t_single / t_parallel (the single-device kernel on the
// whole problem with world x threads-per-rank threads, against the strategy on world ranks of
// threads-per-rank threads each: 1.0 is perfect scaling), the bytes each rank sent per forward +
// backward next to the analytic minimum for that strategy, the process's peak resident memory,
// and the largest difference of any output or gradient row from the single-device result.
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ringflash/parallel.h"

namespace {

using namespace bench;
using ringflash::AttentionParams;
using ringflash::Communicator;
using ringflash::Strategy;

struct Options {
  std::vector<std::string> strategies{"ring", "zigzag", "stripe", "allgather", "ulysses", "hybrid"};
  int world = 4;
  std::string transport = "inproc";
  int64_t seqlen = 16384, heads = 8, kv_heads = 0, hdim = 64;
  std::string dtype = "fp32";
  bool causal = true, check = true;
  int64_t window = -1;
  int threads_per_rank = 1, hybrid_ulysses = 2, iters = 5, warmup = 1;
  std::string json;
};

constexpr const char* kUsage =
    "usage: ringflash-bench [--strategies ring,zigzag,stripe,allgather,ulysses,hybrid] [--world 4]\n"
    "       [--transport inproc|mpi] [--seqlen 16384] [--heads 8] [--kv-heads H] [--hdim 64]\n"
    "       [--dtype fp32|bf16|fp16] [--causal 0|1] [--window W] [--threads-per-rank 1]\n"
    "       [--hybrid-ulysses U] [--iters 5] [--warmup 1] [--no-check] [--json PATH]\n";

Options parse(int argc, char** argv) {
  Options o;
  read_flags(argc, argv, kUsage, {"--no-check"}, [&](const std::string& flag, const std::string& value) {
    if (flag == "--no-check") o.check = false;
    else if (flag == "--strategies") o.strategies = split(value);
    else if (flag == "--world") o.world = std::stoi(value);
    else if (flag == "--transport") o.transport = value;
    else if (flag == "--seqlen") o.seqlen = std::stoll(value);
    else if (flag == "--heads") o.heads = std::stoll(value);
    else if (flag == "--kv-heads") o.kv_heads = std::stoll(value);
    else if (flag == "--hdim") o.hdim = std::stoll(value);
    else if (flag == "--dtype") o.dtype = value;
    else if (flag == "--causal") o.causal = std::stoi(value) != 0;
    else if (flag == "--window") o.window = std::stoll(value);
    else if (flag == "--threads-per-rank") o.threads_per_rank = std::stoi(value);
    else if (flag == "--hybrid-ulysses") o.hybrid_ulysses = std::stoi(value);
    else if (flag == "--iters") o.iters = std::stoi(value);
    else if (flag == "--warmup") o.warmup = std::stoi(value);
    else if (flag == "--json") o.json = value;
    else throw std::invalid_argument("unknown flag " + flag);
  });
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  if (o.world < 1 || o.iters < 1 || o.warmup < 0 || o.threads_per_rank < 1)
    throw std::invalid_argument("need world >= 1, iters >= 1, warmup >= 0, threads-per-rank >= 1");
  if (o.transport != "inproc" && o.transport != "mpi") throw std::invalid_argument("--transport is inproc or mpi");
  return o;
}

Strategy parse_strategy(const std::string& name) {
  for (Strategy s : {Strategy::kRing, Strategy::kZigzag, Strategy::kStripe, Strategy::kAllGather, Strategy::kUlysses,
                     Strategy::kHybrid})
    if (name == ringflash::strategy_name(s)) return s;
  throw std::invalid_argument("unknown strategy " + name);
}

// The whole problem, and the single-device result that every strategy is checked against.
struct Global {
  Buffer q, k, v, dout, out, lse, dq, dk, dv;
  double forward_ms = 0, step_ms = 0;  // single device: forward, forward + backward
};

// Rows `positions` of a (1, S, H, D) tensor, gathered into `dst` (1, n, H, D) or scattered back.
void copy_rows(const TensorView& global, const std::vector<int64_t>& positions, const TensorView& local) {
  const size_t row = static_cast<size_t>(global.size(2) * global.size(3)) * ringflash::dtype_size(global.dtype());
  for (size_t i = 0; i < positions.size(); ++i)
    std::memcpy(static_cast<char*>(local.data()) + i * row,
                static_cast<const char*>(global.data()) + static_cast<size_t>(positions[i]) * row, row);
}

float to_float(const TensorView& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kFloat32: return t.data_as<float>()[i];
    case DType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(t.data_as<uint16_t>()[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
    default: {
      const uint16_t h = t.data_as<uint16_t>()[i];
      const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
      if (exponent == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(mantissa), -24);
      const uint32_t bits = sign | ((exponent == 31 ? 255u : exponent + 112u) << 23) | (mantissa << 13);
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
  }
}

// Largest |local row - global row| over the rows at `positions`.
double max_row_diff(const TensorView& global, const std::vector<int64_t>& positions, const TensorView& local) {
  const int64_t width = global.size(2) * global.size(3);
  double worst = 0;
  for (size_t i = 0; i < positions.size(); ++i)
    for (int64_t j = 0; j < width; ++j)
      worst = std::max(worst, static_cast<double>(std::fabs(to_float(local, static_cast<int64_t>(i) * width + j) -
                                                            to_float(global, positions[i] * width + j))));
  return worst;
}

// Whether some query of rows [qa, qb) sees some key of rows [ka, kb) under the bench's mask.
bool sees(const Options& o, int64_t qa, int64_t qb, int64_t ka, int64_t kb) {
  if (qa >= qb || ka >= kb) return false;
  const int64_t right = o.causal ? 0 : o.window;  // -1: unbounded
  const bool below = right < 0 || ka <= qb - 1 + right;
  const bool above = o.window < 0 || kb - 1 >= qa - o.window;
  return below && above;
}

// Bytes the busiest rank must send per forward + backward at the least, with contiguous shards of
// S/P rows (the other layouts move the same amounts): K/V (and for ulysses Q, O, dO) must reach
// the ranks whose queries see them, and gradient partials must come home.
double analytic_bytes(Strategy s, const Options& o, int world, int ulysses) {
  const double e = static_cast<double>(ringflash::dtype_size(parse_dtype(o.dtype))), d = static_cast<double>(o.hdim);
  const auto rows_of = [&](int r, int p) { return std::make_pair(o.seqlen * r / p, o.seqlen * (r + 1) / p); };
  // One block's K or V, and its fp32 gradient partial, in bytes, for P ranks and `heads` K/V heads.
  const auto block = [&](int p, double heads, double elt) { return static_cast<double>(o.seqlen) / p * heads * d * elt; };
  // Ring family: K/V (forward and backward) and dK/dV partials travel as many hops as the farthest
  // block any rank needs.
  const auto ring = [&](int p, double heads) {
    int hops = 0;
    for (int q = 0; q < p; ++q)
      for (int i = 1; i < p; ++i) {
        const auto [qa, qb] = rows_of(q, p);
        const auto [ka, kb] = rows_of((q - i + p) % p, p);
        if (sees(o, qa, qb, ka, kb) || o.window < 0) hops = std::max(hops, i);
      }
    return hops * (2 * 2 * block(p, heads, e) + 2 * block(p, heads, 4));
  };
  const double share = (static_cast<double>(world) - 1) / world;
  switch (s) {
    case Strategy::kRing:
    case Strategy::kZigzag:
    case Strategy::kStripe:
      return ring(world, static_cast<double>(o.kv_heads));
    case Strategy::kAllGather: {
      double busiest = 0;
      for (int r = 0; r < world; ++r) {
        double sent = 0;
        const auto [ra, rb] = rows_of(r, world);
        for (int q = 0; q < world; ++q) {
          if (q == r) continue;
          const auto [qa, qb] = rows_of(q, world);
          if (sees(o, qa, qb, ra, rb)) sent += 2 * 2 * block(world, static_cast<double>(o.kv_heads), e);  // K, V to q
          if (sees(o, ra, rb, qa, qb)) sent += 2 * block(world, static_cast<double>(o.kv_heads), 4);  // dK, dV of q
        }
        busiest = std::max(busiest, sent);
      }
      return busiest;
    }
    case Strategy::kUlysses: {
      // (P - 1) / P of every shard changes hands: forward q, k, v in and out back; backward q, k,
      // v, out, dout, lse in and dq, dk, dv back (K/V heads replicated when P > H_kv).
      const double kv_heads = std::max<double>(static_cast<double>(o.kv_heads), world);
      const double q = block(world, static_cast<double>(o.heads), e), kv = block(world, kv_heads, e);
      return share * ((2 * q + 2 * kv) + (4 * q + 4 * kv) + block(world, static_cast<double>(o.heads), 4) / d);
    }
    case Strategy::kHybrid: {
      const int r = world / ulysses;
      const double u_share = (ulysses - 1.0) / ulysses;
      const double kv_heads = std::max<double>(static_cast<double>(o.kv_heads), ulysses);
      const double q = block(world, static_cast<double>(o.heads), e), kv = block(world, kv_heads, e);
      const double ulysses_part = u_share * ((2 * q + 2 * kv) + (4 * q + 4 * kv) + block(world, static_cast<double>(o.heads), 4) / d);
      // The ring part moves blocks of S/R rows with H_kv/U heads: the same bytes per rank as a
      // ring over R ranks with H_kv/U heads.
      return ulysses_part + ring(r, kv_heads / ulysses);
    }
  }
  return 0;
}

struct Row {
  std::string strategy;
  int world = 0;
  double forward_ms = 0, step_ms = 0, wait_share = 0, efficiency = 0, sent_mb = 0, analytic_mb = 0, peak_mb = 0,
         max_diff = 0;
  std::string error;
};

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // KiB on Linux
}

// One rank's part of one strategy's measurement; rank 0's `row` gets the results.
void run_rank(Communicator& world, const Options& o, Strategy strategy, const Global& g, Row* row, std::mutex* lock) {
  const DType dtype = parse_dtype(o.dtype);
  std::unique_ptr<Communicator> ulysses, ring;
  ringflash::ParallelGroup group{&world, nullptr, nullptr};
  int u = 1;
  if (strategy == Strategy::kHybrid) {
    u = std::clamp(o.hybrid_ulysses, 1, world.size());
    if (world.size() % u != 0) throw std::invalid_argument("--hybrid-ulysses must divide --world");
    // Ulysses groups are consecutive ranks; rank w is (ring w / U, ulysses w % U).
    ulysses = world.split(world.rank() / u, world.rank());
    ring = world.split(world.rank() % u, world.rank());
    group = {&world, ulysses.get(), ring.get()};
  }
  const ringflash::Shard shard = ringflash::parallel_shard(strategy, group, {}, o.seqlen);
  const std::vector<int64_t> positions = ringflash::shard_positions(shard);
  const int64_t n = static_cast<int64_t>(positions.size()), hq = o.heads, hkv = o.kv_heads, d = o.hdim;
  std::mt19937 unused;
  Buffer q(dtype, {1, n, hq, d}, unused, false), k(dtype, {1, n, hkv, d}, unused, false),
      v(dtype, {1, n, hkv, d}, unused, false), dout(dtype, {1, n, hq, d}, unused, false),
      out(dtype, {1, n, hq, d}, unused, false), lse(DType::kFloat32, {1, hq, n}, unused, false),
      dq(dtype, {1, n, hq, d}, unused, false), dk(dtype, {1, n, hkv, d}, unused, false),
      dv(dtype, {1, n, hkv, d}, unused, false);
  copy_rows(g.q.view, positions, q.view);
  copy_rows(g.k.view, positions, k.view);
  copy_rows(g.v.view, positions, v.view);
  copy_rows(g.dout.view, positions, dout.view);

  AttentionParams params;
  params.causal = o.causal;
  params.window_left = o.window;
  params.window_right = o.causal ? 0 : o.window;
  params.num_threads = o.threads_per_rank;
  const auto forward = [&] {
    ringflash::parallel_attention_forward(strategy, group, q.view, k.view, v.view, out.view, lse.view, params);
  };
  const auto step = [&] {
    forward();
    ringflash::parallel_attention_backward(strategy, group, q.view, k.view, v.view, out.view, dout.view, lse.view,
                                           dq.view, dk.view, dv.view, params);
  };
  std::vector<Communicator*> comms{&world};
  if (ulysses) comms = {&world, ulysses.get(), ring.get()};
  const auto totals = [&] {
    Communicator::Stats t;
    for (Communicator* c : comms) {
      t.bytes_sent += c->stats().bytes_sent;
      t.wait_seconds += c->stats().wait_seconds;
    }
    return t;
  };
  // Median over iterations of the slowest rank's time.
  const auto time_ms = [&](const std::function<void()>& call, Communicator::Stats* spent) {
    for (int i = 0; i < o.warmup; ++i) call();
    std::vector<double> slowest;
    for (int i = 0; i < o.iters; ++i) {
      world.barrier();
      const Communicator::Stats before = totals();
      const auto start = std::chrono::steady_clock::now();
      call();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      const Communicator::Stats after = totals();
      spent->bytes_sent += after.bytes_sent - before.bytes_sent;
      spent->wait_seconds += after.wait_seconds - before.wait_seconds;
      std::vector<double> all(static_cast<size_t>(world.size()));
      world.all_gather(&ms, all.data(), std::vector<size_t>(all.size(), sizeof(double)));
      slowest.push_back(*std::max_element(all.begin(), all.end()));
    }
    std::nth_element(slowest.begin(), slowest.begin() + slowest.size() / 2, slowest.end());
    return slowest[slowest.size() / 2];
  };
  Communicator::Stats forward_stats, step_stats;
  const double forward_ms = time_ms(forward, &forward_stats);
  const double step_ms = time_ms(step, &step_stats);

  // Per rank: [wait share of the step, MB sent per step, max diff]; rank 0 keeps the worst.
  double mine[3] = {step_stats.wait_seconds * 1e3 / (o.iters * step_ms),
                    static_cast<double>(step_stats.bytes_sent) / o.iters / 1e6, 0.0};
  if (o.check) {
    mine[2] = std::max({max_row_diff(g.out.view, positions, out.view), max_row_diff(g.dq.view, positions, dq.view),
                        max_row_diff(g.dk.view, positions, dk.view), max_row_diff(g.dv.view, positions, dv.view)});
    // lse is (1, H, S): compare it head by head.
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < n; ++i)
        mine[2] = std::max(mine[2], static_cast<double>(std::fabs(lse.view.data_as<float>()[h * n + i] -
                                                                  g.lse.view.data_as<float>()[h * o.seqlen + positions[i]])));
  }
  std::vector<double> all(3 * static_cast<size_t>(world.size()));
  world.all_gather(mine, all.data(), std::vector<size_t>(static_cast<size_t>(world.size()), sizeof(mine)));
  if (world.rank() != 0) return;
  std::lock_guard<std::mutex> guard(*lock);
  row->forward_ms = forward_ms;
  row->step_ms = step_ms;
  row->efficiency = g.step_ms / step_ms;
  row->analytic_mb = analytic_bytes(strategy, o, world.size(), u) / 1e6;
  row->peak_mb = peak_rss_mb();
  for (int r = 0; r < world.size(); ++r) {
    row->wait_share += all[3 * r] / world.size();
    row->sent_mb = std::max(row->sent_mb, all[3 * r + 1]);
    row->max_diff = std::max(row->max_diff, all[3 * r + 2]);
  }
}

double tolerance(DType dtype) { return dtype == DType::kFloat32 ? 1e-3 : dtype == DType::kBFloat16 ? 5e-2 : 1e-2; }

}  // namespace

int main(int argc, char** argv) {
  return run_main("ringflash-bench", argc, argv, parse, [](Options& o) {
    std::unique_ptr<Communicator> mpi;
    if (o.transport == "mpi") {
      mpi = ringflash::mpi_world();
      o.world = mpi->size();
    }
    const bool printer = !mpi || mpi->rank() == 0;
    const DType dtype = parse_dtype(o.dtype);
    const int64_t s = o.seqlen, hq = o.heads, hkv = o.kv_heads, d = o.hdim;
    std::mt19937 rng(1234);  // every MPI rank builds the same global problem
    Global g{Buffer(dtype, {1, s, hq, d}, rng, true), Buffer(dtype, {1, s, hkv, d}, rng, true),
             Buffer(dtype, {1, s, hkv, d}, rng, true), Buffer(dtype, {1, s, hq, d}, rng, true),
             Buffer(dtype, {1, s, hq, d}, rng, false), Buffer(DType::kFloat32, {1, hq, s}, rng, false),
             Buffer(dtype, {1, s, hq, d}, rng, false), Buffer(dtype, {1, s, hkv, d}, rng, false),
             Buffer(dtype, {1, s, hkv, d}, rng, false)};
    AttentionParams single;
    single.causal = o.causal;
    single.window_left = o.window;
    single.window_right = o.causal ? 0 : o.window;
    single.num_threads = o.world * o.threads_per_rank;
    const auto forward = [&](int) {
      ringflash::attention_forward(g.q.view, g.k.view, g.v.view, g.out.view, g.lse.view, single);
    };
    g.forward_ms = median_ms(o.warmup, o.iters, forward);
    g.step_ms = median_ms(o.warmup, o.iters, [&](int i) {
      forward(i);
      ringflash::attention_backward(g.q.view, g.k.view, g.v.view, g.out.view, g.dout.view, g.lse.view, g.dq.view,
                                    g.dk.view, g.dv.view, single);
    });
    if (printer) {
      std::printf("%s", ringflash::build_info().c_str());
      std::printf(
          "%s ranks: %d x %d thread(s); single device: %d threads. S=%lld H=%lld H_kv=%lld D=%lld %s causal=%d "
          "window=%lld, iters %d, warmup %d\n",
          o.transport.c_str(), o.world, o.threads_per_rank, o.world * o.threads_per_rank, static_cast<long long>(s),
          static_cast<long long>(hq), static_cast<long long>(hkv), static_cast<long long>(d), o.dtype.c_str(),
          o.causal ? 1 : 0, static_cast<long long>(o.window), o.iters, o.warmup);
      std::printf("single device: forward %.2f ms, forward+backward %.2f ms\n\n", g.forward_ms, g.step_ms);
      std::printf("%-10s %3s %10s %12s %7s %6s %10s %12s %9s %10s %s\n", "strategy", "P", "fwd ms", "fwd+bwd ms",
                  "wait %", "eff", "MB sent", "MB minimum", "peak MB", "max|diff|", "check");
    }
    std::vector<Row> rows;
    bool ok = true;
    for (const std::string& name : o.strategies) {
      Row row;
      row.strategy = name;
      row.world = o.world;
      std::mutex lock;
      try {
        const Strategy strategy = parse_strategy(name);
        if (mpi) {
          run_rank(*mpi, o, strategy, g, &row, &lock);
        } else {
          ringflash::run_inproc(o.world, [&](Communicator& comm) { run_rank(comm, o, strategy, g, &row, &lock); });
        }
      } catch (const std::exception& e) {
        row.error = e.what();
      }
      const bool passed = row.error.empty() && (!o.check || row.max_diff <= tolerance(dtype));
      ok = ok && passed;
      if (printer) {
        if (!row.error.empty())
          std::printf("%-10s %3d  error: %s\n", name.c_str(), o.world, row.error.c_str());
        else
          std::printf("%-10s %3d %10.2f %12.2f %7.1f %6.2f %10.2f %12.2f %9.0f %10.1e %s\n", name.c_str(), o.world,
                      row.forward_ms, row.step_ms, 100 * row.wait_share, row.efficiency, row.sent_mb, row.analytic_mb,
                      row.peak_mb, row.max_diff, !o.check ? "-" : passed ? "ok" : "FAIL");
        std::fflush(stdout);
      }
      rows.push_back(row);
    }
    if (printer && !o.json.empty()) {
      FILE* f = std::fopen(o.json.c_str(), "w");
      if (!f) throw std::runtime_error("cannot write " + o.json);
      std::fprintf(f, "[\n");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "  {\"strategy\": \"%s\", \"world\": %d, \"transport\": \"%s\", \"seqlen\": %lld, \"heads\": %lld, "
                     "\"kv_heads\": %lld, \"hdim\": %lld, \"dtype\": \"%s\", \"causal\": %s, \"forward_ms\": %.4f, "
                     "\"step_ms\": %.4f, \"single_step_ms\": %.4f, \"wait_share\": %.4f, \"efficiency\": %.4f, "
                     "\"mb_sent\": %.4f, \"mb_minimum\": %.4f, \"peak_mb\": %.1f, \"max_diff\": %.3e, \"error\": \"%s\"}%s\n",
                     r.strategy.c_str(), r.world, o.transport.c_str(), static_cast<long long>(s),
                     static_cast<long long>(hq), static_cast<long long>(hkv), static_cast<long long>(d),
                     o.dtype.c_str(), o.causal ? "true" : "false", r.forward_ms, r.step_ms, g.step_ms, r.wait_share,
                     r.efficiency, r.sent_mb, r.analytic_mb, r.peak_mb, r.max_diff, r.error.empty() ? "" : "see log",
                     i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "]\n");
      std::fclose(f);
    }
    return ok ? 0 : 1;
  });
}
