// ulysses: all-to-all from sequence shards to head shards and back.
//
// Rank u of P holds contiguous rows of every head. One all-to-all gives it every row of its query
// heads (heads cut in order, the first Hq % P ranks one more) and of exactly the KV heads those
// read. It runs the single-device kernel over whole sequences, and a second all-to-all returns out
// and lse to the ranks that hold the rows. A KV head read on several ranks (P > Hkv, or a group of
// query heads split between ranks) is sent to each of them once; in the backward its gradients
// come back from each and are summed in fp32.
//
// Query heads that read their KV heads at one ratio go to one kernel call: with a group split
// between ranks, a rank's heads are a part of one group, whole groups and a part of one group.
#include <cstring>
#include <vector>

#include "reshard.h"
#include "strategy.h"

namespace ringflash::parallel {
namespace {

// The caller's options for a kernel call over whole sequences: positions from 0, packed batches
// by their global cu_seqlens.
AttentionParams whole_sequence_params(const Problem& joined, bool accumulate) {
  AttentionParams params = joined.params;
  params.q_offset = 0;
  params.k_offset = 0;
  params.q_seq_offsets.reset();
  params.k_seq_offsets.reset();
  params.cu_seqlens_q.reset();
  params.cu_seqlens_k.reset();
  if (joined.packed) {
    // The kernel only reads cu_seqlens.
    const TensorView cu(const_cast<int32_t*>(joined.cu_seqlens.data()), DType::kInt32, joined.q.device(),
                        {static_cast<int64_t>(joined.cu_seqlens.size())});
    params.cu_seqlens_q = params.cu_seqlens_k = cu;
  }
  params.accumulate = accumulate;
  return params;
}

// A joined buffer whose rows hold fields of whole heads side by side, `row_elems` elements apart.
struct JoinedHeads {
  const RowPlan& plan;
  void* data;
  DType dtype;
  Device device;
  int64_t row_elems, dim;
  // Heads [first, first + count) of every row.
  TensorView heads(int64_t first, int64_t count) const {
    return joined_view(plan, data, dtype, device, row_elems, first, count, dim);
  }
};

// One rank's side of the exchange over `comm`: every rank's heads, this rank's (hq, hkv), and the
// bytes of one head of one row in the input dtype.
class Exchange {
 public:
  Exchange(Communicator& comm, const Problem& p, const RowPlan& plan)
      : comm_(comm),
        p_(p),
        plan_(plan),
        me_(comm.rank()),
        heads_(p.heads_q, p.heads_kv, comm.size()),
        hq_(heads_.q[me_]),
        hkv_(heads_.kv[me_]),
        dtype_(p.q.dtype()),
        device_(p.q.device()),
        dim_(p.head_dim),
        head_bytes_(dim_ * dtype_size(dtype_)) {}

  void forward(const JoinedAttention& attend) {
    // q (B, S_r, Hq, D), k and v (B, S_r, Hkv, D) -> (B, S, hq + 2 hkv, D): rows of [q | k | v] heads
    const auto qkv_bytes = [&](int w) { return (heads_.q[w].count + 2 * heads_.kv[w].count) * head_bytes_; };
    std::vector<char> qkv = to_joined_rows(comm_, plan_, qkv_bytes, [&](int w, int64_t r, char* dst) {
      dst = copy_heads(p_.q, r, heads_.q[w], dst);
      dst = copy_heads(p_.k, r, heads_.kv[w], dst);
      copy_heads(p_.v, r, heads_.kv[w], dst);
    });
    const JoinedHeads in{plan_, qkv.data(), dtype_, device_, (hq_.count + 2 * hkv_.count) * dim_, dim_};
    std::vector<char> out(plan_.rows * hq_.count * head_bytes_);
    std::vector<float> lse(plan_.rows * hq_.count);
    const JoinedHeads out_heads{plan_, out.data(), dtype_, device_, hq_.count * dim_, dim_};
    const TensorView lse_all = joined_lse(plan_, lse.data(), device_, hq_.count);  // (B, hq, S)

    for (const HeadSegment& s : head_segments(hq_, p_.heads_q / p_.heads_kv))
      attend(segment(s, in, out_heads, lse_all));

    // out (B, S, hq, D) and lse (B, hq, S) -> out (B, S_r, Hq, D) and lse (B, Hq, S_r)
    const auto out_bytes = [&](int u) { return heads_.q[u].count * (head_bytes_ + sizeof(float)); };
    from_joined_rows(
        comm_, plan_, out_bytes,
        [&](int64_t t, char* dst) {
          if (hq_.count > 0) std::memcpy(dst, out.data() + t * hq_.count * head_bytes_, hq_.count * head_bytes_);
          copy_lse(lse_all, t, {0, hq_.count}, dst + hq_.count * head_bytes_);
        },
        [&](int u, int64_t r, const char* src) {
          src = paste_heads(src, p_.out, r, heads_.q[u]);
          paste_lse(src, p_.lse, r, heads_.q[u]);
        });
  }

  void backward(const JoinedAttention& attend) {
    // q, dout (B, S_r, Hq, D), k, v (B, S_r, Hkv, D), out (B, S_r, Hq, D) in its dtype, lse (B, Hq, S_r)
    //   -> rows of [q | k | v | dout] heads (B, S, 2 hq + 2 hkv, D), then hq out heads, then hq lse values
    const DType out_dtype = p_.out.dtype();  // the input dtype or fp32
    const size_t out_head_bytes = dim_ * dtype_size(out_dtype);
    const auto in_bytes = [&](int w) {
      const int64_t nq = heads_.q[w].count, nkv = heads_.kv[w].count;
      return (2 * nq + 2 * nkv) * head_bytes_ + nq * (out_head_bytes + sizeof(float));
    };
    std::vector<char> rows = to_joined_rows(comm_, plan_, in_bytes, [&](int w, int64_t r, char* dst) {
      dst = copy_heads(p_.q, r, heads_.q[w], dst);
      dst = copy_heads(p_.k, r, heads_.kv[w], dst);
      dst = copy_heads(p_.v, r, heads_.kv[w], dst);
      dst = copy_heads(p_.dout, r, heads_.q[w], dst);
      dst = copy_heads(p_.out, r, heads_.q[w], dst);
      copy_lse(p_.lse, r, heads_.q[w], dst);
    });
    // The out heads and lse values of every joined row -> out (B, S, hq, D) and lse (B, hq, S)
    const size_t row_bytes = in_bytes(me_), out_offset = (2 * hq_.count + 2 * hkv_.count) * head_bytes_;
    const size_t out_row_bytes = hq_.count * out_head_bytes;
    const JoinedHeads in{plan_, rows.data(), dtype_, device_, static_cast<int64_t>(row_bytes / dtype_size(dtype_)),
                         dim_};
    std::vector<char> out(plan_.rows * out_row_bytes);
    std::vector<float> lse(plan_.rows * hq_.count);
    const JoinedHeads out_heads{plan_, out.data(), out_dtype, device_, hq_.count * dim_, dim_};
    const TensorView lse_all = joined_lse(plan_, lse.data(), device_, hq_.count);
    for (int64_t t = 0; t < plan_.rows; ++t) {
      const char* src = rows.data() + t * row_bytes + out_offset;
      if (out_row_bytes > 0) std::memcpy(out.data() + t * out_row_bytes, src, out_row_bytes);
      paste_lse(src + out_row_bytes, lse_all, t, {0, hq_.count});
    }

    // fp32 gradients of the joined rows: dq (B, S, hq, D), dk and dv (B, S, hkv, D)
    std::vector<float> dq(plan_.rows * hq_.count * dim_), dk(plan_.rows * hkv_.count * dim_), dv(dk.size());
    const JoinedHeads dq_heads{plan_, dq.data(), DType::kFloat32, device_, hq_.count * dim_, dim_};
    const JoinedHeads dk_heads{plan_, dk.data(), DType::kFloat32, device_, hkv_.count * dim_, dim_};
    const JoinedHeads dv_heads{plan_, dv.data(), DType::kFloat32, device_, hkv_.count * dim_, dim_};
    for (const HeadSegment& s : head_segments(hq_, p_.heads_q / p_.heads_kv)) {
      Problem joined = segment(s, in, out_heads, lse_all);
      const int64_t q0 = s.q.first - hq_.first, kv0 = s.kv.first - hkv_.first;
      joined.dout = in.heads(hq_.count + 2 * hkv_.count + q0, s.q.count);
      joined.dq = dq_heads.heads(q0, s.q.count);
      joined.dk = dk_heads.heads(kv0, s.kv.count);
      joined.dv = dv_heads.heads(kv0, s.kv.count);
      attend(joined);
    }

    // dq (B, S, hq, D) in the input dtype, dk and dv (B, S, hkv, D) in `wire`
    //   -> dq (B, S_r, Hq, D), and every replica of dk and dv summed into (B * S_r, Hkv, D) fp32.
    // Without replicas a KV head's gradient is final on the rank that computed it, so it travels in
    // the input dtype; with replicas the partial sums travel in fp32.
    const DType wire = heads_.kv_replicated ? DType::kFloat32 : dtype_;
    const size_t wire_head_bytes = dim_ * dtype_size(wire);
    const auto grad_bytes = [&](int u) {
      return heads_.q[u].count * head_bytes_ + 2 * heads_.kv[u].count * wire_head_bytes;
    };
    std::vector<float> dk_sum(plan_.local_rows[me_] * p_.heads_kv * dim_), dv_sum(dk_sum.size());
    from_joined_rows(
        comm_, plan_, grad_bytes,
        [&](int64_t t, char* dst) {
          dst = store_floats(dq.data() + t * hq_.count * dim_, hq_.count * dim_, dtype_, dst);
          dst = store_floats(dk.data() + t * hkv_.count * dim_, hkv_.count * dim_, wire, dst);
          store_floats(dv.data() + t * hkv_.count * dim_, hkv_.count * dim_, wire, dst);
        },
        [&](int u, int64_t r, const char* src) {
          src = paste_heads(src, p_.dq, r, heads_.q[u]);
          const int64_t n = heads_.kv[u].count * dim_, at = (r * p_.heads_kv + heads_.kv[u].first) * dim_;
          add_as_float(src, wire, n, &dk_sum[at]);
          add_as_float(src + n * dtype_size(wire), wire, n, &dv_sum[at]);
        });

    // (B * S_r, Hkv, D) fp32 -> dk and dv (B, S_r, Hkv, D)
    for (int64_t r = 0; r < plan_.local_rows[me_]; ++r)
      for (int64_t h = 0; h < p_.heads_kv; ++h) {
        store_floats(&dk_sum[(r * p_.heads_kv + h) * dim_], dim_, dtype_, head_ptr(p_.dk, r, h));
        store_floats(&dv_sum[(r * p_.heads_kv + h) * dim_], dim_, dtype_, head_ptr(p_.dv, r, h));
      }
  }

 private:
  // The joined problem of head segment `s` of this rank's heads: q, k and v from `in`, whose rows
  // begin with [q | k | v] heads, out and lse from `out` and `lse`, and the segment's options.
  Problem segment(const HeadSegment& s, const JoinedHeads& in, const JoinedHeads& out, const TensorView& lse) const {
    const int64_t q0 = s.q.first - hq_.first, kv0 = s.kv.first - hkv_.first;
    Problem joined = p_;
    joined.rows = plan_.rows;
    joined.q = in.heads(q0, s.q.count);
    joined.k = in.heads(hq_.count + kv0, s.kv.count);
    joined.v = in.heads(hq_.count + hkv_.count + kv0, s.kv.count);
    joined.out = out.heads(q0, s.q.count);
    joined.lse = narrow(lse, -2, q0, s.q.count);
    joined.heads_q = s.q.count;
    joined.heads_kv = s.kv.count;
    joined.params = params_for_heads(p_.params, s.q);
    return joined;
  }

  Communicator& comm_;
  const Problem& p_;
  const RowPlan& plan_;
  const int me_;
  const HeadSplit heads_;
  const HeadRange hq_, hkv_;
  const DType dtype_;
  const Device device_;
  const int64_t dim_;
  const size_t head_bytes_;
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
