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
// Pipeline. Where every KV head is read on one rank, ulysses moves the heads in parts: every
// rank's KV heads cut into up to kMaxParts parts (with the query heads that read them), each part
// an all-to-all of its own, so that the next part's all-to-all runs while the kernels work on this
// one, and this part's out and lse travel back while they work on the next. Only the first part's
// way in and the last part's way back run beside no kernel.
//
// Buffers. One workspace on the tensors' device holds this rank's heads of the joined rows of
// every tensor, and the staging memory of the all-to-alls: two slots each way when pipelined (a
// part's slot is free again once the part two before it has landed), else one that both ways use
// in turn. The block that one rank sends another holds one contiguous section per tensor, packed
// by one kernels::copy of a strided view; the joined tensors are filled from the sections by one
// copy per rank (per rank and sequence when packed). A rank's own part skips the all-to-all and is
// copied in place.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
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

// Parts of a pipelined exchange at most: the way in of the first and the way back of the last run
// alone, a 1 / kMaxParts share each, and each part's kernels see a kMaxParts-th of the heads.
constexpr int64_t kMaxParts = 2;

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

// The parts of a pipelined exchange (see the top): every rank's KV heads cut into the same number
// of parts, each with the query heads that read its KV heads. One part, the whole split, where a
// KV head is read on several ranks or a rank has fewer than two KV heads.
std::vector<HeadSplit> pipeline_parts(const HeadSplit& all, int64_t group, bool pipelined) {
  int64_t n = pipelined && !all.kv_replicated ? kMaxParts : 1;
  for (const HeadRange& kv : all.kv) n = std::min(n, kv.count);
  if (n < 2) return {all};
  std::vector<HeadSplit> parts(static_cast<size_t>(n));
  for (const HeadRange& kv : all.kv)
    for (int64_t c = 0; c < n; ++c) {
      const int64_t begin = kv.count * c / n, end = kv.count * (c + 1) / n;
      const HeadRange part{kv.first + begin, end - begin};
      parts[c].kv.push_back(part);
      parts[c].q.push_back({part.first * group, part.count * group});  // whole groups: nothing replicated
    }
  return parts;
}

// One rank's side of the exchange over `comm`: every rank's heads, and this rank's query heads hq.
class Exchange {
 public:
  Exchange(Communicator& comm, const Problem& p, const RowPlan& plan, bool pipelined)
      : comm_(comm),
        p_(p),
        plan_(plan),
        me_(comm.rank()),
        world_(comm.size()),
        group_(p.heads_q / p.heads_kv),
        heads_(p.heads_q, p.heads_kv, world_),
        parts_(pipeline_parts(heads_, group_, pipelined)),
        dim_(p.head_dim),
        device_(p.q.device()),
        stream_(p.params.stream) {}

  void forward(const JoinedAttention& attend) {
    Field q = tokens(p_.q, false), k = tokens(p_.k, true), v = tokens(p_.v, true);
    Field out = tokens(p_.out, false), lse = lse_of(p_.lse);
    const std::vector<Field*> in{&q, &k, &v}, back{&out, &lse};
    kernels::WorkspaceLayout layout;
    allocate(layout, in, back);

    // q (B, S_r, Hq, D), k and v (B, S_r, Hkv, D) -> (B, S, hq, D), (B, S, hkv, D); then
    // out (B, S, hq, D), lse (B, hq, S) -> out (B, S_r, Hq, D), lse (B, Hq, S_r)
    pipeline(in, back, [&](const HeadSegment& s) { attend(segment(s, q, k, v, out, lse)); });
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

    // With replicas (one part) what comes back is summed in fp32 first.
    if (sum) {
      dk.local = contiguous_like(workspace_.data() + sums_at[0], DType::kFloat32, p_.dk);
      dv.local = contiguous_like(workspace_.data() + sums_at[1], DType::kFloat32, p_.dv);
      kernels::fill(dk.local, 0.0f, stream_);
      kernels::fill(dv.local, 0.0f, stream_);
    }
    for (Field* g : grads) kernels::fill(g->joined, 0.0f, stream_);
    // q, dout, out (B, S_r, Hq, D), k, v (B, S_r, Hkv, D), lse (B, Hq, S_r)
    //   -> (B, S, hq, D), (B, S, hkv, D) and lse (B, hq, S); then
    // dq (B, S, hq, D), dk and dv (B, S, hkv, D) fp32 -> dq (B, S_r, Hq, D), dk and dv (B, S_r, Hkv, D)
    pipeline(in, grads, [&](const HeadSegment& s) {
      Problem joined = segment(s, q, k, v, out, lse);
      joined.dout = at_segment(dout, s);
      joined.dq = at_segment(dq, s);
      joined.dk = at_segment(dk, s);
      joined.dv = at_segment(dv, s);
      attend(joined);
    });
    if (sum) {
      kernels::copy(dk.local, p_.dk, stream_);
      kernels::copy(dv.local, p_.dv, stream_);
    }
  }

 private:
  // Every part in turn: its way in (`in`), `attend` on each head segment of it, its way back
  // (`back`); the next part's way in and the last part's way back travel while a part's kernels
  // run (see the top). `part_` is the part that the staging and the sections describe.
  void pipeline(const std::vector<Field*>& in, const std::vector<Field*>& back,
                const std::function<void(const HeadSegment&)>& attend) {
    const size_t n = parts_.size();
    std::unique_ptr<CommRequest> coming[2], going[2];
    const auto send_in = [&](size_t c) {
      part_ = &parts_[c];
      coming[c % 2] = post(in, true, slot(true, c % 2));
    };
    const auto land_back = [&](size_t c) {
      part_ = &parts_[c];
      going[c % 2]->wait();
      going[c % 2].reset();
      land(back, false, slot(false, c % 2));
    };
    send_in(0);
    for (size_t c = 0; c < n; ++c) {
      part_ = &parts_[c];
      coming[c % 2]->wait();
      coming[c % 2].reset();
      land(in, true, slot(true, c % 2));
      if (c + 1 < n) send_in(c + 1);
      part_ = &parts_[c];
      for (const HeadSegment& s : head_segments(parts_[c].q[me_], group_)) attend(s);
      if (c >= 2) land_back(c - 2);  // frees the slot this part's way back takes
      part_ = &parts_[c];
      going[c % 2] = post(back, false, slot(false, c % 2));
    }
    for (size_t c = n >= 2 ? n - 2 : 0; c < n; ++c) land_back(c);
  }

  // Heads of `rank` in the part being moved, and in all (what the joined tensors hold).
  HeadRange heads(const Field& f, int rank) const { return f.kv ? part_->kv[rank] : part_->q[rank]; }
  HeadRange all_heads(const Field& f, int rank) const { return f.kv ? heads_.kv[rank] : heads_.q[rank]; }

  // This rank's heads of the part being moved, in f's joined tensor.
  TensorView joined_part(const Field& f) const {
    const HeadRange h = heads(f, me_);
    return narrow(f.joined, -2, h.first - all_heads(f, me_).first, h.count);
  }

  // Field f's local tensor narrowed to `rank`'s heads, batched.
  TensorView local_heads(const Field& f, int rank) const {
    return narrow(batched(f.local, p_.packed), f.head_dim(), heads(f, rank));
  }

  // This rank's heads of the joined rows of f at `data` (null: only the shape).
  TensorView joined_view(const Field& f, void* data) const {
    const int64_t count = all_heads(f, me_).count;
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
  // staging slots; then the workspace, the joined views and, when packed, the cu_seqlens.
  void allocate(kernels::WorkspaceLayout& layout, const std::vector<Field*>& in, const std::vector<Field*>& back) {
    std::vector<size_t> joined_at;
    for (const auto* fields : {&in, &back})
      for (const Field* f : *fields) joined_at.push_back(layout.add(bytes_of(joined_view(*f, nullptr))));
    const size_t cu_at = layout.add(p_.packed ? static_cast<size_t>(plan_.batch + 1) * sizeof(int32_t) : 0);
    size_t in_bytes = 0, back_bytes = 0;
    for (const HeadSplit& part : parts_) {
      part_ = &part;
      in_bytes = std::max(in_bytes, staging(in, true).total);
      back_bytes = std::max(back_bytes, staging(back, false).total);
    }
    if (parts_.size() == 1) {  // one slot, each way in turn
      slots_at_[0][0] = slots_at_[1][0] = layout.add(std::max(in_bytes, back_bytes));
    } else {
      for (size_t j = 0; j < 2; ++j) {
        slots_at_[1][j] = layout.add(in_bytes);
        slots_at_[0][j] = layout.add(back_bytes);
      }
    }
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

  // The staging slot j of one way (to_joined: toward the joined rows).
  unsigned char* slot(bool to_joined, size_t j) const { return workspace_.data() + slots_at_[to_joined][j]; }

  // Packs the part's blocks of `fields` into the slot at `at` and posts their all-to-all. Toward
  // the joined rows rank w gets this rank's rows of w's heads; back, rank j gets its rows of this
  // rank's heads.
  std::unique_ptr<CommRequest> post(const std::vector<Field*>& fields, bool to_joined, unsigned char* at) {
    const Staging s = staging(fields, to_joined);
    unsigned char* recv = at + s.send_total;
    std::vector<P2POp> ops;
    for (int w = 0; w < world_; ++w) {
      if (w == me_) continue;
      const Block b = block(fields, me_, w, to_joined);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        unsigned char* data = at + s.send_offsets[w] + b.at[i];
        if (to_joined) {
          kernels::copy(local_heads(f, w), section(f, data, me_, heads(f, w).count), stream_);  // (B, S_r, heads of w, D)
        } else {
          for_each_run(plan_, w, section(f, data, w, heads(f, me_).count), batched(joined_part(f), p_.packed),
                       f.row_dim(),
                       [&](const TensorView& to, const TensorView& from) { kernels::copy(from, to, stream_); });
        }
      }
      ops.push_back(recv_op(w, recv + s.recv_offsets[w], s.recv_bytes[w]));
      ops.push_back(send_op(w, at + s.send_offsets[w], s.send_bytes[w]));
    }
    return comm_.send_recv(ops);
  }

  // After the all-to-all of `post`: toward the joined rows, every rank's sections (this rank's own
  // rows from the local tensors) into the joined tensors; back, into the local heads they belong
  // to, copied, or for a summed field added, in rank order.
  void land(const std::vector<Field*>& fields, bool to_joined, unsigned char* at) {
    const Staging s = staging(fields, to_joined);
    unsigned char* recv = at + s.send_total;
    for (int u = 0; u < world_; ++u) {
      const Block b = block(fields, u, me_, to_joined);
      for (size_t i = 0; i < fields.size(); ++i) {
        const Field& f = *fields[i];
        unsigned char* data = recv + s.recv_offsets[u] + b.at[i];
        if (to_joined) {
          const TensorView src = u == me_ ? local_heads(f, me_) : section(f, data, u, heads(f, me_).count);
          for_each_run(plan_, u, src, batched(joined_part(f), p_.packed), f.row_dim(),
                       [&](const TensorView& from, const TensorView& to) { kernels::copy(from, to, stream_); });
        } else if (u == me_) {
          for_each_run(plan_, me_, local_heads(f, me_), batched(joined_part(f), p_.packed), f.row_dim(),
                       [&](const TensorView& to, const TensorView& from) { put(f, from, to); });
        } else {
          put(f, section(f, data, me_, heads(f, u).count), local_heads(f, u));
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
    return narrow(f.joined, -2, h.first - all_heads(f, me_).first, h.count);
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
  const int64_t group_;  // query heads per KV head
  const HeadSplit heads_;
  const std::vector<HeadSplit> parts_;
  const HeadSplit* part_ = &heads_;  // the part that heads() describes
  const int64_t dim_;
  const Device device_;
  void* const stream_;
  // Every buffer of a call, in one allocation; each all-to-all ends before it is released.
  kernels::Workspace workspace_;
  size_t slots_at_[2][2] = {};  // [toward the joined rows][slot]
  std::optional<TensorView> cu_seqlens_;  // packed: the joined rows' cu_seqlens, in the workspace
};

}  // namespace

void ulysses_exchange_forward(Communicator& comm, const Problem& p, const RowPlan& plan, const JoinedAttention& attend,
                              bool pipelined) {
  Exchange(comm, p, plan, pipelined).forward(attend);
}

void ulysses_exchange_backward(Communicator& comm, const Problem& p, const RowPlan& plan,
                               const JoinedAttention& attend, bool pipelined) {
  Exchange(comm, p, plan, pipelined).backward(attend);
}

void ulysses_forward(Communicator& comm, const Problem& p) {
  ulysses_exchange_forward(
      comm, p, contiguous_plan(p, comm.size()),
      [](const Problem& joined) {
        attention_forward(joined.q, joined.k, joined.v, joined.out, joined.lse, whole_sequence_params(joined, false));
      },
      true);
}

void ulysses_backward(Communicator& comm, const Problem& p) {
  ulysses_exchange_backward(
      comm, p, contiguous_plan(p, comm.size()),
      [](const Problem& joined) {
        attention_backward(joined.q, joined.k, joined.v, joined.out, joined.dout, joined.lse, joined.dq, joined.dk,
                           joined.dv, whole_sequence_params(joined, true));
      },
      true);
}

}  // namespace ringflash::parallel
