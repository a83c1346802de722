// CPU attention backward (recomputes the probabilities from the saved log-sum-exp).
//
// One work item is a contiguous chunk of key tiles of one K/V head: it owns dK and dV of those
// keys outright, and walks every query tile of every query head of its group that the mask leaves
// visible. dQ receives contributions from every chunk, so each chunk adds into its own fp32 copy
// of dQ and a final pass sums the copies in a fixed order: the result is deterministic, whatever
// the thread count or scheduling.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../core/thread_pool.h"
#include "attention_cpu.h"
#include "tile.h"

namespace ringflash::cpu {
namespace {

constexpr int64_t kBlockN = 128;  // keys per tile
// Chunks per (sequence, K/V head) are chosen so that there are at least this many items per thread.
constexpr int64_t kItemsPerThread = 2;

struct WorkItem {
  int64_t b, hk, chunk;
  int64_t k_begin, k_end;  // key rows of the sequence, a whole number of tiles
  int64_t cost;
};

struct BackwardScratch {
  std::vector<float> st, dpt, tanh_grad;  // P^T, dP^T then dS^T, softcap derivative: kBlockN x kBlockM
  std::vector<float> dk, dv;              // kBlockN x padded accumulators
  explicit BackwardScratch(int64_t padded)
      : st(kBlockN * kBlockM), dpt(kBlockN * kBlockM), tanh_grad(kBlockN * kBlockM), dk(kBlockN * padded),
        dv(kBlockN * padded) {}
};

// Every query tile of every head, packed once per call in the forms the tile products read:
// Q^T (scaled) and dO^T as head_dim x kBlockM, Q and dO rows as kBlockM x padded, delta = rowsum(dO * O)
// and lse in log2 units. Rows past a sequence's end are zero, with lse +inf so that their P is 0.
struct QueryTile {
  const float *qt, *q, *dot, *dout, *delta, *lse2;
};

class QueryTiles {
 public:
  template <typename T>
  void pack(const AttentionArgs& a, float q_scale, int64_t padded) {
    d_ = a.head_dim;
    padded_ = padded;
    first_tile_.assign(static_cast<size_t>(a.batch + 1), 0);
    for (int64_t b = 0; b < a.batch; ++b)
      first_tile_[b + 1] = first_tile_[b] + (sequence(a, b).len_q + kBlockM - 1) / kBlockM;
    tiles_ = first_tile_[a.batch];
    const int64_t n = a.heads_q * tiles_;
    qt_.resize(static_cast<size_t>(n * d_ * kBlockM));
    dot_.resize(qt_.size());
    q_.resize(static_cast<size_t>(n * kBlockM * padded));
    dout_.resize(q_.size());
    delta_.resize(static_cast<size_t>(n * kBlockM));
    lse2_.resize(delta_.size());
    core::parallel_for(a.batch * a.heads_q, a.num_threads, [&](int64_t i, int) {
      const int64_t b = i / a.heads_q, h = i % a.heads_q;
      const Sequence s = sequence(a, b);
      for (int64_t t = 0; t * kBlockM < s.len_q; ++t) pack_tile<T>(a, b, h, s, t, q_scale);
    });
  }

  QueryTile tile(int64_t b, int64_t h, int64_t t) const {
    const int64_t g = h * tiles_ + first_tile_[b] + t;
    return {qt_.data() + g * d_ * kBlockM, q_.data() + g * kBlockM * padded_, dot_.data() + g * d_ * kBlockM,
            dout_.data() + g * kBlockM * padded_, delta_.data() + g * kBlockM, lse2_.data() + g * kBlockM};
  }

 private:
  template <typename T>
  void pack_tile(const AttentionArgs& a, int64_t b, int64_t h, const Sequence& s, int64_t t, float q_scale) {
    const int64_t g = h * tiles_ + first_tile_[b] + t;
    const int64_t row0 = s.row_q + t * kBlockM, rows = std::min(kBlockM, s.len_q - t * kBlockM);
    const T* q = row_ptr<const T>(a.q, b, row0, h);
    const T* dout = row_ptr<const T>(a.dout, b, row0, h);
    pack_transposed(q, a.q.row_stride, rows, d_, q_scale, qt_.data() + g * d_ * kBlockM);
    pack_transposed(dout, a.dout.row_stride, rows, d_, 1.0f, dot_.data() + g * d_ * kBlockM);
    float* qr = q_.data() + g * kBlockM * padded_;
    float* dr = dout_.data() + g * kBlockM * padded_;
    float* delta = delta_.data() + g * kBlockM;
    float* lse2 = lse2_.data() + g * kBlockM;
    for (int64_t r = 0; r < kBlockM; ++r, qr += padded_, dr += padded_) {
      if (r >= rows) {
        std::fill(qr, qr + padded_, 0.0f);
        std::fill(dr, dr + padded_, 0.0f);
        delta[r] = 0.0f;
        lse2[r] = kInf;
        continue;
      }
      convert_row(q + r * a.q.row_stride, d_, padded_, qr);
      convert_row(dout + r * a.dout.row_stride, d_, padded_, dr);
      float sum = 0.0f;
      if (a.out_dtype == DType::kFloat32) {
        const float* o = row_ptr<const float>(a.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) sum += dr[d] * o[d];
      } else {
        const T* o = row_ptr<const T>(a.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) sum += dr[d] * to_float(o[d]);
      }
      delta[r] = sum;
      const float lse = *lse_ptr(a, b, row0 + r, h);
      // A row that saw no key (lse = -inf) has P = 0: exp2(s - inf) = 0.
      lse2[r] = lse == -kInf ? kInf : lse * kLog2e;
    }
  }

  int64_t d_ = 0, padded_ = 0, tiles_ = 0;
  std::vector<int64_t> first_tile_;
  std::vector<float> qt_, q_, dot_, dout_, delta_, lse2_;
};

template <typename T>
class Backward {
 public:
  explicit Backward(const AttentionArgs& a)
      : a_(a), d_(a.head_dim), dp_(round_up(a.head_dim, kVecWidth)), group_(a.heads_q / a.heads_kv),
        t_(ScoreTransform::make(a)) {}

  void run() {
    total_q_ = a_.rows_q;
    chunks_ = chunk_count();
    std::vector<WorkItem> items = make_items();
    const int threads = std::max(1, static_cast<int>(std::min<int64_t>(a_.num_threads, std::max<size_t>(items.size(), 1))));
    const int64_t batches = a_.cu_seqlens_q ? 1 : a_.batch;
    dq_acc_.assign(static_cast<size_t>(chunks_ * batches * total_q_ * a_.heads_q * dp_), 0.0f);
    k_.pack<T>(a_, a_.k, a_.rows_k, a_.heads_kv, dp_);
    v_.pack<T>(a_, a_.v, a_.rows_k, a_.heads_kv, dp_);
    queries_.pack<T>(a_, t_.q_scale, dp_);
    std::vector<BackwardScratch> scratch;
    scratch.reserve(threads);
    for (int i = 0; i < threads; ++i) scratch.emplace_back(dp_);
    core::parallel_for(static_cast<int64_t>(items.size()), threads,
                       [&](int64_t i, int worker) { chunk(items[i], scratch[worker]); });
    write_dq(threads);
  }

 private:
  int64_t chunk_count() const {
    int64_t longest_tiles = 0;
    for (int64_t b = 0; b < a_.batch; ++b)
      longest_tiles = std::max(longest_tiles, (sequence(a_, b).len_k + kBlockN - 1) / kBlockN);
    const int64_t heads = std::max<int64_t>(1, a_.batch * a_.heads_kv);
    const int64_t wanted = (kItemsPerThread * a_.num_threads + heads - 1) / heads;
    return std::max<int64_t>(1, std::min(wanted, longest_tiles));
  }

  std::vector<WorkItem> make_items() const {
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < a_.batch; ++b) {
      const Sequence s = sequence(a_, b);
      const int64_t tiles = (s.len_k + kBlockN - 1) / kBlockN;
      for (int64_t c = 0; c < chunks_; ++c) {
        const int64_t t0 = tiles * c / chunks_, t1 = tiles * (c + 1) / chunks_;
        const int64_t k_begin = t0 * kBlockN, k_end = std::min(t1 * kBlockN, s.len_k);
        if (k_begin >= k_end) continue;
        int64_t first, last;
        t_.mask.query_span(s.pos_k + k_begin, s.pos_k + k_end, s.pos_q, s.pos_q + s.len_q, &first, &last);
        for (int64_t hk = 0; hk < a_.heads_kv; ++hk)
          items.push_back({b, hk, c, k_begin, k_end, (last - first) * (k_end - k_begin)});
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
    return items;
  }

  float* dq_acc(int64_t chunk, int64_t b, int64_t row, int64_t h) {
    const int64_t batches = a_.cu_seqlens_q ? 1 : a_.batch;
    // (chunk, batch, head, row, padded head_dim): rows of one head are contiguous.
    return dq_acc_.data() + (((chunk * batches + (a_.cu_seqlens_q ? 0 : b)) * a_.heads_q + h) * total_q_ + row) * dp_;
  }

  void chunk(const WorkItem& item, BackwardScratch& w) {
    const int64_t b = item.b, hk = item.hk;
    const Sequence s = sequence(a_, b);
    for (int64_t j0 = item.k_begin; j0 < item.k_end; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, item.k_end - j0);
      const int64_t pk0 = s.pos_k + j0;
      const float* kt = k_.row(slot(a_, b), hk, s.row_k + j0);
      const float* vt = v_.row(slot(a_, b), hk, s.row_k + j0);
      std::fill(w.dk.begin(), w.dk.end(), 0.0f);
      std::fill(w.dv.begin(), w.dv.end(), 0.0f);
      int64_t first, last;
      t_.mask.query_span(pk0, pk0 + n, s.pos_q, s.pos_q + s.len_q, &first, &last);
      if (first < last) {
        const int64_t t_first = (first - s.pos_q) / kBlockM, t_last = (last - s.pos_q + kBlockM - 1) / kBlockM;
        for (int64_t g = 0; g < group_; ++g) {
          const int64_t h = hk * group_ + g;
          const float alibi = a_.alibi_slopes ? a_.alibi_slopes[b * a_.alibi_batch_stride + h] * kLog2e : 0.0f;
          for (int64_t t = t_first; t < t_last; ++t) {
            const int64_t q0 = t * kBlockM, rows = std::min(kBlockM, s.len_q - q0);
            const core::BlockKind kind = t_.mask.classify(s.pos_q + q0, s.pos_q + q0 + rows, pk0, pk0 + n);
            if (kind == core::BlockKind::kEmpty) continue;
            const Tile tile{queries_.tile(b, h, t), s.pos_q + q0, rows, pk0, n, kind == core::BlockKind::kPartial, alibi};
            step(tile, kt, vt, dq_acc(item.chunk, b, s.row_q + q0, h), w);
          }
        }
      }
      write_kv(b, hk, s.row_k + j0, n, w);
    }
  }

  struct Tile {
    QueryTile q;
    int64_t pq0, rows, pk0, n;
    bool partial;
    float alibi;
  };

  // One (query tile, key tile) pair: recompute P, then dV, dS, dK and this tile's share of dQ.
  void step(const Tile& t, const float* kt, const float* vt, float* dq, BackwardScratch& w) const {
    const int64_t n = t.n;
    // P^T = exp2(S^T - lse), S^T = K Q^T
    float* st = w.st.data();
    gemm<false>(n, kBlockM, d_, {kt, dp_, 1, t.q.qt, kBlockM, st, kBlockM});
    transform_scores(t_, t.alibi, t.partial, t.pq0, t.pk0, n, st, t_.softcap ? w.tanh_grad.data() : nullptr);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        float* p = st + r * kBlockM + c * kVecWidth;
        store(p, exp2(load(p) - load(t.q.lse2 + c * kVecWidth)));
      }
    // dV += P^T dO
    gemm<true>(n, dp_, t.rows, {st, kBlockM, 1, t.q.dout, dp_, w.dv.data(), dp_});
    // dP^T = V dO^T
    float* ds = w.dpt.data();
    gemm<false>(n, kBlockM, d_, {vt, dp_, 1, t.q.dot, kBlockM, ds, kBlockM});
    // dS^T = P^T (dP^T - delta), times the score's derivative in q.k: scale (x softcap's 1 - tanh^2)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        const int64_t at = r * kBlockM + c * kVecWidth;
        Vec g = load(st + at) * (load(ds + at) - load(t.q.delta + c * kVecWidth)) * a_.scale;
        if (t_.softcap) g *= load(w.tanh_grad.data() + at);
        store(ds + at, g);
      }
    // dK += dS^T Q
    gemm<true>(n, dp_, t.rows, {ds, kBlockM, 1, t.q.q, dp_, w.dk.data(), dp_});
    // dQ += dS K, dS = (dS^T)^T read in place
    gemm<true>(t.rows, dp_, n, {ds, 1, kBlockM, kt, dp_, dq, dp_});
  }

  void write_kv(int64_t b, int64_t hk, int64_t row0, int64_t n, const BackwardScratch& w) const {
    for (int64_t r = 0; r < n; ++r) {
      store_grad(w.dk.data() + r * dp_, a_.dk, b, row0 + r, hk);
      store_grad(w.dv.data() + r * dp_, a_.dv, b, row0 + r, hk);
    }
  }

  void store_grad(const float* src, const AttentionArgs::Operand& o, int64_t b, int64_t row, int64_t h) const {
    if (a_.grad_dtype == DType::kFloat32)
      store_row(src, d_, a_.accumulate, row_ptr<float>(o, b, row, h));
    else
      store_row(src, d_, a_.accumulate, row_ptr<T>(o, b, row, h));
  }

  // dq = sum over chunks of the fp32 partial sums, in chunk order. Rows that no item reached
  // (masked out, or outside every packed sequence) get zeros from the zero-filled partials.
  void write_dq(int threads) {
    const int64_t batches = a_.cu_seqlens_q ? 1 : a_.batch;
    const int64_t rows = batches * total_q_;
    std::vector<std::vector<float>> sums(threads, std::vector<float>(dp_));
    core::parallel_for(rows, threads, [&](int64_t i, int worker) {
      const int64_t b = a_.cu_seqlens_q ? 0 : i / total_q_, row = a_.cu_seqlens_q ? i : i % total_q_;
      float* sum = sums[worker].data();
      for (int64_t h = 0; h < a_.heads_q; ++h) {
        std::copy_n(dq_acc(0, b, row, h), dp_, sum);
        for (int64_t c = 1; c < chunks_; ++c) {
          const float* part = dq_acc(c, b, row, h);
          for (int64_t d = 0; d < dp_; ++d) sum[d] += part[d];
        }
        store_grad(sum, a_.dq, b, row, h);
      }
    });
    zero_unused_kv();
  }

  // Rows of a packed batch outside [cu_seqlens_k[0], cu_seqlens_k[B]) belong to no sequence and
  // are visited by no item; without accumulate their gradients are still written, as zeros.
  void zero_unused_kv() const {
    if (a_.accumulate || !a_.cu_seqlens_k) return;
    const std::vector<float> zeros(dp_, 0.0f);
    for (int64_t r = 0; r < a_.rows_k; ++r) {
      if (r >= a_.cu_seqlens_k[0] && r < a_.cu_seqlens_k[a_.batch]) continue;
      for (int64_t hk = 0; hk < a_.heads_kv; ++hk) {
        store_grad(zeros.data(), a_.dk, 0, r, hk);
        store_grad(zeros.data(), a_.dv, 0, r, hk);
      }
    }
  }

  const AttentionArgs& a_;
  const int64_t d_, dp_, group_;
  const ScoreTransform t_;
  int64_t total_q_ = 0;
  int64_t chunks_ = 1;
  std::vector<float> dq_acc_;
  HeadMajor k_, v_;
  QueryTiles queries_;
};

}  // namespace

void attention_backward(const AttentionArgs& args) {
  switch (args.dtype) {
    case DType::kFloat32: return Backward<float>(args).run();
    case DType::kFloat16: return Backward<_Float16>(args).run();
    case DType::kBFloat16: return Backward<BFloat16>(args).run();
    default: break;
  }
}

}  // namespace ringflash::cpu
