"""The scaled_dot_product_attention override (ringflash.auto): which calls it routes to ringflash,
that those match torch's SDPA under the pass rule (top-left causal alignment included), that every
other call reaches torch's SDPA unchanged, and that enable / disable / override restore exactly
what was there."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

TORCH_SDPA = F.scaled_dot_product_attention  # before ringflash.auto is imported

from ringflash import auto  # noqa: E402 (must come after TORCH_SDPA)

# Importing enables the override, and pytest imports every test module before running any: switch
# it off again, so that the other modules' tests (test_sdpa.py's reference) see torch's SDPA.
auto.disable()

from reference import F64, assert_pass_rule, rounded_randn  # noqa: E402

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture
def enabled():
    auto.enable()
    yield
    auto.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


@pytest.fixture
def routed(monkeypatch):
    """How many calls reached ringflash's chunked attention."""
    calls = []
    inner = auto.chunked_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)
    monkeypatch.setattr(auto, "chunked_attention", counted)
    return calls


def sdpa_inputs(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    """query (B, Hq, Sq, D), key and value (B, Hkv, Sk, D), rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    return (rounded_randn((batch, heads_q, seqlen_q, head_dim), dtype, g),
            rounded_randn((batch, heads_kv, seqlen_k, head_dim), dtype, g),
            rounded_randn((batch, heads_kv, seqlen_k, head_dim), dtype, g))


def outputs_and_grads(fn, inputs, dout):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(dout.to(out.dtype))
    return [out] + [x.grad for x in xs]


# (B, Hq, Hkv, Sq, Sk, D, options): Sq != Sk both ways with is_causal (top-left), GQA, scale.
ROUTED_CASES = {
    "full": (2, 4, 4, 17, 17, 64, dict()),
    "causal": (2, 4, 4, 17, 17, 64, dict(is_causal=True)),
    "causal-sq<sk-gqa": (1, 8, 2, 33, 129, 128, dict(is_causal=True, enable_gqa=True)),
    "causal-sq>sk": (1, 4, 4, 40, 23, 32, dict(is_causal=True)),
    "scale-mqa": (2, 4, 1, 19, 31, 16, dict(scale=0.3, enable_gqa=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(ROUTED_CASES))
def test_routed_matches_sdpa(name, dtype, enabled, routed):
    """torch's SDPA in float64 is the reference, torch's SDPA in the test dtype the naive attention."""
    *dims, options = ROUTED_CASES[name]
    inputs = sdpa_inputs(*dims, dtype, seed=41)
    dout = rounded_randn(inputs[0].shape, dtype, torch.Generator().manual_seed(42))
    got = outputs_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **options), inputs, dout)
    assert len(routed) == 1
    ref = outputs_and_grads(lambda q, k, v: TORCH_SDPA(q, k, v, **options), [t.to(F64) for t in inputs], dout)
    naive = outputs_and_grads(lambda q, k, v: TORCH_SDPA(q, k, v, **options), inputs, dout)
    for result, a, b, c in zip(["out", "dq", "dk", "dv"], got, ref, naive):
        assert a.dtype == dtype
        assert_pass_rule(result, a, b, c, dtype)


def test_positional_arguments(enabled, routed):
    q, k, v = sdpa_inputs(1, 2, 2, 9, 9, 8, torch.float32, seed=43)
    out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
    assert len(routed) == 1
    torch.testing.assert_close(out, TORCH_SDPA(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


def _fallback_cases():
    q, k, v = sdpa_inputs(2, 4, 2, 12, 12, 16, torch.float32, seed=44)
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(45)) > 0.3
    yield "bool mask", (q, k[:, :1].expand(2, 4, 12, 16), v[:, :1].expand(2, 4, 12, 16)), dict(attn_mask=mask)
    yield "float mask", (q, k, v), dict(attn_mask=torch.randn(12, 12), enable_gqa=True)
    yield "dropout", (q, k, v), dict(dropout_p=0.3, enable_gqa=True)
    yield "float64", tuple(t.double() for t in (q, k, v)), dict(enable_gqa=True)
    yield "value head dim", (q, k, torch.randn(2, 2, 12, 24)), dict(enable_gqa=True)
    yield "3-D", (q[0], k[0], v[0]), dict(enable_gqa=True)
    yield "strided head dim", (q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)), dict(enable_gqa=True)
    yield "empty", (q[:, :, :0], k, v), dict(enable_gqa=True)


FALLBACK_CASES = list(_fallback_cases())


@pytest.mark.parametrize("inputs,options", [c[1:] for c in FALLBACK_CASES], ids=[c[0] for c in FALLBACK_CASES])
def test_fallback(inputs, options, enabled, routed):
    """Calls ringflash does not take reach torch's SDPA with the same arguments: identical results."""
    assert not auto.should_route(*inputs, **options)
    torch.manual_seed(46)
    got = F.scaled_dot_product_attention(*inputs, **options)
    torch.manual_seed(46)
    expected = TORCH_SDPA(*inputs, **options)
    assert not routed
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_fallback_keeps_torch_errors(enabled, routed):
    """Different head counts without enable_gqa are torch's error, as without the override."""
    q, k, v = sdpa_inputs(1, 4, 2, 8, 8, 16, torch.float32, seed=47)
    with pytest.raises(RuntimeError) as theirs:
        TORCH_SDPA(q, k, v)
    with pytest.raises(type(theirs.value)):
        F.scaled_dot_product_attention(q, k, v)
    assert not routed


def test_autocast_falls_back(enabled, routed):
    q, k, v = sdpa_inputs(1, 2, 2, 8, 8, 16, torch.float32, seed=48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.scaled_dot_product_attention(q, k, v)
        expected = TORCH_SDPA(q, k, v)
    assert not routed
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_multihead_attention(enabled, routed):
    """nn.MultiheadAttention calls F.scaled_dot_product_attention: routed in eval mode, where it
    passes dropout_p=0; in training its dropout > 0 falls back."""
    torch.manual_seed(49)
    mha = torch.nn.MultiheadAttention(32, 4, dropout=0.2, batch_first=True)
    x = torch.randn(2, 10, 32)
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(10)
    mha.eval()
    for options in (dict(), dict(attn_mask=causal_mask, is_causal=True)):  # the mask becomes is_causal
        calls = len(routed)
        out, _ = mha(x, x, x, need_weights=False, **options)
        assert len(routed) == calls + 1
        with auto.override(False):
            expected, _ = mha(x, x, x, need_weights=False, **options)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    mha.train()
    mha(x, x, x, need_weights=False)
    assert len(routed) == 2


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_graph_targets(fn, *inputs):
    """Runs fn compiled with fullgraph=True; returns its result and the targets of the captured graph."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward
    return torch.compile(fn, backend=backend, fullgraph=True)(*inputs), targets


def test_compile_fullgraph(enabled, fresh_dynamo):
    q, k, v = sdpa_inputs(1, 4, 2, 24, 40, 16, torch.float32, seed=50)
    op = torch.ops.ringflash.chunked_attention_forward.default
    out, targets = compiled_graph_targets(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v)
    assert op in targets
    torch.testing.assert_close(out, TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True), rtol=1e-5, atol=1e-5)
    mask = torch.ones(24, 40, dtype=torch.bool).tril()
    out, targets = compiled_graph_targets(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), q, k, v)
    assert op not in targets
    torch.testing.assert_close(out, TORCH_SDPA(q, k, v, attn_mask=mask, enable_gqa=True), rtol=0, atol=0)


def test_enable_disable():
    assert not auto.is_enabled() and F.scaled_dot_product_attention is TORCH_SDPA
    auto.enable()
    auto.enable()  # a second enable changes nothing: one disable undoes both
    assert F.scaled_dot_product_attention is auto.scaled_dot_product_attention and auto.is_enabled()
    auto.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not auto.is_enabled()
    auto.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_override_context_manager():
    with auto.override():
        assert auto.is_enabled()
        with auto.override(False):
            assert F.scaled_dot_product_attention is TORCH_SDPA
        assert auto.is_enabled()
        with pytest.raises(ZeroDivisionError):
            with auto.override(False):
                1 / 0
        assert auto.is_enabled()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_disable_leaves_a_later_patch(monkeypatch):
    """When something replaced the override after enable(), disable() leaves that alone."""
    auto.enable()
    def theirs(*args, **kwargs):
        return auto.scaled_dot_product_attention(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", theirs)
    auto.disable()
    assert F.scaled_dot_product_attention is theirs
    monkeypatch.undo()
    auto.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_import_enables():
    """`import ringflash.auto` alone turns the override on (as the seed's import does)."""
    script = ("import torch.nn.functional as F; original = F.scaled_dot_product_attention; import ringflash.auto; "
              "assert F.scaled_dot_product_attention is ringflash.auto.scaled_dot_product_attention; "
              "ringflash.auto.disable(); assert F.scaled_dot_product_attention is original")
    subprocess.run([sys.executable, "-c", script], check=True, env=None)
