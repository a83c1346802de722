// CPU attention forward: one work item is one tile of kBlockM queries of one head; it walks the
// key tiles the mask leaves visible and keeps an online softmax per query.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../../core/thread_pool.h"
#include "../common/merge.h"
#include "attention_cpu.h"
#include "tile.h"

namespace ringflash::cpu {
namespace {

// Keys per tile. Larger tiles amortise the per-tile rescale of the output; 128 keys x 64 queries
// of fp32 scores (32 KiB) stay in L1/L2 with the packed Q^T.
constexpr int64_t kBlockN = 128;

struct WorkItem {
  int64_t b, h, q0;
  int64_t cost;  // visible keys, to hand out the longest items first
};

struct ForwardScratch {
  std::vector<float> qt, st, o, m, l;
  ForwardScratch(int64_t head_dim, int64_t padded_dim)
      : qt(head_dim * kBlockM), st(kBlockN * kBlockM), o(kBlockM * padded_dim), m(kBlockM), l(kBlockM) {}
};

template <typename T>
class Forward {
 public:
  explicit Forward(const AttentionArgs& a)
      : a_(a), d_(a.head_dim), dp_(round_up(a.head_dim, kVecWidth)), t_(ScoreTransform::make(a)) {}

  void run() {
    k_.pack<T>(a_, a_.k, a_.rows_k, a_.heads_kv, dp_);
    v_.pack<T>(a_, a_.v, a_.rows_k, a_.heads_kv, dp_);
    std::vector<WorkItem> items = make_items();
    std::vector<ForwardScratch> scratch;
    const int threads = static_cast<int>(std::min<int64_t>(a_.num_threads, std::max<size_t>(items.size(), 1)));
    scratch.reserve(threads);
    for (int i = 0; i < threads; ++i) scratch.emplace_back(d_, dp_);
    core::parallel_for(static_cast<int64_t>(items.size()), threads,
                       [&](int64_t i, int worker) { tile(items[i], scratch[worker]); });
    clear_unused_rows();
  }

 private:
  std::vector<WorkItem> make_items() const {
    std::vector<WorkItem> items;
    const core::Mask mask = mask_of(a_);
    for (int64_t b = 0; b < a_.batch; ++b) {
      const Sequence s = sequence(a_, b);
      for (int64_t q0 = 0; q0 < s.len_q; q0 += kBlockM) {
        const int64_t q1 = std::min(q0 + kBlockM, s.len_q);
        int64_t first, last;
        mask.key_span(s.pos_q + q0, s.pos_q + q1, s.pos_k, s.pos_k + s.len_k, &first, &last);
        for (int64_t h = 0; h < a_.heads_q; ++h) items.push_back({b, h, q0, last - first});
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
    return items;
  }

  void tile(const WorkItem& item, ForwardScratch& w) const {
    const int64_t b = item.b, h = item.h, hk = h / (a_.heads_q / a_.heads_kv);
    const Sequence s = sequence(a_, b);
    const int64_t q0 = item.q0, rows = std::min(kBlockM, s.len_q - q0);
    const int64_t pq0 = s.pos_q + q0;
    const float alibi = a_.alibi_slopes ? a_.alibi_slopes[b * a_.alibi_batch_stride + h] * kLog2e : 0.0f;

    pack_transposed(row_ptr<const T>(a_.q, b, s.row_q + q0, h), a_.q.row_stride, rows, d_, t_.q_scale, w.qt.data());
    std::fill(w.o.begin(), w.o.end(), 0.0f);
    std::fill(w.m.begin(), w.m.end(), -kInf);
    std::fill(w.l.begin(), w.l.end(), 0.0f);

    int64_t first, last;
    t_.mask.key_span(pq0, pq0 + rows, s.pos_k, s.pos_k + s.len_k, &first, &last);
    for (int64_t pk0 = first; pk0 < last; pk0 += kBlockN) {
      const int64_t n = std::min(kBlockN, last - pk0);
      const core::BlockKind kind = t_.mask.classify(pq0, pq0 + rows, pk0, pk0 + n);
      if (kind == core::BlockKind::kEmpty) continue;
      const int64_t k0 = s.row_k + (pk0 - s.pos_k);
      const float* kt = k_.row(slot(a_, b), hk, k0);
      const float* vt = v_.row(slot(a_, b), hk, k0);

      // S^T (n x kBlockM) = K Q^T
      gemm<false>(n, kBlockM, d_, {kt, dp_, 1, w.qt.data(), kBlockM, w.st.data(), kBlockM});
      transform_scores(t_, alibi, kind == core::BlockKind::kPartial, pq0, pk0, n, w.st.data(), nullptr);
      online_softmax(n, w);
      // O += P V, with P = (S^T)^T read in place.
      gemm<true>(kBlockM, dp_, n, {w.st.data(), 1, kBlockM, vt, dp_, w.o.data(), dp_});
    }
    finish(b, h, s, q0, rows, w);
  }

  // Turns the score tile into probabilities against the running column maxima, and rescales the
  // output rows and sums for the new maxima.
  void online_softmax(int64_t n, ForwardScratch& w) const {
    float* st = w.st.data();
    Vec alpha[kColumnVecs];
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      const Vec m_old = load(w.m.data() + c * kVecWidth);
      Vec m_new = m_old;
      for (int64_t r = 0; r < n; ++r) m_new = vmax(m_new, load(st + r * kBlockM + c * kVecWidth));
      // A column that has seen only masked keys keeps max -inf; subtracting 0 instead gives
      // exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
      const Vec m_use = m_new == -kInf ? Vec{} : m_new;
      Vec sum{};
      for (int64_t r = 0; r < n; ++r) {
        float* p = st + r * kBlockM + c * kVecWidth;
        const Vec e = exp2(load(p) - m_use);
        store(p, e);
        sum += e;
      }
      alpha[c] = exp2(m_old - m_use);
      store(w.m.data() + c * kVecWidth, m_new);
      store(w.l.data() + c * kVecWidth, load(w.l.data() + c * kVecWidth) * alpha[c] + sum);
    }
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      for (int i = 0; i < kVecWidth; ++i) {
        const float f = alpha[c][i];
        if (f == 1.0f) continue;
        float* row = w.o.data() + (c * kVecWidth + i) * dp_;
        for (int64_t d = 0; d < dp_; d += kVecWidth) store(row + d, load(row + d) * f);
      }
    }
  }

  void finish(int64_t b, int64_t h, const Sequence& s, int64_t q0, int64_t rows, ForwardScratch& w) const {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = s.row_q + q0 + r;
      float* o = w.o.data() + r * dp_;
      const float l = w.l[r];
      const float lse = l > 0.0f ? (w.m[r] + std::log2(l)) * kLn2 : -kInf;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      float* lse_out = lse_ptr(a_, b, row, h);
      if (a_.accumulate) {
        const core::MergeWeights mw = core::merge_weights(*lse_out, lse);
        float* out = row_ptr<float>(a_.out, b, row, h);
        const float wb = mw.w_blk * inv;
        // w_acc == 0 means the accumulator is empty: ignore whatever it holds.
        for (int64_t d = 0; d < d_; ++d) out[d] = (mw.w_acc == 0.0f ? 0.0f : mw.w_acc * out[d]) + wb * o[d];
        *lse_out = mw.lse;
        continue;
      }
      for (int64_t d = 0; d < d_; ++d) o[d] *= inv;
      *lse_out = lse;
      if (a_.out_dtype == DType::kFloat32)
        store_row(o, d_, false, row_ptr<float>(a_.out, b, row, h));
      else
        store_row(o, d_, false, row_ptr<T>(a_.out, b, row, h));
    }
  }

  // Rows of a packed batch outside [cu_seqlens_q[0], cu_seqlens_q[B]) belong to no sequence:
  // without accumulate they are written as empty rows (out = 0, lse = -inf).
  void clear_unused_rows() const {
    if (a_.accumulate || !a_.cu_seqlens_q) return;
    const std::vector<float> zeros(d_, 0.0f);
    for (int64_t r = 0; r < a_.rows_q; ++r) {
      if (r >= a_.cu_seqlens_q[0] && r < a_.cu_seqlens_q[a_.batch]) continue;
      for (int64_t h = 0; h < a_.heads_q; ++h) {
        *lse_ptr(a_, 0, r, h) = -kInf;
        if (a_.out_dtype == DType::kFloat32)
          store_row(zeros.data(), d_, false, row_ptr<float>(a_.out, 0, r, h));
        else
          store_row(zeros.data(), d_, false, row_ptr<T>(a_.out, 0, r, h));
      }
    }
  }

  const AttentionArgs& a_;
  const int64_t d_, dp_;
  const ScoreTransform t_;
  HeadMajor k_, v_;
};

}  // namespace

void attention_forward(const AttentionArgs& args) {
  switch (args.dtype) {
    case DType::kFloat32: return Forward<float>(args).run();
    case DType::kFloat16: return Forward<_Float16>(args).run();
    case DType::kBFloat16: return Forward<BFloat16>(args).run();
    default: break;
  }
}

const char* isa_name() { return kIsaName; }

}  // namespace ringflash::cpu
