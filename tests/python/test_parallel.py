"""ringflash.parallel_attention on gloo ranks: every strategy, forward and gradients, against the
float64 reference, at world sizes 1, 2 and 4; hybrid at 2 x 2; packed batches; transport choice and
bad input."""

import pytest
import torch
import torch.distributed as dist

import ringflash
from ringflash.parallel import init_process_groups, parallel_attention, shard_positions
from dist_harness import run_world
from parallel_check import GlobalReference
from reference import cu_seqlens, rounded_randn

STRATEGIES = ["ring", "zigzag", "stripe", "allgather", "ulysses"]
MASKS = [dict(causal=True), dict(), dict(causal=True, window=(40, 0))]
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA 4:1, MQA


def _inputs(batch, seqlen, heads, heads_kv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (rounded_randn((batch, seqlen, heads, dim), dtype, g),
            rounded_randn((batch, seqlen, heads_kv, dim), dtype, g),
            rounded_randn((batch, seqlen, heads_kv, dim), dtype, g))


def _run(strategy, group=None, mask=None):
    mask = dict(mask or {})
    window = mask.pop("window", (-1, -1))

    def run(q, k, v):
        return parallel_attention(q, k, v, strategy, group, window_size=window, return_lse=True, **mask)

    return run


def _padded_body(rank, world, seqlen, strategies, hybrid):
    checked = 0
    for mask in MASKS:
        for heads, heads_kv in HEADS:
            ref = GlobalReference(*_inputs(1, seqlen, heads, heads_kv, 64, torch.float32), torch.float32, **mask)
            for strategy in strategies:
                what = f"{strategy} P={world} {mask} H={heads}/{heads_kv}"
                ref.check(_run(strategy, mask=mask), shard_positions(seqlen, strategy), what=what)
                checked += 1
            for ulysses, ring in hybrid:
                group = init_process_groups(ulysses, ring)
                what = f"hybrid {ulysses}x{ring} {mask} H={heads}/{heads_kv}"
                ref.check(_run("hybrid", group, mask), shard_positions(seqlen, "hybrid", group), what=what)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_the_reference(world):
    hybrid = [(2, 2), (4, 1), (1, 4)] if world == 4 else [(2, 1)]
    results = run_world(world, _padded_body, 1013, STRATEGIES, hybrid)
    assert results == [len(MASKS) * len(HEADS) * (len(STRATEGIES) + len(hybrid))] * world


def test_world_of_one_without_torch_distributed():
    assert not dist.is_initialized()
    assert ringflash.distributed.selected()["transport"] == "none"
    counted = _padded_body(0, 1, 257, STRATEGIES, [])
    assert counted == len(MASKS) * len(HEADS) * len(STRATEGIES)


def _packed_body(rank, world, dtype):
    lengths = [300, 0, 1, 77, 513]
    cu = cu_seqlens(lengths)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(3)
    q = rounded_randn((total, 4, 64), dtype, g)
    k = rounded_randn((total, 2, 64), dtype, g)
    v = rounded_randn((total, 2, 64), dtype, g)
    ref = GlobalReference(q, k, v, dtype, cu_seqlens=cu, causal=True)
    for strategy in STRATEGIES:
        # Every document is sharded on its own; the local tensor holds them in order.
        positions = torch.cat([shard_positions(n, strategy) + int(cu[b]) for b, n in enumerate(lengths)])

        def run(q, k, v, strategy=strategy):
            return parallel_attention(q, k, v, strategy, causal=True, cu_seqlens=cu, return_lse=True)

        ref.check(run, positions, what=f"packed {strategy} P={world} {dtype}")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_packed_batches_with_an_empty_document(world):
    assert all(run_world(world, _packed_body, torch.bfloat16 if world == 4 else torch.float32))


def _compile_body(rank, world):
    q, k, v = _inputs(1, 64, 4, 2, 32, torch.float32)
    pos = shard_positions(64, "ulysses")
    ql, kl, vl = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
    results = {}
    # Compiled before any eager call, so the groups are first registered while tracing.
    for strategy, group in (("ring", None), ("ulysses", dist.group.WORLD)):
        def fn(q, k, v, strategy=strategy, group=group):
            return parallel_attention(q, k, v, strategy, group, causal=True) * 2.0

        got = torch.compile(fn, fullgraph=True, backend="eager")(ql, kl, vl)
        eager = fn(ql, kl, vl)
        got.sum().backward()
        results[strategy] = (torch.equal(eager, got), ql.grad is not None)
    return results


def test_torch_compile_fullgraph_on_ring_and_ulysses():
    for result in run_world(2, _compile_body):
        assert result == {"ring": (True, True), "ulysses": (True, True)}


def _keep_body(rank, world):
    seen = []
    calls = {name: getattr(ringflash._C, name) for name in ("parallel_forward", "parallel_backward")}

    def spy(name):
        def call(*args, **kwargs):
            seen.append((name, kwargs.get("kept_kv") is not None))
            return calls[name](*args, **kwargs)
        return call

    for name in calls:
        setattr(ringflash._C, name, spy(name))
    try:
        ref = GlobalReference(*_inputs(1, 301, 8, 2, 64, torch.float32), torch.float32, causal=True)
        for keep in (True, False):
            def run(q, k, v, keep=keep):
                return parallel_attention(q, k, v, "zigzag", causal=True, return_lse=True, keep_kv=keep)
            ref.check(run, shard_positions(301, "zigzag"), what=f"zigzag keep_kv={keep}")
        q, k, v = (ref.rows(t, shard_positions(301, "zigzag")) for t in ref.inputs)
        parallel_attention(q, k, v, "zigzag", causal=True)  # no gradient wanted: nothing kept
    finally:
        for name, call in calls.items():
            setattr(ringflash._C, name, call)
    return seen


def test_two_ranks_keep_the_forwards_key_values_for_the_backward():
    kept = [("parallel_forward", True), ("parallel_backward", True)]
    received = [("parallel_forward", False), ("parallel_backward", False)]
    for seen in run_world(2, _keep_body):
        assert seen == kept + received + [("parallel_forward", False)]


def _errors_body(rank, world):
    messages = {}
    q, k, v = _inputs(1, 16, 3, 3, 32, torch.float32)
    # Three heads over two ranks: ulysses splits heads unevenly, so this works.
    parallel_attention(q, k, v, "ulysses")
    try:
        parallel_attention(q, k, v, "hybrid")
    except ringflash.InvalidArgument as e:
        messages["hybrid without groups"] = str(e)
    try:
        parallel_attention(q, k, v, "spiral")
    except ringflash.InvalidArgument as e:
        messages["unknown strategy"] = str(e)
    try:
        parallel_attention(q, k.to(torch.float64), v, "ring")
    except ringflash.InvalidArgument as e:
        messages["dtype"] = str(e)
    # Shapes that differ across ranks: every rank gets the same clear error, no hang.
    q2 = q[:, : 8 + rank]
    try:
        parallel_attention(q2, k[:, : 8 + rank], v[:, : 8 + rank], "ring", causal=True)
    except ringflash.InvalidArgument as e:
        messages["mismatched shapes"] = str(e)
    # A group this rank is not in.
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes both
    try:
        parallel_attention(q, k, v, "ring", groups[1 - rank])
    except ringflash.InvalidArgument as e:
        messages["foreign group"] = str(e)
    return messages


def test_bad_input_gets_a_clear_error_on_every_rank():
    for messages in run_world(2, _errors_body):
        assert "strategy 'hybrid' needs a group with ulysses and ring groups" in messages["hybrid without groups"]
        assert "strategy must be one of" in messages["unknown strategy"]
        assert "k" in messages["dtype"] and "float64" in messages["dtype"]
        assert "mismatched shapes" in messages, messages
        assert "is not a member of the group" in messages["foreign group"]
