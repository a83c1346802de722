// Entry points of parallel.h: validation on every rank and across ranks, then dispatch.
//
// Every call goes through `run`:
//   1. each rank checks its own tensors and options (what attention.cpp checks for one device, plus
//      what the layout asks of a shard) and writes the verdict into a small Descriptor, which also
//      holds everything the ranks must agree on;
//   2. the ranks all_gather their descriptors (hybrid: over the ulysses group, then the ring group,
//      then the ulysses group again, so every verdict reaches every rank) and each rank derives the
//      same verdict from the same data: the first rank's own error, else the first field that
//      differs from rank 0's, else local row counts that do not match the layout;
//   3. every rank throws that verdict, or every rank runs the strategy. A strategy that throws
//      fails its communicators, so the peers end with CommError at once instead of waiting.
#include "ringflash/parallel.h"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../core/check.h"
#include "../kernels/ops.h"
#include "strategy.h"

namespace ringflash {
namespace {

using core::str_cat;
using parallel::Problem;

constexpr int64_t kNone = INT64_MIN;    // a descriptor field that does not apply
constexpr size_t kMessageBytes = 512;   // room for one error message in a descriptor
constexpr uint64_t kHashSeed = 1469598103934665603ull;  // FNV-1a
constexpr uint64_t kHashPrime = 1099511628211ull;

Layout strategy_layout(Strategy strategy, const ParallelOptions& options) {
  switch (strategy) {
    case Strategy::kZigzag: return Layout::kZigzag;
    case Strategy::kStripe: return Layout::kStripe;
    case Strategy::kHybrid: return options.hybrid_ring_layout;
    default: return Layout::kContiguous;
  }
}

uint64_t hash_bytes(uint64_t h, const void* data, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(data)[i]) * kHashPrime;
  return h;
}

int64_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// ---- what the ranks compare ---------------------------------------------------------------

enum Field {
  kDirection, kStrategy, kPacked, kBatch, kHeadsQ, kHeadsKv, kHeadDim,
  kDtypeQ, kDtypeK, kDtypeV, kDtypeOut, kDtypeDout, kDtypeDq, kDtypeDk, kDtypeDv,
  kCausal, kWindowLeft, kWindowRight, kSoftcap, kSoftmaxScale, kDropout, kDeterministic,
  kAlibiShape, kAlibiValues, kCuSeqlensLength, kCuSeqlensValues, kKvHeadsPerGather, kHybridRingLayout, kKeptKv,
  kFieldCount
};

enum class Shown { kNumber, kDType, kFloat, kHash };

struct FieldInfo {
  const char* name;
  Shown shown;
};

constexpr FieldInfo kFields[kFieldCount] = {
    {"direction (0 forward, 1 backward)", Shown::kNumber}, {"strategy", Shown::kNumber},
    {"packing (1 when cu_seqlens are given)", Shown::kNumber}, {"batch size", Shown::kNumber},
    {"number of q heads", Shown::kNumber}, {"number of k/v heads", Shown::kNumber}, {"head_dim", Shown::kNumber},
    {"q dtype", Shown::kDType}, {"k dtype", Shown::kDType}, {"v dtype", Shown::kDType},
    {"out dtype", Shown::kDType}, {"dout dtype", Shown::kDType}, {"dq dtype", Shown::kDType},
    {"dk dtype", Shown::kDType}, {"dv dtype", Shown::kDType}, {"causal", Shown::kNumber},
    {"window_left", Shown::kNumber}, {"window_right", Shown::kNumber}, {"softcap", Shown::kFloat},
    {"softmax_scale", Shown::kFloat}, {"dropout_p", Shown::kFloat}, {"deterministic", Shown::kNumber},
    {"alibi_slopes shape (0 none, 1 per head, 2 per batch)", Shown::kNumber}, {"alibi_slopes values", Shown::kHash},
    {"cu_seqlens length", Shown::kNumber}, {"cu_seqlens values", Shown::kHash},
    {"kv_heads_per_gather", Shown::kNumber}, {"hybrid_ring_layout", Shown::kNumber},
    {"kept_kv (1 when given)", Shown::kNumber},
};

std::string show(Field f, int64_t value) {
  if (value == kNone) return "(none)";
  switch (kFields[f].shown) {
    case Shown::kDType: return dtype_name(static_cast<DType>(value));
    case Shown::kFloat: {
      float x;
      const uint32_t bits = static_cast<uint32_t>(value);
      std::memcpy(&x, &bits, sizeof x);
      return str_cat(x);
    }
    case Shown::kHash: return str_cat("hash ", std::hex, static_cast<uint64_t>(value));
    default: return str_cat(value);
  }
}

// One rank's account of its call, exchanged with all_gather. Plain data of a fixed size.
struct Descriptor {
  int64_t fields[kFieldCount];
  int64_t rows;        // local rows: S_r, or T_r when packed
  int64_t group_rows;  // hybrid: rows of the whole ulysses group (its ring shard)
  int32_t error_kind;  // 0: none, 1: InvalidArgument, 2: NotSupported
  char error[kMessageBytes];
};

enum ErrorKind : int32_t { kOk = 0, kInvalid = 1, kUnsupported = 2 };

void set_error(Descriptor& d, ErrorKind kind, const std::string& message) {
  d.error_kind = kind;
  const size_t n = std::min(message.size(), kMessageBytes - 1);
  std::memcpy(d.error, message.data(), n);
  d.error[n] = '\0';
}

[[noreturn]] void throw_error(const Descriptor& d) {
  if (d.error_kind == kUnsupported) throw NotSupported(d.error);
  throw InvalidArgument(d.error);
}

// ---- one call ------------------------------------------------------------------------------

struct Call {
  Strategy strategy;
  bool backward;
  const ParallelGroup& group;
  const ParallelOptions& options;
  const AttentionParams& params;
  TensorView q, k, v, out, lse, dout, dq, dk, dv;
  std::string op;  // "[zigzag]" or "[zigzag backward]"

  Layout layout() const { return strategy_layout(strategy, options); }
  bool hybrid() const { return strategy == Strategy::kHybrid; }
  // "rank 2 of 4", or "rank (ring 1 of 2, ulysses 0 of 2)"
  std::string rank_name() const {
    if (!hybrid()) return str_cat("rank ", group.world->rank(), " of ", group.world->size());
    return str_cat("rank (ring ", group.ring->rank(), " of ", group.ring->size(), ", ulysses ", group.ulysses->rank(),
                   " of ", group.ulysses->size(), ")");
  }
  // This rank's shard of a sequence of `length` positions.
  Shard shard(int64_t length) const { return parallel_shard(strategy, group, options, length); }
};

void check_group(const char* op, Strategy strategy, const ParallelGroup& group) {
  if (strategy == Strategy::kHybrid) {
    RINGFLASH_CHECK(group.ulysses && group.ring, InvalidArgument, "[", op,
                    "] hybrid needs group.ulysses and group.ring, got ", group.ulysses ? "" : "no ulysses ",
                    group.ring ? "" : "no ring ", "communicator");
  } else {
    RINGFLASH_CHECK(group.world, InvalidArgument, "[", op, "] group.world must be set for ", strategy_name(strategy));
  }
}

// Global cumulative lengths from cu_seqlens_q (checked), or empty for a padded batch.
std::vector<int32_t> global_cu_seqlens(const Call& c) {
  const AttentionParams& p = c.params;
  if (!p.cu_seqlens_q && !p.cu_seqlens_k) return {};
  RINGFLASH_CHECK(p.cu_seqlens_q, InvalidArgument, c.op,
                  " cu_seqlens_q must hold the global cumulative lengths of a packed batch, got only cu_seqlens_k");
  const TensorView& cu = *p.cu_seqlens_q;
  RINGFLASH_CHECK(cu.dtype() == DType::kInt32, InvalidArgument, c.op, " cu_seqlens_q must have dtype int32, got ",
                  dtype_name(cu.dtype()));
  RINGFLASH_CHECK(cu.ndim() == 1 && cu.size(0) >= 2, InvalidArgument, c.op,
                  " cu_seqlens_q must have shape (B + 1,) with B >= 1, got ", cu.shape_string());
  RINGFLASH_CHECK(cu.device().type == DeviceType::kCPU, InvalidArgument, c.op, " cu_seqlens_q must be on cpu, got ",
                  device_name(cu.device()));
  std::vector<int32_t> values(static_cast<size_t>(cu.size(0)));
  for (int64_t i = 0; i < cu.size(0); ++i) values[i] = cu.data_as<const int32_t>()[i * cu.stride(0)];
  RINGFLASH_CHECK(values[0] >= 0, InvalidArgument, c.op, " cu_seqlens_q[0] must be >= 0, got ", values[0]);
  for (size_t b = 0; b + 1 < values.size(); ++b)
    RINGFLASH_CHECK(values[b + 1] >= values[b], InvalidArgument, c.op, " cu_seqlens_q must be non-decreasing, got ",
                    "cu_seqlens_q[", b, "] = ", values[b], " > cu_seqlens_q[", b + 1, "] = ", values[b + 1]);
  if (p.cu_seqlens_k) {
    const TensorView& ck = *p.cu_seqlens_k;
    bool same = ck.dtype() == DType::kInt32 && ck.ndim() == 1 && ck.size(0) == cu.size(0) &&
                ck.device().type == DeviceType::kCPU;
    for (int64_t i = 0; same && i < ck.size(0); ++i) same = ck.data_as<const int32_t>()[i * ck.stride(0)] == values[i];
    RINGFLASH_CHECK(same, InvalidArgument, c.op,
                    " cu_seqlens_k must be unset or equal to cu_seqlens_q (self-attention over one sequence)");
  }
  return values;
}

void check_like(const Call& c, const TensorView& t, const char* name, const TensorView& like, bool fp32_allowed) {
  bool same = t.ndim() == like.ndim();
  for (int d = 0; same && d < t.ndim(); ++d) same = t.size(d) == like.size(d);
  RINGFLASH_CHECK(same, InvalidArgument, c.op, " ", name, " must have shape ", like.shape_string(), ", got ",
                  t.shape_string());
  RINGFLASH_CHECK(t.dtype() == c.q.dtype() || (fp32_allowed && t.dtype() == DType::kFloat32), InvalidArgument, c.op,
                  " ", name, " must have dtype ", dtype_name(c.q.dtype()), fp32_allowed ? " or float32" : "", ", got ",
                  dtype_name(t.dtype()));
  RINGFLASH_CHECK(t.device() == c.q.device(), InvalidArgument, c.op, " ", name, " must be on ",
                  device_name(c.q.device()), " like q, got ", device_name(t.device()));
  RINGFLASH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0, InvalidArgument, c.op, " ", name,
                  " must be contiguous in its last dimension (head_dim), got stride ", t.stride(-1));
}

// This rank's checks. Returns the Problem with everything but the global length of a padded batch.
Problem check_local(const Call& c) {
  const AttentionParams& p = c.params;
  RINGFLASH_CHECK(p.q_offset == AttentionParams::kBottomRight && p.k_offset == 0, InvalidArgument, c.op,
                  " q_offset and k_offset must be left unset (the layout gives every position), got q_offset ",
                  p.q_offset == AttentionParams::kBottomRight ? std::string("unset") : str_cat(p.q_offset),
                  " and k_offset ", p.k_offset);
  RINGFLASH_CHECK(!p.q_seq_offsets && !p.k_seq_offsets, InvalidArgument, c.op,
                  " q_seq_offsets and k_seq_offsets must be left unset (the layout gives every position)");
  RINGFLASH_CHECK(!p.accumulate && !p.overwrite_dkdv && !p.overwrite_out && !p.final_out, InvalidArgument, c.op,
                  " accumulate, overwrite_dkdv and overwrite_out must be false and final_out unset (the strategy "
                  "accumulates partial results itself)");
  RINGFLASH_CHECK(c.options.kv_heads_per_gather >= 0, InvalidArgument, c.op,
                  " options.kv_heads_per_gather must be >= 0 (0: all at once), got ", c.options.kv_heads_per_gather);
  if (c.options.kept_kv) {
    const TensorView& kept = *c.options.kept_kv;
    const bool ring =
        c.strategy == Strategy::kRing || c.strategy == Strategy::kZigzag || c.strategy == Strategy::kStripe;
    RINGFLASH_CHECK(ring, InvalidArgument, c.op, " options.kept_kv is for ring, zigzag and stripe; leave it empty");
    RINGFLASH_CHECK(kept.dtype() == c.k.dtype(), InvalidArgument, c.op, " options.kept_kv must have k's dtype ",
                    dtype_name(c.k.dtype()), ", got ", dtype_name(kept.dtype()));
    RINGFLASH_CHECK(kept.device() == c.k.device(), InvalidArgument, c.op, " options.kept_kv must be on ",
                    device_name(c.k.device()), " like k, got ", device_name(kept.device()));
    RINGFLASH_CHECK(kept.is_contiguous(), InvalidArgument, c.op, " options.kept_kv must be contiguous, got shape ",
                    kept.shape_string());
  }
  const Layout ring_layout = c.options.hybrid_ring_layout;
  const bool known_layout =
      ring_layout == Layout::kContiguous || ring_layout == Layout::kZigzag || ring_layout == Layout::kStripe;
  RINGFLASH_CHECK(known_layout, InvalidArgument, c.op, " options.hybrid_ring_layout must be a Layout, got ",
                  static_cast<int>(ring_layout));

  Problem prob;
  prob.cu_seqlens = global_cu_seqlens(c);
  prob.packed = !prob.cu_seqlens.empty();
  const int rank = prob.packed ? 3 : 4;
  const char* layout = prob.packed ? "(T_r, H, D)" : "(B, S_r, H, D)";
  for (auto [t, name] : {std::pair{&c.q, "q"}, {&c.k, "k"}, {&c.v, "v"}}) {
    RINGFLASH_CHECK(t->ndim() == rank, InvalidArgument, c.op, " ", name, " must have shape ", layout,
                    prob.packed ? " (packed batch: cu_seqlens given)" : "", ", got ", t->shape_string());
    RINGFLASH_CHECK(is_float(t->dtype()), InvalidArgument, c.op, " ", name,
                    " must have dtype float32, float16 or bfloat16, got ", dtype_name(t->dtype()));
    RINGFLASH_CHECK(t->dtype() == c.q.dtype(), InvalidArgument, c.op, " ", name, " must have q's dtype ",
                    dtype_name(c.q.dtype()), ", got ", dtype_name(t->dtype()));
    RINGFLASH_CHECK(t->device() == c.q.device(), InvalidArgument, c.op, " ", name, " must be on ",
                    device_name(c.q.device()), " like q, got ", device_name(t->device()));
    RINGFLASH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1, InvalidArgument, c.op, " ", name,
                    " must be contiguous in its last dimension (head_dim), got stride ", t->stride(-1));
  }
  if (c.q.device().type == DeviceType::kCUDA)
    for (const Communicator* comm : {c.group.world, c.group.ulysses, c.group.ring})
      RINGFLASH_CHECK(!comm || comm->stream_ordered(), NotSupported, c.op,
                      " CUDA tensors need a stream-ordered transport (nccl), got transport ", comm->transport());
  const int row_dim = prob.packed ? 0 : 1, head_dim = row_dim + 1;
  bool same_kv = true;
  for (int d = 0; d < rank; ++d) same_kv = same_kv && c.k.size(d) == c.v.size(d);
  RINGFLASH_CHECK(same_kv, InvalidArgument, c.op, " v must have k's shape ", c.k.shape_string(), ", got ",
                  c.v.shape_string());
  RINGFLASH_CHECK(c.k.size(row_dim) == c.q.size(row_dim) && (prob.packed || c.k.size(0) == c.q.size(0)),
                  InvalidArgument, c.op, " k must have q's ", prob.packed ? "rows" : "batch size and rows",
                  " (q, k and v share the layout), got q ", c.q.shape_string(), " and k ", c.k.shape_string());
  RINGFLASH_CHECK(c.k.size(-1) == c.q.size(-1) && c.q.size(-1) > 0, InvalidArgument, c.op,
                  " k must have q's head_dim ", c.q.size(-1), " (> 0), got ", c.k.shape_string());
  prob.heads_q = c.q.size(head_dim);
  prob.heads_kv = c.k.size(head_dim);
  prob.head_dim = c.q.size(-1);
  RINGFLASH_CHECK(prob.heads_kv > 0 && prob.heads_q % prob.heads_kv == 0, InvalidArgument, c.op,
                  " the number of q heads must be a multiple of the number of k/v heads, got ", prob.heads_q,
                  " q heads and ", prob.heads_kv, " k/v heads");
  prob.rows = c.q.size(row_dim);
  prob.batch = prob.packed ? static_cast<int64_t>(prob.cu_seqlens.size()) - 1 : c.q.size(0);

  check_like(c, c.out, "out", c.q, c.backward);
  const std::string lse_shape = prob.packed ? str_cat("(", prob.heads_q, ", ", prob.rows, ")")
                                            : str_cat("(", prob.batch, ", ", prob.heads_q, ", ", prob.rows, ")");
  const bool lse_ok = prob.packed ? c.lse.ndim() == 2 && c.lse.size(0) == prob.heads_q && c.lse.size(1) == prob.rows
                                  : c.lse.ndim() == 3 && c.lse.size(0) == prob.batch &&
                                        c.lse.size(1) == prob.heads_q && c.lse.size(2) == prob.rows;
  RINGFLASH_CHECK(lse_ok, InvalidArgument, c.op, " lse must have shape ", lse_shape, ", got ", c.lse.shape_string());
  RINGFLASH_CHECK(c.lse.dtype() == DType::kFloat32, InvalidArgument, c.op, " lse must have dtype float32, got ",
                  dtype_name(c.lse.dtype()));
  RINGFLASH_CHECK(c.lse.device() == c.q.device(), InvalidArgument, c.op, " lse must be on ",
                  device_name(c.q.device()), " like q, got ", device_name(c.lse.device()));
  RINGFLASH_CHECK(c.lse.stride(-1) == 1 || c.lse.size(-1) <= 1, InvalidArgument, c.op,
                  " lse must be contiguous in its last dimension, got stride ", c.lse.stride(-1));
  std::vector<std::pair<const TensorView*, const char*>> inputs{{&c.q, "q"}, {&c.k, "k"}, {&c.v, "v"}};
  std::vector<std::pair<const TensorView*, const char*>> written{{&c.out, "out"}, {&c.lse, "lse"}};
  if (c.backward) {
    check_like(c, c.dout, "dout", c.q, false);
    check_like(c, c.dq, "dq", c.q, false);
    check_like(c, c.dk, "dk", c.k, false);
    check_like(c, c.dv, "dv", c.v, false);
    inputs.insert(inputs.end(), {{&c.out, "out"}, {&c.dout, "dout"}, {&c.lse, "lse"}});
    written = {{&c.dq, "dq"}, {&c.dk, "dk"}, {&c.dv, "dv"}};
  }
  for (size_t i = 0; i < written.size(); ++i) {
    const auto [t, name] = written[i];
    for (const auto& [other, other_name] : inputs)
      RINGFLASH_CHECK(t->data() != other->data() || t->numel() == 0 || other->numel() == 0, InvalidArgument, c.op,
                      " ", name, " must not alias ", other_name);
    for (size_t j = 0; j < i; ++j)
      RINGFLASH_CHECK(t->data() != written[j].first->data() || t->numel() == 0, InvalidArgument, c.op, " ", name,
                      " must not alias ", written[j].second);
  }

  RINGFLASH_CHECK(!(p.alibi_slopes && c.layout() == Layout::kStripe), NotSupported, c.op,
                  " alibi_slopes are not supported with the stripe layout (its pieces have stride P, and ALiBi needs "
                  "the distances that the kernel would see compressed)");
  RINGFLASH_CHECK(p.dropout_p == 0.0f, NotSupported, c.op, " dropout_p > 0 is not supported, got ", p.dropout_p);

  // The single-device checks of the options, on this rank's shard.
  AttentionParams local = p;
  std::vector<int32_t> local_cu;
  if (prob.packed) {
    local_cu = local_cu_seqlens(prob.cu_seqlens, [&](int64_t length) { return c.shard(length); });
    RINGFLASH_CHECK(local_cu.back() == prob.rows, InvalidArgument, c.op, " q must have ", local_cu.back(),
                    " rows: this rank's ", layout_name(c.layout()), " shards of the sequences in cu_seqlens_q, got ",
                    c.q.shape_string());
    // Only its shape is checked on a GPU, so the host array stands in for one on q's device.
    const TensorView cu(local_cu.data(), DType::kInt32, c.q.device(), {static_cast<int64_t>(local_cu.size())});
    local.cu_seqlens_q = cu;
    local.cu_seqlens_k = cu;
  }
  const Support support = attention_support(c.q, c.k, c.v, local);
  if (!support.supported) {
    std::string reason = support.reason;
    const std::string tag = "[attention_support]";
    if (reason.compare(0, tag.size(), tag) == 0) reason.erase(0, tag.size() + 1);
    throw InvalidArgument(str_cat(c.op, " ", reason));
  }

  prob.op = c.op;
  prob.q = c.q;
  prob.k = c.k;
  prob.v = c.v;
  prob.out = c.out;
  prob.lse = c.lse;
  prob.dout = c.dout;
  prob.dq = c.dq;
  prob.dk = c.dk;
  prob.dv = c.dv;
  prob.params = p;
  prob.kept_kv = c.options.kept_kv;
  return prob;
}

// The fields every rank must agree on. Written before the local checks, so a tensor of the wrong
// rank is read only where it has the dimension.
Descriptor describe(const Call& c) {
  Descriptor d{};
  std::fill(std::begin(d.fields), std::end(d.fields), kNone);
  const AttentionParams& p = c.params;
  const bool packed = p.cu_seqlens_q.has_value() || p.cu_seqlens_k.has_value();
  const auto size = [](const TensorView& t, int dim) { return dim < t.ndim() ? t.size(dim) : kNone; };
  const int head_dim = packed ? 1 : 2;
  d.fields[kDirection] = c.backward;
  d.fields[kStrategy] = static_cast<int64_t>(c.strategy);
  d.fields[kPacked] = packed;
  d.fields[kBatch] = packed ? kNone : size(c.q, 0);
  d.fields[kHeadsQ] = size(c.q, head_dim);
  d.fields[kHeadsKv] = size(c.k, head_dim);
  d.fields[kHeadDim] = c.q.ndim() > 0 ? c.q.size(-1) : kNone;
  const std::pair<Field, const TensorView*> dtypes[] = {{kDtypeQ, &c.q},       {kDtypeK, &c.k},   {kDtypeV, &c.v},
                                                        {kDtypeOut, &c.out},   {kDtypeDout, &c.dout},
                                                        {kDtypeDq, &c.dq},     {kDtypeDk, &c.dk}, {kDtypeDv, &c.dv}};
  for (const auto& [field, t] : dtypes)
    if (t->ndim() > 0) d.fields[field] = static_cast<int64_t>(t->dtype());
  d.fields[kCausal] = p.causal;
  d.fields[kWindowLeft] = p.window_left;
  d.fields[kWindowRight] = p.window_right;
  d.fields[kSoftcap] = float_bits(p.softcap);
  if (p.softmax_scale) d.fields[kSoftmaxScale] = float_bits(*p.softmax_scale);
  d.fields[kDropout] = float_bits(p.dropout_p);
  d.fields[kDeterministic] = p.deterministic;
  d.fields[kAlibiShape] = 0;
  if (p.alibi_slopes) {
    const TensorView& a = *p.alibi_slopes;
    d.fields[kAlibiShape] = a.ndim();
    uint64_t h = kHashSeed;
    if (a.dtype() == DType::kFloat32 && a.device().type == DeviceType::kCPU && a.ndim() >= 1 && a.ndim() <= 2) {
      const int64_t rows = a.ndim() == 2 ? a.size(0) : 1, cols = a.size(-1);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const float x = a.data_as<const float>()[(a.ndim() == 2 ? i * a.stride(0) : 0) + j * a.stride(-1)];
          h = hash_bytes(h, &x, sizeof x);
        }
    }
    d.fields[kAlibiValues] = static_cast<int64_t>(h);
  }
  if (p.cu_seqlens_q && p.cu_seqlens_q->ndim() == 1 && p.cu_seqlens_q->dtype() == DType::kInt32 &&
      p.cu_seqlens_q->device().type == DeviceType::kCPU) {
    const TensorView& cu = *p.cu_seqlens_q;
    uint64_t h = kHashSeed;
    for (int64_t i = 0; i < cu.size(0); ++i) h = hash_bytes(h, &cu.data_as<const int32_t>()[i * cu.stride(0)], 4);
    d.fields[kCuSeqlensLength] = cu.size(0);
    d.fields[kCuSeqlensValues] = static_cast<int64_t>(h);
  }
  d.fields[kKvHeadsPerGather] = c.options.kv_heads_per_gather;
  if (c.hybrid()) d.fields[kHybridRingLayout] = static_cast<int64_t>(c.options.hybrid_ring_layout);
  d.fields[kKeptKv] = c.options.kept_kv.has_value();
  d.rows = size(c.q, packed ? 0 : 1);
  return d;
}

std::string list(const std::vector<int64_t>& values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) s += str_cat(i ? ", " : "", values[i]);
  return s + ")";
}

// The ranks one round of the exchange compares.
enum class Round { kWorld, kUlysses, kRing };

// The first rank whose descriptor differs from rank 0's, as an error.
std::string first_difference(const Call& c, const std::vector<Descriptor>& all, Round round) {
  const char* who = round == Round::kWorld ? "rank" : round == Round::kUlysses ? "ulysses rank" : "ring rank";
  std::string group;
  if (round == Round::kUlysses) group = str_cat(" (in the ulysses group of ring rank ", c.group.ring->rank(), ")");
  if (round == Round::kRing) group = str_cat(" (in the ring group of ulysses rank ", c.group.ulysses->rank(), ")");
  for (size_t j = 1; j < all.size(); ++j)
    for (int f = 0; f < kFieldCount; ++f)
      if (all[j].fields[f] != all[0].fields[f])
        return str_cat(c.op, " ", kFields[f].name, " differs across ranks: ", who, " 0 has ",
                       show(static_cast<Field>(f), all[0].fields[f]), ", ", who, " ", j, " has ",
                       show(static_cast<Field>(f), all[j].fields[f]), group);
  return "";
}

// Rows per rank (`got`) against what the layout gives each for their sum.
std::string rows_mismatch(const Call& c, const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                          int64_t seqlen, const char* whose) {
  if (got == want) return "";
  return str_cat(c.op, " the ", whose, " hold ", list(got), " rows, but the ", layout_name(c.layout()),
                 " layout of ", seqlen, " positions (their sum) gives them ", list(want));
}

// One round of the exchange over `comm`. Returns the agreed verdict in `d`; `seqlen` receives the
// global length once this round can tell it.
void exchange(const Call& c, Communicator& comm, Descriptor& d, Round round, int64_t& seqlen) {
  const int n = comm.size();
  std::vector<Descriptor> all(static_cast<size_t>(n));
  comm.all_gather(&d, all.data(), std::vector<size_t>(static_cast<size_t>(n), sizeof(Descriptor)));
  for (const Descriptor& x : all)
    if (x.error_kind != kOk) {
      d = x;
      return;
    }
  std::string error = first_difference(c, all, round);
  const bool packed = all[0].fields[kPacked] == 1;
  if (error.empty() && !packed) {
    std::vector<int64_t> rows, want;
    if (round == Round::kWorld) {  // every rank's rows against the layout of their sum
      for (const Descriptor& x : all) rows.push_back(x.rows);
      int64_t total = 0;
      for (int64_t r : rows) total += r;
      for (int j = 0; j < n; ++j) want.push_back(shard_rows(shard_of(c.layout(), total, j, n)));
      error = rows_mismatch(c, rows, want, total, "ranks");
      seqlen = total;
    } else if (round == Round::kUlysses) {  // the ulysses group's rows make up its ring shard
      d.group_rows = 0;
      for (const Descriptor& x : all) d.group_rows += x.rows;
    } else {  // ring shards against the layout of their sum, then this ulysses rank's row in each
      int64_t total = 0;
      for (const Descriptor& x : all) total += x.group_rows;
      const int uly = c.group.ulysses->rank(), ulys = c.group.ulysses->size();
      for (int j = 0; j < n; ++j) {
        rows.push_back(all[j].group_rows);
        want.push_back(shard_rows(shard_of(c.layout(), total, j, n)));
      }
      error = rows_mismatch(c, rows, want, total, "ring groups");
      if (error.empty()) {
        rows.clear();
        want.clear();
        for (int j = 0; j < n; ++j) {
          rows.push_back(all[j].rows);
          want.push_back(shard_rows(hybrid_shard(c.layout(), total, j, n, uly, ulys)));
        }
        error = rows_mismatch(c, rows, want, total, str_cat("ranks of ulysses rank ", uly, " in the ring").c_str());
      }
      seqlen = total;
    }
  }
  if (!error.empty()) set_error(d, kInvalid, error);
}

// Verdicts the ranks of stream-ordered communicators agreed on: the global length, by the call's
// descriptor and communicators. A call that matches one skips the exchange, which would make the
// host wait for the GPU; a rank whose call differs from its peers' exchanges alone and ends with
// CommError at its deadline instead of InvalidArgument.
class Agreements {
 public:
  static std::string key(const Call& c, const Descriptor& d) {
    std::string k(reinterpret_cast<const char*>(d.fields), sizeof(d.fields));
    k.append(reinterpret_cast<const char*>(&d.rows), sizeof(d.rows));
    for (const Communicator* comm : {c.group.world, c.group.ulysses, c.group.ring}) {
      const int64_t id[3] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(comm)), comm ? comm->rank() : -1,
                             comm ? comm->size() : -1};
      k.append(reinterpret_cast<const char*>(id), sizeof(id));
    }
    return k;
  }
  std::optional<int64_t> find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [k, seqlen] : entries_)
      if (k == key) return seqlen;
    return std::nullopt;
  }
  void add(std::string key, int64_t seqlen) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() == kMaxEntries) entries_.pop_front();
    entries_.emplace_back(std::move(key), seqlen);
  }

 private:
  static constexpr size_t kMaxEntries = 64;
  std::mutex mutex_;
  std::deque<std::pair<std::string, int64_t>> entries_;  // oldest first
};

Agreements& agreements() {
  static Agreements a;
  return a;
}

bool stream_ordered(const ParallelGroup& g) {
  const Communicator* comm = g.world ? g.world : g.ring;
  return comm->stream_ordered();
}

// Validates on every rank and across ranks; every rank returns the Problem or throws the same error.
Problem prepare(const Call& c) {
  Descriptor d = describe(c);
  Problem prob;
  try {
    prob = check_local(c);
  } catch (const InvalidArgument& e) {
    set_error(d, kInvalid, str_cat(e.what(), " (on ", c.rank_name(), ")"));
  } catch (const NotSupported& e) {
    set_error(d, kUnsupported, str_cat(e.what(), " (on ", c.rank_name(), ")"));
  }
  const bool remembered = d.error_kind == kOk && stream_ordered(c.group);
  const std::string key = remembered ? Agreements::key(c, d) : std::string();
  if (remembered) {
    if (const std::optional<int64_t> seqlen = agreements().find(key)) {
      prob.seqlen = *seqlen;
      return prob;
    }
    RINGFLASH_CHECK(!kernels::capturing(c.q.device(), c.params.stream), InvalidArgument, c.op,
                    " a call captured into a CUDA graph must follow the same call outside the capture (the ranks "
                    "agree on their arguments there), on ", c.rank_name());
  }
  int64_t seqlen = 0;
  if (c.hybrid()) {
    exchange(c, *c.group.ulysses, d, Round::kUlysses, seqlen);
    exchange(c, *c.group.ring, d, Round::kRing, seqlen);
    exchange(c, *c.group.ulysses, d, Round::kUlysses, seqlen);
  } else {
    exchange(c, *c.group.world, d, Round::kWorld, seqlen);
  }
  if (d.error_kind != kOk) throw_error(d);
  prob.seqlen = prob.packed ? 0 : seqlen;
  if (remembered) agreements().add(key, prob.seqlen);
  return prob;
}

void dispatch(const Call& c, const Problem& prob) {
  using namespace parallel;
  const ParallelGroup& g = c.group;
  try {
    switch (c.strategy) {
      case Strategy::kRing:
      case Strategy::kZigzag:
      case Strategy::kStripe:
        return c.backward ? ring_backward(*g.world, c.layout(), prob) : ring_forward(*g.world, c.layout(), prob);
      case Strategy::kAllGather:
        return c.backward ? allgather_backward(*g.world, prob, c.options)
                          : allgather_forward(*g.world, prob, c.options);
      case Strategy::kUlysses:
        return c.backward ? ulysses_backward(*g.world, prob) : ulysses_forward(*g.world, prob);
      case Strategy::kHybrid:
        return c.backward ? hybrid_backward(*g.ulysses, *g.ring, prob, c.options)
                          : hybrid_forward(*g.ulysses, *g.ring, prob, c.options);
    }
  } catch (const std::exception& e) {
    const std::string reason = str_cat(c.op, " failed on ", c.rank_name(), ": ", e.what());
    for (Communicator* comm : {g.world, g.ulysses, g.ring})
      if (comm) comm->fail(reason);
    throw;
  }
}

void run(Call c) {
  const char* name = strategy_name(c.strategy);
  check_group(name, c.strategy, c.group);
  c.op = str_cat("[", name, c.backward ? " backward]" : "]");
  for (Communicator* comm : {c.group.world, c.group.ulysses, c.group.ring})
    if (comm) comm->set_stream(c.params.stream);
  const Problem prob = prepare(c);
  dispatch(c, prob);
}

}  // namespace

const char* strategy_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kRing: return "ring";
    case Strategy::kZigzag: return "zigzag";
    case Strategy::kStripe: return "stripe";
    case Strategy::kAllGather: return "allgather";
    case Strategy::kUlysses: return "ulysses";
    case Strategy::kHybrid: return "hybrid";
  }
  return "unknown";
}

Shard parallel_shard(Strategy strategy, const ParallelGroup& group, const ParallelOptions& options, int64_t seqlen) {
  check_group("parallel_shard", strategy, group);
  const Layout layout = strategy_layout(strategy, options);
  if (strategy == Strategy::kHybrid)
    return hybrid_shard(layout, seqlen, group.ring->rank(), group.ring->size(), group.ulysses->rank(),
                        group.ulysses->size());
  return shard_of(layout, seqlen, group.world->rank(), group.world->size());
}

void parallel_attention_forward(Strategy strategy, const ParallelGroup& group, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse, const AttentionParams& params, const ParallelOptions& options) {
  run(Call{strategy, false, group, options, params, q, k, v, out, lse, {}, {}, {}, {}, ""});
}

void parallel_attention_backward(Strategy strategy, const ParallelGroup& group, const TensorView& q,
                                 const TensorView& k, const TensorView& v, const TensorView& out,
                                 const TensorView& dout, const TensorView& lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv, const AttentionParams& params,
                                 const ParallelOptions& options) {
  run(Call{strategy, true, group, options, params, q, k, v, out, lse, dout, dq, dk, dv, ""});
}

#define RINGFLASH_DEFINE_STRATEGY(name, strategy)                                                               \
  void name##_attention_forward(Communicator& comm, const TensorView& q, const TensorView& k,                 \
                                const TensorView& v, const TensorView& out, const TensorView& lse,            \
                                const AttentionParams& params, const ParallelOptions& options) {              \
    parallel_attention_forward(strategy, ParallelGroup{&comm}, q, k, v, out, lse, params, options);          \
  }                                                                                                           \
  void name##_attention_backward(Communicator& comm, const TensorView& q, const TensorView& k,                \
                                 const TensorView& v, const TensorView& out, const TensorView& dout,          \
                                 const TensorView& lse, const TensorView& dq, const TensorView& dk,           \
                                 const TensorView& dv, const AttentionParams& params,                         \
                                 const ParallelOptions& options) {                                            \
    parallel_attention_backward(strategy, ParallelGroup{&comm}, q, k, v, out, dout, lse, dq, dk, dv, params,  \
                                options);                                                                     \
  }
RINGFLASH_DEFINE_STRATEGY(ring, Strategy::kRing)
RINGFLASH_DEFINE_STRATEGY(zigzag, Strategy::kZigzag)
RINGFLASH_DEFINE_STRATEGY(stripe, Strategy::kStripe)
RINGFLASH_DEFINE_STRATEGY(allgather, Strategy::kAllGather)
RINGFLASH_DEFINE_STRATEGY(ulysses, Strategy::kUlysses)
#undef RINGFLASH_DEFINE_STRATEGY

void hybrid_attention_forward(Communicator& ulysses, Communicator& ring, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& out, const TensorView& lse,
                              const AttentionParams& params, const ParallelOptions& options) {
  parallel_attention_forward(Strategy::kHybrid, ParallelGroup{nullptr, &ulysses, &ring}, q, k, v, out, lse, params,
                             options);
}

void hybrid_attention_backward(Communicator& ulysses, Communicator& ring, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& out, const TensorView& dout,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const AttentionParams& params, const ParallelOptions& options) {
  parallel_attention_backward(Strategy::kHybrid, ParallelGroup{nullptr, &ulysses, &ring}, q, k, v, out, dout, lse,
                              dq, dk, dv, params, options);
}

}  // namespace ringflash
