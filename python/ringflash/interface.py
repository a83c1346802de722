"""flash-attn 2.x's single-device functions, on ringflash's kernels.

Names, signatures, defaults and return values follow flash-attn 2.x (``flash_attn_func``,
``flash_attn_varlen_func`` and their packed variants), so code written for flash-attn runs unchanged.
Differences:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the third item, flash-attn's
  ``S_dmask``, only matters with dropout, and ringflash never materialises the attention matrix.
* ``return_softmax_lse=True`` (as in flash-attn 3) returns ``(out, softmax_lse)``. When both are set,
  ``return_attn_probs`` wins. The lse is float32, natural log, (B, H, Sq) or, for packed batches,
  (H, Tq); it carries no gradient, as in flash-attn.
* ``dropout_p > 0`` raises ``NotSupported``; so does a ``block_table`` (paged KV cache).
* Any head dim works, not only multiples of 8 up to 256.
* Inputs are never copied: a tensor whose head dim is not contiguous is an ``InvalidArgument``,
  where flash-attn would copy it silently.
* ``max_seqlen_q`` / ``max_seqlen_k`` are accepted for compatibility and otherwise unused: the
  library reads the lengths from ``cu_seqlens``, which must be int32 and, for CPU tensors, on the CPU.

Errors are ``ringflash.InvalidArgument`` (a ``ValueError``) and ``ringflash.NotSupported`` (a
``NotImplementedError``), and name the argument.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from .ops import attention

__all__ = [
    "Support",
    "attention_support",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


def _window(op: str, window_size: Sequence[int]) -> Tuple[int, int]:
    """flash-attn's window_size as (left, right); the library checks the values."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    ok = ok and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    if not ok:
        raise _C.InvalidArgument(f"[{op}] window_size must be a pair of ints (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_int(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise _C.InvalidArgument(f"[{op}] {name} must be an int, got {value!r}")


def _results(out: Tensor, lse: Tensor, return_attn_probs: bool, return_softmax_lse: bool = False):
    if return_attn_probs:
        return out, lse, None
    if return_softmax_lse:
        return out, lse
    return out


def _attention(op, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
               softcap, alibi_slopes, deterministic):
    left, right = _window(op, window_size)
    return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, causal, left,
                     right, float(softcap), float(dropout_p), bool(deterministic))


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_softmax_lse: bool = False,
):
    """Attention over a padded batch.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) with Hq a multiple of Hkv (GQA/MQA); fp32, fp16 or bf16.
    softmax_scale defaults to 1 / sqrt(D). causal aligns the last query with the last key
    (bottom-right) when Sq != Sk. window_size (left, right): query i sees keys j with
    i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 is unbounded. softcap > 0 caps scores with
    softcap * tanh(s / softcap). alibi_slopes: float32 (Hq,) or (B, Hq), adding
    -slope * |i + Sk - Sq - j| to the scores.

    Returns out (B, Sq, Hq, D); see the module docstring for return_attn_probs and
    return_softmax_lse.
    """
    out, lse = _attention("flash_attn_func", q, k, v, None, None, dropout_p, softmax_scale, causal, window_size,
                          softcap, alibi_slopes, deterministic)
    return _results(out, lse, return_attn_probs, return_softmax_lse)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    return_softmax_lse: bool = False,
):
    """Attention over a packed batch of variable-length sequences.

    q: (Tq, Hq, D); k, v: (Tk, Hkv, D); cu_seqlens_q / cu_seqlens_k: int32 (B + 1,), non-decreasing,
    where sequence b is rows cu_seqlens[b] to cu_seqlens[b + 1]. Empty sequences are allowed. Masks
    and options as in flash_attn_func, per sequence. Returns out (Tq, Hq, D); the lse is (Hq, Tq).
    """
    op = "flash_attn_varlen_func"
    if block_table is not None:
        raise _C.NotSupported(f"[{op}] block_table (paged KV cache) is not supported, got a tensor")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check_int(op, name, value)
    out, lse = _attention(op, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size,
                          softcap, alibi_slopes, deterministic)
    return _results(out, lse, return_attn_probs, return_softmax_lse)


def _unpack(op: str, name: str, packed: Tensor, dim: int, count: int) -> Tuple[Tensor, ...]:
    """Views of `packed` along `dim`, which must have size `count` (3 for qkv, 2 for kv); gradients
    flow back into `packed`."""
    if not isinstance(packed, Tensor) or packed.dim() <= dim or packed.shape[dim] != count:
        got = f"shape {tuple(packed.shape)}" if isinstance(packed, Tensor) else type(packed).__name__
        raise _C.InvalidArgument(f"[{op}] {name} must have size {count} in dimension {dim}, got {got}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              return_softmax_lse=False):
    """flash_attn_func with qkv: (B, S, 3, H, D)."""
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             return_softmax_lse=False):
    """flash_attn_func with kv: (B, Sk, 2, Hkv, D)."""
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, return_softmax_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, return_softmax_lse=False):
    """flash_attn_varlen_func with qkv: (T, 3, H, D) and one cu_seqlens for q and k."""
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, None, return_softmax_lse)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    return_softmax_lse=False):
    """flash_attn_varlen_func with kv: (Tk, 2, Hkv, D)."""
    k, v = _unpack("flash_attn_varlen_kvpacked_func", "kv", kv, 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, None, return_softmax_lse)


class Support(NamedTuple):
    """Whether a case can run: backend is "cpu" or "cuda"; reason is empty when supported. kernels
    names the kernels that run a supported case: "cpu", "sm80" or "sm90"; where an sm_90 GPU runs
    the sm_80 kernels it also says why (e.g. head dim 256)."""

    supported: bool
    backend: str
    reason: str
    kernels: str = ""


def attention_support(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Optional[Tensor] = None,
                      cu_seqlens_k: Optional[Tensor] = None, dropout_p: float = 0.0,
                      softmax_scale: Optional[float] = None, causal: bool = False,
                      window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: Optional[Tensor] = None, deterministic: bool = False) -> Support:
    """Whether flash_attn_func / flash_attn_varlen_func can run these inputs and options, and if
    not, the error they would raise. Options as in flash_attn_func."""
    left, right = _window("attention_support", window_size)
    tensors = [t if t is None else t.detach() for t in (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)]
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes = tensors
    return Support(*_C.attention_support(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_left=left, window_right=right,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))  # fmt: skip
