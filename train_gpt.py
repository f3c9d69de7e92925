"""Train a GPT on FineWeb (GPT-2 tokens) to 3.28 val loss, fast: Aurora + Token-Superposition Training.

Top to bottom: config and the stage table, data, model, TST, optimizers, eval, the training loop.
The CLI, checkpoints, run log and signals are in harness.py, the optimizers in aurora_opt.py, the
fused kernels in kernels.py (every log snapshots all four); the math is in docs/METHODS.md.

    python train_gpt.py --preset baseline_h200                   # one GPU: record #89 as HEAD runs it (run.sh's)
    python train_gpt.py --preset record_h200                     # ... plus TST and Aurora: the A/B
    torchrun --standalone --nproc_per_node=8 train_gpt.py --preset baseline_h200   # the same run on 8 GPUs
    python train_gpt.py --preset cpu_smoke --train-files 'dir/*_train_*.bin' --val-files 'dir/*_val_*.bin'
"""
import copy
import dataclasses
import functools
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    # why: the micro-batch grows 16,384 -> 32,768 -> 49,152 positions; growable segments reuse what it freed
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # read when CUDA first allocates
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import harness
from kernels import (DC_WINDOW, DOWN_BOOTSTRAP_STEPS, HEAD_SCALES, IGNORE_INDEX, PAST_END, SIGMOID_CAP, LayerMasks,
                     attend, build_attention_mask, dc_attention, delay_input_scale_, down_scales, fp8_active,
                     fp8_linear, fp8_unavailable_reason, grad_buckets, layer_masks, multi_target_loss,
                     refresh_down_scales_, upcast)
from aurora_opt import (DEFAULTS as AURORA, NS_COEFFICIENTS, Aurora, CautiousAdam, NorMuon, record89_adam_groups,
                        record89_matrix_groups, warm_step)
from harness import (GPT2_IDS, Clock, ConfigError, DataError, NanGuard, Runtime, TokenStream, compiled_graphs,
                     layer_set, log_wrap)

# ----------------------------------------------------------------------------------------------
# Config and presets


def _f(default, help, **kw):
    """A config field: default, --help text, optional ``choices`` and bounds low <= value < high."""
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    """Every hyperparameter of a run. Each field is a --kebab-case flag; presets override defaults."""
    # data
    train_files: str = _f("data/fineweb10B/fineweb_train_*.bin", "glob of train shards, read in sorted order")
    val_files: str = _f("data/fineweb10B/fineweb_val_*.bin", "glob of val shards")
    val_tokens: int = _f(10_485_760, "val loss is measured on the first this-many tokens of the val shards", low=1)
    val_seq_len: int = _f(0, "val chunk: document-masked flat sequences of this many tokens, chunk i on process "
                             "i mod world (HEAD: 262,144); 0 = --seq-len", low=0)
    # model
    vocab_size: int = _f(50304, "embedding/head rows: GPT-2's 50257 ids padded to a multiple of 128", low=1)
    n_layer: int = _f(12, "Transformer blocks", low=1)
    n_head: int = _f(6, "attention heads; head_dim = model_dim / n_head", low=1)
    model_dim: int = _f(768, "residual stream width", low=1)
    mlp_ratio: int = _f(4, "MLP hidden width = mlp_ratio * model_dim", low=1)
    seq_len: int = _f(1024, "latent positions per sequence (L)", low=1)
    logit_softcap: float = _f(30.0, "logits = c tanh(logits / c) under --logit-cap tanh (0 = none)")
    logit_cap: str = _f("tanh", "logit cap: tanh (--logit-softcap) or 23 sigmoid((x + 5) / 7.5) (record #54)",
                        choices=("tanh", "sigmoid"))
    objectives: bool = _f(False, "add the stage table's multi-token, prefix columns (records #53, #88); val stays CE")
    tied_embed: bool = _f(False, "embedding = LM head until record #89's stage 3, then untied (records #51, #53)")
    rope_base: float = _f(10000.0, "rotary embedding base")
    doc_mask: bool = _f(False, "attention within documents (each opens with <|endoftext|>; a bag: its last token's)")
    window: int = _f(0, "sliding window in latent positions: q sees q-window..q, window + 1 keys as FA3 (0 = none)")
    short_window_layers: str = _f("", "comma list of 0-based layers that attend over half the window")
    no_attn_layers: str = _f("", "comma list of 0-based layers without attention (MLP only)")
    attn_scale: float = _f(0.0, "attention logit scale (0 = 1/sqrt(head_dim))")
    value_embeds: int = _f(0, "value-embedding tables k: j feeds layers j, n_layer - k + j (or --ve-layers)")
    # record #89's model: residual and inputs (docs/METHODS.md §5)
    resid_lambdas: bool = _f(False, "x = r x + p sublayer(norm(x)) per sublayer, r = sqrt(1.1), p = 1 at init (HEAD)")
    skip_gate: str = _f("", "'a,b': stream after layer a into layer b's input x sigmoid(s), s = -1.5 (HEAD: 3,6)")
    x0_gates: bool = _f(False, "after each attention sublayer x += g * x0, a learned g per layer, 0 at init (#62)")
    attn_state_layer: int = _f(-1, "later layers attend from norm(stream after it) (record #77; HEAD: 7)", low=-1)
    bigram_vocab: int = _f(0, "bigram hash embedding rows, injected gated (records #62, #83; HEAD 377280)", low=0)
    bigram_dim: int = _f(0, "bigram embedding width (0 = model_dim, HEAD's)", low=0)
    smear: bool = _f(False, "x[t] += lam sigmoid(w . x[t, :12]) x[t-1], lam = w = 0 at init (record #34)")
    ve_layers: str = _f("", "comma list: value-embedding table j feeds the j-th listed layer (HEAD: 1,2,8,9,10)")
    ve_gate: bool = _f(False, "v += 2 sigmoid(W [x[:6], ve[:6]]) ve per head (records #55, #63, #70)")
    mudd: bool = _f(False, "MUDD dense connections into the last layer and after it (record #81, arXiv 2502.12170)")
    mudd_gates: int = _f(0, "x0/bigram/skip gates per token from two MLPs split here (#85; HEAD 4)", low=0)
    adam_bf16: bool = _f(False, "Adam's matrices (embeddings, head, gates, MUDD) stored in bf16 under --bf16 (HEAD)")
    # record #89's model: attention
    rope_half: bool = _f(False, "half-truncated RoPE, (1/1024)^linspace frequencies (record #89)")
    rope_yarn: bool = _f(False, "YaRN-rescale RoPE and scale at each long-window change (record #31)")
    paired_head_layers: str = _f("", "comma list: heads h, h + n_head/2 share a softmax (#58; HEAD 0,2,5,9)")
    key_offset: bool = _f(False, "long-window keys: half the dims from the previous position (record #49)")
    key_offset_docs: bool = _f(False, "the key offset stops at document starts (HEAD's crosses them)")
    attn_lambdas: bool = _f(False, "a learned pair per attention layer, [.5, 1] at init, scales W_qkv and W_o (HEAD)")
    dc_layers: str = _f("", "comma list: record #85's DC correction over 112 keys, weights from --mudd-gates (HEAD 10)")
    xsa_layers: str = _f("", "comma list: y -= tanh(a_h) proj_v(y), learnable XSA (record #82; HEAD 1,3,4,7)")
    attn_gate_layers: str = _f("", "comma list: heads gated by sigmoid(W x[:12]) (record #28; HEAD 3,10)")
    attn_vo_init: str = _f("zero", "V/O init: zero (O = 0), uniform (HEAD, #64), mimetic (V = -O = sqrt(.05) I)",
                           choices=("zero", "uniform", "mimetic"))
    # batch and steps
    batch_tokens: int = _f(524_288, "latent positions per optimizer step, whole global batch", low=1)
    micro_batch_seqs: int = _f(64, "sequences per process per forward/backward (accumulation fills the rest)", low=1)
    num_iterations: int = _f(3000, "optimizer steps N", low=1)
    max_steps: int = _f(0, "stop after this many steps, schedule unchanged (0 = all N; tests, verify)", low=0)
    stages: str = _f("flags", "stage table: flags (one stage) or record89", choices=("flags", "record89"))
    extension_steps: int = _f(0, "--stages record89: the last this-many steps run past the schedule", low=0)
    window_block: int = _f(128, "--stages record89: latent positions per window block", low=1)
    grow_seq_len: bool = _f(False, "--stages record89: stage k's batch as stage 1's count of k x --seq-len sequences "
                                   "(HEAD: 8 of 16,384 -> 32,768 -> 49,152), not 3k sequences of --seq-len")
    # TST (docs/METHODS.md §1)
    tst_bag_size: int = _f(4, "TST bag size s; 1 turns TST off")
    tst_frac: float = _f(0.3, "fraction r of the N steps spent in TST phase 1; switch at step round(r*N)")
    tst_mode: str = _f("full", "TST: full (bag in, next bag out), input (bag in only), output (next s out only)",
                       choices=("full", "input", "output"))
    # optimizers
    optimizer: str = _f("aurora", "block matrices' optimizer (normuon: record #89's; METHODS §3)",
                        choices=("aurora", "muon", "adamw", "normuon", "aurora_normuon"))
    matrix_lr: float = _f(AURORA["lr"], "Aurora/Muon lr")
    matrix_wd: float = _f(AURORA["weight_decay"], "Aurora/Muon decoupled weight decay (scaled by lr)")
    momentum: float = _f(AURORA["momentum"], "Aurora/Muon momentum (after warmup)")
    momentum_start: float = _f(0.85, "momentum at step 0, warmed up linearly to --momentum", low=0, high=1)
    momentum_warmup_steps: int = _f(300, "steps of momentum warmup (0 = none)", low=0)
    momentum_cooldown_steps: int = _f(0, "momentum back to --momentum-start over the last this-many (#39)", low=0)
    nesterov: bool = _f(True, "Nesterov momentum for Aurora/Muon")
    ns: str = _f(AURORA["ns"], "Newton-Schulz variant", choices=tuple(NS_COEFFICIENTS))
    ns_dtype: str = _f("auto", "Newton-Schulz dtype; auto = bfloat16 on CUDA, float32 on a CPU",
                       choices=("auto", "bfloat16", "float32"))
    pp_iterations: int = _f(AURORA["pp_iterations"], "Aurora row-equalization rounds K (--optimizer muon: 0)")
    pp_beta: float = _f(AURORA["pp_beta"], "Aurora row-scale exponent beta")
    adamw_lr: float = _f(0.0036, "lr of the block matrices with --optimizer adamw", low=0)
    adamw_wd: float = _f(0.0, "weight decay of the block matrices with --optimizer adamw", low=0)
    embed_lr: float = _f(0.6, "Adam lr of the token embedding", low=0)
    head_lr: float = _f(0.008, "Adam lr of the LM head", low=0)
    scalar_lr: float = _f(0.04, "Adam lr of vectors/scalars", low=0)
    adam_beta1: float = _f(0.8, "Adam beta1", low=0, high=1)
    adam_beta2: float = _f(0.95, "Adam beta2", low=0, high=1)
    adam_eps: float = _f(1e-10, "Adam eps")
    # schedule
    warmup_steps: int = _f(0, "linear lr warmup steps", low=0)
    cooldown_frac: float = _f(0.4, "fraction of steps at the end with lr decaying linearly to --lr-floor")
    lr_floor: float = _f(0.0, "lr multiplier at the end of the cooldown")
    # eval, logging, execution
    val_every: int = _f(125, "val every this many steps (0 = only at the start and end)", low=0)
    val_batch_seqs: int = _f(0, "val sequences per process per forward (0 = micro_batch_seqs)", low=0)
    log_every: int = _f(1, "train-loss line every this many steps", low=1)
    log_dir: str = _f("logs", "where <run_id>.txt and <run_id>.json go")
    run_id: str = _f("", "name of the run; unset: date, time and a random suffix")
    seed: int = _f(0, "seed of the weight init")
    device: str = _f("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    compile: bool = _f(None, "torch.compile the model and Aurora; unset: on with CUDA, off on CPU")
    bf16: bool = _f(None, "bfloat16 activations, weights cast per matmul (no autocast); unset: on with CUDA, off "
                          "on CPU (float32)")
    fp8: bool = _f(False, "LM head and MLP matmuls in float8 (records #19, #84, #89); sm_89+ GPUs")
    dist_timeout: int = _f(600, "seconds a collective may wait before the run fails (torchrun)")
    # checkpoints
    checkpoint_dir: str = _f("checkpoints", "where checkpoints go (<dir>/<run_id>/step_NNNNNN.pt)")
    save_every: int = _f(0, "checkpoint every this many steps (0 = never)", low=0)
    keep_checkpoints: int = _f(2, "keep the newest this-many --save-every checkpoints of the run, deleting older "
                                  "ones (0 = keep all); --save-final and --save-on-interrupt ones stay", low=0)
    save_final: bool = _f(False, "checkpoint at the end of the run")
    save_on_interrupt: bool = _f(False, "on SIGINT/SIGTERM, checkpoint after the current step, then stop")
    resume: str = _f("", "checkpoint file to continue from, or 'auto' (highest step under --checkpoint-dir)")
    resume_force: bool = _f(False, "resume even if the checkpoint's config or data differs in what changes the run")



# Record #89's recipe (2026-07-17; docs/METHODS.md §4): the stage table RECORD89_STAGES, 1,270 scheduled
# steps + 15 at the floor, 8 -> 24 sequences of 16,384 in document masks, no TST. Earlier recipes (record
# #21's among them) live in their logs: records/verify.py --extract restores them. Presets list only what
# differs from Config's defaults (or their parent's): tests/test_trainer.py checks it. MODEL89 is record
# #89's model as HEAD builds it (docs/METHODS.md §5, §6; each flag's help names its record).
MODEL89 = dict(n_layer=11, no_attn_layers="6", short_window_layers="0,1,2,4,5,7,8,9",
               value_embeds=5, ve_layers="1,2,8,9,10", ve_gate=True, resid_lambdas=True, skip_gate="3,6",
               x0_gates=True, attn_state_layer=7, bigram_vocab=377_280, smear=True, mudd=True, mudd_gates=4,
               rope_half=True, rope_yarn=True, attn_scale=0.1, paired_head_layers="0,2,5,9", key_offset=True,
               xsa_layers="1,3,4,7", attn_gate_layers="3,10", attn_vo_init="uniform", attn_lambdas=True,
               dc_layers="10")
RECORD89 = dict(MODEL89, doc_mask=True, stages="record89", num_iterations=1285, extension_steps=15, seq_len=16384,
                batch_tokens=393_216, micro_batch_seqs=1, cooldown_frac=0.6, lr_floor=0.15, momentum_cooldown_steps=50,
                tst_frac=0.0, tst_bag_size=1, optimizer="normuon", matrix_lr=0.023, matrix_wd=1.2, head_lr=0.22,
                objectives=True, logit_cap="sigmoid", logit_softcap=15.0, tied_embed=True, fp8=True, adam_bf16=True,
                grow_seq_len=True, val_seq_len=262_144,
                log_every=10)  # a train-loss line is the only host sync between val points
# ... plus this repository's methods: TST for the first 30% of the steps (s = 4) and Aurora's
# polar on the MLP matrices of NorMuon (docs/METHODS.md §1, §3).
RECORD89_OURS = dict(RECORD89, tst_frac=0.3, tst_bag_size=4, optimizer="aurora_normuon")
# Record #89's model at 4 x 128 (cpu_smoke, gpu_check --dry-run): HEAD's layer roles mapped onto 4 layers
# (paired heads 0 and 2, XSA 1, long window, output gate and DC 3, the skip 1 -> 2, MUDD on 3).
SMOKE_MODEL89 = dict(n_layer=4, n_head=4, model_dim=128, value_embeds=2, ve_layers="1,3", short_window_layers="0,1,2",
                     no_attn_layers="", skip_gate="1,2", attn_state_layer=2, bigram_vocab=16_384, mudd_gates=2,
                     paired_head_layers="0,2", xsa_layers="1", attn_gate_layers="3", dc_layers="3")
PRESETS = {
    # run.sh's GPU default: record #89's recipe as HEAD's code runs it. Our methods on it were no better at 3x
    # the steps of the small-scale study (records/cpu/2026-12-03_small_scale_89), so they are the A/B arm.
    "baseline_h200": RECORD89,
    "record_h200": RECORD89_OURS,  # baseline_h200 + TST + Aurora: the A/B on one H200
    "record_8xb200": RECORD89_OURS,  # ... and on 8 B200s: the same run
    # 2 CPU cores, under 5 minutes: the record recipe and model at a tiny shape on the real-text sample, one
    # document-packed sequence of 768 per micro-step, 1 -> 2 -> 3 of them per step.
    "cpu_smoke": dict(RECORD89_OURS, **SMOKE_MODEL89, seq_len=768, batch_tokens=2304, num_iterations=100,
                      extension_steps=2, window_block=32, momentum_warmup_steps=24, momentum_cooldown_steps=4,
                      val_tokens=16384, val_every=50, log_every=1, grow_seq_len=False, val_seq_len=0,
                      tied_embed=False),  # its < 7.5 val loss was measured untied; the tie is tested in tests/
}


# ----------------------------------------------------------------------------------------------
# The stage table: every per-step quantity of a run. A stage: steps sharing one graph shape (TST phase, bag size,
# mode) and tokens per step; a step's row adds the ramps (lr, momentum, windows) and the FLOPs they imply.

@dataclass(frozen=True)
class Stage:
    """Optimizer steps [start, end) of one graph shape; record #89's columns default to a flags run."""
    start: int
    end: int
    phase: int           # TST phase: 1 = bags, 2 = next-token
    bag_size: int        # TST bag size s
    mode: str            # TST mode: full, input, output
    batch_tokens: int    # latent positions per step
    doc_cap: int = 0     # most tokens of a document in a packed sequence (0 = no cap)
    lr_mul: float = 1.0
    blocks: tuple = ()   # (short, long) windows in window blocks; () = the --window flags
    objective: tuple = ()  # OBJECTIVE_WEIGHTS rows (start, end) of the extra columns; () = next-token only
    ramp: tuple = ()     # [first, end) of the recipe stage the objective ramps over (kept by a TST split)
    seq_len: int = 0     # latent positions per sequence (0 = --seq-len; --grow-seq-len: k x it in stage k)

    def length(self, seq_len):
        """Latent positions per sequence of this stage: its own, else ``seq_len`` (--seq-len)."""
        return self.seq_len or seq_len

    def raw_tokens(self, seq_len):
        """Text tokens a step reads (s x the positions in TST; a packed step's skipped tails: logged, not planned)."""
        L = self.length(seq_len)
        return self.batch_tokens // L * sequence_layout(self.mode, self.bag_size, L)[1]


@dataclass(frozen=True)
class StepRow:
    """One optimizer step's schedule: its stage and ramps."""
    stage: Stage
    lr_scale: float
    momentum: float
    window: tuple          # (long, short) in latent positions
    flops_per_position: float
    objective: tuple = ()  # weights of the multi-token and prefix columns; () = next-token only
    yarn: tuple = ()  # long windows of steps 0..min(step, N - 1), no repeats: the RoPE's YaRN history (record #31)


# Record #89 (HEAD's TRAINING_STAGES; docs/METHODS.md §4), per stage: fraction of the scheduled steps,
# --batch-tokens thirds (#46), document cap (#29, #72), (short, long) window blocks (#31, #33, #35), lr
# multiplier (sqrt-ish in the batch: (16/8)^0.6, (24/8)^0.5), OBJECTIVE_WEIGHTS row (#53, #88).
RECORD89_STAGES = ((1 / 3, 1, 896, (1, 3), 1.0, 0),
                   (1 / 3, 2, 2048, (3, 7), 1.52, 1),
                   (1 / 3, 3, 2048, (5, 11), 1.73, 2))
RECORD89_EXTENSION_BLOCKS = (6, 13)  # the extension keeps stage 3's batch and objective
RECORD89_FINAL_LONG_BLOCKS = 20  # the final validation's long window
# Target column weights per stage, (at its start, at its end): multi-token t+1..t+3 (#53), prefix (#88).
OBJECTIVE_WEIGHTS = (((1.0, 0.5, 0.25, 0.25), (1.0, 0.5, 0.0, 0.25)),
                     ((1.0, 0.5, 0.0, 0.25), (1.0, 0.0, 0.0, 0.0)),
                     ((1.0, 0.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0)))


def record89_stages(cfg):
    """Record #89's recipe ``Stage``s (phase 2, before a TST split): boundaries round(c N_s) at cumulative
    fractions c of the N_s = N - extension scheduled steps, as HEAD; then the extension."""
    N, scheduled = cfg.num_iterations, cfg.num_iterations - cfg.extension_steps
    bounds, c = [0], 0.0
    for frac, *_ in RECORD89_STAGES[:-1]:
        c += frac
        bounds.append(int(round(c * scheduled)))
    bounds.append(scheduled)
    rows = []
    for (lo, hi), (_, thirds, cap, blocks, lr_mul, obj) in zip(zip(bounds, bounds[1:]), RECORD89_STAGES):
        rows.append(Stage(lo, hi, 2, 1, "full", cfg.batch_tokens * thirds // 3, cap, lr_mul, blocks,
                          OBJECTIVE_WEIGHTS[obj], (lo, hi), cfg.seq_len * (thirds if cfg.grow_seq_len else 1)))
    if cfg.extension_steps:
        last = rows[-1]
        rows.append(dataclasses.replace(last, start=scheduled, end=N, blocks=RECORD89_EXTENSION_BLOCKS, lr_mul=1.0,
                                        objective=OBJECTIVE_WEIGHTS[-1], ramp=(scheduled, N)))  # lr: the floor
    return [st for st in rows if st.end > st.start]


def stages(cfg):
    """The run's stages over steps [0, N): the recipe (flags: one stage; record89), TST phase 1 over its
    first round(r N) steps, a recipe stage the switch falls in split in two with its columns kept.
    A bag-size schedule is more rows here: loader, warm-up graphs, token counts, --describe follow."""
    if cfg.stages == "record89":
        recipe = record89_stages(cfg)
    else:
        recipe = [Stage(0, cfg.num_iterations, 2, 1, "full", cfg.batch_tokens)]
    switch, rows = tst_switch_step(cfg), []
    for st in recipe:
        if st.start < switch:
            rows.append(dataclasses.replace(st, end=min(st.end, switch), phase=1, bag_size=cfg.tst_bag_size,
                                            mode=cfg.tst_mode))
        if st.end > switch:
            rows.append(dataclasses.replace(st, start=max(st.start, switch)))
    return rows


class Schedule:
    """The stage table of a config: ``rows[step]`` for steps 0..N (row N: the final validation's windows)."""

    def __init__(self, cfg):
        self.stages, flops = stages(cfg), harness.FlopProfile(cfg, GPT)
        self.val_chunk, self.val_piece = val_chunk(cfg), VAL_PIECE  # the val forward's shape (--describe)
        self.rows, yarn = [], ()
        N = cfg.num_iterations
        for step in range(N + 1):
            stage = next((s for s in self.stages if s.start <= step < s.end), self.stages[-1])
            window = stage_window(step, stage, cfg)
            if step < N and window[0] and yarn[-1:] != (window[0],):
                yarn = yarn + (window[0],)
            self.rows.append(StepRow(stage, stage_lr_scale(step, stage, cfg), momentum_at(step, cfg), window,
                                     flops.per_position(window, stage.length(cfg.seq_len)),
                                     stage_objective(step, stage), yarn))

    def __getitem__(self, step):
        return self.rows[step]

    def graphs(self):
        """Distinct ``(bag_size, mode)`` objectives of the stages, in order: one compiled graph each."""
        return list(dict.fromkeys((s.bag_size, s.mode) for s in self.stages))


def stage_window(step, stage, cfg):
    """``(long, short)`` windows at ``step`` in latent positions: blocks x --window-block, else ``flag_windows``."""
    if not stage.blocks:
        return flag_windows(cfg)
    short, long = stage.blocks
    if step >= cfg.num_iterations:  # row N: record #89's final validation
        long = RECORD89_FINAL_LONG_BLOCKS
    return long * cfg.window_block, short * cfg.window_block


def stage_lr_scale(step, stage, cfg):
    """lr multiplier at ``step``: ``lr_scale`` (flags), or record #89's (HEAD's get_lr, record #72): the stage's
    m, then from c = int(N_s (1 - cooldown_frac)) ``m (1 - t) + lr_floor t``, t = min(1, (step - c) / (N_s - c))."""
    if cfg.stages == "flags":
        return lr_scale(step, cfg)
    scheduled = cfg.num_iterations - cfg.extension_steps
    start = int(scheduled * (1 - cfg.cooldown_frac))
    if step < start:
        return stage.lr_mul
    t = min(1.0, (step - start) / max(scheduled - start, 1))
    return stage.lr_mul * (1 - t) + cfg.lr_floor * t


def stage_objective(step, stage):
    """Multi-token and prefix weights at ``step``: the stage's rows, linear over its ramp as HEAD (() = none)."""
    if not stage.objective:
        return ()
    lo, hi = stage.ramp
    t = min(max((step - lo) / (hi - lo), 0.0), 1.0)
    start, end = stage.objective
    return tuple(a + (b - a) * t for a, b in zip(start, end))


# Packed stages also read the tails they skip (how much depends on the documents): the shard count budgets this
# much text per trained token (a short budget only wraps the stream, which the log reports).
PACKED_READ_MARGIN = 1.5


def train_tokens_needed(cfg):
    """Raw train tokens a whole run reads, labels included (a packed stage budgets PACKED_READ_MARGIN x)."""
    run_stages = stages(cfg)
    total = sum((st.end - st.start) * st.raw_tokens(cfg.seq_len) * PACKED_READ_MARGIN for st in run_stages)
    total = int(math.ceil(total))
    return total + max(cfg.tst_bag_size, *(st.bag_size for st in run_stages)) * cfg.seq_len  # last labels


def tst_switch_step(cfg):
    """First step of phase 2 (next-token): round(r N); with s = 1 phase 1 is next-token training, bit for bit."""
    return int(round(cfg.tst_frac * cfg.num_iterations))


def lr_scale(step, cfg):
    """lr multiplier at 0-based ``step``: linear warmup, flat, then linear decay to --lr-floor at step N."""
    N = cfg.num_iterations
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    cooldown = cfg.cooldown_frac * N
    if cooldown > 0 and step >= N - cooldown:
        return cfg.lr_floor + (1 - cfg.lr_floor) * max(0.0, (N - step) / cooldown)
    return 1.0


def momentum_at(step, cfg):
    """Momentum: --momentum-start -> --momentum over the warmup, back over the last c steps after N - c
    (--momentum-cooldown-steps; HEAD's get_muon_momentum, record #39)."""
    lo, hi, N, c = cfg.momentum_start, cfg.momentum, cfg.num_iterations, cfg.momentum_cooldown_steps
    if step < cfg.momentum_warmup_steps:
        frac = step / cfg.momentum_warmup_steps
        return (1 - frac) * lo + frac * hi
    if c and step > N - c:
        frac = (step - (N - c)) / c
        return hi - frac * (hi - lo)
    return hi


def flag_windows(cfg):
    """``(long, short = long // 2)`` windows of a one-stage (--stages flags) run: --window at every step (0 = none)."""
    w = cfg.window
    return (w, max(w // 2, 1)) if w else (0, 0)


# ----------------------------------------------------------------------------------------------
# Model: a GPT (RMSNorm, RoPE, QK-norm, ReLU^2 MLP, untied head, soft-capped logits) with record #89's
# elements behind flags (MODEL89; docs/METHODS.md §5)

def rms_norm(x):
    """Parameter-free RMSNorm over the last dim (x's dtype out; the statistics in float32 inside the op)."""
    return F.rms_norm(x, (x.size(-1),))


def linear(x, w):
    """``x @ w.T`` in x's dtype: float32 master weights cast per matmul (modded-nanogpt's CastedLinear), so a bf16
    run needs no autocast and its stream stays bf16 (CUDA's autocast would return float32 from norms and sums)."""
    return F.linear(x, w.type_as(x))


class Rotary(nn.Module):
    """RoPE (arXiv 2104.09864) on positions 0..max_len-1: dims i, i + r/2 of the first r rotate together, r =
    head_dim at base^(-2i/head_dim), or ``half`` (record #89) r = head_dim/2 at (1/1024)^linspace(0, 1).
    ``scale``: the attention scale, a buffer that ``set_history`` rescales with the tables (YaRN)."""

    def __init__(self, head_dim, max_len, base, half=False, scale=None):
        super().__init__()
        self.rot = head_dim // 2 if half else head_dim
        if half:
            freq0 = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64)
            angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freq0).float()
        else:
            freq0 = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [L, head_dim/2]
        self.register_buffer("freq0", freq0, persistent=False)  # float64 on the device: set_history copies nothing
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self.scale0 = scale
        if scale is not None:
            self.register_buffer("scale", torch.tensor(float(scale)), persistent=False)

    def forward(self, x, paired=False):
        """x: [B, L, H, head_dim] -> same shape and dtype, rotated at position t; ``paired`` (record #58, as HEAD's
        paired table): head h at 2t + h mod 2, so each doubled stream's two heads turn a position apart."""
        L, r = x.size(1), self.rot
        cos, sin = self.cos[:, :L], self.sin[:, :L]
        if paired:
            pos = 2 * torch.arange(L, device=x.device)[:, None] + torch.arange(x.size(2), device=x.device) % 2
            cos, sin = self.cos[0, pos, 0][None], self.sin[0, pos, 0][None]  # [1, L, H, r/2]
        cos, sin = cos.type_as(x), sin.type_as(x)  # bf16 tables in a bf16 run, as modded-nanogpt's
        x1, x2 = x[..., :r].chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin, x[..., r:]), dim=-1)

    @torch.no_grad()
    def set_history(self, windows):
        """Tables after YaRN rescales (record #31; alpha 1, beta 32) through the long ``windows``, in place: per
        old -> new, s = old/new, f <- f (s + r (1 - s)) with r = clamp((old f / 2 pi - 1) / 31, 0, 1), and
        scale *= 0.2 ln(new/old) + 1."""
        freq, scale = self.freq0.clone(), self.scale0
        for old, new in zip(windows, windows[1:]):
            s = old / new
            freq *= s + ((old * freq / (2 * math.pi) - 1) / 31).clamp(0, 1) * (1 - s)
            scale *= 0.2 * math.log(new / old) + 1
        positions = torch.arange(self.cos.size(1), dtype=torch.float64, device=freq.device)
        angles = torch.outer(positions, freq)[None, :, None, :]  # built where the tables live: no host copy
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())
        if scale is not None:
            self.scale.fill_(scale)


# Documents of the attention masks (kernels.py holds the one mask definition, ``mask_mod``, its
# FlexAttention block mask for CUDA and bool matrix for SDPA on a CPU; records #12, #13).

def document_ids(tokens):
    """int64 ``[..., T]`` -> ``[..., T]``: the number of EOTs at or before each position (an EOT opens its document)."""
    return (tokens == EOT_TOKEN).cumsum(dim=-1)


def latent_document_ids(inputs):
    """Inputs ``[B, L, k]`` -> int64 ``[B, L]``: each latent position's document, a TST bag's (k = s) that of its
    last token, so an EOT anywhere in a bag opens the new document there (docs/METHODS.md §1)."""
    B, L, k = inputs.shape
    return document_ids(inputs.reshape(B, L * k)).view(B, L, k)[..., -1]


def offset_keys(k, first=None):
    """Partial key offset (record #49, 2025-12-14): the last half of each key's dims (the unrotated half with
    --rope-half) taken from the previous position, k [B, L, H, D] -> same, except at position 0 (across
    documents, as HEAD) or, with ``first`` bool [B, L] (--key-offset-docs), at document starts."""
    h = k.size(-1) // 2
    own = k[..., h:]
    prev = torch.cat((own[:, :1], own[:, :-1]), dim=1)
    if first is not None:
        prev = torch.where(first[:, :, None, None], own, prev)
    return torch.cat((k[..., :h], prev), dim=-1)


OPT_GROUPS = ("matrix", "embed", "head", "scalar")  # Aurora/Muon/AdamW of the block matrices; Adam for the rest


def route(param, group, role=None):
    """Tag ``param`` with its optimizer group (``OPT_GROUPS``) and record #89 Adam ``role`` where it is created;
    ``build_optimizers`` reads only the tags (an untagged parameter stops the run at start-up)."""
    assert group in OPT_GROUPS, group
    param.opt_group = group
    if role is not None:
        param.adam_role = role
    return param


def _linear(d_in, d_out, zero=False, group="matrix", role=None):
    """A bias-free ``nn.Linear`` whose weight is routed to ``group`` (and Adam ``role``, record #89's optimizer)."""
    lin = nn.Linear(d_in, d_out, bias=False)
    route(lin.weight, group, role)
    with torch.no_grad():
        if zero:  # output projections start at zero: each block starts as the identity
            lin.weight.zero_()
        else:
            bound = math.sqrt(3.0) * 0.5 / math.sqrt(d_in)  # std 0.5/sqrt(d_in)
            lin.weight.uniform_(-bound, bound)
    return lin


def longest_sequence(cfg):
    """Most positions one forward sees: the longest train sequence (--grow-seq-len: 3 x --seq-len) or val chunk."""
    return max(harness.longest_train_sequence(cfg), val_chunk(cfg))


def make_rotary(cfg):
    """The model's one RoPE table (``Rotary``): 2 x the longest sequence with paired layers, a scale with --rope-yarn."""
    hd = cfg.model_dim // cfg.n_head
    return Rotary(hd, longest_sequence(cfg) * (2 if cfg.paired_head_layers else 1), cfg.rope_base, cfg.rope_half,
                  (cfg.attn_scale or hd ** -0.5) if cfg.rope_yarn else None)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with QK-norm and RoPE; q, k, v in one matmul (three optimizer matrices); ``layer``'s
    record #89 elements from the config (value embeddings #9, #55; docs/METHODS.md §5)."""

    def __init__(self, cfg, rotary=None, layer=0):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.model_dim // cfg.n_head
        d = cfg.model_dim
        self.q, self.k, self.v = _linear(d, d), _linear(d, d), _linear(d, d)
        self.proj = _linear(d, d, zero=cfg.attn_vo_init == "zero")
        if cfg.attn_vo_init == "mimetic":  # W_O W_V ~ -0.05 I: each head starts copying its input, negated
            with torch.no_grad():
                for w, sign in ((self.v.weight, 1.0), (self.proj.weight, -1.0)):
                    w.normal_(0.0, 0.01).diagonal().add_(sign * 0.05 ** 0.5)
        # the model passes its one table (GPT.rotary); a layer built alone makes its own
        self.rotary = rotary if rotary is not None else make_rotary(cfg)
        self.scale, self.yarn = cfg.attn_scale or None, cfg.rope_yarn
        self.paired = layer in layer_set(cfg.paired_head_layers)
        self.key_offset = cfg.key_offset and not self.paired and layer not in layer_set(cfg.short_window_layers)
        own = not cfg.mudd_gates  # with --mudd-gates, XSA alphas and output gates come per token (record #85)
        xsa = own and layer in layer_set(cfg.xsa_layers)
        self.xsa = route(nn.Parameter(torch.zeros(self.n_head)), "scalar") if xsa else None
        gated = own and layer in layer_set(cfg.attn_gate_layers)  # Adam treats it as HEAD's gates (role ve_gates)
        self.gate = _linear(12, self.n_head, zero=True, group="scalar", role="ve_gates") if gated else None
        # HEAD's sa_lambdas: W_qkv x lam[0] (with QK-norm it scales V alone), W_o x lam[1]; Adam's scalars
        self.lambdas = route(nn.Parameter(torch.tensor([0.5, 1.0])), "scalar") if cfg.attn_lambdas else None
        self.dc_window = DC_WINDOW if layer in layer_set(cfg.dc_layers) and not self.paired else 0  # record #85

    def weight(self, w, j, x):
        """Weight ``w`` in x's dtype times ``lambdas[j]`` with --attn-lambdas (modded-nanogpt scales the weight, not
        the output); cast first, so the product's backward keeps the bf16 copy, not the float32 master."""
        w = w.type_as(x)
        return w if self.lambdas is None else self.lambdas[j] * w

    def forward(self, x, mask=None, ve=None, ve_gate=None, xsa_alpha=None, attn_gate=None, dc=None):
        """x, ve ``[B, L, d]``, ``mask`` from ``GPT.masks_for`` (None: causal); per-token ``ve_gate`` ``[B, L, H, 1]``,
        ``xsa_alpha`` and ``attn_gate`` ``[B, L, H]`` (MUDD, record #85) replace the layer's own; ``dc`` the
        DC lanes ``(w1, w2)`` ``[B, L, H]`` of a --dc-layers layer (``kernels.dc_attention``)."""
        B, L, _ = x.shape
        H, D = self.n_head, self.head_dim
        shape = (B, L, H, D)
        qkv = F.linear(x, self.weight(torch.cat((self.q.weight, self.k.weight, self.v.weight)), 0, x))  # one matmul
        q, k, v = (t.view(shape) for t in qkv.chunk(3, dim=-1))
        if ve is not None:
            ve = ve.view(shape).type_as(v)
            v = v + ve_gate.type_as(v) * ve if ve_gate is not None else v + ve
        mask, doubled, first, docs = mask if isinstance(mask, LayerMasks) else (mask, None, None, None)
        q, k, vs = rms_norm(q), rms_norm(k), v  # QK-norm, then RoPE
        q, k = self.rotary(q, self.paired), self.rotary(k, self.paired)
        if self.paired:  # record #58: token t's heads h < H/2 at position 2t, the others at 2t + 1 (a view)
            if mask is not None and doubled is None:
                raise ValueError("a paired-head layer needs LayerMasks with the doubled sequence's mask")
            q, k, vs = (t.reshape(B, 2 * L, H // 2, D) for t in (q, k, v))
            mask = doubled
        if self.key_offset:
            k = offset_keys(k, first)
        scale = self.scale
        if self.yarn:  # a buffer, so a rescale changes no graph
            q, scale = q * self.rotary.scale.type_as(q), 1.0
        y = attend(q.transpose(1, 2), k.transpose(1, 2), vs.transpose(1, 2), mask, scale).transpose(1, 2).reshape(shape)
        if self.dc_window:  # record #85 (HEAD's layer 10): the correction over the last 112 keys, added to y
            y = y + dc_attention(q, k, v, *dc, docs, scale or D ** -0.5, self.dc_window).type_as(y)
        if xsa_alpha is not None or self.xsa is not None:  # XSA: remove tanh(alpha) of y's part along its own v
            a = self.xsa if xsa_alpha is None else xsa_alpha
            alpha = torch.tanh(a).type_as(y).reshape(*a.shape[:-1], H, 1)
            y = y - alpha * (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8) * v
        if attn_gate is None and self.gate is not None:  # record #28: a per-head gate from 12 input channels
            attn_gate = torch.sigmoid(linear(x[..., :12], self.gate.weight))
        if attn_gate is not None:
            y = y * attn_gate.reshape(B, L, H, 1).type_as(y)
        return F.linear(y.reshape(B, L, -1), self.weight(self.proj.weight, 1, y))


class MLP(nn.Module):
    """``proj(relu(fc(x))^2)``; with ``--fp8``, both matmuls in FP8 while training on CUDA (``fp8_linear``, sm_89+):
    fc at current scales (record #84), proj (#89's stages) at HEAD's delayed ones, state in ``down_scales``."""

    def __init__(self, cfg):
        super().__init__()
        self.fc = _linear(cfg.model_dim, cfg.mlp_ratio * cfg.model_dim)
        self.proj = _linear(cfg.mlp_ratio * cfg.model_dim, cfg.model_dim, zero=True)
        self.fp8 = cfg.fp8
        delayed = cfg.fp8 and cfg.stages == "record89"  # a persistent buffer: checkpoints carry it, resume is exact
        self.register_buffer("down_scales", down_scales() if delayed else None)

    def forward(self, x):
        if fp8_active(self.fp8, x, self.fc.weight):  # records #84, #89
            h = F.relu(fp8_linear(x, self.fc.weight)).square()
            if self.down_scales is None:
                return fp8_linear(h, self.proj.weight)
            y = fp8_linear(h, self.proj.weight, scales=self.down_scales[:2])
            delay_input_scale_(self.down_scales, h)  # the next forward's input scale (HEAD: per forward)
            return y
        return linear(F.relu(linear(x, self.fc.weight)).square(), self.proj.weight)


def fp8_refresh(model, step):
    """HEAD's FP8 refresh after optimizer ``step`` (-1: at init): the MLP down-projections' weight scales
    (``refresh_down_scales_``; current over the first 16 steps, then delayed)."""
    for block in model.blocks:
        if block.mlp.down_scales is not None:
            refresh_down_scales_(block.mlp.down_scales, block.mlp.proj.weight, step < DOWN_BOOTSTRAP_STEPS)


class Block(nn.Module):
    """Pre-norm block ``x + attn(norm(x))``, ``x + mlp(norm(x))`` (attention absent in --no-attn-layers); with
    record #89's residual (HEAD) ``r x + p sublayer``, then ``+ g x0`` and ``+ g' bigram`` after attention.
    The last layer under --mudd takes these per token from MUDD (``dyn``)."""

    def __init__(self, cfg, layer, value_embed=False, rotary=None):
        super().__init__()
        has_attn = layer not in layer_set(cfg.no_attn_layers)
        static = injects(cfg, layer)  # not MUDD's layer: MUDD gives its gates and lambdas per token
        const = static and not cfg.mudd_gates  # --mudd-gates: the x0 and bigram gates come per token
        self.attn = CausalSelfAttention(cfg, rotary, layer) if has_attn else None
        self.mlp = MLP(cfg)
        lambdas = cfg.resid_lambdas and (static or not has_attn)
        self.resid = route(nn.Parameter(torch.full((2,), 1.1 ** 0.5)), "scalar", "resid_lambdas") if lambdas else None
        self.post = route(nn.Parameter(torch.ones(2)), "scalar", "post_lambdas") if lambdas else None
        self.x0_gate = route(nn.Parameter(torch.zeros(())), "scalar") if cfg.x0_gates and const else None
        # HEAD's bigram gate starts at 0.05 (#85's bias); layer 0's gates the stream before the first layer
        self.bigram_gate = route(nn.Parameter(torch.tensor(0.05)), "scalar") if cfg.bigram_vocab and const else None
        self.ve_gate = (route(nn.Parameter(torch.zeros(cfg.n_head, 2 * VE_GATE_IN)), "scalar", "ve_gates")
                        if value_embed and cfg.ve_gate and static else None)

    def forward(self, x, x0=None, mask=None, ve=None, attn_in=None, bigram=None, dyn=None, gates=None):
        """x, x0 ``[B, L, d]``; ``attn_in`` the attention's input before its norm (record #77; None: x); ``bigram``
        ``[B, L, bigram_dim]`` to inject (None: none); ``dyn`` the 7 ``[B, L, 1]`` lambdas and gates from MUDD
        (``GPT.mudd_in``); ``gates`` ``{kind: [B, L, w]}`` from --mudd-gates (``GPT.gate_coefs``)."""
        lam = (None,) * 4 if self.resid is None else (self.resid[0], self.post[0], self.resid[1], self.post[1])
        g = gates or {}
        ra, pa, rm, pm, gx, gb, gv = dyn or (*lam, g.get("x0", self.x0_gate), g.get("bigram", self.bigram_gate), None)
        if self.attn is not None:
            h = rms_norm(x if attn_in is None else attn_in)
            if self.ve_gate is not None:  # 2 sigmoid(W [h[:6], ve[:6]]) per head: 1 at init (records #55, #70)
                gin = torch.cat((h[..., :VE_GATE_IN], ve[..., :VE_GATE_IN].type_as(h)), dim=-1)
                gv = 2 * torch.sigmoid(linear(gin, self.ve_gate)).unsqueeze(-1)
            x = _residual(x, self.attn(h, mask, ve, gv, g.get("xsa"), g.get("attn"), (g.get("dc1"), g.get("dc2"))),
                          ra, pa)
            if gx is not None:
                x = x + gx * x0
            if gb is not None and bigram is not None:  # into the first bigram_dim channels (HEAD: all of them)
                x = x + F.pad(gb * bigram, (0, x.size(-1) - bigram.size(-1)))
        return _residual(x, self.mlp(rms_norm(x)), rm, pm)


BIGRAM_SIGN_ROWS = 8192  # rows of record #83's sign table (HEAD)
MUDD_SCALE = 0.1  # MUDD coefficients are the MLP's output times this (HEAD)
GATE_START = {"attn": 0.25, "bigram": 0.05, "skip": 0.5, "dc1": 1.0}  # record #85's gate lanes at init (HEAD)
VE_GATE_IN = 6  # channels of the attention input and of the value embedding that the VE gate reads (HEAD)


def injects(cfg, layer):
    """Whether ``layer`` adds x0 and the bigram after attention by its own gates (a scalar, or a --mudd-gates
    lane): it has attention and is not --mudd's last layer, whose gates MUDD gives per token (record #89, HEAD)."""
    return layer not in layer_set(cfg.no_attn_layers) and not (cfg.mudd and layer == cfg.n_layer - 1)


def gate_lanes(cfg):
    """Record #85's two gate MLPs' outputs as ``[(layer, kind, width)]`` each (first: of x0, layers before
    --mudd-gates G; second: of the stream entering G): XSA, output gates, x0, bigram, the skip, DC w1, w2 (HEAD's
    second: 12 + 6 + 10 + 1 + 12 = 41 lanes; docs/METHODS.md §4 "The model")."""
    G, H = cfg.mudd_gates, cfg.n_head
    inject = [i for i in range(cfg.n_layer) if injects(cfg, i)]
    lanes = ([], [])
    for kind, layers, w in (("xsa", layer_set(cfg.xsa_layers), H), ("attn", layer_set(cfg.attn_gate_layers), H)):
        for i in sorted(layers):
            lanes[i >= G].append((i, kind, w))
    for i in inject:
        lanes[i >= G].extend([(i, "x0", 1), (i, "bigram", 1)])
    lanes[1].append((None, "skip", 1))
    for i in sorted(layer_set(cfg.dc_layers)):
        lanes[i >= G].extend([(i, "dc1", H), (i, "dc2", H)])
    return lanes


def _residual(x, y, r, p):
    """``x + y``, or ``r x + p y`` with record #89's per-sublayer lambdas (HEAD)."""
    return x + y if r is None else r * x + p * y


def embed_tokens(table, inputs):
    """Inputs ``[B, L, k]`` through an ``nn.Embedding`` -> ``[B, L, d]``: the row (k = 1) or the bag's mean."""
    x = table(inputs)
    return bag_mean(x) if inputs.size(-1) > 1 else x.squeeze(2)


class GPT(nn.Module):
    """Decoder-only Transformer whose inputs may be bags of tokens (TST phase 1, docs/METHODS.md §1).
    ``forward(inputs, targets=None, weights=None)``: inputs int64 ``[B, L, k]`` (k = s: a bag, embedded as its
    mean), targets int64 ``[B, L, j]`` (-100 = ignore) -> float32 logits ``[B, L, V]``, or with targets the float32
    loss *sum* over valid labels. One mask per window (``masks_for``), windows from the ``windows`` buffer.
    ``dtype``: the activations' (bf16 on CUDA: the stream, q/k/v, MLP hidden and head input, as modded-nanogpt;
    None, on a CPU: the weights' own, float32 and exactly repeatable); weights are cast per matmul (``linear``)."""

    def __init__(self, cfg, dtype=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        n, k, d = cfg.n_layer, cfg.value_embeds, cfg.model_dim
        self.ve_of_layer = {layer: i % k for i, layer in enumerate(harness.ve_layer_list(cfg))}
        self.short = layer_set(cfg.short_window_layers)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.model_dim) for _ in range(k))
        for table in [self.embed, *self.value_embeds]:
            route(table.weight, "embed")
        if cfg.ve_gate:  # HEAD's small spherical init of the gated tables
            for table in self.value_embeds:
                nn.init.normal_(table.weight, std=0.01)
        # one RoPE table shared by every attention layer (one cos/sin pair, not one per layer: 25 MB
        # each at the record's 49,152 positions)
        self.rotary = make_rotary(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i, i in self.ve_of_layer, self.rotary) for i in range(n))
        self.init_model89(cfg)
        self.lm_head = _linear(cfg.model_dim, cfg.vocab_size, zero=True, group="head")
        fixed = cfg.fp8 and cfg.stages == "record89"  # HEAD's fixed FP8 head scales (x, w, grad)
        self.register_buffer("head_scales", torch.tensor(HEAD_SCALES) if fixed else None, persistent=False)
        self._divisor = 1
        self._window = flag_windows(cfg)
        self.register_buffer("windows", torch.tensor(self._window), persistent=False)  # (long, short)
        self.tied = cfg.tied_embed  # the embedding reads the head's weight (``untie``)
        self.flex = None  # FlexAttention block masks: None = on CUDA inputs; False = SDPA's bool masks anywhere
        if self.tied:  # HEAD's init of a tied head: N(0, 0.005^2), the embedding a copy
            with torch.no_grad():
                nn.init.normal_(self.lm_head.weight, std=0.005)
                self.embed.weight.copy_(self.lm_head.weight)

    def init_model89(self, cfg):
        """Record #89's inputs and connections (HEAD's inits): skip gate, smear, bigram table and signs, MUDD."""
        d, scalar = cfg.model_dim, lambda t, role=None: route(nn.Parameter(t), "scalar", role)  # noqa: E731
        self.skip = harness.skip_pair(cfg)  # (a, b) or None
        self.skip_lambda = scalar(torch.tensor(-1.5)) if self.skip else None  # sigmoid(-1.5) = 0.18
        self.smear_w = scalar(torch.zeros(1, 12), "smear_gate") if cfg.smear else None
        self.smear_lambda = scalar(torch.zeros(())) if cfg.smear else None
        self.bigram = nn.Embedding(cfg.bigram_vocab, cfg.bigram_dim or d) if cfg.bigram_vocab else None
        if self.bigram is not None:
            nn.init.zeros_(route(self.bigram.weight, "embed", "bigram_embed"))
            # record #83: a +-1 row per (previous XOR current) lets bigrams that share a hash row differ in sign
            self.register_buffer("bigram_signs", torch.randn(BIGRAM_SIGN_ROWS, cfg.bigram_dim or d).sign())
        self.mudd_w1 = self.mudd_w2 = self.mudd_b2 = None
        if cfg.mudd:  # two 64-wide GELU MLPs of the stream: 14 coefficients at the last layer, 5 after it
            self.mudd_w1 = scalar(torch.empty(2, 64, d).uniform_(-d ** -0.5, d ** -0.5), "mudd")  # kaiming a=sqrt(5)
            self.mudd_w2 = scalar(torch.zeros(2, 14, 64), "mudd")  # zero: MUDD starts as a no-op
            b = torch.zeros(2, 14)  # biases in units of MUDD_SCALE: VE gate 2, lambdas sqrt(1.1) and 1, bigram 0.05,
            b[0, 6:14] = torch.tensor([2.0, 2.0, 1.1 ** 0.5, 1.0, 0.0, 0.05, 1.1 ** 0.5, 1.0])
            b[1, 1] = -0.5  # ... and -0.5 of the state after the loop (the former backout, record #81)
            self.mudd_b2 = scalar(b / MUDD_SCALE, "mudd_bias")
        self.gate_w1 = None
        if cfg.mudd_gates:  # record #85: two gate MLPs, of x0 for the layers before --mudd-gates, then of the stream
            self.gate_lanes = gate_lanes(cfg)
            m = max(sum(w for _, _, w in lanes) for lanes in self.gate_lanes)
            self.gate_w1 = scalar(torch.empty(2, 64, d).uniform_(-d ** -0.5, d ** -0.5), "mudd_gate")
            self.gate_w2 = scalar(torch.zeros(2, m, 64), "mudd_gate")
            b = torch.zeros(2, m)  # HEAD's starts: output gates 0.25, bigram 0.05, the skip 0.5 (XSA and x0: 0)
            for j, lanes in enumerate(self.gate_lanes):
                off = 0
                for _, kind, w in lanes:
                    b[j, off:off + w] = GATE_START.get(kind, 0.0)
                    off += w
            self.gate_b2 = scalar(b / MUDD_SCALE, "mudd_gate_bias")
            self.gate_scale = scalar(torch.tensor(MUDD_SCALE), "mudd_gate_bias")  # learned, unlike MUDD's

    def set_window(self, window, yarn=None):
        """Put ``(long, short)`` windows (a stage-table column) in the ``windows`` buffer and, with --rope-yarn,
        the RoPE tables of the long windows ``yarn`` (``StepRow.yarn``) in ``rotary``'s; written only on a change."""
        if window != self._window:
            self.windows[0], self.windows[1] = window
            self._window = window
        if self.cfg.rope_yarn and yarn is not None and yarn != getattr(self, "_yarn", ()):
            self.rotary.set_history(yarn)
            self._yarn = yarn

    def set_loss_divisor(self, divisor):
        """The FP8 head's gradient scale: HEAD's 0.75/448 times the loss factor 1/``divisor`` (``grad_divisor``), as
        HEAD's grad_s x 1/grad_accum_steps; written only on a change (no sync)."""
        if self.head_scales is not None and divisor != self._divisor:
            self.head_scales[2] = HEAD_SCALES[2] / divisor
            self._divisor = divisor

    def masks_for(self, inputs):
        """``(long, short)`` masks of a forward on ``inputs`` ``[B, L, k]`` (``build_attention_mask``; ``LayerMasks``
        with paired-head layers or --key-offset), or Nones."""
        cfg = self.cfg
        if not cfg.doc_mask and not windowed(cfg):
            return None, None
        if cfg.doc_mask:
            doc_ids = latent_document_ids(inputs)
        else:  # one document: only causality and the window
            doc_ids = torch.zeros(inputs.shape[:2], dtype=torch.int64, device=inputs.device)
        paired = {i in self.short for i in layer_set(cfg.paired_head_layers)}  # the windows paired layers use
        flex = inputs.is_cuda if self.flex is None else self.flex

        def build(window, short):
            if not paired and not cfg.key_offset and not cfg.dc_layers:
                return build_attention_mask(doc_ids, window, flex)
            return layer_masks(doc_ids, window, flex, short in paired, cfg.key_offset_docs and not short,
                               bool(cfg.dc_layers))
        if not windowed(cfg):
            mask = build(0, False)
            return mask, mask
        long = build(self.windows[0], False)
        short = build(self.windows[1], True) if self.short else long
        return long, short

    def forward(self, inputs, targets=None, weights=None):
        masks = self.masks_for(inputs)
        table = functools.partial(F.embedding, weight=self.lm_head.weight) if self.tied else self.embed
        x = self.act(embed_tokens(table, inputs))  # the stream's dtype from here on
        x = x0 = rms_norm(x if self.smear_w is None else self.smeared(x))
        ves = [self.act(embed_tokens(table, inputs)) for table in self.value_embeds]
        bigram = self.bigram_embedding(inputs) if self.bigram is not None else None
        gates, skip_factor = self.gate_coefs(x0, 0) if self.gate_w1 is not None else ({}, 1.0)
        if bigram is not None:  # layer 0's gate: the bigram enters the stream before the first layer (HEAD)
            g0 = gates.get(0, {}).get("bigram", self.blocks[0].bigram_gate)
            x = x + F.pad(g0 * bigram, (0, x.size(-1) - bigram.size(-1)))
        n, start, snaps = len(self.blocks), x, {}
        for i, block in enumerate(self.blocks):
            if self.gate_w1 is not None and i == self.cfg.mudd_gates:  # record #85's second gate MLP
                post, skip_factor = self.gate_coefs(x, 1)
                gates.update(post)
            if self.skip is not None and i == self.skip[1]:  # HEAD's one gated skip (3 -> 6)
                x = x + torch.sigmoid(self.skip_lambda) * skip_factor * snaps[self.skip[0]]
            ve = ves[self.ve_of_layer[i]] if i in self.ve_of_layer else None
            dyn = None
            if self.mudd_w1 is not None and i == n - 1:  # MUDD mixes earlier states into the last layer
                x, ve, dyn = self.mudd_in(x, start, snaps[self.cfg.attn_state_layer], ve)
            # record #77: layers after --attn-state-layer attend from the stream it left (None before it)
            state = snaps.get(self.cfg.attn_state_layer) if self.cfg.attn_state_layer >= 0 else None
            x = block(x, start if dyn else x0, masks[i in self.short], ve, state, bigram if i else None, dyn,
                      gates.get(i))
            snaps[i] = x  # references only: backward keeps these tensors anyway
        if self.mudd_w1 is not None:  # after the loop: the start, the state, the last layer's input, VE 0, the skip
            mu = self.mudd_coefs(x, 1, 5)
            srcs = (start, snaps[self.cfg.attn_state_layer], snaps[n - 2], ves[0], snaps[self.skip[0]])
            x = x + sum(m * src for m, src in zip(mu, srcs))
        x, head = rms_norm(x), self.lm_head.weight
        if targets is not None and not self.training:  # the metric: the logits of a long val chunk in pieces
            return sum(loss_sum(linear(xp, head), tp, None, self.cfg) for xp, tp in head_pieces(x, targets))
        if fp8_active(self.cfg.fp8, x, head):  # record #19's FP8 head
            logits = fp8_linear(x, head, fp8_grad=True, scales=self.head_scales)
        else:
            logits = linear(x, head)
        c = self.cfg.logit_softcap
        if targets is not None:  # the cap is applied inside the fused loss; eval mode: the metric alone
            loss = loss_sum(logits, targets, weights if self.training else None, self.cfg)
            extra = self.train_only_loss(x, logits, targets) if self.training else None
            return loss if extra is None else loss + extra
        logits = upcast(logits)
        if self.cfg.logit_cap == "sigmoid":
            A, B, C = SIGMOID_CAP
            return A * torch.sigmoid((logits + B) / C)
        return c * torch.tanh(logits / c) if c > 0 else logits

    def act(self, x):
        """``x`` in the activations' dtype (``dtype``; None: as it is)."""
        return x if self.dtype is None else x.to(self.dtype)

    def smeared(self, x):
        """Record #34 (HEAD) on embeddings x ``[B, L, d]``: ``x[t] += lam sigmoid(w . x[t, :12]) x[t-1]`` for t >= 1.

        The gate is computed at every position (one unused) so the matmul count is 12 per position."""
        g = (self.smear_lambda * torch.sigmoid(linear(x[..., :12], self.smear_w)))[:, 1:]
        return torch.cat((x[:, :1], x[:, 1:] + g * x[:, :-1]), dim=1)

    def bigram_embedding(self, inputs):
        """Bigram hash embedding (record #62, signs #83): inputs ``[B, L, k]`` -> ``[B, L, bigram_dim]``; token c after
        p takes row ``(36313 c ^ 27191 p) mod (V - 1)`` times sign row ``(p ^ c) mod 8192`` (a row's first: row V - 1,
        sign row 0), a bag the mean over its tokens (docs/METHODS.md §5)."""
        B, L, k = inputs.shape
        cur = inputs.reshape(B, L * k)
        prev = F.pad(cur[:, :-1], (1, 0))
        pos, V = torch.arange(L * k, device=inputs.device), self.bigram.num_embeddings - 1
        # HEAD hashes position 1 with its position 0's row number V as the previous token, in int32 (27191 V wraps)
        term = (27191 * torch.where(pos == 1, V, prev) + 2 ** 31) % 2 ** 32 - 2 ** 31
        rows = torch.where(pos == 0, V, ((36313 * cur) ^ term) % V)  # int64, else as HEAD's int32 ops
        signs = self.bigram_signs[torch.where(pos == 0, 0, (prev ^ cur) % BIGRAM_SIGN_ROWS)]
        e = self.act(self.bigram(rows))
        e = (e * signs.type_as(e)).view(B, L, k, -1)  # +-1: exact in bf16
        return bag_mean(e) if k > 1 else e.squeeze(2)

    def mudd_coefs(self, x, j, m):
        """MUDD block j's m per-token coefficients, each ``[B, L, 1]``: ``(W2 gelu(W1 x) + b) * 0.1`` (#81, HEAD)."""
        h = F.gelu(linear(x, self.mudd_w1[j]))
        return ((linear(h, self.mudd_w2[j, :m]) + self.mudd_b2[j, :m].type_as(h)) * MUDD_SCALE).split(1, dim=-1)

    def gate_coefs(self, x, j):
        """Record #85's gate MLP j of x ``[B, L, d]``: ``{layer: {kind: [B, L, w]}}`` over ``gate_lanes(cfg)[j]`` and
        (j = 1) the skip's factor ``[B, L, 1]``: ``(W2 gelu(W1 x) + b) * scale``, one lane per coefficient."""
        lanes = self.gate_lanes[j]
        m = sum(w for _, _, w in lanes)
        h = F.gelu(linear(x, self.gate_w1[j]))
        c = (linear(h, self.gate_w2[j, :m]) + self.gate_b2[j, :m].type_as(h)) * self.gate_scale
        out, skip = {}, None
        for (layer, kind, w), piece in zip(lanes, c.split([w for _, _, w in lanes], dim=-1)):
            if kind == "skip":
                skip = piece
            else:
                out.setdefault(layer, {})[kind] = piece
        return out, skip

    def mudd_in(self, x, start, state, ve):
        """MUDD at the last layer's input x ``[B, L, d]`` (record #81 v2, HEAD): mixes the stream before layer 0
        (``start``) and the cached ``state`` into V and into the residual, gates the VE per head pair, and gives the
        layer's lambdas and injection gates per token. Returns (x, V addend ``[B, L, d]``, Block's ``dyn``)."""
        mu = self.mudd_coefs(x, 0, 14)
        B, L, d = x.shape
        H = self.cfg.n_head
        v = mu[0] * start + mu[1] * state + mu[2] * x
        if ve is not None:  # two gate lanes, each over half the heads
            gate = torch.cat(mu[6:8], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)  # [B, L, H, 1]
            v = v + (gate * ve.view(B, L, H, d // H)).view(B, L, d)
        x = (1 + mu[5]) * x + mu[3] * start + mu[4] * state
        return x, v, (mu[8], mu[9], mu[12], mu[13], mu[10], mu[11], x.new_ones(()))

    def train_only_loss(self, x, logits, targets):
        """Training-only loss terms (a sum over labels) of x ``[B, L, d]``, logits, targets, or None: none today.
        Never called in eval mode, so no term here can reach ``val_loss``."""
        return None


VAL_PIECE = 16_384  # positions whose logits eval holds at once (a 262,144-token chunk's: 26 GB in bf16)


def head_pieces(x, targets):
    """x ``[B, L, d]`` and targets ``[B, L, j]`` in matching pieces of about ``VAL_PIECE`` positions (along L)."""
    n = max(1, VAL_PIECE // x.size(0))
    return zip(x.split(n, dim=1), targets.split(n, dim=1))


def windowed(cfg):
    """Whether attention has sliding windows: ``--window`` or a stage table with window columns."""
    return cfg.window > 0 or cfg.stages == "record89"


def loss_sum(logits, targets, weights, cfg):
    """The loss sum of a forward with targets ``[..., J]``: ``multi_target_loss`` under the config's cap, column
    ``weights`` ``[J]`` (1 when None: the MCE, or next-token CE with J = 1)."""
    if weights is None:
        weights = torch.ones(targets.size(-1), dtype=torch.float32, device=logits.device)
    cap = "none" if cfg.logit_cap == "tanh" and cfg.logit_softcap == 0 else cfg.logit_cap
    return multi_target_loss(logits, targets, weights, cap=cap, softcap=cfg.logit_softcap)


def model_flops_per_position(cfg, step=0):
    """Training FLOPs per latent position at optimizer ``step`` (``harness.FlopProfile``; for tools)."""
    return Schedule(cfg)[step].flops_per_position


# ----------------------------------------------------------------------------------------------
# Data: batches from the train stream (harness.TokenStream: the shards as one checked token stream)

EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document


def sequence_layout(mode, bag_size, seq_len):
    """``(seq_tokens, advance)`` raw tokens per sequence and stream advance: next-token L + 1, L; TST
    full/input (L + 1) s, L s (the last bag's labels: the next bag); output L + s, L. Each token is input once."""
    s, L = bag_size, seq_len
    if s == 1:
        return L + 1, L
    if mode in ("full", "input"):
        return (L + 1) * s, L * s
    if mode == "output":
        return L + s, L
    raise ValueError(f"unknown TST mode {mode!r}")


def enters_new_pass(old, new, total):
    """Whether a step's stream positions [old, new) reach a pass over the ``total``-token stream that the
    steps before ([0, old)) did not: a wrap, logged once, also when ``old`` sits exactly on a pass boundary."""
    return new > old and (new - 1) // total > max(old - 1, 0) // total


# Document-packed batches (modded-nanogpt records #26 2025-07-13 BOS alignment, #29 2025-09-03
# per-document cap and packing, #72 2026-02-10 the 896-token cap of stage 1; HEAD #89 2026-07-17).

def document_spans(window, start, total):
    """``(starts, ends)`` int64 stream positions of the documents wholly inside ``window`` (int64 ``[n]``,
    the tokens from ``start``; ``total`` per pass): a document runs from an EOT to the next EOT or the
    end of the pass; tokens before a pass's first EOT belong to none."""
    stop = start + window.size
    starts = np.flatnonzero(window == EOT_TOKEN) + start          # vectorized BOS search
    ends = np.minimum(np.append(starts[1:], np.iinfo(np.int64).max), (starts // total + 1) * total)
    keep = ends <= stop
    return starts[keep], ends[keep]


def pack_plan(lengths, seq_tokens, n_seqs):
    """``(first, last, tail)`` int64 ``[n_seqs]``: the documents (clipped ``lengths`` ``[D]``, in order)
    filling each sequence of ``seq_tokens`` and the tokens taken from its last, cut one (the rest is
    skipped); None when the D documents cannot fill ``n_seqs`` sequences."""
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    first = np.empty(n_seqs, dtype=np.int64)
    last = np.empty(n_seqs, dtype=np.int64)
    doc = 0
    for j in range(n_seqs):  # one binary search per sequence, none per token
        end = int(np.searchsorted(bounds, bounds[doc] + seq_tokens, side="left"))
        if end == bounds.size:
            return None
        first[j], last[j], doc = doc, end - 1, end
    return first, last, bounds[first] + seq_tokens - bounds[last]


class PackedLoader:
    """Document-packed train batches (record #89's loader), sized per call: a sequence starts at an EOT (#26)
    and holds whole documents clipped to ``cap`` tokens (#29, #72), the last one cut, no padding. Sequence
    ``rank * accum + micro`` goes to that rank and micro-step; ``position`` is the whole state."""

    def __init__(self, stream, rank, world):
        self.stream, self.rank, self.world = stream, rank, world
        self.position, self.wrapped = 0, False

    def next_batch(self, global_seqs, micro_seqs, seq_len, cap, bag_size=1, mode="full"):
        """``(micro, raw_tokens, positions)``: ``accum`` int64 ``[micro_seqs, seq_tokens]`` of this rank, the
        stream tokens consumed (skipped ones too) and ``global_seqs * seq_len``; ``cap`` 0 = no cap."""
        if micro_seqs < 1 or global_seqs < 1 or global_seqs % (micro_seqs * self.world):
            raise ValueError(f"{global_seqs} sequences do not split into micro-batches of {micro_seqs} "
                             f"over {self.world} process(es)")
        if cap < 0:
            raise ValueError(f"the document cap must be >= 0 tokens (0 = no cap), got {cap}")
        accum = global_seqs // (micro_seqs * self.world)
        seq_tokens, _ = sequence_layout(mode, bag_size, seq_len)
        window, starts, ends, lengths, (first, last, tail) = self._plan(global_seqs, seq_tokens, cap or seq_tokens)
        mine = slice(self.rank * accum * micro_seqs, (self.rank + 1) * accum * micro_seqs)
        lo, hi = first[mine][0], last[mine][-1] + 1                 # this rank's documents
        piece = lengths[lo:hi].copy()
        piece[last[mine] - lo] = tail[mine]                         # each sequence's cut last document
        offset = np.cumsum(piece) - piece                           # where each piece lands
        index = np.repeat(starts[lo:hi] - self.position - offset, piece) + np.arange(accum * micro_seqs * seq_tokens)
        tokens = torch.from_numpy(window[index]).view(accum, micro_seqs, seq_tokens)
        old = self.position
        self.position = int(ends[last[-1]])
        self.wrapped = enters_new_pass(old, self.position, self.stream.total)
        return list(tokens.unbind(0)), self.position - old, global_seqs * seq_len

    def _plan(self, n_seqs, seq_tokens, cap):
        """``(window, starts, ends, clipped lengths, pack_plan)``, reading ahead (doubling) until n_seqs pack."""
        stream, start = self.stream, self.position
        room = None if stream.wrap else max(0, stream.total - start)
        n = 2 * n_seqs * seq_tokens                                 # twice what the sequences hold
        while True:
            n = n if room is None else min(n, room)
            window = stream.read(start, n)
            starts, ends = document_spans(window, start, stream.total)
            lengths = np.minimum(ends - starts, cap)
            plan = pack_plan(lengths, seq_tokens, n_seqs)
            if plan is not None:
                return window, starts, ends, lengths, plan
            if n == room:
                raise DataError(f"the train stream ({stream.total} tokens) has too few documents after token "
                                f"{start} for {n_seqs} packed sequences of {seq_tokens} tokens; add shards")
            if n >= stream.total and not (window == EOT_TOKEN).any():
                raise DataError(f"{', '.join(os.path.basename(f) for f in stream.files[:3])}: no <|endoftext|> "
                                f"(id {EOT_TOKEN}) in the train stream; packed batches need one before every "
                                f"document: re-tokenize with data/tokenize_text.py")
            n *= 2


def open_data(cfg, data):
    """(train TokenStream that wraps, val TokenStream) over the files of ``find_data``. Raises DataError."""
    ids = min(cfg.vocab_size, GPT2_IDS)  # padding rows are never a token
    return (TokenStream([f for f, _ in data["train"]], wrap=True, vocab_size=ids),
            TokenStream([f for f, _ in data["val"]], vocab_size=ids))


# ----------------------------------------------------------------------------------------------
# Token-Superposition Training (Peng, Gigant, Quesnelle 2026, arXiv 2605.06546; docs/METHODS.md §1)

def make_tst_batch(tokens, bag_size):
    """int64 ``[B, (L + 1) s]`` -> ``(bags, next bags)``, int64 ``[B, L, s]`` views; bag i: tokens [i s, (i + 1) s)."""
    B, n = tokens.shape
    s = bag_size
    if s < 1 or n % s or n // s < 2:
        raise ValueError(f"make_tst_batch: length {n} is not (L+1)*s with L >= 1 for s={s}")
    t = tokens.view(B, n // s, s)
    return t[:, :-1], t[:, 1:]


def make_batch(tokens, mode, bag_size):
    """int64 ``[B, seq_tokens]`` -> ``(inputs [B, L, k], targets [B, L, j])``: next-token k = j = 1; full k = j = s;
    input k = s, j = 1 (the next bag's first token); output k = 1, j = s (position t predicts t+1..t+s)."""
    if bag_size == 1 or mode in ("full", "input"):
        bags, targets = make_tst_batch(tokens, bag_size)
        return bags, (targets[..., :1] if mode == "input" else targets)
    if mode == "output":
        L = tokens.size(1) - bag_size
        return tokens[:, :L, None], tokens[:, 1:].unfold(1, bag_size, 1)
    raise ValueError(f"unknown TST mode {mode!r}")


def bag_mean(x):
    """Bag embedding: ``[B, L, s, d]`` -> ``[B, L, d]``, summed in float32, divided by s, cast back."""
    return (upcast(x).sum(dim=2) / x.size(2)).to(x.dtype)


def multi_token_targets(targets, n_predict):
    """int64 ``[..., L]`` -> ``[..., L, n]``: ``out[..., i, k] = targets[..., i + k]``, ``PAST_END`` past L (multi-token
    prediction, record #53, 2025-12-22; as HEAD, not cut at document ends, its weight kept in the softmax term)."""
    return F.pad(targets, (0, n_predict - 1), value=PAST_END).unfold(-1, n_predict, 1)


def prefix_targets(table, targets):
    """Prefix-token labels int64 ``[...]``: ``table[targets]`` (int64 ``[V]``), ignored where ignored (record #88)."""
    return torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, table[targets.clamp_min(0)])


def prefix_token_table(vocab_size, path=harness.GPT2_ENCODER_JSON):
    """int64 ``[vocab_size]``: each token's longest proper byte prefix that is a token, else ignored (record #88,
    2026-07-13): single bytes, <|endoftext|> and padding have none."""
    token_bytes = harness.gpt2_token_bytes(path)
    ids = {b: i for i, b in token_bytes.items()}
    table = [IGNORE_INDEX] * vocab_size
    for i, b in token_bytes.items():
        if i < vocab_size:
            table[i] = next((ids[b[:n]] for n in range(len(b) - 1, 0, -1) if b[:n] in ids), IGNORE_INDEX)
    return torch.tensor(table, dtype=torch.int64)


def objective_targets(targets, prefix_table=None, n_predict=3):
    """int64 ``[..., L]`` -> ``[..., L, n_predict (+ 1)]`` for ``multi_target_loss``: the multi-token columns, then
    the next token's prefix token (with a ``prefix_table``)."""
    cols = multi_token_targets(targets, n_predict)
    if prefix_table is None:
        return cols
    return torch.cat([cols, prefix_targets(prefix_table, targets)[..., None]], dim=-1)


def next_micro_batches(loader, stage, seq_len, rt, micro_seqs):
    """``([(inputs, targets)] of this rank on the device, raw tokens the step read)`` for a step of ``stage``:
    document-packed sequences, the stage's document cap (0 = none)."""
    seq_len = stage.length(seq_len)
    s, mode, global_seqs = stage.bag_size, stage.mode, stage.batch_tokens // seq_len
    tokens, raw_tokens, _ = loader.next_batch(global_seqs, micro_seqs, seq_len, stage.doc_cap, s, mode)
    return [make_batch(rt.to_device(t), mode, s) for t in tokens], raw_tokens


# ----------------------------------------------------------------------------------------------
# Optimizers

def with_initial_lr(opts):
    """Record every group's ``initial_lr`` (what the stage table's lr scale multiplies); returns ``opts``."""
    for opt in opts:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return opts


def build_optimizers(model, cfg, compile=False):
    """Aurora/Muon (or AdamW) on the "matrix" parameters, Adam on the rest, by their ``route`` tags; every group
    keeps its ``initial_lr`` for the schedule. An untagged parameter is a ConfigError naming it."""
    if cfg.optimizer in ("normuon", "aurora_normuon"):
        return build_record89_optimizers(model, cfg, compile)
    cuda = next(model.parameters()).is_cuda
    groups = {g: [] for g in OPT_GROUPS}
    for name, p in model.named_parameters():
        if getattr(p, "opt_group", None) not in groups:
            raise ConfigError(f"parameter {name} {tuple(p.shape)} has no optimizer group; tag it where it is "
                              f"created with route(param, group), group one of {', '.join(OPT_GROUPS)}")
        groups[p.opt_group].append((name, p))
    matrices = groups["matrix"]
    embeds, scalars = [p for _, p in groups["embed"]], [p for _, p in groups["scalar"]]
    adam_groups = [dict(params=embeds, lr=cfg.embed_lr), dict(params=[p for _, p in groups["head"]], lr=cfg.head_lr)]
    if scalars:
        adam_groups.append(dict(params=scalars, lr=cfg.scalar_lr))
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    opts = [torch.optim.Adam(adam_groups, betas=betas, eps=cfg.adam_eps, fused=cuda)]
    if cfg.optimizer in ("aurora", "muon"):
        opts.append(Aurora([dict(params=[p for _, p in matrices], names=[n for n, _ in matrices])],
                           lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum,
                           nesterov=cfg.nesterov, ns=cfg.ns, pp_beta=cfg.pp_beta,
                           pp_iterations=cfg.pp_iterations if cfg.optimizer == "aurora" else 0,
                           compile=compile, ns_dtype=None if cfg.ns_dtype == "auto" else getattr(torch, cfg.ns_dtype)))
    else:
        opts.append(torch.optim.AdamW([p for _, p in matrices], lr=cfg.adamw_lr, betas=(0.9, 0.95),
                                      eps=1e-8, weight_decay=cfg.adamw_wd, fused=cuda))
    return with_initial_lr(opts)


def build_record89_optimizers(model, cfg, compile=False):
    """Record #89's optimizers (docs/METHODS.md §3): NorMuon (aurora_normuon: Aurora's polar on the MLP matrices)
    on the block matrices, CautiousAdam (HEAD's roles, every other step; --embed/head/scalar-lr unused) on the rest."""
    named = dict(model.blocks.named_parameters())
    pick = lambda *ends: [(f"blocks.{n}", p) for n, p in named.items() if n.endswith(ends)]  # noqa: E731
    groups = record89_matrix_groups(pick("attn.q.weight", "attn.k.weight"), pick("attn.v.weight", "attn.proj.weight"),
                                    pick("mlp.fc.weight"), pick("mlp.proj.weight"), cfg.model_dim // cfg.n_head,
                                    aurora=cfg.optimizer == "aurora_normuon", pp_iterations=cfg.pp_iterations)
    matrix = NorMuon(groups, lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum,
                     nesterov=cfg.nesterov, ns=cfg.ns, pp_beta=cfg.pp_beta, compile=compile,
                     ns_dtype=None if cfg.ns_dtype == "auto" else getattr(torch, cfg.ns_dtype))
    routed = {id(p) for g in groups for p in g["params"]}
    tagged = [p for p in model.parameters() if hasattr(p, "adam_role")]  # route(param, group, role)
    scalars = [p for p in model.parameters() if p.ndim < 2 and not hasattr(p, "adam_role")]
    rest = [p for p in model.blocks.parameters() if p.ndim == 2 and id(p) not in routed and not hasattr(p, "adam_role")]
    if rest:
        raise ConfigError(f"--optimizer {cfg.optimizer}: {len(rest)} block matrices have no NorMuon group")
    roles = dict(embed=[model.embed.weight], lm_head=[model.lm_head.weight],
                 value_embeds=[t.weight for t in model.value_embeds], scalars=scalars)
    for p in tagged:
        roles.setdefault(p.adam_role, []).append(p)
    placed = routed | {id(p) for ps in roles.values() for p in ps}
    missing = [n for n, p in model.named_parameters() if id(p) not in placed]
    if missing:
        raise ConfigError(f"--optimizer {cfg.optimizer}: parameter {missing[0]} has no optimizer role; tag it "
                          f"with route(param, group, role)")
    opts = [CautiousAdam(record89_adam_groups(roles), eps=cfg.adam_eps, every=2, compile=compile), matrix]
    return with_initial_lr(opts)


def adam_bf16_(model):
    """--adam-bf16 (HEAD's storage): Adam's parameters of 2+ dims in bf16, so each update rounds as HEAD's; its
    vectors and scalars stay float32 as HEAD's, NorMuon's matrices float32 (HEAD: bf16 + 16 mantissa bits)."""
    for p in model.parameters():
        if p.ndim >= 2 and p.opt_group != "matrix":
            p.data = p.data.bfloat16()


@torch.no_grad()
def untie(model, adam):
    """End ``--tied-embed`` (records #51, #53, HEAD's split): the embedding takes the head's weight, Adam state."""
    model.embed.weight.copy_(model.lm_head.weight)
    head, embed = adam.state[model.lm_head.weight], adam.state[model.embed.weight]
    for key, value in head.items():
        embed[key] = value.clone() if torch.is_tensor(value) else value
    model.tied = False


def split_step(cfg):
    """The step after which ``--tied-embed`` unties: record #89's stage 3 start, made odd (an Adam step, as HEAD)."""
    if not cfg.tied_embed:
        return None
    return record89_stages(cfg)[2].start | 1


# ----------------------------------------------------------------------------------------------
# Optimizer settings of a step (from the stage table)

def apply_schedule(opts, row):
    """Set every group's lr (and Aurora's momentum) from a stage-table ``row``; returns the lr scale."""
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * row.lr_scale
            if isinstance(opt, Aurora):
                g["momentum"] = row.momentum
    return row.lr_scale


# ----------------------------------------------------------------------------------------------
# One step's gradients (gradient accumulation, all-reduce across processes)

def all_reduce_sum(t, rt):
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def grad_divisor(cfg, stage):
    """What a step's loss sum is divided by for its gradient (``accumulate_gradients``), None: the label count. With
    record #89's stages HEAD's: its per-rank sum over one flat sequence, averaged over 8 ranks, i.e. the step's
    sequence count (x s for an MCE's s labels per position): the gradient grows 2x, 1.5x with the sequences."""
    if cfg.stages != "record89":
        return None
    per_label = stage.bag_size if stage.phase == 1 and stage.mode != "input" else 1
    return stage.batch_tokens // stage.length(cfg.seq_len) * per_label


class Objectives:
    """The stage table's multi-token and prefix columns (``--objectives``): every step's weights float32
    ``[N + 1, 4]`` on the device, copied into ``weights`` per step (no host sync, no new graph)."""

    def __init__(self, schedule, vocab_size, device):
        self.table = prefix_token_table(vocab_size).to(device)
        rows = [row.objective or (1.0, 0.0, 0.0, 0.0) for row in schedule.rows]
        self.per_step = torch.tensor(rows, dtype=torch.float32, device=device)
        self.weights = torch.empty(4, dtype=torch.float32, device=device)

    def batches(self, micro, row, step):
        """``(micro, weights)``: next-token rows with an objective get targets ``[b, L, 4]`` and the step's weights."""
        if row.stage.phase == 1 or not row.objective:
            return micro, None
        self.weights.copy_(self.per_step[step])
        return [(inputs, objective_targets(targets[..., 0], self.table)) for inputs, targets in micro], self.weights


def accumulate_gradients(model, micro_batches, rt, weights=None, stop=None, divisor=None):
    """Forward/backward over this rank's ``[(inputs [b, L, k], targets [b, L, j])]``; returns the float32 loss: the
    global label sum (columns weighted by ``weights`` [J]) over the next-token label count, not a mean of means;
    the gradient of the sum over it or ``divisor`` (``grad_divisor``), all-reduced in buckets in the last backward."""
    n_valid = torch.zeros((), device=rt.device)
    for _, targets in micro_batches:
        n_valid += ((targets if weights is None else targets[..., :1]) != IGNORE_INDEX).sum()
    n_valid = all_reduce_sum(n_valid, rt).clamp_min(1)
    divisor = n_valid if divisor is None else divisor
    total = torch.zeros((), device=rt.device)
    buckets = grad_buckets(model) if rt.distributed else None
    for m, (inputs, targets) in enumerate(micro_batches):
        loss_sum = model(inputs, targets) if weights is None else model(inputs, targets, weights)
        handles = buckets.hooks() if buckets is not None and m == len(micro_batches) - 1 else []
        try:
            (loss_sum / divisor).backward()
        finally:
            for h in handles:
                h.remove()
        total += loss_sum.detach()
        harness.should_stop(stop)  # a safe point: raises on a signal unless the step must finish to be saved
    if buckets is not None:
        buckets.finish()
    return all_reduce_sum(total, rt) / n_valid


# ----------------------------------------------------------------------------------------------
# Eval: the metric is next-token cross-entropy over the first --val-tokens tokens of the val shards

class ValData:
    """The first ``n_tokens`` tokens of the val shards (+1 for the last label), in memory."""

    def __init__(self, stream, n_tokens):
        if stream.total < n_tokens + 1:
            raise DataError(f"--val-tokens {n_tokens}: the val shards ({', '.join(stream.files)}) hold only "
                            f"{stream.total} tokens (need {n_tokens} + 1 for the last label); "
                            f"lower --val-tokens or add val shards")
        self.n_tokens = n_tokens
        self.tokens = torch.from_numpy(stream.read(0, n_tokens + 1))

    def batches(self, mode, bag_size, seq_len, batch_seqs, rt):
        """This rank's ``[batch_seqs, ...]`` val batches of a phase objective (fixed shapes); labels past
        ``n_tokens`` are ignored, so the mean is exactly over the first ``n_tokens`` labels. Next-token
        (s = 1, the metric): ``chunks`` of ``seq_len``."""
        if bag_size == 1:
            yield from self.chunks(seq_len, batch_seqs, rt)
            return
        seq_tokens, advance = sequence_layout(mode, bag_size, seq_len)
        n_seqs = -(-self.n_tokens // advance)
        per_rank = -(-n_seqs // (rt.world * batch_seqs)) * batch_seqs
        length = (per_rank * rt.world - 1) * advance + seq_tokens
        tokens = torch.zeros(length, dtype=torch.int64)
        tokens[:self.n_tokens + 1] = self.tokens
        label_ok = torch.zeros(length, dtype=torch.bool)
        label_ok[1:self.n_tokens + 1] = True
        seqs, oks = tokens.unfold(0, seq_tokens, advance), label_ok.unfold(0, seq_tokens, advance)
        for start in range(rt.rank * per_rank, (rt.rank + 1) * per_rank, batch_seqs):
            inputs, targets = make_batch(seqs[start:start + batch_seqs], mode, bag_size)
            _, ok = make_batch(oks[start:start + batch_seqs], mode, bag_size)
            yield inputs, torch.where(ok, targets, IGNORE_INDEX)

    def chunks(self, chunk, batch_seqs, rt):
        """This rank's metric batches ``(inputs, targets)`` int64 ``[batch_seqs, chunk, 1]``: chunk i (tokens [i chunk,
        (i + 1) chunk) and their next tokens) on rank i mod world, so any process count scores the same chunks (HEAD:
        262,144 per rank of 8); as many forwards on every rank, labels past ``n_tokens`` or in padding ignored."""
        n = -(-self.n_tokens // chunk)
        per_rank = -(-(-(-n // rt.world)) // batch_seqs) * batch_seqs
        length = per_rank * rt.world * chunk + 1
        tokens = torch.full((length,), EOT_TOKEN, dtype=torch.int64)
        tokens[:self.n_tokens + 1] = self.tokens
        label_ok = torch.zeros(length, dtype=torch.bool)
        label_ok[1:self.n_tokens + 1] = True
        seqs, oks = tokens.unfold(0, chunk + 1, chunk), label_ok.unfold(0, chunk + 1, chunk)
        mine = torch.arange(rt.rank, per_rank * rt.world, rt.world)
        for group in mine.split(batch_seqs):
            inputs, targets = make_batch(seqs[group], "full", 1)
            yield inputs, torch.where(make_batch(oks[group], "full", 1)[1], targets, IGNORE_INDEX)


def val_batch_seqs(cfg):
    return cfg.val_batch_seqs or cfg.micro_batch_seqs


def val_chunk(cfg, bag_size=1):
    """Tokens per val sequence: the metric's (s = 1) chunk (``harness.val_chunk_tokens``), else --seq-len."""
    return harness.val_chunk_tokens(cfg) if bag_size == 1 else cfg.seq_len


@contextmanager
def eval_mode(model):
    """``model`` in eval mode without gradients inside the block, back in its previous mode after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(model, val, mode, bag_size, cfg, rt, stop=None):
    """Mean loss over the val tokens for a phase objective (s = 1: the metric), in eval mode (no training-only
    terms); a signal ends it between batches (a partial mean the caller drops)."""
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    count = torch.zeros((), device=rt.device, dtype=torch.float64)
    with eval_mode(model):
        for inputs, targets in val.batches(mode, bag_size, val_chunk(cfg, bag_size), val_batch_seqs(cfg), rt):
            if harness.should_stop(stop):  # every rank still meets the all-reduces below
                break
            inputs, targets = rt.to_device(inputs), rt.to_device(targets)
            total += model(inputs, targets).double()
            count += (targets != IGNORE_INDEX).sum()
    all_reduce_sum(total, rt)
    all_reduce_sum(count, rt)
    if count.item() == 0 and not harness.should_stop(stop):
        raise DataError(f"--val-tokens {val.n_tokens}: no label to score for the {mode} s={bag_size} objective")
    return (total / count).item()


# ----------------------------------------------------------------------------------------------
# The training loop

@dataclass
class Progress:
    """What the run has done so far; saved in checkpoints, summed over a resume."""
    train_time_ms: float = 0.0  # wall-clock of training steps only
    raw_tokens: int = 0         # text read from the train stream (TST phase 1 reads s x more per step)
    positions: int = 0          # latent positions trained
    flops: float = 0.0          # model FLOPs (model_flops_per_position x positions)


@dataclass
class Run:
    """What the loop works on: config and its stage table, runtime, the model (``net``: compiled, if
    it is), optimizers, data, progress, the run log and the stop flag the signal handler sets."""
    cfg: Config
    schedule: Schedule
    rt: Runtime
    log: harness.RunLog
    model: GPT
    net: nn.Module
    opts: list
    loader: PackedLoader
    val: ValData
    progress: Progress
    guard: NanGuard
    stop: dict
    data: dict
    objectives: Objectives = None
    split_step: int = None


def count_step(progress, row, raw_tokens):
    progress.raw_tokens += raw_tokens
    progress.positions += row.stage.batch_tokens
    progress.flops += row.flops_per_position * row.stage.batch_tokens


def validate(run, step):
    """Log the val loss at ``step`` (and the TST objective in phase 1); False when a signal cut it short."""
    cfg, rt = run.cfg, run.rt
    stage = run.schedule[max(step - 1, 0)].stage  # the stage that trained the model so far
    run.model.set_window(run.schedule[step].window, run.schedule[step].yarn)  # (the full window at the end)
    loss = evaluate(run.net, run.val, "full", 1, cfg, rt, run.stop)
    if harness.stop_requested(run):
        return False
    if not math.isfinite(loss):
        raise FloatingPointError(f"val loss is {loss} at step {step}; lower the lr ({run.guard.lr_flags})")
    loss_tst = None
    if stage.phase == 1:
        loss_tst = evaluate(run.net, run.val, stage.mode, stage.bag_size, cfg, rt, run.stop)
        if harness.stop_requested(run):
            return False
    harness.log_val_line(run, step, loss, stage.phase, loss_tst)
    return True


def graph_batches(run):
    """``{key: (inputs, targets, weights, tied, train)}``: one batch per graph the run will call, made by the loop's
    own functions (a copy of the loader, ``Objectives``, ``ValData.batches``), keyed on what a graph guards on:
    shapes, weights or not, the tie, train or eval. Nothing here knows a stage's shape."""
    cfg, rt, split, out = run.cfg, run.rt, run.split_step, {}
    tied_at = lambda step: run.model.tied if split is None else step <= split  # noqa: E731 -- untied after split
    add = lambda i, t, w, tied, train: out.setdefault(  # noqa: E731
        (tuple(i.shape), tuple(t.shape), w is None, tied, train), (i, t, w, tied, train))
    for st in run.schedule.stages:
        micro, _ = next_micro_batches(copy.copy(run.loader), st, cfg.seq_len, rt, cfg.micro_batch_seqs)
        micro, weights = micro[:1], None
        if run.objectives is not None:
            micro, weights = run.objectives.batches(micro, run.schedule[st.start], st.start)
        for tied in (tied_at(st.start), tied_at(st.end - 1)):  # both sides of an untie inside the stage
            add(*micro[0], weights, tied, True)
    N, evals = cfg.num_iterations, set()
    for step in {0, N, *(range(cfg.val_every, N, cfg.val_every) if cfg.val_every else ())}:
        stage = run.schedule[max(step - 1, 0)].stage  # as ``validate``: the metric, and the TST objective in phase 1
        evals |= {("full", 1, tied_at(step)), *([(stage.mode, stage.bag_size, tied_at(step))] * (stage.phase == 1))}
    for mode, s, tied in sorted(evals):
        for inputs, targets in run.val.batches(mode, s, val_chunk(cfg, s), val_batch_seqs(cfg), rt):  # as ``evaluate``
            add(inputs, targets, None, tied, False)  # moved to the device by ``warm_up``
    return out


def warm_up(run):
    """Compile every graph the run calls before the clock: the model's (``graph_batches``) and the optimizers'
    (``warm_step``: every parameter variant); logs each one's time, returns the total ms."""
    cfg, rt = run.cfg, run.rt
    if not rt.compile:
        return 0.0
    # why: each variant is compiled here on purpose (stage shapes x tie x train/eval; one optimizer graph per
    # NorMuon bucket of same-shape blocks and per Adam group); torch's default of 8 per function would run the
    # rest uncompiled all run
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    t0, graphs0, tied0 = time.perf_counter(), compiled_graphs(), run.model.tied
    batches = graph_batches(run)
    for (in_shape, t_shape, _, tied, train), (inputs, targets, weights, _, _) in batches.items():
        t1, g1, run.model.tied = time.perf_counter(), compiled_graphs(), tied
        inputs, targets = (inputs, targets) if train else (rt.to_device(inputs), rt.to_device(targets))
        with nullcontext() if train else eval_mode(run.net):
            loss = run.net(inputs, targets) if weights is None else run.net(inputs, targets, weights)
        if train:
            loss.backward()
            run.model.zero_grad(set_to_none=True)
        rt.sync()
        run.log.line(f"compile: {'train' if train else 'val'} {list(in_shape)} -> {list(t_shape)} tied:{int(tied)} "
                     f"took {1000 * (time.perf_counter() - t1):.0f}ms, {compiled_graphs() - g1} graph(s)")
        harness.should_stop(run.stop, can_save=False)  # a safe point between graphs: no step to save yet
    run.model.tied = tied0
    for opt in run.opts:
        if isinstance(opt, (Aurora, CautiousAdam)):
            t1, g1 = time.perf_counter(), compiled_graphs()
            warm_step(opt)
            rt.sync()
            run.log.line(f"compile: optimizer {type(opt).__name__} took {1000 * (time.perf_counter() - t1):.0f}ms, "
                         f"{compiled_graphs() - g1} graph(s)")
    ms = 1000 * (time.perf_counter() - t0)
    run.log.line(f"compile: warm-up of {len(run.schedule.graphs())} phase graph(s) took {ms:.0f}ms (not in "
                 f"train_time): {len(batches)} model graph keys, {compiled_graphs() - graphs0} graphs in all")
    return ms


def training_loop(run, start_step, end_step):
    """The speedrun itself, one optimizer step per iteration; returns the steps done if a signal stopped it."""
    cfg, rt, clock = run.cfg, run.rt, Clock(run.rt, run.progress)
    if start_step == 0 and not validate(run, 0):
        raise harness.StopRequested(f"interrupted by {run.stop['signal']} during the step-0 validation")
    clock.start()
    for step in range(start_step, end_step):
        row = run.schedule[step]  # every per-step quantity comes from the stage table
        if step == row.stage.start > 0:
            harness.log_stage(run, step)
        micro, raw_tokens = next_micro_batches(run.loader, row.stage, cfg.seq_len, rt, cfg.micro_batch_seqs)
        if run.loader.wrapped:
            log_wrap(run, step + 1)
        scale = apply_schedule(run.opts, row)
        run.model.set_window(row.window, row.yarn)
        weights = None
        if run.objectives is not None:
            micro, weights = run.objectives.batches(micro, row, step)
        divisor = grad_divisor(cfg, row.stage)
        run.model.set_loss_divisor(divisor)
        loss = accumulate_gradients(run.net, micro, rt, weights, run.stop, divisor)
        for opt in run.opts:
            opt.step()
        fp8_refresh(run.model, step)
        if step == run.split_step:
            untie(run.model, run.opts[0])
        run.model.zero_grad(set_to_none=True)
        run.guard.update(loss, step + 1)
        count_step(run.progress, row, raw_tokens)
        if harness.after_step(run, step + 1, end_step, loss, scale, clock, validate):  # a signal stopped it
            return step + 1
    return None


def train(cfg, rt, log, data, preset=None, resume=None, stop=None):
    """The run after the start-up checks (``harness.main``): data, model, warm-up, the loop; ``(status, reason)``."""
    train_stream, val_stream = open_data(cfg, data)
    harness.log_run_header(log, cfg, rt, preset, resume, data, (train_stream, val_stream))
    if cfg.fp8 and (why := fp8_unavailable_reason(rt.device)):  # e.g. a CPU or a GPU before sm_89
        log.line(f"fp8: off ({why}); the matmuls run in {'bf16' if rt.bf16 else 'float32'}")
        cfg = dataclasses.replace(cfg, fp8=False)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, torch.bfloat16 if rt.bf16 else None).to(rt.device)
    if cfg.adam_bf16 and rt.bf16:  # bf16 runs only: a float32 CPU run keeps float32 parameters
        adam_bf16_(model)
    schedule = Schedule(cfg)
    run = Run(cfg, schedule, rt, log, model, torch.compile(model, dynamic=False) if rt.compile else model,
              build_optimizers(model, cfg, compile=rt.compile), PackedLoader(train_stream, rt.rank, rt.world),
              ValData(val_stream, cfg.val_tokens), Progress(), NanGuard(rt.device, harness.lr_flags(cfg)),
              stop if stop is not None else {"signal": None}, data)
    if cfg.objectives:
        run.objectives = Objectives(schedule, cfg.vocab_size, rt.device)
    run.split_step = split_step(cfg)
    start_step = harness.restore(run, *resume[:2]) if resume else 0
    if run.split_step is not None:  # a resumed run past the split step is untied (weights and state restored)
        model.tied = start_step <= run.split_step
    harness.log_model_line(run)
    if start_step == 0 or not any(k.endswith("down_scales") for k in resume[0]["model"]):
        fp8_refresh(model, -1)  # HEAD's bootstrap of the delayed FP8 weight scales (a resume keeps its own)
    fp8_state = {n: b.clone() for n, b in model.named_buffers() if n.endswith("down_scales")}
    compile_ms = warm_up(run)
    model.load_state_dict(fp8_state, strict=False)  # the warm-up's forwards leave the delayed scales (HEAD resets)
    log.update(compile_time_ms=round(compile_ms))
    end_step = min(cfg.num_iterations, start_step + cfg.max_steps) if cfg.max_steps else cfg.num_iterations
    graphs_before = compiled_graphs() if rt.compile else 0
    stopped_at = training_loop(run, start_step, end_step)
    return harness.run_outcome(run, end_step, stopped_at, compile_ms, graphs_before)


def plan(cfg):
    """``(parameter count, Schedule)`` of a config for ``--describe``: the model on the meta device, no data."""
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
    return n_params, Schedule(cfg)


def model_shapes(cfg):
    """``{name: shape}`` of the model's state_dict, built on the meta device (no memory): ``--resume`` checks it."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}


TRAINER = harness.Trainer(config=Config, presets=PRESETS, operational=harness.OPERATIONAL,
                          shape_fields=("vocab_size", "n_layer", "n_head", "model_dim", "mlp_ratio"),
                          train=train, plan=plan, flex_attention=lambda cfg: cfg.doc_mask or windowed(cfg), model_shapes=model_shapes)
OPERATIONAL, RUN_DEFINING = TRAINER.operational, TRAINER.run_defining
parse_config, config_to_argv, main = TRAINER.parse_config, TRAINER.config_to_argv, TRAINER.main  # harness.py's CLI


if __name__ == "__main__":
    sys.exit(main())
