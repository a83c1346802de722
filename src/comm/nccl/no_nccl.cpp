// Stub for builds without NCCL.
#include "../../core/backends.h"

namespace ringflash::comm::nccl {

bool is_available() { return false; }
std::string describe() { return "no (built without NCCL)"; }

}  // namespace ringflash::comm::nccl
