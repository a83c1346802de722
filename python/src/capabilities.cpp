// What this build contains (version, build_info, has_cuda, has_mpi, has_nccl), and empty_cache.
#include "ringflash/capabilities.h"

#include <nanobind/stl/string.h>

#include "bindings.h"

namespace nb = nanobind;

namespace ringflash::python {

void init_capabilities(nb::module_& m) {
  m.def("version", [] { return std::string(version()); }, "The version of the C++ library, e.g. '0.1.0'.");
  m.def("build_info", &build_info,
        "One line per component: version, cpu ISA and threads, cuda, mpi, nccl.");
  m.def("has_cuda", &has_cuda, "Whether the CUDA kernels are compiled in and a CUDA device is present.");
  m.def("has_mpi", &has_mpi, "Whether the mpi transport is compiled in.");
  m.def("has_nccl", &has_nccl, "Whether the nccl transport is compiled in.");
  m.def("empty_cache", &empty_cache, nb::call_guard<nb::gil_scoped_release>(),
        "Gives the CUDA memory that ringflash's workspace pools keep unused back to the devices.");
}

}  // namespace ringflash::python
