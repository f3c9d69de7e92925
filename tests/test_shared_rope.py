"""One RoPE table for the whole model: the layers share it and compute what per-layer tables did."""
import torch

import train_gpt as T
from test_attention import tiny_cfg


def test_model_holds_one_table_that_every_attention_layer_uses():
    cfg = tiny_cfg(n_layer=4, no_attn_layers="2")
    model = T.GPT(cfg)
    layers = [b.attn for b in model.blocks if b.attn is not None]
    assert len(layers) == 3 and all(a.rotary is model.rotary for a in layers)
    names = [n for n, _ in model.named_buffers()]
    # named_buffers lists a tensor once however many modules hold it: per-layer tables would show 3
    assert [n for n in names if n.endswith(("cos", "sin"))] == ["rotary.cos", "rotary.sin"]
    assert model.rotary.cos.shape == (1, cfg.seq_len, 1, cfg.model_dim // cfg.n_head // 2)


def test_shared_table_gives_the_per_layer_tables_result():
    cfg = tiny_cfg(n_layer=3, doc_mask=True, window=5)
    torch.manual_seed(0)
    model = T.GPT(cfg)
    with torch.no_grad():  # every weight off its init (zero-initialized projections included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 1000, (2, cfg.seq_len, 1), generator=g)
    targets = torch.randint(0, 1000, (2, cfg.seq_len, 1), generator=g)
    shared = model(inputs, targets)
    shared.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for block in model.blocks:  # what the model had before: a table built by each layer
        own = T.Rotary(cfg.model_dim // cfg.n_head, cfg.seq_len, cfg.rope_base)
        assert own.cos is not block.attn.rotary.cos and torch.equal(own.cos, block.attn.rotary.cos)
        block.attn.rotary = own
    separate = model(inputs, targets)
    separate.backward()
    assert torch.equal(shared, separate)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_moving_the_model_moves_the_shared_table_once():
    model = T.GPT(tiny_cfg(n_layer=2)).double()
    assert model.rotary.cos.dtype == torch.float64
    assert all(b.attn.rotary.cos is model.rotary.cos for b in model.blocks)
