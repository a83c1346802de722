"""ringflash: exact flash attention for long sequences.

Single device, flash-attn's API: ``flash_attn_func``, ``flash_attn_varlen_func`` and their packed
variants. The torch custom ops behind them are ``torch.ops.ringflash.attention_forward`` and
``attention_backward`` (see ``ringflash.ops``); the C++ core is ``ringflash._C``.

Every error the library raises is a ``ringflash.Error``: ``InvalidArgument`` (also a ``ValueError``),
``NotSupported`` (``NotImplementedError``), ``DeviceError`` and ``CommError`` (``RuntimeError``).
"""

from . import _C
from ._C import CommError, DeviceError, Error, InvalidArgument, NotSupported
from . import ops
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

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "DeviceError",
    "Error",
    "InvalidArgument",
    "NotSupported",
    "Support",
    "__version__",
    "attention_support",
    "build_info",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "has_cuda",
    "has_mpi",
    "has_nccl",
    "ops",
]


def build_info() -> str:
    """What this build contains, one line per component (version, cpu, cuda, mpi, nccl)."""
    return _C.build_info()


def has_cuda() -> bool:
    """Whether the CUDA kernels are compiled in and a CUDA device is present."""
    return _C.has_cuda()


def has_mpi() -> bool:
    """Whether the mpi transport is compiled in."""
    return _C.has_mpi()


def has_nccl() -> bool:
    """Whether the nccl transport is compiled in."""
    return _C.has_nccl()
