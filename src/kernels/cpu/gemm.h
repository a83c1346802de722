// Small fp32 matrix products for the attention tiles, register-blocked for the vector ISA.
//
// Every product in the kernels has one operand as a dense panel of rows read as vectors (B below)
// and the other read element by element and broadcast (A, any strides), which lets one routine
// serve S^T = K Q^T, O^T += V^T P^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q and
// dQ^T += K^T dS^T without any transposes.
#pragma once

#include <cstdint>

#include "vec.h"

namespace ringflash::cpu {

// Register tiles: MR rows of C by NV vectors of columns, accumulated in registers.
template <int MR, int NV, bool kUnitRowStride>
struct RegisterTile {
  static constexpr int kMR = MR;
  static constexpr int kNV = NV;
  static constexpr int kNR = NV * kVecWidth;
  static constexpr bool kUnitA = kUnitRowStride;  // A's rows adjacent: a_rs == 1
};

// When A's rows are adjacent in memory (a_rs == 1), the MR broadcasts of a step come from one or
// two cache lines through one pointer, so a tall tile is cheap: 12 x 2 accumulators + 2 B vectors
// + 1 broadcast use 27 of AVX-512's 32 registers, and B's panel is only 2 vectors wide, which
// keeps it in L1 beside everything else.
using UnitStrideTile = RegisterTile<kVecRegisters >= 32 ? 12 : 6, 2, true>;
// When A's rows are far apart, each needs its own pointer; 6 x 4 keeps the six pointers in the
// general registers (12 x 2 would spill them).
using StridedTile = RegisterTile<kVecRegisters >= 32 ? 6 : 4, kVecRegisters >= 32 ? 4 : 2, false>;
// Column panels (gemm_panels) and query tiles are sized by the wider tile.
inline constexpr int kNR = StridedTile::kNR;

struct GemmOperands {
  const float* a;  // A(m, k) = a[m * a_rs + k * a_cs]
  int64_t a_rs, a_cs;
  const float* b;  // B(k, n) = b[k * ldb + n], n contiguous
  int64_t ldb;
  float* c;        // C(m, n) = c[m * ldc + n]
  int64_t ldc;
  // With kAccumulate: C(m, n) = c_scale[n] * C(m, n) + (A B)(m, n) when set (the online softmax's
  // rescale of the running output, folded into the load of C).
  const float* c_scale = nullptr;
};

template <int MR, int NV, bool kAccumulate, bool kUnitA>
inline void gemm_micro(int64_t K, const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                       float* c, int64_t ldc, const float* c_scale) {
  Vec acc[MR][NV];
  Vec scale[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) scale[v] = kAccumulate && c_scale ? load(c_scale + v * kVecWidth) : splat(1.0f);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = kAccumulate ? load(c + m * ldc + v * kVecWidth) * scale[v] : Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = load(b + k * ldb + v * kVecWidth);
    const float* ak = a + k * a_cs;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const Vec am = splat(ak[kUnitA ? m : m * a_rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] += am * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(c + m * ldc + v * kVecWidth, acc[m][v]);
}

// Rows [0, rows) of a column strip of NV vectors, rows < MR handled by a smaller tile.
template <int NV, bool kAccumulate, bool kUnitA, int MR>
inline void gemm_rows_tail(int64_t rows, int64_t K, const GemmOperands& o, int64_t m0, int64_t n0) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return gemm_micro<MR, NV, kAccumulate, kUnitA>(K, o.a + m0 * o.a_rs, o.a_rs, o.a_cs, o.b + n0, o.ldb,
                                             o.c + m0 * o.ldc + n0, o.ldc, o.c_scale ? o.c_scale + n0 : nullptr);
    gemm_rows_tail<NV, kAccumulate, kUnitA, MR - 1>(rows, K, o, m0, n0);
  }
}

template <int MR, int NV, bool kAccumulate, bool kUnitA>
inline void gemm_strip(int64_t M, int64_t K, const GemmOperands& o, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR)
    gemm_micro<MR, NV, kAccumulate, kUnitA>(K, o.a + m0 * o.a_rs, o.a_rs, o.a_cs, o.b + n0, o.ldb,
                                    o.c + m0 * o.ldc + n0, o.ldc, o.c_scale ? o.c_scale + n0 : nullptr);
  if (m0 < M) gemm_rows_tail<NV, kAccumulate, kUnitA, MR - 1>(M - m0, K, o, m0, n0);
}

// Columns [n0, N) in strips of NV vectors, then one narrower strip for what is left.
template <int MR, int NV, bool kAccumulate, bool kUnitA>
inline void gemm_columns(int64_t M, int64_t N, int64_t K, const GemmOperands& o, int64_t n0) {
  if constexpr (NV > 0) {
    for (; n0 + NV * kVecWidth <= N; n0 += NV * kVecWidth) gemm_strip<MR, NV, kAccumulate, kUnitA>(M, K, o, n0);
    if (n0 < N) gemm_columns<MR, NV - 1, kAccumulate, kUnitA>(M, N, K, o, n0);
  }
}

// C (M x N) = A (M x K) B (K x N), or C += A B when kAccumulate, in register tiles of `Tile`.
// N must be a multiple of kVecWidth (callers pad their panels with zeros). K may be 0.
// UnitStrideTile requires o.a_rs == 1.
template <bool kAccumulate, typename Tile = StridedTile>
inline void gemm(int64_t M, int64_t N, int64_t K, const GemmOperands& o) {
  gemm_columns<Tile::kMR, Tile::kNV, kAccumulate, Tile::kUnitA>(M, N, K, o, 0);
}

// C (M x N) = A B, or C += A B, with B stored as column panels: panel p holds columns
// [p * kNR, p * kNR + width) as a dense `depth` x width block (depth >= K), the panels one after
// another. Dense panels keep B reads free of the cache-set conflicts that a wide row stride causes.
template <bool kAccumulate>
inline void gemm_panels(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_rs, int64_t a_cs,
                        const float* b_panels, int64_t depth, float* c, int64_t ldc) {
  for (int64_t n0 = 0; n0 < N; n0 += kNR) {
    const int64_t width = N - n0 < kNR ? N - n0 : kNR;
    gemm<kAccumulate>(M, width, K, {a, a_rs, a_cs, b_panels + n0 * depth, width, c + n0, ldc, nullptr});
  }
}

}  // namespace ringflash::cpu
