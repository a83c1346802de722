"""The command lines of the GPU benchmarks, checked without a GPU: bench/cp_bench.py's strategy
names, hybrid factorisations included."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import cp_bench  # noqa: E402


def test_hybrid_names_give_their_ulysses_degree():
    args = cp_bench.parse_args(["--strategies", "zigzag,hybrid:1,hybrid:4,hybrid", "--ulysses-degree", "2"])
    assert args.strategies == ["zigzag", "hybrid:1", "hybrid:4", "hybrid"]
    assert [cp_bench.hybrid_degree(n, args.ulysses_degree) for n in args.strategies] == [None, 1, 4, 2]


@pytest.mark.parametrize("name", ["hybrid:", "hybrid:x", "hybrid:0", "hybrid:-2", "zigzag:2", "rings"])
def test_unknown_strategy_names_are_refused(name, capsys):
    with pytest.raises(SystemExit):
        cp_bench.parse_args(["--strategies", name])
    assert f"got {name!r}" in capsys.readouterr().err


def test_a_profile_sums_gpu_work_by_kind_and_finds_the_idle_time():
    import cp_profile

    def event(cat, name, ts, dur, tid=7):
        return dict(cat=cat, name=name, ts=ts, dur=dur, tid=tid)

    events = [
        event("kernel", "void ringflash::cuda::sm90::forward_kernel<bf16, 128>(Params)", 100.0, 1000.0),
        event("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgs)", 150.0, 300.0, tid=9),  # overlaps
        event("gpu_memset", "Memset (Device)", 0.0, 50.0),
        event("kernel", "void ringflash::cuda::dot_do_o_kernel<bf16>(Params, long)", 1200.0, 100.0),  # after 100 us idle
        event("cpu_op", "aten::empty", 0.0, 5000.0),  # not GPU work
    ]
    p = cp_profile.summarize(events)
    assert (p["attention"], p["nccl"], p["memset"], p["other"], p["copy"]) == (1.0, 0.3, 0.05, 0.1, 0.0)
    assert p["span"] == pytest.approx(1.3) and p["idle"] == pytest.approx(0.15)  # 50-100 us and 1100-1200 us
    assert [a[4] for a in p["activities"]] == ["Memset", "forward_kernel", "ncclDevKernel_SendRecv", "dot_do_o_kernel"]
    assert cp_profile.summarize([])["span"] == 0.0
