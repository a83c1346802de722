"""Runs a test body on several ranks over torch.distributed, in spawned processes.

    run_world(4, body, arg1, arg2)

calls ``body(rank, world_size, arg1, arg2)`` in 4 processes that share a gloo default group, each
with one torch thread. ``body`` must be a module-level function (spawn pickles it by name). The
call fails with the first failing rank's traceback; a rank that hangs fails it at ``timeout``.
Every rank returns a value (picklable), and run_world returns them in rank order.

GPU ranks: ``backend="nccl"`` gives rank r the device cuda:r (``torch.cuda.set_device(r)``, before
the group is made) and an nccl default group. ``hard_exit=True`` is for bodies after which the
group cannot be trusted (a peer failed on purpose): each rank writes its result (or its
traceback), then leaves with ``os._exit`` without destroying the group, which could hang.

Bodies should check many cases per world: starting a world costs a few seconds.
"""

import glob
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

__all__ = ["run_world"]

BACKENDS = ("gloo", "nccl")


def _entry(rank, world_size, init_file, result_dir, body, args, env, backend="gloo", hard_exit=False):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # Every rank is done connecting before any body runs: a rank whose body returns at once would
    # otherwise leave (closing its connections) while a slower rank still connects to it, whose
    # init then fails.
    dist.barrier()
    if not hard_exit:
        try:
            _write_result(result_dir, rank, body(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
        return
    status = 0
    try:
        _write_result(result_dir, rank, body(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to run_world through the .err file
        with open(os.path.join(result_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _write_result(result_dir, rank, result):
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _tracebacks(result_dir):
    """The tracebacks that hard_exit ranks left, as one text (empty when there are none)."""
    texts = []
    for path in sorted(glob.glob(os.path.join(result_dir, "*.err"))):
        with open(path) as f:
            texts.append(f"-- rank {os.path.basename(path)[:-4]}:\n{f.read()}")
    return "\n".join(texts)


def run_world(world_size, body, *args, timeout=240, env=None, backend="gloo", hard_exit=False):
    """Runs body(rank, world_size, *args) on world_size ranks; returns their results.

    backend: "gloo" (CPU ranks) or "nccl" (rank r on cuda:r). hard_exit: leave each rank with
    os._exit after its result is written, without destroying the group."""
    if backend not in BACKENDS:
        raise ValueError(f"run_world: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        entry_args = (world_size, init_file, tmp, body, args, dict(env or {}), backend, hard_exit)
        context = mp.start_processes(_entry, args=entry_args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in context.processes:
                        p.kill()
                    details = _tracebacks(tmp)
                    raise TimeoutError(f"run_world({world_size}, {body.__name__}) did not finish within {timeout} s"
                                       + (f"\n{details}" if details else ""))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            details = _tracebacks(tmp)
            if details:
                raise RuntimeError(f"run_world({world_size}, {body.__name__}): {e}\n{details}") from e
            raise
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
