// allgather: K and V gathered from every rank, a slice of KV heads at a time.
//
// Every rank holds contiguous rows of the sequence. For each slice of options.kv_heads_per_gather
// KV heads, every rank's K and V rows of the slice are gathered; they are put in global order and
// this rank's queries of the slice's query heads attend to all of them, at global positions, in one
// kernel call. The gather of the next slice is in flight while a slice computes. The slice bounds
// the gathered buffer to (B, S, 2, slice, D), and each KV head is gathered once whatever the number
// of query heads reading it.
//
// Backward gathers K and V again per slice, computes dq for this rank's rows and dk, dv for every
// gathered row in fp32; these are summed over ranks (a reduce-scatter in rank order) so that each
// rank gets its own rows.
//
// A rank's K/V rows go only to the ranks with a query that the mask lets see one of them: with a
// causal mask, rank j gathers from ranks 0..j alone, and a window skips farther ranks. Rows that
// are not sent are zeros in the gathered buffer (every query is masked from them), and their dK/dV
// partial sums, zero too, are not sent back.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "reshard.h"
#include "strategy.h"

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

 private:
  int world_;
  std::vector<bool> seen_;
};

// Kernel options for this rank's queries against the gathered keys: queries at this rank's global
// positions, keys from 0; packed batches by local cu_seqlens for q and global ones for k.
class Positions {
 public:
  Positions(const Problem& p, const RowPlan& plan, int rank) : params_(p.params), cu_k_(p.cu_seqlens) {
    params_.q_seq_offsets.reset();
    params_.k_seq_offsets.reset();
    params_.cu_seqlens_q.reset();
    params_.cu_seqlens_k.reset();
    params_.k_offset = 0;
    // Rank `rank`'s first position in sequence b: the joined rows of sequence b before its own.
    const auto start = [&](int64_t b) { return plan.joined_first[rank][b] - plan.joined_first[0][b]; };
    if (!p.packed) {
      params_.q_offset = plan.batch > 0 ? start(0) : 0;
      return;
    }
    for (int64_t b = 0; b < plan.batch; ++b) {
      cu_q_.push_back(static_cast<int32_t>(plan.local_first[rank][b]));
      q_starts_.push_back(static_cast<int32_t>(start(b)));
    }
    cu_q_.push_back(static_cast<int32_t>(plan.local_rows[rank]));
    const Device device = p.q.device();
    params_.cu_seqlens_q = TensorView(cu_q_.data(), DType::kInt32, device, {plan.batch + 1});
    params_.cu_seqlens_k = TensorView(cu_k_.data(), DType::kInt32, device, {plan.batch + 1});
    params_.q_seq_offsets = TensorView(q_starts_.data(), DType::kInt32, device, {plan.batch});
  }

  // params_ points into this object's vectors.
  Positions(const Positions&) = delete;
  Positions& operator=(const Positions&) = delete;

  // The options for query heads `q` (ALiBi slopes narrowed to them).
  AttentionParams for_heads(HeadRange q, bool accumulate) const {
    AttentionParams params = params_for_heads(params_, q);
    params.accumulate = accumulate;
    return params;
  }

 private:
  AttentionParams params_;
  std::vector<int32_t> cu_q_, cu_k_, q_starts_;
};

// The gathers of each slice's K and V rows from the ranks whose keys this rank's queries may see.
// A slice's gather is one send_recv, posted so that it travels while the previous slice computes.
// Rows arrive in rank order in `gathered_`, where this rank's own rows are packed in place and sent
// from, and are put in joined order in `kv_`.
class KvGather {
 public:
  KvGather(Communicator& comm, const Problem& p, const RowPlan& plan, const Visibility& visible, int64_t widest)
      : comm_(comm),
        p_(p),
        plan_(plan),
        visible_(visible),
        gathered_(plan.rows * 2 * widest * p.head_dim * dtype_size(p.k.dtype())),
        kv_(gathered_.size()) {}

  // Calls fn(slice, k, v) for every slice in turn, with k and v (B, S, slice, D) views of all of its
  // gathered rows; the next slice's gather is in flight while fn runs.
  template <typename Fn>
  void for_each_slice(const std::vector<HeadRange>& slices, Fn&& fn) {
    const DType dtype = p_.k.dtype();
    const Device device = p_.k.device();
    const int64_t dim = p_.head_dim;
    if (!slices.empty()) post(slices[0]);
    for (size_t i = 0; i < slices.size(); ++i) {
      const HeadRange slice = slices[i];
      finish();
      if (i + 1 < slices.size()) post(slices[i + 1]);
      const int64_t row_elems = 2 * slice.count * dim;
      fn(slice, joined_view(plan_, kv_.data(), dtype, device, row_elems, 0, slice.count, dim),
         joined_view(plan_, kv_.data(), dtype, device, row_elems, slice.count, slice.count, dim));
    }
  }

 private:
  // k, v (B, S_r, Hkv, D) -> this rank's (B * S_r, 2, slice, D), sent to every rank.
  void post(HeadRange slice) {
    const int me = comm_.rank();
    row_bytes_ = 2 * slice.count * p_.head_dim * dtype_size(p_.k.dtype());
    char* mine = gathered_.data() + plan_.rank_first[me] * row_bytes_;
    for (int64_t r = 0; r < plan_.local_rows[me]; ++r)
      copy_heads(p_.v, r, slice, copy_heads(p_.k, r, slice, mine + r * row_bytes_));
    std::vector<P2POp> ops;
    for (int j = 0; j < comm_.size(); ++j) {
      if (j == me) continue;
      char* theirs = gathered_.data() + plan_.rank_first[j] * row_bytes_;
      if (visible_.sees(me, j))
        ops.push_back(recv_op(j, theirs, plan_.local_rows[j] * row_bytes_));
      else
        std::memset(theirs, 0, plan_.local_rows[j] * row_bytes_);
      if (visible_.sees(j, me)) ops.push_back(send_op(j, mine, plan_.local_rows[me] * row_bytes_));
    }
    request_ = comm_.send_recv(ops);
  }

  // Waits for the posted slice: (sum_j B * S_j, 2, slice, D) by rank -> kv_ (B, S, 2, slice, D).
  void finish() {
    request_->wait();
    request_.reset();
    rank_order_to_joined(plan_, gathered_.data(), row_bytes_, kv_.data());
  }

  Communicator& comm_;
  const Problem& p_;
  const RowPlan& plan_;
  const Visibility& visible_;
  std::vector<char> gathered_, kv_;
  size_t row_bytes_ = 0;
  std::unique_ptr<CommRequest> request_;
};

// dK/dV partial sums of every rank's rows, in rank order (each row `row_elems` floats) -> this
// rank's rows summed over the ranks whose queries see them, in rank order as reduce_scatter sums.
// `parts` is staging for what the other ranks send.
void reduce_kv(Communicator& comm, const RowPlan& plan, const Visibility& visible, const float* by_rank,
               int64_t row_elems, std::vector<float>& parts, float* mine) {
  const int me = comm.rank();
  const int64_t n = plan.local_rows[me] * row_elems;
  std::vector<P2POp> ops;
  for (int j = 0; j < comm.size(); ++j) {
    if (j == me) continue;
    if (visible.sees(j, me)) ops.push_back(recv_op(j, parts.data() + j * n, n * sizeof(float)));
    const float* theirs = by_rank + plan.rank_first[j] * row_elems;
    if (visible.sees(me, j)) ops.push_back(send_op(j, theirs, plan.local_rows[j] * row_elems * sizeof(float)));
  }
  comm.send_recv(ops)->wait();
  std::fill(mine, mine + n, 0.0f);
  for (int j = 0; j < comm.size(); ++j) {
    const float* part = j == me ? by_rank + plan.rank_first[me] * row_elems : parts.data() + j * n;
    if (j == me || visible.sees(j, me))
      for (int64_t e = 0; e < n; ++e) mine[e] += part[e];
  }
}

// A contiguous (B, S_r, heads, D) view of this rank's rows (packed: (T_r, heads, D)).
TensorView local_view(const RowPlan& plan, int rank, void* data, DType dtype, Device device, int64_t heads,
                      int64_t dim) {
  if (plan.packed) return TensorView(data, dtype, device, {plan.local_rows[rank], heads, dim});
  return TensorView(data, dtype, device, {plan.batch, plan.local_batch_rows(rank), heads, dim});
}

}  // namespace

void allgather_forward(Communicator& comm, const Problem& p, const ParallelOptions& options) {
  const RowPlan plan = contiguous_plan(p, comm.size());
  const Positions positions(p, plan, comm.rank());
  const std::vector<HeadRange> slices = kv_slices(p, options);
  const int64_t group = p.heads_q / p.heads_kv, widest = slices.empty() ? 0 : slices[0].count;
  const Visibility visible(plan, p.params);
  KvGather gather(comm, p, plan, visible, widest);
  gather.for_each_slice(slices, [&](HeadRange slice, const TensorView& k, const TensorView& v) {
    const HeadRange q{slice.first * group, slice.count * group};
    attention_forward(narrow(p.q, -2, q.first, q.count), k, v, narrow(p.out, -2, q.first, q.count),
                      narrow(p.lse, -2, q.first, q.count), positions.for_heads(q, false));
  });
}

void allgather_backward(Communicator& comm, const Problem& p, const ParallelOptions& options) {
  const int me = comm.rank();
  const RowPlan plan = contiguous_plan(p, comm.size());
  const Positions positions(p, plan, me);
  const std::vector<HeadRange> slices = kv_slices(p, options);
  const int64_t group = p.heads_q / p.heads_kv, dim = p.head_dim, widest = slices.empty() ? 0 : slices[0].count;
  const int64_t local_rows = plan.local_rows[me];
  const DType dtype = p.q.dtype();
  const Device device = p.q.device();
  const Visibility visible(plan, p.params);
  KvGather gather(comm, p, plan, visible, widest);
  std::vector<float> dq(local_rows * widest * group * dim), dkv(plan.rows * 2 * widest * dim),
      dkv_by_rank(dkv.size()), dkv_mine(local_rows * 2 * widest * dim), parts(comm.size() * dkv_mine.size());

  gather.for_each_slice(slices, [&](HeadRange slice, const TensorView& k, const TensorView& v) {
    const int64_t row_elems = 2 * slice.count * dim;
    const HeadRange q{slice.first * group, slice.count * group};

    // fp32 gradients: dq (B, S_r, q, D), dk and dv (B, S, 2, slice, D) for every gathered row
    std::fill(dq.begin(), dq.end(), 0.0f);
    std::fill(dkv.begin(), dkv.end(), 0.0f);
    const TensorView dq_view = local_view(plan, me, dq.data(), DType::kFloat32, device, q.count, dim);
    const TensorView dk = joined_view(plan, dkv.data(), DType::kFloat32, device, row_elems, 0, slice.count, dim);
    const TensorView dv =
        joined_view(plan, dkv.data(), DType::kFloat32, device, row_elems, slice.count, slice.count, dim);
    attention_backward(narrow(p.q, -2, q.first, q.count), k, v, narrow(p.out, -2, q.first, q.count),
                       narrow(p.dout, -2, q.first, q.count), narrow(p.lse, -2, q.first, q.count), dq_view, dk, dv,
                       positions.for_heads(q, true));

    // dq (B * S_r, q, D) fp32 -> dq (B, S_r, Hq, D)
    for (int64_t r = 0; r < local_rows; ++r)
      for (int64_t h = 0; h < q.count; ++h)
        store_floats(&dq[(r * q.count + h) * dim], dim, dtype, head_ptr(p.dq, r, q.first + h));

    // (B, S, 2, slice, D) -> by rank (sum_j B * S_j, 2, slice, D) -> summed over ranks, this rank's rows
    joined_to_rank_order(plan, reinterpret_cast<const char*>(dkv.data()), row_elems * sizeof(float),
                         reinterpret_cast<char*>(dkv_by_rank.data()));
    reduce_kv(comm, plan, visible, dkv_by_rank.data(), row_elems, parts, dkv_mine.data());

    // (B * S_r, 2, slice, D) fp32 -> dk, dv (B, S_r, Hkv, D)
    for (int64_t r = 0; r < local_rows; ++r)
      for (int64_t h = 0; h < slice.count; ++h) {
        const float* row = &dkv_mine[r * row_elems];
        store_floats(row + h * dim, dim, dtype, head_ptr(p.dk, r, slice.first + h));
        store_floats(row + (slice.count + h) * dim, dim, dtype, head_ptr(p.dv, r, slice.first + h));
      }
  });
}

}  // namespace ringflash::parallel
