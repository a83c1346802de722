// Host-side launchers, one template per kernel family. Only the generated instance files
// (instances/*.cu) include this header; everything else sees the extern declarations in
// instances.h.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backward.cuh"
#include "check.h"
#include "forward.cuh"
#include "instances.h"

namespace ringflash::cuda {

inline unsigned blocks_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// The current device's SM count.
inline int sm_count() {
  int device = 0, sms = 0;
  RINGFLASH_CUDA_CHECK(cudaGetDevice(&device));
  RINGFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), with `overlap` under programmatic
// stream serialization: its blocks may then start once every block of the kernel before it on the
// stream has run griddepcontrol.launch_dependents (or ended), and it must run griddepcontrol.wait
// before it reads what that kernel writes, and before it ends.
template <typename... Expected, typename... Actual>
void launch_overlapped(bool overlap, void (*kernel)(Expected...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Actual&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (overlap) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  RINGFLASH_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Actual>(args)...));
}

// Raises a kernel's dynamic shared-memory limit; cheap, and allowed during graph capture. A device
// with less shared memory per block than the kernel needs (sm_86/sm_89 have 99 KB) gets a
// NotSupported naming both figures.
template <typename Kernel>
void allow_smem(Kernel kernel, int bytes, const char* name, int head_dim) {
  int device = 0, limit = 0;
  RINGFLASH_CUDA_CHECK(cudaGetDevice(&device));
  RINGFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  RINGFLASH_CHECK(bytes <= limit, NotSupported, "[cuda] the ", name, " kernel for head dim ", head_dim, " needs ",
                  bytes, " bytes of shared memory per block; device ", device, " allows ", limit);
  RINGFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Packed batches: zeros of type T (and lse = -inf) in the rows that belong to no sequence.
template <typename T>
void zero_unused_rows(const core::AttentionArgs& a, const core::AttentionArgs::Operand& o, float* lse,
                      const int32_t* cu_seqlens, int64_t rows, int64_t heads, cudaStream_t stream) {
  if (!cu_seqlens || rows == 0) return;
  constexpr int kThreads = 256;
  clear_unused_rows_kernel<T><<<blocks_for(rows * heads, kThreads), kThreads, 0, stream>>>(
      o, lse, a.lse_head_stride, cu_seqlens, a.batch, rows, heads, static_cast<int>(a.head_dim));
  RINGFLASH_CUDA_CHECK(cudaGetLastError());
}

// The same for an output the call writes rather than adds to: every output without accumulate.
template <typename T>
void clear_unused_rows(const core::AttentionArgs& a, const core::AttentionArgs::Operand& o, float* lse,
                       const int32_t* cu_seqlens, int64_t rows, int64_t heads, cudaStream_t stream) {
  if (!a.accumulate) zero_unused_rows<T>(a, o, lse, cu_seqlens, rows, heads, stream);
}

// The forward's outputs, as clear_unused_rows: out and lse without accumulate; in accumulate mode
// final_out (write_final), and out in fp32 and lse with overwrite_out (lse alone with both).
template <typename T>
void clear_unused_output_rows(const core::AttentionArgs& a, cudaStream_t stream) {
  clear_unused_rows<T>(a, a.out, a.lse, a.cu_seqlens_q, a.rows_q, a.heads_q, stream);
  if (!a.accumulate) return;
  float* lse = a.overwrite_out ? a.lse : nullptr;
  if (a.write_final) zero_unused_rows<T>(a, a.final_out, lse, a.cu_seqlens_q, a.rows_q, a.heads_q, stream);
  else if (a.overwrite_out) zero_unused_rows<float>(a, a.out, lse, a.cu_seqlens_q, a.rows_q, a.heads_q, stream);
}

template <typename T, int kHeadDim>
void run_forward(const Params& p, cudaStream_t stream) {
  using F = Forward<T, kHeadDim>;
  allow_smem(forward_kernel<T, kHeadDim>, F::kSmemBytes, "forward", kHeadDim);
  const dim3 grid(blocks_for(p.max_rows_q, F::kBlockM), static_cast<unsigned>(p.a.heads_q),
                  static_cast<unsigned>(p.a.batch));
  if (grid.x > 0) {
    forward_kernel<T, kHeadDim><<<grid, F::kThreads, F::kSmemBytes, stream>>>(p);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  }
  clear_unused_output_rows<T>(p.a, stream);
}

// The conversion of dq's fp32 accumulator. After a kernel that counts its blocks in p.dq_done
// (`expected` per sequence and k/v head once all are in; 0: it counts none), it is launched with
// programmatic stream serialization: its blocks start on the SMs that the kernel's last blocks
// leave idle, each once its head is done, instead of after the kernel's end.
template <typename T, int kHeadDim>
void launch_convert_dq(const Params& p, int expected, cudaStream_t stream) {
  const core::AttentionArgs& a = p.a;
  const int64_t blocks = blocks_for(a.rows_q, kConvertRows) * a.heads_q * (a.cu_seqlens_q ? 1 : a.batch);
  RINGFLASH_CHECK(blocks <= INT32_MAX, NotSupported, "[cuda] dQ's conversion takes at most ", INT32_MAX,
                  " blocks of ", kConvertRows, " rows per head; got ", blocks);
  const int* done = expected > 0 ? p.dq_done : nullptr;
  launch_overlapped(expected > 0, convert_dq_kernel<T, kHeadDim>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0,
                    stream, p, done, expected);
}

// The passes around a backward kernel: dsum and lse2 first, then main() (the kernel that computes
// dK, dV and dQ's fp32 accumulator, or, when main_writes_dq, dQ itself; it returns what it counts
// per head in p.dq_done, or 0), then dQ (the deterministic pass, or the conversion of the
// accumulator) and the rows of no sequence.
template <typename T, int kHeadDim, typename Main>
void backward_passes(const Params& p, int64_t total_rows, cudaStream_t stream, Main&& main,
                     bool main_writes_dq = false) {
  using D = DqPass<T, kHeadDim>;
  const core::AttentionArgs& a = p.a;
  const int64_t row_heads = total_rows * a.heads_q;  // 0 when there are no queries: dK = dV = 0
  if (row_heads > 0) {
    const auto dot = a.out_dtype == DType::kFloat32 ? dot_do_o_kernel<T, float, kHeadDim> : dot_do_o_kernel<T, T, kHeadDim>;
    // is_supported holds heads and sequences to grid.y's and grid.z's limit.
    const dim3 grid(blocks_for(a.rows_q, kDotRowsPerBlock<kHeadDim>), static_cast<unsigned>(a.heads_q),
                    static_cast<unsigned>(total_rows / a.rows_q));
    dot<<<grid, kDotThreads, 0, stream>>>(p);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
  }

  const int counted = main();

  if (row_heads > 0 && main_writes_dq) {
    clear_unused_rows<T>(a, a.dq, nullptr, a.cu_seqlens_q, a.rows_q, a.heads_q, stream);  // as below
  } else if (row_heads > 0 && p.a.deterministic) {
    const dim3 dq_grid(blocks_for(p.max_rows_q, D::kBlockM), static_cast<unsigned>(a.heads_q),
                       static_cast<unsigned>(a.batch));
    allow_smem(dq_kernel<T, kHeadDim>, D::kSmemBytes, "deterministic dQ", kHeadDim);
    dq_kernel<T, kHeadDim><<<dq_grid, D::kThreads, D::kSmemBytes, stream>>>(p);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
    // The conversion pass writes every row; this one only the rows of a sequence.
    clear_unused_rows<T>(a, a.dq, nullptr, a.cu_seqlens_q, a.rows_q, a.heads_q, stream);
  } else if (row_heads > 0 && !p.dq_in_place()) {
    launch_convert_dq<T, kHeadDim>(p, counted, stream);
  }
  // dK and dV are written too in accumulate mode with overwrite_dkdv, in fp32.
  for (const core::AttentionArgs::Operand* o : {&a.dk, &a.dv}) {
    clear_unused_rows<T>(a, *o, nullptr, a.cu_seqlens_k, a.rows_k, a.heads_kv, stream);
    if (a.accumulate && a.overwrite_dkdv)
      zero_unused_rows<float>(a, *o, nullptr, a.cu_seqlens_k, a.rows_k, a.heads_kv, stream);
  }
}

template <typename T, int kHeadDim>
void run_backward(const Params& p, int64_t total_rows, cudaStream_t stream) {
  using B = Backward<T, kHeadDim>;
  backward_passes<T, kHeadDim>(p, total_rows, stream, [&] {
    const dim3 grid(blocks_for(p.max_rows_k, B::kBlockN) * B::kTiles.dim_parts, static_cast<unsigned>(p.a.heads_kv),
                    static_cast<unsigned>(p.a.batch));
    if (grid.x == 0) return 0;
    allow_smem(backward_kernel<T, kHeadDim>, B::kSmemBytes, "backward", kHeadDim);
    backward_kernel<T, kHeadDim><<<grid, B::kThreads, B::kSmemBytes, stream>>>(p);
    RINGFLASH_CUDA_CHECK(cudaGetLastError());
    return 0;
  });
}

}  // namespace ringflash::cuda
