// What allgather, ulysses and hybrid share: how the rows of a group's ranks join into one tensor in
// sequence order, how heads are split among ranks, the all-to-alls between the two, and conversions
// between the input dtype and fp32. Buffers are host memory.
//
// Joined rows. Each rank of a group holds some rows of every sequence, in layout.h's local order
// (its rows of sequence 0, then of sequence 1, ...). The joined tensor holds, for each sequence in
// turn, rank 0's rows of it, then rank 1's, and so on. For the contiguous layout that is the global
// tensor; for hybrid it is one ring shard. A padded batch is B sequences of equal length, so the
// flat local row r of a (B, S_r, H, D) tensor is (b, i) = (r / S_r, r % S_r).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "ringflash/comm.h"
#include "ringflash/layout.h"
#include "ringflash/tensor.h"
#include "strategy.h"

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

  // Rows per batch entry of a padded tensor: rank j's S_j, and the joined tensor's.
  int64_t local_batch_rows(int rank) const { return packed || batch == 0 ? 0 : counts[rank][0]; }
  int64_t joined_batch_rows() const { return packed || batch == 0 ? 0 : rows / batch; }
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

// Calls fn(rank, local row, joined row, rows) for every non-empty run of rows that one rank holds
// of one sequence, ranks in order. (Empty runs are skipped: their buffers may be null.)
template <typename Fn>
void for_each_run(const RowPlan& plan, Fn&& fn) {
  for (size_t j = 0; j < plan.counts.size(); ++j)
    for (int64_t b = 0; b < plan.batch; ++b)
      if (plan.counts[j][b] > 0)
        fn(static_cast<int>(j), plan.local_first[j][b], plan.joined_first[j][b], plan.counts[j][b]);
}

// Rows as all_gather returns them (rank 0's local rows, then rank 1's, ...) -> joined order.
inline void rank_order_to_joined(const RowPlan& plan, const char* src, size_t row_bytes, char* dst) {
  if (row_bytes == 0) return;  // no heads here: the buffers may be null
  for_each_run(plan, [&](int j, int64_t local, int64_t joined, int64_t rows) {
    std::memcpy(dst + joined * row_bytes, src + (plan.rank_first[j] + local) * row_bytes, rows * row_bytes);
  });
}

// Joined order -> rank order (the inverse of rank_order_to_joined), as a reduce-scatter sends it.
inline void joined_to_rank_order(const RowPlan& plan, const char* src, size_t row_bytes, char* dst) {
  if (row_bytes == 0) return;
  for_each_run(plan, [&](int j, int64_t local, int64_t joined, int64_t rows) {
    std::memcpy(dst + (plan.rank_first[j] + local) * row_bytes, src + joined * row_bytes, rows * row_bytes);
  });
}

// Address of head h of flat row r of a (B, S, H, D) or (T, H, D) tensor.
inline char* head_ptr(const TensorView& t, int64_t r, int64_t h) {
  const bool packed = t.ndim() == 3;
  const int64_t b = packed ? 0 : r / t.size(1), i = packed ? r : r % t.size(1);
  const int64_t e = (packed ? 0 : b * t.stride(0)) + i * t.stride(-3) + h * t.stride(-2);
  return static_cast<char*>(t.data()) + e * static_cast<int64_t>(dtype_size(t.dtype()));
}

// Address of the lse of flat row r, head h, in (B, H, S) or (H, T).
inline char* lse_ptr(const TensorView& lse, int64_t r, int64_t h) {
  const bool packed = lse.ndim() == 2;
  const int64_t b = packed ? 0 : r / lse.size(2), i = packed ? r : r % lse.size(2);
  const int64_t e = (packed ? 0 : b * lse.stride(0)) + h * lse.stride(-2) + i * lse.stride(-1);
  return static_cast<char*>(lse.data()) + e * static_cast<int64_t>(sizeof(float));
}

// Entries [first, first + count) of dimension `dim` of `t`, as a view of the same memory.
inline TensorView narrow(const TensorView& t, int dim, int64_t first, int64_t count) {
  int64_t shape[TensorView::kMaxDims], strides[TensorView::kMaxDims];
  const int d0 = dim < 0 ? dim + t.ndim() : dim;
  for (int d = 0; d < t.ndim(); ++d) {
    shape[d] = t.size(d);
    strides[d] = t.stride(d);
  }
  shape[d0] = count;
  char* data = static_cast<char*>(t.data()) + first * t.stride(d0) * static_cast<int64_t>(dtype_size(t.dtype()));
  return TensorView(data, t.dtype(), t.device(), t.ndim(), shape, strides);
}

// Heads [first, first + heads) of a joined buffer of `plan.rows` rows, `row_elems` elements
// apart: (B, S, heads, D), or (T, heads, D) when packed.
inline TensorView joined_view(const RowPlan& plan, void* data, DType dtype, Device device, int64_t row_elems,
                              int64_t first, int64_t heads, int64_t dim) {
  void* at = static_cast<char*>(data) + first * dim * static_cast<int64_t>(dtype_size(dtype));
  if (plan.packed) return TensorView(at, dtype, device, {plan.rows, heads, dim}, {row_elems, dim, 1});
  const int64_t s = plan.joined_batch_rows();
  return TensorView(at, dtype, device, {plan.batch, s, heads, dim}, {s * row_elems, row_elems, dim, 1});
}

// A contiguous joined lse: (B, heads, S), or (heads, T) when packed.
inline TensorView joined_lse(const RowPlan& plan, float* data, Device device, int64_t heads) {
  if (plan.packed) return TensorView(data, DType::kFloat32, device, {heads, plan.rows});
  return TensorView(data, DType::kFloat32, device, {plan.batch, heads, plan.joined_batch_rows()});
}

// ---------------------------------------------------------------------------------------------
// Heads

struct HeadRange {
  int64_t first = 0, count = 0;
  int64_t end() const { return first + count; }
};

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
  if (out.alibi_slopes) out.alibi_slopes = narrow(*out.alibi_slopes, -1, q.first, q.count);
  return out;
}

// Copies heads `h` of flat row r of `t` to dst; returns the end of what it wrote.
inline char* copy_heads(const TensorView& t, int64_t r, HeadRange h, char* dst) {
  const size_t bytes = t.size(-1) * dtype_size(t.dtype());
  for (int64_t x = h.first; x < h.end(); ++x, dst += bytes) std::memcpy(dst, head_ptr(t, r, x), bytes);
  return dst;
}

// Copies src to heads `h` of flat row r of `t`; returns the end of what it read.
inline const char* paste_heads(const char* src, const TensorView& t, int64_t r, HeadRange h) {
  const size_t bytes = t.size(-1) * dtype_size(t.dtype());
  for (int64_t x = h.first; x < h.end(); ++x, src += bytes) std::memcpy(head_ptr(t, r, x), src, bytes);
  return src;
}

// Copies the lse of heads `h` of flat row r to dst (fp32); returns the end of what it wrote.
inline char* copy_lse(const TensorView& lse, int64_t r, HeadRange h, char* dst) {
  for (int64_t x = h.first; x < h.end(); ++x, dst += sizeof(float))
    std::memcpy(dst, lse_ptr(lse, r, x), sizeof(float));
  return dst;
}

// Copies src (fp32) to the lse of heads `h` of flat row r; returns the end of what it read.
inline const char* paste_lse(const char* src, const TensorView& lse, int64_t r, HeadRange h) {
  for (int64_t x = h.first; x < h.end(); ++x, src += sizeof(float))
    std::memcpy(lse_ptr(lse, r, x), src, sizeof(float));
  return src;
}

// ---------------------------------------------------------------------------------------------
// Conversions

inline float load_float(const char* src, DType dtype) {
  if (dtype == DType::kFloat16) {
    _Float16 h;
    std::memcpy(&h, src, sizeof h);
    return static_cast<float>(h);
  }
  if (dtype == DType::kBFloat16) {
    uint16_t b;
    std::memcpy(&b, src, sizeof b);
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  float f;
  std::memcpy(&f, src, sizeof f);
  return f;
}

// Rounds to nearest even.
inline void store_float(float x, DType dtype, char* dst) {
  if (dtype == DType::kFloat16) {
    const _Float16 h = static_cast<_Float16>(x);
    std::memcpy(dst, &h, sizeof h);
  } else if (dtype == DType::kBFloat16) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint16_t b = static_cast<uint16_t>(nan ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    std::memcpy(dst, &b, sizeof b);
  } else {
    std::memcpy(dst, &x, sizeof x);
  }
}

// dst[i] += src[i] for n values of `dtype`.
inline void add_as_float(const char* src, DType dtype, int64_t n, float* dst) {
  const size_t size = dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) dst[i] += load_float(src + i * size, dtype);
}

// n floats stored as `dtype`; returns the end of what it wrote.
inline char* store_floats(const float* src, int64_t n, DType dtype, char* dst) {
  const size_t size = dtype_size(dtype);
  if (n == 0) return dst;  // src may be null
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * size);
  } else {
    for (int64_t i = 0; i < n; ++i) store_float(src[i], dtype, dst + i * size);
  }
  return dst + n * size;
}

// ---------------------------------------------------------------------------------------------
// All-to-alls between local rows and joined rows

// Local rows -> joined rows. This rank sends rank w each of its local rows as row_bytes(w) bytes,
// written by pack(w, local row, dst), and returns the joined tensor's rows with this rank's part,
// row_bytes(comm.rank()) bytes each.
template <typename RowBytes, typename Pack>
std::vector<char> to_joined_rows(Communicator& comm, const RowPlan& plan, RowBytes&& row_bytes, Pack&& pack) {
  const int world = comm.size(), me = comm.rank();
  std::vector<size_t> send_bytes(world), send_offsets(world), recv_bytes(world), recv_offsets(world);
  size_t send_total = 0, recv_total = 0;
  for (int w = 0; w < world; ++w) {
    send_offsets[w] = send_total;
    send_total += send_bytes[w] = plan.local_rows[me] * row_bytes(w);
    recv_offsets[w] = recv_total;
    recv_total += recv_bytes[w] = plan.local_rows[w] * row_bytes(me);
  }
  std::vector<char> send(send_total), recv(recv_total);
  for (int w = 0; w < world; ++w)
    for (int64_t r = 0; r < plan.local_rows[me]; ++r) pack(w, r, send.data() + send_offsets[w] + r * row_bytes(w));
  comm.all_to_all(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);
  std::vector<char> joined(plan.rows * row_bytes(me));
  rank_order_to_joined(plan, recv.data(), row_bytes(me), joined.data());
  return joined;
}

// Joined rows -> local rows. This rank sends rank j the joined rows that j holds, row_bytes(me)
// bytes each, written by pack(joined row, dst); then unpack(u, local row, src) takes the
// row_bytes(u) bytes that rank u sent for each local row.
template <typename RowBytes, typename Pack, typename Unpack>
void from_joined_rows(Communicator& comm, const RowPlan& plan, RowBytes&& row_bytes, Pack&& pack, Unpack&& unpack) {
  const int world = comm.size(), me = comm.rank();
  const size_t mine = row_bytes(me);
  std::vector<size_t> send_bytes(world), send_offsets(world), recv_bytes(world), recv_offsets(world);
  size_t recv_total = 0;
  for (int j = 0; j < world; ++j) {
    send_offsets[j] = plan.rank_first[j] * mine;
    send_bytes[j] = plan.local_rows[j] * mine;
    recv_offsets[j] = recv_total;
    recv_total += recv_bytes[j] = plan.local_rows[me] * row_bytes(j);
  }
  std::vector<char> send(plan.rows * mine), recv(recv_total);
  for_each_run(plan, [&](int j, int64_t local, int64_t joined, int64_t rows) {
    for (int64_t i = 0; i < rows; ++i) pack(joined + i, send.data() + (plan.rank_first[j] + local + i) * mine);
  });
  comm.all_to_all(send.data(), send_bytes, send_offsets, recv.data(), recv_bytes, recv_offsets);
  for (int u = 0; u < world; ++u)
    for (int64_t r = 0; r < plan.local_rows[me]; ++r) unpack(u, r, recv.data() + recv_offsets[u] + r * row_bytes(u));
}

// ---------------------------------------------------------------------------------------------
// The Ulysses exchange around an attention over joined rows (ulysses.cpp)

// Attention over joined rows for one head segment. `joined` has this rank's heads of the segment
// and the joined rows (its rows, packed, cu_seqlens, seqlen and batch describe them; params has
// ALiBi narrowed to the segment). Forward writes joined.out and joined.lse. Backward writes fp32
// gradients to joined.dq, dk and dv, which are zero on entry.
using JoinedAttention = std::function<void(const Problem& joined)>;

// Ulysses over `comm`: q, k, v of p's local rows to joined rows of this rank's heads, `attend`,
// then out and lse back. ulysses passes whole sequences and the kernel; hybrid one ring shard and
// the ring.
void ulysses_exchange_forward(Communicator& comm, const Problem& p, const RowPlan& plan, const JoinedAttention& attend);
void ulysses_exchange_backward(Communicator& comm, const Problem& p, const RowPlan& plan,
                               const JoinedAttention& attend);

}  // namespace ringflash::parallel
