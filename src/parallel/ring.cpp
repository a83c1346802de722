// ring, zigzag and stripe: K/V travel around the ring while each rank's queries stay.
//
// At step s rank r holds the K/V of rank (r - s) mod P and runs the single-device kernel, in
// accumulate mode, on every pair (query piece of r, key piece of that rank) that the mask does
// not leave empty, in one call for all of them where one call sees what the pairs see. Forward
// merges into fp32 (out, lse), which the first step writes (overwrite_out) and the last rounds
// into out (final_out); backward adds into fp32 dq (local), into this rank's own fp32 dK/dV, and
// into fp32 dK/dV partial sums for the other ranks' K/V: a partial starts on the rank after its
// K/V's home, travels with the K/V, and its last hop lands at home, where it is added to that
// rank's own (P - 1 hops, as the K/V make). The transfer for step s + 1 is posted before step s
// computes. The backward splits its own block in two halves of its K/V heads (of its key rows
// with one K/V head): the first at step 0 (under the first K/V transfer), the second after the
// last step (under the last hop, which would otherwise run alone). A ring of two steps given
// ParallelOptions::kept_kv receives the other rank's K/V there in the forward, and its backward
// reads them from there: it receives no K/V, computes the step against them first and its whole
// own block under the last hop. With a window, the ring stops after the last step any rank needs,
// so farther transfers never happen. A transfer carries only the rows that some rank reads: of a
// K/V block, the span of the key rows that its later holders' calls see (zigzag on 2 ranks: half
// of rank 0's; a window: its reach into the block), and of a partial on its last hop, the rows
// that the calls into it reached.
//
// Tensors are handled as batches: a padded batch is (B, S_r, H, D) with one shard for every batch
// entry, so one kernel call covers the batch; a packed batch (T_r, H, D) is seen as (1, T_r, H, D)
// and every sequence is a group of its own.
#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "../core/check.h"
#include "../kernels/ops.h"
#include "strategy.h"
#include "views.h"

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

// Rows [row, row + count) of a batched tensor: the query or key block of one kernel call.
struct Block {
  int64_t row = 0, count = 0;
};

constexpr Block kAllRows{0, std::numeric_limits<int64_t>::max()};

// The rows of runs[first..last], which are consecutive.
Block block_of(const std::vector<Run>& runs, size_t first, size_t last) {
  return {runs[first].row, runs[last].row + runs[last].piece.count - runs[first].row};
}

// The parts of `runs` in rows [rows.row, rows.row + rows.count).
std::vector<Run> clipped(const std::vector<Run>& runs, const Block& rows) {
  std::vector<Run> out;
  for (const Run& r : runs) {
    const int64_t first = std::max(r.row, rows.row), end = std::min(r.row + r.piece.count, rows.row + rows.count);
    if (first >= end) continue;
    Run c = r;
    c.row = first;
    c.piece.start = r.piece.position(first - r.row);
    c.piece.count = end - first;
    out.push_back(c);
  }
  return out;
}

// One kernel call of a step: this rank's query block against a key block of the step's K/V.
struct Call {
  Block q, k;
  AttentionParams params;
};

// When the calls' query or key blocks (`side`, within `rows`) are disjoint, the parts of `rows`
// that none of them covers: each call can then write its rows of out/lse or dK/dV instead of
// merging or adding into them, and only those parts need filling. Nothing when two blocks overlap.
std::optional<std::vector<Block>> uncovered(const std::vector<Call>& calls, Block Call::*side, const Block& rows) {
  std::vector<Block> blocks;
  for (const Call& c : calls) blocks.push_back(c.*side);
  std::sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) { return a.row < b.row; });
  std::vector<Block> gaps;
  int64_t end = rows.row;
  for (const Block& k : blocks) {
    if (k.row < end) return std::nullopt;
    if (k.row > end) gaps.push_back({end, k.row - end});
    end = k.row + k.count;
  }
  if (end < rows.row + rows.count) gaps.push_back({end, rows.row + rows.count - end});
  return gaps;
}

// Whether one kernel call over query runs qs[qa..qb] and key runs ks[ka..kb] (stride 1), with
// positions laid out linearly from the first runs' starts, sees exactly what the calls per pair
// would. In that call a pair's pk - pq is shifted by D, the difference between the linear layout
// and the pieces' true positions; the pair keeps its visible part of the range of pk - pq it spans
// iff the band cut of that range is the same with and without the shift. ALiBi reads distances,
// so with it a pair that sees anything needs D = 0.
bool same_visibility(const Band& band, bool alibi, const std::vector<Run>& qs, size_t qa, size_t qb,
                     const std::vector<Run>& ks, size_t ka, size_t kb) {
  constexpr int64_t kFar = int64_t{1} << 60;
  const int64_t lo = band.left ? -*band.left : -kFar, hi = band.right ? *band.right : kFar;
  for (size_t i = qa; i <= qb; ++i)
    for (size_t j = ka; j <= kb; ++j) {
      const Piece& q = qs[i].piece;
      const Piece& k = ks[j].piece;
      const int64_t shift_q = qs[qa].piece.start + (qs[i].row - qs[qa].row) - q.start;
      const int64_t shift_k = ks[ka].piece.start + (ks[j].row - ks[ka].row) - k.start;
      const int64_t d = shift_k - shift_q;
      const int64_t first = k.start - (q.start + q.count - 1), last = k.start + k.count - 1 - q.start;
      const int64_t a = std::max(first, lo), b = std::min(last, hi);
      const int64_t a2 = std::max(first, lo - d), b2 = std::min(last, hi - d);
      const bool seen = a <= b;
      if (seen != (a2 <= b2)) return false;
      if (seen && (a != a2 || b != b2 || (alibi && d != 0))) return false;
    }
  return true;
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
        kv_elements_(geo_.batch * *std::max_element(geo_.rows.begin(), geo_.rows.end()) * p.heads_kv * p.head_dim),
        device_(p.q.device()),
        stream_(p.params.stream) {
    q_ = batched(p.q, p.packed);
    home_ = {batched(p.k, p.packed), batched(p.v, p.packed)};
    if (steps_ == 2 && p.kept_kv) {
      const int64_t need = 2 * rows_elements(source(1));
      RINGFLASH_CHECK(p.kept_kv->numel() >= need, InvalidArgument, p.op, " options.kept_kv must hold ", need,
                      " elements (K and V of rank ", source(1), "'s ", geo_.rows[source(1)], " rows), got ",
                      p.kept_kv->numel());
      kept_ = static_cast<unsigned char*>(p.kept_kv->data());
    }
  }

  void forward() {
    const TensorView lse = batched(p_.lse, p_.packed), out = batched(p_.out, p_.packed);
    // The fp32 accumulator: out itself when it is fp32.
    const bool own_acc = out.dtype() != DType::kFloat32;
    kernels::WorkspaceLayout layout;
    const size_t acc_at = layout.add(own_acc ? static_cast<size_t>(out.numel()) * sizeof(float) : 0);
    plan_travel(layout);
    workspace_ = kernels::Workspace(device_, layout.total(), stream_);
    const TensorView acc = own_acc ? contiguous_like(workspace_.data() + acc_at, DType::kFloat32, out) : out;
    // Where the first step's query blocks are disjoint, its calls write the accumulator
    // (overwrite_out) and only the rows that none covers start empty; otherwise every row does,
    // and the calls merge into it.
    const Block all{0, geo_.rows[rank_]};
    const std::vector<Call> first = calls(source(0));
    const std::optional<std::vector<Block>> gaps = uncovered(first, &Call::q, all);
    for (const Block& empty : gaps ? *gaps : std::vector<Block>{all}) {
      if (empty.count == 0) continue;
      kernels::fill(rows(acc, empty), 0.0f, stream_);
      kernels::fill(lse_rows(lse, empty), -std::numeric_limits<float>::infinity(), stream_);
    }
    // Where the last step's query blocks are disjoint, its calls write their rows of out itself,
    // rounded (final_out), and only the rows that none covers are converted from the accumulator.
    const std::vector<Call> last = steps_ == 1 ? first : calls(source(steps_ - 1));
    const std::optional<std::vector<Block>> unfinished =
        own_acc ? uncovered(last, &Call::q, all) : std::optional<std::vector<Block>>{};

    prepare_travel();
    for (int s = 0; s < steps_; ++s) {
      const int src = source(s);
      std::unique_ptr<CommRequest> kv_in = s + 1 < steps_ ? pass_kv(s) : nullptr;
      const KeyValues kv = key_values(s);
      for (const Call& c : s == 0 ? first : s + 1 == steps_ ? last : calls(src)) {
        AttentionParams params = c.params;
        params.overwrite_out = s == 0 && gaps.has_value();
        if (s + 1 == steps_ && unfinished) params.final_out = rows(out, c.q);
        attention_forward(rows(q_, c.q), rows(kv.k, c.k), rows(kv.v, c.k), rows(acc, c.q), lse_rows(lse, c.q),
                          params);
      }
      if (kv_in) kv_in->wait();
    }
    if (own_acc)
      for (const Block& rest : unfinished ? *unfinished : std::vector<Block>{all})
        if (rest.count > 0) kernels::copy(rows(acc, rest), rows(out, rest), stream_);
  }

  void backward() {
    const TensorView out = batched(p_.out, p_.packed), dout = batched(p_.dout, p_.packed);
    const TensorView lse = batched(p_.lse, p_.packed), dq = batched(p_.dq, p_.packed);

    // dK/dV in fp32, [dk | dv]. `own` holds this rank's contribution to its own block. The partial
    // sum of the other ranks' contributions to a block starts on the rank after its home, travels
    // with the block's K/V, and its last hop lands at home, where it is added to `own`: P - 1 hops
    // for a full ring. Two partials travel in turn (one is being sent while the other is
    // received); from step 2 on, the kernel writes into `block`, which is then added to the partial
    // arriving from the previous rank. Where the key blocks of the calls into a buffer are
    // disjoint, the calls write their rows (overwrite_dkdv) and only the rows that none covers are
    // zeroed; otherwise the whole buffer is zeroed and the calls add.
    const bool own_dq = dq.dtype() != DType::kFloat32;
    const size_t grad_bytes = static_cast<size_t>(2 * kv_elements_) * sizeof(float);
    kernels::WorkspaceLayout layout;
    const size_t dq_at = layout.add(own_dq ? static_cast<size_t>(dq.numel()) * sizeof(float) : 0);
    const size_t own_at = layout.add(static_cast<size_t>(2 * rows_elements(rank_)) * sizeof(float));
    const size_t partial_at[2] = {layout.add(grad_bytes), layout.add(grad_bytes)};
    const size_t block_at = layout.add(steps_ > 2 ? grad_bytes : 0);  // from step 2 on
    plan_travel(layout);
    workspace_ = kernels::Workspace(device_, layout.total(), stream_);
    const TensorView dq_acc = own_dq ? contiguous_like(workspace_.data() + dq_at, DType::kFloat32, dq) : dq;
    kernels::fill(dq_acc, 0.0f, stream_);
    unsigned char* own = workspace_.data() + own_at;
    unsigned char* partial[2] = {workspace_.data() + partial_at[0], workspace_.data() + partial_at[1]};
    unsigned char* block = workspace_.data() + block_at;

    // This rank's own block in two halves when the ring goes on: one now, the other while the
    // last hop travels. Halves of its K/V heads (each half's calls are the whole block's, with
    // blocks as long), or of its key rows when it has one K/V head. With the K/V kept from the
    // forward nothing travels now, and the whole block runs under the last hop.
    const Part halves[2] = {own_half(0), own_half(1)};
    const std::vector<Call> own_calls[2] = {calls(rank_, halves[0].keys), calls(rank_, halves[1].keys)};
    const bool own_written[2] = {prepare_grads(own_calls[0], own, rank_, halves[0]),
                                 prepare_grads(own_calls[1], own, rank_, halves[1])};
    const auto own_part = [&](int half) {
      const KeyValues grads = grad_views(own, rank_);
      for (const Call& c : own_calls[half])
        backward_call(c, home_, grads, dq_acc, out, dout, lse, own_written[half], halves[half].heads);
    };

    prepare_travel();
    std::unique_ptr<CommRequest> grads_in;
    for (int s = 0; s < steps_; ++s) {
      std::unique_ptr<CommRequest> kv_in = s + 1 < steps_ && !kept_ ? pass_kv(s) : nullptr;
      if (s == 0) {
        if (!kept_) own_part(0);
        if (kv_in) kv_in->wait();
        continue;
      }
      const int src = source(s);
      const KeyValues kv = key_values(s);
      unsigned char* carried = partial[s % 2];
      unsigned char* target = s == 1 ? carried : block;
      const std::vector<Call> step_calls = calls(src);
      // Step 1's partial travels on even if no pair reached it; a later step's block that no pair
      // reached is simply not added. A partial whose next hop is its last carries only the rows that
      // some call reached, and only those need to be ready.
      const Block ready = steps_ == 2 ? read_rows(src, 1) : Block{0, geo_.rows[src]};
      const bool written =
          (s == 1 || !step_calls.empty()) && prepare_grads(step_calls, target, src, {ready, all_heads()});
      for (const Call& c : step_calls)
        backward_call(c, kv, grad_views(target, src), dq_acc, out, dout, lse, written, all_heads());
      if (s > 1) {
        grads_in->wait();
        const int64_t n = 2 * rows_elements(src);
        if (!step_calls.empty()) kernels::add(flat(block, device_, n), flat(carried, device_, n), stream_);
      }
      if (s + 1 < steps_)
        grads_in = exchange(grad_views(carried, src), {0, geo_.rows[src]}, next(),
                            grad_views(partial[(s + 1) % 2], source(s + 1)), {0, geo_.rows[source(s + 1)]}, prev());
      if (kv_in) kv_in->wait();
    }

    // dK and dV: this rank's own plus the partial that arrives, summed and rounded in one pass. The
    // partial held last is of block (r - steps + 1) mod P: its last hop takes it home, during the
    // second half of this rank's own block, and this rank's own arrives from rank
    // (r + steps - 1) mod P. The hop carries the rows that the other ranks' calls reached; the
    // rest of dK and dV is this rank's own.
    const TensorView dk = batched(p_.dk, p_.packed), dv = batched(p_.dv, p_.packed);
    const KeyValues mine = grad_views(own, rank_);
    Block reached{};
    if (steps_ > 1) {
      const int home = source(steps_ - 1), from = (rank_ + steps_ - 1) % world_;
      unsigned char* arrived = partial[steps_ % 2];
      reached = read_rows(rank_, 1);
      const std::unique_ptr<CommRequest> last = exchange(grad_views(partial[(steps_ - 1) % 2], home),
                                                         read_rows(home, 1), home, grad_views(arrived, rank_),
                                                         reached, from);
      if (kept_) own_part(0);
      own_part(1);
      last->wait();
      const KeyValues others = grad_views(arrived, rank_);
      if (reached.count > 0) {
        kernels::add(rows(mine.k, reached), rows(others.k, reached), rows(dk, reached), stream_);
        kernels::add(rows(mine.v, reached), rows(others.v, reached), rows(dv, reached), stream_);
      }
    }
    const int64_t after = reached.row + reached.count;
    const Block rest[2] = {{0, reached.row}, {after, geo_.rows[rank_] - after}};
    for (const Block& r : rest)
      if (r.count > 0) {
        kernels::copy(rows(mine.k, r), rows(dk, r), stream_);
        kernels::copy(rows(mine.v, r), rows(dv, r), stream_);
      }
    if (own_dq) kernels::copy(dq_acc, dq, stream_);
  }

 private:
  int source(int step) const { return (rank_ - step + world_) % world_; }
  int next() const { return (rank_ + 1) % world_; }
  int prev() const { return (rank_ - 1 + world_) % world_; }

  // K/V heads [first, first + count), and the query heads that attend to them.
  struct Heads {
    int64_t first, count;
  };
  Heads all_heads() const { return {0, p_.heads_kv}; }

  // Key rows and K/V heads of a block.
  struct Part {
    Block keys;
    Heads heads;
  };

  // Half `half` of this rank's own block (all of it at half 0 when the ring has one step or the
  // K/V kept from the forward).
  Part own_half(int half) const {
    const Block keys{0, geo_.rows[rank_]};
    if (steps_ == 1 || kept_) return half == 0 ? Part{keys, all_heads()} : Part{keys, {0, 0}};
    if (p_.heads_kv > 1) {
      const int64_t split = p_.heads_kv / 2;
      return {keys, half == 0 ? Heads{0, split} : Heads{split, p_.heads_kv - split}};
    }
    const int64_t split = keys.count / 2;
    return {half == 0 ? Block{0, split} : Block{split, keys.count - split}, all_heads()};
  }

  // The query heads that attend to K/V heads `h`.
  Heads query_heads(const Heads& h) const {
    const int64_t group = p_.heads_q / p_.heads_kv;
    return {h.first * group, h.count * group};
  }

  // Heads `h` of a (B, rows, H, D) tensor.
  static TensorView heads(const TensorView& t, const Heads& h) { return narrow(t, 2, h.first, h.count); }

  // Readies the rows and heads of `part` of the fp32 dK/dV of `rank`'s block at `grads` for
  // `calls`. When their key blocks are disjoint: zeros in the rows that none of them covers, and
  // true (the calls write their own rows, overwrite_dkdv). Otherwise: zeros in all of them, and
  // false (the calls add).
  bool prepare_grads(const std::vector<Call>& calls, unsigned char* grads, int rank, const Part& part) const {
    const std::optional<std::vector<Block>> gaps = uncovered(calls, &Call::k, part.keys);
    const KeyValues views = grad_views(grads, rank);
    for (const Block& zeros : gaps ? *gaps : std::vector<Block>{part.keys})
      for (const TensorView& t : {views.k, views.v})
        if (zeros.count > 0 && part.heads.count > 0) kernels::fill(heads(rows(t, zeros), part.heads), 0.0f, stream_);
    return gaps.has_value();
  }

  // One backward call of a step, on heads `h`: gradients added into dq_acc and into (or, where
  // `overwrite`, written to) `grads`, the fp32 dK/dV of the step's K/V.
  void backward_call(const Call& c, const KeyValues& kv, const KeyValues& grads, const TensorView& dq_acc,
                     const TensorView& out, const TensorView& dout, const TensorView& lse, bool overwrite,
                     const Heads& h) const {
    if (h.count == 0) return;
    AttentionParams params = c.params;
    params.overwrite_dkdv = overwrite;
    const Heads hq = query_heads(h);
    if (params.alibi_slopes) params.alibi_slopes = narrow(*params.alibi_slopes, -1, hq.first, hq.count);
    const auto q_rows = [&](const TensorView& t) { return heads(rows(t, c.q), hq); };
    const auto k_rows = [&](const TensorView& t) { return heads(rows(t, c.k), h); };
    attention_backward(q_rows(q_), k_rows(kv.k), k_rows(kv.v), q_rows(out), q_rows(dout),
                       narrow(lse_rows(lse, c.q), 1, hq.first, hq.count), q_rows(dq_acc), k_rows(grads.k),
                       k_rows(grads.v), params);
  }

  // Elements of one of K, V, dK, dV of `rank`'s rows.
  int64_t rows_elements(int rank) const { return geo_.batch * geo_.rows[rank] * p_.heads_kv * p_.head_dim; }

  // The kernel calls of a step against `src`'s K/V: per group, one call over every pair of this
  // rank's query pieces and `src`'s key pieces that the mask does not leave empty when one call
  // sees what they see (zigzag's steps always), else one call per pair. Fewer, larger calls leave
  // the GPU idle less at their ends. `keys` limits the calls to those rows of `src`'s (all by
  // default).
  std::vector<Call> calls(int src, const Block& keys = kAllRows) const { return calls_of(rank_, src, keys); }

  // The calls that rank `queries` makes against `src`'s K/V.
  std::vector<Call> calls_of(int queries, int src, const Block& keys = kAllRows) const {
    std::vector<Call> out;
    for (size_t group = 0; group < geo_.runs[queries].size(); ++group) {
      const AttentionParams base = group_params(static_cast<int64_t>(group));
      const std::vector<Run>& qs = geo_.runs[queries][group];
      const std::vector<Run> ks = clipped(geo_.runs[src][group], keys);
      struct Pair {
        size_t q, k;
        AttentionParams params;
      };
      std::vector<Pair> pairs;
      size_t qa = qs.size(), qb = 0, ka = ks.size(), kb = 0;
      for (size_t i = 0; i < qs.size(); ++i)
        for (size_t j = 0; j < ks.size(); ++j)
          if (auto params = pair_params(base, band_, qs[i].piece, ks[j].piece, geo_.stride)) {
            pairs.push_back({i, j, std::move(*params)});
            qa = std::min(qa, i), qb = std::max(qb, i), ka = std::min(ka, j), kb = std::max(kb, j);
          }
      if (pairs.size() > 1 && geo_.stride == 1 &&
          same_visibility(band_, base.alibi_slopes.has_value(), qs, qa, qb, ks, ka, kb)) {
        AttentionParams params = base;
        params.q_offset = qs[qa].piece.start;
        params.k_offset = ks[ka].piece.start;
        out.push_back(visible_keys({block_of(qs, qa, qb), block_of(ks, ka, kb), params}));
        continue;
      }
      for (const Pair& pair : pairs)
        out.push_back(visible_keys({block_of(qs, pair.q, pair.q), block_of(ks, pair.k, pair.k), pair.params}));
    }
    return out;
  }

  // The call cut to the key rows that one of its queries sees, which the kernel reads and the
  // transfers carry (a window's reach into a block rather than all of it). Positions enter the
  // mask and ALiBi only as differences, so the key offset moves with the first row.
  static Call visible_keys(Call c) {
    const Band band = band_of(c.params);
    const int64_t q0 = c.params.q_offset, k0 = c.params.k_offset;
    const int64_t first = band.left ? std::max<int64_t>(0, q0 - *band.left - k0) : 0;
    const int64_t last = band.right ? std::min(c.k.count - 1, q0 + c.q.count - 1 + *band.right - k0) : c.k.count - 1;
    if (first > last) return c;
    c.k = {c.k.row + first, last - first + 1};
    c.params.k_offset += first;
    return c;
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

  static TensorView rows(const TensorView& t, const Block& b) { return narrow(t, 1, b.row, b.count); }
  static TensorView lse_rows(const TensorView& lse, const Block& b) { return narrow(lse, 2, b.row, b.count); }

  // Room in the workspace for the K/V in flight (a ring of two steps receives once, into the kept
  // buffer if there is one; a longer one alternates two buffers), and for a contiguous copy of this
  // rank's K/V when the caller's are strided (a message is one contiguous block).
  void plan_travel(kernels::WorkspaceLayout& layout) {
    if (steps_ == 1) return;
    const size_t size = dtype_size(p_.k.dtype());
    for (int i = kept_ ? 1 : 0; i < std::min(steps_ - 1, 2); ++i)
      travel_at_[i] = layout.add(static_cast<size_t>(2 * kv_elements_) * size);
    if (!p_.k.is_contiguous() || !p_.v.is_contiguous())
      staging_at_ = layout.add(static_cast<size_t>(2 * rows_elements(rank_)) * size);
  }

  void prepare_travel() {
    if (steps_ == 1) return;
    home_send_ = home_;
    if (staging_at_ != kNoStaging) {
      home_send_ = kv_views(workspace_.data() + staging_at_, rank_);
      kernels::copy(home_.k, home_send_.k, stream_);
      kernels::copy(home_.v, home_send_.v, stream_);
    }
  }

  unsigned char* travel(int i) const { return i == 0 && kept_ ? kept_ : workspace_.data() + travel_at_[i]; }

  // K and V (or dK and dV) of `rank` at `data`: [k | v], each (B, rows, Hkv, D) of `dtype`.
  KeyValues pair_views(unsigned char* data, DType dtype, int rank) const {
    const int64_t n = rows_elements(rank);
    return {contiguous(data, dtype, device_, geo_.batch, geo_.rows[rank], p_.heads_kv, p_.head_dim),
            contiguous(data + n * static_cast<int64_t>(dtype_size(dtype)), dtype, device_, geo_.batch,
                       geo_.rows[rank], p_.heads_kv, p_.head_dim)};
  }
  // K and V of `rank` in a travel buffer.
  KeyValues kv_views(unsigned char* data, int rank) const { return pair_views(data, p_.k.dtype(), rank); }
  // The fp32 dK and dV of `rank`'s block at `data`.
  KeyValues grad_views(unsigned char* data, int rank) const { return pair_views(data, DType::kFloat32, rank); }

  // The K/V visited at step s: this rank's own at step 0, then what step s - 1 received.
  KeyValues key_values(int s) const { return s == 0 ? home_ : kv_views(travel((s - 1) % 2), source(s)); }

  // The rows of `block`'s K/V that the ranks holding it at steps [first, steps_) read: the span of
  // their calls' key blocks (empty when none reads any). Every rank computes the same from the
  // layout, so both ends of a transfer know what travels.
  Block read_rows(int block, int first) const {
    int64_t begin = std::numeric_limits<int64_t>::max(), end = 0;
    for (int s = first; s < steps_; ++s)
      for (const Call& c : calls_of((block + s) % world_, block)) {
        begin = std::min(begin, c.k.row);
        end = std::max(end, c.k.row + c.k.count);
      }
    return begin < end ? Block{begin, end - begin} : Block{};
  }

  // The messages that carry rows `span` of `t`, a contiguous (B, rows, ...) tensor: one per batch
  // entry, or one in all where the rows of every entry travel. A tensor with rows of which none
  // travels still sends an empty message, so that the ranks meet at every step as before (a rank
  // that fails then fails its neighbours' steps too).
  static void rows_ops(std::vector<P2POp>& ops, P2POp::Kind kind, int peer, const TensorView& t, const Block& span) {
    if (t.numel() == 0) return;
    if (span.count == 0) return ops.push_back({kind, peer, t.data(), 0});
    // Bytes per row from the shape: a dimension of size 1 may have any stride.
    const int64_t batch = t.size(0), rows = t.size(1);
    const int64_t row_bytes = t.numel() / (batch * rows) * static_cast<int64_t>(dtype_size(t.dtype()));
    const bool whole = batch == 1 || span.count == rows;
    auto* data = static_cast<unsigned char*>(t.data());
    const size_t bytes = static_cast<size_t>(span.count * row_bytes * (whole ? batch : 1));
    for (int64_t b = 0; b < (whole ? 1 : batch); ++b)
      ops.push_back({kind, peer, data + (b * rows + span.row) * row_bytes, bytes});
  }

  // Posts the K/V of step s to the next rank and the receive of step s + 1's from the previous one:
  // only the rows that the block's holders from step s + 1 on read.
  std::unique_ptr<CommRequest> pass_kv(int s) {
    const KeyValues send = s == 0 ? home_send_ : kv_views(travel((s - 1) % 2), source(s));
    const KeyValues recv = kv_views(travel(s % 2), source(s + 1));
    return exchange(send, read_rows(source(s), s + 1), next(), recv, read_rows(source(s + 1), s + 1), prev());
  }

  // Sends rows `send_rows` of a pair (K and V, or a dK/dV partial) to rank `to` and receives rows
  // `recv_rows` of another pair from rank `from`, in one group.
  std::unique_ptr<CommRequest> exchange(const KeyValues& send, const Block& send_rows, int to, const KeyValues& recv,
                                        const Block& recv_rows, int from) {
    std::vector<P2POp> ops;
    for (const TensorView& t : {send.k, send.v}) rows_ops(ops, P2POp::Kind::kSend, to, t, send_rows);
    for (const TensorView& t : {recv.k, recv.v}) rows_ops(ops, P2POp::Kind::kRecv, from, t, recv_rows);
    return comm_.send_recv(ops);
  }

  static constexpr size_t kNoStaging = SIZE_MAX;

  Communicator& comm_;
  const Problem& p_;
  const int rank_, world_;
  const Geometry geo_;
  const Band band_;
  const int steps_;
  const int64_t kv_elements_;  // of one of K, V, dK, dV for the rank with the most rows
  const Device device_;
  void* const stream_;
  TensorView q_;
  KeyValues home_, home_send_;
  // Every buffer of a call, in one allocation; requests in flight end before it is released.
  kernels::Workspace workspace_;
  size_t travel_at_[2] = {0, 0};
  size_t staging_at_ = kNoStaging;
  unsigned char* kept_ = nullptr;  // ParallelOptions::kept_kv, where the ring takes two steps
};

}  // namespace

void ring_forward(Communicator& comm, Layout layout, const Problem& p) { Ring(comm, layout, p).forward(); }

void ring_backward(Communicator& comm, Layout layout, const Problem& p) { Ring(comm, layout, p).backward(); }

}  // namespace ringflash::parallel
