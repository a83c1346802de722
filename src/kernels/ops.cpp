// kernels/ops.h: validation and dimension folding, the CPU loops, and dispatch to CUDA.
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "../core/backends.h"
#include "../core/check.h"
#include "common/elementwise.h"
#include "cpu/vec.h"

namespace ringflash::kernels {
namespace {

using core::ElementwiseArgs;
using core::ElementwiseOp;

const char* op_name(ElementwiseOp op) {
  switch (op) {
    case ElementwiseOp::kFill: return "fill";
    case ElementwiseOp::kCopy: return "copy";
    case ElementwiseOp::kAdd: return "add";
  }
  return "elementwise";
}

// The arguments for `dst` (and `src`, unless null), with size-1 dimensions dropped and neighbours
// that are contiguous in both views merged.
ElementwiseArgs fold(ElementwiseOp op, const TensorView& dst, const TensorView* src, void* stream) {
  const char* name = op_name(op);
  ElementwiseArgs a;
  a.op = op;
  a.dst = dst.data();
  a.dst_dtype = dst.dtype();
  a.stream = stream;
  a.device = dst.device().index;
  a.numel = dst.numel();
  if (src) {
    bool same = src->ndim() == dst.ndim();
    for (int d = 0; same && d < dst.ndim(); ++d) same = src->size(d) == dst.size(d);
    RINGFLASH_CHECK(same, InvalidArgument, "[", name, "] src must have dst's shape ", dst.shape_string(), ", got ",
                    src->shape_string());
    RINGFLASH_CHECK(src->device() == dst.device(), InvalidArgument, "[", name, "] src must be on ",
                    device_name(dst.device()), " like dst, got ", device_name(src->device()));
    a.src = src->data();
    a.src_dtype = src->dtype();
  }
  RINGFLASH_CHECK(a.numel == 0 || a.dst, InvalidArgument, "[", name, "] dst must not be null for ", a.numel,
                  " elements");
  RINGFLASH_CHECK(a.numel == 0 || !src || a.src, InvalidArgument, "[", name, "] src must not be null for ", a.numel,
                  " elements");
  for (int d = 0; d < dst.ndim(); ++d) {
    if (dst.size(d) == 1) continue;
    const int64_t ss = src ? src->stride(d) : 0;
    if (a.ndim > 0) {
      const int last = a.ndim - 1;
      const bool merges = a.dst_stride[last] == dst.stride(d) * dst.size(d) &&
                          (!src || a.src_stride[last] == ss * dst.size(d));
      if (merges) {
        a.size[last] *= dst.size(d);
        a.dst_stride[last] = dst.stride(d);
        a.src_stride[last] = ss;
        continue;
      }
    }
    a.size[a.ndim] = dst.size(d);
    a.dst_stride[a.ndim] = dst.stride(d);
    a.src_stride[a.ndim] = ss;
    ++a.ndim;
  }
  return a;
}

// ---- CPU ----------------------------------------------------------------------------------

// Calls fn(dst element offset, src element offset, n) for each innermost run of n elements of a
// non-empty view (run() returns before empty ones).
template <typename Fn>
void for_each_run(const ElementwiseArgs& a, Fn&& fn) {
  if (a.ndim == 0) return fn(int64_t{0}, int64_t{0}, int64_t{1});
  const int last = a.ndim - 1;
  int64_t index[TensorView::kMaxDims] = {};
  for (;;) {
    int64_t dst = 0, src = 0;
    for (int d = 0; d < last; ++d) {
      dst += index[d] * a.dst_stride[d];
      src += index[d] * a.src_stride[d];
    }
    fn(dst, src, a.size[last]);
    int d = last - 1;
    for (; d >= 0; --d) {
      if (++index[d] < a.size[d]) break;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

template <typename T>
void fill_cpu(const ElementwiseArgs& a) {
  const T x = cpu::from_float<T>(a.value);
  T* base = static_cast<T*>(a.dst);
  const int64_t step = a.ndim ? a.dst_stride[a.ndim - 1] : 1;
  for_each_run(a, [&](int64_t dst, int64_t, int64_t n) {
    for (int64_t i = 0; i < n; ++i) base[dst + i * step] = x;
  });
}

template <typename S, typename D>
void convert_cpu(const ElementwiseArgs& a) {
  const S* src = static_cast<const S*>(a.src);
  D* dst = static_cast<D*>(a.dst);
  const int64_t ds = a.ndim ? a.dst_stride[a.ndim - 1] : 1, ss = a.ndim ? a.src_stride[a.ndim - 1] : 1;
  for_each_run(a, [&](int64_t d, int64_t s, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = cpu::to_float(src[s + i * ss]);
      if (a.op == ElementwiseOp::kAdd) dst[d + i * ds] = cpu::from_float<D>(cpu::to_float(dst[d + i * ds]) + x);
      else dst[d + i * ds] = cpu::from_float<D>(x);
    }
  });
}

template <typename S>
void convert_from(const ElementwiseArgs& a) {
  switch (a.dst_dtype) {
    case DType::kFloat32: return convert_cpu<S, float>(a);
    case DType::kFloat16: return convert_cpu<S, _Float16>(a);
    default: return convert_cpu<S, cpu::BFloat16>(a);
  }
}

void bit_copy_cpu(const ElementwiseArgs& a) {
  const size_t size = dtype_size(a.dst_dtype);
  auto* dst = static_cast<unsigned char*>(a.dst);
  const auto* src = static_cast<const unsigned char*>(a.src);
  const int64_t ds = a.ndim ? a.dst_stride[a.ndim - 1] : 1, ss = a.ndim ? a.src_stride[a.ndim - 1] : 1;
  for_each_run(a, [&](int64_t d, int64_t s, int64_t n) {
    if (ds == 1 && ss == 1) {
      std::memcpy(dst + d * size, src + s * size, static_cast<size_t>(n) * size);
      return;
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + (d + i * ds) * size, src + (s + i * ss) * size, size);
  });
}

void run_cpu(const ElementwiseArgs& a) {
  if (a.op == ElementwiseOp::kFill) {
    switch (a.dst_dtype) {
      case DType::kFloat32: return fill_cpu<float>(a);
      case DType::kFloat16: return fill_cpu<_Float16>(a);
      default: return fill_cpu<cpu::BFloat16>(a);
    }
  }
  if (a.op == ElementwiseOp::kCopy && a.src_dtype == a.dst_dtype) return bit_copy_cpu(a);
  switch (a.src_dtype) {
    case DType::kFloat32: return convert_from<float>(a);
    case DType::kFloat16: return convert_from<_Float16>(a);
    default: return convert_from<cpu::BFloat16>(a);
  }
}

void run(const ElementwiseArgs& a, Device device) {
  if (a.numel == 0) return;
  if (device.type == DeviceType::kCUDA) return cuda::elementwise(a);
  run_cpu(a);
}

}  // namespace

void fill(const TensorView& dst, float value, void* stream) {
  RINGFLASH_CHECK(is_float(dst.dtype()), InvalidArgument,
                  "[fill] dst must have dtype float32, float16 or bfloat16, got ", dtype_name(dst.dtype()));
  ElementwiseArgs a = fold(ElementwiseOp::kFill, dst, nullptr, stream);
  a.value = value;
  run(a, dst.device());
}

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  RINGFLASH_CHECK(src.dtype() == dst.dtype() || (is_float(src.dtype()) && is_float(dst.dtype())), InvalidArgument,
                  "[copy] src and dst must have one dtype, or both float dtypes, got ", dtype_name(src.dtype()),
                  " and ", dtype_name(dst.dtype()));
  run(fold(ElementwiseOp::kCopy, dst, &src, stream), dst.device());
}

void add(const TensorView& src, const TensorView& dst, void* stream) {
  RINGFLASH_CHECK(src.dtype() == DType::kFloat32 && dst.dtype() == DType::kFloat32, InvalidArgument,
                  "[add] src and dst must have dtype float32, got ", dtype_name(src.dtype()), " and ",
                  dtype_name(dst.dtype()));
  run(fold(ElementwiseOp::kAdd, dst, &src, stream), dst.device());
}

void upload(const void* src, size_t bytes, void* dst, Device device, void* stream) {
  if (bytes == 0) return;
  RINGFLASH_CHECK(src && dst, InvalidArgument, "[upload] src and dst must not be null for ", bytes, " bytes");
  if (device.type == DeviceType::kCUDA) return cuda::upload(src, bytes, dst, device.index, stream);
  std::memcpy(dst, src, bytes);
}

bool capturing(Device device, void* stream) {
  return device.type == DeviceType::kCUDA && cuda::capturing(device.index, stream);
}

Workspace::Workspace(Device device, size_t bytes, void* stream) : device_(device), bytes_(bytes), stream_(stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCUDA) {
    data_ = static_cast<unsigned char*>(cuda::allocate(device.index, bytes, stream));
  } else {
    data_ = static_cast<unsigned char*>(::operator new(bytes, std::align_val_t{WorkspaceLayout::kAlignment}));
  }
}

Workspace::~Workspace() { release(); }

Workspace::Workspace(Workspace&& other) noexcept { *this = std::move(other); }

Workspace& Workspace::operator=(Workspace&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = other.stream_;
  }
  return *this;
}

void Workspace::release() noexcept {
  if (!data_) return;
  if (device_.type == DeviceType::kCUDA) cuda::release(device_.index, data_, stream_);
  else ::operator delete(data_, std::align_val_t{WorkspaceLayout::kAlignment});
  data_ = nullptr;
}

}  // namespace ringflash::kernels
