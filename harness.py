"""The harness of train_gpt.py: everything around the speedrun that does not change what it computes.

The CLI generated from the trainer's Config, the config checks, data files and their
fingerprints, the runtime (device, processes), checkpoints and resume checks, the run log with
its source snapshot (docs/SPEC.md), ``--describe``, signals and the skeleton of ``main``. Like
aurora_opt.py it imports nothing from train_gpt.py: the trainer hands in a ``Trainer`` (its
Config class, presets, plan and train function) and the run object its loop works on.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import fcntl
import glob
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from aurora_opt import check_hparams


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


class DataError(ValueError):
    """A shard or glob that cannot be used; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------
# Data: shards of 256 x int32 header + uint16 tokens (llm.c / modded-nanogpt format)

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
EOT_ID = 50256  # GPT-2 <|endoftext|>: a run of it is empty documents, not damage
REMAKE = "re-download or re-tokenize it (data/cached_fineweb10B.py, data/tokenize_text.py)"


def read_shard_header(path):
    """Validate a shard's header and size; return its number of tokens.

    Raises:
        DataError: missing file, short header, wrong magic or version, or a file size other
            than exactly ``1024 + 2 * n_tokens`` bytes. The message names the file and the fix.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except OSError as e:  # missing, a directory, a symlink loop, unreadable
        raise DataError(f"{path}: cannot read shard ({e.strerror}); check the path, or {REMAKE}") from None
    if header.size < HEADER_INTS:
        raise DataError(f"{path}: {size} bytes is shorter than the 1024-byte shard header; {REMAKE}")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a token shard, {REMAKE}")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION}); {REMAKE}")
    n = int(header[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise DataError(f"{path}: file is {size} bytes but its header says {n} tokens "
                        f"({HEADER_BYTES + 2 * n} bytes); truncated or corrupt, {REMAKE}")
    return n


def load_shard(path, n_tokens=None):
    """Memory-map a shard: uint16 numpy array of its tokens (header validated unless ``n_tokens`` is given)."""
    n = read_shard_header(path) if n_tokens is None else n_tokens
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))


CORRUPT_RUN = 8192    # data/shard_format.py's rule: this many copies of one id (not <|endoftext|>) in a row
SCAN_CHUNK = 1 << 22  # tokens per read of the start-up scan (8 MiB of uint16)


def check_shard_tokens(path, tokens, max_id):
    """Refuse, before step 0, a shard whose ids no GPT-2 shard holds (data/shard_format.py's rule).

    One vectorized pass over the memory-mapped ``tokens`` in ``SCAN_CHUNK`` reads (a record's 14
    train shards: a few seconds, bench/shard_checks.py): an id above ``max_id`` (another
    tokenizer), or a run of ``CORRUPT_RUN`` or more copies of one id other than <|endoftext|> (a
    zero-filled or lost stretch of a partial download or write that kept its size). Runs crossing
    a chunk edge are carried over, so the verdict equals data/check_shards.py's (a test compares).

    Raises:
        DataError: naming the file, the first offending token and the fix.
    """
    run_id, run_start = -1, 0  # the run of one id open at the end of the previous chunk
    for start in range(0, len(tokens), SCAN_CHUNK):
        block = np.asarray(tokens[start:start + SCAN_CHUNK])
        top = int(block.max())
        if top > max_id:
            first = int(np.argmax(block > max_id))
            raise DataError(f"{path}: token id {block[first]} at token {start + first} is >= {max_id + 1}; "
                            f"not GPT-2 BPE ids: re-tokenize with data/tokenize_text.py")
        cuts = np.flatnonzero(block[1:] != block[:-1]) + 1  # where a new run begins in this chunk
        if block[0] != run_id:
            run_start = start
        starts = np.concatenate(([run_start - start], cuts))
        ends = np.concatenate((cuts, [len(block)]))
        long = np.flatnonzero((ends - starts >= CORRUPT_RUN) & (block[np.maximum(starts, 0)] != EOT_ID))
        if len(long):
            i = long[0]
            token, at = int(block[max(starts[i], 0)]), start + int(starts[i])
            what = "zero-filled" if token == 0 else f"one id ({token}) repeated"
            raise DataError(f"{path}: {ends[i] - starts[i]:,}+ tokens from token {at:,} are {what}, with no "
                            f"<|endoftext|>: a partial download or write that kept its size; {REMAKE}")
        run_id, run_start = int(block[-1]), start + int(starts[-1])


GPT2_ENCODER_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2_bpe", "encoder.json")
GPT2_EOT = "<|endoftext|>"


def gpt2_token_bytes(path=GPT2_ENCODER_JSON):
    """The bytes of GPT-2's 50,256 ordinary tokens, read from its ``encoder.json`` (no network).

    encoder.json spells each byte as one printable character: the 188 printable bytes
    (33-126, 161-172, 174-255) as themselves, the other 68 as ``chr(256 + i)`` in byte order
    (GPT-2's ``bytes_to_unicode``). ``<|endoftext|>`` (50256) is a special token, left out.

    Args:
        path: the encoder.json file (default: the repository's data/gpt2_bpe/encoder.json).

    Returns:
        ``{id: bytes}`` of the ordinary tokens.

    Raises:
        DataError: the file is missing or not GPT-2's encoder.json (names it and the fix).
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    char_to_byte = {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}
    try:
        with open(path, encoding="utf-8") as f:
            encoder = json.load(f)
        return {i: bytes(char_to_byte[c] for c in s) for s, i in encoder.items() if s != GPT2_EOT}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: cannot read GPT-2's encoder.json ({type(e).__name__}: {e}); "
                        f"restore it from the repository (git checkout -- data/gpt2_bpe)") from None


# ----------------------------------------------------------------------------------------------
# Runtime: this process's device, rank and precision

@dataclass
class Runtime:
    """Where and how this process runs: its rank among ``world`` processes, device, compile, bf16,
    and ``accum``, the micro-batches per process per optimizer step."""
    rank: int
    world: int
    device: torch.device
    compile: bool
    bf16: bool = False
    accum: int = 1

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world > 1

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


# ----------------------------------------------------------------------------------------------
# What the harness runs, and the CLI generated from its Config

@dataclass
class Trainer:
    """The trainer as the harness sees it (train_gpt.py builds one; nothing here imports it).

    Attributes:
        config: the Config dataclass. Each field is a flag; its metadata holds ``help``, and
            optionally ``choices``, ``low`` (smallest value) and ``high`` (values must stay below
            it); ``check_config`` checks the values across fields.
        presets: ``{name: {field: value}}``, applied over the defaults, under explicit flags.
        operational: the fields that change how a run executes, not what it computes (every
            other field defines the run: ``--resume`` refuses a checkpoint that differs in one).
        shape_fields: the fields that fix the shape of the weights (no ``--resume-force`` past them).
        train: ``train(cfg, rt, log, data, preset, resume, stop) -> (status, reason)``, the run.
        plan: ``plan(cfg) -> (parameter count, stage table)``: what a run would do, for ``--describe``
            (no data, no device); ``plan_summary`` reads the table.
        name: the program's name in messages.
        flex_attention: ``flex_attention(cfg) -> bool``: whether the model attends through
            FlexAttention on CUDA (``check_eager_attention``); None: it never does.
        model_shapes: ``model_shapes(cfg) -> {name: shape}``, the model's state_dict built without
            memory: ``check_resume`` refuses, before any log line, a flag that changes it; None: skip.
    """
    config: type
    presets: dict
    operational: frozenset
    shape_fields: tuple
    train: Callable
    plan: Callable
    name: str = "train_gpt.py"
    flex_attention: Callable = None
    model_shapes: Callable = None

    @property
    def run_defining(self):
        return tuple(f.name for f in fields(self.config) if f.name not in self.operational)

    def parse_config(self, argv=None):
        """``(Config, preset)`` from command-line words (``parse_config``)."""
        return parse_config(argv, self)

    def config_to_argv(self, config):
        """The words that reproduce a Config or a logged config dict (``config_to_argv``)."""
        return config_to_argv(config, self.config)

    def main(self, argv=None):
        return main(argv, self)


# The Config fields that change where files go or how a run executes, not what it computes; every
# other field defines the run, and --resume refuses a checkpoint that differs in one of those.
OPERATIONAL = frozenset({"train_files", "val_files", "micro_batch_seqs", "max_steps", "val_every", "val_batch_seqs",
                         "log_every", "log_dir", "run_id", "device", "compile", "bf16", "fp8", "dist_timeout",
                         "checkpoint_dir", "save_every", "keep_checkpoints", "save_final", "save_on_interrupt",
                         "resume", "resume_force"})


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the default is "unset" (its help says what happens)."""

    def _get_help_string(self, action):
        if action.default in (None, "") or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A bad flag gets its one error line, not the 40-line usage above it. Flags are taken whole, never
    by a prefix (``--lr`` would otherwise set --lr-floor): an unknown flag that starts a known one is
    answered with the flags it could mean."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **kw)

    def error(self, message):
        words = re.findall(r"(?<![\w-])--[\w-]+", message) if message.startswith("unrecognized") else []
        known = [o for a in self._actions for o in a.option_strings]
        could = sorted({o for w in words for o in known if o.startswith(w.split("=")[0])})
        hint = f"; did you mean {', '.join(could[:6])}?" if could else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (--help lists every flag)\n")


def build_parser(trainer):
    """argparse parser generated from ``trainer.config``: one --kebab-case flag per field, plus --preset."""
    p = _Parser(
        prog=trainer.name,
        description="Train a GPT with Aurora + Token-Superposition Training. Every flag shows its default; "
                    "--preset sets several at once and explicit flags override it.",
        epilog="presets: " + "; ".join(f"{k}: " + ", ".join(f"{a}={b}" for a, b in v.items())
                                        for k, v in trainer.presets.items()),
        formatter_class=_DefaultsFormatter)
    p.add_argument("--preset", choices=sorted(trainer.presets), default=None, help="bundle of defaults")
    p.add_argument("--describe", action="store_true",
                   help="print what the run would do (config, parameters, FLOPs, tokens, projected time) and exit; "
                        "needs no data and no GPU")
    p.add_argument("--gpu-check", default=None,
                   help="with --describe: project also at the utilization this bench/gpu_check.py report "
                        "(its gpu_check.json) measured (default: the newest under bench/out/, if any)")
    for f in fields(trainer.config):
        flag = flag_of(f.name)
        kw = dict(default=f.default, help=f.metadata["help"])
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            p.add_argument(flag, type=typ, choices=f.metadata.get("choices"), **kw)
    return p


def parse_config(argv, trainer):
    """Config from command-line words: dataclass defaults < --preset < explicit flags.

    Returns ``(Config, preset name or None)``.

    Raises:
        ConfigError: a value that cannot work (names the flag), or a flag typed that the config does not read
            (``unread_fields``; a preset's value of such a field is never refused).
    """
    parser = build_parser(trainer)
    known, _ = parser.parse_known_args(argv)
    if known.preset:
        parser.set_defaults(**trainer.presets[known.preset])
    args, extra = parser.parse_known_args(argv)
    if extra and all(os.path.exists(a) for a in extra):
        raise ConfigError(f"unexpected file arguments ({extra[0]} ...): the shell expanded a glob; quote it, "
                          f"e.g. --train-files 'data/fineweb10B/fineweb_train_*.bin'")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    cfg = trainer.config(**{f.name: getattr(args, f.name) for f in fields(trainer.config)})
    validate_config(cfg)
    parser.set_defaults(**{f.name: _UNSET for f in fields(cfg)})  # the fields typed, not from a preset or default
    typed = vars(parser.parse_known_args(argv)[0])
    idle = [(f, why) for f, why in unread_fields(cfg).items() if typed[f] is not _UNSET]
    if idle:
        raise ConfigError(f"{flag_of(idle[0][0])} {idle[0][1]}")
    return cfg, args.preset


_UNSET = object()


def config_to_argv(config, config_class):
    """Command-line words that reproduce a config (a Config or the dict logged as ``config:``); of a whole
    config, without the fields it does not read (``unread_fields``: typed, they are refused)."""
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    names = [f.name for f in fields(config_class)]
    unread = unread_fields(config_class(**{k: values[k] for k in names})) if set(names) <= set(values) else {}
    argv = []
    for f in fields(config_class):
        if f.name not in values or values[f.name] is None or f.name in unread:
            continue
        flag, value = flag_of(f.name), values[f.name]
        if f.type in (bool, "bool"):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def flag_of(name):
    """The flag of a config field: ``--kebab-case``."""
    return "--" + name.replace("_", "-")


def validate_config(cfg):
    """Raise ConfigError naming the flag for any value that cannot work (the CLI's only check).

    Each field's own bounds come from its metadata (``low``, ``high``); then the checks across
    fields (``check_config``).
    """
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    for f in fields(cfg):
        value, low, high = getattr(cfg, f.name), f.metadata.get("low"), f.metadata.get("high")
        if isinstance(value, float):
            need(math.isfinite(value), f"{flag_of(f.name)} must be finite (got {value})")
        if isinstance(value, int) and not isinstance(value, bool):  # sizes, counts, seeds: int32 is plenty
            need(abs(value) < 2**31, f"{flag_of(f.name)} must be < 2**31 in magnitude (got {value})")
        if high is not None:
            need(low <= value < high, f"{flag_of(f.name)} must be in [{low}, {high}) (got {value})")
        elif low is not None:
            need(value >= low, f"{flag_of(f.name)} must be >= {low} (got {value})")
        if f.name in ("log_dir", "checkpoint_dir"):  # '' would drop the run's files into the current folder
            need(value != "", f"{flag_of(f.name)} '': name a folder (default {f.default!r})")
    check_config(cfg, need)
    need(cfg.dist_timeout >= 1, f"--dist-timeout must be >= 1 s (got {cfg.dist_timeout})")
    need(cfg.run_id == "" or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.run_id) is not None,
         f"--run-id {cfg.run_id!r}: use letters, digits, '.', '_' and '-' only (it names files)")


def check_config(cfg, need):
    """Raise, through ``need(ok, msg)`` (a ConfigError naming the flag), for values that cannot work together."""
    try:  # Aurora's own check, its arguments named as flags
        check_hparams(lr=cfg.matrix_lr, weight_decay=cfg.matrix_wd, momentum=cfg.momentum, ns=cfg.ns,
                      pp_iterations=cfg.pp_iterations, pp_beta=cfg.pp_beta)
    except ValueError as e:
        flags = dict(lr="matrix_lr", weight_decay="matrix_wd", momentum="momentum", pp_iterations="pp_iterations",
                     pp_beta="pp_beta", ns="ns")
        name, rest = str(e).split(" ", 1)
        raise ConfigError(f"{flag_of(flags.get(name, name))} {rest}") from None
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
    need(not cfg.tied_embed or (cfg.stages == "record89" and cfg.optimizer in ("normuon", "aurora_normuon")),
         "--tied-embed needs --stages record89 and --optimizer normuon or aurora_normuon (its untie step and Adam)")
    # flags that only modify another one: alone they would do nothing, silently
    need(not cfg.grow_seq_len or cfg.stages == "record89", "--grow-seq-len lengthens record #89's later stages: it "
         "needs --stages record89 (with --stages flags add --no-grow-seq-len)")
    need(not cfg.key_offset_docs or cfg.key_offset,
         "--key-offset-docs stops the key offset at document starts: it needs --key-offset")
    if cfg.stages == "record89":  # stage k trains k thirds of --batch-tokens
        need(cfg.batch_tokens % (3 * cfg.seq_len) == 0,
             f"--stages record89 needs --batch-tokens ({cfg.batch_tokens}) a multiple of 3 x --seq-len ({cfg.seq_len})")
        need(cfg.batch_tokens // (3 * cfg.seq_len) % cfg.micro_batch_seqs == 0,
             f"--micro-batch-seqs {cfg.micro_batch_seqs} must divide stage 1's {cfg.batch_tokens // (3 * cfg.seq_len)} "
             f"sequences (--stages record89: a third of --batch-tokens / --seq-len)")
        need(cfg.extension_steps < cfg.num_iterations - 2, f"--extension-steps {cfg.extension_steps} leaves fewer "
                                                           f"than 3 of --num-iterations {cfg.num_iterations} scheduled")
    need(cfg.warmup_steps <= cfg.num_iterations,
         f"--warmup-steps {cfg.warmup_steps} exceeds --num-iterations {cfg.num_iterations}")
    if cfg.tst_frac > 0:  # the phase-1 val objective needs at least one bag and its next bag
        need(cfg.val_tokens >= 2 * cfg.tst_bag_size,
             f"--tst-bag-size {cfg.tst_bag_size} needs --val-tokens >= {2 * cfg.tst_bag_size} "
             f"(got {cfg.val_tokens}); lower the bag size or raise --val-tokens")


# The optimizer fields each --optimizer reads (train_gpt.build_optimizers; the momentum ramps through
# apply_schedule, Aurora's and NorMuon's only); adam_eps is read by all. tests/test_bad_inputs_89.py trains
# with each unread field changed and finds the same weights.
_ADAM = ("embed_lr", "head_lr", "scalar_lr", "adam_beta1", "adam_beta2")
_MATRIX = ("matrix_lr", "matrix_wd", "momentum", "momentum_start", "momentum_warmup_steps", "momentum_cooldown_steps",
           "nesterov", "ns", "ns_dtype")
_POLAR = ("pp_iterations", "pp_beta")  # Aurora's row equalization: muon and normuon run K = 0
_ADAMW = ("adamw_lr", "adamw_wd")
OPTIMIZER_READS = dict(aurora=_ADAM + _MATRIX + _POLAR, muon=_ADAM + _MATRIX, adamw=_ADAM + _ADAMW,
                       normuon=_MATRIX, aurora_normuon=_MATRIX + _POLAR)
_UNREAD_WHY = [(_ADAM, "record #89's CautiousAdam sets its lrs and betas per role"),  # a family without them: why
               (_ADAMW, "only --optimizer adamw's AdamW reads it"),
               (_MATRIX, "AdamW updates the block matrices: --adamw-lr, --adamw-wd"),
               (_POLAR, "Aurora's row equalization: off, K = 0")]


def unread_fields(cfg):
    """``{field: why it has no effect, and the fix}`` for the fields ``cfg`` does not read: flags that, typed,
    would silently change nothing (``parse_config`` refuses them; ``config_to_argv`` leaves them out)."""
    out, reads = {}, OPTIMIZER_READS[cfg.optimizer]
    for names, why in _UNREAD_WHY:
        for name in names:
            if name not in reads:
                users = [k for k, v in OPTIMIZER_READS.items() if name in v]
                users = ", ".join(users[:-1]) + " or " * (len(users) > 1) + users[-1]
                out[name] = (f"has no effect with --optimizer {cfg.optimizer} ({why}); drop it, or use "
                             f"--optimizer {users}")
    if "pp_beta" in reads and cfg.pp_iterations <= 1:
        out["pp_beta"] = (f"has no effect with --pp-iterations {cfg.pp_iterations} (beta rescales the rows between "
                          "rounds: K >= 2); drop it, or use --pp-iterations 2")
    if "momentum_start" in reads and not (cfg.momentum_warmup_steps or cfg.momentum_cooldown_steps):
        out["momentum_start"] = ("has no effect without --momentum-warmup-steps or --momentum-cooldown-steps "
                                 "(momentum is --momentum throughout); add one, or drop it")
    if cfg.stages == "record89":
        out["warmup_steps"] = ("has no effect with --stages record89 (its stage table sets the lr); drop it, "
                               "or use --stages flags")
    if cfg.tst_frac == 0:
        off = "has no effect with --tst-frac 0 (TST off); add --tst-frac r > 0 (e.g. 0.3) to train TST, or drop it"
        out.update(tst_mode=off, **({"tst_bag_size": off} if cfg.tst_bag_size != 1 else {}))  # s = 1: TST off too
    if not cfg.resume:
        out["resume_force"] = "has no effect without --resume; add --resume FILE (or auto), or drop it"
    if not cfg.save_every:
        out["keep_checkpoints"] = ("has no effect without --save-every N (it deletes only --save-every checkpoints); "
                                   "add --save-every, or drop it")
    return out


def check_architecture(cfg, need):
    """The architecture flags' checks (part of ``check_config``); ``need(ok, msg)`` raises ConfigError."""
    layers = {}
    for name in ("short_window_layers", "no_attn_layers", "paired_head_layers", "xsa_layers", "attn_gate_layers",
                 "dc_layers"):
        text = getattr(cfg, name)
        try:
            layers[name] = layer_set(text)
        except ValueError as e:
            raise ConfigError(f"{flag_of(name)} {text!r}: {e}") from None
    past = layers_past_end(cfg, layers)  # a preset's lists at a smaller --n-layer: name them all in one line
    for name, found in layers.items():
        bad, others = sorted(i for i in found if i >= cfg.n_layer), [f for f in past if f != flag_of(name)]
        need(not bad, f"{flag_of(name)}: there is no layer {bad[0] if bad else ''} (layers are 0..{cfg.n_layer - 1})"
                      + (f"; set {', '.join(others)} for --n-layer {cfg.n_layer} too" if others else ""))
    need(not layers["short_window_layers"] or cfg.window > 0 or cfg.stages == "record89",
         "--short-window-layers needs a --window (or --stages record89)")
    k, n = cfg.value_embeds, cfg.n_layer
    need(k >= 0, f"--value-embeds must be >= 0 (got {k}); 0 = none")
    need(2 * k <= n or cfg.ve_layers, f"--value-embeds {k}: the first k and last k layers must not overlap (k <= {n // 2})")
    try:
        ve = ve_layer_list(cfg)
    except ValueError as e:
        raise ConfigError(f"--ve-layers {cfg.ve_layers!r}: {e}") from None
    need(not cfg.ve_layers or (len(ve) == k and all(0 <= i < n for i in ve)),
         f"--ve-layers {cfg.ve_layers!r}: name --value-embeds ({k}) layers, each in 0..{n - 1}")
    clash = sorted(set(ve) & layers["no_attn_layers"])
    need(not clash, f"--value-embeds {k} feeds layer {clash[0] if clash else ''}, which --no-attn-layers leaves "
                    f"without attention; drop it from --no-attn-layers or lower --value-embeds")
    check_model89(cfg, need, layers["no_attn_layers"])
    dc = layers["dc_layers"]
    need(not dc or (cfg.mudd_gates and min(dc) >= cfg.mudd_gates and not dc & layers["paired_head_layers"]
                    and not dc & layers["no_attn_layers"]),
         f"--dc-layers {cfg.dc_layers!r}: the DC weights come from --mudd-gates G's second MLP: name layers >= G "
         f"(G = {cfg.mudd_gates}; 0 = no gate MLPs) with attention and without paired heads")
    need(cfg.attn_scale >= 0, f"--attn-scale must be >= 0 (got {cfg.attn_scale}); 0 = 1/sqrt(head_dim)")
    head_dim = cfg.model_dim // cfg.n_head
    need(not cfg.rope_half or head_dim % 4 == 0, f"--rope-half needs head_dim (model_dim / n_head = {head_dim}) "
                                                 f"a multiple of 4")
    need(not layers["paired_head_layers"] or cfg.n_head % 2 == 0,
         f"--paired-head-layers pairs heads: --n-head {cfg.n_head} must be even")
    need(not layers["attn_gate_layers"] or cfg.model_dim >= 12,
         "--attn-gate-layers reads 12 channels: --model-dim >= 12")
    need(0.0 <= cfg.lr_floor <= 1.0, f"--lr-floor must be in [0, 1] (got {cfg.lr_floor})")


def layers_past_end(cfg, lists):
    """The flags that name a layer >= --n-layer, for one message that lists them all.

    Args:
        cfg: the Config. lists: the parsed comma-list flags, ``{field name: frozenset of layers}``.

    Returns:
        Their flags, then --ve-layers, --skip-gate and --attn-state-layer (whose next layer must exist)
        where they do; an entry that does not parse is left to its own flag's message.
    """
    named = dict(lists)
    for name in ("ve_layers", "skip_gate"):
        named[name] = {int(t) for t in getattr(cfg, name).split(",") if t.strip().isdecimal()}
    named["attn_state_layer"] = {cfg.attn_state_layer + 1}
    return [flag_of(name) for name, found in named.items() if any(i >= cfg.n_layer for i in found)]


def ve_layer_list(cfg):
    """Layers fed by the value-embedding tables: entry i is fed by table i mod k (k = --value-embeds); --ve-layers
    in its order, else the first k and the last k layers (table j feeds layers j and n - k + j)."""
    if cfg.ve_layers:
        return [int(t) for t in cfg.ve_layers.split(",")] if layer_set(cfg.ve_layers) else []
    k, n = cfg.value_embeds, cfg.n_layer
    return [*range(k), *range(n - k, n)] if k else []


def skip_pair(cfg):
    """``--skip-gate 'a,b'`` as ``(a, b)``, or None.

    Raises:
        ValueError: not two 0-based layer numbers, or not a < b < n_layer.
    """
    if not cfg.skip_gate:
        return None
    entries = [t.strip() for t in cfg.skip_gate.split(",")]
    if len(entries) != 2 or not all(t.isdecimal() for t in entries):
        raise ValueError("give two 0-based layer numbers 'a,b', e.g. 3,6")
    a, b = map(int, entries)
    if not a < b < cfg.n_layer:
        raise ValueError(f"need a < b < n_layer ({cfg.n_layer})")
    return a, b


def check_model89(cfg, need, no_attn):
    """The checks of record #89's residual and input flags (part of ``check_architecture``)."""
    try:
        skip = skip_pair(cfg)
    except ValueError as e:
        raise ConfigError(f"--skip-gate {cfg.skip_gate!r}: {e}") from None
    need(cfg.attn_state_layer < cfg.n_layer - 1,
         f"--attn-state-layer {cfg.attn_state_layer} must be below the last layer ({cfg.n_layer - 1})")
    need(cfg.bigram_dim <= cfg.model_dim, f"--bigram-dim {cfg.bigram_dim} exceeds --model-dim {cfg.model_dim}")
    need(cfg.bigram_vocab != 1, "--bigram-vocab must be 0 (off) or >= 2 (one row is kept for position 0)")
    need(not cfg.bigram_vocab or 0 not in no_attn,
         "--bigram-vocab enters the stream through layer 0's attention gate: drop 0 from --no-attn-layers")
    need(not cfg.smear or cfg.model_dim >= 12, "--smear reads 12 channels: --model-dim >= 12")
    need(not cfg.ve_gate or (cfg.value_embeds > 0 and cfg.model_dim >= 6),
         "--ve-gate needs --value-embeds > 0 and --model-dim >= 6")
    need(not cfg.mudd or (skip and cfg.attn_state_layer >= 0 and cfg.ve_gate and cfg.n_head % 2 == 0
                          and cfg.n_layer - 1 not in no_attn), "--mudd needs --skip-gate, --attn-state-layer, "
         "--value-embeds with --ve-gate, an even --n-head and attention in the last layer")
    for flag in ("paired_head_layers", "xsa_layers", "attn_gate_layers"):  # attention elements need attention
        idle = sorted(layer_set(getattr(cfg, flag)) & no_attn)
        need(not idle, f"--{flag.replace('_', '-')} names layer(s) {idle} that --no-attn-layers leaves without "
             f"attention: drop them from one of the two")
    G = cfg.mudd_gates
    need(not G or (cfg.x0_gates and cfg.bigram_vocab and skip),
         f"--mudd-gates {G} needs --x0-gates, --bigram-vocab and a --skip-gate 'a,b' with b >= {G}")
    need(not G or G <= skip[1], f"--mudd-gates {G}: give 0 (no gate MLPs) or 1..{skip and skip[1]}; the skip's factor (--skip-gate "
         f"{cfg.skip_gate!r}) comes from the second gate MLP, which must start by the skip's layer")


def layer_set(text):
    """The layers a comma-list flag names ("1,2,5") as a frozenset of ints; "" = none.

    Raises:
        ValueError: an entry is not a non-negative integer (an empty one included), or repeats.
    """
    entries = [t.strip() for t in text.split(",")] if text.strip() else []
    if not all(t.isdecimal() for t in entries):
        raise ValueError("give 0-based layer numbers separated by commas, e.g. 1,2,5 (no empty entry)")
    layers = frozenset(map(int, entries))
    if len(layers) != len(entries):
        raise ValueError("a layer is given twice")
    return layers


# Eager FlexAttention (torch's reference implementation, what runs without --compile) builds fp32
# scores [B, n_head, T, T] per layer: its backward holds four such buffers at once (the scores, the
# masked scores, their softmax and its gradient: torch's sdpa_dense_backward), a forward without
# gradients two (the scores and the masked scores: math_attention).
EAGER_FLEX_BUFFERS = {"train": 4, "val": 2}


def val_chunk_tokens(cfg):
    """Tokens per metric (s = 1) val chunk: --val-seq-len (HEAD: 262,144), else --seq-len, never more than
    --val-tokens (a longer chunk would pad one forward to score fewer tokens)."""
    return min(cfg.val_seq_len or cfg.seq_len, cfg.val_tokens)


def longest_train_sequence(cfg):
    """Positions of the longest train sequence: 3 x --seq-len in record #89's third stage with --grow-seq-len."""
    return cfg.seq_len * (3 if cfg.grow_seq_len and cfg.stages == "record89" else 1)


def eager_attention_bytes(cfg):
    """Least memory of one layer's eager FlexAttention, bytes: the larger of a train micro-step's
    (B = --micro-batch-seqs) and a validation forward's (B = --val-batch-seqs) buffers of fp32 scores,
    each ``B * n_head * T**2 * 4`` bytes, T the longest train sequence or the val chunk (--val-seq-len)."""
    train, val = cfg.n_head * longest_train_sequence(cfg) ** 2 * 4, cfg.n_head * val_chunk_tokens(cfg) ** 2 * 4
    return max(EAGER_FLEX_BUFFERS["train"] * cfg.micro_batch_seqs * train,
               EAGER_FLEX_BUFFERS["val"] * (cfg.val_batch_seqs or cfg.micro_batch_seqs) * val)


def check_eager_attention(cfg, use_compile, flex, device_bytes):
    """Refuse an eager (--no-compile) run whose FlexAttention cannot fit on the GPU.

    Args:
        cfg: the Config. use_compile: whether the run compiles. flex: whether the model attends
            through FlexAttention (document masks or windows on CUDA). device_bytes: the GPU's memory.

    Raises:
        ConfigError: one layer's eager scores (``eager_attention_bytes``) alone exceed ``device_bytes``;
            the message names --compile, whose fused kernel never builds them.
    """
    need = eager_attention_bytes(cfg)
    if flex and not use_compile and need > device_bytes:
        raise ConfigError(f"--no-compile: eager FlexAttention needs at least {need / 2**30:,.0f} GiB for one layer's "
                          f"fp32 attention scores (the longest train sequence or val chunk squared x {cfg.n_head} heads), "
                          f"more than the GPU's {device_bytes / 2**30:,.0f} GiB; run with --compile (its fused kernel "
                          f"never builds them)")


def grad_accum_steps(cfg, world):
    """Micro-batches per process per step: the step's sequences split evenly over processes and micro-batches
    (with --stages record89, stage 1's third of them too: a stage's batch is k thirds, k = 1, 2, 3).

    Raises:
        ConfigError: no even split; names the --micro-batch-seqs values that work, or, when no value
            can work with this many processes, the process counts that can.
    """
    seqs = cfg.batch_tokens // cfg.seq_len
    least = seqs // 3 if cfg.stages == "record89" else seqs  # the smallest step's sequences
    seqs = least if cfg.grow_seq_len and cfg.stages == "record89" else seqs  # every step: stage 1's count, longer
    if least % (cfg.micro_batch_seqs * world) == 0:
        return seqs // (cfg.micro_batch_seqs * world)
    what = (f"{least} sequences of stage 1's steps (--stages record89: a third of --batch-tokens / --seq-len)"
            if least != seqs else f"{seqs} sequences of a step (--batch-tokens / --seq-len)")
    fits = [m for m in range(1, least // world + 1) if least % (m * world) == 0]
    if fits:
        raise ConfigError(f"--micro-batch-seqs {cfg.micro_batch_seqs} x {world} process(es) does not divide the "
                          f"{what}; use one of {fits}")
    counts = [w for w in range(1, min(least, 64) + 1) if least % w == 0]
    thirds = 3 if cfg.stages == "record89" else 1
    raise ConfigError(f"{world} processes cannot share the {what} evenly, whatever --micro-batch-seqs; run with "
                      f"a process count in {counts} (one that divides them) or with --batch-tokens "
                      f"{world * cfg.micro_batch_seqs * thirds * cfg.seq_len} (or a multiple): "
                      f"{world * cfg.micro_batch_seqs} sequence(s) per step{' in stage 1' if thirds == 3 else ''}")


# Model FLOPs (--describe, the log's flops): the matmuls a forward runs, read from the model on the
# meta device, plus attention's products over the keys each layer's window lets a query see.

def attended_keys(seq_len, window):
    """Mean keys a query attends in a causal sequence of ``seq_len`` under ``window`` (0 = none):
    ``(1/L) sum_{q<L} min(q + 1, w + 1)`` (``kernels.mask_mod``: w + 1 keys, FA3's); document masks are not
    counted (they depend on the data)."""
    L = seq_len
    w = min(window + 1, L) if window else L
    return (w * (w + 1) // 2 + (L - w) * w) / L


class FlopProfile:
    """What a forward of ``make_model(cfg)`` multiplies, counted on the meta device (no memory, no data).

    ``n_matmul``: weights multiplied per latent position (FlopCounterMode's mm/addmm FLOPs / 2 per
    position): every ``nn.Linear`` the forward calls, LM head included, so a new weight is counted
    without an edit here; embeddings are lookups. ``layers``: (has attention, short window, paired
    heads) per block (``model.blocks[i].attn``, ``model.short``).
    """

    def __init__(self, cfg, make_model):
        from torch.utils.flop_counter import FlopCounterMode
        L = min(cfg.seq_len, 64)  # matmul FLOPs are linear in the positions: a short sequence tells them
        with torch.device("meta"):
            model = make_model(cfg)
            inputs = torch.zeros(1, L, 1, dtype=torch.int64)
        with FlopCounterMode(display=False) as counter:
            model(inputs)
        ops = counter.get_flop_counts()["Global"]
        matmul = sum(n for op, n in ops.items() if op.__name__.split(".")[0] in ("mm", "addmm"))
        self.n_matmul = int(matmul) // (2 * L)
        self.layers = [(block.attn is not None, i in model.short, block.attn is not None and block.attn.paired)
                       for i, block in enumerate(model.blocks)]
        self.dc_windows = [block.attn.dc_window for block in model.blocks if block.attn is not None and
                           block.attn.dc_window]
        self.cfg = cfg

    def per_position(self, window, seq_len=None):
        """Training FLOPs per latent position under ``window`` (long, short) in sequences of ``seq_len`` (None:
        --seq-len; a stage's own with --grow-seq-len): ``6 N_matmul + 12 d keys``.

        12 d per attended key: QK^T and AV, forward and backward, over each attention layer's keys
        (``attended_keys``; PaLM's accounting, arXiv 2204.02311 app. B, exact for the window). A
        paired-head layer (record #58) runs n_head/2 heads over 2L positions: 12 d keys of the doubled
        sequence. A DC layer (record #85) adds its own QK^T and AV over its 112 keys. TST phase 1 costs the
        same per latent position.
        """
        long, half = window
        L = seq_len or self.cfg.seq_len
        keys = sum(attended_keys(2 * L if paired else L, half if short else long)
                   for attn, short, paired in self.layers if attn)
        keys += sum(attended_keys(L, w - 1) for w in self.dc_windows)  # w keys: a window of w - 1
        return 6 * self.n_matmul + 12 * self.cfg.model_dim * keys


# Dense bf16 peak of one GPU in TFLOP/s (NVIDIA datasheets, SXM parts), for --describe's projections.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0}

# The utilization modded-nanogpt's records reach: record #21 (2025-01-26; 2.933 min = 175.98 s on
# 8 x H100, the README's record table) trained its 12 x 768 model for 1,770 steps of 393,216
# positions, 5.517e17 model FLOPs by FlopProfile's count (taken while its recipe was a preset here):
# 5.517e17 / (175.98 s x 8 x 989e12 FLOP/s) = 39.6% of the H100's dense bf16 peak, its LM head in FP8
# (record #19). (Record #89, 2026-07-17, 1.23 min in its record table, on our count of its recipe and
# model, 2.512e17 FLOPs (`--preset baseline_h200 --describe`), is 43.0%; at its logs' mean train_time,
# 79.7 s, 39.8%: docs/RECORD89.md.)
RECORD_MFU = 0.396
GPU_CHECK_REPORTS = ("bench/out/gpu_check*/gpu_check.json", "bench/out/gpu_check*.json")  # under the repository


def _duration(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.2g} s"


def plan_summary(cfg, n_params, table):
    """What a run would do, from its parameter count and stage table (``Trainer.plan``).

    Args:
        cfg: the run's Config.
        n_params: the model's parameter count.
        table: the stage table: ``stages`` (each with ``start``, ``end``, ``phase``, ``bag_size``,
            ``mode``, ``batch_tokens``, ``doc_cap``, ``lr_mul``, ``raw_tokens(seq_len)``, ``length(seq_len)``),
            a row per step 0..N (``stage``, ``window``, ``flops_per_position``) and ``val_chunk`` (tokens).

    Returns:
        ``dict(lines, flops_total, tokens_total, positions_total, steps)``: lines for the model and
        each stage (steps, positions, raw tokens read and FLOPs per step), the model FLOPs of all N
        steps (float), the raw train tokens read and latent positions trained (ints), N.
    """
    N, L = cfg.num_iterations, cfg.seq_len
    flops = [row.flops_per_position * row.stage.batch_tokens for row in table.rows[:N]]
    lines = [f"model: {n_params:,} parameters; {cfg.n_layer} layers x {cfg.model_dim}, {cfg.n_head} heads, "
             f"sequences of {' -> '.join(f'{n:,}' for n in dict.fromkeys(st.length(L) for st in table.stages))} "
             f"latent positions, window {table[0].window[0]} -> {table[N].window[0]}"]
    chunk = table.val_chunk
    n_chunks = -(-cfg.val_tokens // chunk)
    lines.append(f"validation: {cfg.val_tokens:,} tokens in {n_chunks:,} document-masked chunks of {chunk:,} tokens, "
                 f"chunk i on process i mod world: {-(-n_chunks // 8):,} per process on 8, {n_chunks:,} on 1 "
                 f"(the same chunks, so the same val loss, whatever the process count)")
    tst = any(st.phase == 1 for st in table.stages)  # a baseline (--tst-frac 0) has no TST phase to number
    for st in table.stages:
        what = f"TST {st.mode} s={st.bag_size}" if st.phase == 1 else "next-token"
        label = f"phase {st.phase} ({what})" if tst else "next-token (no TST)"
        recipe = (f", document cap {st.doc_cap}, windows (long, short) {table[st.start].window}, lr x{st.lr_mul}"
                  if cfg.stages != "flags" else "")
        n_seqs = st.batch_tokens // st.length(L)
        lines.append(f"{label}: steps [{st.start}, {st.end}): {st.batch_tokens:,} positions "
                     f"({n_seqs} sequence(s) of {st.length(L):,}) and {st.raw_tokens(L):,} tokens of text trained on per step"
                     f"{recipe}, {min(flops[st.start:st.end]):.3e} - {max(flops[st.start:st.end]):.3e} FLOPs per step")
    tokens = sum((st.end - st.start) * st.raw_tokens(L) for st in table.stages)
    positions = sum(row.stage.batch_tokens for row in table.rows[:N])
    # the log's tokens: count what a step reads, which is more than it trains on
    lines.append("tokens: a packed step also reads, and skips, the rest of each sequence's last document and any "
                 "document's text past the cap; the log's tokens: count that too, so they exceed tokens_total (by how "
                 "much depends on the documents' lengths)")
    return dict(lines=lines, flops_total=sum(flops), tokens_total=tokens, positions_total=positions, steps=N)


def measured_mfu(report):
    """The utilization a ``bench/gpu_check.py`` report (its JSON, a dict) measured, or None.

    Returns ``(mfu, gpu, presets)``: the timing runs' model FLOPs over their time (every timed
    stage of every preset, their kept steps) over the GPU's datasheet peak
    (``env.nominal_bf16_tflops``), and the presets timed; None for a dry run, a report without a
    timed stage, or a GPU without a datasheet figure.
    """
    env, timings = report.get("env") or {}, report.get("timing") or {}
    stages = {preset: [p for p in ((t or {}).get("stages") or {}).values() if p and p.get("flops_per_step")]
              for preset, t in timings.items()}
    stages = {preset: timed for preset, timed in stages.items() if timed}
    peak = env.get("nominal_bf16_tflops")
    if report.get("mode") != "cuda" or not stages or not peak:
        return None
    timed = [p for ps in stages.values() for p in ps]
    flops = sum(p["flops_per_step"] * p["steps_used"] for p in timed)
    seconds = sum(p["ms_per_step"] * p["steps_used"] for p in timed) / 1e3
    return flops / seconds / (peak * 1e12), env.get("gpu"), ", ".join(stages)


def find_gpu_check(path=None):
    """``(path, report)`` of the gpu_check report ``--describe`` projects from, or None.

    Args:
        path: a report given with --gpu-check, or None: the newest of ``GPU_CHECK_REPORTS`` that
            measured a utilization (``measured_mfu``).

    Raises:
        ConfigError: ``path`` cannot be read as a JSON report, or measured nothing.
    """
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--gpu-check {path}: cannot read it as a gpu_check JSON report ({e})") from None
        if measured_mfu(report) is None:
            raise ConfigError(f"--gpu-check {path}: the report has no timed CUDA phase (a dry run, or the run failed)")
        return path, report
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted((p for pattern in GPU_CHECK_REPORTS for p in glob.glob(os.path.join(here, pattern))),
                   key=os.path.getmtime, reverse=True)
    for p in found:
        try:
            with open(p, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        if measured_mfu(report) is not None:
            return p, report
    return None


# Peak memory of one process, per byte of its parts (docs/MEMORY.md): float32 weights and gradients, the
# optimizer's state (CautiousAdam keeps 3 float32 copies: moments and the 2-step gradient sum; Adam 2;
# taken for every parameter: an upper bound where NorMuon keeps 1), and per trained position of a
# micro-batch: LOGIT_COPIES float32 rows of the vocabulary (logits, softmax, gradient) and ACT_PER_LAYER
# saved activations of model_dim per layer. Fitted on a CPU run of cpu_smoke (tests/test_reliability.py).
OPT_COPIES = {"normuon": 3, "aurora_normuon": 3}  # any other optimizer: Adam on part, 2 copies at most
LOGIT_COPIES, ACT_PER_LAYER = 3, 25
# The validation forward (no gradients, nothing saved for a backward) over val_batch_seqs x the val chunk:
# VAL_LOGIT_COPIES float32 vocabulary rows (logits, their softmax) for one head piece of positions at a time,
# and VAL_ROWS + n_layer live model_dim rows per position (stream, x0, q/k/v, attention out, the 4-wide MLP
# hidden, value and bigram embeddings; n_layer: a stash of every layer's output, as MUDD keeps): a bound, not fitted.
VAL_LOGIT_COPIES, VAL_ROWS = 2, 16


def memory_estimate(cfg, n_params, cuda=True, seq_len=None, val=None):
    """Estimated peak bytes per process of a run of ``cfg`` with ``n_params`` parameters: ``dict(parameters,
    gradients, optimizer, activations, logits, total, peak)``; activations (logits included) for one micro-batch
    of ``micro_batch_seqs x seq_len`` positions (``seq_len``: the longest stage's, default --seq-len), bf16 on
    CUDA (``cuda``), float32 on CPU; logits float32. ``val``: ``(val chunk, head piece)`` in positions, adds
    ``val_activations`` (the validation forward's, ``VAL_ROWS``) and takes ``total`` as the larger of the
    train and val peaks, ``peak`` naming which ("train" or "val")."""
    positions = cfg.micro_batch_seqs * (seq_len or cfg.seq_len)
    params = 4 * n_params
    width = 2 if cuda else 4
    logits = positions * LOGIT_COPIES * cfg.vocab_size * 4
    layers = positions * ACT_PER_LAYER * cfg.n_layer * cfg.model_dim * width
    out = dict(parameters=params, gradients=params, optimizer=OPT_COPIES.get(cfg.optimizer, 2) * params,
               activations=logits + layers, logits=logits, peak="train")
    state = out["parameters"] + out["gradients"] + out["optimizer"]
    out["total"] = state + out["activations"]
    if val:
        chunk, piece = val
        seqs = cfg.val_batch_seqs or cfg.micro_batch_seqs
        piece_positions = seqs * min(chunk, max(1, piece // seqs))  # head_pieces: piece // B positions along L
        out["val_activations"] = (piece_positions * VAL_LOGIT_COPIES * cfg.vocab_size * 4
                                  + seqs * chunk * (VAL_ROWS + cfg.n_layer) * cfg.model_dim * width)
        if state + out["val_activations"] > out["total"]:
            out["total"], out["peak"] = state + out["val_activations"], "val"
    return out


def memory_line(cfg, n_params, seq_len=None, val=None):
    """``--describe``'s memory line (GiB per GPU, parts and total) at the longest stage's ``seq_len`` and the
    validation forward's ``val`` = ``(val chunk, head piece)`` (``memory_estimate``)."""
    seq_len = seq_len or cfg.seq_len
    est = memory_estimate(cfg, n_params, seq_len=seq_len, val=val)
    m = {k: v / 2**30 for k, v in est.items() if k != "peak"}
    val_part = (f", the validation forward's {m['val_activations']:.2f} GiB ({cfg.val_batch_seqs or cfg.micro_batch_seqs}"
                f" x {val[0]:,} positions, no gradients)" if val else "")
    peak = "the validation forward" if est["peak"] == "val" else "a train micro-batch"
    lower = memory_flags(cfg)
    if est["peak"] == "val":
        lower = (f"--val-batch-seqs (now {cfg.val_batch_seqs or cfg.micro_batch_seqs}) or --val-seq-len "
                 f"(now {val[0]:,}) for the validation forward; " + lower)
    return (f"memory_estimate: per GPU, one micro-batch of {cfg.micro_batch_seqs} x {seq_len:,} positions: "
            f"parameters {m['parameters']:.2f} GiB, gradients {m['gradients']:.2f} GiB, optimizer state "
            f"{m['optimizer']:.2f} GiB, activations {m['activations']:.2f} GiB (logits {m['logits']:.2f}){val_part}; "
            f"peak about {m['total']:.1f} GiB, in {peak} (docs/MEMORY.md); to lower it: {lower}")


def describe(cfg, preset, trainer, gpu_check=None):
    """The lines of ``--describe``: what a run would do, computed without data, files or a GPU.

    The resolved config; the trainer's plan (``plan_summary``: the model, the stages, then
    ``flops_total`` (float, model FLOPs of all N steps), ``tokens_total`` (int, raw train tokens
    read), ``positions_total`` (int, latent positions trained), ``steps`` (int)); then the train
    time projected from ``flops_total`` at the records' utilization (``RECORD_MFU`` of each GPU's
    dense bf16 peak, ``PEAK_BF16_TFLOPS``) on 1 and 8 GPUs, and at the utilization gpu_check
    measured (``find_gpu_check(gpu_check)``) when a report exists.

    Raises:
        ConfigError: a ``gpu_check`` path that holds no measured report.
    """
    n_params, table = trainer.plan(cfg)
    plan = plan_summary(cfg, n_params, table)
    total = plan["flops_total"]
    lines = [f"describe: preset {preset or '(none)'}; nothing is read or run",
             "config: " + json.dumps(dataclasses.asdict(cfg), sort_keys=True), *plan["lines"],
             f"flops_total: {total:.4e}", f"tokens_total: {plan['tokens_total']}",
             f"positions_total: {plan['positions_total']}", f"steps: {plan['steps']}",
             memory_line(cfg, n_params, longest_train_sequence(cfg),
                         (table.val_chunk, table.val_piece) if hasattr(table, "val_piece") else None)]
    for gpu, tflops in PEAK_BF16_TFLOPS.items():
        for n_gpus in (1, 8):
            t = total / (n_gpus * RECORD_MFU * tflops * 1e12)
            lines.append(f"projected_train_time: {n_gpus} x {gpu} ({tflops:g} TFLOP/s bf16 dense each): {_duration(t)} "
                         f"at {100 * RECORD_MFU:.1f}% of peak (modded-nanogpt record #21's utilization)")
    found = find_gpu_check(gpu_check)
    if found:
        path, report = found
        mfu, gpu, presets = measured_mfu(report)
        peak = report["env"]["nominal_bf16_tflops"]
        lines.append(f"projected_train_time_measured: 1 x {gpu}: {_duration(total / (mfu * peak * 1e12))} at "
                     f"{100 * mfu:.1f}% of peak (measured by gpu_check on {presets}: {path})")
    return lines


# ----------------------------------------------------------------------------------------------
# Data files: which shards a run reads, identified by content

def resolve_files(pattern, flag):
    """Sorted files matching a glob. Raises DataError naming the flag when nothing matches."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataError(f"{flag} {pattern!r}: no file matches; download shards with "
                        f"`python data/cached_fineweb10B.py` or point {flag} (or DATA_DIR for run.sh) at shards")
    for f in files:  # a FIFO would block the first read, a folder fail it
        if os.path.isdir(f) and f == pattern:  # a folder given for the glob: name the glob it meant
            kind = "val" if "val" in flag else "train"
            raise DataError(f"{flag} {pattern!r} is a folder; give a glob of its shard files, e.g. "
                            f"'{os.path.join(f, f'*_{kind}_*.bin')}'")
        if not os.path.isfile(f):
            raise DataError(f"{f}: not a regular file (a folder, FIFO or device); {flag} must match shard files")
    return files


def fingerprint(path, n_bytes=1 << 20):
    """sha256 (16 hex) of a file's size, first and last MiB: fast, identifies a shard's contents."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256(str(size).encode())
            h.update(f.read(n_bytes))
            f.seek(max(0, size - n_bytes))
            h.update(f.read(n_bytes))
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror}); check the path, or {REMAKE}") from None
    return h.hexdigest()[:16]


GPT2_IDS = 50257  # ids 0..50256; the embedding's rows beyond (up to --vocab-size) are padding


class TokenStream:
    """The shards of a glob as one token stream with random access (the trainer's data streams read it).

    Args:
        files: shard paths, in stream order.
        wrap: reads past the end start over at token 0 (the train stream); else they raise.
        vocab_size: ids at or above it are refused (None: GPT-2's 50,257 ids).

    Raises:
        DataError: naming the file, for a bad header, a short or unreadable file, an id out of range
            or a stream without tokens; every shard is checked here, before step 0.
    """

    def __init__(self, files, wrap=False, vocab_size=None):
        self.files = list(files)
        self.sizes = [read_shard_header(f) for f in self.files]  # tokens per file
        self.shards = [load_shard(f, n) for f, n in zip(self.files, self.sizes)]
        for f, shard in zip(self.files, self.shards):  # every id and zero-filled tail, before step 0
            check_shard_tokens(f, shard, (vocab_size or GPT2_IDS) - 1)
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


def find_data(cfg):
    """``{"train": [[path, fingerprint], ...], "val": [...]}`` of the run's globs.

    Raises:
        DataError: a glob matches nothing, or a train file has a val file's content (the
            val tokens would be trained on).
    """
    data = {kind: [[f, fingerprint(f)] for f in resolve_files(pattern, flag)]
            for kind, pattern, flag in (("train", cfg.train_files, "--train-files"),
                                        ("val", cfg.val_files, "--val-files"))}
    val_fps = {fp: f for f, fp in data["val"]}
    for f, fp in data["train"]:
        if fp in val_fps:
            raise DataError(f"--train-files {cfg.train_files!r}: {f} has the content of val shard {val_fps[fp]}; "
                            f"training on val tokens voids the val loss: exclude it (e.g. '<dir>/*_train_*.bin')")
    return data


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume

CHECKPOINT_FORMAT = "train_gpt-checkpoint-1"
CHECKPOINT_HEADER = ("run_id", "step", "phase", "config", "data")  # what --resume's checks read: no tensors


def rank_buffers(model):
    """The model buffers that differ between ranks: the FP8 delayed scales (``kernels.down_scales``, HEAD's per
    process: each rank's last forward set its input scale), on the CPU."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if k.endswith("down_scales")}


def checkpoint_state(run, step):
    """Everything an exact resume needs: weights, optimizer states, stream position, counters, RNG, config, data."""
    return dict(config=dataclasses.asdict(run.cfg), step=step, phase=run.schedule[step].stage.phase,
                run_id=run.log.summary["run_id"], model=run.model.state_dict(),
                optimizers=[o.state_dict() for o in run.opts], loader_position=run.loader.position,
                counters=dataclasses.asdict(run.progress), data=run.data,
                rng=dict(torch=torch.get_rng_state(),
                         cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []))


def save_checkpoint(state, path):
    """Write a checkpoint atomically: serialize, checksum, write ``<path>.tmp.<pid>``, rename.

    The file is ``torch.save({"format", "sha256", "payload", "header"})`` where ``payload`` is the
    uint8 serialization of ``state``, so a truncated *or* bit-flipped file is detected on load, and
    ``header`` a copy of its CHECKPOINT_HEADER fields, read without the payload (``load_checkpoint``).

    Raises:
        ConfigError: the folder lacks the space (checked first: needed and free MB named) or
            the write fails (disk full, file too large, I/O error); the temporary file is removed.
    """
    inner, outer = io.BytesIO(), io.BytesIO()  # serialized in memory: a failed write is a plain OSError
    torch.save(state, inner)
    payload = inner.getbuffer()
    torch.save(dict(format=CHECKPOINT_FORMAT, sha256=hashlib.sha256(payload).hexdigest(),
                    header={k: state[k] for k in CHECKPOINT_HEADER if k in state},
                    payload=torch.frombuffer(payload, dtype=torch.uint8)), outer)
    folder, tmp = os.path.dirname(path) or ".", f"{path}.tmp.{os.getpid()}"
    need_mb = (outer.getbuffer().nbytes >> 20) + 1
    try:
        os.makedirs(folder, exist_ok=True)
        free_mb = shutil.disk_usage(folder).free >> 20
        if free_mb < need_mb:
            raise OSError(28, f"No space left: {need_mb} MB needed, {free_mb} MB free")
        with open(tmp, "wb") as f:
            f.write(outer.getbuffer())
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir: cannot write {path} ({e.strerror}; the checkpoint is ~{need_mb} MB); "
                          f"free space there or choose another --checkpoint-dir") from None
    finally:  # a failed write, or a signal during it, leaves no temporary file
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, header_only=False):
    """The state dict saved by ``save_checkpoint`` (model, optimizers, step, loader, RNG, config, data); with
    ``header_only`` its CHECKPOINT_HEADER fields alone, the payload memory-mapped and never read (run.sh's
    pre-flight: a record checkpoint is GBs, which every rank reads again); a checkpoint older than the header
    is read whole.

    Raises:
        ConfigError: missing file, not a checkpoint of this trainer, truncated, or corrupt
            (checksum mismatch); the message names the file and what to do.
    """
    if os.path.isdir(path):
        newest = max(((s, p) for p in glob.glob(os.path.join(glob.escape(path), "step_*.pt"))
                      if (s := checkpoint_step(p)) is not None), default=None)
        raise ConfigError(f"--resume {path}: a folder; give one of its checkpoint files"
                          + (f" (the newest: {newest[1]})" if newest else " (it holds no step_N.pt)")
                          + ", or --resume auto (the newest under --checkpoint-dir)")
    if not os.path.isfile(path):
        raise ConfigError(f"--resume {path}: no such checkpoint file")
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
    if not is_zip:
        raise ConfigError(f"--resume {path}: not a train_gpt.py checkpoint (give a checkpoints/<run_id>/step_N.pt)")
    try:
        outer = torch.load(path, map_location="cpu", weights_only=True, mmap=header_only)
    except Exception as e:  # torch raises several kinds for a truncated or mangled archive
        first = (str(e).splitlines() or [""])[0][:120]
        raise ConfigError(f"--resume {path}: truncated or unreadable checkpoint ({type(e).__name__}: "
                          f"{first}); resume from an older one") from None
    if not isinstance(outer, dict) or outer.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--resume {path}: not a train_gpt.py checkpoint")
    if header_only and isinstance(outer.get("header"), dict):
        return dict(outer["header"])
    payload = outer["payload"].numpy().tobytes()
    if hashlib.sha256(payload).hexdigest() != outer["sha256"]:
        raise ConfigError(f"--resume {path}: corrupt checkpoint (sha256 mismatch); resume from an older one")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def checkpoint_step(path):
    """The step of a checkpoint file named as ``checkpoint_path`` names them (``step_<N>.pt``), else None."""
    m = re.fullmatch(r"step_(\d+)\.pt", os.path.basename(path))
    return int(m[1]) if m else None


def find_latest_checkpoint(checkpoint_dir, run_id=""):
    """The highest-step ``step_NNNNNN.pt`` of a run under ``checkpoint_dir`` (``<dir>/<run_id>/`` if named).

    By step number, not file time: a copied folder loses its modification times.

    Raises:
        ConfigError: no checkpoint there, or checkpoints of several runs and no --run-id.
    """
    where = os.path.join(checkpoint_dir, run_id) if run_id else checkpoint_dir
    found = [(s, p) for p in glob.glob(os.path.join(where, "**", "step_*.pt"), recursive=True)
             if (s := checkpoint_step(p)) is not None]
    if not found:
        raise ConfigError(f"--resume auto: no checkpoint under {where!r} (--checkpoint-dir"
                          + (", --run-id)" if run_id else ")"))
    runs = sorted({os.path.dirname(p) for _, p in found})
    if len(runs) > 1:
        raise ConfigError(f"--resume auto: checkpoints of {len(runs)} runs under {where!r} "
                          f"({', '.join(os.path.relpath(r, where) for r in runs)}); "
                          + ("keep one folder of step_*.pt files there" if run_id else "name one with --run-id"))
    return max(found)[1]


def check_resume(state, cfg, data, trainer):
    """Differences in run-defining config fields and in the data between a checkpoint and this run.

    Returns the list of differences (continued past with ``--resume-force``).

    Raises:
        ConfigError: any difference without --resume-force, or a different model shape at all.
    """
    # a field newer than the checkpoint counts as its default there (what that trainer computed)
    saved = {**{f.name: f.default for f in fields(cfg)}, **state["config"]}
    diffs = [f"{k}: checkpoint {saved[k]!r} vs now {getattr(cfg, k)!r}"
             for k in trainer.run_defining if saved[k] != getattr(cfg, k)]
    shape, tensors = architecture_diffs(saved, cfg, diffs, trainer)
    if shape or any(d.split(":")[0] in trainer.shape_fields for d in diffs):
        raise ConfigError("--resume: the checkpoint holds a model of another shape ("
                          + "; ".join(shape or [d for d in diffs if d.split(":")[0] in trainer.shape_fields])
                          + (f"; tensors {tensors}" if tensors else "") + "); --resume-force cannot change the "
                          "architecture: use the checkpoint's model flags")
    for kind in ("train", "val"):
        was, now = state.get("data", data)[kind], data[kind]
        if [fp for _, fp in was] != [fp for _, fp in now]:
            diffs.append(f"{kind} data: checkpoint {len(was)} file(s) ({', '.join(os.path.basename(f) for f, _ in was)}) "
                         f"vs now {len(now)} ({', '.join(os.path.basename(f) for f, _ in now)}) with other contents")
    if diffs and not cfg.resume_force:
        raise ConfigError("--resume: the checkpoint was made with a different run config or data ("
                          + "; ".join(diffs) + "); use the same flags and shards, or --resume-force to continue anyway")
    return diffs


def architecture_diffs(saved, cfg, diffs, trainer):
    """``(entries, tensors)``: the entries of ``diffs`` whose flags change the model's state_dict between the
    checkpoint's config ``saved`` and ``cfg`` (each flag alone, else all of them when only together) and
    the line naming the tensors (``shape_mismatch``); ``([], None)`` when the state_dicts match."""
    if not diffs or trainer.model_shapes is None:
        return [], None

    def shapes(**changes):
        try:
            return trainer.model_shapes(dataclasses.replace(cfg, **changes))
        except Exception:  # noqa: BLE001 -- a model this code cannot build differs in structure
            return None
    now = trainer.model_shapes(cfg)
    changed = {k: saved[k] for k in trainer.run_defining if saved[k] != getattr(cfg, k)}
    was = shapes(**changed)
    if was == now:
        return [], None
    alone = [k for k in changed if shapes(**{k: changed[k]}) != now]
    tensors = shape_mismatch(was, now) if was is not None else None
    return [d for d in diffs if d.split(":")[0] in alone] or diffs, tensors


def prepare_resume(cfg, data, trainer, header_only=False):
    """``(state, path, diffs)`` of the checkpoint to resume from, checked before any file is written
    (``header_only``: the state's CHECKPOINT_HEADER fields alone, ``load_checkpoint``)."""
    path = find_latest_checkpoint(cfg.checkpoint_dir, cfg.run_id) if cfg.resume == "auto" else cfg.resume
    state = load_checkpoint(path, header_only)
    return state, path, check_resume(state, cfg, data, trainer)


def resolve_run(cfg, data, trainer, header_only=False):
    """``(resume, run_id)`` of a run, as ``preflight`` and ``start`` both take them: ``resume``
    ``prepare_resume``'s triple or None; ``run_id`` --run-id, else the resumed checkpoint's, else "" (a new
    unnamed run: ``start`` draws its id)."""
    resume = prepare_resume(cfg, data, trainer, header_only) if cfg.resume else None
    return resume, cfg.run_id or (resume[0]["run_id"] if resume else "")


def model_mismatch(saved, model):
    """One line naming the tensors in which a checkpoint's ``saved`` state_dict and ``model`` differ, or None."""
    return shape_mismatch({k: tuple(v.shape) for k, v in saved.items()},
                          {k: tuple(v.shape) for k, v in model.state_dict().items()})


def shape_mismatch(saved, now):
    """One line naming the tensors in which two ``{name: shape}`` state_dicts differ, or None."""
    missing = [k for k in now if k not in saved]
    extra = [k for k in saved if k not in now]
    shapes = [f"{k} {saved[k]} vs {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    parts = [f"{what} {len(names)}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
             for what, names in (("only in this run's model", missing), ("only in the checkpoint", extra),
                                 ("of another shape (checkpoint vs now)", shapes)) if names]
    return "; ".join(parts) or None


def restore_optimizers(run, saved):
    """Load the optimizer states, keeping this run's group settings (lr, wd, betas, momentum...: what
    --resume-force lets change) over the checkpoint's; returns ``["Class.key: old -> new", ...]`` changed."""
    changed = {}
    for opt, sd in zip(run.opts, saved):
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(sd)  # restores the checkpoint's group values too: put this run's back
        for g, new in zip(opt.param_groups, fresh):
            for key, value in new.items():
                if key not in ("lr", "momentum") and key in g and g[key] != value:  # the schedule sets those per step
                    changed.setdefault(f"{type(opt).__name__}.{key}", (g[key], value))
            g.update(new)
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()]


def restore(run, state, path):
    """Load a checkpoint's weights, optimizer states, stream position, counters and RNG; returns its step.

    Raises:
        ConfigError: the checkpoint's model has other tensors (an architecture flag differs), naming them.
    """
    # the FP8 delayed scales (kernels.down_scales) exist only in a --fp8 run on an sm_89+ GPU: a checkpoint may lack
    # them (the trainer bootstraps them) or hold them for a run without; every other key must match
    own = run.model.state_dict()
    saved = {k: v for k, v in state["model"].items() if k in own or not k.endswith("down_scales")}
    saved.update({k: v for k, v in own.items() if k.endswith("down_scales") and k not in saved})
    ranks = state.get("rank_buffers") or [{}]
    saved.update({k: v for k, v in ranks[run.rt.rank if len(ranks) == run.rt.world else 0].items() if k in own})
    mismatch = model_mismatch(saved, run.model)
    if mismatch:
        raise ConfigError(f"--resume {path}: the checkpoint's model differs from this run's in its tensors ({mismatch});"
                          f" --resume-force cannot change the architecture: use the checkpoint's model flags")
    run.model.load_state_dict(saved)
    changed = restore_optimizers(run, state["optimizers"])
    if changed:
        run.log.line("resume_force: the new optimizer settings apply: " + "; ".join(changed))
    run.loader.position = state["loader_position"]
    run.progress = type(run.progress)(**state["counters"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and run.rt.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    p = run.progress
    run.log.line(f"resume: from {path} at step {state['step']} (phase {state['phase']}) "
                 f"train_time:{p.train_time_ms:.0f}ms tokens:{p.raw_tokens}")
    return state["step"]


def checkpoint_path(run, step):
    return os.path.join(run.cfg.checkpoint_dir, run.log.summary["run_id"], f"step_{step:06d}.pt")


def save(run, step, log_line=True, periodic=False):
    """Checkpoint ``<dir>/<run_id>/step_NNNNNN.pt`` (rank 0 writes; every rank waits). Never non-finite weights.

    ``log_line=False``: the ``checkpoint:`` line is printed, not logged (the log's ``status:`` line,
    written before, already names the file). ``periodic``: a --save-every checkpoint, after which
    the older ones beyond --keep-checkpoints are deleted (``prune_checkpoints``).
    """
    run.guard.check(run.model)
    own = rank_buffers(run.model)
    ranks = [own]
    if run.rt.distributed and own:  # every rank's own FP8 delayed scales (a collective: every rank is here)
        ranks = [None] * run.rt.world
        dist.all_gather_object(ranks, own)
    if run.rt.master:
        path = checkpoint_path(run, step)
        save_checkpoint(dict(checkpoint_state(run, step), rank_buffers=ranks), path)
        if log_line:
            run.log.line(f"checkpoint: step {step} -> {path}")
        else:
            print(f"checkpoint: step {step} -> {path}", flush=True)
        if periodic:
            prune_checkpoints(run, path)
    if run.rt.distributed:
        dist.barrier()


def prune_checkpoints(run, path):
    """Record the --save-every checkpoint ``path`` just written, then delete this process's older
    --save-every checkpoints beyond the newest ``cfg.keep_checkpoints`` (0: keep all), one
    ``checkpoint: removed`` line each.

    Only the paths this process wrote as periodic checkpoints (``run.log.checkpoints``) are ever
    deleted: never a --save-final or --save-on-interrupt one, the one a resume started from, or
    a file of another run. A file that cannot be deleted is logged and the run goes on.

    Args:
        run: the trainer's run (``cfg``, ``log``); rank 0 only.
        path: the checkpoint just written, the newest.
    """
    written, keep = run.log.checkpoints, run.cfg.keep_checkpoints
    written.append(path)
    while keep and len(written) > keep:
        old = written.pop(0)
        try:
            os.remove(old)
        except FileNotFoundError:  # removed by hand meanwhile: nothing to say
            continue
        except OSError as e:
            run.log.line(f"checkpoint: could not remove {old} ({e.strerror}); it stays")
            continue
        run.log.line(f"checkpoint: removed {old} (--keep-checkpoints {keep})")


def check_checkpoint_dir(cfg, run_id, resume=None):
    """Fail at start-up, not after hours of training, when checkpoints cannot be written, or when they would
    overwrite (and --keep-checkpoints then delete) those another run left under the same run id, or those of
    its own later steps that a --resume-force past differences would replace with another trajectory.

    Args:
        cfg: the run's config (--checkpoint-dir, the --save-* flags).
        run_id: the run's id: its checkpoints go to ``<checkpoint_dir>/<run_id>/``.
        resume: ``prepare_resume``'s ``(state, path, diffs)`` of the checkpoint this run resumes (None: a new
            run); only a run that continues its own run id may write where step_*.pt files already are.

    Raises:
        ConfigError: the folder cannot be written, or it holds checkpoints this run does not continue.
    """
    if not (cfg.save_every or cfg.save_final or cfg.save_on_interrupt):
        return
    where = os.path.join(cfg.checkpoint_dir, run_id)
    found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(where), "step_*.pt")))
    if found and (resume[0]["run_id"] if resume else None) != run_id:
        raise ConfigError(f"--run-id {run_id}: {where} already holds checkpoints of a run under that id "
                          f"({', '.join(found[:2])}{' ...' if len(found) > 2 else ''}); choose another --run-id, "
                          f"continue that run with --resume auto --run-id {run_id}, or move them away")
    later = [f for f in found if resume and resume[2] and (checkpoint_step(f) or 0) > resume[0]["step"]]
    if later:  # the same steps again under other settings: those files would be overwritten with other weights
        raise ConfigError(f"--resume-force: {where} holds checkpoints after step {resume[0]['step']} "
                          f"({', '.join(later[:2])}{' ...' if len(later) > 2 else ''}) that this run, continuing "
                          f"past differences, would overwrite; give it a new --run-id, or move them away")
    try:
        os.makedirs(where, exist_ok=True)
        probe = os.path.join(where, f".write_test.{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir!r}: cannot write checkpoints there "
                          f"({e.strerror}); choose another --checkpoint-dir") from None


# ----------------------------------------------------------------------------------------------
# The run log: one text file per run, a reproducible snapshot (docs/SPEC.md), plus a JSON summary

SEPARATOR = "=" * 100  # between the source snapshot and the run
SOURCE_FILES = ("train_gpt.py", "kernels.py", "aurora_opt.py", "harness.py")  # what a log snapshots, in order


def source_snapshot():
    """The exact source of every file of SOURCE_FILES, each after a ``### file <name> lines=<n> sha256=<hex>`` line."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name in SOURCE_FILES:
        with open(os.path.join(here, name), encoding="utf-8") as f:
            text = f.read()
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        parts.append(f"### file {name} lines={len(text.splitlines())} sha256={digest}\n{text}")
        if not text.endswith("\n"):
            parts.append("\n")
    return "".join(parts)


def _run_quiet(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else ``platform``'s best guess."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return cpu


def environment_lines(rt):
    """Versions, host, devices (GPU model and nvidia-smi, or CPU model, cores and threads)."""
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
        lines.append(f"cpu: {cpu_model()}  cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}")
    return lines


def git_description():
    commit = _run_quiet(["git", "rev-parse", "HEAD"])
    if not commit:
        return "none (not a git checkout)"
    dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit + (" (uncommitted changes)" if dirty else "")


def log_exists(run_id, path):
    """The refusal of a new run whose log ``path`` exists (a log is never replaced)."""
    return ConfigError(f"--run-id {run_id}: {path} already exists; choose another --run-id "
                       f"(or continue that run with --resume)")


class RunLog:
    """The run's log file and JSON summary. Only rank 0 writes; every rank may call it.

    The text file holds, in order: source snapshot, separator, environment, command line,
    config, git commit, data files, step lines, summary, ``status:`` line. A new log never
    replaces an existing one; ``resume=True`` appends to the run's log when it exists.

    Raises:
        ConfigError: the log exists (and this is no resume), or --log-dir cannot be written
            (at creation or later, e.g. a full disk).
    """

    def __init__(self, cfg, rt, run_id, resume=False):
        self.cfg = cfg  # the out-of-memory line names its memory flags (known_failure)
        self.rt, self.path, self.json_path, self.is_new, self.file = rt, None, None, False, None
        self.marked = None  # (status, reason) of the status line written by mark()
        self.checkpoints = []  # the --save-every checkpoints this process wrote, oldest first (prune_checkpoints)
        self.summary = dict(run_id=run_id, status="running")
        if not rt.master:
            return
        path = os.path.join(cfg.log_dir, f"{run_id}.txt")
        json_path = os.path.join(cfg.log_dir, f"{run_id}.json")
        try:
            if not os.path.isdir(cfg.log_dir):
                os.makedirs(cfg.log_dir)
            if resume and os.path.exists(path):
                if os.path.exists(json_path):
                    self.summary = self._read_summary(json_path)
                if "final_val_loss" in self.summary:  # going on again: not final (an older trainer's name)
                    self.summary["last_val_loss"] = self.summary.pop("final_val_loss")
                self.file = open(path, "a", encoding="utf-8")
            else:
                self.file = open(path, "x", encoding="utf-8")  # exclusive: never overwrite a run's log
                self.is_new = True
        except FileExistsError:
            if not os.path.isdir(cfg.log_dir):
                raise ConfigError(f"--log-dir {cfg.log_dir!r} is a file; choose another --log-dir") from None
            raise log_exists(run_id, path) from None
        except OSError as e:
            raise ConfigError(f"--log-dir {cfg.log_dir!r}: cannot write the log there ({e.strerror}); "
                              f"choose another --log-dir") from None
        self.path, self.json_path = path, json_path
        if self.is_new:
            try:
                self._write(source_snapshot() + SEPARATOR + "\n")
            except ConfigError:  # not even the snapshot fits: leave no partial log behind
                self.file.close()
                os.remove(path)
                raise

    @staticmethod
    def _read_summary(json_path):
        """The JSON summary of the run being resumed. Raises ConfigError when it is not valid JSON."""
        try:
            with open(json_path, encoding="utf-8") as f:
                summary = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"--resume: {json_path} is not valid JSON ({e}); restore it, or move it away "
                              f"to start a new summary") from None
        if not isinstance(summary, dict):
            raise ConfigError(f"--resume: {json_path} is not a run summary; restore it, or move it away")
        return summary

    def _write(self, text):
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:
            raise ConfigError(f"--log-dir: cannot write {self.path} ({e.strerror}); free space there "
                              f"or choose another --log-dir") from None

    def line(self, text, echo=True):
        if not self.rt.master:
            return
        if echo:
            print(text, flush=True)
        self._write(text + "\n")

    def update(self, **kw):
        self.summary.update(kw)

    def mark(self, status, reason=None):
        """Write the ``status:`` line and the JSON summary now, the file kept open: what a later
        SIGKILL leaves. ``finish`` with the same status and reason then adds no second line.

        Best effort: when even that cannot be written (a full disk), say so on stderr.
        """
        if not self.rt.master or self.path is None or self.file.closed:
            return
        reason = " | ".join(str(reason).split("\n")) if reason else None  # the status stays one line
        self.summary["status"] = status
        self.summary.pop("reason", None)  # a resumed run's earlier stop reason no longer applies
        if reason:
            self.summary["reason"] = reason
        tmp = self.json_path + ".tmp"
        try:
            if self.marked != (status, reason):
                self.line(f"status:{status}" + (f" reason:{reason}" if reason else ""))
            self.marked = (status, reason)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.summary, f, indent=1)
            os.replace(tmp, self.json_path)
        except (OSError, ConfigError) as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            print(f"train_gpt.py: could not finish the log {self.path} as {status} ({e})", file=sys.stderr)

    def finish(self, status, reason=None):
        """Write the final ``status:`` line (unless ``mark`` wrote it) and the JSON summary
        (``complete``, ``incomplete``, ...), and close the log."""
        if not self.rt.master or self.path is None or self.file.closed:
            return
        try:
            self.mark(status, reason)
        finally:
            try:
                self.file.close()
            except OSError:  # the last flush failed: already reported
                pass


def log_run_header(log, cfg, rt, preset, resume, data, streams):
    """Every start (a resume too, maybe on another machine) records where and how it ran, and on what data."""
    if resume and resume[2]:
        log.line("resume_force: continuing despite differences: " + "; ".join(resume[2]))
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
    for kind, stream in zip(("train", "val"), streams):
        for (f, fp), n in zip(data[kind], stream.sizes):
            log.line(f"data {kind}: {f} tokens:{n} bytes:{os.path.getsize(f)} fingerprint:{fp}", echo=False)
    if getattr(cfg, "objectives", False):  # the prefix-token table's source: records/verify.py checks it
        try:
            size = os.path.getsize(GPT2_ENCODER_JSON)
        except OSError:
            gpt2_token_bytes()  # raises its DataError naming the file and the fix
        log.line(f"data tokenizer: data/gpt2_bpe/encoder.json bytes:{size} fingerprint:{fingerprint(GPT2_ENCODER_JSON)}",
                 echo=False)


def peak_memory_mib(rt):
    if rt.device.type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    import resource  # peak resident set size of this process, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def log_summary(run, end_step, compile_ms, complete):
    """The summary line and JSON fields of a run that reached ``end_step``.

    Args:
        run: the trainer's run (``log``, ``rt``, ``progress``, ``loader``).
        end_step: the steps done.
        compile_ms: the warm-up's time.
        complete: True when ``end_step`` is the run's last step: its last val loss (always at that
            step) becomes ``final_val_loss``; a run stopped early by --max-steps names it
            ``last_val_loss`` with its ``val_step`` instead, so that no earlier loss reads as a final one.
    """
    p, log, peak = run.progress, run.log, peak_memory_mib(run.rt)
    log.update(**dataclasses.asdict(p), steps=end_step, flops_per_position=p.flops / max(p.positions, 1),
               train_epochs=round(run.loader.position / run.loader.stream.total, 4),
               peak_memory_mib=round(peak, 1), world_size=run.rt.world)
    if complete and "last_val_loss" in log.summary:
        log.summary["final_val_loss"] = log.summary.pop("last_val_loss")
    nan = float("nan")
    val = (f"final_val_loss:{log.summary.get('final_val_loss', nan):.4f}" if complete else
           f"last_val_loss:{log.summary.get('last_val_loss', nan):.4f} val_step:{log.summary.get('val_step')}")
    log.line(SEPARATOR)
    log.line(f"summary: {val} "
             f"train_time:{p.train_time_ms:.0f}ms steps:{end_step} raw_tokens:{p.raw_tokens} "
             f"positions:{p.positions} flops:{p.flops:.3e} peak_memory:{peak:.0f}MiB "
             f"compile_time:{compile_ms:.0f}ms")


def run_outcome(run, end_step, stopped_at, compile_ms, graphs_before):
    """Log the end of a run's loop and return its ``(status, reason)`` for ``main``.

    Args:
        run: the trainer's run (``log``, ``cfg``, ``rt``, ``progress``, ...).
        end_step: the step the loop was to stop at.
        stopped_at: the steps done when a signal stopped the loop, or None.
        compile_ms: the warm-up's time.
        graphs_before: ``compiled_graphs()`` before the loop (with --compile).

    Returns:
        ``("interrupted", why)``, ``("stopped_early", "--max-steps N")`` or ``("complete", None)``.
    """
    log, cfg = run.log, run.cfg
    if stopped_at is not None:
        log.update(**dataclasses.asdict(run.progress), steps=stopped_at)
        return "interrupted", interrupt_reason(run, stopped_at)
    if run.rt.compile:
        log.update(graphs_compiled_during_training=compiled_graphs() - graphs_before)
    log_summary(run, end_step, compile_ms, complete=end_step == cfg.num_iterations)
    if end_step < cfg.num_iterations:
        return "stopped_early", f"--max-steps {cfg.max_steps}"
    return "complete", None


# ----------------------------------------------------------------------------------------------
# The loop's clock, NaN guard and log lines (nothing here changes what a run computes)

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
                                     f"({self.lr_flags}; with --resume-force from a checkpoint the new value "
                                     f"applies) or check the data")
        if model is not None and not all(torch.isfinite(p).all() for p in model.parameters()):
            raise FloatingPointError(f"a weight is not finite; lower the lr ({self.lr_flags}); "
                                     f"no checkpoint was written")


def lr_flags(cfg):
    """The flags that set ``cfg``'s learning rates, for the non-finite loss message: only those its optimizers read."""
    if cfg.optimizer in ("normuon", "aurora_normuon"):  # record #89's Adam lrs are fixed multiples, no flag
        return "--matrix-lr"
    return ("--adamw-lr" if cfg.optimizer == "adamw" else "--matrix-lr") + ", --embed-lr, --head-lr"


def step_line(step, cfg, what, value, train_time_ms, extra):
    """``step:{n}/{N} {what}:{x:.4f} train_time:{ms}ms step_avg:{ms:.2f}ms k:v ...`` (modded-nanogpt shape)."""
    avg = train_time_ms / max(step, 1)
    fields_ = " ".join(f"{k}:{v}" for k, v in extra.items())
    return (f"step:{step}/{cfg.num_iterations} {what}:{value:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{avg:.2f}ms {fields_}").rstrip()


def log_wrap(run, step):
    stream = run.loader.stream
    run.log.line(f"data: the train stream ({stream.total} tokens) wrapped around during step {step}; from "
                 f"here on tokens are read again (epoch {(run.loader.position - 1) // stream.total + 1})")


def _progress_fields(progress):
    return dict(tokens=progress.raw_tokens, positions=progress.positions, flops=f"{progress.flops:.3e}")


def log_train_line(run, step, loss, scale):
    """Log the train loss after ``step`` steps (one host sync; the NaN guard's check first).

    Args:
        run: the trainer's run (``log``, ``cfg``, ``progress``, ``guard``, ``schedule``).
        step: optimizer steps done.
        loss: the last step's loss, a 0-d device tensor.
        scale: the step's lr multiplier (a float).

    Raises:
        FloatingPointError: a loss since the last check was not finite.
    """
    run.guard.check()
    value, p = loss.item(), run.progress
    run.log.summary.setdefault("train_losses", []).append([step, value])
    run.log.line(step_line(step, run.cfg, "train_loss", value, p.train_time_ms, dict(
        phase=run.schedule[step - 1].stage.phase, **_progress_fields(p), lr_scale=f"{scale:.4f}")))


def log_val_line(run, step, loss, phase, loss_tst=None):
    """Log the val loss at ``step`` and record it as the run's ``last_val_loss`` (with ``val_step``).

    Only the end of a complete run names it ``final_val_loss`` (``log_summary``): the JSON of a
    run stopped or failed before that keeps ``last_val_loss``, never a ``final_val_loss``.

    Args:
        run: the trainer's run (``log``, ``cfg``, ``progress``).
        step: optimizer steps done.
        loss: the next-token val loss (a float).
        phase: the TST phase that trained the model so far.
        loss_tst: the phase-1 objective's val loss, or None outside phase 1.
    """
    extra = dict(phase=phase, **({} if loss_tst is None else dict(val_loss_tst=f"{loss_tst:.4f}")))
    run.log.line(step_line(step, run.cfg, "val_loss", loss, run.progress.train_time_ms,
                           dict(extra, **_progress_fields(run.progress))))
    run.log.update(last_val_loss=loss, val_step=step)


def log_stage(run, step):
    """Log the first step of a stage: ``tst_switch`` when TST ends, else ``stage``.

    Args:
        run: the trainer's run (``log``, ``schedule`` with rows ``.stage``, ``progress``).
        step: the stage's first step (> 0).
    """
    was, now = run.schedule[step - 1].stage, run.schedule[step].stage
    tail = f"same weights and optimizer state; tokens:{run.progress.raw_tokens}"
    if (was.phase, now.phase) == (1, 2):
        run.log.line(f"tst_switch: step {step}: phase 1 -> 2 (bag_size {was.bag_size} -> {now.bag_size}, mode "
                     f"{was.mode} -> next-token); {tail}")
        return
    changes = [f"{name} {getattr(was, name)} -> {getattr(now, name)}"
               for name in ("bag_size", "mode", "batch_tokens", "seq_len", "doc_cap", "blocks", "lr_mul")
               if getattr(was, name) != getattr(now, name)]
    run.log.line(f"stage: step {step}: {', '.join(changes) or 'a new stage'}; {tail}")


def log_model_line(run):
    """Log the parameter count, step 0's FLOPs per position, the accumulation and the TST stages.

    Args:
        run: the trainer's run (``log``, ``cfg``, ``rt``, ``model``, ``schedule``).
    """
    cfg, rt = run.cfg, run.rt
    n_params = sum(p.numel() for p in run.model.parameters())
    tst = ", ".join(f"{st.mode} s={st.bag_size} for steps [{st.start}, {st.end})"
                    for st in run.schedule.stages if st.phase == 1) or "off"
    run.log.line(f"model: {n_params:,} parameters, {run.schedule[0].flops_per_position:,.0f} FLOPs per latent "
                 f"position at step 0; "
                 f"grad accumulation {rt.accum} x {cfg.micro_batch_seqs} seqs x {rt.world} processes; TST {tst}")


def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------------------------
# Processes, signals, main

def answer_describe(argv, trainer, cfg, preset):
    """Print ``describe``'s lines on stdout when ``argv`` asks for --describe.

    Args:
        argv: the command-line words; cfg, preset: what ``parse_config`` made of them.
        trainer: the ``Trainer`` whose flags they are.

    Returns:
        True when the description was printed (the run stops there), else False.

    Raises:
        ConfigError: an unreadable --gpu-check report (``describe``).
    """
    known = build_parser(trainer).parse_known_args(argv)[0]
    if known.gpu_check is not None and not known.describe:
        raise ConfigError(f"--gpu-check {known.gpu_check}: it applies to --describe only (a run would ignore it); "
                          "add --describe, or drop it")
    if known.describe:
        print("\n".join(describe(cfg, preset, trainer, known.gpu_check)))
    return known.describe


def check_start(cfg, world, accum=None):
    """The start-up checks every rank of a ``world``-process run makes alike, before its process group forms:
    the device, the batch's split over the processes (``accum``: already checked, its result), the data files.
    Cheap (no model, no GPU memory): run.sh runs them once before torchrun starts (``preflight``), so that a
    refusal is one line.

    Returns:
        ``(device kind "cuda" or "cpu", micro-batches per process, find_data's files)``.

    Raises:
        ConfigError: --device cuda without a visible CUDA device, or a batch that does not split
            (``grad_accum_steps``).
        DataError: a glob that matches nothing or names a folder, or train files holding a val
            file's content (``find_data``).
    """
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    return kind, grad_accum_steps(cfg, world) if accum is None else accum, find_data(cfg)


def check_gpu_count(cfg, world):
    """ConfigError when ``world`` CUDA processes would outnumber the visible GPUs (one process per GPU:
    each extra rank would fail to take its device)."""
    if world > 1 and cfg.device != "cpu" and torch.cuda.is_available() and world > torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"{world} processes but {n} GPU(s) visible (one process per GPU); set NPROC to at most "
                          f"{n}, or unset it to use every GPU")


def check_forced_log(path, step):
    """Refuse a --resume-force past differences from step ``step`` into the log ``path`` of its own run when
    that log already holds later steps: they would be logged again under other settings, and the log and
    its JSON would then describe a run that no checkpoint of it made (ConfigError)."""
    last = step
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.match(r"step:(\d+)/\d+ ", line)
            last = max(last, int(m[1])) if m else last
    if last > step:
        raise ConfigError(f"--resume-force: {path} already logs steps {step + 1}..{last} of this run, which a "
                          f"continuation past differences from step {step} would log again under other settings; "
                          "give it a new --run-id (its own log)")


def check_run_files(cfg, run_id, resume, lock=None):
    """What rank 0 refuses at start for the files of run ``run_id`` (``preflight`` and ``start``): its lock (a
    run of that id going now, an unwritable --log-dir; ``RunLock``), a log of that id that a new run would not
    replace, and its checkpoint folder (``check_checkpoint_dir``).

    Args:
        cfg: the run's config; run_id: its id.
        resume: ``prepare_resume``'s ``(state, path, diffs)`` of the checkpoint it resumes, None for a new run.
        lock: the run's ``RunLock`` if already taken (``start`` locks a named run before reading its checkpoint).

    Returns:
        the run's ``RunLock``, held: the caller releases it (at once in ``preflight``, at the run's end in ``main``).

    Raises:
        ConfigError: any of these, naming the flag (as the run itself would); the lock is released first.
    """
    lock = lock or RunLock(cfg.log_dir, run_id)
    try:
        path = os.path.join(cfg.log_dir, f"{run_id}.txt")
        resumed_run_id = resume[0]["run_id"] if resume else None
        if resumed_run_id is None and os.path.exists(path):
            raise log_exists(run_id, path)
        if resumed_run_id is not None and resumed_run_id != run_id and os.path.exists(path):
            # another run's checkpoint continued under this id: its steps would land in this run's log
            raise ConfigError(f"--run-id {run_id}: {path} is the log of another run (the checkpoint is run "
                              f"{resumed_run_id}'s); choose a new --run-id, or leave --run-id out to continue "
                              f"{resumed_run_id}")
        if resume and resume[2] and resumed_run_id == run_id and os.path.exists(path):
            check_forced_log(path, resume[0]["step"])
        check_checkpoint_dir(cfg, run_id, resume)
    except BaseException:
        lock.release()
        raise
    return lock


def preflight(argv, trainer, world):
    """The flags, read as the trainer reads them, and ``check_start`` for ``world`` processes, in this one
    process: run.sh's check before torchrun, so that a refusal is one line rather than one per rank and
    torchrun's report.

    Args:
        argv: the trainer's command-line words (the preset included).
        trainer: the ``Trainer`` whose flags they are.
        world: the number of processes torchrun will start.

    Besides the flags and ``check_start``: the checkpoint to resume (``resolve_run``: its header and config,
    not its tensors) and, for a named run, its files (``check_run_files``), which rank 0 alone checks in the run. Only --help's
    and --describe's answers go to stdout: run.sh prints them and starts no process.

    Returns:
        0, or 2 after printing the refusal's one line on stderr (a split over the processes that
        cannot work is named as ``NPROC=<world>``, run.sh's variable).

    Raises:
        SystemExit: --help (status 0), or argparse's own refusal (its one line already printed), status 2.
    """
    who = f"{trainer.name}: error"
    try:
        cfg, preset = parse_config(argv, trainer)  # --help: its text on stdout, SystemExit(0)
        if answer_describe(argv, trainer, cfg, preset):
            return 0
        who = f"run.sh: NPROC={world}"  # the process count is run.sh's
        check_gpu_count(cfg, world)
        accum = grad_accum_steps(cfg, world)
        who = f"{trainer.name}: error"
        _, _, data = check_start(cfg, world, accum)
        resume, run_id = resolve_run(cfg, data, trainer, header_only=True)
        if run_id:  # an unnamed new run gets a fresh id: nothing can be in its way
            check_run_files(cfg, run_id, resume).release()
    except (ConfigError, DataError) as e:
        print(f"{who}: {e}", file=sys.stderr)
        return 2
    return 0


def setup_runtime(cfg, kind, accum):
    """Take the device (``kind``, from ``check_start``) and join the process group when launched by torchrun.

    The device index comes from LOCAL_RANK (multi-node safe); NCCL on CUDA, gloo on CPU, with
    a timeout so a rank that died never leaves the others hanging in a collective.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    use_bf16 = (kind == "cuda") if cfg.bf16 is None else cfg.bf16
    if kind == "cuda":
        torch.cuda.set_device(device)
        if use_bf16:  # the float32 matmuls left in a bf16 run are DC's scores, TF32 in modded-nanogpt's kernel; a
            torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 run (a reference) keeps IEEE float32
    else:
        tune_cpu_allocator()
    if world > 1:
        join_process_group("nccl" if kind == "cuda" else "gloo", device, cfg.dist_timeout)
    use_compile = (kind == "cuda") if cfg.compile is None else cfg.compile
    return Runtime(rank, world, device, use_compile, use_bf16, accum)


@contextlib.contextmanager
def quiet_native_stderr():
    """File descriptor 2 goes to a temporary file inside the block; its text is replayed on stderr
    when the block succeeds and dropped when it raises (the exception says what failed)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        text = held.read()
        if text:
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()


def join_process_group(backend, device, timeout_s):
    """``dist.init_process_group`` (env:// rendezvous from torchrun's variables), its failures in one line.

    Raises:
        ConfigError: the group could not form (endpoint unreachable or taken, no such socket
            interface, a rank missing until the timeout); the message names the cause and what to
            check: MASTER_ADDR/MASTER_PORT, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, --dist-timeout.
    """
    try:
        with quiet_native_stderr():  # c10d logs each failed try with a C++ stack: the line below says it once
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                    **({"device_id": device} if device.type == "cuda" else {}))
    except (RuntimeError, ValueError, OSError) as e:  # DistError, DistNetworkError, gloo's and NCCL's errors
        cause = " ".join(str(e).split())[:200]
        ifname = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
        endpoint = f"{os.environ.get('MASTER_ADDR', '(unset)')}:{os.environ.get('MASTER_PORT', '(unset)')}"
        raise ConfigError(f"cannot join the {backend} process group ({type(e).__name__}: {cause}); check "
                          f"MASTER_ADDR:MASTER_PORT ({endpoint}) is reachable from every rank, "
                          f"{ifname} ({os.environ.get(ifname, 'unset')}) names an interface of this host, "
                          f"and --dist-timeout ({timeout_s} s) leaves every rank time to start") from None


def tune_cpu_allocator():
    """glibc: keep freed big blocks (the [N, V] logits) in the heap instead of unmapping them.

    A CPU step allocates and frees ~100 MB buffers; returning them to the OS and faulting them
    in again doubles the step time. Same as MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**31-1.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


OOM_SIZE_RE = re.compile(r"[Tt]ried to allocate (\d[\d.,]*\s*(?:[KMGTP]i?B|bytes))")


def memory_flags(cfg):
    """The flags that lower a run's peak memory per GPU for ``cfg`` (its values named), largest effect first."""
    if cfg is None:
        return "--seq-len, --micro-batch-seqs, or the model size (--model-dim, --n-layer)"
    flags = [f"--seq-len (now {cfg.seq_len:,}: activations grow with it)"]
    if cfg.micro_batch_seqs > 1:
        flags.append(f"--micro-batch-seqs (now {cfg.micro_batch_seqs}; the accumulation grows to keep the batch)")
    if getattr(cfg, "bigram_vocab", 0):
        flags.append(f"--bigram-vocab (now {cfg.bigram_vocab:,} rows: the table, its gradient and Adam state)")
    if getattr(cfg, "fp8", None) is False:
        flags.append("--fp8 (FP8 matmuls on sm_89+ GPUs)")
    return ", ".join(flags) + ", or the model size (--model-dim, --n-layer)"


def known_failure(err, cfg=None):
    """One line for a failure of the machine rather than of the code, else None: running out of memory
    (also inside a compile: checked first), or a torch.compile toolchain failure (no working C++
    compiler, ...). ``cfg``: the run's config, whose memory flags the out-of-memory line names."""
    names, texts = set(), []
    while err is not None:
        names.add(type(err).__name__)
        texts.append(str(err))
        err = err.__cause__ or err.__context__
    oom = [t for t in texts if "out of memory" in t.lower() or "can't allocate memory" in t]
    if names & {"OutOfMemoryError", "MemoryError"} or oom:
        size = next((m[1] for t in texts for m in [OOM_SIZE_RE.search(t)] if m), None)
        what = f"tried to allocate {size}" if size else " ".join((oom or texts)[0].split()[:12])
        return f"out of memory ({what}); lower {memory_flags(cfg)}"
    if names & {"InvalidCxxCompiler", "CppCompileError", "BackendCompilerFailed", "CompilationError"}:
        kind = "no working C++ compiler" if "InvalidCxxCompiler" in names else "the compiler toolchain failed"
        return (f"--compile: torch.compile could not build the model ({kind}); install a C++ compiler "
                f"(and Triton on CUDA) or run with --no-compile")
    return None


class StopRequested(Exception):
    """Raised at a safe point (never by the signal handler) once SIGINT/SIGTERM asked the run to stop."""


def install_stop_handlers(stop):
    """SIGINT/SIGTERM only set ``stop["signal"]``: nothing is raised inside library code (a
    compile, a collective, a file write); the run stops at its next safe point (``should_stop``).
    Returns the previous handlers."""
    def on_signal(signum, frame):
        if stop["signal"] is None:
            stop["signal"] = signal.Signals(signum).name
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def should_stop(stop, can_save=True):
    """A safe point (between micro-batches, val batches, compiled graphs, steps).

    Args:
        stop: the dict the handler fills, ``{"signal": name or None, "save": --save-on-interrupt}``,
            or None (no handler: never stops).
        can_save: False where no checkpoint can be made (the compile warm-up, the step-0 val).

    Returns:
        True when a signal came and the caller should finish its step for the checkpoint
        (--save-on-interrupt), else False.

    Raises:
        StopRequested: a signal came and there is nothing to save (no --save-on-interrupt, or
            ``can_save`` is False).
    """
    if stop is None or stop["signal"] is None:
        return False
    if not (stop.get("save") and can_save):
        raise StopRequested(f"interrupted by {stop['signal']}")
    return True


# Under torchrun the ranks agree on a signal (an all-reduce and a host sync) at most this often.
STOP_CHECK_STEPS = 10


def stop_check_every(cfg):
    """Steps between the ranks' agreements on a signal under torchrun with --save-on-interrupt: the
    first multiple of --log-every that is >= STOP_CHECK_STEPS, so that each falls on a train-loss
    line (which waits for the device anyway) and no step in between pays a collective."""
    return cfg.log_every * -(-STOP_CHECK_STEPS // cfg.log_every)


def stop_requested(run, step=None):
    """True once a signal asked to stop after this step (--save-on-interrupt); with torchrun, once any
    rank got one, checked after the steps ``stop_check_every`` names (``step``: steps done so far;
    None at a validation, where the ranks always agree). Without --save-on-interrupt a signal raises
    StopRequested here (``should_stop``)."""
    local = should_stop(run.stop)
    if run.cfg.save_on_interrupt and run.rt.distributed:  # every rank stops after the same step
        if step is not None and step % stop_check_every(run.cfg):
            return False  # a signal seen here waits for the next check (the step is finished either way)
        flag = torch.tensor(float(local), device=run.rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not local:
            run.stop["signal"] = "SIGTERM (on another rank)"
    return run.stop["signal"] is not None


def interrupt_reason(run, step):
    """The ``status:interrupted`` reason of a run stopped after ``step`` with a checkpoint."""
    return (f"{run.stop['signal']} after step {step}; checkpoint {checkpoint_path(run, step)}; "
            f"resume with --resume auto --run-id {run.log.summary['run_id']}")


def save_on_stop(run, step):
    """--save-on-interrupt: mark the log ``status:interrupted`` first, then write the checkpoint, so
    that a SIGKILL during the write (torchrun's shutdown timeout) still leaves the log marked."""
    run.log.mark("interrupted", interrupt_reason(run, step))
    save(run, step, log_line=False)


def after_step(run, done, end_step, loss, scale, clock, validate):
    """The loop's work after optimizer step ``done`` (``end_step``: where it stops), outside train_time: the
    train-loss line, ``validate(run, step)`` (False: a signal cut it short) every --val-every steps and at the
    end, checkpoints; True when a signal stopped the run here (its checkpoint written)."""
    cfg = run.cfg
    last, stopping = done == end_step, stop_requested(run, done)
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
                save_on_stop(run, done)  # the status line first, then the checkpoint
                return True
            if save_now:
                save(run, done, periodic=not (last and cfg.save_final))
    return False


def interrupt_in_chain(err):
    """The StopRequested or KeyboardInterrupt in ``err``'s cause/context chain (a compile callback
    wraps it in its own error), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (StopRequested, KeyboardInterrupt)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


# ----------------------------------------------------------------------------------------------
# One run at a time per run id

class RunLock:
    """An exclusive ``flock`` on ``<log_dir>/<run_id>.lock`` held for the run's life (its log, JSON
    summary and checkpoint folder), taken before the log is written. The file holds the holder's
    pid. A killed holder never blocks: the OS releases its lock; the file's presence means nothing.

    Raises:
        ConfigError: another process holds the lock (names its pid), or --log-dir cannot be written.
    """

    def __init__(self, log_dir, run_id):
        self.path, self.file, self.made_dir = os.path.join(log_dir, f"{run_id}.lock"), None, None
        try:
            if not os.path.isdir(log_dir):
                os.makedirs(log_dir)
                self.made_dir = log_dir  # removed again at release when the run wrote nothing there
            for _ in range(5):  # a file unlinked by a finishing holder between our open and flock: retry
                f = open(self.path, "a+", encoding="utf-8")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    f.close()
                    raise ConfigError(f"--run-id {run_id}: the run is already going (pid {holder} holds "
                                      f"{self.path}); wait for it to end or stop it, or choose another "
                                      f"--run-id") from None
                if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
                f.close()
            else:
                raise ConfigError(f"--run-id {run_id}: {self.path} keeps being replaced; is another run of "
                                  f"this id starting and ending in a loop?")
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
        except OSError as e:
            raise ConfigError(f"--log-dir {log_dir!r}: cannot write {self.path} ({e.strerror}); "
                              f"choose another --log-dir") from None
        self.file = f

    def release(self):
        """Remove the file while still holding the lock, then let go (nothing left behind: a --log-dir
        this lock created goes too when the run was refused before writing its log)."""
        if self.file is None:
            return
        try:
            os.remove(self.path)
        except OSError:  # already gone or not removable: the lock itself still ends on close
            pass
        self.file.close()
        self.file = None
        if self.made_dir:
            try:
                os.rmdir(self.made_dir)
            except OSError:  # the run's log is there
                pass


def start(cfg, trainer, rt, data):
    """What can be refused after ``check_start`` and before a file is written: eager attention's memory, the
    resume, the run id, folders, and the run's lock (rank 0; None on other ranks). Returns ``(resume, run_id, lock)``."""
    if rt.device.type == "cuda" and trainer.flex_attention is not None:
        check_eager_attention(cfg, rt.compile, trainer.flex_attention(cfg),
                              torch.cuda.get_device_properties(rt.device).total_memory)
    # a named run is locked before its checkpoint is read (a second --resume of a running run stops here)
    lock = RunLock(cfg.log_dir, cfg.run_id) if rt.master and cfg.run_id else None
    try:
        resume, run_id = resolve_run(cfg, data, trainer)
        run_id = run_id or datetime.datetime.now().strftime("%Y%m%d_%H%M%S_") + uuid.uuid4().hex[:6]
        if rt.master:
            lock = check_run_files(cfg, run_id, resume, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return resume, run_id, lock


def main(argv, trainer):
    """Run ``trainer`` from command-line words; returns the exit status (0 only for a completed run).

    Everything that can be refused (flags, data files, the checkpoint to resume, the log and
    checkpoint folders, the run's lock) is checked before the log is created; from then on any
    failure closes the log with ``status:incomplete`` and the reason. Exit 2 for a refusal,
    130 for a signal (SIGINT/SIGTERM, handled at safe points), 1 for a failure of the run.
    Under torchrun a start-up refusal that every rank makes alike is said by rank 0 alone.
    """
    log, lock, rank, stop, handlers = None, None, int(os.environ.get("RANK", "0")), {"signal": None}, {}
    status, reason, code, world = "incomplete", None, 1, int(os.environ.get("WORLD_SIZE", "1"))
    alike = True  # a refusal here is every rank's: the others keep quiet
    try:
        if world > 1:  # torchrun's SIGTERM, sent when another rank refused, waits for rank 0's line
            handlers = install_stop_handlers(stop)
        with contextlib.redirect_stderr(io.StringIO()) if rank else contextlib.nullcontext():  # argparse's line
            cfg, preset = parse_config(argv, trainer)
        if answer_describe(argv, trainer, cfg, preset):
            return 0
        stop["save"] = cfg.save_on_interrupt
        handlers = handlers or install_stop_handlers(stop)
        kind, accum, data = check_start(cfg, world)
        alike = False  # a rank that cannot join the process group says so itself
        rt = setup_runtime(cfg, kind, accum)
        rank, alike = rt.rank, True
        resume, run_id, lock = start(cfg, trainer, rt, data)
        log = RunLog(cfg, rt, run_id, resume=resume is not None)
        alike = False  # from here a failure may be one rank's own (a read error in training)
        status, reason = trainer.train(cfg, rt, log, data, preset, resume, stop)
        code = {"complete": 0, "stopped_early": 0, "interrupted": 130}.get(status, 1)
    except SystemExit as e:  # --help, or argparse's own exit
        code = e.code if isinstance(e.code, int) else 1
        raise
    except BaseException as e:
        status, reason, code = "incomplete", *failure(e, rank, stop, log, trainer.name, quiet=alike and rank != 0)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if log is not None:
            log.finish(status, reason)
            if log.path:
                print(f"log: {log.path} ({status})", file=sys.stderr)
        if lock is not None:
            lock.release()
        write_exit_code(code, rank)
    if code == 0 and dist.is_available() and dist.is_initialized():
        leave_process_group()
    return code


def leave_process_group():
    """Leave the process group together: a barrier, then ``destroy_process_group``. A rank that tears down
    its gloo pairs while another still reads them can kill that one in gloo's C++ (std::terminate, SIGABRT)
    after its run completed; the barrier makes every rank finish its last collective first."""
    try:
        dist.barrier()
    except RuntimeError:  # another rank died after this one completed: its own message says why
        pass
    dist.destroy_process_group()


def failure(err, rank, stop, log, name, quiet=False):
    """``(reason, exit code)`` of an exception that ended ``main``, its one line printed on stderr (not for a
    refusal when ``quiet``: a rank other than 0 whose refusal rank 0 makes alike).

    A refusal (ConfigError, DataError) exits 2, a non-finite loss 1, a signal 130: a StopRequested
    or KeyboardInterrupt anywhere in the cause chain, or any error after a stop signal came (a
    Ctrl-C also reaches the compile workers, whose death the compile then reports); a toolchain
    or memory failure 2.

    Raises:
        the exception itself when it is none of these (its traceback is the report); the log is
        closed first, marked incomplete with its type and message.
    """
    if isinstance(err, (ConfigError, DataError, FloatingPointError)):
        reason = f"rank {rank}: {err}"
        if not quiet:
            print(f"{name}: error: {reason}", file=sys.stderr)
        return reason, 1 if isinstance(err, FloatingPointError) else 2
    interrupt = interrupt_in_chain(err)
    if interrupt is not None or stop["signal"] is not None:
        what = str(interrupt or "") or f"interrupted by {stop['signal'] or 'KeyboardInterrupt'}"
        if interrupt is not err:
            what += f" (the run then ended in {type(err).__name__})"
        reason = f"rank {rank}: {what}"
        print(f"{name}: {reason}", file=sys.stderr)
        return reason, 130
    message = known_failure(err, getattr(log, "cfg", None))
    if message is None:
        if log is not None:
            log.finish("incomplete", f"rank {rank}: {type(err).__name__}: {err}")
        raise err
    reason = f"rank {rank}: {message}"
    print(f"{name}: error: {reason}", file=sys.stderr)
    return reason, 2


EXIT_CODE_DIR = "TRAIN_GPT_EXIT_CODE_DIR"  # run.sh: where each rank leaves its exit status (torchrun hides it)


def write_exit_code(code, rank):
    """Leave ``code`` in ``$TRAIN_GPT_EXIT_CODE_DIR/rank<N>`` when run.sh set it (best effort)."""
    folder = os.environ.get(EXIT_CODE_DIR)
    if folder:
        try:
            with open(os.path.join(folder, f"rank{rank}"), "w") as f:
                f.write(f"{code}\n")
        except OSError:
            pass
