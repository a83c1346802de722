// NCCL transport. So far only reports itself; the Communicator comes with the GPU strategies.
#include <nccl.h>

#include "../../core/backends.h"

namespace ringflash::comm::nccl {

bool is_available() { return true; }

std::string describe() {
  int version = 0;
  ncclGetVersion(&version);
  return "compiled in (NCCL " + std::to_string(version) + ")";
}

}  // namespace ringflash::comm::nccl
