"""Optimizer step time of Aurora and Muon on the GPT-2-small block matrices.

    python bench/optimizer_step.py                  # CPU (minutes on 2 cores); every NS variant x Muon, Aurora K=1, K=2
    python bench/optimizer_step.py --device cuda    # on a GPU (add --compile to compile the direction)
    python bench/optimizer_step.py --markdown       # the table as markdown (for the README)
    python bench/optimizer_step.py --ns-dtype bfloat16   # Newton-Schulz in bf16 on CPU too (the GPU's dtype)

The matrices of a 12-layer, 768-wide GPT with a 3072-wide MLP: per layer q, k, v, o (768 x 768),
the MLP's fc (3072 x 768, tall) and proj (768 x 3072, wide); 72 matrices, 85M parameters.
Same-shape matrices are orthogonalized as one batched [k, m, n] call, as in training. One step
= momentum, orthogonalization, weight update, the finite check; time per step is the median of
``--steps`` steps after one warm-up step (ms). The ratio column is each row over Muon with the
same Newton-Schulz variant.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from aurora_opt import NS_COEFFICIENTS, Aurora, ns_dtype_on  # noqa: E402


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the direction computation")
    p.add_argument("--ns-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="Newton-Schulz dtype; auto = the optimizer's default (bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
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
