// What the strategy files share: the validated problem, and each strategy's forward and backward.
//
// parallel.cpp validates the caller's tensors and options once (on every rank, and across ranks),
// builds a Problem and calls one of the functions below. The functions assume a valid Problem.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ringflash/attention.h"
#include "ringflash/comm.h"
#include "ringflash/layout.h"
#include "ringflash/parallel.h"
#include "ringflash/tensor.h"

namespace ringflash::parallel {

// One rank's view of a validated call. Local tensors follow attention.h's shapes with this rank's
// rows (padded: (B, S_r, H, D); packed: (T_r, H, D)).
struct Problem {
  std::string op;                // the call's error prefix, e.g. "[zigzag backward]"
  TensorView q, k, v, out, lse;  // out and lse: written by forward, read by backward
  TensorView dout, dq, dk, dv;   // backward only
  // The caller's options; positions, cu_seqlens and accumulate are left for the strategy to set.
  AttentionParams params;
  bool packed = false;
  std::vector<int32_t> cu_seqlens;  // global, B + 1 entries, when packed
  int64_t seqlen = 0;               // global length, padded batches
  int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t rows = 0;                 // local rows: S_r, or T_r when packed
  std::optional<TensorView> kept_kv;  // ParallelOptions::kept_kv (ring, zigzag, stripe)

  // Global length of sequence b.
  int64_t sequence_length(int64_t b) const { return packed ? cu_seqlens[b + 1] - cu_seqlens[b] : seqlen; }
};

// ring, zigzag and stripe: K/V travel around `comm` while each rank's queries stay; this rank's
// rows of every sequence are shard_of(layout, length, comm.rank(), comm.size()). Gradients are
// written in the dtypes of dq, dk, dv; fp32 ones are never rounded to a narrower type on the way
// (hybrid relies on this to round replicated K/V-head gradients only once).
void ring_forward(Communicator& comm, Layout layout, const Problem& p);
void ring_backward(Communicator& comm, Layout layout, const Problem& p);

// allgather: K/V gathered from every rank, options.kv_heads_per_gather heads at a time;
// contiguous layout.
void allgather_forward(Communicator& comm, const Problem& p, const ParallelOptions& options);
void allgather_backward(Communicator& comm, const Problem& p, const ParallelOptions& options);

// ulysses: all-to-all from sequence shards to head shards and back; contiguous layout.
void ulysses_forward(Communicator& comm, const Problem& p);
void ulysses_backward(Communicator& comm, const Problem& p);

// hybrid: ulysses inside `ulysses`, then ring_forward/ring_backward over `ring` with
// options.hybrid_ring_layout; rows as hybrid_shard says.
void hybrid_forward(Communicator& ulysses, Communicator& ring, const Problem& p, const ParallelOptions& options);
void hybrid_backward(Communicator& ulysses, Communicator& ring, const Problem& p, const ParallelOptions& options);

}  // namespace ringflash::parallel
