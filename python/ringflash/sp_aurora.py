"""sp_aurora's names on ringflash: ring and Ulysses attention over sequence shards, its MPI setup and
its capability queries.

Code written for sp_aurora (ring-flash-attn and yunchang's Ulysses layer ported to Intel GPUs)
switches with ``from ringflash.sp_aurora import ...``; names, signatures and defaults are sp_aurora's:

* ``sp_aurora_func(q, k, v, ...)`` and its ``_kvpacked`` / ``_qkvpacked`` variants: ring attention
  with ring-flash-attn's ``ring_flash_attn_func`` signature. Every rank of ``group`` (None: the default
  group) passes its contiguous shard (rank r holds the r-th of P parts), q (B, S/P, Hq, D), k and v
  (B, S/P, Hkv, D); kv packed is (B, S/P, 2, Hkv, D), qkv packed (B, S/P, 3, H, D).
  ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` with the lse (B, Hq, S/P).
* ``UlyssesAttention`` (an ``nn.Module``) and ``ulysses_flash_attn_func``: Ulysses attention on the
  same contiguous shards, (B, S/P, H, D) in and out.
* ``setup_mpi_distributed()``: initialises torch.distributed under ``mpiexec`` or ``torchrun``
  (``ringflash.distributed.setup_mpi_distributed``); ``detect_mpi_environment``,
  ``get_device_for_rank`` and ``cleanup_distributed`` as in sp_aurora's ``mpi_utils``.
* ``is_sycl_available``, ``get_sycl_device_info``, ``auto_select_flash_attn_forward``: answered for
  ringflash, which has cpu and cuda kernels and no SYCL ones (see each function).

Every name runs ringflash's exact kernels (cpu or cuda, by the tensors' device) and its C++
strategies, over the mpi transport under mpiexec or the torch.distributed group otherwise
(``ringflash.distributed``). Differences from sp_aurora:

* ``AttnType`` only records the request: every member runs ringflash's kernels. It holds sp_aurora's
  members (TORCH, INTEL_SYCL, INTEL_ONEDNN, FA, FA3) and yunchang's, with yunchang's values
  (``AttnType.FA.value == "fa"``); ``AttnType.from_string`` also takes sp_aurora's "flash_attn" and
  "flash_attn_3".
* ``dropout_p`` must be 0 (``NotSupported`` otherwise); ``deterministic`` and ``use_sync`` are accepted
  and ignored (the ops return finished results).
* Ulysses takes any head count: Hq need not divide by P (the first Hq % P ranks take one head more,
  and with P > Hq some ranks hold no heads), and KV heads read on several ranks are sent to each
  (GQA and MQA with P > Hkv). Hq must be a multiple of Hkv. sp_aurora and yunchang assert P | H.
* Lengths need not divide by P: the first S % P ranks hold one row more.
* ``ulysses_flash_attn_func(..., return_attn_probs=True)`` returns ``(out, softmax_lse)`` where
  sp_aurora returns ``(out, None)``; ``UlyssesAttention`` returns out alone, as in sp_aurora.
* Errors are ``ringflash.InvalidArgument`` (a ``ValueError``) and ``ringflash.NotSupported`` (a
  ``NotImplementedError``), raised on every rank, where sp_aurora asserts.
"""

import enum
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from .distributed import launched_by_mpiexec, selected, setup_mpi_distributed
from .interface import _results, flash_attn_func
from .parallel import ParallelGroup, parallel_attention, parallel_group

__all__ = [
    "AttnType",
    "UlyssesAttention",
    "auto_select_flash_attn_forward",
    "cleanup_distributed",
    "detect_mpi_environment",
    "get_device_for_rank",
    "get_sycl_device_info",
    "is_sycl_available",
    "select_flash_attn_impl",
    "setup_mpi_distributed",
    "sp_aurora_func",
    "sp_aurora_kvpacked_func",
    "sp_aurora_qkvpacked_func",
    "ulysses_flash_attn_func",
    "ulysses_flash_attn_kvpacked_func",
    "ulysses_flash_attn_qkvpacked_func",
]


class AttnType(str, enum.Enum):
    """The attention kernel a caller asked for. ringflash records it (``.attn_type`` of the modules)
    and runs its own exact kernels for every member: cpu or cuda, by the tensors' device."""

    FA = "fa"
    FA3 = "fa3"
    TORCH = "torch"
    TORCH_MATH = "torch_math"
    TORCH_FLASH = "torch_flash"
    TORCH_EFFICIENT = "torch_efficient"
    TORCH_CUDNN = "torch_cudnn"
    FLASHINFER = "flashinfer"
    AITER = "aiter"
    SAGE_AUTO = "sage_auto"
    SAGE_FP16 = "sage_fp16"
    SAGE_FP16_TRITON = "sage_fp16_triton"
    SAGE_FP8 = "sage_fp8"
    SAGE_FP8_SM90 = "sage_fp8_sm90"
    SPARSE_SAGE = "sparse_sage"
    NPU = "npu"
    INTEL_SYCL = "intel_sycl"
    INTEL_ONEDNN = "intel_onednn"

    @classmethod
    def from_string(cls, s: str) -> "AttnType":
        """The member whose value is ``s`` (sp_aurora's "flash_attn" and "flash_attn_3" name FA and FA3)."""
        s = _SP_AURORA_VALUES.get(s, s)
        for member in cls:
            if member.value == s:
                return member
        raise _C.InvalidArgument(f"[AttnType] must be one of {', '.join(m.value for m in cls)}, got {s!r}")


_SP_AURORA_VALUES = {"flash_attn": "fa", "flash_attn_3": "fa3"}


def _attn_type(op: str, attn_type) -> AttnType:
    if isinstance(attn_type, AttnType):
        return attn_type
    if isinstance(attn_type, str):
        try:
            return AttnType.from_string(attn_type)
        except _C.InvalidArgument:
            pass
    raise _C.InvalidArgument(f"[{op}] attn_type must be an AttnType or one of its values, got {attn_type!r}")


def _check_all_to_all_dims(op: str, scatter_idx: int, gather_idx: int, expected: Tuple[int, int]) -> None:
    """The all-to-all dims that the shards' layout implies: scatter heads, gather the sequence."""
    if (scatter_idx, gather_idx) != expected:
        raise _C.NotSupported(f"[{op}] (scatter_idx, gather_idx) must be {expected}: the heads are scattered and the "
                              f"sequence (dim 1) gathered, got ({scatter_idx!r}, {gather_idx!r})")


def _unpack(op: str, name: str, packed: Tensor, count: int) -> Tuple[Tensor, ...]:
    """Views of `packed` (B, S, count, H, D) along dim 2."""
    if not isinstance(packed, Tensor) or packed.dim() != 5 or packed.shape[2] != count:
        got = tuple(packed.shape) if isinstance(packed, Tensor) else type(packed).__name__
        raise _C.InvalidArgument(f"[{op}] {name} must have shape (B, S, {count}, H, D), got {got}")
    return packed.unbind(2)


# Ring attention on contiguous shards.


def sp_aurora_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group=None,
):
    """Ring attention over the ranks of ``group`` (a torch.distributed group; None: the default group).

    q (B, S/P, Hq, D), k and v (B, S/P, Hkv, D): this rank's contiguous shard. Options as in
    flash_attn_func; causal masks and windows use global positions. Returns out (B, S/P, Hq, D), or
    with return_attn_probs ``(out, softmax_lse (B, Hq, S/P) float32, None)``."""
    out, lse = parallel_attention(q, k, v, "ring", group, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  return_lse=True, op="sp_aurora_func")
    return _results(out, lse, return_attn_probs)


def sp_aurora_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """sp_aurora_func with kv: (B, S/P, 2, Hkv, D)."""
    k, v = _unpack("sp_aurora_kvpacked_func", "kv", kv, 2)
    return sp_aurora_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          return_attn_probs, group)


def sp_aurora_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """sp_aurora_func with qkv: (B, S/P, 3, H, D)."""
    q, k, v = _unpack("sp_aurora_qkvpacked_func", "qkv", qkv, 3)
    return sp_aurora_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          return_attn_probs, group)


# Ulysses attention on contiguous shards.


def ulysses_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group=None,
):
    """Ulysses attention over the ranks of ``group`` (None: the default group).

    q (B, S/P, Hq, D), k and v (B, S/P, Hkv, D): this rank's contiguous shard; any Hq and Hkv with
    Hq a multiple of Hkv. Returns out (B, S/P, Hq, D), or with return_attn_probs
    ``(out, softmax_lse (B, Hq, S/P))`` (sp_aurora returns ``(out, None)``)."""
    out, lse = parallel_attention(q, k, v, "ulysses", group, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  return_lse=True, op="ulysses_flash_attn_func")
    return (out, lse) if return_attn_probs else out


def ulysses_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ulysses_flash_attn_func with kv: (B, S/P, 2, Hkv, D)."""
    k, v = _unpack("ulysses_flash_attn_kvpacked_func", "kv", kv, 2)
    return ulysses_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                   deterministic, return_attn_probs, group)


def ulysses_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                      alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """ulysses_flash_attn_func with qkv: (B, S/P, 3, H, D)."""
    q, k, v = _unpack("ulysses_flash_attn_qkvpacked_func", "qkv", qkv, 3)
    return ulysses_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                                   deterministic, return_attn_probs, group)


class UlyssesAttention(torch.nn.Module):
    """Ulysses attention as a module: (B, S/P, H, D) shards in, this rank's output shard out.

    sequence_process_group: the torch.distributed group that shares the sequence (None: the default
    group; without torch.distributed, a single process). scatter_idx and gather_idx must be 2 and 1,
    the layout above. use_sync is ignored; attn_type is recorded in ``.attn_type`` and every member
    runs ringflash's kernels."""

    def __init__(
        self,
        sequence_process_group: Optional[dist.ProcessGroup] = None,
        scatter_idx: int = 2,
        gather_idx: int = 1,
        use_sync: bool = False,
        attn_type: AttnType = AttnType.TORCH,
    ) -> None:
        super().__init__()
        op = type(self).__name__
        _check_all_to_all_dims(op, scatter_idx, gather_idx, (2, 1))
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.use_sync = use_sync
        self.attn_type = _attn_type(op, attn_type)
        # Resolved once, so that a compiled forward only reads an attribute.
        self._group: ParallelGroup = parallel_group(sequence_process_group)

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
        in flash_attn_func; extra positional arguments are ignored, as in sp_aurora and yunchang."""
        return parallel_attention(query, key, value, "ulysses", self._group, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, dropout_p=dropout_p, op=type(self).__name__)


def select_flash_attn_impl(impl_type: AttnType, stage: str = "fwd-bwd", attn_processor=None):
    """yunchang's kernel choice: for stage "fwd-bwd", a function with flash_attn_func's signature
    (single device, ringflash's kernels, whatever ``impl_type``). The "fwd-only" and "bwd-only" stages
    and ``attn_processor`` are yunchang internals that ringflash does not have."""
    op = "select_flash_attn_impl"
    _attn_type(op, impl_type)
    if stage != "fwd-bwd":
        raise _C.NotSupported(f"[{op}] stage must be 'fwd-bwd' (ringflash has no counterpart of yunchang's "
                              f"forward-only and backward-only kernel functions), got {stage!r}")
    if attn_processor is not None:
        raise _C.NotSupported(f"[{op}] attn_processor must be None (ringflash runs its own kernels), "
                              f"got {type(attn_processor).__name__}")
    return flash_attn_func


# MPI helpers, as in sp_aurora's mpi_utils.


def detect_mpi_environment() -> bool:
    """Whether this process was launched by mpiexec (Open MPI, MPICH, Intel MPI, MVAPICH)."""
    return launched_by_mpiexec()


def get_device_for_rank(rank: Optional[int] = None) -> torch.device:
    """The device of ``rank`` (None: this process's rank): cuda:<rank % device count> when CUDA is
    available, else cpu."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def cleanup_distributed() -> None:
    """Destroys the default process group, if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Capability queries.


def is_sycl_available() -> bool:
    """False: ringflash has no SYCL kernels. Its kernels are cpu and, when built with CUDA, cuda
    (``get_sycl_device_info`` lists them)."""
    return False


def get_sycl_device_info(device="cpu") -> Dict[str, Any]:
    """What this build of ringflash can run, in place of sp_aurora's SYCL device description.

    As in sp_aurora without SYCL, the dict has an "error" entry. The others: "backends", each
    component and whether this build has it (cpu, cuda: compiled in and a device present; mpi and
    nccl: transports compiled in; sycl: never); "selected", the transport and kernel a call on
    tensors of ``device`` uses now (``ringflash.distributed.selected``), or why none can; "build",
    ``ringflash.build_info()``."""
    try:
        chosen: Any = selected(device)
    except _C.Error as e:
        chosen = str(e)
    return {
        "error": "SYCL is not available: ringflash has cpu and cuda kernels, no SYCL ones",
        "backends": {"cpu": True, "cuda": _C.has_cuda(), "mpi": _C.has_mpi(), "nccl": _C.has_nccl(), "sycl": False},
        "selected": chosen,
        "build": _C.build_info(),
    }


def auto_select_flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    alibi_slopes: Optional[Tensor] = None,
    return_softmax: bool = False,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Single-device attention on the kernel that ringflash selects for the tensors' device (cpu or
    cuda), in sp_aurora's layout: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D). Returns
    ``(out (B, Hq, Sq, D), softmax_lse (B, Hq, Sq) float32)``; gradients flow to q, k and v.
    ``return_softmax`` changes nothing: ringflash never forms the attention matrix."""
    out, lse = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, H, S, D) -> (B, S, H, D)
                               dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax_lse=True)
    return out.transpose(1, 2), lse  # (B, Sq, Hq, D) -> (B, Hq, Sq, D)
