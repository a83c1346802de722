"""Opt-in override of ``torch.nn.functional.scaled_dot_product_attention`` (the IPU seed's
``flash_attention_ipu.auto``).

``import ringflash.auto`` replaces ``F.scaled_dot_product_attention`` with
``ringflash.auto.scaled_dot_product_attention``, which runs ringflash's chunked attention with
automatic chunk counts (``ringflash.chunked.chunked_attention``) where ringflash computes the same
thing, and calls the function it replaced for everything else. ``disable()`` puts that function
back (the very same object), ``enable()`` installs the override again, and ``override(enabled)`` is
a context manager that sets the state for a block and restores the previous one after it.

Routed to ringflash, when all of these hold:

* query, key and value are plain strided tensors (not nested, not subclasses), 4-D (B, H, S, D)
  with the same dtype, float32, float16 or bfloat16, on the CPU (or on CUDA when this build has
  CUDA kernels and the library supports the case), head dim contiguous and equal for all three;
* key and value have the same shape, and the batch size of query;
* query has as many heads as key and value, or, with ``enable_gqa=True``, a multiple of them;
* ``attn_mask`` is None and ``dropout_p`` is 0 (SDPA applies dropout whenever ``dropout_p > 0``;
  modules pass 0 in eval mode, so inference is routed and dropout training falls back);
* autocast is off for the tensors' device (SDPA would compute in the autocast dtype);
* no tensor is empty, and no keyword other than SDPA's own is given.

``is_causal`` keeps SDPA's top-left alignment when the query and key lengths differ (query i sees
keys 0..i; ringflash's own functions align bottom-right); ``scale`` is the softmax scale, default
1 / sqrt(D). Outputs have SDPA's layout (B, H, Sq, D) and are differentiable in query, key and
value. Code that bound the function before the override (``from torch.nn.functional import
scaled_dot_product_attention``) keeps the original.
"""

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C
from .chunked import chunked_attention

__all__ = ["disable", "enable", "is_enabled", "override", "scaled_dot_product_attention", "should_route"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HAS_CUDA = _C.has_cuda()
# The function that the override replaced, called for every case it does not route.
_previous: Callable = F.scaled_dot_product_attention


def should_route(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                 enable_gqa: bool = False) -> bool:
    """Whether the override sends this call to ringflash (see the module docstring)."""
    if attn_mask is not None or dropout_p != 0.0:
        return False
    tensors = (query, key, value)
    if not all(type(t) is torch.Tensor for t in tensors):  # noqa: E721 (subclasses keep their own SDPA)
        return False
    if any(t.is_nested or t.layout != torch.strided or t.dim() != 4 or t.numel() == 0 for t in tensors):
        return False
    device = query.device
    if any(t.device != device or t.dtype != query.dtype for t in tensors) or query.dtype not in _DTYPES:
        return False
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not _HAS_CUDA):
        return False
    if torch.is_autocast_enabled(device.type):
        return False
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1]:
        return False
    if any(t.stride(-1) != 1 for t in tensors):
        return False
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_q != heads_kv and not (enable_gqa and heads_q % heads_kv == 0):
        return False
    if device.type == "cuda" and not torch.compiler.is_compiling():
        # The CUDA kernels' own limits; only the library knows them (it needs real tensors).
        q, k, v = (t.detach().transpose(1, 2) for t in tensors)
        return _C.attention_support(q, k, v, causal=bool(is_causal), softmax_scale=scale, q_offset=0)[0]
    return True


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, **kwargs) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention, on ringflash where it can (see the module
    docstring), else the function that the override replaced."""
    if kwargs or not should_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _previous(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa, **kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, S, D) -> (B, S, H, D)
    # q_offset=0, k_offset=0: SDPA's top-left causal alignment.
    out = chunked_attention(q, k, v, causal=bool(is_causal), softmax_scale=scale, q_offset=0, k_offset=0)
    return out.transpose(1, 2)  # (B, Sq, H, D) -> (B, H, Sq, D)


def is_enabled() -> bool:
    """Whether F.scaled_dot_product_attention is the override now."""
    return F.scaled_dot_product_attention is scaled_dot_product_attention


def enable() -> None:
    """Installs the override; the function it replaces becomes the fallback. Does nothing when it
    is installed already."""
    global _previous
    if not is_enabled():
        _previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention


def disable() -> None:
    """Puts back the function that enable() replaced. Does nothing when the override is not
    installed (also when something else has replaced it since)."""
    if is_enabled():
        F.scaled_dot_product_attention = _previous


@contextlib.contextmanager
def override(enabled: bool = True):
    """Within the block the override is on (enabled=True) or off; afterwards it is as before."""
    was_enabled = is_enabled()
    (enable if enabled else disable)()
    try:
        yield
    finally:
        (enable if was_enabled else disable)()


enable()
