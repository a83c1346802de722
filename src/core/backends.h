// What each optional backend exposes to the core. Each backend has a real implementation and a
// stub (no_*.cpp) that CMake picks between; the stub reports is_available() == false and throws
// NotSupported when used.
#pragma once

#include <string>

#include "../kernels/common/params.h"

namespace ringflash::cuda {
bool is_available();
std::string describe();  // one line for build_info()
// Why the CUDA kernels cannot run this case, or "" when they can. The one function behind both
// dispatch and attention_support().
std::string unsupported_reason(const core::AttentionArgs& args);
void attention_forward(const core::AttentionArgs& args);
void attention_backward(const core::AttentionArgs& args);
}  // namespace ringflash::cuda

namespace ringflash::comm::mpi {
bool is_available();
std::string describe();
}  // namespace ringflash::comm::mpi

namespace ringflash::comm::nccl {
bool is_available();
std::string describe();
}  // namespace ringflash::comm::nccl
