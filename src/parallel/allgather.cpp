// allgather: K and V gathered from every rank, a slice of KV heads at a time.
//
// Every rank holds contiguous rows of the sequence. For each slice of options.kv_heads_per_gather
// KV heads, every rank's K and V rows of the slice are gathered; they are put in global order and
// this rank's queries of the slice's query heads attend to all of them, at global positions, in one
// kernel call. The gather of the next slice is in flight while a slice computes. The slice bounds
// the gathered K and V to (B, S, slice, D) each, and each KV head is gathered once whatever the
// number of query heads reading it.
//
// Backward gathers K and V again per slice, computes dq for this rank's rows and dk, dv for every
// gathered row in fp32; these are summed over ranks (a reduce-scatter in rank order) so that each
// rank gets its own rows.
//
// A rank's K/V rows go only to the ranks with a query that the mask lets see one of them: with a
// causal mask, rank j gathers from ranks 0..j alone, and a window skips farther ranks. Rows that
// are not sent are zeros in the gathered K/V (every query is masked from them), and their dK/dV
// partial sums, zero too, are not sent back.
//
// Buffers. One workspace on the tensors' device holds every buffer of a call. Rank j's K/V rows of
// a slice travel as one block, (2, B, S_j, slice, D), to its place in a buffer in rank order, and
// are copied from there to their place in the gathered K and V by one kernels::copy per tensor (per
// tensor and sequence when packed); the dK/dV partial sums travel back the same way.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../kernels/ops.h"
#include "reshard.h"
#include "strategy.h"
#include "views.h"

namespace ringflash::parallel {
namespace {

// Slices of at most options.kv_heads_per_gather KV heads (0: all at once).
std::vector<HeadRange> kv_slices(const Problem& p, const ParallelOptions& options) {
  const int64_t per = options.kv_heads_per_gather > 0 ? std::min(options.kv_heads_per_gather, p.heads_kv) : p.heads_kv;
  std::vector<HeadRange> slices;
  for (int64_t h = 0; h < p.heads_kv; h += per) slices.push_back({h, std::min(per, p.heads_kv - h)});
  return slices;
}

// A window at least this wide is unbounded: no position difference reaches it.
constexpr int64_t kUnboundedWindow = int64_t{1} << 50;

// Which ranks' queries may see which ranks' keys under the mask of `params`, for every pair.
class Visibility {
 public:
  Visibility(const RowPlan& plan, const AttentionParams& params) : world_(static_cast<int>(plan.counts.size())) {
    const int64_t left = params.window_left < 0 ? kUnboundedWindow : params.window_left;
    int64_t right = params.window_right < 0 ? kUnboundedWindow : params.window_right;
    if (params.causal) right = std::min<int64_t>(right, 0);
    seen_.assign(static_cast<size_t>(world_) * world_, false);
    for (int q = 0; q < world_; ++q)
      for (int k = 0; k < world_; ++k)
        for (int64_t b = 0; b < plan.batch; ++b) {
          const int64_t nq = plan.counts[q][b], nk = plan.counts[k][b];
          const int64_t q0 = plan.joined_first[q][b] - plan.joined_first[0][b];
          const int64_t k0 = plan.joined_first[k][b] - plan.joined_first[0][b];
          // Keys [k0, k0 + nk) meet the positions [q0 - left, q0 + nq - 1 + right] that some query sees.
          if (nq > 0 && nk > 0 && k0 <= q0 + nq - 1 + right && k0 + nk - 1 >= q0 - left) seen_[q * world_ + k] = true;
        }
  }

  // Whether some query of rank `queries` may see some key of rank `keys`.
  bool sees(int queries, int keys) const { return seen_[queries * world_ + keys]; }

  // Whether some query of a rank other than `keys` may see one of its keys.
  bool seen_by_others(int keys) const {
    for (int q = 0; q < world_; ++q)
      if (q != keys && sees(q, keys)) return true;
    return false;
  }

 private:
  int world_;
  std::vector<bool> seen_;
};


// One rank's K and V (or dK and dV) rows of a slice, batched: (B, rows, slice, D) each.
struct KeyValues {
  TensorView k, v;
};

// One rank's side of allgather over `comm`.
class AllGather {
 public:
  AllGather(Communicator& comm, const Problem& p, const ParallelOptions& options)
      : comm_(comm),
        p_(p),
        me_(comm.rank()),
        world_(comm.size()),
        plan_(contiguous_plan(p, world_)),
        slices_(kv_slices(p, options)),
        group_(p.heads_q / p.heads_kv),
        widest_(slices_.empty() ? 0 : slices_[0].count),
        visible_(plan_, p.params),
        dtype_(p.k.dtype()),
        dim_(p.head_dim),
        device_(p.q.device()),
        stream_(p.params.stream) {}

  void forward() {
    kernels::WorkspaceLayout layout;
    plan_gather(layout);
    allocate(layout);
    for_each_slice([&](HeadRange slice, const TensorView& k, const TensorView& v) {
      const HeadRange q = query_heads_of(slice);
      attention_forward(narrow(p_.q, -2, q), k, v, narrow(p_.out, -2, q), narrow(p_.lse, -2, q), params(q, false));
    });
  }

  void backward() {
    const int64_t local_rows = plan_.local_rows[me_], kv_elems = widest_ * dim_;
    kernels::WorkspaceLayout layout;
    plan_gather(layout);
    const size_t dq_at = layout.add(floats(local_rows * group_ * kv_elems));
    const size_t dk_at = layout.add(floats(plan_.rows * kv_elems)), dv_at = layout.add(floats(plan_.rows * kv_elems));
    by_rank_at_ = layout.add(floats(2 * plan_.rows * kv_elems));
    parts_at_ = layout.add(floats(world_ * 2 * local_rows * kv_elems));
    sum_at_ = layout.add(floats(2 * local_rows * kv_elems));
    allocate(layout);

    for_each_slice([&](HeadRange slice, const TensorView& k, const TensorView& v) {
      const HeadRange q = query_heads_of(slice);
      // fp32 gradients: dq (B, S_r, q, D), dk and dv (B, S, slice, D) for every gathered row
      const TensorView dq = contiguous_like(at(dq_at), DType::kFloat32, narrow(p_.dq, -2, q));
      const KeyValues dkv{joined_tokens(plan_, at(dk_at), DType::kFloat32, device_, slice.count, dim_),
                          joined_tokens(plan_, at(dv_at), DType::kFloat32, device_, slice.count, dim_)};
      // One call over every gathered row writes all of dK/dV (overwrite_dkdv) and adds into dq; a
      // rank without rows has no gradient, and its dK/dV are zeros.
      kernels::fill(dq, 0.0f, stream_);
      if (dq.numel() > 0) {
        AttentionParams grads = params(q, true);
        grads.overwrite_dkdv = true;
        attention_backward(narrow(p_.q, -2, q), k, v, narrow(p_.out, -2, q), narrow(p_.dout, -2, q),
                           narrow(p_.lse, -2, q), dq, dkv.k, dkv.v, grads);
      } else {
        for (const TensorView& t : {dkv.k, dkv.v}) kernels::fill(t, 0.0f, stream_);
      }
      kernels::copy(dq, narrow(p_.dq, -2, q), stream_);  // fp32 -> dq (B, S_r, Hq, D)

      // (B, S, slice, D) fp32 -> this rank's rows summed over ranks (B, S_r, slice, D) -> dk, dv (B, S_r, Hkv, D)
      const KeyValues mine = reduce(slice, dkv);
      kernels::copy(mine.k, batched(narrow(p_.dk, -2, slice), p_.packed), stream_);
      kernels::copy(mine.v, batched(narrow(p_.dv, -2, slice), p_.packed), stream_);
    });
  }

 private:
  static size_t floats(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }
  unsigned char* at(size_t offset) const { return workspace_.data() + offset; }
  HeadRange query_heads_of(HeadRange slice) const { return {slice.first * group_, slice.count * group_}; }

  // The options for query heads `q` (ALiBi slopes narrowed to them).
  AttentionParams params(HeadRange q, bool accumulate) const {
    AttentionParams params = params_for_heads(params_, q);
    params.accumulate = accumulate;
    return params;
  }

  // Room for the gathered K/V in rank order and in joined order, and for the positions.
  void plan_gather(kernels::WorkspaceLayout& layout) {
    const size_t kv_bytes = static_cast<size_t>(plan_.rows * widest_ * dim_) * dtype_size(dtype_);
    gathered_at_ = layout.add(2 * kv_bytes);
    joined_at_[0] = layout.add(kv_bytes);
    joined_at_[1] = layout.add(kv_bytes);
    positions_at_ = layout.add(p_.packed ? static_cast<size_t>(3 * plan_.batch + 2) * sizeof(int32_t) : 0);
  }

  // The workspace, and the kernel options for this rank's queries against the gathered keys:
  // queries at this rank's global positions, keys from 0; packed batches by local cu_seqlens for q
  // (with each sequence's first query position) and the global ones for k, put in the workspace.
  void allocate(const kernels::WorkspaceLayout& layout) {
    workspace_ = kernels::Workspace(device_, layout.total(), stream_);
    params_ = p_.params;
    params_.q_seq_offsets.reset();
    params_.k_seq_offsets.reset();
    params_.cu_seqlens_q.reset();
    params_.cu_seqlens_k.reset();
    params_.k_offset = 0;
    // This rank's first position in sequence b: the joined rows of sequence b before its own.
    const auto start = [&](int64_t b) { return plan_.joined_first[me_][b] - plan_.joined_first[0][b]; };
    if (!p_.packed) {
      params_.q_offset = plan_.batch > 0 ? start(0) : 0;
      return;
    }
    std::vector<int32_t> ints;  // [cu_seqlens_q (B + 1) | cu_seqlens_k (B + 1) | q_seq_offsets (B)]
    for (int64_t b = 0; b < plan_.batch; ++b) ints.push_back(static_cast<int32_t>(plan_.local_first[me_][b]));
    ints.push_back(static_cast<int32_t>(plan_.local_rows[me_]));
    ints.insert(ints.end(), p_.cu_seqlens.begin(), p_.cu_seqlens.end());
    for (int64_t b = 0; b < plan_.batch; ++b) ints.push_back(static_cast<int32_t>(start(b)));
    auto* on_device = reinterpret_cast<int32_t*>(at(positions_at_));
    kernels::upload(ints.data(), ints.size() * sizeof(int32_t), on_device, device_, stream_);
    const int64_t n = plan_.batch + 1;
    params_.cu_seqlens_q = TensorView(on_device, DType::kInt32, device_, {n});
    params_.cu_seqlens_k = TensorView(on_device + n, DType::kInt32, device_, {n});
    params_.q_seq_offsets = TensorView(on_device + 2 * n, DType::kInt32, device_, {plan_.batch});
  }

  // Rank j's rows of a slice as one block at `data`: k, then v.
  KeyValues block(unsigned char* data, DType dtype, int j, HeadRange slice) const {
    const int64_t rows = plan_.entry_rows(j);
    const TensorView k = token_buffer(plan_, data, dtype, device_, rows, slice.count, dim_);
    return {k, token_buffer(plan_, data + bytes_of(k), dtype, device_, rows, slice.count, dim_)};
  }

  // Rank j's block in a buffer of every rank's blocks in rank order at `data`.
  KeyValues rank_block(unsigned char* data, DType dtype, int j, HeadRange slice) const {
    const int64_t before = plan_.rank_first[j] * 2 * slice.count * dim_;
    return block(data + before * static_cast<int64_t>(dtype_size(dtype)), dtype, j, slice);
  }

  // The block of the partial sums of this rank's rows that rank j sends.
  KeyValues part(int j, HeadRange slice) const {
    const int64_t before = j * 2 * plan_.local_rows[me_] * slice.count * dim_;
    return block(at(parts_at_) + floats(before), DType::kFloat32, me_, slice);
  }

  // Calls fn(slice, k, v) for every slice in turn, with k and v (B, S, slice, D) of all of its
  // gathered rows; the next slice's gather is in flight while fn runs.
  template <typename Fn>
  void for_each_slice(Fn&& fn) {
    if (!slices_.empty()) post(slices_[0]);
    for (size_t i = 0; i < slices_.size(); ++i) {
      const KeyValues kv = finish(slices_[i]);
      if (i + 1 < slices_.size()) post(slices_[i + 1]);
      fn(slices_[i], kv.k, kv.v);
    }
  }

  // k, v (B, S_r, Hkv, D) -> this rank's block (2, B, S_r, slice, D), sent to every rank whose
  // queries see its keys; the blocks of the ranks whose keys this rank's queries see are received.
  void post(HeadRange slice) {
    const KeyValues mine = rank_block(at(gathered_at_), dtype_, me_, slice);
    if (visible_.seen_by_others(me_)) {
      kernels::copy(batched(narrow(p_.k, -2, slice), p_.packed), mine.k, stream_);
      kernels::copy(batched(narrow(p_.v, -2, slice), p_.packed), mine.v, stream_);
    }
    std::vector<P2POp> ops;
    for (int j = 0; j < world_; ++j) {
      if (j == me_) continue;
      if (visible_.sees(me_, j)) {
        const KeyValues theirs = rank_block(at(gathered_at_), dtype_, j, slice);
        ops.push_back(recv_op(j, theirs.k.data(), 2 * bytes_of(theirs.k)));
      }
      if (visible_.sees(j, me_)) ops.push_back(send_op(j, mine.k.data(), 2 * bytes_of(mine.k)));
    }
    request_ = comm_.send_recv(ops);
  }

  // Waits for the gather of `slice` and puts it in joined order: every rank j's block
  // (2, B, S_j, slice, D) -> k and v (B, S, slice, D), with zeros for the blocks not received. This
  // rank's own rows come straight from its k and v.
  KeyValues finish(HeadRange slice) {
    request_->wait();
    request_.reset();
    const KeyValues joined{joined_tokens(plan_, at(joined_at_[0]), dtype_, device_, slice.count, dim_),
                           joined_tokens(plan_, at(joined_at_[1]), dtype_, device_, slice.count, dim_)};
    for (int j = 0; j < world_; ++j) {
      const KeyValues from = j == me_ ? KeyValues{batched(narrow(p_.k, -2, slice), p_.packed),
                                                  batched(narrow(p_.v, -2, slice), p_.packed)}
                                      : rank_block(at(gathered_at_), dtype_, j, slice);
      const bool received = j == me_ || visible_.sees(me_, j);
      const auto put = [&](const TensorView& src, const TensorView& dst) {
        if (received) kernels::copy(src, dst, stream_);
        else kernels::fill(dst, 0.0f, stream_);
      };
      for_each_run(plan_, j, from.k, batched(joined.k, p_.packed), 1, put);
      for_each_run(plan_, j, from.v, batched(joined.v, p_.packed), 1, put);
    }
    return joined;
  }

  // dK/dV of every gathered row, (B, S, slice, D) fp32 each -> this rank's rows summed over the
  // ranks whose queries see them, in rank order as reduce_scatter sums. The sums of rank j's rows
  // travel as one block (2, B, S_j, slice, D) from a buffer in rank order.
  KeyValues reduce(HeadRange slice, const KeyValues& dkv) {
    const auto to_block = [&](int j) {
      const KeyValues b = rank_block(at(by_rank_at_), DType::kFloat32, j, slice);
      const auto copy = [&](const TensorView& dst, const TensorView& src) { kernels::copy(src, dst, stream_); };
      for_each_run(plan_, j, b.k, batched(dkv.k, p_.packed), 1, copy);
      for_each_run(plan_, j, b.v, batched(dkv.v, p_.packed), 1, copy);
      return b;
    };
    std::vector<P2POp> ops;
    for (int j = 0; j < world_; ++j) {
      if (j == me_) continue;
      if (visible_.sees(j, me_)) {
        const KeyValues from = part(j, slice);
        ops.push_back(recv_op(j, from.k.data(), 2 * bytes_of(from.k)));
      }
      if (visible_.sees(me_, j)) {
        const KeyValues theirs = to_block(j);
        ops.push_back(send_op(j, theirs.k.data(), 2 * bytes_of(theirs.k)));
      }
    }
    const KeyValues own = to_block(me_);
    comm_.send_recv(ops)->wait();

    // Each block is [k | v], 2n contiguous floats.
    const KeyValues sum = block(at(sum_at_), DType::kFloat32, me_, slice);
    const int64_t n = 2 * sum.k.numel();
    kernels::fill(flat(sum.k.data(), device_, n), 0.0f, stream_);
    for (int j = 0; j < world_; ++j) {
      if (j != me_ && !visible_.sees(j, me_)) continue;
      const KeyValues from = j == me_ ? own : part(j, slice);
      kernels::add(flat(from.k.data(), device_, n), flat(sum.k.data(), device_, n), stream_);
    }
    return sum;
  }

  Communicator& comm_;
  const Problem& p_;
  const int me_, world_;
  const RowPlan plan_;
  const std::vector<HeadRange> slices_;
  const int64_t group_, widest_;
  const Visibility visible_;
  const DType dtype_;
  const int64_t dim_;
  const Device device_;
  void* const stream_;
  AttentionParams params_;  // positions for every kernel call; its arrays are in the workspace
  // Every buffer of a call, in one allocation, declared before the request so that it outlives it.
  kernels::Workspace workspace_;
  size_t gathered_at_ = 0, joined_at_[2] = {0, 0}, positions_at_ = 0;
  size_t by_rank_at_ = 0, parts_at_ = 0, sum_at_ = 0;  // backward
  std::unique_ptr<CommRequest> request_;
};

}  // namespace

void allgather_forward(Communicator& comm, const Problem& p, const ParallelOptions& options) {
  AllGather(comm, p, options).forward();
}

void allgather_backward(Communicator& comm, const Problem& p, const ParallelOptions& options) {
  AllGather(comm, p, options).backward();
}

}  // namespace ringflash::parallel
