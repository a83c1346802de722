// Reference attention for the tests: naive, one sequence at a time, with an explicit index mask.
//
// It implements exactly the semantics of include/ringflash/attention.h:
//   pq = q_pos + i, pk = k_pos + j;  visible iff (!causal || pk <= pq) and
//   pq - window_left <= pk <= pq + window_right (a side that is -1 is unbounded);
//   s = scale * q.k;  s = softcap * tanh(s / softcap) if softcap > 0;  s -= slope[h] * |pq - pk|;
//   out = softmax(s) v,  lse = log(sum exp(s));  q head h reads kv head h / (Hq / Hkv);
//   a row that sees no key has out = 0 and lse = -inf.
// The backward is derived analytically: with p = exp(s - lse) and D_i = dout_i . out_i,
//   dv_j = sum_i p_ij dout_i,   ds_ij = p_ij (dout_i . v_j - D_i) * dcap_ij,
//   dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,
// where dcap = 1 - tanh^2(scale q.k / softcap) with softcap (ALiBi does not depend on q or k).
//
// Two precisions run the same algorithm:
//   Precision::float64()      float64 throughout: the reference the kernels are measured against.
//   Precision::naive(...)     float accumulation, and every stage (scores, probabilities, outputs,
//                             gradients) rounded to the test dtype: the error of this "naive
//                             attention in the test dtype" sets the tolerance (see tolerance.h).
// No gtest here, so the benchmarks can use it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "half.h"
#include "ringflash/tensor.h"

namespace ringflash::test {

// Mask and score options, resolved (no defaults left to apply).
struct RefOptions {
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t head_dim = 1;
  double scale = 1.0;
  double softcap = 0.0;        // 0: off
  bool causal = false;
  int64_t window_left = -1;    // -1: unbounded
  int64_t window_right = -1;   // -1: unbounded
};

// One sequence: a batch entry of a padded batch or one document of a packed one. Row-major.
struct RefSequence {
  int64_t len_q = 0;
  int64_t len_k = 0;
  int64_t q_pos = 0;            // global position of query row 0
  int64_t k_pos = 0;            // global position of key row 0
  std::vector<double> slopes;   // ALiBi slope of each q head, or empty
  std::vector<double> q;        // (len_q, Hq, D)
  std::vector<double> k;        // (len_k, Hkv, D)
  std::vector<double> v;        // (len_k, Hkv, D)
  std::vector<double> dout;     // (len_q, Hq, D); backward only
};

struct RefForward {
  std::vector<double> out;  // (len_q, Hq, D)
  std::vector<double> lse;  // (Hq, len_q)
};

struct RefGrads {
  std::vector<double> dq;  // (len_q, Hq, D)
  std::vector<double> dk;  // (len_k, Hkv, D)
  std::vector<double> dv;  // (len_k, Hkv, D)
};

// How the reference rounds; see the header comment.
struct Precision {
  bool exact = true;
  DType dtype = DType::kFloat64;       // scores and probabilities
  DType out_dtype = DType::kFloat64;   // forward output
  DType grad_dtype = DType::kFloat64;  // dq, dk, dv

  static Precision float64() { return {}; }
  static Precision naive(DType dtype, DType out_dtype, DType grad_dtype) {
    return {false, dtype, out_dtype, grad_dtype};
  }
};

// The explicit mask: may query position pq see key position pk?
inline bool visible(const RefOptions& o, int64_t pq, int64_t pk) {
  if (o.causal && pk > pq) return false;
  if (o.window_left >= 0 && pk < pq - o.window_left) return false;
  if (o.window_right >= 0 && pk > pq + o.window_right) return false;
  return true;
}

namespace detail {

// The keys row i may see, [begin, end). Evaluated key by key with `visible`; the visible keys of
// a row always form one run, and the check below keeps that promise honest.
struct KeyRange {
  int64_t begin = 0, end = 0;
};

inline KeyRange visible_keys(const RefOptions& o, const RefSequence& s, int64_t i) {
  const int64_t pq = s.q_pos + i;
  KeyRange r{s.len_k, s.len_k};
  bool ended = false;
  for (int64_t j = 0; j < s.len_k; ++j) {
    const bool vis = visible(o, pq, s.k_pos + j);
    if (vis && ended) throw std::logic_error("reference: visible keys of a row are not contiguous");
    if (vis && r.begin == s.len_k) r.begin = j;
    if (!vis && r.begin != s.len_k && !ended) {
      r.end = j;
      ended = true;
    }
  }
  if (r.begin == s.len_k) r.end = s.len_k;
  return r;
}

// Rounding of one stage: identity in float64, the test dtype otherwise.
template <typename Acc>
Acc round_as(const Precision& p, DType dtype, double x) {
  return static_cast<Acc>(p.exact ? x : round_to(dtype, x));
}

// (len, H, D) as Acc, transposed per head to (H, D, len), so that the scores of one query
// against a run of keys vectorise across keys while each dot product still sums over d in order.
template <typename Acc>
std::vector<Acc> transpose_heads(const std::vector<double>& x, int64_t len, int64_t heads, int64_t dim) {
  std::vector<Acc> t(x.size());
  for (int64_t j = 0; j < len; ++j)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) t[(h * dim + d) * len + j] = static_cast<Acc>(x[(j * heads + h) * dim + d]);
  return t;
}

template <typename Acc>
std::vector<Acc> cast(const std::vector<double>& x) {
  return std::vector<Acc>(x.begin(), x.end());
}

// Scores of query row i (head h) against keys [r.begin, r.end), after scale, softcap and ALiBi.
// `raw` receives the scaled scores before softcap (needed for its derivative).
template <typename Acc>
void scores(const RefOptions& o, const Precision& p, const RefSequence& s, const std::vector<Acc>& q,
            const std::vector<Acc>& k_t, int64_t i, int64_t h, KeyRange r, std::vector<Acc>& out,
            std::vector<Acc>& raw) {
  const int64_t n = r.end - r.begin, dim = o.head_dim, g = h / (o.heads_q / o.heads_kv);
  out.assign(n, Acc(0));
  raw.assign(n, Acc(0));
  const Acc* qi = &q[(i * o.heads_q + h) * dim];
  for (int64_t d = 0; d < dim; ++d) {
    const Acc* kd = &k_t[(g * dim + d) * s.len_k + r.begin];
    const Acc qd = qi[d];
    for (int64_t j = 0; j < n; ++j) out[j] += qd * kd[j];
  }
  const int64_t pq = s.q_pos + i;
  for (int64_t j = 0; j < n; ++j) {
    Acc x = round_as<Acc>(p, p.dtype, static_cast<Acc>(o.scale) * out[j]);
    raw[j] = x;
    if (o.softcap > 0) {
      const Acc cap = static_cast<Acc>(o.softcap);
      x = round_as<Acc>(p, p.dtype, cap * std::tanh(x / cap));
    }
    if (!s.slopes.empty()) {
      const int64_t dist = std::abs(pq - (s.k_pos + r.begin + j));
      x = round_as<Acc>(p, p.dtype, x - static_cast<Acc>(s.slopes[h]) * static_cast<Acc>(dist));
    }
    out[j] = x;
  }
}

template <typename Acc>
RefForward forward(const RefOptions& o, const RefSequence& s, const Precision& p) {
  const int64_t hq = o.heads_q, hkv = o.heads_kv, dim = o.head_dim;
  const std::vector<Acc> q = cast<Acc>(s.q), v = cast<Acc>(s.v);
  const std::vector<Acc> k_t = transpose_heads<Acc>(s.k, s.len_k, hkv, dim);
  RefForward f;
  f.out.assign(s.len_q * hq * dim, 0.0);
  f.lse.assign(hq * s.len_q, -std::numeric_limits<double>::infinity());
  std::vector<Acc> sc, raw, acc(dim);
  for (int64_t i = 0; i < s.len_q; ++i) {
    const KeyRange r = visible_keys(o, s, i);
    if (r.begin == r.end) continue;  // sees no key: out = 0, lse = -inf
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / (hq / hkv);
      scores<Acc>(o, p, s, q, k_t, i, h, r, sc, raw);
      const Acc m = *std::max_element(sc.begin(), sc.end());
      Acc l = 0;
      for (Acc& x : sc) {
        x = round_as<Acc>(p, p.dtype, std::exp(x - m));
        l += x;
      }
      f.lse[h * s.len_q + i] = static_cast<double>(m + std::log(l));
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t j = r.begin; j < r.end; ++j) {
        const Acc pj = round_as<Acc>(p, p.dtype, sc[j - r.begin] / l);
        const Acc* vj = &v[(j * hkv + g) * dim];
        for (int64_t d = 0; d < dim; ++d) acc[d] += pj * vj[d];
      }
      for (int64_t d = 0; d < dim; ++d) f.out[(i * hq + h) * dim + d] = round_as<Acc>(p, p.out_dtype, acc[d]);
    }
  }
  return f;
}

template <typename Acc>
RefGrads backward(const RefOptions& o, const RefSequence& s, const std::vector<double>& out,
                  const std::vector<double>& lse, const Precision& p) {
  const int64_t hq = o.heads_q, hkv = o.heads_kv, dim = o.head_dim;
  const std::vector<Acc> q = cast<Acc>(s.q), k = cast<Acc>(s.k), dout = cast<Acc>(s.dout);
  const std::vector<Acc> k_t = transpose_heads<Acc>(s.k, s.len_k, hkv, dim);
  const std::vector<Acc> v_t = transpose_heads<Acc>(s.v, s.len_k, hkv, dim);
  std::vector<Acc> dq(s.q.size(), Acc(0)), dk(s.k.size(), Acc(0)), dv(s.v.size(), Acc(0));
  std::vector<Acc> sc, raw, dp;
  for (int64_t i = 0; i < s.len_q; ++i) {
    const KeyRange r = visible_keys(o, s, i);
    const int64_t n = r.end - r.begin;
    if (n == 0) continue;
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / (hq / hkv);
      scores<Acc>(o, p, s, q, k_t, i, h, r, sc, raw);
      const Acc lse_i = static_cast<Acc>(lse[h * s.len_q + i]);
      const Acc* dout_i = &dout[(i * hq + h) * dim];
      Acc delta = 0;  // D_i = dout_i . out_i
      for (int64_t d = 0; d < dim; ++d) delta += dout_i[d] * static_cast<Acc>(out[(i * hq + h) * dim + d]);
      dp.assign(n, Acc(0));  // dout_i . v_j
      for (int64_t d = 0; d < dim; ++d) {
        const Acc* vd = &v_t[(g * dim + d) * s.len_k + r.begin];
        for (int64_t j = 0; j < n; ++j) dp[j] += dout_i[d] * vd[j];
      }
      Acc* dq_i = &dq[(i * hq + h) * dim];
      const Acc* q_i = &q[(i * hq + h) * dim];
      for (int64_t j = 0; j < n; ++j) {
        const Acc pj = round_as<Acc>(p, p.dtype, std::exp(sc[j] - lse_i));
        const int64_t kv = ((r.begin + j) * hkv + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dv[kv + d] += pj * dout_i[d];
        Acc ds = round_as<Acc>(p, p.dtype, pj * (round_as<Acc>(p, p.dtype, dp[j]) - delta));
        if (o.softcap > 0) {
          const Acc t = std::tanh(raw[j] / static_cast<Acc>(o.softcap));
          ds = round_as<Acc>(p, p.dtype, ds * (Acc(1) - t * t));
        }
        for (int64_t d = 0; d < dim; ++d) dq_i[d] += ds * k[kv + d];
        for (int64_t d = 0; d < dim; ++d) dk[kv + d] += ds * q_i[d];
      }
    }
  }
  RefGrads g;
  const Acc scale = static_cast<Acc>(o.scale);
  auto finish = [&](const std::vector<Acc>& x, Acc factor) {
    std::vector<double> y(x.size());
    for (size_t e = 0; e < x.size(); ++e) y[e] = round_as<Acc>(p, p.grad_dtype, factor * x[e]);
    return y;
  };
  g.dq = finish(dq, scale);
  g.dk = finish(dk, scale);
  g.dv = finish(dv, Acc(1));
  return g;
}

}  // namespace detail

// Which rows see at least one key, and which keys at least one row sees (the same for every head).
// Outputs of the others are exactly zero (lse -inf), not merely small: a row that sees one key has
// a mathematically zero dq too, but rounding may leave a residue there, and that is fine.
struct RefVisibility {
  std::vector<bool> row_sees_keys;  // (len_q)
  std::vector<bool> key_is_seen;    // (len_k)
};

inline RefVisibility reference_visibility(const RefOptions& o, const RefSequence& s) {
  RefVisibility v;
  v.row_sees_keys.assign(s.len_q, false);
  v.key_is_seen.assign(s.len_k, false);
  for (int64_t i = 0; i < s.len_q; ++i) {
    const detail::KeyRange r = detail::visible_keys(o, s, i);
    v.row_sees_keys[i] = r.begin < r.end;
    for (int64_t j = r.begin; j < r.end; ++j) v.key_is_seen[j] = true;
  }
  return v;
}

// Forward of one sequence.
inline RefForward reference_forward(const RefOptions& o, const RefSequence& s,
                                    const Precision& p = Precision::float64()) {
  return p.exact ? detail::forward<double>(o, s, p) : detail::forward<float>(o, s, p);
}

// Gradients of one sequence, given the forward's `out` (len_q, Hq, D) and `lse` (Hq, len_q): the
// exact ones for the float64 reference, the ones handed to the kernel for the naive one.
inline RefGrads reference_backward(const RefOptions& o, const RefSequence& s, const std::vector<double>& out,
                                   const std::vector<double>& lse, const Precision& p = Precision::float64()) {
  return p.exact ? detail::backward<double>(o, s, out, lse, p) : detail::backward<float>(o, s, out, lse, p);
}

}  // namespace ringflash::test
