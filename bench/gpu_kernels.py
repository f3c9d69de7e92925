"""In-process kernel checks and the one-step time breakdown of ``bench/gpu_check.py``.

Each check compares the trainer's own function (``train_gpt``) on random inputs with a slow,
obviously-right reference, at tolerances that a window off by one fails (tests/test_gpu_check.py
injects one):

* ``attention_check``: FlexAttention under ``block_mask_from_bounds`` (compiled on CUDA) vs SDPA
  under the materialized ``attention_mask``, forward and (CUDA) gradients, float32.
* ``loss_check``: ``multi_target_loss`` vs a float64 log-softmax reference, value and gradient.
* ``compiled_vs_eager_check`` (CUDA): the tiny model's loss and gradients, compiled vs eager, float32.
* ``profile_step``: one training step under ``torch.profiler`` split into attention, mask build,
  MLP, head + loss (forward), backward, optimizer, communication; ``max_memory_reserved``.
"""
import argparse
import contextlib
import json
import os
import sys
import time

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


def attention_check(T, device, length=384, window=48, tol=1e-4, seed=0):
    """FlexAttention (block mask from bounds) vs masked SDPA on the same float32 q, k, v.

    Args:
        T: the trainer module (``train_gpt``); its ``block_mask_from_bounds``, ``attention_mask``.
        device: torch.device; on CUDA FlexAttention is compiled and gradients are compared too,
            on CPU the forward only (FlexAttention has no CPU backward).
        length: sequence length T (3 blocks of 128 by default: partial and full blocks both occur).
        window: the window in positions, not a multiple of the block so partial blocks bind.
        tol: largest relative difference allowed (float32 kernels agree to ~1e-6; a window
            off by one moves outputs by ~1e-1).
        seed: random inputs' seed.

    Returns:
        dict: passed, tol, max_rel_diff of the output (and of dq, dk, dv on CUDA).
    """
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 2, 2, 32
    ids = random_documents(gen, B, length, 3, device)
    q, k, v = (torch.randn(B, H, length, D, generator=gen).to(device).requires_grad_(device.type == "cuda")
               for _ in range(3))
    w = torch.tensor(window, device=device)
    flex = torch.compile(_flex(), dynamic=False) if device.type == "cuda" else _flex()
    with (contextlib.nullcontext() if device.type == "cuda" else torch.no_grad()):
        out = flex(q, k, v, block_mask=T.block_mask_from_bounds(ids, w))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=T.attention_mask(ids, window)[:, None])
    diffs = dict(out=_max_rel(out.detach(), ref.detach()))
    if device.type == "cuda":
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, (q, k, v), g)
        diffs.update({f"d{n}": _max_rel(a, b) for n, a, b in zip("qkv", got, want)})
    worst = max(diffs.values())
    return dict(name="flex_vs_sdpa", passed=worst <= tol, tol=tol, max_rel_diff=worst, diffs=diffs,
                shape=[B, H, length, D], window=window, grad=device.type == "cuda")


def reference_loss(logits, targets, weights, softcap):
    """float64 ``sum_{n, j valid} w_j (logsumexp(z_n) - z_n[y_nj])``, ``z = softcap tanh(x / softcap)``."""
    z = logits.double()
    z = softcap * torch.tanh(z / softcap) if softcap > 0 else z
    logp = torch.log_softmax(z, dim=-1)
    valid = targets != -100
    picked = logp.gather(-1, targets.clamp_min(0))
    return -(picked * valid * weights.double()).sum()


def loss_check(T, device, n=300, vocab=1000, tol=1e-5, seed=0):
    """``T.multi_target_loss`` (float32, tanh cap, chunked) vs ``reference_loss`` in float64.

    Args:
        T: the trainer module. device: where the fused loss runs.
        n, vocab: positions and vocabulary of the random logits; chunks of 128 positions.
        tol: largest relative difference of the value and of the gradient.
        seed: random inputs' seed.

    Returns:
        dict: passed, tol, max_rel_diff, diffs (value, grad).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, vocab, generator=gen)).to(device).requires_grad_(True)
    targets = torch.randint(0, vocab, (n, 3), generator=gen)
    targets[torch.rand(n, 3, generator=gen) < 0.2] = -100
    targets = targets.to(device)
    weights = torch.tensor([1.0, 0.5, 0.25], device=device)
    got = T.multi_target_loss(logits, targets, weights, cap="tanh", softcap=15.0, chunk=128)
    (g_got,) = torch.autograd.grad(got, logits)
    leaf = logits.detach().double().requires_grad_(True)
    want = reference_loss(leaf, targets, weights, 15.0)
    (g_want,) = torch.autograd.grad(want, leaf)
    diffs = dict(value=_max_rel(got.detach(), want.detach()), grad=_max_rel(g_got, g_want))
    worst = max(diffs.values())
    return dict(name="loss_vs_float64", passed=worst <= tol, tol=tol, max_rel_diff=worst, diffs=diffs)


def _tiny_batch(T, cfg, device, seed=0):
    """One micro-batch of the tiny model's next-token objective on random documents."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 50256, (cfg.micro_batch_seqs, cfg.seq_len + 1), generator=gen)
    toks[torch.rand(toks.shape, generator=gen) < 1 / 40] = T.EOT_TOKEN
    return T.make_batch(toks.to(device), "full", 1)


def compiled_vs_eager_check(T, cfg, device, tol=1e-4):
    """Loss and gradients of the model ``cfg`` (float32, one micro-batch), compiled vs eager.

    Args:
        T: the trainer module. cfg: its Config (the tiny model). device: CUDA (compiled FlexAttention).
        tol: largest relative difference of the loss and of any parameter's gradient.

    Returns:
        dict: passed, tol, max_rel_diff, diffs (loss, worst grad and its parameter).
    """
    torch.manual_seed(0)
    model = T.GPT(cfg).to(device)
    for p in model.parameters():  # the zero-initialized projections and head would hide differences
        torch.nn.init.normal_(p, std=0.05)
    inputs, targets = _tiny_batch(T, cfg, device)
    results = []
    for net in (model, torch.compile(model, dynamic=False)):
        model.zero_grad(set_to_none=True)
        loss = net(inputs, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l_c, g_c), (l_e, g_e) = results[1], results[0]
    grads = {n: _max_rel(g_c[n], g_e[n]) for n in g_e}
    worst_param = max(grads, key=grads.get)
    diffs = dict(loss=_max_rel(l_c, l_e), grad=grads[worst_param])
    worst = max(diffs.values())
    return dict(name="compiled_vs_eager_fp32", passed=worst <= tol, tol=tol, max_rel_diff=worst,
                diffs=diffs, worst_grad_param=worst_param)


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


def profile_step(T, cfg, device):
    """One training step of ``cfg`` (eager, one micro-batch, the autocast of the run) under torch.profiler.

    Args:
        T: the trainer module. cfg: the Config to profile (a shape eager attention fits).
        device: torch.device.

    Returns:
        dict: ms per part (``PROFILE_PARTS``), step_ms (wall), max_memory_reserved_mib (CUDA),
        shares of the step, and the profiled shape.
    """
    cuda = device.type == "cuda"
    model = T.GPT(cfg).to(device)
    opts = T.build_optimizers(model, cfg)
    inputs, targets = _tiny_batch(T, cfg, device)
    handles = []
    for block in model.blocks:
        if block.attn is not None:
            _labelled(block.attn, "attention", handles)
        _labelled(block.mlp, "MLP", handles)
    _labelled(model.lm_head, "head + loss", handles)
    masks_for, mce = model.masks_for, T.mce_loss

    def timed_masks(x):
        with torch.profiler.record_function("mask build"):
            return masks_for(x)

    def timed_loss(*a, **kw):
        with torch.profiler.record_function("head + loss"):
            return mce(*a, **kw)
    model.masks_for, T.mce_loss = timed_masks, timed_loss
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and cfg.bf16 else contextlib.nullcontext()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            with torch.profiler.record_function("forward"), autocast:
                loss = model(inputs, targets)
            with torch.profiler.record_function("backward"):
                loss.backward()
            with torch.profiler.record_function("optimizer"):
                for opt in opts:
                    opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            step_ms = 1000 * (time.perf_counter() - t0)
    finally:
        T.mce_loss = mce
        del model.masks_for
        for h in handles:
            h.remove()
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


def run_checks(T, device, tiny_cfg, report=None):
    """The agreement checks in order; ``report(results)`` after each, so a stopped run keeps the finished ones.

    Returns:
        dict name -> the check's dict (``attention_check``, ``loss_check``, and on CUDA
        ``compiled_vs_eager_check`` of ``tiny_cfg``).
    """
    steps = [lambda: attention_check(T, device), lambda: loss_check(T, device)]
    if device.type == "cuda":  # compiling on CPU takes minutes: the dry run leaves this one out
        steps.append(lambda: compiled_vs_eager_check(T, tiny_cfg, device))
    results = {}
    for step in steps:
        c = step()
        results[c["name"]] = c
        print(f"{c['name']}: {'PASS' if c['passed'] else 'FAIL'} (max relative diff {c['max_rel_diff']:.2e} "
              f"vs tolerance {c['tol']}; {c['diffs']})", flush=True)
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
    import gpu_check as G  # the tiny model and the profiled shape are gpu_check's
    T = G.T
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tiny, _ = T.parse_config(G.TINY_MODEL + ["--no-bf16", "--device", device.type])
    out = {}
    if "kernels" in args.parts:
        out["kernels"] = run_checks(T, device, tiny, lambda r: write_json(args.json, dict(out, kernels=r)))
        write_json(args.json, out)
    if "profile" in args.parts:
        cfg = tiny if args.dry_run else G.profile_config(args.preset, device)
        out["profile"] = profile_step(T, cfg, device)
        pf = out["profile"]
        print(f"one step ({pf['timer']} time, seq_len {pf['seq_len']} x {pf['micro_batch_seqs']}): "
              + ", ".join(f"{k} {v:.1f} ms ({100 * pf['share'][k]:.0f}%)" for k, v in pf["ms"].items())
              + f"; max_memory_reserved {pf['max_memory_reserved_mib']} MiB", flush=True)
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    sys.exit(main())
