// Host-side launchers, one template per kernel family. Only the generated instance files
// (instances/*.cu) include this header; everything else sees the extern declarations in
// instances.h.
#pragma once

#include <cuda_runtime.h>

#include "backward.cuh"
#include "check.h"
#include "forward.cuh"
#include "instances.h"

namespace ringflash::cuda {

inline unsigned blocks_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// Raises a kernel's dynamic shared-memory limit; cheap, and allowed during graph capture.
template <typename Kernel>
void allow_smem(Kernel kernel, int bytes) {
  RINGFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename T, int kHeadDim>
void run_forward(const Params& p, cudaStream_t stream) {
  using F = Forward<T, kHeadDim>;
  allow_smem(forward_kernel<T, kHeadDim>, F::kSmemBytes);
  const dim3 grid(blocks_for(p.max_rows_q, F::kBlockM), static_cast<unsigned>(p.a.heads_q),
                  static_cast<unsigned>(p.a.batch));
  forward_kernel<T, kHeadDim><<<grid, F::kThreads, F::kSmemBytes, stream>>>(p);
  RINGFLASH_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int kHeadDim>
void run_backward(const Params& p, int64_t total_rows, cudaStream_t stream) {
  using B = Backward<T, kHeadDim>;
  using D = DqPass<T, kHeadDim>;
  constexpr int kThreads = 256;
  const int64_t row_heads = total_rows * p.a.heads_q;
  if (p.a.out_dtype == DType::kFloat32)
    dot_do_o_kernel<T, float, kHeadDim><<<blocks_for(row_heads, kThreads), kThreads, 0, stream>>>(p, total_rows);
  else
    dot_do_o_kernel<T, T, kHeadDim><<<blocks_for(row_heads, kThreads), kThreads, 0, stream>>>(p, total_rows);
  RINGFLASH_CUDA_CHECK(cudaGetLastError());

  allow_smem(backward_kernel<T, kHeadDim>, B::kSmemBytes);
  const dim3 grid(blocks_for(p.max_rows_k, B::kBlockN) * B::kTiles.dim_parts, static_cast<unsigned>(p.a.heads_kv),
                  static_cast<unsigned>(p.a.batch));
  backward_kernel<T, kHeadDim><<<grid, B::kThreads, B::kSmemBytes, stream>>>(p);
  RINGFLASH_CUDA_CHECK(cudaGetLastError());

  if (p.deterministic) {
    allow_smem(dq_kernel<T, kHeadDim>, D::kSmemBytes);
    const dim3 dq_grid(blocks_for(p.max_rows_q, D::kBlockM), static_cast<unsigned>(p.a.heads_q),
                       static_cast<unsigned>(p.a.batch));
    dq_kernel<T, kHeadDim><<<dq_grid, D::kThreads, D::kSmemBytes, stream>>>(p);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  } else if (!p.dq_in_place) {
    convert_dq_kernel<T, kHeadDim><<<blocks_for(row_heads * (p.a.head_dim / 8), kThreads), kThreads, 0, stream>>>(
        p, total_rows);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace ringflash::cuda
