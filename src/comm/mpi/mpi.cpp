// MPI transport. So far only reports itself; the Communicator comes with the strategies.
#include <mpi.h>

#include "../../core/backends.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash::comm::mpi {

bool is_available() { return true; }

std::string describe() {
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  return "compiled in (MPI " + std::to_string(major) + "." + std::to_string(minor) + ")";
}

}  // namespace ringflash::comm::mpi

namespace ringflash {

std::unique_ptr<Communicator> mpi_world() { throw NotSupported("[mpi_world] not implemented yet"); }

}  // namespace ringflash
