// Views that the strategies carve from their tensors and workspaces: no data is touched here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ringflash/tensor.h"

namespace ringflash::parallel {

// `count` entries of dimension `dim` (negative counts from the end) from `start`. A view with no
// elements keeps t's pointer, which may be null.
inline TensorView narrow(const TensorView& t, int dim, int64_t start, int64_t count) {
  const int d0 = dim < 0 ? dim + t.ndim() : dim;
  int64_t shape[TensorView::kMaxDims], strides[TensorView::kMaxDims];
  int64_t numel = 1;
  for (int d = 0; d < t.ndim(); ++d) {
    shape[d] = d == d0 ? count : t.size(d);
    strides[d] = t.stride(d);
    numel *= shape[d];
  }
  auto* data = static_cast<unsigned char*>(t.data());
  if (numel > 0) data += start * t.stride(d0) * static_cast<int64_t>(dtype_size(t.dtype()));
  return TensorView(data, t.dtype(), t.device(), t.ndim(), shape, strides);
}

// A packed tensor as a batch of one: (T, H, D) -> (1, T, H, D), (H, T) -> (1, H, T).
inline TensorView batched(const TensorView& t, bool packed) {
  if (!packed) return t;
  int64_t shape[TensorView::kMaxDims] = {1}, strides[TensorView::kMaxDims] = {0};
  for (int d = 0; d < t.ndim(); ++d) {
    shape[d + 1] = t.size(d);
    strides[d + 1] = t.stride(d);
  }
  return TensorView(t.data(), t.dtype(), t.device(), t.ndim() + 1, shape, strides);
}

// A contiguous (B, rows, H, D) tensor at `data`.
inline TensorView contiguous(void* data, DType dtype, Device device, int64_t batch, int64_t rows, int64_t heads,
                             int64_t dim) {
  return TensorView(data, dtype, device, {batch, rows, heads, dim});
}

// A contiguous tensor at `data` with the shape and device of `like`.
inline TensorView contiguous_like(void* data, DType dtype, const TensorView& like) {
  int64_t shape[TensorView::kMaxDims];
  for (int d = 0; d < like.ndim(); ++d) shape[d] = like.size(d);
  return TensorView(data, dtype, like.device(), like.ndim(), shape);
}

// Bytes that the elements of `t` take, were they contiguous.
inline size_t bytes_of(const TensorView& t) { return static_cast<size_t>(t.numel()) * dtype_size(t.dtype()); }

// The first `n` elements at `data` as a flat fp32 tensor.
inline TensorView flat(void* data, Device device, int64_t n) { return TensorView(data, DType::kFloat32, device, {n}); }

}  // namespace ringflash::parallel
