"""ringflash: exact flash attention for long sequences.

Single device, flash-attn's API: ``flash_attn_func``, ``flash_attn_varlen_func`` and their packed
variants; chunked attention (``chunked_attention``); ``import ringflash.auto`` routes
``scaled_dot_product_attention`` to ringflash. Sequence parallel: ``parallel_attention`` with the
strategies ring, zigzag, stripe, allgather, ulysses and hybrid over any torch.distributed group or
MPI (``ringflash.distributed``); the drop-in modules ``ringflash.ring_flash_attn``,
``ringflash.sp_aurora`` and ``ringflash.yunchang``; Hugging Face models through ``ringflash.hf``.
The torch custom ops are in ``ringflash.ops``, ``ringflash.parallel`` and ``ringflash.chunked``;
the C++ core is ``ringflash._C``.

Every error the library raises is a ``ringflash.Error``: ``InvalidArgument`` (also a ``ValueError``),
``NotSupported`` (``NotImplementedError``), ``DeviceError`` and ``CommError`` (``RuntimeError``).
"""

from . import _C
from ._C import CommError, DeviceError, Error, InvalidArgument, NotSupported
from . import chunked, distributed, ops, parallel, ring_flash_attn, sp_aurora, yunchang
from .chunked import ChunkedAttention, chunked_attention, flash_attention_qkv_packed
from .distributed import selected, setup_mpi_distributed
from .interface import (
    Support,
    attention_support,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .parallel import ParallelGroup, init_process_groups, parallel_attention, parallel_group, shard_positions

__version__ = "0.1.0"

__all__ = [
    "ChunkedAttention",
    "CommError",
    "DeviceError",
    "Error",
    "InvalidArgument",
    "NotSupported",
    "Support",
    "__version__",
    "ParallelGroup",
    "attention_support",
    "build_info",
    "chunked",
    "chunked_attention",
    "distributed",
    "empty_cache",
    "flash_attention_qkv_packed",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "has_cuda",
    "has_mpi",
    "has_nccl",
    "init_process_groups",
    "ops",
    "parallel",
    "parallel_attention",
    "parallel_group",
    "ring_flash_attn",
    "selected",
    "setup_mpi_distributed",
    "shard_positions",
    "sp_aurora",
    "yunchang",
]


def build_info() -> str:
    """What this build contains, one line per component (version, cpu, cuda, mpi, nccl)."""
    return _C.build_info()


def empty_cache() -> None:
    """Give the CUDA memory that ringflash's workspace pools keep unused between calls back to the
    devices, as torch.cuda.empty_cache() does for torch's cache. ringflash's pools are its own, so
    torch's cache does not hold them; a ringflash allocation that fails empties them by itself
    before it raises. Each device ringflash has used is synchronised first."""
    _C.empty_cache()


def has_cuda() -> bool:
    """Whether the CUDA kernels are compiled in and a CUDA device is present."""
    return _C.has_cuda()


def has_mpi() -> bool:
    """Whether the mpi transport is compiled in."""
    return _C.has_mpi()


def has_nccl() -> bool:
    """Whether the nccl transport is compiled in."""
    return _C.has_nccl()
