"""Document-masked, sliding-window causal attention: ids, masks, FlexAttention vs SDPA, the model with the flags.

References are Python loops over positions and a float64 softmax; FlexAttention runs its
forward on CPU (the unfused path, no grad), which must agree with the masked SDPA path.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import conftest
import kernels
import train_gpt as T
from conftest import PLAIN_ARCHITECTURE, SMALL_FLAGS
from test_tst import randomized_model  # a GPT with non-zero output layers

EOT = T.EOT_TOKEN
WINDOWS = [0, 1, 2, 5, 16, 1000]


def random_tokens(shape, seed, p_eot=0.1):
    return conftest.random_tokens(shape, seed, p_eot)


def loop_document_ids(row):
    """EOTs at or before each position, by counting."""
    out, count = [], 0
    for t in row.tolist():
        count += t == EOT
        out.append(count)
    return out


def loop_mask(doc, window):
    """mask[q][k]: k <= q, same document, q - k <= window (window 0: no limit); doc is a list."""
    T_ = len(doc)
    return [[k <= q and doc[q] == doc[k] and (window == 0 or q - k <= window) for k in range(T_)]
            for q in range(T_)]


def reference_attention(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(d)) v with mask [B, T, T] (True = attend)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ---------------------------------------------------------------------------------------------
# document ids and masks against loops


@pytest.mark.parametrize("seed", range(4))
def test_document_ids_count_eots_at_or_before_each_position(seed):
    tokens = random_tokens((3, 57), seed, p_eot=0.15)
    tokens[0, 0], tokens[1, -1], tokens[2] = EOT, EOT, 7  # EOT first, last, and a row with none
    ids = T.document_ids(tokens)
    assert ids.dtype == torch.int64 and ids.shape == tokens.shape
    assert ids.tolist() == [loop_document_ids(row) for row in tokens]
    assert T.document_ids(tokens[1]).tolist() == loop_document_ids(tokens[1])  # 1-D


@pytest.mark.parametrize("window", WINDOWS)
def test_attention_mask_matches_loop(window):
    tokens = random_tokens((3, 40), seed=window, p_eot=0.12)
    doc = T.document_ids(tokens)
    mask = kernels.attention_mask(doc, window)
    assert mask.dtype == torch.bool and mask.shape == (3, 40, 40)
    for b in range(3):
        expected = loop_mask(loop_document_ids(tokens[b]), window)
        assert mask[b].tolist() == expected
        assert kernels.attention_mask(doc[b], window).tolist() == expected  # 1-D doc ids -> [T, T]
    assert mask.diagonal(dim1=-2, dim2=-1).all()  # every query sees itself: no empty softmax row


@pytest.mark.parametrize("mode, s", [("full", 3), ("input", 4), ("output", 3), ("full", 1)])
@pytest.mark.parametrize("window", [0, 2, 5])
def test_tst_phase1_latent_mask_from_raw_tokens(mode, s, window):
    """A latent position's document is that of its bag's last raw token; windows count latent positions."""
    L = 12
    seq_tokens, _ = T.sequence_layout(mode, s, L)
    raw = random_tokens((2, seq_tokens), seed=10 * s + window, p_eot=0.08)
    raw[0, s + 1] = EOT         # an EOT in the middle of bag 1 (full/input): bag 1 opens the new document
    raw[1, 3 * s - 1] = EOT     # an EOT as the last token of bag 2
    inputs, _ = T.make_batch(raw, mode, s)
    k = inputs.size(-1)
    doc = T.latent_document_ids(inputs)
    mask = kernels.attention_mask(doc, window)
    for b in range(2):
        # document of latent position i: EOTs among the raw tokens up to its slot's last token
        ref_doc = [sum(t == EOT for t in raw[b, :(i + 1) * k].tolist()) for i in range(L)]
        assert doc[b].tolist() == ref_doc
        assert mask[b].tolist() == loop_mask(ref_doc, window)


def test_bag_document_is_its_last_tokens_by_hand():
    """s = 3: an EOT mid-bag or at a bag's end puts that whole bag in the new document."""
    a = 11
    raw = torch.tensor([[a, a, a, a, EOT, a, a, a, a, a, a, EOT, a, a, a]])  # bags 0..3 + the labels' bag
    inputs, _ = T.make_batch(raw, "full", 3)
    assert T.latent_document_ids(inputs).tolist() == [[0, 1, 1, 2]]
    assert kernels.attention_mask(T.latent_document_ids(inputs), 0).tolist() == [[[True, False, False, False],
                                                                             [False, True, False, False],
                                                                             [False, True, True, False],
                                                                             [False, False, False, True]]]


# ---------------------------------------------------------------------------------------------
# FlexAttention forward (CPU, no grad) == masked SDPA == float64 reference


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [0, 1, 5, 17, 64, 100])
@pytest.mark.parametrize("block_size", [16, 128])
def test_flex_attention_forward_equals_masked_sdpa(window, block_size):
    B, H, T_, D = 2, 2, 64, 16
    g = torch.Generator().manual_seed(window + block_size)
    q, k, v = (torch.randn(B, H, T_, D, generator=g) for _ in range(3))
    tokens = random_tokens((B, T_), seed=window, p_eot=0.06)
    doc = T.document_ids(tokens)
    with torch.no_grad():
        flex_mask = T.build_attention_mask(doc, window, flex=True, block_size=block_size)
        dense_mask = T.build_attention_mask(doc, window, flex=False)
        assert isinstance(flex_mask, BlockMask) and dense_mask.shape == (B, 1, T_, T_)
        flex = T.attend(q, k, v, flex_mask)
        sdpa = T.attend(q, k, v, dense_mask)
    ref = reference_attention(q, k, v, kernels.attention_mask(doc, window))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdpa.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("flex", [False, True])
def test_window_longer_than_sequence_is_causal_attention_within_each_document(flex):
    B, H, T_, D = 2, 2, 48, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, T_, D, generator=g) for _ in range(3))
    tokens = random_tokens((B, T_), seed=4, p_eot=0.1)
    tokens[0, 0], tokens[0, 20], tokens[1, 31] = EOT, EOT, EOT
    doc = T.document_ids(tokens)
    assert torch.equal(kernels.attention_mask(doc, T_ + 7), kernels.attention_mask(doc, 0))
    with torch.no_grad():
        out = T.attend(q, k, v, T.build_attention_mask(doc, T_ + 7, flex=flex, block_size=16))
        for b in range(B):
            for d in doc[b].unique().tolist():
                idx = (doc[b] == d).nonzero().flatten()
                lo, hi = int(idx[0]), int(idx[-1]) + 1  # documents are contiguous
                alone = F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                       v[b:b + 1, :, lo:hi], is_causal=True)
                torch.testing.assert_close(out[b:b + 1, :, lo:hi], alone, rtol=1e-5, atol=1e-5)


def test_no_mask_is_exactly_causal_sdpa():
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    assert torch.equal(T.attend(q, k, v, None), F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---------------------------------------------------------------------------------------------
# the model with the flags


def tiny_cfg(**kw):
    cfg, _ = T.parse_config([*SMALL_FLAGS, "--n-layer", "2", "--model-dim", "32", "--n-head", "2",
                             "--seq-len", "24", "--batch-tokens", "48"])
    return T.dataclasses.replace(cfg, **{**PLAIN_ARCHITECTURE, **kw})


def causal_reference(model, inputs):
    """The model's forward written out with ``is_causal=True`` SDPA (the attention before the flags)."""
    x = T.rms_norm(model.embed(inputs).squeeze(2))
    for block in model.blocks:
        a, h = block.attn, T.rms_norm(x)
        B, L, _ = h.shape
        q, k, v = (lin(h).view(B, L, a.n_head, a.head_dim) for lin in (a.q, a.k, a.v))
        q, k = a.rotary(T.rms_norm(q)), a.rotary(T.rms_norm(k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + a.proj(y.transpose(1, 2).reshape(B, L, -1))
        x = x + block.mlp(T.rms_norm(x))
    c = model.cfg.logit_softcap
    return c * torch.tanh(model.lm_head(T.rms_norm(x)).float() / c)


def test_flags_default_off_and_on_in_every_preset():
    assert (T.Config().doc_mask, T.Config().window) == (False, 0)
    for name in T.PRESETS:
        cfg, _ = T.parse_config(["--preset", name])
        assert cfg.doc_mask, name
        assert cfg.stages == "record89", name  # windows from the stage table's columns
    cfg, _ = T.parse_config(["--doc-mask", "--window", "7"])
    assert (cfg.doc_mask, cfg.window) == (True, 7)
    assert T.parse_config(T.config_to_argv(cfg))[0] == cfg


def test_negative_window_is_a_config_error_naming_the_flag():
    with pytest.raises(T.ConfigError, match="--window must be >= 0"):
        T.parse_config(["--window", "-1"])


def test_model_without_flags_is_todays_causal_model():
    model = randomized_model(tiny_cfg())
    inputs = random_tokens((2, 24, 1), seed=1, p_eot=0.2)  # EOTs present, but no flag: ignored
    assert model.masks_for(inputs) == (None, None)
    with torch.no_grad():
        assert torch.equal(model(inputs), causal_reference(model, inputs))


def test_doc_mask_without_eot_and_no_window_equals_causal_model():
    inputs = random_tokens((2, 24, 1), seed=2, p_eot=0.0)
    with torch.no_grad():
        plain = randomized_model(tiny_cfg())(inputs)
        masked = randomized_model(tiny_cfg(doc_mask=True))(inputs)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)


def flow_diff(cfg, inputs, changed):
    """|logits(inputs) - logits(changed)| per latent position, max over batch and vocab: [L]."""
    model = randomized_model(cfg)
    with torch.no_grad():
        return (model(inputs) - model(changed)).abs().amax(dim=(0, 2))


@pytest.mark.parametrize("s", [1, 3])
def test_doc_mask_blocks_information_from_earlier_documents(s):
    """Perturb the earlier document's tokens: the later document's logits stay exactly the same."""
    L = 24
    raw = random_tokens((2, L * s), seed=5, p_eot=0.0)
    start = 9 * s + (s - 1) // 2  # EOT in the middle of bag 9 (s = 3), or token 9: latent 9 opens document 1
    raw[:, start] = EOT
    changed = raw.clone()
    changed[:, :9 * s] = random_tokens((2, 9 * s), seed=6, p_eot=0.0)  # bags 0..8: document 0 only
    inputs, changed = raw.view(2, L, s), changed.view(2, L, s)
    diff = flow_diff(tiny_cfg(doc_mask=True), inputs, changed)
    assert diff[:9].min() > 1e-4       # the perturbation does reach its own document ...
    assert diff[9:].max() == 0         # ... and nothing past the boundary
    assert flow_diff(tiny_cfg(), inputs, changed)[9:].min() > 1e-4  # without the mask it would


def test_window_limits_information_flow_to_n_layer_times_window():
    """Token 0 reaches position p only through 2 layers of windows of 3 (4 keys each, FA3's): p <= 2 * 3."""
    inputs = random_tokens((2, 24, 1), seed=7, p_eot=0.0)
    changed = inputs.clone()
    changed[:, 0] = (inputs[:, 0] + 1) % 1000
    diff = flow_diff(tiny_cfg(window=3), inputs, changed)
    assert diff[:7].min() > 1e-5 and diff[7:].max() == 0


@pytest.mark.parametrize("phase, mode, s", [(1, "full", 3), (1, "input", 3), (1, "output", 3), (2, "full", 1)])
def test_masked_model_trains_one_step_in_both_tst_phases(phase, mode, s):
    cfg = tiny_cfg(doc_mask=True, window=5, tst_bag_size=3, tst_mode=mode)
    model = randomized_model(cfg)
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    inputs, targets = T.make_batch(random_tokens((2, seq_tokens), seed=8, p_eot=0.05), mode, s)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opts = T.build_optimizers(model, cfg)
    loss = model(inputs, targets) / targets.numel()
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert model.blocks[0].attn.q.weight.grad.abs().max() > 0
    for opt in opts:
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith("blocks"))
