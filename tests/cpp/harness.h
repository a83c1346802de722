// Runs one KernelCase through the library and checks it against the float64 reference.
//
// A Problem holds everything a case needs: seeded random inputs already rounded to the test dtype,
// in the case's memory layout; the per-sequence view of the same values that the reference reads;
// positions, ALiBi slopes and cu_seqlens; and the AttentionParams pointing at them.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cases.h"
#include "host_tensor.h"
#include "reference.h"
#include "ringflash/attention.h"
#include "ringflash/errors.h"
#include "tolerance.h"

namespace ringflash::test {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Gaps added by Layout::kStrided, in elements.
constexpr int64_t kHeadGap = 3;
constexpr int64_t kRowGap = 5;
constexpr int64_t kSeqGap = 7;

// Positions::kPerSequence: sequence b starts its keys at kSeqKeyStride * b + kSeqKeyBase, and its
// queries at the bottom-right place shifted by kSeqQueryShift[b % 3] (so causal rows appear that
// see no key, and rows that see every key).
constexpr int64_t kSeqKeyStride = 1000;
constexpr int64_t kSeqKeyBase = -3;
constexpr int64_t kSeqQueryShift[3] = {-60, 25, 0};

// Three tensors shaped like q, k and v (the inputs, or dq, dk, dv).
struct QKV {
  HostTensor q, k, v;
};

class Problem {
 public:
  explicit Problem(const KernelCase& c)
      : case_(c), shape_(case_.shape), opt_(case_.options), dtype_(c.dtype), rng_(seed(c.name())) {
    const int64_t n = shape_.num_seqs();
    cu_q_.push_back(static_cast<int32_t>(shape_.unused_lead));
    cu_k_.push_back(static_cast<int32_t>(shape_.unused_lead));
    for (int64_t b = 0; b < n; ++b) {
      cu_q_.push_back(cu_q_.back() + static_cast<int32_t>(shape_.len_q(b)));
      cu_k_.push_back(cu_k_.back() + static_cast<int32_t>(shape_.len_k(b)));
      q_pos_.push_back(position_q(b));
      k_pos_.push_back(position_k(b));
    }
    q_seq_.assign(q_pos_.begin(), q_pos_.end());
    k_seq_.assign(k_pos_.begin(), k_pos_.end());
    make_slopes();
    ref_.heads_q = shape_.heads_q;
    ref_.heads_kv = shape_.heads_kv;
    ref_.head_dim = shape_.head_dim;
    ref_.scale = opt_.softmax_scale ? *opt_.softmax_scale
                                    : static_cast<float>(1.0f / std::sqrt(static_cast<float>(shape_.head_dim)));
    ref_.softcap = opt_.softcap;
    ref_.causal = opt_.causal;
    ref_.window_left = opt_.window_left;
    ref_.window_right = opt_.window_right;

    in_ = make_qkv(dtype_, kNaN);
    dout_ = make_q_like(dtype_, shape_.heads_q, kNaN);
    for (const HostTensor* t : {&in_.q, &in_.k, &in_.v, &dout_}) fill_normal(*t);
    for (int64_t b = 0; b < n; ++b) {
      RefSequence s;
      s.len_q = shape_.len_q(b);
      s.len_k = shape_.len_k(b);
      s.q_pos = q_pos_[b];
      s.k_pos = k_pos_[b];
      if (opt_.alibi != Alibi::kNone)
        for (int64_t h = 0; h < shape_.heads_q; ++h) s.slopes.push_back(slope(b, h));
      s.q = gather(in_.q, cu_q_, b, s.len_q, shape_.heads_q);
      s.k = gather(in_.k, cu_k_, b, s.len_k, shape_.heads_kv);
      s.v = gather(in_.v, cu_k_, b, s.len_k, shape_.heads_kv);
      s.dout = gather(dout_, cu_q_, b, s.len_q, shape_.heads_q);
      seqs_.push_back(std::move(s));
    }
  }

  const KernelCase& kernel_case() const { return case_; }
  const Shape& shape() const { return shape_; }
  const Options& options() const { return opt_; }
  DType dtype() const { return dtype_; }
  const RefOptions& ref() const { return ref_; }
  const std::vector<RefSequence>& seqs() const { return seqs_; }
  const QKV& inputs() const { return in_; }
  const HostTensor& dout() const { return dout_; }
  std::mt19937_64& rng() { return rng_; }

  // The params of a call over all keys.
  AttentionParams params() {
    AttentionParams p;
    p.softmax_scale = opt_.softmax_scale;
    p.causal = opt_.causal;
    p.window_left = opt_.window_left;
    p.window_right = opt_.window_right;
    p.softcap = opt_.softcap;
    p.deterministic = opt_.deterministic;
    p.num_threads = opt_.num_threads;
    p.accumulate = opt_.accumulate;
    p.overwrite_dkdv = opt_.overwrite_dkdv;
    const int64_t n = shape_.num_seqs();
    if (opt_.alibi == Alibi::kPerHead)
      p.alibi_slopes = TensorView(slopes_.data(), DType::kFloat32, Device{}, {shape_.heads_q});
    if (opt_.alibi == Alibi::kPerBatch)
      p.alibi_slopes = TensorView(slopes_.data(), DType::kFloat32, Device{}, {n, shape_.heads_q});
    if (opt_.positions == Positions::kScalar) {
      p.q_offset = opt_.q_offset;
      p.k_offset = opt_.k_offset;
    }
    if (opt_.positions == Positions::kPerSequence) {
      p.q_seq_offsets = TensorView(q_seq_.data(), DType::kInt32, Device{}, {n});
      p.k_seq_offsets = TensorView(k_seq_.data(), DType::kInt32, Device{}, {n});
    }
    if (shape_.packed()) {
      p.cu_seqlens_q = TensorView(cu_q_.data(), DType::kInt32, Device{}, {n + 1});
      p.cu_seqlens_k = TensorView(cu_k_.data(), DType::kInt32, Device{}, {n + 1});
    }
    return p;
  }

  // Fresh tensors in the case's layout.
  QKV make_qkv(DType dtype, double fill) const {
    const int64_t hq = shape_.heads_q, hkv = shape_.heads_kv, dim = shape_.head_dim;
    if (opt_.layout != Layout::kQkvPacked)
      return {make_q_like(dtype, hq, fill), make_k_like(dtype, hkv, fill), make_k_like(dtype, hkv, fill)};
    const bool same_rows = shape_.packed() ? shape_.docs_q == shape_.docs_k : shape_.seqlen_q == shape_.seqlen_k;
    const std::vector<int64_t> lead_k =
        shape_.packed() ? std::vector<int64_t>{shape_.total_k()} : std::vector<int64_t>{shape_.batch, shape_.seqlen_k};
    const int h = static_cast<int>(lead_k.size());  // index of the head dimension
    if (same_rows) {  // (..., Hq + 2 Hkv, D), sliced along the heads
      std::vector<int64_t> shape = lead_k;
      shape.insert(shape.end(), {hq + 2 * hkv, dim});
      const HostTensor all = HostTensor::empty(dtype, shape, fill);
      return {all.slice(h, 0, hq), all.slice(h, hq, hkv), all.slice(h, hq + hkv, hkv)};
    }
    std::vector<int64_t> shape = lead_k;  // q alone; k and v from (..., 2, Hkv, D)
    shape.insert(shape.end(), {2, hkv, dim});
    const HostTensor kv = HostTensor::empty(dtype, shape, fill);
    std::vector<int64_t> kv_shape = lead_k, kv_strides(kv.strides().begin(), kv.strides().begin() + h);
    kv_shape.insert(kv_shape.end(), {hkv, dim});
    kv_strides.insert(kv_strides.end(), {dim, 1});
    return {make_q_like(dtype, hq, fill), HostTensor(kv.storage(), kv_shape, kv_strides, 0),
            HostTensor(kv.storage(), kv_shape, kv_strides, hkv * dim)};
  }

  HostTensor make_q_like(DType dtype, int64_t heads, double fill) const {
    return make_rows(dtype, shape_.packed() ? shape_.total_q() : shape_.seqlen_q, heads, fill);
  }
  HostTensor make_k_like(DType dtype, int64_t heads, double fill) const {
    return make_rows(dtype, shape_.packed() ? shape_.total_k() : shape_.seqlen_k, heads, fill);
  }

  // lse: (B, Hq, Sq), or (Hq, T) when packed; fp32.
  HostTensor make_lse(double fill) const {
    const int64_t hq = shape_.heads_q;
    if (shape_.packed()) {
      const int64_t t = shape_.total_q();
      if (opt_.layout == Layout::kStrided) return HostTensor::strided(DType::kFloat32, {hq, t}, {t + kRowGap, 1}, fill);
      return HostTensor::empty(DType::kFloat32, {hq, t}, fill);
    }
    const int64_t b = shape_.batch, s = shape_.seqlen_q;
    if (opt_.layout == Layout::kStrided)
      return HostTensor::strided(DType::kFloat32, {b, hq, s}, {hq * (s + kRowGap) + kSeqGap, s + kRowGap, 1}, fill);
    return HostTensor::empty(DType::kFloat32, {b, hq, s}, fill);
  }

  // Rows [0, len) of sequence b of a q- or k-like tensor as (len, H, D) doubles.
  std::vector<double> gather(const HostTensor& t, const std::vector<int32_t>& cu, int64_t b, int64_t len,
                             int64_t heads) const {
    std::vector<double> x;
    x.reserve(len * heads * shape_.head_dim);
    for (int64_t i = 0; i < len; ++i)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < shape_.head_dim; ++d) x.push_back(t.at_element(row_element(t, cu, b, i, h, d)));
    return x;
  }
  std::vector<double> gather_q(const HostTensor& t, int64_t b, int64_t heads) const {
    return gather(t, cu_q_, b, shape_.len_q(b), heads);
  }
  std::vector<double> gather_k(const HostTensor& t, int64_t b, int64_t heads) const {
    return gather(t, cu_k_, b, shape_.len_k(b), heads);
  }

  // Writes (len, H, D) values into rows of sequence b.
  void scatter_q(const HostTensor& t, int64_t b, const std::vector<double>& x) const {
    size_t e = 0;
    for (int64_t i = 0; i < shape_.len_q(b); ++i)
      for (int64_t h = 0; h < shape_.heads_q; ++h)
        for (int64_t d = 0; d < shape_.head_dim; ++d) t.set_element(row_element(t, cu_q_, b, i, h, d), x[e++]);
  }

  // lse of sequence b as (Hq, len_q).
  std::vector<double> gather_lse(const HostTensor& lse, int64_t b) const {
    std::vector<double> x;
    for (int64_t h = 0; h < shape_.heads_q; ++h)
      for (int64_t i = 0; i < shape_.len_q(b); ++i) x.push_back(lse.at_element(lse_element(lse, b, h, i)));
    return x;
  }
  void scatter_lse(const HostTensor& lse, int64_t b, const std::vector<double>& x) const {
    size_t e = 0;
    for (int64_t h = 0; h < shape_.heads_q; ++h)
      for (int64_t i = 0; i < shape_.len_q(b); ++i) lse.set_element(lse_element(lse, b, h, i), x[e++]);
  }

  // Per element of the concatenated per-sequence vectors: is it masked out entirely (a query row
  // that sees no key, or a key that no query sees)? For (len, H, D) rows or (H, len) lse.
  std::vector<bool> masked_rows(bool keys, int64_t heads, bool lse) const {
    std::vector<bool> m;
    for (const RefSequence& seq : seqs_) {
      const RefVisibility vis = reference_visibility(ref_, seq);
      const std::vector<bool>& live = keys ? vis.key_is_seen : vis.row_sees_keys;
      const int64_t len = static_cast<int64_t>(live.size());
      if (lse) {
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < len; ++i) m.push_back(!live[i]);
      } else {
        for (int64_t i = 0; i < len; ++i) m.insert(m.end(), heads * shape_.head_dim, !live[i]);
      }
    }
    return m;
  }

  // Global positions of the rows of sequence b.
  int64_t q_pos(int64_t b) const { return q_pos_[b]; }
  int64_t k_pos(int64_t b) const { return k_pos_[b]; }
  const std::vector<int32_t>& cu_k() const { return cu_k_; }

  // Names flat element e of the concatenated per-sequence (len, H, D) vectors ("rows") or
  // (H, len) vectors (lse).
  std::function<std::string(size_t)> where(bool keys, int64_t heads, bool lse) const {
    return [this, keys, heads, lse](size_t e) {
      int64_t rest = static_cast<int64_t>(e);
      for (int64_t b = 0; b < shape_.num_seqs(); ++b) {
        const int64_t len = keys ? shape_.len_k(b) : shape_.len_q(b);
        const int64_t size = len * heads * (lse ? 1 : shape_.head_dim);
        if (rest < size) {
          const char* row = keys ? "j" : "i";
          if (lse)
            return "(b=" + std::to_string(b) + ", h=" + std::to_string(rest / len) + ", " + row + "=" +
                   std::to_string(rest % len) + ")";
          const int64_t dim = shape_.head_dim;
          return "(b=" + std::to_string(b) + ", " + row + "=" + std::to_string(rest / (heads * dim)) +
                 ", h=" + std::to_string(rest / dim % heads) + ", d=" + std::to_string(rest % dim) + ")";
        }
        rest -= size;
      }
      return std::string("(out of range)");
    };
  }

 private:
  static uint64_t seed(const std::string& name) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across standard libraries
    for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
    return h;
  }

  int64_t position_q(int64_t b) const {
    const int64_t bottom_right = shape_.len_k(b) - shape_.len_q(b);
    switch (opt_.positions) {
      case Positions::kScalar: return opt_.q_offset;
      case Positions::kPerSequence: return position_k(b) + bottom_right + kSeqQueryShift[b % 3];
      default: return bottom_right;
    }
  }
  int64_t position_k(int64_t b) const {
    switch (opt_.positions) {
      case Positions::kScalar: return opt_.k_offset;
      case Positions::kPerSequence: return kSeqKeyStride * b + kSeqKeyBase;
      default: return 0;
    }
  }

  void make_slopes() {
    const int64_t hq = shape_.heads_q;
    const int64_t rows = opt_.alibi == Alibi::kPerBatch ? shape_.num_seqs() : 1;
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < hq; ++h)  // the ALiBi paper's geometric slopes, varied per sequence
        slopes_.push_back(static_cast<float>(std::exp2(-8.0 * (h + 1) / hq) * (1.0 + 0.25 * b)));
  }
  double slope(int64_t b, int64_t h) const {
    return slopes_[(opt_.alibi == Alibi::kPerBatch ? b * shape_.heads_q : 0) + h];
  }

  HostTensor make_rows(DType dtype, int64_t rows, int64_t heads, double fill) const {
    const int64_t dim = shape_.head_dim;
    std::vector<int64_t> shape = shape_.packed() ? std::vector<int64_t>{rows, heads, dim}
                                                 : std::vector<int64_t>{shape_.batch, rows, heads, dim};
    if (opt_.layout != Layout::kStrided) return HostTensor::empty(dtype, shape, fill);
    const int64_t head = dim + kHeadGap, row = heads * head + kRowGap;
    std::vector<int64_t> strides = shape_.packed() ? std::vector<int64_t>{row, head, 1}
                                                   : std::vector<int64_t>{rows * row + kSeqGap, row, head, 1};
    return HostTensor::strided(dtype, shape, strides, fill);
  }

  int64_t row_element(const HostTensor& t, const std::vector<int32_t>& cu, int64_t b, int64_t i, int64_t h,
                      int64_t d) const {
    return shape_.packed() ? t.element({cu[b] + i, h, d}) : t.element({b, i, h, d});
  }
  int64_t lse_element(const HostTensor& lse, int64_t b, int64_t h, int64_t i) const {
    return shape_.packed() ? lse.element({h, cu_q_[b] + i}) : lse.element({b, h, i});
  }

  void fill_normal(const HostTensor& t) {
    std::normal_distribution<double> normal(0.0, 1.0);
    t.for_each_element([&](int64_t e) { t.set_element(e, normal(rng_)); });
  }

  KernelCase case_;
  const Shape& shape_;
  const Options& opt_;
  DType dtype_;
  std::mt19937_64 rng_;
  std::vector<int32_t> cu_q_, cu_k_;
  std::vector<int64_t> q_pos_, k_pos_;
  std::vector<int32_t> q_seq_, k_seq_;
  std::vector<float> slopes_;
  RefOptions ref_;
  QKV in_;
  HostTensor dout_;
  std::vector<RefSequence> seqs_;
};

// gtest prints a case by its name.
inline void PrintTo(const KernelCase& c, std::ostream* os) { *os << c.name(); }

// Concatenation of per-sequence vectors.
inline std::vector<double> concat(const std::vector<std::vector<double>>& parts) {
  std::vector<double> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

inline void expect_pass(const std::string& name, const std::vector<double>& got, const std::vector<double>& want,
                        const std::vector<double>& naive, const std::vector<bool>& masked, DType dtype,
                        Quantity what, const std::function<std::string(size_t)>& where) {
  const CheckResult r = check_pass_rule(name, got, want, naive, masked, dtype, what, where);
  EXPECT_TRUE(r.ok) << r.message;
  if (std::getenv("RINGFLASH_TEST_VERBOSE"))  // the margins, for tuning the tolerance table
    std::printf("  %-16s error %.3g  naive %.3g  tolerance %.3g  (%.0f%% of it)\n", name.c_str(), r.error,
                r.naive_error, r.tolerance, 100 * r.error / r.tolerance);
}

// Guards for the storages behind `views`, one per distinct storage.
inline std::vector<OutsideGuard> guard_outside(const std::vector<const HostTensor*>& views) {
  std::vector<OutsideGuard> guards;
  std::vector<const HostTensor*> done;
  for (const HostTensor* t : views) {
    bool seen = false;
    for (const HostTensor* d : done) seen = seen || d->storage() == t->storage();
    if (seen) continue;
    std::vector<const HostTensor*> same;
    for (const HostTensor* u : views)
      if (u->storage() == t->storage()) same.push_back(u);
    guards.emplace_back(same);
    done.push_back(t);
  }
  return guards;
}

inline void expect_untouched(const std::vector<OutsideGuard>& guards, const char* name) {
  for (const OutsideGuard& guard : guards) {
    const int64_t e = guard.first_changed();
    EXPECT_EQ(e, -1) << name << ": the call wrote outside its tensors, at storage element " << e;
  }
}

// The bytes of the storages behind some tensors, to prove that a call did not write its inputs.
class InputSnapshot {
 public:
  explicit InputSnapshot(const std::vector<const HostTensor*>& inputs) {
    for (const HostTensor* t : inputs) saved_.push_back({t->storage(), t->storage()->bytes});
  }
  bool unchanged() const {
    for (const auto& [storage, bytes] : saved_)
      if (storage->bytes != bytes) return false;
    return true;
  }

 private:
  std::vector<std::pair<std::shared_ptr<Storage>, std::vector<unsigned char>>> saved_;
};

// Calls `fn`; a NotSupported error fails the test with the reason instead of crashing the suite.
template <typename Fn>
bool call_library(const char* what, Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const Error& e) {
    ADD_FAILURE() << what << " threw " << e.what();
    return false;
  }
}

// reference_forward / reference_backward, compiled in reference_oracle.cpp.
RefForward oracle_forward(const RefOptions& o, const RefSequence& s, const Precision& p = Precision::float64());
RefGrads oracle_backward(const RefOptions& o, const RefSequence& s, const std::vector<double>& out,
                         const std::vector<double>& lse, const Precision& p = Precision::float64());

void run_forward_case(const KernelCase& c);
void run_backward_case(const KernelCase& c);

}  // namespace ringflash::test
