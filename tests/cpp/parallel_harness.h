// Distributed test harness for the strategies of parallel.h, over any Communicator.
//
// Every rank builds the global inputs of a case from a seed, takes its shard with the strategy's
// layout (parallel_shard), runs the strategy through parallel_attention_forward/backward, and
// checks its own rows of out and lse, or of dq, dk and dv, against the single-device float64
// reference by DESIGN.md's rule (tolerance.h). The ranks then add up their failure counts with
// all_gather, and every rank asserts that the sum is zero, so all ranks agree on the verdict.
//
// The same case runs on inproc ranks (run_inproc_case) or on the ranks of any communicator
// (run_parallel_case, e.g. under mpiexec). The float64 reference of a case depends only on its
// inputs and mask (ParallelCase::problem()), so it is computed once per process and shared by the
// strategies and world sizes that follow.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "host_tensor.h"
#include "reference.h"
#include "ringflash/comm.h"
#include "ringflash/layout.h"
#include "ringflash/parallel.h"
#include "tolerance.h"

namespace ringflash::test {

enum class MaskKind {
  kNone,
  kCausal,
  kWindow,        // window_left and window_right, not causal
  kCausalWindow,  // causal with window_left (a sliding window)
};

struct ParallelCase {
  Strategy strategy = Strategy::kRing;
  bool backward = false;
  MaskKind mask = MaskKind::kNone;
  int64_t window_left = 37;
  int64_t window_right = 11;
  int64_t heads_q = 4;
  int64_t heads_kv = 4;
  int64_t head_dim = 16;
  // A padded batch (B, S, H, D) when `docs` is empty, else a packed batch of these documents.
  int64_t batch = 2;
  int64_t seqlen = 203;
  std::vector<int64_t> docs;
  DType dtype = DType::kFloat32;
  bool alibi = false;                  // ALiBi slopes (Hq) ...
  bool alibi_per_sequence = false;     // ... or (B, Hq), different for every sequence
  float softcap = 0.0f;
  std::optional<float> softmax_scale;
  int world = 1;                       // ranks (inproc)
  int ulysses = 1;                     // hybrid: ranks per ulysses group; world / ulysses ring positions
  ParallelOptions options;
  bool strided = false;                // local tensors with gaps between heads, rows and sequences

  bool packed() const { return !docs.empty(); }
  int64_t num_seqs() const { return packed() ? static_cast<int64_t>(docs.size()) : batch; }
  int64_t length(int64_t b) const { return packed() ? docs[b] : seqlen; }
  // The inputs, mask and options: what the reference depends on (and the seed).
  std::string problem() const;
  // problem() plus the strategy, the world and its split: a gtest name.
  std::string name() const;
};

// gtest prints a case by its name.
inline void PrintTo(const ParallelCase& c, std::ostream* os) { *os << c.name(); }

// The float64 reference and naive-in-dtype results of a case, per sequence.
struct Expected {
  std::vector<RefSequence> seqs;
  std::vector<RefForward> exact, naive;  // forward
  std::vector<RefForward> given;         // backward: the out (rounded to the dtype) and lse it is given
  std::vector<RefGrads> grads, naive_grads;
  std::vector<RefVisibility> visibility;
};

// The communicators a case runs over, split from the caller's so that a failure inside the
// strategy leaves the caller's communicator usable for the verdict: a copy of it, or for hybrid
// its ulysses and ring groups (ranks w / ulysses share a ring position; w % ulysses is the ulysses
// rank). Collective over `world`.
struct CaseGroup {
  CaseGroup(Communicator& world, const ParallelCase& c);
  std::unique_ptr<Communicator> world, ulysses, ring;
  ParallelGroup group;
};

// One rank's part of a case: its shard of the global inputs, and its outputs (NaN until written).
class RankProblem {
 public:
  // Backward takes out and lse from `expected` (the exact forward result, out rounded to the dtype).
  RankProblem(const ParallelCase& c, const ParallelGroup& group, const Expected& expected);

  // The options of the call (cu_seqlens global, positions unset).
  AttentionParams params();
  // Calls parallel_attention_forward or _backward.
  void run();
  // Checks this rank's outputs; returns one message per failed check.
  std::vector<std::string> check(const Expected& expected) const;

  const ParallelCase& spec() const { return case_; }
  int64_t rows() const { return rows_; }

  // Inputs (q, k, v; backward also out, dout and lse) and outputs (out and lse, or dq, dk, dv).
  HostTensor q, k, v, out, lse, dout, dq, dk, dv;

 private:
  HostTensor make_rows(DType dtype, int64_t heads, double fill) const;
  HostTensor make_lse(double fill) const;
  int64_t element(const HostTensor& t, int64_t b, int64_t i, int64_t h, int64_t d) const;
  int64_t lse_element(const HostTensor& t, int64_t b, int64_t h, int64_t i) const;

  ParallelCase case_;
  ParallelGroup group_;
  std::vector<Shard> shards_;             // per sequence
  std::vector<int32_t> cu_, local_cu_;    // packed: global and local cumulative lengths
  std::vector<float> slopes_;
  int64_t rows_ = 0;                      // local rows (S_r, or T_r when packed)
};

// The reference's options for a case.
RefOptions ref_options(const ParallelCase& c);
// The case's inputs, built from its seed (the same on every rank), already rounded to its dtype.
std::vector<RefSequence> case_inputs(const ParallelCase& c);
// The reference of a case, computed once per process (guarded, shared by the ranks of inproc).
std::shared_ptr<const Expected> expected_for(const ParallelCase& c);

// The sum over the ranks of `comm` of `count`, the same on every rank.
int64_t sum_over_ranks(Communicator& comm, int64_t count);

// Every rank of `world` calls this: runs the case and asserts the agreed verdict. The verdict is
// exchanged on `verdict` (default: `world`); a communicator of another failure domain (a second
// mpi_world()) keeps it intact when the strategy fails its communicators.
void run_parallel_case(Communicator& world, const ParallelCase& c, Communicator* verdict = nullptr);
// Runs the case on c.world inproc ranks.
void run_inproc_case(const ParallelCase& c, std::chrono::milliseconds timeout = std::chrono::seconds(60));

// reference_forward / reference_backward, compiled in reference_oracle.cpp.
RefForward oracle_forward(const RefOptions& o, const RefSequence& s, const Precision& p = Precision::float64());
RefGrads oracle_backward(const RefOptions& o, const RefSequence& s, const std::vector<double>& out,
                         const std::vector<double>& lse, const Precision& p = Precision::float64());

}  // namespace ringflash::test
