#include "parallel_harness.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <mutex>
#include <random>
#include <sstream>
#include <utility>

#include "ringflash/errors.h"

namespace ringflash::test {
namespace {

// Gaps of strided local tensors, in elements.
constexpr int64_t kHeadGap = 3;
constexpr int64_t kRowGap = 5;
constexpr int64_t kSeqGap = 7;
// References kept per process: enough for the strategies and world sizes of one problem that
// run one after another.
constexpr size_t kCachedReferences = 4;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

uint64_t seed_of(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across standard libraries
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

const char* dtype_short(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    default: return "fp32";
  }
}

const char* mask_name(MaskKind mask) {
  switch (mask) {
    case MaskKind::kCausal: return "causal";
    case MaskKind::kWindow: return "window";
    case MaskKind::kCausalWindow: return "slide";
    default: return "full";
  }
}

std::vector<double> normal_values(std::mt19937_64& rng, int64_t n, DType dtype) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(static_cast<size_t>(n));
  for (double& e : x) e = round_to(dtype, normal(rng));
  return x;
}

std::string join(const std::vector<std::string>& lines) {
  std::string all;
  for (const std::string& line : lines) all += line + "\n";
  return all;
}

// Values gathered from this rank's rows, with what the reference says about each.
struct Checked {
  std::vector<double> got, want, naive;
  std::vector<bool> masked;
  std::vector<std::string> where;

  void add(double g, double w, double n, bool m, std::string label) {
    got.push_back(g);
    want.push_back(w);
    naive.push_back(n);
    masked.push_back(m);
    where.push_back(std::move(label));
  }
};

void check_into(std::vector<std::string>& failures, const std::string& name, const Checked& c, DType dtype,
                Quantity what) {
  const CheckResult r = check_pass_rule(name, c.got, c.want, c.naive, c.masked, dtype, what,
                                        [&](size_t e) { return c.where[e]; });
  if (!r.ok) failures.push_back(r.message);
}

}  // namespace

std::string ParallelCase::problem() const {
  std::ostringstream s;
  s << (backward ? "bwd" : "fwd") << "_" << dtype_short(dtype) << "_" << mask_name(mask);
  if (mask == MaskKind::kWindow || mask == MaskKind::kCausalWindow) s << window_left;
  if (mask == MaskKind::kWindow) s << "x" << window_right;
  s << "_h" << heads_q << "x" << heads_kv << "_d" << head_dim;
  if (packed()) {
    s << "_docs";
    for (int64_t d : docs) s << "_" << d;
  } else {
    s << "_b" << batch << "_s" << seqlen;
  }
  if (alibi) s << (alibi_per_sequence ? "_alibiseq" : "_alibi");
  if (softcap > 0) s << "_softcap";
  if (softmax_scale) s << "_scale";
  return s.str();
}

std::string ParallelCase::name() const {
  std::ostringstream s;
  s << strategy_name(strategy) << "_" << problem() << "_p" << world;
  if (strategy == Strategy::kHybrid)
    s << "_u" << ulysses << "_" << layout_name(options.hybrid_ring_layout);
  if (strategy == Strategy::kAllGather && options.kv_heads_per_gather > 0)
    s << "_gather" << options.kv_heads_per_gather;
  if (strided) s << "_strided";
  return s.str();
}

RefOptions ref_options(const ParallelCase& c) {
  RefOptions o;
  o.heads_q = c.heads_q;
  o.heads_kv = c.heads_kv;
  o.head_dim = c.head_dim;
  o.scale = c.softmax_scale ? *c.softmax_scale : static_cast<float>(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  o.softcap = c.softcap;
  o.causal = c.mask == MaskKind::kCausal || c.mask == MaskKind::kCausalWindow;
  if (c.mask == MaskKind::kWindow || c.mask == MaskKind::kCausalWindow) o.window_left = c.window_left;
  if (c.mask == MaskKind::kWindow) o.window_right = c.window_right;
  return o;
}

std::vector<RefSequence> case_inputs(const ParallelCase& c) {
  std::mt19937_64 rng(seed_of(c.problem()));
  std::vector<RefSequence> seqs;
  for (int64_t b = 0; b < c.num_seqs(); ++b) {
    RefSequence s;
    s.len_q = s.len_k = c.length(b);
    s.q = normal_values(rng, s.len_q * c.heads_q * c.head_dim, c.dtype);
    s.k = normal_values(rng, s.len_k * c.heads_kv * c.head_dim, c.dtype);
    s.v = normal_values(rng, s.len_k * c.heads_kv * c.head_dim, c.dtype);
    s.dout = normal_values(rng, s.len_q * c.heads_q * c.head_dim, c.dtype);
    if (c.alibi)
      for (int64_t h = 0; h < c.heads_q; ++h)  // the ALiBi paper's geometric slopes, as fp32
        s.slopes.push_back(static_cast<float>(std::exp2(-8.0 * (h + 1) / c.heads_q) *
                                              (c.alibi_per_sequence ? 1.0 + 0.25 * b : 1.0)));
    seqs.push_back(std::move(s));
  }
  return seqs;
}

std::shared_ptr<const Expected> expected_for(const ParallelCase& c) {
  static std::mutex mutex;
  static std::vector<std::pair<std::string, std::shared_ptr<const Expected>>> cache;
  const std::string key = c.problem();
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [name, e] : cache)
    if (name == key) return e;

  auto e = std::make_shared<Expected>();
  e->seqs = case_inputs(c);
  const RefOptions o = ref_options(c);
  const Precision naive = Precision::naive(c.dtype, c.dtype, c.dtype);
  for (const RefSequence& s : e->seqs) {
    e->visibility.push_back(reference_visibility(o, s));
    RefForward exact = oracle_forward(o, s);
    if (!c.backward) {
      e->naive.push_back(oracle_forward(o, s, naive));
    } else {
      RefForward given = exact;
      for (double& x : given.out) x = round_to(c.dtype, x);
      for (double& x : given.lse) x = round_to(DType::kFloat32, x);
      e->grads.push_back(oracle_backward(o, s, exact.out, exact.lse));
      e->naive_grads.push_back(oracle_backward(o, s, given.out, given.lse, naive));
      e->given.push_back(std::move(given));
    }
    e->exact.push_back(std::move(exact));
  }
  if (cache.size() == kCachedReferences) cache.erase(cache.begin());
  cache.emplace_back(key, e);
  return e;
}

CaseGroup::CaseGroup(Communicator& parent, const ParallelCase& c) {
  if (c.strategy == Strategy::kHybrid) {
    const int u = parent.rank() % c.ulysses, r = parent.rank() / c.ulysses;
    ulysses = parent.split(r, u);
    ring = parent.split(u, r);
    ulysses->set_timeout(parent.timeout());
    ring->set_timeout(parent.timeout());
    group = ParallelGroup{nullptr, ulysses.get(), ring.get()};
  } else {
    world = parent.split(0, parent.rank());
    world->set_timeout(parent.timeout());
    group = ParallelGroup{world.get(), nullptr, nullptr};
  }
}

RankProblem::RankProblem(const ParallelCase& c, const ParallelGroup& group, const Expected& expected)
    : case_(c), group_(group) {
  cu_.push_back(0);
  for (int64_t b = 0; b < c.num_seqs(); ++b) {
    shards_.push_back(parallel_shard(c.strategy, group, c.options, c.length(b)));
    cu_.push_back(cu_.back() + static_cast<int32_t>(c.length(b)));
  }
  if (c.packed()) {
    local_cu_.push_back(0);
    for (const Shard& s : shards_) local_cu_.push_back(local_cu_.back() + static_cast<int32_t>(shard_rows(s)));
    rows_ = local_cu_.back();
  } else {
    rows_ = shard_rows(parallel_shard(c.strategy, group, c.options, c.seqlen));
  }
  for (int64_t b = 0; b < (c.alibi_per_sequence ? c.num_seqs() : std::min<int64_t>(c.num_seqs(), 1)); ++b)
    slopes_.insert(slopes_.end(), expected.seqs[b].slopes.begin(), expected.seqs[b].slopes.end());

  q = make_rows(c.dtype, c.heads_q, kNaN);
  k = make_rows(c.dtype, c.heads_kv, kNaN);
  v = make_rows(c.dtype, c.heads_kv, kNaN);
  if (c.backward) {
    out = make_rows(c.dtype, c.heads_q, kNaN);
    dout = make_rows(c.dtype, c.heads_q, kNaN);
    lse = make_lse(kNaN);
    dq = make_rows(c.dtype, c.heads_q, kNaN);
    dk = make_rows(c.dtype, c.heads_kv, kNaN);
    dv = make_rows(c.dtype, c.heads_kv, kNaN);
  } else {
    out = make_rows(c.dtype, c.heads_q, kNaN);
    lse = make_lse(kNaN);
  }
  const int64_t hq = c.heads_q, hkv = c.heads_kv, dim = c.head_dim;
  for (int64_t b = 0; b < c.num_seqs(); ++b) {
    const RefSequence& s = expected.seqs[b];
    const std::vector<int64_t> positions = shard_positions(shards_[b]);
    for (int64_t i = 0; i < static_cast<int64_t>(positions.size()); ++i) {
      const int64_t pos = positions[i];
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t d = 0; d < dim; ++d) {
          q.set_element(element(q, b, i, h, d), s.q[(pos * hq + h) * dim + d]);
          if (c.backward) {
            dout.set_element(element(dout, b, i, h, d), s.dout[(pos * hq + h) * dim + d]);
            out.set_element(element(out, b, i, h, d), expected.given[b].out[(pos * hq + h) * dim + d]);
          }
        }
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t d = 0; d < dim; ++d) {
          k.set_element(element(k, b, i, h, d), s.k[(pos * hkv + h) * dim + d]);
          v.set_element(element(v, b, i, h, d), s.v[(pos * hkv + h) * dim + d]);
        }
      if (c.backward)
        for (int64_t h = 0; h < hq; ++h)
          lse.set_element(lse_element(lse, b, h, i), expected.given[b].lse[h * s.len_q + pos]);
    }
  }
}

AttentionParams RankProblem::params() {
  AttentionParams p;
  const RefOptions o = ref_options(case_);
  p.causal = o.causal;
  p.window_left = o.window_left;
  p.window_right = o.window_right;
  p.softcap = case_.softcap;
  p.softmax_scale = case_.softmax_scale;
  p.num_threads = 1;
  if (case_.alibi && case_.alibi_per_sequence)
    p.alibi_slopes = TensorView(slopes_.data(), DType::kFloat32, Device{}, {case_.num_seqs(), case_.heads_q});
  else if (case_.alibi)
    p.alibi_slopes = TensorView(slopes_.data(), DType::kFloat32, Device{}, {case_.heads_q});
  if (case_.packed())
    p.cu_seqlens_q = TensorView(cu_.data(), DType::kInt32, Device{}, {static_cast<int64_t>(cu_.size())});
  return p;
}

void RankProblem::run() {
  const AttentionParams p = params();
  if (case_.backward)
    parallel_attention_backward(case_.strategy, group_, q.view(), k.view(), v.view(), out.view(), dout.view(),
                                lse.view(), dq.view(), dk.view(), dv.view(), p, case_.options);
  else
    parallel_attention_forward(case_.strategy, group_, q.view(), k.view(), v.view(), out.view(), lse.view(), p,
                               case_.options);
}

std::vector<std::string> RankProblem::check(const Expected& expected) const {
  const ParallelCase& c = case_;
  const int64_t hq = c.heads_q, hkv = c.heads_kv, dim = c.head_dim;
  Checked o, l, gq, gk, gv;
  for (int64_t b = 0; b < c.num_seqs(); ++b) {
    const std::vector<int64_t> positions = shard_positions(shards_[b]);
    const RefVisibility& vis = expected.visibility[b];
    const int64_t len = c.length(b);
    for (int64_t i = 0; i < static_cast<int64_t>(positions.size()); ++i) {
      const int64_t pos = positions[i];
      const auto label = [&](int64_t h, int64_t d) {
        return "(b=" + std::to_string(b) + ", position " + std::to_string(pos) + " = local row " + std::to_string(i) +
               ", h=" + std::to_string(h) + (d >= 0 ? ", d=" + std::to_string(d) : "") + ")";
      };
      for (int64_t h = 0; h < hq; ++h) {
        if (!c.backward)
          l.add(lse.at_element(lse_element(lse, b, h, i)), expected.exact[b].lse[h * len + pos],
                expected.naive[b].lse[h * len + pos], !vis.row_sees_keys[pos], label(h, -1));
        for (int64_t d = 0; d < dim; ++d) {
          const size_t e = static_cast<size_t>((pos * hq + h) * dim + d);
          if (!c.backward)
            o.add(out.at_element(element(out, b, i, h, d)), expected.exact[b].out[e], expected.naive[b].out[e],
                  !vis.row_sees_keys[pos], label(h, d));
          else
            gq.add(dq.at_element(element(dq, b, i, h, d)), expected.grads[b].dq[e], expected.naive_grads[b].dq[e],
                   !vis.row_sees_keys[pos], label(h, d));
        }
      }
      if (!c.backward) continue;
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t d = 0; d < dim; ++d) {
          const size_t e = static_cast<size_t>((pos * hkv + h) * dim + d);
          gk.add(dk.at_element(element(dk, b, i, h, d)), expected.grads[b].dk[e], expected.naive_grads[b].dk[e],
                 !vis.key_is_seen[pos], label(h, d));
          gv.add(dv.at_element(element(dv, b, i, h, d)), expected.grads[b].dv[e], expected.naive_grads[b].dv[e],
                 !vis.key_is_seen[pos], label(h, d));
        }
    }
  }
  std::vector<std::string> failures;
  if (!c.backward) {
    check_into(failures, "out", o, c.dtype, Quantity::kOut);
    check_into(failures, "lse", l, c.dtype, Quantity::kLse);
  } else {
    check_into(failures, "dq", gq, c.dtype, Quantity::kGrad);
    check_into(failures, "dk", gk, c.dtype, Quantity::kGrad);
    check_into(failures, "dv", gv, c.dtype, Quantity::kGrad);
  }
  return failures;
}

HostTensor RankProblem::make_rows(DType dtype, int64_t heads, double fill) const {
  const int64_t dim = case_.head_dim, rows = rows_;
  const std::vector<int64_t> shape = case_.packed() ? std::vector<int64_t>{rows, heads, dim}
                                                    : std::vector<int64_t>{case_.batch, rows, heads, dim};
  if (!case_.strided) return HostTensor::empty(dtype, shape, fill);
  const int64_t head = dim + kHeadGap, row = heads * head + kRowGap;
  const std::vector<int64_t> strides = case_.packed() ? std::vector<int64_t>{row, head, 1}
                                                      : std::vector<int64_t>{rows * row + kSeqGap, row, head, 1};
  return HostTensor::strided(dtype, shape, strides, fill);
}

HostTensor RankProblem::make_lse(double fill) const {
  const int64_t hq = case_.heads_q, rows = rows_;
  if (case_.packed()) {
    if (case_.strided) return HostTensor::strided(DType::kFloat32, {hq, rows}, {rows + kRowGap, 1}, fill);
    return HostTensor::empty(DType::kFloat32, {hq, rows}, fill);
  }
  const int64_t b = case_.batch;
  if (case_.strided)
    return HostTensor::strided(DType::kFloat32, {b, hq, rows}, {hq * (rows + kRowGap) + kSeqGap, rows + kRowGap, 1},
                               fill);
  return HostTensor::empty(DType::kFloat32, {b, hq, rows}, fill);
}

int64_t RankProblem::element(const HostTensor& t, int64_t b, int64_t i, int64_t h, int64_t d) const {
  return case_.packed() ? t.element({local_cu_[b] + i, h, d}) : t.element({b, i, h, d});
}

int64_t RankProblem::lse_element(const HostTensor& t, int64_t b, int64_t h, int64_t i) const {
  return case_.packed() ? t.element({h, local_cu_[b] + i}) : t.element({b, h, i});
}

int64_t sum_over_ranks(Communicator& comm, int64_t count) {
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<int64_t> all(n);
  comm.all_gather(&count, all.data(), std::vector<size_t>(n, sizeof(int64_t)));
  int64_t total = 0;
  for (int64_t x : all) total += x;
  return total;
}

void run_parallel_case(Communicator& world, const ParallelCase& c, Communicator* verdict) {
  const std::string rank = "rank " + std::to_string(world.rank()) + " of " + std::to_string(world.size());
  std::vector<std::string> failures;
  try {
    CaseGroup group(world, c);
    const std::shared_ptr<const Expected> expected = expected_for(c);
    RankProblem problem(c, group.group, *expected);
    const std::vector<const HostTensor*> inputs = c.backward
        ? std::vector<const HostTensor*>{&problem.q, &problem.k, &problem.v, &problem.out, &problem.dout, &problem.lse}
        : std::vector<const HostTensor*>{&problem.q, &problem.k, &problem.v};
    std::vector<std::vector<unsigned char>> before;
    for (const HostTensor* t : inputs) before.push_back(t->storage()->bytes);
    try {
      problem.run();
      failures = problem.check(*expected);
      for (size_t i = 0; i < inputs.size(); ++i)
        if (inputs[i]->storage()->bytes != before[i]) failures.push_back("the call wrote into one of its inputs");
    } catch (const std::exception& e) {
      failures.push_back(std::string("the strategy threw: ") + e.what());
    }
  } catch (const std::exception& e) {
    failures.push_back(std::string("setting up the case threw: ") + e.what());
  }
  int64_t total = -1;
  std::string verdict_error;
  try {
    total = sum_over_ranks(verdict ? *verdict : world, static_cast<int64_t>(failures.size()));
  } catch (const std::exception& e) {
    verdict_error = std::string("the verdict exchange threw: ") + e.what();
  }
  EXPECT_EQ(total, 0) << c.name() << ", " << rank << ": " << failures.size() << " failed check(s) here\n"
                      << join(failures) << verdict_error;
}

void run_inproc_case(const ParallelCase& c, std::chrono::milliseconds timeout) {
  try {
    run_inproc(c.world, [&](Communicator& comm) { run_parallel_case(comm, c); }, timeout);
  } catch (const std::exception& e) {
    ADD_FAILURE() << c.name() << ": run_inproc threw " << e.what();
  }
}

}  // namespace ringflash::test
