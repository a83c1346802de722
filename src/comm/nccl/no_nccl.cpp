// Stub for builds without NCCL.
#include "../../core/backends.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash {
namespace comm::nccl {

bool is_available() { return false; }
std::string describe() { return "no (built without NCCL)"; }

}  // namespace comm::nccl

namespace {
[[noreturn]] void no_nccl() { throw NotSupported("[nccl_communicator] ringflash was built without NCCL"); }
}  // namespace

NcclUniqueId nccl_unique_id() { no_nccl(); }
std::unique_ptr<Communicator> nccl_communicator(const NcclUniqueId&, int, int, int, std::chrono::milliseconds) {
  no_nccl();
}
std::unique_ptr<Communicator> nccl_communicator(Communicator&, int) { no_nccl(); }

}  // namespace ringflash
