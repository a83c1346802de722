// CPU attention backward (recomputes the probabilities from the saved log-sum-exp).
//
// One work item is a contiguous chunk of key tiles of one K/V head: it owns dK and dV of those
// keys outright, and walks every query tile of every query head of its group that the mask leaves
// visible. dQ receives contributions from every chunk, so each chunk adds into its own fp32 copy
// of dQ and a final pass sums the copies in a fixed order: the result is deterministic, whatever
// the thread count or scheduling.
//
// Per (query tile, key tile), with every B operand a dense panel:
//   S^T = K Q^T,   P^T = exp2(S^T - lse)          B = Q^T
//   dV += P^T dO                                   B = dO (column panels)
//   dP^T = V dO^T, dS^T = P^T (dP^T - delta)       B = dO^T
//   dK += dS^T Q                                   B = Q (column panels)
//   dQ^T += K^T dS^T                               B = dS^T
#include <algorithm>
#include <cmath>
#include <vector>

#include "../../core/thread_pool.h"
#include "attention_cpu.h"
#include "tile.h"

namespace ringflash::cpu {
namespace {

// Chunks per (sequence, K/V head) are chosen so that there are at least this many items per core
// of the machine. They depend on the machine, not on the call's thread count, so that results are
// bit-identical whatever num_threads is.
constexpr int64_t kItemsPerThread = 2;

struct WorkItem {
  int64_t b, hk, chunk;
  int64_t k_begin, k_end;  // key rows of the sequence, a whole number of tiles
  int64_t cost;
};

// A work item's scratch, carved from the running thread's kWorkerTiles buffer.
struct BackwardScratch {
  float *st, *ds, *tanh_grad;  // P^T, dP^T then dS^T, softcap derivative: kBlockN x kBlockM
  float *dk, *dv;              // kBlockN x padded accumulators of one query head
  float *dk_sum, *dv_sum;      // their sums over the heads of a GQA group
  explicit BackwardScratch(int64_t padded) {
    constexpr int64_t kTile = kBlockN * kBlockM;
    float* p = workspace(Buffer::kWorkerTiles, static_cast<size_t>(3 * kTile + 4 * kBlockN * padded));
    st = p;
    ds = p + kTile;
    tanh_grad = p + 2 * kTile;
    dk = p + 3 * kTile;
    dv = dk + kBlockN * padded;
    dk_sum = dv + kBlockN * padded;
    dv_sum = dk_sum + kBlockN * padded;
  }
};

// One query tile in the forms the products read.
struct QueryTile {
  const float* qt;     // Q^T, scaled: head_dim x kBlockM
  const float* q;      // Q: kBlockM x padded, column panels
  const float* dot;    // dO^T: head_dim x kBlockM
  const float* dout;   // dO: kBlockM x padded, column panels
  const float* delta;  // rowsum(dO * O), kBlockM
  const float* lse2;   // lse in log2 units, kBlockM
};

// Every query tile of every head, packed once per call. Rows past a sequence's end are zero,
// with lse +inf so that their P is exactly 0. Tiles are numbered per head: sequence b's tile t
// is tile first_tile(b) + t.
class QueryTiles {
 public:
  template <typename T>
  void pack(const AttentionArgs& a, float q_scale, int64_t padded) {
    d_ = a.head_dim;
    padded_ = padded;
    first_tile_.assign(static_cast<size_t>(a.batch + 1), 0);
    for (int64_t b = 0; b < a.batch; ++b)
      first_tile_[b + 1] = first_tile_[b] + (sequence(a, b).len_q + kBlockM - 1) / kBlockM;
    const size_t n = static_cast<size_t>(a.heads_q * tiles());
    qt_ = workspace(Buffer::kQueryT, n * d_ * kBlockM);
    dot_ = workspace(Buffer::kDoutT, n * d_ * kBlockM);
    q_ = workspace(Buffer::kQuery, n * kBlockM * padded);
    dout_ = workspace(Buffer::kDout, n * kBlockM * padded);
    delta_ = workspace(Buffer::kDelta, n * kBlockM);
    lse2_ = workspace(Buffer::kLse2, n * kBlockM);
    core::parallel_for(a.batch * a.heads_q, a.num_threads, [&](int64_t i, int) {
      const int64_t b = i / a.heads_q, h = i % a.heads_q;
      const Sequence s = sequence(a, b);
      for (int64_t t = 0; t * kBlockM < s.len_q; ++t) pack_tile<T>(a, b, h, s, t, q_scale);
    });
  }

  int64_t tiles() const { return first_tile_.back(); }
  int64_t index(int64_t b, int64_t h, int64_t t) const { return h * tiles() + first_tile_[b] + t; }

  QueryTile tile(int64_t g) const {
    return {qt_ + g * d_ * kBlockM, q_ + g * kBlockM * padded_, dot_ + g * d_ * kBlockM,
            dout_ + g * kBlockM * padded_, delta_ + g * kBlockM, lse2_ + g * kBlockM};
  }

 private:
  template <typename T>
  void pack_tile(const AttentionArgs& a, int64_t b, int64_t h, const Sequence& s, int64_t t, float q_scale) {
    const int64_t g = index(b, h, t);
    const int64_t row0 = s.row_q + t * kBlockM, rows = std::min(kBlockM, s.len_q - t * kBlockM);
    const T* q = row_ptr<const T>(a.q, b, row0, h);
    const T* dout = row_ptr<const T>(a.dout, b, row0, h);
    pack_transposed(q, a.q.row_stride, rows, d_, q_scale, qt_ + g * d_ * kBlockM);
    pack_transposed(dout, a.dout.row_stride, rows, d_, 1.0f, dot_ + g * d_ * kBlockM);
    pack_panels(q, a.q.row_stride, rows, q_ + g * kBlockM * padded_);
    pack_panels(dout, a.dout.row_stride, rows, dout_ + g * kBlockM * padded_);
    float* delta = delta_ + g * kBlockM;
    float* lse2 = lse2_ + g * kBlockM;
    for (int64_t r = 0; r < kBlockM; ++r) {
      if (r >= rows) {
        delta[r] = 0.0f;
        lse2[r] = kInf;
        continue;
      }
      const T* dr = dout + r * a.dout.row_stride;
      float sum = 0.0f;
      if (a.out_dtype == DType::kFloat32) {
        const float* o = row_ptr<const float>(a.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) sum += to_float(dr[d]) * o[d];
      } else {
        const T* o = row_ptr<const T>(a.out, b, row0 + r, h);
        for (int64_t d = 0; d < d_; ++d) sum += to_float(dr[d]) * to_float(o[d]);
      }
      delta[r] = sum;
      const float lse = *lse_ptr(a, b, row0 + r, h);
      // A row that saw no key (lse = -inf) has P = 0: exp2(s - inf) = 0.
      lse2[r] = lse == -kInf ? kInf : lse * kLog2e;
    }
  }

  // kBlockM rows as column panels of kNR (gemm_panels' layout), zero-padded.
  template <typename T>
  void pack_panels(const T* src, int64_t row_stride, int64_t rows, float* dst) const {
    for (int64_t n0 = 0; n0 < padded_; n0 += kNR) {
      const int64_t width = std::min<int64_t>(kNR, padded_ - n0);
      float* panel = dst + n0 * kBlockM;
      for (int64_t r = 0; r < kBlockM; ++r) {
        float* out = panel + r * width;
        if (r >= rows) {
          std::fill(out, out + width, 0.0f);
          continue;
        }
        const T* in = src + r * row_stride + n0;
        const int64_t valid = std::clamp<int64_t>(d_ - n0, 0, width);
        convert_row(in, valid, width, out);
      }
    }
  }

  int64_t d_ = 0, padded_ = 0;
  std::vector<int64_t> first_tile_;
  float *qt_ = nullptr, *q_ = nullptr, *dot_ = nullptr, *dout_ = nullptr, *delta_ = nullptr, *lse2_ = nullptr;
};

template <typename T>
class Backward {
 public:
  explicit Backward(const AttentionArgs& a)
      : a_(a), d_(a.head_dim), dp_(round_up(a.head_dim, kVecWidth)), group_(a.heads_q / a.heads_kv),
        t_(ScoreTransform::make(a)) {}

  void run() {
    k_by_dim_.pack<T>(a_, a_.k, KeyTiles::Layout::kByDim, Buffer::kKeysByDim);
    k_by_key_.pack<T>(a_, a_.k, KeyTiles::Layout::kByKey, Buffer::kKeysByKey);
    v_by_key_.pack<T>(a_, a_.v, KeyTiles::Layout::kByKey, Buffer::kValuesByKey);
    queries_.pack<T>(a_, t_.q_scale, dp_);
    chunks_ = chunk_count();
    const std::vector<WorkItem> items = make_items();
    const int threads = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(items.size()), 1, a_.num_threads));
    const size_t acc_size = static_cast<size_t>(chunks_ * a_.heads_q * queries_.tiles() * d_ * kBlockM);
    dq_acc_ = workspace(Buffer::kDqAccumulator, acc_size);
    std::fill(dq_acc_, dq_acc_ + acc_size, 0.0f);
    core::parallel_for(static_cast<int64_t>(items.size()), threads, [&](int64_t i, int) {
      BackwardScratch scratch(dp_);
      chunk(items[i], scratch);
    });
    write_dq();
    zero_unused_rows();
  }

 private:
  int64_t chunk_count() const {
    int64_t longest_tiles = 0;
    for (int64_t b = 0; b < a_.batch; ++b)
      longest_tiles = std::max(longest_tiles, (sequence(a_, b).len_k + kBlockN - 1) / kBlockN);
    const int64_t heads = std::max<int64_t>(1, a_.batch * a_.heads_kv);
    const int64_t wanted = (kItemsPerThread * core::hardware_threads() + heads - 1) / heads;
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

  // dQ^T of query tile g, as summed by one chunk: head_dim x kBlockM.
  float* dq_acc(int64_t chunk, int64_t g) { return dq_acc_ + (chunk * a_.heads_q * queries_.tiles() + g) * d_ * kBlockM; }

  void chunk(const WorkItem& item, BackwardScratch& w) {
    const int64_t b = item.b, hk = item.hk;
    const Sequence s = sequence(a_, b);
    for (int64_t j0 = item.k_begin; j0 < item.k_end; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, item.k_end - j0);
      const int64_t pk0 = s.pos_k + j0;
      const int64_t key_tile = k_by_key_.index(b, hk, j0 / kBlockN);
      const KeyTile keys{k_by_key_.operand(key_tile), v_by_key_.operand(key_tile), k_by_dim_.operand(key_tile)};
      // Each query head of the group sums into its own accumulators, which are then added up: a
      // chain of group x rows additions would lose precision as the group grows (MQA).
      const int64_t tile_floats = kBlockN * dp_;
      std::fill(w.dk, w.dk + tile_floats, 0.0f);
      std::fill(w.dv, w.dv + tile_floats, 0.0f);
      if (group_ > 1) {
        std::fill(w.dk_sum, w.dk_sum + tile_floats, 0.0f);
        std::fill(w.dv_sum, w.dv_sum + tile_floats, 0.0f);
      }
      int64_t first, last;
      t_.mask.query_span(pk0, pk0 + n, s.pos_q, s.pos_q + s.len_q, &first, &last);
      const int64_t t_first = (first - s.pos_q) / kBlockM, t_last = (last - s.pos_q + kBlockM - 1) / kBlockM;
      for (int64_t g = 0; g < group_ && first < last; ++g) {
        if (g > 0) {
          add_and_clear(w.dk_sum, w.dk, n * dp_);
          add_and_clear(w.dv_sum, w.dv, n * dp_);
        }
        const int64_t h = hk * group_ + g;
        const float alibi = a_.alibi_slopes ? a_.alibi_slopes[b * a_.alibi_batch_stride + h] * kLog2e : 0.0f;
        for (int64_t t = t_first; t < t_last; ++t) {
          const int64_t q0 = t * kBlockM, rows = std::min(kBlockM, s.len_q - q0);
          const core::BlockKind kind = t_.mask.classify(s.pos_q + q0, s.pos_q + q0 + rows, pk0, pk0 + n);
          if (kind == core::BlockKind::kEmpty) continue;
          const int64_t tile = queries_.index(b, h, t);
          const Step step{queries_.tile(tile), s.pos_q + q0, rows, pk0, n, kind == core::BlockKind::kPartial, alibi};
          run_step(step, keys, dq_acc(item.chunk, tile), w);
        }
      }
      if (group_ > 1) {
        add_and_clear(w.dk_sum, w.dk, n * dp_);
        add_and_clear(w.dv_sum, w.dv, n * dp_);
      }
      write_kv(b, hk, s.row_k + j0, n, group_ > 1 ? w.dk_sum : w.dk, group_ > 1 ? w.dv_sum : w.dv);
    }
  }

  // sum += part, then part = 0; `count` is a multiple of kVecWidth.
  static void add_and_clear(float* sum, float* part, int64_t count) {
    const Vec zero = splat(0.0f);
    for (int64_t i = 0; i < count; i += kVecWidth) {
      store(sum + i, load(sum + i) + load(part + i));
      store(part + i, zero);
    }
  }

  // One key tile as the A operands of S^T = K Q^T, dP^T = V dO^T and dQ^T += K^T dS^T.
  struct KeyTile {
    PanelOperand k, v, k_transposed;
  };

  struct Step {
    QueryTile q;
    int64_t pq0, rows, pk0, n;
    bool partial;
    float alibi;
  };

  // One (query tile, key tile) pair: recompute P, then dV, dS, dK and this tile's share of dQ.
  void run_step(const Step& t, const KeyTile& keys, float* dqt, BackwardScratch& w) const {
    const int64_t n = t.n;
    float* st = w.st;
    float* ds = w.ds;
    gemm<false, UnitStrideTile>(n, kBlockM, d_, {keys.k.a, keys.k.a_rs, keys.k.a_cs, t.q.qt, kBlockM, st, kBlockM});
    transform_scores(t_, t.alibi, t.partial, t.pq0, t.pk0, n, st, t_.softcap ? w.tanh_grad : nullptr);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        float* p = st + r * kBlockM + c * kVecWidth;
        store(p, exp2(load(p) - load(t.q.lse2 + c * kVecWidth)));
      }
    gemm_panels<true>(n, dp_, t.rows, st, kBlockM, 1, t.q.dout, kBlockM, w.dv, dp_);
    gemm<false, UnitStrideTile>(n, kBlockM, d_, {keys.v.a, keys.v.a_rs, keys.v.a_cs, t.q.dot, kBlockM, ds, kBlockM});
    // dS^T = P^T (dP^T - delta), times the score's derivative in q.k: scale (x softcap's 1 - tanh^2)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < kColumnVecs; ++c) {
        const int64_t at = r * kBlockM + c * kVecWidth;
        Vec g = load(st + at) * (load(ds + at) - load(t.q.delta + c * kVecWidth)) * a_.scale;
        if (t_.softcap) g *= load(w.tanh_grad + at);
        store(ds + at, g);
      }
    gemm_panels<true>(n, dp_, t.rows, ds, kBlockM, 1, t.q.q, kBlockM, w.dk, dp_);
    const PanelOperand& kd = keys.k_transposed;
    gemm<true, UnitStrideTile>(d_, kBlockM, n, {kd.a, kd.a_rs, kd.a_cs, ds, kBlockM, dqt, kBlockM});
  }

  void write_kv(int64_t b, int64_t hk, int64_t row0, int64_t n, const float* dk, const float* dv) const {
    for (int64_t r = 0; r < n; ++r) {
      store_grad(dk + r * dp_, a_.dk, b, row0 + r, hk, adds_kv());
      store_grad(dv + r * dp_, a_.dv, b, row0 + r, hk, adds_kv());
    }
  }

  // dK and dV are added to in accumulate mode, unless overwrite_dkdv.
  bool adds_kv() const { return a_.accumulate && !a_.overwrite_dkdv; }

  void store_grad(const float* src, const AttentionArgs::Operand& o, int64_t b, int64_t row, int64_t h,
                  bool add) const {
    store_operand_row<T>(src, d_, add, a_.grad_dtype, o, b, row, h);
  }

  // dq = sum over chunks of the fp32 dQ^T tiles, in chunk order. Query rows that no key reached
  // get zeros from the zero-filled partials.
  void write_dq() {
    core::parallel_for(a_.batch * a_.heads_q, a_.num_threads, [&](int64_t i, int) {
      const int64_t b = i / a_.heads_q, h = i % a_.heads_q;
      const Sequence s = sequence(a_, b);
      std::vector<float> sum(d_ * kBlockM), rows_t(kVecWidth * d_);
      for (int64_t t = 0; t * kBlockM < s.len_q; ++t) {
        const int64_t tile = queries_.index(b, h, t);
        std::copy_n(dq_acc(0, tile), sum.size(), sum.begin());
        for (int64_t c = 1; c < chunks_; ++c) {
          const float* part = dq_acc(c, tile);
          for (size_t e = 0; e < sum.size(); ++e) sum[e] += part[e];
        }
        const int64_t rows = std::min(kBlockM, s.len_q - t * kBlockM);
        for (int64_t r = 0; r < rows; ++r) {
          if (r % kVecWidth == 0)  // dQ^T's next kVecWidth columns as rows
            transpose_rows(sum.data() + r, kBlockM, d_, d_, std::min<int64_t>(kVecWidth, rows - r), 1.0f,
                           rows_t.data(), d_);
          store_grad(rows_t.data() + r % kVecWidth * d_, a_.dq, b, s.row_q + t * kBlockM + r, h, a_.accumulate);
        }
      }
    });
  }

  // Rows of a packed batch outside every sequence are visited by nothing; gradients that are
  // written rather than added to (all without accumulate, dK and dV with overwrite_dkdv) are still
  // written there, as zeros.
  void zero_unused_rows() const {
    const std::vector<float> zeros(d_, 0.0f);
    if (!a_.accumulate)
      for_unused_rows(a_, a_.cu_seqlens_q, a_.rows_q, [&](int64_t r) {
        for (int64_t h = 0; h < a_.heads_q; ++h) store_grad(zeros.data(), a_.dq, 0, r, h, false);
      });
    if (!adds_kv())
      for_unused_rows(a_, a_.cu_seqlens_k, a_.rows_k, [&](int64_t r) {
        for (int64_t hk = 0; hk < a_.heads_kv; ++hk) {
          store_grad(zeros.data(), a_.dk, 0, r, hk, false);
          store_grad(zeros.data(), a_.dv, 0, r, hk, false);
        }
      });
  }

  const AttentionArgs& a_;
  const int64_t d_, dp_, group_;
  const ScoreTransform t_;
  int64_t chunks_ = 1;
  float* dq_acc_ = nullptr;
  KeyTiles k_by_key_, v_by_key_, k_by_dim_;
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
