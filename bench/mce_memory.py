"""Peak memory and time of the trainer's loss forward+backward against plain cross-entropy, s targets per position.

    python bench/mce_memory.py                 # CPU: B*L = 8192 positions, V = 50304, s in 1, 4, 8, 16
    python bench/mce_memory.py --device cuda   # on a GPU (torch.cuda.max_memory_allocated)
    python bench/mce_memory.py --markdown      # the table as markdown

Each measurement runs in a fresh process: logits ``[N, V]`` (float32, or ``--dtype``) (a leaf that requires grad)
and targets are made first, then one forward+backward of the loss. Peak memory is what the
loss adds on top of the logits: on CPU the growth of the process's peak resident set size
(``ru_maxrss``; glibc maps big blocks with mmap, so freed memory leaves the resident set at
once), on CUDA the growth of ``max_memory_allocated``. The logits' own gradient ``[N, V]`` is
part of every loss's cost. Time is the median of ``--repeats`` forward+backward passes (ms).

Rows: ``cross_entropy`` (``F.cross_entropy`` on the logits in float32, the s = 1 baseline, no cap),
``loss_sum`` (``train_gpt.loss_sum``, the trainer's loss: record #54's sigmoid cap, s target columns of weight 1 over
one softmax, i.e. TST's multi-hot cross-entropy; float32 chunks of ``kernels.LOSS_CHUNK`` positions, the gradient
written once in the logits' dtype; divided by the label count) and ``mce_naive`` (s copies of the logits fed to
cross-entropy: what MCE must not do; up to ``--naive-up-to``), for each s. ``--dtype bfloat16`` makes the logits
bf16, as the model's head gives them on a GPU (the logits then take half the memory, and the baseline's float32 copy
of them counts as its cost).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import train_gpt  # noqa: E402

KINDS = ("cross_entropy", "loss_sum", "mce_naive")


def loss_fn(kind, logits, targets):
    """The mean loss of ``kind`` (``KINDS``) of logits ``[N, V]`` against targets int64 ``[N, s]``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "cross_entropy":
        return F.cross_entropy(logits.float(), targets[:, 0])
    if kind == "loss_sum":
        return train_gpt.loss_sum(logits, targets) / targets.numel()
    if kind == "mce_naive":
        s = targets.size(1)
        return F.cross_entropy(logits.repeat_interleave(s, dim=0), targets.flatten())
    raise ValueError(f"mce_memory.py: unknown loss {kind!r}; choose one of {', '.join(KINDS)}")


def peak_mib(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(kind, s, n, vocab, device, repeats, dtype="float32"):
    """One process's measurement: (extra peak MiB over the logits, median ms of fwd+bwd)."""
    torch.manual_seed(0)
    logits = torch.randn(n, vocab, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    targets = torch.randint(0, vocab, (n, s), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = peak_mib(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss_fn(kind, logits, targets).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
        logits.grad = None
    return peak_mib(device) - base, statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, default=8192, help="N = B * L positions")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--bag-sizes", default="1,4,8,16")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the logits' dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-up-to", type=int, default=2,
                   help="largest s for the naive row (it needs s + 2 copies of the logits)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "kind,s" measured in this process
    args = p.parse_args(argv)
    if args.one:
        kind, s = args.one.split(",")
        mib, ms = measure(kind, int(s), args.positions, args.vocab, args.device, args.repeats, args.dtype)
        print(json.dumps(dict(mib=mib, ms=ms)))
        return 0
    logits_mib = args.positions * args.vocab * (2 if args.dtype == "bfloat16" else 4) / 2**20
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # plain glibc: see above
    rows = []
    for s in [int(x) for x in args.bag_sizes.split(",")]:
        naive = ["mce_naive"] if 1 < s <= args.naive_up_to else []
        for kind in (["cross_entropy"] if s == 1 else []) + ["loss_sum"] + naive:
            out = subprocess.run([sys.executable, __file__, "--one", f"{kind},{s}", "--positions",
                                  str(args.positions), "--vocab", str(args.vocab), "--device", args.device,
                                  "--dtype", args.dtype,
                                  "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                why = (out.stderr.strip().splitlines() or [f"killed by signal {-out.returncode} (out of memory?)"])
                rows.append((kind, s, None, None, why[-1][:80]))
                continue
            r = json.loads(out.stdout)
            rows.append((kind, s, r["mib"], r["ms"], ""))
            print(f"# {kind:14s} s={s:<3d} peak +{r['mib']:8.0f} MiB  {r['ms']:8.1f} ms", file=sys.stderr)
    ce_mib = next(r[2] for r in rows if r[0] == "cross_entropy")
    print(f"positions N={args.positions}, vocab V={args.vocab}, device {args.device} "
          f"({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"{args.dtype} logits [N, V] = {logits_mib:.0f} MiB (not counted below)\n")
    head = ["loss", "s", "peak extra MiB", "x plain CE", "fwd+bwd ms"]
    lines = []
    for kind, s, mib, ms, err in rows:
        if mib is None:
            lines.append([kind, str(s), "failed", "-", err])
        else:
            lines.append([kind, str(s), f"{mib:.0f}", f"{mib / ce_mib:.2f}", f"{ms:.0f}"])
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for l in lines:
            print("| " + " | ".join(l) + " |")
    else:
        widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for l in lines:
            print("  ".join(c.rjust(w) for c, w in zip(l, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
