"""The elements that make baseline_h200 HEAD's model (modded-nanogpt f411b3d3; issue 36), each against a slow
float64 reference on random inputs or HEAD's own integer arithmetic written out: record #85's DC correction
(``kernels.dc_attention``) and its gate lanes, the bigram hash at position 1, the attention lambdas' init and
Adam group, the multi-token softmax weight past the sequence end, and which parameters HEAD stores in bf16.
The attention layer with all of them (paired-head RoPE angles, key offset across documents, w + 1 keys) is
tests/test_model89_attention.py's pairwise reference; the parameter count, tests/test_model89_inputs.py.
"""
import math

import pytest
import torch

import harness as H
import kernels
import train_gpt as T


def ref_dc(q, k, v, w1, w2, docs, scale, window):
    """The DC correction written out in Python floats: per query t, keys j in t - window + 1..t of t's document;
    a[t, j] = sum_g w1[t, g] / rms(w1[t]) softmax_g[t, j]; out_h[t] = w2[t, h] sum_j a[t, j] v_h[j]."""
    B, T_, Hn, D = q.shape
    out = torch.zeros(B, T_, Hn, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T_):
            keys = [j for j in range(max(0, t - window + 1), t + 1) if docs[b][j] == docs[b][t]]
            rms = math.sqrt(sum(float(w1[b, t, g]) ** 2 for g in range(Hn)) / Hn + 1e-6)
            a = dict.fromkeys(keys, 0.0)
            for g in range(Hn):
                s = [scale * float(q[b, t, g] @ k[b, j, g]) for j in keys]
                e = [math.exp(x - max(s)) for x in s]
                for j, ej in zip(keys, e):
                    a[j] += float(w1[b, t, g]) / rms * ej / sum(e)
            for h in range(Hn):
                out[b, t, h] = float(w2[b, t, h]) * sum(a[j] * v[b, j, h] for j in keys)
    return out


def dc_inputs(B, T_, Hn, D, seed, p_doc=0.1):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T_, Hn, D, generator=g, dtype=torch.float64) for _ in range(3))
    w1, w2 = (torch.randn(B, T_, Hn, generator=g, dtype=torch.float64) for _ in range(2))
    docs = torch.cumsum(torch.rand(B, T_, generator=g) < p_doc, dim=1)
    return q, k, v, w1, w2, docs


@pytest.mark.parametrize("T_, window, block", [(37, 5, 8), (64, 8, 8), (20, 3, 32), (130, 112, 128)])
def test_dc_attention_equals_a_float64_loop(T_, window, block):
    """Blocks that do not divide T, a window equal to the block, HEAD's 112 over a block boundary, documents."""
    q, k, v, w1, w2, docs = dc_inputs(2, T_, 3, 4, seed=T_, p_doc=0.02 if window == 112 else 0.1)
    got = kernels.dc_attention(q, k, v, w1, w2, docs, 0.7, window, block)
    assert got.dtype == torch.float64 and got.shape == q.shape
    torch.testing.assert_close(got, ref_dc(q, k, v, w1, w2, docs.tolist(), 0.7, window), rtol=0, atol=1e-12)


def test_dc_attention_gradients_equal_finite_differences():
    q, k, v, w1, w2, docs = dc_inputs(1, 11, 2, 3, seed=5, p_doc=0.2)
    args = tuple(t.requires_grad_() for t in (q, k, v, w1, w2))
    assert torch.autograd.gradcheck(lambda *a: kernels.dc_attention(*a, docs, 0.9, 4, 4), args)


def test_dc_attention_float32_matches_float64():
    """A bf16 run's inputs (bf16 q, k, v and lanes): float32 inside and out, against float64 of the same values."""
    q, k, v, w1, w2, docs = dc_inputs(1, 300, 6, 16, seed=8, p_doc=0.01)
    inputs = [t.bfloat16() for t in (q, k, v, w1, w2)]
    want = kernels.dc_attention(*(t.double() for t in inputs), docs, 0.12)
    got = kernels.dc_attention(*inputs, docs, 0.12)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_gate_lanes_are_heads_layout():
    """HEAD's pre gate: XSA 1, 3, gate 3, (x0, bigram) 0-3 = 26; post: XSA 4, 7, gate 10, (x0, bigram) of
    4, 5, 7, 8, 9, the skip, DC w1 (lanes 29:35, start 1.0) and w2 (35:41, start 0) = 41."""
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    pre, post = T.gate_lanes(cfg)
    assert sum(w for *_, w in pre) == 26 and sum(w for *_, w in post) == 41
    offsets, off = {}, 0
    for layer, kind, w in post:
        offsets[(layer, kind)] = (off, off + w)
        off += w
    assert offsets[(10, "dc1")] == (29, 35) and offsets[(10, "dc2")] == (35, 41) and offsets[(None, "skip")] == (28, 29)
    assert T.GATE_START["dc1"] == 1.0 and "dc2" not in T.GATE_START


def heads_bigram_hash(x, vocab):
    """HEAD's get_bigram_hash (train_gpt.py at f411b3d3) as its int32 operations run: out[0] = vocab - 1 is written
    first, so position 1's previous token reads it; products wrap in int32; % is floor-mod."""
    mod = vocab - 1
    out = x.to(torch.int32).clone()
    out[0] = mod
    out[1:] = torch.bitwise_xor(36313 * out[1:], 27191 * out[:-1]) % mod
    return out


def test_bigram_rows_and_signs_equal_heads_int32_hash():
    cfg = T.Config(n_layer=2, model_dim=32, n_head=2, seq_len=64, batch_tokens=128, num_iterations=4,
                   val_tokens=64, tst_bag_size=1, tst_frac=0.0, bigram_vocab=377_280, bigram_dim=2)
    H.validate_config(cfg)
    model = T.GPT(cfg).double()
    with torch.no_grad():
        model.bigram.weight[:, 0] = torch.arange(377_280, dtype=torch.float64)  # a row reads its own number
        model.bigram.weight[:, 1] = 1.0
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50257, (3, 64), generator=g)
    signs = model.bigram_signs.clone()
    model.bigram_signs.fill_(1.0)
    rows = model.bigram_embedding(tokens[..., None])[..., 0].long()
    model.bigram_signs.copy_(signs)
    e = model.bigram_embedding(tokens[..., None])
    assert 27191 * (377_280 - 1) > 2 ** 31  # position 1 wraps in HEAD
    for b in range(3):
        want = heads_bigram_hash(tokens[b], 377_280)
        assert torch.equal(rows[b], want.long())
        sign_rows = torch.zeros(64, dtype=torch.long)
        sign_rows[1:] = (tokens[b, :-1] ^ tokens[b, 1:]) % 8192  # HEAD's sign_idx: real tokens at position 1
        assert torch.equal(e[b], model.bigram.weight[rows[b]] * signs[sign_rows])


def test_attention_lambdas_init_and_adam_group_are_heads_scalars():
    """A [0.5, 1.0] pair per attention layer, in Adam's scalars group: betas (0.9, 0.99), lr x5, no decay (HEAD)."""
    cfg, _ = T.parse_config(["--preset", "cpu_smoke"])
    model = T.GPT(cfg)
    lambdas = [b.attn.lambdas for b in model.blocks if b.attn is not None]
    assert len(lambdas) == cfg.n_layer - len(T.layer_set(cfg.no_attn_layers))
    assert all(torch.equal(p, torch.tensor([0.5, 1.0])) for p in lambdas)
    adam, _ = T.build_record89_optimizers(model, cfg)
    for p in lambdas:
        group = next(g for g in adam.param_groups if any(q is p for q in g["params"]))
        assert (group["role"], group["betas"], group["weight_decay"]) == ("scalars", (0.9, 0.99), 0.0)
        assert group["initial_lr"] == pytest.approx(0.008 * 5)


def test_multi_token_gradient_keeps_past_end_weights_in_the_softmax_term():
    """HEAD's kernel: loss terms only for targets inside the sequence, but the softmax term of the gradient
    weighs every column (S_w); an ignored label (no prefix) counts nowhere. Float64, sigmoid cap."""
    g = torch.Generator().manual_seed(2)
    L, V = 6, 40
    tokens = torch.randint(0, V, (1, L), generator=g)
    targets = T.multi_token_targets(tokens, 3)[0]                  # [L, 3], PAST_END in the last two rows
    prefix = torch.randint(0, V, (L, 1), generator=g)
    prefix[2] = kernels.IGNORE_INDEX
    targets = torch.cat((targets, prefix), 1)
    assert (targets == kernels.PAST_END).sum() == 3
    w = torch.tensor([1.0, 0.5, 0.25, 0.3], dtype=torch.float64)
    x = (3 * torch.randn(L, V, generator=g, dtype=torch.float64)).requires_grad_()
    loss = kernels.multi_target_loss(x, targets, w, cap="sigmoid")
    loss.backward()
    A, B, C = kernels.SIGMOID_CAP
    s = torch.sigmoid((x.detach() + B) / C)
    z, slope = A * s, A / C * s * (1 - s)
    ref_loss, ref_grad = 0.0, torch.zeros(L, V, dtype=torch.float64)
    for n in range(L):
        p = torch.softmax(z[n], 0)
        soft = sum(float(w[j]) for j in range(4) if targets[n, j] >= 0 or targets[n, j] == kernels.PAST_END)
        ref_grad[n] = soft * p
        for j in range(4):
            y = int(targets[n, j])
            if y >= 0:
                ref_loss += float(w[j]) * float(torch.logsumexp(z[n], 0) - z[n, y])
                ref_grad[n, y] -= float(w[j])
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(x.grad, ref_grad * slope, rtol=1e-10, atol=1e-12)


def test_adam_bf16_stores_heads_bf16_parameters():
    """HEAD casts its Adam matrices to bf16 (embeddings, head, value embeddings, bigram, smear and VE gates, MUDD
    and gate MLPs) and keeps its vectors float32 (scalars, post and residual lambdas, the gate scale)."""
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    with torch.device("meta"):
        model = T.GPT(cfg)
    T.adam_bf16_(model)
    bf16 = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    want = {"embed.weight", "lm_head.weight", "bigram.weight", "smear_w", "mudd_w1", "mudd_w2", "mudd_b2",
            "gate_w1", "gate_w2", "gate_b2", *(f"value_embeds.{i}.weight" for i in range(5)),
            *(f"blocks.{i}.ve_gate" for i in (1, 2, 8, 9))}
    assert bf16 == want
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n not in want)
    assert cfg.adam_bf16  # every record preset; a run stores them so only in bf16 runs (not a CPU's float32)


def test_dc_layers_need_the_gate_mlps():
    with pytest.raises(H.ConfigError, match="--dc-layers"):
        H.validate_config(T.parse_config(["--preset", "cpu_smoke", "--mudd-gates", "0"])[0])
    with pytest.raises(H.ConfigError, match="--dc-layers"):
        H.validate_config(T.parse_config(["--preset", "cpu_smoke", "--dc-layers", "0"])[0])  # paired, before G


def test_flops_count_the_dc_keys():
    cfg, _ = T.parse_config(["--preset", "cpu_smoke"])
    off, _ = T.parse_config(["--preset", "cpu_smoke", "--dc-layers", ""])
    row, row_off = T.Schedule(cfg)[0], T.Schedule(off)[0]
    lanes = 2 * cfg.n_head * 64  # the gate MLP's W2 rows of w1, w2
    want = 6 * lanes + 12 * cfg.model_dim * H.attended_keys(cfg.seq_len, kernels.DC_WINDOW - 1)
    assert row.flops_per_position - row_off.flops_per_position == pytest.approx(want, rel=1e-12)
