// The CUDA status check: a DeviceError naming the call and CUDA's own words.
#pragma once

#include <cuda_runtime.h>

#include "../../core/check.h"

#define RINGFLASH_CUDA_CHECK(call)                                                                     \
  do {                                                                                                 \
    const cudaError_t ringflash_cuda_rc_ = (call);                                                     \
    RINGFLASH_CHECK(ringflash_cuda_rc_ == cudaSuccess, DeviceError, "[cuda] ", #call, " failed: ",    \
                    cudaGetErrorName(ringflash_cuda_rc_), ": ", cudaGetErrorString(ringflash_cuda_rc_)); \
  } while (0)
