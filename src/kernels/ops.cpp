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
using Offsets = core::ElementwiseOffsets;

const char* op_name(ElementwiseOp op) {
  switch (op) {
    case ElementwiseOp::kFill: return "fill";
    case ElementwiseOp::kCopy: return "copy";
    case ElementwiseOp::kAdd: return "add";
  }
  return "elementwise";
}

// A source of an elementwise op and the name its errors give it.
struct Source {
  const TensorView* view = nullptr;  // none when null
  const char* name = "src";
};

// The arguments for `dst` and its sources, with size-1 dimensions dropped and neighbours that are
// contiguous in every view merged.
ElementwiseArgs fold(ElementwiseOp op, const TensorView& dst, Source src, void* stream, Source src2 = {}) {
  const char* name = op_name(op);
  ElementwiseArgs a;
  a.op = op;
  a.dst = dst.data();
  a.dst_dtype = dst.dtype();
  a.stream = stream;
  a.device = dst.device().index;
  a.numel = dst.numel();
  for (const Source& from : {src, src2}) {
    if (!from.view) continue;
    const TensorView& v = *from.view;
    bool same = v.ndim() == dst.ndim();
    for (int d = 0; same && d < dst.ndim(); ++d) same = v.size(d) == dst.size(d);
    RINGFLASH_CHECK(same, InvalidArgument, "[", name, "] ", from.name, " must have dst's shape ", dst.shape_string(),
                    ", got ", v.shape_string());
    RINGFLASH_CHECK(v.device() == dst.device(), InvalidArgument, "[", name, "] ", from.name, " must be on ",
                    device_name(dst.device()), " like dst, got ", device_name(v.device()));
    RINGFLASH_CHECK(a.numel == 0 || v.data(), InvalidArgument, "[", name, "] ", from.name, " must not be null for ",
                    a.numel, " elements");
  }
  if (src.view) {
    a.src = src.view->data();
    a.src_dtype = src.view->dtype();
  }
  if (src2.view) a.src2 = src2.view->data();
  RINGFLASH_CHECK(a.numel == 0 || a.dst, InvalidArgument, "[", name, "] dst must not be null for ", a.numel,
                  " elements");
  const auto stride_of = [](const Source& from, int d) { return from.view ? from.view->stride(d) : int64_t{0}; };
  for (int d = 0; d < dst.ndim(); ++d) {
    if (dst.size(d) == 1) continue;
    const int64_t ss = stride_of(src, d), ss2 = stride_of(src2, d);
    if (a.ndim > 0) {
      const int last = a.ndim - 1;
      const int64_t n = dst.size(d);
      const bool merges = a.dst_stride[last] == dst.stride(d) * n && a.src_stride[last] == ss * n &&
                          a.src2_stride[last] == ss2 * n;
      if (merges) {
        a.size[last] *= n;
        a.dst_stride[last] = dst.stride(d);
        a.src_stride[last] = ss;
        a.src2_stride[last] = ss2;
        continue;
      }
    }
    a.size[a.ndim] = dst.size(d);
    a.dst_stride[a.ndim] = dst.stride(d);
    a.src_stride[a.ndim] = ss;
    a.src2_stride[a.ndim] = ss2;
    ++a.ndim;
  }
  return a;
}

// ---- CPU ----------------------------------------------------------------------------------

// Calls fn(Offsets, n) for each innermost run of n elements of a non-empty view (run() returns
// before empty ones).
template <typename Fn>
void for_each_run(const ElementwiseArgs& a, Fn&& fn) {
  if (a.ndim == 0) return fn(Offsets{}, int64_t{1});
  const int last = a.ndim - 1;
  int64_t index[TensorView::kMaxDims] = {};
  for (;;) {
    Offsets at;
    for (int d = 0; d < last; ++d) {
      at.dst += index[d] * a.dst_stride[d];
      at.src += index[d] * a.src_stride[d];
      at.src2 += index[d] * a.src2_stride[d];
    }
    fn(at, a.size[last]);
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
  for_each_run(a, [&](Offsets at, int64_t n) {
    for (int64_t i = 0; i < n; ++i) base[at.dst + i * step] = x;
  });
}

template <typename S, typename D>
void convert_cpu(const ElementwiseArgs& a) {
  const S* src = static_cast<const S*>(a.src);
  D* dst = static_cast<D*>(a.dst);
  const int64_t ds = a.ndim ? a.dst_stride[a.ndim - 1] : 1, ss = a.ndim ? a.src_stride[a.ndim - 1] : 1;
  for_each_run(a, [&](Offsets at, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[at.dst + i * ds] = cpu::from_float<D>(cpu::to_float(src[at.src + i * ss]));
  });
}

// kAdd: src and src2 are float32; the sum is rounded once, to dst's dtype.
template <typename D>
void add_cpu(const ElementwiseArgs& a) {
  const auto* src = static_cast<const float*>(a.src);
  const auto* src2 = static_cast<const float*>(a.src2);
  D* dst = static_cast<D*>(a.dst);
  const int last = a.ndim - 1;
  const int64_t ds = a.ndim ? a.dst_stride[last] : 1, ss = a.ndim ? a.src_stride[last] : 1;
  const int64_t ss2 = a.ndim ? a.src2_stride[last] : 1;
  for_each_run(a, [&](Offsets at, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      dst[at.dst + i * ds] = cpu::from_float<D>(src[at.src + i * ss] + src2[at.src2 + i * ss2]);
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
  for_each_run(a, [&](Offsets at, int64_t n) {
    if (ds == 1 && ss == 1) {
      std::memcpy(dst + at.dst * size, src + at.src * size, static_cast<size_t>(n) * size);
      return;
    }
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dst + (at.dst + i * ds) * size, src + (at.src + i * ss) * size, size);
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
  if (a.op == ElementwiseOp::kAdd) {
    switch (a.dst_dtype) {
      case DType::kFloat32: return add_cpu<float>(a);
      case DType::kFloat16: return add_cpu<_Float16>(a);
      default: return add_cpu<cpu::BFloat16>(a);
    }
  }
  if (a.src_dtype == a.dst_dtype) return bit_copy_cpu(a);
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
  ElementwiseArgs a = fold(ElementwiseOp::kFill, dst, {}, stream);
  a.value = value;
  run(a, dst.device());
}

void copy(const TensorView& src, const TensorView& dst, void* stream) {
  RINGFLASH_CHECK(src.dtype() == dst.dtype() || (is_float(src.dtype()) && is_float(dst.dtype())), InvalidArgument,
                  "[copy] src and dst must have one dtype, or both float dtypes, got ", dtype_name(src.dtype()),
                  " and ", dtype_name(dst.dtype()));
  run(fold(ElementwiseOp::kCopy, dst, {&src}, stream), dst.device());
}

void add(const TensorView& src, const TensorView& dst, void* stream) {
  RINGFLASH_CHECK(src.dtype() == DType::kFloat32 && dst.dtype() == DType::kFloat32, InvalidArgument,
                  "[add] src and dst must have dtype float32, got ", dtype_name(src.dtype()), " and ",
                  dtype_name(dst.dtype()));
  run(fold(ElementwiseOp::kAdd, dst, {&src}, stream, {&dst, "dst"}), dst.device());
}

void add(const TensorView& a, const TensorView& b, const TensorView& dst, void* stream) {
  RINGFLASH_CHECK(a.dtype() == DType::kFloat32 && b.dtype() == DType::kFloat32 && is_float(dst.dtype()),
                  InvalidArgument, "[add] a and b must have dtype float32 and dst a float dtype, got ",
                  dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " and ", dtype_name(dst.dtype()));
  run(fold(ElementwiseOp::kAdd, dst, {&a, "a"}, stream, {&b, "b"}), dst.device());
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
