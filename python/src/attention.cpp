// attention_forward, attention_backward and attention_support on DLPack tensors.
//
// Tensors are positional; every option is keyword-only and has the default of
// ringflash::AttentionParams. The GIL is released around the compute calls. `stream` is the
// cudaStream_t as an int (torch: torch.cuda.current_stream().cuda_stream); 0 is the default
// stream, and CPU calls ignore it.
#include "ringflash/attention.h"

#include <cstdint>
#include <tuple>

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "bindings.h"
#include "params.h"
#include "tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ringflash::python {
namespace {

void forward(const InputArray& q, const InputArray& k, const InputArray& v, const OutputArray& out,
             const OutputArray& lse, RINGFLASH_OPTION_PARAMS) {
  constexpr const char* op = "attention_forward";
  attention_forward(to_tensor_view(op, "q", q), to_tensor_view(op, "k", k), to_tensor_view(op, "v", v),
                    to_tensor_view(op, "out", out), to_tensor_view(op, "lse", lse),
                    make_params(op, RINGFLASH_OPTION_NAMES));
}

void backward(const InputArray& q, const InputArray& k, const InputArray& v, const InputArray& out,
              const InputArray& dout, const InputArray& lse, const OutputArray& dq, const OutputArray& dk,
              const OutputArray& dv, RINGFLASH_OPTION_PARAMS) {
  constexpr const char* op = "attention_backward";
  attention_backward(to_tensor_view(op, "q", q), to_tensor_view(op, "k", k), to_tensor_view(op, "v", v),
                     to_tensor_view(op, "out", out), to_tensor_view(op, "dout", dout),
                     to_tensor_view(op, "lse", lse), to_tensor_view(op, "dq", dq), to_tensor_view(op, "dk", dk),
                     to_tensor_view(op, "dv", dv), make_params(op, RINGFLASH_OPTION_NAMES));
}

std::tuple<bool, std::string, std::string, std::string> support(const InputArray& q, const InputArray& k, const InputArray& v,
                                                   RINGFLASH_OPTION_PARAMS) {
  constexpr const char* op = "attention_support";
  Support s = attention_support(to_tensor_view(op, "q", q), to_tensor_view(op, "k", k),
                                to_tensor_view(op, "v", v), make_params(op, RINGFLASH_OPTION_NAMES));
  return {s.supported, s.backend, s.reason, s.kernels};
}

constexpr const char* kForwardDoc = R"(Attention forward: out = softmax(mask(scale * q k^T)) v, and its log-sum-exp.

Padded batch: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), out like q, lse float32 (B, Hq, Sq).
Packed batch (cu_seqlens_q and cu_seqlens_k given, int32 (B + 1,) on the host for cpu tensors):
q (Tq, Hq, D), k and v (Tk, Hkv, D), lse (Hq, Tq). D must be contiguous; Hq a multiple of Hkv.
`out` and `lse` are written (merged into, with accumulate=True; then out is float32; with
overwrite_out=True as well, written as this block's result, their old contents never read; with a
final_out, shaped like q in its dtype, the merged rows go there rounded, and out is not written).
Causal alignment is bottom-right (q_offset=None); q_offset / k_offset, or the per-sequence
q_seq_offsets / k_seq_offsets (int32 (B,)), give global positions instead. window_left/right:
-1 is unbounded. softcap 0 is off. alibi_slopes: float32 (Hq,) or (B, Hq). dropout_p > 0 raises
NotSupported. Errors: InvalidArgument, NotSupported, DeviceError.)";

constexpr const char* kBackwardDoc = R"(Attention backward: dq, dk, dv from q, k, v, out, dout and lse.

`out` and `lse` are the forward's results; dout has out's shape and q's dtype. dq, dk, dv have the
shapes and dtypes of q, k, v (float32 and added to, with accumulate=True; with overwrite_dkdv=True
as well, dk and dv are written instead, and dq still added to). Options as in attention_forward;
they must match the forward's.)";

constexpr const char* kSupportDoc = R"(Whether attention_forward/backward can run this case.

Returns (supported, backend, reason, kernels): backend is "cpu" or "cuda"; reason is empty when
supported and otherwise the message the call would raise; kernels names the kernels that run a
supported case ("cpu", "sm80" or "sm90"; on an sm_90 device that runs the sm_80 kernels, also why).)";

}  // namespace

void init_attention(nb::module_& m) {
  m.def("attention_forward", &forward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, RINGFLASH_OPTION_ARGS,
        nb::call_guard<nb::gil_scoped_release>(), kForwardDoc);
  m.def("attention_backward", &backward, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a,
        "dv"_a, RINGFLASH_OPTION_ARGS, nb::call_guard<nb::gil_scoped_release>(), kBackwardDoc);
  m.def("attention_support", &support, "q"_a, "k"_a, "v"_a, RINGFLASH_OPTION_ARGS, kSupportDoc);
}

}  // namespace ringflash::python
