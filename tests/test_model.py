"""The model (record #89's GPT as a ``ModelSpec``) against the float64 reference of tests/model_reference.py.

Logits, loss and every gradient of the model's forward equal the reference's, written from the definitions, for
the tests' spec, a 4-head one, and one with every role moved (a layer without attention, paired long-window layers,
DC on the last layer, XSA and output gates in both gate MLPs); tied and untied; on tokens and on TST bags. Then:
the bigram hash against modded-nanogpt's int32 operations, the gate lanes' layout, the optimizer routing, which
parameters a bf16 run stores in bf16, the record's parameter count, the windows, and exact accumulation.
"""
import dataclasses

import pytest
import torch

import harness
import kernels
import train_gpt as T
from model_reference import (MOVED, TINY, TINY_H4, capped, config, float64_model, lane_layout, random_tokens,
                             ref_logits, ref_loss)

EOT = T.EOT_TOKEN


def targets_of(inputs, seed, J=3):
    """int64 [B, L, J] labels, about one in five ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 1000, (*inputs.shape[:2], J), generator=g)
    return torch.where(torch.rand(y.shape, generator=g) < 0.2, kernels.IGNORE_INDEX, y)


def compare(cfg, spec, inputs, targets, weights=None, window=(12, 5), yarn=(6, 12), tied=True):
    """The model against the reference: capped logits, the loss sum (column ``weights``), every gradient; then the
    eval-mode metric (next-token CE sum over the first column)."""
    model = float64_model(cfg, spec, window, yarn, tied=tied)
    logits = model(inputs)
    loss = model(inputs, targets) if weights is None else model(inputs, targets, weights)
    loss.backward()
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref = ref_logits(P, model.spec, model, inputs, window, yarn, tied)
    want = ref_loss(ref, targets, weights)
    want.backward()
    assert logits.dtype == loss.dtype == torch.float64
    torch.testing.assert_close(logits, capped(ref).detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-9)
    for name, p in model.named_parameters():
        if p.grad is None or P[name].grad is None:  # the embedding while tied
            assert p.grad is None and P[name].grad is None and tied and name == "embed.weight", name
        else:
            torch.testing.assert_close(p.grad, P[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    model.eval()
    with torch.no_grad():
        metric = model(inputs, targets[..., :1])
    torch.testing.assert_close(metric, ref_loss(ref.detach(), targets[..., :1]), rtol=1e-10, atol=1e-9)
    return model


CASES = {  # spec, window (long, short) in positions, the long windows before it (YaRN), tied
    "tiny": (TINY, (12, 5), (6, 12), True),
    "tiny_untied": (TINY, (12, 5), (6, 12), False),
    "tiny_windows_past_the_sequence": (TINY, (40, 33), (), True),
    "four_heads": (TINY_H4, (9, 4), (3, 9), True),
    "roles_moved": (MOVED, (10, 3), (4, 10), True),
}


@pytest.mark.parametrize("case", CASES)
def test_model_equals_float64_reference(case):
    spec, window, yarn, tied = CASES[case]
    cfg = config(spec)
    tokens = random_tokens((2, cfg.seq_len + 1), seed=len(case), p_eot=0.15)
    inputs, _ = T.make_batch(tokens, "full", 1)
    weights = torch.tensor([1.0, 0.5, 0.3], dtype=torch.float64)
    compare(cfg, spec, inputs, targets_of(inputs, len(case)), weights, window, yarn, tied)


@pytest.mark.parametrize("mode", ["full", "input", "output"])
def test_tst_bags_equal_reference(mode):
    """TST phase 1 (s = 3): bag-mean embedding, bigram over the raw stream, smear over bags, an EOT mid-bag opening
    its document there; MCE over the phase's labels (each weight 1)."""
    cfg, s = config(TINY), 3
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    raw = random_tokens((2, seq_tokens), seed=3, p_eot=0.03)
    raw[0, 5 * s + 1] = EOT
    inputs, targets = T.make_batch(raw, mode, s)
    compare(cfg, TINY, inputs, targets, tied=mode != "input")


@pytest.mark.parametrize("spec", [TINY, MOVED], ids=["tiny", "roles_moved"])
def test_every_parameter_gets_a_gradient(spec):
    """With the inits perturbed, every parameter has a path to the loss (the embedding once untied)."""
    cfg = config(spec)
    inputs, targets = T.make_batch(random_tokens((2, cfg.seq_len + 1), 1, 0.1), "full", 1)
    for tied in (True, False):
        model = float64_model(cfg, spec, (12, 5), tied=tied)
        model(inputs, targets).backward()
        for name, p in model.named_parameters():
            if tied and name == "embed.weight":
                assert p.grad is None
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bags_of_one_are_plain_tokens_exactly():
    cfg = config(TINY)
    model = float64_model(cfg, TINY, (12, 5))
    tokens = random_tokens((2, cfg.seq_len + 1), 9)
    bags, _ = T.make_tst_batch(tokens, 1)
    assert torch.equal(model(bags), model(tokens[:, :-1, None]))
    # a bag's bigram embedding is the mean of its tokens' rows, read off the same raw stream as plain tokens
    per_token = model.bigram_embedding(tokens[:, :12, None]).view(2, 4, 3, -1).mean(2)
    torch.testing.assert_close(model.bigram_embedding(tokens[:, :12].view(2, 4, 3)), per_token, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# the bigram hash and the gate lanes against modded-nanogpt's


def test_bigram_hash_rows_by_hand():
    spec = dataclasses.replace(TINY, bigram_vocab=97)
    model = T.build_model(config(spec), spec).double()
    with torch.no_grad():
        model.bigram.weight.copy_(torch.arange(97, dtype=torch.float64)[:, None].expand(97, TINY.model_dim))
    tokens = torch.tensor([[50256, 7, 50255, 7]])
    got = model.bigram_embedding(tokens[..., None]).abs()[0, :, 0].tolist()
    want = [96, (36313 * 7 ^ 27191 * 96) % 96, (36313 * 50255 ^ 27191 * 7) % 96, (36313 * 7 ^ 27191 * 50255) % 96]
    assert got == want
    assert torch.equal(model.bigram_embedding(tokens[..., None])[0, 1].sign(), model.bigram_signs[(50256 ^ 7) % 8192])


def modded_bigram_hash(x, vocab):
    """modded-nanogpt's get_bigram_hash (train_gpt.py at f411b3d3, record #89) as its int32 operations run:
    out[0] = vocab - 1 is written first, so position 1's previous token reads it; products wrap in int32."""
    mod = vocab - 1
    out = x.to(torch.int32).clone()
    out[0] = mod
    out[1:] = torch.bitwise_xor(36313 * out[1:], 27191 * out[:-1]) % mod
    return out


def test_bigram_rows_and_signs_equal_modded_nanogpts_int32_hash():
    spec = dataclasses.replace(TINY, bigram_vocab=377_280)
    model = T.build_model(config(spec, seq_len=64), spec).double()
    with torch.no_grad():
        model.bigram.weight[:, 0] = torch.arange(377_280, dtype=torch.float64)  # a row reads its own number
        model.bigram.weight[:, 1:] = 1.0
    tokens = torch.randint(0, 50257, (3, 64), generator=torch.Generator().manual_seed(3))
    signs = model.bigram_signs.clone()
    model.bigram_signs.fill_(1.0)
    rows = model.bigram_embedding(tokens[..., None])[..., 0].long()
    model.bigram_signs.copy_(signs)
    e = model.bigram_embedding(tokens[..., None])
    assert 27191 * (377_280 - 1) > 2 ** 31  # position 1 wraps in modded-nanogpt
    for b in range(3):
        assert torch.equal(rows[b], modded_bigram_hash(tokens[b], 377_280).long())
        sign_rows = torch.zeros(64, dtype=torch.long)
        sign_rows[1:] = (tokens[b, :-1] ^ tokens[b, 1:]) % 8192  # its sign_idx: real tokens at position 1
        assert torch.equal(e[b], model.bigram.weight[rows[b]] * signs[sign_rows])


def test_gate_lanes_are_modded_nanogpts_layout():
    """Record #89's pre gate: XSA 1, 3, gate 3, (x0, bigram) 0-3 = 26 lanes; post: XSA 4, 7, gate 10, (x0, bigram)
    of 4, 5, 7, 8, 9, the skip, DC w1 (lanes 29:35, start 1.0) and w2 (35:41, start 0) = 41."""
    pre, post = T.gate_lanes(T.MODELS["record"])
    assert sum(w for *_, w in pre) == 26 and sum(w for *_, w in post) == 41
    offsets, off = {}, 0
    for layer, kind, w in post:
        offsets[(layer, kind)] = (off, off + w)
        off += w
    assert offsets[(10, "dc1")] == (29, 35) and offsets[(10, "dc2")] == (35, 41) and offsets[(None, "skip")] == (28, 29)
    assert T.GATE_START["dc1"] == 1.0 and "dc2" not in T.GATE_START
    for spec in (T.MODELS["record"], T.MODELS["smoke"], TINY, MOVED):  # the reference's layout, as a set of lanes
        assert [sorted(side, key=str) for side in T.gate_lanes(spec)] == \
            [sorted(side, key=str) for side in lane_layout(spec)]


# ---------------------------------------------------------------------------------------------
# optimizer routing and storage


def test_every_parameter_is_in_one_optimizer_group_by_its_role():
    cfg = config(MOVED)
    model = T.build_model(cfg, MOVED)
    adam, normuon = T.build_optimizers(model, cfg)
    seen = [id(p) for opt in (adam, normuon) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each exactly once
    matrices = {id(p) for g in normuon.param_groups for p in g["params"]}
    assert matrices == {id(p) for n, p in model.blocks.named_parameters()
                        if n.endswith(("q.weight", "k.weight", "v.weight", "attn.proj.weight", "fc.weight",
                                       "mlp.proj.weight"))}
    roles = {g["role"]: {id(p) for p in g["params"]} for g in adam.param_groups}
    assert roles["embed"] == {id(model.embed.weight)} and roles["lm_head"] == {id(model.lm_head.weight)}
    assert roles["value_embeds"] == {id(t.weight) for t in model.value_embeds}
    assert roles["bigram_embed"] == {id(model.bigram.weight)}
    assert roles["smear_gate"] == {id(model.smear_w)}
    assert roles["mudd"] == {id(model.mudd_w1), id(model.mudd_w2)} and roles["mudd_bias"] == {id(model.mudd_b2)}
    assert roles["ve_gates"] == {id(model.blocks[i].ve_gate) for i in (0, 2)}  # layer 5's VE: MUDD gates it
    assert roles["resid_lambdas"] == {id(b.resid) for b in model.blocks if b.resid is not None}
    assert roles["post_lambdas"] == {id(b.post) for b in model.blocks if b.post is not None}
    assert len(roles["resid_lambdas"]) == 5  # every layer but MUDD's (the layer without attention too)
    assert roles["mudd_gate"] == {id(model.gate_w1), id(model.gate_w2)}
    assert roles["mudd_gate_bias"] == {id(model.gate_b2), id(model.gate_scale)}
    attn_lambdas = {id(b.attn.lambdas) for b in model.blocks if b.attn is not None}
    assert roles["scalars"] == attn_lambdas | {id(model.skip_lambda), id(model.smear_lambda)}


def test_attention_lambdas_init_and_adam_group_are_modded_nanogpts_scalars():
    """A [0.5, 1.0] pair per attention layer, in Adam's scalars group: betas (0.9, 0.99), lr x5, no decay."""
    cfg, _, _ = harness.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])
    model = T.build_model(cfg, T.MODELS[cfg.model])
    lambdas = [b.attn.lambdas for b in model.blocks if b.attn is not None]
    assert len(lambdas) == model.spec.n_layer - len(model.spec.no_attn)
    assert all(torch.equal(p, torch.tensor([0.5, 1.0])) for p in lambdas)
    adam, _ = T.build_optimizers(model, cfg)
    for p in lambdas:
        group = next(g for g in adam.param_groups if any(q is p for q in g["params"]))
        assert (group["role"], group["betas"], group["weight_decay"]) == ("scalars", (0.9, 0.99), 0.0)
        assert group["initial_lr"] == pytest.approx(cfg.adam_lr * 5)


def test_adam_bf16_stores_modded_nanogpts_bf16_parameters():
    """modded-nanogpt casts its Adam matrices to bf16 (embeddings, head, value embeddings, bigram, smear and VE
    gates, MUDD and gate MLPs) and keeps its vectors float32 (scalars, post and residual lambdas, the gate scale)."""
    with torch.device("meta"):
        model = T.build_model(T.Config(), T.MODELS["record"])
    T.adam_bf16_(model)
    bf16 = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    want = {"embed.weight", "lm_head.weight", "bigram.weight", "smear_w", "mudd_w1", "mudd_w2", "mudd_b2",
            "gate_w1", "gate_w2", "gate_b2", *(f"value_embeds.{i}.weight" for i in range(5)),
            *(f"blocks.{i}.ve_gate" for i in (1, 2, 8, 9))}
    assert bf16 == want
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n not in want)


# ---------------------------------------------------------------------------------------------
# the record's parameter count


def test_record_parameter_count_on_meta_by_hand():
    with torch.device("meta"):
        model = T.build_model(T.Config(), T.MODELS["record"])
    spec = model.spec
    V, d, n = spec.vocab_size, spec.model_dim, spec.n_layer
    tables = (1 + 1 + 5) * V * d + 377280 * d  # embedding, head, 5 value embeddings, bigram
    mlp = n * 2 * 4 * d * d
    attn = (n - 1) * (4 * d * d + 2)              # q, k, v, o and the lambda pair of the 10 attention layers
    lambdas = (n - 1) * 4                         # resid + post per block, the MUDD layer's come per token
    ve_gates = 4 * 6 * 12                         # VE gates of layers 1, 2, 8, 9 (layer 10's: MUDD)
    other = 1 + 12 + 1 + 2 * 64 * d + 2 * 14 * 64 + 2 * 14  # skip lambda, smear w and lambda, MUDD
    other += 2 * 64 * d + 2 * 41 * 64 + 2 * 41 + 1          # record #85's gate MLPs: W1, W2, b of 41 lanes, the scale
    total = tables + mlp + attn + lambdas + ve_gates + other
    assert sum(p.numel() for p in model.parameters()) == total == 635_886_937  # what --describe prints


def test_record_parameter_count_equals_modded_nanogpts():
    """The record's count equals modded-nanogpt's (f411b3d3 GPT.__init__, counted by formula from its shapes), less
    its padding rows (banks padded for 8 ranks) and the entries its forward never reads (docs/METHODS.md)."""
    with torch.device("meta"):
        ours = sum(p.numel() for p in T.build_model(T.Config(), T.MODELS["record"]).parameters())
    V, d, n, Hh, hd, D = 50304, 768, 11, 6, 128, 3072
    theirs = dict(embed=V * d, lm_head=d * V, value_embeds=5 * V * d, ve_gate_bank=5 * Hh * 12,
                  qk_bank=64 * 2 * hd * d, vo_bank=24 * d * d, mlp_bank=12 * 2 * D * d, smear_gate=12,
                  bigram_embed=377280 * d, post_lambdas=n * 2, resid_lambdas=n * 2, scalars=2 * n + 2,
                  mudd_w1=2 * 64 * d, mudd_w2=2 * 14 * 64, mudd_b2=2 * 14,
                  mudd_gate_w1=2 * 64 * d, mudd_gate_w2=2 * 41 * 64, mudd_gate_b2=2 * 41, _mudd_gate_scale=1)
    padding = (64 - 60) * 2 * hd * d + (24 - 20) * d * d + 1 * 2 * D * d  # qk, vo, mlp banks' rows past the model
    # never read: ve_gate_bank[4] (layer 10 gates its VE by MUDD), layer 6's sa_lambdas (no attention there),
    # resid/post lambdas of layer 10 (MUDD gives them per token)
    unused = Hh * 12 + 2 + 2 * 2
    assert sum(theirs.values()) == 643_751_335
    assert ours == sum(theirs.values()) - padding - unused == 635_886_937


# ---------------------------------------------------------------------------------------------
# windows and accumulation


def test_set_window_after_other_windows_equals_a_fresh_model():
    """No stale mask, window or table: moving the windows around first changes nothing."""
    cfg = config(TINY)
    inputs, targets = T.make_batch(random_tokens((2, cfg.seq_len + 1), 4, 0.1), "full", 1)
    moved = float64_model(cfg, TINY, (12, 6), (12,))
    for long in (4, 8, 12):
        for w, yarn in (((4, 2), (12, 4)), ((12, 6), (12, 4, 12)), ((long, long // 2), (6, long))):
            moved.set_window(w, yarn)
        fresh = float64_model(cfg, TINY, (long, long // 2), (6, long))
        assert torch.equal(moved(inputs), fresh(inputs))
        assert torch.equal(moved(inputs, targets), fresh(inputs, targets))


def test_set_window_changes_the_output():
    cfg = config(TINY)
    model = float64_model(cfg, TINY, (4, 2))
    inputs, _ = T.make_batch(random_tokens((2, cfg.seq_len + 1), 4), "full", 1)
    a = model(inputs)
    model.set_window((12, 6), ())
    assert (a - model(inputs)).abs().amax() > 1e-3


@pytest.mark.parametrize("s", [4, 1])
def test_accumulation_is_exact_in_float64(s):
    """One micro-batch of 4 sequences or two of 2: the same step loss and gradients (TST phase 1's MCE, and phase
    2's weighted columns); the loss is the label sum over the step's column-0 labels, the gradient that of the sum
    over the divisor."""
    cfg = config(TINY)
    seq_tokens, _ = T.sequence_layout("full", s, cfg.seq_len)
    inputs, targets = T.make_batch(random_tokens((4, seq_tokens), seed=s, p_eot=0.05), "full", s)
    weights = None
    if s == 1:
        targets = T.objective_targets(targets[..., 0], torch.randint(0, 1000, (50304,)))
        targets[:, -2:] = kernels.IGNORE_INDEX  # no PAST_END: its softmax-only weight is the kernel's (test_objectives)
        weights = torch.tensor([1.0, 0.5, 0.25, 0.25], dtype=torch.float64)
    rt = harness.Runtime(rank=0, world=1, device=torch.device("cpu"), compile=False)
    model = float64_model(cfg, TINY, (12, 5))
    one = T.accumulate_gradients(model, [(inputs, targets)], rt, weights, 4)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    two = T.accumulate_gradients(model, [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])], rt, weights, 4)
    assert one.item() == pytest.approx(two.item(), rel=1e-6)  # the step loss is accumulated in float32
    extra = [] if weights is None else [weights]
    with torch.no_grad():
        total = model(inputs, targets, *extra)
    labels = (targets if weights is None else targets[..., :1]) != kernels.IGNORE_INDEX
    assert one.item() == pytest.approx(total.item() / labels.sum().item(), rel=1e-6)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-10, atol=1e-14, msg=n)
    model.zero_grad()
    (model(inputs, targets, *extra) / 4).backward()
    for n, p in model.named_parameters():  # the gradient of the step's loss sum over the divisor
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-10, atol=1e-14, msg=n)


def test_an_unknown_model_is_one_line(tmp_path, capsys):
    assert T.main(["--model", "bogus", "--log-dir", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("train_gpt.py: error: --model 'bogus': choose one of record, smoke"), line
