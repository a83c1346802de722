"""Chunked attention (ringflash.chunked) against the float64 reference: out, lse and every gradient
for several chunk counts, uneven lengths, causal and not, GQA and Sq != Sk; the chunk pairs that a
mask removes are never computed; automatic chunk counts; the seed's packed form and module;
torch.compile; bad input."""

import re

import pytest
import torch
from torch.library import opcheck

import ringflash
from ringflash import chunked
from reference import Shape, alibi_slopes, attention, compare_with_reference, make_qkv, max_error

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def run_chunked(num_chunks_q, num_chunks_kv, **options):
    def run(q, k, v, *extra):
        if extra:
            options["alibi_slopes"] = extra[0]
        return ringflash.chunked.chunked_attention(q, k, v, num_chunks_q, num_chunks_kv, return_softmax_lse=True,
                                                   **options)
    return run


def run_reference(causal=False, window_size=(-1, -1), q_offset=None, k_offset=0, **options):
    def reference(q, k, v, *extra, dtype):
        alibi = extra[0] if extra else None
        return attention(q, k, v, dtype=dtype, causal=causal, window=window_size, alibi=alibi, q_pos=q_offset,
                         k_pos=k_offset, **options)
    return reference


# (shape, [(num_chunks_q, num_chunks_kv), ...]): one pair, even and uneven splits, one row per chunk,
# more chunks than rows, lengths 1, 17 and 1013, Sq != Sk both ways, GQA ratios 1, 4 and H.
COUNT_CASES = [
    (Shape(2, 17, 17, 4, 4, 64), [(1, 1), (2, 2), (3, 2), (17, 17)]),
    (Shape(2, 1, 17, 4, 1, 32), [(1, 3), (4, 40)]),
    (Shape(1, 17, 1013, 8, 2, 128), [(2, 3), (1, 7)]),
    (Shape(1, 1013, 17, 4, 4, 40), [(5, 2)]),
    (Shape(2, 37, 91, 4, 2, 64), [(3, 4)]),
    (Shape(1, 91, 37, 4, 1, 32), [(4, 3)]),
]
COUNT_PARAMS = [(shape, counts) for shape, all_counts in COUNT_CASES for counts in all_counts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,counts", COUNT_PARAMS, ids=[f"{s}-{c[0]}x{c[1]}" for s, c in COUNT_PARAMS])
def test_chunk_counts(shape, counts, causal, dtype):
    q, k, v = make_qkv(shape, dtype, seed=21)
    compare_with_reference(run_chunked(*counts, causal=causal), run_reference(causal=causal), [q, k, v], dtype)


def test_fp16_long_causal():
    """Length 1013 both ways, fp16, causal, 4 x 3 chunks."""
    q, k, v = make_qkv(Shape(1, 1013, 1013, 2, 1, 64), torch.float16, seed=22)
    compare_with_reference(run_chunked(4, 3, causal=True), run_reference(causal=True), [q, k, v], torch.float16)


OPTION_SHAPES = [Shape(2, 37, 91, 4, 2, 64), Shape(1, 91, 37, 4, 2, 32)]
OPTIONS = {
    "scale": dict(softmax_scale=0.3),
    "window-both": dict(window_size=(7, 3)),
    "causal-window": dict(causal=True, window_size=(20, 9)),
    "causal-softcap": dict(causal=True, softcap=1.5),
    "top-left": dict(causal=True, q_offset=0),
    "offsets": dict(causal=True, window_size=(30, -1), q_offset=70, k_offset=45),
    # Every query sits before every key: no row sees anything (out = 0, lse = -inf, no NaN).
    "nothing-visible": dict(causal=True, q_offset=-200),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(name, shape, dtype):
    options = OPTIONS[name]
    q, k, v = make_qkv(shape, dtype, seed=23)
    compare_with_reference(run_chunked(3, 4, **options), run_reference(**options), [q, k, v], dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(causal):
    shape = OPTION_SHAPES[0]
    q, k, v = make_qkv(shape, torch.float32, seed=24)
    slopes = alibi_slopes(shape.heads_q, shape.batch)
    compare_with_reference(run_chunked(2, 5, causal=causal), run_reference(causal=causal), [q, k, v, slopes],
                           torch.float32)


class CountingC:
    """Stands in for ringflash._C inside ringflash.chunked and counts the kernel calls."""

    def __init__(self):
        self.calls = {"attention_forward": 0, "attention_backward": 0}

    def __getattr__(self, name):
        target = getattr(ringflash._C, name)
        if name not in self.calls:
            return target

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return target(*args, **kwargs)
        return counted


@pytest.fixture
def kernel_calls(monkeypatch):
    counter = CountingC()
    monkeypatch.setattr(chunked, "_C", counter)
    return counter.calls


# (options, expected kernel calls forward and backward) for S = 64 in 4 x 4 chunks of 16 rows.
SKIP_CASES = {
    "full": (dict(), 16),
    "causal": (dict(causal=True), 10),  # the lower triangle, diagonal included
    "window": (dict(window_size=(16, 0)), 7),  # the diagonal and the pairs just below it
    "causal-top-left-past": (dict(causal=True, q_offset=-16), 6),  # one chunk sees nothing
}


@pytest.mark.parametrize("name", list(SKIP_CASES))
def test_masked_pairs_are_skipped(name, kernel_calls):
    options, expected = SKIP_CASES[name]
    q, k, v = (t.requires_grad_() for t in make_qkv(Shape(1, 64, 64, 2, 2, 16), torch.float32, seed=25))
    out = chunked.chunked_attention(q, k, v, 4, 4, **options)
    assert kernel_calls["attention_forward"] == expected
    out.backward(torch.ones_like(out))
    assert kernel_calls["attention_backward"] == expected
    ref, _ = attention(q.detach().double(), k.detach().double(), v.detach().double(), dtype=torch.float64,
                       causal=options.get("causal", False), window=options.get("window_size", (-1, -1)),
                       q_pos=options.get("q_offset"))
    assert max_error(out, ref) < 1e-5


def test_one_pair_calls_once(kernel_calls):
    """A single chunk pair is one plain kernel call each way, no accumulators."""
    q, k, v = (t.requires_grad_() for t in make_qkv(Shape(1, 40, 40, 2, 2, 16), torch.bfloat16, seed=26))
    chunked.chunked_attention(q, k, v, 1, 1, causal=True).sum().backward()
    assert kernel_calls == {"attention_forward": 1, "attention_backward": 1}


def working_set(shape, dtype, counts, backward):
    """The bytes of one chunk pair by the module docstring's accounting, recomputed here."""
    size = torch.empty((), dtype=dtype).element_size()
    rows_q = -(-shape.seqlen_q // counts[0])
    rows_k = -(-shape.seqlen_k // counts[1])
    q_row = shape.batch * shape.heads_q * shape.head_dim
    k_row = shape.batch * shape.heads_kv * shape.head_dim
    lse_row = shape.batch * shape.heads_q * 4
    if backward:
        return rows_q * (q_row * (3 * size + 4) + lse_row) + rows_k * k_row * 2 * (size + 4)
    accumulator = 0 if dtype == torch.float32 else 4
    return rows_q * (q_row * (2 * size + accumulator) + lse_row) + rows_k * k_row * 2 * size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_automatic_counts_fit_the_budget(backward, dtype):
    shape = Shape(2, 1000, 3000, 8, 2, 64)
    q = torch.empty(shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim, dtype=dtype, device="meta")
    k = torch.empty(shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim, dtype=dtype, device="meta")
    assert chunked.choose_num_chunks(q, k, backward=backward) == (1, 1)  # the default budget holds it all
    whole = working_set(shape, dtype, (1, 1), backward)
    for fraction in (2, 5, 17, 100):
        budget = whole // fraction
        counts = chunked.choose_num_chunks(q, k, budget, backward=backward)
        assert working_set(shape, dtype, counts, backward) <= budget, (fraction, counts)
        # Not more chunks than needed: halving one of the counts breaks the budget.
        halved = [(-(-counts[0] // 2), counts[1]), (counts[0], -(-counts[1] // 2))]
        assert any(working_set(shape, dtype, h, backward) > budget for h in halved if h != counts), (fraction, counts)
    # A budget below one row per chunk: one row per chunk.
    assert chunked.choose_num_chunks(q, k, 1, backward=backward) == (shape.seqlen_q, shape.seqlen_k)


def test_automatic_chunking(kernel_calls):
    """None chooses the counts from max_chunk_bytes, separately for the backward; results hold."""
    shape = Shape(2, 97, 131, 4, 2, 32)
    q, k, v = make_qkv(shape, torch.bfloat16, seed=27)
    budget = working_set(shape, torch.bfloat16, (1, 1), backward=False) // 6
    forward_counts = chunked.choose_num_chunks(q, k, budget)
    backward_counts = chunked.choose_num_chunks(q, k, budget, backward=True)
    assert forward_counts != (1, 1) and backward_counts[0] * backward_counts[1] > forward_counts[0] * forward_counts[1]
    compare_with_reference(run_chunked(None, None, max_chunk_bytes=budget), run_reference(), [q, k, v],
                           torch.bfloat16)
    # compare_with_reference runs the forward and the backward once, over every pair (no mask).
    assert kernel_calls["attention_forward"] == forward_counts[0] * forward_counts[1]
    assert kernel_calls["attention_backward"] == backward_counts[0] * backward_counts[1]


def test_one_count_automatic():
    q, k, v = make_qkv(Shape(1, 50, 50, 2, 2, 16), torch.float32, seed=28)
    compare_with_reference(run_chunked(3, None, causal=True, max_chunk_bytes=4096), run_reference(causal=True),
                           [q, k, v], torch.float32)


def test_qkv_packed_and_module():
    """The seed's layout (3, ..., S, D), causal and unscaled by default; the module is the function."""
    g = torch.Generator().manual_seed(29)
    batch, heads, seqlen, head_dim = 2, 3, 45, 16
    qkv = (torch.randn(3, batch, heads, seqlen, head_dim, generator=g) * 0.3).requires_grad_()
    out = chunked.flash_attention_qkv_packed(qkv, num_chunks_q=3, num_chunks_kv=2)
    assert out.shape == (batch, heads, seqlen, head_dim)
    q, k, v = (t.detach().double().transpose(1, 2) for t in qkv)  # (B, H, S, D) -> (B, S, H, D)
    ref, _ = attention(q, k, v, dtype=torch.float64, causal=True, softmax_scale=1.0)
    assert max_error(out, ref.transpose(1, 2)) < 1e-5
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()

    # The seed's usage: the leading dimensions flattened, (3, B * H, S, D).
    module = chunked.ChunkedAttention(num_chunks_q=3, num_chunks_kv=2)
    flat = module(qkv.detach().reshape(3, -1, seqlen, head_dim))
    torch.testing.assert_close(flat.reshape(out.shape), out.detach(), rtol=0, atol=0)
    scaled = chunked.ChunkedAttention(causal=False, softmax_scale=None)(qkv.detach())
    ref, _ = attention(q, k, v, dtype=torch.float64)
    assert max_error(scaled, ref.transpose(1, 2)) < 1e-5


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph(fresh_dynamo):
    """torch.compile(fullgraph=True) traces the op forward and backward; results are bit-identical."""
    q, k, v = make_qkv(Shape(2, 29, 41, 4, 2, 16), torch.bfloat16, seed=30)

    def fn(q, k, v):
        out, lse = chunked.chunked_attention(q * 1.5, k, v, 3, 2, causal=True, return_softmax_lse=True)
        return out.float() + lse.transpose(1, 2)[..., None]

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = f(*xs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append([out.detach()] + [x.grad for x in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_opcheck():
    g = torch.Generator().manual_seed(31)
    q = torch.randn(2, 10, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 13, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    options = (torch.rand(4), None, True, -1, -1, 0.0, False, None, 0, 3, 2, chunked.DEFAULT_MAX_CHUNK_BYTES)
    opcheck(torch.ops.ringflash.chunked_attention_forward.default, (q, k, v) + options)
    out, lse = torch.ops.ringflash.chunked_attention_forward(q, k, v, *options)
    dout = torch.randn(out.shape, generator=g)
    opcheck(torch.ops.ringflash.chunked_attention_backward.default,
            (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse) + options)


def test_meta_tensors():
    q = torch.empty(2, 5, 4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 7, 2, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = chunked.chunked_attention(q, k, k, 2, 2, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 5)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


Invalid = ringflash.InvalidArgument


def _bad_cases():
    q, k, v = make_qkv(Shape(2, 8, 8, 4, 2, 16), torch.float32, seed=32)
    attn = chunked.chunked_attention
    yield "num_chunks_q 0", lambda: attn(q, k, v, num_chunks_q=0), r"num_chunks_q must be an int >= 1, or None .*got 0"
    yield "num_chunks_kv -2", lambda: attn(q, k, v, 1, -2), r"num_chunks_kv must be an int >= 1, .*got -2"
    yield "num_chunks_q float", lambda: attn(q, k, v, 1.5), r"num_chunks_q must be an int .*got 1.5"
    yield "num_chunks_q bool", lambda: attn(q, k, v, True), r"num_chunks_q must be an int .*got True"
    yield "max_chunk_bytes", lambda: attn(q, k, v, max_chunk_bytes=0), r"max_chunk_bytes must be an int > 0, got 0"
    yield "window", lambda: attn(q, k, v, window_size=(3,)), r"window_size must be a pair of ints"
    yield "q_offset", lambda: attn(q, k, v, q_offset=1.0), r"q_offset must be an int or None, got 1.0"
    yield "k_offset", lambda: attn(q, k, v, k_offset=None), r"k_offset must be an int, got None"
    yield "q rank", lambda: attn(q[0], k, v, 2, 2), r"q must have shape \(B, S, H, D\), got \(8, 4, 16\)"
    # The library's own checks, reported with the whole tensors' shapes, not the chunks'.
    yield "k batch", lambda: attn(q, k[:1], v[:1], 2, 2), r"k must have q's batch size 2, got \(1, 8, 2, 16\)"
    yield "v shape", lambda: attn(q, k, v[:, :5], 2, 2), r"v must have k's shape \(2, 8, 2, 16\), got \(2, 5, 2, 16\)"
    yield "dtype", lambda: attn(q, k.half(), v, 2, 2), r"k must have q's dtype float32, got float16"
    yield "offset range", lambda: attn(q, k, v, 2, 2, causal=True, q_offset=2 ** 50), r"q_offset"
    yield "qkv shape", lambda: chunked.flash_attention_qkv_packed(torch.randn(2, 4, 8, 16)), (
        r"qkv must have shape \(3, ..., S, D\), got \(2, 4, 8, 16\)")
    yield "module", lambda: chunked.ChunkedAttention(num_chunks_q=0), r"num_chunks_q must be an int >= 1"
    yield "op count", lambda: torch.ops.ringflash.chunked_attention_forward(
        q, k, v, None, None, False, -1, -1, 0.0, False, None, 0, -1, 1, 1024), r"num_chunks_q must be an int >= 1"
    yield "choose_num_chunks", lambda: chunked.choose_num_chunks(q, k, -5), r"max_chunk_bytes must be an int > 0"


BAD_CASES = list(_bad_cases())


@pytest.mark.parametrize("call,pattern", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_input(call, pattern):
    with pytest.raises(Invalid, match=pattern) as info:
        call()
    assert re.match(r"\[\w+\] ", str(info.value)), f"message does not name the op: {info.value}"
