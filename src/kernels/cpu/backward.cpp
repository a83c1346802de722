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
  std::vector<float> k, v;               // K and V tile rows, fp32, padded
  std::vector<float> qt, dot;            // Q^T (scaled) and dO^T, head_dim x kBlockM
  std::vector<float> q, dout;            // Q and dO rows, kBlockM x padded
  std::vector<float> st, dpt, tanh_grad; // P^T, dP^T / dS^T, softcap derivative: kBlockN x kBlockM
  std::vector<float> dk, dv;             // kBlockN x padded accumulators
  std::vector<float> delta, lse2;        // per query of the tile
  BackwardScratch(int64_t head_dim, int64_t padded)
      : k(kBlockN * padded), v(kBlockN * padded), qt(head_dim * kBlockM), dot(head_dim * kBlockM),
        q(kBlockM * padded), dout(kBlockM * padded), st(kBlockN * kBlockM), dpt(kBlockN * kBlockM),
        tanh_grad(kBlockN * kBlockM), dk(kBlockN * padded), dv(kBlockN * padded), delta(kBlockM), lse2(kBlockM) {}
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
    std::vector<BackwardScratch> scratch;
    scratch.reserve(threads);
    for (int i = 0; i < threads; ++i) scratch.emplace_back(d_, dp_);
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
    return dq_acc_.data() + (((chunk * batches + (a_.cu_seqlens_q ? 0 : b)) * total_q_ + row) * a_.heads_q + h) * dp_;
  }

  void chunk(const WorkItem& item, BackwardScratch& w) {
    const int64_t b = item.b, hk = item.hk;
    const Sequence s = sequence(a_, b);
    for (int64_t j0 = item.k_begin; j0 < item.k_end; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, item.k_end - j0);
      const int64_t pk0 = s.pos_k + j0;
      const RowBlock kb = rows_fp32<T>(a_.k, b, s.row_k + j0, hk, n, d_, dp_, w.k.data());
      const RowBlock vb = rows_fp32<T>(a_.v, b, s.row_k + j0, hk, n, d_, dp_, w.v.data());
      std::fill(w.dk.begin(), w.dk.end(), 0.0f);
      std::fill(w.dv.begin(), w.dv.end(), 0.0f);
      int64_t first, last;
      t_.mask.query_span(pk0, pk0 + n, s.pos_q, s.pos_q + s.len_q, &first, &last);
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t h = hk * group_ + g;
        const float alibi = a_.alibi_slopes ? a_.alibi_slopes[b * a_.alibi_batch_stride + h] * kLog2e : 0.0f;
        for (int64_t pq0 = first; pq0 < last; pq0 += kBlockM) {
          const int64_t rows = std::min(kBlockM, last - pq0);
          const core::BlockKind kind = t_.mask.classify(pq0, pq0 + rows, pk0, pk0 + n);
          if (kind == core::BlockKind::kEmpty) continue;
          tile(b, h, s, pq0 - s.pos_q, rows, pk0, n, kind == core::BlockKind::kPartial, alibi, kb, vb, item.chunk, w);
        }
      }
      write_kv(b, hk, s.row_k + j0, n, w);
    }
  }

  void tile(int64_t b, int64_t h, const Sequence& s, int64_t q0, int64_t rows, int64_t pk0, int64_t n, bool partial,
            float alibi, const RowBlock& kb, const RowBlock& vb, int64_t chunk, BackwardScratch& w) {
    const int64_t row0 = s.row_q + q0, pq0 = s.pos_q + q0;
    pack_queries(b, h, row0, rows, w);

    // P^T = exp2(S^T - lse), S^T = K Q^T
    float* st = w.st.data();
    gemm<false>(n, kBlockM, d_, {kb.data, kb.ld, 1, w.qt.data(), kBlockM, st, kBlockM});
    transform_scores(t_, alibi, partial, pq0, pk0, n, st, t_.softcap ? w.tanh_grad.data() : nullptr);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        float* p = st + r * kBlockM + c * kVecWidth;
        store(p, exp2(load(p) - load(w.lse2.data() + c * kVecWidth)));
      }

    // dV += P^T dO
    gemm<true>(n, dp_, rows, {st, kBlockM, 1, w.dout.data(), dp_, w.dv.data(), dp_});
    // dP^T = V dO^T
    float* ds = w.dpt.data();
    gemm<false>(n, kBlockM, d_, {vb.data, vb.ld, 1, w.dot.data(), kBlockM, ds, kBlockM});
    // dS^T = P^T (dP^T - delta), times the score's derivative in q.k: scale (x softcap's 1 - tanh^2)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        const int64_t at = r * kBlockM + c * kVecWidth;
        Vec g = load(st + at) * (load(ds + at) - load(w.delta.data() + c * kVecWidth)) * a_.scale;
        if (t_.softcap) g *= load(w.tanh_grad.data() + at);
        store(ds + at, g);
      }
    // dK += dS^T Q
    gemm<true>(n, dp_, rows, {ds, kBlockM, 1, w.q.data(), dp_, w.dk.data(), dp_});
    // dQ += dS K, dS = (dS^T)^T read in place
    gemm<true>(rows, dp_, n, {ds, 1, kBlockM, kb.data, kb.ld, dq_acc(chunk, b, row0, h), a_.heads_q * dp_});
  }

  // Q, dO and their transposes for one query tile, with delta = rowsum(dO * O) and lse in log2
  // units. Rows past `rows` are zero, and their lse is +inf so that their P is exactly 0.
  void pack_queries(int64_t b, int64_t h, int64_t row0, int64_t rows, BackwardScratch& w) const {
    const T* q = row_ptr<const T>(a_.q, b, row0, h);
    const T* dout = row_ptr<const T>(a_.dout, b, row0, h);
    pack_transposed(q, a_.q.row_stride, rows, d_, t_.q_scale, w.qt.data());
    pack_transposed(dout, a_.dout.row_stride, rows, d_, 1.0f, w.dot.data());
    for (int64_t r = 0; r < kBlockM; ++r) {
      float* qr = w.q.data() + r * dp_;
      float* dr = w.dout.data() + r * dp_;
      if (r >= rows) {
        std::fill(qr, qr + dp_, 0.0f);
        std::fill(dr, dr + dp_, 0.0f);
        w.delta[r] = 0.0f;
        w.lse2[r] = kInf;
        continue;
      }
      convert_row(q + r * a_.q.row_stride, d_, dp_, qr);
      convert_row(dout + r * a_.dout.row_stride, d_, dp_, dr);
      float delta = 0.0f;
      if (a_.out_dtype == DType::kFloat32) {
        const float* o = row_ptr<const float>(a_.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) delta += dr[d] * o[d];
      } else {
        const T* o = row_ptr<const T>(a_.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) delta += dr[d] * to_float(o[d]);
      }
      w.delta[r] = delta;
      const float lse = *lse_ptr(a_, b, row0 + r, h);
      // A row that saw no key (lse = -inf) has P = 0: exp2(s - inf) = 0.
      w.lse2[r] = lse == -kInf ? kInf : lse * kLog2e;
    }
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
