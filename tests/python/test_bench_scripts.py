"""The GPU benchmarks, checked without a GPU: bench/cp_bench.py's strategy names (hybrid
factorisations included) and its check's differences, bench/cp_profile.py's summary of a trace,
bench/zigzag_steps_bench.py's plan of a rank's kernel calls, run on the CPU kernels, and
bench/gpu_bench.py's options."""

import json
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


def test_the_check_compares_a_few_heads_at_a_time():
    import torch
    b = torch.randn(1, 50, 9, 8, dtype=torch.bfloat16)
    a = b.clone()
    a[0, 7, 8, 3] += 3.0  # in the last chunk of heads, which is short
    diff, scale = cp_bench.max_abs_diff_and_max(a, b, heads_per_chunk=4)
    assert diff == (a.float() - b.float()).abs().max().item() > 2.9
    assert scale == b.float().abs().max().item()


def test_a_shard_is_new_leaves_of_its_rows():
    import torch
    inputs = [torch.arange(12.0).reshape(1, 6, 1, 2).requires_grad_(i < 3) for i in range(4)]
    positions = torch.tensor([4, 1, 5])
    shards = cp_bench.shard(inputs, positions, "cpu")
    assert [s.requires_grad for s in shards] == [True, True, True, False]
    assert all(s.is_leaf for s in shards)
    assert shards[3][0, :, 0, 0].tolist() == [8.0, 2.0, 10.0]


def test_the_table_shows_how_far_apart_the_gpus_ran_the_one_gpu_call():
    row = dict(seqlen=32768, heads_kv=8, strategy="zigzag", t1_ms=50.0, tp_ms=13.0, t1_spread=0.025,
               tflops_per_gpu=500.0, one_gpu_tflops=550.0, efficiency=0.96, **{"pass": "fwd_bwd"})
    header, line = cp_bench.table([row]).splitlines()
    assert "GPUs %" in header
    assert "50.00    2.5     13.00" in line
    failed = dict(seqlen=32768, heads_kv=8, strategy="ring", error="boom", **{"pass": "fwd"})
    assert "| - - - |" in cp_bench.table([failed]).splitlines()[1]


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


def test_a_profile_prints_energy_where_a_counter_is_there():
    import cp_profile

    assert cp_profile.fixed(None, 6, 3) == "     -"
    assert cp_profile.fixed(1.23456, 6, 3) == " 1.235"
    assert cp_profile.fixed(None, 0, 2) == "-" and cp_profile.fixed(22.5849, 0, 2) == "22.58"
    if not cp_profile.torch.cuda.is_available():  # no GPU, no counter: "-" in the table
        assert cp_profile.EnergyCounter("cpu").read() is None


def test_a_profile_splits_the_gpus_idle_time_by_what_it_waited_for():
    import cp_profile

    def gpu(name, ts, dur, correlation):
        return dict(cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=correlation))

    def launch(ts, dur, correlation):
        return dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=dur, args=dict(correlation=correlation))

    events = [
        dict(cat="user_annotation", name=cp_profile.CALL_MARKER, ts=0.0, dur=900.0),
        launch(40.0, 5.0, 1), gpu("void a_kernel<int>(int)", 50.0, 100.0, 1),
        launch(60.0, 5.0, 2), gpu("b_kernel", 200.0, 100.0, 2),  # launched long before: waited on another stream
        launch(340.0, 10.0, 3), gpu("c_kernel", 360.0, 40.0, 3),  # launched after b ended: waited on the host
        launch(350.0, 5.0, 4), gpu("d_kernel", 401.0, 10.0, 4),  # 1 us apart: the GPU's own
    ]
    w = cp_profile.host_waits(events)
    assert w["start"] == pytest.approx(0.05)
    assert w["other"] == pytest.approx(0.05) and w["host"] == pytest.approx(0.06)
    assert w["gaps"] == [(0.1, 0.05, "other", "b_kernel"), (0.25, 0.06, "host", "c_kernel")]
    assert cp_profile.host_waits([])["gaps"] == []


@pytest.mark.parametrize("heads_kv", [1, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_step_calls_cover_every_causal_pair_once_per_pass(world, heads_kv):
    """bench/zigzag_steps_bench.py's plan of a rank's kernel calls: under each call's offsets (the
    kernel's causal mask over contiguous positions) a pair is visible exactly when it is under the
    true positions, and over every rank the calls of each pass see each causal pair once in each
    half of the K/V heads (a call on every head sees it in both)."""
    import zigzag_steps_bench as zz

    halves = {-1: (0, 1), 0: (0,), 1: (1,)}
    seqlen = 4 * world * 3  # chunks of 6 rows
    for pass_name in ("fwd", "bwd"):
        seen = {}
        for rank in range(world):
            calls = [c for c in zz.zigzag_calls(world, rank, seqlen, heads_kv) if c.pass_name == pass_name]
            assert len(calls) == world + (pass_name == "bwd" and world > 1)
            assert all(c.heads == -1 for c in calls) or (pass_name == "bwd" and heads_kv > 1)
            q_pos = zz.zigzag_positions(world, rank, seqlen)
            for c in calls:
                k_pos = zz.zigzag_positions(world, c.source, seqlen)
                for i in range(c.q_rows[0], sum(c.q_rows)):
                    for j in range(c.k_rows[0], sum(c.k_rows)):
                        kernel_sees = c.k_offset + (j - c.k_rows[0]) <= c.q_offset + (i - c.q_rows[0])
                        assert kernel_sees == (k_pos[j] <= q_pos[i]), (rank, c, i, j)
                        for half in halves[c.heads] if kernel_sees else ():
                            key = (q_pos[i], k_pos[j], half)
                            seen[key] = seen.get(key, 0) + 1
        assert seen == {(i, j, h): 1 for i in range(seqlen) for j in range(i + 1) for h in (0, 1)}


def test_zigzag_step_plan_refuses_lengths_that_do_not_split(capsys):
    import zigzag_steps_bench as zz

    with pytest.raises(ValueError):
        zz.zigzag_calls(4, 0, 100)
    with pytest.raises(SystemExit):
        zz.parse_args(["--world", "4", "--seqlen", "100"])
    assert "multiple of 2 * --world" in capsys.readouterr().err


def test_zigzag_steps_bench_runs_on_the_cpu_and_its_calls_agree_with_one_call(tmp_path, capsys):
    import zigzag_steps_bench as zz

    path = tmp_path / "zz.json"
    rc = zz.main(["--device", "cpu", "--world", "3", "--seqlen", "192", "--heads", "4", "--heads-kv", "2",
                  "--hdim", "64", "-w", "0", "-n", "1", "--json", str(path)])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(path.read_text())
    assert len(result["calls"]) == 3 * (3 + 4)  # per rank: 3 forward calls, 4 backward
    assert all(c["out"] < 2e-2 and c["dq"] < 2e-2 for c in result["checks"].values())
    assert set(result["summary"]) == {"fwd", "bwd", "fwd_bwd"}
    assert all(s["kernel_efficiency"] > 0 for s in result["summary"].values())


def test_gpu_bench_takes_its_timing_options():
    import gpu_bench
    assert gpu_bench.parse_args(["--interleave", "30"]).interleave == 30
    assert gpu_bench.parse_args(["--steady", "2"]).steady == 2
    defaults = gpu_bench.parse_args([])
    assert defaults.interleave == 0 and defaults.steady == 0


@pytest.mark.parametrize("argv, message", [
    (["--interleave", "-1"], "--interleave must be >= 0, got -1"),
    (["--steady", "-1"], "--steady must be >= 0 seconds, got -1"),
    (["--steady", "2", "--interleave", "30"], "--steady and --interleave are two ways of timing: give one"),
])
def test_gpu_bench_refuses_bad_timing_options(argv, message, capsys):
    import gpu_bench
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(argv)
    assert message in capsys.readouterr().err
