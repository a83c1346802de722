// DLPack arrays (torch, numpy, cupy, jax, ...) to ringflash::TensorView.
#pragma once

#include <optional>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include "ringflash/tensor.h"

namespace ringflash::python {

// Inputs may be read-only; outputs must be writable. Neither is ever copied or converted: a
// tensor that does not fit is an error, not a silent copy.
using InputArray = nanobind::ndarray<nanobind::ro>;
using OutputArray = nanobind::ndarray<>;
using OptionalInput = std::optional<InputArray>;
using OptionalOutput = std::optional<OutputArray>;

// The one conversion from a DLPack tensor to a TensorView. Checks that the dtype is one of
// float32, float16, bfloat16, int32, int64, float64 and the device cpu or cuda, and that the
// rank fits; errors are InvalidArgument naming `op` and `name`, e.g.
//   "[attention_forward] q must have dtype float32, float16, bfloat16, int32, int64 or float64, got int8".
// The view borrows the array's memory: the array must outlive it. Strides are in elements.
TensorView to_tensor_view(const char* op, const char* name, void* data, nanobind::dlpack::dtype dtype,
                          int device_type, int device_id, size_t ndim, const int64_t* shape,
                          const int64_t* strides);

template <typename... Config>
TensorView to_tensor_view(const char* op, const char* name, const nanobind::ndarray<Config...>& a) {
  return to_tensor_view(op, name, const_cast<void*>(static_cast<const void*>(a.data())), a.dtype(),
                        a.device_type(), a.device_id(), a.ndim(), a.shape_ptr(), a.stride_ptr());
}

template <typename... Config>
std::optional<TensorView> to_tensor_view(const char* op, const char* name,
                                         const std::optional<nanobind::ndarray<Config...>>& a) {
  if (!a) return std::nullopt;
  return to_tensor_view(op, name, *a);
}

}  // namespace ringflash::python
