"""The Python examples run as the README shows them (short lengths)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


def _launch(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RINGFLASH_TRANSPORT"):
        env.pop(name, None)
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def _run(args, timeout=300):
    result = _launch(args, timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_quickstart():
    _run([sys.executable, str(EXAMPLES / "quickstart.py")])


def test_sequence_parallel_under_torchrun():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                str(EXAMPLES / "sequence_parallel.py"), "--seqlen", "301"])
    assert "2 ranks (torchrun), transport torch" in out, out
    rows = re.findall(r"^(\w+)\s+[\d.]+\s+([\d.e+-]+)\s+(ok|MISMATCH)$", out, re.M)
    assert [row[0] for row in rows] == ["ring", "zigzag", "stripe", "allgather", "ulysses", "hybrid"], out
    assert all(float(diff) < 1e-4 and check == "ok" for _, diff, check in rows), out


def test_sequence_parallel_exits_1_on_a_disagreement():
    # On CPU ranks (fp32) the ring differs from one device by about 1e-6.
    result = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                      str(EXAMPLES / "sequence_parallel.py"), "--seqlen", "301", "--strategies", "ring",
                      "--limit", "1e-12"])
    assert result.returncode != 0, result.stdout + result.stderr
    assert re.search(r"^ring\s+[\d.]+\s+[\d.e+-]+\s+MISMATCH$", result.stdout, re.M), result.stdout
    assert "outside 1e-12: ring" in result.stdout, result.stdout
