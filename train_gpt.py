"""Train a GPT on FineWeb (GPT-2 tokens) to 3.28 val loss, fast: Aurora + Token-Superposition Training.

Read top to bottom, this file is the speedrun: config and the stage table, data, model, TST,
optimizers, eval, and last the training loop. The CLI, checkpoints, the run log and signals are
in harness.py; the optimizer in aurora_opt.py; every log snapshots all three. One GPU (gradient
accumulation) or ``torchrun`` on many; CPU for tests and smoke runs. The exact math of TST and
Aurora is in docs/METHODS.md.

    python train_gpt.py --preset record_h200                                   # one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt.py --preset record_8xb200
    python train_gpt.py --preset cpu_smoke --train-files 'dir/*_train_*.bin' --val-files 'dir/*_val_*.bin'
"""
import dataclasses
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import harness
from aurora_opt import NS_COEFFICIENTS, Aurora, check_hparams
from harness import ConfigError, DataError, Runtime, load_shard, read_shard_header

# ----------------------------------------------------------------------------------------------
# Config and presets


def _f(default, help, **kw):
    """A config field: its default, its --help text, optional ``choices`` and bounds (``low``, ``high``:
    the value must be >= low, and < high; harness.validate_config checks them)."""
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    """Every hyperparameter of a run. Each field is a --kebab-case flag; presets override defaults."""
    # data
    train_files: str = _f("data/fineweb10B/fineweb_train_*.bin", "glob of train shards, read in sorted order")
    val_files: str = _f("data/fineweb10B/fineweb_val_*.bin", "glob of val shards")
    val_tokens: int = _f(10_485_760, "val loss is measured on the first this-many tokens of the val shards", low=1)
    # model
    vocab_size: int = _f(50304, "embedding/head rows: GPT-2's 50257 ids padded to a multiple of 128", low=1)
    n_layer: int = _f(12, "Transformer blocks", low=1)
    n_head: int = _f(6, "attention heads; head_dim = model_dim / n_head", low=1)
    model_dim: int = _f(768, "residual stream width", low=1)
    mlp_ratio: int = _f(4, "MLP hidden width = mlp_ratio * model_dim", low=1)
    seq_len: int = _f(1024, "latent positions per sequence (L)", low=1)
    logit_softcap: float = _f(30.0, "logits = c * tanh(logits / c) (c = 15 is the record's 30 * sigmoid(z / 7.5) "
                                    "up to a constant); 0 disables")
    rope_base: float = _f(10000.0, "rotary embedding base")
    doc_mask: bool = _f(False, "document-masked attention: a position attends only within its document (one starts "
                               "at each <|endoftext|>); in TST phase 1 a bag belongs to its last token's document")
    window: int = _f(0, "sliding attention window in latent positions: query q sees keys q-window+1..q "
                        "(0 = no window, full causal); with --window-start, the window of the last step")
    window_start: int = _f(0, "window at step 0, grown linearly to --window over the run in multiples of itself "
                              "(0 = --window at every step)")
    short_window_layers: str = _f("", "comma list of 0-based layers that attend over half the window")
    no_attn_layers: str = _f("", "comma list of 0-based layers without attention (MLP only)")
    attn_scale: float = _f(0.0, "attention logit scale (0 = 1/sqrt(head_dim))")
    merged_qkv: bool = _f(False, "q, k, v from one [3 * model_dim, model_dim] matmul (three matrices to the optimizer)")
    value_embeds: int = _f(0, "value-embedding tables k: table j is mixed into the attention values of layers j and "
                              "n_layer - k + j (0 = none)")
    unet: bool = _f(False, "U-net skips: block i's output is added, with a learned weight, to the input of block "
                           "n_layer - 1 - i, for i in the first half")
    x0_mix: bool = _f(False, "each block's input is a learned mix a * x + b * x0 of the residual stream and the "
                             "normed embedding x0 (a = 1, b = 0 at init)")
    # batch and steps
    batch_tokens: int = _f(524_288, "latent positions per optimizer step, whole global batch", low=1)
    micro_batch_seqs: int = _f(64, "sequences per process per forward/backward (grad accumulation fills the rest)",
                               low=1)
    num_iterations: int = _f(3000, "optimizer steps N", low=1)
    max_steps: int = _f(0, "stop after this many steps, schedule unchanged (0 = run all N); for tests and verify",
                        low=0)
    # TST (docs/METHODS.md §1)
    tst_bag_size: int = _f(4, "TST bag size s; 1 turns TST off")
    tst_frac: float = _f(0.3, "fraction r of the N steps spent in TST phase 1; switch at step round(r*N)")
    tst_mode: str = _f("full", "full: bag-mean in, MCE over next bag out; input: bag-mean in only; "
                               "output: MCE over next s tokens only", choices=("full", "input", "output"))
    # optimizers
    optimizer: str = _f("aurora", "optimizer of the 2-D block matrices (embedding/head always use Adam)",
                        choices=("aurora", "muon", "adamw"))
    matrix_lr: float = _f(0.05, "Aurora/Muon lr")
    matrix_wd: float = _f(0.025, "Aurora/Muon decoupled weight decay (scaled by lr)")
    momentum: float = _f(0.95, "Aurora/Muon momentum (after warmup)")
    momentum_start: float = _f(0.85, "momentum at step 0, warmed up linearly to --momentum", low=0, high=1)
    momentum_warmup_steps: int = _f(300, "steps of momentum warmup (0 = none)", low=0)
    nesterov: bool = _f(True, "Nesterov momentum for Aurora/Muon")
    ns: str = _f("polar_express", "Newton-Schulz variant", choices=tuple(NS_COEFFICIENTS))
    ns_dtype: str = _f("auto", "Newton-Schulz dtype; auto = bfloat16 on CUDA, float32 on a CPU (where bf16 matmuls "
                       "are emulated, dozens of times slower)", choices=("auto", "bfloat16", "float32"))
    pp_iterations: int = _f(2, "Aurora row-equalization rounds K (ignored by --optimizer muon, which uses 0)")
    pp_beta: float = _f(0.5, "Aurora row-scale exponent beta")
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
    bf16: bool = _f(None, "bfloat16 autocast; unset: on with CUDA, off on CPU (float32)")
    dist_timeout: int = _f(600, "seconds a collective may wait before the run fails (torchrun)")
    # checkpoints
    checkpoint_dir: str = _f("checkpoints", "where checkpoints go (<dir>/<run_id>/step_NNNNNN.pt)")
    save_every: int = _f(0, "checkpoint every this many steps (0 = never)", low=0)
    save_final: bool = _f(False, "checkpoint at the end of the run")
    save_on_interrupt: bool = _f(False, "on SIGINT/SIGTERM, checkpoint after the current step, then stop")
    resume: str = _f("", "checkpoint file to continue from, or 'auto' (highest step under --checkpoint-dir)")
    resume_force: bool = _f(False, "resume even if the checkpoint's config or data differs in what changes the run")

    def check(self, need):
        """The cross-field checks (``check_config``); ``harness.validate_config`` runs them."""
        check_config(self, need)


# The architecture of the modded-nanogpt record history, switched on by the presets (each element
# is a flag, off by default, so each can be ablated): record #21 (2025-01-26, 3.28 in 1,770 steps
# of 393,216 tokens) has document masks with sliding windows growing 128 -> 1,792 over the run
# (records #12-#13), half windows in the "short" layers, value embeddings (#9), U-net skips and
# the x0 mix, merged QKV, attention scale 0.12, no attention in layer 7, logit softcap 15, and an
# lr cooldown over the last 40% to 0.1x (record #19 onward).
ARCHITECTURE = dict(doc_mask=True, value_embeds=3, unet=True, x0_mix=True, merged_qkv=True, attn_scale=0.12,
                    logit_softcap=15.0, lr_floor=0.1, cooldown_frac=0.4)

# Record #21's model, batch and steps plus Aurora and TST. One flat 49,152-token sequence per
# micro-step: 8 micro-steps on one GPU, one each on eight -- the same run whatever the GPU count.
RECORD = dict(ARCHITECTURE, n_layer=12, model_dim=768, n_head=6, seq_len=48 * 1024, batch_tokens=393_216,
              micro_batch_seqs=1, num_iterations=1770, window_start=128, window=1792,
              short_window_layers="1,2,3,5,6,8,9,10", no_attn_layers="7", head_lr=0.22, embed_lr=0.6,
              tst_bag_size=4, tst_frac=0.3, tst_mode="full", optimizer="aurora", matrix_lr=0.05,
              matrix_wd=0.025, momentum=0.95, val_tokens=10_485_760, val_every=125,
              log_every=10)  # a train-loss line is the only host sync between val points
PRESETS = {
    "record_h200": RECORD,    # the record's name on one H200
    "record_8xb200": RECORD,  # ... and on 8 B200s: the same run
    # 2 CPU cores, under 5 minutes: a tiny model of the same architecture on the real-text sample.
    "cpu_smoke": dict(ARCHITECTURE, n_layer=4, n_head=4, model_dim=128, seq_len=128, batch_tokens=2048,
                      micro_batch_seqs=8, num_iterations=100, momentum_warmup_steps=0, value_embeds=1,
                      window_start=32, window=128, short_window_layers="1",
                      embed_lr=0.3, head_lr=0.02, val_tokens=16384, val_every=50),
}

# Fields that change where files go or how a run executes, not what it computes; every other
# field defines the run, and --resume refuses a checkpoint that differs in one of those.
OPERATIONAL = frozenset({"train_files", "val_files", "micro_batch_seqs", "max_steps", "val_every", "val_batch_seqs",
                         "log_every", "log_dir", "run_id", "device", "compile", "bf16", "dist_timeout",
                         "checkpoint_dir", "save_every", "save_final", "save_on_interrupt", "resume", "resume_force"})


# ----------------------------------------------------------------------------------------------
# The stage table: every per-step quantity of a run, in one place. A stage is a run of steps that
# share one graph shape (TST phase, bag size, mode) and tokens per step; each step's row adds
# the ramps (lr scale, momentum, attention windows) and the FLOPs they imply. The loop,
# warm-up (one graph per distinct shape), --describe, the token counts and run.sh read it.

@dataclass(frozen=True)
class Stage:
    """Optimizer steps [start, end) of one graph shape: TST ``phase`` (1 = bags, 2 = next-token),
    ``bag_size`` s and ``mode`` of its objective, ``batch_tokens`` latent positions per step."""
    start: int
    end: int
    phase: int
    bag_size: int
    mode: str
    batch_tokens: int

    def raw_tokens(self, seq_len):
        """Raw text tokens a step of this stage reads (TST bags read s times the positions)."""
        return self.batch_tokens // seq_len * sequence_layout(self.mode, self.bag_size, seq_len)[1]


@dataclass(frozen=True)
class StepRow:
    """One optimizer step's schedule: its stage and ramps (``window`` = (long, short) latent positions)."""
    stage: Stage
    lr_scale: float
    momentum: float
    window: tuple
    flops_per_position: float


def stages(cfg):
    """The stages of a run, in order, covering steps [0, N): TST phase 1 for the first round(r N)
    steps (``--tst-bag-size``, ``--tst-mode``; none when r N = 0), then next-token training.

    A bag-size schedule (e.g. s = 8, then 4, then next-token) is more rows here; the loader's
    layout, warm-up graphs, token counts and --describe follow from the table."""
    switch, N = tst_switch_step(cfg), cfg.num_iterations
    rows = [Stage(0, switch, 1, cfg.tst_bag_size, cfg.tst_mode, cfg.batch_tokens)] if switch else []
    return rows + ([Stage(switch, N, 2, 1, "full", cfg.batch_tokens)] if switch < N else [])


class Schedule:
    """The stage table of a config: ``rows[step]`` for steps 0..N (row N: the final validation's windows)."""

    def __init__(self, cfg):
        self.stages = stages(cfg)
        self.rows = []
        for step in range(cfg.num_iterations + 1):
            stage = next((s for s in self.stages if s.start <= step < s.end), self.stages[-1])
            window = window_at(step, cfg)
            self.rows.append(StepRow(stage, lr_scale(step, cfg), momentum_at(step, cfg), window,
                                     model_flops_per_position(cfg, step)))

    def __getitem__(self, step):
        return self.rows[step]

    def graphs(self):
        """Distinct ``(bag_size, mode)`` objectives of the stages, in order: one compiled graph each."""
        return list(dict.fromkeys((s.bag_size, s.mode) for s in self.stages))


def train_tokens_needed(cfg):
    """Raw train tokens a whole run reads (a TST stage reads s times more per step), labels included."""
    run_stages = stages(cfg)
    total = sum((st.end - st.start) * st.raw_tokens(cfg.seq_len) for st in run_stages)
    return total + max(cfg.tst_bag_size, *(st.bag_size for st in run_stages)) * cfg.seq_len  # last labels


def tst_switch_step(cfg):
    """Step at which phase 2 (plain next-token training) starts: round(r * N) (0 = no phase 1).
    With ``--tst-bag-size 1`` phase 1 is next-token training: a run repeats one without TST bit for bit."""
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
    """Aurora/Muon momentum: linear from --momentum-start to --momentum over the warmup steps."""
    if cfg.momentum_warmup_steps == 0:
        return cfg.momentum
    frac = min(step / cfg.momentum_warmup_steps, 1.0)
    return (1 - frac) * cfg.momentum_start + frac * cfg.momentum


def window_at(step, cfg):
    """``(long, short)`` attention windows in latent positions at optimizer ``step`` (0 = no window).

    With ``--window-start w0`` the long window grows linearly from w0 at step 0 to ``--window`` at
    step N, rounded up to a multiple of w0 (record #13's window warmup; record #21: 128 to 1,792 in
    blocks of 128), else it is ``--window``. ``--short-window-layers`` see half of it (at least 1).
    """
    w, w0, N = cfg.window, cfg.window_start, cfg.num_iterations
    if w == 0:
        return 0, 0
    if w0:
        grown = w0 * N + (w - w0) * min(step, N)  # w0 + (w - w0) * step / N, times N: exact integers
        w = min(w, w0 * -(-grown // (w0 * N)))
    return w, max(w // 2, 1)


# ----------------------------------------------------------------------------------------------
# Model: a GPT (RMSNorm, RoPE, QK-norm, ReLU^2 MLP, untied head, soft-capped logits) with the record
# history's elements behind flags: document masks and sliding windows, value embeddings, U-net skips,
# the x0 mix, merged QKV, the attention scale, layers without attention (see ARCHITECTURE)

def rms_norm(x):
    """Parameter-free RMSNorm over the last dim."""
    return F.rms_norm(x, (x.size(-1),))


def upcast(x):
    """x in float32, or float64 if it already is (so float64 reference runs stay float64)."""
    return x if x.dtype == torch.float64 else x.float()


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864) on latent positions 0..L-1."""

    def __init__(self, head_dim, max_len, base):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [L, head_dim/2]
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def forward(self, x):
        """x: [B, L, H, head_dim] -> same shape and dtype, rotated."""
        L = x.size(1)
        cos, sin = self.cos[:, :L], self.sin[:, :L]
        x1, x2 = upcast(x).chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


# Attention masks: causal, optionally within a document and within a sliding window. Both come
# from the modded-nanogpt record history: record #12 (2024-11-19, "FlexAttention": 64K-token
# flat sequences, document masks, a sliding window) and #13 (2024-11-24, window warmup). One
# mask definition, ``mask_mod``, serves both paths: FlexAttention's block mask on CUDA, and on
# CPU (no FlexAttention backward there) the same mask as a boolean matrix for SDPA.

def document_ids(tokens):
    """Document index of every position: the number of ``<|endoftext|>`` tokens at or before it.

    Args:
        tokens: int64 ``[..., T]`` (e.g. ``[T]`` or ``[B, T]``). Each document starts *with*
            its EOT (50256), so the EOT belongs to the document it opens.

    Returns:
        int64 ``[..., T]``, non-decreasing along the last dim; equal ids = same document.
    """
    return (tokens == EOT_TOKEN).cumsum(dim=-1)


def latent_document_ids(inputs):
    """Document of each latent position of model inputs ``[B, L, k]`` -> int64 ``[B, L]``.

    k = 1 (plain tokens): the token's document. k = s (TST phase-1 bags): the document of the
    bag's *last* token, counted over the raw tokens, so an EOT anywhere in a bag starts the new
    document at that bag. Windows count latent positions, so attention cost per position is
    the same in both phases (docs/METHODS.md, TST and attention masks).
    """
    B, L, k = inputs.shape
    return document_ids(inputs.reshape(B, L * k)).view(B, L, k)[..., -1]


def mask_mod(doc_ids, window):
    """The mask as a FlexAttention ``mask_mod(b, h, q, k) -> bool``: True where query q may attend key k.

    Allowed: ``k <= q`` and ``doc_ids[b, q] == doc_ids[b, k]`` and ``q - k < window``.
    ``doc_ids`` int64 ``[B, T]``; ``window`` an int (0 = no window) or an int64 0-d tensor (a
    window, read on the device: a window schedule changes no graph). Index arguments are int
    tensors that broadcast (FlexAttention calls it on scalars, ``attention_mask`` on grids).
    """
    windowed = torch.is_tensor(window) or window > 0

    def allowed(b, h, q, k):
        ok = (k <= q) & (doc_ids[b, q] == doc_ids[b, k])
        return ok & (q - k < window) if windowed else ok
    return allowed


def attention_mask(doc_ids, window):
    """``mask_mod`` materialized: bool ``[T, T]`` for doc_ids ``[T]``, ``[B, T, T]`` for ``[B, T]``.

    ``mask[..., q, k]`` is True where query q may attend key k (``k <= q``, same document,
    ``q - k < window``; ``window`` 0 = no window). Every row allows at least its diagonal.
    """
    ids = doc_ids if doc_ids.ndim == 2 else doc_ids[None]
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device)
    batch = torch.arange(B, device=ids.device)[:, None, None]
    mask = mask_mod(ids, window)(batch, None, pos[:, None], pos[None, :])
    return mask if doc_ids.ndim == 2 else mask[0]


def build_attention_mask(doc_ids, window, flex, block_size=128):
    """The mask one forward shares across layers, for ``attend``.

    Args:
        doc_ids: int64 ``[B, T]`` (``latent_document_ids``).
        window: latent positions a query sees (0 = no window).
        flex: True: a FlexAttention ``BlockMask`` (CUDA; built inside the compiled graph);
            False: bool ``[B, 1, T, T]`` for SDPA (broadcast over heads).
        block_size: the BlockMask's tile (FlexAttention's default 128; smaller in tests).
    """
    if flex:
        B, T = doc_ids.shape
        return create_block_mask(mask_mod(doc_ids, window), B, None, T, T, device=doc_ids.device,
                                 BLOCK_SIZE=block_size)
    return attention_mask(doc_ids, window)[:, None]


def attend(q, k, v, mask=None, scale=None):
    """Attention ``softmax(scale * q k^T) v`` under a mask; q, k, v ``[B, H, T, head_dim]``.

    ``scale`` None: ``1/sqrt(head_dim)``. ``mask`` None: plain causal SDPA (``is_causal=True``,
    the model without --doc-mask or --window); a ``BlockMask``: FlexAttention (q and k cast to
    v's dtype, bf16 under autocast); a bool tensor: SDPA with that mask. Returns
    ``[B, H, T, head_dim]`` in v's dtype.
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if isinstance(mask, BlockMask):
        return flex_attention(q.type_as(v), k.type_as(v), v, block_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def layer_set(text):
    """The layers a comma-list flag names ("1,2,5") as a frozenset of ints; "" = none.

    Raises:
        ValueError: an entry is not a non-negative integer (an empty one included), or repeats.
    """
    entries = [t.strip() for t in text.split(",")] if text.strip() else []
    if not all(t.isdigit() for t in entries):
        raise ValueError("give 0-based layer numbers separated by commas, e.g. 1,2,5 (no empty entry)")
    layers = frozenset(map(int, entries))
    if len(layers) != len(entries):
        raise ValueError("a layer is given twice")
    return layers


def _linear(d_in, d_out, zero=False):
    lin = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        if zero:  # output projections start at zero: each block starts as the identity
            lin.weight.zero_()
        else:
            bound = math.sqrt(3.0) * 0.5 / math.sqrt(d_in)  # std 0.5/sqrt(d_in)
            lin.weight.uniform_(-bound, bound)
    return lin


class CausalSelfAttention(nn.Module):
    """Multi-head attention with QK-norm and RoPE.

    ``merged_qkv``: q, k, v from one ``[3d, d]`` matmul of the three weights (record #21), which
    stay three matrices for the optimizer, each orthogonalized on its own as before.
    ``value_embed``: a value embedding ``ve`` is mixed into the values, ``v <- a v + b ve`` with
    learned scalars a = b = 0.5 at init (record #9, 2024-11-06; the "012 ... 012" layout of #21).
    """

    def __init__(self, cfg, value_embed=False):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.model_dim // cfg.n_head
        d = cfg.model_dim
        self.q, self.k, self.v = _linear(d, d), _linear(d, d), _linear(d, d)
        self.proj = _linear(d, d, zero=True)
        self.rotary = Rotary(self.head_dim, cfg.seq_len, cfg.rope_base)
        self.merged_qkv, self.scale = cfg.merged_qkv, cfg.attn_scale or None
        self.ve_mix = nn.Parameter(torch.full((2,), 0.5)) if value_embed else None

    def forward(self, x, mask=None, ve=None):
        """x ``[B, L, d]``; ``mask`` from ``build_attention_mask`` (None: plain causal); ``ve`` ``[B, L, d]``."""
        B, L, _ = x.shape
        shape = (B, L, self.n_head, self.head_dim)
        if self.merged_qkv:
            qkv = F.linear(x, torch.cat((self.q.weight, self.k.weight, self.v.weight)))
            q, k, v = (t.view(shape) for t in qkv.chunk(3, dim=-1))
        else:
            q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
        if ve is not None:  # 0-d scalars keep v's dtype (bf16 under autocast)
            v = self.ve_mix[0] * v + self.ve_mix[1] * ve.view(shape).type_as(v)
        q, k = self.rotary(rms_norm(q)), self.rotary(rms_norm(k))  # QK-norm, then RoPE
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = _linear(cfg.model_dim, cfg.mlp_ratio * cfg.model_dim)
        self.proj = _linear(cfg.mlp_ratio * cfg.model_dim, cfg.model_dim, zero=True)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``x0_mix``: the input is first replaced by ``a x + b x0`` (x0: the normed embedding; learned
    a = 1, b = 0 at init; modded-nanogpt record history, used in record #21). A layer in
    ``--no-attn-layers`` has no attention (record #21 drops layer 7's).
    """

    def __init__(self, cfg, layer, value_embed=False):
        super().__init__()
        has_attn = layer not in layer_set(cfg.no_attn_layers)
        self.attn = CausalSelfAttention(cfg, value_embed) if has_attn else None
        self.mlp = MLP(cfg)
        self.x0_mix = nn.Parameter(torch.tensor([1.0, 0.0])) if cfg.x0_mix else None

    def forward(self, x, x0=None, mask=None, ve=None):
        if self.x0_mix is not None:
            x = self.x0_mix[0] * x + self.x0_mix[1] * x0
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), mask, ve)
        return x + self.mlp(rms_norm(x))


def embed_tokens(table, inputs):
    """Inputs ``[B, L, k]`` through an ``nn.Embedding`` -> ``[B, L, d]``: the row (k = 1) or the bag's mean."""
    x = table(inputs)
    return bag_mean(x) if inputs.size(-1) > 1 else x.squeeze(2)


class GPT(nn.Module):
    """Decoder-only Transformer whose inputs may be bags of tokens (TST phase 1).

    ``forward(inputs, targets=None)``: ``inputs`` int64 ``[B, L, k]`` (k = 1 for plain tokens,
    k = s for bags, embedded as the float32 mean of the bag, value embeddings alike);
    ``targets`` int64 ``[B, L, j]`` with -100 = ignore. Returns float32 logits
    ``[B, L, vocab_size]`` without targets, else the float32 scalar *sum* over valid
    (position, label) pairs of ``logsumexp(z) - z[y]`` (the caller divides by the global number
    of valid labels, see ``accumulate_gradients``).

    Attention is plain causal unless ``--doc-mask`` or ``--window`` is set; then the layers
    share one mask (two with short-window layers) built from the inputs' documents
    (``latent_document_ids``) and the windows in the ``windows`` buffer (``set_window``): a
    FlexAttention block mask on CUDA (fused only when the model is compiled), a boolean matrix
    on CPU. ``--value-embeds k``: table j feeds layers j and n_layer - k + j. ``--unet``: block
    i's output is added, times a learned weight (1 at init), to the input of block
    n_layer - 1 - i, for the first n_layer // 2 blocks (record #21's U-net).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        n, k = cfg.n_layer, cfg.value_embeds
        self.ve_of_layer = {**{j: j for j in range(k)}, **{n - k + j: j for j in range(k)}}
        self.short = layer_set(cfg.short_window_layers)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.model_dim) for _ in range(k))
        self.blocks = nn.ModuleList(Block(cfg, i, i in self.ve_of_layer) for i in range(n))
        self.skip_weights = nn.Parameter(torch.ones(n // 2)) if cfg.unet else None
        self.lm_head = _linear(cfg.model_dim, cfg.vocab_size, zero=True)
        self._window = window_at(0, cfg)
        self.register_buffer("windows", torch.tensor(self._window), persistent=False)  # (long, short)

    def set_window(self, window):
        """Put ``(long, short)`` windows (a stage-table column) in the ``windows`` buffer (written only on a change)."""
        if window != self._window:
            self.windows[0], self.windows[1] = window
            self._window = window

    def masks_for(self, inputs):
        """``(long, short)`` masks of a forward on ``inputs`` ``[B, L, k]`` (``build_attention_mask``), or Nones."""
        cfg = self.cfg
        if not cfg.doc_mask and cfg.window == 0:
            return None, None
        if cfg.doc_mask:
            doc_ids = latent_document_ids(inputs)
        else:  # one document: only causality and the window
            doc_ids = torch.zeros(inputs.shape[:2], dtype=torch.int64, device=inputs.device)
        if cfg.window == 0:
            mask = build_attention_mask(doc_ids, 0, flex=inputs.is_cuda)
            return mask, mask
        long = build_attention_mask(doc_ids, self.windows[0], flex=inputs.is_cuda)
        short = build_attention_mask(doc_ids, self.windows[1], flex=inputs.is_cuda) if self.short else long
        return long, short

    def forward(self, inputs, targets=None):
        masks = self.masks_for(inputs)
        x = x0 = rms_norm(embed_tokens(self.embed, inputs))
        ves = [embed_tokens(table, inputs) for table in self.value_embeds]
        n, half, skips = len(self.blocks), len(self.blocks) // 2, []
        for i, block in enumerate(self.blocks):
            if self.skip_weights is not None and i >= n - half:  # the second half, in reverse order
                x = x + self.skip_weights[i - (n - half)] * skips.pop()
            ve = ves[self.ve_of_layer[i]] if i in self.ve_of_layer else None
            x = block(x, x0, masks[i in self.short], ve)
            if self.skip_weights is not None and i < half:
                skips.append(x)
        logits, c = self.lm_head(rms_norm(x)), self.cfg.logit_softcap
        if targets is not None:  # the softcap is applied inside the fused loss
            return mce_loss(logits, targets, reduction="sum", softcap=c)
        logits = upcast(logits)
        return c * torch.tanh(logits / c) if c > 0 else logits


def attended_keys(seq_len, window):
    """Mean number of keys a query attends in a causal sequence of ``seq_len`` under a window.

    ``(1/L) sum_{q<L} min(q + 1, w)`` with ``w = window`` (0: no window, w = L); e.g. (L + 1) / 2
    without a window. Document masks are not counted (they depend on the data).
    """
    L = seq_len
    w = min(window, L) if window else L
    return (w * (w + 1) // 2 + (L - w) * w) / L


def model_flops_per_position(cfg, step=0):
    """Training FLOPs per latent position at optimizer ``step``: ``6 * N_matmul + 12 d * keys``.

    ``N_matmul`` counts every weight used in a matmul (attention and MLP matrices of the layers
    that have them, and the LM head; embeddings and value embeddings are lookups). The second
    term is attention's QK^T and AV products, forward and backward (12 d FLOPs per attended
    key), summed over the layers with attention, each over the keys its queries actually attend
    (``attended_keys``: causality and the layer's window at ``step``; document masks ignored),
    as in PaLM's accounting (arXiv 2204.02311, appendix B) made exact for the mask. TST phase 1
    costs the same per latent position.
    """
    d, no_attn, short = cfg.model_dim, layer_set(cfg.no_attn_layers), layer_set(cfg.short_window_layers)
    attn_layers = [i for i in range(cfg.n_layer) if i not in no_attn]
    n_matmul = len(attn_layers) * 4 * d * d + cfg.n_layer * 2 * cfg.mlp_ratio * d * d + cfg.vocab_size * d
    long, half = window_at(step, cfg)
    keys = sum(attended_keys(cfg.seq_len, half if i in short else long) for i in attn_layers)
    return 6 * n_matmul + 12 * d * keys


# ----------------------------------------------------------------------------------------------
# Config checks across fields (each field's own bounds are in its metadata; harness.validate_config)

def check_config(cfg, need):
    """Raise, through ``need(ok, msg)`` (a ConfigError naming the flag), for values that cannot work together."""
    try:  # Aurora's own check, its arguments named as flags
        check_hparams(lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum, ns=cfg.ns,
                      pp_iterations=cfg.pp_iterations, pp_beta=cfg.pp_beta)
    except ValueError as e:
        flags = dict(lr="matrix_lr", weight_decay="matrix_wd", momentum="momentum", pp_iterations="pp_iterations",
                     pp_beta="pp_beta", ns="ns")
        name, rest = str(e).split(" ", 1)
        raise ConfigError(f"{harness.flag_of(flags.get(name, name))} {rest}") from None
    need(cfg.model_dim % cfg.n_head == 0 and (cfg.model_dim // cfg.n_head) % 2 == 0,
         f"--model-dim {cfg.model_dim} must be n_head ({cfg.n_head}) times an even head_dim")
    need(cfg.vocab_size >= 50257, f"--vocab-size {cfg.vocab_size} is below GPT-2's 50257 ids")
    need(cfg.tst_bag_size >= 1, f"--tst-bag-size must be >= 1 (got {cfg.tst_bag_size}); use 1 to turn TST off")
    need(0.0 <= cfg.tst_frac < 1.0, f"--tst-frac must be in [0, 1) (got {cfg.tst_frac}); 0 turns TST off")
    need(cfg.batch_tokens % cfg.seq_len == 0,
         f"--batch-tokens {cfg.batch_tokens} must be a multiple of --seq-len {cfg.seq_len}")
    need(0.0 <= cfg.cooldown_frac <= 1.0, f"--cooldown-frac must be in [0, 1] (got {cfg.cooldown_frac})")
    need(cfg.logit_softcap >= 0, f"--logit-softcap must be >= 0 (got {cfg.logit_softcap})")
    need(cfg.adam_eps > 0, f"--adam-eps must be > 0 (got {cfg.adam_eps})")
    need(cfg.rope_base > 1, f"--rope-base must be > 1 (got {cfg.rope_base})")
    need(cfg.window >= 0, f"--window must be >= 0 latent positions (got {cfg.window}); 0 turns the window off")
    check_architecture(cfg, need)
    need(cfg.warmup_steps <= cfg.num_iterations,
         f"--warmup-steps {cfg.warmup_steps} exceeds --num-iterations {cfg.num_iterations}")
    if cfg.tst_frac > 0:  # the phase-1 val objective needs at least one bag and its next bag
        need(cfg.val_tokens >= 2 * cfg.tst_bag_size,
             f"--tst-bag-size {cfg.tst_bag_size} needs --val-tokens >= {2 * cfg.tst_bag_size} "
             f"(got {cfg.val_tokens}); lower the bag size or raise --val-tokens")


def check_architecture(cfg, need):
    """The architecture flags' checks (part of ``check_config``); ``need(ok, msg)`` raises ConfigError."""
    need(cfg.window_start >= 0, f"--window-start must be >= 0 (got {cfg.window_start}); 0 = a fixed window")
    need(not cfg.window_start or 0 < cfg.window_start <= cfg.window,
         f"--window-start {cfg.window_start} needs --window >= {cfg.window_start} (got {cfg.window})")
    layers = {}
    for name in ("short_window_layers", "no_attn_layers"):
        text = getattr(cfg, name)
        try:
            layers[name] = layer_set(text)
        except ValueError as e:
            raise ConfigError(f"{harness.flag_of(name)} {text!r}: {e}") from None
        bad = sorted(i for i in layers[name] if not 0 <= i < cfg.n_layer)
        need(not bad, f"{harness.flag_of(name)}: there is no layer {bad[0] if bad else ''} "
                      f"(layers are 0..{cfg.n_layer - 1})")
    need(not layers["short_window_layers"] or cfg.window > 0, "--short-window-layers needs a --window")
    k, n = cfg.value_embeds, cfg.n_layer
    need(k >= 0, f"--value-embeds must be >= 0 (got {k}); 0 = none")
    need(2 * k <= n, f"--value-embeds {k}: the first k and last k layers must not overlap (k <= {n // 2})")
    clash = sorted((set(range(k)) | set(range(n - k, n))) & layers["no_attn_layers"])
    need(not clash, f"--value-embeds {k} feeds layer {clash[0] if clash else ''}, which --no-attn-layers leaves "
                    f"without attention; drop it from --no-attn-layers or lower --value-embeds")
    need(cfg.attn_scale >= 0, f"--attn-scale must be >= 0 (got {cfg.attn_scale}); 0 = 1/sqrt(head_dim)")
    need(0.0 <= cfg.lr_floor <= 1.0, f"--lr-floor must be in [0, 1] (got {cfg.lr_floor})")


# ----------------------------------------------------------------------------------------------
# Data: the train stream and its batches (shards: harness.read_shard_header)

EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document
GPT2_IDS = 50257   # ids 0..50256; the embedding's rows beyond (up to --vocab-size) are padding


class TokenStream:
    """The shards of a glob as one long token stream; ``read`` is random access.

    Each header is read once, here (a bad shard fails before training starts); every read
    checks its ids are below ``vocab_size`` (a shard from another tokenizer fails naming the
    file, not deep inside the embedding). ``wrap=True``: reads past the end start over.
    """

    def __init__(self, files, wrap=False, vocab_size=None):
        self.files = list(files)
        self.sizes = [read_shard_header(f) for f in self.files]  # tokens per file
        self.shards = [load_shard(f, n) for f, n in zip(self.files, self.sizes)]
        self.offsets = np.cumsum([0] + self.sizes)
        self.total = int(self.offsets[-1])
        self.wrap, self.vocab_size = wrap, vocab_size
        if self.total == 0:
            raise DataError(f"{', '.join(self.files)}: the shards hold no tokens; tokenize some text into them "
                            f"(data/tokenize_text.py) or point the glob at other shards")

    def locate(self, pos):
        """(file index, token offset in it) of stream position ``pos``."""
        pos %= self.total
        i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
        return i, pos - int(self.offsets[i])

    def read(self, start, n):
        """int64 numpy array of the n tokens from stream position ``start``. Raises DataError past the end."""
        if not self.wrap and start + n > self.total:
            raise DataError(f"asked for tokens [{start}, {start + n}) but the shards hold {self.total} "
                            f"({', '.join(os.path.basename(f) for f in self.files[:3])}...); add shards")
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            i, lo = self.locate(start + done)
            take = min(n - done, self.sizes[i] - lo)
            out[done:done + take] = self.shards[i][lo:lo + take]
            done += take
        if self.vocab_size is not None and n and out.max() >= self.vocab_size:
            bad = int(np.argmax(out >= self.vocab_size))
            i, offset = self.locate(start + bad)
            raise DataError(f"{self.files[i]}: token id {out[bad]} at token {offset} is >= {self.vocab_size}; "
                            f"not GPT-2 BPE ids: re-tokenize with data/tokenize_text.py")
        return out


def sequence_layout(mode, bag_size, seq_len):
    """Raw tokens per sequence and the stream advance per sequence, for a phase.

    Returns ``(seq_tokens, advance)``: plain next-token (``bag_size == 1``) needs ``L + 1``
    tokens and advances ``L``; TST ``full``/``input`` need ``(L + 1) * s`` (the last latent
    position's labels are the next bag) and advance ``L * s``; ``output`` needs ``L + s``
    and advances ``L``. Every token of the stream is an input exactly once.
    """
    s, L = bag_size, seq_len
    if s == 1:
        return L + 1, L
    if mode in ("full", "input"):
        return (L + 1) * s, L * s
    if mode == "output":
        return L + s, L
    raise ValueError(f"unknown TST mode {mode!r}")


class TrainLoader:
    """Sequential train batches over a TokenStream; each (rank, micro-step) gets its own slice.

    A global batch is ``global_seqs`` sequences cut from the stream at ``position``; the chunk
    of ``micro_seqs`` sequences number ``rank * accum + micro`` goes to that rank and
    micro-step, so one process with accumulation and many processes see the same batch.
    ``position`` (tokens consumed) is all the state there is; it is saved in checkpoints.
    ``wrapped`` tells whether the last batch read past the end of the stream (a new epoch).
    """

    def __init__(self, stream, global_seqs, micro_seqs, rank, world):
        self.stream, self.global_seqs, self.micro_seqs = stream, global_seqs, micro_seqs
        self.rank, self.world = rank, world
        self.position, self.wrapped = 0, False

    def next_batch(self, seq_tokens, advance, global_seqs=None):
        """This rank's micro-batches of one step: a list of ``accum`` int64 ``[micro_seqs, seq_tokens]``.

        ``global_seqs``: the step's sequences (its stage's tokens per step; None = the constructor's).
        """
        global_seqs = global_seqs or self.global_seqs
        accum = global_seqs // (self.micro_seqs * self.world)
        micro = []
        for m in range(accum):
            first = (self.rank * accum + m) * self.micro_seqs
            n = (self.micro_seqs - 1) * advance + seq_tokens
            flat = torch.from_numpy(self.stream.read(self.position + first * advance, n))
            micro.append(flat.unfold(0, seq_tokens, advance))
        epoch = self.position // self.stream.total
        self.position += global_seqs * advance
        self.wrapped = (self.position - 1) // self.stream.total > epoch
        return micro


def open_data(cfg, data):
    """(train TokenStream that wraps, val TokenStream) over the files of ``find_data``. Raises DataError."""
    ids = min(cfg.vocab_size, GPT2_IDS)  # padding rows are never a token
    return (TokenStream([f for f, _ in data["train"]], wrap=True, vocab_size=ids),
            TokenStream([f for f, _ in data["val"]], vocab_size=ids))


# ----------------------------------------------------------------------------------------------
# Token-Superposition Training (Peng, Gigant, Quesnelle 2026, arXiv 2605.06546; docs/METHODS.md §1)

IGNORE_INDEX = -100


def make_tst_batch(tokens, bag_size):
    """Cut sequences into bags and next-bag targets.

    Args:
        tokens: int64 ``[B, (L + 1) * s]``.
        bag_size: s >= 1.

    Returns:
        ``(bags, targets)``, both int64 ``[B, L, s]`` views of ``tokens``:
        ``bags[b, i] = tokens[b, i*s:(i+1)*s]``, ``targets[b, i] = tokens[b, (i+1)*s:(i+2)*s]``.

    Raises:
        ValueError: the length is not a multiple of s, or holds fewer than 2 bags.
    """
    B, n = tokens.shape
    s = bag_size
    if s < 1 or n % s or n // s < 2:
        raise ValueError(f"make_tst_batch: length {n} is not (L+1)*s with L >= 1 for s={s}")
    t = tokens.view(B, n // s, s)
    return t[:, :-1], t[:, 1:]


def make_batch(tokens, mode, bag_size):
    """Model inputs and targets of one phase from raw sequences (see ``sequence_layout``).

    ``tokens`` int64 ``[B, seq_tokens]`` -> ``(inputs [B, L, k], targets [B, L, j])``:
    plain (s = 1): k = j = 1; ``full``: k = j = s; ``input``: k = s, j = 1 (the first token of
    the next bag); ``output``: k = 1, j = s (position t predicts tokens t+1..t+s).
    """
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


class _MCELossSum(torch.autograd.Function):
    """Sum over valid (position, label) pairs of ``logsumexp(z) - z[y]``, with a fused backward.

    ``z = c * tanh(x / c)`` for a softcap ``c > 0``, else ``z = x``. The backward writes one
    ``[N, V]`` tensor, ``c_i * softmax(z_i)`` minus 1 at each valid label (``c_i`` = valid labels
    of position i), times ``1 - tanh^2`` under a softcap, instead of autograd's separate
    logsumexp, gather and tanh gradients: the memory of plain cross-entropy for any s, and
    fewer passes over the ``[N, V]`` logits (they dominate a small model's step on a CPU).
    """

    @staticmethod
    def forward(ctx, logits, targets, softcap):
        valid = targets != IGNORE_INDEX
        index = targets.clamp_min(0)
        tanh = logits.div(softcap).tanh_() if softcap else None     # kept for the backward
        z = tanh * softcap if softcap else logits
        lse = torch.logsumexp(z, dim=-1, keepdim=True)               # [N, 1]
        picked = z.gather(-1, index)                                 # [N, s]
        ctx.softcap = softcap
        ctx.save_for_backward(tanh if softcap else logits, lse, index, valid)
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        saved, lse, index, valid = ctx.saved_tensors
        c = ctx.softcap
        n_valid = valid.sum(dim=-1, keepdim=True).to(saved.dtype)    # [N, 1]
        g = saved.mul(c) if c else saved.clone()                     # z, then the gradient, in place
        g.sub_(lse).exp_().mul_(n_valid * grad)
        g.scatter_add_(-1, index, valid.to(saved.dtype) * -grad)     # repeated labels add up
        if c:
            g.addcmul_(g, saved.square(), value=-1.0)                # dz/dx = 1 - tanh(x / c)^2 (a 2nd [N, V])
        return g, None, None


def mce_loss(logits, targets, reduction="mean", softcap=0.0):
    """Multi-hot cross-entropy (MCE) of TST; plain cross-entropy when s = 1.

    Args:
        logits: float ``[..., V]`` (computed in float32; float64 stays float64).
        targets: int64 ``[..., s]``; ``-100`` marks a label to ignore. Repeated ids count each time.
        reduction: ``"mean"`` (over valid (position, label) pairs; 0 if none) or ``"sum"``.
        softcap: c > 0 scores ``z = c * tanh(logits / c)`` (inside the fused loss); 0 = no cap.

    Returns:
        float32 scalar (float64 for float64 logits): the mean (or sum) of ``logsumexp(z) - z[y]``
        over valid pairs. Per position with all s labels this is ``lse(z) - (1/s) sum_k z[y_k]`` (averaged), whose
        gradient in z is ``softmax(z) - (1/s) sum_k onehot(y_k)``. One logsumexp per position and
        an s-wide gather: no ``[..., s, V]`` tensor is ever built, forward or backward.

    Raises:
        ValueError: unknown reduction, a softcap that is not a finite number >= 0, or
            logits/targets leading shapes differ.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not (isinstance(softcap, (int, float)) and 0 <= softcap < math.inf):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = no cap), got {softcap!r}")
    if logits.shape[:-1] != targets.shape[:-1]:
        raise ValueError(f"mce_loss: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         f"differ in their leading dims")
    V, s = logits.size(-1), targets.size(-1)
    total = _MCELossSum.apply(upcast(logits).reshape(-1, V), targets.reshape(-1, s), float(softcap))
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().clamp_min(1)


def next_micro_batches(loader, stage, seq_len, rt):
    """This rank's ``[(inputs, targets)]`` for a step of ``stage`` (its layout and batch), on the device.

    Returns ``(micro_batches, raw_tokens)``: ``raw_tokens`` is what the whole step read from the stream.
    """
    s, mode, global_seqs = stage.bag_size, stage.mode, stage.batch_tokens // seq_len
    seq_tokens, advance = sequence_layout(mode, s, seq_len)
    micro = [make_batch(rt.to_device(t), mode, s) for t in loader.next_batch(seq_tokens, advance, global_seqs)]
    return micro, global_seqs * advance


# ----------------------------------------------------------------------------------------------
# Optimizers

def build_optimizers(model, cfg, compile=False):
    """Aurora/Muon (or AdamW) on the 2-D block matrices; Adam on the embeddings, the head and the scalars.

    ``compile`` compiles Aurora's direction computation (the run's resolved --compile).

    Returns a list of optimizers; every param group carries ``initial_lr`` for the schedule.
    """
    cuda = next(model.parameters()).is_cuda
    matrices = [(f"blocks.{n}", p) for n, p in model.blocks.named_parameters() if p.ndim == 2]
    embeds = [model.embed.weight] + [table.weight for table in model.value_embeds]
    scalars = [p for p in model.parameters() if p.ndim < 2]  # mixing and skip weights
    adam_groups = [dict(params=embeds, lr=cfg.embed_lr), dict(params=[model.lm_head.weight], lr=cfg.head_lr)]
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
    for opt in opts:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return opts


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


def accumulate_gradients(model, micro_batches, rt, stop=None):
    """Forward/backward over a step's micro-batches; gradients of the step's mean loss.

    Args:
        model: callable ``(inputs, targets) -> loss sum`` (the GPT, possibly compiled).
        micro_batches: list of ``(inputs [b, L, k], targets [b, L, j])`` of this process.
        rt: Runtime (device, process group).
        stop: the signal flag (``harness.should_stop``), checked between micro-batches.

    Returns:
        float32 scalar tensor: the step loss, the mean over *every* valid (position, label)
        pair of the global batch (all micro-batches, all ranks) -- not a mean of per-micro-
        batch means. The gradient in ``.grad`` is that loss's gradient, summed over ranks.
    """
    n_valid = torch.zeros((), device=rt.device)
    for _, targets in micro_batches:
        n_valid += (targets != IGNORE_INDEX).sum()
    n_valid = all_reduce_sum(n_valid, rt).clamp_min(1)
    total = torch.zeros((), device=rt.device)
    for inputs, targets in micro_batches:
        with rt.autocast():
            loss_sum = model(inputs, targets)
        (loss_sum / n_valid).backward()
        total += loss_sum.detach()
        harness.should_stop(stop)  # a safe point: raises on a signal unless the step must finish to be saved
    if rt.distributed:
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters() if p.grad is not None]
        for w in works:
            w.wait()
    return all_reduce_sum(total, rt) / n_valid


# ----------------------------------------------------------------------------------------------
# Eval: the metric is next-token cross-entropy over the first --val-tokens tokens of the val shards

class ValData:
    """The first ``n_tokens`` tokens of the val shards (+1 for the last label), held in memory.

    Raises:
        DataError: the val shards hold fewer than ``n_tokens + 1`` tokens.
    """

    def __init__(self, stream, n_tokens):
        if stream.total < n_tokens + 1:
            raise DataError(f"--val-tokens {n_tokens}: the val shards ({', '.join(stream.files)}) hold only "
                            f"{stream.total} tokens (need {n_tokens} + 1 for the last label); "
                            f"lower --val-tokens or add val shards")
        self.n_tokens = n_tokens
        self.tokens = torch.from_numpy(stream.read(0, n_tokens + 1))

    def batches(self, mode, bag_size, seq_len, batch_seqs, rt):
        """This rank's val batches for a phase objective, all ``[batch_seqs, ...]`` (fixed shapes).

        Label positions past token ``n_tokens`` (and padding sequences) get -100, so the mean
        over valid labels is exactly the mean over the first ``n_tokens`` next-token labels.
        """
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


def val_batch_seqs(cfg):
    return cfg.val_batch_seqs or cfg.micro_batch_seqs


@torch.no_grad()
def evaluate(model, val, mode, bag_size, cfg, rt, stop=None):
    """Mean loss over the val tokens for a phase objective (s = 1: the next-token val loss metric).

    A signal (``stop``) ends the loop between batches (a partial mean: the caller drops it).
    """
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    count = torch.zeros((), device=rt.device, dtype=torch.float64)
    for inputs, targets in val.batches(mode, bag_size, cfg.seq_len, val_batch_seqs(cfg), rt):
        if harness.should_stop(stop):  # every rank still meets the all-reduces below
            break
        inputs, targets = rt.to_device(inputs), rt.to_device(targets)
        with rt.autocast():
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


class Clock:
    """train_time: the device is synchronized before each reading; pauses (val, logs, checkpoints) excluded."""

    def __init__(self, rt, progress):
        self.rt, self.progress, self.t0 = rt, progress, None

    def start(self):
        self.rt.sync()
        self.t0 = time.perf_counter()

    @contextmanager
    def paused(self):
        self.rt.sync()
        self.progress.train_time_ms += 1000 * (time.perf_counter() - self.t0)
        yield
        self.start()


class NanGuard:
    """The first step whose loss was not finite, kept on the device: no host sync per step.

    ``check`` (one sync) runs at every logged line and before every checkpoint write.
    """

    def __init__(self, device, lr_flags):
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)
        self.lr_flags = lr_flags

    def update(self, loss, step):
        self.first_bad.masked_fill_((self.first_bad == 0) & ~torch.isfinite(loss), step)

    def check(self, model=None):
        """Raise FloatingPointError naming the first bad step (or, given ``model``, a non-finite weight)."""
        bad = int(self.first_bad)
        if bad:
            raise FloatingPointError(f"train loss is not finite since step {bad}; lower the lr "
                                     f"({self.lr_flags}) or check the data")
        if model is not None and not all(torch.isfinite(p).all() for p in model.parameters()):
            raise FloatingPointError(f"a weight is not finite; lower the lr ({self.lr_flags}); "
                                     f"no checkpoint was written")


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
    loader: TrainLoader
    val: ValData
    progress: Progress
    guard: NanGuard
    stop: dict
    data: dict

    def phase_at(self, step):
        """The TST phase (1 or 2) of optimizer ``step``: what a checkpoint records."""
        return self.schedule[step].stage.phase


def count_step(progress, row, raw_tokens):
    progress.raw_tokens += raw_tokens
    progress.positions += row.stage.batch_tokens
    progress.flops += row.flops_per_position * row.stage.batch_tokens


def validate(run, step):
    """Log the val loss at ``step`` (and the TST objective while in phase 1).

    Returns False when a signal cut it short (nothing logged; every rank agrees), else True.
    """
    cfg, rt = run.cfg, run.rt
    stage = run.schedule[max(step - 1, 0)].stage  # the stage that trained the model so far
    run.model.set_window(run.schedule[step].window)  # this step's windows (the full window at the end)
    loss = evaluate(run.net, run.val, "full", 1, cfg, rt, run.stop)
    if harness.stop_requested(run):
        return False
    if not math.isfinite(loss):
        raise FloatingPointError(f"val loss is {loss} at step {step}; lower the lr ({run.guard.lr_flags})")
    extra = {"phase": stage.phase}
    if stage.phase == 1:
        loss_tst = evaluate(run.net, run.val, stage.mode, stage.bag_size, cfg, rt, run.stop)
        if harness.stop_requested(run):
            return False
        extra["val_loss_tst"] = f"{loss_tst:.4f}"
    p = run.progress
    extra.update(tokens=p.raw_tokens, positions=p.positions, flops=f"{p.flops:.3e}")
    run.log.line(step_line(step, cfg, "val_loss", loss, p.train_time_ms, extra))
    run.log.update(final_val_loss=loss, val_step=step)
    return True


def log_train_line(run, step, loss, scale):
    run.guard.check()
    value, p = loss.item(), run.progress
    run.log.summary.setdefault("train_losses", []).append([step, value])
    run.log.line(step_line(step, run.cfg, "train_loss", value, p.train_time_ms, dict(
        phase=run.phase_at(step - 1), tokens=p.raw_tokens, positions=p.positions,
        flops=f"{p.flops:.3e}", lr_scale=f"{scale:.4f}")))


def log_stage(run, step):
    """The line at the first step of a stage: ``tst_switch`` when TST ends, else ``stage``."""
    was, now = run.schedule[step - 1].stage, run.schedule[step].stage
    what = "tst_switch" if (was.phase, now.phase) == (1, 2) else "stage"
    into = "next-token" if now.phase == 2 else now.mode
    run.log.line(f"{what}: step {step}: phase {was.phase} -> {now.phase} (bag_size {was.bag_size} -> "
                 f"{now.bag_size}, mode {was.mode} -> {into}); same weights and optimizer state; "
                 f"tokens:{run.progress.raw_tokens}")


def log_wrap(run, step):
    stream = run.loader.stream
    run.log.line(f"data: the train stream ({stream.total} tokens) wrapped around during step {step}; from "
                 f"here on tokens are read again (epoch {(run.loader.position - 1) // stream.total + 1})")


def step_line(step, cfg, what, value, train_time_ms, extra):
    """``step:{n}/{N} {what}:{x:.4f} train_time:{ms}ms step_avg:{ms:.2f}ms k:v ...`` (modded-nanogpt shape)."""
    avg = train_time_ms / max(step, 1)
    fields_ = " ".join(f"{k}:{v}" for k, v in extra.items())
    return (f"step:{step}/{cfg.num_iterations} {what}:{value:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{avg:.2f}ms {fields_}").rstrip()


def log_model_line(run):
    cfg, rt = run.cfg, run.rt
    n_params = sum(p.numel() for p in run.model.parameters())
    tst = ", ".join(f"{st.mode} s={st.bag_size} for steps [{st.start}, {st.end})"
                    for st in run.schedule.stages if st.phase == 1) or "off"
    run.log.line(f"model: {n_params:,} parameters, {run.schedule[0].flops_per_position:,.0f} FLOPs per latent "
                 f"position at step 0; "
                 f"grad accumulation {rt.accum} x {cfg.micro_batch_seqs} seqs x {rt.world} processes; TST {tst}")


def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def warm_up(run):
    """Compile every graph the stage table implies (one per distinct objective, train and val) before the clock.

    Returns the warm-up time in ms (0 without --compile); reported, not counted in train_time.
    """
    cfg, rt = run.cfg, run.rt
    if not rt.compile:
        return 0.0
    t0 = time.perf_counter()
    graphs = list(dict.fromkeys(run.schedule.graphs() + [(1, "full")]))  # + the val metric's next-token
    for s, mode in graphs:
        seq_tokens, _ = sequence_layout(mode, s, cfg.seq_len)
        dummy = torch.zeros(cfg.micro_batch_seqs, seq_tokens, dtype=torch.int64)
        inputs, targets = make_batch(rt.to_device(dummy), mode, s)
        with rt.autocast():
            run.net(inputs, targets).backward()
        run.model.zero_grad(set_to_none=True)
        vi, vt = next(run.val.batches(mode, s, cfg.seq_len, val_batch_seqs(cfg), rt))
        with torch.no_grad(), rt.autocast():
            run.net(rt.to_device(vi), rt.to_device(vt))
        harness.should_stop(run.stop, can_save=False)  # a safe point between graphs: no step to save yet
    for opt in run.opts:
        if isinstance(opt, Aurora):
            opt.warmup()
    rt.sync()
    ms = 1000 * (time.perf_counter() - t0)
    run.log.line(f"compile: warm-up of {len(graphs)} phase graph(s) took {ms:.0f}ms (not in train_time)")
    return ms


def training_loop(run, start_step, end_step):
    """The speedrun itself: one optimizer step per iteration.

    Returns None, or the number of steps done when a signal stopped the run after a checkpoint.
    """
    cfg, rt, clock = run.cfg, run.rt, Clock(run.rt, run.progress)
    if start_step == 0 and not validate(run, 0):
        raise harness.StopRequested(f"interrupted by {run.stop['signal']} during the step-0 validation")
    clock.start()
    for step in range(start_step, end_step):
        row = run.schedule[step]  # every per-step quantity comes from the stage table
        if step == row.stage.start > 0:
            log_stage(run, step)
        micro, raw_tokens = next_micro_batches(run.loader, row.stage, cfg.seq_len, rt)
        if run.loader.wrapped:
            log_wrap(run, step + 1)
        scale = apply_schedule(run.opts, row)
        run.model.set_window(row.window)
        loss = accumulate_gradients(run.net, micro, rt, run.stop)
        for opt in run.opts:
            opt.step()
        run.model.zero_grad(set_to_none=True)
        run.guard.update(loss, step + 1)
        count_step(run.progress, row, raw_tokens)

        done = step + 1
        last, stopping = done == end_step, harness.stop_requested(run)
        if done % cfg.log_every == 0 or last or stopping:
            with clock.paused():
                log_train_line(run, done, loss, scale)
        val_now = (cfg.val_every and done % cfg.val_every == 0) or (last and done == cfg.num_iterations)
        save_now = (cfg.save_every and done % cfg.save_every == 0) or (last and cfg.save_final)
        if val_now or save_now or (stopping and not last):
            with clock.paused():
                if val_now and not validate(run, done):
                    stopping, last = True, False  # a signal during validation: stop here, val not logged
                if stopping and not last:
                    harness.save_on_stop(run, done)  # the status line first, then the checkpoint
                    return done
                if save_now:
                    harness.save(run, done)
    return None


def train(cfg, rt, log, data, preset=None, resume=None, stop=None):
    """The whole run after the start-up checks: data, model, warm-up, the loop, the summary.

    ``data`` is ``find_data``'s file list, ``resume`` ``prepare_resume``'s ``(state, path, diffs)``,
    ``stop`` the dict the signal handler fills (``{"signal": name}``). Returns ``(status, reason)``.
    """
    train_stream, val_stream = open_data(cfg, data)
    harness.log_run_header(log, cfg, rt, preset, resume, data, (train_stream, val_stream))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(rt.device)
    lr_flags = ("--adamw-lr" if cfg.optimizer == "adamw" else "--matrix-lr") + ", --embed-lr, --head-lr"
    run = Run(cfg, Schedule(cfg), rt, log, model, torch.compile(model, dynamic=False) if rt.compile else model,
              build_optimizers(model, cfg, compile=rt.compile),
              TrainLoader(train_stream, cfg.batch_tokens // cfg.seq_len, cfg.micro_batch_seqs, rt.rank, rt.world),
              ValData(val_stream, cfg.val_tokens), Progress(), NanGuard(rt.device, lr_flags),
              stop if stop is not None else {"signal": None}, data)
    start_step = harness.restore(run, *resume[:2]) if resume else 0
    log_model_line(run)
    compile_ms = warm_up(run)
    log.update(compile_time_ms=round(compile_ms))
    end_step = min(cfg.num_iterations, start_step + cfg.max_steps) if cfg.max_steps else cfg.num_iterations
    graphs_before = compiled_graphs() if rt.compile else 0
    stopped_at = training_loop(run, start_step, end_step)
    if stopped_at is not None:
        log.update(**dataclasses.asdict(run.progress), steps=stopped_at)
        return "interrupted", harness.interrupt_reason(run, stopped_at)
    if rt.compile:
        log.update(graphs_compiled_during_training=compiled_graphs() - graphs_before)
    harness.log_summary(run, end_step, compile_ms)
    if end_step < cfg.num_iterations:
        return "stopped_early", f"--max-steps {cfg.max_steps}"
    return "complete", None


def plan(cfg):
    """What a run would do, for ``--describe`` (``harness.Trainer.plan``): no data, no device.

    Lines for the parameter count (the model built on the meta device) and, per stage, its
    steps, latent positions, raw tokens (text read) and FLOPs per step; ``flops_total`` (model
    FLOPs of all N steps), ``tokens_total`` (raw train tokens read), ``steps``: all from the stage table.
    """
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
    table, N, L = Schedule(cfg), cfg.num_iterations, cfg.seq_len
    flops = [row.flops_per_position * row.stage.batch_tokens for row in table.rows[:N]]
    lines = [f"model: {n_params:,} parameters; {cfg.n_layer} layers x {cfg.model_dim}, {cfg.n_head} heads, "
             f"sequences of {L:,} latent positions, window {table[0].window[0]} -> {table[N].window[0]}"]
    for st in table.stages:
        what = f"TST {st.mode} s={st.bag_size}" if st.phase == 1 else "next-token"
        lines.append(f"phase {st.phase} ({what}): steps [{st.start}, {st.end}): {st.batch_tokens:,} positions and "
                     f"{st.raw_tokens(L):,} raw tokens per step, "
                     f"{min(flops[st.start:st.end]):.3e} - {max(flops[st.start:st.end]):.3e} FLOPs per step")
    tokens = sum((st.end - st.start) * st.raw_tokens(L) for st in table.stages)
    return dict(lines=lines, flops_total=sum(flops), tokens_total=tokens, steps=N)


TRAINER = harness.Trainer(config=Config, presets=PRESETS, operational=OPERATIONAL,
                          shape_fields=("vocab_size", "n_layer", "n_head", "model_dim", "mlp_ratio"),
                          train=train, plan=plan)
RUN_DEFINING = TRAINER.run_defining


def parse_config(argv=None):
    """``(Config, preset)`` from command-line words (``harness.parse_config``). Raises ConfigError."""
    return harness.parse_config(argv, TRAINER)


def config_to_argv(config):
    """Command-line words that reproduce a config (a Config or the dict logged as ``config:``)."""
    return harness.config_to_argv(config, Config)


def main(argv=None):
    """Run from command-line words (``harness.main``); returns the exit status."""
    return harness.main(argv, TRAINER)


if __name__ == "__main__":
    sys.exit(main())
