// Stub for builds without MPI.
#include "../../core/backends.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash::comm::mpi {

bool is_available() { return false; }
std::string describe() { return "no (built without MPI)"; }

}  // namespace ringflash::comm::mpi

namespace ringflash {

std::unique_ptr<Communicator> mpi_world() {
  throw NotSupported("[mpi_world] this build of ringflash has no MPI transport (configure with RINGFLASH_MPI=ON)");
}

}  // namespace ringflash
