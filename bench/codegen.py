"""The code inductor writes for the CUDA path, read on a CPU: per compiled graph of the loss and of the model's
train step, its Triton kernels, the most exp calls and the deepest where chain in one kernel, its big float32
buffers and the bytes it moves.

    python bench/codegen.py                          # the loss at 16,384 x 1,024 and at 49,152 x 50,304 (record
                                                     # #89's stage 3), an eval piece, the cpu_smoke train step
    python bench/codegen.py --loss 4096x256 --no-eval --no-model --json out.json
    python bench/codegen.py --no-loss --no-eval      # the model's train step alone
    python bench/codegen.py --dump DIR               # also each graph's generated code, one file a graph

How: inductor's Triton backend for CPU tensors (``cpu_backend = "triton"``, ``TRITON_INTERPRET=1``) writes the
Triton kernels and the wrapper it writes for CUDA tensors (same decompositions, partitioner, fusion and buffer
plan; the launch configurations may differ). No kernel runs: the launcher is a no-op, the inputs are
``torch.empty`` (memory never touched), so a record-sized loss costs its compile time and no memory, and every
output is garbage. Extern kernels (the model's matmuls and CPU attention) do run, on garbage. The loss is called
as the model calls it (``train_gpt.loss_sum``, bf16 logits, the preset's cap, 4 weighted columns); the model
under bf16 autocast, as on a GPU (on a CPU it takes SDPA's path, not FlexAttention's, and no FP8).

Columns, per graph (fwd: the forward; bwd: the backward):
  kernels    the graph's Triton kernels
  exp        the most exp-family calls (exp, exp2, expm1, sigmoid) in one kernel's text: per element of its loop
  where      the most ``tl.where`` on one data path of a kernel (a loop over row chunks fused into one kernel
             nests one or two per chunk; masking and one weight select per column add one or two)
  f32>=NV/8  float32 buffers the graph allocates of at least N x V / 8 elements: their count and total / (N x V)
  f32 all    every float32 buffer the graph allocates (a reused one once), in elements / (N x V): a chunk loop's
             buffers of [chunk, V] add up to 1 NV; an [N] row vector is 1 / V
  GB moved   inductor's estimate of the bytes the graph's kernels read and write (``count_bytes``, the figure of
             its ``inductor_metrics`` log, with fused kernels sized by their own loops: ``kernel_bytes``), in 1e9
"""
import argparse
import atexit
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import warnings

# Before torch is imported: triton's interpreter stands in for a GPU driver, and a fresh inductor cache means
# every graph is generated here (a cached one would skip the code generation this reads).
os.environ["TRITON_INTERPRET"] = "1"
CACHE = tempfile.mkdtemp(prefix="codegen_inductor_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = CACHE
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)

import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
import torch.utils._triton  # noqa: E402
from torch._inductor.graph import GraphLowering  # noqa: E402
from torch._inductor.runtime.triton_heuristics import CachingAutotuner  # noqa: E402
from torch._inductor.scheduler import FusedSchedulerNode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import harness  # noqa: E402
import kernels  # noqa: E402
import train_gpt  # noqa: E402

RECORD_STAGE3 = (49_152, 50_304)  # record #89's stage 3: 49,152 positions a micro-step, the padded vocabulary
DEFAULT_LOSS = ((16_384, 1_024), RECORD_STAGE3)
EXP = re.compile(r"\b(?:libdevice|tl_math|tl)\.(?:exp|exp2|expm1|sigmoid)\(")
KERNEL = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)
ASSIGN = re.compile(r"^\s*(_?tmp\d+) = (.*)$", re.M)
TMP = re.compile(r"\b_?tmp\d+\b")
ALLOC = re.compile(r"(buf\d+) = empty_strided_\w+\(\(([^()]*)\), \([^()]*\), torch\.(\w+)\)")


def generate_only():
    """Inductor writes Triton kernels for CPU tensors and launches none; returns the list each compiled graph
    appends ``(wrapper code, inductor's byte estimate)`` to."""
    torch.utils._triton.triton_hash_with_backend = lambda: "CPUINTERP"  # no driver to hash: any fixed key
    inductor_config.cpu_backend = "triton"
    warnings.filterwarnings("ignore", "Could not find an active CPU backend")  # known: the kernels are not run
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    CachingAutotuner.run = lambda self, *args, **kwargs: None  # the interpreter cannot run some kernels: read only
    graphs = []
    compile_to_module = GraphLowering.compile_to_module

    def recorded(self):
        module = compile_to_module(self)
        with open(module.__file__, encoding="utf-8") as f:
            graphs.append((f.read(), sum(kernel_bytes(node) for node in self.scheduler.nodes)))
        return module
    GraphLowering.compile_to_module = recorded
    return graphs


def kernel_bytes(node):
    """Inductor's estimate of the bytes a scheduled kernel reads and writes (``get_read_write_buffers_sizes``: each
    buffer at most once, at most the elements the kernel's loops visit); for a fused kernel, whose loops it takes
    as 1e9 elements (4 GB where the record's 9.9 GB is moved), each buffer at the most one of its parts moves."""
    if not isinstance(node, FusedSchedulerNode):
        return node.get_read_write_buffers_sizes()
    inside = {name for name in node.get_buffer_names()  # written and read only within the kernel: not moved
              if all(user.node in node.snodes for user in node.scheduler.name_to_buf[name].users)}
    moved = {}
    for part in node.snodes:
        for name, nbytes in part.get_read_write_buffer_accesses(include_reads=True, include_writes=True).items():
            if name not in inside:
                moved[name] = max(moved.get(name, 0), nbytes)
    return sum(moved.values())


def where_depth(body):
    """The most ``tl.where`` on one chain of assignments in a kernel's text (a loop's accumulator feeds itself)."""
    depth = {}
    for name, rhs in ASSIGN.findall(body):
        inputs = [depth.get(t, 0) for t in TMP.findall(rhs) if t != name]
        depth[name] = max(inputs, default=0) + rhs.count("tl.where(")
    return max(depth.values(), default=0)


def analyse(code, nbytes, nv):
    """One graph's row: kernels, the most exp and where depth of one kernel, float32 buffers >= nv / 8, bytes."""
    kernels = KERNEL.findall(code)
    f32 = []
    for _, sizes, dtype in ALLOC.findall(code):
        dims = [d.strip() for d in sizes.split(",") if d.strip()]
        if dtype == "float32" and all(d.isdigit() for d in dims):  # static shapes only (compiled dynamic=False)
            f32.append(math.prod(int(d) for d in dims))
    big = [numel for numel in f32 if numel * 8 >= nv]
    backward = "tangents_" in code.split("def call(", 1)[-1]  # the wrapper's inputs: a backward takes the tangents
    return dict(kernels=len(kernels), exp=max((len(EXP.findall(k)) for _, k in kernels), default=0),
                where=max((where_depth(k) for _, k in kernels), default=0), f32_big=len(big),
                f32_big_nv=sum(big) / nv, f32_all_nv=sum(f32) / nv, gb=nbytes / 1e9, backward=backward)


def loss_of(cap):
    """The loss the model calls (``train_gpt.loss_sum``: the sigmoid cap), or the same loss under the tanh (15) or no
    cap (``kernels.multi_target_loss``)."""
    if cap == "sigmoid":
        return train_gpt.loss_sum
    return lambda x, t, w: kernels.multi_target_loss(x, t, torch.ones(t.size(-1)) if w is None else w,
                                                     cap=cap, softcap=15.0 if cap == "tanh" else 0.0)


def loss_case(n, v, loss, train=True):
    """``loss_sum`` on bf16 logits ``[n, v]``, compiled: forward and backward (``train``, 4 weighted columns) or the
    metric's no-grad forward (one column, as eval calls it on pieces of the logits)."""
    logits = torch.empty(n, v, dtype=torch.bfloat16, requires_grad=train)
    targets = torch.zeros(n, 4 if train else 1, dtype=torch.int64)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25]) if train else None
    fn = torch.compile(loss, fullgraph=True, dynamic=False)
    if train:
        fn(logits, targets, weights).backward()
    else:
        with torch.no_grad():
            fn(logits, targets, weights)


def model_case(preset):
    """One micro-step of ``preset``'s model (``build_model`` in bf16 as a CUDA run builds it, the record's 4 weighted
    columns), compiled as the trainer compiles it; returns N x V of its logits."""
    cfg, _, _ = harness.parse_flags(train_gpt.Config, train_gpt.PRESETS, ["--preset", preset])
    model = train_gpt.build_model(dataclasses.replace(cfg, fp8=False), train_gpt.MODELS[cfg.model], torch.bfloat16)
    train_gpt.adam_bf16_(model)
    L, V = cfg.seq_len, model.lm_head.weight.size(0)
    inputs = torch.randint(0, 50_257, (1, L, 1))
    targets = train_gpt.objective_targets(inputs[..., 0], train_gpt.prefix_token_table(V))
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    loss = torch.compile(model, dynamic=False)(inputs, targets, weights)
    loss.backward()
    return L * V


def cases(args):
    """``[(name, N x V, run)]`` the flags ask for."""
    loss = loss_of(args.cap)
    out = [(f"loss {n}x{v} {args.cap}", n * v, lambda n=n, v=v: loss_case(n, v, loss)) for n, v in args.loss
           if args.losses]
    if args.eval:
        n, v = train_gpt.VAL_PIECE, RECORD_STAGE3[1]
        out.append((f"eval piece {n}x{v} {args.cap}", n * v, lambda: loss_case(n, v, loss, train=False)))
    if args.model:
        out.append((f"model {args.model}", None, lambda: model_case(args.model)))
    return out


def shape(text):
    """``NxV`` -> (N, V)."""
    try:
        n, v = (int(x) for x in text.lower().split("x"))
        if n < 1 or v < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positions x vocabulary, e.g. 16384x1024") from None
    return n, v


def table(rows):
    """The rows as aligned text."""
    head = ["case", "graph", "kernels", "exp", "where", "f32>=NV/8", "f32 all", "GB moved"]
    lines = [[r["case"], "bwd" if r["backward"] else "fwd", str(r["kernels"]), str(r["exp"]), str(r["where"]),
              f"{r['f32_big']} ({r['f32_big_nv']:.2f} NV)", f"{r['f32_all_nv']:.3f} NV", f"{r['gb']:.3g}"]
             for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(l, widths)))
                     for l in [head] + lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", type=shape, action="append", help="a loss shape NxV (repeatable; default "
                   + ", ".join(f"{n}x{v}" for n, v in DEFAULT_LOSS) + ")")
    p.add_argument("--no-loss", dest="losses", action="store_false", help="skip the training loss alone")
    p.add_argument("--cap", default="sigmoid", choices=("sigmoid", "tanh", "none"), help="the logits' cap")
    p.add_argument("--no-eval", dest="eval", action="store_false", help="skip the eval piece (no-grad forward)")
    p.add_argument("--model", default="cpu_smoke", help="the preset whose train step to compile (default "
                   "cpu_smoke: a record preset's model would build its full size on the CPU)")
    p.add_argument("--no-model", dest="model", action="store_const", const=None, help="skip the model")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--dump", help="also write each graph's generated code into this folder")
    args = p.parse_args(argv)
    args.loss = args.loss or list(DEFAULT_LOSS)
    if args.model and args.model not in train_gpt.PRESETS:
        p.error(f"--model {args.model}: no such preset; give one of {', '.join(train_gpt.PRESETS)}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: its folder does not exist; give a path in an existing folder")
    if args.dump and os.path.exists(args.dump) and not os.path.isdir(args.dump):
        p.error(f"--dump {args.dump}: a file, not a folder; give a folder (made if missing)")
    graphs, rows = generate_only(), []
    for name, nv, run in cases(args):
        torch._dynamo.reset()
        first = len(graphs)
        nv = run() or nv
        for i, (code, nbytes) in enumerate(graphs[first:]):
            rows.append(dict(case=name, nv=nv, **analyse(code, nbytes, nv)))
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                path = os.path.join(args.dump, re.sub(r"\W+", "_", name) + f"_{i}.py")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(code)
        print(f"# {name}: {len(graphs) - first} graphs", file=sys.stderr)
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
