"""Document-masked, sliding-window causal attention: ids, masks, FlexAttention vs SDPA, record #85's DC kernel, and
what the masks let through the whole model.

References are Python loops over positions and a float64 softmax; FlexAttention runs its forward on CPU (the
unfused path, no grad), which must agree with the masked SDPA path.
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import conftest
import kernels
import train_gpt as T
from model_reference import TINY, config

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
        flex_mask = kernels.build_attention_mask(doc, window, flex=True, block_size=block_size)
        dense_mask = kernels.build_attention_mask(doc, window, flex=False)
        assert isinstance(flex_mask, BlockMask) and dense_mask.shape == (B, 1, T_, T_)
        flex = kernels.attend(q, k, v, flex_mask)
        sdpa = kernels.attend(q, k, v, dense_mask)
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
        out = kernels.attend(q, k, v, kernels.build_attention_mask(doc, T_ + 7, flex=flex, block_size=16))
        for b in range(B):
            for d in doc[b].unique().tolist():
                idx = (doc[b] == d).nonzero().flatten()
                lo, hi = int(idx[0]), int(idx[-1]) + 1  # documents are contiguous
                alone = F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                       v[b:b + 1, :, lo:hi], is_causal=True)
                torch.testing.assert_close(out[b:b + 1, :, lo:hi], alone, rtol=1e-5, atol=1e-5)


def test_no_mask_is_exactly_causal_sdpa():
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    assert torch.equal(kernels.attend(q, k, v, None), F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---------------------------------------------------------------------------------------------
# record #85's DC correction (kernels.dc_attention) against a float64 loop


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
    """Blocks that do not divide T, a window equal to the block, the record's 112 over a block boundary, documents."""
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


# ---------------------------------------------------------------------------------------------
# what the masks let through the whole model

# every layer short or paired: no key offset (record #49's offset crosses documents, as modded-nanogpt's)
NO_OFFSET = dataclasses.replace(TINY, short_window=(0, 1, 2, 3))


def randomized_model(spec, window, seed=0):
    """The spec's GPT (24 positions) with every weight off its init, at windows ``window``."""
    torch.manual_seed(seed)
    model = T.build_model(config(spec, seq_len=24), spec)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.set_window(window, (window[0],))
    return model


def flow_diff(spec, window, inputs, changed):
    """|logits(inputs) - logits(changed)| per latent position, max over batch and vocab: [L]."""
    model = randomized_model(spec, window)
    with torch.no_grad():
        return (model(inputs) - model(changed)).abs().amax(dim=(0, 2))


@pytest.mark.parametrize("s", [1, 3])
def test_doc_mask_blocks_information_from_earlier_documents(s):
    """Change the earlier document's tokens but its last bag's: the later document's logits stay exactly the same
    (smear and the bigram read the previous bag's tokens across a document start, as modded-nanogpt's)."""
    L = 24
    raw = random_tokens((2, L * s), seed=5, p_eot=0.0)
    raw[:, 9 * s + (s - 1) // 2] = EOT  # EOT in the middle of bag 9 (s = 3), or token 9: latent 9 opens document 1
    changed = raw.clone()
    changed[:, :8 * s] = random_tokens((2, 8 * s), seed=6, p_eot=0.0)  # bags 0..7
    inputs, changed = raw.view(2, L, s), changed.view(2, L, s)
    diff = flow_diff(NO_OFFSET, (64, 64), inputs, changed)
    assert diff[:9].min() > 1e-4       # the change does reach its own document ...
    assert diff[9:].max() == 0         # ... and nothing past the boundary
    # TINY's layer 3 offsets its keys: key 9 carries half of key 8 into the queries that weigh it against others
    assert flow_diff(TINY, (64, 64), inputs, changed)[10:].min() > 1e-6


def test_windows_limit_information_flow_to_n_layer_times_window():
    """Token 0 reaches position 1 by smear and the bigram, then 3 more per layer (windows of 3: 4 keys each, FA3's):
    4 layers reach position 1 + 4 x 3 = 13."""
    spec = dataclasses.replace(NO_OFFSET, paired_heads=(), dc=())
    inputs = random_tokens((2, 24, 1), seed=7, p_eot=0.0)
    changed = inputs.clone()
    changed[:, 0] = (inputs[:, 0] + 1) % 1000
    diff = flow_diff(spec, (3, 3), inputs, changed)
    assert diff[:14].min() > 1e-6 and diff[14:].max() == 0


@pytest.mark.parametrize("mode, s", [("full", 3), ("input", 3), ("output", 3), ("full", 1)])
def test_masked_model_trains_one_step_in_both_tst_phases(mode, s):
    cfg = config(TINY, seq_len=24)
    model = randomized_model(TINY, (12, 5))
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    inputs, targets = T.make_batch(random_tokens((2, seq_tokens), seed=8, p_eot=0.05), mode, s)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam, normuon = T.build_optimizers(model, cfg)
    loss = model(inputs, targets) / targets.numel()
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert n == "embed.weight" or (p.grad is not None and torch.isfinite(p.grad).all()), n
    assert model.blocks[0].attn.q.weight.grad.abs().max() > 0
    normuon.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.opt_group == "matrix")
