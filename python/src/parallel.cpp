// parallel_forward, parallel_backward and parallel_shard: the strategies of parallel.h on DLPack
// tensors and _C.Communicator objects.
//
// `strategy` is a name: ring, zigzag, stripe, allgather, ulysses or hybrid. `world` is the group
// of every strategy but hybrid, which takes `ulysses` and `ring` instead. Tensors are each rank's
// shard in the strategy's layout (ringflash/layout.h); cu_seqlens_q/k are the GLOBAL cumulative
// lengths of a packed batch. Options are those of attention_forward, except the offsets, which the
// layout fixes. `kept_kv` is ParallelOptions::kept_kv: the forward writes it, the backward reads
// it. The GIL is released while the call runs (the torch bridge takes it back for its messages).
#include "ringflash/parallel.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "comm.h"
#include "ringflash/errors.h"
#include "params.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ringflash::python {
namespace {

constexpr Strategy kStrategies[] = {Strategy::kRing,      Strategy::kZigzag,  Strategy::kStripe,
                                    Strategy::kAllGather, Strategy::kUlysses, Strategy::kHybrid};
constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStripe};

template <typename T, size_t N, typename NameFn>
T parse(const char* op, const char* what, const std::string& name, const T (&values)[N], NameFn name_of) {
  std::string known;
  for (T v : values) {
    if (name == name_of(v)) return v;
    known += std::string(known.empty() ? "" : ", ") + name_of(v);
  }
  throw InvalidArgument(std::string("[") + op + "] " + what + " must be one of " + known + ", got '" + name + "'");
}

using OptionalComm = std::optional<const CommHandle*>;

struct Setup {
  Strategy strategy;
  ParallelGroup group;
  ParallelOptions options;
};

Setup make_setup(const char* op, const std::string& strategy, OptionalComm world, OptionalComm ulysses,
                 OptionalComm ring, int64_t kv_heads_per_gather, const std::string& hybrid_ring_layout) {
  Setup s;
  s.strategy = parse(op, "strategy", strategy, kStrategies, strategy_name);
  auto get = [](OptionalComm c) { return c && *c ? (*c)->comm.get() : nullptr; };
  s.group = {get(world), get(ulysses), get(ring)};
  s.options.kv_heads_per_gather = kv_heads_per_gather;
  s.options.hybrid_ring_layout = parse(op, "hybrid_ring_layout", hybrid_ring_layout, kLayouts, layout_name);
  return s;
}

#define RINGFLASH_GROUP_PARAMS                                                                     \
  const std::string &strategy, OptionalComm world, OptionalComm ulysses, OptionalComm ring,     \
      int64_t kv_heads_per_gather, const std::string &hybrid_ring_layout
#define RINGFLASH_GROUP_NAMES strategy, world, ulysses, ring, kv_heads_per_gather, hybrid_ring_layout
#define RINGFLASH_GROUP_ARGS                                                                        \
  nb::kw_only(), "strategy"_a, "world"_a.none() = nb::none(), "ulysses"_a.none() = nb::none(),                    \
      "ring"_a.none() = nb::none(), "kv_heads_per_gather"_a = 0, "hybrid_ring_layout"_a = "zigzag"

void forward(const InputArray& q, const InputArray& k, const InputArray& v, const OutputArray& out,
             const OutputArray& lse, RINGFLASH_GROUP_PARAMS, const OptionalOutput& kept_kv, RINGFLASH_OPTION_PARAMS) {
  constexpr const char* op = "parallel_forward";
  Setup s = make_setup(op, RINGFLASH_GROUP_NAMES);
  s.options.kept_kv = to_tensor_view(op, "kept_kv", kept_kv);
  parallel_attention_forward(s.strategy, s.group, to_tensor_view(op, "q", q), to_tensor_view(op, "k", k),
                             to_tensor_view(op, "v", v), to_tensor_view(op, "out", out),
                             to_tensor_view(op, "lse", lse), make_params(op, RINGFLASH_OPTION_NAMES), s.options);
}

void backward(const InputArray& q, const InputArray& k, const InputArray& v, const InputArray& out,
              const InputArray& dout, const InputArray& lse, const OutputArray& dq, const OutputArray& dk,
              const OutputArray& dv, RINGFLASH_GROUP_PARAMS, const OptionalInput& kept_kv,
              RINGFLASH_OPTION_PARAMS) {
  constexpr const char* op = "parallel_backward";
  Setup s = make_setup(op, RINGFLASH_GROUP_NAMES);
  s.options.kept_kv = to_tensor_view(op, "kept_kv", kept_kv);
  parallel_attention_backward(s.strategy, s.group, to_tensor_view(op, "q", q), to_tensor_view(op, "k", k),
                              to_tensor_view(op, "v", v), to_tensor_view(op, "out", out),
                              to_tensor_view(op, "dout", dout), to_tensor_view(op, "lse", lse),
                              to_tensor_view(op, "dq", dq), to_tensor_view(op, "dk", dk), to_tensor_view(op, "dv", dv),
                              make_params(op, RINGFLASH_OPTION_NAMES), s.options);
}

// This rank's positions of a sequence of `seqlen`, as (start, count, stride) pieces.
std::vector<std::tuple<int64_t, int64_t, int64_t>> shard(int64_t seqlen, RINGFLASH_GROUP_PARAMS) {
  const Setup s = make_setup("parallel_shard", RINGFLASH_GROUP_NAMES);
  std::vector<std::tuple<int64_t, int64_t, int64_t>> pieces;
  for (const Piece& p : parallel_shard(s.strategy, s.group, s.options, seqlen))
    pieces.emplace_back(p.start, p.count, p.stride);
  return pieces;
}

}  // namespace

void init_parallel(nb::module_& m) {
  m.def("parallel_forward", &forward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, RINGFLASH_GROUP_ARGS,
        "kept_kv"_a.none() = nb::none(), RINGFLASH_OPTION_KWARGS, nb::call_guard<nb::gil_scoped_release>(),
        "Sequence-parallel attention forward over this rank's shards; every rank of the group calls it.");
  m.def("parallel_backward", &backward, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a,
        "dv"_a, RINGFLASH_GROUP_ARGS, "kept_kv"_a.none() = nb::none(), RINGFLASH_OPTION_KWARGS,
        nb::call_guard<nb::gil_scoped_release>(),
        "Sequence-parallel attention backward; options as in the forward.");
  m.def("parallel_shard", &shard, "seqlen"_a, RINGFLASH_GROUP_ARGS,
        "This rank's positions of a sequence of seqlen tokens: a list of (start, count, stride) pieces.");
}

}  // namespace ringflash::python
