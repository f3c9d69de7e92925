"""Train a GPT on FineWeb (GPT-2 tokens) to 3.28 val loss, fast: modded-nanogpt's record #89 plus
Aurora and Token-Superposition Training (TST). Read top to bottom: config and presets, the model
spec, the stage table, the model, TST, optimizers, data, eval, then main() and its loop. harness.py
holds the tools it calls (shards, CLI, run log, checkpoints), aurora_opt.py the optimizers,
kernels.py the fused loss, FP8 matmuls, RoPE and attention masks; docs/METHODS.md has the math.

    python train_gpt.py                                    # one GPU: record #89 (baseline_h200)
    python train_gpt.py --preset record_h200               # ... plus TST and Aurora
    torchrun --standalone --nproc_per_node=8 train_gpt.py --preset record_h200
    python train_gpt.py --preset cpu_smoke                 # a CPU: the smoke model, ~6 min
"""
import copy
import dataclasses
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    # why: the micro-batch grows 16,384 -> 32,768 -> 49,152 positions; growable segments reuse what
    # it freed
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # read when CUDA first allocates
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import harness
import kernels
from aurora_opt import CautiousAdam, NorMuon, adam_groups, matrix_groups, warm_step
from harness import ConfigError, DataError
from kernels import (DC_WINDOW, DOWN_BOOTSTRAP_STEPS, HEAD_SCALES, IGNORE_INDEX, PAST_END,
                     SIGMOID_CAP, GradBuckets, Rotary, attend, dc_attention, delay_input_scale_,
                     down_scales, fp8_active, fp8_linear, fp8_unavailable_reason, layer_masks,
                     multi_target_loss, offset_keys, refresh_down_scales_, upcast)

# ----------------------------------------------------------------------------------------------
# Config and presets: every flag a user types (defaults: record #89's run on one H200)


def _f(default, help, **kw):
    """A config field: default, --help text, optional ``choices`` and bounds low <= value < high."""
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass(frozen=True)
class Config:
    """One run. Each field is a --kebab-case flag; a preset sets some, typed flags override both."""
    # data
    train_files: str = _f(
        "data/fineweb10B/fineweb_train_*.bin", "glob of train shards, read in sorted order")
    val_files: str = _f("data/fineweb10B/fineweb_val_*.bin", "glob of val shards")
    val_tokens: int = _f(
        10_485_760, "val loss over the first this-many tokens of the val shards", low=1)
    val_seq_len: int = _f(
        262_144, "val chunk: document-masked tokens per forward, chunk i on process i mod world "
        "(0 = --seq-len)", low=0)
    val_batch_seqs: int = _f(1, "val chunks per process per forward", low=1)
    val_every: int = _f(125, "val every this many steps (0 = only at the start and the end)", low=0)
    # model and batch
    model: str = _f("record", "the model spec (MODELS): record (11 x 768, record #89's) or smoke "
                    "(4 x 128, CPU)")
    seq_len: int = _f(16_384, "positions per packed sequence in stage 1 (stage k: k x this)", low=1)
    batch_tokens: int = _f(
        393_216, "positions per step of the last stage (stage k: k thirds of it)", low=1)
    micro_batch_seqs: int = _f(
        1, "sequences per process per forward; accumulation fills the step", low=1)
    num_iterations: int = _f(1285, "optimizer steps N, the extension's included", low=4)
    extension_steps: int = _f(
        15, "the last this-many steps at the lr floor, longer windows (record #89)", low=0)
    max_steps: int = _f(0, "stop after this many steps, schedule unchanged (0 = all N)", low=0)
    # TST (docs/METHODS.md §1)
    tst_frac: float = _f(
        0.0, "fraction r of the N steps in TST phase 1 (0 = off); the switch at step round(r N)",
        low=0.0, high=1.0)
    tst_bag_size: int = _f(4, "TST bag size s", low=1)
    tst_mode: str = _f(
        "full", "TST: full (bag in, next bag out), input (bag in only), output (next s out only)",
        choices=("full", "input", "output"))
    # optimizers (docs/METHODS.md §2, §3)
    optimizer: str = _f(
        "normuon", "the block matrices' optimizer: normuon (record #89's) or aurora_normuon "
        "(Aurora's polar on the MLP matrices)", choices=("normuon", "aurora_normuon"))
    matrix_lr: float = _f(0.023, "NorMuon lr", low=0.0)
    matrix_wd: float = _f(1.2, "NorMuon cautious weight decay (times lr)", low=0.0)
    adam_lr: float = _f(
        0.008, "CautiousAdam base lr; each parameter role has its multiplier (record #89)", low=0.0)
    momentum: float = _f(0.95, "NorMuon momentum after the warmup", low=0.0, high=1.0)
    momentum_warmup_steps: int = _f(300, "steps of the momentum warmup from 0.85", low=0)
    momentum_cooldown_steps: int = _f(
        50, "the last this-many steps take momentum back to 0.85 (record #39)", low=0)
    pp_iterations: int = _f(2, "aurora_normuon: row-equalization rounds K of Aurora's polar", low=1)
    pp_beta: float = _f(0.5, "aurora_normuon: row-scale exponent beta", low=0.0)
    cooldown_frac: float = _f(
        0.6, "fraction of the scheduled steps the lr decays over", low=0.0, high=1.0)
    lr_floor: float = _f(0.15, "lr multiplier at the end of the cooldown", low=0.0, high=1.0)
    # execution and logs
    seed: int = _f(0, "seed of the weight init")
    run_id: str = _f("", "name of the run (its log and checkpoint folder); unset: date, time and a "
                     "random suffix")
    log_dir: str = _f("logs", "where <run_id>.txt and <run_id>.json go")
    log_every: int = _f(10, "train-loss line every this many steps (each is a host sync)", low=1)
    device: str = _f("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    compile: bool = _f(
        None, "torch.compile the model and optimizers; unset: on with CUDA, off on a CPU")
    bf16: bool = _f(None, "bf16 activations, weights cast per matmul; unset: on with CUDA, off on "
                    "a CPU (float32)")
    fp8: bool = _f(True, "the LM head and MLP matmuls in FP8 while training (sm_89+ GPUs; records "
                   "#19, #84, #89)")
    attention_backend: str = _f(
        "auto", "FlexAttention's kernels on CUDA: flash (FlashAttention-4, sm_90/sm_100), "
        "triton, or auto (flash where it can)", choices=("auto", "triton", "flash"))
    dist_timeout: int = _f(
        600, "seconds a collective may wait before the run fails (torchrun)", low=1)
    # checkpoints
    checkpoint_dir: str = _f("checkpoints", "checkpoints go to <dir>/<run_id>/step_NNNNNN.pt")
    save_every: int = _f(0, "checkpoint every this many steps (0 = never)", low=0)
    save_final: bool = _f(False, "checkpoint at the end of the run")
    resume: str = _f("", "checkpoint file to continue from, or 'auto': the newest of --run-id in "
                     "--checkpoint-dir")


# Fields that change how a run executes, not what it computes: --resume accepts a checkpoint that
# differs in these.
OPERATIONAL = frozenset({
    "train_files", "val_files", "micro_batch_seqs", "max_steps", "val_every", "val_batch_seqs",
    "log_every", "log_dir", "run_id", "device", "compile", "bf16", "fp8", "attention_backend",
    "dist_timeout", "checkpoint_dir", "save_every", "save_final", "resume"})

CPU_DATA = dict(train_files="data/sample/*_train_*.bin", val_files="data/sample/*_val_*.bin")
# The CPU presets: record #89's recipe and model roles at the smoke shape on the repository's
# real-text sample, 2 cores, about 6 minutes. cpu_baseline is the small-scale study's baseline (its
# swept NorMuon lr, 0.046: records/cpu/2026-12-03_small_scale_89); cpu_smoke adds our methods, as
# record_h200 does to baseline_h200.
CPU_BASELINE = dict(
    CPU_DATA, model="smoke", seq_len=768, batch_tokens=2304, num_iterations=100, extension_steps=2,
    momentum_warmup_steps=24, momentum_cooldown_steps=4, matrix_lr=0.046, val_tokens=16384,
    val_seq_len=0, val_every=50, log_every=1, fp8=False)
OUR_METHODS = dict(tst_frac=0.3, tst_bag_size=4, optimizer="aurora_normuon")  # METHODS.md §1, §2
PRESETS = {
    "baseline_h200": {},  # the defaults: record #89 as modded-nanogpt runs it; run.sh's GPU default
    "record_h200": dict(OUR_METHODS),
    "cpu_baseline": CPU_BASELINE,
    "cpu_smoke": dict(CPU_BASELINE, **OUR_METHODS),  # run.sh's CPU default
}


def check_config(cfg, models=None):
    """Refuse values that cannot work together (each field's own bounds: ``harness.parse_flags``);
    ConfigError. ``models``: the specs --model may name (default ``MODELS``)."""
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    models = MODELS if models is None else models
    need(cfg.model in models, f"--model {cfg.model!r}: choose one of {', '.join(models)}")
    need(cfg.batch_tokens % (3 * cfg.seq_len) == 0,
         f"--batch-tokens {cfg.batch_tokens} must be a multiple of 3 x --seq-len "
         f"({3 * cfg.seq_len}): stage k trains k thirds of it in sequences of k x --seq-len")
    need(cfg.extension_steps < cfg.num_iterations - 2,
         f"--extension-steps {cfg.extension_steps} leaves fewer than 3 of --num-iterations "
         f"{cfg.num_iterations} for the three stages")
    need(cfg.tst_frac == 0 or cfg.val_tokens >= 2 * cfg.tst_bag_size,
         f"--tst-bag-size {cfg.tst_bag_size} needs --val-tokens >= {2 * cfg.tst_bag_size} (a bag "
         f"and its next bag); lower the bag size")
    need(cfg.run_id == "" or harness.SAFE_NAME.fullmatch(cfg.run_id) and len(cfg.run_id) <= 200,
         f"--run-id {cfg.run_id[:40]!r}: use up to 200 letters, digits, '.', '_' and '-' (it names files)")


def grad_accum_steps(cfg, world):
    """Micro-batches per process per step: every step has stage 1's sequence count (longer sequences
    later), split evenly over ``world`` processes and --micro-batch-seqs; else a ConfigError naming
    what divides it."""
    seqs = cfg.batch_tokens // (3 * cfg.seq_len)
    micro = cfg.micro_batch_seqs
    if seqs % (micro * world) == 0:
        return seqs // (micro * world)
    counts = [w for w in range(1, seqs + 1) if seqs % (w * micro) == 0]
    alone = "" if counts else " with --micro-batch-seqs 1"  # the micro-batch is more than a step
    counts = counts or [w for w in range(1, seqs + 1) if seqs % w == 0]
    named = " or ".join(map(str, counts[-4:]))
    fixes = [f"run {named} process(es){alone} (run.sh's NPROC, torchrun's --nproc_per_node)"]
    if seqs % world == 0:  # this many processes can split it in smaller micro-batches
        per = seqs // world
        sizes = [str(m) for m in range(per, 0, -1) if per % m == 0][:3]
        fixes.append("--micro-batch-seqs " + " or ".join(sizes))
    raise ConfigError(f"{world} process(es) x --micro-batch-seqs {micro} do not divide a step's "
                      f"{seqs} sequence(s) (--batch-tokens / (3 x --seq-len)); "
                      + ", or ".join(fixes))


# ----------------------------------------------------------------------------------------------
# The model spec: record #89's architecture as layer roles (docs/METHODS.md §5), one per shape

@dataclass(frozen=True)
class ModelSpec:
    """The model's shape and each layer's role (0-based layers; the record that brought it in)."""
    n_layer: int
    n_head: int
    model_dim: int
    no_attn: tuple         # layers with an MLP only
    short_window: tuple    # layers over the short window (#31); the rest over the long one
    paired_heads: tuple    # heads h, h + H/2 share a softmax over a doubled sequence (#58)
    xsa: tuple             # y -= tanh(a) proj_v(y): exclusive self-attention (#82)
    attn_gate: tuple       # per-head output gates (#28)
    dc: tuple              # the dynamically composable correction over 112 keys (#85)
    ve_layers: tuple       # layers fed a value embedding: entry i by table i mod value_embeds (#14)
    value_embeds: int
    skip: tuple            # (a, b): the stream after layer a gated into layer b (#45, #55)
    attn_state_layer: int  # later layers attend from the stream after this one (#77)
    bigram_vocab: int      # rows of the bigram hash embedding (#62, #83)
    mudd_gates: int        # gate MLP 1 serves layers before this, gate MLP 2 the rest (#85)
    window_block: int      # positions per window block of the stage table
    mlp_ratio: int = 4
    vocab_size: int = 50304  # GPT-2's 50,257 ids padded to a multiple of 128
    attn_scale: float = 0.1  # the attention logit scale at the first window, YaRN-rescaled (#31)

    @property
    def head_dim(self):
        return self.model_dim // self.n_head


MODELS = {
    "record": ModelSpec(
        n_layer=11, n_head=6, model_dim=768, no_attn=(6,), short_window=(0, 1, 2, 4, 5, 7, 8, 9),
        paired_heads=(0, 2, 5, 9), xsa=(1, 3, 4, 7), attn_gate=(3, 10), dc=(10,),
        ve_layers=(1, 2, 8, 9, 10), value_embeds=5, skip=(3, 6), attn_state_layer=7,
        bigram_vocab=377_280, mudd_gates=4, window_block=128),
    # the record's roles on 4 layers: paired heads 0 and 2, XSA 1, long window, output gate and DC 3
    "smoke": ModelSpec(
        n_layer=4, n_head=4, model_dim=128, no_attn=(), short_window=(0, 1, 2), paired_heads=(0, 2),
        xsa=(1,), attn_gate=(3,), dc=(3,), ve_layers=(1, 3), value_embeds=2, skip=(1, 2),
        attn_state_layer=2, bigram_vocab=16_384, mudd_gates=2, window_block=32),
}


# ----------------------------------------------------------------------------------------------
# The stage table: every per-step quantity of a run. A stage: steps sharing one graph shape (TST
# phase, bag size, mode, sequence length); a step's row adds the ramps (lr, momentum, windows,
# objective weights) and its FLOPs.

@dataclass(frozen=True)
class Stage:
    """Optimizer steps [start, end) of one graph shape (docs/METHODS.md §4)."""
    start: int
    end: int
    phase: int           # TST phase: 1 = bags, 2 = next-token
    bag_size: int        # TST bag size s (1 in phase 2)
    mode: str            # TST mode: full, input, output
    batch_tokens: int    # latent positions per step
    seq_len: int         # latent positions per packed sequence
    doc_cap: int         # most tokens of one document in a sequence
    lr_mul: float
    blocks: tuple        # (short, long) windows in window blocks
    objective: tuple     # OBJECTIVE_WEIGHTS rows (at the start, at the end) of the 4 target columns
    ramp: tuple          # [first, end) of the recipe stage its objective ramps over (split: kept)

    def raw_tokens(self):
        """Text tokens a step reads (s x the positions in TST phase 1; packing skips some too)."""
        _, advance = sequence_layout(self.mode, self.bag_size, self.seq_len)
        return self.batch_tokens // self.seq_len * advance


@dataclass(frozen=True)
class StepRow:
    """One optimizer step's schedule."""
    stage: Stage
    lr_scale: float
    momentum: float
    window: tuple          # (long, short) in latent positions
    flops_per_position: float
    objective: tuple       # weights of the 4 target columns (next token, t+2, t+3, prefix)
    yarn: tuple            # long windows of steps 0..min(step, N - 1), no repeats: RoPE's history


# Record #89 (modded-nanogpt's TRAINING_STAGES), per stage: fraction of the scheduled steps, thirds
# of --batch-tokens (#46), document cap (#29, #72), (short, long) window blocks (#31, #33, #35), lr
# multiplier, OBJECTIVE_WEIGHTS row (#53, #88). Stage k trains sequences of k x --seq-len (#89).
RECORD_STAGES = ((1 / 3, 1, 896, (1, 3), 1.0, 0),
                 (1 / 3, 2, 2048, (3, 7), 1.52, 1),
                 (1 / 3, 3, 2048, (5, 11), 1.73, 2))
EXTENSION_BLOCKS = (6, 13)  # the extension keeps stage 3's batch and objective
FINAL_LONG_BLOCKS = 20  # the final validation's long window
MOMENTUM_START = 0.85  # NorMuon's momentum at step 0 and after the cooldown (record #39)
# Target column weights per stage, (at its start, at its end): t+1, multi-token t+2, t+3 (#53),
# prefix token (#88).
OBJECTIVE_WEIGHTS = (((1.0, 0.5, 0.25, 0.25), (1.0, 0.5, 0.0, 0.25)),
                     ((1.0, 0.5, 0.0, 0.25), (1.0, 0.0, 0.0, 0.0)),
                     ((1.0, 0.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0)))


def recipe_stages(cfg):
    """Record #89's stages before a TST split: boundaries round(c N_s) at cumulative fractions c of
    the N_s = N - extension scheduled steps, as modded-nanogpt; then the extension."""
    N = cfg.num_iterations
    scheduled = N - cfg.extension_steps
    bounds = [0]
    c = 0.0
    for frac, *_ in RECORD_STAGES[:-1]:
        c += frac
        bounds.append(int(round(c * scheduled)))
    bounds.append(scheduled)
    rows = []
    for lo, hi, (_, k, cap, blocks, lr_mul, obj) in zip(bounds, bounds[1:], RECORD_STAGES):
        rows.append(Stage(lo, hi, 2, 1, "full", cfg.batch_tokens * k // 3, cfg.seq_len * k, cap,
                          lr_mul, blocks, OBJECTIVE_WEIGHTS[obj], (lo, hi)))
    if cfg.extension_steps:  # lr_mul 1: the lr is at its floor there
        rows.append(dataclasses.replace(rows[-1], start=scheduled, end=N, blocks=EXTENSION_BLOCKS,
                                        lr_mul=1.0, objective=OBJECTIVE_WEIGHTS[-1],
                                        ramp=(scheduled, N)))
    return [st for st in rows if st.end > st.start]


def tst_switch_step(cfg):
    """First step of phase 2 (next-token): round(r N)."""
    return int(round(cfg.tst_frac * cfg.num_iterations))


def stages(cfg):
    """The run's stages over steps [0, N): the recipe, TST phase 1 over its first round(r N) steps
    (a recipe stage the switch falls in is split in two, its ramps kept)."""
    switch = tst_switch_step(cfg)
    rows = []
    for st in recipe_stages(cfg):
        if st.start < switch:
            rows.append(dataclasses.replace(st, end=min(st.end, switch), phase=1,
                                            bag_size=cfg.tst_bag_size, mode=cfg.tst_mode))
        if st.end > switch:
            rows.append(dataclasses.replace(st, start=max(st.start, switch)))
    return rows


class Schedule:
    """The stage table of ``cfg`` on ``spec``: ``rows[step]``, steps 0..N (N: the final val's)."""

    def __init__(self, cfg, spec):
        self.stages = stages(cfg)
        N = cfg.num_iterations
        self.rows = []
        yarn = ()
        for step in range(N + 1):
            stage = next((s for s in self.stages if s.start <= step < s.end), self.stages[-1])
            short, long = stage.blocks
            if step == N:  # the final validation's long window
                long = FINAL_LONG_BLOCKS
            window = (long * spec.window_block, short * spec.window_block)
            if step < N and yarn[-1:] != (window[0],):
                yarn = yarn + (window[0],)
            flops = flops_per_position(spec, window, stage.seq_len)
            self.rows.append(StepRow(stage, lr_scale(step, stage, cfg), momentum_at(step, cfg),
                                     window, flops, objective_at(step, stage), yarn))

    def __getitem__(self, step):
        return self.rows[step]


def lr_scale(step, stage, cfg):
    """lr multiplier at ``step`` (modded-nanogpt's get_lr, record #72): the stage's m, then from c =
    int(N_s (1 - cooldown_frac)) ``m (1 - t) + lr_floor t``, t = min(1, (step - c) / (N_s - c))."""
    scheduled = cfg.num_iterations - cfg.extension_steps
    start = int(scheduled * (1 - cfg.cooldown_frac))
    if step < start:
        return stage.lr_mul
    t = min(1.0, (step - start) / max(scheduled - start, 1))
    return stage.lr_mul * (1 - t) + cfg.lr_floor * t


def momentum_at(step, cfg):
    """NorMuon's momentum: 0.85 -> --momentum over the warmup, back over the last c steps (#39)."""
    lo = MOMENTUM_START
    hi = cfg.momentum
    N = cfg.num_iterations
    c = cfg.momentum_cooldown_steps
    if step < cfg.momentum_warmup_steps:
        frac = step / cfg.momentum_warmup_steps
        return (1 - frac) * lo + frac * hi
    if c and step > N - c:
        frac = (step - (N - c)) / c
        return hi - frac * (hi - lo)
    return hi


def objective_at(step, stage):
    """The 4 target columns' weights at ``step``: the stage's rows, linear over its ramp."""
    lo, hi = stage.ramp
    t = min(max((step - lo) / (hi - lo), 0.0), 1.0)
    start, end = stage.objective
    return tuple(a + (b - a) * t for a, b in zip(start, end))


def attended_keys(seq_len, window):
    """Mean keys a query attends in a causal sequence of ``seq_len`` under ``window`` (0 = none):
    ``(1/L) sum_{q<L} min(q + 1, w + 1)`` (w + 1 keys, ``kernels.mask_mod``); document masks are not
    counted."""
    L = seq_len
    w = min(window + 1, L) if window else L
    return (w * (w + 1) // 2 + (L - w) * w) / L


def matmul_weights(spec):
    """Weights a forward multiplies per latent position (each matmul's in x out; no lookups)."""
    d = spec.model_dim
    attn = [i for i in range(spec.n_layer) if i not in spec.no_attn]
    ve_gated = [i for i in spec.ve_layers if i != spec.n_layer - 1]  # MUDD gates the last one's
    lanes = [sum(w for _, _, w in side) for side in gate_lanes(spec)]
    return (12 + 2 * 64 * d + 64 * sum(lanes)       # smear gate; the two gate MLPs (#85)
            + len(attn) * 4 * d * d + len(ve_gated) * 2 * VE_GATE_IN * spec.n_head  # qkvo; VE gates
            + spec.n_layer * 2 * spec.mlp_ratio * d * d  # MLP
            + 2 * 64 * d + 64 * (14 + 5)             # MUDD's two MLPs (#81)
            + d * spec.vocab_size)                   # LM head


def flops_per_position(spec, window, seq_len):
    """Training FLOPs per latent position: ``6 matmul_weights + 12 d keys`` (PaLM's accounting,
    arXiv 2204.02311 app. B): QK^T and AV, forward and backward, over each attention layer's keys; a
    paired-head layer's H/2 heads over 2L positions; a DC layer's own 112 keys (#85). TST phase 1
    costs the same per latent position."""
    long, short = window
    keys = sum(attended_keys(2 * seq_len if i in spec.paired_heads else seq_len,
                             short if i in spec.short_window else long)
               for i in range(spec.n_layer) if i not in spec.no_attn)
    keys += len(spec.dc) * attended_keys(seq_len, DC_WINDOW - 1)
    return 6 * matmul_weights(spec) + 12 * spec.model_dim * keys


def optimizer_flops(cfg, spec):
    """FLOPs of one optimizer step's orthogonalizations: Polar Express, 5 iterations of ``4 m^2 n +
    2 m^3`` on each m x n block (m <= n), K of them on the MLP matrices under aurora_normuon
    (Aurora's row equalization)."""
    d = spec.model_dim
    hidden = spec.mlp_ratio * d
    hd = spec.head_dim
    n_attn = spec.n_layer - len(spec.no_attn)
    polar = lambda m, n: 5 * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3)  # noqa: E731
    K = cfg.pp_iterations if cfg.optimizer == "aurora_normuon" else 1
    qk = n_attn * 2 * (d // (2 * hd)) * polar(2 * hd, d)  # Q and K in head-pair blocks (#80)
    return qk + n_attn * 2 * polar(d, d) + spec.n_layer * 2 * K * polar(hidden, d)


# ----------------------------------------------------------------------------------------------
# Model: record #89's GPT (docs/METHODS.md §5): RMSNorm, half-truncated RoPE with YaRN, QK-norm,
# ReLU^2 MLP, value embeddings, paired heads, XSA, DC, gate MLPs, MUDD, a bigram hash embedding, a
# sigmoid-capped head

def rms_norm(x):
    """Parameter-free RMSNorm over the last dim (x's dtype out; float32 statistics inside)."""
    return F.rms_norm(x, (x.size(-1),))


def linear(x, w):
    """``x @ w.T`` in x's dtype: float32 master weights cast per matmul (modded-nanogpt's
    CastedLinear), so a bf16 run needs no autocast and its stream stays bf16 (CUDA's autocast would
    return float32 from norms and sums)."""
    return F.linear(x, w.type_as(x))


def document_ids(tokens):
    """int64 ``[..., T]`` -> ``[..., T]``: EOTs up to each position (an EOT opens a document)."""
    return (tokens == EOT_TOKEN).cumsum(dim=-1)


def latent_document_ids(inputs):
    """Inputs ``[B, L, k]`` -> int64 ``[B, L]``: each latent position's document, a TST bag's (k =
    s) that of its last token, so an EOT anywhere in a bag opens the new document there
    (docs/METHODS.md §1)."""
    B, L, k = inputs.shape
    return document_ids(inputs.reshape(B, L * k)).view(B, L, k)[..., -1]


def route(param, group, role=None):
    """Tag ``param`` where it is created: ``group`` "matrix" (NorMuon) or "adam" with its
    CautiousAdam ``role`` (record #89's table, ``aurora_opt.ADAM_ROLES``); ``build_optimizers``
    reads only the tags."""
    param.opt_group = group
    param.adam_role = role
    return param


def _linear(d_in, d_out, zero=False, group="matrix", role=None):
    """A bias-free ``nn.Linear`` routed to ``group``: uniform, std 0.5/sqrt(d_in), or zeros."""
    lin = nn.Linear(d_in, d_out, bias=False)
    w = route(lin.weight, group, role)
    bound = math.sqrt(3.0) * 0.5 / math.sqrt(d_in)  # uniform(-b, b) has std b / sqrt(3)
    with torch.no_grad():
        if zero:  # an output projection: its block starts as the identity (and draws no numbers)
            w.zero_()
        else:
            w.uniform_(-bound, bound)
    return lin


def scalar(t, role="scalars"):
    """A learned vector or scalar, CautiousAdam's ``role``."""
    return route(nn.Parameter(t), "adam", role)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with QK-norm and RoPE (q, k, v one matmul of three optimizer matrices)
    and the layer's roles: paired heads (#58), key offset (#49, long-window layers), XSA (#82),
    output gate (#28), DC (#85)."""

    def __init__(self, spec, rotary, layer):
        super().__init__()
        self.n_head = spec.n_head
        self.head_dim = spec.head_dim
        d = spec.model_dim
        self.q = _linear(d, d)
        self.k = _linear(d, d)
        self.v = _linear(d, d)
        self.proj = _linear(d, d)  # uniform, not zero: the lambdas and gates after it do (#64)
        self.rotary = rotary  # the model's one table
        self.paired = layer in spec.paired_heads
        self.key_offset = not self.paired and layer not in spec.short_window
        self.lambdas = scalar(torch.tensor([0.5, 1.0]))  # W_qkv x lam[0] (V: QK-norm), W_o x lam[1]
        self.dc_window = DC_WINDOW if layer in spec.dc else 0

    def forward(self, x, mask, ve=None, ve_gate=None, xsa_alpha=None, attn_gate=None, dc=None):
        """x, ve ``[B, L, d]``, ``mask`` a ``LayerMasks`` (``GPT.masks_for``); per token ``ve_gate``
        ``[B, L, H, 1]``, ``xsa_alpha`` and ``attn_gate`` ``[B, L, H]`` (the gate MLPs, #85); ``dc``
        the DC lanes ``(w1, w2)``."""
        B, L, _ = x.shape
        H = self.n_head
        D = self.head_dim
        shape = (B, L, H, D)
        # the lambda scales the weights, cast first: the backward keeps the bf16 copy, not float32
        w_qkv = torch.cat((self.q.weight, self.k.weight, self.v.weight))
        qkv = F.linear(x, self.lambdas[0] * w_qkv.type_as(x))
        q, k, v = (t.view(shape) for t in qkv.chunk(3, dim=-1))
        if ve is not None:
            ve = ve.view(shape).type_as(v)
            v = v + ve_gate.type_as(v) * ve if ve_gate is not None else v + ve
        q = self.rotary(rms_norm(q), self.paired)  # QK-norm, then RoPE
        k = self.rotary(rms_norm(k), self.paired)
        vs = v
        mask_here = mask.plain
        if self.paired:  # token t's heads h < H/2 at position 2t, the others at 2t + 1: a view
            q, k, vs = (t.reshape(B, 2 * L, H // 2, D) for t in (q, k, v))
            mask_here = mask.paired
        if self.key_offset:
            k = offset_keys(k)
        q = q * self.rotary.scale.type_as(q)  # the YaRN scale, a buffer: a rescale changes no graph
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, vs))  # [B, heads, positions, head_dim]
        y = attend(qh, kh, vh, mask_here, 1.0, mask.backend).transpose(1, 2).reshape(shape)
        if self.dc_window:  # the correction over the last 112 keys, added to y
            y = y + dc_attention(q, k, v, *dc, mask.docs, 1.0, self.dc_window).type_as(y)
        if xsa_alpha is not None:  # XSA: remove tanh(alpha) of y's part along its own v
            alpha = torch.tanh(xsa_alpha).type_as(y).reshape(B, L, H, 1)
            yv = (y * v).sum(-1, keepdim=True)
            vv = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
            y = y - alpha * yv / vv * v
        if attn_gate is not None:
            y = y * attn_gate.reshape(B, L, H, 1).type_as(y)
        return F.linear(y.reshape(B, L, -1), self.lambdas[1] * self.proj.weight.type_as(y))


class MLP(nn.Module):
    """``proj(relu(fc(x))^2)``; with --fp8 both matmuls in FP8 while training on CUDA
    (``fp8_linear``, sm_89+): fc at current scales (record #84), proj at delayed ones (#89), its
    state in ``down_scales``."""

    def __init__(self, spec, fp8):
        super().__init__()
        self.fc = _linear(spec.model_dim, spec.mlp_ratio * spec.model_dim)
        self.proj = _linear(spec.mlp_ratio * spec.model_dim, spec.model_dim, zero=True)
        self.fp8 = fp8
        # persistent: resume is exact
        self.register_buffer("down_scales", down_scales() if fp8 else None)

    def forward(self, x):
        if fp8_active(self.fp8, x, self.fc.weight):
            h = F.relu(fp8_linear(x, self.fc.weight)).square()
            y = fp8_linear(h, self.proj.weight, scales=self.down_scales[:2])
            # the next forward's input scale (modded-nanogpt: per forward)
            delay_input_scale_(self.down_scales, h)
            return y
        return linear(F.relu(linear(x, self.fc.weight)).square(), self.proj.weight)


def fp8_refresh(model, step):
    """After optimizer ``step`` (-1: at init): the MLP down-projections' FP8 weight scales."""
    for block in model.blocks:
        if block.mlp.down_scales is not None:
            bootstrap = step < DOWN_BOOTSTRAP_STEPS
            refresh_down_scales_(block.mlp.down_scales, block.mlp.proj.weight, bootstrap)


BIGRAM_SIGN_ROWS = 8192  # rows of record #83's sign table
MUDD_SCALE = 0.1  # MUDD coefficients are the MLP's output times this
# record #85's gate lanes at init
GATE_START = {"attn": 0.25, "bigram": 0.05, "skip": 0.5, "dc1": 1.0}
VE_GATE_IN = 6  # channels of the attention input and of the value embedding that the VE gate reads
# positions whose logits eval holds at once (a 262,144-token chunk's: 26 GB in bf16)
VAL_PIECE = 16_384


def injects(spec, layer):
    """Whether ``layer`` adds x0 and the bigram after attention by gate-MLP lanes: it has attention
    and is not the last layer, whose gates MUDD gives per token."""
    return layer not in spec.no_attn and layer != spec.n_layer - 1


def gate_lanes(spec):
    """Record #85's two gate MLPs' outputs as ``[(layer, kind, width)]`` each (first: of x0, layers
    before ``mudd_gates`` G; second: of the stream entering G): XSA, output gates, x0, bigram, the
    skip, DC w1, w2 (the record's second: 12 + 6 + 10 + 1 + 12 = 41 lanes)."""
    G = spec.mudd_gates
    H = spec.n_head
    lanes = ([], [])
    for kind, layers in (("xsa", spec.xsa), ("attn", spec.attn_gate)):
        for i in sorted(layers):
            lanes[i >= G].append((i, kind, H))
    for i in range(spec.n_layer):
        if injects(spec, i):
            lanes[i >= G].extend([(i, "x0", 1), (i, "bigram", 1)])
    lanes[1].append((None, "skip", 1))
    for i in sorted(spec.dc):
        lanes[i >= G].extend([(i, "dc1", H), (i, "dc2", H)])
    return lanes


class Mix(NamedTuple):
    """How a block mixes its sublayers into the stream: ``x = attn_keep x + attn_add attn(norm(x))
    + x0_gate x0 + bigram_gate bigram``, then ``x = mlp_keep x + mlp_add mlp(norm(x))``; each a
    learned scalar (a block's lambdas), a gate-MLP lane or MUDD's per-token ``[B, L, 1]``
    coefficient (the last layer). ``ve_gate``: the value embedding's (None: the block's own)."""
    attn_keep: object
    attn_add: object
    mlp_keep: object
    mlp_add: object
    x0_gate: object
    bigram_gate: object
    ve_gate: object


class LayerInputs(NamedTuple):
    """What a block reads besides the stream, per forward: ``x0`` ``[B, L, d]`` (the normed
    embedding; the last layer: the stream before layer 0), its ``LayerMasks``, the value embedding
    ``ve``, ``attn_in`` (an earlier state the attention reads instead of x, #77), the ``bigram``
    embedding to inject, the gate MLPs' lanes ``gates`` ``{kind: [B, L, w]}`` (None: none)."""
    x0: object
    mask: object
    ve: object = None
    attn_in: object = None
    bigram: object = None
    gates: object = None


class Block(nn.Module):
    """Pre-norm block with record #89's residual (``Mix``); the last layer's mix is MUDD's."""

    def __init__(self, spec, layer, rotary, fp8):
        super().__init__()
        has_attn = layer not in spec.no_attn
        static = injects(spec, layer)
        self.attn = CausalSelfAttention(spec, rotary, layer) if has_attn else None
        self.mlp = MLP(spec, fp8)
        lambdas = static or not has_attn
        self.resid = scalar(torch.full((2,), 1.1 ** 0.5), "resid_lambdas") if lambdas else None
        self.post = scalar(torch.ones(2), "post_lambdas") if lambdas else None
        gated = layer in spec.ve_layers and static
        self.ve_gate = None
        if gated:
            self.ve_gate = scalar(torch.zeros(spec.n_head, 2 * VE_GATE_IN), "ve_gates")

    def forward(self, x, feed, mix=None):
        """x ``[B, L, d]``; ``feed`` its ``LayerInputs``; ``mix`` MUDD's ``Mix`` (None: the block's
        own lambdas and its gate lanes)."""
        g = feed.gates or {}
        if mix is None:
            mix = Mix(self.resid[0], self.post[0], self.resid[1], self.post[1], g.get("x0"),
                      g.get("bigram"), None)
        gv = mix.ve_gate
        if self.attn is not None:
            h = rms_norm(x if feed.attn_in is None else feed.attn_in)
            if self.ve_gate is not None:  # 2 sigmoid(W [h[:6], ve[:6]]) per head: 1 at init
                gin = torch.cat((h[..., :VE_GATE_IN], feed.ve[..., :VE_GATE_IN].type_as(h)), dim=-1)
                gv = 2 * torch.sigmoid(linear(gin, self.ve_gate)).unsqueeze(-1)
            dc = (g.get("dc1"), g.get("dc2"))
            y = self.attn(h, feed.mask, feed.ve, gv, g.get("xsa"), g.get("attn"), dc)
            x = mix.attn_keep * x + mix.attn_add * y
            if mix.x0_gate is not None:
                x = x + mix.x0_gate * feed.x0
            if mix.bigram_gate is not None and feed.bigram is not None:
                x = x + mix.bigram_gate * feed.bigram
        return mix.mlp_keep * x + mix.mlp_add * self.mlp(rms_norm(x))


def embed_tokens(table, inputs):
    """Inputs ``[B, L, k]`` through an embedding (a module or a function) -> ``[B, L, d]``: the row
    (k = 1) or the bag's mean (TST)."""
    x = table(inputs)
    return bag_mean(x) if inputs.size(-1) > 1 else x.squeeze(2)


def rope_positions(cfg):
    """Positions of the RoPE table a run needs: 2 x its longest sequence (stage 3's or a val chunk),
    as paired layers place a token's two head halves at 2t and 2t + 1."""
    return 2 * max(3 * cfg.seq_len, val_chunk(cfg))


def build_model(cfg, spec, dtype=None):
    """The GPT of a run of ``cfg`` on ``spec``: RoPE for its sequences, FP8 as --fp8 asks."""
    return GPT(spec, rope_positions(cfg), cfg.fp8, dtype)


class GPT(nn.Module):
    """Record #89's decoder whose inputs may be bags of tokens (TST phase 1, docs/METHODS.md §1).
    ``forward``: inputs int64 ``[B, L, k]`` (k = s: a bag, embedded as its mean), targets int64
    ``[B, L, j]`` (-100: ignored) -> float32 capped logits ``[B, L, V]``, or with targets the
    float32 loss *sum* (``loss_sum``; ``weights`` ``[j]`` of the target columns in training).
    ``spec``: the ``ModelSpec``; ``max_len``: RoPE positions (``rope_positions``); ``fp8``: the head
    and MLP matmuls in FP8 while training on CUDA; ``dtype``: the activations' (bf16 on CUDA, as
    modded-nanogpt; None on a CPU: the weights' own, float32, exactly repeatable); weights cast per
    matmul (``linear``). ``tied``: until ``untie``."""

    def __init__(self, spec, max_len, fp8=False, dtype=None):
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        d = spec.model_dim
        V = spec.vocab_size
        self.ve_of_layer = {layer: i % spec.value_embeds for i, layer in enumerate(spec.ve_layers)}
        self.embed = nn.Embedding(V, d)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, d) for _ in range(spec.value_embeds))
        route(self.embed.weight, "adam", "embed")
        for table in self.value_embeds:
            # small, as the record's
            nn.init.normal_(route(table.weight, "adam", "value_embeds"), std=0.01)
        # one RoPE table for every layer
        self.rotary = Rotary(spec.head_dim, max_len, spec.attn_scale)
        self.blocks = nn.ModuleList(Block(spec, i, self.rotary, fp8) for i in range(spec.n_layer))
        self.init_inputs(spec)
        self.lm_head = _linear(d, V, zero=True, group="adam", role="lm_head")
        head_scales = torch.tensor(HEAD_SCALES) if fp8 else None
        self.register_buffer("head_scales", head_scales, persistent=False)
        self._divisor = 1  # what the buffers below hold now: they are written only on a change
        self._window = (0, 0)
        self._yarn = ()
        # (long, short)
        self.register_buffer("windows", torch.tensor(self._window), persistent=False)
        self.tied = True  # until stage 3 (records #51, #53): the embedding reads the head's weight
        # FlexAttention block masks: None = on CUDA inputs; False = SDPA's bool masks anywhere
        self.flex = None
        # FlexAttention's kernels (--attention-backend: kernels.choose_flex_backend)
        self.flex_backend = "TRITON"
        with torch.no_grad():  # the tied head's init: N(0, 0.005^2), the embedding a copy
            nn.init.normal_(self.lm_head.weight, std=0.005)
            self.embed.weight.copy_(self.lm_head.weight)

    def init_inputs(self, spec):
        """The record's inputs and connections: skip gate, smear, bigram table, MUDD, gate MLPs."""
        d = spec.model_dim
        self.skip_lambda = scalar(torch.tensor(-1.5))  # sigmoid(-1.5) = 0.18
        self.smear_w = scalar(torch.zeros(1, 12), "smear_gate")
        self.smear_lambda = scalar(torch.zeros(()))
        self.bigram = nn.Embedding(spec.bigram_vocab, d)
        nn.init.zeros_(route(self.bigram.weight, "adam", "bigram_embed"))
        # record #83: a +-1 row per (previous XOR current) lets bigrams that share a hash row differ
        # in sign
        self.register_buffer("bigram_signs", torch.randn(BIGRAM_SIGN_ROWS, d).sign())
        # MUDD (#81): two 64-wide GELU MLPs of the stream, 14 coefficients at the last layer, 5
        # after it
        # kaiming a=sqrt(5)
        self.mudd_w1 = scalar(torch.empty(2, 64, d).uniform_(-d ** -0.5, d ** -0.5), "mudd")
        self.mudd_w2 = scalar(torch.zeros(2, 14, 64), "mudd")  # zero: MUDD starts as a no-op
        # biases in units of MUDD_SCALE: VE gate 2, lambdas sqrt(1.1) and 1, bigram 0.05,
        b = torch.zeros(2, 14)
        b[0, 6:14] = torch.tensor([2.0, 2.0, 1.1 ** 0.5, 1.0, 0.0, 0.05, 1.1 ** 0.5, 1.0])
        b[1, 1] = -0.5  # ... and -0.5 of the state after the loop (the former backout, record #81)
        self.mudd_b2 = scalar(b / MUDD_SCALE, "mudd_bias")
        # record #85: two gate MLPs, of x0 for the layers before mudd_gates, then of the stream
        self.gate_lanes = gate_lanes(spec)
        m = max(sum(w for _, _, w in lanes) for lanes in self.gate_lanes)
        self.gate_w1 = scalar(torch.empty(2, 64, d).uniform_(-d ** -0.5, d ** -0.5), "mudd_gate")
        self.gate_w2 = scalar(torch.zeros(2, m, 64), "mudd_gate")
        # starts: output gates 0.25, bigram 0.05, the skip 0.5 (XSA and x0: 0)
        b = torch.zeros(2, m)
        for j, lanes in enumerate(self.gate_lanes):
            off = 0
            for _, kind, w in lanes:
                b[j, off:off + w] = GATE_START.get(kind, 0.0)
                off += w
        self.gate_b2 = scalar(b / MUDD_SCALE, "mudd_gate_bias")
        # learned, unlike MUDD's
        self.gate_scale = scalar(torch.tensor(MUDD_SCALE), "mudd_gate_bias")

    def set_window(self, window, yarn):
        """Put ``(long, short)`` windows (a stage-table column) in the ``windows`` buffer and the
        RoPE tables of the long windows ``yarn`` (``StepRow.yarn``) in ``rotary``'s; written only on
        a change (no sync)."""
        if window != self._window:
            self.windows[0], self.windows[1] = window
            self._window = window
        if yarn != self._yarn:
            self.rotary.set_history(yarn)
            self._yarn = yarn

    def set_loss_divisor(self, divisor):
        """The FP8 head's gradient scale: 0.75/448 times the loss factor 1/``divisor``
        (``grad_divisor``), as modded-nanogpt's grad_s x 1/grad_accum_steps; written only on a
        change (no sync)."""
        if self.head_scales is not None and divisor != self._divisor:
            self.head_scales[2] = HEAD_SCALES[2] / divisor
            self._divisor = divisor

    def masks_for(self, inputs):
        """``(long, short)`` ``LayerMasks`` of a forward on ``inputs`` ``[B, L, k]``:
        document-masked sliding windows (a FlexAttention block mask on CUDA, SDPA's bool mask
        elsewhere), the doubled sequence's where paired layers use that window, and the document ids
        for DC."""
        spec = self.spec
        doc_ids = latent_document_ids(inputs)
        flex = inputs.is_cuda if self.flex is None else self.flex
        # the windows paired layers use
        paired = {i in spec.short_window for i in spec.paired_heads}
        return tuple(layer_masks(doc_ids, self.windows[j], flex, short in paired, False,
                                 bool(spec.dc), self.flex_backend)
                     for j, short in enumerate((False, True)))

    def forward(self, inputs, targets=None, weights=None):
        spec = self.spec
        n = spec.n_layer
        masks = self.masks_for(inputs)
        table = (lambda ids: F.embedding(ids, self.lm_head.weight)) if self.tied else self.embed
        # the stream's dtype from here on
        x = x0 = rms_norm(self.smeared(self.act(embed_tokens(table, inputs))))
        ves = [self.act(embed_tokens(t, inputs)) for t in self.value_embeds]
        bigram = self.bigram_embedding(inputs)
        gates, skip_factor = self.gate_coefs(x0, 0)
        # layer 0's gate: the bigram enters before the first layer
        x = x + gates[0]["bigram"] * bigram
        start = x
        snaps = {}
        for i, block in enumerate(self.blocks):
            if i == spec.mudd_gates:  # record #85's second gate MLP
                post, skip_factor = self.gate_coefs(x, 1)
                gates.update(post)
            if i == spec.skip[1]:  # the one gated skip (record #89: 3 -> 6)
                x = x + torch.sigmoid(self.skip_lambda) * skip_factor * snaps[spec.skip[0]]
            ve = ves[self.ve_of_layer[i]] if i in self.ve_of_layer else None
            mix = None
            if i == n - 1:  # MUDD mixes earlier states into the last layer
                x, ve, mix = self.mudd_in(x, start, snaps[spec.attn_state_layer], ve)
            feed = LayerInputs(x0 if mix is None else start, masks[i in spec.short_window], ve,
                               snaps.get(spec.attn_state_layer), bigram if i else None,
                               gates.get(i))
            x = block(x, feed, mix)  # layers after attn_state_layer attend from the stream it left
            snaps[i] = x  # references only: the backward keeps these tensors anyway
        # after the loop: the start, the state, the last layer's input, VE 0, the skip
        mu = self.mudd_coefs(x, 1, 5)
        srcs = (start, snaps[spec.attn_state_layer], snaps[n - 2], ves[0], snaps[spec.skip[0]])
        x = rms_norm(x + sum(m * src for m, src in zip(mu, srcs)))
        head = self.lm_head.weight
        # the metric: a long val chunk's logits in pieces of VAL_PIECE
        if targets is not None and not self.training:
            n = max(1, VAL_PIECE // x.size(0))
            pieces = zip(x.split(n, dim=1), targets.split(n, dim=1))
            return sum(loss_sum(linear(xp, head), tp) for xp, tp in pieces)
        # record #19's FP8 head, its fixed scales (#89)
        if fp8_active(self.head_scales is not None, x, head):
            logits = fp8_linear(x, head, fp8_grad=True, scales=self.head_scales)
        else:
            logits = linear(x, head)
        if targets is not None:  # the cap is applied inside the fused loss
            return loss_sum(logits, targets, weights)
        A, B, C = SIGMOID_CAP
        return A * torch.sigmoid((upcast(logits) + B) / C)

    def act(self, x):
        """``x`` in the activations' dtype (``dtype``; None: as it is)."""
        return x if self.dtype is None else x.to(self.dtype)

    def smeared(self, x):
        """Record #34 on embeddings x ``[B, L, d]``: ``x[t] += lam sigmoid(w . x[t, :12]) x[t-1]``
        for t >= 1 (the gate is computed at every position, one unused, so the matmul count is 12
        per position)."""
        g = (self.smear_lambda * torch.sigmoid(linear(x[..., :12], self.smear_w)))[:, 1:]
        return torch.cat((x[:, :1], x[:, 1:] + g * x[:, :-1]), dim=1)

    def bigram_embedding(self, inputs):
        """Bigram hash embedding (record #62, signs #83): inputs ``[B, L, k]`` -> ``[B, L, d]``;
        token c after p takes row ``(36313 c ^ 27191 p) mod (V - 1)`` times sign row ``(p ^ c) mod
        8192`` (a row's first: row V - 1, sign row 0), a bag the mean over its tokens
        (docs/METHODS.md §5)."""
        B, L, k = inputs.shape
        cur = inputs.reshape(B, L * k)
        prev = F.pad(cur[:, :-1], (1, 0))
        pos = torch.arange(L * k, device=inputs.device)
        V = self.bigram.num_embeddings - 1
        # position 1 hashes its position 0's row number V as the previous token, in int32 (27191 V
        # wraps)
        term = (27191 * torch.where(pos == 1, V, prev) + 2 ** 31) % 2 ** 32 - 2 ** 31
        # int64, else as modded-nanogpt's int32 ops
        rows = torch.where(pos == 0, V, ((36313 * cur) ^ term) % V)
        signs = self.bigram_signs[torch.where(pos == 0, 0, (prev ^ cur) % BIGRAM_SIGN_ROWS)]
        e = self.act(self.bigram(rows))
        e = (e * signs.type_as(e)).view(B, L, k, -1)  # +-1: exact in bf16
        return bag_mean(e) if k > 1 else e.squeeze(2)

    def mudd_coefs(self, x, j, m):
        """MUDD block j's m coefficients, each ``[B, L, 1]``: ``(W2 gelu(W1 x) + b) * 0.1`` (#81)."""
        h = F.gelu(linear(x, self.mudd_w1[j]))
        coefs = (linear(h, self.mudd_w2[j, :m]) + self.mudd_b2[j, :m].type_as(h)) * MUDD_SCALE
        return coefs.split(1, dim=-1)

    def gate_coefs(self, x, j):
        """Record #85's gate MLP j of x ``[B, L, d]``: ``{layer: {kind: [B, L, w]}}`` over
        ``gate_lanes[j]`` and (j = 1) the skip's factor ``[B, L, 1]``: ``(W2 gelu(W1 x) + b) *
        scale``, one lane per coefficient."""
        lanes = self.gate_lanes[j]
        m = sum(w for _, _, w in lanes)
        h = F.gelu(linear(x, self.gate_w1[j]))
        c = (linear(h, self.gate_w2[j, :m]) + self.gate_b2[j, :m].type_as(h)) * self.gate_scale
        out = {}
        skip = None
        for (layer, kind, w), piece in zip(lanes, c.split([w for _, _, w in lanes], dim=-1)):
            if kind == "skip":
                skip = piece
            else:
                out.setdefault(layer, {})[kind] = piece
        return out, skip

    def mudd_in(self, x, start, state, ve):
        """MUDD at the last layer's input x ``[B, L, d]`` (record #81 v2): mixes the stream before
        layer 0 (``start``) and ``state`` into V and into the residual, gates the VE per head pair,
        and gives the layer's ``Mix`` per token. Returns (x, V addend ``[B, L, d]``, ``Mix``)."""
        mu = self.mudd_coefs(x, 0, 14)
        B, L, d = x.shape
        H = self.spec.n_head
        v = mu[0] * start + mu[1] * state + mu[2] * x
        if ve is not None:  # two gate lanes, each over half the heads
            # [B, L, H, 1]
            gate = torch.cat(mu[6:8], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
            v = v + (gate * ve.view(B, L, H, d // H)).view(B, L, d)
        x = (1 + mu[5]) * x + mu[3] * start + mu[4] * state
        return x, v, Mix(mu[8], mu[9], mu[12], mu[13], mu[10], mu[11], x.new_ones(()))


def loss_sum(logits, targets, weights=None):
    """The loss *sum* of logits ``[..., V]`` against targets ``[..., J]`` under the sigmoid cap
    (record #54): ``multi_target_loss``, column ``weights`` ``[J]`` (None: each 1, the metric and
    TST's MCE)."""
    if weights is None:
        weights = torch.ones(targets.size(-1), dtype=torch.float32, device=logits.device)
    return multi_target_loss(logits, targets, weights, cap="sigmoid")


# ----------------------------------------------------------------------------------------------
# Token-Superposition Training (Peng, Gigant, Quesnelle 2026, arXiv 2605.06546; docs/METHODS.md §1)
# and the multi-token and prefix targets of the record's objective (records #53, #88)

EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document


def sequence_layout(mode, bag_size, seq_len):
    """``(seq_tokens, advance)``: raw tokens per sequence and stream advance: next-token L + 1, L;
    TST full/input (L + 1) s, L s (the last bag's labels: the next bag); output L + s, L. Each token
    is input once."""
    s = bag_size
    L = seq_len
    if s == 1:
        return L + 1, L
    if mode in ("full", "input"):
        return (L + 1) * s, L * s
    return L + s, L  # output


def make_tst_batch(tokens, bag_size):
    """int64 ``[B, (L + 1) s]`` -> ``(bags, next bags)``, int64 ``[B, L, s]`` views (bag i: s tokens)."""
    B, n = tokens.shape
    s = bag_size
    if s < 1 or n % s or n // s < 2:
        raise ValueError(f"make_tst_batch: length {n} is not (L+1)*s with L >= 1 for s={s}")
    t = tokens.view(B, n // s, s)
    return t[:, :-1], t[:, 1:]


def make_batch(tokens, mode, bag_size):
    """int64 ``[B, seq_tokens]`` -> ``(inputs [B, L, k], targets [B, L, j])``: next-token k = j = 1;
    full k = j = s; input k = s, j = 1 (the next bag's first token); output k = 1, j = s (position t
    predicts t+1..t+s)."""
    if bag_size == 1 or mode in ("full", "input"):
        bags, targets = make_tst_batch(tokens, bag_size)
        return bags, (targets[..., :1] if mode == "input" else targets)
    L = tokens.size(1) - bag_size
    return tokens[:, :L, None], tokens[:, 1:].unfold(1, bag_size, 1)


def bag_mean(x):
    """Bag embedding: ``[B, L, s, d]`` -> ``[B, L, d]``, summed in float32, divided by s, cast back.
    """
    return (upcast(x).sum(dim=2) / x.size(2)).to(x.dtype)


def multi_token_targets(targets, n_predict):
    """int64 ``[..., L]`` -> ``[..., L, n]``: ``out[..., i, k] = targets[..., i + k]``, ``PAST_END``
    past L (record #53; not cut at document ends, its weight kept in the softmax term, as
    modded-nanogpt)."""
    return F.pad(targets, (0, n_predict - 1), value=PAST_END).unfold(-1, n_predict, 1)


def prefix_targets(table, targets):
    """Prefix-token labels int64 ``[...]``: ``table[targets]``, ignored where ignored (#88)."""
    return torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, table[targets.clamp_min(0)])


def prefix_token_table(vocab_size, path=harness.shard_format.GPT2_ENCODER_JSON):
    """int64 ``[vocab_size]``: each token's longest proper byte prefix that is a token, else ignored
    (record #88): single bytes, <|endoftext|> and padding have none."""
    token_bytes = harness.shard_format.gpt2_token_bytes(path)
    ids = {b: i for i, b in token_bytes.items()}
    table = [IGNORE_INDEX] * vocab_size
    for i, b in token_bytes.items():
        if i < vocab_size:
            prefixes = (ids[b[:n]] for n in range(len(b) - 1, 0, -1) if b[:n] in ids)
            table[i] = next(prefixes, IGNORE_INDEX)
    return torch.tensor(table, dtype=torch.int64)


def objective_targets(targets, prefix_table, n_predict=3):
    """int64 ``[..., L]`` -> ``[..., L, n_predict + 1]``: multi-token columns, then the prefix."""
    cols = multi_token_targets(targets, n_predict)
    return torch.cat([cols, prefix_targets(prefix_table, targets)[..., None]], dim=-1)


class Targets(NamedTuple):
    """A step's training targets: ``micro`` ``[(inputs, targets)]`` per micro-batch and ``weights``
    float32 ``[J]`` of the target columns (None: each column 1, TST's own objective)."""
    micro: list
    weights: object


class Objectives:
    """The stage table's 4 target columns in phase 2: every step's weights float32 ``[N + 1, 4]`` on
    the device, copied into ``weights`` per step (no host sync, no new graph)."""

    def __init__(self, schedule, vocab_size, device):
        self.table = prefix_token_table(vocab_size).to(device)
        per_step = [row.objective for row in schedule.rows]
        self.per_step = torch.tensor(per_step, dtype=torch.float32, device=device)
        self.weights = torch.empty(4, dtype=torch.float32, device=device)

    def batches(self, micro, step, stage):
        """The step's ``Targets``: a phase-2 step's next-token rows get the record's 4 columns
        ``[b, L, 4]`` and the step's weights; TST phase 1 trains its own objective."""
        if stage.phase == 1:
            return Targets(micro, None)
        self.weights.copy_(self.per_step[step])
        columns = [(inputs, objective_targets(t[..., 0], self.table)) for inputs, t in micro]
        return Targets(columns, self.weights)


# ----------------------------------------------------------------------------------------------
# Data: document-packed batches from the train stream (records #26 BOS alignment, #29 per-document
# cap and packing, #72 the 896-token cap of stage 1), the val tokens in memory

def enters_new_pass(old, new, total):
    """Whether a step's stream positions [old, new) reach a pass over the ``total``-token stream
    that the steps before ([0, old)) did not: a wrap, logged once, also when ``old`` sits exactly on
    a pass boundary."""
    return new > old and (new - 1) // total > max(old - 1, 0) // total


def document_spans(window, start, total):
    """``(starts, ends)`` int64 stream positions of the documents wholly inside ``window`` (int64
    ``[n]``, the tokens from ``start``; ``total`` per pass): a document runs from an EOT to the next
    EOT or the end of the pass."""
    stop = start + window.size
    starts = np.flatnonzero(window == EOT_TOKEN) + start
    ends = np.minimum(np.append(starts[1:], np.iinfo(np.int64).max), (starts // total + 1) * total)
    keep = ends <= stop
    return starts[keep], ends[keep]


def pack_plan(lengths, seq_tokens, n_seqs):
    """``(first, last, tail)`` int64 ``[n_seqs]``: the documents (clipped ``lengths`` ``[D]``, in
    order) filling each sequence of ``seq_tokens`` and the tokens taken from its last, cut one (the
    rest is skipped); None when the D documents cannot fill ``n_seqs`` sequences."""
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    first = np.empty(n_seqs, dtype=np.int64)
    last = np.empty(n_seqs, dtype=np.int64)
    doc = 0
    for j in range(n_seqs):  # one binary search per sequence, none per token
        end = int(np.searchsorted(bounds, bounds[doc] + seq_tokens, side="left"))
        if end == bounds.size:
            return None
        first[j] = doc
        last[j] = end - 1
        doc = end
    return first, last, bounds[first] + seq_tokens - bounds[last]


class Packing(NamedTuple):
    """Where a step's sequences come from: the stream ``window`` read at the loader's position, its
    documents' ``starts``, ``ends`` and clipped ``lengths``, and ``pack_plan``'s ``first`` and
    ``last`` document of each sequence and the ``tail`` taken from the last one."""
    window: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    lengths: np.ndarray
    first: np.ndarray
    last: np.ndarray
    tail: np.ndarray


class PackedLoader:
    """Document-packed train batches, sized per call: a sequence starts at an EOT and holds whole
    documents clipped to ``cap`` tokens, the last one cut, no padding. Sequence ``rank * accum +
    micro`` goes to that rank and micro-step; ``position`` is the whole state."""

    def __init__(self, stream, rank, world):
        self.stream = stream
        self.rank = rank
        self.world = world
        self.position = 0  # the stream position of the next batch: the loader's whole state
        self.wrapped = False

    def next_batch(self, global_seqs, micro_seqs, seq_len, cap, bag_size=1, mode="full"):
        """``(micro, raw_tokens)``: ``accum`` int64 ``[micro_seqs, seq_tokens]`` of this rank and
        the stream tokens consumed (skipped ones too)."""
        accum = global_seqs // (micro_seqs * self.world)
        seq_tokens, _ = sequence_layout(mode, bag_size, seq_len)
        plan = self._plan(global_seqs, seq_tokens, cap)
        mine = slice(self.rank * accum * micro_seqs, (self.rank + 1) * accum * micro_seqs)
        lo = plan.first[mine][0]                                    # this rank's documents
        hi = plan.last[mine][-1] + 1
        piece = plan.lengths[lo:hi].copy()
        piece[plan.last[mine] - lo] = plan.tail[mine]               # each sequence's cut last one
        offset = np.cumsum(piece) - piece                           # where each piece lands
        index = np.repeat(plan.starts[lo:hi] - self.position - offset, piece)
        index += np.arange(accum * micro_seqs * seq_tokens)
        tokens = torch.from_numpy(plan.window[index]).view(accum, micro_seqs, seq_tokens)
        old = self.position
        self.position = int(plan.ends[plan.last[-1]])
        self.wrapped = enters_new_pass(old, self.position, self.stream.total)
        return list(tokens.unbind(0)), self.position - old

    def _plan(self, n_seqs, seq_tokens, cap):
        """The ``Packing`` of ``n_seqs`` sequences, reading ahead (doubling) until they fit."""
        stream = self.stream
        start = self.position
        n = 2 * n_seqs * seq_tokens                                 # twice what the sequences hold
        while True:
            window = stream.read(start, n)
            starts, ends = document_spans(window, start, stream.total)
            lengths = np.minimum(ends - starts, cap)
            plan = pack_plan(lengths, seq_tokens, n_seqs)
            if plan is not None:
                return Packing(window, starts, ends, lengths, *plan)
            if n >= stream.total and not (window == EOT_TOKEN).any():
                names = ", ".join(os.path.basename(f) for f in stream.files[:3])
                raise DataError(f"{names}: no <|endoftext|> (id {EOT_TOKEN}) in the train stream; "
                                f"packed batches need one before every document: re-tokenize with "
                                f"data/tokenize_text.py")
            n *= 2


def next_micro_batches(loader, stage, rt, micro_seqs):
    """``([(inputs, targets)] of this rank, on the device; raw tokens read)`` of a step."""
    global_seqs = stage.batch_tokens // stage.seq_len
    tokens, raw_tokens = loader.next_batch(global_seqs, micro_seqs, stage.seq_len, stage.doc_cap,
                                           stage.bag_size, stage.mode)
    micro = [make_batch(rt.to_device(t), stage.mode, stage.bag_size) for t in tokens]
    return micro, raw_tokens


def val_chunk(cfg, bag_size=1):
    """Tokens per val sequence: the metric's chunk (--val-seq-len, else --seq-len; at most
    --val-tokens), else the phase-1 objective's --seq-len."""
    return min(cfg.val_seq_len or cfg.seq_len, cfg.val_tokens) if bag_size == 1 else cfg.seq_len


class ValData:
    """The first ``n_tokens`` tokens of the val shards (+1 for the last label), in memory."""

    def __init__(self, stream, n_tokens):
        if stream.total < n_tokens + 1:
            names = ", ".join(stream.files)
            raise DataError(f"--val-tokens {n_tokens}: the val shards ({names}) hold only "
                            f"{stream.total} tokens (need {n_tokens} + 1 for the last label); "
                            f"lower --val-tokens or add val shards")
        self.n_tokens = n_tokens
        self.tokens = torch.from_numpy(stream.read(0, n_tokens + 1))

    def batches(self, mode, bag_size, seq_len, batch_seqs, rt):
        """This rank's int64 batches ``[batch_seqs, ...]`` of an objective (``make_batch``; s = 1:
        the metric's chunks of ``seq_len``): sequence i on rank i mod world, as many forwards on
        every rank, so any process count scores the same sequences (modded-nanogpt: 262,144 tokens
        per rank of 8); labels past ``n_tokens`` are ignored."""
        seq_tokens, advance = sequence_layout(mode, bag_size, seq_len)
        per_rank = -(-self.n_tokens // (advance * rt.world * batch_seqs)) * batch_seqs
        length = (per_rank * rt.world - 1) * advance + seq_tokens
        tokens = torch.full((length,), EOT_TOKEN, dtype=torch.int64)  # padding, its labels ignored
        tokens[:self.n_tokens + 1] = self.tokens
        label_ok = torch.zeros(length, dtype=torch.bool)
        label_ok[1:self.n_tokens + 1] = True
        seqs = tokens.unfold(0, seq_tokens, advance)
        oks = label_ok.unfold(0, seq_tokens, advance)
        for group in torch.arange(rt.rank, per_rank * rt.world, rt.world).split(batch_seqs):
            inputs, targets = make_batch(seqs[group], mode, bag_size)
            _, counted = make_batch(oks[group], mode, bag_size)
            yield inputs, torch.where(counted, targets, IGNORE_INDEX)


# ----------------------------------------------------------------------------------------------
# Optimizers (docs/METHODS.md §2, §3): NorMuon (or Aurora's polar on the MLP matrices) on the
# block matrices, CautiousAdam by role on the rest, every other step; the stage table sets their lr
# and momentum per step

def build_optimizers(model, cfg, compile=False, shard=None):
    """``[CautiousAdam, NorMuon]`` over ``model``'s parameters by their ``route`` tags (``shard``:
    the GradBuckets of a run on several processes: Adam keeps 1/world of its state); every group
    keeps its ``initial_lr``."""
    blocks = dict(model.blocks.named_parameters())

    def pick(*ends):
        return [(f"blocks.{n}", p) for n, p in blocks.items() if n.endswith(ends)]
    groups = matrix_groups(pick("attn.q.weight", "attn.k.weight"),
                           pick("attn.v.weight", "attn.proj.weight"), pick("mlp.fc.weight"),
                           pick("mlp.proj.weight"), model.spec.head_dim,
                           aurora=cfg.optimizer == "aurora_normuon",
                           pp_iterations=cfg.pp_iterations)
    matrices = NorMuon(groups, lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum,
                       pp_beta=cfg.pp_beta, compile=compile)
    roles = {}
    for p in model.parameters():
        if p.opt_group == "adam":
            roles.setdefault(p.adam_role, []).append(p)
    adam = CautiousAdam(adam_groups(roles, lr=cfg.adam_lr), eps=1e-10, every=2, compile=compile,
                        shard=shard)
    for opt in (adam, matrices):
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return [adam, matrices]


def adam_bf16_(model):
    """A bf16 run stores Adam's parameters of 2+ dims in bf16, so each update rounds as
    modded-nanogpt's; its vectors and scalars stay float32, NorMuon's matrices float32
    (modded-nanogpt: bf16 + 16 extra mantissa bits)."""
    for p in model.parameters():
        if p.ndim >= 2 and p.opt_group == "adam":
            p.data = p.data.bfloat16()


@torch.no_grad()
def untie(model, adam):
    """End the tie (records #51, #53): the embedding takes the head's weight and its Adam state."""
    model.embed.weight.copy_(model.lm_head.weight)
    head = adam.state[model.lm_head.weight]
    embed = adam.state[model.embed.weight]
    for key, value in head.items():
        embed[key] = value.clone() if torch.is_tensor(value) else value
    model.tied = False


def split_step(cfg):
    """The step after which the embedding unties: stage 3's first, made odd (an Adam step)."""
    return recipe_stages(cfg)[2].start | 1


def apply_schedule(opts, row):
    """Every group's lr (and NorMuon's momentum) from a stage-table ``row``."""
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * row.lr_scale
            if isinstance(opt, NorMuon):
                g["momentum"] = row.momentum


def all_reduce_sum(t, rt):
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def grad_divisor(stage):
    """What a step's loss sum is divided by for its gradient: modded-nanogpt's per-rank sum over one
    flat sequence, averaged over 8 ranks, i.e. the step's sequence count (x s for an MCE's s labels
    per position)."""
    per_label = stage.bag_size if stage.phase == 1 and stage.mode != "input" else 1
    return stage.batch_tokens // stage.seq_len * per_label


def accumulate_gradients(model, micro_batches, rt, weights, divisor, buckets=None):
    """Forward/backward over this rank's ``[(inputs [b, L, k], targets [b, L, j])]``; returns the
    float32 loss (the global label sum, columns weighted by ``weights`` [J], over the next-token
    label count); the gradient of the sum over ``divisor``, communicated in ``buckets`` (several
    processes) from the last backward on."""
    n_valid = torch.zeros((), device=rt.device)
    for _, targets in micro_batches:
        n_valid += ((targets if weights is None else targets[..., :1]) != IGNORE_INDEX).sum()
    total = torch.zeros((), device=rt.device)
    for m, (inputs, targets) in enumerate(micro_batches):
        loss_sum = model(inputs, targets) if weights is None else model(inputs, targets, weights)
        handles = buckets.hooks() if buckets is not None and m == len(micro_batches) - 1 else []
        (loss_sum / divisor).backward()
        for h in handles:
            h.remove()
        total += loss_sum.detach()
    if not rt.distributed:
        return total / n_valid.clamp_min(1)
    sums = torch.stack([total, n_valid.float()])
    # before the buckets: two numbers do not wait behind the tables
    work = dist.all_reduce(sums, async_op=True)
    if buckets is not None:
        buckets.start_rest()  # Adam's reduce-scatters last: they run while NorMuon computes
    work.wait()
    if buckets is not None:
        # NorMuon's all-reduced gradients; Adam waits for its own in its step
        buckets.wait("reduce")
    return sums[0] / sums[1].clamp_min(1)


# ----------------------------------------------------------------------------------------------
# Eval: the metric is next-token cross-entropy over the first --val-tokens tokens of the val shards

@contextmanager
def eval_mode(model):
    """``model`` in eval mode without gradients inside the block, back in its previous mode after.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def evaluate(model, val, mode, bag_size, cfg, rt):
    """Mean loss over the val tokens for an objective (s = 1: the metric), in eval mode."""
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    count = torch.zeros((), device=rt.device, dtype=torch.float64)
    with eval_mode(model):
        chunk = val_chunk(cfg, bag_size)
        for inputs, targets in val.batches(mode, bag_size, chunk, cfg.val_batch_seqs, rt):
            targets = rt.to_device(targets)
            total += model(rt.to_device(inputs), targets).double()
            count += (targets != IGNORE_INDEX).sum()
    all_reduce_sum(total, rt)
    all_reduce_sum(count, rt)
    return (total / count.clamp_min(1)).item()


# ----------------------------------------------------------------------------------------------
# The run: what the loop works on, the compile warm-up, validation, then main() and the loop itself

@dataclass
class Progress:
    """What the run has done so far; saved in checkpoints, summed over a resume."""
    train_time_ms: float = 0.0  # wall-clock of training steps only
    # text read from the train stream (TST phase 1 reads s x more per step)
    raw_tokens: int = 0
    positions: int = 0          # latent positions trained
    flops: float = 0.0          # model FLOPs (StepRow.flops_per_position x positions)


@dataclass
class Run:
    """The loop's state: config and stage table, runtime, log, the model (``net``: compiled, if it
    is), optimizers, data, progress; ``split``: the step after which the embedding unties."""
    cfg: Config
    schedule: Schedule
    rt: harness.Runtime
    log: harness.RunLog
    model: GPT
    net: nn.Module
    # several processes: gradient all-reduce / reduce-scatter, Adam's all-gather; else None
    buckets: GradBuckets
    opts: list
    loader: PackedLoader
    val: ValData
    objectives: Objectives
    data: dict
    progress: Progress = field(default_factory=Progress)
    split: int = 0
    start: int = 0
    end: int = 0  # the step this invocation stops after (N, or sooner by --max-steps)


def build_run(cfg, spec, rt, log, data, resume, backend="TRITON"):
    """The model, optimizers and data of a run (restored from ``resume``, a checkpoint's state, when
    given); ``backend``: FlexAttention's kernels on CUDA (``kernels.choose_flex_backend``)."""
    train_stream = harness.TokenStream([f for f, _ in data["train"]], wrap=True)
    val_stream = harness.TokenStream([f for f, _ in data["val"]])
    harness.log_header(log, cfg, rt, data, (train_stream, val_stream))
    why = fp8_unavailable_reason(rt.device)  # a CPU, or a GPU before sm_89
    if cfg.fp8 and why:
        log.line(f"fp8: off ({why})")
        cfg = dataclasses.replace(cfg, fp8=False)
    log.line(f"attention: {'FlexAttention, ' + backend if rt.device.type == 'cuda' else 'SDPA'}")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, spec, torch.bfloat16 if rt.bf16 else None).to(rt.device)
    model.flex_backend = backend
    if rt.bf16:
        adam_bf16_(model)
    schedule = Schedule(cfg, spec)
    adam_params = [p for p in model.parameters() if p.opt_group == "adam"]
    buckets = None
    if rt.distributed:
        buckets = GradBuckets(model.parameters(), rt.rank, rt.world, adam_params)
    net = torch.compile(model, dynamic=False) if rt.compile else model
    opts = build_optimizers(model, cfg, rt.compile, buckets)
    loader = PackedLoader(train_stream, rt.rank, rt.world)
    objectives = Objectives(schedule, model.spec.vocab_size, rt.device)
    val = ValData(val_stream, cfg.val_tokens)
    run = Run(cfg, schedule, rt, log, model, net, buckets, opts, loader, val,
              objectives, data, split=split_step(cfg))
    fp8_refresh(model, -1)  # the delayed FP8 weight scales' bootstrap (a resume restores its own)
    if resume:
        run.start = harness.restore(resume, model, run.opts, run.loader, rt)
        run.progress = Progress(**resume["counters"])
        model.tied = run.start <= run.split
        log.line(f"resume: from step {run.start} train_time:{run.progress.train_time_ms:.0f}ms")
    run.end = cfg.num_iterations
    if cfg.max_steps:
        run.end = min(cfg.num_iterations, run.start + cfg.max_steps)
    n_params = sum(p.numel() for p in model.parameters())
    log.line(f"model: {n_params:,} parameters; {rt.accum} micro-batch(es) x {cfg.micro_batch_seqs} "
             f"sequence(s) x {rt.world} process(es) a step")
    return run


def graph_batches(run):
    """``{key: (inputs, targets, weights, tied, train)}``: one batch per graph that steps [start,
    end) and their validations call (--max-steps: only those), made by the loop's own functions,
    keyed on what a compiled graph guards on."""
    out = {}

    def add(inputs, targets, weights, tied, train):
        key = (tuple(inputs.shape), tuple(targets.shape), weights is None, tied, train)
        out.setdefault(key, (inputs, targets, weights, tied, train))

    lo = run.start
    hi = run.end
    for st in run.schedule.stages:
        if st.start >= hi or st.end <= lo:
            continue
        micro, _ = next_micro_batches(copy.copy(run.loader), st, run.rt, run.cfg.micro_batch_seqs)
        micro, weights = run.objectives.batches(micro[:1], st.start, st)
        for tied in (max(st.start, lo) <= run.split, min(st.end, hi) - 1 <= run.split):  # an untie
            add(*micro[0], weights, tied, True)
    evals = set()  # where ``train`` validates: the metric, and in phase 1 the TST objective too
    for step in range(lo + (lo > 0), hi + 1):
        every = run.cfg.val_every
        if step in (0, run.cfg.num_iterations) or (every and step % every == 0):
            st = run.schedule[max(step - 1, 0)].stage
            tied = step <= run.split
            evals.add(("full", 1, tied))
            if st.phase == 1:
                evals.add((st.mode, st.bag_size, tied))
    for mode, s, tied in sorted(evals):
        chunk = val_chunk(run.cfg, s)
        for inputs, targets in run.val.batches(mode, s, chunk, run.cfg.val_batch_seqs, run.rt):
            add(run.rt.to_device(inputs), run.rt.to_device(targets), None, tied, False)
    return out


def warm_up(run, stop):
    """Compile every graph the run calls before the clock: the model's (``graph_batches``) and the
    optimizers' (``warm_step``: every parameter variant); logs each one's time; returns all ms."""
    if not run.rt.compile:
        return 0.0
    # why: each variant is compiled here on purpose (stage shapes x tie x train/eval; an optimizer
    # graph per NorMuon bucket of same-shape blocks and per Adam group); torch's default of 8 per
    # function would run the rest uncompiled
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    t0 = time.perf_counter()
    graphs0 = harness.compiled_graphs()
    tied0 = run.model.tied
    fp8_state = {n: b.clone() for n, b in run.model.named_buffers() if n.endswith("down_scales")}
    batches = graph_batches(run)
    run.log.line(f"compile: warm-up plan: {len(batches)} model graph keys, {len(run.opts)} "
                 f"optimizers")
    attention = run.model.flex_backend if run.rt.device.type == "cuda" else "SDPA"
    for (in_shape, t_shape, _, tied, train), (inputs, targets, weights, _, _) in batches.items():
        t1 = time.perf_counter()
        g1 = harness.compiled_graphs()
        run.model.tied = tied
        try:
            with nullcontext() if train else eval_mode(run.net):
                args = (inputs, targets) if weights is None else (inputs, targets, weights)
                loss = run.net(*args)
        except Exception as err:  # noqa: BLE001 -- only FlashAttention-4 refusing a graph (auto)
            if not kernels.flash_refused(run.cfg.attention_backend, run.model.flex_backend, err):
                raise
            why = " ".join(str(err).split())[:160]
            run.log.line(f"attention: FLASH refused a graph ({why}); auto falls back to TRITON and "
                         f"compiles again")
            run.model.flex_backend = "TRITON"
            run.model.tied = tied0
            torch._dynamo.reset()
            return warm_up(run, stop)
        if train:
            loss.backward()
            run.model.zero_grad(set_to_none=True)
        run.rt.sync()
        took = 1000 * (time.perf_counter() - t1)
        run.log.line(f"compile: {'train' if train else 'val'} {list(in_shape)} -> {list(t_shape)} "
                     f"tied:{int(tied)} attention:{attention} took {took:.0f}ms, "
                     f"{harness.compiled_graphs() - g1} graph(s)")
        stop.raise_if_set()  # between graphs: no step to finish, nothing to save
    run.model.tied = tied0
    run.model.load_state_dict(fp8_state, strict=False)  # the warm-up's forwards moved them
    for opt in run.opts:
        t1 = time.perf_counter()
        g1 = harness.compiled_graphs()
        warm_step(opt)
        run.rt.sync()
        took = 1000 * (time.perf_counter() - t1)
        run.log.line(f"compile: optimizer {type(opt).__name__} took {took:.0f}ms, "
                     f"{harness.compiled_graphs() - g1} graph(s)")
    ms = 1000 * (time.perf_counter() - t0)
    graphs = harness.compiled_graphs() - graphs0
    run.log.line(f"compile: warm-up took {ms:.0f}ms (not in train_time), {graphs} graphs")
    if run.rt.distributed:  # the ranks compile alone and meet at the first collective: their skew
        every = [None] * run.rt.world
        dist.all_gather_object(every, ms)
        run.log.line(f"compile: warm-up per rank {min(every):.0f}-{max(every):.0f}ms, skew "
                     f"{max(every) - min(every):.0f}ms (--dist-timeout {run.cfg.dist_timeout}s)")
    return ms


def validate(run, step):
    """Log the val loss at ``step`` (the metric, and in phase 1 the TST objective's too)."""
    stage = run.schedule[max(step - 1, 0)].stage  # the stage that trained the model so far
    row = run.schedule[step]
    run.model.set_window(row.window, row.yarn)  # the final validation has its own long window
    loss = evaluate(run.net, run.val, "full", 1, run.cfg, run.rt)
    if not math.isfinite(loss):
        raise FloatingPointError(f"val loss is {loss} at step {step}; lower --matrix-lr or "
                                 f"--adam-lr")
    extra = ""
    if stage.phase == 1:  # the TST objective's own val loss, beside the metric
        tst = evaluate(run.net, run.val, stage.mode, stage.bag_size, run.cfg, run.rt)
        extra = f" val_loss_tst:{tst:.4f}"
    p = run.progress
    line = harness.step_line(step, run.cfg.num_iterations, "val_loss", loss, p.train_time_ms)
    run.log.line(f"{line} phase:{stage.phase}{extra} tokens:{p.raw_tokens} flops:{p.flops:.3e}")
    run.log.update(last_val_loss=loss, val_step=step)


def log_stage(run, step):
    """The first step of a stage: ``tst_switch`` where TST phase 1 ends, else what changed."""
    was = run.schedule[step - 1].stage
    now = run.schedule[step].stage
    tail = f"same weights and optimizer state; tokens:{run.progress.raw_tokens}"
    if (was.phase, now.phase) == (1, 2):
        return run.log.line(f"tst_switch: step {step}: phase 1 -> 2 (bag_size {was.bag_size} -> 1, "
                            f"mode {was.mode} -> next-token); {tail}")
    changes = []
    for k in ("batch_tokens", "seq_len", "doc_cap", "blocks", "lr_mul"):
        if getattr(was, k) != getattr(now, k):
            changes.append(f"{k} {getattr(was, k)} -> {getattr(now, k)}")
    run.log.line(f"stage: step {step}: {', '.join(changes) or 'a new stage'}; {tail}")


def describe(cfg, spec, preset, machines):
    """``--describe``: what a run would do, without data or a GPU: parameters (embedding tables and
    matrices), the stage rows, validation, totals, the memory estimate and the projected train time
    on ``machines``."""
    with torch.device("meta"):
        model = build_model(cfg, spec)
    n_params = sum(p.numel() for p in model.parameters())
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    tables = sum(w.numel() for w in embeddings) + model.lm_head.weight.numel()
    matrices = sum(p.numel() for p in model.parameters() if p.opt_group == "matrix")
    table = Schedule(cfg, spec)
    N = cfg.num_iterations
    flops = sum(row.flops_per_position * row.stage.batch_tokens for row in table.rows[:N])
    opt_flops = N * optimizer_flops(cfg, spec)  # the matrices' updates (Adam's are elementwise)
    tst = "off"
    if cfg.tst_frac:
        tst = f"{cfg.tst_mode} s={cfg.tst_bag_size} for {tst_switch_step(cfg)} steps"
    lines = [f"describe: preset {preset or '(none)'}: model {cfg.model}, {cfg.optimizer}, "
             f"TST {tst}",
             f"parameters: {n_params:,} = embedding tables and head {tables:,} + block matrices "
             f"{matrices:,} (NorMuon) + gates and scalars {n_params - tables - matrices:,} "
             f"(CautiousAdam)"]
    for st in table.stages:
        what = f"TST phase 1, {st.mode} s={st.bag_size}" if st.phase == 1 else "next-token"
        row = table[st.start]
        lines.append(f"steps [{st.start}, {st.end}) {what}: {st.batch_tokens // st.seq_len} x "
                     f"{st.seq_len:,} positions, {st.raw_tokens():,} tokens of text, windows "
                     f"{row.window}, cap {st.doc_cap}, lr x{st.lr_mul}, "
                     f"{row.flops_per_position * st.batch_tokens:.3e} FLOPs")
    chunk = val_chunk(cfg)
    positions = sum(r.stage.batch_tokens for r in table.rows[:N])
    text = sum((st.end - st.start) * st.raw_tokens() for st in table.stages)
    micro = cfg.micro_batch_seqs * 3 * cfg.seq_len
    lines += [f"validation: {cfg.val_tokens:,} tokens in {-(-cfg.val_tokens // chunk):,} "
              f"document-masked chunks of {chunk:,}, chunk i on process i mod world (the same val "
              f"loss on any process count)",
              f"totals: {N:,} steps, {positions:,} positions, {text:,} tokens of text, {flops:.4e} "
              f"model FLOPs + {opt_flops:.3e} in the optimizer's orthogonalizations",
              harness.memory_line(n_params, micro, spec, cfg.val_batch_seqs, chunk,
                                  min(chunk, VAL_PIECE))]
    return "\n".join(lines + harness.projection_lines(flops + opt_flops, machines))


def train(run, stop):
    """The speedrun: one optimizer step per iteration; validation, log lines and checkpoints outside
    train_time. Returns ``(status, reason)``: complete, stopped_early (--max-steps), interrupted."""
    cfg = run.cfg
    rt = run.rt
    model = run.model
    p = run.progress
    adam, normuon = run.opts
    checkpoints = cfg.save_every or cfg.save_final
    nan_guard = harness.NanGuard(rt.device)
    clock = harness.Clock(rt, p)
    if run.start == 0:
        validate(run, 0)
    clock.start()
    for step in range(run.start, run.end):
        row = run.schedule[step]  # every per-step quantity comes from the stage table
        if step == row.stage.start > 0:
            log_stage(run, step)
        micro, raw_tokens = next_micro_batches(run.loader, row.stage, rt, cfg.micro_batch_seqs)
        if run.loader.wrapped:
            run.log.line(f"data: the train stream wrapped around during step {step + 1}; tokens "
                         f"are read again")
        apply_schedule(run.opts, row)
        model.set_window(row.window, row.yarn)
        micro, weights = run.objectives.batches(micro, step, row.stage)
        divisor = grad_divisor(row.stage)
        model.set_loss_divisor(divisor)
        loss = accumulate_gradients(run.net, micro, rt, weights, divisor, run.buckets)
        normuon.step()  # first: its math runs while Adam's reduce-scatter is in flight
        adam.step()  # waits for its shards, updates them, starts its all-gather (big tables: last)
        adam.wait_gather()
        fp8_refresh(model, step)
        if step == run.split:
            untie(model, adam)
        model.zero_grad(set_to_none=True)
        nan_guard.update(loss, step + 1)
        p.raw_tokens += raw_tokens
        p.positions += row.stage.batch_tokens
        p.flops += row.flops_per_position * row.stage.batch_tokens
        done = step + 1
        logged = done % cfg.log_every == 0 or done == run.end
        stopping = stop.agreed(rt) if logged else stop.signal is not None and not rt.distributed
        if logged or stopping:
            with clock.paused():
                nan_guard.check(done)
                line = harness.step_line(done, cfg.num_iterations, "train_loss", loss.item(),
                                         p.train_time_ms)
                run.log.line(f"{line} phase:{row.stage.phase} tokens:{p.raw_tokens} "
                             f"lr_scale:{row.lr_scale:.4f}")
        if done == cfg.num_iterations or (cfg.val_every and done % cfg.val_every == 0):
            with clock.paused():
                validate(run, done)
        periodic = cfg.save_every and done % cfg.save_every == 0
        if periodic or (done == run.end and cfg.save_final) or (stopping and checkpoints):
            with clock.paused():
                save(run, done)
        if stopping:
            resume = f"; resume with --resume auto --run-id {run.log.run_id}" if checkpoints else ""
            return "interrupted", f"{stop.signal} after step {done}{resume}"
    final = run.end == cfg.num_iterations
    run.log.summary_line(dict(dataclasses.asdict(p), steps=run.end), final=final)
    return ("complete", None) if final else ("stopped_early", f"--max-steps {cfg.max_steps}")


def save(run, step):
    """Checkpoint ``<dir>/<run_id>/step_NNNNNN.pt``: all an exact resume needs (rank 0 writes)."""
    state = dict(config=dataclasses.asdict(run.cfg), step=step, run_id=run.log.run_id,
                 data=run.data, counters=dataclasses.asdict(run.progress))
    path = os.path.join(run.cfg.checkpoint_dir, run.log.run_id, f"step_{step:06d}.pt")
    harness.save_checkpoint(state, run.model, run.opts, run.loader, run.rt, path, run.log)


def main(argv=None, models=None):
    """Parse the flags, check what the run needs, build it, compile it, train. ``models``: the specs
    --model may name (default ``MODELS``; the tests add their own). Exit status: 0 a completed run
    (or --max-steps), 2 a refusal (one line naming the flag or file and the fix), 130 a signal (129
    SIGHUP), 1 a failure."""
    stop = harness.StopFlag()
    log = None
    models = MODELS if models is None else models
    try:
        cfg, preset, machines = harness.parse_flags(Config, PRESETS, argv)
        check_config(cfg, models)
        spec = models[cfg.model]
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's process count
        accum = grad_accum_steps(cfg, world)
        if machines is not None:  # --describe (run.sh checks a process count with it first)
            harness.echo_line(describe(cfg, spec, preset, machines))
            return 0
        rt = harness.setup_runtime(cfg, accum)
        data = harness.find_data(cfg.train_files, cfg.val_files)
        backend, why = kernels.choose_flex_backend(cfg.attention_backend, rt.device, rt.compile)
        if why:
            raise ConfigError(f"--attention-backend flash: {why}; or use --attention-backend "
                              f"triton")
        resume = harness.load_resume(cfg, data, OPERATIONAL) if cfg.resume else None
        log = harness.RunLog(cfg, rt, preset, resume)
        run = build_run(cfg, spec, rt, log, data, resume, backend)
        log.update(compile_time_ms=round(warm_up(run, stop)))
        graphs = harness.compiled_graphs()
        status, reason = train(run, stop)
        log.update(graphs_compiled_during_training=harness.compiled_graphs() - graphs)
        code = stop.exit_code if status == "interrupted" else 0
    except BaseException as err:  # noqa: BLE001 -- one line, the log kept, marked (a bug: raised)
        status, reason, code = harness.failure(err, stop, log)
    finally:
        stop.restore()
    harness.finish(log, status, reason)
    return code


if __name__ == "__main__":
    sys.exit(main())
