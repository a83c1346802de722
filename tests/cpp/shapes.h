// The one list of awkward shapes that every attention test (and benchmark sanity check) runs.
//
// Lengths 1, 17, 1013 and 4097 (prime-ish, so no tile divides them), Sq != Sk both ways, empty
// sequences, packed batches with an empty document and a document of length 1 and with tokens
// outside every document, GQA ratios 1, 3, 4 and H (MQA), and head dims 64, 128, 256, odd ones
// (40, 72, 96) and extremes (1, 3, 512). Shapes marked `large` cost
// seconds in the float64 reference, so only a couple of cases run them (see cases.h).
//
// Build switches: a head dim that the build leaves out (-DRINGFLASH_DISABLE_HDIM256=ON, forwarded
// as a compile definition by tests/cpp/CMakeLists.txt) drops its shapes from the list.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace ringflash::test {

struct Shape {
  std::string name;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t head_dim = 1;
  // Padded batch (B, S, H, D) when `docs_q` is empty ...
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  // ... else a packed batch (T, H, D) of these documents, with cu_seqlens.
  std::vector<int64_t> docs_q;
  std::vector<int64_t> docs_k;
  int64_t unused_lead = 0;   // packed: tokens before the first document (cu_seqlens[0] > 0) ...
  int64_t unused_trail = 0;  // ... and after the last (cu_seqlens[B] < T), in both q and k
  bool large = false;         // only a couple of cases run it
  bool every_option = false;  // the option sweep runs every option on it

  bool packed() const { return !docs_q.empty(); }
  int64_t num_seqs() const { return packed() ? static_cast<int64_t>(docs_q.size()) : batch; }
  int64_t len_q(int64_t b) const { return packed() ? docs_q[b] : seqlen_q; }
  int64_t len_k(int64_t b) const { return packed() ? docs_k[b] : seqlen_k; }
  // Packed: rows of the q and k tensors, documents and unused tokens.
  int64_t total_q() const { return packed() ? unused_lead + sum(docs_q) + unused_trail : 0; }
  int64_t total_k() const { return packed() ? unused_lead + sum(docs_k) + unused_trail : 0; }

 private:
  static int64_t sum(const std::vector<int64_t>& x) { return std::accumulate(x.begin(), x.end(), int64_t{0}); }
};

inline Shape padded_shape(std::string name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q,
                          int64_t heads_kv, int64_t head_dim, bool large = false) {
  Shape s;
  s.name = std::move(name);
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = head_dim;
  s.large = large;
  return s;
}

inline Shape packed_shape(std::string name, std::vector<int64_t> docs_q, std::vector<int64_t> docs_k,
                          int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t unused_lead = 0,
                          int64_t unused_trail = 0) {
  Shape s;
  s.unused_lead = unused_lead;
  s.unused_trail = unused_trail;
  s.name = std::move(name);
  s.docs_q = std::move(docs_q);
  s.docs_k = std::move(docs_k);
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.head_dim = head_dim;
  return s;
}

// Marks a shape for the option sweep.
inline Shape every_option(Shape s) {
  s.every_option = true;
  return s;
}

// Whether this build has kernels for `head_dim` (the RINGFLASH_DISABLE_HDIM* switches).
inline bool head_dim_enabled(int64_t head_dim) {
#ifdef RINGFLASH_DISABLE_HDIM256
  if (head_dim > 192) return false;
#endif
#ifdef RINGFLASH_DISABLE_HDIM192
  if (head_dim > 128 && head_dim <= 192) return false;
#endif
  (void)head_dim;
  return true;
}

inline std::vector<Shape> build_awkward_shapes() {
  const std::vector<Shape> all = {
      padded_shape("b1_q1_k1_h2_d64", 1, 1, 1, 2, 2, 64),
      padded_shape("b2_q17_k17_h4_d128", 2, 17, 17, 4, 4, 128),
      every_option(padded_shape("b2_q17_k1013_gqa4_d64", 2, 17, 1013, 8, 2, 64)),   // Sq < Sk
      every_option(padded_shape("b2_q1013_k17_mqa4_d128", 2, 1013, 17, 4, 1, 128)),  // Sq > Sk, MQA
      padded_shape("b1_q1_k1013_h2_d256", 1, 1, 1013, 2, 2, 256),
      padded_shape("b1_q1013_k1013_gqa2_d40", 1, 1013, 1013, 2, 1, 40),
      padded_shape("b3_q17_k1_h3_d72", 3, 17, 1, 3, 3, 72),
      padded_shape("b2_q64_k300_gqa4_d96", 2, 64, 300, 4, 1, 96),
      padded_shape("b1_q17_k33_gqa3_d3", 1, 17, 33, 6, 2, 3),        // tiny head dim, GQA ratio 3
      padded_shape("b2_q5_k9_h1_d1", 2, 5, 9, 1, 1, 1),
      padded_shape("b1_q33_k17_h2_d512", 1, 33, 17, 2, 2, 512),
      padded_shape("b2_q17_k0_h2_d64", 2, 17, 0, 2, 2, 64),            // no keys at all
      padded_shape("b2_q0_k17_h2_d64", 2, 0, 17, 2, 2, 64),            // no queries at all
      padded_shape("b1_q1_k4097_mqa8_d128", 1, 1, 4097, 8, 1, 128),
      padded_shape("b1_q4097_k17_h2_d64", 1, 4097, 17, 2, 2, 64),
      padded_shape("b1_q4097_k4097_h1_d64", 1, 4097, 4097, 1, 1, 64, /*large=*/true),
      // Self-attention documents, one of them empty and one of length 1.
      every_option(packed_shape("packed_self_gqa4_d64", {17, 0, 1, 113, 64}, {17, 0, 1, 113, 64}, 8, 2, 64)),
      // Cross-attention documents: Sq != Sk both ways, no keys, no queries, neither.
      every_option(packed_shape("packed_cross_mqa8_d128", {1, 0, 17, 100, 0, 33}, {17, 5, 0, 130, 0, 1}, 8, 1, 128)),
      packed_shape("packed_long_h2_d72", {1013, 1, 0, 17}, {1013, 1, 0, 17}, 2, 2, 72),
      packed_shape("packed_h4_d256", {1, 17, 0, 200}, {17, 1, 3, 150}, 4, 4, 256),
      // Documents that do not cover the whole packed tensor: 3 tokens before, 2 after.
      packed_shape("packed_unused_tokens_gqa2_d64", {5, 17, 0}, {9, 1, 4}, 4, 2, 64, 3, 2),
  };
  std::vector<Shape> enabled;
  for (const Shape& s : all)
    if (head_dim_enabled(s.head_dim)) enabled.push_back(s);
  return enabled;
}

// The list.
inline const std::vector<Shape>& awkward_shapes() {
  static const std::vector<Shape> shapes = build_awkward_shapes();
  return shapes;
}


}  // namespace ringflash::test
