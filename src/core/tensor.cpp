#include "ringflash/tensor.h"

#include <sstream>

#include "ringflash/errors.h"

namespace ringflash {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

bool is_float(DType dtype) { return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

std::string device_name(Device device) {
  if (device.type == DeviceType::kCPU) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

namespace {

// The strides to hand to the pointer constructor: null for "contiguous", checked against the
// shape before anything reads them.
const int64_t* checked_strides(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides) {
  if (strides.size() == 0) return nullptr;
  if (strides.size() != shape.size())
    throw InvalidArgument("[TensorView] strides must have one entry per dimension, got " +
                          std::to_string(strides.size()) + " for " + std::to_string(shape.size()) +
                          " dimensions");
  return strides.begin();
}

}  // namespace

TensorView::TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
                       std::initializer_list<int64_t> strides)
    : TensorView(data, dtype, device, static_cast<int>(shape.size()), shape.begin(), checked_strides(shape, strides)) {}

TensorView::TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
                       const int64_t* strides)
    : data_(data), dtype_(dtype), device_(device), ndim_(ndim) {
  if (ndim < 0 || ndim > kMaxDims)
    throw InvalidArgument("[TensorView] ndim must be in [0, " + std::to_string(kMaxDims) +
                          "], got " + std::to_string(ndim));
  int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] < 0)
      throw InvalidArgument("[TensorView] sizes must be >= 0, got " + std::to_string(shape[d]) +
                            " in dimension " + std::to_string(d));
    shape_[d] = shape[d];
    strides_[d] = strides ? strides[d] : running;
    running *= shape[d];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t running = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != running) return false;
    running *= shape_[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream s;
  s << '(';
  for (int d = 0; d < ndim_; ++d) s << (d ? ", " : "") << shape_[d];
  if (ndim_ == 1) s << ',';
  s << ')';
  return s.str();
}

}  // namespace ringflash
