// kernels/ops.h on CUDA: elementwise kernels over folded strided views, uploads of host bytes
// passed as kernel parameters, and stream-ordered workspace memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "../../core/backends.h"
#include "check.h"

namespace ringflash::cuda {
namespace {

using core::ElementwiseArgs;
using core::ElementwiseOp;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

using Offsets = core::ElementwiseOffsets;

// Element offsets in dst, src and src2 of the i-th element, dimensions in row-major order.
__device__ __forceinline__ Offsets offsets(const ElementwiseArgs& a, int64_t i) {
  Offsets at;
  for (int d = a.ndim - 1; d >= 0; --d) {
    const int64_t size = a.size[d];
    const int64_t q = d > 0 ? i / size : 0;
    const int64_t r = i - q * size;
    at.dst += r * a.dst_stride[d];
    at.src += r * a.src_stride[d];
    at.src2 += r * a.src2_stride[d];
    i = q;
  }
  return at;
}

// One element: kFill (src and src2 unused: null), kCopy with conversion (src2 unused), kAdd
// (S = float, src2 float, the sum rounded once to D).
template <ElementwiseOp kOp, typename S, typename D>
__device__ __forceinline__ void apply(const ElementwiseArgs& a, D& dst, const S* src, const float* src2) {
  if constexpr (kOp == ElementwiseOp::kFill) {
    dst = from_float<D>(a.value);
  } else if constexpr (kOp == ElementwiseOp::kAdd) {
    dst = from_float<D>(*src + *src2);
  } else if constexpr (std::is_same_v<S, D>) {
    dst = *src;
  } else {
    dst = from_float<D>(load_float(src));
  }
}

// Elements per thread and step of the contiguous kernel.
constexpr int kVec = 8;

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Any folded views: one element per thread and step.
template <ElementwiseOp kOp, typename S, typename D>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const ElementwiseArgs a) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  D* dst = static_cast<D*>(a.dst);
  const S* src = static_cast<const S*>(a.src);
  const float* src2 = static_cast<const float*>(a.src2);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < a.numel; i += step) {
    const Offsets at = offsets(a, i);
    apply<kOp>(a, dst[at.dst], src ? src + at.src : nullptr, src2 ? src2 + at.src2 : nullptr);
  }
}

// Contiguous views with Pack-aligned starts: kVec elements per thread and step, in whole-pack
// loads and stores (one element per thread ran the copies at a third of the memory bandwidth).
template <ElementwiseOp kOp, typename S, typename D>
__global__ void __launch_bounds__(kThreads) contiguous_kernel(const ElementwiseArgs a) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  auto* dst = static_cast<Pack<D>*>(a.dst);
  const auto* src = static_cast<const Pack<S>*>(a.src);
  const auto* src2 = static_cast<const Pack<float>*>(a.src2);
  const int64_t packs = a.numel / kVec;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < packs; i += step) {
    Pack<S> in;
    Pack<float> in2;
    if constexpr (kOp != ElementwiseOp::kFill) in = src[i];
    if constexpr (kOp == ElementwiseOp::kAdd) in2 = src2[i];
    Pack<D> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) apply<kOp>(a, out.v[j], in.v + j, in2.v + j);
    dst[i] = out;
  }
  // The last numel % kVec elements: one per thread of the first block.
  const int64_t tail = packs * kVec + (blockIdx.x == 0 ? threadIdx.x : kVec);
  const S* last = static_cast<const S*>(a.src);
  const float* last2 = static_cast<const float*>(a.src2);
  if (tail < a.numel)
    apply<kOp>(a, static_cast<D*>(a.dst)[tail], last ? last + tail : nullptr, last2 ? last2 + tail : nullptr);
}

// Views whose rows (the innermost dimension) are contiguous in every view and whole packs long,
// with Pack-aligned starts and row strides, such as a slice of heads: `a` counted in packs, the
// offsets of one pack per thread and step (the general kernel's index arithmetic, once for kVec
// elements) and whole-pack loads and stores. Its body repeats contiguous_kernel's: with the pack's
// work in a shared helper, ptxas compiled contiguous_kernel (measured as it is) to a third of its
// instructions, fewer loads in flight.
template <ElementwiseOp kOp, typename S, typename D>
__global__ void __launch_bounds__(kThreads) rows_kernel(const ElementwiseArgs a) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  auto* dst = static_cast<Pack<D>*>(a.dst);
  const auto* src = static_cast<const Pack<S>*>(a.src);
  const auto* src2 = static_cast<const Pack<float>*>(a.src2);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < a.numel; i += step) {
    const Offsets at = offsets(a, i);
    Pack<S> in;
    Pack<float> in2;
    if constexpr (kOp != ElementwiseOp::kFill) in = src[at.src];
    if constexpr (kOp == ElementwiseOp::kAdd) in2 = src2[at.src2];
    Pack<D> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) apply<kOp>(a, out.v[j], in.v + j, in2.v + j);
    dst[at.dst] = out;
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// `a` counted in packs for rows_kernel, if its views qualify.
template <ElementwiseOp kOp, typename S, typename D>
bool in_packs(const ElementwiseArgs& a, ElementwiseArgs* packs) {
  const int inner = a.ndim - 1;
  if (a.ndim < 2 || a.size[inner] % kVec != 0) return false;
  const auto rows = [&](const int64_t* stride, const void* data, size_t pack_bytes) {
    if (stride[inner] != 1 || !aligned(data, pack_bytes)) return false;
    for (int d = 0; d < inner; ++d)
      if (stride[d] % kVec != 0) return false;
    return true;
  };
  if (!rows(a.dst_stride, a.dst, sizeof(Pack<D>))) return false;
  if (kOp != ElementwiseOp::kFill && !rows(a.src_stride, a.src, sizeof(Pack<S>))) return false;
  if (kOp == ElementwiseOp::kAdd && !rows(a.src2_stride, a.src2, sizeof(Pack<float>))) return false;
  *packs = a;
  packs->numel = a.numel / kVec;
  packs->size[inner] = a.size[inner] / kVec;
  for (int d = 0; d < inner; ++d) {
    packs->dst_stride[d] /= kVec;
    packs->src_stride[d] /= kVec;
    packs->src2_stride[d] /= kVec;
  }
  return true;
}

template <ElementwiseOp kOp, typename S, typename D>
void launch(const ElementwiseArgs& a) {
  const bool sources = kOp == ElementwiseOp::kFill || (a.src_stride[0] == 1 && aligned(a.src, sizeof(Pack<S>)));
  const bool second = kOp != ElementwiseOp::kAdd || (a.src2_stride[0] == 1 && aligned(a.src2, sizeof(Pack<float>)));
  const bool contiguous = a.ndim == 1 && a.dst_stride[0] == 1 && aligned(a.dst, sizeof(Pack<D>)) && sources && second;
  const auto run = [&](auto kernel, const ElementwiseArgs& args, int64_t per_block) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((args.numel + per_block - 1) / per_block, kMaxBlocks));
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(args);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  };
  ElementwiseArgs packs;
  if (contiguous) run(contiguous_kernel<kOp, S, D>, a, int64_t{kThreads} * kVec);
  else if (in_packs<kOp, S, D>(a, &packs)) run(rows_kernel<kOp, S, D>, packs, kThreads);
  else run(elementwise_kernel<kOp, S, D>, a, kThreads);
}

// Calls fn(T{}) for the storage type of a float dtype.
template <typename Fn>
void with_float(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(__half{});
    default: return fn(__nv_bfloat16{});
  }
}

// An unsigned type of `size` bytes.
template <typename Fn>
void with_bits(size_t size, Fn&& fn) {
  switch (size) {
    case 2: return fn(uint16_t{});
    case 4: return fn(uint32_t{});
    default: return fn(uint64_t{});
  }
}

// Bytes handed to the upload kernel as its parameter.
constexpr size_t kUploadChunk = 2048;
struct UploadChunk {
  unsigned char bytes[kUploadChunk];
};

__global__ void upload_kernel(const UploadChunk chunk, unsigned char* dst, unsigned n) {
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) dst[i] = chunk.bytes[i];
}

// A pool per device that keeps freed memory for the next call, made on first use.
constexpr int kMaxDevices = 64;
std::mutex pools_mutex;
cudaMemPool_t pools[kMaxDevices] = {};

cudaMemPool_t pool(int device) {
  RINGFLASH_CHECK(device >= 0 && device < kMaxDevices, InvalidArgument, "[Workspace] CUDA device index must be in [0, ",
                  kMaxDevices, "), got ", device);
  std::lock_guard<std::mutex> lock(pools_mutex);
  if (!pools[device]) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    RINGFLASH_CUDA_CHECK(cudaMemPoolCreate(&pools[device], &props));
    uint64_t keep = UINT64_MAX;
    RINGFLASH_CUDA_CHECK(cudaMemPoolSetAttribute(pools[device], cudaMemPoolAttrReleaseThreshold, &keep));
  }
  return pools[device];
}

// Gives the memory that the device's pool keeps unused back to the device. The device is
// synchronised first: a block freed stream-ordered counts as in use until the host has seen its
// free complete.
void trim(int device) {
  DeviceGuard guard(device);
  RINGFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  RINGFLASH_CUDA_CHECK(cudaMemPoolTrimTo(pool(device), 0));
}

}  // namespace

void elementwise(const ElementwiseArgs& a) {
  DeviceGuard guard(a.device);
  switch (a.op) {
    case ElementwiseOp::kFill:
      // Zeros in a contiguous view (all bits zero in every float dtype): a memset.
      if (a.value == 0.0f && !std::signbit(a.value) && a.ndim == 1 && a.dst_stride[0] == 1) {
        RINGFLASH_CUDA_CHECK(cudaMemsetAsync(a.dst, 0, static_cast<size_t>(a.numel) * dtype_size(a.dst_dtype),
                                             static_cast<cudaStream_t>(a.stream)));
        return;
      }
      return with_float(a.dst_dtype, [&](auto d) { launch<ElementwiseOp::kFill, decltype(d), decltype(d)>(a); });
    case ElementwiseOp::kAdd:
      return with_float(a.dst_dtype, [&](auto d) { launch<ElementwiseOp::kAdd, float, decltype(d)>(a); });
    case ElementwiseOp::kCopy:
      if (a.src_dtype == a.dst_dtype)
        return with_bits(dtype_size(a.dst_dtype),
                         [&](auto t) { launch<ElementwiseOp::kCopy, decltype(t), decltype(t)>(a); });
      return with_float(a.src_dtype, [&](auto s) {
        with_float(a.dst_dtype, [&](auto d) { launch<ElementwiseOp::kCopy, decltype(s), decltype(d)>(a); });
      });
  }
}

void upload(const void* src, size_t bytes, void* dst, int device, void* stream) {
  DeviceGuard guard(device);
  for (size_t done = 0; done < bytes; done += kUploadChunk) {
    UploadChunk chunk;
    const size_t n = std::min(kUploadChunk, bytes - done);
    std::memcpy(chunk.bytes, static_cast<const unsigned char*>(src) + done, n);
    upload_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(chunk, static_cast<unsigned char*>(dst) + done,
                                                                          static_cast<unsigned>(n));
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  }
}

bool capturing(int device, void* stream) {
  DeviceGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  RINGFLASH_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

// Outside capture from ringflash's pool; while capturing, from the device's default pool, whose
// allocations a graph records as memory nodes. When the pool cannot grow, it gives back what it
// keeps unused and tries once more, so that memory held from an earlier, larger call does not make
// this one fail.
void* allocate(int device, size_t bytes, void* stream) {
  DeviceGuard guard(device);
  void* data = nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (capturing(device, stream)) {
    RINGFLASH_CUDA_CHECK(cudaMallocAsync(&data, bytes, s));
    return data;
  }
  cudaError_t rc = cudaMallocFromPoolAsync(&data, bytes, pool(device), s);
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: clear it, then retry after the trim
    trim(device);
    rc = cudaMallocFromPoolAsync(&data, bytes, pool(device), s);
  }
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    size_t free = 0, total = 0;
    RINGFLASH_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    throw DeviceError(core::str_cat("[Workspace] out of memory on CUDA device ", device, ": needs ", bytes,
                                    " bytes, ", free, " of ", total, " free (ringflash's pool keeps none unused)"));
  }
  RINGFLASH_CUDA_CHECK(rc);
  return data;
}

// Only devices that have a pool: those ringflash has allocated on (none on a machine without GPUs).
void release_unused() {
  for (int device = 0; device < kMaxDevices; ++device) {
    bool made;
    {
      std::lock_guard<std::mutex> lock(pools_mutex);
      made = pools[device] != nullptr;
    }
    if (made) trim(device);
  }
}

void release(int device, void* data, void* stream) noexcept {
  const QuietDeviceGuard guard(device);
  cudaFreeAsync(data, static_cast<cudaStream_t>(stream));
}

}  // namespace ringflash::cuda
