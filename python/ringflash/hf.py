"""Hugging Face transformers: ringflash attention inside stock models, and long-context training.

Importing this module registers one attention implementation per strategy with transformers'
``AttentionInterface`` (and a mask hook with ``AttentionMaskInterface``):

================== =============================================================
name               attention
================== =============================================================
``ringattn``       one device, no sequence parallelism (``flash_attn_func``)
``ringattn_ring``  ``parallel_attention(..., "ring")``; likewise ``_zigzag``,
                   ``_stripe``, ``_allgather``, ``_ulysses`` and ``_hybrid``
================== =============================================================

The names do not contain "flash": transformers 5.x takes any implementation whose name contains
"flash" for a Flash Attention kernel to load from the hub, and refuses it. Pick one with

    model = AutoModelForCausalLM.from_config(config, attn_implementation="ringattn_zigzag")
    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation="ringattn_zigzag"))
    model.set_attn_implementation("ringattn_zigzag")     # or ringflash.hf.apply(model, "zigzag")

or ``from_pretrained(..., attn_implementation=...)``. (``LlamaForCausalLM(config,
attn_implementation=...)`` is not a transformers 5.23 signature.)

Training on a sequence split across the ranks of a group, each rank holding the same global batch:

    local = ringflash.hf.shard_batch(batch, "zigzag", group)      # this rank's tokens
    labels = local.pop("shift_labels")
    logits = model(**local, use_cache=False).logits               # (B, S_local, V)
    loss = ringflash.hf.sequence_parallel_loss(logits, labels)    # the global mean, on every rank
    loss.backward()
    ringflash.hf.all_reduce_gradients(model)                      # sum over the group
    optimizer.step()

``shard_batch`` keeps the global layout of the batch (strategy, group, document boundaries) in a
module-level ``Sharding`` that the attention layers read, as ring-flash-attn's
``update_ring_flash_attn_params`` does: a layer sees only its rank's tokens and could not find the
global ``cu_seqlens`` by itself. ``update_sharding`` sets it without sharding anything, for data
that is already sharded. The sharded ``position_ids`` hold every token's global position, which
rotary embeddings need; pass them to the model.

Documents packed into one row are told apart by ``position_ids``: a document starts wherever a
position is not its predecessor + 1 (a reset to 0, as packing collators write them), the rule that
transformers' own masks use. Each document is sharded on its own (``parallel_attention``'s packed
layout). Rows of a batch must share their document boundaries; pack documents into one row
otherwise.

The loss is computed on the local logits, not on gathered ones: labels are shifted on the global
sequence before sharding (``shift_labels``: token t is trained to predict token t + 1), each rank
sums the losses of its tokens, and one all-reduce of (sum, count) gives the global mean. Gathering
logits would cost every rank a (S, V) tensor. The returned loss has the global value and the
gradient of this rank's share, so after ``all_reduce_gradients`` (a sum over the group) every
parameter gradient equals the single-process one. Cross-document targets follow transformers:
the last token of a document predicts the first of the next unless its label is -100 (as
``DataCollatorWithFlattening`` writes them).

Supported: causal and non-causal attention, GQA/MQA (K/V keep their own heads, never repeated),
sliding windows (``sliding_window``), softcap, custom scaling. Refused with ``NotSupported``:
padding or custom attention masks, attention sinks (``s_aux``), position biases, dropout, and a
KV cache under sequence parallelism (``ringattn`` alone supports generation with a cache).
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import _C
from .interface import flash_attn_func, flash_attn_varlen_func
from .parallel import STRATEGIES, ParallelGroup, parallel_attention, parallel_group, shard_positions

__all__ = [
    "IMPLEMENTATIONS",
    "Sharding",
    "all_reduce_gradients",
    "apply",
    "current_sharding",
    "cu_seqlens_from_position_ids",
    "gather_sequence",
    "implementation",
    "register",
    "sequence_parallel_loss",
    "shard_batch",
    "shift_labels",
    "update_sharding",
]

_PREFIX = "ringattn"
IGNORE_INDEX = -100  # transformers' label for "no target"

IMPLEMENTATIONS: Dict[Optional[str], str] = {None: _PREFIX, **{s: f"{_PREFIX}_{s}" for s in STRATEGIES}}
"""The attention implementation registered for each strategy (None: single device)."""


def implementation(strategy: Optional[str] = None) -> str:
    """The ``attn_implementation`` name of ``strategy`` (None: single device, no sequence parallelism)."""
    if strategy not in IMPLEMENTATIONS:
        raise _C.InvalidArgument(f"[ringflash.hf.implementation] strategy must be None or one of "
                                 f"{', '.join(STRATEGIES)}, got {strategy!r}")
    return IMPLEMENTATIONS[strategy]


def apply(model, strategy: Optional[str] = None):
    """Switches ``model`` (a transformers PreTrainedModel) to ringflash attention with ``strategy``
    (None: single device) and returns it. Raises ``NotSupported`` when the model does not route its
    attention through transformers' AttentionInterface."""
    name = implementation(strategy)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise _C.NotSupported(f"[ringflash.hf.apply] {type(model).__name__} kept attn_implementation "
                              f"{model.config._attn_implementation!r}: it does not call transformers' "
                              f"AttentionInterface, so {name!r} cannot be set")
    return model


# ---------------------------------------------------------------------------------------------
# The global layout of the batch the model is running on


@dataclass
class Sharding:
    """How a global batch of ``batch_size`` rows of ``seqlen`` tokens is split across ``group``.

    ``positions`` (int64) are the indices within a row that this rank holds, in local order; every
    row is split alike. ``cu_seqlens`` (int32, CPU) are the GLOBAL cumulative document lengths
    over all rows (row 0's documents, then row 1's, ...), or None when every row is one document."""

    strategy: str
    group: ParallelGroup
    batch_size: int
    seqlen: int
    positions: Tensor
    cu_seqlens: Optional[Tensor]

    @property
    def local_len(self) -> int:
        return int(self.positions.numel())

    def shard(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a global (B, S, ...) tensor: the rows ``positions`` of ``dim``."""
        if t.shape[dim] != self.seqlen:
            raise _C.InvalidArgument(f"[ringflash.hf.shard] dim {dim} must have the global length {self.seqlen}, "
                                     f"got shape {tuple(t.shape)}")
        return t.index_select(dim, self.positions.to(t.device))

    def gather(self, local: Tensor, dim: int = 1) -> Tensor:
        """The global tensor from every rank's ``shard``: the inverse of ``shard``, on every rank.
        Detached (no gradient); a collective over the group."""
        if local.shape[dim] != self.local_len:
            raise _C.InvalidArgument(f"[ringflash.hf.gather] dim {dim} must have this rank's length "
                                     f"{self.local_len}, got shape {tuple(local.shape)}")
        rows = local.detach().movedim(dim, 0)                     # (S_local, ...)
        all_rows, all_positions = _all_gather_rows(rows, self.positions.to(local.device), self.group)
        out = rows.new_empty((self.seqlen, *rows.shape[1:]))
        out[all_positions] = all_rows                             # (S, ...) in global order
        return out.movedim(0, dim)


_current: Optional[Sharding] = None


def current_sharding() -> Optional[Sharding]:
    """The Sharding that the attention layers use now (set by shard_batch / update_sharding)."""
    return _current


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Cumulative document lengths (int32, on position_ids' device) over the rows of a (B, S) or
    (S,) ``position_ids``, flattened row after row: a document starts at every row start and
    wherever a position is not its predecessor + 1."""
    pos = _rows(position_ids, "cu_seqlens_from_position_ids", "position_ids")
    batch, seqlen = pos.shape
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat_starts = starts.reshape(-1).nonzero().flatten()
    total = torch.tensor([batch * seqlen], device=pos.device)
    return torch.cat([flat_starts, total]).to(torch.int32)


def _rows(position_ids: Tensor, op: str, name: str) -> Tensor:
    if not isinstance(position_ids, Tensor) or position_ids.dim() not in (1, 2):
        got = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids).__name__
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] {name} must be a (B, S) or (S,) tensor, got {got}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] {name} must hold integers, got {position_ids.dtype}")
    return position_ids.reshape(1, -1) if position_ids.dim() == 1 else position_ids


def _group(strategy: str, group, op: str) -> ParallelGroup:
    if strategy not in STRATEGIES:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] strategy must be one of {', '.join(STRATEGIES)}, "
                                 f"got {strategy!r}")
    if isinstance(group, ParallelGroup):
        pg = group
    else:
        pg = parallel_group(group)
    if strategy == "hybrid" and not pg.is_hybrid:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] strategy 'hybrid' needs the group of "
                                 f"ringflash.parallel.init_process_groups(ulysses_degree, ring_degree), got {group!r}")
    if strategy != "hybrid" and pg.is_hybrid:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] strategy {strategy!r} needs one group, got a hybrid group")
    return pg


def update_sharding(position_ids: Tensor, strategy: str = "zigzag", group=None) -> Sharding:
    """Sets the layout that the attention layers use from the GLOBAL ``position_ids`` (B, S) of the
    batch, the same on every rank, and returns it. ``group``: a ParallelGroup (for hybrid, the one
    of ``init_process_groups``), a torch.distributed group or None (the default group).

    Collective: every rank of the group calls it. Raises ``InvalidArgument`` on every rank when the
    ranks' batches differ in shape, when rows do not share document boundaries, or when a rank
    would hold no token (S smaller than the number of ranks)."""
    global _current
    op = "update_sharding"
    pg = _group(strategy, group, op)
    pos = _rows(position_ids, op, "position_ids").cpu()
    batch, seqlen = pos.shape
    if batch < 1 or seqlen < 1:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] position_ids must hold at least one token, got shape "
                                 f"{tuple(pos.shape)}")
    cu_rows = cu_seqlens_from_position_ids(pos)
    starts_per_row = (cu_rows[:-1].long() % seqlen).tolist()
    doc_starts = sorted(set(starts_per_row))
    if len(starts_per_row) != batch * len(doc_starts):
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] the rows of position_ids must start documents at the same "
                                 f"places (every row is sharded alike); pack the documents into one row instead")
    bounds = doc_starts + [seqlen]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if len(lengths) == 1:
        positions, cu_seqlens = shard_positions(seqlen, strategy, pg), None
    else:
        positions = torch.cat([shard_positions(n, strategy, pg) + start for start, n in zip(doc_starts, lengths)])
        cu_seqlens = torch.tensor([0] + lengths * batch, dtype=torch.int64).cumsum(0).to(torch.int32)
    size = pg.size()
    if _distributed(pg, op):
        # One all-reduce (max) checks that every rank has the same batch shape and holds a token.
        mine = torch.tensor([seqlen, -seqlen, batch, -batch, -positions.numel()], dtype=torch.int64)
        seen = _all_reduce(mine.clone(), pg, dist.ReduceOp.MAX)
        if seen[0] != -seen[1] or seen[2] != -seen[3]:
            raise _C.InvalidArgument(f"[ringflash.hf.{op}] every rank must pass the same global batch: sequence "
                                     f"lengths {int(-seen[1])}..{int(seen[0])} and batch sizes "
                                     f"{int(-seen[3])}..{int(seen[2])} across the group, this rank (B, S) = "
                                     f"({batch}, {seqlen})")
        if seen[4] >= 0:
            raise _C.InvalidArgument(f"[ringflash.hf.{op}] a sequence of {seqlen} tokens in {len(lengths)} "
                                     f"document(s) cannot be sharded over {size} ranks with {strategy!r}: a rank "
                                     f"would hold no token, and transformers models cannot run on none (every "
                                     f"document is split on its own; give each rank at least one token)")
    _current = Sharding(strategy, pg, batch, seqlen, positions, cu_seqlens)
    return _current


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Causal-LM targets on the global sequence: out[..., t] = labels[..., t + 1], and
    ``ignore_index`` for the last token (transformers' ForCausalLMLoss shift)."""
    if not isinstance(labels, Tensor) or labels.dim() < 1:
        raise _C.InvalidArgument(f"[ringflash.hf.shift_labels] labels must be a (B, S) tensor, got {labels!r}")
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def shard_batch(batch: Dict[str, object], strategy: str = "zigzag", group=None) -> Dict[str, object]:
    """This rank's part of a global ``batch`` (the same dict on every rank), ready for ``model(**out)``.

    ``input_ids`` (B, S) (or ``inputs_embeds`` (B, S, E)) is required; ``position_ids`` default to
    0..S-1 per row and are always returned, sharded (the model needs the global positions).
    ``labels`` are shifted on the global sequence (``shift_labels``) and returned sharded as
    ``shift_labels``, for ``sequence_parallel_loss``; ``shift_labels`` given instead are sharded as
    they are. An ``attention_mask`` of ones is dropped; one with padding raises ``NotSupported``.
    Other tensors of shape (B, S, ...) are sharded; anything else is passed through.

    Collective (see ``update_sharding``, which it calls)."""
    op = "shard_batch"
    if not isinstance(batch, dict):
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] batch must be a dict, got {type(batch).__name__}")
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(tokens, Tensor) or tokens.dim() < 2:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] batch['input_ids'] must be a (B, S) tensor (or "
                                 f"inputs_embeds (B, S, E)), got {tokens if tokens is None else tuple(tokens.shape)}")
    shape = tuple(tokens.shape[:2])
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise _C.NotSupported(f"[ringflash.hf.{op}] attention_mask must be all ones: padding cannot be sharded; "
                              f"pack the documents into one row with position_ids restarting at 0 instead")
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(shape[1], device=tokens.device).expand(shape)
    position_ids = _rows(position_ids, op, "position_ids")
    if tuple(position_ids.shape) != shape and not (position_ids.shape[0] == 1 and position_ids.shape[1] == shape[1]):
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] position_ids must have shape {shape} like input_ids, got "
                                 f"{tuple(position_ids.shape)}")
    position_ids = position_ids.expand(shape)
    sharding = update_sharding(position_ids, strategy, group)
    out: Dict[str, object] = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids"):
            continue
        if key == "labels":
            key, value = "shift_labels", shift_labels(value)
        if isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == shape:
            out[key] = sharding.shard(value)
        elif key in ("input_ids", "inputs_embeds", "shift_labels"):
            raise _C.InvalidArgument(f"[ringflash.hf.{op}] batch[{key!r}] must have shape {shape} (B, S) like "
                                     f"input_ids, got {tuple(value.shape) if isinstance(value, Tensor) else value!r}")
        else:
            out[key] = value
    out["position_ids"] = sharding.shard(position_ids)
    return out


def gather_sequence(local: Tensor, dim: int = 1) -> Tensor:
    """The global tensor (e.g. logits (B, S, V)) from every rank's part under the current sharding;
    detached, on every rank. Collective."""
    if _current is None:
        raise _C.InvalidArgument("[ringflash.hf.gather_sequence] no sharding is set: call shard_batch or "
                                 "update_sharding first")
    return _current.gather(local, dim)


# ---------------------------------------------------------------------------------------------
# Loss and gradients over the group


def _distributed(pg: ParallelGroup, op: str) -> bool:
    if dist.is_available() and dist.is_initialized():
        return True
    if pg.size() > 1:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] torch.distributed must be initialised "
                                 f"(ringflash.distributed.setup_mpi_distributed() does it under mpiexec)")
    return False


def _torch_groups(pg: ParallelGroup) -> tuple:
    # Hybrid ranks form a grid: reducing over the ulysses group, then over the ring group, covers it.
    return (pg.ulysses, pg.ring) if pg.is_hybrid else (pg.world,)


def _all_reduce(t: Tensor, pg: ParallelGroup, op=dist.ReduceOp.SUM) -> Tensor:
    for g in _torch_groups(pg):
        dist.all_reduce(t, op=op, group=g)
    return t


def _all_gather_rows(rows: Tensor, positions: Tensor, pg: ParallelGroup):
    if not _distributed(pg, "gather"):
        return rows, positions
    for g in _torch_groups(pg):
        count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
        counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(g))]
        dist.all_gather(counts, count, group=g)
        most = max(int(c) for c in counts)
        padded = rows.new_zeros((most, *rows.shape[1:]))          # shards may be uneven: pad to the longest
        padded[: rows.shape[0]] = rows
        padded_pos = positions.new_zeros(most)
        padded_pos[: rows.shape[0]] = positions
        parts = [torch.empty_like(padded) for _ in counts]
        pos_parts = [torch.empty_like(padded_pos) for _ in counts]
        dist.all_gather(parts, padded, group=g)
        dist.all_gather(pos_parts, padded_pos, group=g)
        rows = torch.cat([p[: int(c)] for p, c in zip(parts, counts)])
        positions = torch.cat([p[: int(c)] for p, c in zip(pos_parts, counts)])
    return rows, positions


def _resolve(group, op: str) -> ParallelGroup:
    if group is None:
        return _current.group if _current is not None else parallel_group()
    return group if isinstance(group, ParallelGroup) else parallel_group(group)


def sequence_parallel_loss(logits: Tensor, shift_labels: Tensor, group=None,
                           ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The causal-LM cross entropy of the whole sequence, from this rank's logits (B, S_local, V)
    and shifted labels (B, S_local) (``shard_batch``'s ``shift_labels``): the sum over the
    group's tokens divided by the number of targets that are not ``ignore_index`` (as
    transformers' mean; 0 when there are none). ``group``: as given to shard_batch (None: the
    current sharding's group).

    Every rank gets the global value; its gradient is this rank's share, so ``backward`` on every
    rank followed by ``all_reduce_gradients`` gives the single-process gradient. Collective."""
    op = "sequence_parallel_loss"
    if logits.shape[:-1] != shift_labels.shape:
        raise _C.InvalidArgument(f"[ringflash.hf.{op}] shift_labels must have shape {tuple(logits.shape[:-1])} "
                                 f"(logits without the vocabulary), got {tuple(shift_labels.shape)}")
    pg = _resolve(group, op)
    labels = shift_labels.reshape(-1).to(logits.device)
    local_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index,
                                reduction="sum")
    totals = torch.stack([local_sum.detach().double(), (labels != ignore_index).sum().double()])
    if _distributed(pg, op):
        _all_reduce(totals, pg)
    global_sum, count = totals[0].to(local_sum.dtype), totals[1].clamp(min=1).to(local_sum.dtype)
    return (local_sum - local_sum.detach() + global_sum) / count  # value: global mean; gradient: this rank's part


def all_reduce_gradients(model_or_params: Union[torch.nn.Module, Iterable[Tensor]], group=None) -> None:
    """Sums the ``.grad`` of every parameter that requires grad over the group (None: the current
    sharding's group), in one flat buffer per dtype; one without a gradient counts as zeros.
    Collective. With data parallelism on top, average over the data-parallel group as usual."""
    params: List[Tensor] = [p for p in (model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module)
                                        else model_or_params) if p.requires_grad]
    pg = _resolve(group, "all_reduce_gradients")
    if not params or not _distributed(pg, "all_reduce_gradients"):
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: Dict[tuple, List[Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        _all_reduce(flat, pg)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


# ---------------------------------------------------------------------------------------------
# The attention functions transformers calls: query (B, Hq, S, D), key and value (B, Hkv, S, D)


def _options(op: str, module, query, key, attention_mask, sliding_window, softcap, is_causal, kwargs):
    """(causal, window_size, softcap) for ringflash, after refusing what it cannot express."""
    if attention_mask is not None:
        raise _C.NotSupported(f"[{op}] attention_mask must be None, got a {tuple(attention_mask.shape)} mask: "
                              f"ringflash expresses causal masks, sliding windows and packed documents "
                              f"(position_ids), not padding or custom masks; pack the documents into one row with "
                              f"position_ids restarting at 0 instead of padding")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise _C.NotSupported(f"[{op}] {name} is not supported (attention sinks and position biases), got a tensor")
    if query.shape[1] % key.shape[1] != 0:
        raise _C.InvalidArgument(f"[{op}] the query heads ({query.shape[1]}) must be a multiple of the key/value "
                                 f"heads ({key.shape[1]})")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None:
        if sliding_window < 1:
            raise _C.InvalidArgument(f"[{op}] sliding_window must be >= 1, got {sliding_window}")
        # transformers' window keeps key j for query i when i - j < sliding_window.
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    return causal, window, float(softcap or 0.0)


def _sequence_parallel_attention(strategy: str):
    name = implementation(strategy)

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  scaling: Optional[float] = None, dropout: float = 0.0, sliding_window: Optional[int] = None,
                  softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
        op = f"ringflash.hf {name}"
        causal, window, cap = _options(op, module, query, key, attention_mask, sliding_window, softcap, is_causal,
                                       kwargs)
        if kwargs.get("cu_seq_lens_q") is not None:
            raise _C.InvalidArgument(f"[{op}] cu_seq_lens_q cannot say whether it counts global or local tokens: "
                                     f"give the document boundaries as global position_ids to shard_batch instead")
        sharding = _current
        if sharding is None:
            raise _C.InvalidArgument(f"[{op}] no sharding is set: call ringflash.hf.shard_batch (or update_sharding) "
                                     f"with this batch's global position_ids before the forward")
        if sharding.strategy != strategy:
            raise _C.InvalidArgument(f"[{op}] the batch was sharded for {sharding.strategy!r}, but the model uses "
                                     f"{name!r}; shard with strategy {strategy!r}")
        batch, _, seqlen, _ = query.shape
        if key.shape[2] != seqlen:
            raise _C.NotSupported(f"[{op}] query and key lengths must be equal (no KV cache under sequence "
                                  f"parallelism: pass use_cache=False), got {seqlen} and {key.shape[2]}")
        if (batch, seqlen) != (sharding.batch_size, sharding.local_len):
            raise _C.InvalidArgument(f"[{op}] the layer got (B, S_local) = ({batch}, {seqlen}), but the current "
                                     f"sharding holds ({sharding.batch_size}, {sharding.local_len}) on this rank; "
                                     f"call shard_batch for every batch and feed the model its output")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, S_local, D) -> (B, S_local, H, D)
        options = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=cap, dropout_p=dropout,
                       op=op)
        if sharding.cu_seqlens is None:
            return parallel_attention(q, k, v, strategy, sharding.group, **options), None
        out = parallel_attention(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), strategy, sharding.group,
                                 cu_seqlens=sharding.cu_seqlens, **options)  # (B * S_local, H, D) packed
        return out.view(batch, seqlen, *out.shape[1:]), None

    attention.__name__ = attention.__qualname__ = f"{name}_attention_forward"
    return attention


_cu_cache: List[object] = [None, -1, None]  # (position_ids, its version, cu_seqlens or None)


def _packed_cu_seqlens(position_ids: Optional[Tensor], batch: int, seqlen: int) -> Optional[Tensor]:
    """Document boundaries of a single-device batch from the position_ids the layer got, or None
    when every row is one document. Computed once per position_ids tensor, not once per layer."""
    if position_ids is None or position_ids.shape[-1] != seqlen:
        return None
    cached, version, cu = _cu_cache
    if cached is position_ids and version == position_ids._version:
        return cu
    pos = position_ids.reshape(-1, seqlen).expand(batch, seqlen)
    cu = cu_seqlens_from_position_ids(pos)
    if cu.numel() == batch + 1:
        cu = None
    _cu_cache[:] = [position_ids, position_ids._version, cu]
    return cu


def _single_device_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                             scaling: Optional[float] = None, dropout: float = 0.0,
                             sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                             is_causal: Optional[bool] = None, **kwargs):
    op = f"ringflash.hf {_PREFIX}"
    causal, window, cap = _options(op, module, query, key, attention_mask, sliding_window, softcap, is_causal, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, S, D) -> (B, S, H, D)
    batch, seqlen_q = q.shape[:2]
    cu_q = kwargs.get("cu_seq_lens_q")  # as transformers' flash path takes them (DataCollatorWithFlattening)
    cu_k = kwargs.get("cu_seq_lens_k", cu_q)
    if cu_q is None:
        if k.shape[1] == seqlen_q:
            cu_q = cu_k = _packed_cu_seqlens(kwargs.get("position_ids"), batch, seqlen_q)
        # else: a step with a KV cache, where position_ids count from the cached tokens
    if cu_q is None:
        out = flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                              softcap=cap)
        return out, None
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_q, cu_k))
    longest_q, longest_k = (int((c[1:] - c[:-1]).max()) for c in (cu_q, cu_k))
    out = flash_attn_varlen_func(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu_q, cu_k, longest_q,
                                 longest_k, dropout_p=dropout, softmax_scale=scaling, causal=causal,
                                 window_size=window, softcap=cap)  # (B * S, H, D) packed
    return out.view(batch, seqlen_q, *out.shape[1:]), None


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: Optional[Tensor] = None, use_vmap: bool = False, **kwargs):
    """transformers' mask hook for the ringflash implementations. Causal, window and document
    masks come from the attention call itself, so this returns None, or the 2D mask when it
    holds padding (the attention function then refuses it)."""
    if use_vmap:
        raise _C.NotSupported("[ringflash.hf] the model adds its own mask pattern (or_mask_function / "
                              "and_mask_function), which ringflash attention cannot express")
    chunk = getattr(kwargs.get("config"), "attention_chunk_size", None)
    if chunk is not None:
        raise _C.NotSupported(f"[ringflash.hf] chunked attention (attention_chunk_size = {chunk}) is not supported")
    if attention_mask is None or (attention_mask.shape[-1] == kv_length and bool(attention_mask.all())):
        return None
    return attention_mask


def register() -> None:
    """Registers the ringflash implementations with transformers (done on import; idempotent)."""
    AttentionInterface.register(_PREFIX, _single_device_attention)
    AttentionMaskInterface.register(_PREFIX, _mask)
    for strategy in STRATEGIES:
        AttentionInterface.register(implementation(strategy), _sequence_parallel_attention(strategy))
        AttentionMaskInterface.register(implementation(strategy), _mask)


register()
