#include "tensor.h"

#include <string>

#include "ringflash/errors.h"

namespace nb = nanobind;

namespace ringflash::python {
namespace {

using nb::dlpack::dtype_code;

std::optional<DType> to_dtype(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  switch (static_cast<dtype_code>(t.code)) {
    case dtype_code::Float:
      if (t.bits == 32) return DType::kFloat32;
      if (t.bits == 16) return DType::kFloat16;
      if (t.bits == 64) return DType::kFloat64;
      break;
    case dtype_code::Bfloat:
      if (t.bits == 16) return DType::kBFloat16;
      break;
    case dtype_code::Int:
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    default:
      break;
  }
  return std::nullopt;
}

// A readable name for a DLPack dtype that ringflash does not take: "int8", "complex64", "bool".
std::string dlpack_dtype_name(nb::dlpack::dtype t) {
  const char* prefix = "dtype_code_";
  switch (static_cast<dtype_code>(t.code)) {
    case dtype_code::Int: prefix = "int"; break;
    case dtype_code::UInt: prefix = "uint"; break;
    case dtype_code::Float: prefix = "float"; break;
    case dtype_code::Bfloat: prefix = "bfloat"; break;
    case dtype_code::Complex: prefix = "complex"; break;
    case dtype_code::Bool: return "bool";
    default: return "float8/6/4 or another dtype with DLPack code " + std::to_string(t.code);
  }
  std::string name = prefix + std::to_string(t.bits);
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

std::string dlpack_device_name(int type, int id) {
  const char* name = "device_type_";
  switch (type) {
    case nb::device::cpu::value: name = "cpu"; break;
    case nb::device::cuda::value: name = "cuda"; break;
    case nb::device::cuda_host::value: name = "cuda_host"; break;
    case nb::device::cuda_managed::value: name = "cuda_managed"; break;
    case nb::device::rocm::value: name = "rocm"; break;
    case nb::device::rocm_host::value: name = "rocm_host"; break;
    case nb::device::metal::value: name = "metal"; break;
    case nb::device::oneapi::value: name = "oneapi"; break;
    case nb::device::vulkan::value: name = "vulkan"; break;
    case nb::device::opencl::value: name = "opencl"; break;
    default: return "device_type_" + std::to_string(type) + ":" + std::to_string(id);
  }
  return std::string(name) + ":" + std::to_string(id);
}

}  // namespace

TensorView to_tensor_view(const char* op, const char* name, void* data, nb::dlpack::dtype dtype, int device_type,
                          int device_id, size_t ndim, const int64_t* shape, const int64_t* strides) {
  const std::string where = std::string("[") + op + "] " + name;
  const std::optional<DType> dt = to_dtype(dtype);
  if (!dt)
    throw InvalidArgument(where + " must have dtype float32, float16, bfloat16, int32, int64 or float64, got " +
                          dlpack_dtype_name(dtype));
  Device device;
  if (device_type == nb::device::cpu::value) {
    device = {DeviceType::kCPU, 0};
  } else if (device_type == nb::device::cuda::value) {
    device = {DeviceType::kCUDA, device_id};
  } else {
    throw InvalidArgument(where + " must be on cpu or cuda, got " + dlpack_device_name(device_type, device_id));
  }
  if (ndim > static_cast<size_t>(TensorView::kMaxDims))
    throw InvalidArgument(where + " must have at most " + std::to_string(TensorView::kMaxDims) +
                          " dimensions, got " + std::to_string(ndim));
  return TensorView(data, *dt, device, static_cast<int>(ndim), shape, strides);
}

}  // namespace ringflash::python
