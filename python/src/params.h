// The attention options of the Python entry points (single device and parallel), in one place:
// the C++ parameters, the same names forwarded to make_params, and nanobind's keyword-only
// annotations with the defaults of ringflash::AttentionParams.
#pragma once

#include <cstdint>
#include <optional>

#include "ringflash/attention.h"
#include "tensor.h"

namespace ringflash::python {

// The keyword options, in one place for the three entry points: the C++ parameters, the same
// names forwarded to make_params, and nanobind's annotations with their defaults.
#define RINGFLASH_OPTION_PARAMS                                                                   \
  std::optional<float> softmax_scale, bool causal, int64_t window_left, int64_t window_right,   \
      float softcap, const OptionalInput &alibi_slopes, float dropout_p, bool deterministic,      \
      std::optional<int64_t> q_offset, int64_t k_offset, const OptionalInput &q_seq_offsets,      \
      const OptionalInput &k_seq_offsets, const OptionalInput &cu_seqlens_q,                      \
      const OptionalInput &cu_seqlens_k, bool accumulate, bool overwrite_dkdv, bool overwrite_out, \
      const OptionalInput &final_out, int num_threads, uintptr_t stream
#define RINGFLASH_OPTION_NAMES                                                                    \
  softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,            \
      deterministic, q_offset, k_offset, q_seq_offsets, k_seq_offsets, cu_seqlens_q, cu_seqlens_k, \
      accumulate, overwrite_dkdv, overwrite_out, final_out, num_threads, stream
#define RINGFLASH_OPTION_ARGS nb::kw_only(), RINGFLASH_OPTION_KWARGS
#define RINGFLASH_OPTION_KWARGS                                                                   \
  "softmax_scale"_a = nb::none(), "causal"_a = false, "window_left"_a = -1,        \
      "window_right"_a = -1, "softcap"_a = 0.0f, "alibi_slopes"_a = nb::none(),                   \
      "dropout_p"_a = 0.0f, "deterministic"_a = false, "q_offset"_a = nb::none(),                 \
      "k_offset"_a = 0, "q_seq_offsets"_a = nb::none(), "k_seq_offsets"_a = nb::none(),           \
      "cu_seqlens_q"_a = nb::none(), "cu_seqlens_k"_a = nb::none(), "accumulate"_a = false,       \
      "overwrite_dkdv"_a = false, "overwrite_out"_a = false, "final_out"_a = nb::none(), "num_threads"_a = 0, \
      "stream"_a = 0

inline AttentionParams make_params(const char* op, RINGFLASH_OPTION_PARAMS) {
  AttentionParams p;
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  p.alibi_slopes = to_tensor_view(op, "alibi_slopes", alibi_slopes);
  p.dropout_p = dropout_p;
  p.deterministic = deterministic;
  p.q_offset = q_offset.value_or(AttentionParams::kBottomRight);
  p.k_offset = k_offset;
  p.q_seq_offsets = to_tensor_view(op, "q_seq_offsets", q_seq_offsets);
  p.k_seq_offsets = to_tensor_view(op, "k_seq_offsets", k_seq_offsets);
  p.cu_seqlens_q = to_tensor_view(op, "cu_seqlens_q", cu_seqlens_q);
  p.cu_seqlens_k = to_tensor_view(op, "cu_seqlens_k", cu_seqlens_k);
  p.accumulate = accumulate;
  p.overwrite_dkdv = overwrite_dkdv;
  p.overwrite_out = overwrite_out;
  p.final_out = to_tensor_view(op, "final_out", final_out);
  p.num_threads = num_threads;
  p.stream = reinterpret_cast<void*>(stream);
  return p;
}

}  // namespace ringflash::python
