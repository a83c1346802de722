// CPU attention forward: one work item is a run of up to kMaxGroup tiles of kBlockM queries of
// one head; it walks the key tiles the mask leaves visible and keeps an online softmax per query.
//
// Both products keep a dense kBlockM-column panel as their B operand, which keeps every B read
// inside L1 without cache-set conflicts:
//   S^T (keys x queries) = K Q^T            B = Q^T, packed once per item
//   O^T (dims x queries) += V^T P^T         B = P^T = the score tile itself
// and every per-query statistic (max, sum, rescale) is a vector across the columns.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../../core/thread_pool.h"
#include "../common/merge.h"
#include "attention_cpu.h"
#include "tile.h"

namespace ringflash::cpu {
namespace {

// A work item takes up to this many consecutive query tiles of one head, so each key tile it
// loads serves them all while it is in L2.
constexpr int64_t kMaxGroup = 8;
// Fewer tiles per item when that is what it takes to give each thread this many items.
constexpr int64_t kItemsPerThread = 16;

struct WorkItem {
  int64_t b, h, q0, tiles;
  int64_t cost;  // visible keys, to hand out the longest items first
};

// Per query tile of an item: Q^T, O^T, running max and sum per query, and the factor that
// rescales O^T for the latest max.
struct QueryState {
  float *qt, *ot, *m, *l, *alpha;
};

// A work item's scratch, carved from the running thread's kWorkerTiles buffer.
struct ForwardScratch {
  QueryState queries[kMaxGroup];
  float* st;  // S^T, then P^T; at the end, output rows

  explicit ForwardScratch(int64_t head_dim) {
    const size_t per_query = static_cast<size_t>(2 * head_dim * kBlockM + 3 * kBlockM);
    float* p = workspace(Buffer::kWorkerTiles, kMaxGroup * per_query + std::max(kBlockN * kBlockM, kVecWidth * head_dim));
    for (QueryState& q : queries) {
      q = {p, p + head_dim * kBlockM, p + 2 * head_dim * kBlockM, p + 2 * head_dim * kBlockM + kBlockM,
           p + 2 * head_dim * kBlockM + 2 * kBlockM};
      p += per_query;
    }
    st = p;
  }
};

template <typename T>
class Forward {
 public:
  explicit Forward(const AttentionArgs& a) : a_(a), d_(a.head_dim), t_(ScoreTransform::make(a)) {}

  void run() {
    k_.pack<T>(a_, a_.k, KeyTiles::Layout::kByKey, Buffer::kKeysByKey);
    v_.pack<T>(a_, a_.v, KeyTiles::Layout::kByDim, Buffer::kValuesByDim);
    const std::vector<WorkItem> items = make_items();
    const int threads = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(items.size()), 1, a_.num_threads));
    core::parallel_for(static_cast<int64_t>(items.size()), threads, [&](int64_t i, int) {
      ForwardScratch scratch(d_);
      run_item(items[i], scratch);
    });
    clear_unused_rows();
  }

 private:
  std::vector<WorkItem> make_items() const {
    int64_t tiles = 0;
    for (int64_t b = 0; b < a_.batch; ++b) tiles += (sequence(a_, b).len_q + kBlockM - 1) / kBlockM * a_.heads_q;
    const int64_t group = std::clamp<int64_t>(tiles / (kItemsPerThread * a_.num_threads), 1, kMaxGroup);
    // Head-major order, so that items handed out one after another share their head's K and V
    // while it is in L2; the stable sort by cost keeps that order among equal items.
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < a_.batch; ++b) {
      const Sequence s = sequence(a_, b);
      for (int64_t h = 0; h < a_.heads_q; ++h) {
        for (int64_t q0 = 0; q0 < s.len_q; q0 += group * kBlockM) {
          const int64_t q1 = std::min(q0 + group * kBlockM, s.len_q);
          int64_t first, last;
          t_.mask.key_span(s.pos_q + q0, s.pos_q + q1, s.pos_k, s.pos_k + s.len_k, &first, &last);
          const int64_t n_tiles = (q1 - q0 + kBlockM - 1) / kBlockM;
          items.push_back({b, h, q0, n_tiles, (last - first) * n_tiles});
        }
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
    return items;
  }

  void run_item(const WorkItem& item, ForwardScratch& w) const {
    const int64_t b = item.b, h = item.h, hk = h / (a_.heads_q / a_.heads_kv);
    const Sequence s = sequence(a_, b);
    const float alibi = a_.alibi_slopes ? a_.alibi_slopes[b * a_.alibi_batch_stride + h] * kLog2e : 0.0f;
    const int64_t q_end = std::min(item.q0 + item.tiles * kBlockM, s.len_q);

    for (int64_t i = 0; i < item.tiles; ++i) {
      QueryState& q = w.queries[i];
      const int64_t q0 = item.q0 + i * kBlockM;
      pack_transposed(row_ptr<const T>(a_.q, b, s.row_q + q0, h), a_.q.row_stride, std::min(kBlockM, s.len_q - q0),
                      d_, t_.q_scale, q.qt);
      std::fill(q.ot, q.ot + d_ * kBlockM, 0.0f);
      std::fill(q.m, q.m + kBlockM, -kInf);
      std::fill(q.l, q.l + kBlockM, 0.0f);
    }

    int64_t first, last;
    t_.mask.key_span(s.pos_q + item.q0, s.pos_q + q_end, s.pos_k, s.pos_k + s.len_k, &first, &last);
    const int64_t t_first = (first - s.pos_k) / kBlockN, t_last = (last - s.pos_k + kBlockN - 1) / kBlockN;
    for (int64_t t = t_first; t < t_last; ++t) {
      const int64_t pk0 = s.pos_k + t * kBlockN, n = std::min(kBlockN, s.len_k - t * kBlockN);
      const PanelOperand kt = k_.operand(k_.index(b, hk, t));
      const PanelOperand vt = v_.operand(v_.index(b, hk, t));
      for (int64_t i = 0; i < item.tiles; ++i) {
        const int64_t pq0 = s.pos_q + item.q0 + i * kBlockM;
        const int64_t rows = std::min(kBlockM, s.len_q - (item.q0 + i * kBlockM));
        const core::BlockKind kind = t_.mask.classify(pq0, pq0 + rows, pk0, pk0 + n);
        if (kind == core::BlockKind::kEmpty) continue;
        QueryState& q = w.queries[i];
        // S^T (n x kBlockM) = K Q^T
        gemm<false, UnitStrideTile>(n, kBlockM, d_, {kt.a, kt.a_rs, kt.a_cs, q.qt, kBlockM, w.st, kBlockM});
        transform_scores(t_, alibi, kind == core::BlockKind::kPartial, pq0, pk0, n, w.st, nullptr);
        online_softmax(n, w.st, q);
        // O^T (d x kBlockM) = alpha O^T + V^T P^T
        gemm<true, UnitStrideTile>(d_, kBlockM, n,
                   {vt.a, vt.a_rs, vt.a_cs, w.st, kBlockM, q.ot, kBlockM, q.alpha});
      }
    }
    for (int64_t i = 0; i < item.tiles; ++i) {
      const int64_t q0 = item.q0 + i * kBlockM;
      finish(b, h, s, q0, std::min(kBlockM, s.len_q - q0), w.queries[i], w.st);
    }
  }

  // Turns the score tile into probabilities against the running column maxima, rescales the
  // sums for the new maxima and leaves the output's factor in `alpha`. The column vectors are the
  // inner loop, so the max and sum reductions run as kColumnVecs independent chains.
  void online_softmax(int64_t n, float* st, QueryState& w) const {
    Vec m_new[kColumnVecs], m_use[kColumnVecs], sum[kColumnVecs];
    for (int64_t c = 0; c < kColumnVecs; ++c) m_new[c] = load(w.m + c * kVecWidth);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) m_new[c] = vmax(m_new[c], load(st + r * kBlockM + c * kVecWidth));
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      // A column that has seen only masked keys keeps max -inf; subtracting 0 instead gives
      // exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
      m_use[c] = m_new[c] == -kInf ? Vec{} : m_new[c];
      sum[c] = Vec{};
    }
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        float* p = st + r * kBlockM + c * kVecWidth;
        const Vec e = exp2(load(p) - m_use[c]);
        store(p, e);
        sum[c] += e;
      }
    }
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      const int64_t col = c * kVecWidth;
      const Vec alpha = exp2(load(w.m + col) - m_use[c]);
      store(w.m + col, m_new[c]);
      store(w.l + col, load(w.l + col) * alpha + sum[c]);
      store(w.alpha + col, alpha);
    }
  }

  // Writes the tile's rows; `rows_t` is scratch for kVecWidth output rows.
  void finish(int64_t b, int64_t h, const Sequence& s, int64_t q0, int64_t rows, QueryState& w,
              float* rows_t) const {
    // O^T's columns divided by their sums, a vector of queries at a time.
    for (int64_t c = 0; c < kColumnVecs; ++c) {
      const Vec l = load(w.l + c * kVecWidth);
      const Vec inv = l > 0.0f ? 1.0f / l : Vec{};
      for (int64_t d = 0; d < d_; ++d) {
        float* o = w.ot + d * kBlockM + c * kVecWidth;
        store(o, load(o) * inv);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float l = w.l[r];
      w.l[r] = l > 0.0f ? (w.m[r] + std::log2(l)) * kLn2 : -kInf;  // now the row's lse
    }
    if (!a_.accumulate && a_.out_dtype == DType::kFloat32) {  // transposed straight into the output
      transpose_rows(w.ot, kBlockM, d_, d_, rows, 1.0f, row_ptr<float>(a_.out, b, s.row_q + q0, h),
                     a_.out.row_stride);
      for (int64_t r = 0; r < rows; ++r) *lse_ptr(a_, b, s.row_q + q0 + r, h) = w.l[r];
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (r % kVecWidth == 0)  // O^T's next kVecWidth columns as rows
        transpose_rows(w.ot + r, kBlockM, d_, d_, std::min<int64_t>(kVecWidth, rows - r), 1.0f, rows_t, d_);
      float* o = rows_t + r % kVecWidth * d_;  // this row's, used once: the merge goes in place
      const int64_t row = s.row_q + q0 + r;
      float* lse_out = lse_ptr(a_, b, row, h);
      if (a_.accumulate) {
        // With overwrite_out the accumulator counts as empty, whatever it holds.
        const core::MergeWeights mw = core::merge_weights(a_.overwrite_out ? -kInf : *lse_out, w.l[r]);
        float* acc = row_ptr<float>(a_.out, b, row, h);
        // w_acc == 0 means the accumulator is empty: ignore whatever it holds.
        for (int64_t d = 0; d < d_; ++d) o[d] = (mw.w_acc == 0.0f ? 0.0f : mw.w_acc * acc[d]) + mw.w_blk * o[d];
        if (a_.write_final)
          store_operand_row<T>(o, d_, false, a_.dtype, a_.final_out, b, row, h);
        else
          std::copy(o, o + d_, acc);
        *lse_out = mw.lse;
        continue;
      }
      *lse_out = w.l[r];
      store_output(o, b, row, h);
    }
  }

  void store_output(const float* o, int64_t b, int64_t row, int64_t h) const {
    store_operand_row<T>(o, d_, false, a_.out_dtype, a_.out, b, row, h);
  }

  // Rows of a packed batch outside [cu_seqlens_q[0], cu_seqlens_q[B]) belong to no sequence: the
  // outputs a call writes rather than merges into get empty rows there (out or final_out = 0; lse
  // = -inf without accumulate or with overwrite_out).
  void clear_unused_rows() const {
    if (a_.accumulate && !a_.overwrite_out && !a_.write_final) return;
    const std::vector<float> zeros(d_, 0.0f);
    for_unused_rows(a_, a_.cu_seqlens_q, a_.rows_q, [&](int64_t row) {
      for (int64_t h = 0; h < a_.heads_q; ++h) {
        if (!a_.accumulate || a_.overwrite_out) *lse_ptr(a_, 0, row, h) = -kInf;
        if (a_.write_final)
          store_operand_row<T>(zeros.data(), d_, false, a_.dtype, a_.final_out, 0, row, h);
        else
          store_output(zeros.data(), 0, row, h);
      }
    });
  }

  const AttentionArgs& a_;
  const int64_t d_;
  const ScoreTransform t_;
  KeyTiles k_, v_;
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
