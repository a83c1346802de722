// ulysses: all-to-all from sequence shards to head shards and back.
//
// Rank u of P holds contiguous rows of every head. One all-to-all gives it every row of its query
// heads (heads cut in order, the first Hq % P ranks one more) and of exactly the KV heads those
// read. It runs the single-device kernel over whole sequences, and a second all-to-all returns out
// and lse to the ranks that hold the rows. A KV head read on several ranks (P > Hkv, or a group of
// query heads split between ranks) is sent to each of them once; in the backward its gradients
// come back from each and are summed in fp32, in rank order.
//
// Query heads that read their KV heads at one ratio go to one kernel call: with a group split
// between ranks, a rank's heads are a part of one group, whole groups and a part of one group.
//
// Buffers. One workspace on the tensors' device holds this rank's heads of the joined rows of
// every tensor, and the staging memory of the all-to-alls (both use the same memory in turn). The
// block that one rank sends another holds one contiguous section per tensor, packed by one
// kernels::copy of a strided view; the joined tensors are filled from the sections by one copy per
// rank (per rank and sequence when packed). A rank's own part skips the all-to-all and is copied
// in place.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "../kernels/ops.h"
#include "reshard.h"
#include "strategy.h"
#include "views.h"

namespace ringflash::parallel {
namespace {

// Sections start this many bytes apart from their block's start at least, which suits the
// alignment of every element type.
constexpr size_t kSectionAlignment = 16;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The caller's options for a kernel call over whole sequences: positions from 0; packed batches
// keep the joined rows' cu_seqlens (the global ones) that the exchange put in params.
AttentionParams whole_sequence_params(const Problem& joined, bool accumulate) {
  AttentionParams params = joined.params;
  params.q_offset = 0;
  params.k_offset = 0;
  params.q_seq_offsets.reset();
  params.k_seq_offsets.reset();
  params.accumulate = accumulate;
  return params;
}

// One tensor's part of an exchange: this rank's rows of every head (`local`) and this rank's heads
// of the joined rows (`joined`, in the workspace). Both have the shapes the kernels take.
struct Field {
  Field(const TensorView& local, bool kv, bool lse, DType joined_dtype, DType wire, bool summed)
      : local(local), kv(kv), lse(lse), joined_dtype(joined_dtype), wire(wire), summed(summed) {}

  TensorView local;    // the caller's tensor, or an fp32 sum of replicas
  bool kv;             // heads cut as KV heads, else as query heads
  bool lse;            // (B, H, S) or (H, T), else (B, S, H, D) or (T, H, D)
  DType joined_dtype;
  DType wire;          // the dtype of its sections in the all-to-all
  bool summed;         // what arrives for `local` is added (fp32), else copied
  TensorView joined;

  // Dimensions of the batched views (views.h).
  int row_dim() const { return lse ? 2 : 1; }
  int head_dim() const { return lse ? 1 : 2; }
};

// q, k, v, out or dout: joined and sent in its own dtype.
Field tokens(const TensorView& local, bool kv) { return {local, kv, false, local.dtype(), local.dtype(), false}; }
Field lse_of(const TensorView& lse) { return {lse, false, true, DType::kFloat32, DType::kFloat32, false}; }
// A gradient: joined in fp32, sent as `wire`.
Field gradient(const TensorView& local, bool kv, DType wire, bool summed) {
  return {local, kv, false, DType::kFloat32, wire, summed};
}

// The block that one rank sends another: each field's section at `at`, `bytes` in all.
struct Block {
  std::vector<size_t> at;
  size_t bytes = 0;
};

// An all-to-all's blocks in the staging memory: the blocks to every rank, then those from every
// rank. This rank's own are empty: its part is copied in place.
struct Staging {
  std::vector<size_t> send_bytes, send_offsets, recv_bytes, recv_offsets;
  size_t send_total = 0, total = 0;
};

// One rank's side of the exchange over `comm`: every rank's heads, and this rank's query heads hq.
class Exchange {
 public:
  Exchange(Communicator& comm, const Problem& p, const RowPlan& plan)
      : comm_(comm),
        p_(p),
        plan_(plan),
        me_(comm.rank()),
        world_(comm.size()),
        heads_(p.heads_q, p.heads_kv, world_),
        hq_(heads_.q[me_]),
        dim_(p.head_dim),
        device_(p.q.device()),
        stream_(p.params.stream) {}

  void forward(const JoinedAttention& attend) {
    Field q = tokens(p_.q, false), k = tokens(p_.k, true), v = tokens(p_.v, true);
    Field out = tokens(p_.out, false), lse = lse_of(p_.lse);
    const std::vector<Field*> in{&q, &k, &v}, back{&out, &lse};
    kernels::WorkspaceLayout layout;
    allocate(layout, in, back);

    to_joined(in);  // q (B, S_r, Hq, D), k and v (B, S_r, Hkv, D) -> (B, S, hq, D), (B, S, hkv, D)
    for (const HeadSegment& s : head_segments(hq_, p_.heads_q / p_.heads_kv)) attend(segment(s, q, k, v, out, lse));
    from_joined(back);  // out (B, S, hq, D), lse (B, hq, S) -> out (B, S_r, Hq, D), lse (B, Hq, S_r)
  }

  void backward(const JoinedAttention& attend) {
    Field q = tokens(p_.q, false), k = tokens(p_.k, true), v = tokens(p_.v, true);
    Field dout = tokens(p_.dout, false), out = tokens(p_.out, false), lse = lse_of(p_.lse);
    // Without replicas a KV head's gradient is final on the rank that computed it, so it travels
    // in the input dtype; with replicas the partial sums travel in fp32 and are summed here.
    const bool sum = heads_.kv_replicated;
    const DType wire = sum ? DType::kFloat32 : p_.dk.dtype();
    Field dq = gradient(p_.dq, false, p_.dq.dtype(), false), dk = gradient(p_.dk, true, wire, sum),
          dv = gradient(p_.dv, true, wire, sum);
    const std::vector<Field*> in{&q, &k, &v, &dout, &out, &lse}, grads{&dq, &dk, &dv};
    kernels::WorkspaceLayout layout;
    const size_t sum_bytes = sum ? static_cast<size_t>(p_.dk.numel()) * sizeof(float) : 0;
    const size_t sums_at[2] = {layout.add(sum_bytes), layout.add(sum_bytes)};
    allocate(layout, in, grads);

    // q, dout, out (B, S_r, Hq, D), k, v (B, S_r, Hkv, D), lse (B, Hq, S_r)
    //   -> (B, S, hq, D), (B, S, hkv, D) and lse (B, hq, S)
    to_joined(in);
    for (Field* g : grads) kernels::fill(g->joined, 0.0f, stream_);
    for (const HeadSegment& s : head_segments(hq_, p_.heads_q / p_.heads_kv)) {
      Problem joined = segment(s, q, k, v, out, lse);
      joined.dout = at_segment(dout, s);
      joined.dq = at_segment(dq, s);
      joined.dk = at_segment(dk, s);
      joined.dv = at_segment(dv, s);
      attend(joined);
    }

    // dq (B, S, hq, D), dk and dv (B, S, hkv, D) fp32 -> dq (B, S_r, Hq, D), dk and dv
    // (B, S_r, Hkv, D), through fp32 sums of every replica when there are replicas.
    if (sum) {
      dk.local = contiguous_like(workspace_.data() + sums_at[0], DType::kFloat32, p_.dk);
      dv.local = contiguous_like(workspace_.data() + sums_at[1], DType::kFloat32, p_.dv);
      kernels::fill(dk.local, 0.0f, stream_);
      kernels::fill(dv.local, 0.0f, stream_);
    }
    from_joined(grads);
    if (sum) {
      kernels::copy(dk.local, p_.dk, stream_);
      kernels::copy(dv.local, p_.dv, stream_);
    }
  }

 private:
  HeadRange heads(const Field& f, int rank) const { return f.kv ? heads_.kv[rank] : heads_.q[rank]; }

  // Field f's local tensor narrowed to `rank`'s heads, batched.
  TensorView local_heads(const Field& f, int rank) const {
    return narrow(batched(f.local, p_.packed), f.head_dim(), heads(f, rank));
  }

  // This rank's heads of the joined rows of f at `data` (null: only the shape).
  TensorView joined_view(const Field& f, void* data) const {
    const int64_t count = heads(f, me_).count;
    if (f.lse) return joined_lse(plan_, data, device_, count);
    return joined_tokens(plan_, data, f.joined_dtype, device_, count, dim_);
  }

  // `rows_of`'s rows of `count` heads of f, contiguous at `data` in the wire dtype, batched.
  TensorView section(const Field& f, void* data, int rows_of, int64_t count) const {
    const int64_t rows = plan_.entry_rows(rows_of);
    if (f.lse) return lse_buffer(plan_, data, device_, rows, count);
    return token_buffer(plan_, data, f.wire, device_, rows, count, dim_);
  }

  // Room in the workspace for the joined tensors of both directions, the joined cu_seqlens and the
  // staging memory; then the workspace, the joined views and, when packed, the cu_seqlens.
  void allocate(kernels::WorkspaceLayout& layout, const std::vector<Field*>& in, const std::vector<Field*>& back) {
    std::vector<size_t> joined_at;
    for (const auto* fields : {&in, &back})
      for (const Field* f : *fields) joined_at.push_back(layout.add(bytes_of(joined_view(*f, nullptr))));
    const size_t cu_at = layout.add(p_.packed ? static_cast<size_t>(plan_.batch + 1) * sizeof(int32_t) : 0);
    staging_at_ = layout.add(std::max(staging(in, true).total, staging(back, false).total));
    workspace_ = kernels::Workspace(device_, layout.total(), stream_);

    size_t i = 0;
    for (const auto* fields : {&in, &back})
      for (Field* f : *fields) f->joined = joined_view(*f, workspace_.data() + joined_at[i++]);
    if (p_.packed) {
      // The joined rows' cu_seqlens: where each sequence's rank-0 rows begin, then the end.
      std::vector<int32_t> cu;
      for (int64_t b = 0; b < plan_.batch; ++b) cu.push_back(static_cast<int32_t>(plan_.joined_first[0][b]));
      cu.push_back(static_cast<int32_t>(plan_.rows));
      void* at = workspace_.data() + cu_at;
      kernels::upload(cu.data(), cu.size() * sizeof(int32_t), at, device_, stream_);
      cu_seqlens_ = TensorView(at, DType::kInt32, device_, {plan_.batch + 1});
    }
  }

  // The block that rank `from` sends rank `to`: toward the joined rows, from's rows of to's heads;
  // back, to's rows of from's heads. One section per field, in order.
  Block block(const std::vector<Field*>& fields, int from, int to, bool to_joined) const {
    const int rows_of = to_joined ? from : to, heads_of = to_joined ? to : from;
    Block b;
    for (const Field* f : fields) {
      b.bytes = round_up(b.bytes, kSectionAlignment);
      b.at.push_back(b.bytes);
      b.bytes += bytes_of(section(*f, nullptr, rows_of, heads(*f, heads_of).count));
    }
    return b;
  }

  Staging staging(const std::vector<Field*>& fields, bool to_joined) const {
    Staging s;
    kernels::WorkspaceLayout send, recv;
    for (int w = 0; w < world_; ++w) {
      const size_t out = w == me_ ? 0 : block(fields, me_, w, to_joined).bytes;
      const size_t in = w == me_ ? 0 : block(fields, w, me_, to_joined).bytes;
      s.send_offsets.push_back(send.add(out));
      s.send_bytes.push_back(out);
      s.recv_offsets.push_back(recv.add(in));
      s.recv_bytes.push_back(in);
    }
    s.send_total = send.total();
    s.total = send.total() + recv.total();
    return s;
  }

  unsigned char* send_buffer() const { return workspace_.data() + staging_at_; }

  // Local rows -> joined rows of this rank's heads. Rank w gets this rank's rows of its heads.
  void to_joined(const std::vector<Field*>& fields) {
    const Staging s = staging(fields, true);
    unsigned char* send = send_buffer();
    unsigned char* recv = send + s.send_total;
    for (int w = 0; w < world_; ++w) {
      if (w == me_) continue;
      const Block b = block(fields, me_, w, true);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        const TensorView dst = section(f, send + s.send_offsets[w] + b.at[i], me_, heads(f, w).count);
        kernels::copy(local_heads(f, w), dst, stream_);  // (B, S_r, heads of w, D)
      }
    }
    comm_.all_to_all(send, s.send_bytes, s.send_offsets, recv, s.recv_bytes, s.recv_offsets);
    for (int u = 0; u < world_; ++u) {
      const Block b = block(fields, u, me_, true);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        const TensorView src = u == me_ ? local_heads(f, me_)
                                        : section(f, recv + s.recv_offsets[u] + b.at[i], u, heads(f, me_).count);
        for_each_run(plan_, u, src, batched(f.joined, p_.packed), f.row_dim(),
                     [&](const TensorView& from, const TensorView& to) { kernels::copy(from, to, stream_); });
      }
    }
  }

  // Joined rows of this rank's heads -> local rows. Rank j gets its rows of this rank's heads;
  // what arrives is copied to, or for a summed field added to, the local heads it belongs to, in
  // rank order.
  void from_joined(const std::vector<Field*>& fields) {
    const Staging s = staging(fields, false);
    unsigned char* send = send_buffer();
    unsigned char* recv = send + s.send_total;
    for (int j = 0; j < world_; ++j) {
      if (j == me_) continue;
      const Block b = block(fields, me_, j, false);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        const TensorView dst = section(f, send + s.send_offsets[j] + b.at[i], j, heads(f, me_).count);
        for_each_run(plan_, j, dst, batched(f.joined, p_.packed), f.row_dim(),
                     [&](const TensorView& to, const TensorView& from) { kernels::copy(from, to, stream_); });
      }
    }
    comm_.all_to_all(send, s.send_bytes, s.send_offsets, recv, s.recv_bytes, s.recv_offsets);
    for (int u = 0; u < world_; ++u) {
      const Block b = block(fields, u, me_, false);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        const TensorView dst = local_heads(f, u);
        if (u == me_) {
          for_each_run(plan_, me_, dst, batched(f.joined, p_.packed), f.row_dim(),
                       [&](const TensorView& to, const TensorView& from) { put(f, from, to); });
        } else {
          put(f, section(f, recv + s.recv_offsets[u] + b.at[i], me_, heads(f, u).count), dst);
        }
      }
    }
  }

  void put(const Field& f, const TensorView& src, const TensorView& dst) const {
    if (f.summed) kernels::add(src, dst, stream_);
    else kernels::copy(src, dst, stream_);
  }

  // Field f's joined tensor narrowed to the query or KV heads of segment s.
  TensorView at_segment(const Field& f, const HeadSegment& s) const {
    const HeadRange h = f.kv ? s.kv : s.q;
    return narrow(f.joined, -2, h.first - heads(f, me_).first, h.count);
  }

  // The joined problem of head segment `s` of this rank's heads, with the segment's options.
  Problem segment(const HeadSegment& s, const Field& q, const Field& k, const Field& v, const Field& out,
                  const Field& lse) const {
    Problem joined = p_;
    joined.rows = plan_.rows;
    joined.q = at_segment(q, s);
    joined.k = at_segment(k, s);
    joined.v = at_segment(v, s);
    joined.out = at_segment(out, s);
    joined.lse = at_segment(lse, s);
    joined.heads_q = s.q.count;
    joined.heads_kv = s.kv.count;
    joined.params = params_for_heads(p_.params, s.q);
    joined.params.cu_seqlens_q = joined.params.cu_seqlens_k = cu_seqlens_;
    return joined;
  }

  Communicator& comm_;
  const Problem& p_;
  const RowPlan& plan_;
  const int me_, world_;
  const HeadSplit heads_;
  const HeadRange hq_;
  const int64_t dim_;
  const Device device_;
  void* const stream_;
  // Every buffer of a call, in one allocation; each all-to-all ends before it is released.
  kernels::Workspace workspace_;
  size_t staging_at_ = 0;
  std::optional<TensorView> cu_seqlens_;  // packed: the joined rows' cu_seqlens, in the workspace
};

}  // namespace

void ulysses_exchange_forward(Communicator& comm, const Problem& p, const RowPlan& plan,
                              const JoinedAttention& attend) {
  Exchange(comm, p, plan).forward(attend);
}

void ulysses_exchange_backward(Communicator& comm, const Problem& p, const RowPlan& plan,
                               const JoinedAttention& attend) {
  Exchange(comm, p, plan).backward(attend);
}

void ulysses_forward(Communicator& comm, const Problem& p) {
  ulysses_exchange_forward(comm, p, contiguous_plan(p, comm.size()), [](const Problem& joined) {
    attention_forward(joined.q, joined.k, joined.v, joined.out, joined.lse, whole_sequence_params(joined, false));
  });
}

void ulysses_backward(Communicator& comm, const Problem& p) {
  ulysses_exchange_backward(comm, p, contiguous_plan(p, comm.size()), [](const Problem& joined) {
    attention_backward(joined.q, joined.k, joined.v, joined.out, joined.dout, joined.lse, joined.dq, joined.dk,
                       joined.dv, whole_sequence_params(joined, true));
  });
}

}  // namespace ringflash::parallel
