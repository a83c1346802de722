"""Under mpiexec without torch.distributed, CUDA tensors travel over ringflash's NCCL transport with
its unique id sent over MPI. Skipped unless there are 2 CUDA devices, ringflash has CUDA, NCCL and
MPI, and mpiexec is on PATH.

Each of 2 ranks (cuda:<local rank>) runs a zigzag forward and backward, causal, bf16, GQA, at an
awkward length, and compares its shard with ringflash.flash_attn_func on the whole sequence on its
own GPU (the same kernels: the difference is the ring's fp32 merge order, a few bf16 units; on
2 x H200 at most 0.4 % of the largest gradient). Every input, dout included, comes from one seeded
generator, so both ranks build the same sequence. It writes the transport it used to a file of its own.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import ringflash

pytestmark = pytest.mark.skipif(
    not (torch.cuda.device_count() >= 2 and ringflash.has_cuda() and ringflash._C.has_nccl()
         and ringflash.has_mpi() and shutil.which("mpiexec")),
    reason="needs 2 CUDA devices, ringflash built with CUDA, NCCL and MPI, and mpiexec")

SCRIPT = '''
import os, sys, torch, ringflash
from ringflash.parallel import parallel_attention, shard_positions
rank = int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
torch.cuda.set_device(rank)
g = torch.Generator(device="cuda").manual_seed(0)
S = 4097
q = torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, S, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
full = [t.clone().requires_grad_() for t in (q, k, v)]
ref = ringflash.flash_attn_func(*full, causal=True)
ref.backward(dout)
pos = shard_positions(S, "zigzag", device=torch.device("cuda", rank)).cuda()
mine = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
out = parallel_attention(*mine, "zigzag", causal=True)
out.backward(dout[:, pos])
torch.cuda.synchronize()
for name, got, want in (("out", out, ref[:, pos]), ("dq", mine[0].grad, full[0].grad[:, pos]),
                        ("dk", mine[1].grad, full[1].grad[:, pos]), ("dv", mine[2].grad, full[2].grad[:, pos])):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= 1e-2 * max(scale, 1.0), (name, err, scale)
with open(sys.argv[1] + f"/rank{rank}", "w") as f:
    f.write(ringflash.selected("cuda")["transport"])
'''


def test_mpiexec_without_torch_distributed_uses_nccl(tmp_path):
    script = tmp_path / "mpi_gpu.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", NCCL_NVLS_ENABLE="0",
               RINGFLASH_COMM_TIMEOUT="60", PYTHONPATH=os.pathsep.join(sys.path))
    for name in ("RINGFLASH_TRANSPORT", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["nccl"] * 2, result.stdout
