// What each optional backend exposes to the core. Each backend has a real implementation and a
// stub (no_*.cpp) that CMake picks between; the stub reports is_available() == false and throws
// NotSupported when used.
#pragma once

#include <string>

#include <cstddef>

#include "../kernels/common/elementwise.h"
#include "../kernels/common/params.h"

namespace ringflash::cuda {
bool is_available();
std::string describe();  // one line for build_info()
// Why the CUDA kernels cannot run this case, or "" when they can. The one function behind both
// dispatch and attention_support().
std::string unsupported_reason(const core::AttentionArgs& args);
// The kernels that run a supported case, for attention_support(): "sm80", "sm90", or the sm_80 ones
// and why the sm_90a ones do not take it.
std::string kernels_used(const core::AttentionArgs& args);
void attention_forward(const core::AttentionArgs& args);
void attention_backward(const core::AttentionArgs& args);
// kernels/ops.h on CUDA: device is a CUDA device index, stream a cudaStream_t.
void elementwise(const core::ElementwiseArgs& args);
void upload(const void* src, size_t bytes, void* dst, int device, void* stream);
bool capturing(int device, void* stream);
void* allocate(int device, size_t bytes, void* stream);
void release(int device, void* data, void* stream) noexcept;
// Every device's pool gives back the memory it keeps unused (after a device synchronisation).
void release_unused();
}  // namespace ringflash::cuda

namespace ringflash::comm::mpi {
bool is_available();
std::string describe();
}  // namespace ringflash::comm::mpi

namespace ringflash::comm::nccl {
bool is_available();
std::string describe();
}  // namespace ringflash::comm::nccl
