// The plain argument block every attention kernel receives, by value.
//
// Host code (src/core/attention.cpp) validates the user's tensors once and fills this struct with
// pointers, sizes, strides (in elements) and every derived constant. Kernels never see a
// TensorView and never re-validate.
#pragma once

#include <cstdint>

#include "ringflash/tensor.h"

namespace ringflash::core {

struct AttentionArgs {
  DType dtype = DType::kFloat32;       // of q, k, v and dout
  DType out_dtype = DType::kFloat32;   // of out (written by forward, read by backward)
  DType grad_dtype = DType::kFloat32;  // of dq, dk, dv
  bool accumulate = false;             // forward merges into out/lse; backward adds into dq/dk/dv
  bool overwrite_dkdv = false;         // backward with accumulate: dk, dv (fp32) written, not added to
  bool overwrite_out = false;          // forward with accumulate: out, lse (fp32) written, not merged into
  bool write_final = false;            // forward with accumulate: merged rows to final_out (dtype), not out
  bool deterministic = false;          // backward: bit-identical results run to run
  int device = -1;                     // the CUDA device of the tensors, -1 on the CPU

  int64_t batch = 0;        // number of sequences
  int64_t seqlen_q = 0;     // padded: every sequence's length; packed: the longest
  int64_t seqlen_k = 0;
  int64_t rows_q = 0;       // rows of the q tensor per sequence slot: padded S, packed T
  int64_t rows_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;

  // Packed batches: cumulative lengths (B + 1), or null for a padded batch.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;

  // Global positions: pq = q_pos(b) + i, pk = k_pos(b) + j.
  bool q_bottom_right = true;  // q_pos(b) = len_k(b) - len_q(b), unless q_seq_offsets is set
  int64_t q_offset = 0;        // used when !q_bottom_right and q_seq_offsets is null
  int64_t k_offset = 0;        // used when k_seq_offsets is null
  const int32_t* q_seq_offsets = nullptr;
  const int32_t* k_seq_offsets = nullptr;

  // Mask: visible iff pq - window_left <= pk <= pq + window_right. Unbounded sides hold
  // kUnbounded; causal is folded into window_right (<= 0).
  static constexpr int64_t kUnbounded = INT64_MAX / 4;
  int64_t window_left = kUnbounded;
  int64_t window_right = kUnbounded;

  float scale = 1.0f;
  float softcap = 0.0f;                 // 0: off
  const float* alibi_slopes = nullptr;  // slope of (b, h) at alibi_slopes[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0;

  // Tensors. Strides are per sequence (batch), per row (token) and per head; for packed batches
  // the batch stride is 0 and rows start at cu_seqlens.
  struct Operand {
    void* data = nullptr;
    int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  };
  Operand q, k, v, out;
  Operand final_out;         // forward with write_final: shaped like q, in its dtype
  Operand dout, dq, dk, dv;  // backward only
  // lse: fp32; element (b, h, i) at lse + b * lse_batch_stride + h * lse_head_stride + row(i),
  // where row(i) = i for padded batches and cu_seqlens_q[b] + i for packed ones.
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  int num_threads = 1;
  void* stream = nullptr;
};

}  // namespace ringflash::core
