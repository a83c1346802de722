// Entry points of single-device attention: validate once, build AttentionArgs, dispatch.
#include "ringflash/attention.h"

#include <cmath>
#include <vector>

#include "../kernels/cpu/attention_cpu.h"
#include "backends.h"
#include "check.h"
#include "thread_pool.h"

namespace ringflash {
namespace {

using core::AttentionArgs;
using core::str_cat;

constexpr int64_t kMaxOffset = int64_t{1} << 40;

// Validates the tensors and options shared by forward and backward and fills everything in
// AttentionArgs but the output operands.
class Validator {
 public:
  Validator(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
            const AttentionParams& p)
      : op_(op), q_(q), k_(k), v_(v), p_(p) {}

  AttentionArgs run() {
    check_options();
    check_qkv();
    check_packing();
    check_positions();
    check_alibi();
    fill_operands();
    args_.device = q_.device().type == DeviceType::kCUDA ? q_.device().index : -1;
    return args_;
  }

  // Which dtypes a tensor shaped like q, k or v may have.
  enum class DTypeRule {
    kSame,        // the dtype of the tensor it is shaped like
    kAccumulate,  // fp32 in accumulate mode, else the dtype of the tensor it is shaped like
    kSameOrFp32,  // either
  };

  // A tensor with the shape of `like`, D contiguous, not aliasing q, k or v (an empty tensor holds
  // no memory, so it aliases nothing).
  AttentionArgs::Operand like(const TensorView& t, const char* name, const TensorView& ref,
                              DTypeRule rule) const {
    same_device(t, name);
    RINGFLASH_CHECK(t.ndim() == ref.ndim() && same_shape(t, ref), InvalidArgument, "[", op_, "] ", name,
                    " must have shape ", ref.shape_string(), ", got ", t.shape_string());
    const DType want = rule == DTypeRule::kAccumulate && p_.accumulate ? DType::kFloat32 : ref.dtype();
    const bool ok = t.dtype() == want || (rule == DTypeRule::kSameOrFp32 && t.dtype() == DType::kFloat32);
    RINGFLASH_CHECK(ok, InvalidArgument, "[", op_, "] ", name, " must have dtype ", dtype_name(want),
                    rule == DTypeRule::kSameOrFp32 ? " or float32" : "",
                    rule == DTypeRule::kAccumulate && p_.accumulate ? " (accumulate mode)" : "", ", got ",
                    dtype_name(t.dtype()));
    RINGFLASH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0, InvalidArgument, "[", op_, "] ", name,
                    " must be contiguous in its last dimension (head_dim), got stride ", t.stride(-1));
    for (const TensorView* in : {&q_, &k_, &v_})
      RINGFLASH_CHECK(t.data() != in->data() || t.numel() == 0 || in->numel() == 0, InvalidArgument, "[", op_, "] ",
                      name, " must not alias q, k or v");
    return operand(t);
  }

  void check_lse(const TensorView& lse, AttentionArgs& a) const {
    same_device(lse, "lse");
    const bool packed = a.cu_seqlens_q != nullptr;
    const std::string want = packed ? str_cat("(", a.heads_q, ", ", q_.size(0), ")")
                                    : str_cat("(", a.batch, ", ", a.heads_q, ", ", a.seqlen_q, ")");
    const bool ok = packed ? lse.ndim() == 2 && lse.size(0) == a.heads_q && lse.size(1) == q_.size(0)
                           : lse.ndim() == 3 && lse.size(0) == a.batch && lse.size(1) == a.heads_q &&
                                 lse.size(2) == a.seqlen_q;
    RINGFLASH_CHECK(ok, InvalidArgument, "[", op_, "] lse must have shape ", want, ", got ", lse.shape_string());
    RINGFLASH_CHECK(lse.dtype() == DType::kFloat32, InvalidArgument, "[", op_,
                    "] lse must have dtype float32, got ", dtype_name(lse.dtype()));
    RINGFLASH_CHECK(lse.stride(-1) == 1 || lse.size(-1) <= 1, InvalidArgument, "[", op_,
                    "] lse must be contiguous in its last dimension, got stride ", lse.stride(-1));
    a.lse = lse.data_as<float>();
    a.lse_batch_stride = packed ? 0 : lse.stride(0);
    a.lse_head_stride = lse.stride(packed ? 0 : 1);
  }

  void same_device(const TensorView& t, const char* name) const {
    RINGFLASH_CHECK(t.device() == q_.device(), InvalidArgument, "[", op_, "] ", name, " must be on ",
                    device_name(q_.device()), " like q, got ", device_name(t.device()));
  }

 private:
  static bool same_shape(const TensorView& a, const TensorView& b) {
    for (int d = 0; d < a.ndim(); ++d)
      if (a.size(d) != b.size(d)) return false;
    return true;
  }

  AttentionArgs::Operand operand(const TensorView& t) const {
    AttentionArgs::Operand o;
    o.data = t.data();
    const bool packed = t.ndim() == 3;
    o.batch_stride = packed ? 0 : t.stride(0);
    o.row_stride = t.stride(packed ? 0 : 1);
    o.head_stride = t.stride(packed ? 1 : 2);
    return o;
  }

  void check_options() {
    const float scale = p_.softmax_scale.value_or(1.0f);
    RINGFLASH_CHECK(std::isfinite(scale), InvalidArgument, "[", op_, "] softmax_scale must be finite, got ", scale);
    RINGFLASH_CHECK(std::isfinite(p_.softcap) && p_.softcap >= 0.0f, InvalidArgument, "[", op_,
                    "] softcap must be finite and >= 0 (0 turns it off), got ", p_.softcap);
    RINGFLASH_CHECK(p_.window_left >= -1, InvalidArgument, "[", op_,
                    "] window_left must be >= 0, or -1 for unbounded, got ", p_.window_left);
    RINGFLASH_CHECK(p_.window_right >= -1, InvalidArgument, "[", op_,
                    "] window_right must be >= 0, or -1 for unbounded, got ", p_.window_right);
    RINGFLASH_CHECK(std::isfinite(p_.dropout_p) && p_.dropout_p >= 0.0f && p_.dropout_p < 1.0f, InvalidArgument,
                    "[", op_, "] dropout_p must be in [0, 1), got ", p_.dropout_p);
    RINGFLASH_CHECK(p_.dropout_p == 0.0f, NotSupported, "[", op_, "] dropout_p > 0 is not supported yet, got ",
                    p_.dropout_p);
    RINGFLASH_CHECK(p_.num_threads >= 0, InvalidArgument, "[", op_,
                    "] num_threads must be >= 0 (0 means every core), got ", p_.num_threads);
  }

  void check_qkv() {
    const bool packed = p_.cu_seqlens_q.has_value() || p_.cu_seqlens_k.has_value();
    const int rank = packed ? 3 : 4;
    const char* layout = packed ? "(T, H, D)" : "(B, S, H, D)";
    for (auto [t, name] : {std::pair{&q_, "q"}, {&k_, "k"}, {&v_, "v"}}) {
      RINGFLASH_CHECK(t->ndim() == rank, InvalidArgument, "[", op_, "] ", name, " must have shape ", layout,
                      packed ? " (packed batch: cu_seqlens given)" : "", ", got ", t->shape_string());
      RINGFLASH_CHECK(is_float(t->dtype()), InvalidArgument, "[", op_, "] ", name,
                      " must have dtype float32, float16 or bfloat16, got ", dtype_name(t->dtype()));
      RINGFLASH_CHECK(t->dtype() == q_.dtype(), InvalidArgument, "[", op_, "] ", name, " must have q's dtype ",
                      dtype_name(q_.dtype()), ", got ", dtype_name(t->dtype()));
      same_device(*t, name);
      RINGFLASH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1, InvalidArgument, "[", op_, "] ", name,
                      " must be contiguous in its last dimension (head_dim), got stride ", t->stride(-1));
    }
    const int h = packed ? 1 : 2;
    RINGFLASH_CHECK(k_.ndim() == v_.ndim() && same_shape(k_, v_), InvalidArgument, "[", op_,
                    "] v must have k's shape ", k_.shape_string(), ", got ", v_.shape_string());
    if (!packed)
      RINGFLASH_CHECK(k_.size(0) == q_.size(0), InvalidArgument, "[", op_, "] k must have q's batch size ",
                      q_.size(0), ", got ", k_.shape_string());
    RINGFLASH_CHECK(k_.size(-1) == q_.size(-1), InvalidArgument, "[", op_, "] k must have q's head_dim ",
                    q_.size(-1), ", got ", k_.shape_string());
    RINGFLASH_CHECK(q_.size(-1) > 0, InvalidArgument, "[", op_, "] head_dim must be > 0, got ",
                    q_.shape_string());
    const int64_t hq = q_.size(h), hkv = k_.size(h);
    RINGFLASH_CHECK(hkv > 0 && hq % hkv == 0, InvalidArgument, "[", op_,
                    "] the number of q heads must be a multiple of the number of k/v heads, got ", hq,
                    " q heads and ", hkv, " k/v heads");
    const DeviceType dev = q_.device().type;
    if (dev == DeviceType::kCUDA)
      RINGFLASH_CHECK(q_.dtype() != DType::kFloat32, NotSupported, "[", op_,
                      "] float32 is supported on CPU only; use float16 or bfloat16 on CUDA");
    args_.dtype = q_.dtype();
    args_.heads_q = hq;
    args_.heads_kv = hkv;
    args_.head_dim = q_.size(-1);
    args_.batch = packed ? 0 : q_.size(0);
    args_.seqlen_q = packed ? 0 : q_.size(1);
    args_.seqlen_k = packed ? 0 : k_.size(1);
    args_.rows_q = q_.size(packed ? 0 : 1);
    args_.rows_k = k_.size(packed ? 0 : 1);
  }

  // An int32 vector argument, checked for dtype, rank, length and device.
  const int32_t* host_int32(const TensorView& t, const char* name, int64_t length) const {
    RINGFLASH_CHECK(t.dtype() == DType::kInt32, InvalidArgument, "[", op_, "] ", name,
                    " must have dtype int32, got ", dtype_name(t.dtype()));
    RINGFLASH_CHECK(t.ndim() == 1 && t.size(0) == length, InvalidArgument, "[", op_, "] ", name,
                    " must have shape (", length, ",), got ", t.shape_string());
    RINGFLASH_CHECK(t.stride(0) == 1 || length <= 1, InvalidArgument, "[", op_, "] ", name,
                    " must be contiguous, got stride ", t.stride(0));
    // Read where the kernel runs: on the host for CPU tensors, on q's device for CUDA ones.
    RINGFLASH_CHECK(t.device() == q_.device(), InvalidArgument, "[", op_, "] ", name, " must be on ",
                    device_name(q_.device()), " like q, got ", device_name(t.device()));
    return t.data_as<const int32_t>();
  }

  void check_packing() {
    const bool has_q = p_.cu_seqlens_q.has_value(), has_k = p_.cu_seqlens_k.has_value();
    if (!has_q && !has_k) return;
    RINGFLASH_CHECK(has_q && has_k, InvalidArgument, "[", op_,
                    "] cu_seqlens_q and cu_seqlens_k must be given together, got only ",
                    has_q ? "cu_seqlens_q" : "cu_seqlens_k");
    const TensorView& cq = *p_.cu_seqlens_q;
    const TensorView& ck = *p_.cu_seqlens_k;
    RINGFLASH_CHECK(cq.ndim() == 1 && cq.size(0) >= 2, InvalidArgument, "[", op_,
                    "] cu_seqlens_q must have shape (B + 1,) with B >= 1, got ", cq.shape_string());
    const int64_t batch = cq.size(0) - 1;
    args_.batch = batch;
    args_.cu_seqlens_q = host_int32(cq, "cu_seqlens_q", batch + 1);
    args_.cu_seqlens_k = host_int32(ck, "cu_seqlens_k", batch + 1);
    if (q_.device().type != DeviceType::kCPU) return;  // device arrays are checked by the kernel host code
    for (auto [cu, name, total] : {std::tuple{args_.cu_seqlens_q, "cu_seqlens_q", q_.size(0)},
                                   {args_.cu_seqlens_k, "cu_seqlens_k", k_.size(0)}}) {
      RINGFLASH_CHECK(cu[0] >= 0, InvalidArgument, "[", op_, "] ", name, "[0] must be >= 0, got ", cu[0]);
      int64_t longest = 0;
      for (int64_t b = 0; b < batch; ++b) {
        RINGFLASH_CHECK(cu[b + 1] >= cu[b], InvalidArgument, "[", op_, "] ", name,
                        " must be non-decreasing, got ", name, "[", b, "] = ", cu[b], " > ", name, "[",
                        b + 1, "] = ", cu[b + 1]);
        longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
      }
      RINGFLASH_CHECK(cu[batch] <= total, InvalidArgument, "[", op_, "] ", name, " ends at ", cu[batch],
                      ", past the end of the packed tensor of ", total, " tokens");
      (cu == args_.cu_seqlens_q ? args_.seqlen_q : args_.seqlen_k) = longest;
    }
  }

  void check_positions() {
    const int64_t batch = args_.batch;
    if (p_.q_seq_offsets) {
      args_.q_seq_offsets = host_int32(*p_.q_seq_offsets, "q_seq_offsets", batch);
      args_.q_bottom_right = false;
    } else if (p_.q_offset != AttentionParams::kBottomRight) {
      args_.q_offset = p_.q_offset;
      args_.q_bottom_right = false;
    }
    if (p_.k_seq_offsets) args_.k_seq_offsets = host_int32(*p_.k_seq_offsets, "k_seq_offsets", batch);
    args_.k_offset = p_.k_offset;
    // Positions stay far below kUnbounded, so every position difference the kernels form is exact.
    const auto check_offset = [&](int64_t value, const char* name) {
      RINGFLASH_CHECK(value >= -kMaxOffset && value <= kMaxOffset, InvalidArgument, "[", op_, "] ", name,
                      " must be in [-2^40, 2^40], got ", value);
    };
    if (p_.q_offset != AttentionParams::kBottomRight) check_offset(p_.q_offset, "q_offset");
    check_offset(p_.k_offset, "k_offset");
    // A window wider than any position difference is unbounded.
    args_.window_left = p_.window_left < 0 ? AttentionArgs::kUnbounded
                                           : std::min<int64_t>(p_.window_left, AttentionArgs::kUnbounded);
    args_.window_right = p_.window_right < 0 ? AttentionArgs::kUnbounded
                                             : std::min<int64_t>(p_.window_right, AttentionArgs::kUnbounded);
    if (p_.causal) args_.window_right = std::min<int64_t>(args_.window_right, 0);
    args_.scale = p_.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(args_.head_dim)));
    args_.softcap = p_.softcap;
  }

  void check_alibi() {
    if (!p_.alibi_slopes) return;
    const TensorView& a = *p_.alibi_slopes;
    same_device(a, "alibi_slopes");
    RINGFLASH_CHECK(a.dtype() == DType::kFloat32, InvalidArgument, "[", op_,
                    "] alibi_slopes must have dtype float32, got ", dtype_name(a.dtype()));
    const bool per_head = a.ndim() == 1 && a.size(0) == args_.heads_q;
    const bool per_batch = a.ndim() == 2 && a.size(0) == args_.batch && a.size(1) == args_.heads_q;
    RINGFLASH_CHECK(per_head || per_batch, InvalidArgument, "[", op_, "] alibi_slopes must have shape (",
                    args_.heads_q, ",) or (", args_.batch, ", ", args_.heads_q, "), got ", a.shape_string());
    RINGFLASH_CHECK(a.stride(-1) == 1 || args_.heads_q <= 1, InvalidArgument, "[", op_,
                    "] alibi_slopes must be contiguous in its last dimension, got stride ", a.stride(-1));
    args_.alibi_slopes = a.data_as<const float>();
    args_.alibi_batch_stride = per_batch ? a.stride(0) : 0;
  }

  void fill_operands() {
    args_.q = operand(q_);
    args_.k = operand(k_);
    args_.v = operand(v_);
    args_.accumulate = p_.accumulate;
    args_.overwrite_dkdv = p_.overwrite_dkdv;
    args_.overwrite_out = p_.overwrite_out;
    args_.deterministic = p_.deterministic;
    args_.out_dtype = args_.grad_dtype = p_.accumulate ? DType::kFloat32 : q_.dtype();
    args_.num_threads = core::resolve_threads(p_.num_threads);
    args_.stream = p_.stream;
  }

  const char* op_;
  const TensorView& q_;
  const TensorView& k_;
  const TensorView& v_;
  const AttentionParams& p_;
  AttentionArgs args_;
};

void require_cuda(const char* op, const AttentionArgs& args) {
  const std::string reason = cuda::unsupported_reason(args);
  RINGFLASH_CHECK(reason.empty(), NotSupported, "[", op, "] ", reason);
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionParams& params) {
  using Rule = Validator::DTypeRule;
  Validator check("attention_forward", q, k, v, params);
  RINGFLASH_CHECK(!params.overwrite_out || params.accumulate, InvalidArgument,
                  "[attention_forward] overwrite_out needs accumulate mode (it writes fp32 out and lse), got "
                  "accumulate=false");
  RINGFLASH_CHECK(!params.final_out || params.accumulate, InvalidArgument,
                  "[attention_forward] final_out needs accumulate mode (it takes the merged result), got "
                  "accumulate=false");
  AttentionArgs args = check.run();
  args.out = check.like(out, "out", q, Rule::kAccumulate);
  if (params.final_out) {
    args.final_out = check.like(*params.final_out, "final_out", q, Rule::kSame);
    RINGFLASH_CHECK(params.final_out->data() != out.data() || out.numel() == 0, InvalidArgument,
                    "[attention_forward] final_out must not alias out");
    args.write_final = true;
  }
  check.check_lse(lse, args);
  if (q.numel() == 0) return;
  if (q.device().type == DeviceType::kCUDA) {
    require_cuda("attention_forward", args);
    return cuda::attention_forward(args);
  }
  cpu::attention_forward(args);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& dout, const TensorView& lse, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv, const AttentionParams& params) {
  using Rule = Validator::DTypeRule;
  Validator check("attention_backward", q, k, v, params);
  RINGFLASH_CHECK(!params.overwrite_dkdv || params.accumulate, InvalidArgument,
                  "[attention_backward] overwrite_dkdv needs accumulate mode (it writes fp32 dk and dv), got "
                  "accumulate=false");
  RINGFLASH_CHECK(!params.overwrite_out && !params.final_out, InvalidArgument,
                  "[attention_backward] overwrite_out and final_out are options of the forward, got ",
                  params.overwrite_out ? "overwrite_out=true" : "a final_out");
  AttentionArgs args = check.run();
  args.out = check.like(out, "out", q, Rule::kSameOrFp32);
  args.out_dtype = out.dtype();
  args.dout = check.like(dout, "dout", q, Rule::kSame);
  check.check_lse(lse, args);
  args.dq = check.like(dq, "dq", q, Rule::kAccumulate);
  args.dk = check.like(dk, "dk", k, Rule::kAccumulate);
  args.dv = check.like(dv, "dv", v, Rule::kAccumulate);
  for (auto [grad, name] : {std::pair{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}})
    for (auto [other, other_name] : {std::pair{&out, "out"}, {&dout, "dout"}, {&lse, "lse"}, {&dq, "dq"}, {&dk, "dk"}})
      RINGFLASH_CHECK(grad == other || grad->data() != other->data() || grad->numel() == 0 || other->numel() == 0,
                      InvalidArgument, "[attention_backward] ", name, " must not alias ", other_name);
  if (q.numel() == 0 && k.numel() == 0) return;
  if (q.device().type == DeviceType::kCUDA) {
    require_cuda("attention_backward", args);
    return cuda::attention_backward(args);
  }
  cpu::attention_backward(args);
}

Support attention_support(const TensorView& q, const TensorView& k, const TensorView& v,
                          const AttentionParams& params) {
  Support s;
  s.backend = q.device().type == DeviceType::kCUDA ? "cuda" : "cpu";
  try {
    const AttentionArgs args = Validator("attention_support", q, k, v, params).run();
    if (q.device().type == DeviceType::kCUDA) require_cuda("attention_support", args);
    s.supported = true;
    s.kernels = q.device().type == DeviceType::kCUDA ? cuda::kernels_used(args) : "cpu";
  } catch (const Error& e) {
    s.reason = e.what();
  }
  return s;
}

}  // namespace ringflash
