// What this build of ringflash contains.
#pragma once

#include <string>

namespace ringflash {

const char* version();
bool has_cuda();   // CUDA kernels compiled in, and a CUDA device present
bool has_mpi();    // the mpi transport compiled in
bool has_nccl();   // the nccl transport compiled in
// One line per component, e.g. "cpu: yes (avx512, 2 threads)\ncuda: no (built without CUDA)".
std::string build_info();

}  // namespace ringflash
