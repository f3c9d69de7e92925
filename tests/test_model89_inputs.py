"""Record #89's residual stream and inputs (HEAD's GPT) against slow float64 references.

A from-scratch forward written here with loops (the bigram hash token by token, smear position by
position, attention head by head) is compared with the model's, logits, loss and every gradient,
for each flag alone and all together, on plain tokens and on TST bags. Then: k = 1 bags are plain
tokens, the optimizer roles, the matmul count, and the record shape's parameter count on the meta
device against a count by hand.
"""
import math

import pytest
import torch

import harness as H
import train_gpt as T
from test_architecture import exact_rotary_tables, random_tokens, ref_rms, ref_rope

BASE = dict(n_layer=6, model_dim=32, n_head=2, seq_len=16, batch_tokens=64, micro_batch_seqs=4, num_iterations=10,
            val_tokens=64, tst_bag_size=4, logit_softcap=15.0, no_attn_layers="3")
VE = dict(value_embeds=3, ve_layers="1,2,5", ve_gate=True)
ALL = dict(VE, resid_lambdas=True, skip_gate="1,3", x0_gates=True, attn_state_layer=3, bigram_vocab=97,
           bigram_dim=16, smear=True, mudd=True)
ALL85 = dict(ALL, mudd_gates=2)
# record #85's gate MLPs also give the XSA alphas and output gates per token (HEAD): layer 1 from the first MLP,
# layers 2, 4 and the MUDD layer 5 from the second
LANES85 = dict(ALL85, xsa_layers="1,4", attn_gate_layers="2,5")
EACH = [dict(x0_gates=True, bigram_vocab=97, skip_gate="1,3", mudd_gates=1), ALL85, LANES85, dict(resid_lambdas=True), dict(skip_gate="1,3"), dict(x0_gates=True), dict(attn_state_layer=3),
        dict(bigram_vocab=97, bigram_dim=16), dict(bigram_vocab=97, x0_gates=True), dict(smear=True), VE,
        dict(value_embeds=3, ve_layers="5,0,1"), ALL, dict(ALL, bigram_dim=0)]
# record #89's model (HEAD) at full size: the flags the record presets set
RECORD_FLAGS = dict(n_layer=11, no_attn_layers="6", short_window_layers="0,1,2,4,5,7,8,9",
                    resid_lambdas=True, skip_gate="3,6", x0_gates=True, attn_state_layer=7, bigram_vocab=377280,
                    smear=True, value_embeds=5, ve_layers="1,2,8,9,10", ve_gate=True, mudd=True, mudd_gates=4)


def tiny(**kw):
    cfg = T.Config(**{**BASE, **kw})
    H.validate_config(cfg)
    return cfg


def float64_model(cfg, seed=0):
    """T.GPT(cfg) in float64 with every weight moved off its (often zero or constant) init."""
    torch.manual_seed(seed)
    model = T.GPT(cfg).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.6 if name == "lm_head.weight" else 0.4 if p.ndim < 2 or "gate" in name else 0.1
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    exact_rotary_tables(model, cfg)
    return model


# ---------------------------------------------------------------------------------------------
# the float64 reference


def int32(x):
    """A Python int wrapped to int32 (HEAD's get_bigram_hash runs in int32)."""
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


def ref_bigram(P, signs, inputs):
    """[B, L, k] -> [B, L, bigram_dim]: per raw token, row hash(prev, cur) times sign row (prev ^ cur) % 8192; the
    hash of position 1 reads position 0's row number V as its previous token, in int32 (HEAD's out[0] = V)."""
    B, L, k = inputs.shape
    V = P["bigram.weight"].size(0) - 1
    out = []
    for b in range(B):
        flat = inputs[b].reshape(-1).tolist()
        rows = []
        for t, c in enumerate(flat):
            if t == 0:
                rows.append(P["bigram.weight"][V] * signs[0])
            else:
                p = flat[t - 1]
                row = ((36313 * c) ^ int32(27191 * (V if t == 1 else p))) % V
                rows.append(P["bigram.weight"][row] * signs[(p ^ c) % 8192])
        out.append(torch.stack([sum(rows[i * k:(i + 1) * k]) / k for i in range(L)]))
    return torch.stack(out)


def ref_attention(P, i, cfg, h, v_add, xsa=None, gate=None):
    """Causal attention of layer i (softmax over keys j <= t); ``v_add`` [B, L, d] is added to the values; per
    token and head, ``xsa`` [B, L, H] removes tanh(xsa) of y's part along v, ``gate`` [B, L, H] scales y."""
    B, L, d = h.shape
    Hn, hd = cfg.n_head, d // cfg.n_head
    q, k, v = (h @ P[f"blocks.{i}.attn.{n}.weight"].T for n in "qkv")
    if v_add is not None:
        v = v + v_add
    q, k, v = (t.reshape(B, L, Hn, hd) for t in (q, k, v))
    q, k = ref_rope(ref_rms(q), cfg.rope_base), ref_rope(ref_rms(k), cfg.rope_base)
    s = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(hd)
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # key j <= query t
    w = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
    y = torch.einsum("bhqk,bkhe->bqhe", w, v)
    if xsa is not None:
        y = y - torch.tanh(xsa)[..., None] * (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True) * v
    if gate is not None:
        y = y * gate[..., None]
    return y.reshape(B, L, d) @ P[f"blocks.{i}.attn.proj.weight"].T


def ref_mlp(P, i, h):
    return torch.relu(h @ P[f"blocks.{i}.mlp.fc.weight"].T) ** 2 @ P[f"blocks.{i}.mlp.proj.weight"].T


def ref_mudd(P, j, x, m, prefix="mudd", scale=0.1):
    """MUDD block j: m coefficients [B, L, 1] = (W2 gelu(W1 x) + b) * scale, written out."""
    h = x @ P[f"{prefix}_w1"][j].T
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    c = (h @ P[f"{prefix}_w2"][j, :m].T + P[f"{prefix}_b2"][j, :m]) * scale
    return [c[..., r:r + 1] for r in range(m)]


def ref_gates(P, j, x, layers, cfg):
    """Record #85's gate MLP j, its outputs in order: n_head XSA alphas per --xsa-layers layer, then n_head output
    gates per --attn-gate-layers layer (those of this MLP's half: below --mudd-gates for j = 0), then (x0 gate,
    bigram gate) per layer of ``layers``, then (j = 1) the skip factor. Returns ({layer: {kind: value}}, skip)."""
    mine = lambda flag: [i for i in sorted(H.layer_set(getattr(cfg, flag))) if (i >= cfg.mudd_gates) == j]  # noqa
    n_xsa, n_attn, Hn = len(mine("xsa_layers")), len(mine("attn_gate_layers")), cfg.n_head
    c = ref_mudd(P, j, x, Hn * (n_xsa + n_attn) + 2 * len(layers) + j, prefix="gate", scale=P["gate_scale"])
    heads = lambda r: torch.cat(c[r * Hn:(r + 1) * Hn], -1)  # noqa: E731  (the r-th block of n_head lanes)
    out = {}
    for r, i in enumerate(mine("xsa_layers")):
        out.setdefault(i, {})["xsa"] = heads(r)
    for r, i in enumerate(mine("attn_gate_layers")):
        out.setdefault(i, {})["attn"] = heads(n_xsa + r)
    first = Hn * (n_xsa + n_attn)
    for r, i in enumerate(layers):
        out.setdefault(i, {}).update(x0=c[first + 2 * r], bigram=c[first + 2 * r + 1])
    return out, c[-1] if j else 1.0


def ref_inputs(P, cfg, model, inputs):
    """x0 (smeared, normed bag-mean embedding), the value embeddings and the bigram embedding (or None)."""
    e = P["embed.weight"][inputs].mean(2)
    if cfg.smear:  # over latent positions: a bag smears the previous bag's mean
        rows = [e[:, 0]]
        for t in range(1, e.size(1)):
            g = P["smear_lambda"] * torch.sigmoid(e[:, t, :12] @ P["smear_w"][0])
            rows.append(e[:, t] + g[:, None] * e[:, t - 1])
        e = torch.stack(rows, 1)
    ves = [P[f"value_embeds.{j}.weight"][inputs].mean(2) for j in range(cfg.value_embeds)]
    bigram = ref_bigram(P, model.bigram_signs.double(), inputs) if cfg.bigram_vocab else None
    return ref_rms(e), ves, bigram


def ref_forward(P, cfg, model, inputs, targets):
    """Logits [B, L, V] and the summed cross-entropy, from the definitions in the flags' help."""
    n, d = cfg.n_layer, cfg.model_dim
    x0, ves, bigram = ref_inputs(P, cfg, model, inputs)
    no_attn = H.layer_set(cfg.no_attn_layers)
    ve_of = {layer: j % max(cfg.value_embeds, 1) for j, layer in enumerate(H.ve_layer_list(cfg))}
    pad = lambda t: torch.cat((t, torch.zeros(*t.shape[:-1], d - t.size(-1), dtype=t.dtype)), -1)  # noqa: E731
    gated = [i for i in range(n) if i not in no_attn and not (cfg.mudd and i == n - 1)]
    G = cfg.mudd_gates
    gates, factor = ref_gates(P, 0, x0, [i for i in gated if i < G], cfg) if G else ({}, 1.0)
    x = x0 if bigram is None else x0 + (gates[0]["bigram"] if G else P["blocks.0.bigram_gate"]) * pad(bigram)
    start, after, skip = x, {}, H.skip_pair(cfg)
    for i in range(n):
        last_mudd = cfg.mudd and i == n - 1
        if G and i == G:
            post, factor = ref_gates(P, 1, x, [i for i in gated if i >= G], cfg)
            gates.update(post)
        if skip and i == skip[1]:
            x = x + torch.sigmoid(P["skip_lambda"]) * factor * after[skip[0]]
        r = P.get(f"blocks.{i}.resid", torch.ones(2, dtype=torch.float64))
        p = P.get(f"blocks.{i}.post", torch.ones(2, dtype=torch.float64))
        ra, pa, rm, pm = r[0], p[0], r[1], p[1]
        if i not in no_attn:
            src = after[cfg.attn_state_layer] if 0 <= cfg.attn_state_layer < i else x
            h = ref_rms(src)
            ve = ves[ve_of[i]] if i in ve_of else None
            lanes = gates.get(i, {})
            v_add, gx, gb = None, lanes.get("x0", P.get(f"blocks.{i}.x0_gate")), lanes.get("bigram",
                                                                                     P.get(f"blocks.{i}.bigram_gate"))
            inject = x0
            if last_mudd:
                mu = ref_mudd(P, 0, x, 14)
                state = after[cfg.attn_state_layer]
                v_add = mu[0] * start + mu[1] * state + mu[2] * x
                if ve is not None:
                    hd, half = d // cfg.n_head, cfg.n_head // 2
                    vgate = torch.cat([mu[6 + hh // half] for hh in range(cfg.n_head)], -1)  # [B, L, H]
                    v_add = v_add + (vgate[..., None] * ve.view(*ve.shape[:2], cfg.n_head, hd)).flatten(2)
                x = (1 + mu[5]) * x + mu[3] * start + mu[4] * state
                ra, pa, rm, pm, gx, gb, inject = mu[8], mu[9], mu[12], mu[13], mu[10], mu[11], start
            elif ve is not None:
                W = P[f"blocks.{i}.ve_gate"]  # [H, 12]
                g = 2 * torch.sigmoid(torch.cat((h[..., :6], ve[..., :6]), -1) @ W.T)  # [B, L, H]
                v_add = (g[..., None] * ve.view(*ve.shape[:2], cfg.n_head, -1)).flatten(2)
            x = ra * x + pa * ref_attention(P, i, cfg, h, v_add, lanes.get("xsa"), lanes.get("attn"))
            if gx is not None:
                x = x + gx * inject
            if gb is not None and i > 0:
                x = x + gb * pad(bigram)
        x = rm * x + pm * ref_mlp(P, i, ref_rms(x))
        after[i] = x
    if cfg.mudd:
        mu = ref_mudd(P, 1, x, 5)
        x = x + mu[0] * start + mu[1] * after[cfg.attn_state_layer] + mu[2] * after[n - 2] + mu[3] * ves[0] \
            + mu[4] * after[skip[0]]
    z = ref_rms(x) @ P["lm_head.weight"].T
    z = cfg.logit_softcap * torch.tanh(z / cfg.logit_softcap)
    assert (targets >= 0).all()  # every label valid: the sum runs over all of them
    loss = (torch.logsumexp(z, -1, keepdim=True) - z.gather(-1, targets)).sum()
    return z, loss


def compare(cfg, inputs, targets):
    model = float64_model(cfg)
    logits = model(inputs)
    loss = model(inputs, targets)
    loss.backward()
    P = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref_logits, ref_loss = ref_forward_ungated(P, cfg, model, inputs, targets)
    ref_loss.backward()
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-9)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, P[name].grad, rtol=1e-8, atol=1e-10, msg=name)
    return model


def ref_forward_ungated(P, cfg, model, inputs, targets):
    """``ref_forward``; without --ve-gate the values get ``v + ve`` (the mix pinned to (1, 1) by ``compare``)."""
    if cfg.ve_gate or not cfg.value_embeds:
        return ref_forward(P, cfg, model, inputs, targets)
    gated = T.Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "ve_gate": True})
    Q = dict(P)
    for i in {layer for layer in H.ve_layer_list(cfg)}:  # 2 sigmoid(0) = 1: the gate is the identity
        Q[f"blocks.{i}.ve_gate"] = torch.zeros(cfg.n_head, 12, dtype=torch.float64)
    return ref_forward(Q, gated, model, inputs, targets)


def plain(cfg, seed, B=2):
    tokens = random_tokens((B, cfg.seq_len + 1), seed)
    return T.make_batch(tokens, "full", 1)


@pytest.mark.parametrize("flags", EACH, ids=lambda f: "+".join(sorted(f)))
def test_model89_equals_float64_reference(flags):
    cfg = tiny(**flags)
    compare(cfg, *plain(cfg, seed=3))


@pytest.mark.parametrize("flags", [ALL85, dict(bigram_vocab=97, smear=True)], ids=["all", "bigram+smear"])
def test_bags_equal_reference_bag_definitions(flags):
    """TST phase 1 (k = 3): bigram = mean of the bag's tokens' bigram rows over the raw stream, smear over bags."""
    cfg = tiny(**flags)
    tokens = random_tokens((2, 6 * 3), 5)
    compare(cfg, *T.make_batch(tokens, "full", 3))


@pytest.mark.parametrize("flags", [ALL, ALL85], ids=["static-gates", "gate-mlps"])
def test_every_new_parameter_gets_a_gradient(flags):
    cfg = tiny(**flags)
    model = float64_model(cfg)
    model(*plain(cfg, 1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_k1_bags_equal_plain_tokens_exactly():
    cfg = tiny(**ALL85)
    model = float64_model(cfg)
    tokens = random_tokens((2, cfg.seq_len + 1), 9)
    bags, _ = T.make_tst_batch(tokens, 1)
    assert torch.equal(model(bags), model(tokens[:, :-1, None]))
    # a bag's bigram embedding is the mean of its tokens' rows, read off the same raw stream as plain tokens
    per_token = model.bigram_embedding(tokens[:, :12, None]).view(2, 4, 3, -1).mean(2)
    torch.testing.assert_close(model.bigram_embedding(tokens[:, :12].view(2, 4, 3)), per_token, rtol=1e-12, atol=0)


def test_bigram_hash_rows_by_hand():
    cfg = tiny(bigram_vocab=97, bigram_dim=16)
    model = float64_model(cfg)
    with torch.no_grad():
        model.bigram.weight.copy_(torch.arange(97, dtype=torch.float64)[:, None].expand(97, 16))
    tokens = torch.tensor([[50256, 7, 50255, 7]])
    got = model.bigram_embedding(tokens[..., None]).abs()[0, :, 0].tolist()
    want = [96, (36313 * 7 ^ 27191 * 96) % 96, (36313 * 50255 ^ 27191 * 7) % 96, (36313 * 7 ^ 27191 * 50255) % 96]
    assert got == want
    assert torch.equal(model.bigram_embedding(tokens[..., None])[0, 1].sign(), model.bigram_signs[(50256 ^ 7) % 8192])


def test_flags_off_build_no_new_parameters():
    names = {n for n, _ in T.GPT(tiny()).named_parameters()}
    assert not any(k in n for n in names for k in ("resid", "post", "gate", "bigram", "smear", "mudd", "skip_l"))


def test_record89_adam_roles():
    cfg = tiny(**ALL85, optimizer="normuon")
    model = T.GPT(cfg)
    adam, _ = T.build_optimizers(model, cfg)
    roles = {g["role"]: {id(p) for p in g["params"]} for g in adam.param_groups}
    assert roles["bigram_embed"] == {id(model.bigram.weight)}
    assert roles["smear_gate"] == {id(model.smear_w)}
    assert roles["mudd"] == {id(model.mudd_w1), id(model.mudd_w2)} and roles["mudd_bias"] == {id(model.mudd_b2)}
    assert roles["ve_gates"] == {id(model.blocks[i].ve_gate) for i in (1, 2)}
    assert roles["resid_lambdas"] == {id(b.resid) for b in model.blocks if b.resid is not None}
    assert roles["post_lambdas"] == {id(b.post) for b in model.blocks if b.post is not None}
    assert roles["mudd_gate"] == {id(model.gate_w1), id(model.gate_w2)}
    assert roles["mudd_gate_bias"] == {id(model.gate_b2), id(model.gate_scale)}
    assert {id(model.skip_lambda), id(model.smear_lambda)} <= roles["scalars"]
    static = T.GPT(tiny(**ALL, optimizer="normuon"))
    scalars = {id(p) for g in T.build_optimizers(static, static.cfg)[0].param_groups if g["role"] == "scalars"
               for p in g["params"]}
    assert {id(static.blocks[0].x0_gate), id(static.blocks[4].bigram_gate)} <= scalars
    # every parameter in exactly one optimizer group
    all_ids = [id(p) for opt in T.build_optimizers(model, cfg) for g in opt.param_groups for p in g["params"]]
    assert sorted(all_ids) == sorted(id(p) for p in model.parameters())


def test_bad_model89_flags_are_config_errors():
    for kw, says in [(dict(skip_gate="4,2"), "--skip-gate"), (dict(mudd=True), "--mudd"),
                     (dict(value_embeds=2, ve_layers="1"), "--ve-layers"), (dict(bigram_dim=64, bigram_vocab=9),
                                                                            "--bigram-dim")]:
        with pytest.raises(H.ConfigError, match=says):
            tiny(**kw)


def extra_matmuls89(cfg):
    """Matmul weights per position that the record #89 inputs add: smear 12, a [n_head, 12] VE gate per gated
    layer (not MUDD's), MUDD's W1 twice and W2's 14 + 5 rows, the gate MLPs' W1 twice and W2's rows (2 per
    layer with static gates otherwise, 1 for the skip, 2 n_head per DC layer)."""
    ve = [i for i in H.ve_layer_list(cfg) if not (cfg.mudd and i == cfg.n_layer - 1)] if cfg.ve_gate else []
    mudd = 2 * 64 * cfg.model_dim + (14 + 5) * 64 if cfg.mudd else 0
    no_attn = H.layer_set(cfg.no_attn_layers)
    gated = [i for i in range(cfg.n_layer) if i not in no_attn and not (cfg.mudd and i == cfg.n_layer - 1)]
    per_token = cfg.n_head * (len(H.layer_set(cfg.xsa_layers)) + len(H.layer_set(cfg.attn_gate_layers))
                              + 2 * len(H.layer_set(cfg.dc_layers)))  # DC's w1, w2 (record #85)
    gate_mlps = 2 * 64 * cfg.model_dim + (2 * len(gated) + 1 + per_token) * 64 if cfg.mudd_gates else 0
    return 12 * cfg.smear + len(ve) * cfg.n_head * 12 + mudd + gate_mlps


def test_flop_profile_counts_the_new_matmuls():
    d, n_attn = BASE["model_dim"], BASE["n_layer"] - 1
    base = n_attn * 4 * d * d + BASE["n_layer"] * 8 * d * d + 50304 * d
    for flags, extra in [(ALL, 12 + 2 * 2 * 12 + 2 * 64 * d + 19 * 64),
                         (ALL85, 12 + 2 * 2 * 12 + 2 * 64 * d + 19 * 64 + 2 * 64 * d + (2 * 4 + 1) * 64)]:
        cfg = tiny(**flags)
        assert extra_matmuls89(cfg) == extra
        assert H.FlopProfile(cfg, T.GPT).n_matmul == base + extra


def test_record_shape_parameter_count_on_meta_by_hand():
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    cfg = T.Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, **RECORD_FLAGS})
    H.validate_config(cfg)
    with torch.device("meta"):
        model = T.GPT(cfg)
    V, d, n = cfg.vocab_size, cfg.model_dim, cfg.n_layer
    attn_layers = [i for i in range(n) if i != 6]
    tables = (1 + 1 + 5) * V * d + 377280 * d  # embedding, head, 5 value embeddings, bigram
    mlp = n * 2 * 4 * d * d
    attn = sum(p.numel() for b in model.blocks if b.attn is not None for p in b.attn.parameters())
    assert attn >= len(attn_layers) * 4 * d * d  # q, k, v, o at least (attention's own extras counted as built)
    lambdas = (n - 1) * 4                         # resid + post per block, the MUDD layer's come per token
    gates = 4 * 6 * 12                            # VE gates of layers 1, 2, 8, 9 (x0 and bigram gates come per token)
    other = 1 + 12 + 1 + 2 * 64 * d + 2 * 14 * 64 + 2 * 14  # skip lambda, smear w and lambda, MUDD
    # record #85's gate MLPs: W1, W2 and b of 26 | 41 lanes, the scale. First: XSA 1, 3 (6 each), the gate of 3
    # (6), (x0, bigram) of 0-3; second: XSA 4, 7, the gate of 10, (x0, bigram) of 4, 5, 7, 8, 9, the skip, DC's
    # w1, w2 of layer 10 (HEAD's 26 | 41)
    assert [sum(w for *_, w in lanes) for lanes in T.gate_lanes(cfg)] == [12 + 6 + 8, 12 + 6 + 10 + 1 + 12]
    other += 2 * 64 * d + 2 * 41 * 64 + 2 * 41 + 1
    total = tables + mlp + attn + lambdas + gates + other
    assert sum(p.numel() for p in model.parameters()) == total
    # with --mudd-gates, XSA and output gates own no parameters; each attention layer owns its lambda pair (HEAD)
    assert attn == len(attn_layers) * (4 * d * d + 2)
    assert total == 635_886_937  # what --describe prints


def test_record_parameter_count_equals_heads():
    """baseline_h200's count equals HEAD's (f411b3d3 GPT.__init__, counted by formula from its shapes), less its
    padding rows (banks padded for 8 ranks) and the entries its forward never reads (docs/METHODS.md)."""
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    with torch.device("meta"):
        ours = sum(p.numel() for p in T.GPT(cfg).parameters())
    V, d, n, Hh, hd, D = 50304, 768, 11, 6, 128, 3072
    head = dict(embed=V * d, lm_head=d * V, value_embeds=5 * V * d, ve_gate_bank=5 * Hh * 12,
                qk_bank=64 * 2 * hd * d, vo_bank=24 * d * d, mlp_bank=12 * 2 * D * d, smear_gate=12,
                bigram_embed=377280 * d, post_lambdas=n * 2, resid_lambdas=n * 2, scalars=2 * n + 2,
                mudd_w1=2 * 64 * d, mudd_w2=2 * 14 * 64, mudd_b2=2 * 14,
                mudd_gate_w1=2 * 64 * d, mudd_gate_w2=2 * 41 * 64, mudd_gate_b2=2 * 41, _mudd_gate_scale=1)
    padding = (64 - 60) * 2 * hd * d + (24 - 20) * d * d + 1 * 2 * D * d  # qk, vo, mlp banks' rows past the model
    # never read: ve_gate_bank[4] (layer 10 gates its VE by MUDD), layer 6's sa_lambdas (no attention there),
    # resid/post lambdas of layer 10 (MUDD gives them per token)
    unused = Hh * 12 + 2 + 2 * 2
    assert sum(head.values()) == 643_751_335
    assert ours == sum(head.values()) - padding - unused == 635_886_937


@pytest.mark.parametrize("argv", [["--preset", "cpu_smoke"], ["--preset", "cpu_smoke", "--no-mudd"],
                                  ["--preset", "cpu_smoke", "--mudd-gates", "0", "--dc-layers", ""],
                                  ["--preset", "baseline_h200"],
                                  ["--preset", "baseline_h200", "--no-mudd"]], ids=" ".join)
def test_each_attention_layer_takes_its_x0_and_bigram_gates_from_one_place(argv):
    """An attention layer's x0 and bigram gates come from exactly one of: its own scalar (Block), a lane of the
    --mudd-gates MLPs (gate_lanes), MUDD's per-token coefficients (--mudd's last layer); a layer without
    attention has none. Built on the meta device (baseline_h200 has 635M parameters)."""
    cfg, _ = T.parse_config(argv)
    with torch.device("meta"):
        model = T.GPT(cfg)
    lanes = {(i, kind) for side in T.gate_lanes(cfg) for i, kind, _ in side}
    n_attn = 0
    for i, block in enumerate(model.blocks):
        has_attn = block.attn is not None
        n_attn += has_attn
        for kind in ("x0", "bigram"):
            sources = {"scalar": getattr(block, f"{kind}_gate") is not None,
                       "lane": cfg.mudd_gates > 0 and (i, kind) in lanes,
                       "mudd": has_attn and cfg.mudd and i == cfg.n_layer - 1}
            assert sum(sources.values()) == has_attn, (i, kind, sources)
        assert has_attn or not any(i == j for j, _ in lanes)  # no lane for a layer without attention
    # the lanes name every attention layer but MUDD's: without --mudd-gates these own the scalars instead
    listed = {i for i, kind in lanes if kind == "x0"}
    assert len(listed) == n_attn - cfg.mudd
    owners = {i for i, b in enumerate(model.blocks) if b.x0_gate is not None}
    assert owners == (set() if cfg.mudd_gates else listed)
