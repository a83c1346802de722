"""The CUDA kernels against the float64 reference (computed on the CPU), and what only a GPU has:
device mapping, the stream argument, CUDA graphs. Skipped without a CUDA device and a CUDA build.

In fp16 and bf16 and head dims 64, 128 and 256 (and the odd head dims of the shared awkward shapes),
out, lse and every gradient are held to the pass rule of reference.py (DESIGN.md) over:

* the awkward shapes: lengths 1, 17 and 1013 (4097 in a few cases of its own), Sq != Sk both ways,
  GQA ratios 1, 4 and H; causal and not; a backward of more blocks than the GPU holds at once;
* every option of test_attention.py and test_varlen.py (softmax scale; sliding windows left, right,
  both, zero and forward-reaching; softcap; ALiBi per head and per batch), also at lengths that span
  many tiles, where rows that see no key sit between rows that do;
* packed batches with empty documents and rows outside every document, cu_seqlens on the GPU;
* global positions through ringflash._C: q_offset / k_offset, and per-sequence q_seq_offsets /
  k_seq_offsets (int32 on q's device, as include/ringflash/attention.h says);
* accumulate mode: forward over key blocks merged into fp32 (out, lse), backward adding into fp32
  dq, dk, dv that already hold values; against the reference and against the CPU kernel making
  the same calls;
* deterministic=True: two backward runs give bit-identical results, and right ones;
* torch SDPA on the GPU in the same dtype, where its causal mask is ringflash's (Sq == Sk):
  ringflash's error is at most twice SDPA's plus the dtype's absolute term;
* outputs written whole: every raw _C call here writes into NaN-filled views of larger buffers,
  and no NaN may remain in the view nor anything change in the margins;
* a forward+backward captured in a CUDA graph, replayed with new inputs, gives the eager results.

Head dim 256 can be left out of a build (RINGFLASH_DISABLE_HDIM256): its cases skip when
ringflash.attention_support says so and names the head dim. Any other case the CUDA kernels refuse
fails.
"""

import dataclasses
import fcntl
import math
import os
import re
import tempfile

import pytest
import torch
import torch.nn.functional as F

import ringflash
from ringflash import _C
from graph_check import graph_replay_problems
from reference import (ATOL, AWKWARD_SHAPES, F64, VARLEN_LENGTHS, Shape, alibi_slopes, assert_pass_rule, attention,
                       attention_varlen, compare_with_reference, cu_seqlens, make_qkv, max_error, rounded_randn)
from test_attention import OPTIONS, run_flash, run_reference
from test_varlen import OPTIONS as VARLEN_OPTIONS
from test_varlen import make_packed, reference_varlen, run_varlen

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ringflash.has_cuda()),
                                reason="needs a CUDA device and ringflash built with CUDA")

DEVICE = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
HEAD_DIMS = [64, 128, 256]
GRAD_NAMES = ("dq", "dk", "dv")

# How attention_support names a head dim that the build leaves out.
HEAD_DIM_REASON = re.compile(r"head[ _]?dim|hdim", re.IGNORECASE)

# Shared by every process running this file (pytest-xdist's workers).
GPU_LOCK = os.path.join(tempfile.gettempdir(), "ringflash_test_cuda.lock")


@pytest.fixture(autouse=True)
def gpu_share(request):
    """The tests share the GPU with each other (pytest-xdist runs several at once), but for those
    marked exclusive_gpu, which fill its memory: one of them runs alone."""
    exclusive = request.node.get_closest_marker("exclusive_gpu") is not None
    with open(GPU_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # closing the file lets the lock go


def test_devices():
    q, k, v = (t.cuda() for t in make_qkv(AWKWARD_SHAPES[2], torch.bfloat16))
    with pytest.raises(ringflash.InvalidArgument, match=r"k must be on cuda:0 like q, got cpu"):
        ringflash.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(ringflash.InvalidArgument, match=r"alibi_slopes must be on cuda:0 like q, got cpu"):
        ringflash.flash_attn_func(q, k, v, alibi_slopes=torch.ones(q.shape[2]))
    with pytest.raises(ringflash.NotSupported, match=r"float32 is supported on CPU only"):
        ringflash.flash_attn_func(q.float(), k.float(), v.float())
    assert ringflash.attention_support(q, k, v, causal=True)[:3] == (True, "cuda", "")


def test_support_names_the_kernels():
    """sm_90 devices run the sm_90a kernels where they take the case and say why where they don't;
    other devices run the sm_80 kernels."""
    hopper = torch.cuda.get_device_capability() == (9, 0) and os.environ.get("RINGFLASH_SM90") != "0"
    q, k, v = (torch.randn(1, 256, 4, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    kernels = ringflash.attention_support(q, k, v, causal=True).kernels
    assert kernels.startswith("sm90") if hopper else kernels == "sm80"
    wide = torch.randn(1, 256, 4, 256, device=DEVICE, dtype=torch.bfloat16)
    support = ringflash.attention_support(wide, wide, wide)
    if support.supported:  # head dim 256 is built
        assert support.kernels == ("sm90" if hopper else "sm80")
        # No atomics at head dim 256: the sm_90a backward is deterministic as it is.
        assert ringflash.attention_support(wide, wide, wide, deterministic=True).kernels == (
            "sm90" if hopper else "sm80")
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device=DEVICE)
    packed = ringflash.attention_support(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu).kernels
    assert packed == ("sm90" if hopper else "sm80")
    assert ringflash.attention_support(q, k, v, deterministic=True).kernels == (
        "sm90 forward, sm80 backward (the deterministic backward below head dim 256 is the sm_80 one)" if hopper
        else "sm80")
    if hopper:
        assert kernels == "sm90"


def on_cuda(fn):
    """Runs fn on copies of its inputs on the GPU; results come back to the CPU, gradients too."""
    def run(*inputs):
        return tuple(t.cpu() for t in fn(*(t.to(DEVICE) for t in inputs)))
    return run


def run_options(t: torch.Tensor) -> dict:
    """The _C keyword that runs a call on torch's current stream (CPU calls take none)."""
    if t.device.type == "cuda":
        return dict(stream=torch.cuda.current_stream(t.device).cuda_stream)
    return {}


def to_device(value):
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


def require_support(q, k, v, **options):
    """Skips a head-dim-256 case that this build leaves out (attention_support names the head dim);
    fails on anything else the CUDA kernels refuse. Options as in flash_attn_func."""
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    supported, backend, reason, _ = ringflash.attention_support(
        q, k, v, **{name: to_device(value) for name, value in options.items()})
    assert backend == q.device.type
    if supported:
        return
    if q.shape[-1] == 256 and HEAD_DIM_REASON.search(reason):
        pytest.skip(f"head dim 256 is left out of this build: {reason}")
    pytest.fail(f"the CUDA kernels refuse a case they must run: {reason}")


def require_support_raw(q, k, v, window_left=-1, window_right=-1, **options):
    """require_support for the options of a raw _C call: positions and accumulate mode do not change
    which kernel runs, so they are left out."""
    kept = {name: options[name] for name in ("softmax_scale", "causal", "softcap", "alibi_slopes", "deterministic",
                                              "cu_seqlens_q", "cu_seqlens_k") if name in options}
    require_support(q, k, v, window_size=(window_left, window_right), **kept)


def without_deterministic(options: dict) -> dict:
    """The reference takes every option of flash_attn_func but `deterministic`."""
    return {name: value for name, value in options.items() if name != "deterministic"}


def check_padded(q, k, v, dtype, slopes=None, **options):
    """flash_attn_func on the GPU against the reference: out, lse, dq, dk, dv. Returns the results of
    compare_with_reference."""
    require_support(q, k, v, alibi_slopes=slopes, **options)
    inputs = [q, k, v] + ([] if slopes is None else [slopes])
    return compare_with_reference(on_cuda(run_flash(**options)), run_reference(**without_deterministic(options)),
                                  inputs, dtype)


def check_packed(q, k, v, cu_q, cu_k, lengths_q, lengths_k, dtype, slopes=None, **options):
    """flash_attn_varlen_func on the GPU, with cu_seqlens on the GPU, against the reference."""
    require_support(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes, **options)
    run = on_cuda(run_varlen(cu_q.to(DEVICE), cu_k.to(DEVICE), lengths_q, lengths_k, **options))
    inputs = [q, k, v] + ([] if slopes is None else [slopes])
    return compare_with_reference(run, reference_varlen(cu_q, cu_k, **without_deterministic(options)), inputs,
                                  dtype)


def with_head_dim(shape: Shape, head_dim: int) -> Shape:
    return dataclasses.replace(shape, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_shapes(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype)
    compare_with_reference(
        on_cuda(lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)),
        lambda q, k, v, dtype: attention(q, k, v, dtype=dtype, causal=causal), [q, k, v], dtype)


# The awkward geometries at every CUDA head dim, less those test_shapes runs already.
HEAD_DIM_SHAPES = [s for s in dict.fromkeys(with_head_dim(a, d) for a in AWKWARD_SHAPES for d in HEAD_DIMS)
                   if s not in AWKWARD_SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HEAD_DIM_SHAPES, ids=str)
def test_head_dims(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype)
    check_padded(q, k, v, dtype, causal=causal)


# GQA ratios 1, 4 and H (MQA) at every head dim; lengths that are no multiple of any tile.
GQA_SHAPES = [Shape(2, 129, 257, 8, heads_kv, d) for d in HEAD_DIMS for heads_kv in (8, 2, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=str)
def test_gqa(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype, seed=2)
    check_padded(q, k, v, dtype, causal=causal)


# More blocks of the backward kernel than an H100 or H200 holds at once (256 of 132), so that dQ's
# conversion, which starts on a head once all of the kernel's blocks of it are done, runs beside
# blocks of later heads still running or not yet started. Padded and packed; GQA 2.
WAVES_LENGTHS = [256] * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_backward_in_waves(layout, head_dim, causal, dtype):
    if layout == "padded":
        q, k, v = make_qkv(Shape(len(WAVES_LENGTHS), 256, 256, 32, 16, head_dim), dtype, seed=9)
        check_padded(q, k, v, dtype, causal=causal)
    else:
        q, k, v, cu_q, cu_k = make_packed(WAVES_LENGTHS, WAVES_LENGTHS, 32, 16, head_dim, dtype, seed=9)
        check_packed(q, k, v, cu_q, cu_k, WAVES_LENGTHS, WAVES_LENGTHS, dtype, causal=causal)


# test_attention.py's options on its shapes (Sq < Sk and Sq > Sk, GQA 2), at every CUDA head dim.
OPTION_SHAPES = [Shape(2, 37, 91, 4, 2, d) for d in HEAD_DIMS] + [Shape(1, 91, 37, 4, 2, d) for d in HEAD_DIMS]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(name, shape, dtype):
    q, k, v = make_qkv(shape, dtype, seed=3)
    check_padded(q, k, v, dtype, **OPTIONS[name])


# Options on lengths that span many tiles: windows that cut tiles on both sides, that reach only
# forward, that leave rows seeing no key in the middle of a tile (narrow, with Sq > Sk).
LONG_OPTION_SHAPES = [Shape(1, 1013, 1013, 4, 1, 64), Shape(2, 300, 1013, 4, 4, 128), Shape(1, 1013, 300, 4, 2, 256)]
LONG_OPTIONS = {
    "window-both": dict(window_size=(200, 70)),
    "window-left": dict(window_size=(333, -1)),
    "window-right": dict(window_size=(-1, 77)),
    "window-forward": dict(window_size=(0, 130)),
    "window-narrow": dict(window_size=(10, 10)),
    "causal-window": dict(causal=True, window_size=(250, -1)),
    "causal-window-softcap": dict(causal=True, window_size=(150, 0), softcap=5.0),
    "softcap-scale": dict(softcap=20.0, softmax_scale=0.3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", LONG_OPTION_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(LONG_OPTIONS))
def test_long_options(name, shape, dtype):
    q, k, v = make_qkv(shape, dtype, seed=4)
    check_padded(q, k, v, dtype, **LONG_OPTIONS[name])


ALIBI_SHAPES = [Shape(2, 37, 91, 4, 2, 64), Shape(2, 91, 37, 4, 2, 128), Shape(2, 300, 1013, 4, 1, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ALIBI_SHAPES, ids=str)
def test_alibi(shape, causal, per_batch, dtype):
    q, k, v = make_qkv(shape, dtype, seed=5)
    slopes = alibi_slopes(shape.heads_q, shape.batch if per_batch else None)
    check_padded(q, k, v, dtype, slopes=slopes, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", [Shape(2, 1013, 1013, 4, 2, 128), Shape(2, 1013, 400, 4, 4, 64)], ids=str)
def test_alibi_with_options(shape, dtype):
    """ALiBi per batch with a window and softcap, across many tiles."""
    q, k, v = make_qkv(shape, dtype, seed=6)
    slopes = alibi_slopes(shape.heads_q, shape.batch)
    check_padded(q, k, v, dtype, slopes=slopes, window_size=(128, 16), softcap=10.0)


# The cases at length 4097, few because the float64 reference on the CPU is what costs.
LENGTH_4097_CASES = {
    "self-causal-gqa2": (Shape(1, 4097, 4097, 2, 1, 64), torch.bfloat16, dict(causal=True)),
    "self-full": (Shape(1, 4097, 4097, 2, 2, 128), torch.float16, dict()),
    "one-query-mqa": (Shape(1, 1, 4097, 8, 1, 128), torch.bfloat16, dict(causal=True)),
    "few-keys-causal": (Shape(1, 4097, 17, 2, 2, 256), torch.float16, dict(causal=True)),
    "sliding-window": (Shape(1, 4097, 4097, 2, 2, 64), torch.bfloat16, dict(causal=True, window_size=(511, 0))),
}


@pytest.mark.parametrize("name", list(LENGTH_4097_CASES))
def test_length_4097(name):
    shape, dtype, options = LENGTH_4097_CASES[name]
    q, k, v = make_qkv(shape, dtype, seed=7)
    check_padded(q, k, v, dtype, **options)


@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=lambda lens: f"q{lens[0]}-k{lens[1]}")
def test_varlen(lengths):
    lengths_q, lengths_k = lengths
    g = torch.Generator().manual_seed(1)
    q = rounded_randn((sum(lengths_q), 4, 64), torch.bfloat16, g)
    k = rounded_randn((sum(lengths_k), 2, 64), torch.bfloat16, g)
    v = rounded_randn((sum(lengths_k), 2, 64), torch.bfloat16, g)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    run = on_cuda(lambda q, k, v: ringflash.flash_attn_varlen_func(
        q, k, v, cu_q.cuda(), cu_k.cuda(), max(lengths_q), max(lengths_k), causal=True, return_softmax_lse=True))
    compare_with_reference(run, lambda q, k, v, dtype: attention_varlen(q, k, v, cu_q, cu_k, dtype=dtype, causal=True),
                           [q, k, v], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name", list(VARLEN_OPTIONS))
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=lambda lens: f"q{lens[0]}-k{lens[1]}")
def test_varlen_options(lengths, name, head_dim, dtype):
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, 4, 2, head_dim, dtype, seed=1)
    check_packed(q, k, v, cu_q, cu_k, lengths_q, lengths_k, dtype, **VARLEN_OPTIONS[name])


# Packed batches of long documents (many tiles each), empty ones and ones of length 1 between them.
LONG_PACKED = {
    "self-gqa4-D64": ([1013, 0, 1, 300, 17], [1013, 0, 1, 300, 17], 8, 2, 64),
    "cross-mqa-D128": ([1, 0, 17, 700], [900, 5, 0, 33], 8, 1, 128),
    "self-h4-D256": ([129, 0, 517], [129, 0, 517], 4, 4, 256),
}
LONG_PACKED_OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(100, 20)),
    "causal-alibi": dict(causal=True, alibi=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("option", list(LONG_PACKED_OPTIONS))
@pytest.mark.parametrize("name", list(LONG_PACKED))
def test_varlen_long(name, option, dtype):
    lengths_q, lengths_k, heads_q, heads_kv, head_dim = LONG_PACKED[name]
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, seed=8)
    options = dict(LONG_PACKED_OPTIONS[option])
    slopes = alibi_slopes(heads_q, len(lengths_q)) if options.pop("alibi", False) else None
    check_packed(q, k, v, cu_q, cu_k, lengths_q, lengths_k, dtype, slopes=slopes, **options)


def packed_with_margins(lengths_q, lengths_k, lead, trail, heads_q, heads_kv, head_dim, dtype, seed):
    """Like make_packed, but the documents start `lead` rows into q, k and v and end `trail` rows
    before their ends: those rows belong to no sequence."""
    g = torch.Generator().manual_seed(seed)
    q = rounded_randn((lead + sum(lengths_q) + trail, heads_q, head_dim), dtype, g)
    k = rounded_randn((lead + sum(lengths_k) + trail, heads_kv, head_dim), dtype, g)
    v = rounded_randn((lead + sum(lengths_k) + trail, heads_kv, head_dim), dtype, g)
    return q, k, v, cu_seqlens(lengths_q) + lead, cu_seqlens(lengths_k) + lead


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("margins", [(2, 3), (3, 130)], ids=["short-margins", "long-tail"])
def test_rows_outside_the_sequences(margins, head_dim, dtype):
    """cu_seqlens need not start at 0 nor end at T: rows outside the sequences get out 0, lse -inf
    and gradient 0, also when the unused tail is longer than a tile."""
    lead, trail = margins
    lengths_q, lengths_k = [3, 0, 150, 7], [4, 2, 150, 0]
    q, k, v, cu_q, cu_k = packed_with_margins(lengths_q, lengths_k, lead, trail, 4, 2, head_dim, dtype, seed=9)
    results = check_packed(q, k, v, cu_q, cu_k, lengths_q, lengths_k, dtype, causal=True)
    out, lse, (dq, dk, dv) = results["ringflash"]
    outside_q = torch.ones(q.shape[0], dtype=torch.bool)
    outside_q[cu_q[0]:cu_q[-1]] = False
    outside_k = torch.ones(k.shape[0], dtype=torch.bool)
    outside_k[cu_k[0]:cu_k[-1]] = False
    assert torch.all(out[outside_q] == 0) and torch.all(lse[:, outside_q] == float("-inf"))
    assert torch.all(dq[outside_q] == 0) and torch.all(dk[outside_k] == 0) and torch.all(dv[outside_k] == 0)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
def test_nan_outside_the_sequences(head_dim):
    """Rows of a packed batch outside every sequence may hold anything, NaN included (torch.empty):
    the tiles that run past the last sequence read them, and no result may carry them."""
    lengths_q, lengths_k = [3, 0, 150, 7], [4, 2, 150, 70]
    q, k, v, cu_q, cu_k = packed_with_margins(lengths_q, lengths_k, 2, 130, 4, 2, head_dim, torch.bfloat16, seed=9)
    for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
        t[:cu[0]] = float("nan")
        t[cu[-1]:] = float("nan")
    results = check_packed(q, k, v, cu_q, cu_k, lengths_q, lengths_k, torch.bfloat16, causal=True)
    out, lse, grads = results["ringflash"]
    assert all(torch.isfinite(x).all() for x in (out, *grads))


# --- raw _C calls: positions, accumulate mode, outputs written whole --------------------------------

# NaN rows on each side of every output of a raw call, and one NaN head past its last head.
MARGIN_ROWS = 5


def poisoned(shape, dtype, device, rows_dim, heads_dim):
    """A NaN-filled view of `shape` inside a larger buffer: MARGIN_ROWS more rows on each side along
    rows_dim and one more head along heads_dim. Returns the view and a check that the margins still
    hold nothing but NaN."""
    full = list(shape)
    full[rows_dim] += 2 * MARGIN_ROWS
    full[heads_dim] += 1
    buffer = torch.full(full, float("nan"), dtype=dtype, device=device)
    index = [slice(None)] * len(shape)
    index[rows_dim] = slice(MARGIN_ROWS, MARGIN_ROWS + shape[rows_dim])
    index[heads_dim] = slice(0, shape[heads_dim])
    view = buffer[tuple(index)]

    def check_margins(name):
        margin_nan = int(torch.isnan(buffer).sum()) - int(torch.isnan(view).sum())
        margin = buffer.numel() - view.numel()
        assert margin_nan == margin, f"{name}: {margin - margin_nan} entries written outside the tensor"

    return view, check_margins


def poisoned_like(t: torch.Tensor, packed: bool):
    """For q, k or v: (B, S, H, D) rows dim 1, heads dim 2; packed (T, H, D) rows 0, heads 1."""
    return poisoned(t.shape, t.dtype, t.device, 0 if packed else 1, 1 if packed else 2)


def poisoned_lse(q: torch.Tensor, packed: bool):
    """lse (B, H, S), or (H, T) packed, float32."""
    if packed:
        return poisoned((q.shape[1], q.shape[0]), torch.float32, q.device, 1, 0)
    return poisoned((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device, 2, 1)


class RawAttention(torch.autograd.Function):
    """ringflash._C.attention_forward / attention_backward with any keyword options (q_offset,
    q_seq_offsets, cu_seqlens, ...), writing into NaN-poisoned views of larger buffers whose margins
    must stay untouched. Gradients flow to q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, options):
        q, k, v = q.detach(), k.detach(), v.detach()
        packed = options.get("cu_seqlens_q") is not None
        out, check_out = poisoned_like(q, packed)
        lse, check_lse = poisoned_lse(q, packed)
        _C.attention_forward(q, k, v, out, lse, alibi_slopes=slopes, **options, **run_options(q))
        check_out("out")
        check_lse("lse")
        ctx.save_for_backward(q, k, v, out, lse, slopes)
        ctx.options = options
        ctx.packed = packed
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        grads = [poisoned_like(t, ctx.packed) for t in (q, k, v)]
        (dq, _), (dk, _), (dv, _) = grads
        _C.attention_backward(q, k, v, out, dout.contiguous(), lse, dq, dk, dv, alibi_slopes=slopes, **ctx.options,
                              **run_options(q))
        for name, (_, check) in zip(GRAD_NAMES, grads):
            check(name)
        return dq, dk, dv, None, None


def run_raw(options):
    """run() for compare_with_reference: RawAttention on the GPU; an optional 4th input is ALiBi."""
    return on_cuda(lambda q, k, v, *extra: RawAttention.apply(q, k, v, extra[0] if extra else None, options))


def raw_mask(options):
    """The reference's mask options for _C's window_left / window_right / causal."""
    return dict(causal=options.get("causal", False),
                window=(options.get("window_left", -1), options.get("window_right", -1)))


def reference_positions(positions, **options):
    """Padded batch, sequence b at (q position, k position) = positions[b]: the reference per sequence."""
    def reference(q, k, v, *, dtype):
        results = [attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], dtype=dtype, q_pos=q_pos, k_pos=k_pos, **options)
                   for b, (q_pos, k_pos) in enumerate(positions)]
        return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
    return reference


def reference_packed_positions(cu_q, cu_k, positions, **options):
    """Packed batch, document b at (q position, k position) = positions[b]; rows outside every
    document get out 0 and lse -inf (as in attention_varlen)."""
    def reference(q, k, v, *, dtype):
        cq, ck = cu_q.tolist(), cu_k.tolist()

        def empty_rows(n):
            return torch.zeros(n, *q.shape[1:], dtype=dtype), torch.full((q.shape[1], n), float("-inf"), dtype=dtype)

        head = empty_rows(cq[0])
        outs, lses = [head[0]], [head[1]]
        for b, (q_pos, k_pos) in enumerate(positions):
            out, lse = attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                 dtype=dtype, q_pos=q_pos, k_pos=k_pos, **options)
            outs.append(out[0])
            lses.append(lse[0])
        tail = empty_rows(q.shape[0] - cq[-1])
        outs.append(tail[0])
        lses.append(tail[1])
        return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    return reference


def assert_rows_without_keys(results, packed):
    """Rows whose lse is -inf saw no key: their out and dq must be exactly 0."""
    out, lse, (dq, _, _) = results["ringflash"]
    # lse (B, H, S) -> (B, S, H); packed (H, T) -> (T, H): the layout of out's rows and heads.
    empty = lse.transpose(-1, -2) == float("-inf")
    assert torch.all(out.detach()[empty] == 0), "out is not 0 in rows that see no key"
    assert torch.all(dq[empty] == 0), "dq is not 0 in rows that see no key"


OFFSET_CASES = {
    "causal-window": dict(causal=True, window_left=30, q_offset=70, k_offset=45),
    "causal-top-left": dict(causal=True, q_offset=0),
    "nothing-visible": dict(causal=True, q_offset=-400),
    "window-ahead": dict(window_left=5, window_right=40, q_offset=10, k_offset=0),
    "far-positions-alibi": dict(causal=True, q_offset=2 ** 40 - 1000, k_offset=2 ** 40 - 1500, alibi=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name", list(OFFSET_CASES))
def test_offsets(name, head_dim, dtype):
    """q_offset / k_offset through _C place the blocks; top-left causal, past and future blocks."""
    shape = Shape(2, 200, 333, 4, 2, head_dim)
    q, k, v = make_qkv(shape, dtype, seed=10)
    options = dict(OFFSET_CASES[name])
    inputs = [q, k, v]
    if options.pop("alibi", False):
        inputs.append(alibi_slopes(shape.heads_q))
    require_support_raw(q, k, v, alibi_slopes=inputs[3] if len(inputs) > 3 else None, **options)
    mask = raw_mask(options)

    def reference(q, k, v, *extra, dtype):
        return attention(q, k, v, dtype=dtype, alibi=extra[0] if extra else None, q_pos=options["q_offset"],
                         k_pos=options.get("k_offset", 0), **mask)

    results = compare_with_reference(run_raw(options), reference, inputs, dtype)
    assert_rows_without_keys(results, packed=False)
    if name == "nothing-visible":
        assert torch.all(results["ringflash"][1] == float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
def test_sequence_offsets(head_dim, dtype):
    """Per-sequence q_seq_offsets / k_seq_offsets (int32, on the GPU) on a padded batch; the third sequence
    sees nothing."""
    shape = Shape(3, 50, 70, 4, 2, head_dim)
    q, k, v = make_qkv(shape, dtype, seed=11)
    positions = [(30, 25), (2, 0), (-5, 100)]
    options = dict(causal=True, window_left=40,
                   q_seq_offsets=torch.tensor([p[0] for p in positions], dtype=torch.int32, device=DEVICE),
                   k_seq_offsets=torch.tensor([p[1] for p in positions], dtype=torch.int32, device=DEVICE))
    require_support_raw(q, k, v, causal=True, window_left=40)
    results = compare_with_reference(run_raw(options), reference_positions(positions, **raw_mask(options)),
                                     [q, k, v], dtype)
    assert_rows_without_keys(results, packed=False)
    assert torch.all(results["ringflash"][1][2] == float("-inf"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
def test_packed_sequence_offsets(head_dim, dtype):
    """Per-document positions on a packed batch (cu_seqlens and offsets on the GPU), with
    rows outside every document: what the llama3 strategy hands the kernel."""
    lengths_q, lengths_k = [17, 0, 130, 1], [40, 3, 130, 0]
    positions = [(23, 0), (5, 5), (1000, 950), (7, 7)]
    q, k, v, cu_q, cu_k = packed_with_margins(lengths_q, lengths_k, 2, 9, 8, 2, head_dim, dtype, seed=12)
    options = dict(causal=True, window_left=64, cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE),
                   q_seq_offsets=torch.tensor([p[0] for p in positions], dtype=torch.int32, device=DEVICE),
                   k_seq_offsets=torch.tensor([p[1] for p in positions], dtype=torch.int32, device=DEVICE))
    require_support_raw(q, k, v, causal=True, window_left=64, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    results = compare_with_reference(run_raw(options),
                                     reference_packed_positions(cu_q, cu_k, positions, **raw_mask(options)),
                                     [q, k, v], dtype)
    assert_rows_without_keys(results, packed=True)


# Outputs written whole: NaN-poisoned outputs (RawAttention) on cases with rows that see no key,
# tails shorter than a tile, windows, and packed rows outside every document.
POISON_CASES = {
    "rows-without-keys-D64": (Shape(2, 1013, 300, 4, 2, 64), dict(causal=True)),
    "tails-D128": (Shape(1, 17, 1013, 4, 1, 128), dict()),
    "window-D256": (Shape(2, 300, 300, 4, 4, 256), dict(window_left=30, window_right=30)),
    "packed-D128": (None, dict(causal=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(POISON_CASES))
def test_outputs_fully_written(name, dtype):
    shape, options = POISON_CASES[name]
    options = dict(options)
    if shape is None:
        q, k, v, cu_q, cu_k = packed_with_margins([17, 0, 1, 200], [5, 0, 33, 200], 3, 130, 8, 2, 128, dtype,
                                                  seed=13)
        require_support_raw(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
        mask = raw_mask(options)
        options.update(cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE))
        reference = reference_varlen(cu_q, cu_k, causal=mask["causal"], window_size=mask["window"])
    else:
        q, k, v = make_qkv(shape, dtype, seed=13)
        require_support_raw(q, k, v, **options)
        mask = raw_mask(options)
        reference = run_reference(causal=mask["causal"], window_size=mask["window"])
    # compare_with_reference fails on any NaN left in out, lse, dq, dk or dv; RawAttention on any
    # write into the margins.
    results = compare_with_reference(run_raw(options), reference, [q, k, v], dtype)
    assert_rows_without_keys(results, packed=shape is None)


# Accumulate mode, as a ring step uses it: three uneven key blocks, not in order, merged into fp32
# (out, lse) that start at (0, -inf), then backward adding into fp32 dq, dk, dv that hold values.
ACCUMULATE_SHAPES = [Shape(2, 23, 61, 4, 2, 64), Shape(1, 300, 1013, 8, 2, 128), Shape(1, 129, 700, 4, 4, 256)]
ACCUMULATE_MASKS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window_left=100),
}
# The same, with the first block's forward writing out and lse (overwrite_out) and each block's
# backward writing its rows of dk and dv (overwrite_dkdv): they start as NaN, which any element
# left unwritten would keep.
OVERWRITE_MASKS = {"causal-overwrite": "causal"}


def key_blocks(seqlen_k):
    """Three uneven blocks of keys, in the order a ring might visit them (not the keys' order)."""
    cuts = [0, seqlen_k // 5 + 1, min(seqlen_k, 2 * seqlen_k // 3 + 3), seqlen_k]
    blocks = list(zip(cuts[:-1], cuts[1:]))
    return [blocks[1], blocks[2], blocks[0]]


def accumulate_over_blocks(q, k, v, dout, grads0, device, overwrite=False, **options):
    """Forward and backward over key_blocks in accumulate mode on `device`; returns out, lse and the
    gradients added to grads0 (on the CPU), or with `overwrite` (overwrite_out for the first
    forward, overwrite_dkdv), dk and dv as written."""
    q, k, v, dout = (t.to(device) for t in (q, k, v, dout))
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    out = torch.full(q.shape, float("nan") if overwrite else 0.0, dtype=torch.float32, device=device)
    lse = torch.full((batch, heads_q, seqlen_q), float("nan") if overwrite else float("-inf"), device=device)
    blocks = key_blocks(seqlen_k)
    q_pos = seqlen_k - seqlen_q  # bottom-right, made explicit
    for i, (start, end) in enumerate(blocks):
        _C.attention_forward(q, k[:, start:end], v[:, start:end], out, lse, q_offset=q_pos, k_offset=start,
                             accumulate=True, overwrite_out=overwrite and i == 0, **options, **run_options(q))
    dq, dk, dv = (g.to(device).clone() for g in grads0)
    if overwrite:
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
    for start, end in blocks:
        _C.attention_backward(q, k[:, start:end], v[:, start:end], out, dout, lse, dq, dk[:, start:end],
                              dv[:, start:end], q_offset=q_pos, k_offset=start, accumulate=True,
                              overwrite_dkdv=overwrite, **options, **run_options(q))
    added = [dq.cpu() - grads0[0]]
    if overwrite:
        return [out.cpu(), lse.cpu()] + added + [dk.cpu(), dv.cpu()]
    return [out.cpu(), lse.cpu()] + added + [(g.cpu() - g0) for g, g0 in zip((dk, dv), grads0[1:])]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("mask", list(ACCUMULATE_MASKS) + list(OVERWRITE_MASKS))
@pytest.mark.parametrize("shape", ACCUMULATE_SHAPES, ids=str)
def test_accumulate(shape, mask, dtype):
    overwrite = mask in OVERWRITE_MASKS
    options = ACCUMULATE_MASKS[OVERWRITE_MASKS.get(mask, mask)]
    q, k, v = make_qkv(shape, dtype, seed=14)
    require_support_raw(q, k, v, **options)
    g = torch.Generator().manual_seed(15)
    dout = rounded_randn(q.shape, dtype, g)
    grads0 = [torch.randn(t.shape, generator=g) for t in (q, k, v)]  # fp32 values the gradients add to

    gpu = accumulate_over_blocks(q, k, v, dout, grads0, DEVICE, overwrite=overwrite, **options)
    cpu = accumulate_over_blocks(q, k, v, dout, grads0, "cpu", overwrite=overwrite, **options)

    reference_mask = raw_mask(options)
    xs = [t.to(F64).requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention(*xs, dtype=F64, **reference_mask)
    ref_out.backward(dout.to(F64))
    xn = [t.clone().requires_grad_() for t in (q, k, v)]
    naive_out, _ = attention(*xn, dtype=dtype, **reference_mask)
    naive_out.backward(dout)
    naive_lse = attention(q, k, v, dtype=torch.float32, **reference_mask)[1]

    refs = [ref_out, ref_lse] + [x.grad for x in xs]
    naives = [naive_out, naive_lse] + [x.grad for x in xn]
    for name, got, on_cpu, ref, naive in zip(("out", "lse") + GRAD_NAMES, gpu, cpu, refs, naives):
        rule_dtype = torch.float32 if name == "lse" else dtype
        assert_pass_rule(name, got, ref, naive, rule_dtype)
        assert_pass_rule(f"{name} (CUDA against the CPU kernel)", got, on_cpu, naive, rule_dtype)


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
def test_overwrite_out_writes_every_row(head_dim):
    """overwrite_out on a packed batch with rows outside every document: out and lse start as NaN
    and come out bit-identical to a merge into an empty accumulator (0 and -inf in the rows of no
    document)."""
    q, k, v, cu_q, cu_k = packed_with_margins([17, 0, 1, 200], [5, 0, 33, 200], 3, 130, 8, 2, head_dim,
                                              torch.bfloat16, seed=16)
    require_support_raw(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    options = dict(causal=True, cu_seqlens_q=cu_q.to(DEVICE), cu_seqlens_k=cu_k.to(DEVICE), accumulate=True,
                   **run_options(q))
    results = []
    for overwrite in (False, True):
        out = torch.full(q.shape, float("nan") if overwrite else 0.0, dtype=torch.float32, device=DEVICE)
        lse = torch.full((q.shape[1], q.shape[0]), float("nan") if overwrite else float("-inf"), device=DEVICE)
        _C.attention_forward(q, k, v, out, lse, overwrite_out=overwrite, **options)
        results.append((out.cpu(), lse.cpu()))
    (merged_out, merged_lse), (written_out, written_lse) = results
    assert torch.equal(written_out, merged_out)
    assert torch.equal(written_lse, merged_lse)


# --- deterministic backward -------------------------------------------------------------------------

DETERMINISTIC_CASES = {
    "gqa4-causal-D128": (Shape(2, 1013, 1013, 8, 2, 128), dict(causal=True)),
    "mqa-cross-D64": (Shape(1, 300, 1013, 8, 1, 64), dict()),
    "window-D256": (Shape(1, 517, 517, 4, 4, 256), dict(window_size=(100, 30))),
    "gqa2-causal-D256": (Shape(2, 700, 700, 4, 2, 256), dict(causal=True)),
    "packed-gqa4-D128": (None, dict(causal=True)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(DETERMINISTIC_CASES))
def test_deterministic(name, dtype):
    """deterministic=True: two runs give bit-identical out, lse, dq, dk, dv, and pass the rule."""
    shape, options = DETERMINISTIC_CASES[name]
    runs = []
    for _ in range(2):
        if shape is None:
            lengths = [1013, 0, 17, 300]
            q, k, v, cu_q, cu_k = make_packed(lengths, lengths, 8, 2, 128, dtype, seed=16)
            results = check_packed(q, k, v, cu_q, cu_k, lengths, lengths, dtype, deterministic=True, **options)
        else:
            q, k, v = make_qkv(shape, dtype, seed=16)
            results = check_padded(q, k, v, dtype, deterministic=True, **options)
        out, lse, grads = results["ringflash"]
        runs.append([out.detach(), lse] + list(grads))
    for name_, first, second in zip(("out", "lse") + GRAD_NAMES, *runs):
        assert torch.equal(first, second), (
            f"{name_} differs between two deterministic runs: max |difference| = "
            f"{(first.double() - second.double()).nan_to_num().abs().max().item():.3g}")


# --- torch SDPA on the GPU as a second check --------------------------------------------------------

# Sq == Sk only: SDPA's causal mask is top-left, ringflash's bottom-right, the same when Sq == Sk.
SDPA_SHAPES = [Shape(2, 1013, 1013, 4, 4, d) for d in HEAD_DIMS] + [Shape(1, 17, 17, 8, 2, 128),
                                                                    Shape(3, 1, 1, 4, 1, 64)]
SDPA_OPTIONS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal-scale": dict(causal=True, softmax_scale=0.3),
}


def check_against_sdpa(q, k, v, dtype, causal=False, softmax_scale=None):
    """ringflash's error (against the float64 reference) is at most twice that of torch's
    scaled_dot_product_attention on the same GPU in the same dtype, plus the dtype's absolute term,
    for out and every gradient. q, k, v on the CPU, (B, S, H, D), Sq == Sk."""
    require_support(q, k, v, causal=causal, softmax_scale=softmax_scale)
    dout = rounded_randn(q.shape, dtype, torch.Generator().manual_seed(18))

    xs = [t.to(F64).requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention(*xs, dtype=F64, causal=causal, softmax_scale=softmax_scale)
    ref_out.backward(dout.to(F64))
    refs = [ref_out] + [x.grad for x in xs]

    xr = [t.to(DEVICE, copy=True).requires_grad_() for t in (q, k, v)]
    out = ringflash.flash_attn_func(*xr, causal=causal, softmax_scale=softmax_scale)
    out.backward(dout.to(DEVICE))
    ours = [out] + [x.grad for x in xr]

    # (B, S, H, D) -> (B, H, S, D), SDPA's layout.
    xt = [t.to(DEVICE).transpose(1, 2).contiguous().detach().requires_grad_() for t in (q, k, v)]
    out_t = F.scaled_dot_product_attention(*xt, is_causal=causal, scale=softmax_scale,
                                           enable_gqa=q.shape[2] != k.shape[2])
    out_t.backward(dout.to(DEVICE).transpose(1, 2))
    theirs = [out_t.transpose(1, 2)] + [x.grad.transpose(1, 2) for x in xt]

    for result, got, sdpa, ref in zip(("out",) + GRAD_NAMES, ours, theirs, refs):
        assert not torch.isnan(got).any(), f"{result}: NaN entries"
        err, err_sdpa = max_error(got.cpu(), ref), max_error(sdpa.cpu(), ref)
        bound = 2 * err_sdpa + ATOL[dtype]
        assert err <= bound, (f"{result} ({dtype}): max |ringflash - reference| = {err:.3g} > {bound:.3g} "
                              f"= 2 * {err_sdpa:.3g} (torch SDPA on the GPU) + {ATOL[dtype]:g}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(SDPA_OPTIONS))
@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=str)
def test_sdpa(shape, name, dtype):
    options = SDPA_OPTIONS[name]
    check_against_sdpa(*make_qkv(shape, dtype, seed=17), dtype, **options)


def rising_scores(shape: Shape, dtype: torch.dtype, rise: float):
    """q, k, v whose scores climb along the keys by `rise` (log2 units, the default scale) from the
    first key to the last, with a little noise: every row's max moves in each key tile, by less than
    the lag the sm_90a forward allows its max (8) when rise / tiles is below it, by more above. The
    scores end near 0, so that the lse is small and its error that of the weights, not that of a
    large score's fp32 accumulation."""
    g = torch.Generator().manual_seed(23)
    d = shape.head_dim
    ramp = torch.linspace(-rise / (math.log2(math.e) * math.sqrt(d)), 0.0, shape.seqlen_k)
    noise = lambda *size: 0.02 * torch.randn(*size, generator=g)
    q = (1.0 + noise(shape.batch, shape.seqlen_q, shape.heads_q, d)).to(dtype)
    k = (ramp[None, :, None, None] + noise(shape.batch, shape.seqlen_k, shape.heads_kv, d)).to(dtype)
    v = rounded_randn((shape.batch, shape.seqlen_k, shape.heads_kv, d), dtype, g)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("rise", [40.0, 400.0], ids=["gentle", "sharp"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
def test_rising_scores(head_dim, rise, dtype):
    """A max that climbs through every key tile (the case a lagging max and the rounding of the
    largest weights meet): out, lse and the gradients by the pass rule, and within twice SDPA's error.
    No causal mask: its first rows would see only the lowest scores, where the lse is large."""
    shape = Shape(1, 1013, 1013, 2, 2, head_dim)
    q, k, v = rising_scores(shape, dtype, rise)
    check_padded(q, k, v, dtype)
    check_against_sdpa(q, k, v, dtype)


# --- streams and CUDA graphs ------------------------------------------------------------------------

def test_side_stream():
    """A call on a side stream runs on torch's current stream there, and the result is ready after it."""
    q, k, v = (t.cuda() for t in make_qkv(AWKWARD_SHAPES[3], torch.bfloat16))
    expected = ringflash.flash_attn_func(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = torch.empty_like(q)
        _C.attention_forward(q, k, v, out, torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda"),
                             causal=True, stream=stream.cuda_stream)
    stream.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# --- workspace memory --------------------------------------------------------------------------------

MiB = 2**20


def backward_call(batch):
    """A causal backward whose workspace grows with batch (its fp32 dQ accumulator: 16 MiB per
    sequence of 1024 x 32 heads x 128), as a function, and its dq. Every tensor is made up front, so
    during the call ringflash's workspace is the only memory taken."""
    gen = torch.Generator(DEVICE).manual_seed(batch)
    q, k, v, dout = (torch.randn(batch, 1024, 32, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.empty(batch, 32, 1024, device=DEVICE)
    _C.attention_forward(q, k, v, out, lse, causal=True)
    return (lambda: _C.attention_backward(q, k, v, out, dout, lse, dq, dk, dv, causal=True)), dq


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.exclusive_gpu
def test_workspace_memory_given_back():
    """ringflash's pool keeps a call's workspace for the next call; empty_cache() gives it back, and a
    call that does not fit beside what the pool keeps gives it back by itself instead of failing."""
    small, _ = backward_call(32)
    large, dq = backward_call(40)  # a workspace 1.25 x small's
    small()  # loads the kernels (lazy module loading takes device memory too)
    ringflash.empty_cache()
    before = free_bytes()
    small()
    kept = before - free_bytes()
    assert kept >= 32 * 16 * MiB, f"ringflash's pool keeps {kept / MiB:.0f} MiB after a call that needed 512+"
    ringflash.empty_cache()
    assert free_bytes() >= before - 64 * MiB, "empty_cache() did not give the pool's memory back"

    small()  # the pool keeps `kept` again
    filler = torch.empty(free_bytes() - kept // 2, dtype=torch.uint8, device=DEVICE)
    try:
        large()  # needs 1.25 x kept, and 0.5 x kept is free beside the pool's
        torch.cuda.synchronize()
    finally:
        del filler
    first = dq.clone()
    large()
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, dq, rtol=1e-2, atol=1e-2)


GRAPH_LENGTHS = [17, 0, 300, 129]  # the packed batch of the graph tests


def graph_inputs(layout, seed):
    """q, k, v on the CPU for the graph tests: a padded batch with GQA, or GRAPH_LENGTHS packed."""
    if layout == "padded":
        return make_qkv(Shape(2, 300, 300, 8, 2, 128), torch.bfloat16, seed=seed)
    return make_packed(GRAPH_LENGTHS, GRAPH_LENGTHS, 8, 2, 128, torch.bfloat16, seed=seed)[:3]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cuda_graph(layout, deterministic):
    """A forward+backward of flash_attn_func (flash_attn_varlen_func) captured in a CUDA graph, replayed
    with new values in the captured inputs, gives what eager calls on those values give: bit for bit
    where the kernels are deterministic (the forward always, the backward with deterministic=True)."""
    cu = cu_seqlens(GRAPH_LENGTHS).to(DEVICE)
    options = dict(causal=True, deterministic=deterministic, return_softmax_lse=True)

    def attend(q, k, v):
        if layout == "padded":
            return ringflash.flash_attn_func(q, k, v, **options)
        return ringflash.flash_attn_varlen_func(q, k, v, cu, cu, max(GRAPH_LENGTHS), max(GRAPH_LENGTHS), **options)

    values = [graph_inputs(layout, seed) for seed in (19, 20, 21)]  # capture, then two replays
    require_support(*values[0], causal=True, deterministic=deterministic,
                    **({} if layout == "padded" else dict(cu_seqlens_q=cu, cu_seqlens_k=cu)))
    dout = rounded_randn(values[0][0].shape, torch.bfloat16, torch.Generator().manual_seed(22)).to(DEVICE)
    problems = graph_replay_problems(attend, values, dout, warmup_steps=3, exact_grads=deterministic)
    assert not problems, "\n".join(problems)


# --- small and empty cases --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rows_without_keys(dtype):
    """Causal with Sq > Sk: the first Sq - Sk queries see no key; out = 0, lse = -inf, gradients 0,
    no NaN anywhere."""
    q, k, v = (t.to(DEVICE) for t in make_qkv(Shape(1, 200, 17, 2, 2, 64), dtype, seed=23))
    q.requires_grad_(True)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert torch.all(out[:, :183] == 0)
    assert torch.all(lse[:, :, :183] == float("-inf"))
    assert torch.isfinite(lse[:, :, 183:]).all()
    out.sum().backward()
    assert torch.all(q.grad[:, :183] == 0)
    assert torch.isfinite(q.grad).all()


def test_no_keys_and_no_queries():
    """Sk = 0: every row sees nothing (out 0, lse -inf, dq 0). Sq = 0: empty results, dk = dv = 0."""
    q = torch.randn(2, 5, 2, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 0, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    out, lse = ringflash.flash_attn_func(q, k, k, return_softmax_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.sum().backward()
    assert torch.all(q.grad == 0)

    q = torch.randn(2, 0, 2, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 5, 2, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out, lse = ringflash.flash_attn_func(q, k, k, return_softmax_lse=True)
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)
    out.sum().backward()
    assert k.grad is not None and torch.all(k.grad == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_strided_inputs(dtype):
    """Inputs strided everywhere but in D (a (B, H, S, D) tensor transposed, slices of wider
    tensors) pass the rule like contiguous ones."""
    shape = Shape(2, 333, 450, 4, 2, 128)
    q, k, v = make_qkv(shape, dtype, seed=24)
    require_support(q, k, v, causal=True)

    def strided(q, k, v):
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) memory
        k = torch.cat([k, torch.zeros_like(k)], dim=2)[:, :, :shape.heads_kv]  # strides of a wider tensor
        v = torch.cat([v, torch.zeros_like(v)], dim=3)[..., :shape.head_dim]  # row stride 2 D
        assert not any(t.is_contiguous() for t in (q, k, v))
        return ringflash.flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)

    compare_with_reference(on_cuda(strided), run_reference(causal=True), [q, k, v], dtype)

