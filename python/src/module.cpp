// The one nanobind module of ringflash: ringflash._C.
#include "bindings.h"

NB_MODULE(_C, m) {
  m.doc() = "ringflash C++ core: exact attention kernels and sequence-parallel strategies on DLPack tensors (cpu, cuda)";
  ringflash::python::init_errors(m);
  ringflash::python::init_attention(m);
  ringflash::python::init_capabilities(m);
  ringflash::python::init_comm(m);
  ringflash::python::init_parallel(m);
}
