// The parts of the nanobind module ringflash._C, one init function per concern.
#pragma once

#include <nanobind/nanobind.h>

namespace ringflash::python {

void init_errors(nanobind::module_& m);        // errors.cpp: the exception classes
void init_attention(nanobind::module_& m);     // attention.cpp: forward, backward, support
void init_capabilities(nanobind::module_& m);  // capabilities.cpp: version, build_info, has_*
void init_comm(nanobind::module_& m);          // comm.cpp: Communicator, mpi_world, bridge
void init_parallel(nanobind::module_& m);      // parallel.cpp: the strategies

}  // namespace ringflash::python
