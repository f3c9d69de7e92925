"""The FLOP count by formula (``matmul_weights``, ``flops_per_position``: ``6 W + 12 d keys`` per latent position,
PaLM's accounting) against what the model does.

The matmul term: torch's ``FlopCounterMode`` over a training forward and backward of the model built on the meta
device (aten.mm and aten.addmm: every weight's product, its input's and its own gradient), for the record, smoke
and tiny specs, on tokens and on TST bags. The attention term: 12 head_dim x heads per (query, key) pair that the
masks the model hands to attention allow (counted from the masks), and per pair of DC's 112-key window, on the CPU
for the tiny and smoke specs and the record's roles at a small width, over windows and sequence lengths.
"""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import train_gpt as T
from model_reference import TINY, config

# the record's layer roles (no attention in layer 6, paired 0, 2, 5, 9, DC 10, ...) at 96 wide, 6 heads of 16
RECORD_ROLES = dataclasses.replace(T.MODELS["record"], model_dim=96, bigram_vocab=1024, vocab_size=1024,
                                   window_block=8)


def spec_named(name):
    return TINY if name == "tiny" else T.MODELS[name]


@pytest.mark.parametrize("name", ["record", "smoke", "tiny"])
@pytest.mark.parametrize("L, bag, blocks, tied", [(256, 1, (3, 1), True), (520, 1, (13, 6), False),
                                                  (130, 4, (7, 3), True)], ids=["tied", "untied", "bags"])
def test_matmul_flops_are_six_matmul_weights_per_position(name, L, bag, blocks, tied):
    spec = spec_named(name)
    with torch.device("meta"):
        model = T.build_model(config(spec, seq_len=L), spec)
        inputs = torch.zeros(1, L, bag, dtype=torch.int64)
        targets = torch.zeros(1, L, 4 if bag == 1 else bag, dtype=torch.int64)
    model.tied = tied
    model.set_window((blocks[0] * spec.window_block, blocks[1] * spec.window_block), (blocks[0] * spec.window_block,))
    weights = [torch.ones(4, device="meta")] if bag == 1 else []  # phase 2's 4 columns; phase 1's MCE
    with FlopCounterMode(display=False) as counter:
        model(inputs, targets, *weights).backward()
    counts = counter.get_flop_counts()["Global"]
    matmul = counts.get(torch.ops.aten.mm, 0) + counts.get(torch.ops.aten.addmm, 0)
    assert matmul == 6 * T.matmul_weights(spec) * L


def dc_pairs(L, window):
    """(query, key) pairs of DC in one document of L positions: 0 <= t - s < window (record #85's kernel)."""
    return sum(1 for t in range(L) for s in range(L) if 0 <= t - s < window)


@pytest.mark.parametrize("spec", [TINY, T.MODELS["smoke"], RECORD_ROLES], ids=["tiny", "smoke", "record_roles"])
@pytest.mark.parametrize("L, window", [(40, (24, 8)), (130, (52, 13)), (130, (300, 200))])
def test_attention_flops_count_the_pairs_the_masks_allow(spec, L, window, monkeypatch):
    """One document (the formula does not count document masks): every call's allowed (query, key) pairs from its
    mask, 12 head_dim flops per pair and head (QK^T and AV, forward and backward); a paired layer's H/2 heads over
    its doubled sequence come as they are called."""
    torch.manual_seed(0)
    model = T.build_model(config(spec, seq_len=L), spec)
    model.set_window(window, (window[0],))
    flops, attend, dc = [], T.attend, T.dc_attention

    def counting_attend(q, k, v, mask, scale, backend):  # q [B, heads, positions, head_dim]; mask bool [B, 1, T, T]
        flops.append(12 * q.size(-1) * q.size(1) * int(mask.sum()))
        return attend(q, k, v, mask, scale, backend)

    def counting_dc(q, k, v, w1, w2, docs, scale, window):  # q [B, T, H, D]
        B, T_, H, D = q.shape
        flops.append(12 * D * H * B * dc_pairs(T_, window))
        return dc(q, k, v, w1, w2, docs, scale, window)

    monkeypatch.setattr(T, "attend", counting_attend)
    monkeypatch.setattr(T, "dc_attention", counting_dc)
    inputs = torch.randint(0, 1000, (1, L, 1), generator=torch.Generator().manual_seed(L))  # no EOT
    model.flex = False
    with torch.no_grad():
        model(inputs)
    n_attn = spec.n_layer - len(spec.no_attn)
    assert len(flops) == n_attn + len(spec.dc)
    formula = T.flops_per_position(spec, window, L)
    assert formula == pytest.approx(6 * T.matmul_weights(spec) + sum(flops) / L, rel=1e-12, abs=0)
