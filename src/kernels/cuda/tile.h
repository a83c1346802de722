// Shared-memory tiles and the fragment loads that read them.
//
// A tile is kRows x kCols 16-bit elements, row-major, with the 16-byte chunks of each row permuted
// by (chunk ^ (row % 8)). The eight row addresses of an ldmatrix then fall in eight different
// 16-byte bank groups, so neither the row-wise nor the transposed reads conflict, and cp.async
// writes whole 16-byte chunks.
#pragma once

#include <cstdint>

#include "ptx.h"

namespace ringflash::cuda {

constexpr int kChunk = 8;  // 16-bit elements per 16-byte chunk

template <int kRows, int kCols>
struct Tile {
  static_assert(kCols % (8 * kChunk) == 0, "a tile row must be whole 128-byte lines");
  static constexpr int kElements = kRows * kCols;
  static constexpr int kBytes = 2 * kElements;
  static constexpr int kChunksPerRow = kCols / kChunk;

  // Element offset of (row, col); col % 8 is kept, the chunk is permuted.
  static __device__ __forceinline__ int offset(int row, int col) {
    return row * kCols + ((((col / kChunk) ^ (row % 8)) * kChunk) | (col % kChunk));
  }

  // Copies rows [0, valid_rows) and columns [0, valid_cols) of a global tile (row stride in
  // elements; valid_cols a multiple of 8) with cp.async and zero-fills the rest. The caller commits
  // the group.
  template <int kThreads, typename T>
  static __device__ __forceinline__ void load(T* smem, const T* gmem, int64_t row_stride, int valid_rows,
                                              int valid_cols) {
    static_assert(kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0,
                  "every thread copies the same chunk column of evenly spaced rows");
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int row0 = static_cast<int>(threadIdx.x) / kChunksPerRow;
    const int col = static_cast<int>(threadIdx.x) % kChunksPerRow * kChunk;
    // Source addresses as integers, one add per row. A chunk past valid_rows or valid_cols is
    // zero-filled: cp.async reads none of its bytes, so its address needs no guard.
    uintptr_t src = reinterpret_cast<uintptr_t>(gmem + row0 * row_stride + col);
    const uintptr_t step = static_cast<uintptr_t>(kRowStep * row_stride) * sizeof(T);
    const uint32_t dst = smem_address(smem + offset(row0, col));
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i, src += step) {
      const int row = row0 + i * kRowStep;
      // With a row step of a multiple of 8 the chunk permutation repeats, so the destination
      // moves by whole rows.
      const uint32_t to = kRowStep % 8 == 0 ? dst + 2 * i * kRowStep * kCols : smem_address(smem + offset(row, col));
      cp_async_16(to, reinterpret_cast<const void*>(src), row < valid_rows && col < valid_cols);
    }
  }

  // Each lane's ldmatrix row address for the four fragment shapes, at (0, 0); at(row0, col0)
  // moves it. Stored [m][k] for A: a_lanes, at(m0, k0). Stored [k][m] for A: a_trans_lanes,
  // at(k0, m0). Stored [n][k] for B (two n-tiles, {b[n0][0], b[n0][1], b[n0 + 8][0],
  // b[n0 + 8][1]}): b_lanes, at(n0, k0). Stored [k][n] for B: b_trans_lanes, at(k0, n0).
  struct Lanes {
    uint32_t base;
    // Rows move the address by whole rows; a column offset that is a multiple of 8 flips the
    // chunk bits that the permutation also flips, so it is an XOR (the tile must start on a
    // multiple of 2 * kCols bytes). Both are one instruction, which the compiler can redo at each
    // use instead of keeping every address in a register.
    __device__ __forceinline__ uint32_t at(int row0, int col0) const {
      return (base + row0 * (2 * kCols)) ^ (2 * col0);
    }
    // The same address, column first: the XOR only touches bits below a row's size, so whole
    // rows, and whole tiles of the same shape further on in shared memory, can follow as adds
    // that the compiler folds into the load's immediate, and one XORed base serves them all. The
    // backward, whose K and V (and q and dout) share lane addresses, measured faster with this
    // form, the forward slower (hdim 64: 5 %).
    __device__ __forceinline__ uint32_t at_column_first(int row0, int col0) const {
      return (base ^ (2 * col0)) + row0 * (2 * kCols);
    }
  };
  static __device__ __forceinline__ Lanes a_lanes(uint32_t tile, int lane) {
    return {tile + 2 * offset(lane & 15, (lane >> 4) * 8)};
  }
  static __device__ __forceinline__ Lanes a_trans_lanes(uint32_t tile, int lane) {
    return {tile + 2 * offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8)};
  }
  static __device__ __forceinline__ Lanes b_lanes(uint32_t tile, int lane) {
    return {tile + 2 * offset((lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) * 8)};
  }
  static __device__ __forceinline__ Lanes b_trans_lanes(uint32_t tile, int lane) {
    return {tile + 2 * offset((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8)};
  }
};

// Stores A fragment `a` (16 x 16 at (row0, col0); lane (g, t) holds rows g and g + 8, columns
// 2t, 2t + 1, 2t + 8 and 2t + 9) into `tile` of type Tile, where Tile::a_lanes would load it from:
// one stmatrix on sm_90, four 32-bit stores before.
template <typename Tile, typename T>
__device__ __forceinline__ void store_a(T* tile, int row0, int col0, const uint32_t (&a)[4], int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  stmatrix_x4(Tile::a_lanes(smem_address(tile), lane).at_column_first(row0, col0), a);
#else
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = row0 + lane / 4 + (j % 2) * 8, col = col0 + (j / 2) * 8 + (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(tile + Tile::offset(row, col)) = a[j];
  }
#endif
}

// C fragments of two adjacent n-tiles as the A fragment of the next product, rounded to T.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = Mma<T>::pack(c0[0], c0[1]);
  a[1] = Mma<T>::pack(c0[2], c0[3]);
  a[2] = Mma<T>::pack(c1[0], c1[1]);
  a[3] = Mma<T>::pack(c1[2], c1[3]);
}

}  // namespace ringflash::cuda
