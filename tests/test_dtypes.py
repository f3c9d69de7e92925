"""The bf16 run's dtypes are modded-nanogpt's (issue 44): no autocast; weights cast per matmul; the residual
stream, x0, q/k/v, the MLP hidden and the head input bf16; float32 only in norm statistics, the loss's logsumexp,
DC's scores and the optimizer state. A float32 run (the CPU default)
casts nothing.

What the backward keeps is measured on the compiled step (inductor's decompositions and its min-cut partitioner,
as on CUDA): eager CPU kernels upcast inside ``rms_norm`` and would count float32 copies a GPU never makes.
"""
import collections

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

import harness as H
import train_gpt as T


def smoke_batch(cfg, seed=0):
    """One cpu_smoke micro-batch of 768 positions with documents and the record's 4 weighted target columns."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50257, (1, cfg.seq_len + 1), generator=g)
    tokens[0, ::97] = T.EOT_TOKEN
    inputs, targets = T.make_batch(tokens, "full", 1)
    columns = T.objective_targets(targets[..., 0], T.prefix_token_table(T.MODELS[cfg.model].vocab_size))
    return inputs, columns, torch.tensor([1.0, 0.5, 0.25, 0.25])


def smoke_model(dtype):
    cfg = H.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])[0]
    torch.manual_seed(0)
    model = T.build_model(cfg, T.MODELS[cfg.model], dtype if dtype == torch.bfloat16 else None)
    if dtype == torch.bfloat16:
        T.adam_bf16_(model)
    model.flex = False
    row = T.Schedule(cfg, T.MODELS[cfg.model])[0]
    model.set_window(row.window, row.yarn)
    return cfg, model


class Enough(Exception):
    """Stops a probe once it has what it measures (the bf16 head and its backward are slow on a CPU)."""


def test_a_bf16_forward_keeps_every_block_output_in_bf16():
    cfg, model = smoke_model(torch.bfloat16)
    dtypes = []

    def record(module, args, out):
        dtypes.append(out.dtype)
        if len(dtypes) == model.spec.n_layer:
            raise Enough
    for block in model.blocks:
        block.register_forward_hook(record)
    with pytest.raises(Enough):
        model(*smoke_batch(cfg))
    assert dtypes == [torch.bfloat16] * model.spec.n_layer


def saved_bytes_by_dtype(model, batch):
    """{dtype: bytes} the compiled forward hands to its backward (the partitioner's saved tensors, weights
    excluded: they are kept whatever the step saves). Compiles the step's graphs; runs none of them."""
    saved = collections.Counter()

    def forward_compiler(gm, example_inputs):
        inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor) and node not in inputs:
                saved[value.dtype] += value.numel() * value.element_size()
        raise Enough  # the partition is known before anything runs

    backend = aot_autograd(fw_compiler=forward_compiler, partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as caught:
            torch.compile(model, backend=backend, dynamic=False, fullgraph=True)(*batch)
        assert saved and "Enough" in repr(caught.value), caught.value  # stopped by the probe, not a failure
    finally:
        torch._dynamo.reset()
    return saved


def test_float32_is_under_a_tenth_of_what_a_bf16_step_saves_for_backward():
    """At cpu_smoke's 768 positions (CUDA autocast gave 27% float32 here: its stream was float32)."""
    cfg, model = smoke_model(torch.bfloat16)
    saved = saved_bytes_by_dtype(model, smoke_batch(cfg))
    total = sum(saved.values())
    assert saved[torch.bfloat16] > 0.8 * total
    assert saved[torch.float32] <= 0.10 * total, {str(k): v for k, v in saved.items()}


def test_runtime_has_no_autocast():
    assert not hasattr(H.Runtime, "autocast")


@pytest.mark.parametrize("layout", ["gx", "xg"])
def test_both_head_gradient_layouts_equal_float64(layout, monkeypatch):
    """The FP8 head's weight gradient as g^T x or (x^T g)^T (emulated FP8, float64 products): the same matrix."""
    import kernels
    monkeypatch.setattr(kernels, "HEAD_GRAD_LAYOUT", layout)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w = (0.05 * torch.randn(80, 32, generator=g, dtype=torch.float64)).requires_grad_()
    gy = torch.randn(48, 80, generator=g, dtype=torch.float64)
    kernels.fp8_linear(x, w, fp8_grad=True, emulate=True).backward(gy)
    x_s, w_s, g_s = (kernels.fp8_scale(t, m) for t, m in ((x, kernels.E4M3_MAX), (w, kernels.E4M3_MAX),
                                                           (gy, kernels.E5M2_MAX)))
    xq = kernels.fp8_quantize(x.detach(), x_s).double() * x_s
    gq = kernels.fp8_quantize(gy, g_s, torch.float8_e5m2).double() * g_s
    torch.testing.assert_close(w.grad, gq.t() @ xq, rtol=1e-12, atol=1e-12)
