// The CUDA status check (a DeviceError naming the call and CUDA's own words) and the device guard.
#pragma once

#include <cuda_runtime.h>

#include "../../core/check.h"

#define RINGFLASH_CUDA_CHECK(call)                                                                     \
  do {                                                                                                 \
    const cudaError_t ringflash_cuda_rc_ = (call);                                                     \
    RINGFLASH_CHECK(ringflash_cuda_rc_ == cudaSuccess, DeviceError, "[cuda] ", #call, " failed: ",    \
                    cudaGetErrorName(ringflash_cuda_rc_), ": ", cudaGetErrorString(ringflash_cuda_rc_)); \
  } while (0)

namespace ringflash::cuda {

// Makes `device` current for the guard's lifetime (nothing for a negative one).
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    RINGFLASH_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous == device) previous = -1;
    else RINGFLASH_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// The same for destructors and other paths that may not throw: a device that cannot be made
// current is left as it is.
struct QuietDeviceGuard {
  int previous = -1;
  explicit QuietDeviceGuard(int device) noexcept {
    int current = -1;
    if (device < 0 || cudaGetDevice(&current) != cudaSuccess || current == device) return;
    if (cudaSetDevice(device) == cudaSuccess) previous = current;
  }
  ~QuietDeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;
};

}  // namespace ringflash::cuda
