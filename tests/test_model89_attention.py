"""Record #89's attention elements against slow float64 references on random inputs.

Half-truncated RoPE and its YaRN rescales (records #31, #89) against the formulas written out
here, the stage table's window history and resume; one attention layer (paired heads #58, the
partial key offset #49, learnable XSA #82, the sparse output gate #28, value-embedding gates)
against a loop over (query, key) pairs; FlexAttention vs masked SDPA in forward; FLOPs against a
brute-force count of allowed pairs; the V/O inits (#64); the optimizer routing of the new parameters.
"""
import dataclasses
import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import harness as H
import conftest
import kernels
import train_gpt as T

EOT = T.EOT_TOKEN
ALL = "0,1,2,3"


def cfg_of(**kw):
    """A valid 4-layer config, 4 heads of 16, windows (9, 4) with layers 1, 2 short; new flags as given."""
    base = dict(n_layer=4, model_dim=64, n_head=4, seq_len=24, batch_tokens=48, micro_batch_seqs=2,
                num_iterations=10, val_tokens=64, tst_bag_size=1, tst_frac=0.0, doc_mask=True, window=9,
                short_window_layers="1,2", value_embeds=1)
    cfg = T.Config(**{**base, **kw})
    H.validate_config(cfg)
    return cfg


def random_tokens(shape, seed, p_eot=0.15):
    return conftest.random_tokens(shape, seed, p_eot)


def half_freqs(D):
    return [(1 / 1024) ** (i / (D // 4 - 1)) for i in range(D // 4)]


def full_freqs(D, base=10000.0):
    return [base ** (-2 * i / D) for i in range(D // 2)]


def ref_yarn(freqs, windows, scale):
    """HEAD's Yarn.apply (alpha 1, beta 32) step by step, in Python floats."""
    freqs = list(freqs)
    for old, new in zip(windows, windows[1:]):
        for i, f in enumerate(freqs):
            ramp = min(max((old * f / (2 * math.pi) - 1) / (32 - 1), 0.0), 1.0)
            freqs[i] = f * (old / new + ramp * (1 - old / new))
        scale *= 0.2 * math.log(new / old) + 1
    return freqs, scale


def ref_rope(vec, pos, freqs):
    """Rotate pairs (i, i + n) of ``vec``'s first 2n dims by pos * freqs[i]; the rest unchanged."""
    n, out = len(freqs), vec.clone()
    for i, f in enumerate(freqs):
        c, s = math.cos(pos * f), math.sin(pos * f)
        out[i] = vec[i] * c + vec[i + n] * s
        out[i + n] = vec[i + n] * c - vec[i] * s
    return out


# ---------------------------------------------------------------------------------------------
# RoPE: half-truncated, YaRN, the stage table's history, resume, no recompile


def test_new_flags_default_off():
    cfg = T.Config()
    assert (cfg.rope_half, cfg.rope_yarn, cfg.key_offset, cfg.attn_vo_init) == (False, False, False, "zero")
    assert cfg.paired_head_layers == cfg.xsa_layers == cfg.attn_gate_layers == ""
    model = T.GPT(cfg_of())
    assert model.rotary.rot == 16 and not hasattr(model.rotary, "scale")
    for block in model.blocks:
        a = block.attn
        assert not a.paired and not a.key_offset and a.xsa is None and a.gate is None and not a.yarn
        assert torch.count_nonzero(a.proj.weight) == 0


def test_half_rope_against_formula():
    rot = T.Rotary(16, 40, 10000.0, half=True)
    x = torch.randn(2, 40, 3, 16, dtype=torch.float64)
    ref = torch.stack([torch.stack([torch.stack([ref_rope(x[b, t, h], t, half_freqs(16)) for h in range(3)])
                                    for t in range(40)]) for b in range(2)])
    assert torch.allclose(rot(x), ref, atol=1e-5)  # float32 tables as built
    rot = rot.double()
    rot.set_history(())
    assert torch.allclose(rot(x), ref, atol=1e-12, rtol=0)
    assert torch.equal(rot(x)[..., 8:], x[..., 8:])  # the second half is never rotated


def test_yarn_rescale_against_formula_and_its_two_ends():
    windows = (384, 896, 1408, 1664)
    rot = T.Rotary(128, 50, 10000.0, half=True, scale=0.1).double()
    rot.set_history(windows)
    freqs, scale = ref_yarn(half_freqs(128), windows, 0.1)
    angles = torch.outer(torch.arange(50, dtype=torch.float64), torch.tensor(freqs, dtype=torch.float64))
    assert torch.allclose(rot.cos[0, :, 0], angles.cos(), atol=1e-12, rtol=0)
    assert torch.allclose(rot.sin[0, :, 0], angles.sin(), atol=1e-12, rtol=0)
    assert rot.scale.item() == pytest.approx(scale, rel=1e-14)
    # the fastest frequency (1 rad per position: > 32 turns in 384) is kept, the slowest interpolated by old/new
    assert freqs[0] == 1.0 and freqs[-1] == pytest.approx(1 / 1024 * 384 / 1664, rel=1e-12)
    assert scale == pytest.approx(0.1 * math.prod(0.2 * math.log(n / o) + 1 for o, n in zip(windows, windows[1:])))
    rot.set_history(())  # back to the tables as built
    assert torch.allclose(rot.sin[0, 7, 0, -1], torch.tensor(math.sin(7 / 1024), dtype=torch.float64), atol=1e-15)
    assert rot.scale.item() == 0.1


def smoke_yarn_cfg(**kw):
    cfg, _ = T.parse_config(["--preset", "cpu_smoke", "--rope-half", "--rope-yarn", "--attn-scale", "0.1"])
    return dataclasses.replace(cfg, model_dim=64, n_head=2, **kw)


def test_schedule_yarn_history_is_the_long_windows_before_the_final_validation():
    cfg = smoke_yarn_cfg()
    rows, N = T.Schedule(cfg).rows, cfg.num_iterations
    longs = [r.window[0] for r in rows]
    for step in range(N):
        seen = [w for i, w in enumerate(longs[:step + 1]) if i == 0 or w != longs[i - 1]]
        assert rows[step].yarn == tuple(seen), step
    assert rows[N - 1].yarn == (96, 224, 352, 416)  # (3, 7, 11, 13) blocks of 32
    assert rows[N].window[0] == 20 * 32 and rows[N].yarn == rows[N - 1].yarn  # not rescaled for the final val


def test_resumed_model_has_the_uninterrupted_tables():
    cfg = smoke_yarn_cfg()
    rows = T.Schedule(cfg).rows
    run = T.GPT(cfg)
    for step, row in enumerate(rows):
        run.set_window(row.window, row.yarn)
        if step in (0, 32, 33, 64, 65, 97, 98, 99, 100):  # stages start at 33, 65, 98
            resumed = T.GPT(cfg)
            resumed.set_window(row.window, row.yarn)
            for name in ("cos", "sin", "scale"):
                assert torch.equal(getattr(run.rotary, name), getattr(resumed.rotary, name)), (step, name)
            freqs, scale = ref_yarn(half_freqs(32), row.yarn, 0.1)
            angles = torch.outer(torch.arange(2 * cfg.seq_len if cfg.paired_head_layers else cfg.seq_len,
                                              dtype=torch.float64), torch.tensor(freqs, dtype=torch.float64))
            assert torch.allclose(run.rotary.cos[0, :, 0].double(), angles.cos(), atol=1e-6)
            assert run.rotary.scale.item() == pytest.approx(scale, rel=1e-6)
    assert run.rotary.scale.item() > 0.1  # three rescales happened


def test_rescale_changes_buffers_not_the_graph():
    cfg = cfg_of(rope_half=True, rope_yarn=True, attn_scale=0.1, attn_vo_init="uniform")
    torch.manual_seed(0)
    model = T.GPT(cfg)
    layer = model.blocks[0].attn
    x = torch.randn(2, cfg.seq_len, cfg.model_dim)
    masks = model.masks_for(random_tokens((2, cfg.seq_len, 1), 1))
    compiled = torch.compile(layer, backend="eager", dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        before = compiled(x, masks[0])
        model.set_window((9, 4), (6, 12, 18))
        after = compiled(x, masks[0])
        assert torch.allclose(after, layer(x, masks[0]), atol=1e-6)
    assert not torch.allclose(before, after, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# one attention layer against a loop over (query, key) pairs


def ref_layer(a, x, doc, window, freqs, scale, ve=None, ve_gate=None, xsa_alpha=None, attn_gate=None,
              offset_docs=False, dc=None):
    """The layer written out: per (query, key) pair, float64; paired heads as positions in a doubled sequence.

    HEAD's elements: RoPE of a paired layer's head h at 2t + h mod 2; the key offset across documents
    (``offset_docs``: stopping at their starts); the lambdas on W_qkv, W_o; ``dc`` (w1, w2) ``[B, L, H]``: the
    DC correction over the last 112 keys of the document, added before XSA and the gate (record #85)."""
    B, L, _ = x.shape
    Hn, D = a.n_head, a.head_dim
    lam = a.lambdas if a.lambdas is not None else torch.ones(2, dtype=x.dtype)
    q, k, v = (x @ (lam[0] * w.weight).T for w in (a.q, a.k, a.v))
    q, k, v = (t.view(B, L, Hn, D) for t in (q, k, v))
    if ve is not None:
        ve = ve.view(B, L, Hn, D)
        v = v + ve_gate * ve if ve_gate is not None else v + ve
    q, k = (t / torch.sqrt(t.square().mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) for t in (q, k))
    pos = (lambda t, h: 2 * t + (h >= Hn // 2)) if a.paired else (lambda t, h: t)
    angle = (lambda t, h: 2 * t + h % 2) if a.paired else pos  # HEAD's paired table: heads 2j, 2j+1 at 2t, 2t+1
    stream = (lambda h: h % (Hn // 2)) if a.paired else (lambda h: h)
    Q = [[[ref_rope(q[b, t, h], angle(t, h), freqs) for h in range(Hn)] for t in range(L)] for b in range(B)]
    K = [[[ref_rope(k[b, t, h], angle(t, h), freqs) for h in range(Hn)] for t in range(L)] for b in range(B)]
    if a.key_offset:  # the second half of the dims from the previous position (of the same document: offset_docs)
        K = [[[torch.cat((K[b][t][h][:D // 2], K[b][t - 1][h][D // 2:]))
               if t and (not offset_docs or doc[b][t - 1] == doc[b][t]) else K[b][t][h]
               for h in range(Hn)] for t in range(L)] for b in range(B)]
    y = torch.zeros(B, L, Hn, D, dtype=x.dtype)
    for b in range(B):
        for t in range(L):
            for h in range(Hn):
                p = pos(t, h)
                keys = [(t2, h2) for t2 in range(L) for h2 in range(Hn) if stream(h2) == stream(h)
                        and pos(t2, h2) <= p and doc[b][t2] == doc[b][t] and (window == 0 or p - pos(t2, h2) <= window)]
                w = torch.softmax(torch.stack([scale * Q[b][t][h] @ K[b][t2][h2] for t2, h2 in keys]), 0)
                out = sum(wi * v[b, t2, h2] for wi, (t2, h2) in zip(w, keys))
                if dc is not None:  # sum over heads g of rms(w1)_g softmax_g, times w2_h, over v_h
                    near = [j for j in range(max(0, t - 111), t + 1) if doc[b][j] == doc[b][t]]
                    w1 = dc[0][b, t] / torch.sqrt(dc[0][b, t].square().mean() + 1e-6)
                    mix = sum(w1[g] * torch.softmax(torch.stack([scale * Q[b][t][g] @ K[b][j][g] for j in near]), 0)
                              for g in range(Hn))
                    out = out + dc[1][b, t, h] * sum(m * v[b, j, h] for m, j in zip(mix, near))
                if xsa_alpha is not None or a.xsa is not None:
                    alpha = math.tanh(xsa_alpha[b, t, h] if xsa_alpha is not None else a.xsa[h])
                    own = v[b, t, h]
                    out = out - alpha * (out @ own) / max(own @ own, 1e-8) * own
                if attn_gate is not None:
                    out = out * attn_gate[b, t, h]
                elif a.gate is not None:
                    out = out * torch.sigmoid(a.gate.weight[h] @ x[b, t, :12])
                y[b, t, h] = out
    return y.reshape(B, L, -1) @ (lam[1] * a.proj.weight).T


def float64_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = T.GPT(cfg).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("blocks.") and (p.ndim < 2 or "gate" in name or "proj" in name):  # lambdas too
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if "proj" in name else 0.7))
    model.rotary.set_history(())  # float64 tables
    return model


CASES = {
    "plain": dict(),
    "half_rope": dict(rope_half=True),
    "paired": dict(paired_head_layers=ALL, rope_half=True),
    "paired_full_rope_no_window": dict(paired_head_layers="0,3", window=0, short_window_layers=""),
    "key_offset": dict(key_offset=True, rope_half=True),
    "key_offset_docs": dict(key_offset=True, key_offset_docs=True, rope_half=True),
    "lambdas": dict(attn_lambdas=True, rope_half=True),
    "lambdas_paired": dict(attn_lambdas=True, paired_head_layers="1", key_offset=True),
    "xsa": dict(xsa_layers=ALL),
    "gate": dict(attn_gate_layers=ALL),
    "yarn": dict(rope_half=True, rope_yarn=True, attn_scale=0.1),
    "all": dict(rope_half=True, rope_yarn=True, attn_scale=0.1, paired_head_layers="0,1", key_offset=True,
                xsa_layers="2,3", attn_gate_layers="1,3"),
}


@pytest.mark.parametrize("case", CASES)
def test_attention_layer_equals_pairwise_reference(case):
    cfg = cfg_of(**CASES[case])
    model = float64_model(cfg)
    if cfg.rope_yarn:
        model.set_window((9, 4), (5, 7, 9))
    inputs = random_tokens((2, cfg.seq_len, 1), seed=3)
    masks = model.masks_for(inputs)
    doc = T.latent_document_ids(inputs).tolist() if cfg.doc_mask else [[0] * cfg.seq_len] * 2
    D = cfg.model_dim // cfg.n_head
    freqs = half_freqs(D) if cfg.rope_half else full_freqs(D)
    freqs, scale = ref_yarn(freqs, (5, 7, 9), 0.1) if cfg.rope_yarn else (freqs, cfg.attn_scale or D ** -0.5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, cfg.seq_len, cfg.model_dim, generator=g, dtype=torch.float64)
    ve = torch.randn(2, cfg.seq_len, cfg.model_dim, generator=g, dtype=torch.float64)
    for i, block in enumerate(model.blocks):
        a, short = block.attn, i in model.short
        assert a.paired == (str(i) in cfg.paired_head_layers.split(","))
        window = (4 if short else 9) if T.windowed(cfg) else 0
        with torch.no_grad():
            got = a(x, masks[short], ve)
            ref = ref_layer(a, x, doc, window, freqs, scale, ve, offset_docs=cfg.key_offset_docs)
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), (case, i)


def test_per_token_gates_from_outside():
    """``ve_gate``, ``xsa_alpha`` and ``attn_gate`` given per token replace the layer's own (any layer)."""
    cfg = cfg_of(rope_half=True, paired_head_layers="2", key_offset=True, xsa_layers="0")
    model = float64_model(cfg)
    inputs = random_tokens((2, cfg.seq_len, 1), seed=5)
    masks, doc = model.masks_for(inputs), T.latent_document_ids(inputs).tolist()
    g = torch.Generator().manual_seed(6)
    x, ve = (torch.randn(2, cfg.seq_len, cfg.model_dim, generator=g, dtype=torch.float64) for _ in range(2))
    ve_gate = torch.rand(2, cfg.seq_len, cfg.n_head, 1, generator=g, dtype=torch.float64) * 2
    alpha, gate = (torch.randn(2, cfg.seq_len, cfg.n_head, generator=g, dtype=torch.float64) for _ in range(2))
    for i in (0, 1, 3):  # own XSA, short window, long window with the key offset
        a, short = model.blocks[i].attn, i in model.short
        with torch.no_grad():
            got = a(x, masks[short], ve, ve_gate, alpha, gate)
            ref = ref_layer(a, x, doc, 4 if short else 9, half_freqs(16), 16 ** -0.5, ve, ve_gate, alpha, gate)
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), i


def test_model_gradients_flow_to_the_new_parameters():
    cfg = cfg_of(rope_half=True, paired_head_layers="0", key_offset=True, xsa_layers="1,3", attn_gate_layers="2,3",
                 attn_vo_init="uniform")
    model = T.GPT(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)  # a zero head passes no gradient back
    inputs = random_tokens((2, cfg.seq_len, 1), seed=7)
    targets = random_tokens((2, cfg.seq_len, 1), seed=8)
    model(inputs, targets).backward()
    with torch.no_grad():
        for b in model.blocks:  # the XSA alphas start at 0 and the gates' W at 0: their gradients must not vanish
            for p in (b.attn.xsa, b.attn.gate.weight if b.attn.gate is not None else None):
                if p is not None:
                    assert p.grad is not None and torch.count_nonzero(p.grad) > 0


# ---------------------------------------------------------------------------------------------
# FlexAttention (CUDA's path) vs masked SDPA, in forward on CPU; FLOPs; inits; routing


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [0, 37, 200])
def test_flex_attention_equals_masked_sdpa_for_paired_and_offset_layers(window):
    cfg = cfg_of(seq_len=160, batch_tokens=320, rope_half=True, paired_head_layers="0", key_offset=True,
                 xsa_layers="3", attn_gate_layers="3", attn_vo_init="uniform")
    torch.manual_seed(0)
    model = T.GPT(cfg)
    doc = T.latent_document_ids(random_tokens((2, cfg.seq_len, 1), seed=9, p_eot=0.02))
    x = torch.randn(2, cfg.seq_len, cfg.model_dim)
    for i, paired in ((0, True), (3, False)):  # paired; the key offset, XSA and the gate
        a = model.blocks[i].attn
        assert a.paired == paired and a.key_offset != paired
        flex_masks = T.layer_masks(doc, window, True, paired, True)
        assert isinstance(flex_masks.plain, BlockMask) and (flex_masks.paired is not None) == paired
        with torch.no_grad():
            flex = a(x, flex_masks)
            sdpa = a(x, T.layer_masks(doc, window, False, paired, True))
        assert flex.abs().mean() > 0.01 and torch.allclose(flex, sdpa, atol=2e-5), i


@pytest.mark.parametrize("window", [(9, 4), (0, 0), (40, 20)])
def test_flops_count_the_pairs_the_masks_allow(window):
    cfg = cfg_of(paired_head_layers="0,2", no_attn_layers="", window=window[0] or 1)
    profile = H.FlopProfile(cfg, T.GPT)
    L, d = cfg.seq_len, cfg.model_dim
    short = H.layer_set(cfg.short_window_layers)
    brute = 0
    for i in range(cfg.n_layer):
        w = window[1] if i in short else window[0]
        if i in (0, 2):  # n_head/2 heads of d/n_head over 2L positions
            brute += 12 * (d / 2) * kernels.attention_mask(torch.zeros(2 * L, dtype=torch.int64), w).sum().item() / L
        else:
            brute += 12 * d * kernels.attention_mask(torch.zeros(L, dtype=torch.int64), w).sum().item() / L
    assert profile.per_position(window) - 6 * profile.n_matmul == pytest.approx(brute, rel=1e-12)


def test_vo_inits():
    torch.manual_seed(0)
    d = 64
    eye = torch.eye(d)
    a = T.CausalSelfAttention(cfg_of(attn_vo_init="mimetic"))
    for w, sign in ((a.v.weight, 1), (a.proj.weight, -1)):
        noise = w - sign * math.sqrt(0.05) * eye
        assert abs(noise.std().item() - 0.01) < 0.001 and abs(noise.mean().item()) < 0.001
    assert torch.allclose(a.proj.weight @ a.v.weight, -0.05 * eye, atol=0.02)
    a = T.CausalSelfAttention(cfg_of(attn_vo_init="uniform"))
    bound = math.sqrt(3) * 0.5 / math.sqrt(d)
    for w in (a.q.weight, a.v.weight, a.proj.weight):
        assert w.abs().max() <= bound and abs(w.std().item() - 0.5 / math.sqrt(d)) < 0.05 / math.sqrt(d)


@pytest.mark.parametrize("optimizer", ["aurora", "normuon"])
def test_new_parameters_reach_one_optimizer_group(optimizer):
    cfg = cfg_of(xsa_layers="1,3", attn_gate_layers="0,3", optimizer=optimizer, num_iterations=12)
    model = T.GPT(cfg)
    opts = T.build_optimizers(model, cfg)
    seen = [id(p) for opt in opts for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    new = {id(b.attn.xsa) for b in model.blocks if b.attn.xsa is not None} | \
          {id(b.attn.gate.weight) for b in model.blocks if b.attn.gate is not None}
    adam = {id(p) for g in opts[0].param_groups for p in g["params"]}
    assert len(new) == 4 and new <= adam  # Adam, never the orthogonalizing optimizer


def test_config_checks_name_the_flag():
    with pytest.raises(T.ConfigError, match="--paired-head-layers: there is no layer 7"):
        cfg_of(paired_head_layers="7")
    with pytest.raises(T.ConfigError, match="--n-head 3 must be even"):
        cfg_of(n_head=3, model_dim=48, paired_head_layers="1")
    with pytest.raises(T.ConfigError, match="--rope-half needs head_dim"):
        cfg_of(n_head=8, model_dim=48, rope_half=True)


@pytest.mark.parametrize("window", [0, 3, 16, 37])
def test_paired_mask_is_the_mask_of_the_doubled_documents(window):
    """``mask_mod(paired=True)`` reads token t's document at positions 2t, 2t + 1: the doubled ids' mask; and
    the block build from bounds equals ``create_block_mask`` of it."""
    doc = T.latent_document_ids(random_tokens((2, 40, 1), seed=11, p_eot=0.1))
    doubled = doc.repeat_interleave(2, dim=1)
    assert torch.equal(kernels.attention_mask(doc, window, paired=True), kernels.attention_mask(doubled, window))
    ref = create_block_mask(kernels.mask_mod(doubled, window), 2, None, 80, 80, device="cpu", BLOCK_SIZE=16)
    got = kernels.block_mask_from_bounds(doc, window, 16, paired=True)
    assert torch.equal(got.to_dense(), ref.to_dense())
    assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks) and torch.equal(got.full_kv_num_blocks,
                                                                              ref.full_kv_num_blocks)


def test_dc_layer_equals_pairwise_reference():
    """Record #85's DC (HEAD's layer 10) inside a layer with the key offset and lambdas: the base attention plus
    the correction over the last 112 keys of the document (seq 160 > 112, so the window cuts), per pair."""
    cfg = cfg_of(seq_len=160, batch_tokens=320, rope_half=True, key_offset=True, attn_lambdas=True, mudd_gates=1,
                 dc_layers="3", x0_gates=True, bigram_vocab=64, skip_gate="0,2")
    model = float64_model(cfg)
    a = model.blocks[3].attn
    assert a.dc_window == 112 and model.blocks[2].attn.dc_window == 0
    inputs = random_tokens((1, cfg.seq_len, 1), seed=11, p_eot=0.01)
    masks, doc = model.masks_for(inputs), T.latent_document_ids(inputs).tolist()
    assert masks[0].docs is not None and masks[0].first is None  # HEAD's offset crosses documents
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, cfg.seq_len, cfg.model_dim, generator=g, dtype=torch.float64)
    w1, w2 = (torch.randn(1, cfg.seq_len, cfg.n_head, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        got = a(x, masks[0], dc=(w1, w2))
        ref = ref_layer(a, x, doc, 9, half_freqs(16), 16 ** -0.5, dc=(w1, w2))
        base = a(x, masks[0], dc=(w1, torch.zeros_like(w2)))
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    assert (got - base).abs().max() > 1e-3  # the correction is there
