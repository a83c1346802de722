"""Runs a test body on several CPU ranks over torch.distributed (gloo), in spawned processes.

    run_world(4, body, arg1, arg2)

calls ``body(rank, world_size, arg1, arg2)`` in 4 processes that share a gloo default group, each
with one torch thread. ``body`` must be a module-level function (spawn pickles it by name). The
call fails with the first failing rank's traceback; a rank that hangs fails it at ``timeout``.
Every rank returns a value (picklable), and run_world returns them in rank order.

Bodies should check many cases per world: starting a world costs a few seconds.
"""

import os
import pickle
import tempfile
import time

import torch.multiprocessing as mp

__all__ = ["run_world"]


def _entry(rank, world_size, init_file, result_dir, body, args, env):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = body(rank, world_size, *args)
        with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(world_size, body, *args, timeout=240, env=None):
    """Runs body(rank, world_size, *args) on world_size gloo ranks; returns their results."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(_entry, args=(world_size, init_file, tmp, body, args, dict(env or {})),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"run_world({world_size}, {body.__name__}) did not finish within {timeout} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
