"""Communicators for sequence-parallel attention: torch.distributed groups, MPI, and the choice.

ringflash's strategies run in C++ and talk through a ``ringflash._C.Communicator``. This module
makes one for a ``torch.distributed`` process group:

* ``mpi``: the C++ MPI transport, when the job was launched by ``mpiexec`` and ringflash was built
  with MPI. Ranks must be those of MPI_COMM_WORLD (``setup_mpi_distributed`` makes them so). CPU
  tensors only; the messages never touch Python.
* ``nccl``: the C++ NCCL transport, for CUDA tensors: a communicator of its own over the group's
  ranks (it never uses torch's), its unique id broadcast over the group (or over MPI under
  ``mpiexec`` without torch.distributed). Stream-ordered on torch's current stream.
* ``torch``: the torch bridge, which carries the library's messages as ``torch.distributed``
  point-to-point operations on the group (gloo, nccl, or any other backend). CPU tensors.

``RINGFLASH_TRANSPORT`` forces one (``mpi``, ``nccl`` or ``torch``); ``auto`` (the default) takes
``nccl`` for CUDA tensors when ringflash has NCCL, ``mpi`` for CPU tensors under ``mpiexec``, and
``torch`` otherwise. ``RINGFLASH_KERNEL`` forces the attention
kernels (``cpu`` or ``cuda``); ``auto`` follows the tensors' device. ``selected(device)`` says what was
chosen, and the first choice is logged (logger ``ringflash``, level INFO).
``RINGFLASH_COMM_TIMEOUT`` sets the deadline of every wait in seconds (default 300).

``setup_mpi_distributed()`` initialises torch.distributed from an ``mpiexec`` launch (or a
``torchrun`` one) and returns the seed's ``setup_info`` dict.
"""

import atexit
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import _C

__all__ = [
    "communicator",
    "launched_by_mpiexec",
    "selected",
    "setup_mpi_distributed",
]

logger = logging.getLogger("ringflash")

_TRANSPORTS = ("auto", "mpi", "nccl", "torch")
_KERNELS = ("auto", "cpu", "cuda")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


def _env_choice(name: str, choices) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value not in choices:
        raise _C.InvalidArgument(f"[{name}] must be one of {', '.join(choices)}, got {value!r}")
    return value


def _env_int(names) -> Optional[int]:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def launched_by_mpiexec() -> bool:
    """Whether this process is a rank of an mpiexec job (Open MPI, MPICH, Intel MPI, MVAPICH)."""
    return _env_int(_MPI_SIZE_VARS) is not None


def _timeout() -> float:
    value = os.environ.get("RINGFLASH_COMM_TIMEOUT")
    if not value:
        return 300.0
    seconds = float(value)
    if not seconds > 0:
        raise _C.InvalidArgument(f"[RINGFLASH_COMM_TIMEOUT] must be > 0 seconds, got {value!r}")
    return seconds


def selected(device="cpu") -> Dict[str, str]:
    """The transport and kernel that a call on tensors of ``device`` uses: {"transport", "kernel"}.

    transport is "mpi", "nccl", "torch" or "none" (a single process: nothing to send)."""
    device = torch.device(device)
    kernel = _env_choice("RINGFLASH_KERNEL", _KERNELS)
    if kernel == "auto":
        kernel = device.type
    elif kernel != device.type:
        raise _C.InvalidArgument(f"[RINGFLASH_KERNEL] is {kernel!r}, but the tensors are on {device}")
    if kernel not in ("cpu", "cuda"):
        raise _C.NotSupported(f"[ringflash] tensors on {device}: ringflash has kernels for cpu and cuda")
    return {"transport": _transport(device), "kernel": kernel}


def _transport(device: torch.device) -> str:
    forced = _env_choice("RINGFLASH_TRANSPORT", _TRANSPORTS)
    if forced == "mpi":
        if not _C.has_mpi():
            raise _C.NotSupported("[RINGFLASH_TRANSPORT] is 'mpi', but ringflash was built without MPI")
        if device.type != "cpu":
            raise _C.NotSupported(f"[RINGFLASH_TRANSPORT] the mpi transport carries cpu tensors, got {device}")
        return "mpi"
    if forced == "nccl":
        if not _C.has_nccl():
            raise _C.NotSupported("[RINGFLASH_TRANSPORT] is 'nccl', but ringflash was built without NCCL")
        if device.type != "cuda":
            raise _C.NotSupported(f"[RINGFLASH_TRANSPORT] the nccl transport carries cuda tensors, got {device}")
    if forced == "torch":
        return "torch"
    initialized = dist.is_available() and dist.is_initialized()
    if device.type == "cuda" and _C.has_nccl() and (initialized or launched_by_mpiexec()):
        return "nccl"
    if forced == "nccl":
        raise _C.InvalidArgument("[RINGFLASH_TRANSPORT] is 'nccl', but neither torch.distributed is initialised "
                                 "nor was this process launched by mpiexec")
    if device.type == "cpu" and launched_by_mpiexec() and _C.has_mpi():
        return "mpi"
    if initialized:
        return "torch"
    return "none"


class _TorchBridge:
    """Carries the C++ library's messages over a torch.distributed group (see ``_C.bridge``)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks: List[int] = dist.get_process_group_ranks(group)

    def send_recv(self, ops):
        p2p, to_self, from_self = [], [], []
        for is_send, peer, buffer in ops:
            if peer == self.rank:
                (to_self if is_send else from_self).append(buffer)
            else:
                op = dist.isend if is_send else dist.irecv
                p2p.append(dist.P2POp(op, buffer, self.global_ranks[peer], self.group))
        for sent, received in zip(to_self, from_self):
            received.copy_(sent)
        return dist.batch_isend_irecv(p2p) if p2p else []

    def wait(self, works, seconds):
        deadline = time.monotonic() + seconds
        try:
            for work in works:
                left = max(deadline - time.monotonic(), 0.001)
                if not work.wait(timeout=timedelta(seconds=left)):
                    raise TimeoutError(f"a message did not complete within {seconds:g} s")
        except BaseException:
            # The library frees the buffers when the error reaches it: nothing may write into them
            # later, so every message still in flight is aborted.
            for work in works:
                if not work.is_completed():
                    try:
                        work.abort()
                    except Exception:  # backends without abort: the message stays posted
                        pass
            raise


_mpi_world = None
_communicators: Dict[tuple, "_C.Communicator"] = {}
_logged = False


@atexit.register
def _release() -> None:
    """Drops the communicators before the interpreter tears the module down (the torch bridge
    holds Python objects, and MPI is finalised after this)."""
    global _mpi_world
    _communicators.clear()
    _mpi_world = None


def _mpi() -> "_C.Communicator":
    global _mpi_world
    if _mpi_world is None:
        _mpi_world = _C.mpi_world()
        _mpi_world.timeout = _timeout()
    return _mpi_world


def _group_ranks(group) -> List[int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return list(range(_mpi().size))


def communicator(group=None, device="cpu") -> Optional["_C.Communicator"]:
    """The ringflash communicator for torch.distributed ``group`` (None: the default group) and
    tensors on ``device``, made once and cached. None when there is a single process and no
    group: the strategies then run on one rank without sending anything.

    Without torch.distributed initialised, ``group`` must be None, and an mpiexec job uses every
    MPI rank."""
    global _logged
    device = torch.device(device)
    choice = selected(device)
    if not _logged:
        logger.info("ringflash: transport %s, kernel %s", choice["transport"], choice["kernel"])
        _logged = True
    transport = choice["transport"]
    initialized = dist.is_available() and dist.is_initialized()
    if group is not None and not initialized:
        raise _C.InvalidArgument("[communicator] group was given, but torch.distributed is not initialised")
    if transport == "none":
        return None
    if group is not None and dist.get_rank(group) < 0:
        raise _C.InvalidArgument(f"[communicator] this process (rank {dist.get_rank()}) is not a member of the group "
                                 f"of ranks {dist.get_process_group_ranks(group)}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (transport, group if group is not None else "world", device.type, device.index)
    comm = _communicators.get(key)
    if comm is not None:
        return comm
    if transport == "nccl":
        comm = _nccl(group, device.index)
    elif transport == "mpi":
        world = _mpi()
        if initialized and dist.get_rank() != world.rank:
            raise _C.InvalidArgument(f"[communicator] torch.distributed rank {dist.get_rank()} is not MPI rank "
                                     f"{world.rank}: initialise torch.distributed with setup_mpi_distributed(), "
                                     f"or set RINGFLASH_TRANSPORT=torch")
        ranks = _group_ranks(group)
        comm = world if ranks == list(range(world.size)) else world.subgroup(ranks)
    else:
        if not initialized:
            raise _C.InvalidArgument("[communicator] RINGFLASH_TRANSPORT is 'torch', but torch.distributed is not "
                                     "initialised")
        pg = group if group is not None else dist.group.WORLD
        bridge = _TorchBridge(pg)
        device_type = 2 if device.type == "cuda" else 1  # DLPack's kDLCUDA and kDLCPU
        comm = _C.bridge(bridge, bridge.rank, bridge.size, device_type, device.index or 0)
        comm.timeout = _timeout()
    _communicators[key] = comm
    return comm


def _nccl(group, device_index: int) -> "_C.Communicator":
    """A new nccl communicator over the ranks of ``group`` (over MPI_COMM_WORLD under mpiexec without
    torch.distributed), this rank on CUDA device ``device_index``."""
    if not (dist.is_available() and dist.is_initialized()):
        comm = _C.nccl_world(_mpi(), device_index)
        comm.timeout = _timeout()
        return comm
    pg = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    box = [_C.nccl_unique_id() if rank == 0 else None]
    with torch.cuda.device(device_index):  # an nccl group sends the object from the current device
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(pg)[0], group=pg)
    return _C.nccl_communicator(box[0], rank, size, device_index, _timeout())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _destroy_default_group():
    if dist.is_initialized():
        dist.destroy_process_group()


def setup_mpi_distributed(backend: Optional[str] = None, timeout: Optional[timedelta] = None) -> dict:
    """Initialises torch.distributed for this job and returns ``setup_info``:
    {"rank", "world_size", "local_rank", "device", "backend", "launcher"}.

    Under mpiexec, the ranks are MPI_COMM_WORLD's; rank 0 picks a free port and MPI tells the
    others (MASTER_ADDR defaults to rank 0's host name; set MASTER_ADDR/MASTER_PORT to override).
    Under torchrun (or with RANK/WORLD_SIZE set) it uses torchrun's variables. Otherwise it is a
    single process, and torch.distributed is initialised with world size 1. The device is
    cuda:<local rank> when CUDA is available, else cpu; the backend nccl for cuda, gloo for cpu.
    Calling it again returns the same information."""
    if launched_by_mpiexec():
        launcher = "mpiexec"
        rank, world_size = _env_int(_MPI_RANK_VARS), _env_int(_MPI_SIZE_VARS)
        local_rank = _env_int(_MPI_LOCAL_RANK_VARS) or 0
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launcher = "torchrun"
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        launcher, rank, world_size, local_rank = "none", 0, 1, 0
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        if launcher == "mpiexec" and not os.environ.get("MASTER_PORT"):
            if not _C.has_mpi():
                raise _C.NotSupported("[setup_mpi_distributed] set MASTER_ADDR and MASTER_PORT: ringflash was built "
                                      "without MPI, so it cannot share a port between the ranks")
            world = _mpi()
            mine = f"{socket.gethostname()} {_free_port()}".encode() if world.rank == 0 else b""
            host, port = world.all_gather_bytes(mine)[0].decode().split()
            os.environ.setdefault("MASTER_ADDR", host)
            os.environ["MASTER_PORT"] = port
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if launcher == "none":
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                **kwargs)
        # A group left to interpreter shutdown can abort the process ("terminate called without an
        # active exception", pytorch/pytorch#190489), after the script's work is done: the group
        # made here is destroyed at exit unless the script did so first.
        atexit.register(_destroy_default_group)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "local_rank": local_rank,
            "device": device, "backend": dist.get_backend(), "launcher": launcher}
