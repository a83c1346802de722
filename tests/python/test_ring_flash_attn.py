"""ringflash.ring_flash_attn, ring-flash-attn's API on ringflash.

Every drop-in function is called by name, forward, lse and gradients against the float64
reference, at world size 1 (in this process, without torch.distributed) and on 2 and 4 gloo ranks:
ring, zigzag and stripe with awkward lengths (not divisible by P or 2P, which ring-flash-attn
refuses), causal and not, GQA; their varlen forms with local cu_seqlens and an empty document;
llama3 with its prepare helper over a packed stream whose documents cross rank boundaries. Also:
the layouts against ring-flash-attn's conventions, the signatures against ring-flash-attn's,
torch.compile, the Hugging Face adapter, and bad input (an error on every rank, no hang).

Each world body returns the names it called; the tests check that together they cover __all__.
"""

import functools
import inspect
import traceback

import pytest
import torch
import torch.distributed as dist

import ringflash
import ringflash.ring_flash_attn as rfa
from ringflash.parallel import shard_positions
from dist_harness import run_world
from parallel_check import GlobalReference
from reference import cu_seqlens, rounded_randn

FAMILIES = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn"}
VARIANTS = ("func", "kvpacked_func", "qkvpacked_func")
LLAMA3 = [f"llama3_flash_attn_varlen_{v}" for v in VARIANTS]
PADDED = [f"{prefix}_{v}" for prefix in FAMILIES.values() for v in VARIANTS]
VARLEN = [f"{prefix}_varlen_{v}" for prefix in FAMILIES.values() for v in VARIANTS]
HF = ["substitute_hf_flash_attn", "update_ring_flash_attn_params", "use_ring_attn"]
MASKS = [dict(causal=True), dict(causal=False)]


def _inputs(shape_q, shape_kv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rounded_randn(shape_q, dtype, g), rounded_randn(shape_kv, dtype, g), rounded_randn(shape_kv, dtype, g)


def _pack(name, q, k, v, dim):
    """The tensors a variant takes: (q, k, v), (q, kv) or (qkv,), stacked along `dim` so that the
    gradients flow back to q, k and v."""
    if name.endswith("_qkvpacked_func"):
        return (torch.stack((q, k, v), dim=dim),)
    if name.endswith("_kvpacked_func"):
        return q, torch.stack((k, v), dim=dim)
    return q, k, v


def _checked(name, result):
    out, lse, probs = result
    assert probs is None, f"{name}: return_attn_probs gives (out, lse, None)"
    return out, lse


# ---- ring, zigzag, stripe ----------------------------------------------------------------------

def _padded_run(name, causal, window=(-1, -1)):
    fn = getattr(rfa, name)

    def run(q, k, v):
        # Positional: dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        # return_attn_probs, group, in ring-flash-attn's order.
        return _checked(name, fn(*_pack(name, q, k, v, 2), 0.0, None, causal, window, None, False, True, None))

    return run


def _padded_body(rank, world):
    called = set()
    # Causal on an awkward length (for P > 1, P does not divide S), non-causal where 2P | S.
    for seqlen, mask in ((6 * world + 3, MASKS[0]), (8 * world, MASKS[1])):
        for heads, heads_kv in ((4, 2), (4, 4)):
            ref = GlobalReference(*_inputs((1, seqlen, heads, 32), (1, seqlen, heads_kv, 32), seed=seqlen),
                                  torch.float32, **mask)
            for family, prefix in FAMILIES.items():
                for variant in VARIANTS:
                    if (variant == "qkvpacked_func") != (heads == heads_kv):
                        continue  # GQA for func and kvpacked, MHA for qkvpacked
                    name = f"{prefix}_{variant}"
                    ref.check(_padded_run(name, mask["causal"]), shard_positions(seqlen, family),
                              what=f"{name} P={world} S={seqlen} {mask} H={heads}/{heads_kv}")
                    called.add(name)
    # Sliding windows and a batch of two, bf16.
    seqlen = 6 * world + 1
    ref = GlobalReference(*_inputs((2, seqlen, 4, 32), (2, seqlen, 1, 32), torch.bfloat16, seed=5), torch.bfloat16,
                          causal=True, window=(5, 0))
    for family, prefix in FAMILIES.items():
        name = f"{prefix}_func"
        ref.check(_padded_run(name, True, (5, 0)), shard_positions(seqlen, family),
                  what=f"{name} P={world} window (5, 0) bf16")
    # Without return_attn_probs: out alone.
    q, k, v = _inputs((1, 3, 2, 16), (1, 3, 2, 16))
    assert isinstance(rfa.ring_flash_attn_func(q, k, v, causal=True), torch.Tensor)
    return called


# ---- the varlen forms --------------------------------------------------------------------------

def _varlen_run(name, local_cu, causal):
    fn = getattr(rfa, name)
    max_seqlen = int((local_cu[1:] - local_cu[:-1]).max())

    def run(q, k, v):
        return _checked(name, fn(*_pack(name, q, k, v, 1), local_cu, max_seqlen, 0.0, None, causal, (-1, -1), None,
                                 False, True, None))

    return run


def _varlen_body(rank, world):
    called = set()
    # Global lengths with an empty document: multiples of 2P for zigzag, odd multiples of P
    # (not of 2P) for ring and stripe.
    lengths = {"zigzag": [6 * world, 0, 2 * world, 4 * world], "ring": [3 * world, 0, world, 5 * world]}
    lengths["stripe"] = lengths["ring"]
    for mask in MASKS:
        for heads, heads_kv in ((4, 2), (4, 4)):
            refs = {}
            for family, prefix in FAMILIES.items():
                cu = cu_seqlens(lengths[family])
                key = tuple(lengths[family])
                if key not in refs:
                    total = int(cu[-1])
                    q, k, v = _inputs((total, heads, 32), (total, heads_kv, 32), seed=total + heads_kv)
                    refs[key] = GlobalReference(q, k, v, torch.float32, cu_seqlens=cu, **mask)
                # Each document sharded on its own; the local cu_seqlens are the global ones / P.
                positions = torch.cat([shard_positions(n, family) + int(cu[b])
                                       for b, n in enumerate(lengths[family])])
                for variant in VARIANTS:
                    if (variant == "qkvpacked_func") != (heads == heads_kv):
                        continue
                    name = f"{prefix}_varlen_{variant}"
                    refs[key].check(_varlen_run(name, cu // world, mask["causal"]), positions,
                                    what=f"{name} P={world} {lengths[family]} {mask} H={heads}/{heads_kv}")
                    called.add(name)
    return called


# ---- llama3 ------------------------------------------------------------------------------------

def _llama3_run(name, cu, rank, world, causal, window, heads_k_stride):
    fn = getattr(rfa, name)
    prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)

    def run(q, k, v):
        # Positional: cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
        # local_k_slice, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        # return_attn_probs, group.
        cu_q, cu_k, max_q, max_k, local_k_slice = prepared
        return _checked(name, fn(*_pack(name, q, k, v, 1), cu_q, cu_k, max_q, max_k, heads_k_stride, local_k_slice,
                                 0.0, None, causal, window, None, False, True, None))

    return run


LLAMA3_CASES = [  # (lengths per 40 tokens, causal, window, heads, heads_kv, heads_k_stride, dtype)
    ([13, 0, 5, 1, 21], True, (-1, -1), 4, 2, 1, torch.float32),
    ([13, 0, 5, 1, 21], False, (-1, -1), 4, 2, 2, torch.float32),
    ([10, 0, 7, 3, 20], True, (5, 0), 6, 3, 2, torch.float32),     # stride 2 of 3 heads; edges on ranks
    ([10, 0, 7, 3, 20], False, (4, 4), 4, 4, 4, torch.float32),    # non-causal window across ranks
    ([13, 0, 5, 1, 21], True, (-1, -1), 4, 1, 1, torch.bfloat16),  # MQA, bf16
]


def _llama3_body(rank, world):
    called = set()
    for lengths, causal, window, heads, heads_kv, stride, dtype in LLAMA3_CASES:
        cu = cu_seqlens(lengths)
        total = int(cu[-1])
        q, k, v = _inputs((total, heads, 32), (total, heads_kv, 32), dtype, seed=heads_kv)
        ref = GlobalReference(q, k, v, dtype, cu_seqlens=cu, causal=causal, window=window)
        per_rank = total // world
        positions = torch.arange(rank * per_rank, (rank + 1) * per_rank)  # a contiguous cut of the stream
        for name in LLAMA3:
            if name.endswith("qkvpacked_func") != (heads == heads_kv):
                continue
            ref.check(_llama3_run(name, cu, rank, world, causal, window, stride), positions,
                      what=f"{name} P={world} {lengths} causal={causal} window={window} H={heads}/{heads_kv} "
                           f"stride={stride} {dtype}")
            called.add(name)
    called.add("llama3_flash_attn_prepare_cu_seqlens")
    return called


def _all_bodies(rank, world):
    return _padded_body(rank, world) | _varlen_body(rank, world) | _llama3_body(rank, world)


def _world_body(rank, world):
    """Every distributed check of this file on one world (starting one costs seconds), section by
    section; a failing section gives its traceback and the next ones still run."""
    sections = {"layouts": _layout_body, "functions": _all_bodies}
    if world == 2:
        sections.update(compile=_compile_body, errors=_errors_body)
    results = {}
    for name, section in sections.items():
        try:
            results[name] = section(rank, world)
        except Exception:  # noqa: BLE001 - reported by the section's test
            results[name] = _Failed(traceback.format_exc())
    return results


class _Failed(str):
    """A section's traceback."""


@functools.lru_cache(maxsize=None)
def _world_results(world):
    return run_world(world, _world_body)


def _section(world, name):
    """Every rank's result of one section of _world_body."""
    results = [r[name] for r in _world_results(world)]
    for rank, result in enumerate(results):
        assert not isinstance(result, _Failed), f"rank {rank} of {world}:\n{result}"
    return results


# ---- layouts and signatures --------------------------------------------------------------------

def _original_positions(family, seqlen, rank, world):
    """The positions ring-flash-attn's tests give rank `rank` (lengths that divide): contiguous
    chunks, chunks r and 2P - 1 - r of 2P, or every P-th position from r."""
    index = torch.arange(seqlen)
    if family == "ring":
        return index.chunk(world)[rank]
    if family == "zigzag":
        chunks = index.chunk(2 * world)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    return index.view(-1, world)[:, rank]  # split into rows of P, take column r


def _layout_body(rank, world):
    for family in FAMILIES:
        for seqlen in (2 * world, 12 * world):
            got = shard_positions(seqlen, family)
            want = _original_positions(family, seqlen, rank, world)
            assert torch.equal(got, want), f"{family} S={seqlen} rank {rank}/{world}: {got.tolist()} != {want.tolist()}"
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_match_ring_flash_attn_when_lengths_divide(world):
    assert _layout_body(0, 1) if world == 1 else all(_section(world, "layouts"))


# ring-flash-attn's parameters after the tensors (and cu_seqlens...), in order, with their defaults.
_PADDED_PARAMS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                  ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False), ("group", None)]
_REQUIRED = object()


def _expected_signature(name):
    if name.startswith("llama3_flash_attn_varlen"):
        lead = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "heads_k_stride", "local_k_slice"]
    elif "_varlen_" in name:
        lead = ["cu_seqlens", "max_seqlen"]
    else:
        lead = []
    tensors = {"func": ["q", "k", "v"], "kvpacked_func": ["q", "kv"], "qkvpacked_func": ["qkv"]}
    variant = next(v for v in ("qkvpacked_func", "kvpacked_func", "func") if name.endswith(v))
    return [(p, _REQUIRED) for p in tensors[variant] + lead] + _PADDED_PARAMS


@pytest.mark.parametrize("name", PADDED + VARLEN + LLAMA3)
def test_signature_matches_ring_flash_attn(name):
    params = list(inspect.signature(getattr(rfa, name)).parameters.values())
    positional = [(p.name, _REQUIRED if p.default is inspect.Parameter.empty else p.default)
                  for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == _expected_signature(name)
    assert [(p.name, p.default, p.kind) for p in params[len(positional):]] == [
        ("softcap", 0.0, inspect.Parameter.KEYWORD_ONLY)]


def test_llama3_prepare_cu_seqlens():
    # ring-flash-attn's example: 3 documents over 8 ranks, 2 tokens each.
    cu = torch.tensor([0, 7, 14, 16], dtype=torch.int32)
    expected = {  # rank: (cu_q, cu_k causal, slice causal, cu_k non-causal, slice non-causal)
        0: ([0, 2], [0, 2], (0, 2), [0, 7], (0, 7)),
        3: ([0, 1, 2], [0, 7, 8], (0, 8), [0, 7, 14], (0, 14)),
        4: ([0, 2], [0, 3], (7, 10), [0, 7], (7, 14)),
        7: ([0, 2], [0, 2], (14, 16), [0, 2], (14, 16)),
    }
    for rank, (cu_q, cu_k, k_slice, cu_k_full, k_slice_full) in expected.items():
        for causal, want_k, want_slice in ((True, cu_k, k_slice), (False, cu_k_full, k_slice_full)):
            got_q, got_k, max_q, max_k, got_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, 8)
            assert got_q.tolist() == cu_q and got_k.tolist() == want_k, (rank, causal, got_q, got_k)
            assert got_q.dtype == torch.int32 and got_k.dtype == torch.int32
            assert (got_slice.start, got_slice.stop) == want_slice
            assert max_q == max(b - a for a, b in zip(cu_q, cu_q[1:])) and isinstance(max_q, int)
            assert max_k == max(b - a for a, b in zip(want_k, want_k[1:])) and isinstance(max_k, int)
    # An empty document that starts on a rank boundary belongs to the later rank.
    got_q, got_k, _, _, got_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(
        torch.tensor([0, 4, 4, 8], dtype=torch.int32), True, 1, 2)
    assert got_q.tolist() == [0, 0, 4] and got_k.tolist() == [0, 0, 4] and got_slice == slice(4, 8)
    with pytest.raises(ringflash.InvalidArgument, match=r"cu_seqlens\[-1\] \(the total length, 16\) must be "
                                                        r"divisible by world_size 3"):
        rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 3)
    with pytest.raises(ringflash.InvalidArgument, match="rank must be in"):
        rfa.llama3_flash_attn_prepare_cu_seqlens(cu, True, 8, 8)


# ---- every function at world sizes 1, 2 and 4 ----------------------------------------------------

def test_world_of_one_without_torch_distributed():
    assert not dist.is_initialized()
    assert _all_bodies(0, 1) == set(PADDED + VARLEN + LLAMA3 + ["llama3_flash_attn_prepare_cu_seqlens"])


@pytest.mark.parametrize("world", [2, 4])
def test_every_function_matches_the_reference(world):
    for called in _section(world, "functions"):
        assert called == set(PADDED + VARLEN + LLAMA3 + ["llama3_flash_attn_prepare_cu_seqlens"])


def test_every_name_is_covered():
    assert set(rfa.__all__) == set(PADDED + VARLEN + LLAMA3 + HF + ["llama3_flash_attn_prepare_cu_seqlens"])


def test_llama3_op_registration():
    """The custom op's fake implementation and autograd, checked by torch.library.opcheck."""
    cu = cu_seqlens([5, 0, 3])
    q, k, v = (t.requires_grad_() for t in _inputs((8, 4, 16), (8, 2, 16)))
    handle = ringflash.parallel.parallel_group(None).handle
    args = (q, k, v, cu, cu, None, None, True, -1, -1, 0.0, False, 0, 8, 1, handle)
    torch.library.opcheck(torch.ops.ringflash.llama3_varlen_forward.default, args)


# ---- torch.compile, the Hugging Face adapter, bad input --------------------------------------------

def _compile_body(rank, world):
    """torch.compile(fullgraph=True) of a ring, a zigzag varlen and a llama3 call, compiled before
    any eager call, against the eager results (out and gradients)."""
    torch._dynamo.reset()
    padded = _inputs((1, 21, 4, 32), (1, 21, 2, 32))
    packed = _inputs((16, 4, 32), (16, 2, 32))
    cu_zigzag = cu_seqlens([8, 0, 8])
    cu_llama3 = cu_seqlens([5, 0, 11])
    prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(cu_llama3, True, rank, world)

    def ring(q, k, v):
        return rfa.ring_flash_attn_func(q, k, v, causal=True)

    def zigzag_varlen(q, k, v):
        return rfa.zigzag_ring_flash_attn_varlen_func(q, k, v, cu_zigzag // world, 8 // world, causal=True)

    def llama3(q, k, v):
        return rfa.llama3_flash_attn_varlen_func(q, k, v, *prepared[:4], 1, prepared[4], causal=True)

    cases = {  # (inputs, this rank's positions, their dim, function)
        "ring": (padded, shard_positions(21, "ring"), 1, ring),
        "zigzag varlen": (packed, torch.cat([shard_positions(8, "zigzag") + s for s in (0, 8)]), 0, zigzag_varlen),
        "llama3": (packed, torch.arange(rank * 16 // world, (rank + 1) * 16 // world), 0, llama3),
    }
    same = {}
    for name, (inputs, pos, dim, fn) in cases.items():
        results = []
        for compiled in (True, False):
            xs = [t.index_select(dim, pos).requires_grad_() for t in inputs]
            out = (torch.compile(fn, fullgraph=True, backend="eager") if compiled else fn)(*xs) * 2.0
            out.sum().backward()
            results.append([out.detach()] + [x.grad for x in xs])
        same[name] = all(torch.equal(a, b) for a, b in zip(*results))
    return same


def test_torch_compile_fullgraph():
    for same in _section(2, "compile"):
        assert same == {"ring": True, "zigzag varlen": True, "llama3": True}


class _Attention(torch.nn.Module):
    is_causal = True


def test_hf_adapter():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = ALL_ATTENTION_FUNCTIONS.get("flash_attention_2")
    ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = lambda *args, **kwargs: "replaced"
    try:
        lengths = [9, 0, 4, 11]
        cu = cu_seqlens(lengths)
        rfa.update_ring_flash_attn_params(cu, None)
        rfa.substitute_hf_flash_attn(None, 1)
        attention = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
        q, k, v = _inputs((24, 4, 16), (24, 2, 16), seed=9)
        # transformers hands over (B, H, S, D) and takes back (B, S, H, D).
        got, weights = attention(_Attention(), *(t.transpose(0, 1)[None] for t in (q, k, v)), None,
                                 scaling=0.3, sliding_window=6)
        want = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, softmax_scale=0.3,
                                                window_size=(5, 5))
        assert weights is None and got.shape == (1, 24, 4, 16)
        torch.testing.assert_close(got[0], want, rtol=0, atol=0)
        with pytest.raises(ringflash.NotSupported, match="is_causal=False"):
            attention(_Attention(), *(t.transpose(0, 1)[None] for t in (q, k, v)), None, is_causal=False)
        rfa.use_ring_attn(False)
        assert attention(_Attention(), q, k, v, None) == "replaced"
    finally:
        rfa.use_ring_attn(True)
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = saved


def _expect(errors, key, kind, fn, *args, **kwargs):
    """Records the message of the `kind` error that fn raises (or what happened instead)."""
    try:
        fn(*args, **kwargs)
        errors[key] = "no error"
    except kind as e:
        errors[key] = str(e)
    except Exception as e:  # noqa: BLE001 - reported by the test with its type
        errors[key] = f"{type(e).__name__}: {e}"


def _errors_body(rank, world):
    errors = {}
    Invalid, Unsupported = ringflash.InvalidArgument, ringflash.NotSupported
    q, k, v = _inputs((12, 4, 16), (12, 2, 16))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    _expect(errors, "zigzag odd local length", Invalid, rfa.zigzag_ring_flash_attn_varlen_func, q, k, v, cu, 7)
    _expect(errors, "cu_seqlens short of q", Invalid, rfa.ring_flash_attn_varlen_func, q, k, v, cu[:2], 5)
    _expect(errors, "cu_seqlens int64", Invalid, rfa.ring_flash_attn_varlen_func, q, k, v, cu.long(), 7)
    # Valid on each rank, but not the same: the library's cross-rank check names it on every rank.
    mine = torch.tensor([0, 4 + 2 * rank, 12], dtype=torch.int32)
    _expect(errors, "cu_seqlens differ across ranks", Invalid, rfa.ring_flash_attn_varlen_func, q, k, v, mine, 8)
    _expect(errors, "max_seqlen", Invalid, rfa.stripe_flash_attn_varlen_func, q, k, v, cu, 7.0)
    _expect(errors, "kv shape", Invalid, rfa.ring_flash_attn_varlen_kvpacked_func, q, q, cu, 7)
    qp, kp, vp = _inputs((1, 8, 4, 16), (1, 8, 2, 16))
    _expect(errors, "k on another device", Invalid, rfa.ring_flash_attn_func, qp, kp.to("meta"), vp)
    _expect(errors, "dropout", Unsupported, rfa.zigzag_ring_flash_attn_func, qp, kp, vp, 0.1)
    _expect(errors, "stripe alibi", Unsupported, rfa.stripe_flash_attn_func, qp, kp, vp, causal=True,
            alibi_slopes=torch.ones(4))
    # llama3: the ranks agree before any transfer.
    cu_g = cu_seqlens([10, 0, 14])
    cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(cu_g, True, rank, world)
    ql, kl, vl = (t[rank * 12:(rank + 1) * 12] for t in _inputs((24, 4, 16), (24, 2, 16)))
    llama3 = rfa.llama3_flash_attn_varlen_func
    _expect(errors, "llama3 k on another device on rank 1", Invalid, llama3, ql, kl if rank == 0 else kl.to("meta"),
            vl, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True)
    # Rank 1 holds a token more than rank 0: each call is valid on its own.
    _expect(errors, "llama3 tokens differ across ranks", Invalid, llama3,
            *_inputs((12 + rank, 4, 16), (12 + rank, 2, 16)), cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True)
    _expect(errors, "llama3 local_k_slice", Invalid, llama3, ql, kl, vl, cu_q, cu_k, max_q, max_k, 1, slice(0, 25),
            causal=True)
    _expect(errors, "llama3 cu_seqlens_k past the keys", Invalid, llama3, ql, kl, vl, cu_q, cu_k + 1, max_q, max_k,
            1, k_slice, causal=True)
    _expect(errors, "llama3 heads_k_stride", Invalid, llama3, ql, kl, vl, cu_q, cu_k, max_q, max_k, 0, k_slice)
    _expect(errors, "llama3 dropout", Unsupported, llama3, ql, kl, vl, cu_q, cu_k, max_q, max_k, 1, k_slice, 0.5)
    # The world still works after every error.
    out = llama3(ql, kl, vl, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True)
    errors["after"] = bool(torch.isfinite(out).all())
    return errors


def test_bad_input_gets_a_clear_error_on_every_rank():
    expected = {
        "zigzag odd local length": "[zigzag_ring_flash_attn_varlen_func] cu_seqlens: every local sequence length "
                                   "must be divisible by 2",
        "cu_seqlens short of q": "cu_seqlens (local) must run from 0 to the 12 local tokens of q, got 0 to 5",
        "cu_seqlens int64": "cu_seqlens must be int32",
        "cu_seqlens differ across ranks": "cu_seqlens values differs across ranks",
        "max_seqlen": "[stripe_flash_attn_varlen_func] max_seqlen must be an int, got 7.0",
        "kv shape": "[ring_flash_attn_varlen_kvpacked_func] kv must have size 2 in dimension 1",
        "k on another device": "k must be on cpu like q, got meta",
        "dropout": "dropout_p must be 0",
        "stripe alibi": "alibi_slopes are not supported with the stripe layout",
        "llama3 k on another device on rank 1": "[llama3_flash_attn_varlen_func] k must be on cpu like q, got meta "
                                                "(on rank 1)",
        "llama3 tokens differ across ranks": "[llama3_flash_attn_varlen_func] local tokens of q differs across ranks: "
                                             "rank 0 has 12, rank 1 has 13",
        "llama3 local_k_slice": "local_k_slice must lie within the 24 gathered keys",
        "llama3 cu_seqlens_k past the keys": "cu_seqlens_k ends at 13, past the end of the packed tensor of 12 "
                                             "tokens (k and v there: the keys of local_k_slice",
        "llama3 heads_k_stride": "heads_k_stride must be >= 1, got 0",
        "llama3 dropout": "dropout_p must be 0",
    }
    for rank, errors in enumerate(_section(2, "errors")):
        errors = dict(errors)
        assert errors.pop("after") is True
        for key, text in expected.items():
            assert text in errors[key], f"rank {rank}, {key}: {errors[key]!r}"
