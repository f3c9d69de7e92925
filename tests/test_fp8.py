"""FP8 matmuls (``fp8_linear``): scaling, saturation and rounding against float64 references.

The references are independent of the code under test: rounding to the nearest value of a
table of every finite float8 value (ties to the even code), and products in float64 of the
dequantized operands. ``emulate=True`` runs the op's own scaling and rounding on CPU with the
products in float64; the CUDA path (``torch._scaled_mm``) is traced on the meta device, which
checks its shapes, dtypes and layouts.
"""
import os
import sys

import pytest
import torch
from conftest import REPO

import harness
import kernels
import train_gpt as T
from model_reference import TINY, config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_table(dtype):
    """float64 values and uint8 codes of every finite value of an fp8 format, sorted by value."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).double()
    keep = values.isfinite()
    values, codes = values[keep], codes[keep]
    order = values.argsort()
    return values[order], codes[order]


def nearest_fp8(x, dtype):
    """x (float64) saturated to the format's max, rounded to the nearest fp8 value, ties to the even code."""
    values, codes = fp8_table(dtype)
    x = x.clamp(values.min(), values.max())
    dist = (x.reshape(-1, 1) - values).abs()
    best = dist.min(dim=1, keepdim=True).values
    tie_break = (codes.long() % 2).double()  # among equally near values, the odd code loses
    candidates = torch.where(dist == best, tie_break, torch.inf)
    return values[candidates.argmin(dim=1)].reshape(x.shape)


def dequant(t, scale):
    return t.double() * float(scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounds_to_nearest_and_saturates(dtype):
    g = torch.Generator().manual_seed(0)
    limit = torch.finfo(dtype).max
    x = torch.randn(4000, generator=g, dtype=torch.float64) * torch.logspace(-6, 0, 4000, dtype=torch.float64)
    x = torch.cat([x * 3 * limit, torch.tensor([limit, -limit, 1.5 * limit, -7 * limit, 0.0], dtype=torch.float64)])
    scale = torch.tensor(2.5)
    got = kernels.fp8_quantize(x, scale, dtype)
    assert got.dtype == dtype and got.double().isfinite().all()
    assert torch.equal(got.double(), nearest_fp8(x / 2.5, dtype))
    assert got.double().abs().max() == limit          # beyond the max saturates, never NaN or inf
    assert (got.double().abs() == limit).sum() > 3


def test_the_table_reference_rounds_ties_to_even():
    # 1.0625 lies halfway between 1.0 (code 0x38) and 1.125 (0x39) in e4m3: the even code wins
    assert nearest_fp8(torch.tensor([1.0625, 1.1875], dtype=torch.float64), E4M3).tolist() == [1.0, 1.25]


def test_scale_maps_amax_to_448_exactly():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 7
    s = kernels.fp8_scale(x)
    assert s.dtype == torch.float32 and s.ndim == 0
    assert float(s) == pytest.approx(float(x.abs().max()) / 448, rel=1e-6)
    q = kernels.fp8_quantize(x, s)
    assert q.double().abs().max() == 448                # the largest entry lands on (or saturates to) 448
    assert float(kernels.fp8_scale(x, kernels.E5M2_MAX)) == pytest.approx(float(x.abs().max()) / 57344, rel=1e-6)
    assert float(kernels.fp8_scale(torch.zeros(4, 4))) > 0    # an all-zero tensor does not divide by zero


def operands(M=48, K=64, N=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, K, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    G = torch.randn(M, N, generator=g, dtype=torch.float64) * torch.logspace(-5, -1, N, dtype=torch.float64)
    return x, w, G


def reference(x, w, G):
    """Forward and fp8-gradient backward from torch's conversion at the documented scales, float64 products."""
    x_s, w_s = x.abs().max().float() / 448, w.abs().max().float() / 448
    g_s = G.abs().max().float() / 57344
    xq = dequant((x / x_s).clamp(-448, 448).to(E4M3), x_s)
    wq = dequant((w / w_s).clamp(-448, 448).to(E4M3), w_s)
    gq = dequant((G / g_s).clamp(-57344, 57344).to(E5M2), g_s)
    return xq @ wq.t(), gq @ wq, gq.t() @ xq


@pytest.mark.parametrize("seed", range(3))
def test_emulated_forward_and_fp8_backward_equal_the_float64_reference(seed):
    x, w, G = operands(seed=seed)
    x, w = x.requires_grad_(), w.requires_grad_()
    y = kernels.fp8_linear(x.view(4, 12, 64), w, fp8_grad=True, emulate=True)
    assert y.shape == (4, 12, 32) and y.dtype == torch.float64
    (y.reshape(48, 32) * G).sum().backward()
    y_ref, dx_ref, dw_ref = reference(x.detach(), w.detach(), G)
    torch.testing.assert_close(y.reshape(48, 32), y_ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(w.grad, dw_ref, rtol=1e-12, atol=1e-18)
    # and close to the exact product: a scale applied twice or not at all is off by orders of magnitude
    exact = x.detach() @ w.detach().t()
    assert (y.reshape(48, 32) - exact).norm() / exact.norm() < 0.05
    assert (x.grad - G @ w.detach()).norm() / (G @ w.detach()).norm() < 0.1
    assert (w.grad - G.t() @ x.detach()).norm() / (G.t() @ x.detach()).norm() < 0.1


def test_fp8_weights_and_inputs_saturate_not_overflow_in_the_op():
    # one huge entry sets the scale; the rest quantize relative to it, none becomes NaN
    x, w, _ = operands()
    x[3, 5] = 1e6
    y = kernels.fp8_linear(x, w, emulate=True)
    assert y.isfinite().all()
    torch.testing.assert_close(y, reference(x, w, torch.ones(48, 32))[0], rtol=1e-12, atol=1e-15)


def test_mlp_style_backward_is_exact_high_precision():
    """Without fp8_grad (the MLP, records #84/#89) the gradients are those of x @ w.T, unquantized."""
    x, w, G = operands(seed=5)
    x, w = x.requires_grad_(), w.requires_grad_()
    (kernels.fp8_linear(x, w, emulate=True) * G).sum().backward()
    torch.testing.assert_close(x.grad, G @ w.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(w.grad, G.t() @ x.detach(), rtol=1e-12, atol=0)


def test_cuda_path_traces_on_the_meta_device():
    """The _scaled_mm calls (row-major a, column-major b, float32 0-d scales) pass torch's shape checks."""
    x = torch.empty(64, 48, device="meta", requires_grad=True)
    w = torch.empty(80, 48, device="meta", requires_grad=True)
    for fp8_grad in (True, False):
        y = kernels.fp8_linear(x, w, fp8_grad=fp8_grad)
        assert y.shape == (64, 80) and y.dtype == torch.bfloat16
        dx, dw = torch.autograd.grad(y.float().sum(), (x, w))
        assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == dw.dtype == torch.float32


def test_availability_and_shapes():
    assert "CUDA" in kernels.fp8_unavailable_reason("cpu")
    assert kernels.fp8_fits(torch.empty(2, 8, 32), torch.empty(48, 32))
    assert not kernels.fp8_fits(torch.empty(3, 5, 32), torch.empty(48, 32))   # 15 rows
    assert not kernels.fp8_fits(torch.empty(2, 8, 32), torch.empty(50, 32))   # 50 outputs


def test_flag_is_the_records_and_leaves_the_cpu_model_unchanged():
    assert T.Config().fp8 is True  # record #89's head and MLP in FP8; the CPU presets turn it off
    assert harness.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])[0].fp8 is False
    torch.manual_seed(0)
    plain = T.build_model(config(TINY, fp8=False), TINY)
    torch.manual_seed(0)
    fp8 = T.build_model(config(TINY, fp8=True), TINY)
    assert fp8.head_scales is not None and all(b.mlp.down_scales is not None for b in fp8.blocks)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        fp8.load_state_dict(plain.state_dict(), strict=False)  # its FP8 scales stay
    plain.set_window((12, 5), ())
    fp8.set_window((12, 5), ())
    inputs = torch.randint(0, 1000, (2, 16, 1))
    assert torch.equal(plain(inputs, inputs), fp8(inputs, inputs))  # CPU: fp8 only on CUDA


@pytest.mark.parametrize("fp8_grad", [True, False])
def test_scaled_mm_path_equals_the_emulation_to_bf16_rounding(fp8_grad):
    """The non-emulated path (torch._scaled_mm, which this CPU build also runs) against emulate=True.

    The output gradient is bf16-representable so both paths quantize the same numbers; the
    scaled_mm path rounds y and dx to bf16 (1 ulp = 2^-8 relative), dW stays float32. Without
    fp8_grad the CUDA path's backward is bf16: its reference is the product of the bf16-rounded
    operands.
    """
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 64, generator=g).requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.1).requires_grad_()
    G = torch.randn(32, 48, generator=g).bfloat16().float()
    y, y_emu = kernels.fp8_linear(x, w, fp8_grad=fp8_grad), kernels.fp8_linear(x, w, fp8_grad=fp8_grad, emulate=True)
    assert y.dtype == torch.bfloat16 and y_emu.dtype == torch.float32
    dx, dw = torch.autograd.grad((y.float() * G).sum(), (x, w))
    dx_emu, dw_emu = torch.autograd.grad((y_emu * G).sum(), (x, w))
    bf16 = dict(rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(y.float(), y_emu, **bf16)
    if fp8_grad:
        torch.testing.assert_close(dx, dx_emu, **bf16)
        torch.testing.assert_close(dw, dw_emu, rtol=1e-5, atol=1e-6)
    else:
        rounded = [t.detach().bfloat16().float() for t in (x, w)]
        torch.testing.assert_close(dx, G @ rounded[1], **bf16)
        torch.testing.assert_close(dw, G.t() @ rounded[0], **bf16)


# bench/gpu_kernels.fp8_check: the GPU box's kernel check, run here through the emulation path

def _fp8_check(**kw):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import gpu_kernels
    return gpu_kernels.fp8_check(T, torch.device("cpu"), shapes=(64, 32, 128, 256), **kw)


def test_the_gpu_kernel_check_passes_through_the_emulation_path():
    c = _fp8_check()
    assert c["passed"] and c["emulated"]
    mm = {k: v for k, v in c["diffs"].items() if "_mm" in k}
    assert len(mm) == 5  # the head: forward, dx, dW in fp8; the MLP: the forward
    assert max(mm.values()) < 1e-6  # float32 products of the same fp8 operands
    assert 5e-3 < max(v for k, v in c["diffs"].items() if k.endswith("_out")) < 0.1  # e4m3 rounding, not zero


@pytest.mark.parametrize("bug", ["dropped", "doubled", "doubled_in_quantize"])
def test_the_gpu_kernel_check_fails_a_dropped_or_doubled_scale(monkeypatch, bug):
    real_mm, real_q = kernels.fp8_mm, kernels.fp8_quantize
    if bug == "dropped":  # the product ignores the scale it is given
        monkeypatch.setattr(kernels, "fp8_mm", lambda a, s, b, t, *r, **k: real_mm(a, torch.ones_like(s), b, t, *r, **k))
    elif bug == "doubled":  # the product uses twice the scale it is given
        monkeypatch.setattr(kernels, "fp8_mm", lambda a, s, b, t, *r, **k: real_mm(a, 2 * s, b, t, *r, **k))
    else:  # operands quantized at twice the scale the product is given (halves every result)
        monkeypatch.setattr(kernels, "fp8_quantize", lambda t, s, *r: real_q(t, 2 * s, *r))
    c = _fp8_check()
    assert not c["passed"]
    assert max(v for k, v in c["diffs"].items() if k.endswith("_out")) > 0.4


# modded-nanogpt's (record #89) fixed head scales and delayed MLP down-projection scales (issue 36)

def fixed_reference(x, w, G, x_s, w_s, g_s):
    """The head at given scales: e4m3 of x / x_s and w / w_s, e5m2 of G / g_s (saturated), float64 products."""
    xq = dequant(nearest_fp8(x / x_s, E4M3), x_s)
    wq = dequant(nearest_fp8(w / w_s, E4M3), w_s)
    gq = dequant(nearest_fp8(G / g_s, E5M2), g_s)
    return xq @ wq.t(), gq @ wq, gq.t() @ xq


def head_operands(seed):
    """Inputs, weights and gradients from fp8's subnormals to past its saturation at the record's scales, so that
    a scale off by 2x shows (within the normal range a power of 2 only shifts the exponent)."""
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(48, 64, generator=g, dtype=torch.float64) * torch.logspace(-4, 2.3, 64, dtype=torch.float64)
    w = torch.randn(32, 64, generator=g, dtype=torch.float64) * torch.logspace(-6, 0.5, 64, dtype=torch.float64)
    G = torch.randn(48, 32, generator=g, dtype=torch.float64) * torch.logspace(-10, 1.5, 32, dtype=torch.float64)
    return x, w, G


@pytest.mark.parametrize("seed", range(2))
def test_head_uses_the_records_fixed_scales_and_a_dropped_or_doubled_scale_fails(seed):
    x, w, G = head_operands(seed)
    scales = torch.tensor(kernels.HEAD_SCALES)
    scales[2] /= 8  # the record's grad_s x the loss factor 1/8 (grad_divisor of the GPU presets)
    assert scales.tolist() == pytest.approx([100 / 448, 1.6 / 448, 0.75 / 448 / 8], rel=1e-7)
    x, w = x.requires_grad_(), w.requires_grad_()
    y = kernels.fp8_linear(x, w, fp8_grad=True, emulate=True, scales=scales)
    (y * G).sum().backward()
    got = (y.detach(), x.grad, w.grad)
    s = [float(v) for v in scales]
    for a, b in zip(got, fixed_reference(x.detach(), w.detach(), G, *s)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-18)
    for i in range(3):  # each scale dropped (1) or doubled: a reference the op does not match
        for wrong in (1.0, 2 * s[i]):
            bad = fixed_reference(x.detach(), w.detach(), G, *[wrong if j == i else v for j, v in enumerate(s)])
            assert any((a - b).abs().max() > 1e-6 * b.abs().max() for a, b in zip(got, bad)), (i, wrong)


def test_current_scales_stay_the_default():
    x, w, G = head_operands(0)
    y = kernels.fp8_linear(x, w, fp8_grad=True, emulate=True)
    torch.testing.assert_close(y, reference(x, w, G)[0], rtol=1e-12, atol=1e-15)


def down_projection(h, w, scales):
    """What MLP.forward does with the record's delayed scales: the product at the state's scales, then the next
    input scale."""
    y = kernels.fp8_linear(h, w, emulate=True, scales=scales[:2])
    kernels.delay_input_scale_(scales, h)
    return y


def test_down_projection_uses_the_previous_forwards_amax_and_the_weights_delayed_scale():
    """Over 20 optimizer steps of 2 forwards each: the input scale is the previous forward's amax x 1.80 / 448 (1 at
    the first), the weight's its amax x 1 / 448 after each of the first 16 steps (and at init), then the amax
    before the last step x 1.12 / 448; each forward equals the float64 product at those scales."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g, dtype=torch.float64) * 0.02
    state = kernels.down_scales()
    kernels.refresh_down_scales_(state, w, bootstrap=True)  # at init
    prev_act, prev_w, used_w = None, w.clone(), w.abs().max() / 448
    for step in range(20):
        for micro in range(2):
            h = torch.relu(torch.randn(32, 64, generator=g, dtype=torch.float64)).square() * (1 + step)
            act = 1.0 if prev_act is None else float(prev_act * 1.80 / 448)
            y = down_projection(h, w, state)
            assert float(state[0]) == pytest.approx(float(h.max()) * 1.80 / 448, rel=1e-6)
            ref = dequant(nearest_fp8(h / act, E4M3), act) @ dequant(nearest_fp8(w / used_w.float(), E4M3),
                                                                    used_w.float()).t()
            assert float(state[1]) == pytest.approx(float(used_w), rel=1e-6)
            torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-9)
            prev_act = h.max()
        w = w + torch.randn(16, 64, generator=g, dtype=torch.float64) * 0.01   # the optimizer step
        kernels.refresh_down_scales_(state, w, bootstrap=step < kernels.DOWN_BOOTSTRAP_STEPS)
        used_w = w.abs().max() / 448 if step < 16 else prev_w.abs().max() * 1.12 / 448
        prev_w = w.clone()
    assert float(state[1]) == pytest.approx(float(used_w), rel=1e-6)


def test_delayed_scales_are_model_state_that_a_checkpoint_restores_bit_for_bit():
    cfg = config(TINY, fp8=True)
    a, b = T.build_model(cfg, TINY), T.build_model(cfg, TINY)
    keys = [k for k in a.state_dict() if k.endswith("down_scales")]
    assert len(keys) == TINY.n_layer and a.head_scales.tolist() == pytest.approx(list(kernels.HEAD_SCALES))
    for block in a.blocks:
        block.mlp.down_scales.copy_(torch.rand(3, dtype=torch.float32) / 448)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in keys)
    a.set_loss_divisor(8)
    assert float(a.head_scales[2]) == pytest.approx(0.75 / 448 / 8, rel=1e-7)


def test_restore_gives_each_rank_its_own_delayed_scales_and_tolerates_a_resume_across_fp8():
    """harness.restore: a checkpoint's ``rank_buffers`` (every rank's down_scales, all-gathered at save) go back to
    their rank; --fp8 may differ on resume (a CPU turns it off): a checkpoint without them leaves the model's own
    (bootstrapped by build_run), a model without them ignores the checkpoint's."""
    import types
    model, plain = T.build_model(config(TINY, fp8=True), TINY), T.build_model(config(TINY, fp8=False), TINY)
    keys = [k for k in model.state_dict() if k.endswith("down_scales")]
    per_rank = [{k: torch.full((3,), float(r + 2)) for k in keys} for r in range(2)]  # neither the init (1)
    state = dict(model={k: v.clone() for k, v in model.state_dict().items()}, optimizers=[], loader_position=7,
                 rng=dict(torch=torch.get_rng_state(), cuda=[]), step=3, rank_buffers=per_rank)
    loader = types.SimpleNamespace(position=None)
    for rank in (1, 0):
        rt = harness.Runtime(rank=rank, world=2, device=torch.device("cpu"), compile=False)
        assert harness.restore(state, model, [], loader, rt) == 3 and loader.position == 7
        assert all(torch.equal(model.state_dict()[k], per_rank[rank][k]) for k in keys)
    own = {k: model.state_dict()[k].clone() for k in keys}
    bare = dict(state, model={k: v.clone() for k, v in plain.state_dict().items()}, rank_buffers=[{}])
    harness.restore(bare, model, [], loader, rt)
    assert all(torch.equal(model.state_dict()[k], own[k]) for k in keys)
    harness.restore(state, plain, [], loader, rt)  # the fp8 checkpoint into a model without FP8
    assert all(torch.equal(v, state["model"][k]) for k, v in plain.state_dict().items())
    assert not all(torch.equal(v, bare["model"][k]) for k, v in plain.state_dict().items())  # they did change


def test_the_fp8_matmul_is_a_custom_op_whose_fake_kernel_agrees_with_it():
    """torch.library's opcheck of the fake kernel against the real one on this CPU (its schema check multiplies
    float8 tensors, which the CPU cannot); the meta device traces through the fake kernel."""
    a = kernels.fp8_quantize(torch.randn(32, 48), torch.tensor(0.01))
    b = kernels.fp8_quantize(torch.randn(16, 48), torch.tensor(0.02))
    torch.library.opcheck(kernels.scaled_mm, (a, b, torch.tensor(0.01), torch.tensor(0.02), torch.bfloat16, True),
                          test_utils=("test_faketensor",))
    with torch.device("meta"):
        y = kernels.scaled_mm(torch.empty(32, 48, dtype=torch.float8_e4m3fn),
                              torch.empty(16, 48, dtype=torch.float8_e4m3fn), torch.ones(()), torch.ones(()),
                              torch.float32, False)
    assert y.shape == (32, 16) and y.dtype == torch.float32


def test_a_compiled_fp8_linear_calls_the_op_three_times_and_leaves_inductor_no_scaled_mm_to_lower():
    """Compiled, the forward holds one call of ``train_gpt::scaled_mm`` and the backward two (dx, dW), as extern
    calls; aten's ``_scaled_mm``, which inductor lowers to its autotuned templates, is nowhere in the graphs."""
    from torch._inductor.utils import run_and_get_code
    x = torch.randn(64, 48, requires_grad=True)
    w = torch.randn(80, 48, requires_grad=True)
    fn = torch.compile(lambda x, w: kernels.fp8_linear(x, w, fp8_grad=True).float().sum(), dynamic=False)
    _, (forward, backward) = run_and_get_code(lambda: fn(x, w).backward())
    call = "torch.ops.train_gpt.scaled_mm.default("
    assert forward.count(call) == 1 and backward.count(call) == 2
    for code in (forward, backward):
        assert "aten._scaled_mm" not in code and "extern_kernels._scaled_mm" not in code
    # the same op, the same bits: compare the matmul's output (the graph's sum reduces in its own order)
    y = torch.compile(lambda x, w: kernels.fp8_linear(x, w, fp8_grad=True), dynamic=False)(x, w)
    assert torch.equal(y, kernels.fp8_linear(x, w, fp8_grad=True))
