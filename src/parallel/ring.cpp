// ring, zigzag and stripe: K/V travel around the ring while each rank's queries stay.
//
// At step s rank r holds the K/V of rank (r - s) mod P and runs the single-device kernel, in
// accumulate mode, on every pair (query piece of r, key piece of that rank) that the mask does
// not leave empty. Forward merges into fp32 (out, lse); backward adds into fp32 dq (local), into
// this rank's own fp32 dK/dV, and into fp32 dK/dV partial sums for the other ranks' K/V: a
// partial starts on the rank after its K/V's home, travels with the K/V, and its last hop lands at
// home, where it is added to that rank's own (P - 1 hops, as the K/V make). The transfer for
// step s + 1 is posted before step s computes. With a window, the ring stops after the last step
// any rank needs, so farther transfers never happen.
//
// Tensors are handled as batches: a padded batch is (B, S_r, H, D) with one shard for every batch
// entry, so one kernel call covers the batch; a packed batch (T_r, H, D) is seen as (1, T_r, H, D)
// and every sequence is a group of its own.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "strategy.h"

namespace ringflash::parallel {
namespace {

// A window at least this wide is unbounded: no position difference reaches it.
constexpr int64_t kUnboundedWindow = int64_t{1} << 50;

// A piece of a rank's shard and the local row where it starts.
struct Run {
  int64_t row = 0;
  Piece piece;
};

// Which rows every rank holds: runs[rank][group], where a group is the whole padded batch or one
// sequence of a packed batch.
struct Geometry {
  int world = 1;
  int64_t stride = 1;  // positions between consecutive rows of a piece: P for stripe, else 1
  int64_t batch = 1;   // leading dimension of the batched tensors: B, or 1 when packed
  std::vector<int64_t> rows;
  std::vector<std::vector<std::vector<Run>>> runs;
};

Geometry make_geometry(Layout layout, const Problem& p, int world) {
  Geometry g;
  g.world = world;
  g.stride = layout == Layout::kStripe ? world : 1;
  g.batch = p.packed ? 1 : p.batch;
  const int64_t groups = p.packed ? p.batch : 1;
  g.rows.assign(world, 0);
  g.runs.assign(world, std::vector<std::vector<Run>>(groups));
  for (int rank = 0; rank < world; ++rank) {
    int64_t row = 0;
    for (int64_t group = 0; group < groups; ++group) {
      for (const Piece& piece : shard_of(layout, p.sequence_length(group), rank, world)) {
        g.runs[rank][group].push_back(Run{row, piece});
        row += piece.count;
      }
    }
    g.rows[rank] = row;
  }
  return g;
}

// The mask as a band of position differences: a key is visible iff -left <= pk - pq <= right,
// where an unbounded side is left out.
struct Band {
  std::optional<int64_t> left, right;
};

Band band_of(const AttentionParams& params) {
  Band b;
  if (params.window_left >= 0 && params.window_left < kUnboundedWindow) b.left = params.window_left;
  if (params.window_right >= 0 && params.window_right < kUnboundedWindow) b.right = params.window_right;
  if (params.causal) b.right = std::min<int64_t>(b.right.value_or(0), 0);
  return b;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0) ? 1 : 0); }
int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// The kernel parameters for a query piece against a key piece (both of stride `stride`), or
// nothing when the mask leaves the pair empty.
//
// With pq = qa + i * st and pk = kc + j * st, a key is visible iff
//   -left <= pk - pq <= right   <=>   -left <= (kc - qa) + (j - i) * st <= right
//   <=>   lo = ceil((-left - (kc - qa)) / st)  <=  j - i  <=  floor((right - (kc - qa)) / st) = hi,
// a band on the local indices. The pair has a visible element iff the band meets the differences
// j - i that occur, [-(count_q - 1), count_k - 1].
// For st = 1 the kernel applies the caller's mask itself at the true positions (q_offset = qa,
// k_offset = kc), which ALiBi needs. For st > 1 (stripe) the kernel sees compressed positions
// pq' = i + shift and pk' = j, so pk' - pq' = (j - i) - shift, with no causal flag and
//   shift = hi, window [-(hi - lo), 0]      when hi is bounded (lo possibly unbounded),
//   shift = lo, window [0, unbounded)       when only lo is bounded,
//   shift = 0, no window                    when neither is;
// each keeps exactly lo <= j - i <= hi. ALiBi would need the true distances, so it is refused
// for stripe at the entry point.
std::optional<AttentionParams> pair_params(const AttentionParams& base, const Band& band, const Piece& q,
                                           const Piece& k, int64_t stride) {
  const int64_t offset = k.start - q.start;
  std::optional<int64_t> lo, hi;
  if (band.left) lo = ceil_div(-*band.left - offset, stride);
  if (band.right) hi = floor_div(*band.right - offset, stride);
  const int64_t first = std::max(lo.value_or(std::numeric_limits<int64_t>::min()), 1 - q.count);
  const int64_t last = std::min(hi.value_or(std::numeric_limits<int64_t>::max()), k.count - 1);
  if (first > last) return std::nullopt;

  AttentionParams params = base;
  if (stride == 1) {
    params.q_offset = q.start;
    params.k_offset = k.start;
    return params;
  }
  params.causal = false;
  params.k_offset = 0;
  if (hi) {
    params.q_offset = *hi;
    params.window_left = lo ? *hi - *lo : -1;
    params.window_right = 0;
  } else {
    params.q_offset = lo.value_or(0);
    params.window_left = lo ? 0 : -1;
    params.window_right = -1;
  }
  return params;
}

// Steps of the ring that some rank needs: 1 + the largest s for which a rank sees a key of rank
// (r - s) mod P. Every rank computes the same number from the layout.
int ring_steps(const Geometry& g, const Band& band, const AttentionParams& base) {
  int last = 0;
  for (int s = 1; s < g.world; ++s)
    for (int rank = 0; rank < g.world && last < s; ++rank) {
      const int src = (rank - s + g.world) % g.world;
      for (size_t group = 0; group < g.runs[rank].size() && last < s; ++group)
        for (const Run& q : g.runs[rank][group])
          for (const Run& k : g.runs[src][group])
            if (pair_params(base, band, q.piece, k.piece, g.stride)) last = s;
    }
  return last + 1;
}

// ---- views and copies ----------------------------------------------------------------------

TensorView make_view(void* data, DType dtype, Device device, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  return TensorView(data, dtype, device, static_cast<int>(shape.size()), shape.data(), strides.data());
}

// A packed tensor as a batch of one: (T, H, D) -> (1, T, H, D), (H, T) -> (1, H, T).
TensorView batched(const TensorView& t, bool packed) {
  if (!packed) return t;
  std::vector<int64_t> shape{1}, strides{0};
  for (int d = 0; d < t.ndim(); ++d) {
    shape.push_back(t.size(d));
    strides.push_back(t.stride(d));
  }
  return make_view(t.data(), t.dtype(), t.device(), shape, strides);
}

// `count` entries of dimension `dim` from `start`.
TensorView narrow(const TensorView& t, int dim, int64_t start, int64_t count) {
  std::vector<int64_t> shape, strides;
  for (int d = 0; d < t.ndim(); ++d) {
    shape.push_back(d == dim ? count : t.size(d));
    strides.push_back(t.stride(d));
  }
  const int64_t bytes = start * t.stride(dim) * static_cast<int64_t>(dtype_size(t.dtype()));
  auto* data = static_cast<unsigned char*>(t.data()) + bytes;
  return make_view(data, t.dtype(), t.device(), shape, strides);
}

// A contiguous (B, rows, H, D) tensor at `data`.
TensorView contiguous(void* data, DType dtype, int64_t batch, int64_t rows, int64_t heads, int64_t dim) {
  return make_view(data, dtype, Device{}, {batch, rows, heads, dim}, {rows * heads * dim, heads * dim, dim, 1});
}

// Calls fn(pointer to element (b, i, h, 0), n) for the n-th (b, i, h) of a (B, rows, H, D) view.
template <typename Fn>
void for_each_vector(const TensorView& t, Fn&& fn) {
  const int64_t size = static_cast<int64_t>(dtype_size(t.dtype()));
  int64_t n = 0;
  for (int64_t b = 0; b < t.size(0); ++b)
    for (int64_t i = 0; i < t.size(1); ++i)
      for (int64_t h = 0; h < t.size(2); ++h)
        fn(static_cast<unsigned char*>(t.data()) + (b * t.stride(0) + i * t.stride(1) + h * t.stride(2)) * size, n++);
}

// Every element of a (B, rows, H, D) fp32 view set to `value`.
void fill(const TensorView& t, float value) {
  const int64_t dim = t.size(3);
  for_each_vector(t, [&](unsigned char* p, int64_t) { std::fill_n(reinterpret_cast<float*>(p), dim, value); });
}

// Every element of a (B, H, rows) fp32 view set to `value`.
void fill_lse(const TensorView& lse, float value) {
  for (int64_t b = 0; b < lse.size(0); ++b)
    for (int64_t h = 0; h < lse.size(1); ++h)
      std::fill_n(lse.data_as<float>() + b * lse.stride(0) + h * lse.stride(1), lse.size(2), value);
}

// Copies a (B, rows, H, D) view into contiguous memory of the same dtype.
void copy_to_contiguous(const TensorView& t, void* dst) {
  const size_t bytes = static_cast<size_t>(t.size(3)) * dtype_size(t.dtype());
  auto* out = static_cast<unsigned char*>(dst);
  for_each_vector(t, [&](unsigned char* p, int64_t n) { std::memcpy(out + n * bytes, p, bytes); });
}

// bfloat16 bits of x, rounded to nearest even.
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Writes contiguous fp32 values into a (B, rows, H, D) view of any float dtype.
void store_from_fp32(const float* src, const TensorView& t) {
  const int64_t dim = t.size(3);
  const DType dtype = t.dtype();
  for_each_vector(t, [&](unsigned char* p, int64_t n) {
    const float* x = src + n * dim;
    if (dtype == DType::kFloat32) {
      std::memcpy(p, x, static_cast<size_t>(dim) * sizeof(float));
    } else if (dtype == DType::kFloat16) {
      for (int64_t d = 0; d < dim; ++d) reinterpret_cast<_Float16*>(p)[d] = static_cast<_Float16>(x[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) reinterpret_cast<uint16_t*>(p)[d] = to_bf16(x[d]);
    }
  });
}

// A zeroed fp32 accumulator for a (B, rows, H, D) output: the output itself when it is fp32, else
// a contiguous buffer that store() rounds into the output.
class Fp32Accumulator {
 public:
  explicit Fp32Accumulator(const TensorView& out) : out_(out), acc_(out) {
    if (out.dtype() != DType::kFloat32) {
      buffer_.resize(static_cast<size_t>(out.numel()));
      acc_ = contiguous(buffer_.data(), DType::kFloat32, out.size(0), out.size(1), out.size(2), out.size(3));
    }
    fill(acc_, 0.0f);
  }
  // acc_ may point into buffer_.
  Fp32Accumulator(const Fp32Accumulator&) = delete;
  Fp32Accumulator& operator=(const Fp32Accumulator&) = delete;

  const TensorView& view() const { return acc_; }
  void store() const {
    if (acc_.data() != out_.data()) store_from_fp32(buffer_.data(), out_);
  }

 private:
  TensorView out_, acc_;
  std::vector<float> buffer_;
};

// ---- the ring -----------------------------------------------------------------------------

// One rank's K and V, (B, rows, Hkv, D) each.
struct KeyValues {
  TensorView k, v;
};

class Ring {
 public:
  Ring(Communicator& comm, Layout layout, const Problem& p)
      : comm_(comm),
        p_(p),
        rank_(comm.rank()),
        world_(comm.size()),
        geo_(make_geometry(layout, p, world_)),
        band_(band_of(p.params)),
        steps_(ring_steps(geo_, band_, p.params)),
        max_rows_(*std::max_element(geo_.rows.begin(), geo_.rows.end())),
        kv_elements_(geo_.batch * max_rows_ * p.heads_kv * p.head_dim) {
    q_ = batched(p.q, p.packed);
    home_ = {batched(p.k, p.packed), batched(p.v, p.packed)};
  }

  void forward() {
    const TensorView lse = batched(p_.lse, p_.packed);
    const Fp32Accumulator out(batched(p_.out, p_.packed));
    fill_lse(lse, -std::numeric_limits<float>::infinity());

    prepare_travel();
    for (int s = 0; s < steps_; ++s) {
      const int src = source(s);
      std::unique_ptr<CommRequest> kv_in = s + 1 < steps_ ? pass_kv(s) : nullptr;
      const KeyValues kv = key_values(s);
      for_each_pair(src, [&](const Run& q, const Run& k, const AttentionParams& params) {
        attention_forward(rows(q_, q), rows(kv.k, k), rows(kv.v, k), rows(out.view(), q), lse_rows(lse, q), params);
      });
      if (kv_in) kv_in->wait();
    }
    out.store();
  }

  void backward() {
    const TensorView out = batched(p_.out, p_.packed), dout = batched(p_.dout, p_.packed);
    const TensorView lse = batched(p_.lse, p_.packed);
    const Fp32Accumulator dq(batched(p_.dq, p_.packed));

    // dK/dV in fp32, [dk | dv]. `own` holds this rank's contribution to its own block. The partial
    // sum of the other ranks' contributions to a block starts on the rank after its home, travels
    // with the block's K/V, and its last hop lands at home, where it is added to `own`: P - 1 hops
    // for a full ring. Two partials travel in turn (one is being sent while the other is
    // received); from step 2 on, the kernel adds into `block`, which is then added to the partial
    // arriving from the previous rank.
    std::vector<float> own(static_cast<size_t>(2 * rows_elements(rank_))), partial[2], block;
    for (auto* b : {&partial[0], &partial[1], &block}) b->resize(static_cast<size_t>(2 * kv_elements_));

    prepare_travel();
    std::unique_ptr<CommRequest> grads_in;
    for (int s = 0; s < steps_; ++s) {
      const int src = source(s);
      std::unique_ptr<CommRequest> kv_in = s + 1 < steps_ ? pass_kv(s) : nullptr;
      const KeyValues kv = key_values(s);
      std::vector<float>& carried = partial[s % 2];
      std::vector<float>& target = s == 0 ? own : s == 1 ? carried : block;
      const KeyValues grads = grad_views(target, src);
      fill(grads.k, 0.0f);
      fill(grads.v, 0.0f);
      bool computed = false;
      for_each_pair(src, [&](const Run& q, const Run& k, const AttentionParams& params) {
        attention_backward(rows(q_, q), rows(kv.k, k), rows(kv.v, k), rows(out, q), rows(dout, q), lse_rows(lse, q),
                           rows(dq.view(), q), rows(grads.k, k), rows(grads.v, k), params);
        computed = true;
      });
      if (s > 1) {
        grads_in->wait();
        const int64_t n = 2 * rows_elements(src);
        if (computed)
          for (int64_t e = 0; e < n; ++e) carried[e] += block[e];
      }
      if (s > 0 && s + 1 < steps_) {
        const int64_t next_src = source(s + 1);
        grads_in = comm_.send_recv(transfer(next(), carried.data(), 2 * rows_elements(src) * sizeof(float), prev(),
                                            partial[(s + 1) % 2].data(), 2 * rows_elements(next_src) * sizeof(float)));
      }
      if (kv_in) kv_in->wait();
    }

    // The partial held last is of block (r - steps + 1) mod P: its last hop takes it home, and this
    // rank's own arrives from rank (r + steps - 1) mod P.
    if (steps_ > 1) {
      const int home = source(steps_ - 1), from = (rank_ + steps_ - 1) % world_;
      std::vector<float>& arrived = partial[steps_ % 2];
      const int64_t n = 2 * rows_elements(rank_);
      comm_.send_recv(transfer(home, partial[(steps_ - 1) % 2].data(), 2 * rows_elements(home) * sizeof(float), from,
                               arrived.data(), n * sizeof(float)))
          ->wait();
      for (int64_t e = 0; e < n; ++e) own[e] += arrived[e];
    }
    const KeyValues mine = grad_views(own, rank_);
    store_from_fp32(mine.k.data_as<float>(), batched(p_.dk, p_.packed));
    store_from_fp32(mine.v.data_as<float>(), batched(p_.dv, p_.packed));
    dq.store();
  }

 private:
  int source(int step) const { return (rank_ - step + world_) % world_; }
  int next() const { return (rank_ + 1) % world_; }
  int prev() const { return (rank_ - 1 + world_) % world_; }

  // Elements of one of K, V, dK, dV of `rank`'s rows.
  int64_t rows_elements(int rank) const { return geo_.batch * geo_.rows[rank] * p_.heads_kv * p_.head_dim; }

  // Calls fn(query run, key run, kernel params) for every pair of this rank's query pieces and
  // `src`'s key pieces that the mask does not leave empty.
  template <typename Fn>
  void for_each_pair(int src, Fn&& fn) const {
    for (size_t group = 0; group < geo_.runs[rank_].size(); ++group) {
      const AttentionParams base = group_params(static_cast<int64_t>(group));
      for (const Run& q : geo_.runs[rank_][group])
        for (const Run& k : geo_.runs[src][group])
          if (const auto params = pair_params(base, band_, q.piece, k.piece, geo_.stride)) fn(q, k, *params);
    }
  }

  // The caller's options for the kernel calls of one group: accumulate mode, positions set per
  // pair, and for a packed batch with per-sequence ALiBi slopes (B, Hq), that sequence's row.
  AttentionParams group_params(int64_t group) const {
    AttentionParams params = p_.params;
    params.accumulate = true;
    params.cu_seqlens_q.reset();
    params.cu_seqlens_k.reset();
    params.q_seq_offsets.reset();
    params.k_seq_offsets.reset();
    if (p_.packed && params.alibi_slopes && params.alibi_slopes->ndim() == 2)
      params.alibi_slopes = narrow(*params.alibi_slopes, 0, group, 1);  // (B, Hq) -> (1, Hq)
    return params;
  }

  TensorView rows(const TensorView& t, const Run& run) const { return narrow(t, 1, run.row, run.piece.count); }
  TensorView lse_rows(const TensorView& lse, const Run& run) const { return narrow(lse, 2, run.row, run.piece.count); }

  // Buffers for the K/V in flight, and a contiguous copy of this rank's K/V when the caller's are
  // strided (a message is one contiguous block).
  void prepare_travel() {
    if (steps_ == 1) return;
    const size_t bytes = static_cast<size_t>(2 * kv_elements_) * dtype_size(p_.k.dtype());
    for (auto& b : travel_) b.resize(bytes);
    home_send_ = home_;
    if (!p_.k.is_contiguous() || !p_.v.is_contiguous()) {
      const int64_t n = rows_elements(rank_);
      staging_.resize(static_cast<size_t>(2 * n) * dtype_size(p_.k.dtype()));
      home_send_ = kv_views(staging_.data(), rank_);
      copy_to_contiguous(home_.k, home_send_.k.data());
      copy_to_contiguous(home_.v, home_send_.v.data());
    }
  }

  // K and V of `rank` in a travel buffer: [k | v], each (B, rows, Hkv, D).
  KeyValues kv_views(unsigned char* data, int rank) const {
    const DType dtype = p_.k.dtype();
    const int64_t n = rows_elements(rank);
    return {contiguous(data, dtype, geo_.batch, geo_.rows[rank], p_.heads_kv, p_.head_dim),
            contiguous(data + n * static_cast<int64_t>(dtype_size(dtype)), dtype, geo_.batch, geo_.rows[rank],
                       p_.heads_kv, p_.head_dim)};
  }

  KeyValues grad_views(std::vector<float>& data, int rank) const {
    const int64_t n = rows_elements(rank);
    return {contiguous(data.data(), DType::kFloat32, geo_.batch, geo_.rows[rank], p_.heads_kv, p_.head_dim),
            contiguous(data.data() + n, DType::kFloat32, geo_.batch, geo_.rows[rank], p_.heads_kv, p_.head_dim)};
  }

  // The K/V visited at step s: this rank's own at step 0, then what step s - 1 received.
  KeyValues key_values(int s) { return s == 0 ? home_ : kv_views(travel_[(s - 1) % 2].data(), source(s)); }

  // Posts the K/V of step s to the next rank and the receive of step s + 1's from the previous one.
  std::unique_ptr<CommRequest> pass_kv(int s) {
    const KeyValues send = s == 0 ? home_send_ : kv_views(travel_[(s - 1) % 2].data(), source(s));
    const KeyValues recv = kv_views(travel_[s % 2].data(), source(s + 1));
    const size_t size = dtype_size(p_.k.dtype());
    const size_t send_bytes = static_cast<size_t>(rows_elements(source(s))) * size;
    const size_t recv_bytes = static_cast<size_t>(rows_elements(source(s + 1))) * size;
    std::vector<P2POp> ops;
    if (send_bytes > 0) {
      ops.push_back(send_op(next(), send.k.data(), send_bytes));
      ops.push_back(send_op(next(), send.v.data(), send_bytes));
    }
    if (recv_bytes > 0) {
      ops.push_back(recv_op(prev(), recv.k.data(), recv_bytes));
      ops.push_back(recv_op(prev(), recv.v.data(), recv_bytes));
    }
    return comm_.send_recv(ops);
  }

  // One send and one receive, each left out when empty (both ends know the sizes).
  static std::vector<P2POp> transfer(int to, const void* send, size_t send_bytes, int from, void* recv,
                                     size_t recv_bytes) {
    std::vector<P2POp> ops;
    if (send_bytes > 0) ops.push_back(send_op(to, send, send_bytes));
    if (recv_bytes > 0) ops.push_back(recv_op(from, recv, recv_bytes));
    return ops;
  }

  Communicator& comm_;
  const Problem& p_;
  const int rank_, world_;
  const Geometry geo_;
  const Band band_;
  const int steps_;
  const int64_t max_rows_, kv_elements_;
  TensorView q_;
  KeyValues home_, home_send_;
  std::vector<unsigned char> travel_[2], staging_;
};

}  // namespace

void ring_forward(Communicator& comm, Layout layout, const Problem& p) { Ring(comm, layout, p).forward(); }

void ring_backward(Communicator& comm, Layout layout, const Problem& p) { Ring(comm, layout, p).backward(); }

}  // namespace ringflash::parallel
