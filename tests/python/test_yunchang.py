"""ringflash.yunchang against the float64 reference: LongContextAttention and its QKV-packed form for
every ring_impl_type, forward and gradients, on 4 gloo ranks laid out by set_seq_parallel_pg as
2 x 2, 4 x 1, 1 x 4, both rank orders, and with data-parallel replicas (groups of 2 and 1); the shard
layout against yunchang's; UlyssesAttention on the ulysses group; bad input on every rank."""

import pytest
import torch

import ringflash
from ringflash.parallel import parallel_group, shard_positions
from ringflash.yunchang import (
    PROCESS_GROUP,
    RING_IMPL_TYPES,
    AttnType,
    LongContextAttention,
    LongContextAttentionQKVPacked,
    UlyssesAttention,
    set_seq_parallel_pg,
)
from dist_harness import run_world
from parallel_check import GlobalReference
from reference import rounded_randn

DIM = 32
# (sp_ulysses_degree, sp_ring_degree, use_ulysses_low) on 4 ranks; 2 x 1, 1 x 2 and 1 x 1 leave 2 and 4
# data-parallel replicas.
LAYOUTS = [(2, 2, True), (4, 1, True), (1, 4, True), (2, 2, False), (2, 1, True), (1, 2, False), (1, 1, True)]
IMPLS = ["basic", "zigzag", "strip"]
# (seqlen, heads, heads_kv, causal, window, dtype): a length every yunchang layout divides, and one
# that no degree divides with heads the ulysses degree does not divide.
CASES = [(96, 4, 2, True, (-1, -1), torch.float32), (67, 6, 3, False, (16, 4), torch.float32)]


def _inputs(seqlen, heads, heads_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (rounded_randn((1, seqlen, heads, DIM), dtype, g), rounded_randn((1, seqlen, heads_kv, DIM), dtype, g),
            rounded_randn((1, seqlen, heads_kv, DIM), dtype, g))


def _yunchang_positions(seqlen, impl, rank, world, ring_degree, ulysses_degree):
    """The positions that yunchang's EXTRACT_FUNC_DICT gives `rank` (ulysses groups of consecutive ranks,
    lengths that divide), derived here from its layout: ring rank r = rank // U, ulysses rank u = rank % U."""
    positions = torch.arange(seqlen)
    r, u = divmod(rank, ulysses_degree)
    if impl == "basic":
        return positions.chunk(world)[rank]
    if impl == "zigzag":
        chunks = positions.chunk(2 * ring_degree)
        return torch.cat([chunks[r], chunks[2 * ring_degree - 1 - r]]).chunk(ulysses_degree)[u]
    strided = positions.reshape(seqlen // ring_degree, ring_degree).t().reshape(-1)  # ring rank r's stripe, in turn
    return strided.chunk(world)[rank]


def _impls(ulysses, ring):
    """The ring_impl_types to check at a layout: yunchang's three, and the "stripe" alias at 2 x 2."""
    return IMPLS + ["stripe"] if (ulysses, ring) == (2, 2) else IMPLS


def _out_only(module_call, ref, positions):
    """The modules return out alone: the lse check gets the reference's rows, so out, dq, dk and dv
    are what is checked."""
    def run(q, k, v):
        return module_call(q, k, v), ref.rows(ref.results["reference"][1], positions, lse=True)

    return run


def _usp_body(rank, world):
    import torch.distributed as dist

    checked, layouts_match = [], []
    big = GlobalReference(*_inputs(1013, 8, 2, torch.float32, 5), torch.float32, causal=True)
    for ulysses, ring, low in LAYOUTS:
        set_seq_parallel_pg(ulysses, ring, rank, world, use_ulysses_low=low)
        sp = ulysses * ring
        replica = rank // sp  # replicas see different data
        sizes = (dist.get_world_size(PROCESS_GROUP.ULYSSES_PG), dist.get_world_size(PROCESS_GROUP.RING_PG))
        assert sizes == (ulysses, ring), sizes
        tag = f"{ulysses}x{ring}{'' if low else ' ring-low'} rank {rank}"
        for impl in _impls(ulysses, ring):
            group = parallel_group(ulysses=PROCESS_GROUP.ULYSSES_PG, ring=PROCESS_GROUP.RING_PG,
                                   ring_layout=RING_IMPL_TYPES[impl])
            attn = LongContextAttention(ring_impl_type=impl, attn_type=AttnType.TORCH)
            for seqlen, heads, heads_kv, causal, window, dtype in CASES:
                ref = GlobalReference(*_inputs(seqlen, heads, heads_kv, dtype, replica), dtype, causal=causal,
                                      window=window)
                positions = shard_positions(seqlen, "hybrid", group)
                if low and sp == world and seqlen % (2 * world) == 0:
                    layouts_match.append(torch.equal(positions, _yunchang_positions(seqlen, impl, rank, world, ring,
                                                                                    ulysses)))
                def call(q, k, v, attn=attn, causal=causal, window=window):
                    return attn(q, k, v, causal=causal, window_size=window)

                ref.check(_out_only(call, ref, positions), positions, what=f"LongContextAttention {impl} {tag} "
                          f"S={seqlen} H={heads}/{heads_kv} causal={causal} window={window}")
            checked.append(("LongContextAttention", impl, ulysses, ring, low))
            # Packed qkv (B, S/P, 3, H, D).
            packed = LongContextAttentionQKVPacked(ring_impl_type=impl)
            ref = GlobalReference(*_inputs(50, 4, 4, torch.float32, replica), torch.float32, causal=True)
            positions = shard_positions(50, "hybrid", group)
            def call_packed(q, k, v, packed=packed):
                return packed(torch.stack([q, k, v], dim=2), causal=True)  # 3 x (B, S, H, D) -> (B, S, 3, H, D)

            ref.check(_out_only(call_packed, ref, positions), positions,
                      what=f"LongContextAttentionQKVPacked {impl} {tag}")
            checked.append(("LongContextAttentionQKVPacked", impl, ulysses, ring, low))
        if (ulysses, ring, low) == (2, 2, True):
            # The long case, and yunchang's UlyssesAttention on the ulysses group alone.
            attn = LongContextAttention(ring_impl_type="zigzag")
            group = parallel_group(ulysses=PROCESS_GROUP.ULYSSES_PG, ring=PROCESS_GROUP.RING_PG, ring_layout="zigzag")
            positions = shard_positions(1013, "hybrid", group)
            big.check(_out_only(lambda q, k, v: attn(q, k, v, 0.0, None, True), big, positions), positions,
                      what=f"LongContextAttention zigzag S=1013 {tag}")
            ulysses_attn = UlyssesAttention(PROCESS_GROUP.ULYSSES_PG)
            assert ulysses_attn.attn_type is AttnType.FA
            positions = shard_positions(1013, "ulysses", parallel_group(PROCESS_GROUP.ULYSSES_PG))
            big.check(_out_only(lambda q, k, v: ulysses_attn(q, k, v, causal=True), big, positions), positions,
                      what=f"UlyssesAttention on the ulysses group, rank {rank}")
            checked.append(("UlyssesAttention", "", ulysses, 1, low))
    return checked, layouts_match


def test_long_context_attention_for_every_ring_impl_and_layout():
    expected = {("UlyssesAttention", "", 2, 1, True)}
    for ulysses, ring, low in LAYOUTS:
        for impl in _impls(ulysses, ring):
            expected |= {(name, impl, ulysses, ring, low) for name in ("LongContextAttention",
                                                                       "LongContextAttentionQKVPacked")}
    # yunchang's layout is checked at 2 x 2, 4 x 1 and 1 x 4 (one replica, ulysses groups of consecutive ranks).
    for checked, layouts_match in run_world(4, _usp_body):
        assert set(checked) == expected
        assert len(layouts_match) == 3 * len(IMPLS) + 1 and all(layouts_match), layouts_match


def test_without_torch_distributed():
    with pytest.raises(ringflash.InvalidArgument, match=r"\[set_seq_parallel_pg\] torch.distributed must be init"):
        set_seq_parallel_pg(1, 1, 0, 1)
    assert PROCESS_GROUP.ULYSSES_PG is None and PROCESS_GROUP.RING_PG is None
    with pytest.raises(ringflash.InvalidArgument, match=r"\[LongContextAttention\] call set_seq_parallel_pg\(\) first"):
        LongContextAttention()
    assert UlyssesAttention().attn_type is AttnType.FA
    assert RING_IMPL_TYPES == {"basic": "contiguous", "zigzag": "zigzag", "strip": "stripe", "stripe": "stripe"}


def _errors_body(rank, world):
    import torch.distributed as dist

    def error_of(fn):
        try:
            fn()
        except ringflash.Error as e:
            return type(e).__name__, str(e)
        return None

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 4, DIM, generator=g)
    messages = {"before set_seq_parallel_pg": error_of(lambda: LongContextAttention())}
    for name, args in (("degrees do not divide", (3, 1, rank, world)), ("degrees exceed", (2, 2, rank, world)),
                       ("world_size", (2, 1, rank, 4)), ("rank", (2, 1, 1 - rank, world)),
                       ("degree", (0, 2, rank, world))):
        messages[name] = error_of(lambda: set_seq_parallel_pg(*args))
    set_seq_parallel_pg(1, 2, rank, world)
    messages["ring_impl_type"] = error_of(lambda: LongContextAttention(ring_impl_type="basic_pytorch"))
    messages["attn_processor"] = error_of(lambda: LongContextAttention(attn_processor=torch.nn.Identity()))
    messages["all-to-all dims"] = error_of(lambda: LongContextAttention(scatter_idx=1, gather_idx=2))
    messages["packed all-to-all dims"] = error_of(lambda: LongContextAttentionQKVPacked(scatter_idx=2))
    messages["qkv shape"] = error_of(lambda: LongContextAttentionQKVPacked()(q))
    messages["dropout"] = error_of(lambda: LongContextAttention()(q, q, q, dropout_p=0.1))
    # Ranks that disagree on the layout of the shards.
    attn = LongContextAttention(ring_impl_type=["basic", "zigzag"][rank])
    messages["ranks disagree on ring_impl_type"] = error_of(lambda: attn(q, q, q, causal=True))
    # Groups that do not form a 2D layout, or lack this rank.
    ulysses, ring = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
    PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = dist.group.WORLD
    messages["overlapping groups"] = error_of(lambda: LongContextAttention())
    singles = [dist.new_group([0]), dist.new_group([1])]  # every rank makes both
    PROCESS_GROUP.ULYSSES_PG = singles[1 - rank]
    messages["group without this rank"] = error_of(lambda: LongContextAttention())
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = ulysses, ring
    messages["afterwards"] = tuple(LongContextAttention()(q, q, q, causal=True).shape)
    return messages


def test_bad_input_gets_a_clear_error_on_every_rank():
    expected = {
        "before set_seq_parallel_pg": ("InvalidArgument", "[LongContextAttention] call set_seq_parallel_pg() first"),
        "degrees do not divide": ("InvalidArgument",
                                  "sp_ulysses_degree x sp_ring_degree must divide the world size 2, got 3 x 1 = 3"),
        "degrees exceed": ("InvalidArgument", "must divide the world size 2, got 2 x 2 = 4"),
        "world_size": ("InvalidArgument", "world_size must be torch.distributed's world size 2, got 4"),
        "rank": ("InvalidArgument", "rank must be this process's rank"),
        "degree": ("InvalidArgument", "sp_ulysses_degree must be an int >= 1, got 0"),
        "ring_impl_type": ("NotSupported", "ring_impl_type must be one of basic, zigzag, strip, stripe, got "
                                           "'basic_pytorch'"),
        "attn_processor": ("NotSupported", "attn_processor must be None"),
        "all-to-all dims": ("NotSupported", "[LongContextAttention] (scatter_idx, gather_idx) must be (2, 1)"),
        "packed all-to-all dims": ("NotSupported",
                                   "[LongContextAttentionQKVPacked] (scatter_idx, gather_idx) must be (3, 1)"),
        "qkv shape": ("InvalidArgument", "qkv must have shape (B, S, 3, H, D), got (1, 16, 4, 32)"),
        "dropout": ("NotSupported", "dropout_p must be 0"),
        "ranks disagree on ring_impl_type": ("InvalidArgument", "hybrid_ring_layout differs across ranks"),
        "overlapping groups": ("InvalidArgument", "PROCESS_GROUP.ULYSSES_PG and RING_PG must share only this rank"),
        "group without this rank": ("InvalidArgument", "PROCESS_GROUP.ULYSSES_PG must hold this rank"),
    }
    for messages in run_world(2, _errors_body, env={"RINGFLASH_COMM_TIMEOUT": "30"}):
        for case, (kind, text) in expected.items():
            assert messages[case] is not None and messages[case][0] == kind and text in messages[case][1], \
                (case, messages[case])
        assert messages["afterwards"] == (1, 16, 4, DIM)
