// Sequence-parallel attention: one sequence split across the ranks of a Communicator.
//
// Every rank calls the same function with its own shard. Shapes are those of attention.h with
// the sequence dimension local:
//   padded batch:  q (B, S_r, Hq, D), k and v (B, S_r, Hkv, D), out like q, lse (B, Hq, S_r) fp32
//   packed batch:  q (T_r, Hq, D), k and v (T_r, Hkv, D), out like q, lse (Hq, T_r) fp32
// where S_r / T_r is the number of rows layout.h gives this rank (the global length is the sum
// over ranks). q, k and v share the layout: self-attention over one global sequence, so causal
// means pk <= pq in global positions.
//
// Params are attention.h's AttentionParams with these differences:
//   - cu_seqlens_q holds the GLOBAL cumulative lengths (B + 1, int32, the same on every rank);
//     cu_seqlens_k must be unset or equal. The local tensors hold each sequence's shard in order.
//   - q_offset, k_offset, q_seq_offsets, k_seq_offsets and accumulate must be left unset: the
//     strategy derives positions from the layout.
//   - alibi_slopes is not supported with the stripe layout.
// Every rank must pass the same shapes (up to its shard length), dtypes and options; a mismatch
// is an InvalidArgument on every rank. Partial results are merged in fp32 whatever the dtype.
//
// Backward takes the forward's out and lse (this rank's shard) and returns dq, dk, dv in the
// shapes and dtypes of q, k, v.
#pragma once

#include <optional>

#include "ringflash/attention.h"
#include "ringflash/comm.h"
#include "ringflash/layout.h"
#include "ringflash/tensor.h"

namespace ringflash {

enum class Strategy { kRing, kZigzag, kStripe, kAllGather, kUlysses, kHybrid };
const char* strategy_name(Strategy strategy);

// Strategy-specific knobs, with defaults that suit most cases.
struct ParallelOptions {
  // allgather: K/V heads gathered at a time (bounds the gathered buffer); 0 means all at once.
  int64_t kv_heads_per_gather = 0;
  // hybrid: the ring layout across ring groups.
  Layout hybrid_ring_layout = Layout::kZigzag;
  // ring, zigzag and stripe, where the ring takes two steps (two ranks, or a window that reaches no
  // farther): a contiguous tensor of k's dtype on k's device that the forward receives the other
  // rank's K and V into, and that the backward of the same call (the same arguments) reads them
  // from instead of receiving them again. It holds 2 x B x R x Hkv x D elements, R the other rank's
  // rows, which is at most S_r + 2 (packed: 2 x (T_r + 2 per sequence) x Hkv x D elements).
  // Unset: the backward receives them. The other strategies take none.
  std::optional<TensorView> kept_kv;
};

// The communicators a strategy runs over. Every strategy but hybrid uses `world`; hybrid uses
// `ulysses` (inner, all-to-all) and `ring` (outer); rank (ring r, ulysses u) holds
// hybrid_shard(..., r, R, u, U).
struct ParallelGroup {
  Communicator* world = nullptr;
  Communicator* ulysses = nullptr;
  Communicator* ring = nullptr;
};

// The layout this rank's shard must follow.
Shard parallel_shard(Strategy strategy, const ParallelGroup& group, const ParallelOptions& options, int64_t seqlen);

void parallel_attention_forward(Strategy strategy, const ParallelGroup& group, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse, const AttentionParams& params,
                                const ParallelOptions& options = {});

void parallel_attention_backward(Strategy strategy, const ParallelGroup& group, const TensorView& q,
                                 const TensorView& k, const TensorView& v, const TensorView& out,
                                 const TensorView& dout, const TensorView& lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv, const AttentionParams& params,
                                 const ParallelOptions& options = {});

// One entry point per strategy, forward and backward (the functions above, named).
#define RINGFLASH_DECLARE_STRATEGY(name)                                                                     \
  void name##_attention_forward(Communicator& comm, const TensorView& q, const TensorView& k,              \
                                const TensorView& v, const TensorView& out, const TensorView& lse,         \
                                const AttentionParams& params, const ParallelOptions& options = {});       \
  void name##_attention_backward(Communicator& comm, const TensorView& q, const TensorView& k,             \
                                 const TensorView& v, const TensorView& out, const TensorView& dout,       \
                                 const TensorView& lse, const TensorView& dq, const TensorView& dk,        \
                                 const TensorView& dv, const AttentionParams& params,                      \
                                 const ParallelOptions& options = {});
RINGFLASH_DECLARE_STRATEGY(ring)
RINGFLASH_DECLARE_STRATEGY(zigzag)
RINGFLASH_DECLARE_STRATEGY(stripe)
RINGFLASH_DECLARE_STRATEGY(allgather)
RINGFLASH_DECLARE_STRATEGY(ulysses)
#undef RINGFLASH_DECLARE_STRATEGY

void hybrid_attention_forward(Communicator& ulysses, Communicator& ring, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& out, const TensorView& lse,
                              const AttentionParams& params, const ParallelOptions& options = {});
void hybrid_attention_backward(Communicator& ulysses, Communicator& ring, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& out, const TensorView& dout,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const AttentionParams& params,
                               const ParallelOptions& options = {});

}  // namespace ringflash
