// Exact (flash) attention on one device, forward and backward.
//
// Layouts follow flash-attn:
//   padded batch:  q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out like q, lse (B, Hq, Sq) fp32.
//   packed batch:  q (Tq, Hq, D), k and v (Tk, Hkv, D), out like q, lse (Hq, Tq) fp32, with
//                  cu_seqlens_q / cu_seqlens_k (int32, B + 1) giving where each sequence starts.
// D must be contiguous (stride 1); the other dimensions may have any stride. Hq must be a
// multiple of Hkv (GQA/MQA); K and V are read in place, never repeated.
//
// Positions and masks. Query row i of sequence b sits at global position
//   pq = q_pos(b) + i,   and key row j at   pk = k_pos(b) + j,
// where q_pos / k_pos come from `q_offset` / `k_offset` (or the per-sequence arrays). By default
// k_pos(b) = 0 and q_pos(b) = k_pos(b) + seqlen_k(b) - seqlen_q(b): the last query is aligned with
// the last key (bottom-right causal alignment, as in flash-attn). Scalar offsets must lie in
// [-2^40, 2^40]. A key is visible when
//   pk <= pq                       (causal)
//   pq - window_left <= pk <= pq + window_right   (window; -1 means unbounded on that side).
// A row that sees no key gets out = 0 and lse = -inf, never NaN.
//
// Scores, in this order:  s = softmax_scale * q.k;  s = softcap * tanh(s / softcap) if softcap > 0;
//   s -= slope[h] * |pq - pk| with ALiBi;  out = softmax(s) v,  lse = log(sum(exp(s))) (natural log).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ringflash/tensor.h"

namespace ringflash {

struct AttentionParams {
  // Sentinel for `q_offset`: align the last query with the last key, q_pos = k_pos + len_k - len_q.
  static constexpr int64_t kBottomRight = INT64_MIN;

  std::optional<float> softmax_scale;      // default 1 / sqrt(D); must be finite
  bool causal = false;
  int64_t window_left = -1;                // -1: unbounded
  int64_t window_right = -1;               // -1: unbounded (0 with `causal`)
  float softcap = 0.0f;                    // 0: off
  std::optional<TensorView> alibi_slopes;  // fp32, (Hq) or (B, Hq), on the device of q
  float dropout_p = 0.0f;                  // > 0 raises NotSupported
  bool deterministic = false;              // backward gives bit-identical results run to run

  // Global positions (see above). Per-sequence arrays, when given, replace the scalars.
  int64_t q_offset = kBottomRight;
  int64_t k_offset = 0;
  std::optional<TensorView> q_seq_offsets;  // int32 (B), on the device of q
  std::optional<TensorView> k_seq_offsets;  // int32 (B), on the device of q

  // Packed batches: both or neither. int32 (B + 1), increasing, ending at T, on the device of q.
  // On CUDA they are not checked on the host (that would synchronise): invalid values there are
  // undefined behaviour, as in flash-attn.
  std::optional<TensorView> cu_seqlens_q;
  std::optional<TensorView> cu_seqlens_k;

  // Accumulate mode. Forward: out (fp32) and lse (fp32) already hold a partial result over other
  // keys (lse = -inf where nothing was seen yet); this block is merged into them exactly.
  // Backward: dq, dk, dv are fp32 and the gradients are added to them.
  bool accumulate = false;
  // Backward in accumulate mode: dk and dv are written rather than added to (their old contents are
  // never read; dq is still added to). For the first of several calls into the same dK/dV, such as
  // a ring's first step over a block of keys, whose accumulators then need no zero fill.
  bool overwrite_dkdv = false;
  // Forward in accumulate mode: out and lse are written as this block's own result (in fp32),
  // never read. For the first of several calls into the same accumulator, such as a ring's first
  // step, which then needs no fill.
  bool overwrite_out = false;
  // Forward in accumulate mode: the merged rows go, rounded to q's dtype, to this tensor (q's
  // shape) instead of back into out, which is then not written. For the last of several calls
  // into the same accumulator, such as a ring's last step, which then needs no conversion pass.
  std::optional<TensorView> final_out;

  int num_threads = 0;     // CPU: threads to use; 0 means every core
  void* stream = nullptr;  // CUDA: the cudaStream_t to run on; ignored on CPU
};

// out = attention(q, k, v) and its log-sum-exp. `out` and `lse` are written, never read, unless
// `accumulate`. `out` has q's dtype (fp32 with `accumulate`) and shape; it may not alias q, k or v.
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse, const AttentionParams& params);

// Gradients of attention. `out` and `lse` are the forward's results over all keys (in ring
// attention: the merged ones); `dout` has out's shape. dq, dk, dv have the shapes of q, k, v and
// their dtype (fp32 with `accumulate`); they are overwritten, or added to with `accumulate`.
// They may not alias any input.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& dout, const TensorView& lse,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionParams& params);

// Whether attention_forward/backward can run this case, and if not, why.
struct Support {
  bool supported = false;
  std::string backend;  // "cpu" or "cuda"
  std::string reason;   // empty when supported
  // The kernels that run it: "cpu"; on CUDA "sm80" or "sm90", and where an sm_90 device runs the
  // sm_80 kernels, why (e.g. "sm80 (the sm_90a kernels do not run this case: ...)").
  std::string kernels;
};
Support attention_support(const TensorView& q, const TensorView& k, const TensorView& v,
                          const AttentionParams& params);

}  // namespace ringflash
