"""ringflash.distributed: transport choice, environment variables, deadlines and faults over the
torch bridge (gloo), and bad input through the Python API."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ringflash
from ringflash.distributed import communicator, selected
from ringflash.parallel import parallel_attention
from dist_harness import run_world


def test_selected_without_torch_distributed(monkeypatch):
    monkeypatch.delenv("RINGFLASH_TRANSPORT", raising=False)
    monkeypatch.delenv("RINGFLASH_KERNEL", raising=False)
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert selected("cpu") == {"transport": "none", "kernel": "cpu"}
    assert communicator() is None


@pytest.mark.parametrize("name, value, message", [
    ("RINGFLASH_TRANSPORT", "carrier-pigeon", "must be one of auto, mpi, nccl, torch, got 'carrier-pigeon'"),
    ("RINGFLASH_KERNEL", "tpu", "must be one of auto, cpu, cuda, got 'tpu'"),
    ("RINGFLASH_KERNEL", "cuda", "is 'cuda', but the tensors are on cpu"),
])
def test_bad_environment_variables(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ringflash.InvalidArgument, match=f"\\[{name}\\] {message}"):
        selected("cpu")


def test_the_nccl_transport_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setenv("RINGFLASH_TRANSPORT", "nccl")
    error = ringflash.NotSupported
    message = ("the nccl transport carries cuda tensors, got cpu" if ringflash._C.has_nccl()
               else "is 'nccl', but ringflash was built without NCCL")
    with pytest.raises(error, match=f"\\[RINGFLASH_TRANSPORT\\] {message}"):
        selected("cpu")


def test_tensors_on_different_devices():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ringflash.InvalidArgument, match=r"\[parallel_attention\] k must be on cpu like q, got meta"):
        parallel_attention(q, q.to("meta"), q, "ring")


def _deadline_body(rank, world, fault):
    q = torch.randn(1, 32, 2, 16)
    start = time.monotonic()
    if rank == 1:
        if fault == "raises before its send":
            return "skipped"
        if fault == "other group":
            # Rank 1 runs on a group of its own (a one-rank world): rank 0 never hears from it.
            groups = [dist.new_group([0]), dist.new_group([1])]
            parallel_attention(q, q, q, "ring", groups[1])
            return "alone"
    elif fault == "other group":
        dist.new_group([0])
        dist.new_group([1])
    try:
        parallel_attention(q, q, q, "ring", causal=True)
    except ringflash.CommError as e:
        return (str(e), time.monotonic() - start)
    return "no error"


@pytest.mark.parametrize("fault", ["raises before its send", "other group"])
def test_a_silent_peer_ends_in_a_comm_error_at_the_deadline(fault):
    results = run_world(2, _deadline_body, fault, env={"RINGFLASH_COMM_TIMEOUT": "2"}, timeout=120)
    message, seconds = results[0]
    assert message.startswith("[ring]") or message.startswith("[send_recv]") or "rank 0 of 2" in message, message
    assert "rank 0 of 2" in message
    # At the deadline, or earlier when the peer's exit closes its connections; never a hang.
    assert seconds < 30, seconds


def _mpi_script(tmp_path):
    script = tmp_path / "mpi_hybrid.py"
    script.write_text('''
import sys, torch, ringflash
from ringflash.parallel import init_process_groups, parallel_attention, shard_positions
info = ringflash.setup_mpi_distributed()
torch.set_num_threads(1)
assert info["launcher"] == "mpiexec" and info["world_size"] == 4, info
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 301, 4, 32, generator=g) for _ in range(3))
ref = ringflash.flash_attn_func(q, k, v, causal=True)
group = init_process_groups(2, 2)
for strategy, grp in (("zigzag", None), ("hybrid", group)):
    pos = shard_positions(301, strategy, grp)
    out = parallel_attention(q[:, pos], k[:, pos], v[:, pos], strategy, grp, causal=True)
    err = (out - ref[:, pos]).abs().max().item()
    assert err < 1e-5, (strategy, err)
with open(sys.argv[1] + f"/rank{info['rank']}", "w") as f:
    f.write(ringflash.selected()["transport"])
''')
    return script


@pytest.mark.skipif(not ringflash.has_mpi(), reason="built without MPI")
def test_mpiexec_launch_uses_the_mpi_transport(tmp_path):
    mpiexec = "mpiexec"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    for name in ("RINGFLASH_TRANSPORT", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    result = subprocess.run([mpiexec, "--oversubscribe", "-n", "4", sys.executable, str(_mpi_script(tmp_path)),
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    # Each rank writes the transport it used to a file of its own (stdout lines may interleave).
    assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["mpi"] * 4, result.stdout
