"""Sequence-parallel attention: the strategies of the C++ library as torch custom ops.

``parallel_attention(q, k, v, strategy, group)`` is the one entry point that the drop-in modules
(``ring_flash_attn``, ``sp_aurora``, ``yunchang``, ``hf``) build on. Every rank of the group calls it
with its own shard of the sequence, in the strategy's layout (``shard_positions`` says which global
positions a rank holds):

* ``ring``, ``allgather``, ``ulysses``: contiguous shards, rank r holding the r-th of P parts;
* ``zigzag``: the sequence cut into 2P chunks, rank r holding chunks r and 2P - 1 - r;
* ``stripe``: rank r holding positions r, r + P, r + 2P, ...;
* ``hybrid``: the ring layout over the ring group, each ring shard then cut contiguously among
  the ulysses group.

When the length does not divide by P (or 2P), the first ranks hold one row more. Packed batches
shard every sequence on its own; ``cu_seqlens`` are then the GLOBAL cumulative lengths, the same
on every rank, and each rank's tensors hold sequence 0's shard, then sequence 1's, and so on.

The ops are ``torch.ops.ringflash.parallel_forward`` and ``parallel_backward``, with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces them. A group is passed
to them as an int handle (``ParallelGroup.handle``).

On two ranks, ring, zigzag and stripe keep the K/V that the forward receives for the backward (a
buffer as large as the rank's own K/V, held between the passes as the forward's inputs are), so
that the backward does not receive them again; ``keep_kv=False`` gives that memory back.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from .distributed import communicator
from .interface import _window
from .ops import _custom_op, _detach, _empty_outputs, _lse_shape, _register_autograd, _stream

__all__ = [
    "ParallelGroup",
    "STRATEGIES",
    "init_process_groups",
    "parallel_attention",
    "parallel_group",
    "shard_positions",
]

STRATEGIES = ("ring", "zigzag", "stripe", "allgather", "ulysses", "hybrid")
_KEEPING = ("ring", "zigzag", "stripe")  # the strategies that can keep the forward's K/V
_RING_LAYOUTS = {"ring": "contiguous", "basic": "contiguous", "contiguous": "contiguous", "zigzag": "zigzag",
                 "stripe": "stripe", "strip": "stripe"}


class ParallelGroup:
    """The ranks that share one sequence, as the strategies need them: ``world`` for every strategy
    but hybrid, ``ulysses`` and ``ring`` for hybrid (torch.distributed groups, None for the default
    group). Made by ``parallel_group``."""

    _registry: List["ParallelGroup"] = []

    def __init__(self, world=None, ulysses=None, ring=None, ring_layout: str = "zigzag"):
        if ring_layout not in _RING_LAYOUTS:
            raise _C.InvalidArgument(f"[parallel_group] ring_layout must be one of {', '.join(_RING_LAYOUTS)}, "
                                     f"got {ring_layout!r}")
        if (ulysses is None) != (ring is None):
            raise _C.InvalidArgument("[parallel_group] ulysses and ring must be given together (hybrid), got one")
        self.world, self.ulysses, self.ring = world, ulysses, ring
        self.ring_layout = _RING_LAYOUTS[ring_layout]
        self.handle = len(ParallelGroup._registry)
        ParallelGroup._registry.append(self)

    @property
    def is_hybrid(self) -> bool:
        return self.ulysses is not None

    def communicators(self, device) -> Tuple[Optional["_C.Communicator"], ...]:
        """(world, ulysses, ring) ringflash communicators for tensors on ``device`` (made once, then
        cached by ringflash.distributed); None where there is nothing to send."""
        if self.is_hybrid:
            return None, communicator(self.ulysses, device), communicator(self.ring, device)
        return communicator(self.world, device), None, None

    def size(self, device="cpu") -> int:
        return math.prod(c.size for c in self.communicators(device) if c is not None)


_groups: Dict[tuple, ParallelGroup] = {}


def parallel_group(group=None, ulysses=None, ring=None, ring_layout: str = "zigzag") -> ParallelGroup:
    """The ParallelGroup of a torch.distributed group (None: the default group), or of a pair of
    ulysses and ring groups for hybrid; made once per argument set."""
    key = (group, ulysses, ring, ring_layout)
    if key not in _groups:
        _groups[key] = ParallelGroup(group, ulysses, ring, ring_layout)
    return _groups[key]


def init_process_groups(ulysses_degree: int, ring_degree: int, use_ulysses_low: bool = True,
                        ring_layout: str = "zigzag") -> ParallelGroup:
    """The 2D layout of ranks for ``hybrid``: torch.distributed groups of ``ulysses_degree`` ranks
    (all-to-all inside) and of ``ring_degree`` ranks (the ring across), from the default group,
    whose size must be their product. With ``use_ulysses_low`` (the default, as in yunchang) a
    ulysses group is ``ulysses_degree`` consecutive ranks; otherwise a ring group is.

    Collective: every process of the default group calls it, with the same arguments. Returns the
    ParallelGroup of this rank's two groups, which ``parallel_attention(..., "hybrid", group)`` takes."""
    op = "init_process_groups"
    if not (dist.is_available() and dist.is_initialized()):
        raise _C.InvalidArgument(f"[{op}] torch.distributed must be initialised first")
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _C.InvalidArgument(f"[{op}] {name} must be an int >= 1, got {value!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    if ulysses_degree * ring_degree != world:
        raise _C.InvalidArgument(f"[{op}] ulysses_degree x ring_degree must be the world size {world}, got "
                                 f"{ulysses_degree} x {ring_degree}")
    ulysses_pg = ring_pg = None
    if use_ulysses_low:
        ulysses_sets = [list(range(i * ulysses_degree, (i + 1) * ulysses_degree)) for i in range(ring_degree)]
        ring_sets = [list(range(i, world, ulysses_degree)) for i in range(ulysses_degree)]
    else:
        ring_sets = [list(range(i * ring_degree, (i + 1) * ring_degree)) for i in range(ulysses_degree)]
        ulysses_sets = [list(range(i, world, ring_degree)) for i in range(ring_degree)]
    for ranks in ulysses_sets:  # every process makes every group, in the same order
        pg = dist.new_group(ranks)
        if rank in ranks:
            ulysses_pg = pg
    for ranks in ring_sets:
        pg = dist.new_group(ranks)
        if rank in ranks:
            ring_pg = pg
    return parallel_group(ulysses=ulysses_pg, ring=ring_pg, ring_layout=ring_layout)


@torch.compiler.assume_constant_result
def _world_size(handle: int) -> int:
    """The number of ranks of a non-hybrid ParallelGroup (0 for hybrid), read eagerly while tracing."""
    pg = ParallelGroup._registry[handle]
    return 0 if pg.is_hybrid or not dist.is_initialized() else dist.get_world_size(pg.world)


@torch.compiler.assume_constant_result
def _handle(group) -> int:
    """parallel_group(group).handle, run eagerly even while torch.compile traces the caller: the
    group must be registered before the traced op runs (a traced registration would happen after).
    While tracing, a process group arrives wrapped as a fake object; the group is the real one."""
    if type(group).__name__ == "FakeScriptObject":
        group = object.__getattribute__(group, "real_obj")
    return parallel_group(group).handle


def _group_kwargs(strategy: str, group: ParallelGroup, device) -> Optional[dict]:
    """The group arguments of _C.parallel_forward/backward/shard, or None when the group is a single
    rank (nothing to send: the single-device kernels run)."""
    world, ulysses, ring = group.communicators(device)
    if math.prod(c.size for c in (world, ulysses, ring) if c is not None) == 1:
        return None
    if strategy == "hybrid" and not group.is_hybrid:
        raise _C.InvalidArgument("[parallel_attention] strategy 'hybrid' needs a group with ulysses and ring groups "
                                 "(parallel_group(ulysses=..., ring=...) or init_process_groups), got one group")
    if strategy != "hybrid" and group.is_hybrid:
        raise _C.InvalidArgument(f"[parallel_attention] strategy {strategy!r} needs one group, got a hybrid group")
    return {"strategy": strategy, "world": world, "ulysses": ulysses, "ring": ring,
            "hybrid_ring_layout": group.ring_layout}


def _check_dropout(op: str, dropout_p) -> None:
    if dropout_p != 0.0:
        raise _C.NotSupported(f"[{op}] dropout_p must be 0 (dropout is not supported), got {dropout_p}")


def shard_positions(seqlen: int, strategy: str = "zigzag", group: Optional[ParallelGroup] = None,
                    device="cpu") -> Tensor:
    """The global positions (int64, in local order) that this rank holds of a sequence of ``seqlen``
    tokens under ``strategy``. Index a full sequence with it to get this rank's shard."""
    group = group if group is not None else parallel_group()
    if strategy not in STRATEGIES:
        raise _C.InvalidArgument(f"[shard_positions] strategy must be one of {', '.join(STRATEGIES)}, "
                                 f"got {strategy!r}")
    kwargs = _group_kwargs(strategy, group, device)
    if kwargs is None:
        return torch.arange(seqlen)
    pieces = _C.parallel_shard(seqlen, **kwargs)
    parts = [torch.arange(count) * stride + start for start, count, stride in pieces]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _options(cu_seqlens, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, q, parallel):
    """The keyword arguments of _C's calls. A strategy plans its shards from the global cu_seqlens on
    the host (a copy from the GPU waits for it); the single-device kernels read them on q's device."""
    if cu_seqlens is not None and parallel:
        cu_seqlens = cu_seqlens.cpu()
    return dict(softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, alibi_slopes=_detach(alibi_slopes), cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens, num_threads=torch.get_num_threads() if q.device.type == "cpu" else 0,
                stream=_stream(q))


def _kept_buffer(k: Tensor, cu_seqlens: Optional[Tensor], keep_kv: bool) -> Tensor:
    """Room for the K and V of the other rank of a ring of two steps (ParallelOptions::kept_kv in
    the C++ library): its rows are at most this rank's plus 2 per sequence. Empty without keep_kv."""
    if not keep_kv:
        return k.new_empty(0)
    sequences = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    rows = (k.shape[0] if cu_seqlens is not None else k.shape[1]) + 2 * sequences
    batch = 1 if cu_seqlens is not None else k.shape[0]
    return k.new_empty(2 * batch * rows * k.shape[-2] * k.shape[-1])


def _parallel_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    strategy: str,
    group: int,
    kv_heads_per_gather: int,
    keep_kv: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(out, lse, kept) of this rank's query shard, kept being the K/V received for the backward
    (empty unless keep_kv); see the module docstring."""
    pg = ParallelGroup._registry[group]
    out, lse = _empty_outputs(q, packed=cu_seqlens is not None)
    kept = _kept_buffer(k, cu_seqlens, keep_kv)
    kwargs = _group_kwargs(strategy, pg, q.device)
    options = _options(cu_seqlens, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, q,
                       kwargs is not None)
    if kwargs is None:
        _C.attention_forward(_detach(q), _detach(k), _detach(v), out, lse, **options)
    else:
        _C.parallel_forward(_detach(q), _detach(k), _detach(v), out, lse, kv_heads_per_gather=kv_heads_per_gather,
                            kept_kv=kept if keep_kv else None, **kwargs, **options)
    return out, lse, kept


parallel_forward = _custom_op(_parallel_forward)


@parallel_forward.register_fake
def _parallel_forward_fake(q, k, v, cu_seqlens, alibi_slopes, softmax_scale, causal, window_left, window_right,
                           softcap, strategy, group, kv_heads_per_gather, keep_kv):
    return (torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens is not None), dtype=torch.float32),
            _kept_buffer(k, cu_seqlens, keep_kv))


def _parallel_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kept: Tensor,
    cu_seqlens: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    strategy: str,
    group: int,
    kv_heads_per_gather: int,
    keep_kv: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, for the forward with the same arguments (and its kept)."""
    pg = ParallelGroup._registry[group]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    tensors = (_detach(q), _detach(k), _detach(v), _detach(out), _detach(dout), _detach(lse), dq, dk, dv)
    kwargs = _group_kwargs(strategy, pg, q.device)
    options = _options(cu_seqlens, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, q,
                       kwargs is not None)
    if kwargs is None:
        _C.attention_backward(*tensors, **options)
    else:
        _C.parallel_backward(*tensors, kv_heads_per_gather=kv_heads_per_gather,
                             kept_kv=_detach(kept) if keep_kv else None, **kwargs, **options)
    return dq, dk, dv


parallel_backward = _custom_op(_parallel_backward)


@parallel_backward.register_fake
def _parallel_backward_fake(dout, q, k, v, out, lse, kept, cu_seqlens, alibi_slopes, softmax_scale, causal,
                            window_left, window_right, softcap, strategy, group, kv_heads_per_gather, keep_kv):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_parallel = _register_autograd(parallel_forward, parallel_backward, num_tensors=2)  # cu_seqlens, alibi_slopes


def parallel_attention(q: Tensor, k: Tensor, v: Tensor, strategy: str = "zigzag", group=None, *,
                       causal: bool = False, softmax_scale: Optional[float] = None,
                       window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                       dropout_p: float = 0.0, kv_heads_per_gather: int = 0, return_lse: bool = False,
                       keep_kv: bool = True, op: str = "parallel_attention"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q (B, S_local, Hq, D), k and v (B, S_local, Hkv, D), each rank's shard in ``strategy``'s layout;
    or, with ``cu_seqlens`` (int32 (B + 1,), the GLOBAL cumulative lengths), packed shards
    (T_local, H, D). ``group`` is a ParallelGroup, a torch.distributed group, or None (the default
    group). Options as in flash_attn_func; causal masks and windows use global positions.
    ``kv_heads_per_gather`` (allgather) bounds the K/V heads gathered at a time (0: all).
    ``keep_kv`` (ring, zigzag and stripe on two ranks, when a gradient is wanted) keeps the K/V that
    the forward receives for the backward, which then does not receive them again.
    Returns out like q, and with ``return_lse`` also the float32 lse, (B, Hq, S_local) or
    (Hq, T_local). Gradients flow to q, k and v."""
    if strategy not in STRATEGIES:
        raise _C.InvalidArgument(f"[{op}] strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    _check_dropout(op, dropout_p)
    handle = group.handle if isinstance(group, ParallelGroup) else _handle(group)
    left, right = _window(op, window_size)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise _C.InvalidArgument(f"[{op}] {name} must be on {q.device} like q, got {t.device}")
    keep = bool(keep_kv) and strategy in _KEEPING and _world_size(handle) == 2 and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v))
    out, lse, _ = _parallel(q, k, v, cu_seqlens, alibi_slopes, softmax_scale, bool(causal), left, right,
                            float(softcap), strategy, handle, int(kv_heads_per_gather), keep)
    return (out, lse) if return_lse else out
