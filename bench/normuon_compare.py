"""Muon, NorMuon and Aurora + NorMuon on three small CPU problems: loss and the shape of the update.

    python bench/normuon_compare.py --lrs 0.08,0.16,0.32   # 20 minutes on 2 cores shared at load 15
    python bench/normuon_compare.py --markdown    # the table as markdown (docs/METHODS.md §3)

Problems (float32, seeded): ``mlp``, a student 2-layer MLP (d=32 -> 4d=128 -> 32, ReLU^2, as the
trainer's MLP) fitting a random teacher of the same shape on Gaussian inputs (MSE); ``mlp8``, the
same with an 8x expansion (256 hidden units: Aurora's authors report gains growing with it);
``lsq``, least squares ``min |X W^T - Y|^2`` for a tall ``W`` (128 x 32) whose target rows
differ in scale by 30x, so a plain polar update starves the small rows. Every variant is
``NorMuon`` with the same momentum 0.95, cautious wd 1.2, lr schedule (linear decay to 0.15)
and Nesterov; only the direction and the normalization differ:

* ``muon``: plain Polar Express, no normalization.
* ``normuon``: Polar Express, then the per-neuron normalization (record #89).
* ``aurora``: Aurora's row-equalized polar (K=2) on the non-square matrices, no normalization.
* ``aurora+normuon``: Aurora's polar, then the per-neuron normalization.

Each (variant, lr) is run on ``--seeds`` seeds; the table shows the best lr of each variant by
mean final loss. Columns: final loss (mean over seeds); ``spread``: max/min of the update's
per-neuron norms (rows of the tall matrices, i.e. the MLP's hidden units), averaged over steps;
``orth``: the update's condition number (max/min singular value; 1 = orthogonal), averaged;
``starved``: fraction of neurons whose summed update norm over the run is under 1/3 of the median.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import harness  # noqa: E402
from aurora_opt import NorMuon  # noqa: E402

PROBLEMS = ("mlp", "mlp8", "lsq")
VARIANTS = {"muon": dict(pp_iterations=0, normalize=False), "normuon": dict(pp_iterations=0, normalize=True),
            "aurora": dict(pp_iterations=2, normalize=False), "aurora+normuon": dict(pp_iterations=2, normalize=True)}


def make_problem(name, seed):
    """One seeded problem.

    Args:
        name: one of ``PROBLEMS``.
        seed: generator seed of the data, the teacher and the initial weights.

    Returns:
        ``(params, loss_fn, neuron_views)``: the trained matrices, a closure giving the normalized
        MSE, and per matrix a function mapping it to ``[neurons, fan]`` (the hidden units as rows).

    Raises:
        ValueError: an unknown ``name``.
    """
    g = torch.Generator().manual_seed(seed)
    if name in ("mlp", "mlp8"):
        d, h = 32, 128 if name == "mlp" else 256
        teacher = [torch.randn(h, d, generator=g) / d ** 0.5, torch.randn(d, h, generator=g) / h ** 0.5]
        fc = (torch.rand(h, d, generator=g) * 2 - 1) * (3 / d) ** 0.5 * 0.5
        params = [fc.requires_grad_(), torch.zeros(d, h, requires_grad=True)]
        X = torch.randn(2048, d, generator=g)

        def mlp(x, w):
            return torch.relu(x @ w[0].T).square() @ w[1].T
        Y = mlp(X, teacher)
        return params, lambda: (mlp(X, params) - Y).square().mean() / Y.square().mean(), [lambda w: w, lambda w: w.T]
    if name == "lsq":
        m, n = 128, 32
        A = torch.randn(m, n, generator=g) * torch.logspace(-1, 0.5, m)[torch.randperm(m, generator=g), None]
        X = torch.randn(1024, n, generator=g)
        Y = X @ A.T + 0.01 * torch.randn(1024, m, generator=g)
        W = torch.zeros(m, n, requires_grad=True)
        return [W], lambda: (X @ W.T - Y).square().mean() / Y.square().mean(), [lambda w: w]
    raise ValueError(f"normuon_compare.py: unknown problem {name!r}; choose mlp, mlp8 or lsq")


def run(problem, variant, lr, seed, steps):
    """Train once.

    Args:
        problem: one of ``PROBLEMS``. variant: a key of ``VARIANTS``.
        lr: peak learning rate (linear decay to 0.15 of it). seed: ``make_problem``'s seed.
        steps: optimizer steps.

    Returns:
        ``(final loss, mean spread, mean condition number, starved fraction)`` (module docstring).
    """
    params, loss_fn, views = make_problem(problem, seed)
    opt = NorMuon(params, lr=lr, **VARIANTS[variant])
    spread, cond, total = [], [], [torch.zeros(views[i](p).size(0)) for i, p in enumerate(params)]
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (1 - 0.85 * step / steps)
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (p, w0) in enumerate(zip(params, before)):
            delta = views[i](p.detach() - w0)
            norms = delta.norm(dim=1)
            total[i] += norms
            spread.append((norms.max() / norms.min().clamp_min(1e-12)).item())
            sv = torch.linalg.svdvals(delta.double())
            cond.append((sv.max() / sv.min().clamp_min(1e-30)).item())
    starved = torch.cat([(t < t.median() / 3).float() for t in total]).mean().item()
    with torch.no_grad():
        final = loss_fn().item()
    return final, sum(spread) / len(spread), sum(cond) / len(cond), starved


def parse_args(argv=None):
    """Command line: --problems, --lrs, --seeds, --steps, --markdown."""
    ap = harness._Parser(prog="normuon_compare.py", description=__doc__.split("\n")[0])  # a bad flag: one line
    ap.add_argument("--problems", default="mlp,mlp8,lsq", help="comma-separated: mlp, mlp8, lsq")
    ap.add_argument("--lrs", default="0.04,0.08,0.16,0.32", help="comma-separated learning rates to sweep")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per (variant, lr)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    bad = [p for p in args.problems.split(",") if p not in PROBLEMS]
    if bad:
        ap.error(f"--problems: unknown {bad[0]!r}; choose from {', '.join(PROBLEMS)}")
    try:
        args.lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        ap.error(f"--lrs: {args.lrs!r} is not a comma-separated list of numbers, e.g. 0.08,0.16")
    if args.seeds < 1 or args.steps < 1:
        ap.error("--seeds and --steps must be >= 1")
    return args


def main(argv=None):
    """Run the sweep and print one row per (problem, variant) at its best lr."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    lrs = args.lrs
    rows = []
    for problem in args.problems.split(","):
        for variant in VARIANTS:
            best = None
            for lr in lrs:
                runs = [run(problem, variant, lr, seed, args.steps) for seed in range(args.seeds)]
                mean = [sum(r[j] for r in runs) / len(runs) for j in range(4)]
                spread_loss = max(r[0] for r in runs) - min(r[0] for r in runs)
                if best is None or mean[0] < best[1][0]:
                    best = (lr, mean, spread_loss)
            rows.append((problem, variant, best[0], *best[1], best[2]))
    head = ["problem", "variant", "best lr", "final loss", "spread", "orth", "starved", "loss range (seeds)"]
    fmt = lambda r: [r[0], r[1], f"{r[2]:g}", f"{r[3]:.3g}", f"{r[4]:.2f}", f"{r[5]:.2f}", f"{r[6]:.2f}", f"{r[7]:.2g}"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(fmt(r)) + " |")
    else:
        print("  ".join(f"{h:>14}" for h in head))
        for r in rows:
            print("  ".join(f"{c:>14}" for c in fmt(r)))


if __name__ == "__main__":
    main()
