"""Record #89's attention against slow float64 references on random inputs.

Half-truncated RoPE and its YaRN rescales (records #31, #89) against the formulas written out here, the stage
table's window history and resume; one attention layer of each role (paired heads #58, the partial key offset
#49 across documents, DC #85, and the per-token XSA #82, output gate #28 and value-embedding gates the gate MLPs
give) against a loop over (query, key) pairs; FlexAttention vs masked SDPA in forward; the one RoPE table the
layers share; the V/O init (#64).
"""
import dataclasses
import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import harness
import kernels
import train_gpt as T
from model_reference import TINY_H4, config, half_freqs, random_tokens, ref_yarn

# 4 layers of 4 heads of 16: layer 0 paired with the short window, 1 plain short, 2 paired long, 3 long with the
# key offset and DC
LAYERS = dataclasses.replace(TINY_H4, short_window=(0, 1), paired_heads=(0, 2))


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


def test_half_rope_against_formula():
    rot = T.Rotary(16, 40, 0.1)
    x = torch.randn(2, 40, 3, 16, dtype=torch.float64)
    ref = torch.stack([torch.stack([torch.stack([ref_rope(x[b, t, h], t, half_freqs(16)) for h in range(3)])
                                    for t in range(40)]) for b in range(2)])
    assert torch.allclose(rot(x), ref, atol=1e-5)  # float32 tables as built
    rot = rot.double()
    rot.set_history(())
    assert torch.allclose(rot(x), ref, atol=1e-12, rtol=0)
    assert torch.equal(rot(x)[..., 8:], x[..., 8:])  # the second half is never rotated


def test_paired_rope_turns_head_h_of_token_t_at_2t_plus_h_mod_2():
    rot = T.Rotary(16, 40, 0.1).double()
    rot.set_history(())
    x = torch.randn(2, 20, 4, 16, dtype=torch.float64)
    ref = torch.stack([torch.stack([torch.stack([ref_rope(x[b, t, h], 2 * t + h % 2, half_freqs(16))
                                                 for h in range(4)]) for t in range(20)]) for b in range(2)])
    assert torch.allclose(rot(x, paired=True), ref, atol=1e-12, rtol=0)


def test_yarn_rescale_against_formula_and_its_two_ends():
    windows = (384, 896, 1408, 1664)
    rot = T.Rotary(128, 50, 0.1).double()
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


def smoke_cfg():
    return harness.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])[0]


def test_schedule_yarn_history_is_the_long_windows_before_the_final_validation():
    cfg = smoke_cfg()
    rows, N = T.Schedule(cfg, T.MODELS[cfg.model]).rows, cfg.num_iterations
    longs = [r.window[0] for r in rows]
    for step in range(N):
        seen = [w for i, w in enumerate(longs[:step + 1]) if i == 0 or w != longs[i - 1]]
        assert rows[step].yarn == tuple(seen), step
    assert rows[N - 1].yarn == (96, 224, 352, 416)  # (3, 7, 11, 13) blocks of 32
    assert rows[N].window[0] == 20 * 32 and rows[N].yarn == rows[N - 1].yarn  # not rescaled for the final val


def test_resumed_model_has_the_uninterrupted_tables():
    """A run's model that went through every row's set_window has, at each stage start, the tables of a model built
    there (what a resume does), and those of the formula."""
    cfg = smoke_cfg()
    spec = T.MODELS["smoke"]
    rows = T.Schedule(cfg, spec).rows
    run = T.build_model(cfg, spec)
    max_len = 2 * max(3 * cfg.seq_len, T.val_chunk(cfg))
    for step, row in enumerate(rows):
        run.set_window(row.window, row.yarn)
        if step in (0, 32, 33, 64, 65, 97, 98, 99, 100):  # stages start at 33, 65, 98
            resumed = T.Rotary(spec.head_dim, max_len, spec.attn_scale)
            resumed.set_history(row.yarn)
            for name in ("cos", "sin", "scale"):
                assert torch.equal(getattr(run.rotary, name), getattr(resumed, name)), (step, name)
            freqs, scale = ref_yarn(half_freqs(spec.head_dim), row.yarn, 0.1)
            angles = torch.outer(torch.arange(max_len, dtype=torch.float64), torch.tensor(freqs, dtype=torch.float64))
            assert torch.allclose(run.rotary.cos[0, :, 0].double(), angles.cos(), atol=1e-6)
            assert run.rotary.scale.item() == pytest.approx(scale, rel=1e-6)
    assert run.rotary.scale.item() > 0.1  # three rescales happened


def test_rescale_changes_buffers_not_the_graph():
    torch.manual_seed(0)
    cfg = config(LAYERS, seq_len=24)
    model = T.build_model(cfg, LAYERS)
    layer = model.blocks[1].attn
    x = torch.randn(2, cfg.seq_len, LAYERS.model_dim)
    model.set_window((9, 4), (6,))
    masks = model.masks_for(random_tokens((2, cfg.seq_len, 1), 1, 0.15))
    compiled = torch.compile(layer, backend="eager", dynamic=False)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        before = compiled(x, masks[1])
        model.set_window((9, 4), (6, 12, 18))
        after = compiled(x, masks[1])
        assert torch.allclose(after, layer(x, masks[1]), atol=1e-6)
    assert not torch.allclose(before, after, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# one attention layer against a loop over (query, key) pairs


def ref_layer(a, x, doc, window, freqs, scale, ve=None, ve_gate=None, xsa_alpha=None, attn_gate=None, dc=None):
    """The layer written out: per (query, key) pair, float64; paired heads as positions in a doubled sequence.

    modded-nanogpt's elements: RoPE of a paired layer's head h at 2t + h mod 2; the key offset across documents;
    the lambdas on W_qkv, W_o; ``dc`` (w1, w2) ``[B, L, H]``: the DC correction over the last 112 keys of the
    document, added before XSA and the gate (record #85)."""
    B, L, _ = x.shape
    Hn, D = a.n_head, a.head_dim
    lam = a.lambdas
    q, k, v = (x @ (lam[0] * w.weight).T for w in (a.q, a.k, a.v))
    q, k, v = (t.view(B, L, Hn, D) for t in (q, k, v))
    if ve is not None:
        ve = ve.view(B, L, Hn, D)
        v = v + ve_gate * ve if ve_gate is not None else v + ve
    q, k = (t / torch.sqrt(t.square().mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) for t in (q, k))
    pos = (lambda t, h: 2 * t + (h >= Hn // 2)) if a.paired else (lambda t, h: t)
    angle = (lambda t, h: 2 * t + h % 2) if a.paired else pos  # modded-nanogpt's paired table
    stream = (lambda h: h % (Hn // 2)) if a.paired else (lambda h: h)
    Q = [[[ref_rope(q[b, t, h], angle(t, h), freqs) for h in range(Hn)] for t in range(L)] for b in range(B)]
    K = [[[ref_rope(k[b, t, h], angle(t, h), freqs) for h in range(Hn)] for t in range(L)] for b in range(B)]
    if a.key_offset:  # the second half of the dims from the previous position
        K = [[[torch.cat((K[b][t][h][:D // 2], K[b][t - 1][h][D // 2:])) if t else K[b][t][h]
               for h in range(Hn)] for t in range(L)] for b in range(B)]
    y = torch.zeros(B, L, Hn, D, dtype=x.dtype)
    for b in range(B):
        for t in range(L):
            for h in range(Hn):
                p = pos(t, h)
                keys = [(t2, h2) for t2 in range(L) for h2 in range(Hn) if stream(h2) == stream(h)
                        and pos(t2, h2) <= p and doc[b][t2] == doc[b][t] and p - pos(t2, h2) <= window]
                w = torch.softmax(torch.stack([scale * Q[b][t][h] @ K[b][t2][h2] for t2, h2 in keys]), 0)
                out = sum(wi * v[b, t2, h2] for wi, (t2, h2) in zip(w, keys))
                if dc is not None:  # sum over heads g of rms(w1)_g softmax_g, times w2_h, over v_h
                    near = [j for j in range(max(0, t - 111), t + 1) if doc[b][j] == doc[b][t]]
                    w1 = dc[0][b, t] / torch.sqrt(dc[0][b, t].square().mean() + 1e-6)
                    mix = sum(w1[g] * torch.softmax(torch.stack([scale * Q[b][t][g] @ K[b][j][g] for j in near]), 0)
                              for g in range(Hn))
                    out = out + dc[1][b, t, h] * sum(m * v[b, j, h] for m, j in zip(mix, near))
                if xsa_alpha is not None:
                    own = v[b, t, h]
                    out = out - math.tanh(xsa_alpha[b, t, h]) * (out @ own) / max(own @ own, 1e-8) * own
                if attn_gate is not None:
                    out = out * attn_gate[b, t, h]
                y[b, t, h] = out
    return y.reshape(B, L, -1) @ (lam[1] * a.proj.weight).T


def layer_model(seq_len=24, seed=0):
    """The LAYERS model in float64, the layers' weights and lambdas moved off their init, float64 RoPE tables after
    the long windows (5, 7, 9) at windows (9, 4)."""
    torch.manual_seed(seed)
    model = T.build_model(config(LAYERS, seq_len=seq_len), LAYERS).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.blocks.named_parameters():
            if name.endswith(("lambdas", "proj.weight")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if "proj" in name else 0.7))
    model.set_window((9, 4), (5, 7, 9))
    return model


def per_token(seq_len, seed, B=2):
    """float64 x and ve ``[B, L, 64]``, ve_gate ``[B, L, 4, 1]``, XSA alphas, output gates, DC w1 and w2 ``[B, L, 4]``."""
    g = torch.Generator().manual_seed(seed)
    x, ve = (torch.randn(B, seq_len, 64, generator=g, dtype=torch.float64) for _ in range(2))
    ve_gate = 2 * torch.rand(B, seq_len, 4, 1, generator=g, dtype=torch.float64)
    alpha, gate, w1, w2 = (torch.randn(B, seq_len, 4, generator=g, dtype=torch.float64) for _ in range(4))
    return x, ve, ve_gate, alpha, gate, (w1, w2)


@pytest.mark.parametrize("extras", ["none", "ve", "all"])
@pytest.mark.parametrize("layer", range(4))
def test_attention_layer_equals_pairwise_reference(layer, extras):
    """Each role with nothing passed in, with a gated value embedding, and with every per-token input."""
    model = layer_model()
    a = model.blocks[layer].attn
    assert (a.paired, a.key_offset, a.dc_window) == (layer in (0, 2), layer == 3, 112 * (layer == 3))
    inputs = random_tokens((2, 24, 1), seed=3, p_eot=0.15)
    masks, doc = model.masks_for(inputs), T.latent_document_ids(inputs).tolist()
    x, ve, ve_gate, alpha, gate, dc = per_token(24, 4 + layer)
    kw = dict(none={}, ve=dict(ve=ve), all=dict(ve=ve, ve_gate=ve_gate, xsa_alpha=alpha, attn_gate=gate))[extras]
    if layer == 3:
        kw["dc"] = dc
    freqs, scale = ref_yarn(half_freqs(16), (5, 7, 9), 0.1)
    short = layer in LAYERS.short_window
    with torch.no_grad():
        got = a(x, masks[short], **kw)
        ref = ref_layer(a, x, doc, 4 if short else 9, freqs, scale, **kw)
    assert torch.allclose(got, ref, atol=1e-10, rtol=0), (layer, extras)


def test_dc_layer_equals_pairwise_reference_past_its_112_keys():
    """DC in the layer with the key offset: the base attention plus the correction over the last 112 keys of the
    document (160 positions, so the window cuts), per pair."""
    model = layer_model(seq_len=160)
    a = model.blocks[3].attn
    inputs = random_tokens((1, 160, 1), seed=11, p_eot=0.01)
    masks, doc = model.masks_for(inputs), T.latent_document_ids(inputs).tolist()
    assert masks[0].docs is not None and masks[0].first is None  # modded-nanogpt's key offset crosses documents
    x, _, _, _, _, (w1, w2) = per_token(160, 12, B=1)
    freqs, scale = ref_yarn(half_freqs(16), (5, 7, 9), 0.1)
    with torch.no_grad():
        got = a(x, masks[0], dc=(w1, w2))
        ref = ref_layer(a, x, doc, 9, freqs, scale, dc=(w1, w2))
        base = a(x, masks[0], dc=(w1, torch.zeros_like(w2)))
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    assert (got - base).abs().max() > 1e-3  # the correction is there


# ---------------------------------------------------------------------------------------------
# FlexAttention (CUDA's path) vs masked SDPA, in forward on CPU


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [1, 37, 200])
def test_flex_attention_equals_masked_sdpa_for_paired_offset_and_dc_layers(window):
    torch.manual_seed(0)
    model = T.build_model(config(LAYERS, seq_len=160), LAYERS)
    doc = T.latent_document_ids(random_tokens((2, 160, 1), seed=9, p_eot=0.02))
    x = torch.randn(2, 160, 64)
    _, _, _, alpha, gate, (w1, w2) = per_token(160, 10)
    alpha, gate, dc = alpha.float(), gate.float(), (w1.float(), w2.float())
    for i, paired in ((0, True), (3, False)):  # paired; the key offset with DC, XSA and the gate
        a = model.blocks[i].attn
        kw = {} if paired else dict(xsa_alpha=alpha, attn_gate=gate, dc=dc)
        flex_masks = kernels.layer_masks(doc, window, True, paired, False, True)
        assert isinstance(flex_masks.plain, BlockMask) and (flex_masks.paired is not None) == paired
        with torch.no_grad():
            flex = a(x, flex_masks, **kw)
            sdpa = a(x, kernels.layer_masks(doc, window, False, paired, False, True), **kw)
        assert flex.abs().mean() > 0.01 and torch.allclose(flex, sdpa, atol=2e-5), i


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


# ---------------------------------------------------------------------------------------------
# the one RoPE table; inits


def test_model_holds_one_table_that_every_attention_layer_uses():
    spec = dataclasses.replace(LAYERS, no_attn=(2,))
    cfg = config(spec)
    model = T.build_model(cfg, spec)
    layers = [b.attn for b in model.blocks if b.attn is not None]
    assert len(layers) == 3 and all(a.rotary is model.rotary for a in layers)
    names = [n for n, _ in model.named_buffers()]
    # named_buffers lists a tensor once however many modules hold it: per-layer tables would show 3
    assert [n for n in names if n.endswith(("cos", "sin"))] == ["rotary.cos", "rotary.sin"]
    assert model.rotary.cos.shape == (1, 2 * max(3 * cfg.seq_len, T.val_chunk(cfg)), 1, LAYERS.head_dim // 4)
    model = model.double()
    assert model.rotary.cos.dtype == torch.float64 and all(a.rotary.cos is model.rotary.cos for a in layers)


def test_the_shared_table_gives_the_per_layer_tables_result():
    cfg = config(LAYERS)
    torch.manual_seed(0)
    model = T.build_model(cfg, LAYERS)
    model.set_window((9, 4), (5, 9))
    with torch.no_grad():  # every weight off its init (zero-initialized projections included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 1000, (2, cfg.seq_len, 1), generator=g)
    targets = torch.randint(0, 1000, (2, cfg.seq_len, 1), generator=g)
    shared = model(inputs, targets)
    shared.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for block in model.blocks:  # a table built by each layer
        own = T.Rotary(LAYERS.head_dim, 2 * max(3 * cfg.seq_len, T.val_chunk(cfg)), LAYERS.attn_scale)
        own.set_history((5, 9))
        assert own.cos is not block.attn.rotary.cos and torch.equal(own.cos, block.attn.rotary.cos)
        block.attn.rotary = own
    separate = model(inputs, targets)
    separate.backward()
    assert torch.equal(shared, separate)
    assert all(a is p.grad is None or torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_q_k_v_and_o_are_uniform_at_std_half_over_sqrt_d():
    """Record #64 as modded-nanogpt keeps it: the output projection initialized like Q, K, V, not at zero."""
    torch.manual_seed(0)
    a = T.CausalSelfAttention(dataclasses.replace(LAYERS, model_dim=256, n_head=4), T.Rotary(64, 8, 0.1), 1)
    bound = math.sqrt(3) * 0.5 / math.sqrt(256)
    for w in (a.q.weight, a.k.weight, a.v.weight, a.proj.weight):
        assert w.abs().max() <= bound and abs(w.std().item() - 0.5 / math.sqrt(256)) < 0.02 / math.sqrt(256)
