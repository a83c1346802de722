// Where sequence b of a batch lives and which global positions it covers; shared by every kernel.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "params.h"

namespace ringflash::core {

struct Sequence {
  int64_t len_q = 0, len_k = 0;
  int64_t row_q = 0, row_k = 0;  // first row in the tensor (packed batches), else 0
  int64_t pos_q = 0, pos_k = 0;  // global position of row 0
};

// The cu_seqlens and per-sequence offset arrays are read where the kernel runs: host memory for
// the CPU kernels, device memory for the CUDA ones.
RINGFLASH_HOST_DEVICE Sequence sequence(const AttentionArgs& a, int64_t b) {
  Sequence s;
  if (a.cu_seqlens_q) {
    s.row_q = a.cu_seqlens_q[b];
    s.row_k = a.cu_seqlens_k[b];
    s.len_q = a.cu_seqlens_q[b + 1] - s.row_q;
    s.len_k = a.cu_seqlens_k[b + 1] - s.row_k;
  } else {
    s.len_q = a.seqlen_q;
    s.len_k = a.seqlen_k;
  }
  s.pos_k = a.k_seq_offsets ? a.k_seq_offsets[b] : a.k_offset;
  if (a.q_seq_offsets)
    s.pos_q = a.q_seq_offsets[b];
  else if (a.q_bottom_right)
    s.pos_q = s.pos_k + s.len_k - s.len_q;
  else
    s.pos_q = a.q_offset;
  return s;
}

}  // namespace ringflash::core
