"""ring-flash-attn's API (zhuzilin/ring-flash-attention) on ringflash.

Code written for ring-flash-attn switches with one line::

    import ringflash.ring_flash_attn as ring_flash_attn
    from ringflash.ring_flash_attn import zigzag_ring_flash_attn_func, llama3_flash_attn_varlen_func

Names, signatures, defaults and return values are ring-flash-attn's:

* ``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and their
  ``_kvpacked_func`` / ``_qkvpacked_func`` variants: q (B, S_local, H, D), kv (B, S_local, 2, Hkv, D),
  qkv (B, S_local, 3, H, D), each rank holding its shard of the sequence;
* ``ring_flash_attn_varlen_*``, ``zigzag_ring_flash_attn_varlen_*``, ``stripe_flash_attn_varlen_*``:
  packed shards (T_local, H, D) with the LOCAL ``cu_seqlens`` that ring-flash-attn takes (every
  document cut into world-size parts, or 2 x world-size for zigzag, the same on every rank);
* ``llama3_flash_attn_varlen_*`` and ``llama3_flash_attn_prepare_cu_seqlens``: the packed token
  stream cut contiguously across ranks, K/V all-gathered ``heads_k_stride`` heads at a time;
* ``substitute_hf_flash_attn``, ``update_ring_flash_attn_params`` and ``use_ring_attn`` (the Hugging
  Face adapter).

Layouts. Rank r of P holds, of every sequence (of every document, for varlen):

* ring: the r-th of P contiguous parts;
* zigzag: chunks r and 2P - 1 - r of 2P;
* stripe: positions r, r + P, r + 2P, ...

These are ring-flash-attn's layouts whenever its divisibility rules hold (S divisible by P for ring
and stripe, by 2P for zigzag). ringflash also accepts lengths that do not divide: the first ranks
then hold one row more (``ringflash.parallel.shard_positions`` gives any rank's positions). The
varlen functions keep ring-flash-attn's rule that every document divides (their local cu_seqlens
could not describe uneven shards), and say which document does not.

Return values: ``out`` like q; with ``return_attn_probs=True``, ``(out, softmax_lse, None)``, the lse
float32 with natural log, (B, H, S_local), or (H, T_local) for packed batches. Gradients reach q, k
and v (or the packed tensors) in their dtype.

Differences from ring-flash-attn:

* ringflash computes exact attention for every option: zigzag and stripe also run with
  ``causal=False`` (ring-flash-attn asserts causal), sliding windows and ALiBi slopes use global
  positions (ALiBi is NotSupported with stripe), and ``softcap`` is accepted as a keyword-only
  argument after ``group`` (ring-flash-attn releases that take softcap place it among the positional
  parameters: pass it by name).
* ``dropout_p > 0`` raises ``ringflash.NotSupported``. ``deterministic`` is accepted (the llama3
  functions pass it to the kernels; ringflash's CPU backward is always deterministic).
* The varlen lse is flash-attn's packed layout (H, T_local), never the padded
  (B, H, max_seqlen) of old flash-attn versions. ``max_seqlen`` arguments are accepted and unused.
* Partial results are merged in fp32 and never rounded between ring steps; dq is returned in q's
  dtype (ring-flash-attn's ring backward returns bf16 whatever the input).
* llama3: masks use positions in the token stream, so sliding windows are right also where a
  non-causal rank's last document continues on later ranks; ``heads_k_stride`` need not divide the
  K/V heads; dK/dV are reduce-scattered in fp32; the ranks agree on their arguments before any
  transfer, so bad input on one rank raises the same error on every rank instead of a hang.
* A tensor whose head dim is not contiguous is an InvalidArgument, not copied silently.
* Errors are ``ringflash.InvalidArgument`` (a ValueError) and ``ringflash.NotSupported`` (a
  NotImplementedError), named after the function and the argument, instead of assertions.

``group`` is a torch.distributed process group, or None for the default group; without
torch.distributed, a single process (or, except for llama3, an mpiexec job).
"""

import bisect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from .distributed import communicator
from .interface import _check_int, _results, _unpack, _window
from .ops import _custom_op, _detach, _lse_shape, _register_autograd, _stream
from .parallel import ParallelGroup, _check_dropout, _handle, parallel_attention

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "stripe_flash_attn_varlen_func",
    "stripe_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_varlen_qkvpacked_func",
    "substitute_hf_flash_attn",
    "update_ring_flash_attn_params",
    "use_ring_attn",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]


# ---- shared by every function ----------------------------------------------------------------

def _as_parallel_group(group) -> ParallelGroup:
    # _handle registers the group eagerly, also while torch.compile traces the caller.
    return group if isinstance(group, ParallelGroup) else ParallelGroup._registry[_handle(group)]


def _group_size(pg: ParallelGroup, device) -> int:
    """The number of ranks in the group, traceable by torch.compile (dist.get_world_size is folded
    to a constant; the library's communicators are not traceable)."""
    if not pg.is_hybrid and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(pg.world)
    return pg.size(device)


# ---- ring, zigzag, stripe: padded batches -----------------------------------------------------

def _padded(op, strategy, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            return_attn_probs, group, softcap):
    out, lse = parallel_attention(q, k, v, strategy, group, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, return_lse=True, op=op)
    return _results(out, lse, return_attn_probs)


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                         softcap=0.0):
    """Ring attention: q (B, S_local, Hq, D), k and v (B, S_local, Hkv, D), contiguous shards."""
    return _padded("ring_flash_attn_func", "ring", q, k, v, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  softcap=0.0):
    """ring_flash_attn_func with kv (B, S_local, 2, Hkv, D)."""
    op = "ring_flash_attn_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 2, 2)
    return _padded(op, "ring", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                   softcap=0.0):
    """ring_flash_attn_func with qkv (B, S_local, 3, H, D)."""
    op = "ring_flash_attn_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 2, 3)
    return _padded(op, "ring", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                softcap=0.0):
    """Zigzag ring attention: rank r holds chunks r and 2P - 1 - r of 2P (causal load balance)."""
    return _padded("zigzag_ring_flash_attn_func", "zigzag", q, k, v, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0):
    """zigzag_ring_flash_attn_func with kv (B, S_local, 2, Hkv, D)."""
    op = "zigzag_ring_flash_attn_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 2, 2)
    return _padded(op, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0):
    """zigzag_ring_flash_attn_func with qkv (B, S_local, 3, H, D)."""
    op = "zigzag_ring_flash_attn_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 2, 3)
    return _padded(op, "zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                           softcap=0.0):
    """Striped attention: rank r holds positions r, r + P, r + 2P, ..."""
    return _padded("stripe_flash_attn_func", "stripe", q, k, v, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                    softcap=0.0):
    """stripe_flash_attn_func with kv (B, S_local, 2, Hkv, D)."""
    op = "stripe_flash_attn_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 2, 2)
    return _padded(op, "stripe", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                     softcap=0.0):
    """stripe_flash_attn_func with qkv (B, S_local, 3, H, D)."""
    op = "stripe_flash_attn_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 2, 3)
    return _padded(op, "stripe", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   return_attn_probs, group, softcap)


# ---- ring, zigzag, stripe: packed batches ----------------------------------------------------

def _check_local_cu_seqlens(op: str, cu_seqlens, rows: int, pieces: int) -> None:
    """ring-flash-attn's local cu_seqlens: int32 (B + 1,), from 0 to the local tokens, and (zigzag)
    every local length divisible by `pieces`."""
    if not isinstance(cu_seqlens, Tensor):
        raise _C.InvalidArgument(f"[{op}] cu_seqlens must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise _C.InvalidArgument(f"[{op}] cu_seqlens must be int32 of shape (B + 1,) with B >= 1, got "
                                 f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    if torch.compiler.is_compiling():
        return  # the values are data; the library checks the global ones
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != rows:
        raise _C.InvalidArgument(f"[{op}] cu_seqlens (local) must run from 0 to the {rows} local tokens of q, got "
                                 f"{values[0]} to {values[-1]}")
    for b in range(len(values) - 1):
        length = values[b + 1] - values[b]
        if length < 0:
            raise _C.InvalidArgument(f"[{op}] cu_seqlens must be non-decreasing, got {values[b]} then "
                                     f"{values[b + 1]} at index {b}")
        if length % pieces:
            raise _C.InvalidArgument(
                f"[{op}] cu_seqlens: every local sequence length must be divisible by {pieces} (zigzag cuts each "
                f"sequence into 2 x world size chunks, two per rank), got {length} for sequence {b}")


def _varlen(op, strategy, q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
            alibi_slopes, return_attn_probs, group, softcap):
    _check_dropout(op, dropout_p)
    _check_int(op, "max_seqlen", max_seqlen)
    rows = q.shape[0] if isinstance(q, Tensor) and q.dim() > 0 else 0
    _check_local_cu_seqlens(op, cu_seqlens, rows, 2 if strategy == "zigzag" else 1)
    pg = _as_parallel_group(group)
    # Every document holds the same number of tokens on every rank: the global lengths are P times
    # the local ones, and the library shards each document by the strategy's rule.
    global_cu_seqlens = cu_seqlens * _group_size(pg, q.device)
    out, lse = parallel_attention(q, k, v, strategy, pg, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  cu_seqlens=global_cu_seqlens, return_lse=True, op=op)
    return _results(out, lse, return_attn_probs)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, softcap=0.0):
    """Ring attention over packed shards: q (T_local, Hq, D), k and v (T_local, Hkv, D); cu_seqlens the
    local (B + 1,) boundaries, each document's r-th contiguous part on rank r."""
    return _varlen("ring_flash_attn_varlen_func", "ring", q, k, v, cu_seqlens, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group, softcap)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0):
    """ring_flash_attn_varlen_func with kv (T_local, 2, Hkv, D)."""
    op = "ring_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 1, 2)
    return _varlen(op, "ring", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0):
    """ring_flash_attn_varlen_func with qkv (T_local, 3, H, D)."""
    op = "ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 1, 3)
    return _varlen(op, "ring", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None, *, softcap=0.0):
    """Zigzag ring attention over packed shards: each document cut into 2P chunks, rank r holding
    chunks r and 2P - 1 - r; every local length in cu_seqlens must be even."""
    return _varlen("zigzag_ring_flash_attn_varlen_func", "zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None, *,
                                                softcap=0.0):
    """zigzag_ring_flash_attn_varlen_func with kv (T_local, 2, Hkv, D)."""
    op = "zigzag_ring_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 1, 2)
    return _varlen(op, "zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None, *,
                                                 softcap=0.0):
    """zigzag_ring_flash_attn_varlen_func with qkv (T_local, 3, H, D)."""
    op = "zigzag_ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 1, 3)
    return _varlen(op, "zigzag", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def stripe_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0):
    """Striped attention over packed shards: rank r holds positions r, r + P, ... of every document."""
    return _varlen("stripe_flash_attn_varlen_func", "stripe", q, k, v, cu_seqlens, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group, softcap)


def stripe_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None, *,
                                           softcap=0.0):
    """stripe_flash_attn_varlen_func with kv (T_local, 2, Hkv, D)."""
    op = "stripe_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 1, 2)
    return _varlen(op, "stripe", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


def stripe_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *,
                                            softcap=0.0):
    """stripe_flash_attn_varlen_func with qkv (T_local, 3, H, D)."""
    op = "stripe_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 1, 3)
    return _varlen(op, "stripe", q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group, softcap)


# ---- llama3: the token stream cut contiguously, K/V all-gathered in head slices -------------------

def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: Tensor, causal: bool, rank: int, world_size: int):
    """What rank `rank` of `world_size` needs to attend its contiguous cut of a packed stream.

    cu_seqlens: int (B + 1,), the GLOBAL document boundaries of the whole stream, whose length must
    divide by world_size; the rank holds tokens [rank * L, (rank + 1) * L) with L = total / world_size.

    Returns (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice): the boundaries
    of the documents that meet the rank's tokens, relative to its first token (q) and to the first
    key it needs (k); their longest lengths (ints); and the slice of the all-gathered keys it needs,
    from the start of its first document to the end of its tokens (causal) or of its last document.
    Tensors keep cu_seqlens' dtype and device."""
    op = "llama3_flash_attn_prepare_cu_seqlens"
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        raise _C.InvalidArgument(f"[{op}] cu_seqlens must be a tensor of shape (B + 1,) with B >= 1, got {got}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        _check_int(op, name, value)
    if world_size < 1 or not 0 <= rank < world_size:
        raise _C.InvalidArgument(f"[{op}] rank must be in [0, world_size) with world_size >= 1, got rank {rank} "
                                 f"and world_size {world_size}")
    bounds: List[int] = cu_seqlens.tolist()
    if any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[0] != 0:
        raise _C.InvalidArgument(f"[{op}] cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
    total = bounds[-1]
    if total == 0:
        raise _C.InvalidArgument(f"[{op}] cu_seqlens must describe at least one token, got {bounds}")
    if total % world_size:
        raise _C.InvalidArgument(f"[{op}] cu_seqlens[-1] (the total length, {total}) must be divisible by "
                                 f"world_size {world_size}")
    per_rank = total // world_size
    begin, end = rank * per_rank, (rank + 1) * per_rank
    # Documents first..last meet [begin, end): `first` contains `begin` (or starts there, with any
    # empty documents that start there too), `last` is the first boundary at or after `end`.
    first = bisect.bisect_left(bounds, begin)
    if bounds[first] != begin:
        first -= 1
    last = bisect.bisect_left(bounds, end)
    inner = bounds[first:last + 1]
    q_bounds = [0] + [b - begin for b in inner[1:-1]] + [per_rank]
    k_begin = inner[0]
    k_end = end if causal else inner[-1]
    k_bounds = [b - k_begin for b in inner[:-1]] + [k_end - k_begin]

    def as_cu(values):
        return torch.tensor(values, dtype=cu_seqlens.dtype, device=cu_seqlens.device)

    def longest(values):
        return max(b - a for a, b in zip(values, values[1:]))

    return (as_cu(q_bounds), as_cu(k_bounds), longest(q_bounds), longest(k_bounds), slice(k_begin, k_end))


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# What every rank's call must agree on, in the order of the exchanged descriptor.
_AGREED = ("local tokens of q", "local tokens of k", "q heads", "k/v heads", "head_dim", "dtype",
           "heads_k_stride", "causal")
_MESSAGE_BYTES = 448  # room for one error message in a descriptor
_ERROR_KINDS = (None, _C.InvalidArgument, _C.NotSupported)


class _Llama3World:
    """The ranks of one llama3 call: rank, size and the torch.distributed group it talks over."""

    def __init__(self, op: str, pg: ParallelGroup, device):
        if pg.is_hybrid:
            raise _C.InvalidArgument(f"[{op}] group must be one process group, got a hybrid (ulysses, ring) group")
        self.group = None
        if dist.is_available() and dist.is_initialized():
            group = pg.world if pg.world is not None else dist.group.WORLD
            if dist.get_rank(group) < 0:
                raise _C.InvalidArgument(f"[{op}] this process (rank {dist.get_rank()}) is not a member of the group "
                                         f"of ranks {dist.get_process_group_ranks(group)}")
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            self.group = group if self.size > 1 else None
        elif communicator(pg.world, device) is None:
            self.rank, self.size = 0, 1
        else:
            raise _C.NotSupported(f"[{op}] llama3 attention over several processes needs torch.distributed: call "
                                  f"ringflash.distributed.setup_mpi_distributed() (or init_process_group) first")

    def agree(self, op: str, fields: List[int], error: Optional[Tuple[int, str]], device) -> None:
        """Every rank raises the same error, or none does: the first rank's own error, else the first
        field of _AGREED that differs from rank 0's."""
        if self.group is None:
            if error is not None:
                raise _ERROR_KINDS[error[0]](error[1])
            return
        kind, message = error if error is not None else (0, "")
        header = torch.tensor([kind] + fields, dtype=torch.int64).view(torch.uint8)
        text = message.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        mine = torch.cat([header, torch.frombuffer(bytearray(text), dtype=torch.uint8)]).to(device)
        everyone = torch.empty(self.size * mine.numel(), dtype=torch.uint8, device=device)
        _all_gather(everyone, mine, self.group)
        everyone = everyone.cpu().view(self.size, -1)
        headers = everyone[:, :header.numel()].contiguous().view(torch.int64)  # (P, 1 + len(_AGREED))
        for r in range(self.size):
            if headers[r, 0] != 0:
                text = bytes(everyone[r, header.numel():].tolist()).rstrip(b"\0").decode(errors="replace")
                raise _ERROR_KINDS[int(headers[r, 0])](f"{text} (on rank {r})")
        for r in range(1, self.size):
            for i, name in enumerate(_AGREED):
                a, b = int(headers[0, i + 1]), int(headers[r, i + 1])
                if a != b:
                    raise _C.InvalidArgument(f"[{op}] {name} differs across ranks: rank 0 has {_show(name, a)}, "
                                             f"rank {r} has {_show(name, b)}")

    def gathered_heads(self, k: Tensor, v: Tensor, stride: int, keys: slice):
        """Yields (h0, k_i, v_i) for the K/V heads [h0, h0 + stride): the keys `keys` of the gathered
        (P * T_local, n, D) tensors. The next slice's gather runs while the caller uses this one."""
        heads = k.shape[1]
        if self.group is None:
            for h0 in range(0, heads, stride):
                yield h0, k[keys, h0:h0 + stride], v[keys, h0:h0 + stride]
            return

        def post(h0):
            sent = [t[:, h0:h0 + stride].contiguous() for t in (k, v)]  # (T, n, D)
            bufs = [t.new_empty((self.size * t.shape[0],) + tuple(t.shape[1:])) for t in sent]  # (P * T, n, D)
            works = [_all_gather(buf, t, self.group, async_op=True) for buf, t in zip(bufs, sent)]
            return h0, bufs, works, sent

        pending = post(0)
        while pending is not None:
            h0, (k_all, v_all), works, _ = pending
            for work in works:
                work.wait()
            pending = post(h0 + stride) if h0 + stride < heads else None
            yield h0, k_all[keys], v_all[keys]

    def reduce_scatter(self, local: Tensor, full: Tensor):
        """Posts local = the sum over ranks of this rank's rows of `full`; returns the work."""
        return _reduce_scatter(local, full, self.group, async_op=True)


def _all_gather(output: Tensor, input: Tensor, group, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter(output: Tensor, input: Tensor, group, async_op: bool = False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def _dtype_code(t: Tensor) -> int:
    return _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1


def _show(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else "another dtype"
    return str(value)


def _llama3_check(op: str, world: _Llama3World, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options,
                  k_start: int, k_stop: int, heads_k_stride: int) -> Tuple[List[int], Optional[Tuple[int, str]]]:
    """This rank's descriptor fields and its own error, if any (kind 1 InvalidArgument, 2 NotSupported).
    Checks everything the kernel calls would, so that no rank fails once the transfers have begun."""
    def dim(t, i):
        return t.shape[i] if -t.dim() <= i < t.dim() else -1

    fields = [dim(q, 0), dim(k, 0), dim(q, 1), dim(k, 1), dim(q, -1), _dtype_code(q), heads_k_stride,
              int(options["causal"])]

    def invalid(message):
        return fields, (1, f"[{op}] {message}")

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            return invalid(f"{name} must have shape (T_local, H, D), got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("alibi_slopes", alibi_slopes)):
        if t is not None and t.device != q.device:
            return invalid(f"{name} must be on {q.device} like q, got {t.device}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.device not in (q.device, torch.device("cpu")):
            return invalid(f"{name} must be on {q.device} or the host, got {t.device}")
    if k.shape != v.shape:
        return invalid(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        return invalid(f"k must hold the same local tokens as q (the llama3 layout cuts q, k and v alike), got "
                       f"{k.shape[0]} and {q.shape[0]}")
    keys = world.size * k.shape[0]
    if not 0 <= k_start <= k_stop <= keys:
        return invalid(f"local_k_slice must lie within the {keys} gathered keys (world size {world.size} x "
                       f"{k.shape[0]} local tokens), got slice({k_start}, {k_stop})")
    # The kernel's own checks, on stand-ins with the shapes of the gathered keys.
    stand_in = k.new_empty((1,) + tuple(k.shape[1:])).expand(k_stop - k_start, *k.shape[1:])
    support = _C.attention_support(_detach(q), stand_in, stand_in, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, alibi_slopes=_detach(alibi_slopes),
                                   dropout_p=0.0, **options)
    if not support[0]:
        reason = support[2].replace("[attention_support]", f"[{op}]", 1)
        if "cu_seqlens_k" in reason:
            reason += f" (k and v there: the keys of local_k_slice, slice({k_start}, {k_stop}))"
        return fields, (2 if "not supported" in reason else 1, reason)
    return fields, None


def _llama3_validate(op: str, world: _Llama3World, *args) -> None:
    """Checks this rank's call (_llama3_check's arguments) and agrees on the verdict with every rank."""
    fields, error = _llama3_check(op, world, *args)
    world.agree(op, fields, error, args[0].device)


def _llama3_positions(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, q_shift: int) -> Tuple[Tensor, Tensor]:
    """Per-document positions (int32 (B,), on the host) that keep every query and key at its distance in
    the token stream: local query row i is stream row rank * T_local + i, gathered key row j is stream
    row j, and the keys of document b start at local_k_slice.start + cu_seqlens_k[b]. Only differences
    matter, so each document's keys count from 0; q_shift = rank * T_local - local_k_slice.start."""
    cu_q, cu_k = cu_seqlens_q.cpu().to(torch.int64), cu_seqlens_k.cpu().to(torch.int64)
    q_pos = (cu_q[:-1] + q_shift - cu_k[:-1]).to(torch.int32)
    return q_pos, torch.zeros_like(q_pos)


def _kernel_options(softmax_scale, causal, window_left, window_right, softcap, deterministic) -> dict:
    return dict(softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, deterministic=deterministic)


def _run_options(q: Tensor) -> dict:
    if q.device.type == "cuda":
        return dict(stream=_stream(q))
    return dict(num_threads=torch.get_num_threads())


def _slopes(alibi_slopes: Optional[Tensor], heads: slice) -> Optional[Tensor]:
    return None if alibi_slopes is None else alibi_slopes.detach()[..., heads]


_LLAMA3_OP = "llama3_flash_attn_varlen_func"


def _llama3_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    k_start: int,
    k_stop: int,
    heads_k_stride: int,
    group: int,
) -> Tuple[Tensor, Tensor]:
    """(out (T_local, Hq, D), lse float32 (Hq, T_local)) of this rank's cut of the token stream."""
    world = _Llama3World(_LLAMA3_OP, ParallelGroup._registry[group], q.device)
    options = _kernel_options(softmax_scale, causal, window_left, window_right, softcap, deterministic)
    _llama3_validate(_LLAMA3_OP, world, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, k_start, k_stop,
                     heads_k_stride)
    tokens, heads_q, _ = q.shape
    per_kv = heads_q // k.shape[1]
    q_pos, k_pos = _llama3_positions(cu_seqlens_q, cu_seqlens_k, world.rank * tokens - k_start)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads_q, tokens), dtype=torch.float32, device=q.device)
    for h0, k_i, v_i in world.gathered_heads(_detach(k), _detach(v), heads_k_stride, slice(k_start, k_stop)):
        heads = slice(h0 * per_kv, (h0 + k_i.shape[1]) * per_kv)
        _C.attention_forward(_detach(q)[:, heads], k_i, v_i, out[:, heads], lse[heads],
                             alibi_slopes=_slopes(alibi_slopes, heads), q_seq_offsets=q_pos, k_seq_offsets=k_pos,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options, **_run_options(q))
    return out, lse


llama3_varlen_forward = _custom_op(_llama3_varlen_forward)


@llama3_varlen_forward.register_fake
def _llama3_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, causal,
                                window_left, window_right, softcap, deterministic, k_start, k_stop, heads_k_stride,
                                group):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, packed=True), dtype=torch.float32)


def _llama3_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    k_start: int,
    k_stop: int,
    heads_k_stride: int,
    group: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's tokens. Each head slice's dK/dV over the gathered keys is
    accumulated in fp32 and reduce-scattered (summed) back to the ranks that own the keys."""
    world = _Llama3World(_LLAMA3_OP, ParallelGroup._registry[group], q.device)
    options = _kernel_options(softmax_scale, causal, window_left, window_right, softcap, deterministic)
    tokens, heads_q, head_dim = q.shape
    per_kv = heads_q // k.shape[1]
    q_pos, k_pos = _llama3_positions(cu_seqlens_q, cu_seqlens_k, world.rank * tokens - k_start)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    q, out, dout, lse = _detach(q), _detach(out), _detach(dout), _detach(lse)
    pending = None  # the previous slice's reduce-scatter, finished before the next one is posted

    def finish(pending):
        h0, parts, works = pending
        for work in works:
            work.wait()
        dk[:, h0:h0 + parts[0].shape[1]] = parts[0]
        dv[:, h0:h0 + parts[1].shape[1]] = parts[1]

    for h0, k_i, v_i in world.gathered_heads(_detach(k), _detach(v), heads_k_stride, slice(k_start, k_stop)):
        n = k_i.shape[1]
        heads = slice(h0 * per_kv, (h0 + n) * per_kv)
        # dK, dV over every gathered key, (P * T, n, D): the call writes rows [k_start, k_stop)
        # (overwrite_dkdv), the others are zeros.
        full = [torch.empty((world.size * tokens, n, head_dim), dtype=torch.float32, device=q.device)
                for _ in range(2)]
        for t in full:
            t[:k_start].zero_()
            t[k_stop:].zero_()
        _C.attention_backward(q[:, heads], k_i, v_i, out[:, heads], dout[:, heads], lse[heads], dq[:, heads],
                              full[0][k_start:k_stop], full[1][k_start:k_stop], accumulate=True, overwrite_dkdv=True,
                              alibi_slopes=_slopes(alibi_slopes, heads), q_seq_offsets=q_pos, k_seq_offsets=k_pos,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options, **_run_options(q))
        if world.group is None:
            dk[:, h0:h0 + n], dv[:, h0:h0 + n] = full
            continue
        if pending is not None:
            finish(pending)
        parts = [torch.empty((tokens, n, head_dim), dtype=torch.float32, device=q.device) for _ in range(2)]
        pending = (h0, parts, [world.reduce_scatter(part, f) for part, f in zip(parts, full)])
    if pending is not None:
        finish(pending)
    return dq.to(q.dtype), dk, dv


llama3_varlen_backward = _custom_op(_llama3_varlen_backward)


@llama3_varlen_backward.register_fake
def _llama3_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale,
                                 causal, window_left, window_right, softcap, deterministic, k_start, k_stop,
                                 heads_k_stride, group):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# The tensors after q, k, v: cu_seqlens_q, cu_seqlens_k, alibi_slopes.
_llama3_varlen = _register_autograd(llama3_varlen_forward, llama3_varlen_backward, num_tensors=3)


def _llama3(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
            dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
            softcap):
    _check_dropout(op, dropout_p)
    left, right = _window(op, window_size)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("heads_k_stride", heads_k_stride)):
        _check_int(op, name, value)
    if heads_k_stride < 1:
        raise _C.InvalidArgument(f"[{op}] heads_k_stride must be >= 1, got {heads_k_stride}")
    ok = isinstance(local_k_slice, slice) and local_k_slice.step in (None, 1)
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in (local_k_slice.start, local_k_slice.stop))
    if not ok:
        raise _C.InvalidArgument(f"[{op}] local_k_slice must be a slice(start, stop) of ints, as "
                                 f"llama3_flash_attn_prepare_cu_seqlens returns it, got {local_k_slice!r}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise _C.InvalidArgument(f"[{op}] {name} must be an int32 tensor, got {type(t).__name__}")
    pg = _as_parallel_group(group)
    far = [t for t in (k, v, alibi_slopes) if isinstance(t, Tensor) and t.device != q.device]
    far += [t for t in (cu_seqlens_q, cu_seqlens_k) if t.device not in (q.device, torch.device("cpu"))]
    if far:
        # The op would be dispatched by the other device (meta: its fake implementation), so the ranks
        # agree on the error here, where the others' op bodies expect the exchange.
        options = _kernel_options(softmax_scale, causal, left, right, softcap, deterministic)
        _llama3_validate(_LLAMA3_OP, _Llama3World(op, pg, q.device), q, k, v, cu_seqlens_q, cu_seqlens_k,
                         alibi_slopes, options, local_k_slice.start, local_k_slice.stop, heads_k_stride)
    out, lse = _llama3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, softmax_scale, bool(causal),
                              left, right, float(softcap), bool(deterministic), local_k_slice.start,
                              local_k_slice.stop, int(heads_k_stride), pg.handle)
    return _results(out, lse, return_attn_probs)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0):
    """Llama-3 context parallelism: q, k, v (T_local, H, D) are this rank's contiguous cut of the packed
    token stream; cu_seqlens_q, cu_seqlens_k, the max_seqlens and local_k_slice come from
    llama3_flash_attn_prepare_cu_seqlens. K/V are all-gathered heads_k_stride heads at a time."""
    return _llama3(_LLAMA3_OP, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                   local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                   return_attn_probs, group, softcap)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None, *,
                                           softcap=0.0):
    """llama3_flash_attn_varlen_func with kv (T_local, 2, Hkv, D)."""
    op = "llama3_flash_attn_varlen_kvpacked_func"
    k, v = _unpack(op, "kv", kv, 1, 2)
    return _llama3(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                   local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                   return_attn_probs, group, softcap)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *,
                                            softcap=0.0):
    """llama3_flash_attn_varlen_func with qkv (T_local, 3, H, D)."""
    op = "llama3_flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(op, "qkv", qkv, 1, 3)
    return _llama3(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                   local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                   return_attn_probs, group, softcap)


# ---- Hugging Face transformers -----------------------------------------------------------------

DATA_PARAMS = {}
"""The llama3 arguments of this rank's current batch, set by update_ring_flash_attn_params."""

_hf_state = {"enabled": True, "replaced": None}


def update_ring_flash_attn_params(cu_seqlens: Tensor, process_group) -> None:
    """Sets the batch that the attention substituted by substitute_hf_flash_attn runs on: cu_seqlens
    are the GLOBAL document boundaries of the packed stream, cut contiguously across process_group
    (llama3 layout, causal)."""
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    else:
        rank, world_size = 0, 1
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")
    DATA_PARAMS.update(zip(names, llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world_size)))


def use_ring_attn(flag: bool) -> None:
    """Switches the substituted attention between ringflash's llama3 attention (True, the default) and
    the function it replaced."""
    _hf_state["enabled"] = bool(flag)


def substitute_hf_flash_attn(process_group, heads_k_stride: int) -> None:
    """Makes transformers' "flash_attention_2" implementation run llama3_flash_attn_varlen_func on the
    batch of update_ring_flash_attn_params: every model set to attn_implementation="flash_attention_2"
    then attends across process_group, K/V gathered heads_k_stride heads at a time.

    transformers 5 replaces the entry of ALL_ATTENTION_FUNCTIONS (older releases' patch of
    modeling_flash_attention_utils._flash_attention_forward no longer reaches the models).
    transformers only lets a model select "flash_attention_2" where the flash-attn package is
    installed; elsewhere (CPU), use ringflash.hf, which registers ringflash's own implementations."""
    op = "substitute_hf_flash_attn"
    _check_int(op, "heads_k_stride", heads_k_stride)
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as e:
        raise _C.NotSupported(f"[{op}] needs transformers >= 4.48 (ALL_ATTENTION_FUNCTIONS): {e}") from None
    current = ALL_ATTENTION_FUNCTIONS.get("flash_attention_2")
    if not getattr(current, "_ringflash_substitute", False):  # keep what use_ring_attn(False) falls back to
        _hf_state["replaced"] = current
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = _hf_attention(process_group, heads_k_stride)


def _hf_attention(process_group, heads_k_stride: int):
    op = "substitute_hf_flash_attn"

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                  softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
        if not _hf_state["enabled"]:
            if _hf_state["replaced"] is None:
                raise _C.NotSupported(f"[{op}] use_ring_attn(False): transformers had no flash_attention_2 "
                                      f"implementation to fall back to")
            return _hf_state["replaced"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                         sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
                                         **kwargs)
        if not DATA_PARAMS:
            raise _C.InvalidArgument(f"[{op}] call update_ring_flash_attn_params(cu_seqlens, group) before the "
                                     f"forward pass")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            raise _C.NotSupported(f"[{op}] the substituted attention is causal (llama3 layout), got is_causal=False")
        if query.shape[0] != 1:
            raise _C.InvalidArgument(f"[{op}] the batch must be packed into one row (cu_seqlens), got batch size "
                                     f"{query.shape[0]}")
        if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.all()):
            raise _C.NotSupported(f"[{op}] padding masks are not supported: pack the documents instead")
        # (B, H, S, D) -> (S, H, D); transformers' window of `sliding_window` tokens back is flash-attn's
        # (sliding_window - 1, sliding_window - 1).
        q, k, v = (t.transpose(1, 2)[0] for t in (query, key, value))
        window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
        out = llama3_flash_attn_varlen_func(q, k, v, heads_k_stride=heads_k_stride, dropout_p=dropout,
                                            softmax_scale=scaling, causal=True, window_size=window,
                                            group=process_group, softcap=softcap or 0.0, **DATA_PARAMS)
        return out.unsqueeze(0), None  # (1, S, H, D), no attention weights

    attention._ringflash_substitute = True
    return attention
