"""ringflash.hf: stock transformers models on ringflash attention, against the same model on its
own attention (sdpa) in one process.

Two tiny GQA models: Llama (4 query heads, 2 K/V heads) and Qwen2 (biases on q/k/v, a full layer
then a sliding-window layer of 24 tokens). On 2 and 4 gloo ranks, every strategy (hybrid 2 x 1 and
1 x 2 at 2 ranks, 2 x 2 at 4) runs one forward and backward on a batch of 67 tokens, padded (two
rows) and packed (four documents in one row, one of them a single token), and must give the
single-process loss, logits and EVERY parameter gradient.

Tolerance (fp32): |loss - ref| <= 1e-5 * |ref|, and for logits and every gradient
max |x - ref| <= 1e-4 * max |ref|. The two computations differ only in summation order (online
softmax over key blocks and ranks against sdpa's full softmax, per-rank partial gradients summed
by an all-reduce), which in fp32 (eps 1.2e-7) through two layers leaves errors of about 1e-6 of
the largest entry (measured: at most 9e-7, and 2e-7 on the loss). Any layout, position, mask or reduction
mistake moves some entry by a large fraction of it, so 1e-4 keeps a wide margin on both sides.
"""

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import ringflash
import ringflash.hf as hf
from ringflash.parallel import STRATEGIES, init_process_groups, shard_positions
from dist_harness import run_world

SEQLEN = 67
DOCS = [30, 1, 19, 17]  # packed into one row; the 1-token document leaves most ranks without it
LOSS_RTOL = 1e-5
RTOL = 1e-4  # of the largest entry, for logits and every gradient
SEQUENCE_PARALLEL = [s for s in STRATEGIES if s != "hybrid"]


def _model(name: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        config = transformers.Qwen2Config(use_sliding_window=True, sliding_window=24, max_window_layers=1, **common)
        model = transformers.Qwen2ForCausalLM(config)
    return model.train()


def _batch(packed: bool):
    g = torch.Generator().manual_seed(1)
    if packed:
        input_ids = torch.randint(0, 128, (1, SEQLEN), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in DOCS])[None]
        labels = input_ids.clone()
        labels[0, torch.tensor(DOCS).cumsum(0)[:-1]] = -100  # as DataCollatorWithFlattening: no cross-document target
    else:
        input_ids = torch.randint(0, 128, (2, SEQLEN), generator=g)
        position_ids = torch.arange(SEQLEN).expand(2, SEQLEN)
        labels = input_ids.clone()
    labels[:, 5] = -100  # an ignored target inside a document
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def _reference(model, batch):
    """loss, logits and gradients of the model on its own attention (sdpa), in this process."""
    model.set_attn_implementation("sdpa")
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def _relative(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _compare(what, loss, logits, grads, ref, failures, worst):
    ref_loss, ref_logits, ref_grads = ref
    loss_error = float((loss - ref_loss).abs() / ref_loss.abs())
    if not loss_error <= LOSS_RTOL:
        failures.append(f"{what}: loss {float(loss)} vs {float(ref_loss)}")
    errors = {"logits": _relative(logits, ref_logits)}
    for name, ref_grad in ref_grads.items():
        if grads[name] is None:
            failures.append(f"{what}: no gradient reached {name}")
            continue
        errors[name] = _relative(grads[name], ref_grad)
    for name, error in errors.items():
        if not error <= RTOL:
            failures.append(f"{what}: {name} differs by {error:.2e} of its largest entry")
    worst[0] = max(worst[0], loss_error)
    worst[1] = max([worst[1]] + list(errors.values()))


def _strategies(world):
    """(strategy, group) pairs: every strategy on the default group, hybrid on each factorisation."""
    pairs = [(s, None) for s in SEQUENCE_PARALLEL]
    factorisations = [(2, 2)] if world == 4 else [(2, 1), (1, 2)]
    for ulysses, ring in factorisations:
        pairs.append((f"hybrid {ulysses}x{ring}", init_process_groups(ulysses, ring)))
    return pairs


def _models_body(rank, world):
    """Every model x batch x strategy: loss, logits and every gradient against one process."""
    failures, worst, checked = [], [0.0, 0.0], 0
    pairs = _strategies(world)
    for name in ("llama", "qwen2"):
        model = _model(name)
        for packed in (False, True):
            batch = _batch(packed)
            ref = _reference(model, batch)
            for label, group in pairs:
                strategy = label.split()[0]
                what = f"{name} {'packed' if packed else 'padded'} {label} P={world}"
                hf.apply(model, strategy)
                model.zero_grad(set_to_none=True)
                local = hf.shard_batch(batch, strategy, group)
                labels = local.pop("shift_labels")
                logits = model(**local, use_cache=False).logits
                loss = hf.sequence_parallel_loss(logits, labels)
                loss.backward()
                hf.all_reduce_gradients(model)
                grads = {n: p.grad for n, p in model.named_parameters()}
                _compare(what, loss.detach(), hf.gather_sequence(logits), grads, ref, failures, worst)
                checked += 1
    return failures, checked, worst


def _sharding_body(rank, world):
    """The helpers on awkward lengths: every token lands on exactly one rank, gather inverts shard,
    padded layouts agree with shard_positions and packed ones shard each document on its own. A
    layout that leaves a rank without a token is refused; returns this rank's token count per case
    so that the caller can check that a refusal happens exactly then."""
    failures, counts = [], {}
    lengths = [world, world + 1, 2 * world - 1, 2 * world + 1, 67]
    for label, group in _strategies(world):
        strategy = label.split()[0]
        for seqlen in lengths:
            for docs in ([seqlen], [1, seqlen - 1], [seqlen // 2, 1, seqlen - seqlen // 2 - 1]):
                if 0 in docs:
                    continue
                what = f"{label} S={seqlen} docs={docs} P={world}"
                position_ids = torch.cat([torch.arange(n) for n in docs]).expand(3, seqlen)
                starts = torch.tensor([0] + docs).cumsum(0)
                mine = torch.cat([shard_positions(n, strategy, group) + int(starts[i])
                                  for i, n in enumerate(docs)])
                try:
                    sharding = hf.update_sharding(position_ids, strategy, group)
                except ringflash.InvalidArgument as e:
                    counts[what] = (mine.numel(), "refused")
                    if "a rank would hold no token" not in str(e):
                        failures.append(f"{what}: {e}")
                    continue
                counts[what] = (mine.numel(), "sharded")
                values = torch.arange(3 * seqlen).view(3, seqlen)
                if not torch.equal(sharding.gather(sharding.shard(values)), values):
                    failures.append(f"{what}: gather(shard(x)) != x")
                expected_cu = None if len(docs) == 1 else torch.tensor([0] + docs * 3).cumsum(0).to(torch.int32)
                if (sharding.cu_seqlens is None) != (expected_cu is None) or (
                        expected_cu is not None and not torch.equal(sharding.cu_seqlens, expected_cu)):
                    failures.append(f"{what}: cu_seqlens {sharding.cu_seqlens} != {expected_cu}")
                if not torch.equal(sharding.positions, mine):
                    failures.append(f"{what}: positions {sharding.positions.tolist()} != {mine.tolist()}")
    return failures, counts


def _errors_body(rank, world):
    """Bad input: the same clear exception on every rank, and no rank left waiting."""
    messages = {}
    model = hf.apply(_model("llama"), "zigzag")
    batch = _batch(packed=False)

    def attempt(key, fn, kind):
        try:
            fn()
        except kind as e:
            messages[key] = str(e)

    padding = torch.ones(2, SEQLEN, dtype=torch.long)
    padding[1, :4] = 0
    attempt("shard padding", lambda: hf.shard_batch({**batch, "attention_mask": padding}, "zigzag"),
            ringflash.NotSupported)
    local = hf.shard_batch(batch, "zigzag")
    local.pop("shift_labels")
    local_padding = torch.ones_like(local["input_ids"])
    local_padding[1, 0] = 0
    attempt("model padding", lambda: model(**local, attention_mask=local_padding, use_cache=False),
            ringflash.NotSupported)
    # Every rank would need a token: fewer tokens than ranks cannot be sharded.
    short = {"input_ids": batch["input_ids"][:, : world - 1]}
    attempt("too short", lambda: hf.shard_batch(short, "ring"), ringflash.InvalidArgument)
    # Ranks that disagree on the global batch are told so, all of them.
    uneven = {"input_ids": batch["input_ids"][:, : SEQLEN - rank]}
    attempt("different batches", lambda: hf.shard_batch(uneven, "ring"), ringflash.InvalidArgument)
    rows = torch.stack([torch.arange(SEQLEN), torch.cat([torch.arange(10), torch.arange(SEQLEN - 10)])])
    attempt("different rows", lambda: hf.shard_batch({**batch, "position_ids": rows}, "ring"),
            ringflash.InvalidArgument)
    attempt("hybrid without groups", lambda: hf.shard_batch(batch, "hybrid"), ringflash.InvalidArgument)
    # A batch sharded for one strategy fed to a model that uses another.
    local = hf.shard_batch(batch, "ring")
    local.pop("shift_labels")
    attempt("strategy mismatch", lambda: model(**local, use_cache=False), ringflash.InvalidArgument)
    # The global batch fed without sharding it.
    hf.shard_batch(batch, "zigzag")
    attempt("not sharded", lambda: model(input_ids=batch["input_ids"], use_cache=False), ringflash.InvalidArgument)
    return messages


@pytest.mark.parametrize("world", [2, 4])
def test_models_match_one_process_for_every_strategy(world):
    # One world per size runs every check, so the price of starting ranks is paid once.
    results = run_world(world, _run_all)
    for failures, checked, worst in (r["models"] for r in results):
        assert failures == [], "\n".join(failures)
        assert checked == 2 * 2 * (len(SEQUENCE_PARALLEL) + (1 if world == 4 else 2))
        assert worst[0] <= LOSS_RTOL and worst[1] <= RTOL
    for failures, _ in (r["sharding"] for r in results):
        assert failures == [], "\n".join(failures)
    counts = [r["sharding"][1] for r in results]
    for case in counts[0]:
        verdicts = {c[case][1] for c in counts}
        emptiest = min(c[case][0] for c in counts)
        assert verdicts == {"refused" if emptiest == 0 else "sharded"}, (case, [c[case] for c in counts])
    assert any(v == "refused" for _, v in counts[0].values()) and any(v == "sharded" for _, v in counts[0].values())
    for messages in (r["errors"] for r in results):
        assert "attention_mask must be all ones" in messages["shard padding"]
        assert "attention_mask must be None" in messages["model padding"]
        assert f"cannot be sharded over {world} ranks with 'ring': a rank would hold no token" in messages["too short"]
        assert "every rank must pass the same global batch" in messages["different batches"]
        assert "must start documents at the same places" in messages["different rows"]
        assert "strategy 'hybrid' needs the group of" in messages["hybrid without groups"]
        assert "the batch was sharded for 'ring', but the model uses 'ringattn_zigzag'" in messages["strategy mismatch"]
        assert "call shard_batch for every batch" in messages["not sharded"]


def _run_all(rank, world):
    return {"models": _models_body(rank, world), "sharding": _sharding_body(rank, world),
            "errors": _errors_body(rank, world)}


# ---------------------------------------------------------------------------------------------
# One process: the single-device implementation, registration, helpers and refusals


def test_names_are_registered_and_avoid_flash():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    names = [hf.implementation(None)] + [hf.implementation(s) for s in STRATEGIES]
    assert names == ["ringattn", "ringattn_ring", "ringattn_zigzag", "ringattn_stripe", "ringattn_allgather",
                     "ringattn_ulysses", "ringattn_hybrid"]
    for name in names:
        assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS
        assert "flash" not in name  # transformers would look for a hub kernel
    with pytest.raises(ringflash.InvalidArgument, match="strategy must be None or one of"):
        hf.implementation("spiral")


def test_every_way_to_choose_the_implementation():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, attn_implementation="ringattn_ring")
    assert transformers.LlamaForCausalLM(config).config._attn_implementation == "ringattn_ring"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ringattn_stripe")
    assert model.config._attn_implementation == "ringattn_stripe"
    assert hf.apply(model).config._attn_implementation == "ringattn"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_single_device_matches_sdpa_padded_packed_and_generating(name):
    model = _model(name)
    for packed in (False, True):
        batch = _batch(packed)
        ref = _reference(model, batch)
        hf.apply(model)
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        failures, worst = [], [0.0, 0.0]
        _compare(f"{name} packed={packed}", out.loss.detach(), out.logits.detach(),
                 {n: p.grad for n, p in model.named_parameters()}, ref, failures, worst)
        assert failures == [], "\n".join(failures)
    # Document boundaries as transformers' flash path takes them (DataCollatorWithFlattening). The
    # position_ids run on across documents here, so only cu_seq_lens can separate them; rotary scores
    # depend on relative positions only, so the result is that of the packed reference.
    batch = _batch(packed=True)
    cu = hf.cu_seqlens_from_position_ids(batch["position_ids"])
    logits = model(input_ids=batch["input_ids"], position_ids=torch.arange(SEQLEN)[None], cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, use_cache=False).logits.detach()
    assert _relative(logits, _reference(model, batch)[1]) <= RTOL
    # Generation with a KV cache: the query is shorter than the keys (bottom-right causal alignment).
    model.eval()
    prompt = _batch(False)["input_ids"][:1, :20]
    tokens = {}
    for implementation in ("sdpa", "ringattn"):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens["sdpa"], tokens["ringattn"])


def test_a_strategy_on_one_process_is_single_device():
    assert not dist.is_initialized()
    model = _model("llama")
    batch = _batch(packed=True)
    ref = _reference(model, batch)
    hf.apply(model, "zigzag")
    model.zero_grad(set_to_none=True)
    local = hf.shard_batch(batch, "zigzag")
    assert torch.equal(local["position_ids"], batch["position_ids"])
    logits = model(**local, use_cache=False).logits
    loss = hf.sequence_parallel_loss(logits, local["shift_labels"])
    loss.backward()
    hf.all_reduce_gradients(model)
    failures, worst = [], [0.0, 0.0]
    _compare("zigzag P=1", loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}, ref,
             failures, worst)
    assert failures == [], "\n".join(failures)


def test_helpers():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert hf.shift_labels(labels).tolist() == [[6, 7, 8, -100]]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 7, 8]])
    assert hf.cu_seqlens_from_position_ids(position_ids).tolist() == [0, 3, 5, 6, 8]
    assert hf.cu_seqlens_from_position_ids(torch.arange(4).expand(2, 4)).tolist() == [0, 4, 8]
    assert hf.cu_seqlens_from_position_ids(torch.arange(4)).dtype == torch.int32
    # The loss: the mean over targets that are not -100, like torch's cross entropy.
    logits = torch.randn(2, 5, 11)
    targets = torch.tensor([[1, -100, 3, 4, 5], [-100, -100, 0, 10, 2]])
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 11), targets.view(-1))
    assert torch.allclose(hf.sequence_parallel_loss(logits, targets), expected)
    assert float(hf.sequence_parallel_loss(logits, torch.full((2, 5), -100))) == 0.0


def test_refusals_on_one_process():
    model = _model("llama")
    hf.apply(model)
    batch = _batch(packed=False)
    padding = torch.ones(2, SEQLEN, dtype=torch.long)
    padding[0, :3] = 0
    with pytest.raises(ringflash.NotSupported, match="attention_mask must be None"):
        model(input_ids=batch["input_ids"], attention_mask=padding, use_cache=False)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1  # the model is in training mode
    with pytest.raises(ringflash.NotSupported, match="dropout"):
        model(input_ids=batch["input_ids"], use_cache=False)
    attention = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["ringattn_zigzag"]
    module = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 9, 16)
    hf.update_sharding(torch.arange(3), "zigzag")
    with pytest.raises(ringflash.NotSupported, match="no KV cache under sequence parallelism"):
        attention(module, q, k, k, None, scaling=0.25)
    with pytest.raises(ringflash.InvalidArgument, match="cu_seq_lens_q cannot say"):
        attention(module, q, q[:, :2], q[:, :2], None, cu_seq_lens_q=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ringflash.NotSupported, match="s_aux"):
        attention(module, q, k, k, None, s_aux=torch.zeros(4))
    with pytest.raises(ringflash.InvalidArgument, match="must hold integers"):
        hf.update_sharding(torch.zeros(5), "ring")
    with pytest.raises(ringflash.InvalidArgument, match="shift_labels must have shape"):
        hf.sequence_parallel_loss(torch.randn(1, 4, 8), torch.zeros(1, 5, dtype=torch.long))
