"""Fast paths of the speedrun beside train_gpt.py: fused losses, FP8 matmuls, the bucketed
all-reduce, RoPE with YaRN, attention masks (one mask definition for FlexAttention and SDPA) and the
FlexAttention backend.

Each is exact math with a reference test (tests/test_objectives.py, test_fp8.py,
test_grad_allreduce.py, test_attention.py, test_block_mask.py); nothing here imports the trainer.
Record numbers: modded-nanogpt's table.
"""
import importlib.util
import math
import typing
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# torch 2.13 deprecates these two for *_single names that torch 2.11 (the lent GPU box's) lacks;
# both versions run them
warnings.filterwarnings(
    "ignore",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    FutureWarning)

IGNORE_INDEX = -100  # a label that counts nowhere (padding, the positions past a document's end)
# A multi-token label past the sequence's end (multi_target_loss): no loss term, but its weight
# stays in the gradient's softmax term, which reproduces record #53's gradient (its kernel's S_w
# sums every column's weight at every position)
PAST_END = -101


def upcast(x):
    """x in float32, or float64 if it already is (so float64 reference runs stay float64)."""
    return x if x.dtype == torch.float64 else x.float()


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
E5M2_MAX = torch.finfo(torch.float8_e5m2).max    # 57344


def fp8_unavailable_reason(device):
    """Why ``--fp8`` cannot run on ``device`` (``_scaled_mm`` needs CUDA 8.9+), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8 matmuls need a CUDA GPU (device is {device.type}); running without fp8"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"fp8 matmuls need compute capability 8.9+ ({name} is "
                f"{major}.{minor}); running without fp8")
    return None


def fp8_scale(t, fp8_max=E4M3_MAX):
    """Current scale ``amax(|t|) / fp8_max``, float32 0-d on t's device; no sync (record #84)."""
    return upcast(t.detach()).abs().amax().float().clamp_min(1e-12) / fp8_max


# The LM head's fixed scales (x, w, grad) (record #89, 2026-07-17): no amax is read, since the
# bounds are known: RMS-normed inputs stay under 100 (sqrt(768) = 28), the head's weights under
# 1.6, each logit's gradient of the loss sum under 96 (e5m2's 57344 x 0.75/448). The trainer
# divides the grad scale by its loss divisor (GPT.set_loss_divisor), as the record's grad_s x
# 1/grad_accum_steps.
HEAD_SCALES = (100 / E4M3_MAX, 1.6 / E4M3_MAX, 0.75 / E4M3_MAX)
# Delayed scales of the MLP down-projection (record #89's quantize_mlp_fp8 and triton_kernels.py's
# reduce_mlp_activation_scales): each is known before its matmul, so no amax pass runs in front of
# it; the headroom covers a tensor's growth since its amax was read.
DOWN_ACT_HEADROOM = 1.80  # the input (relu^2): the previous training forward's amax x 1.80
DOWN_WEIGHT_HEADROOM = 1.12  # the weight: its amax before the last optimizer step x 1.12
DOWN_BOOTSTRAP_STEPS = 16  # at init and after each of the first 16 steps: the weight's own amax x 1


def down_scales(device=None):
    """The delayed state of one MLP down-projection: float32 ``[3]`` (input scale, weight scale,
    next weight scale); the input's starts at 1 (modded-nanogpt's buffer init), the weight's are set
    by ``refresh_down_scales_``."""
    return torch.ones(3, dtype=torch.float32, device=device)


@torch.no_grad()
def delay_input_scale_(scales, h):
    """After a training forward: the next forward's input scale
    ``max(amax(h), 1e-12) x 1.80 / 448`` into ``scales[0]`` (device ops: no sync)."""
    amax = upcast(h.detach()).abs().amax().float().clamp_min(1e-12)
    scales[0].copy_(amax * (DOWN_ACT_HEADROOM / E4M3_MAX))


@torch.no_grad()
def refresh_down_scales_(scales, weight, bootstrap):
    """After an optimizer step (modded-nanogpt's ``quantize_mlp_fp8``, record #89): the weight scale
    ``scales[1]`` the coming forwards use is the one computed at the previous refresh
    (``scales[2]``), or with ``bootstrap`` the weight's own ``amax / 448``; then
    ``scales[2] = amax x 1.12 / 448`` of the weight now."""
    amax = upcast(weight.detach()).abs().amax().float().clamp_min(1e-12)
    scales[1].copy_(amax / E4M3_MAX if bootstrap else scales[2])
    scales[2].copy_(amax * (DOWN_WEIGHT_HEADROOM / E4M3_MAX))


def fp8_quantize(t, scale, dtype=torch.float8_e4m3fn):
    """``t / scale`` saturated to ``dtype``'s max (no NaN on overflow, as the records), rounded
    to nearest."""
    limit = torch.finfo(dtype).max
    return (upcast(t) / scale).clamp(-limit, limit).to(dtype)


# The FP8 head's weight gradient [V, d]: "gx" computes g^T x (M = V), "xg" (x^T g)^T (M = d,
# modded-nanogpt's). Same math; which is faster is cuBLASLt's business: bench/gpu_check.py times
# both (its head_grad_layout row).
HEAD_GRAD_LAYOUT = "gx"


@torch.library.custom_op("train_gpt::scaled_mm", mutates_args=())
def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_mm(a, b.T)`` (cuBLASLt) as an op the compiler cannot see into: inductor
    would lower ``_scaled_mm`` with its own templates and autotune them against cuBLAS during the
    cold compile; as a custom op it is one extern call (modded-nanogpt keeps its FP8 matmuls in
    custom ops too). The quantizing around it stays in the graph, where inductor fuses it."""
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_scale, scale_b=b_scale,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


@scaled_mm.register_fake
def _scaled_mm_fake(a, b, a_scale, b_scale, out_dtype, fast_accum):
    """For tracing (fake and meta tensors): ``scaled_mm``'s ``[M, N]`` of ``out_dtype``."""
    return a.new_empty((a.size(0), b.size(0)), dtype=out_dtype)


def fp8_mm(a, a_scale, b, b_scale, out_dtype, fast_accum=False, emulate=False):
    """``(a a_scale) @ (b b_scale).T`` for fp8 ``a [M, R]``, ``b [N, R]`` -> ``[M, N]`` by
    ``scaled_mm`` (the forward's and both backward matmuls); ``emulate``: the same product in
    ``out_dtype`` from the fp8 values (CPU tests)."""
    if emulate:
        scale = a_scale.to(out_dtype) * b_scale.to(out_dtype)
        return (a.to(out_dtype) @ b.to(out_dtype).t()) * scale
    return scaled_mm(a, b, a_scale, b_scale, out_dtype, fast_accum)


class _FP8Linear(torch.autograd.Function):
    """``y = x @ w.T``, x and w in e4m3 at per-tensor scales, given or current (``fp8_linear``)."""

    @staticmethod
    def forward(ctx, x, w, fp8_grad, emulate, scales):
        if scales is None:
            x_s = fp8_scale(x)
            w_s = fp8_scale(w)
        else:
            x_s = scales[0]
            w_s = scales[1]
        g_s = (scales[2],) if scales is not None and scales.numel() > 2 else ()
        x_f8 = fp8_quantize(x, x_s)
        w_f8 = fp8_quantize(w, w_s)
        out = upcast(x).dtype if emulate else torch.bfloat16
        ctx.fp8_grad = fp8_grad
        ctx.emulate = emulate
        ctx.dtypes = (x.dtype, w.dtype)
        if fp8_grad:  # the head (record #21): the backward reads the fp8 copies, half bf16's bytes
            ctx.save_for_backward(x_f8, w_f8, x_s, w_s, *g_s)
        else:  # the MLP (records #84, #89): the backward stays in bf16 (high precision if emulated)
            ctx.save_for_backward(*((x, w) if emulate else (x.bfloat16(), w.bfloat16())))
        return fp8_mm(x_f8, x_s, w_f8, w_s, out, fast_accum=True, emulate=emulate)

    @staticmethod
    def backward(ctx, grad):
        x_dtype, w_dtype = ctx.dtypes
        if not ctx.fp8_grad:
            x, w = ctx.saved_tensors
            g = grad.to(x.dtype)
            return (g @ w).to(x_dtype), (g.t() @ x).to(w_dtype), None, None, None
        x_f8, w_f8, x_s, w_s, *fixed = ctx.saved_tensors
        # gradients in e5m2 (wider range, fewer mantissa bits: record #21): the fixed scale where
        # given (the loss is a sum, so the bound is known), else the gradient's own amax (a mean's
        # gradient over a device count)
        g_s = fixed[0] if fixed else fp8_scale(grad, E5M2_MAX)
        g_f8 = fp8_quantize(grad, g_s, torch.float8_e5m2)
        out = upcast(grad).dtype if ctx.emulate else torch.bfloat16
        grad_x = fp8_mm(g_f8, g_s, w_f8.t(), w_s, out, emulate=ctx.emulate)  # [M, in]
        # dW out in float32: not rounded to bf16 before it takes the weight's dtype
        out_w = upcast(grad).dtype if ctx.emulate else torch.float32
        if HEAD_GRAD_LAYOUT == "xg":  # (x^T g)^T: M = in, then transposed back
            grad_w = fp8_mm(x_f8.t(), x_s, g_f8.t(), g_s, out_w, emulate=ctx.emulate).t()
        else:  # g^T x: M = out
            grad_w = fp8_mm(g_f8.t(), g_s, x_f8.t(), x_s, out_w, emulate=ctx.emulate)  # [out, in]
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None


def fp8_linear(x, weight, fp8_grad=False, emulate=False, scales=None):
    """``F.linear(x [..., in], weight [out, in])``, both in e4m3 (saturated), bf16 out (records
    #21, #84, #89).

    ``scales``: None, every scale current (``amax / max``); or float32 ``[2]`` (x, w) or ``[3]``
    (x, w, grad) per-tensor scales used as they are (record #89's fixed ``HEAD_SCALES``, the delayed
    ``down_scales``): the e4m3 value is ``x / scales[0]``. ``fp8_grad`` (the LM head, record #21):
    the output gradient in e5m2 (at ``scales[2]`` or current), dx and dW from the e4m3 copies; else
    (the MLP) dx, dW in bf16. ``emulate``: the same roundings, products in float32 (float64), for
    CPU tests.
    """
    y = _FP8Linear.apply(x.reshape(-1, x.size(-1)), weight, fp8_grad, emulate, scales)
    return y.view(*x.shape[:-1], weight.size(0))


def fp8_fits(x, weight):
    """Whether ``x @ weight.T`` fits ``torch._scaled_mm``'s shapes: every dim a multiple of 16."""
    return x.numel() // x.size(-1) % 16 == 0 and x.size(-1) % 16 == 0 and weight.size(0) % 16 == 0


def fp8_active(on, x, weight):
    """Whether a ``--fp8`` matmul runs in FP8: flag on, a training forward (grad enabled: val stays
    bf16, as the records evaluate), x on CUDA, shapes that ``torch._scaled_mm`` takes."""
    return on and torch.is_grad_enabled() and x.is_cuda and fp8_fits(x, weight)


# One loss for every objective on the logits, training and the metric: any number of weighted
# targets per position over one capped softmax. TST's MCE is s targets of weight 1 (plain CE:
# s = 1); multi-token prediction (modded-nanogpt record #53, 2025-12-22) and the prefix token
# (record #88, 2026-07-13) add columns. Compiled, the loss is two kernels (the rows' logsumexp; the
# gradient, one exp per logit, written once in the logits' dtype) and keeps no float32 [N, V]:
# bench/codegen.py prints inductor's code for it.

# eager only: positions per pass, so the float32 temporaries are [LOSS_CHUNK, V], never [N, V]
LOSS_CHUNK = 1024
LOGIT_CAPS = ("none", "tanh", "sigmoid")
# z = A sigmoid((x + B) / C), in (0, A): record #54's (A, B, C) (2025-12-26); A = 23 is under
# SHIFT_LIMIT, so its logsumexp needs no max pass
SIGMOID_CAP = (23.0, 5.0, 7.5)
# a cap z <= b with b <= 40 shifts the logsumexp by b: exp(z - b) >= exp(-80), a normal float32
SHIFT_LIMIT = 40.0


def _cap_(x, cap, softcap):
    """Cap ``x`` in place: ``(u, a)`` with capped logits ``a u``: none (x, 1), tanh (tanh(x / c),
    c: Gemma 2), sigmoid (sigmoid((x + B) / C), A: record #54, 2025-12-26)."""
    if cap == "tanh":
        return x.div_(softcap).tanh_(), softcap
    if cap == "sigmoid":
        A, B, C = SIGMOID_CAP
        return x.add_(B).div_(C).sigmoid_(), A
    return x, 1.0


def _times_slope_(g, u, cap):
    """``g * dz/dx`` in place, from ``u`` of ``_cap_`` (overwritten): no temporary, and no addcmul_
    (compiled, its decomposition's copy_ made the partitioner keep sigma for the backward: float32
    [N, V])."""
    if cap == "tanh":
        return g.mul_(u.mul_(u).neg_().add_(1.0))              # 1 - tanh^2
    if cap == "sigmoid":
        A, _, C = SIGMOID_CAP
        return g.mul_(u).mul_(u.neg_().add_(1.0)).mul_(A / C)  # (A / C) g sigma (1 - sigma)
    return g


def _lse_shift(cap, softcap):
    """The capped logits' upper bound, the logsumexp's shift (no max pass); None: the row max."""
    bound = {"sigmoid": SIGMOID_CAP[0], "tanh": softcap}.get(cap)
    return bound if bound is not None and bound <= SHIFT_LIMIT else None


def _row_lse(x, acc, cap, softcap):
    """``logsumexp(z_n)`` of rows ``x`` ``[n, V]`` in ``acc`` (float32 or float64) -> ``[n]``; z in
    (-b, b) (tanh) or (0, b) (sigmoid): one pass of ``exp(z - b)`` terms in ``(exp(-2b), 1]``."""
    u, a = _cap_(x.to(acc, copy=True), cap, softcap)
    z = u if cap == "none" else u.mul_(a)
    shift = _lse_shift(cap, softcap)
    if shift is None:
        return torch.logsumexp(z, dim=-1)
    return z.sub_(shift).exp_().sum(-1).log_().add_(shift)


def _logit_grad(x, lse, index, w, w_soft, cap, softcap):
    """The loss's gradient at rows ``x`` ``[n, V]``, in x's dtype:
    ``dz/dx (W_n exp(z - lse_n) - sum_j w_nj [v == y_nj])``; ``lse``, ``w_soft`` (W_n) ``[n]`` and
    ``w`` ``[n, J]`` in float32 (float64), times the incoming gradient. Compiled, elementwise (J
    compares, no scatter): one kernel, one exp a logit (+1: sigmoid)."""
    u, a = _cap_(x.to(lse.dtype, copy=True), cap, softcap)
    z = u if cap == "none" else u * a
    g = z.sub_(lse[:, None]).exp_().mul_(w_soft[:, None])
    if torch.compiler.is_compiling():  # J compares fuse into one kernel (a scatter needs g stored)
        column = torch.arange(x.size(-1), device=x.device)
        for j in range(index.size(-1)):                        # repeated labels add up
            g.sub_(torch.where(column == index[:, j, None], w[:, j, None], 0.0))
    else:  # eager: n J values put in place, not J passes over [n, V] (twice the loss's CPU time)
        rows = torch.arange(x.size(0), device=x.device)[:, None].expand_as(index)
        g.index_put_((rows, index), -w, accumulate=True)       # repeated labels add up
    return _times_slope_(g, u, cap).to(x.dtype)


class _LossSum(torch.autograd.Function):
    """Sum over positions n and valid targets j of ``w_j (logsumexp(z_n) - z_n[y_nj])``.

    Saves the logits as given (bf16 on a GPU), the float32 row ``lse`` ``[N]`` and the ``[N, J]``
    targets and weights; the backward recomputes ``z`` from the logits. Compiled: one pass over all
    rows each way; eager: passes of ``chunk`` rows over the same functions, so a CPU holds float32
    ``[chunk, V]`` at most.
    """

    @staticmethod
    def forward(ctx, logits, targets, weights, cap, softcap, chunk):
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        valid = targets >= 0
        index = targets.clamp_min(0)
        w = torch.where(valid, weights.to(acc), 0.0)  # [N, J]: 0 for absent labels
        in_softmax = valid | (targets == PAST_END)  # PAST_END: no loss term, a softmax weight
        w_soft = torch.where(in_softmax, weights.to(acc), 0.0).sum(-1)  # [N]: W_n
        step = logits.size(0) if torch.compiler.is_compiling() else chunk
        starts = range(0, logits.size(0), step)
        lse = torch.cat([_row_lse(logits[a:a + step], acc, cap, softcap) for a in starts])  # [N]
        u, scale = _cap_(logits.gather(1, index).to(acc, copy=True), cap, softcap)
        ctx.cap = cap
        ctx.softcap = softcap
        ctx.chunk = chunk
        ctx.save_for_backward(logits, lse, index, w, w_soft)
        return (w * (lse[:, None] - u * scale)).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, index, w, w_soft = ctx.saved_tensors
        cap = ctx.cap
        softcap = ctx.softcap
        w = w * grad
        w_soft = w_soft * grad
        # compiled: all rows in one call (inductor would fuse a chunk loop into one kernel that
        # repeats every chunk)
        if torch.compiler.is_compiling():
            grad_logits = _logit_grad(logits, lse, index, w, w_soft, cap, softcap)
            return grad_logits, None, None, None, None, None
        out = torch.empty_like(logits)
        for a in range(0, logits.size(0), ctx.chunk):
            b = a + ctx.chunk
            out[a:b] = _logit_grad(logits[a:b], lse[a:b], index[a:b], w[a:b], w_soft[a:b],
                                   cap, softcap)
        return out, None, None, None, None, None


def multi_target_loss(logits, targets, weights, cap="none", softcap=0.0, chunk=LOSS_CHUNK):
    """``sum_{n, j valid} w_j (logsumexp(z_n) - z_n[y_nj])`` over one capped softmax: float32
    (float64), a *sum*.

    ``logits`` ``[..., V]`` (bf16 on a GPU; the gradient comes back in their dtype), ``targets``
    int64 ``[..., J]`` (-100 absent; ``PAST_END``: absent, its weight kept in the gradient's softmax
    term as modded-nanogpt's kernel, so there the gradient is not the loss's), ``weights`` ``[J]``
    (a tensor: a weight schedule compiles no new graph), ``cap`` none / tanh (``softcap``) / sigmoid
    (record #54). The caller divides by a global count (valid column-0 labels: extra columns weigh
    on top, as modded-nanogpt). ``chunk``: positions per pass when not compiling. ValueError for a
    bad cap, softcap, chunk or shape.
    """
    if cap not in LOGIT_CAPS:
        raise ValueError(f"cap must be one of {', '.join(LOGIT_CAPS)}, got {cap!r}")
    if cap == "tanh" and not (isinstance(softcap, (int, float)) and 0 < softcap < math.inf):
        raise ValueError(f"the tanh cap needs a finite softcap > 0, got {softcap!r}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if logits.shape[:-1] != targets.shape[:-1] or weights.shape != targets.shape[-1:]:
        raise ValueError(f"multi_target_loss: logits {tuple(logits.shape)}, "
                         f"targets {tuple(targets.shape)} and weights {tuple(weights.shape)} "
                         f"must be [..., V], [..., J] and [J]")
    rows = logits.reshape(-1, logits.size(-1))  # [N, V]
    labels = targets.reshape(-1, targets.size(-1))  # [N, J]
    return _LossSum.apply(rows, labels, weights, cap, float(softcap), chunk)


def mce_loss(logits, targets, reduction="mean", softcap=0.0):
    """TST's multi-hot cross-entropy (plain CE when s = 1): float32 (float64) mean or sum over
    valid labels.

    ``multi_target_loss`` with s targets of weight 1: ``logits`` ``[..., V]``, ``targets`` int64
    ``[..., s]`` (-100 ignored, repeats count each time), ``softcap`` c > 0 scores
    ``c tanh(x / c)``. Gradient ``softmax(z) - (1/s) sum_k onehot(y_k)`` per label; no
    ``[..., s, V]`` tensor is built. ValueError for a bad reduction, cap or shape.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not (isinstance(softcap, (int, float)) and 0 <= softcap < math.inf):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = no cap), got {softcap!r}")
    if logits.shape[:-1] != targets.shape[:-1]:
        raise ValueError(f"mce_loss: logits {tuple(logits.shape)} and "
                         f"targets {tuple(targets.shape)} differ in their leading dims")
    ones = torch.ones(targets.size(-1), dtype=torch.float32, device=logits.device)
    total = multi_target_loss(logits, targets, ones, "tanh" if softcap else "none", softcap)
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().clamp_min(1)


GRAD_BUCKET_BYTES = 25 * 2**20  # gradient bucket size: PyTorch DDP's default bucket_cap_mb


class GradBuckets:
    """Gradient communication in buckets of ``cap_bytes``, each started once its gradients are
    final (PyTorch DDP's bucketing, arXiv 2006.15704): parameters in reverse order, flat buffers
    allocated once. Under torch.compile the backward is one node per graph: the buckets then start
    together, at its end.

    ``sharded``: the parameters whose optimizer keeps 1/world of their state (ZeRO-1/2, arXiv
    1910.02054; modded-nanogpt's sharded Adam): their gradients are reduce-scattered, rank r
    receiving the sum of flat elements [r k, (r + 1) k), k = ceil(n / world), of each
    (``grad_shard``); after the optimizer updated those shards in place, ``gather`` /
    ``wait_gather`` all-gather the parameters. Every other gradient is all-reduced.
    """

    def __init__(self, params, rank=0, world=1, sharded=(), cap_bytes=GRAD_BUCKET_BYTES):
        self.params = [p for p in params if p.requires_grad]
        self.rank = rank
        self.world = world
        scatter = {id(p) for p in sharded}
        self.buckets = []
        self.bucket_of = {}
        self.shards = {}
        self.gathers = []
        for p in reversed(self.params):
            kind = "scatter" if id(p) in scatter else "reduce"
            last = self.buckets[-1] if self.buckets else None
            # a new bucket where the last is full or holds another kind, dtype or device
            if (last is None or last["bytes"] + p.numel() * p.element_size() > cap_bytes
                    or (last["kind"], last["dtype"], last["device"]) != (kind, p.dtype, p.device)):
                last = dict(params=[], bytes=0, kind=kind, dtype=p.dtype, device=p.device)
                self.buckets.append(last)
            last["params"].append(p)
            last["bytes"] += p.numel() * p.element_size()
            self.bucket_of[p] = len(self.buckets) - 1
        for b in self.buckets:
            if b["kind"] == "reduce":
                numel = sum(p.numel() for p in b["params"])
                b["flat"] = torch.empty(numel, dtype=b["dtype"], device=b["device"])
                continue
            b["ks"] = [-(-p.numel() // world) for p in b["params"]]  # each shard's length, padded
            shard_numel = sum(b["ks"])
            # send: the reduce-scatter's input, also gather's output; shard: the other way round
            b["send"] = torch.empty(world * shard_numel, dtype=b["dtype"], device=b["device"])
            b["shard"] = torch.zeros(shard_numel, dtype=b["dtype"], device=b["device"])
        self.left = []
        self.works = {}

    def shard_range(self, p):
        """``(lo, hi)``: the flat elements of ``p`` this rank's optimizer owns (maybe none:
        lo == hi)."""
        k = -(-p.numel() // self.world)
        return min(self.rank * k, p.numel()), min((self.rank + 1) * k, p.numel())

    def grad_shard(self, p):
        """This rank's shard of ``p``'s reduced gradient, a view (zeros before the first step)."""
        if p not in self.shards:
            lo, hi = self.shard_range(p)
            return torch.zeros(hi - lo, dtype=p.dtype, device=p.device)
        return self.shards[p]

    def _pieces(self, b):
        """``[(p, offset in the bucket's shard, k, this rank's length)]`` of a scatter bucket."""
        out = []
        off = 0
        for p, k in zip(b["params"], b["ks"]):
            lo, hi = self.shard_range(p)
            out.append((p, off, k, hi - lo))
            off += k
        return out

    def _start(self, i):
        b = self.buckets[i]
        if b["kind"] == "reduce":
            grads = [p.grad for p in b["params"] if p.grad is not None]
            flat = b["flat"][:sum(g.numel() for g in grads)]
            torch.cat([g.reshape(-1) for g in grads], out=flat)
            self.works[i] = (dist.all_reduce(flat, async_op=True), grads, flat)
            return
        # [world, k] per parameter: rank r's row is its shard (zeros where no gradient, or padding)
        rows = []
        for p, _, k, _ in self._pieces(b):
            g = p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
            if g.numel() != self.world * k:
                g = F.pad(g, (0, self.world * k - g.numel()))
            rows.append(g.view(self.world, k))
        torch.cat(rows, dim=1, out=b["send"].view(self.world, -1))
        work = dist.reduce_scatter_tensor(b["shard"], b["send"], async_op=True)
        self.works[i] = (work, None, None)

    def _ready(self, p):
        i = self.bucket_of[p]
        self.left[i] -= 1
        if self.left[i] == 0:
            self._start(i)

    def hooks(self):
        """Arm the hooks for the next backward; returns their handles (remove them after it)."""
        self.left = [len(b["params"]) for b in self.buckets]
        self.works = {}
        return [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def start_rest(self):
        """Start the buckets the backward did not (compiled: every one; eager: those with a
        parameter without a gradient; a scatter bucket always, so every rank calls the same
        collectives): the all-reduced ones first (NorMuon's matrices: their math waits for them),
        the reduce-scattered ones last (Adam's tables, the big banks: their transfer runs while
        NorMuon computes)."""
        for kind in ("reduce", "scatter"):
            for i, b in enumerate(self.buckets):
                if b["kind"] == kind and i not in self.works and (
                        kind == "scatter" or any(p.grad is not None for p in b["params"])):
                    self._start(i)

    def wait(self, kind):
        """Wait for the started buckets of ``kind``: "reduce" copies back the all-reduced
        gradients, "scatter" points ``grad_shard`` at the reduce-scattered ones."""
        for i in [i for i in self.works if self.buckets[i]["kind"] == kind]:
            work, grads, flat = self.works.pop(i)
            work.wait()
            if grads is not None:
                reduced = flat.split([g.numel() for g in grads])
                torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(reduced, grads)])
            else:
                b = self.buckets[i]
                self.shards.update({p: b["shard"][off:off + n] for p, off, _, n in self._pieces(b)})

    def finish(self):
        """Start what is left and wait for every bucket (``start_rest``, then both kinds)."""
        self.start_rest()
        self.wait("reduce")
        self.wait("scatter")

    def gather(self):
        """Start all-gathering every sharded parameter from its owners' updated shards (async)."""
        for b in self.buckets:
            if b["kind"] == "scatter":
                pieces = self._pieces(b)
                # this rank's updated elements into the send buffer (the parameter is the truth)
                for p, off, _, n in pieces:
                    lo, hi = self.shard_range(p)
                    b["shard"][off:off + n].copy_(p.detach().view(-1)[lo:hi])
                work = dist.all_gather_into_tensor(b["send"], b["shard"], async_op=True)
                self.gathers.append((work, b, pieces))

    def wait_gather(self):
        """Wait for ``gather`` and write each parameter whole from its ranks' shards."""
        for work, b, pieces in self.gathers:
            work.wait()
            got = b["send"].view(self.world, -1)
            for p, off, k, _ in pieces:
                p.detach().view(-1).copy_(got[:, off:off + k].reshape(-1)[:p.numel()])
        self.gathers = []


# Rotary embeddings with YaRN, and the partial key offset: the attention's position machinery

class Rotary(nn.Module):
    """Half-truncated RoPE (arXiv 2104.09864; record #89): dims i, i + r/2 of the first
    r = head_dim/2 rotate at (1/1024)^linspace(0, 1), the rest pass; positions 0..max_len-1.
    ``scale``: the attention scale, a buffer that ``set_history`` rescales with the tables (YaRN,
    record #31)."""

    def __init__(self, head_dim, max_len, scale):
        super().__init__()
        self.rot = head_dim // 2
        freq0 = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freq0).float()
        # float64 on the device: set_history copies nothing
        self.register_buffer("freq0", freq0, persistent=False)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self.scale0 = scale
        self.register_buffer("scale", torch.tensor(float(scale)), persistent=False)

    def forward(self, x, paired=False):
        """x: [B, L, H, head_dim] -> same shape and dtype, rotated at position t; ``paired`` (record
        #58): head h at 2t + h mod 2, so each doubled stream's two heads turn a position apart."""
        L = x.size(1)
        r = self.rot
        if paired:
            t = torch.arange(L, device=x.device)[:, None]
            pos = 2 * t + torch.arange(x.size(2), device=x.device) % 2  # [L, H]
            cos = self.cos[0, pos, 0][None]  # [1, L, H, r/2]
            sin = self.sin[0, pos, 0][None]
        else:
            cos = self.cos[:, :L]
            sin = self.sin[:, :L]
        # the tables in x's dtype: a bf16 run rotates in bf16, with no float32 copy of q and k
        cos = cos.type_as(x)
        sin = sin.type_as(x)
        x1, x2 = x[..., :r].chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin, x[..., r:]), dim=-1)

    @torch.no_grad()
    def set_history(self, windows):
        """Tables after YaRN rescales (record #31; alpha 1, beta 32) through the long ``windows``,
        in place: per old -> new, s = old/new, f <- f (s + r (1 - s)) with
        r = clamp((old f / 2 pi - 1) / 31, 0, 1), and scale *= 0.2 ln(new/old) + 1."""
        freq = self.freq0.clone()
        scale = self.scale0
        for old, new in zip(windows, windows[1:]):
            s = old / new
            freq *= s + ((old * freq / (2 * math.pi) - 1) / 31).clamp(0, 1) * (1 - s)
            scale *= 0.2 * math.log(new / old) + 1
        positions = torch.arange(self.cos.size(1), dtype=torch.float64, device=freq.device)
        # built where the tables live: no host copy
        angles = torch.outer(positions, freq)[None, :, None, :]
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())
        self.scale.fill_(scale)


def offset_keys(k):
    """Partial key offset (record #49): the last half of each key's dims (the unrotated half) taken
    from the previous position, k [B, L, H, D] -> same, except at position 0 (across documents, as
    modded-nanogpt)."""
    h = k.size(-1) // 2
    own = k[..., h:]
    return torch.cat((k[..., :h], torch.cat((own[:, :1], own[:, :-1]), dim=1)), dim=-1)


# Attention masks (records #12, 2024-11-19: document masks and a sliding window in FlexAttention;
# #58, 2026-01-07: paired heads). One definition, ``mask_mod``, serves both paths: FlexAttention's
# block mask on CUDA and, on a CPU (no FlexAttention backward there), the same mask as a bool
# matrix for SDPA; tests/test_attention.py and test_block_mask.py prove the two agree.

def mask_mod(doc_ids, window, paired=False):
    """FlexAttention ``mask_mod(b, h, q, k) -> bool``: ``k <= q``, same document,
    ``q - k <= window``.

    ``doc_ids`` int64 ``[B, T]``; ``window`` an int (0 = none) or an int64 0-d device tensor (a
    schedule then changes no graph). ``paired``: the doubled sequence of paired-head layers, token
    t at positions 2t and 2t + 1 (documents read at q // 2: no doubled ids in the kernel). A window
    of w sees w + 1 keys, q - w..q: FA3's ``window_size=(w, 0)`` as modded-nanogpt calls it
    (record #89).
    """
    windowed = torch.is_tensor(window) or window > 0

    def allowed(b, h, q, k):
        if paired:  # the doubled sequence: documents read at q // 2
            same = doc_ids[b, q // 2] == doc_ids[b, k // 2]
        else:
            same = doc_ids[b, q] == doc_ids[b, k]
        ok = (k <= q) & same
        return ok & (q - k <= window) if windowed else ok
    return allowed


def attention_mask(doc_ids, window, paired=False):
    """``mask_mod`` materialized: bool ``[T, T]`` for doc_ids ``[T]``, ``[B, T, T]`` for
    ``[B, T]`` (2T paired)."""
    ids = doc_ids if doc_ids.ndim == 2 else doc_ids[None]
    B = ids.shape[0]
    T = ids.shape[1] * (2 if paired else 1)
    pos = torch.arange(T, device=ids.device)
    batch = torch.arange(B, device=ids.device)[:, None, None]
    mask = mask_mod(ids, window, paired)(batch, None, pos[:, None], pos[None, :])
    return mask if doc_ids.ndim == 2 else mask[0]


def build_attention_mask(doc_ids, window, flex, block_size=128, paired=False):
    """The mask of doc_ids ``[B, T]`` for ``attend``: a ``BlockMask`` (``flex``, CUDA) or
    bool ``[B, 1, T, T]``."""
    if flex:
        return block_mask_from_bounds(doc_ids, window, block_size, paired)
    return attention_mask(doc_ids, window, paired)[:, None]


class LayerMasks(NamedTuple):
    """One window's masks: ``plain`` (the sequence), ``paired`` (the doubled sequence of
    paired-head layers, record #58), ``first`` bool ``[B, L]`` True at document starts (the key
    offset, record #49), ``docs`` the int64 ``[B, L]`` document ids (``dc_attention``); unused:
    None. ``backend``: FlexAttention's kernels (``attend``)."""
    plain: object
    paired: object = None
    first: object = None
    docs: object = None
    backend: str = "TRITON"


def layer_masks(doc_ids, window, flex, paired=False, first=False, docs=False, backend="TRITON"):
    """``LayerMasks`` of doc_ids ``[B, L]`` under ``window``, the doubled mask, document starts and
    ids as asked."""
    doubled = build_attention_mask(doc_ids, window, flex, paired=True) if paired else None
    starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True) if first else None
    plain = build_attention_mask(doc_ids, window, flex)
    return LayerMasks(plain, doubled, starts, doc_ids if docs else None, backend)


def _ordered_blocks(blocks):
    """bool ``[B, nq, nk]`` -> (int32 ``[B, 1, nq]`` counts, int32 ``[B, 1, nq, nk]`` indices,
    the True ones first)."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    # a stable descending sort lists the chosen key blocks in increasing order, as
    # create_block_mask does
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None], indices.to(torch.int32)[:, None]


def block_mask_from_bounds(doc_ids, window, block_size=128, paired=False):
    """``create_block_mask(mask_mod(doc_ids, window, paired), B, None, T, T)`` from block bounds.

    O((T / block_size)^2) work where create_block_mask evaluates all T^2 pairs; partial blocks are
    masked per element by the same ``mask_mod`` inside FlexAttention. Exact because document ids are
    non-decreasing: for query block [q0, q1] and key block [k0, k1], some pair is allowed iff
    ``k0 <= q1``, ``doc[k1] >= doc[q0]``, ``q0 - k1 <= window``; every pair iff ``k1 <= q0``,
    ``doc[k0] == doc[q1]``, ``q1 - k0 <= window`` and neither block reaches past T.
    """
    ids = doc_ids.repeat_interleave(2, dim=1) if paired else doc_ids  # for the bounds only
    B, T = ids.shape
    n = -(-T // block_size)
    first = torch.arange(n, device=doc_ids.device) * block_size  # [n] each block's first position
    last = (first + block_size - 1).clamp_max(T - 1)              # [n] last position inside T
    complete = first + block_size <= T                            # [n] no padding in the block
    # query blocks along rows, key blocks along columns
    q0 = first[:, None]
    q1 = last[:, None]
    k0 = first[None, :]
    k1 = last[None, :]
    doc_first = ids[:, first]  # [B, n]
    doc_last = ids[:, last]
    some = (k0 <= q1) & (doc_last[:, None, :] >= doc_first[:, :, None])
    both_complete = complete[:, None] & complete[None, :]
    every = (k1 <= q0) & (doc_first[:, None, :] == doc_last[:, :, None]) & both_complete
    if torch.is_tensor(window) or window > 0:
        some = some & (q0 - k1 <= window)
        every = every & (q1 - k0 <= window)
    kv_num, kv_idx = _ordered_blocks(some & ~every)
    full_num, full_idx = _ordered_blocks(every)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod(doc_ids, window, paired),
                                    seq_lengths=(T, T))


# The post-only dynamically composable (DC) correction of record #85 (2026-05, layer 10), in plain
# PyTorch instead of its Triton kernel (modded-nanogpt's dc_triton_kernels.py) so that a CPU runs
# it too; compiled on CUDA.
DC_WINDOW = 112  # the correction's keys: q - 111..q in q's document (record #85's 0 <= q - k < 112)


def dc_attention(q, k, v, w1, w2, doc_ids, scale, window=DC_WINDOW, block=128):
    """The DC correction ``c`` that record #85 adds to a layer's attention output: for each head h
    and query t, ``P_h[t, j] = softmax_j(scale q_h[t] . k_h[j])`` over keys j in t - window + 1..t
    of t's document, ``a[t, j] = sum_g rms_norm(w1[t])_g P_g[t, j]`` (RMS over heads, eps 1e-6:
    modded-nanogpt's ``dc_gate``), and ``c_h[t] = w2[t, h] sum_j a[t, j] v_h[j]``.

    q, k, v ``[B, T, H, D]`` (q, k after norm, RoPE and key offset; v with its value embeddings),
    w1, w2 ``[B, T, H]`` (the DC gate lanes), doc_ids int64 ``[B, T]`` -> float32 ``[B, T, H, D]``.
    Queries in blocks of ``block`` (>= window) against that block and the one before: O(T block)
    memory, dense float32 matmuls.
    """
    B, T, H, D = q.shape
    C = block
    n = -(-T // block)
    assert 0 < window <= C, (window, C)
    pad = n * C - T

    # [B, T, ...] -> [B, n, C, ...] in float32, the precision of the record's scores and mixing
    # (its dots in TF32 on CUDA: harness.setup_runtime); ``two``: [B, n, 2C, ...], the block
    # before, then it
    def blocks(x, two=False, front=0.0):
        padded = F.pad(upcast(x), (0, 0) * (x.ndim - 2) + (0, pad), value=-1.0)
        x = padded.view(B, n, C, *x.shape[2:])
        if not two:
            return x
        before = F.pad(x[:, :-1], (0, 0) * (x.ndim - 2) + (1, 0), value=front)
        return torch.cat((before, x), 2)
    # ids -1 pad T up to n C (padded queries see padded keys: no empty softmax row),
    # -2 before position 0
    docs_q = blocks(doc_ids[..., None])[..., 0]
    docs_k = blocks(doc_ids[..., None], True, -2.0)[..., 0]
    query_at = C + torch.arange(C, device=q.device)[:, None]  # a query's position in its 2C window
    rel = query_at - torch.arange(2 * C, device=q.device)  # [C, 2C]: q - k
    same_doc = docs_q[..., :, None] == docs_k[..., None, :]
    ok = (rel >= 0) & (rel < window) & same_doc  # [B, n, C, 2C]
    scores = torch.einsum("bnqhd,bnkhd->bnhqk", blocks(q), blocks(k, True)) * scale
    P = torch.softmax(scores.masked_fill(~ok[:, :, None], -math.inf), dim=-1)  # [B, n, H, C, 2C]
    mix = F.rms_norm(upcast(w1), (H,), eps=1e-6)
    a = torch.einsum("bnhqk,bnqh->bnqk", P, blocks(mix))
    out = torch.einsum("bnqk,bnkhd->bnqhd", a, blocks(v, True)) * blocks(w2)[..., None]
    return out.reshape(B, n * C, H, D)[:, :T]


def flash_unavailable_reason(device):
    """Why FlexAttention's FLASH backend cannot run on ``device``, or None: it needs the
    flash-attn-4 package (``flash_attn.cute``) and a Hopper or Blackwell GPU (sm_90, sm_100)."""
    try:
        found = (importlib.util.find_spec("flash_attn") is not None
                 and importlib.util.find_spec("flash_attn.cute"))
    except ImportError:
        found = False
    if not found:
        return "the flash-attn-4 package is not installed (pip install -r requirements-gpu.txt)"
    backends = typing.get_args(getattr(flex_module, "_Backend", None))
    if "FLASH" not in backends:  # an older torch: no such backend
        return f"torch {torch.__version__} has no FLASH backend in FlexAttention"
    if torch.device(device).type != "cuda":
        return "it needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major in (9, 10):
        return None
    return f"it needs a Hopper or Blackwell GPU (sm_90, sm_100), not sm_{major}{minor}"


def choose_flex_backend(requested, device, compiled):
    """``(backend, why)`` for --attention-backend ``requested``: FLASH where asked for or allowed
    (auto) and it can run, else TRITON; ``why``: FLASH asked for by name cannot run (the trainer
    refuses, naming the flag)."""
    if requested == "triton":
        return "TRITON", None
    if requested == "auto" and not (compiled and torch.device(device).type == "cuda"):
        return "TRITON", None  # FLASH's kernels are generated by inductor: a compiled CUDA run only
    why = flash_unavailable_reason(device)
    backend = "TRITON" if why else "FLASH"
    return backend, (why if requested == "flash" else None)


def flash_refused(requested, backend, err):
    """Whether ``err`` is FLASH refusing a graph that --attention-backend auto gave it (TRITON
    then takes over)."""
    return requested == "auto" and backend == "FLASH" and "FLASH" in str(err)


def attend(q, k, v, mask=None, scale=None, backend="TRITON"):
    """``softmax(scale q k^T) v``, q, k, v ``[B, H, T, head_dim]`` -> same in v's dtype; ``mask``
    None: causal SDPA, a ``BlockMask``: FlexAttention (q, k cast to v's dtype) with its kernels
    ``backend``: "TRITON" (its Triton templates) or "FLASH" (FlashAttention-4's CuTe kernels for
    Hopper and Blackwell, the same masks; experimental in torch 2.13); a bool tensor: masked
    SDPA."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if isinstance(mask, BlockMask):
        return flex_attention(q.type_as(v), k.type_as(v), v, block_mask=mask, scale=scale,
                              kernel_options={"BACKEND": backend})
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
