// Lets a function be compiled for host and device alike.
#pragma once

#if defined(__CUDACC__)
#define RINGFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RINGFLASH_HOST_DEVICE inline
#endif
