"""Optimizer step time of Aurora and Muon on the GPT-2-small block matrices.

    python bench/optimizer_step.py                  # CPU (minutes on 2 cores); every NS variant x Muon, Aurora K=1, K=2
    python bench/optimizer_step.py --device cuda    # on a GPU (add --compile to compile the direction)
    python bench/optimizer_step.py --markdown       # the table as markdown (for the README)
    python bench/optimizer_step.py --ns-dtype bfloat16   # Newton-Schulz in bf16 on CPU too (the GPU's dtype)
    python bench/optimizer_step.py --count-calls record_h200   # compiled calls per step of a preset (seconds)

The matrices of a 12-layer, 768-wide GPT with a 3072-wide MLP: per layer q, k, v, o (768 x 768),
the MLP's fc (3072 x 768, tall) and proj (768 x 3072, wide); 72 matrices, 85M parameters.
Same-shape matrices are orthogonalized as one batched [k, m, n] call, as in training. One step
= momentum, orthogonalization, weight update, the finite check; time per step is the median of
``--steps`` steps after one warm-up step (ms). The ratio column is each row over Muon with the
same Newton-Schulz variant.

``--count-calls PRESET`` times nothing: it builds the preset's model on the meta device (no memory), its
optimizers as train_gpt.py does, and counts per step the calls of the functions the trainer compiles
(``_direction``, ``_finish``, ``_accumulate``) and the eager aten ops outside them, after two steps that make the
state: now (batched by shape, issue 44) and before (e6fff65: one ``_finish`` per matrix and per Adam parameter,
the same directions, no ``_accumulate``).
"""
import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from aurora_opt import NS_COEFFICIENTS, Aurora, NorMuon, ns_dtype_on  # noqa: E402


def gpt2_small_matrices(device, n_layer=12, d=768, hidden=3072):
    shapes = [(d, d)] * 4 + [(hidden, d), (d, hidden)]
    return [torch.randn(*s, device=device, requires_grad=True) for _ in range(n_layer) for s in shapes]


def time_step(params, device, steps, **kw):
    """Median ms of one optimizer step (after a warm-up step that also compiles, if asked)."""
    opt = Aurora(params, **kw)
    g = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g)
    times = []
    for i in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


class _EagerOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched while ``self.outside`` is true (the step's eager ops)."""

    def __init__(self):
        super().__init__()
        self.outside, self.ops = True, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.outside:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_calls(preset):
    """Compiled-function calls and eager ops per optimizer step of ``preset``'s parameters, now and before.

    Args:
        preset: a train_gpt.py preset name.

    Returns:
        Lines of text: per step kind (Adam accumulating or updating), the calls of each optimizer now and the
        per-parameter count of e6fff65, then the eager ops outside the compiled functions now.
    """
    import train_gpt as T
    cfg, _ = T.parse_config(["--preset", preset])
    with torch.device("meta"):
        model = T.GPT(cfg)
    if cfg.adam_bf16:  # as a CUDA run stores them
        T.adam_bf16_(model)
    opts = T.build_optimizers(model, cfg)
    mode, calls = _EagerOps(), collections.Counter()
    for opt in opts:
        for name in ("_direction", "_finish", "_accumulate"):
            if hasattr(opt, name):
                setattr(opt, name, _counted(getattr(opt, name), (type(opt).__name__, name), calls, mode))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    for opt in opts:  # two steps: every state made, CautiousAdam's sum and update calls both seen
        opt.step()
        opt.step()
    lines = [f"{preset}: {sum(len(g['params']) for o in opts for g in o.param_groups)} parameters"]
    for kind in ("accumulate", "update"):
        calls.clear()
        mode.ops.clear()
        with mode:
            for opt in opts:
                opt.step()
        for opt in opts:
            name = type(opt).__name__
            now = {f: n for (o, f), n in sorted(calls.items()) if o == name}
            lines.append(f"  Adam {kind:10s} step, {name:12s} compiled calls now {sum(now.values()):3d} {now}, "
                         f"before {_per_parameter_calls(opt, kind)}")
        launches = {k: n for k, n in mode.ops.items() if not k.startswith(("view", "slice", "_record_function"))}
        lines.append(f"  Adam {kind:10s} step: eager ops outside them now {sum(mode.ops.values())} "
                     f"(launching: {dict(sorted(launches.items()))})")
    return lines


def _counted(fn, key, calls, mode):
    """``fn`` counting its calls under ``key``, its own aten ops not counted as eager ones."""
    def wrapped(*args):
        calls[key] += 1
        mode.outside = False
        try:
            return fn(*args)
        finally:
            mode.outside = True
    return wrapped


def _per_parameter_calls(opt, kind):
    """Compiled calls per step at e6fff65: a direction per block-shape bucket and a finish per matrix (NorMuon),
    a finish per parameter on an update step (CautiousAdam)."""
    if isinstance(opt, NorMuon):
        return sum(len(b) for b in opt._by_shape) + sum(len(g["params"]) for g in opt.param_groups)
    return sum(len(g["params"]) for g in opt.param_groups) if kind == "update" else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the direction computation")
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="Newton-Schulz dtype; auto = the optimizer's default (bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--count-calls", metavar="PRESET", help="count the compiled calls per step of a train_gpt.py "
                   "preset's optimizers (meta device, no timing) and exit")
    args = p.parse_args(argv)
    if args.count_calls:
        import train_gpt as T
        if args.count_calls not in T.PRESETS:
            p.error(f"--count-calls {args.count_calls!r}: not a preset; choose one of {', '.join(T.PRESETS)}")
        print("\n".join(count_calls(args.count_calls)))
        return 0
    params = gpt2_small_matrices(args.device)
    ns_dtype = None if args.ns_dtype == "auto" else getattr(torch, args.ns_dtype)
    rows = []
    for ns in NS_COEFFICIENTS:
        muon_ms = None
        for name, K in (("muon", 0), ("aurora K=1", 1), ("aurora K=2", 2)):
            ms = time_step(params, args.device, args.steps, ns=ns, pp_iterations=K, compile=args.compile,
                           ns_dtype=ns_dtype)
            muon_ms = muon_ms or ms
            rows.append([ns, name, f"{ms:.0f}", f"{ms / muon_ms:.2f}"])
            print(f"# {ns:14s} {name:11s} {ms:8.0f} ms", file=sys.stderr)
    n_params = sum(p.numel() for p in params)
    print(f"{len(params)} matrices ({n_params / 1e6:.1f}M parameters), device {args.device} "
          f"({torch.get_num_threads()} threads), torch {torch.__version__}, compile {args.compile}, "
          f"Newton-Schulz dtype {ns_dtype_on(params[0].device, ns_dtype)}\n")
    head = ["ns", "optimizer", "step ms", "x Muon"]
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + rows:
            print(f"{r[0]:>14s}  {r[1]:>11s}  {r[2]:>8s}  {r[3]:>6s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
