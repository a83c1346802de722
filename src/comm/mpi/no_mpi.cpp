// Stub for builds without MPI.
#include "../../core/backends.h"

namespace ringflash::comm::mpi {

bool is_available() { return false; }
std::string describe() { return "no (built without MPI)"; }

}  // namespace ringflash::comm::mpi
