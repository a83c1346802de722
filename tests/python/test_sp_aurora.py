"""ringflash.sp_aurora against the float64 reference: every name, forward and gradients, in one process
and on gloo ranks in groups of 1, 2 and 4; torch.compile on a Ulysses module; bad input on every
rank; and an mpiexec launch over the mpi transport.

Run as a script (``mpiexec -n 2 python test_sp_aurora.py``), the module is the mpiexec check itself.
"""

import os
import shutil
import subprocess
import sys

import torch

import ringflash
from ringflash.parallel import parallel_group, shard_positions
from ringflash.sp_aurora import (
    AttnType,
    UlyssesAttention,
    auto_select_flash_attn_forward,
    cleanup_distributed,
    detect_mpi_environment,
    get_device_for_rank,
    get_sycl_device_info,
    is_sycl_available,
    select_flash_attn_impl,
    setup_mpi_distributed,
    sp_aurora_func,
    sp_aurora_kvpacked_func,
    sp_aurora_qkvpacked_func,
    ulysses_flash_attn_func,
    ulysses_flash_attn_kvpacked_func,
    ulysses_flash_attn_qkvpacked_func,
)
from parallel_check import GlobalReference
from reference import rounded_randn

# (seqlen, heads, heads_kv, causal, dtype) per group size: lengths that P does not divide, Hq < P
# (ulysses ranks without heads), heads that P does not divide, GQA and MQA, ranks without rows.
CASES = {
    4: [(1013, 8, 2, True, torch.float32), (67, 3, 3, False, torch.float32), (130, 4, 1, True, torch.bfloat16),
        (3, 2, 2, True, torch.float32)],
    2: [(131, 6, 2, False, torch.float32), (33, 3, 3, True, torch.float32)],
    1: [(45, 4, 2, True, torch.float32), (1, 2, 2, False, torch.float32)],
}
DIM = 32


def _inputs(seqlen, heads, heads_kv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (rounded_randn((1, seqlen, heads, DIM), dtype, g), rounded_randn((1, seqlen, heads_kv, DIM), dtype, g),
            rounded_randn((1, seqlen, heads_kv, DIM), dtype, g))


def _with_lse(result):
    """(out, lse) of a call with return_attn_probs=True: ring returns (out, lse, None), ulysses (out, lse)."""
    assert isinstance(result, tuple) and len(result) in (2, 3), type(result)
    if len(result) == 3:
        assert result[2] is None
    return result[0], result[1]


def _runs(group, causal, mha):
    """(name, strategy of its layout, run(q, k, v) -> (out, lse) or out) for every name of sp_aurora."""
    opts = dict(causal=causal, group=group, return_attn_probs=True)

    def kv(k, v):
        return torch.stack([k, v], dim=2)  # 2 x (B, S, Hkv, D) -> (B, S, 2, Hkv, D)

    runs = [
        ("sp_aurora_func", "ring", lambda q, k, v: _with_lse(sp_aurora_func(q, k, v, **opts))),
        ("sp_aurora_kvpacked_func", "ring", lambda q, k, v: _with_lse(sp_aurora_kvpacked_func(q, kv(k, v), **opts))),
        ("ulysses_flash_attn_func", "ulysses", lambda q, k, v: _with_lse(ulysses_flash_attn_func(q, k, v, **opts))),
        ("ulysses_flash_attn_kvpacked_func", "ulysses",
         lambda q, k, v: _with_lse(ulysses_flash_attn_kvpacked_func(q, kv(k, v), **opts))),
        ("UlyssesAttention", "ulysses",
         lambda q, k, v: UlyssesAttention(group, attn_type=AttnType.INTEL_SYCL)(q, k, v, causal=causal)),
    ]
    if mha:
        runs += [
            ("sp_aurora_qkvpacked_func", "ring",
             lambda q, k, v: _with_lse(sp_aurora_qkvpacked_func(torch.stack([q, k, v], dim=2), **opts))),
            ("ulysses_flash_attn_qkvpacked_func", "ulysses",
             lambda q, k, v: _with_lse(ulysses_flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **opts))),
        ]
    return runs


def _out_only(run, ref, positions):
    """A module returns out alone: its lse check gets the reference's rows, so out, dq, dk and dv
    are what is checked."""
    def wrapped(q, k, v):
        out = run(q, k, v)
        if isinstance(out, tuple):
            return out
        return out, ref.rows(ref.results["reference"][1], positions, lse=True)

    return wrapped


def _check_every_name(size, group, rank):
    """Checks every name on this rank's shard, for the cases of groups of `size`; returns the names."""
    checked = set()
    for seqlen, heads, heads_kv, causal, dtype in CASES[size]:
        ref = GlobalReference(*_inputs(seqlen, heads, heads_kv, dtype), dtype, causal=causal)
        for name, strategy, run in _runs(group, causal, heads == heads_kv):
            positions = shard_positions(seqlen, strategy, parallel_group(group))
            what = f"{name} P={size} rank {rank} S={seqlen} H={heads}/{heads_kv} causal={causal} {dtype}"
            ref.check(_out_only(run, ref, positions), positions, what=what)
            checked.add(name)
    return checked


def _names_body(rank, world):
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    singles = [dist.new_group([r]) for r in range(world)]
    results = {}
    for size, group in ((4, None), (2, pairs[rank // 2]), (1, singles[rank])):
        results[size] = sorted(_check_every_name(size, group, rank))
    return results


ALL_NAMES = sorted(["sp_aurora_func", "sp_aurora_kvpacked_func", "sp_aurora_qkvpacked_func", "ulysses_flash_attn_func",
                    "ulysses_flash_attn_kvpacked_func", "ulysses_flash_attn_qkvpacked_func", "UlyssesAttention"])


def test_every_name_on_groups_of_1_2_and_4():
    from dist_harness import run_world

    for result in run_world(4, _names_body):
        assert result == {4: ALL_NAMES, 2: ALL_NAMES, 1: ALL_NAMES}


def test_one_process_without_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert _check_every_name(1, None, 0) == set(ALL_NAMES)


def test_capability_queries():
    assert is_sycl_available() is False
    info = get_sycl_device_info("cpu")
    assert "SYCL is not available" in info["error"]
    assert info["backends"] == {"cpu": True, "cuda": ringflash.has_cuda(), "mpi": ringflash.has_mpi(),
                                "nccl": ringflash.has_nccl(), "sycl": False}
    assert info["selected"] == ringflash.selected("cpu")
    assert info["build"] == ringflash.build_info()
    assert "meta" in get_sycl_device_info("meta")["selected"]  # no kernels for meta tensors: the error, not a raise
    assert detect_mpi_environment() is ringflash.distributed.launched_by_mpiexec()
    assert get_device_for_rank(3) == (torch.device("cuda", 3 % torch.cuda.device_count()) if torch.cuda.is_available()
                                      else torch.device("cpu"))
    cleanup_distributed()  # no process group: nothing to do


def test_auto_select_flash_attn_forward_takes_sp_aurora_layout():
    # sp_aurora's single-device layout: (B, H, S, D) in and out, lse (B, H, S).
    q, k, v = _inputs(77, 4, 2, torch.float32)
    ref = GlobalReference(q, k, v, torch.float32, causal=True)

    def run(q, k, v):
        out, lse = auto_select_flash_attn_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        assert out.shape == (1, 4, 77, DIM) and lse.shape == (1, 4, 77)
        return out.transpose(1, 2), lse

    ref.check(run, torch.arange(77), what="auto_select_flash_attn_forward")
    fn = select_flash_attn_impl(AttnType.FA3)
    assert torch.equal(fn(q, k, v, causal=True), ringflash.flash_attn_func(q, k, v, causal=True))


def test_attn_type_takes_both_spellings():
    assert AttnType.from_string("fa") is AttnType.FA
    assert AttnType.from_string("flash_attn") is AttnType.FA  # sp_aurora's value
    assert AttnType.from_string("flash_attn_3") is AttnType.FA3
    assert AttnType.TORCH == "torch" and AttnType.INTEL_SYCL.value == "intel_sycl"
    assert UlyssesAttention().attn_type is AttnType.TORCH
    assert UlyssesAttention(attn_type="intel_onednn").attn_type is AttnType.INTEL_ONEDNN


def _errors_body(rank, world):
    import torch.distributed as dist

    def error_of(fn):
        try:
            fn()
        except ringflash.Error as e:
            return type(e).__name__, str(e)
        return None

    q, k, v = _inputs(16, 4, 2, torch.float32)
    messages = {
        "q heads not a multiple of kv heads": error_of(lambda: UlyssesAttention()(q[:, :, :3], k, v)),
        "dropout": error_of(lambda: sp_aurora_func(q, k, v, dropout_p=0.1)),
        "kv shape": error_of(lambda: sp_aurora_kvpacked_func(q, torch.stack([k, v, v], dim=2))),
        "qkv shape": error_of(lambda: ulysses_flash_attn_qkvpacked_func(q)),
        "all-to-all dims": error_of(lambda: UlyssesAttention(scatter_idx=1, gather_idx=2)),
        "attn_type": error_of(lambda: UlyssesAttention(attn_type="sycl_turbo")),
        "ranks disagree on causal": error_of(lambda: ulysses_flash_attn_func(q, k, v, causal=bool(rank))),
        "ranks disagree on heads": error_of(lambda: sp_aurora_func(q[:, :, : 2 + 2 * rank], k, v)),
        "stage": error_of(lambda: select_flash_attn_impl(AttnType.FA, stage="fwd-only")),
    }
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes both
    messages["foreign group"] = error_of(lambda: sp_aurora_func(q, k, v, group=groups[1 - rank]))
    messages["foreign module group"] = error_of(lambda: UlyssesAttention(groups[1 - rank])(q, k, v))
    # The calls above leave the ranks able to go on.
    out = sp_aurora_func(q, k, v, causal=True)
    messages["afterwards"] = tuple(out.shape)
    return messages


def _compile_body(rank, world):
    torch._dynamo.reset()
    q, k, v = _inputs(64, 4, 2, torch.float32)
    pos = shard_positions(64, "ulysses")
    module = UlyssesAttention()

    def fn(q, k, v):
        return module(q, k, v, causal=True) * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    grads = []
    for f in (fn, compiled):
        xs = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
        out = f(*xs)
        out.sum().backward()
        grads.append([out.detach()] + [x.grad for x in xs])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def _bad_input_and_compile_body(rank, world):
    return _errors_body(rank, world), _compile_body(rank, world)


def test_bad_input_gets_a_clear_error_on_every_rank_and_compile_traces_ulysses():
    from dist_harness import run_world

    expected = {
        "q heads not a multiple of kv heads": ("InvalidArgument", "must be a multiple of the number of k/v heads"),
        "dropout": ("NotSupported", "[sp_aurora_func] dropout_p must be 0"),
        "kv shape": ("InvalidArgument", "[sp_aurora_kvpacked_func] kv must have shape (B, S, 2, H, D), got (1, 16, 3"),
        "qkv shape": ("InvalidArgument", "[ulysses_flash_attn_qkvpacked_func] qkv must have shape (B, S, 3, H, D)"),
        "all-to-all dims": ("NotSupported", "[UlyssesAttention] (scatter_idx, gather_idx) must be (2, 1)"),
        "attn_type": ("InvalidArgument", "attn_type must be an AttnType or one of its values, got 'sycl_turbo'"),
        "ranks disagree on causal": ("InvalidArgument", "causal differs across ranks"),
        "ranks disagree on heads": ("InvalidArgument", "number of q heads differs across ranks"),
        "stage": ("NotSupported", "stage must be 'fwd-bwd'"),
        "foreign group": ("InvalidArgument", "is not a member of the group"),
        "foreign module group": ("InvalidArgument", "is not a member of the group"),
    }
    results = run_world(2, _bad_input_and_compile_body, env={"RINGFLASH_COMM_TIMEOUT": "30"})
    for messages, compiled_matches in results:
        for case, (kind, text) in expected.items():
            assert messages[case] is not None and messages[case][0] == kind and text in messages[case][1], \
                (case, messages[case])
        assert messages["afterwards"] == (1, 16, 4, DIM)
        assert compiled_matches


# mpiexec: this file run as a script on every rank.

MPI_SEQLEN = 301


def _mpi_main():
    info = setup_mpi_distributed()
    assert info["launcher"] == "mpiexec" and info["world_size"] == 2, info
    assert ringflash.selected("cpu")["transport"] == "mpi"
    q, k, v = _inputs(MPI_SEQLEN, 4, 2, torch.float32)
    ref = GlobalReference(q, k, v, torch.float32, causal=True)
    ref.check(lambda q, k, v: _with_lse(sp_aurora_func(q, k, v, causal=True, return_attn_probs=True)),
              shard_positions(MPI_SEQLEN, "ring"), what=f"sp_aurora_func under mpiexec, rank {info['rank']}")
    cleanup_distributed()
    assert not torch.distributed.is_initialized()
    # A file per rank: lines that ranks print to one stdout may interleave.
    with open(os.path.join(sys.argv[1], f"rank{info['rank']}"), "w") as f:
        f.write("mpi ok")


def test_mpiexec_launch_runs_sp_aurora_func_over_mpi(tmp_path):
    import pytest

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None or not ringflash.has_mpi():
        pytest.skip("needs mpiexec and a ringflash built with MPI")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for name in ("RINGFLASH_TRANSPORT", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    result = subprocess.run([mpiexec, "--oversubscribe", "-n", "2", sys.executable, os.path.abspath(__file__),
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["mpi ok"] * 2, result.stdout


if __name__ == "__main__":
    _mpi_main()
