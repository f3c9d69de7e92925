"""Train a GPT on FineWeb (GPT-2 tokens) to 3.28 val loss, fast: Aurora + Token-Superposition Training.

One file, read top to bottom: config, data, model, TST, optimizers, schedule, eval,
checkpoints, logging, main. One GPU (gradient accumulation) or `torchrun` on many; CPU for
tests and smoke runs. The exact math of TST and Aurora is in docs/METHODS.md.

    python train_gpt.py --preset record_h200                                   # one GPU
    torchrun --standalone --nproc_per_node=8 train_gpt.py --preset record_8xb200
    python train_gpt.py --preset cpu_smoke --train-files 'dir/*_train_*.bin' --val-files 'dir/*_val_*.bin'
"""
import argparse
import dataclasses
import datetime
import glob
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from aurora_opt import NS_COEFFICIENTS, Aurora

# ----------------------------------------------------------------------------------------------
# Config


def _f(default, help, **kw):
    """A config field: its default, its --help text, optional argparse extras (choices)."""
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    """Every hyperparameter of a run. Each field is a --kebab-case flag; presets override defaults."""
    # data
    train_files: str = _f("data/fineweb10B/fineweb_train_*.bin", "glob of train shards, read in sorted order")
    val_files: str = _f("data/fineweb10B/fineweb_val_*.bin", "glob of val shards")
    val_tokens: int = _f(10_485_760, "val loss is measured on the first this-many tokens of the val shards")
    # model
    vocab_size: int = _f(50304, "embedding/head rows: GPT-2's 50257 ids padded to a multiple of 128")
    n_layer: int = _f(12, "Transformer blocks")
    n_head: int = _f(6, "attention heads; head_dim = model_dim / n_head")
    model_dim: int = _f(768, "residual stream width")
    mlp_ratio: int = _f(4, "MLP hidden width = mlp_ratio * model_dim")
    seq_len: int = _f(1024, "latent positions per sequence (L)")
    logit_softcap: float = _f(30.0, "logits = c * tanh(logits / c); 0 disables")
    rope_base: float = _f(10000.0, "rotary embedding base")
    # batch and steps
    batch_tokens: int = _f(524_288, "latent positions per optimizer step, whole global batch")
    micro_batch_seqs: int = _f(64, "sequences per process per forward/backward (grad accumulation fills the rest)")
    num_iterations: int = _f(3000, "optimizer steps N")
    max_steps: int = _f(0, "stop after this many steps, schedule unchanged (0 = run all N); for tests and verify")
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
    momentum_start: float = _f(0.85, "momentum at step 0, warmed up linearly to --momentum")
    momentum_warmup_steps: int = _f(300, "steps of momentum warmup (0 = none)")
    nesterov: bool = _f(True, "Nesterov momentum for Aurora/Muon")
    ns: str = _f("polar_express", "Newton-Schulz variant", choices=tuple(NS_COEFFICIENTS))
    pp_iterations: int = _f(2, "Aurora row-equalization rounds K (ignored by --optimizer muon, which uses 0)")
    pp_beta: float = _f(0.5, "Aurora row-scale exponent beta")
    adamw_lr: float = _f(0.0036, "lr of the block matrices with --optimizer adamw")
    adamw_wd: float = _f(0.0, "weight decay of the block matrices with --optimizer adamw")
    embed_lr: float = _f(0.6, "Adam lr of the token embedding")
    head_lr: float = _f(0.008, "Adam lr of the LM head")
    scalar_lr: float = _f(0.04, "Adam lr of vectors/scalars")
    adam_beta1: float = _f(0.8, "Adam beta1")
    adam_beta2: float = _f(0.95, "Adam beta2")
    adam_eps: float = _f(1e-10, "Adam eps")
    # schedule
    warmup_steps: int = _f(0, "linear lr warmup steps")
    cooldown_frac: float = _f(0.4, "fraction of steps at the end with lr decaying linearly to 0")
    # eval, logging, execution
    val_every: int = _f(125, "val every this many steps (0 = only at the start and end)")
    val_batch_seqs: int = _f(0, "val sequences per process per forward (0 = micro_batch_seqs)")
    log_every: int = _f(1, "train-loss line every this many steps")
    log_dir: str = _f("logs", "where <run_id>.txt and <run_id>.json go")
    run_id: str = _f("", "name of the run; unset: date, time and a random suffix")
    seed: int = _f(0, "seed of the weight init")
    device: str = _f("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    compile: bool = _f(None, "torch.compile the model and Aurora; unset: on with CUDA, off on CPU")
    bf16: bool = _f(None, "bfloat16 autocast; unset: on with CUDA, off on CPU (float32)")
    dist_timeout: int = _f(600, "seconds a collective may wait before the run fails (torchrun)")
    # checkpoints
    checkpoint_dir: str = _f("checkpoints", "where checkpoints go (<dir>/<run_id>/step_NNNNNN.pt)")
    save_every: int = _f(0, "checkpoint every this many steps (0 = never)")
    save_final: bool = _f(False, "checkpoint at the end of the run")
    save_on_interrupt: bool = _f(False, "on SIGINT/SIGTERM, checkpoint after the current step, then stop")
    resume: str = _f("", "checkpoint file to continue from, or 'auto' (newest under --checkpoint-dir)")
    resume_force: bool = _f(False, "resume even if the checkpoint's config differs in what changes the run")


# The known-good GPT-2-small recipe (3.28 in ~3,000 steps with a Muon-family optimizer) plus TST.
RECORD = dict(n_layer=12, model_dim=768, n_head=6, seq_len=1024, batch_tokens=524_288, num_iterations=3000,
              tst_bag_size=4, tst_frac=0.3, tst_mode="full", optimizer="aurora", matrix_lr=0.05, matrix_wd=0.025,
              momentum=0.95, val_tokens=10_485_760)
PRESETS = {
    # 1 GPU: 8 micro-steps of 64 x 1024 make the 524,288-position step.
    "record_h200": dict(RECORD, micro_batch_seqs=64),
    # 8 GPUs: one micro-step each, same global batch, same dynamics as record_h200.
    "record_8xb200": dict(RECORD, micro_batch_seqs=64),
    # 2 CPU cores, under 5 minutes: a tiny model on the real-text shards.
    "cpu_smoke": dict(n_layer=4, n_head=4, model_dim=128, seq_len=128, batch_tokens=2048,
                      micro_batch_seqs=8, num_iterations=120, momentum_warmup_steps=0,
                      embed_lr=0.3, head_lr=0.02, val_tokens=16384, val_every=40),
}

# Fields that change where files go or how a run executes, not what it computes; every other
# field defines the run, and --resume refuses a checkpoint that differs in one of those.
OPERATIONAL = {"train_files", "val_files", "micro_batch_seqs", "max_steps", "val_every", "val_batch_seqs",
               "log_every", "log_dir", "run_id", "device", "compile", "bf16", "dist_timeout", "checkpoint_dir",
               "save_every", "save_final", "save_on_interrupt", "resume", "resume_force"}
RUN_DEFINING = tuple(f.name for f in fields(Config) if f.name not in OPERATIONAL)


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


class DataError(ValueError):
    """A shard or glob that cannot be used; the message names the file and the fix."""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the default is "unset" (its help says what happens)."""

    def _get_help_string(self, action):
        if action.default in (None, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser():
    """argparse parser generated from Config: one --kebab-case flag per field, plus --preset."""
    p = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a GPT with Aurora + Token-Superposition Training. Every flag shows its default; "
                    "--preset sets several at once and explicit flags override it.",
        epilog="presets: " + "; ".join(f"{k}: " + ", ".join(f"{a}={b}" for a, b in v.items())
                                        for k, v in PRESETS.items()),
        formatter_class=_DefaultsFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="bundle of defaults")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kw = dict(default=f.default, help=f.metadata["help"])
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(flag, type=typ, choices=f.metadata.get("choices"), **kw)
    return p


def parse_config(argv=None):
    """Config from command-line words: dataclass defaults < --preset < explicit flags.

    Raises:
        ConfigError: a value that cannot work (names the flag).
    """
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.preset:
        parser.set_defaults(**PRESETS[known.preset])
    args, extra = parser.parse_known_args(argv)
    if extra and all(os.path.exists(a) for a in extra):
        raise ConfigError(f"unexpected file arguments ({extra[0]} ...): the shell expanded a glob; quote it, "
                          f"e.g. --train-files 'data/fineweb10B/fineweb_train_*.bin'")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    preset = args.preset
    cfg = Config(**{f.name: getattr(args, f.name) for f in fields(Config)})
    validate_config(cfg)
    return cfg, preset


def config_to_argv(config):
    """Command-line words that reproduce a config (a Config or the dict logged as ``config:``)."""
    values = dataclasses.asdict(config) if isinstance(config, Config) else dict(config)
    argv = []
    for f in fields(Config):
        if f.name not in values or values[f.name] is None:
            continue
        flag, value = "--" + f.name.replace("_", "-"), values[f.name]
        if f.type in (bool, "bool"):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def validate_config(cfg):
    """Raise ConfigError naming the flag for any value that cannot work."""
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    for name in ("n_layer", "n_head", "model_dim", "mlp_ratio", "seq_len", "batch_tokens",
                 "micro_batch_seqs", "num_iterations", "val_tokens", "vocab_size", "log_every"):
        need(getattr(cfg, name) >= 1, f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    for name in ("max_steps", "val_every", "val_batch_seqs", "save_every", "warmup_steps",
                 "momentum_warmup_steps"):
        need(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} must be >= 0 (got {getattr(cfg, name)})")
    need(cfg.model_dim % cfg.n_head == 0 and (cfg.model_dim // cfg.n_head) % 2 == 0,
         f"--model-dim {cfg.model_dim} must be n_head ({cfg.n_head}) times an even head_dim")
    need(cfg.vocab_size >= 50257, f"--vocab-size {cfg.vocab_size} is below GPT-2's 50257 ids")
    need(cfg.tst_bag_size >= 1, f"--tst-bag-size must be >= 1 (got {cfg.tst_bag_size}); use 1 to turn TST off")
    need(0.0 <= cfg.tst_frac < 1.0, f"--tst-frac must be in [0, 1) (got {cfg.tst_frac}); 0 turns TST off")
    need(cfg.batch_tokens % cfg.seq_len == 0,
         f"--batch-tokens {cfg.batch_tokens} must be a multiple of --seq-len {cfg.seq_len}")
    need(0.0 <= cfg.cooldown_frac <= 1.0, f"--cooldown-frac must be in [0, 1] (got {cfg.cooldown_frac})")
    need(cfg.logit_softcap >= 0, f"--logit-softcap must be >= 0 (got {cfg.logit_softcap})")
    need(cfg.dist_timeout >= 1, f"--dist-timeout must be >= 1 s (got {cfg.dist_timeout})")
    for name in ("matrix_lr", "matrix_wd", "adamw_lr", "adamw_wd", "embed_lr", "head_lr", "scalar_lr"):
        need(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} must be >= 0 (got {getattr(cfg, name)})")
    for name in ("momentum", "momentum_start", "adam_beta1", "adam_beta2"):
        need(0.0 <= getattr(cfg, name) < 1.0,
             f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(cfg, name)})")
    need(cfg.pp_iterations >= 0, f"--pp-iterations must be >= 0 (got {cfg.pp_iterations})")
    need(cfg.pp_beta > 0, f"--pp-beta must be > 0 (got {cfg.pp_beta})")
    need(cfg.adam_eps > 0, f"--adam-eps must be > 0 (got {cfg.adam_eps})")
    need(cfg.rope_base > 1, f"--rope-base must be > 1 (got {cfg.rope_base})")
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if isinstance(value, float):
            need(math.isfinite(value), f"--{f.name.replace('_', '-')} must be finite (got {value})")
    need(cfg.warmup_steps <= cfg.num_iterations,
         f"--warmup-steps {cfg.warmup_steps} exceeds --num-iterations {cfg.num_iterations}")
    if cfg.tst_frac > 0:  # the phase-1 val objective needs at least one bag and its next bag
        need(cfg.val_tokens >= 2 * cfg.tst_bag_size,
             f"--tst-bag-size {cfg.tst_bag_size} needs --val-tokens >= {2 * cfg.tst_bag_size} "
             f"(got {cfg.val_tokens}); lower the bag size or raise --val-tokens")
    need(cfg.run_id == "" or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.run_id) is not None,
         f"--run-id {cfg.run_id!r}: use letters, digits, '.', '_' and '-' only (it names files)")


# ----------------------------------------------------------------------------------------------
# Data: shards of 256 x int32 header + uint16 tokens (llm.c / modded-nanogpt format)

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document


def read_shard_header(path):
    """Validate a shard's header and size; return its number of tokens.

    Raises:
        DataError: missing file, short header, wrong magic or version, or a file size other
            than exactly ``1024 + 2 * n_tokens`` bytes. The message names the file and the fix.
    """
    redo = "re-download or re-tokenize it (data/cached_fineweb10B.py, data/tokenize.py)"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except OSError as e:  # missing, a directory, a symlink loop, unreadable
        raise DataError(f"{path}: cannot read shard ({e.strerror}); check the path, or {redo}") from None
    if header.size < HEADER_INTS:
        raise DataError(f"{path}: {size} bytes is shorter than the 1024-byte shard header; {redo}")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a token shard, {redo}")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION}); {redo}")
    n = int(header[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: file is {size} bytes but its header says {n} tokens "
                        f"({HEADER_BYTES + 2 * n} bytes); truncated or corrupt, {redo}")
    return n


def load_shard(path):
    """Memory-map a validated shard: uint16 numpy array of its tokens. Raises DataError."""
    n = read_shard_header(path)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))


def resolve_files(pattern, flag):
    """Sorted files matching a glob. Raises DataError naming the flag when nothing matches."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataError(f"{flag} {pattern!r}: no file matches; download shards with "
                        f"`python data/cached_fineweb10B.py` or point {flag} (or DATA_DIR for run.sh) at shards")
    return files


def fingerprint(path, n_bytes=1 << 20):
    """sha256 (16 hex) of a file's size, first and last MiB: fast, identifies a shard's contents."""
    h = hashlib.sha256(str(os.path.getsize(path)).encode())
    with open(path, "rb") as f:
        h.update(f.read(n_bytes))
        f.seek(max(0, os.path.getsize(path) - n_bytes))
        h.update(f.read(n_bytes))
    return h.hexdigest()[:16]


class TokenStream:
    """The shards of a glob as one long token stream; ``read`` is random access.

    All headers are validated at construction (a bad shard fails before training starts);
    every read checks its token ids are below ``vocab_size`` (a shard from another tokenizer
    fails naming the file, not deep inside the embedding). With ``wrap=True`` reads past the
    end continue from the start (another epoch).
    """

    def __init__(self, files, wrap=False, vocab_size=None):
        self.files = list(files)
        self.shards = [load_shard(f) for f in self.files]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.total = int(self.offsets[-1])
        self.wrap, self.vocab_size = wrap, vocab_size
        if self.total == 0:
            raise DataError(f"{', '.join(self.files)}: the shards hold no tokens; tokenize some text into them "
                            f"(data/tokenize.py) or point the glob at other shards")

    def locate(self, pos):
        """(file, token offset in it) of stream position ``pos``."""
        pos %= self.total
        i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
        return self.files[i], pos - int(self.offsets[i])

    def read(self, start, n):
        """int64 numpy array of the n tokens from stream position ``start``. Raises DataError past the end."""
        if not self.wrap and start + n > self.total:
            raise DataError(f"asked for tokens [{start}, {start + n}) but the shards hold {self.total} "
                            f"({', '.join(os.path.basename(f) for f in self.files[:3])}...); add shards")
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            pos = (start + done) % self.total
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            take = min(n - done, int(self.offsets[i + 1]) - pos)
            lo = pos - int(self.offsets[i])
            out[done:done + take] = self.shards[i][lo:lo + take]
            done += take
        if self.vocab_size is not None and n and out.max() >= self.vocab_size:
            bad = int(np.argmax(out >= self.vocab_size))
            path, offset = self.locate(start + bad)
            raise DataError(f"{path}: token id {out[bad]} at token {offset} is >= --vocab-size {self.vocab_size}; "
                            f"not GPT-2 BPE ids: re-tokenize with data/tokenize.py")
        return out


def sequence_layout(mode, bag_size, seq_len):
    """Raw tokens per sequence and the stream advance per sequence, for a phase.

    Returns ``(seq_tokens, advance)``: plain next-token (``bag_size == 1``) needs ``L + 1``
    tokens and advances ``L``; TST ``full``/``input`` need ``(L + 1) * s`` (the last latent
    position's labels are the next bag) and advance ``L * s``; ``output`` needs ``L + s``
    and advances ``L``. Consecutive sequences overlap only by their label tokens, so every
    token of the stream is an input exactly once.
    """
    s, L = bag_size, seq_len
    if s == 1:
        return L + 1, L
    if mode in ("full", "input"):
        return (L + 1) * s, L * s
    if mode == "output":
        return L + s, L
    raise ValueError(f"unknown TST mode {mode!r}")


def train_tokens_needed(cfg):
    """Raw train tokens a whole run reads (phase 1 reads s times more per step), labels included."""
    switch = tst_switch_step(cfg)
    seqs = cfg.batch_tokens // cfg.seq_len
    total = 0
    for steps, (_, s, mode) in ((switch, phase_of(0, cfg)), (cfg.num_iterations - switch, (2, 1, "full"))):
        seq_tokens, advance = sequence_layout(mode, s, cfg.seq_len)
        total += steps * seqs * advance
    return total + cfg.tst_bag_size * cfg.seq_len  # the last sequence's labels


class TrainLoader:
    """Sequential train batches over a TokenStream; each (rank, micro-step) gets its own slice.

    A global batch is ``global_seqs`` sequences cut from the stream at ``position``; the chunk
    of ``micro_seqs`` sequences number ``rank * accum + micro`` goes to that rank and
    micro-step, so one process with accumulation and many processes see the same batch.
    ``position`` (tokens consumed) is all the state there is; it is saved in checkpoints.
    """

    def __init__(self, stream, global_seqs, micro_seqs, rank, world):
        if global_seqs % (micro_seqs * world):
            raise ConfigError(f"--batch-tokens / --seq-len = {global_seqs} sequences is not a multiple of "
                              f"--micro-batch-seqs {micro_seqs} x world size {world}; change either")
        self.stream, self.global_seqs, self.micro_seqs = stream, global_seqs, micro_seqs
        self.rank, self.accum = rank, global_seqs // (micro_seqs * world)
        self.position = 0

    def next_batch(self, seq_tokens, advance):
        """This rank's micro-batches of one step: a list of ``accum`` int64 ``[micro_seqs, seq_tokens]``."""
        micro = []
        for m in range(self.accum):
            first = (self.rank * self.accum + m) * self.micro_seqs
            n = (self.micro_seqs - 1) * advance + seq_tokens
            flat = torch.from_numpy(self.stream.read(self.position + first * advance, n))
            micro.append(flat.unfold(0, seq_tokens, advance))
        self.position += self.global_seqs * advance
        return micro


# ----------------------------------------------------------------------------------------------
# Model: a plain GPT (RMSNorm, RoPE, QK-norm, causal SDPA, ReLU^2 MLP, untied head, soft-capped logits)

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
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.model_dim // cfg.n_head
        d = cfg.model_dim
        self.q, self.k, self.v = _linear(d, d), _linear(d, d), _linear(d, d)
        self.proj = _linear(d, d, zero=True)
        self.rotary = Rotary(self.head_dim, cfg.seq_len, cfg.rope_base)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.n_head, self.head_dim)
        k = self.k(x).view(B, L, self.n_head, self.head_dim)
        v = self.v(x).view(B, L, self.n_head, self.head_dim)
        q, k = self.rotary(rms_norm(q)), self.rotary(rms_norm(k))  # QK-norm, then RoPE
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = _linear(cfg.model_dim, cfg.mlp_ratio * cfg.model_dim)
        self.proj = _linear(cfg.mlp_ratio * cfg.model_dim, cfg.model_dim, zero=True)

    def forward(self, x):
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn, self.mlp = CausalSelfAttention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(rms_norm(x))
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    """Decoder-only Transformer whose inputs may be bags of tokens (TST phase 1).

    ``forward(inputs, targets=None)``: ``inputs`` int64 ``[B, L, k]`` (k = 1 for plain tokens,
    k = s for bags, embedded as the float32 mean of the bag); ``targets`` int64 ``[B, L, j]``
    with -100 = ignore. Returns float32 logits ``[B, L, vocab_size]`` without targets, else
    the float32 scalar *sum* over valid (position, label) pairs of ``logsumexp(z) - z[y]``
    (the caller divides by the global number of valid labels, see ``accumulate_gradients``).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.lm_head = _linear(cfg.model_dim, cfg.vocab_size, zero=True)

    def forward(self, inputs, targets=None):
        x = self.embed(inputs)  # [B, L, k, d]
        x = bag_mean(x) if inputs.size(-1) > 1 else x.squeeze(2)
        x = rms_norm(x)
        for block in self.blocks:
            x = block(x)
        logits = upcast(self.lm_head(rms_norm(x)))
        c = self.cfg.logit_softcap
        if c > 0:
            logits = c * torch.tanh(logits / c)
        if targets is None:
            return logits
        return mce_loss(logits, targets, reduction="sum")


def model_flops_per_position(cfg):
    """Training FLOPs per latent position: ``6 * N_matmul + 12 * n_layer * model_dim * seq_len``.

    ``N_matmul`` counts every weight used in a matmul (block matrices and LM head; the
    embedding is a lookup). The second term is attention's QK^T and AV products, forward and
    backward, counted over the full (not causally halved) L x L square, as in PaLM (arXiv
    2204.02311, appendix B) and nanoGPT. TST phase 1 costs the same per latent position.
    """
    d, L = cfg.model_dim, cfg.seq_len
    n_matmul = cfg.n_layer * (4 * d * d + 2 * cfg.mlp_ratio * d * d) + cfg.vocab_size * d
    return 6 * n_matmul + 12 * cfg.n_layer * d * L


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

    The backward writes one ``[N, V]`` tensor, ``c_i * softmax(z_i)`` minus 1 at each valid
    label (``c_i`` = valid labels of position i), instead of autograd's separate logsumexp and
    gather gradients: the same memory and time as plain cross-entropy, for any s.
    """

    @staticmethod
    def forward(ctx, logits, targets):
        valid = targets != IGNORE_INDEX
        index = targets.clamp_min(0)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)          # [N, 1]
        picked = logits.gather(-1, index)                            # [N, s]
        ctx.save_for_backward(logits, lse, index, valid)
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, index, valid = ctx.saved_tensors
        n_valid = valid.sum(dim=-1, keepdim=True).to(logits.dtype)   # [N, 1]
        g = torch.sub(logits, lse).exp_().mul_(n_valid * grad)   # in place: one [N, V] allocation
        g.scatter_add_(-1, index, valid.to(logits.dtype) * -grad)    # repeated labels add up
        return g, None


def mce_loss(logits, targets, reduction="mean"):
    """Multi-hot cross-entropy (MCE) of TST; plain cross-entropy when s = 1.

    Args:
        logits: float ``[..., V]``.
        targets: int64 ``[..., s]``; ``-100`` marks a label to ignore. Repeated ids count each time.
        reduction: ``"mean"`` (over valid (position, label) pairs; 0 if none) or ``"sum"``.

    Returns:
        float32 scalar: the mean (or sum) of ``logsumexp(z) - z[y]`` over valid pairs. Per
        position with all s labels this is ``lse(z) - (1/s) sum_k z[y_k]`` (averaged), whose
        gradient is ``softmax(z) - (1/s) sum_k onehot(y_k)``. One logsumexp per position and
        an s-wide gather: no ``[..., s, V]`` tensor is ever built, forward or backward.

    Raises:
        ValueError: unknown reduction, or logits/targets leading shapes differ.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.shape[:-1] != targets.shape[:-1]:
        raise ValueError(f"mce_loss: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         f"differ in their leading dims")
    V, s = logits.size(-1), targets.size(-1)
    total = _MCELossSum.apply(upcast(logits).reshape(-1, V), targets.reshape(-1, s))
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().clamp_min(1)


def tst_switch_step(cfg):
    """Step at which phase 2 (plain next-token training) starts: round(r * N) (0 = no phase 1).

    With ``--tst-bag-size 1`` phase 1 is plain next-token training through the TST code path,
    so a run with s = 1 repeats a run without TST bit for bit.
    """
    return int(round(cfg.tst_frac * cfg.num_iterations))


def phase_of(step, cfg):
    """(phase, bag size, mode) of an optimizer step: phase 1 (TST) before the switch, else 2."""
    if step < tst_switch_step(cfg):
        return 1, cfg.tst_bag_size, cfg.tst_mode
    return 2, 1, "full"


# ----------------------------------------------------------------------------------------------
# Optimizers

def build_optimizers(model, cfg, compile=False):
    """Aurora/Muon (or AdamW) on the 2-D block matrices; Adam on embedding, head, vectors/scalars.

    ``compile`` compiles Aurora's direction computation (the run's resolved --compile).

    Returns a list of optimizers; every param group carries ``initial_lr`` for the schedule.
    """
    cuda = next(model.parameters()).is_cuda
    block_named = [(f"blocks.{n}", p) for n, p in model.blocks.named_parameters()]
    matrices = [(n, p) for n, p in block_named if p.ndim == 2]
    scalars = [p for n, p in block_named if p.ndim < 2]
    adam_groups = [dict(params=[model.embed.weight], lr=cfg.embed_lr),
                   dict(params=[model.lm_head.weight], lr=cfg.head_lr)]
    if scalars:
        adam_groups.append(dict(params=scalars, lr=cfg.scalar_lr))
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    opts = [torch.optim.Adam(adam_groups, betas=betas, eps=cfg.adam_eps, fused=cuda)]
    if cfg.optimizer in ("aurora", "muon"):
        opts.append(Aurora([dict(params=[p for _, p in matrices], names=[n for n, _ in matrices])],
                           lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum,
                           nesterov=cfg.nesterov, ns=cfg.ns, pp_beta=cfg.pp_beta,
                           pp_iterations=cfg.pp_iterations if cfg.optimizer == "aurora" else 0,
                           compile=compile))
    else:
        opts.append(torch.optim.AdamW([p for _, p in matrices], lr=cfg.adamw_lr, betas=(0.9, 0.95),
                                      eps=1e-8, weight_decay=cfg.adamw_wd, fused=cuda))
    for opt in opts:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return opts


# ----------------------------------------------------------------------------------------------
# Schedule

def lr_scale(step, cfg):
    """lr multiplier at 0-based ``step``: linear warmup, flat, then linear decay to 0 at step N."""
    N = cfg.num_iterations
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    cooldown = cfg.cooldown_frac * N
    if cooldown > 0 and step >= N - cooldown:
        return max(0.0, (N - step) / cooldown)
    return 1.0


def momentum_at(step, cfg):
    """Aurora/Muon momentum: linear from --momentum-start to --momentum over the warmup steps."""
    if cfg.momentum_warmup_steps == 0:
        return cfg.momentum
    frac = min(step / cfg.momentum_warmup_steps, 1.0)
    return (1 - frac) * cfg.momentum_start + frac * cfg.momentum


def apply_schedule(opts, step, cfg):
    scale = lr_scale(step, cfg)
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * scale
            if isinstance(opt, Aurora):
                g["momentum"] = momentum_at(step, cfg)
    return scale


# ----------------------------------------------------------------------------------------------
# Runtime: devices, processes, one training step

@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    compile: bool
    bf16: bool = False

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world > 1

    def autocast(self):
        """bf16 autocast (default on CUDA), else plain float32 (exactly repeatable on CPU)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def to_device(self, t):
        """Host tensor to the device, contiguous (pinned and asynchronous on CUDA).

        Contiguous matters: compiled graphs are specialized to strides, and the loader's
        sequences are overlapping views.
        """
        if self.device.type == "cuda":
            return t.contiguous().pin_memory().to(self.device, non_blocking=True)
        return t.contiguous()


def setup_runtime(cfg):
    """Pick the device and join the process group when launched by torchrun.

    The device index comes from LOCAL_RANK (multi-node safe); NCCL on CUDA, gloo on CPU, with
    a timeout so a rank that died never leaves the others hanging in a collective.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.dist_timeout),
                                **({"device_id": device} if kind == "cuda" else {}))
    use_compile = (kind == "cuda") if cfg.compile is None else cfg.compile
    use_bf16 = (kind == "cuda") if cfg.bf16 is None else cfg.bf16
    return Runtime(rank, world, local_rank, device, use_compile, use_bf16)


def all_reduce_sum(t, rt):
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def accumulate_gradients(model, micro_batches, rt):
    """Forward/backward over a step's micro-batches; gradients of the step's mean loss.

    Args:
        model: callable ``(inputs, targets) -> loss sum`` (the GPT, possibly compiled).
        micro_batches: list of ``(inputs [b, L, k], targets [b, L, j])`` of this process.
        rt: Runtime (device, process group).

    Returns:
        float32 scalar tensor: the step loss, the mean over *every* valid (position, label)
        pair of the global batch (all micro-batches, all ranks) -- not a mean of per-micro-
        batch means. The gradient in ``.grad`` is that loss's gradient, summed over ranks.
    """
    n_valid = torch.zeros((), device=rt.device)
    for _, targets in micro_batches:
        n_valid += (targets != IGNORE_INDEX).sum()
    all_reduce_sum(n_valid, rt)
    n_valid = n_valid.clamp_min(1)
    total = torch.zeros((), device=rt.device)
    for inputs, targets in micro_batches:
        with rt.autocast():
            loss_sum = model(inputs, targets)
        (loss_sum / n_valid).backward()
        total += loss_sum.detach()
    if rt.distributed:
        works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters() if p.grad is not None]
        for w in works:
            w.wait()
    return all_reduce_sum(total, rt) / n_valid


# ----------------------------------------------------------------------------------------------
# Eval

class ValData:
    """The first ``n_tokens`` tokens of the val shards (+1 for the last label), held in memory.

    Raises:
        DataError: the val shards hold fewer than ``n_tokens + 1`` tokens.
    """

    def __init__(self, files, n_tokens, vocab_size=None):
        stream = TokenStream(files, vocab_size=vocab_size)
        if stream.total < n_tokens + 1:
            raise DataError(f"--val-tokens {n_tokens}: the val shards ({', '.join(files)}) hold only "
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


def next_micro_batches(loader, step, cfg, rt):
    """This rank's ``[(inputs, targets)]`` for optimizer ``step`` (its phase's layout), on the device.

    Returns ``(micro_batches, advance)``; the loader moves ``global_seqs * advance`` tokens on.
    """
    _, s, mode = phase_of(step, cfg)
    seq_tokens, advance = sequence_layout(mode, s, cfg.seq_len)
    return [make_batch(rt.to_device(t), mode, s) for t in loader.next_batch(seq_tokens, advance)], advance


def val_batch_seqs(cfg):
    return cfg.val_batch_seqs or cfg.micro_batch_seqs


@torch.no_grad()
def evaluate(model, val, mode, bag_size, cfg, rt):
    """Mean loss over the val tokens for a phase objective (s = 1: the next-token val loss metric)."""
    total = torch.zeros((), device=rt.device, dtype=torch.float64)
    count = torch.zeros((), device=rt.device, dtype=torch.float64)
    for inputs, targets in val.batches(mode, bag_size, cfg.seq_len, val_batch_seqs(cfg), rt):
        inputs, targets = rt.to_device(inputs), rt.to_device(targets)
        with rt.autocast():
            total += model(inputs, targets).double()
        count += (targets != IGNORE_INDEX).sum()
    all_reduce_sum(total, rt)
    all_reduce_sum(count, rt)
    if count.item() == 0:
        raise DataError(f"--val-tokens {val.n_tokens}: no label to score for the {mode} s={bag_size} objective")
    return (total / count).item()


# ----------------------------------------------------------------------------------------------
# Checkpoints

def checkpoint_state(model, opts, loader, step, run, cfg):
    return dict(config=dataclasses.asdict(cfg), step=step,
                phase=phase_of(step, cfg)[0], run_id=run["run_id"], model=model.state_dict(),
                optimizers=[o.state_dict() for o in opts], loader_position=loader.position,
                counters={k: run[k] for k in ("train_time_ms", "raw_tokens", "positions", "flops")},
                rng=dict(torch=torch.get_rng_state(),
                         cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []))


CHECKPOINT_FORMAT = "train_gpt-checkpoint-1"


def save_checkpoint(state, path):
    """Write a checkpoint atomically: serialize, checksum, write ``<path>.tmp.<pid>``, rename.

    The file is ``torch.save({"format", "sha256", "payload"})`` where ``payload`` is the
    uint8 serialization of ``state``, so a truncated *or* bit-flipped file is detected on load.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(dict(format=CHECKPOINT_FORMAT, sha256=hashlib.sha256(payload).hexdigest(),
                    payload=torch.frombuffer(bytearray(payload), dtype=torch.uint8)), tmp)
    os.replace(tmp, path)


def load_checkpoint(path):
    """The state dict saved by ``save_checkpoint`` (model, optimizers, step, loader, RNG, config).

    Raises:
        ConfigError: missing file, not a checkpoint of this trainer, truncated, or corrupt
            (checksum mismatch); the message names the file and what to do.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"--resume {path}: no such checkpoint file")
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    if not is_zip:
        raise ConfigError(f"--resume {path}: not a train_gpt.py checkpoint (give a checkpoints/<run_id>/step_N.pt)")
    try:
        outer = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several kinds for a truncated or mangled archive
        first = (str(e).splitlines() or [""])[0][:120]
        raise ConfigError(f"--resume {path}: truncated or unreadable checkpoint ({type(e).__name__}: "
                          f"{first}); resume from an older one") from None
    if not isinstance(outer, dict) or outer.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--resume {path}: not a train_gpt.py checkpoint")
    payload = outer["payload"].numpy().tobytes()
    if hashlib.sha256(payload).hexdigest() != outer["sha256"]:
        raise ConfigError(f"--resume {path}: corrupt checkpoint (sha256 mismatch); resume from an older one")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def find_latest_checkpoint(checkpoint_dir, run_id=""):
    """Newest ``*.pt`` under ``checkpoint_dir`` (only ``<dir>/<run_id>/`` when a run id is given).

    Raises:
        ConfigError: no checkpoint there.
    """
    where = os.path.join(checkpoint_dir, run_id) if run_id else checkpoint_dir
    found = sorted(glob.glob(os.path.join(where, "**", "*.pt"), recursive=True), key=os.path.getmtime)
    if not found:
        raise ConfigError(f"--resume auto: no checkpoint under {where!r} (--checkpoint-dir"
                          + (", --run-id)" if run_id else ")"))
    return found[-1]


SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "model_dim", "mlp_ratio")


def check_resume_config(saved, cfg):
    """Differences in run-defining fields between a checkpoint's config and this run's.

    Returns the list of differences (continued past with ``--resume-force``).

    Raises:
        ConfigError: any difference without --resume-force, or a different model shape at all.
    """
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(cfg, k)!r}"
             for k in RUN_DEFINING if saved.get(k) != getattr(cfg, k)]
    shape = [d for d in diffs if d.split(":")[0] in SHAPE_FIELDS]
    if shape:
        raise ConfigError("--resume: the checkpoint holds a model of another shape (" + "; ".join(shape)
                          + "); use the checkpoint's model flags")
    if diffs and not cfg.resume_force:
        raise ConfigError("--resume: the checkpoint was made with a different run config ("
                          + "; ".join(diffs) + "); use the same flags, or --resume-force to continue anyway")
    return diffs


def prepare_resume(cfg):
    """``(state, path, diffs)`` of the checkpoint to resume from, checked before any file is written."""
    path = find_latest_checkpoint(cfg.checkpoint_dir, cfg.run_id) if cfg.resume == "auto" else cfg.resume
    state = load_checkpoint(path)
    return state, path, check_resume_config(state["config"], cfg)


def check_batch_split(cfg, world):
    """The global batch must split into equal micro-batches over the processes; suggest values."""
    seqs = cfg.batch_tokens // cfg.seq_len
    if seqs % (cfg.micro_batch_seqs * world):
        fits = [m for m in range(1, seqs // world + 1) if seqs % (m * world) == 0]
        raise ConfigError(f"--micro-batch-seqs {cfg.micro_batch_seqs} x {world} process(es) does not divide the "
                          f"{seqs} sequences of a step (--batch-tokens / --seq-len); use one of {fits}")


def check_checkpoint_dir(cfg, run_id):
    """Fail at start-up, not after hours of training, when checkpoints cannot be written."""
    if not (cfg.save_every or cfg.save_final or cfg.save_on_interrupt):
        return
    where = os.path.join(cfg.checkpoint_dir, run_id)
    try:
        os.makedirs(where, exist_ok=True)
        probe = os.path.join(where, f".write_test.{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir!r}: cannot write checkpoints there "
                          f"({e.strerror}); choose another --checkpoint-dir") from None


# ----------------------------------------------------------------------------------------------
# Logging: one text file per run, a reproducible snapshot (docs/SPEC.md), plus a JSON summary

SEPARATOR = "=" * 100
SOURCE_FILES = ("train_gpt.py", "aurora_opt.py")


def source_snapshot():
    """The exact source of both files, each after a ``### file <name> lines=<n> sha256=<hex>`` line."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name in SOURCE_FILES:
        with open(os.path.join(here, name), encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines(keepends=True)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        parts.append(f"### file {name} lines={len(lines)} sha256={digest}\n{text}")
        if not text.endswith("\n"):
            parts.append("\n")
    return "".join(parts)


def _run_quiet(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment_lines(rt):
    lines = [f"python: {platform.python_version()}  torch: {torch.__version__}  "
             f"cuda: {torch.version.cuda}  numpy: {np.__version__}",
             f"host: {platform.node()}  platform: {platform.platform()}",
             f"world_size: {rt.world}  device: {rt.device}  compile: {rt.compile}  bf16: {rt.bf16}"]
    if rt.device.type == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"gpus: {len(names)} x {names[0]}" if len(set(names)) == 1 else f"gpus: {names}")
        smi = _run_quiet(["nvidia-smi"])
        if smi:
            lines.append(smi)
    else:
        cpu = platform.processor() or platform.machine()
        if os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
        lines.append(f"cpu: {cpu}  cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}")
    return lines


def git_description():
    commit = _run_quiet(["git", "rev-parse", "HEAD"])
    if not commit:
        return "none (not a git checkout)"
    dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit + (" (uncommitted changes)" if dirty else "")


class RunLog:
    """The run's log file and JSON summary. Only rank 0 writes; every rank may call it.

    The text file holds, in order: source snapshot, separator, environment, command line,
    config, git commit, data files, step lines, summary, ``status:`` line. A new log never
    replaces an existing one; ``resume=True`` appends to the run's log when it exists.

    Raises:
        ConfigError: the log exists (and this is no resume), or --log-dir cannot be written.
    """

    def __init__(self, cfg, rt, run_id, resume=False):
        self.rt, self.path, self.json_path, self.is_new = rt, None, None, False
        self.summary = dict(run_id=run_id, status="running")
        if not rt.master:
            return
        path = os.path.join(cfg.log_dir, f"{run_id}.txt")
        json_path = os.path.join(cfg.log_dir, f"{run_id}.json")
        try:
            if not os.path.isdir(cfg.log_dir):
                os.makedirs(cfg.log_dir)
            if resume and os.path.exists(path):
                self.file = open(path, "a", encoding="utf-8")
                if os.path.exists(json_path):
                    with open(json_path, encoding="utf-8") as f:
                        self.summary = json.load(f)
            else:
                self.file = open(path, "x", encoding="utf-8")  # exclusive: never overwrite a run's log
                self.is_new = True
        except FileExistsError:
            if not os.path.isdir(cfg.log_dir):
                raise ConfigError(f"--log-dir {cfg.log_dir!r} is a file; choose another --log-dir") from None
            raise ConfigError(f"--run-id {run_id}: {path} already exists; choose another --run-id "
                              f"(or continue that run with --resume)") from None
        except OSError as e:
            raise ConfigError(f"--log-dir {cfg.log_dir!r}: cannot write the log there ({e.strerror}); "
                              f"choose another --log-dir") from None
        self.path, self.json_path = path, json_path
        if self.is_new:
            self.file.write(source_snapshot() + SEPARATOR + "\n")
            self.file.flush()

    def line(self, text, echo=True):
        if not self.rt.master:
            return
        if echo:
            print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def update(self, **kw):
        self.summary.update(kw)

    def finish(self, status, reason=None):
        """Write the final ``status:`` line and the JSON summary (``complete``, ``incomplete``, ...)."""
        if not self.rt.master or self.path is None or self.file.closed:
            return
        reason = " | ".join(str(reason).split("\n")) if reason else None  # the status stays one line
        self.summary["status"] = status
        self.summary.pop("reason", None)  # a resumed run's earlier stop reason no longer applies
        if reason:
            self.summary["reason"] = reason
        self.line(f"status:{status}" + (f" reason:{reason}" if reason else ""))
        self.file.close()
        tmp = self.json_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(tmp, self.json_path)


def step_line(step, cfg, what, value, train_time_ms, steps_timed, extra):
    avg = train_time_ms / max(steps_timed, 1)
    fields_ = " ".join(f"{k}:{v}" for k, v in extra.items())
    return (f"step:{step}/{cfg.num_iterations} {what}:{value:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{avg:.2f}ms {fields_}").rstrip()


def peak_memory_mib(rt):
    if rt.device.type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    import resource  # peak resident set size of this process, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------
# Main

class StopRequested(Exception):
    """Raised by the SIGINT/SIGTERM handler when no checkpoint-on-interrupt is wanted."""


def train(cfg, rt, log, preset=None, resume=None, stop=None):
    """The whole run after setup: data, model, warm-up, the training loop, val, summary.

    ``resume`` is ``prepare_resume``'s ``(state, path, diffs)``; ``stop`` the dict the signal
    handler fills (``{"signal": name}``) when a checkpoint-on-interrupt is wanted.
    Returns ``(status, reason)``.
    """
    stop = stop if stop is not None else {"signal": None}
    global_seqs = cfg.batch_tokens // cfg.seq_len
    switch = tst_switch_step(cfg)
    train_files = resolve_files(cfg.train_files, "--train-files")
    val_files = resolve_files(cfg.val_files, "--val-files")

    resume_state, resume_path, diffs = resume or (None, None, [])
    if diffs:
        log.line("resume_force: continuing despite config differences: " + "; ".join(diffs))
    # every start (a resume too, maybe on another machine) records where and how it ran
    for text in environment_lines(rt):
        log.line(text, echo=False)
    log.line("command: " + " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), echo=False)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        log.line(f"launcher: torchrun, {os.environ.get('LOCAL_WORLD_SIZE', '?')} process(es) per node, "
                 f"world size {rt.world}", echo=False)
    log.line(f"git: {git_description()}", echo=False)
    if log.is_new:
        log.line(f"preset: {preset}", echo=False)
        log.line("config: " + json.dumps(dataclasses.asdict(cfg), sort_keys=True), echo=False)
    for kind, files in (("train", train_files), ("val", val_files)):
        for f in files:
            log.line(f"data {kind}: {f} tokens:{read_shard_header(f)} bytes:{os.path.getsize(f)} "
                     f"fingerprint:{fingerprint(f)}", echo=False)
    train_stream = TokenStream(train_files, wrap=True, vocab_size=cfg.vocab_size)
    val = ValData(val_files, cfg.val_tokens, cfg.vocab_size)
    loader = TrainLoader(train_stream, global_seqs, cfg.micro_batch_seqs, rt.rank, rt.world)

    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(rt.device)
    opts = build_optimizers(model, cfg, compile=rt.compile)
    flops_per_step = model_flops_per_position(cfg) * cfg.batch_tokens
    run = dict(run_id=log.summary["run_id"], train_time_ms=0.0, raw_tokens=0, positions=0, flops=0)
    start_step = 0
    if resume_state is not None:
        model.load_state_dict(resume_state["model"])
        for opt, sd in zip(opts, resume_state["optimizers"]):
            opt.load_state_dict(sd)
        loader.position = resume_state["loader_position"]
        run.update(resume_state["counters"])
        start_step = resume_state["step"]
        torch.set_rng_state(resume_state["rng"]["torch"])
        if resume_state["rng"]["cuda"] and rt.device.type == "cuda":
            torch.cuda.set_rng_state_all(resume_state["rng"]["cuda"])
        log.line(f"resume: from {resume_path} at step {start_step} (phase {resume_state['phase']}) "
                 f"train_time:{run['train_time_ms']:.0f}ms tokens:{run['raw_tokens']}")
    net = torch.compile(model, dynamic=False) if rt.compile else model

    n_params = sum(p.numel() for p in model.parameters())
    tst = "off" if switch == 0 else f"{cfg.tst_mode} s={cfg.tst_bag_size} for steps [0, {switch})"
    log.line(f"model: {n_params:,} parameters, {model_flops_per_position(cfg):,} FLOPs per latent position; "
             f"grad accumulation {loader.accum} x {cfg.micro_batch_seqs} seqs x {rt.world} processes; TST {tst}")

    # Warm-up: compile every graph the run will use (both phases, train and val) before the clock starts.
    compile_ms = 0.0
    if rt.compile:
        t0 = time.perf_counter()
        phases = sorted({phase_of(s, cfg) for s in (0, switch, cfg.num_iterations - 1)})
        for _, s, mode in phases:
            seq_tokens, _ = sequence_layout(mode, s, cfg.seq_len)
            dummy = torch.zeros(cfg.micro_batch_seqs, seq_tokens, dtype=torch.int64)
            inputs, targets = make_batch(rt.to_device(dummy), mode, s)
            with rt.autocast():
                net(inputs, targets).backward()
            model.zero_grad(set_to_none=True)
            vi, vt = next(val.batches(mode, s, cfg.seq_len, val_batch_seqs(cfg), rt))
            with torch.no_grad(), rt.autocast():
                net(rt.to_device(vi), rt.to_device(vt))
        for opt in opts:
            if isinstance(opt, Aurora):
                opt.warmup()
        rt.sync()
        compile_ms = 1000 * (time.perf_counter() - t0)
        log.line(f"compile: warm-up of {len(phases)} phase graph(s) took {compile_ms:.0f}ms (not in train_time)")
    log.update(compile_time_ms=round(compile_ms))

    lr_flags = ("--adamw-lr" if cfg.optimizer == "adamw" else "--matrix-lr") + ", --embed-lr, --head-lr"

    def do_val(step, steps_timed):
        extra = {"phase": phase_of(max(step - 1, 0), cfg)[0]}  # the phase that trained the model so far
        loss = evaluate(net, val, "full", 1, cfg, rt)
        if not math.isfinite(loss):
            raise FloatingPointError(f"val loss is {loss} at step {step}; lower the lr ({lr_flags})")
        if extra["phase"] == 1:  # also the TST objective on the same val tokens
            extra["val_loss_tst"] = f"{evaluate(net, val, cfg.tst_mode, cfg.tst_bag_size, cfg, rt):.4f}"
        extra.update(tokens=run["raw_tokens"], positions=run["positions"], flops=f"{run['flops']:.3e}")
        log.line(step_line(step, cfg, "val_loss", loss, run["train_time_ms"], steps_timed, extra))
        log.update(final_val_loss=loss, val_step=step)
        return loss

    def save(step, tag):
        if rt.master:
            path = os.path.join(cfg.checkpoint_dir, run["run_id"], f"{tag}.pt")
            save_checkpoint(checkpoint_state(model, opts, loader, step, run, cfg), path)
            log.line(f"checkpoint: step {step} -> {path}")
        if rt.distributed:
            dist.barrier()

    end_step = min(cfg.num_iterations, start_step + cfg.max_steps) if cfg.max_steps else cfg.num_iterations
    steps_timed = 0
    graphs = torch._dynamo.utils.counters["stats"] if rt.compile else None
    graphs_before = graphs["unique_graphs"] if rt.compile else 0
    if start_step == 0:
        do_val(0, 0)
    # first step whose loss was not finite, tracked on the device: no extra host sync per step
    first_bad = torch.zeros((), dtype=torch.int64, device=rt.device)
    rt.sync()
    t0 = time.perf_counter()
    for step in range(start_step, end_step):
        phase, s, mode = phase_of(step, cfg)
        if step == switch and switch > 0:
            log.line(f"tst_switch: step {step}: phase 1 -> 2 (bag_size {cfg.tst_bag_size} -> 1, mode "
                     f"{cfg.tst_mode} -> next-token); same weights and optimizer state; "
                     f"tokens:{run['raw_tokens']}")
        epoch = loader.position // train_stream.total
        micro, advance = next_micro_batches(loader, step, cfg, rt)
        if (loader.position - 1) // train_stream.total > epoch:
            log.line(f"data: the train stream ({train_stream.total} tokens) wrapped around during step "
                     f"{step + 1}; from here on tokens are read again (epoch {epoch + 2})")
        scale = apply_schedule(opts, step, cfg)
        loss = accumulate_gradients(net, micro, rt)
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        run["raw_tokens"] += global_seqs * advance
        run["positions"] += cfg.batch_tokens
        run["flops"] += flops_per_step
        steps_timed += 1
        done = step + 1
        first_bad.masked_fill_((first_bad == 0) & ~torch.isfinite(loss), done)
        if cfg.save_on_interrupt and rt.distributed:  # every rank stops after the same step
            flag = torch.tensor(float(stop["signal"] is not None), device=rt.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and stop["signal"] is None:
                stop["signal"] = "SIGTERM (on another rank)"
        last = done == end_step
        if done % cfg.log_every == 0 or last or stop["signal"]:
            rt.sync()
            run["train_time_ms"] += 1000 * (time.perf_counter() - t0)
            value, bad_step = loss.item(), int(first_bad)
            if bad_step:
                raise FloatingPointError(f"train loss is not finite since step {bad_step}; lower the lr "
                                         f"({lr_flags}) or check the data")
            log.summary.setdefault("train_losses", []).append([done, value])
            log.line(step_line(done, cfg, "train_loss", value, run["train_time_ms"], done, dict(
                phase=phase, tokens=run["raw_tokens"], positions=run["positions"],
                flops=f"{run['flops']:.3e}", lr_scale=f"{scale:.4f}")))
            t0 = time.perf_counter()  # the log line itself is not training time
        timed_pause = (cfg.val_every and done % cfg.val_every == 0) or last or \
            (cfg.save_every and done % cfg.save_every == 0) or stop["signal"]
        if timed_pause:
            rt.sync()
            now = time.perf_counter()
            run["train_time_ms"] += 1000 * (now - t0)
            if (cfg.val_every and done % cfg.val_every == 0) or (last and done == cfg.num_iterations):
                do_val(done, done)
            if (cfg.save_every and done % cfg.save_every == 0) or (last and cfg.save_final):
                save(done, f"step_{done:06d}")
            if stop["signal"] and not last:
                save(done, f"step_{done:06d}")
                log.update(**run, steps=done)
                return "interrupted", f"{stop['signal']}; resume with --resume auto --run-id {run['run_id']}"
            rt.sync()
            t0 = time.perf_counter()
    if rt.compile:
        log.update(graphs_compiled_during_training=graphs["unique_graphs"] - graphs_before)
    peak = peak_memory_mib(rt)
    log.update(**run, steps=end_step, flops_per_position=model_flops_per_position(cfg),
               train_epochs=round(loader.position / train_stream.total, 4),
               peak_memory_mib=round(peak, 1), world_size=rt.world)
    s = log.summary
    log.line(SEPARATOR)
    log.line(f"summary: final_val_loss:{s.get('final_val_loss', float('nan')):.4f} "
             f"train_time:{run['train_time_ms']:.0f}ms steps:{end_step} raw_tokens:{run['raw_tokens']} "
             f"positions:{run['positions']} flops:{run['flops']:.3e} peak_memory:{peak:.0f}MiB "
             f"compile_time:{compile_ms:.0f}ms")
    if end_step < cfg.num_iterations:
        return "stopped_early", f"--max-steps {cfg.max_steps}"
    return "complete", None


def install_stop_handlers(stop, save_on_interrupt):
    """SIGINT/SIGTERM: stop now (log marked incomplete), or with --save-on-interrupt after the
    current step (checkpoint, log marked interrupted). Returns the previous handlers."""
    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name
        if not save_on_interrupt:
            raise StopRequested(f"interrupted by {stop['signal']}")
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def main(argv=None):
    """Run from command-line words; returns the exit status (0 only for a completed run).

    Everything that can be refused (flags, the checkpoint to resume, the log and checkpoint
    folders) is checked before the log is created; from then on any failure closes the log
    with ``status:incomplete`` and the reason.
    """
    log, rank, stop, handlers = None, os.environ.get("RANK", "0"), {"signal": None}, {}
    status, reason, code = "incomplete", None, 1
    try:
        cfg, preset = parse_config(argv)
        handlers = install_stop_handlers(stop, cfg.save_on_interrupt)
        rt = setup_runtime(cfg)
        rank = rt.rank
        resume = prepare_resume(cfg) if cfg.resume else None
        run_id = cfg.run_id or (resume[0]["run_id"] if resume else
                                datetime.datetime.now().strftime("%Y%m%d_%H%M%S_") + uuid.uuid4().hex[:6])
        check_batch_split(cfg, rt.world)
        if rt.master:
            check_checkpoint_dir(cfg, run_id)
        log = RunLog(cfg, rt, run_id, resume=resume is not None)
        status, reason = train(cfg, rt, log, preset, resume, stop)
        code = {"complete": 0, "stopped_early": 0, "interrupted": 130}.get(status, 1)
    except (ConfigError, DataError, FloatingPointError) as e:
        reason = f"rank {rank}: {e}"
        print(f"train_gpt.py: error: {reason}", file=sys.stderr)
        code = 1 if isinstance(e, FloatingPointError) else 2
    except (KeyboardInterrupt, StopRequested) as e:
        reason = f"rank {rank}: interrupted ({str(e) or 'KeyboardInterrupt'})"
        print(f"train_gpt.py: {reason}", file=sys.stderr)
        code = 130
    except BaseException as e:  # unexpected: keep the traceback, still close the log as incomplete
        if log is not None:
            log.finish("incomplete", f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if log is not None:
        log.finish(status, reason)
        if log.path:
            print(f"log: {log.path} ({status})", file=sys.stderr)
    if code == 0 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
