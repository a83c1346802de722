#include "harness.h"

#include <algorithm>
#include <cstring>

namespace ringflash::test {
namespace {

// Accumulate-mode backward: dq, dk and dv start from these values (a function of the storage
// element, so that two runs and the check agree). Multiples of 2^-10 in [-1, 1): exact in fp32.
double prefill(int64_t element) {
  constexpr int64_t kMultiplier = 2654435761;
  constexpr int64_t kLevels = 2048;
  return static_cast<double>((element * kMultiplier) % kLevels - kLevels / 2) / (kLevels / 2);
}

bool any_masked_row(const std::vector<double>& lse) {
  return std::any_of(lse.begin(), lse.end(), [](double x) { return std::isinf(x); });
}

// The reference of a forward case, float64 and naive in the test dtype.
struct ForwardRefs {
  std::vector<double> out, lse, naive_out, naive_lse;
};

ForwardRefs forward_refs(const Problem& pb, DType out_dtype) {
  std::vector<std::vector<double>> out, lse, naive_out, naive_lse;
  for (const RefSequence& s : pb.seqs()) {
    RefForward exact = oracle_forward(pb.ref(), s);
    RefForward naive = oracle_forward(pb.ref(), s, Precision::naive(pb.dtype(), out_dtype, out_dtype));
    out.push_back(std::move(exact.out));
    lse.push_back(std::move(exact.lse));
    naive_out.push_back(std::move(naive.out));
    naive_lse.push_back(std::move(naive.lse));
  }
  return {concat(out), concat(lse), concat(naive_out), concat(naive_lse)};
}

void check_forward(const Problem& pb, const ForwardRefs& refs, const HostTensor& out, const HostTensor& lse,
                   const std::string& label) {
  std::vector<std::vector<double>> got_out, got_lse;
  for (int64_t b = 0; b < pb.shape().num_seqs(); ++b) {
    got_out.push_back(pb.gather_q(out, b, pb.shape().heads_q));
    got_lse.push_back(pb.gather_lse(lse, b));
  }
  const int64_t hq = pb.shape().heads_q;
  expect_pass(label + "out", concat(got_out), refs.out, refs.naive_out, pb.masked_rows(false, hq, false), pb.dtype(),
              Quantity::kOut, pb.where(false, hq, false));
  expect_pass(label + "lse", concat(got_lse), refs.lse, refs.naive_lse, pb.masked_rows(false, hq, true), pb.dtype(),
              Quantity::kLse, pb.where(false, hq, true));
}

// Keys [start, start + len) of every sequence of a packed k-like tensor, as a new packed tensor.
HostTensor packed_key_rows(const Problem& pb, const HostTensor& t, const std::vector<int64_t>& start,
                           const std::vector<int64_t>& len, std::vector<int32_t>& cu) {
  const Shape& s = pb.shape();
  cu.assign(1, 0);
  for (int64_t b = 0; b < s.num_seqs(); ++b) cu.push_back(cu.back() + static_cast<int32_t>(len[b]));
  HostTensor half = HostTensor::empty(t.dtype(), {cu.back(), s.heads_kv, s.head_dim});
  for (int64_t b = 0; b < s.num_seqs(); ++b) {
    const std::vector<double> rows = pb.gather_k(t, b, s.heads_kv);
    const int64_t width = s.heads_kv * s.head_dim;
    for (int64_t j = 0; j < len[b]; ++j)
      for (int64_t e = 0; e < width; ++e)
        half.set({cu[b] + j, e / s.head_dim, e % s.head_dim}, rows[(start[b] + j) * width + e]);
  }
  return half;
}

// Forward in accumulate mode over the keys [start, start + len) of every sequence, merged into
// (out, lse), or written to them with `overwrite`; with `final`, the merged out goes there instead.
bool forward_key_block(Problem& pb, const std::vector<int64_t>& start, const std::vector<int64_t>& len,
                       const HostTensor& out, const HostTensor& lse, bool overwrite, const HostTensor* final) {
  const Shape& s = pb.shape();
  const Options& o = pb.options();
  const int64_t n = s.num_seqs();
  AttentionParams p = pb.params();
  p.overwrite_out = overwrite;
  if (final) p.final_out = final->view();
  // Queries keep the positions they have against all keys; the default bottom-right would move.
  std::vector<int32_t> q_seq(n), k_seq(n), cu_k;
  for (int64_t b = 0; b < n; ++b) {
    q_seq[b] = static_cast<int32_t>(pb.q_pos(b));
    k_seq[b] = static_cast<int32_t>(pb.k_pos(b) + start[b]);
  }
  HostTensor k, v;
  if (s.packed()) {
    k = packed_key_rows(pb, pb.inputs().k, start, len, cu_k);
    v = packed_key_rows(pb, pb.inputs().v, start, len, cu_k);
    p.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, Device{}, {n + 1});
  } else {
    k = pb.inputs().k.slice(1, start[0], len[0]);  // (B, Sk, Hkv, D) -> (B, len, Hkv, D)
    v = pb.inputs().v.slice(1, start[0], len[0]);
  }
  if (s.packed() || o.positions == Positions::kPerSequence) {
    p.q_seq_offsets = TensorView(q_seq.data(), DType::kInt32, Device{}, {n});
    p.k_seq_offsets = TensorView(k_seq.data(), DType::kInt32, Device{}, {n});
  } else {
    p.q_offset = pb.q_pos(0);
    p.k_offset = pb.k_pos(0) + start[0];
  }
  const QKV& in = pb.inputs();
  return call_library("attention_forward (accumulate)", [&] {
    attention_forward(in.q.view(), k.view(), v.view(), out.view(), lse.view(), p);
  });
}

}  // namespace

void run_forward_case(const KernelCase& c) {
  Problem pb(c);
  const Shape& s = pb.shape();
  const Options& o = pb.options();
  const QKV& in = pb.inputs();
  const int64_t hq = s.heads_q;
  const DType out_dtype = o.accumulate ? DType::kFloat32 : c.dtype;
  const ForwardRefs refs = forward_refs(pb, out_dtype);
  if (o.masks_rows && s.total_q() + s.seqlen_q > 0) {
    ASSERT_TRUE(any_masked_row(refs.lse)) << "the case should have a query that sees no key";
  }
  const InputSnapshot inputs({&in.q, &in.k, &in.v});

  if (!o.accumulate) {
    const HostTensor out = pb.make_q_like(out_dtype, hq, kNaN);  // NaN: every element must be written
    const HostTensor lse = pb.make_lse(kNaN);
    const auto guards = guard_outside({&out, &lse});
    const AttentionParams p = pb.params();
    if (!call_library("attention_forward",
                      [&] { attention_forward(in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view(), p); }))
      return;
    check_forward(pb, refs, out, lse, "");
    expect_untouched(guards, "out/lse");
    EXPECT_TRUE(inputs.unchanged()) << "attention_forward wrote into q, k or v";
    return;
  }

  // Accumulate mode: one call over all keys into an empty accumulator (out = 0, lse = -inf), or
  // with overwrite_out into one of NaN (every element must be written) ...
  const double start_out = o.overwrite_out ? kNaN : 0.0, start_lse = o.overwrite_out ? kNaN : -kInf;
  {
    const HostTensor out = pb.make_q_like(DType::kFloat32, hq, start_out);
    const HostTensor lse = pb.make_lse(start_lse);
    const auto guards = guard_outside({&out, &lse});
    AttentionParams p = pb.params();
    p.overwrite_out = o.overwrite_out;
    if (!call_library("attention_forward (accumulate)",
                      [&] { attention_forward(in.q.view(), in.k.view(), in.v.view(), out.view(), lse.view(), p); }))
      return;
    check_forward(pb, refs, out, lse, "one call: ");
    expect_untouched(guards, "out/lse");
  }
  // ... and two calls, each over one half of the keys, merged into it in turn (the first written
  // with overwrite_out; with final_out, the second rounds the result into a tensor of q's dtype
  // and leaves out as the first left it).
  const int64_t n = s.num_seqs();
  std::vector<int64_t> start_a(n, 0), len_a(n), start_b(n), len_b(n);
  for (int64_t b = 0; b < n; ++b) {
    len_a[b] = s.len_k(b) / 2;
    start_b[b] = len_a[b];
    len_b[b] = s.len_k(b) - len_a[b];
  }
  const HostTensor out = pb.make_q_like(DType::kFloat32, hq, start_out);
  const HostTensor lse = pb.make_lse(start_lse);
  const HostTensor final = pb.make_q_like(c.dtype, hq, kNaN);
  const auto guards = guard_outside({&out, &lse, &final});
  if (!forward_key_block(pb, start_a, len_a, out, lse, o.overwrite_out, nullptr)) return;
  const auto first_out = out.storage()->bytes;
  if (!forward_key_block(pb, start_b, len_b, out, lse, false, o.final_out ? &final : nullptr)) return;
  if (o.final_out) {
    check_forward(pb, forward_refs(pb, c.dtype), final, lse, "two halves, final_out: ");
    EXPECT_TRUE(out.storage()->bytes == first_out) << "a call with final_out wrote into out";
  } else {
    check_forward(pb, refs, out, lse, "two halves: ");
  }
  expect_untouched(guards, "out/lse/final_out");
  EXPECT_TRUE(inputs.unchanged()) << "attention_forward wrote into q, k or v";
}

void run_backward_case(const KernelCase& c) {
  Problem pb(c);
  const Shape& s = pb.shape();
  const Options& o = pb.options();
  const QKV& in = pb.inputs();
  const int64_t hq = s.heads_q, hkv = s.heads_kv;
  // In accumulate mode the forward result is the fp32 one a ring merged, and gradients add up in fp32.
  const DType out_dtype = o.accumulate || o.fp32_out ? DType::kFloat32 : c.dtype;
  const DType grad_dtype = o.accumulate ? DType::kFloat32 : c.dtype;

  // The kernel gets the exact forward result rounded to out's dtype (and lse to fp32); the naive
  // reference starts from the same rounded values.
  const HostTensor out = pb.make_q_like(out_dtype, hq, kNaN);
  const HostTensor lse = pb.make_lse(kNaN);
  std::vector<std::vector<double>> dq, dk, dv, naive_dq, naive_dk, naive_dv, all_lse;
  for (int64_t b = 0; b < s.num_seqs(); ++b) {
    const RefSequence& seq = pb.seqs()[b];
    const RefForward f = oracle_forward(pb.ref(), seq);
    std::vector<double> given_out = f.out, given_lse = f.lse;
    for (double& x : given_out) x = round_to(out_dtype, x);
    for (double& x : given_lse) x = round_to(DType::kFloat32, x);
    pb.scatter_q(out, b, given_out);
    pb.scatter_lse(lse, b, given_lse);
    RefGrads exact = oracle_backward(pb.ref(), seq, f.out, f.lse);
    RefGrads naive = oracle_backward(pb.ref(), seq, given_out, given_lse,
                                        Precision::naive(c.dtype, out_dtype, grad_dtype));
    dq.push_back(std::move(exact.dq));
    dk.push_back(std::move(exact.dk));
    dv.push_back(std::move(exact.dv));
    naive_dq.push_back(std::move(naive.dq));
    naive_dk.push_back(std::move(naive.dk));
    naive_dv.push_back(std::move(naive.dv));
    all_lse.push_back(f.lse);
  }
  if (o.masks_rows && s.total_q() + s.seqlen_q > 0) {
    ASSERT_TRUE(any_masked_row(concat(all_lse))) << "the case should have a query that sees no key";
  }
  const InputSnapshot inputs({&in.q, &in.k, &in.v, &out, &pb.dout(), &lse});

  // dq, dk, dv: NaN (every element must be written), or the prefill where accumulate mode adds
  // (dq; dk and dv unless overwrite_dkdv).
  const auto adds = [&](const HostTensor* t, const QKV& grads) {
    return o.accumulate && (t == &grads.q || !o.overwrite_dkdv);
  };
  auto run = [&](QKV& grads) {
    grads = pb.make_qkv(grad_dtype, kNaN);
    for (const HostTensor* t : {&grads.q, &grads.k, &grads.v})
      if (adds(t, grads)) t->for_each_element([&](int64_t e) { t->set_element(e, prefill(e)); });
    const auto guards = guard_outside({&grads.q, &grads.k, &grads.v});
    const AttentionParams p = pb.params();
    const bool ok = call_library("attention_backward", [&] {
      attention_backward(in.q.view(), in.k.view(), in.v.view(), out.view(), pb.dout().view(), lse.view(),
                         grads.q.view(), grads.k.view(), grads.v.view(), p);
    });
    if (ok) expect_untouched(guards, "dq/dk/dv");
    return ok;
  };
  QKV grads;
  if (!run(grads)) return;
  EXPECT_TRUE(inputs.unchanged()) << "attention_backward wrote into one of its inputs";

  // The gradients the kernel computed, less the prefill, in float64 (same layout).
  QKV copy = pb.make_qkv(DType::kFloat64, kNaN);
  for (auto [src, dst] : {std::pair{&grads.q, &copy.q}, {&grads.k, &copy.k}, {&grads.v, &copy.v}}) {
    std::vector<int64_t> from, to;
    src->for_each_element([&](int64_t e) { from.push_back(e); });
    dst->for_each_element([&](int64_t e) { to.push_back(e); });
    const bool added = adds(src, grads);
    for (size_t e = 0; e < from.size(); ++e) {
      const double x = src->at_element(from[e]);
      dst->set_element(to[e], added ? x - prefill(from[e]) : x);
    }
  }
  auto read = [&](const HostTensor& t, bool keys, int64_t heads) {
    std::vector<std::vector<double>> parts;
    for (int64_t b = 0; b < s.num_seqs(); ++b)
      parts.push_back(keys ? pb.gather_k(t, b, heads) : pb.gather_q(t, b, heads));
    return concat(parts);
  };
  expect_pass("dq", read(copy.q, false, hq), concat(dq), concat(naive_dq), pb.masked_rows(false, hq, false), c.dtype,
              Quantity::kGrad, pb.where(false, hq, false));
  expect_pass("dk", read(copy.k, true, hkv), concat(dk), concat(naive_dk), pb.masked_rows(true, hkv, false), c.dtype,
              Quantity::kGrad, pb.where(true, hkv, false));
  expect_pass("dv", read(copy.v, true, hkv), concat(dv), concat(naive_dv), pb.masked_rows(true, hkv, false), c.dtype,
              Quantity::kGrad, pb.where(true, hkv, false));

  if (o.deterministic) {
    QKV again;
    if (!run(again)) return;
    for (auto [a, b, name] : {std::tuple{&grads.q, &again.q, "dq"}, {&grads.k, &again.k, "dk"},
                              {&grads.v, &again.v, "dv"}})
      EXPECT_TRUE(a->storage()->bytes == b->storage()->bytes)
          << name << " differs between two deterministic runs";
  }
}

}  // namespace ringflash::test
