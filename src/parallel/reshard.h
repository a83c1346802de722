// What allgather, ulysses and hybrid share: how the rows of a group's ranks join into one tensor in
// sequence order, how heads are split among ranks, and the views and copies that move rows
// between a rank's local order and the joined order. Every buffer is on the tensors' device (the
// caller's tensors or a kernels::Workspace) and every byte is moved by kernels/ops.h; the host
// only computes the plans and offsets.
//
// Joined rows. Each rank of a group holds some rows of every sequence, in layout.h's local order
// (its rows of sequence 0, then of sequence 1, ...). The joined tensor holds, for each sequence in
// turn, rank 0's rows of it, then rank 1's, and so on. For the contiguous layout that is the global
// tensor; for hybrid it is one ring shard. A padded batch is B sequences of equal length, so rank
// j's rows are (B, S_j, H, D) and the joined tensor's (B, S, H, D), S = sum_j S_j.
//
// Copies see tensors batched (views.h): a packed (T, H, D) as (1, T, H, D) and its lse (H, T) as
// (1, H, T). Rank j's rows are then one run along the row dimension of a padded batch (the same
// S_j rows of every batch entry) and one run per sequence of a packed batch, so a copy between
// the two orders takes one kernels::copy per rank, or per rank and sequence.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ringflash/comm.h"
#include "ringflash/layout.h"
#include "ringflash/tensor.h"
#include "strategy.h"
#include "views.h"

namespace ringflash::parallel {

// ---------------------------------------------------------------------------------------------
// Rows

// Where each rank's rows of each sequence sit: in its local tensor and in the joined tensor.
struct RowPlan {
  bool packed = false;
  int64_t batch = 0;                               // B: sequences (padded) or documents (packed)
  std::vector<std::vector<int64_t>> counts;        // [rank][b]: rows of sequence b on the rank
  std::vector<std::vector<int64_t>> local_first;   // [rank][b]: its first local row
  std::vector<std::vector<int64_t>> joined_first;  // [rank][b]: its first row in the joined tensor
  std::vector<int64_t> local_rows;                 // [rank]: all its rows
  std::vector<int64_t> rank_first;                 // [rank]: its first row when ranks come in order
  int64_t rows = 0;                                // rows of the joined tensor

  // Entries of the batched dimension: B, or 1 when packed.
  int64_t entries() const { return packed ? 1 : batch; }
  // Rows per batched entry: rank j's (S_j, or T_j when packed), and the joined tensor's.
  int64_t entry_rows(int rank) const { return packed ? local_rows[rank] : batch > 0 ? counts[rank][0] : 0; }
  int64_t joined_entry_rows() const { return packed ? rows : batch > 0 ? rows / batch : 0; }
};

// The plan for `world` ranks where rank j holds rows_of(j, L) rows of a sequence of length L.
template <typename RowsOf>
RowPlan make_row_plan(const Problem& p, int world, RowsOf&& rows_of) {
  RowPlan plan;
  plan.packed = p.packed;
  plan.batch = p.packed ? static_cast<int64_t>(p.cu_seqlens.size()) - 1 : p.batch;
  plan.counts.assign(world, std::vector<int64_t>(plan.batch));
  plan.local_first = plan.joined_first = plan.counts;
  plan.local_rows.assign(world, 0);
  plan.rank_first.assign(world, 0);
  for (int j = 0; j < world; ++j)
    for (int64_t b = 0; b < plan.batch; ++b) plan.counts[j][b] = rows_of(j, p.sequence_length(b));
  for (int64_t b = 0; b < plan.batch; ++b)
    for (int j = 0; j < world; ++j) {
      plan.local_first[j][b] = plan.local_rows[j];
      plan.joined_first[j][b] = plan.rows;
      plan.local_rows[j] += plan.counts[j][b];
      plan.rows += plan.counts[j][b];
    }
  for (int j = 1; j < world; ++j) plan.rank_first[j] = plan.rank_first[j - 1] + plan.local_rows[j - 1];
  return plan;
}

// The contiguous layout over `world` ranks (allgather, ulysses): the joined tensor is the global one.
inline RowPlan contiguous_plan(const Problem& p, int world) {
  return make_row_plan(p, world, [&](int rank, int64_t length) {
    return shard_rows(shard_of(Layout::kContiguous, length, rank, world));
  });
}

// Calls fn(local run, joined run) for every run of rank j's rows: the run's rows of batched
// `local` (j's rows in local order) and of batched `joined` (all rows in joined order), narrowed
// along dimension `dim` of both (1 for (B, S, H, D), 2 for an lse (B, H, S)). Empty runs are left
// out.
template <typename Fn>
void for_each_run(const RowPlan& plan, int j, const TensorView& local, const TensorView& joined, int dim, Fn&& fn) {
  const auto run = [&](int64_t local_first, int64_t joined_first, int64_t rows) {
    if (rows > 0) fn(narrow(local, dim, local_first, rows), narrow(joined, dim, joined_first, rows));
  };
  if (!plan.packed) {
    if (plan.batch > 0) run(0, plan.joined_first[j][0], plan.counts[j][0]);
    return;
  }
  for (int64_t b = 0; b < plan.batch; ++b) run(plan.local_first[j][b], plan.joined_first[j][b], plan.counts[j][b]);
}

// A contiguous buffer of `rows` rows per batched entry of `heads` heads, batched:
// (B, rows, heads, dim), or (1, rows, heads, dim) when packed.
inline TensorView token_buffer(const RowPlan& plan, void* data, DType dtype, Device device, int64_t rows,
                               int64_t heads, int64_t dim) {
  return contiguous(data, dtype, device, plan.entries(), rows, heads, dim);
}

// The same for an lse: (B, heads, rows), or (1, heads, rows) when packed.
inline TensorView lse_buffer(const RowPlan& plan, void* data, Device device, int64_t rows, int64_t heads) {
  return TensorView(data, DType::kFloat32, device, {plan.entries(), heads, rows});
}

// A contiguous joined tensor of `heads` heads as the kernels take it: (B, S, heads, dim), or
// (T, heads, dim) when packed.
inline TensorView joined_tokens(const RowPlan& plan, void* data, DType dtype, Device device, int64_t heads,
                                int64_t dim) {
  if (plan.packed) return TensorView(data, dtype, device, {plan.rows, heads, dim});
  return TensorView(data, dtype, device, {plan.batch, plan.joined_entry_rows(), heads, dim});
}

// A contiguous joined lse: (B, heads, S), or (heads, T) when packed.
inline TensorView joined_lse(const RowPlan& plan, void* data, Device device, int64_t heads) {
  if (plan.packed) return TensorView(data, DType::kFloat32, device, {heads, plan.rows});
  return TensorView(data, DType::kFloat32, device, {plan.batch, heads, plan.joined_entry_rows()});
}

// ---------------------------------------------------------------------------------------------
// Heads

struct HeadRange {
  int64_t first = 0, count = 0;
  int64_t end() const { return first + count; }
};

// Heads `h` of `t`, whose heads are dimension `dim`.
inline TensorView narrow(const TensorView& t, int dim, HeadRange h) { return narrow(t, dim, h.first, h.count); }

// Query heads of `rank` of `world`: heads cut in order, the first heads % world ranks one more.
inline HeadRange query_heads(int64_t heads, int rank, int world) {
  const int64_t base = heads / world, extra = heads % world;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

// The KV heads that query heads `q` read, `group` query heads per KV head.
inline HeadRange kv_heads_of(HeadRange q, int64_t group) {
  if (q.count == 0) return {q.first / group, 0};
  return {q.first / group, (q.end() - 1) / group - q.first / group + 1};
}

// Query heads and the KV heads they read, at one ratio: what one kernel call can serve.
struct HeadSegment {
  HeadRange q, kv;
};

// `q` cut into at most three segments: a part of one group, whole groups, a part of one group.
// Every KV head of kv_heads_of(q) belongs to exactly one segment.
inline std::vector<HeadSegment> head_segments(HeadRange q, int64_t group) {
  std::vector<HeadSegment> segments;
  const int64_t whole_end = q.end() / group * group;  // end of the last whole group in q
  for (int64_t h = q.first; h < q.end();) {
    const int64_t end = h % group == 0 && whole_end > h ? whole_end : std::min(q.end(), (h / group + 1) * group);
    const HeadRange part{h, end - h};
    segments.push_back({part, kv_heads_of(part, group)});
    h = end;
  }
  return segments;
}

// Query heads and KV heads of every rank of a group of `world` (ulysses and hybrid).
struct HeadSplit {
  std::vector<HeadRange> q, kv;
  bool kv_replicated = false;  // some KV head is read on more than one rank

  HeadSplit(int64_t heads_q, int64_t heads_kv, int world) {
    int64_t kv_total = 0;
    for (int w = 0; w < world; ++w) {
      q.push_back(query_heads(heads_q, w, world));
      kv.push_back(kv_heads_of(q.back(), heads_q / heads_kv));
      kv_total += kv.back().count;
    }
    kv_replicated = kv_total > heads_kv;
  }
};

// The caller's options for query heads `q` alone: ALiBi slopes narrowed to them.
inline AttentionParams params_for_heads(const AttentionParams& params, HeadRange q) {
  AttentionParams out = params;
  if (out.alibi_slopes) out.alibi_slopes = narrow(*out.alibi_slopes, -1, q);
  return out;
}

// ---------------------------------------------------------------------------------------------
// The Ulysses exchange around an attention over joined rows (ulysses.cpp)

// Attention over joined rows for one head segment. `joined` has this rank's heads of the segment
// and the joined rows (its rows, packed, cu_seqlens, seqlen and batch describe them; params has
// ALiBi narrowed to the segment and, when packed, the joined rows' cu_seqlens on the device as
// cu_seqlens_q and cu_seqlens_k). Forward writes joined.out and joined.lse. Backward writes fp32
// gradients to joined.dq, dk and dv, which are zero on entry. Its tensors are in the exchange's
// workspace, which outlives the call.
using JoinedAttention = std::function<void(const Problem& joined)>;

// Ulysses over `comm`: q, k, v of p's local rows to joined rows of this rank's heads, `attend`,
// then out and lse back. ulysses passes whole sequences and the kernel; hybrid one ring shard and
// the ring.
void ulysses_exchange_forward(Communicator& comm, const Problem& p, const RowPlan& plan, const JoinedAttention& attend);
void ulysses_exchange_backward(Communicator& comm, const Problem& p, const RowPlan& plan,
                               const JoinedAttention& attend);

}  // namespace ringflash::parallel
