// The argument block of the elementwise kernels behind kernels/ops.h, by value.
//
// ops.cpp validates the views and folds their dimensions (dropping size-1 ones and merging
// neighbours that are contiguous in every view), so a kernel sees at most TensorView::kMaxDims
// dimensions, innermost last, usually one or two.
#pragma once

#include <cstdint>

#include "ringflash/tensor.h"

namespace ringflash::core {

enum class ElementwiseOp : uint8_t {
  kFill,  // dst = value
  kCopy,  // dst = src, converted to dst's dtype (a bit copy when the dtypes match)
  kAdd,   // dst = src + src2, both float32; dst any float dtype (src2 may be dst itself)
};

// Element offsets of one position in each view (CPU: the start of a run; CUDA: one element).
struct ElementwiseOffsets {
  int64_t dst = 0, src = 0, src2 = 0;
};

struct ElementwiseArgs {
  ElementwiseOp op = ElementwiseOp::kFill;
  int ndim = 0;
  int64_t numel = 0;
  int64_t size[TensorView::kMaxDims] = {};
  int64_t dst_stride[TensorView::kMaxDims] = {};  // in elements
  int64_t src_stride[TensorView::kMaxDims] = {};
  int64_t src2_stride[TensorView::kMaxDims] = {};  // kAdd
  void* dst = nullptr;
  const void* src = nullptr;
  const void* src2 = nullptr;  // kAdd
  DType dst_dtype = DType::kFloat32;
  DType src_dtype = DType::kFloat32;
  float value = 0.0f;      // kFill
  int device = 0;          // CUDA device
  void* stream = nullptr;  // cudaStream_t
};

}  // namespace ringflash::core
