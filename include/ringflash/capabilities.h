// What this build of ringflash contains, and the memory it keeps.
#pragma once

#include <string>

namespace ringflash {

const char* version();
bool has_cuda();   // CUDA kernels compiled in, and a CUDA device present
bool has_mpi();    // the mpi transport compiled in
bool has_nccl();   // the nccl transport compiled in
// One line per component, e.g. "cpu: yes (avx512, 2 threads)\ncuda: no (built without CUDA)".
std::string build_info();
// Gives the CUDA memory that ringflash's workspace pools keep unused between calls back to the
// devices (each device that ringflash has used is synchronised first). Nothing to do without CUDA.
// A workspace allocation that fails does this by itself before it raises.
void empty_cache();

}  // namespace ringflash
