"""ringflash's torch custom ops, with fake implementations and autograd.

``torch.ops.ringflash.attention_forward`` and ``torch.ops.ringflash.attention_backward`` call the C++
kernels through ``ringflash._C``. They allocate their outputs, so they mutate nothing, and they take
every option as a plain int, float, bool or optional tensor, so that ``torch.compile(fullgraph=True)``
traces them. Layouts (flash-attn's):

* padded batch: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D); out like q, lse float32 (B, Hq, Sq).
* packed batch (``cu_seqlens_q`` and ``cu_seqlens_k`` given, int32 (B + 1,)): q (Tq, Hq, D),
  k and v (Tk, Hkv, D); out like q, lse float32 (Hq, Tq).

Gradients flow to q, k and v; ``alibi_slopes`` and ``cu_seqlens`` get none, and the lse output is
not differentiable (as in flash-attn). All checking is the C++ library's, except what it cannot see:
the fake implementations check ranks and devices so that tracing fails early with the same error
types.

Eager code calls ``attention`` here, and the other modules the entry points that _register_autograd
returns for their ops: these run the ops' implementations without torch's custom-op dispatch,
unless torch.compile traces.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C

__all__ = ["attention_forward", "attention_backward"]


def _stream(t: Tensor) -> int:
    """The cudaStream_t to run on, as an int: torch's current stream for CUDA tensors, else 0."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _lse_shape(q: Tensor, packed: bool) -> Tuple[int, ...]:
    """(B, Hq, Sq), or (Hq, Tq) for a packed batch. A q of the wrong rank gets an empty lse; the
    library then reports q's rank, which it checks first."""
    if packed:
        return (q.shape[1], q.shape[0]) if q.dim() == 3 else (0,)
    return (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (0, 0, 0)


def _check_traced(op: str, tensors: Sequence[Tuple[str, Optional[Tensor]]], packed: bool) -> None:
    """The checks the library would make but cannot while tracing (fake or meta tensors): q's rank,
    and that every tensor is on q's device."""
    q = tensors[0][1]
    rank = 3 if packed else 4
    if q.dim() != rank:
        layout = "(T, H, D) (packed batch: cu_seqlens given)" if packed else "(B, S, H, D)"
        raise _C.InvalidArgument(f"[{op}] q must have shape {layout}, got {tuple(q.shape)}")
    for name, t in tensors[1:]:
        if t is not None and t.device != q.device:
            raise _C.InvalidArgument(f"[{op}] {name} must be on {q.device} like q, got {t.device}")


def _detach(t: Optional[Tensor]) -> Optional[Tensor]:
    # DLPack refuses tensors that require grad; the kernels never need the graph.
    return None if t is None else t.detach()


def _empty_outputs(q: Tensor, packed: bool) -> Tuple[Tensor, Tensor]:
    """Uninitialised (out, lse) for q: out contiguous like q, lse float32 (see _lse_shape)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, packed), dtype=torch.float32, device=q.device)
    return out, lse


def _empty_grads(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Uninitialised contiguous (dq, dk, dv) of the shapes and dtypes of q, k and v."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


# Each custom op's implementation, which eager calls run without the op's dispatch (_register_autograd).
_implementations = {}


def _custom_op(fn):
    """fn as the torch custom op ringflash::<fn's name without the leading underscore>, which
    mutates none of its arguments."""
    op = torch.library.custom_op(f"ringflash::{fn.__name__.lstrip('_')}", mutates_args=())(fn)
    _implementations[op] = fn
    return op


def _attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse). See the module docstring for layouts."""
    # The library writes every row, also those of a packed tensor that belong to no sequence.
    out, lse = _empty_outputs(q, packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    _C.attention_forward(
        _detach(q), _detach(k), _detach(v), out, lse,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=_detach(alibi_slopes),
        dropout_p=dropout_p, deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, stream=_stream(q),
    )  # fmt: skip
    return out, lse


attention_forward = _custom_op(_attention_forward)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, causal,
                            window_left, window_right, softcap, dropout_p, deterministic):
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_traced("attention_forward", [("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes)], packed)
    return _empty_outputs(q, packed)


def _attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv) for the forward with the same options, given its out and lse."""
    # Overwritten whole, rows that belong to no sequence included (they get 0).
    dq, dk, dv = _empty_grads(q, k, v)
    _C.attention_backward(
        _detach(q), _detach(k), _detach(v), _detach(out), _detach(dout), _detach(lse), dq, dk, dv,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=_detach(alibi_slopes),
        dropout_p=dropout_p, deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, stream=_stream(q),
    )  # fmt: skip
    return dq, dk, dv


attention_backward = _custom_op(_attention_backward)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale,
                             causal, window_left, window_right, softcap, dropout_p, deterministic):
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_traced("attention_backward", [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout),
                                         ("lse", lse), ("alibi_slopes", alibi_slopes)], packed)
    return _empty_grads(q, k, v)


def _grad_wanted(tensors: Sequence[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _eager(tensors: Sequence[Tensor]) -> bool:
    """Whether a call may skip torch's custom-op dispatch: not while torch.compile traces, and only
    for plain tensors on the CPU or a GPU (fake, meta and subclass tensors take the op)."""
    return not torch.compiler.is_compiling() and all(
        type(t) is torch.Tensor and t.device.type in ("cpu", "cuda") for t in tensors)


def _register_autograd(forward_op, backward_op, num_tensors: int):
    """Autograd for a forward op with inputs (q, k, v, `num_tensors` optional tensors such as
    cu_seqlens and alibi_slopes, then plain options) and outputs (out, lse, then any tensors kept for
    the backward), whose backward op takes (dout, q, k, v, out, lse, the kept tensors, the same
    optional tensors, the same options) and returns (dq, dk, dv). Only q, k and v get gradients; lse
    and the kept tensors are not differentiable.

    Returns the forward as eager code should call it: the op while torch.compile traces (or for
    tensors that are not plain CPU or GPU tensors); otherwise the op's implementation itself, under
    a torch.autograd.Function when a gradient is wanted, whose backward calls the backward op's. Both
    ways run the same implementations; the direct one skips the dispatch of torch's custom ops,
    which with autograd cost about 470 us of host time per forward call on an H100 machine's host
    (bench/NOTES.md, h32)."""

    forward_fn, backward_fn = _implementations[forward_op], _implementations[backward_op]

    def saved(ctx, inputs, output):
        out, lse, *kept = output
        ctx.save_for_backward(*inputs[:3], out, lse, *kept, *inputs[3:3 + num_tensors])
        ctx.options = inputs[3 + num_tensors:]
        ctx.mark_non_differentiable(lse, *kept)
        ctx.set_materialize_grads(False)  # no zero gradients made for lse and the kept tensors

    def gradients(ctx, dout, backward):
        if dout is None:  # out reached no loss
            return (None,) * (3 + num_tensors + len(ctx.options))
        if dout.stride(-1) != 1:
            # Autograd may hand over an expanded gradient (stride 0); the kernels need D contiguous.
            # (contiguous() would keep the strides of an empty tensor.)
            dout = dout.clone(memory_format=torch.contiguous_format)
        dq, dk, dv = backward(dout, *ctx.saved_tensors, *ctx.options)
        return (dq, dk, dv) + (None,) * (num_tensors + len(ctx.options))

    forward_op.register_autograd(lambda ctx, dout, *_: gradients(ctx, dout, backward_op), setup_context=saved)

    def forward(ctx, *inputs):
        output = forward_fn(*inputs)
        saved(ctx, inputs, output)
        return output

    # Named after the op (_attention_forward: Attention), so that grad_fn reads AttentionBackward.
    name = "".join(w.capitalize() for w in forward_fn.__name__.strip("_").removesuffix("_forward").split("_"))
    backward = staticmethod(lambda ctx, dout, *_: gradients(ctx, dout, backward_fn))
    function = type(name, (torch.autograd.Function,), dict(forward=staticmethod(forward), backward=backward))

    def call(*inputs):
        if not _eager(inputs[:3]):
            return forward_op(*inputs)
        return function.apply(*inputs) if _grad_wanted(inputs[:3]) else forward_fn(*inputs)

    return call


# flash_attn_func's entry point. The tensors after q, k, v: cu_seqlens_q, cu_seqlens_k, alibi_slopes.
attention = _register_autograd(attention_forward, attention_backward, num_tensors=3)
