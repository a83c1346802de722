"""yunchang's names on ringflash: USP (Ulysses inside, ring across) with its process groups.

Code written for yunchang (feifeibear/long-context-attention) switches with
``from ringflash.yunchang import ...``; names, signatures and defaults are yunchang's:

* ``set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True)``
  makes the ulysses and ring torch.distributed groups and stores them in ``PROCESS_GROUP``
  (``.ULYSSES_PG``, ``.RING_PG``). The world may hold several sequence-parallel replicas (data
  parallel): world_size must be a multiple of sp_ulysses_degree x sp_ring_degree, and replica d is
  ranks [d x sp, (d + 1) x sp). Inside a replica, with use_ulysses_low a ulysses group is
  sp_ulysses_degree consecutive ranks (rank = ring rank x U + ulysses rank); otherwise a ring group is.
* ``LongContextAttention`` and ``LongContextAttentionQKVPacked``: modules over the groups that
  ``PROCESS_GROUP`` holds when they are made. Each rank passes its shard (B, S/P, H, D) (packed:
  (B, S/P, 3, H, D)) and gets its output shard (B, S/P, H, D).
* ``UlyssesAttention``, ``AttnType`` and ``select_flash_attn_impl``, as in ``ringflash.sp_aurora``.

The shard layout is yunchang's (its ``EXTRACT_FUNC_DICT``): ``ring_impl_type`` picks the layout of
the sequence over the ring group, and each ring shard is cut contiguously among the ulysses group.
"basic": contiguous shards (with use_ulysses_low, rank r holds the r-th of P parts); "zigzag": ring
rank r holds chunks r and 2R - 1 - r of 2R; "strip" (or "stripe"): ring rank r holds positions r,
r + R, r + 2R, ... ``ringflash.shard_positions(S, "hybrid", group)`` gives a rank's positions, for
any length. Other ring_impl_type values ("basic_pytorch", NPU and flashinfer variants) raise
``NotSupported``.

Differences from yunchang:

* Every ``AttnType`` runs ringflash's exact kernels (cpu or cuda); the request is kept in
  ``.attn_type``. ``attn_processor`` must be None. ``use_sync`` and ``use_pack_qkv`` are accepted and
  change nothing (ringflash sends q, k and v in one all-to-all).
* Heads need not divide by the ulysses degree, nor lengths by P (the first ranks take one more);
  GQA and MQA work at any degree. ``dropout_p`` must be 0.
* ``return_attn_probs`` changes nothing: the modules return the output shard alone, as yunchang's do.
* Errors are ``ringflash.InvalidArgument`` / ``NotSupported``, raised on every rank, where yunchang
  asserts: degrees that do not fit the world, a rank or world_size that is not torch.distributed's,
  modules made before ``set_seq_parallel_pg``, and ulysses and ring groups that do not meet in
  exactly this rank.
"""

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from . import sp_aurora
from .parallel import ParallelGroup, parallel_attention, parallel_group
from .sp_aurora import AttnType, select_flash_attn_impl

__all__ = [
    "AttnType",
    "LongContextAttention",
    "LongContextAttentionQKVPacked",
    "PROCESS_GROUP",
    "ProcessGroupSingleton",
    "RING_IMPL_TYPES",
    "UlyssesAttention",
    "select_flash_attn_impl",
    "set_seq_parallel_pg",
]

# yunchang's ring_impl_type -> ringflash's ring layout
RING_IMPL_TYPES = {"basic": "contiguous", "zigzag": "zigzag", "strip": "stripe", "stripe": "stripe"}


class ProcessGroupSingleton:
    """The process groups of the sequence-parallel layout: ULYSSES_PG (all-to-all inside) and RING_PG
    (the ring across), torch.distributed groups set by ``set_seq_parallel_pg``."""

    def __init__(self) -> None:
        self.ULYSSES_PG: Optional[dist.ProcessGroup] = None
        self.RING_PG: Optional[dist.ProcessGroup] = None


PROCESS_GROUP = ProcessGroupSingleton()


def _check_degree(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _C.InvalidArgument(f"[{op}] {name} must be an int >= 1, got {value!r}")


def set_seq_parallel_pg(sp_ulysses_degree: int, sp_ring_degree: int, rank: int, world_size: int,
                        use_ulysses_low: bool = True) -> None:
    """Makes this rank's ulysses and ring groups and stores them in ``PROCESS_GROUP``.

    Collective: every process of the default group calls it, with the same degrees. world_size must
    be torch.distributed's world size and a multiple of sp_ulysses_degree x sp_ring_degree (the
    quotient is the number of data-parallel replicas); rank must be this process's rank."""
    op = "set_seq_parallel_pg"
    if not (dist.is_available() and dist.is_initialized()):
        raise _C.InvalidArgument(f"[{op}] torch.distributed must be initialised first")
    _check_degree(op, "sp_ulysses_degree", sp_ulysses_degree)
    _check_degree(op, "sp_ring_degree", sp_ring_degree)
    if world_size != dist.get_world_size():
        raise _C.InvalidArgument(f"[{op}] world_size must be torch.distributed's world size "
                                 f"{dist.get_world_size()}, got {world_size!r}")
    if rank != dist.get_rank():
        raise _C.InvalidArgument(f"[{op}] rank must be this process's rank {dist.get_rank()}, got {rank!r}")
    sp = sp_ulysses_degree * sp_ring_degree
    if world_size % sp != 0:
        raise _C.InvalidArgument(f"[{op}] sp_ulysses_degree x sp_ring_degree must divide the world size "
                                 f"{world_size}, got {sp_ulysses_degree} x {sp_ring_degree} = {sp}")
    # Inside a replica of sp ranks: with use_ulysses_low, ulysses groups are runs of U consecutive
    # ranks and ring groups stride U; otherwise ring groups are runs of R and ulysses groups stride R.
    if use_ulysses_low:
        ulysses_sets = [[i * sp_ulysses_degree + u for u in range(sp_ulysses_degree)] for i in range(sp_ring_degree)]
        ring_sets = [list(range(i, sp, sp_ulysses_degree)) for i in range(sp_ulysses_degree)]
    else:
        ring_sets = [[i * sp_ring_degree + r for r in range(sp_ring_degree)] for i in range(sp_ulysses_degree)]
        ulysses_sets = [list(range(i, sp, sp_ring_degree)) for i in range(sp_ring_degree)]
    ulysses_pg = ring_pg = None
    for offset in range(0, world_size, sp):  # every process makes every group, in the same order
        for ranks in ulysses_sets:
            group = dist.new_group([offset + r for r in ranks])
            if rank - offset in ranks:
                ulysses_pg = group
        for ranks in ring_sets:
            group = dist.new_group([offset + r for r in ranks])
            if rank - offset in ranks:
                ring_pg = group
    PROCESS_GROUP.ULYSSES_PG = ulysses_pg
    PROCESS_GROUP.RING_PG = ring_pg


def _ring_layout(op: str, ring_impl_type: str) -> str:
    if ring_impl_type not in RING_IMPL_TYPES:
        raise _C.NotSupported(f"[{op}] ring_impl_type must be one of {', '.join(RING_IMPL_TYPES)}, "
                              f"got {ring_impl_type!r}")
    return RING_IMPL_TYPES[ring_impl_type]


def _hybrid_group(op: str, ring_impl_type: str) -> ParallelGroup:
    """The ParallelGroup of PROCESS_GROUP's groups, checked on this rank alone (no messages): a
    group missing is the default group, as in yunchang, and the two must meet in exactly this rank."""
    layout = _ring_layout(op, ring_impl_type)
    ulysses, ring = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
    if ulysses is None and ring is None:
        raise _C.InvalidArgument(f"[{op}] call set_seq_parallel_pg() first: PROCESS_GROUP.ULYSSES_PG and "
                                 f"PROCESS_GROUP.RING_PG are None")
    if not (dist.is_available() and dist.is_initialized()):
        raise _C.InvalidArgument(f"[{op}] torch.distributed must be initialised first")
    ulysses = ulysses if ulysses is not None else dist.group.WORLD
    ring = ring if ring is not None else dist.group.WORLD
    me = dist.get_rank()
    ranks = {}
    for name, group in (("ULYSSES_PG", ulysses), ("RING_PG", ring)):
        ranks[name] = dist.get_process_group_ranks(group)
        if me not in ranks[name]:
            raise _C.InvalidArgument(f"[{op}] PROCESS_GROUP.{name} must hold this rank {me}, got ranks {ranks[name]}")
    shared = sorted(set(ranks["ULYSSES_PG"]) & set(ranks["RING_PG"]))
    if shared != [me]:
        raise _C.InvalidArgument(f"[{op}] PROCESS_GROUP.ULYSSES_PG and RING_PG must share only this rank {me}, got "
                                 f"ranks {ranks['ULYSSES_PG']} and {ranks['RING_PG']}")
    return parallel_group(ulysses=ulysses, ring=ring, ring_layout=layout)


class LongContextAttention(torch.nn.Module):
    """USP attention over ``PROCESS_GROUP``'s groups, as they are when the module is made.

    scatter_idx and gather_idx must be 2 and 1 (shards (B, S/P, H, D)). ring_impl_type: "basic",
    "zigzag" or "strip"/"stripe", the layout of the input shards (module docstring). use_pack_qkv and
    use_sync change nothing; attn_type is recorded; attn_processor must be None."""

    def __init__(
        self,
        scatter_idx: int = 2,
        gather_idx: int = 1,
        ring_impl_type: str = "basic",
        use_pack_qkv: bool = False,
        use_sync: bool = False,
        attn_type: AttnType = AttnType.FA,
        attn_processor: Optional[torch.nn.Module] = None,
    ) -> None:
        super().__init__()
        op = type(self).__name__
        sp_aurora._check_all_to_all_dims(op, scatter_idx, gather_idx, (2, 1))
        if attn_processor is not None:
            raise _C.NotSupported(f"[{op}] attn_processor must be None (ringflash runs its own kernels), "
                                  f"got {type(attn_processor).__name__}")
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.ring_impl_type = ring_impl_type
        self.use_pack_qkv = use_pack_qkv
        self.use_sync = use_sync
        self.attn_type = sp_aurora._attn_type(op, attn_type)
        self.attn_processor = None
        self._group = _hybrid_group(op, ring_impl_type)
        self.ulysses_pg, self.ring_pg = self._group.ulysses, self._group.ring

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        *args: Any,
    ) -> Tensor:
        """query (B, S/P, Hq, D), key and value (B, S/P, Hkv, D) -> out (B, S/P, Hq, D). Options as
        in flash_attn_func, with global positions; extra positional arguments are ignored."""
        return parallel_attention(query, key, value, "hybrid", self._group, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, dropout_p=dropout_p, op=type(self).__name__)


class LongContextAttentionQKVPacked(torch.nn.Module):
    """LongContextAttention on a packed qkv (B, S/P, 3, H, D); scatter_idx and gather_idx must be 3
    and 1 (yunchang's defaults for this layout)."""

    def __init__(
        self,
        scatter_idx: int = 3,
        gather_idx: int = 1,
        ring_impl_type: str = "basic",
        use_sync: bool = False,
        attn_type: AttnType = AttnType.FA,
    ) -> None:
        super().__init__()
        op = type(self).__name__
        sp_aurora._check_all_to_all_dims(op, scatter_idx, gather_idx, (3, 1))
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.ring_impl_type = ring_impl_type
        self.use_sync = use_sync
        self.attn_type = sp_aurora._attn_type(op, attn_type)
        self._group = _hybrid_group(op, ring_impl_type)
        self.ulysses_pg, self.ring_pg = self._group.ulysses, self._group.ring

    def forward(
        self,
        qkv: Tensor,
        dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        *args: Any,
    ) -> Tensor:
        """qkv (B, S/P, 3, H, D) -> out (B, S/P, H, D)."""
        op = type(self).__name__
        q, k, v = sp_aurora._unpack(op, "qkv", qkv, 3)
        return parallel_attention(q, k, v, "hybrid", self._group, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, op=op)


class UlyssesAttention(sp_aurora.UlyssesAttention):
    """``ringflash.sp_aurora.UlyssesAttention`` with yunchang's default attn_type (FA)."""

    def __init__(
        self,
        sequence_process_group: Optional[dist.ProcessGroup] = None,
        scatter_idx: int = 2,
        gather_idx: int = 1,
        use_sync: bool = False,
        attn_type: AttnType = AttnType.FA,
    ) -> None:
        super().__init__(sequence_process_group, scatter_idx, gather_idx, use_sync, attn_type)
