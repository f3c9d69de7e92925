"""Step time of the trainer's matrix optimizer (NorMuon, or Aurora's polar on the MLP matrices) and its call count.

    python bench/optimizer_step.py                          # CPU, record #89's block matrices (minutes on 2 cores)
    python bench/optimizer_step.py --device cuda --compile  # on a GPU, compiled as the trainer runs it
    python bench/optimizer_step.py --model smoke --markdown # the smoke model's matrices; a markdown table
    python bench/optimizer_step.py --count-calls record_h200   # compiled calls per step of a preset (seconds)

The timing builds the model of ``--model`` on the meta device, makes only its block matrices real (the ones
``train_gpt.build_optimizers`` gives NorMuon: per attention layer q, k, v, o; per layer the MLP's fc and proj),
builds the optimizers as the trainer does for ``--optimizer normuon`` and ``aurora_normuon``, and times
``NorMuon.step()`` on random gradients: momentum, the polar factor of each same-shape bucket (Newton-Schulz in
bf16 on CUDA, float32 on a CPU), normalization and the cautious step. Time per step is the median of ``--steps``
steps after one warm-up step (which also compiles, with ``--compile``); TFLOP/s counts ``optimizer_flops``.

``--count-calls PRESET`` times nothing: it builds the preset's model on the meta device (no memory), its
optimizers as train_gpt.py does, and counts per step the calls of the functions the trainer compiles
(``_direction``, ``_finish``, ``_accumulate``) and the eager aten ops outside them, after two steps that make the
state: now (batched by shape, issue 44) and before (e6fff65: one ``_finish`` per matrix and per Adam parameter,
the same directions, no ``_accumulate``).
"""
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import harness  # noqa: E402
import train_gpt as T  # noqa: E402
from aurora_opt import NorMuon, ns_dtype_on  # noqa: E402

OPTIMIZERS = ("normuon", "aurora_normuon")  # train_gpt.Config.optimizer's choices


def config_of(argv):
    """The trainer's Config of command-line words (its own parser and checks)."""
    cfg, _, _ = harness.parse_flags(T.Config, T.PRESETS, argv)
    T.check_config(cfg)
    return cfg


def matrix_optimizer(cfg, device, compile_):
    """``(NorMuon, its matrices)`` of ``cfg``'s model as ``train_gpt.build_optimizers`` makes it, the block matrices
    real on ``device`` (uniform, std 0.5/sqrt(fan_in)) with N(0, 1) gradients; everything else stays on the meta
    device (the CautiousAdam beside it is never stepped).

    Args:
        cfg: a train_gpt Config (its --model and --optimizer matter). device: torch.device of the matrices.
        compile_: compile the optimizer's direction and finish, as the trainer with --compile.

    Returns:
        ``(NorMuon, [parameters])``.
    """
    with torch.device("meta"):
        model = T.build_model(cfg, T.MODELS[cfg.model])
    tags = {n: (p.opt_group, p.adam_role) for n, p in model.blocks.named_parameters()}
    model.blocks.to_empty(device=device)  # new parameters: their routing tags put back
    for n, p in model.blocks.named_parameters():
        T.route(p, *tags[n])
    _, normuon = T.build_optimizers(model, cfg, compile=compile_)
    params = [p for g in normuon.param_groups for p in g["params"]]
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in params:
            bound = 3 ** 0.5 * 0.5 / p.size(1) ** 0.5
            p.uniform_(-bound, bound, generator=gen)
            p.grad = torch.randn(p.shape, device=device, generator=gen)
    return normuon, params


def time_step(opt, device, steps):
    """Median ms of ``opt.step()`` over ``steps`` steps, after one untimed step (the compile, if any)."""
    times = []
    for i in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
    cfg = config_of(["--preset", preset])
    with torch.device("meta"):
        model = T.build_model(cfg, T.MODELS[cfg.model])
    T.adam_bf16_(model)  # as a CUDA run stores them
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


def timing_rows(model, device, steps, compile_):
    """``[[optimizer, matrices, step ms, TFLOP/s, x normuon]]`` for each ``OPTIMIZERS`` entry on ``model``'s block
    matrices (``matrix_optimizer``, ``time_step``; FLOPs: ``train_gpt.optimizer_flops``)."""
    rows, base = [], None
    for name in OPTIMIZERS:
        cfg = config_of(["--model", model, "--optimizer", name])
        opt, params = matrix_optimizer(cfg, device, compile_)
        ms = time_step(opt, device, steps)
        base = base or ms
        rows.append([name, f"{len(params)} ({sum(p.numel() for p in params) / 1e6:.1f}M)", f"{ms:.0f}",
                     f"{T.optimizer_flops(cfg, T.MODELS[cfg.model]) / (ms / 1e3) / 1e12:.3g}", f"{ms / base:.2f}"])
        print(f"# {name:15s} {ms:8.0f} ms", file=sys.stderr)
        del opt, params
    return rows


def main(argv=None):
    p = harness._Parser(prog="optimizer_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="record", help="train_gpt.MODELS entry whose block matrices are stepped")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported), after one untimed")
    p.add_argument("--compile", action="store_true", help="torch.compile the optimizer, as the trainer on a GPU")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--count-calls", metavar="PRESET", help="count the compiled calls per step of a train_gpt.py "
                   "preset's optimizers (meta device, no timing) and exit")
    args = p.parse_args(argv)
    if args.count_calls:
        if args.count_calls not in T.PRESETS:
            p.error(f"--count-calls {args.count_calls!r}: not a preset; choose one of {', '.join(T.PRESETS)}")
        print("\n".join(count_calls(args.count_calls)))
        return 0
    if args.model not in T.MODELS:
        p.error(f"--model {args.model!r}: choose one of {', '.join(T.MODELS)}")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu")
    device = torch.device(args.device)
    rows = timing_rows(args.model, device, args.steps, args.compile)
    print(f"model {args.model}, device {args.device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"compile {args.compile}, Newton-Schulz dtype {ns_dtype_on(device)}; median of {args.steps} step(s)\n")
    head = ["optimizer", "matrices", "step ms", "TFLOP/s", "x normuon"]
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + rows:
            print("  ".join(f"{c:>16s}" for c in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
