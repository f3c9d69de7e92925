"""In-process kernel checks and the one-step time breakdown of ``bench/gpu_check.py``.

Each check compares the trainer's own function (``train_gpt``) on random inputs with a slow,
obviously-right reference, at tolerances that a window off by one fails (tests/test_gpu_check.py
injects one):

* ``attention_check``: FlexAttention under ``block_mask_from_bounds`` (compiled on CUDA) vs SDPA
  under the materialized ``attention_mask``, of the sequence and of the doubled sequence of
  paired-head layers, forward and (CUDA) gradients, float32.
* ``fp8_check``: ``kernels.fp8_linear`` forward and backward, each fp8 product vs its float64 emulation
  with the scales the op chose, and the results vs the unquantized float64 products (record shapes on CUDA);
  ``fp8_head_fixed_check``, ``fp8_down_delayed_check``: the same at the scales the FP8 presets give the op (the
  head's fixed ones, the down-projection's delayed ones), which must be record #89's to float32 rounding.
* ``head_grad_layout_check`` (CUDA): the FP8 head's forward and backward timed under each weight-gradient layout
  (``kernels.HEAD_GRAD_LAYOUT``), the faster named; the two dW must agree.
* ``loss_check``: the trainer's ``loss_sum`` (record #54's sigmoid cap, weighted targets, several chunks) vs a
  float64 log-softmax reference, value and gradient.
* ``model_checks``: the check model (the smoke model: every layer role of record #89's) on a TST phase-1 and a
  phase-2 batch at their stage-table windows and YaRN tables, float32: FlexAttention vs masked SDPA (compiled on
  CUDA: loss and every gradient; eager forward on CPU: the logits) and, on CUDA, compiled vs eager (loss and every
  gradient).
* ``attention_backend_check`` (CUDA): ``kernels.attend`` under a FlexAttention block mask compiled with each of
  FlexAttention's backends (TRITON; FLASH, FlashAttention-4, where ``kernels.flash_unavailable_reason`` allows), bf16 at
  the record's shapes: forward and forward + backward ms, and the max difference against float32 masked SDPA; a
  backend that raises is a row saying ``refused: ...``.
* ``profile_step``: one training step (bf16 and FP8 as the trainer runs them on CUDA, no autocast) under
  ``torch.profiler`` split into attention, mask build, MLP, head + loss (forward), backward, optimizer,
  communication; ``max_memory_reserved``.
"""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


def _max_rel(a, b):
    """max |a - b| / (max |b| + 1e-12), both cast to float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def random_documents(gen, batch, length, n_docs, device):
    """int64 ``[batch, length]`` non-decreasing document ids, ``n_docs`` random cut points a row."""
    cuts = torch.randint(1, length, (batch, n_docs), generator=gen)
    pos = torch.arange(length)
    return (pos[None, None, :] >= cuts[:, :, None]).sum(1).to(device)


def attention_cases(gen, length, window, device):
    """``attention_check``'s cases, each over ``length`` positions (one compiled shape on CUDA):
    name -> (doc_ids int64 [2, length or length / 2], window, paired).

    ``short``: three random documents a row under ``window`` (partial blocks: the window and the
    documents bind inside blocks); ``paired``: the doubled sequence of paired-head layers (record #58)
    of half as many tokens; ``long``: a first document longer than a window of ``length - 64``, so
    the second block attends the first as a full block (no mask_mod) and the window binds further on.
    """
    cut = torch.randint(length - 32, length, (2, 1), generator=gen)
    long_ids = (torch.arange(length)[None, :] >= cut).long().to(device)
    return {"short": (random_documents(gen, 2, length, 3, device), window, False),
            "paired": (random_documents(gen, 2, length // 2, 3, device), window, True),
            "long": (long_ids, length - 64, False)}


def attention_check(T, device, length=384, window=48, tol=1e-4, seed=0):
    """FlexAttention (block mask from bounds) vs masked SDPA on the same float32 q, k, v, in each of
    ``attention_cases``: windows in partial blocks, the doubled sequence of paired-head layers, full blocks.

    Args:
        T: the trainer module (``train_gpt``); the masks are kernels.py's ``block_mask_from_bounds``,
            ``attention_mask``.
        device: torch.device; on CUDA FlexAttention is compiled and gradients are compared too,
            on CPU the forward only (FlexAttention has no CPU backward).
        length: positions T of every case (3 blocks of 128 by default; >= 256 for a full block).
        window: the short and paired cases' window, not a multiple of the block so partial blocks bind.
        tol: largest relative difference allowed (float32 kernels agree to ~1e-6; a window
            off by one moves outputs by ~1e-1).
        seed: random inputs' seed.

    Returns:
        dict: passed, tol, max_rel_diff, diffs: per case its output's (``short_out``, ...) and on
        CUDA its gradients' (``short_dq``, ...) max relative differences.
    """
    import kernels  # the masks, beside the trainer (the repository root is on sys.path)
    gen = torch.Generator().manual_seed(seed)
    H, D = 2, 32
    cuda = device.type == "cuda"
    flex = torch.compile(_flex(), dynamic=False) if cuda else _flex()
    diffs = {}
    for case, (ids, w, paired) in attention_cases(gen, length, window, device).items():
        q, k, v = (torch.randn(2, H, length, D, generator=gen).to(device).requires_grad_(cuda) for _ in range(3))
        with (contextlib.nullcontext() if cuda else torch.no_grad()):
            out = flex(q, k, v, block_mask=kernels.block_mask_from_bounds(ids, torch.tensor(w, device=device), paired=paired))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=kernels.attention_mask(ids, w, paired)[:, None])
        diffs[f"{case}_out"] = _max_rel(out.detach(), ref.detach())
        if cuda:
            g = torch.randn_like(ref)
            got = torch.autograd.grad(out, (q, k, v), g)
            want = torch.autograd.grad(ref, (q, k, v), g)
            diffs.update({f"{case}_d{x}": _max_rel(a, b) for x, a, b in zip("qkv", got, want)})
    worst = max(diffs.values())
    return dict(name="flex_vs_sdpa", passed=worst <= tol, tol=tol, max_rel_diff=worst, diffs=diffs,
                heads=H, head_dim=D, length=length, window=window, grad=cuda)


# FP8 (kernels.fp8_linear): each product the op computes vs the float64 product of the same fp8 operands
# times the scales it passed (bf16 output: 2^-9 per element; fast accumulation), and the op's output and
# gradients vs the float64 product of the unquantized operands (e4m3 rounds by up to 2^-4, e5m2 2^-3, per
# element; measured on CPU: 2-6%). A dropped scale is off by the scale itself, a doubled one by 100%.
FP8_KERNEL_TOL = 2e-2
FP8_VALUE_TOL = 0.25
# The scales the presets give the op (fixed head, delayed down-projection) vs the same rule computed here in float64:
# float32 rounding is 2^-24 relative; a doubled or dropped (1) scale is 50% or more off.
FP8_SCALE_TOL = 1e-5
E4M3 = 448.0  # e4m3's largest value
# The check's own copy of modded-nanogpt record #89's FP8 rules (2026-07-17): the reference must not be the value
# under test (kernels.HEAD_SCALES, kernels.DOWN_*_HEADROOM). Head: CastedLinearT(x_s=100/448, w_s=1.6/448,
# grad_s=0.75/448); down-projection: input at the previous forward's amax x 1.80, weight at its amax before the
# last optimizer step x 1.12.
RECORD89_HEAD_SCALES = (100 / E4M3, 1.6 / E4M3, 0.75 / E4M3)
RECORD89_DOWN_HEADROOM = (1.80, 1.12)


def _frob_rel(a, b):
    """||a - b|| / ||b||, float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fp8_cases(gen, shapes):
    """``{name: (x [M, K], w [N, K], g [M, N], fp8_grad)}`` float32 on ``gen``'s device at ``shapes`` = (positions,
    model_dim, hidden, vocab): the LM head (unit-scale normed input, its softmax-minus-onehot gradient over the
    positions), the MLP's input and output projections (relu^2 activations), at magnitudes like a trained model's."""
    M, d, h, V = shapes
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device)  # noqa: E731
    x, w_head = randn(M, d), 0.05 * randn(V, d)
    g_head = torch.softmax(x @ w_head.t(), dim=-1)
    g_head[torch.arange(M), torch.randint(0, V, (M,), generator=gen, device=gen.device)] -= 1
    w_fc = randn(h, d) / d ** 0.5
    return {"fp8_head": (x, w_head, g_head / M, True),
            "fp8_mlp_fc": (x, w_fc, 1e-3 * randn(M, h), False),
            "fp8_mlp_proj": (torch.relu(x @ w_fc.t()).square(), 0.5 * randn(d, h) / h ** 0.5, 1e-3 * randn(M, d),
                             False)}


def _fp8_run(x, w, g, fp8_grad, emulate, scales=None):
    """``kernels.fp8_linear(x, w)`` forward and backward (output gradient ``g``), each ``kernels.fp8_mm`` call kept.

    Returns:
        ``(y, dx, dw, calls)``: calls ``[(a, a_scale, b, b_scale, out)]``, the fp8 operands and a copy of the scales
        the op passed (a delayed scale is rewritten in place after the forward).
    """
    import kernels
    calls, real_mm = [], kernels.fp8_mm

    def spy(a, a_scale, b, b_scale, *args, **kw):
        out = real_mm(a, a_scale, b, b_scale, *args, **kw)
        calls.append((a, a_scale.detach().clone(), b, b_scale.detach().clone(), out))
        return out
    kernels.fp8_mm = spy
    try:
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y = kernels.fp8_linear(x, w, fp8_grad=fp8_grad, emulate=emulate, scales=scales)
        dx, dw = torch.autograd.grad(y, (x, w), g)
    finally:
        kernels.fp8_mm = real_mm
    return y.detach(), dx, dw, calls


def _fp8_diffs(name, x, w, g, run):
    """``_fp8_run``'s ``run`` of ``x``, ``w``, ``g``: each product vs the float64 product of its fp8 operands times its
    scales (``<name>_mm<i>``), the output and gradients vs the float64 products of the unquantized operands (``_out``,
    ``_dx``, ``_dw``)."""
    y, dx, dw, calls = run
    diffs = {f"{name}_mm{i}": _frob_rel(out, (a.double() * a_s.double()) @ (b.double() * b_s.double()).t())
             for i, (a, a_s, b, b_s, out) in enumerate(calls)}
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    diffs.update({f"{name}_out": _frob_rel(y, x64 @ w64.t()), f"{name}_dx": _frob_rel(dx, g64 @ w64),
                  f"{name}_dw": _frob_rel(dw, g64.t() @ x64)})
    return diffs


def fp8_reference(x, w, g, scales, fp8_grad):
    """float64 ``(y, dx, dw)`` of ``fp8_linear`` at given ``scales`` (x, w[, grad]): x and w in e4m3 at ``scales[0]``,
    ``scales[1]`` (saturated, nearest); with ``fp8_grad`` (the head) g in e5m2 at ``scales[2]`` and both gradients from
    the fp8 copies, else (the MLP's bf16 backward) the gradients of the unquantized operands."""
    def dequant(t, s, dtype=torch.float8_e4m3fn):
        limit = torch.finfo(dtype).max
        return (t.double() / s).clamp(-limit, limit).float().to(dtype).double() * s
    xq, wq = dequant(x, scales[0]), dequant(w, scales[1])
    if not fp8_grad:
        g64 = g.double()
        return xq @ wq.t(), g64 @ w.detach().double(), g64.t() @ x.detach().double()
    gq = dequant(g, scales[2], torch.float8_e5m2)
    return xq @ wq.t(), gq @ wq, gq.t() @ xq


def _given_scale_diffs(name, x, w, g, run, want, fp8_grad):
    """The checks of an op given its scales (fixed or delayed) against the scales ``want`` (floats, computed here):
    ``<name>_scale``, each scale a product used vs the nearest of ``want`` (relative; a doubled or dropped one is 50%
    or more away), and ``_ref_out``, ``_ref_dx``, ``_ref_dw``, the op vs ``fp8_reference`` at ``want``."""
    used = [float(s) for _, a_s, _, b_s, _ in run[3] for s in (a_s, b_s)]
    diffs = {f"{name}_scale": max((min(abs(u / v - 1) for v in want) for u in used), default=float("inf"))}
    for part, got, ref in zip(("out", "dx", "dw"), run[:3], fp8_reference(x, w, g, want, fp8_grad)):
        diffs[f"{name}_ref_{part}"] = _frob_rel(got, ref)
    return diffs


def _fp8_result(name, diffs, **info):
    """A check's dict from its diffs: products and references within ``FP8_KERNEL_TOL``, scales within
    ``FP8_SCALE_TOL``, results vs the unquantized products within ``FP8_VALUE_TOL``."""
    kind = lambda k: ("kernel" if "_mm" in k or "_ref_" in k else "scale" if k.endswith("_scale")  # noqa: E731
                      else "value")
    tols = dict(kernel=FP8_KERNEL_TOL, scale=FP8_SCALE_TOL, value=FP8_VALUE_TOL)
    passed = all(v <= tols[kind(k)] for k, v in diffs.items())
    return dict(name=name, passed=passed, tol=FP8_VALUE_TOL, kernel_tol=FP8_KERNEL_TOL, scale_tol=FP8_SCALE_TOL,
                max_rel_diff=max(v for k, v in diffs.items() if kind(k) == "value"),
                max_kernel_diff=max((v for k, v in diffs.items() if kind(k) == "kernel"), default=None),
                max_scale_diff=max((v for k, v in diffs.items() if kind(k) == "scale"), default=None),
                diffs={k: float(f"{v:.3g}") for k, v in diffs.items()}, **info)


def _fp8_setup(device, seed):
    """``(generator on device, emulate, dtype)``: the emulation path in float32 where the device has no FP8, else
    ``torch._scaled_mm`` on bf16 inputs."""
    import kernels
    emulate = kernels.fp8_unavailable_reason(device) is not None
    return torch.Generator(device).manual_seed(seed), emulate, torch.float32 if emulate else torch.bfloat16


def fp8_check(T, device, shapes=(256, 128, 512, 1024), seed=0):
    """``kernels.fp8_linear`` at current scales forward and backward against float64, at ``shapes`` (positions,
    model_dim, hidden, vocab).

    On a GPU with FP8 the op runs ``torch._scaled_mm`` on bf16 inputs; elsewhere its ``emulate`` path (the
    same scaling and rounding, float32 products). Every ``kernels.fp8_mm`` call is recorded with the fp8
    operands and the scales the op itself chose (whatever its scaling rule), and each product is compared
    with ``(a a_scale) @ (b b_scale).T`` in float64 (``FP8_KERNEL_TOL``); the output and both gradients are
    compared with the float64 products of the unquantized operands (``FP8_VALUE_TOL``).

    Returns:
        dict: name ``fp8_linear``, passed, tol, max_rel_diff, diffs (per case: ``<case>_mm<i>``, ``_out``,
        ``_dx``, ``_dw``), emulated, shapes.
    """
    gen, emulate, dtype = _fp8_setup(device, seed)
    diffs = {}
    for name, (x, w, g, fp8_grad) in fp8_cases(gen, shapes).items():
        x, w, g = (t.to(device, dtype) for t in (x, w, g))
        diffs.update(_fp8_diffs(name, x, w, g, _fp8_run(x, w, g, fp8_grad, emulate)))
        del x, w, g
    worst_mm = max((v for k, v in diffs.items() if "_mm" in k), default=0.0)
    worst = max(v for k, v in diffs.items() if "_mm" not in k)
    passed = worst_mm <= FP8_KERNEL_TOL and worst <= FP8_VALUE_TOL
    return dict(name="fp8_linear", passed=passed, tol=FP8_VALUE_TOL, kernel_tol=FP8_KERNEL_TOL,
                max_rel_diff=max(worst, worst_mm), diffs={k: float(f"{v:.3g}") for k, v in diffs.items()},
                emulated=emulate, shapes=dict(zip(("positions", "model_dim", "hidden", "vocab"), shapes)))


def fp8_head_fixed_check(T, device, cfg, spec, shapes=(256, 128, 512, 1024), divisor=8, seed=0):
    """The LM head as the FP8 presets run it: ``fp8_linear(fp8_grad=True)`` at the model's fixed ``head_scales``
    (``build_model(cfg, spec)`` with --fp8, ``cfg`` with record #89's stages, after ``set_loss_divisor(divisor)``), on
    the head operands of ``fp8_cases`` with the gradient of a loss sum divided by ``divisor`` (softmax minus one-hot /
    divisor).

    The scales the products used must be record #89's (``RECORD89_HEAD_SCALES``, grad's / ``divisor``), the results
    ``fp8_reference`` at those scales, and near the unquantized products (``_fp8_result``).

    Returns:
        dict: name ``fp8_head_fixed_scales``, passed, the tolerances, max_rel_diff, max_kernel_diff, max_scale_diff,
        diffs (``head_fixed_mm<i>``, ``_out``, ``_dx``, ``_dw``, ``_scale``, ``_ref_out``, ``_ref_dx``, ``_ref_dw``),
        scales_used, scales_expected, divisor, emulated, shapes.
    """
    gen, emulate, dtype = _fp8_setup(device, seed)
    model = T.build_model(dataclasses.replace(cfg, fp8=True), spec)
    model.set_loss_divisor(divisor)
    # a model without fixed scales leaves the op its current ones, which the check then finds off
    scales = None if model.head_scales is None else model.head_scales.to(device)
    x, w, g, _ = fp8_cases(gen, shapes)["fp8_head"]
    x, w, g = x.to(device, dtype), w.to(device, dtype), (g * (shapes[0] / divisor)).to(device, dtype)
    want = (*RECORD89_HEAD_SCALES[:2], RECORD89_HEAD_SCALES[2] / divisor)
    run = _fp8_run(x, w, g, True, emulate, scales=scales)
    diffs = {**_fp8_diffs("head_fixed", x, w, g, run), **_given_scale_diffs("head_fixed", x, w, g, run, want, True)}
    used = None if scales is None else [float(s) for s in scales]
    return _fp8_result("fp8_head_fixed_scales", diffs, scales_used=used, scales_expected=list(want), divisor=divisor,
                       emulated=emulate, shapes=dict(zip(("positions", "model_dim", "hidden", "vocab"), shapes)))


def fp8_down_delayed_check(T, device, shapes=(256, 128, 512, 1024), seed=0):
    """The MLP down-projection as the FP8 presets run it (``MLP.forward``, ``fp8_refresh``): ``fp8_linear`` at the
    delayed scales of ``kernels.down_scales``, kept by ``refresh_down_scales_`` and ``delay_input_scale_``.

    The state starts as the trainer's (a refresh at init, one earlier forward); then two forwards on relu^2
    activations of ``shapes``: ``bootstrap`` (a step of the first 16: the weight's own amax / 448) and, after an
    optimizer step and a refresh past them, ``delayed`` (the amax before the step x 1.12 / 448); each forward's
    input scale is the previous forward's amax x 1.80 / 448. Expected scales are computed here in float64
    from record #89's rule (``RECORD89_DOWN_HEADROOM``), results judged as ``fp8_head_fixed_check``'s.

    Returns:
        dict: name ``fp8_down_delayed_scales``, passed, the tolerances, diffs (``down_bootstrap_*``,
        ``down_delayed_*``), scales_used, scales_expected (per forward), emulated, shapes.
    """
    import kernels
    gen, emulate, dtype = _fp8_setup(device, seed)
    M, d, hidden, _ = shapes
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device)  # noqa: E731
    w_fc = randn(hidden, d) / d ** 0.5
    acts = [torch.relu(randn(M, d) @ w_fc.t()).square().to(dtype) for _ in range(3)]  # 3 forwards' relu^2
    w0 = (0.5 * randn(d, hidden) / hidden ** 0.5).to(dtype)
    w1 = (w0.float() + 0.1 * randn(d, hidden) / hidden ** 0.5).to(dtype)  # after an optimizer step
    g = (1e-3 * randn(M, d)).to(dtype)
    amax = lambda t: float(t.detach().double().abs().max())  # noqa: E731
    act_room, weight_room = RECORD89_DOWN_HEADROOM
    state = kernels.down_scales(device)
    kernels.refresh_down_scales_(state, w0, bootstrap=True)  # at init (fp8_refresh(model, -1))
    kernels.delay_input_scale_(state, acts[0])  # an earlier training forward
    diffs, used, expected = {}, {}, {}
    for name, h, w, prev, want_w in (("down_bootstrap", acts[1], w0, acts[0], amax(w0) / E4M3),
                                     ("down_delayed", acts[2], w1, acts[1], amax(w0) * weight_room / E4M3)):
        if name == "down_delayed":
            kernels.refresh_down_scales_(state, w1, bootstrap=False)  # after a step past the first 16
        want = (amax(prev) * act_room / E4M3, want_w)
        used[name] = [float(s) for s in state[:2]]
        run = _fp8_run(h, w, g, False, emulate, scales=state[:2])
        kernels.delay_input_scale_(state, h)  # MLP.forward: the next forward's input scale
        diffs.update({**_fp8_diffs(name, h, w, g, run), **_given_scale_diffs(name, h, w, g, run, want, False)})
        expected[name] = list(want)
    return _fp8_result("fp8_down_delayed_scales", diffs, scales_used=used, scales_expected=expected,
                       emulated=emulate, shapes=dict(zip(("positions", "model_dim", "hidden", "vocab"), shapes)))


LAYOUTS = ("gx", "xg")  # kernels.HEAD_GRAD_LAYOUT: g^T x (M = vocab), (x^T g)^T (M = model_dim, modded-nanogpt's)


def head_grad_layout_check(T, device, shapes=None, divisor=8, iters=10, seed=0, run_here=False):
    """The FP8 LM head's forward and backward (``fp8_linear(fp8_grad=True)`` at record #89's fixed head scales) timed
    under each weight-gradient layout (``kernels.HEAD_GRAD_LAYOUT``, ``LAYOUTS``); issue 44 keeps both, chosen by
    this measurement. Same math: each shape's dx and dW must agree between the layouts.

    Args:
        T: the trainer module. device: torch.device; runs only where FP8 runs (sm_89+), unless ``run_here``.
        shapes: ``[(positions, model_dim, hidden, vocab)]`` (default: the record's stage-1 and stage-3 micro-batches).
        divisor: the loss divisor in the gradient's scale. iters: timed calls per layout, after 2 untimed.
        seed: random inputs' seed. run_here: run on ``device`` whatever it is (the tests: a CPU's emulation path).

    Returns:
        dict: name ``head_grad_layout``, passed, tol, max_rel_diff, diffs (``<positions>_dx``, ``_dw``: one layout vs
        the other), ms ``{positions: {layout: forward + backward ms}}``, faster ``{positions: layout}``, current (the
        layout the trainer uses), note; or ``passed`` None and ``skipped`` saying why it did not run.
    """
    import kernels
    from gpu_check import time_ms  # the one timer: CUDA events on CUDA
    why = kernels.fp8_unavailable_reason(device)
    if why and not run_here:
        where = "not run on the CPU" if device.type != "cuda" else "not run"
        return dict(name="head_grad_layout", passed=None, current=kernels.HEAD_GRAD_LAYOUT,
                    skipped=f"{where}: it times torch._scaled_mm, which needs a GPU with FP8 ({why})")
    gen, emulate, dtype = _fp8_setup(device, seed)
    scales = torch.tensor((*RECORD89_HEAD_SCALES[:2], RECORD89_HEAD_SCALES[2] / divisor), device=device)
    current, diffs, ms, faster = kernels.HEAD_GRAD_LAYOUT, {}, {}, {}
    try:
        for M, d, _, V in shapes or [fp8_record_shapes(T, 0), fp8_record_shapes(T, 2)]:
            randn = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
            x, w, g = randn(M, d).requires_grad_(True), (0.05 * randn(V, d)).requires_grad_(True), 1e-3 * randn(M, V)
            step = lambda: torch.autograd.grad(  # noqa: E731
                kernels.fp8_linear(x, w, fp8_grad=True, emulate=emulate, scales=scales), (x, w), g)
            got = {}
            for layout in LAYOUTS:
                kernels.HEAD_GRAD_LAYOUT = layout
                got[layout] = step()
                step()
                ms.setdefault(M, {})[layout] = round(time_ms(step, iters, device), 3)
            diffs.update({f"{M}_{k}": _frob_rel(a, b) for k, a, b in zip(("dx", "dw"), got["xg"], got["gx"])})
            faster[M] = min(LAYOUTS, key=ms[M].get)
            del x, w, g, got
    finally:
        kernels.HEAD_GRAD_LAYOUT = current
    winners = set(faster.values())
    times = "; ".join(f"{k}: " + ", ".join(f"{a} {b}" for a, b in v.items()) for k, v in ms.items())
    note = ("faster: " + (winners.pop() if len(winners) == 1 else ", ".join(f"{v} at {k}" for k, v in faster.items()))
            + f" (forward + backward ms {times}; the trainer uses {current})")
    worst = max(diffs.values())
    return dict(name="head_grad_layout", passed=worst <= FP8_KERNEL_TOL, tol=FP8_KERNEL_TOL, max_rel_diff=worst,
                diffs={k: float(f"{v:.3g}") for k, v in diffs.items()}, ms=ms, faster=faster, current=current,
                note=note, emulated=emulate)


def fp8_record_shapes(T, stage=0):
    """(positions of one micro-batch of recipe ``stage`` 0, 1 or 2, model_dim, MLP hidden, vocab) of the record's
    defaults (baseline_h200 and record_h200 share them)."""
    cfg = T.Config()
    spec = T.MODELS[cfg.model]
    return (T.recipe_stages(cfg)[stage].seq_len * cfg.micro_batch_seqs, spec.model_dim,
            spec.mlp_ratio * spec.model_dim, spec.vocab_size)


def fp8_head_divisor(T):
    """``grad_divisor`` of the record's last stage (its sequences per step, 8): the head's gradient scale's."""
    return T.grad_divisor(T.stages(T.Config())[-1])


def reference_loss(logits, targets, weights, sigmoid=None):
    """float64 ``sum_{n, j valid} w_j (logsumexp(z_n) - z_n[y_nj])``: z = x or, given ``sigmoid`` = (A, B, C) (record
    #54's cap), ``z = A sigmoid((x + B) / C)``; a target of -100 counts nowhere."""
    z = logits.double()
    if sigmoid:
        A, B, C = sigmoid
        z = A * torch.sigmoid((z + B) / C)
    logp = torch.log_softmax(z, dim=-1)
    valid = targets != -100
    picked = logp.gather(-1, targets.clamp_min(0))
    return -(picked * valid * weights.double()).sum()


def loss_check(T, device, n=2348, vocab=300, tol=1e-5, seed=0):
    """The trainer's loss (``T.loss_sum``: the sigmoid cap, 4 weighted target columns, some ignored) vs
    ``reference_loss`` in float64, value and gradient.

    Args:
        T: the trainer module. device: where the loss runs.
        n, vocab: positions and vocabulary of the random float32 logits (2,348: two of the fused loss's
            1,024-position chunks and a ragged one).
        tol: largest relative difference of the value and of the gradient. seed: random inputs' seed.

    Returns:
        dict: passed, tol, max_rel_diff, diffs (value, grad).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, vocab, generator=gen)).to(device).requires_grad_(True)
    targets = torch.randint(0, vocab, (n, 4), generator=gen)
    targets[torch.rand(n, 4, generator=gen) < 0.2] = -100
    targets = targets.to(device)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25], device=device)
    got = T.loss_sum(logits, targets, weights)
    (g_got,) = torch.autograd.grad(got, logits)
    leaf = logits.detach().double().requires_grad_(True)
    want = reference_loss(leaf, targets, weights, T.SIGMOID_CAP)
    (g_want,) = torch.autograd.grad(want, leaf)
    diffs = {"value": _max_rel(got.detach(), want.detach()), "grad": _max_rel(g_got, g_want)}
    worst = max(diffs.values())
    return dict(name="loss_vs_float64", passed=worst <= tol, tol=tol, max_rel_diff=worst, diffs=diffs)


def step_batch(T, cfg, spec, row, device, seqs=1, mean_doc=40, seed=0):
    """``(inputs [seqs, L, k], targets [seqs, L, j], weights [j] or None)`` of a step at stage-table ``row`` of ``cfg``
    on the model ``spec`` (the model's ``seq_len`` positions), on random tokens with documents of mean ``mean_doc``:
    TST phase 1 its bags, phase 2 the 4 target columns (``objective_targets``) with record #89's stage-1 weights (all
    4 non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    s, mode = row.stage.bag_size, row.stage.mode
    toks = torch.randint(0, T.EOT_TOKEN, (seqs, T.sequence_layout(mode, s, cfg.seq_len)[0]), generator=gen)
    toks[torch.rand(toks.shape, generator=gen) < 1 / mean_doc] = T.EOT_TOKEN
    inputs, targets = T.make_batch(toks, mode, s)
    weights = None
    if row.stage.phase == 2:
        prefix = T.prefix_token_table(spec.vocab_size)
        targets, weights = T.objective_targets(targets[..., 0], prefix), torch.tensor(T.OBJECTIVE_WEIGHTS[0][0])
    return inputs.to(device), targets.to(device), None if weights is None else weights.to(device)


def check_batches(T, cfg, spec, device, seqs=2, mean_doc=100, seed=0):
    """The model checks' batches (``step_batch``): at the first row of ``cfg``'s stage table (TST phase 1: bags) and
    at its last row (the final validation's windows, the YaRN tables after every long window of the run).

    Args:
        T: the trainer module. cfg: the check model's Config, spec its ModelSpec. device: where the tensors go.
        seqs: sequences per batch. mean_doc: mean document length of the random tokens (geometric),
            long enough that some 128-blocks lie inside one document. seed: the tokens' seed.

    Returns:
        list of ``(row, inputs [seqs, L, k], targets [seqs, L, j], weights [j] or None)``.
    """
    table = T.Schedule(cfg, spec)
    return [(row, *step_batch(T, cfg, spec, row, device, seqs, mean_doc, seed + i))
            for i, row in enumerate((table[0], table[cfg.num_iterations]))]


@contextlib.contextmanager
def masks_of_kind(model, use_flex):
    """Within: ``model``'s attention masks are FlexAttention block masks (``use_flex`` True) or SDPA boolean
    masks (False) whatever the device (``GPT.flex``; eager runs only: a compiled graph keeps what it traced)."""
    original = model.flex
    model.flex = use_flex
    try:
        yield
    finally:
        model.flex = original


def check_model(T, cfg, spec, device, seed=0):
    """The check model ``cfg`` (its ModelSpec ``spec``) in float32 on ``device``, every weight moved by N(0, 0.05^2)
    noise: the zero-initialized projections, head, gates and tables would otherwise hide differences."""
    torch.manual_seed(seed)
    model = T.build_model(cfg, spec)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def model_outputs(model, net, batches, grads):
    """``net`` (the model or its compiled form) on ``batches`` (``check_batches``), each at its row's
    windows and YaRN tables. With ``grads``: float64 losses per batch (sum over labels / valid
    next-token labels) and every parameter's gradient of their sum (None where a parameter gets none);
    else (FlexAttention has no CPU backward) the logits per batch, a forward without autograd."""
    model.zero_grad(set_to_none=True)
    out = dict(loss=[], logits=[], grads=None)
    for row, inputs, targets, weights in batches:
        model.set_window(row.window, row.yarn)
        if not grads:
            with torch.no_grad():
                out["logits"].append(net(inputs).double())
            continue
        loss = (net(inputs, targets) if weights is None else net(inputs, targets, weights))
        loss = loss / (targets[..., :1] != -100).sum()
        loss.backward()
        out["loss"].append(loss.detach().double())
    if grads:
        out["grads"] = {name: None if p.grad is None else p.grad.detach().double().clone()
                        for name, p in model.named_parameters()}
    return out


def compare_outputs(got, want, floor=1e-4):
    """Largest relative differences of two ``model_outputs``: ``loss`` and ``logits`` (max |a - b| /
    max |b| per batch) and ``grad`` (per parameter ||a - b|| / max(||b||, floor x the largest ||b||):
    compiled reductions reorder sums, so a gradient near zero is judged on the scale of the others).

    Returns:
        ``(diffs, worst_param)``; a gradient present in one output only counts as inf.
    """
    diffs = {}
    for key in ("loss", "logits"):
        if want[key] and got[key]:
            diffs[key] = max(_max_rel(a, b) for a, b in zip(got[key], want[key]))
    worst = None
    if want["grads"] is not None and got["grads"] is not None:
        scale = max((g.norm() for g in want["grads"].values() if g is not None), default=torch.tensor(0.0))
        rel = {}
        for name, b in want["grads"].items():
            a = got["grads"][name]
            if a is None or b is None:
                rel[name] = 0.0 if a is None and b is None else float("inf")
            else:
                rel[name] = float((a - b).norm() / torch.clamp_min(b.norm(), float(floor * scale) + 1e-30))
        worst = max(rel, key=rel.get)
        diffs["grad"] = rel[worst]
    return diffs, worst


def _model_check(name, got, want, tol, grad_tol, **info):
    diffs, worst_param = compare_outputs(got, want)
    passed = bool(diffs) and all(v <= (grad_tol if k == "grad" else tol) for k, v in diffs.items())
    return dict(name=name, passed=passed, tol=tol, grad_tol=grad_tol, max_rel_diff=max(diffs.values(), default=None),
                diffs=diffs, worst_grad_param=worst_param, **info)


def model_checks(T, cfg, spec, device, tol=1e-4, grad_tol=1e-3, compile_fn=None, backward=None):
    """FlexAttention vs masked SDPA and compiled vs eager on the check model ``cfg``, float32.

    Args:
        T: the trainer module. cfg: the check model's Config (record #89's elements on), spec its ModelSpec.
        device: on CUDA, the compiled model (FlexAttention fused by inductor) vs the eager model under
            SDPA masks (``flex_vs_sdpa_model``) and vs the eager model under eager FlexAttention
            (``compiled_vs_eager_fp32``), loss and every gradient; on CPU, where FlexAttention has no
            backward and compiling takes minutes, eager FlexAttention vs SDPA, the logits.
        tol: largest relative difference of losses and logits. grad_tol: of a gradient (norm-wise).
        compile_fn: what compiles the model (default ``torch.compile(m, dynamic=False)``, as the trainer).
        backward: run CUDA's comparisons (losses, gradients, the compiled model); default: on CUDA.
            The tests set it on CPU, with the masks and ``compile_fn`` swapped for what a CPU runs.

    Returns:
        dict name -> check (passed, tol, grad_tol, max_rel_diff, diffs, worst_grad_param); a check
        that cannot run here has ``passed`` None and ``skipped`` saying why.
    """
    cuda = device.type == "cuda" if backward is None else backward
    model, batches = check_model(T, cfg, spec, device), check_batches(T, cfg, spec, device)
    info = dict(shape=[len(batches[0][1]), cfg.seq_len], windows=[list(b[0].window) for b in batches])
    with masks_of_kind(model, use_flex=False):
        sdpa = model_outputs(model, model, batches, grads=cuda)
    with masks_of_kind(model, use_flex=True):
        flex = model_outputs(model, model, batches, grads=cuda)
    if not cuda:
        return {"flex_vs_sdpa_model": _model_check("flex_vs_sdpa_model", flex, sdpa, tol, grad_tol, **info),
                "compiled_vs_eager_fp32": dict(name="compiled_vs_eager_fp32", passed=None, skipped=(
                    "CUDA only: FlexAttention has no CPU backward and compiling on a CPU takes minutes"))}
    compile_fn = compile_fn or (lambda m: torch.compile(m, dynamic=False))
    compiled = model_outputs(model, compile_fn(model), batches, grads=True)
    return {"flex_vs_sdpa_model": _model_check("flex_vs_sdpa_model", compiled, sdpa, tol, grad_tol, **info),
            "compiled_vs_eager_fp32": _model_check("compiled_vs_eager_fp32", compiled, flex, tol, grad_tol, **info)}


# ----------------------------------------------------------------------------------------------
# FlexAttention's CUDA backends (issue 46): TRITON (its Triton templates) and FLASH (FlashAttention-4's CuTe DSL kernels,
# the flash-attn-4 package), the trainer's ``kernels.attend`` compiled under each, at the record's shapes

ATTENTION_REF_LEN = 4096  # the SDPA reference's positions: its dense [T, T] bool mask (16 MiB) and float32 math fit
# bf16 kernels vs the float32 SDPA of the same bf16 inputs: the output rounds to 8 significand bits (2^-9 relative) and
# both backends round the probabilities (and dS) to bf16 for their products; a mask that drops or adds a document's keys
# moves whole rows by O(1). A window off by one moves a row by ~1/window only: the float32 ``flex_vs_sdpa`` row (1e-4)
# is the exact mask check, this one the backends' arithmetic.
ATTENTION_TOL = 3e-2
ATTENTION_DOC = 1000  # mean document length of the random documents, tokens (FineWeb's is about 1,000)
ATTENTION_ON_CPU = "not run on the CPU: FlexAttention's Triton and FLASH kernels need a CUDA GPU"


def attention_shapes(T):
    """``(lengths, windows, heads, head_dim, scale)`` of the record's attention: stage 1's and stage 3's sequence (one
    a micro-batch), stage 3's (long, short) windows in positions, the model's heads, head size and logit scale."""
    cfg = T.Config()
    spec = T.MODELS[cfg.model]
    recipe, table = T.recipe_stages(cfg), T.Schedule(cfg, spec)
    third = next(st for st in table.stages if st.seq_len == recipe[2].seq_len)
    return ((recipe[0].seq_len, recipe[2].seq_len), tuple(table[third.start].window), spec.n_head, spec.head_dim,
            spec.attn_scale)


def attention_unavailable(device, backend):
    """Why FlexAttention's ``backend`` ("triton", "flash") cannot be measured on ``device``, or None."""
    if device.type != "cuda":
        return ATTENTION_ON_CPU
    import kernels
    why = kernels.flash_unavailable_reason(device) if backend == "flash" else None
    return f"not run: {why}" if why else None


def refusal(err):
    """``"refused: <type>: <first line>"`` of the innermost cause of ``err`` (Dynamo and inductor wrap a backend's own
    error, whose first line is the one that says why)."""
    inner, seen = err, {id(err)}
    while (nxt := getattr(inner, "inner_exception", None) or inner.__cause__) is not None and id(nxt) not in seen:
        inner = nxt
        seen.add(id(nxt))
    line = next((x.strip() for x in str(inner).splitlines() if x.strip()), "")
    return f"refused: {type(inner).__name__}: {line[:200]}"


def attention_inputs(gen, length, heads, head_dim, device, dtype, grad):
    """``(doc_ids int64 [1, length], q, k, v [1, heads, length, head_dim] in dtype)``: documents of ~``ATTENTION_DOC``
    tokens, unit normal inputs (``requires_grad`` as ``grad``)."""
    ids = random_documents(gen, 1, length, max(1, round(length / ATTENTION_DOC) - 1), device)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen).to(device, dtype).requires_grad_(grad)
               for _ in range(3))
    return ids, q, k, v


def attention_diffs(attend, ids, q, k, v, windows, scale, grad):
    """Max relative differences of ``attend`` (``kernels.attend``, compiled) under FlexAttention block masks
    (``kernels.build_attention_mask``) vs float32 SDPA of the same inputs under the dense mask
    (``kernels.attention_mask``), per window w: the output (``out_<w>``) and, with ``grad``, the gradients of a
    random output gradient (``dq_<w>``, ``dk_<w>``, ``dv_<w>``)."""
    import kernels
    diffs, leaves = {}, [t.detach().float().requires_grad_(grad) for t in (q, k, v)]
    for w in windows:
        out = attend(q, k, v, kernels.build_attention_mask(ids, torch.tensor(w, device=ids.device), True), scale)
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=kernels.attention_mask(ids, w)[:, None], scale=scale)
        diffs[f"out_{w}"] = _max_rel(out.detach(), ref.detach())
        if grad:
            g = torch.randn_like(ref)
            got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
            want = torch.autograd.grad(ref, leaves, g)
            diffs.update({f"d{x}_{w}": _max_rel(a, b) for x, a, b in zip("qkv", got, want)})
    return diffs


def median_ms(fn, device, trials, iters):
    """Median over ``trials`` of the mean ms of ``iters`` calls of ``fn`` (CUDA events on CUDA), after two untimed
    calls (the first compiles)."""
    from gpu_check import time_ms  # the one timer
    fn()
    fn()
    return round(statistics.median(time_ms(fn, iters, device) for _ in range(trials)), 4)


def attention_times(attend, gen, shapes, device, dtype, grad, trials, iters, row):
    """Forward and (``grad``) forward + backward ms of ``attend`` at each (length, window) of ``shapes``
    (``attention_shapes``' order), into ``row``'s ``ms_forward`` and ``ms_forward_backward`` (keyed
    ``"<length>x<window>"``) as each is measured: a backend refusing a later shape keeps the earlier ones."""
    import kernels
    lengths, windows, heads, head_dim, scale = shapes
    for length in lengths:
        ids, q, k, v = attention_inputs(gen, length, heads, head_dim, device, dtype, grad)
        g = torch.randn(q.shape, generator=gen).to(device, dtype)
        for w in windows:
            mask = kernels.build_attention_mask(ids, torch.tensor(w, device=device), True)
            forward = lambda: attend(q, k, v, mask, scale)  # noqa: E731
            row["ms_forward"][f"{length}x{w}"] = median_ms(forward, device, trials, iters)
            if grad:
                row["ms_forward_backward"][f"{length}x{w}"] = median_ms(
                    lambda: torch.autograd.grad(forward(), (q, k, v), g), device, trials, iters)
        del ids, q, k, v, g


def attention_backend_check(T, device, backend, shapes=None, ref_len=ATTENTION_REF_LEN, tol=ATTENTION_TOL, trials=5,
                            iters=3, seed=0, dtype=torch.bfloat16, compile_fn=None, backward=None, run_here=False):
    """One ``attention_backends`` row of gpu_check: ``kernels.attend`` under a FlexAttention BlockMask, compiled with
    ``backend`` (``torch._dynamo.reset()`` before and after: no graph of the other backend
    is reused), timed at the record's shapes and compared with masked SDPA.

    Args:
        T: the trainer module. device: torch.device (CUDA; elsewhere the row says why it did not run, unless
            ``run_here``). backend: "triton" or "flash".
        shapes: ``(lengths, windows, heads, head_dim, scale)`` (default ``attention_shapes``: 16,384 and 49,152
            positions, windows 1,408 and 640, 6 heads of 128).
        ref_len: positions of the comparison with SDPA (a dense [T, T] mask), at each window. tol: its largest max
            relative difference (``ATTENTION_TOL``). trials, iters: timing (``median_ms``). seed: the inputs' seed.
        dtype: the inputs' dtype (bf16, as the trainer on CUDA). compile_fn: what compiles ``kernels.attend``
            (default ``torch.compile(f, dynamic=False)``). backward: time and compare gradients too (default: on
            CUDA; FlexAttention has no CPU backward). run_here: run on ``device`` whatever it is (the tests: eager on
            a CPU).

    Returns:
        dict: name ``attention_<backend>``, backend, passed (max_rel_diff_vs_sdpa <= tol; None when it did not run
        or was refused), skipped (why not run; ``"refused: <type>: <first line>"`` when the backend raised, with
        what it had measured kept), tol, ms_forward and ms_forward_backward (``{"<length>x<window>": ms}``),
        max_rel_diff_vs_sdpa, diffs (``attention_diffs``), shapes.
    """
    import kernels
    row = dict(name=f"attention_{backend}", backend=backend, passed=None, skipped=None, tol=tol, ms_forward=None,
               ms_forward_backward=None, max_rel_diff_vs_sdpa=None, diffs=None)
    why = None if run_here else attention_unavailable(device, backend)
    if why:
        return dict(row, skipped=why)
    shapes = shapes or attention_shapes(T)
    grad = device.type == "cuda" if backward is None else backward
    row["shapes"] = dict(zip(("lengths", "windows", "heads", "head_dim", "scale"), shapes), ref_len=ref_len,
                         dtype=str(dtype).replace("torch.", ""), mean_document=ATTENTION_DOC)
    gen = torch.Generator().manual_seed(seed)
    saved = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(saved, 64)  # a graph per length, on purpose
    with_backend = functools.partial(kernels.attend, backend=backend.upper())
    attend = (compile_fn or (lambda f: torch.compile(f, dynamic=False)))(with_backend)
    try:
        ids, q, k, v = attention_inputs(gen, ref_len, *shapes[2:4], device, dtype, grad)
        diffs = attention_diffs(attend, ids, q, k, v, shapes[1], shapes[4], grad)
        row.update(diffs={n: float(f"{d:.3g}") for n, d in diffs.items()}, max_rel_diff_vs_sdpa=max(diffs.values()))
        del ids, q, k, v
        row["ms_forward"], row["ms_forward_backward"] = {}, {} if grad else None
        attention_times(attend, gen, shapes, device, dtype, grad, trials, iters, row)
    except Exception as err:  # noqa: BLE001 -- a backend refusing a graph is this row's result, not a crash
        row["skipped"] = refusal(err)
    finally:
        torch._dynamo.config.recompile_limit = saved
        torch._dynamo.reset()
    if row["skipped"] is None:
        row["passed"] = row["max_rel_diff_vs_sdpa"] <= tol
    return row


def print_attention(row):
    """One line: the backend's row, its times and difference, or why it did not run."""
    if row["skipped"]:
        print(f"{row['name']}: {row['skipped']}" + (f" (measured before: {row['ms_forward']})"
                                                   if row["ms_forward"] else ""), flush=True)
        return
    print(f"{row['name']}: {'PASS' if row['passed'] else 'FAIL'} (max relative diff vs SDPA "
          f"{row['max_rel_diff_vs_sdpa']:.2e} vs tolerance {row['tol']}); ms forward {row['ms_forward']}, forward + "
          f"backward {row['ms_forward_backward']}", flush=True)


PROFILE_PARTS = ("mask build", "attention", "MLP", "head + loss", "forward (rest)", "backward", "optimizer",
                 "communication")


def _labelled(module, label, handles):
    """Wrap ``module``'s forward in a ``record_function(label)`` range (hooks; removed via ``handles``)."""
    state = {}

    def pre(_m, _a):
        state.setdefault("r", []).append(torch.profiler.record_function(label).__enter__())

    def post(_m, _a, _o):
        state["r"].pop().__exit__(None, None, None)
    handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def _event_ms(prof, label, cuda):
    """Total time of the ranges named ``label`` (device time on CUDA, CPU time otherwise), ms."""
    total = 0.0
    for e in prof.key_averages():
        if e.key == label:
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            # a range can be listed on the host and as a device annotation: take the larger, never both
            total = max(total, (dev if cuda and dev else e.cpu_time_total) / 1e3)
    return total


def profile_model(T, cfg, spec, device):
    """``(model, optimizers, stage-table row 0)`` of ``cfg`` on ``spec`` as ``train_gpt.build_run`` makes them on
    ``device``: bf16 activations and Adam matrices on CUDA unless --no-bf16 (no autocast), FP8 where the GPU has it,
    stage 1's window, YaRN tables, loss divisor and FP8 scales; eager (the profile attributes time to modules)."""
    if cfg.fp8 and T.fp8_unavailable_reason(device):  # as the trainer: no FP8 where the GPU has none
        cfg = dataclasses.replace(cfg, fp8=False)
    bf16 = device.type == "cuda" and cfg.bf16 is not False  # the trainer's default: bf16 on CUDA
    torch.manual_seed(cfg.seed)
    model = T.build_model(cfg, spec, torch.bfloat16 if bf16 else None).to(device)
    if bf16:
        T.adam_bf16_(model)
    row = T.Schedule(cfg, spec)[0]
    model.set_window(row.window, row.yarn)
    model.set_loss_divisor(T.grad_divisor(row.stage))
    T.fp8_refresh(model, -1)
    return model, T.build_optimizers(model, cfg), row


def profile_step(T, cfg, spec, device):
    """One training step of ``cfg`` at its stage-table row 0 (``profile_model``, one micro-batch) under torch.profiler.

    Args:
        T: the trainer module. cfg: the Config to profile (a shape eager attention fits), spec its ModelSpec.
        device: torch.device.

    Returns:
        dict: ms per part (``PROFILE_PARTS``), step_ms (wall), max_memory_reserved_mib (CUDA),
        shares of the step, and the profiled shape.
    """
    cuda = device.type == "cuda"
    model, opts, row = profile_model(T, cfg, spec, device)
    inputs, targets, weights = step_batch(T, cfg, spec, row, device, cfg.micro_batch_seqs)
    handles = []
    for block in model.blocks:
        if block.attn is not None:
            _labelled(block.attn, "attention", handles)
        _labelled(block.mlp, "MLP", handles)
    saved = dict(loss_sum=T.loss_sum, linear=T.linear, fp8_linear=T.fp8_linear)
    head = model.lm_head.weight

    def labelled(fn, only_head=False):  # the head's matmul (a weight, not a module: no hook) and the loss
        def call(*a, **kw):
            if only_head and a[1] is not head:
                return fn(*a, **kw)
            with torch.profiler.record_function("head + loss"):
                return fn(*a, **kw)
        return call

    def timed_masks(x, masks_for=model.masks_for):
        with torch.profiler.record_function("mask build"):
            return masks_for(x)
    model.masks_for = timed_masks
    T.loss_sum, T.linear, T.fp8_linear = (labelled(saved["loss_sum"]), labelled(saved["linear"], True),
                                          labelled(saved["fp8_linear"], True))
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            with torch.profiler.record_function("forward"):
                loss = model(inputs, targets) if weights is None else model(inputs, targets, weights)
            with torch.profiler.record_function("backward"):
                (loss / T.grad_divisor(row.stage)).backward()
            with torch.profiler.record_function("optimizer"):
                for opt in opts:
                    opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            step_ms = 1000 * (time.perf_counter() - t0)
    finally:
        for name, fn in saved.items():
            setattr(T, name, fn)
        del model.masks_for
        for h in handles:
            h.remove()
    return profile_result(prof, cuda, step_ms, cfg, device)


def profile_result(prof, cuda, step_ms, cfg, device):
    """``profile_step``'s dict from its profiler ``prof``: ms and share per part, the step's wall ms, memory."""
    parts = {p: _event_ms(prof, p, cuda) for p in ("mask build", "attention", "MLP", "head + loss",
                                                  "backward", "optimizer")}
    parts["forward (rest)"] = max(0.0, _event_ms(prof, "forward", cuda) - sum(
        parts[p] for p in ("mask build", "attention", "MLP", "head + loss")))
    parts["communication"] = sum(e.cpu_time_total / 1e3 for e in prof.key_averages()
                                 if any(s in e.key.lower() for s in ("nccl", "all_reduce", "c10d")))
    total = sum(parts.values()) or 1.0
    return dict(ms={p: round(parts[p], 3) for p in PROFILE_PARTS}, step_ms=round(step_ms, 1),
                share={p: round(parts[p] / total, 3) for p in PROFILE_PARTS},
                timer="device" if cuda else "cpu", seq_len=cfg.seq_len, micro_batch_seqs=cfg.micro_batch_seqs,
                max_memory_reserved_mib=round(torch.cuda.max_memory_reserved(device) / 2**20) if cuda else None,
                note="forward parts split by module; the backward is one total (its kernels are not attributed "
                     "to modules); one process, so communication is 0")


def write_json(path, obj):
    """Write ``obj`` to ``path`` atomically (a reader never sees half a file)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def print_check(c):
    """One line: the check's name, PASS / FAIL / skipped and its differences."""
    if c.get("skipped"):
        print(f"{c['name']}: skipped ({c['skipped']})", flush=True)
        return
    grad = f", gradients {c['grad_tol']}" if c.get("grad_tol") else ""
    if c.get("scale_tol"):  # an FP8 op given its scales: its products and scales are judged too
        grad = (f"; products/references {c['max_kernel_diff']:.2e} vs {c['kernel_tol']}, scales "
                f"{c['max_scale_diff']:.2e} vs {c['scale_tol']}")
    print(f"{c['name']}: {'PASS' if c['passed'] else 'FAIL'} (max relative diff {c['max_rel_diff']:.2e} "
          f"vs tolerance {c['tol']}{grad}; {c['diffs']})", flush=True)


def run_checks(T, device, check_cfg, check_spec, report=None):
    """The agreement checks in order; ``report(results)`` after each, so a stopped run keeps the finished ones.

    Args:
        T: the trainer module. device: torch.device. check_cfg: the check model's float32 Config, check_spec its
            ModelSpec.
        report: called with the results so far after each check (None: not called).

    Returns:
        dict name -> the check's dict: ``fp8_check``, ``fp8_head_fixed_check``, ``fp8_down_delayed_check``
        (the record's shapes on CUDA), ``head_grad_layout_check``, ``attention_check``, ``loss_check``, then
        ``model_checks``
        of ``check_cfg`` (``flex_vs_sdpa_model``, ``compiled_vs_eager_fp32``).
    """
    results = {}
    fp8_shapes = fp8_record_shapes(T) if device.type == "cuda" else (256, 128, 512, 1024)
    for step in (lambda: [fp8_check(T, device, fp8_shapes)],
                 lambda: [fp8_head_fixed_check(T, device, check_cfg, check_spec, fp8_shapes, fp8_head_divisor(T))],
                 lambda: [fp8_down_delayed_check(T, device, fp8_shapes)],
                 lambda: [head_grad_layout_check(T, device, divisor=fp8_head_divisor(T))],
                 lambda: [attention_check(T, device)], lambda: [loss_check(T, device)],
                 lambda: model_checks(T, check_cfg, check_spec, device).values()):
        for c in step():
            results[c["name"]] = c
            print_check(c)
        if report:
            report(results)
    return results


def main(argv=None):
    """``python bench/gpu_kernels.py --device D --json PATH [--dry-run] [--preset P]``: kernels, then profile.

    Writes ``{"kernels": {...}, "profile": {...}}`` to ``--json`` after each part; run by
    ``bench/gpu_check.py`` as a subprocess, so its time budget can stop a slow compile.
    """
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--preset", default="record_h200")
    p.add_argument("--parts", default="kernels,profile")
    args = p.parse_args(argv)
    # eager FlexAttention is the reference of the compiled one here (and all a CPU has), not a slip
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    import gpu_check as G  # the check model and the profiled shape are gpu_check's
    T = G.T
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = {}
    if "kernels" in args.parts:
        cfg = G.check_model_config(device.type, *G.MODEL_CHECK_SHAPE)
        out["kernels"] = run_checks(T, device, cfg, G.spec_of(cfg),
                                    lambda r: write_json(args.json, dict(out, kernels=r)))
        write_json(args.json, out)
    if "profile" in args.parts:
        cfg = G.check_model_config(device.type) if args.dry_run else G.profile_config(args.preset, device)
        out["profile"] = profile_step(T, cfg, G.spec_of(cfg), device)
        pf = out["profile"]
        print(f"one step ({pf['timer']} time, seq_len {pf['seq_len']} x {pf['micro_batch_seqs']}): "
              + ", ".join(f"{k} {v:.1f} ms ({100 * pf['share'][k]:.0f}%)" for k, v in pf["ms"].items())
              + f"; max_memory_reserved {pf['max_memory_reserved_mib']} MiB", flush=True)
        write_json(args.json, out)
    if "attention" in args.parts:  # last: a backend's crash can leave the CUDA context unusable
        out["attention_backends"] = {}
        for backend in G.ATTENTION_BACKENDS:
            out["attention_backends"][backend] = row = attention_backend_check(T, device, backend)
            print_attention(row)
            write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    sys.exit(main())
