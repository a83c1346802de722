#include "ringflash/capabilities.h"

#include "../kernels/cpu/attention_cpu.h"
#include "backends.h"
#include "thread_pool.h"

namespace ringflash {

const char* version() { return "0.1.0"; }
bool has_cuda() { return cuda::is_available(); }
bool has_mpi() { return comm::mpi::is_available(); }
bool has_nccl() { return comm::nccl::is_available(); }
void empty_cache() { cuda::release_unused(); }

std::string build_info() {
  return "version: " + std::string(version()) + "\n" +
         "cpu: yes (" + cpu::isa_name() + ", " + std::to_string(core::hardware_threads()) +
         " threads)\n" +
         "cuda: " + cuda::describe() + "\n" +
         "mpi: " + comm::mpi::describe() + "\n" +
         "nccl: " + comm::nccl::describe() + "\n";
}

}  // namespace ringflash
