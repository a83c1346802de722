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

}  // namespace

void ulysses_exchange_forward(Communicator& comm, const Problem& p, const RowPlan& plan,
                              const JoinedAttention& attend) {
  const int me = comm.rank();
  const HeadSplit heads(p.heads_q, p.heads_kv, comm.size());
  const HeadRange hq = heads.q[me], hkv = heads.kv[me];
  const DType dtype = p.q.dtype();
  const Device device = p.q.device();
  const int64_t dim = p.head_dim;
  const size_t head_bytes = dim * dtype_size(dtype);

  // q (B, S_r, Hq, D), k and v (B, S_r, Hkv, D) -> (B, S, hq + 2 hkv, D): rows of [q | k | v] heads
  const auto qkv_bytes = [&](int w) { return (heads.q[w].count + 2 * heads.kv[w].count) * head_bytes; };
  std::vector<char> qkv = to_joined_rows(comm, plan, qkv_bytes, [&](int w, int64_t r, char* dst) {
    dst = copy_heads(p.q, r, heads.q[w], dst);
    dst = copy_heads(p.k, r, heads.kv[w], dst);
    copy_heads(p.v, r, heads.kv[w], dst);
  });
  const JoinedHeads in{plan, qkv.data(), dtype, device, (hq.count + 2 * hkv.count) * dim, dim};
  std::vector<char> out(plan.rows * hq.count * head_bytes);
  std::vector<float> lse(plan.rows * hq.count);
  const JoinedHeads out_heads{plan, out.data(), dtype, device, hq.count * dim, dim};
  const TensorView lse_all = joined_lse(plan, lse.data(), device, hq.count);  // (B, hq, S)

  Problem joined = p;
  joined.rows = plan.rows;
  for (const HeadSegment& s : head_segments(hq, p.heads_q / p.heads_kv)) {
    const int64_t q0 = s.q.first - hq.first, kv0 = s.kv.first - hkv.first;
    joined.q = in.heads(q0, s.q.count);
    joined.k = in.heads(hq.count + kv0, s.kv.count);
    joined.v = in.heads(hq.count + hkv.count + kv0, s.kv.count);
    joined.out = out_heads.heads(q0, s.q.count);
    joined.lse = narrow(lse_all, -2, q0, s.q.count);
    joined.heads_q = s.q.count;
    joined.heads_kv = s.kv.count;
    joined.params = params_for_heads(p.params, s.q);
    attend(joined);
  }

  // out (B, S, hq, D) and lse (B, hq, S) -> out (B, S_r, Hq, D) and lse (B, Hq, S_r)
  const auto out_bytes = [&](int u) { return heads.q[u].count * (head_bytes + sizeof(float)); };
  from_joined_rows(
      comm, plan, out_bytes,
      [&](int64_t t, char* dst) {
        if (hq.count > 0) std::memcpy(dst, out.data() + t * hq.count * head_bytes, hq.count * head_bytes);
        copy_lse(lse_all, t, {0, hq.count}, dst + hq.count * head_bytes);
      },
      [&](int u, int64_t r, const char* src) {
        src = paste_heads(src, p.out, r, heads.q[u]);
        paste_lse(src, p.lse, r, heads.q[u]);
      });
}

void ulysses_exchange_backward(Communicator& comm, const Problem& p, const RowPlan& plan,
                               const JoinedAttention& attend) {
  const int me = comm.rank();
  const HeadSplit heads(p.heads_q, p.heads_kv, comm.size());
  const HeadRange hq = heads.q[me], hkv = heads.kv[me];
  const DType dtype = p.q.dtype();
  const Device device = p.q.device();
  const int64_t dim = p.head_dim;
  const size_t head_bytes = dim * dtype_size(dtype);

  // q, dout (B, S_r, Hq, D), k, v (B, S_r, Hkv, D), out (B, S_r, Hq, D) in its dtype, lse (B, Hq, S_r)
  //   -> rows of [q | k | v | dout] heads (B, S, 2 hq + 2 hkv, D), then hq out heads, then hq lse values
  const DType out_dtype = p.out.dtype();  // the input dtype or fp32
  const size_t out_head_bytes = dim * dtype_size(out_dtype);
  const auto in_bytes = [&](int w) {
    const int64_t nq = heads.q[w].count, nkv = heads.kv[w].count;
    return (2 * nq + 2 * nkv) * head_bytes + nq * (out_head_bytes + sizeof(float));
  };
  std::vector<char> rows = to_joined_rows(comm, plan, in_bytes, [&](int w, int64_t r, char* dst) {
    dst = copy_heads(p.q, r, heads.q[w], dst);
    dst = copy_heads(p.k, r, heads.kv[w], dst);
    dst = copy_heads(p.v, r, heads.kv[w], dst);
    dst = copy_heads(p.dout, r, heads.q[w], dst);
    dst = copy_heads(p.out, r, heads.q[w], dst);
    copy_lse(p.lse, r, heads.q[w], dst);
  });
  // The out heads and lse values of every joined row -> out (B, S, hq, D) and lse (B, hq, S)
  const size_t row_bytes = in_bytes(me), out_offset = (2 * hq.count + 2 * hkv.count) * head_bytes;
  const size_t out_row_bytes = hq.count * out_head_bytes;
  const JoinedHeads in{plan, rows.data(), dtype, device, static_cast<int64_t>(row_bytes / dtype_size(dtype)), dim};
  std::vector<char> out(plan.rows * out_row_bytes);
  std::vector<float> lse(plan.rows * hq.count);
  const JoinedHeads out_heads{plan, out.data(), out_dtype, device, hq.count * dim, dim};
  const TensorView lse_all = joined_lse(plan, lse.data(), device, hq.count);
  for (int64_t t = 0; t < plan.rows; ++t) {
    const char* src = rows.data() + t * row_bytes + out_offset;
    if (out_row_bytes > 0) std::memcpy(out.data() + t * out_row_bytes, src, out_row_bytes);
    paste_lse(src + out_row_bytes, lse_all, t, {0, hq.count});
  }

  // fp32 gradients of the joined rows: dq (B, S, hq, D), dk and dv (B, S, hkv, D)
  std::vector<float> dq(plan.rows * hq.count * dim), dk(plan.rows * hkv.count * dim), dv(dk.size());
  const JoinedHeads dq_heads{plan, dq.data(), DType::kFloat32, device, hq.count * dim, dim};
  const JoinedHeads dk_heads{plan, dk.data(), DType::kFloat32, device, hkv.count * dim, dim};
  const JoinedHeads dv_heads{plan, dv.data(), DType::kFloat32, device, hkv.count * dim, dim};
  Problem joined = p;
  joined.rows = plan.rows;
  for (const HeadSegment& s : head_segments(hq, p.heads_q / p.heads_kv)) {
    const int64_t q0 = s.q.first - hq.first, kv0 = s.kv.first - hkv.first;
    joined.q = in.heads(q0, s.q.count);
    joined.k = in.heads(hq.count + kv0, s.kv.count);
    joined.v = in.heads(hq.count + hkv.count + kv0, s.kv.count);
    joined.dout = in.heads(hq.count + 2 * hkv.count + q0, s.q.count);
    joined.out = out_heads.heads(q0, s.q.count);
    joined.lse = narrow(lse_all, -2, q0, s.q.count);
    joined.dq = dq_heads.heads(q0, s.q.count);
    joined.dk = dk_heads.heads(kv0, s.kv.count);
    joined.dv = dv_heads.heads(kv0, s.kv.count);
    joined.heads_q = s.q.count;
    joined.heads_kv = s.kv.count;
    joined.params = params_for_heads(p.params, s.q);
    attend(joined);
  }

  // dq (B, S, hq, D) in the input dtype, dk and dv (B, S, hkv, D) in `wire`
  //   -> dq (B, S_r, Hq, D), and every replica of dk and dv summed into (B * S_r, Hkv, D) fp32.
  // Without replicas a KV head's gradient is final on the rank that computed it, so it travels in
  // the input dtype; with replicas the partial sums travel in fp32.
  const DType wire = heads.kv_replicated ? DType::kFloat32 : dtype;
  const size_t wire_head_bytes = dim * dtype_size(wire);
  const auto grad_bytes = [&](int u) {
    return heads.q[u].count * head_bytes + 2 * heads.kv[u].count * wire_head_bytes;
  };
  std::vector<float> dk_sum(plan.local_rows[me] * p.heads_kv * dim), dv_sum(dk_sum.size());
  from_joined_rows(
      comm, plan, grad_bytes,
      [&](int64_t t, char* dst) {
        dst = store_floats(dq.data() + t * hq.count * dim, hq.count * dim, dtype, dst);
        dst = store_floats(dk.data() + t * hkv.count * dim, hkv.count * dim, wire, dst);
        store_floats(dv.data() + t * hkv.count * dim, hkv.count * dim, wire, dst);
      },
      [&](int u, int64_t r, const char* src) {
        src = paste_heads(src, p.dq, r, heads.q[u]);
        const int64_t n = heads.kv[u].count * dim, at = (r * p.heads_kv + heads.kv[u].first) * dim;
        add_as_float(src, wire, n, &dk_sum[at]);
        add_as_float(src + n * dtype_size(wire), wire, n, &dv_sum[at]);
      });

  // (B * S_r, Hkv, D) fp32 -> dk and dv (B, S_r, Hkv, D)
  for (int64_t r = 0; r < plan.local_rows[me]; ++r)
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      store_floats(&dk_sum[(r * p.heads_kv + h) * dim], dim, dtype, head_ptr(p.dk, r, h));
      store_floats(&dv_sum[(r * p.heads_kv + h) * dim], dim, dtype, head_ptr(p.dv, r, h));
    }
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
