// Data movement for the strategies, on the device of the tensors: loops on the CPU, kernels
// enqueued on `stream` (a cudaStream_t; ignored on the CPU) on CUDA, where the host never waits.
//
// Views may have any strides and up to TensorView::kMaxDims dimensions; the views of one call
// have the same shape and device. Errors are InvalidArgument naming the op and the argument.
#pragma once

#include <cstddef>
#include <memory>

#include "ringflash/tensor.h"

namespace ringflash::kernels {

// Every element of `dst` (float32, float16 or bfloat16) set to `value`.
void fill(const TensorView& dst, float value, void* stream);

// dst = src. The same dtype is a bit copy (any dtype); float dtypes convert, rounding to nearest
// even. The views must not overlap.
void copy(const TensorView& src, const TensorView& dst, void* stream);

// dst += src, both float32. The views must not overlap.
void add(const TensorView& src, const TensorView& dst, void* stream);

// dst = a + b: a and b float32, dst float32, float16 or bfloat16 (the sum rounded once, to
// nearest even). dst may be b itself (the same view); the views must not overlap otherwise.
void add(const TensorView& a, const TensorView& b, const TensorView& dst, void* stream);

// `bytes` bytes from host memory `src` to `dst` on `device`. The bytes are taken at the call: `src`
// may change at once, and a CUDA graph that captured the call replays the same bytes.
void upload(const void* src, size_t bytes, void* dst, Device device, void* stream);

// Whether `stream` on `device` is being captured into a CUDA graph (never on the CPU).
bool capturing(Device device, void* stream);

// One call's scratch memory: a single allocation, made by the constructor and released by the
// destructor. On CUDA both are stream-ordered on `stream` (from a pool that keeps its memory), so
// work enqueued on `stream` before the destructor may still use it, and a CUDA graph can capture
// both. The memory is not initialised.
class Workspace {
 public:
  Workspace() = default;
  Workspace(Device device, size_t bytes, void* stream);
  ~Workspace();
  Workspace(Workspace&& other) noexcept;
  Workspace& operator=(Workspace&& other) noexcept;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  unsigned char* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void release() noexcept;

  Device device_{};
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
  void* stream_ = nullptr;
};

// Places pieces in one workspace, each at a 256-byte boundary: offsets first, then one Workspace
// of total() bytes.
class WorkspaceLayout {
 public:
  static constexpr size_t kAlignment = 256;
  // The offset of a new piece of `bytes` bytes.
  size_t add(size_t bytes) {
    const size_t offset = total_;
    total_ += (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return offset;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

}  // namespace ringflash::kernels
