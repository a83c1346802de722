// Host-side launchers of the Hopper kernels: the tensor maps of the operands, then the launch.
// Only the generated sm90 instance files (built for sm_90a) include this header.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../check.h"
#include "../launch.cuh"
#include "../scratch.h"
#include "backward.cuh"
#include "dq.cuh"
#include "forward.cuh"

namespace ringflash::cuda::sm90 {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, found once (the runtime does not link the driver API).
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    RINGFLASH_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    RINGFLASH_CHECK(found == cudaDriverEntryPointSuccess && p, NotSupported,
                    "[cuda] the driver has no cuTensorMapEncodeTiled (the Hopper kernels need CUDA 12 or newer)");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A tensor map of kRank dimensions (innermost first; strides in bytes of every dimension but the
// first), the box's elements contiguous along the first. `what` names the tensor in the error.
template <int kRank>
CUtensorMap encode(CUtensorMapDataType type, const void* data, const cuuint64_t (&dims)[kRank],
                   const cuuint64_t (&strides)[kRank - 1], const cuuint32_t (&box)[kRank], CUtensorMapSwizzle swizzle,
                   const char* what) {
  cuuint32_t element_strides[kRank];
  for (int d = 0; d < kRank; ++d) element_strides[d] = 1;
  CUtensorMap map{};
  const CUresult rc = encode_tiled()(&map, type, kRank, const_cast<void*>(data), dims, strides, box, element_strides,
                                     CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (rc != CUDA_SUCCESS) {
    std::string shape, stride;
    for (int d = 0; d < kRank; ++d) shape += (d ? " x " : "") + std::to_string(dims[d]);
    for (int d = 0; d + 1 < kRank; ++d) stride += (d ? "/" : "") + std::to_string(strides[d]);
    throw NotSupported(core::str_cat("[cuda] cuTensorMapEncodeTiled refused ", what, " (error ", static_cast<int>(rc),
                                     "; dims ", shape, ", strides ", stride, " bytes)"));
  }
  return map;
}

// One operand (rows x heads x head dim per sequence, strides in elements) as a 4-D map (head dim,
// heads, rows, batch) with boxes of 64 columns x 1 head x box_rows rows, 128-byte swizzle. Columns
// past the head dim and rows past `rows` read as zeros.
template <typename T>
CUtensorMap operand_map(const core::AttentionArgs::Operand& o, int64_t head_dim, int64_t heads, int64_t rows,
                        int64_t batch, int box_rows) {
  constexpr auto kType = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const auto bytes = [](int64_t elements) { return static_cast<cuuint64_t>(elements) * sizeof(T); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(batch)};
  // A dimension of size 1 may have any stride; give it one that keeps the strides legal.
  const cuuint64_t strides[3] = {bytes(heads > 1 ? o.head_stride : head_dim), bytes(o.row_stride),
                                 bytes(batch > 1 ? o.batch_stride : rows * o.row_stride)};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(box_rows), 1};
  return encode(kType, o.data, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "an operand");
}

// The backward's fp32 dQ accumulator (Params::dq_accum and its strides) as a 4-D map (head dim,
// heads, rows, batch) with boxes of 32 columns x 1 head x box_rows rows, 128-byte swizzle: the
// destination of the TMA reduce-adds. Rows and columns past the tensor are not written. A packed
// batch is one sequence of the map (batch 1).
inline CUtensorMap dq_map(const Params& p, int64_t batch, int box_rows) {
  const core::AttentionArgs& a = p.a;
  const auto bytes = [](int64_t elements) { return static_cast<cuuint64_t>(elements) * sizeof(float); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(a.head_dim), static_cast<cuuint64_t>(a.heads_q),
                              static_cast<cuuint64_t>(a.rows_q), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {bytes(a.heads_q > 1 ? p.dq_accum_head_stride : a.head_dim),
                                 bytes(p.dq_accum_row_stride),
                                 bytes(batch > 1 ? p.dq_accum_batch_stride : a.rows_q * p.dq_accum_row_stride)};
  const cuuint32_t box[4] = {32, 1, static_cast<cuuint32_t>(box_rows), 1};
  return encode(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.dq_accum, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                "the dQ accumulator");
}

// A row statistic of the backward's workspace (fp32, row i of column c at data[c * rows + i]) as a
// 2-D map (rows, columns) with boxes of box_rows x 1; rows must be a multiple of 4 (16-byte strides).
inline CUtensorMap stat_map(const float* data, int64_t rows, int64_t columns, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(columns)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(rows) * sizeof(float)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_rows), 1};
  return encode(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, data, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE,
                "a row statistic");
}

// core::tile_order for a launch of one block per (tile, head) of each sequence, and its grid.
inline core::TileOrder tile_order(const Params& p, int64_t heads, int64_t tiles, int group, int64_t shared_bytes,
                                  const char* kernel, dim3* grid) {
  RINGFLASH_CHECK(tiles * heads <= INT32_MAX, NotSupported, "[cuda] the Hopper ", kernel, " takes at most ",
                  INT32_MAX, " tiles x heads per sequence; got ", tiles, " x ", heads);
  *grid = dim3(static_cast<unsigned>(tiles * heads), static_cast<unsigned>(p.a.batch));
  return core::tile_order(p.mask(), static_cast<int>(heads), static_cast<int>(tiles), group, shared_bytes);
}

// The same for a kernel of query tiles of block_m rows (the forward, the dQ kernel): a q head's
// blocks read k and v of its k/v head, which the heads of a group share.
template <typename T, int kHeadDim>
core::TileOrder query_tile_order(const Params& p, int block_m, const char* kernel, dim3* grid) {
  return tile_order(p, p.a.heads_q, blocks_for(p.max_rows_q, block_m), p.group,
                    p.max_rows_k * kHeadDim * 2 * int64_t{sizeof(T)}, kernel, grid);
}

template <typename T, int kHeadDim, bool kPlain>
void launch_forward(const Params& p, cudaStream_t stream) {
  using F = Forward<T, kHeadDim, kPlain>;
  const core::AttentionArgs& a = p.a;
  allow_smem(forward_kernel<T, kHeadDim, kPlain>, F::kSmemBytes, "Hopper forward", kHeadDim);
  const int64_t batch = a.cu_seqlens_q ? 1 : a.batch;  // a packed batch is one sequence of the maps
  Maps maps{operand_map<T>(a.q, a.head_dim, a.heads_q, a.rows_q, batch, 64),  // a consumer's rows
            operand_map<T>(a.k, a.head_dim, a.heads_kv, a.rows_k, batch, F::kBlockN),
            operand_map<T>(a.v, a.head_dim, a.heads_kv, a.rows_k, batch, F::kBlockN),
            {},
            !a.accumulate};
  // Whole query tiles go out through shared memory by TMA (a consumer's rows as one box), partial
  // ones and fp32 accumulators from registers. attention_forward holds out to q's alignment rule.
  if (maps.store_out) maps.out = operand_map<T>(a.out, a.head_dim, a.heads_q, a.rows_q, batch, 64);
  dim3 grid;
  const core::TileOrder order = query_tile_order<T, kHeadDim>(p, F::kBlockM, "forward", &grid);
  const int64_t items = int64_t{grid.x} * grid.y;
  if (items == 0) return;
  if constexpr (F::kPersistent) {
    // A block per SM (one fits), each taking items until none is left; the count of those taken
    // runs past the items by each block's last try.
    const int64_t blocks = std::min<int64_t>(items, sm_count());
    RINGFLASH_CHECK(items + blocks <= INT32_MAX, NotSupported, "[cuda] the Hopper forward takes at most ", INT32_MAX,
                    " query tiles in all; got ", items);
    const Scratch taken(a.device, sizeof(int), stream);
    RINGFLASH_CUDA_CHECK(cudaMemsetAsync(taken.data, 0, sizeof(int), stream));
    forward_kernel<T, kHeadDim, kPlain><<<static_cast<unsigned>(blocks), F::kThreads, F::kSmemBytes, stream>>>(
        p, maps, order, Schedule{static_cast<int*>(taken.data), static_cast<int>(items)});
  } else {
    forward_kernel<T, kHeadDim, kPlain><<<grid, F::kThreads, F::kSmemBytes, stream>>>(p, maps, order, Schedule{});
  }
  RINGFLASH_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int kHeadDim>
void run_forward(const Params& p, cudaStream_t stream) {
  const core::AttentionArgs& a = p.a;
  const bool plain = a.alibi_slopes == nullptr && p.softcap_log2 == 0.0f && p.qk_scale > 0.0f;
  if (plain) launch_forward<T, kHeadDim, true>(p, stream);
  else launch_forward<T, kHeadDim, false>(p, stream);
  clear_unused_output_rows<T>(a, stream);
}

// The dQ kernel of the head-dim-256 backward (dq.cuh).
template <typename T, int kHeadDim>
void launch_backward_dq(const Params& p, cudaStream_t stream) {
  using D = BackwardDq<T, kHeadDim>;
  const core::AttentionArgs& a = p.a;
  dim3 grid;
  const core::TileOrder order = query_tile_order<T, kHeadDim>(p, D::kBlockM, "dQ", &grid);
  if (grid.x == 0) return;
  allow_smem(backward_dq_kernel<T, kHeadDim>, D::kSmemBytes, "Hopper dQ", kHeadDim);
  const int64_t batch = a.cu_seqlens_q ? 1 : a.batch;  // a packed batch is one sequence of the maps
  const DqMaps maps{operand_map<T>(a.q, a.head_dim, a.heads_q, a.rows_q, batch, D::kBlockM),
                    operand_map<T>(a.dout, a.head_dim, a.heads_q, a.rows_q, batch, D::kBlockM),
                    operand_map<T>(a.k, a.head_dim, a.heads_kv, a.rows_k, batch, D::kBlockN),
                    operand_map<T>(a.v, a.head_dim, a.heads_kv, a.rows_k, batch, D::kBlockN)};
  backward_dq_kernel<T, kHeadDim><<<grid, D::kThreads, D::kSmemBytes, stream>>>(p, maps, order);
  RINGFLASH_CUDA_CHECK(cudaGetLastError());
}

// At head dim 256 (kWide) the backward kernel computes dK and dV, and the dQ kernel writes dQ.
// Below it, with an accumulator from the workspace, each consumer of a block counts itself in
// p.dq_done once its part of dQ is in: kConsumers per block, `tiles` blocks per sequence and k/v
// head.
template <typename T, int kHeadDim>
void run_backward(const Params& p, int64_t total_rows, cudaStream_t stream) {
  using B = Backward<T, kHeadDim>;
  const auto main = [&]() -> int {
    const core::AttentionArgs& a = p.a;
    // A k/v head's blocks read q and dout of its group and, below head dim 256, add into its fp32 dq.
    dim3 grid;
    const int64_t dq_bytes = B::kWide ? 0 : 4, tiles = blocks_for(p.max_rows_k, B::kBlockN);
    const core::TileOrder order =
        tile_order(p, a.heads_kv, tiles, 1, p.group * p.max_rows_q * kHeadDim * (2 * int64_t{sizeof(T)} + dq_bytes),
                   "backward", &grid);
    int counted = 0;
    if (grid.x > 0) {
      allow_smem(backward_kernel<T, kHeadDim>, B::kSmemBytes, "Hopper backward", kHeadDim);
      const int64_t batch = a.cu_seqlens_q ? 1 : a.batch;  // a packed batch is one sequence of the maps
      BackwardMaps maps{operand_map<T>(a.q, a.head_dim, a.heads_q, a.rows_q, batch, B::kBlockM),
                        operand_map<T>(a.dout, a.head_dim, a.heads_q, a.rows_q, batch, B::kBlockM),
                        operand_map<T>(a.k, a.head_dim, a.heads_kv, a.rows_k, batch, B::kBlockN),
                        operand_map<T>(a.v, a.head_dim, a.heads_kv, a.rows_k, batch, B::kBlockN),
                        stat_map(p.lse2, p.stat_head_stride, batch * a.heads_q, B::kStatRows),
                        stat_map(p.dsum, p.stat_head_stride, batch * a.heads_q, B::kStatRows),
                        B::kWide ? CUtensorMap{} : dq_map(p, batch, B::kDq),
                        {},
                        {},
                        !a.accumulate && !B::kWide};
      // Whole key tiles' dK and dV go out through shared memory by TMA (a consumer's 64 keys as
      // one box), partial ones and fp32 accumulators from registers. attention_backward holds dk
      // and dv to q's alignment rule.
      if (maps.store_grads) {
        maps.dk = operand_map<T>(a.dk, a.head_dim, a.heads_kv, a.rows_k, batch, 64);
        maps.dv = operand_map<T>(a.dv, a.head_dim, a.heads_kv, a.rows_k, batch, 64);
      }
      // Its blocks start under the last ones of the dsum pass (backward_passes runs it when there
      // are queries), and wait for it before they load the statistics.
      launch_overlapped(total_rows > 0, backward_kernel<T, kHeadDim>, grid, dim3(B::kThreads), B::kSmemBytes, stream,
                        p, maps, order);
      if (!B::kWide && p.dq_done) counted = static_cast<int>(B::kConsumers * tiles * (a.cu_seqlens_q ? a.batch : 1));
    }
    if constexpr (B::kWide) launch_backward_dq<T, kHeadDim>(p, stream);
    return counted;
  };
  backward_passes<T, kHeadDim>(p, total_rows, stream, main, B::kWide);
}

}  // namespace ringflash::cuda::sm90
