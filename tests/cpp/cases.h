// The kernel test cases: every awkward shape with the basic masks, and every option on the shapes
// marked `every_option`, each in fp32, fp16 and bf16, forward and backward.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ringflash/tensor.h"
#include "shapes.h"

namespace ringflash::test {

enum class Direction { kForward, kBackward };
enum class Alibi { kNone, kPerHead, kPerBatch };

// Where the rows sit (attention.h, "Positions and masks").
enum class Positions {
  kDefault,      // bottom-right: q_pos = len_k - len_q, k_pos = 0
  kScalar,       // q_offset / k_offset below
  kPerSequence,  // q_seq_offsets / k_seq_offsets, different for every sequence (see harness.h)
};

// How the tensors lie in memory.
enum class Layout {
  kContiguous,
  kQkvPacked,  // q, k, v (and dq, dk, dv) are slices of one qkv- (or kv-) packed buffer
  kStrided,    // every tensor has gaps between heads, rows and sequences
};

struct Options {
  std::string name;
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;
  std::optional<float> softmax_scale;
  Alibi alibi = Alibi::kNone;
  Positions positions = Positions::kDefault;
  int64_t q_offset = 0;  // with Positions::kScalar
  int64_t k_offset = 0;
  bool accumulate = false;     // forward: two calls over the two halves of the keys; backward: add
  bool deterministic = false;  // backward: a second run must be bit-identical
  int num_threads = 0;
  Layout layout = Layout::kContiguous;
  bool masks_rows = false;  // by construction some query sees no key; the test asserts it
  bool fp32_out = false;    // backward: out is fp32 whatever the input dtype (a ring's merged out)
  bool overwrite_dkdv = false;  // backward with accumulate: dk and dv written, not added to
  bool overwrite_out = false;   // forward with accumulate: the first call writes out and lse (from NaN)
  bool final_out = false;       // forward with accumulate: the last call rounds out into q's dtype
  bool backward_only = false;
  bool forward_only = false;
};

template <typename Fn>
Options make_options(std::string name, Fn&& set) {
  Options o;
  o.name = std::move(name);
  set(o);
  return o;
}

// The masks every shape runs.
inline const std::vector<Options>& basic_options() {
  static const std::vector<Options> options = {
      make_options("none", [](Options&) {}),
      make_options("causal", [](Options& o) { o.causal = true; }),
  };
  return options;
}

// Every option, alone and in combination.
inline const std::vector<Options>& all_options() {
  static const std::vector<Options> options = {
      make_options("window_left", [](Options& o) { o.window_left = 100; }),
      make_options("window_right", [](Options& o) { o.window_right = 37; }),
      make_options("window_both", [](Options& o) {
        o.window_left = 70;
        o.window_right = 150;
      }),
      make_options("causal_window", [](Options& o) {
        o.causal = true;
        o.window_left = 90;
      }),
      make_options("softcap", [](Options& o) { o.softcap = 1.5f; }),
      make_options("alibi_per_head", [](Options& o) { o.alibi = Alibi::kPerHead; }),
      make_options("alibi_per_batch_causal", [](Options& o) {
        o.alibi = Alibi::kPerBatch;
        o.causal = true;
      }),
      make_options("scale", [](Options& o) { o.softmax_scale = 0.37f; }),
      make_options("offsets_causal", [](Options& o) {
        o.positions = Positions::kScalar;
        o.q_offset = 300;
        o.k_offset = 250;
        o.causal = true;
      }),
      make_options("seq_offsets_causal", [](Options& o) {
        o.positions = Positions::kPerSequence;
        o.causal = true;
      }),
      make_options("seq_offsets_window", [](Options& o) {
        o.positions = Positions::kPerSequence;
        o.window_left = 50;
        o.window_right = 20;
      }),
      make_options("everything", [](Options& o) {
        o.causal = true;
        o.window_left = 200;
        o.softcap = 2.5f;
        o.alibi = Alibi::kPerBatch;
        o.positions = Positions::kPerSequence;
        o.softmax_scale = 0.2f;
      }),
      make_options("masked_rows", [](Options& o) {
        o.positions = Positions::kScalar;  // queries 0..4 sit before the first key
        o.q_offset = 0;
        o.k_offset = 5;
        o.causal = true;
        o.window_left = 3;
        o.masks_rows = true;
      }),
      make_options("threads1_causal", [](Options& o) {
        o.causal = true;
        o.num_threads = 1;
      }),
      make_options("threads3_window", [](Options& o) {  // more threads than this machine's cores
        o.window_left = 40;
        o.window_right = 40;
        o.num_threads = 3;
      }),
      make_options("qkv_packed_causal", [](Options& o) {
        o.causal = true;
        o.layout = Layout::kQkvPacked;
      }),
      make_options("strided_window_alibi", [](Options& o) {
        o.causal = true;
        o.window_left = 70;
        o.alibi = Alibi::kPerHead;
        o.layout = Layout::kStrided;
      }),
      make_options("deterministic_causal", [](Options& o) {
        o.causal = true;
        o.deterministic = true;
      }),
      make_options("deterministic_everything", [](Options& o) {
        o.causal = true;
        o.window_left = 200;
        o.softcap = 2.5f;
        o.alibi = Alibi::kPerBatch;
        o.positions = Positions::kPerSequence;
        o.deterministic = true;
        o.layout = Layout::kStrided;
      }),
      make_options("fp32_out_causal", [](Options& o) {
        o.causal = true;
        o.fp32_out = true;
        o.backward_only = true;
      }),
      make_options("accumulate", [](Options& o) { o.accumulate = true; }),
      make_options("accumulate_causal_window_alibi_softcap", [](Options& o) {
        o.accumulate = true;
        o.causal = true;
        o.window_left = 90;
        o.alibi = Alibi::kPerHead;
        o.softcap = 2.0f;
      }),
      make_options("accumulate_seq_offsets_strided", [](Options& o) {
        o.accumulate = true;
        o.positions = Positions::kPerSequence;
        o.window_left = 50;
        o.window_right = 20;
        o.layout = Layout::kStrided;
      }),
      make_options("accumulate_overwrite_dkdv_causal", [](Options& o) {
        o.accumulate = true;
        o.overwrite_dkdv = true;
        o.causal = true;
        o.backward_only = true;
      }),
      make_options("accumulate_overwrite_out_causal_window", [](Options& o) {
        o.accumulate = true;
        o.overwrite_out = true;
        o.causal = true;
        o.window_left = 70;
        o.forward_only = true;
      }),
      make_options("accumulate_overwrite_out_seq_offsets_strided", [](Options& o) {
        o.accumulate = true;
        o.overwrite_out = true;
        o.positions = Positions::kPerSequence;
        o.window_left = 50;
        o.window_right = 20;
        o.layout = Layout::kStrided;
        o.forward_only = true;
      }),
      make_options("accumulate_final_out_causal", [](Options& o) {
        o.accumulate = true;
        o.final_out = true;
        o.causal = true;
        o.forward_only = true;
      }),
      make_options("accumulate_overwrite_final_out_seq_offsets_strided", [](Options& o) {
        o.accumulate = true;
        o.overwrite_out = true;
        o.final_out = true;
        o.positions = Positions::kPerSequence;
        o.window_left = 40;
        o.layout = Layout::kStrided;
        o.forward_only = true;
      }),
      make_options("accumulate_masked_rows", [](Options& o) {
        o.accumulate = true;
        o.positions = Positions::kScalar;
        o.q_offset = 0;
        o.k_offset = 5;
        o.causal = true;
        o.masks_rows = true;
      }),
  };
  return options;
}

inline const std::vector<DType>& test_dtypes() {
  static const std::vector<DType> dtypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  return dtypes;
}

inline const char* short_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    default: return "fp32";
  }
}

struct KernelCase {
  Direction direction = Direction::kForward;
  DType dtype = DType::kFloat32;
  Shape shape;
  Options options;

  std::string name() const { return std::string(short_name(dtype)) + "_" + options.name + "_" + shape.name; }
};

// The only cases that run `large` shapes (a few seconds each in the float64 reference).
inline bool runs_large(Direction direction, DType dtype, const Options& options) {
  if (direction == Direction::kForward) return dtype == DType::kBFloat16 && options.causal;
  return dtype == DType::kFloat16 && options.causal;
}

// Every awkward shape, with and without the causal mask.
inline std::vector<KernelCase> shape_cases(Direction direction) {
  std::vector<KernelCase> cases;
  for (const Shape& shape : awkward_shapes())
    for (DType dtype : test_dtypes())
      for (const Options& options : basic_options())
        if (!shape.large || runs_large(direction, dtype, options))
          cases.push_back({direction, dtype, shape, options});
  return cases;
}

// Every option on every shape marked `every_option`.
inline std::vector<KernelCase> option_cases(Direction direction) {
  std::vector<KernelCase> cases;
  for (const Options& options : all_options())
    if (!(options.backward_only && direction == Direction::kForward) &&
        !(options.forward_only && direction == Direction::kBackward))
      for (DType dtype : test_dtypes())
        for (const Shape& shape : awkward_shapes())
          if (shape.every_option) cases.push_back({direction, dtype, shape, options});
  return cases;
}

}  // namespace ringflash::test
