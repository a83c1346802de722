// ringflash's C++ errors as Python exceptions.
//
//   ringflash._C.Error            (Exception)           base of every ringflash error
//   ringflash._C.InvalidArgument  (Error, ValueError)
//   ringflash._C.NotSupported     (Error, NotImplementedError)
//   ringflash._C.DeviceError      (Error, RuntimeError)
//   ringflash._C.CommError        (Error, RuntimeError)
//
// Each also derives from the builtin that Python code would catch for that kind of failure, so
// `except ValueError` keeps working for callers that do not know ringflash.
#include "ringflash/errors.h"

#include "bindings.h"

namespace nb = nanobind;

namespace ringflash::python {

void init_errors(nb::module_& m) {
  // nanobind tries translators newest first, so the base is registered before its subclasses.
  nb::exception<Error> base(m, "Error", PyExc_Exception);
  auto bases = [&](PyObject* builtin) { return nb::make_tuple(base, nb::handle(builtin)); };
  nb::exception<InvalidArgument>(m, "InvalidArgument", bases(PyExc_ValueError));
  nb::exception<NotSupported>(m, "NotSupported", bases(PyExc_NotImplementedError));
  nb::exception<DeviceError>(m, "DeviceError", bases(PyExc_RuntimeError));
  nb::exception<CommError>(m, "CommError", bases(PyExc_RuntimeError));
}

}  // namespace ringflash::python
