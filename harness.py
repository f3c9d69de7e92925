"""Tools train_gpt.py calls around the speedrun; none changes what it computes, none calls back into it.

Shards and their fingerprints, the runtime (device, processes), the CLI built from the trainer's Config, the run
log (a reproducible snapshot: docs/LOGS.md), checkpoints, the clock, the NaN guard, signals and the one-line
report of a failure. Every log snapshots this file with the trainer.
"""
import argparse
import ctypes
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
import uuid
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from data import shard_format  # the shard format and its checks, defined once (numpy only: the data tools' own)


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


class DataError(ValueError):
    """A shard or glob that cannot be used; the message names the file and the fix."""


class StopRequested(Exception):
    """A SIGINT/SIGTERM seen where no step can be finished (the compile warm-up)."""


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a run id: it names files
HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------------
# Shards: a 256 x int32 header (magic, version, token count) then uint16 tokens (llm.c / modded-nanogpt format)

GPT2_IDS = 50257  # ids 0..50256; the embedding's rows beyond are padding
GPT2_ENCODER_JSON = os.path.join(HERE, "data", "gpt2_bpe", "encoder.json")
REMAKE = shard_format.REDO  # "re-download or re-tokenize it (...)"


def read_shard(path):
    """A shard's tokens (a read-only uint16 memmap) after the data tools' checks of its header, size and every token
    (``shard_format.check_shard``: no id above 50256, no zero-filled stretch); DataError naming the file."""
    try:
        tokens = shard_format.read_tokens(path)
        shard_format.check_shard_tokens(path, tokens)  # one pass over the memmap: about a second per 2 GB
    except shard_format.ShardError as e:
        raise DataError(str(e)) from None
    return tokens


def gpt2_token_bytes(path=GPT2_ENCODER_JSON):
    """``{id: bytes}`` of GPT-2's 50,256 ordinary tokens from its encoder.json (no network): the 188 printable bytes
    spell themselves, the other 68 ``chr(256 + i)`` in byte order (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    char_to_byte = {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}
    try:
        with open(path, encoding="utf-8") as f:
            encoder = json.load(f)
        return {i: bytes(char_to_byte[c] for c in s) for s, i in encoder.items() if s != "<|endoftext|>"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: cannot read GPT-2's encoder.json ({type(e).__name__}: {e}); restore it from the "
                        f"repository (git checkout -- data/gpt2_bpe)") from None


def resolve_files(pattern, flag):
    """Sorted regular files matching a glob; DataError naming the flag when there are none."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataError(f"{flag} {pattern!r}: no file matches; download shards with `python data/cached_fineweb10B.py`"
                        f" or point {flag} (or DATA_DIR for run.sh) at shards")
    bad = [f for f in files if not os.path.isfile(f)]
    if bad:
        raise DataError(f"{flag} {pattern!r}: {bad[0]} is not a file (a folder?); give a glob of shard files, e.g. "
                        f"'{os.path.join(bad[0], '*.bin')}'")
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


def find_data(train_files, val_files):
    """``{"train": [[path, fingerprint], ...], "val": [...]}`` of the two globs; DataError when a glob matches
    nothing or a train shard has a val shard's contents (training on val tokens voids the val loss)."""
    data = {kind: [[f, fingerprint(f)] for f in resolve_files(pattern, flag)]
            for kind, pattern, flag in (("train", train_files, "--train-files"), ("val", val_files, "--val-files"))}
    val_fps = {fp: f for f, fp in data["val"]}
    for f, fp in data["train"]:
        if fp in val_fps:
            raise DataError(f"--train-files {train_files!r}: {f} has the contents of val shard {val_fps[fp]}; "
                            f"exclude it (e.g. '<dir>/*_train_*.bin')")
    return data


class TokenStream:
    """The shards of a glob as one token stream with random access; every shard checked whole before step 0
    (``read_shard``). ``wrap``: reads past the end start over (train)."""

    def __init__(self, files, wrap=False):
        self.files = list(files)
        self.shards = [read_shard(f) for f in self.files]
        self.sizes = [len(shard) for shard in self.shards]
        self.offsets = np.cumsum([0] + self.sizes)
        self.total, self.wrap = int(self.offsets[-1]), wrap
        if self.total == 0:
            raise DataError(f"{', '.join(self.files)}: the shards hold no tokens; point the glob at other shards")

    def read(self, start, n):
        """int64 numpy array of the n tokens from stream position ``start``; DataError past the end (val)."""
        if not self.wrap and start + n > self.total:
            raise DataError(f"asked for tokens [{start}, {start + n}) but the shards hold {self.total} "
                            f"({', '.join(os.path.basename(f) for f in self.files[:3])}...); add shards")
        out, done = np.empty(n, dtype=np.int64), 0
        while done < n:
            pos = (start + done) % self.total
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            lo = pos - int(self.offsets[i])
            take = min(n - done, self.sizes[i] - lo)
            out[done:done + take] = self.shards[i][lo:lo + take]
            done += take
        return out


def open_streams(data):
    """(train stream, wrapping; val stream) over ``find_data``'s files."""
    return (TokenStream([f for f, _ in data["train"]], wrap=True), TokenStream([f for f, _ in data["val"]]))


# ----------------------------------------------------------------------------------------------
# The runtime: this process's device, rank and precision

@dataclasses.dataclass
class Runtime:
    """Where and how this process runs: rank of ``world``, device, compile, bf16, and ``accum`` micro-batches per
    process per optimizer step."""
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
        """Host tensor to the device, contiguous (compiled graphs are specialized to strides; the loader's sequences
        are views), pinned and asynchronous on CUDA."""
        if self.device.type == "cuda":
            return t.contiguous().pin_memory().to(self.device, non_blocking=True)
        return t.contiguous()


def setup_runtime(cfg, accum):
    """Take the device and join the process group when launched by torchrun (NCCL on CUDA, gloo on a CPU, with
    --dist-timeout); ConfigError for --device cuda without a GPU or a group that cannot form."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if kind == "cuda" else torch.device("cpu")
    bf16 = (kind == "cuda") if cfg.bf16 is None else cfg.bf16
    if kind == "cuda":
        torch.cuda.set_device(device)
        if bf16:  # the float32 matmuls left in a bf16 run are DC's scores, TF32 in modded-nanogpt's kernel; a
            torch.backends.cuda.matmul.fp32_precision = "tf32"  # float32 run (a reference) keeps IEEE float32
    else:
        keep_freed_blocks()
    if world > 1:
        try:
            dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=cfg.dist_timeout),
                                    **({"device_id": device} if kind == "cuda" else {}))
        except (RuntimeError, ValueError, OSError) as e:
            raise ConfigError(f"cannot join the process group ({' '.join(str(e).split())[:160]}); check "
                              f"MASTER_ADDR:MASTER_PORT and --dist-timeout ({cfg.dist_timeout} s)") from None
    return Runtime(rank, world, device, (kind == "cuda") if cfg.compile is None else cfg.compile, bf16, accum)


def keep_freed_blocks():
    """glibc: keep freed big blocks (the [N, V] logits) in the heap, not unmapped and faulted in again each step
    (which doubles a CPU step's time): MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=2**31-1."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(-4, 0), libc.mallopt(-1, 2**31 - 1)  # M_MMAP_MAX, M_TRIM_THRESHOLD


def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------------------------
# The CLI: one --kebab-case flag per Config field, --preset and --describe

class _Parser(argparse.ArgumentParser):
    """A bad flag gets one error line (not the usage above it); flags are matched whole, never by a prefix."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def flag_of(name):
    return "--" + name.replace("_", "-")


def machines_of(text):
    """``--describe``'s machines: "" -> 1 x H200 and 8 x B200; "8xB200" -> one; else ConfigError."""
    if not text:
        return [(1, "H200"), (8, "B200")]
    m = re.fullmatch(r"(\d+)x(H100|H200|B200)", text.replace(" ", ""))
    if not m or int(m[1]) < 1:
        raise ConfigError(f"--describe {text!r}: give GPUs as NxGPU, e.g. 8xB200 (H100, H200 or B200)")
    return [(int(m[1]), m[2])]


def parse_flags(config, presets, argv=None):
    """``(Config, preset, machines)`` from command-line words: defaults < --preset < typed flags; ``machines`` the
    --describe list, None without it. ConfigError for a value out of its field's bounds (metadata low, high)."""
    p = _Parser(prog="train_gpt.py", description="Train a GPT on FineWeb to 3.28 val loss: record #89 + TST + "
                "Aurora. Defaults are baseline_h200's; a preset sets several flags, typed flags override it.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                epilog="presets: " + "; ".join(f"{k}: " + (", ".join(f"{a}={b}" for a, b in v.items()) or "the defaults")
                                                for k, v in presets.items()))
    p.add_argument("--preset", choices=list(presets), default=None, help="bundle of flags")
    p.add_argument("--describe", nargs="?", const="", default=None, metavar="NxGPU",
                   help="print what the run would do and its projected time (1xH200 and 8xB200, or the one given), "
                        "then exit; needs no data and no GPU")
    for f in dataclasses.fields(config):
        kw = dict(default=f.default, help=f.metadata["help"])
        if f.type in (bool, "bool"):
            p.add_argument(flag_of(f.name), action=argparse.BooleanOptionalAction, **kw)
        else:
            p.add_argument(flag_of(f.name), type=f.type if f.type in (int, float) else str,
                           choices=f.metadata.get("choices"), **kw)
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**presets[preset])
    args, extra = p.parse_known_args(argv)
    if extra and all(os.path.exists(a) for a in extra):
        raise ConfigError(f"unexpected file arguments ({extra[0]} ...): the shell expanded a glob; quote it, e.g. "
                          f"--train-files 'data/fineweb10B/fineweb_train_*.bin'")
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    for f in dataclasses.fields(config):
        value, low, high = getattr(args, f.name), f.metadata.get("low"), f.metadata.get("high")
        if isinstance(value, float) and not np.isfinite(value):
            raise ConfigError(f"{flag_of(f.name)} must be finite (got {value})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**31:
            raise ConfigError(f"{flag_of(f.name)} must be < 2**31 in magnitude (got {value})")
        if (low is not None and value < low) or (high is not None and value >= high):
            raise ConfigError(f"{flag_of(f.name)} must be >= {low}" + (f" and < {high}" if high is not None else "")
                              + f" (got {value})")
        if f.name.endswith("_dir") and not value:
            raise ConfigError(f"{flag_of(f.name)} '': name a folder (default {f.default!r})")
    cfg = config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config)})
    return cfg, preset, None if args.describe is None else machines_of(args.describe)


def config_to_argv(config):
    """Command-line words that reproduce a config (a Config or the dict a log holds as ``config:``)."""
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    argv = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag_of(name) if value else "--no-" + flag_of(name)[2:])
        else:
            argv += [flag_of(name), str(value)]
    return argv


# ----------------------------------------------------------------------------------------------
# The run log: one text file per run, a reproducible snapshot (docs/LOGS.md), and a JSON summary beside it

SEPARATOR = "=" * 100  # between the source snapshot and the run
SOURCE_FILES = ("train_gpt.py", "kernels.py", "aurora_opt.py", "harness.py", "data/shard_format.py")  # in a log


def source_snapshot():
    """Every file of SOURCE_FILES, each after a ``### file <name> lines=<n> sha256=<hex>`` line."""
    parts = []
    for name in SOURCE_FILES:
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            text = f.read()
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        parts.append(f"### file {name} lines={len(text.splitlines())} sha256={digest}\n{text}"
                     + ("" if text.endswith("\n") else "\n"))
    return "".join(parts)


def run_quiet(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=HERE).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``), else ``platform``'s best guess."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    return platform.processor() or platform.machine()


def environment_lines(rt):
    """Versions, host and devices (GPU model and nvidia-smi, or CPU model, cores and threads)."""
    lines = [f"python: {platform.python_version()}  torch: {torch.__version__}  cuda: {torch.version.cuda}  "
             f"numpy: {np.__version__}", f"host: {platform.node()}  platform: {platform.platform()}",
             f"world_size: {rt.world}  device: {rt.device}  compile: {rt.compile}  bf16: {rt.bf16}"]
    if rt.device.type == "cuda":
        lines += [f"gpus: {torch.cuda.device_count()} x {torch.cuda.get_device_name(rt.device)}", run_quiet(["nvidia-smi"])]
    else:
        lines.append(f"cpu: {cpu_model()}  cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}")
    return [line for line in lines if line]


class RunLog:
    """``<log_dir>/<run_id>.txt`` (rank 0 writes; every rank may call): the source snapshot, a separator, the run's
    header, step lines, the summary and a ``status:`` line; ``<run_id>.json`` beside it. A new run never replaces a
    log; a resumed one appends to its own. ConfigError when the log exists or --log-dir cannot be written."""

    def __init__(self, cfg, rt, preset, resume=None):
        self.rt, self.file, self.lock = rt, None, None
        self.run_id = cfg.run_id or (resume["run_id"] if resume else
                                     datetime.datetime.now().strftime("%Y%m%d_%H%M%S_") + uuid.uuid4().hex[:6])
        if rt.distributed:  # rank 0's id on every rank: any rank can name, and if need be mark, the log
            agreed = [self.run_id]
            dist.broadcast_object_list(agreed, src=0)
            self.run_id = agreed[0]
        self.summary = dict(run_id=self.run_id, preset=preset, status="running")
        self.path = os.path.join(cfg.log_dir, f"{self.run_id}.txt")
        self.json_path = self.path[:-4] + ".json"
        refused = None
        if rt.master:
            try:
                self._open(cfg, resume)
            except ConfigError as e:
                refused = str(e)
        if rt.distributed:  # rank 0's refusal stops every rank at once, not at their next collective
            box = [refused]
            dist.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused:
            raise ConfigError(refused)

    def _open(self, cfg, resume):
        """Rank 0: take the run's lock, then open its log (a resume appends) and write the snapshot."""
        append = resume is not None and os.path.exists(self.path)
        try:
            os.makedirs(cfg.log_dir, exist_ok=True)
            self.lock = take_lock(os.path.join(cfg.log_dir, f"{self.run_id}.lock"), self.run_id)
            if append and os.path.exists(self.json_path):
                with open(self.json_path, encoding="utf-8") as f:
                    self.summary = dict(json.load(f), status="running")
            self.file = open(self.path, "a" if append else "x", encoding="utf-8")  # "x": never overwrite a log
        except ConfigError:  # the lock: another process runs this run id
            raise
        except FileExistsError:
            self.release()
            raise ConfigError(f"--run-id {self.run_id}: {self.path} already exists; choose another --run-id, or "
                              f"continue that run with --resume auto --run-id {self.run_id}") from None
        except (OSError, ValueError) as e:
            self.release()
            raise ConfigError(f"--log-dir {cfg.log_dir!r}: cannot write the log there ({e}); choose another "
                              f"--log-dir") from None
        if not append:
            self.write(source_snapshot() + SEPARATOR + "\n")

    def write(self, text):
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:
            raise ConfigError(f"--log-dir: cannot write {self.path} ({e.strerror}); free space there or choose "
                              f"another --log-dir") from None

    def line(self, text, echo=True):
        if self.file is None:
            return
        if echo:
            print(text, flush=True)
        self.write(text + "\n")

    def update(self, **kw):
        self.summary.update(kw)

    def summary_line(self, counters, final):
        """The run's summary: its last val loss (``final_val_loss`` only for a run that reached step N), the
        counters (train_time_ms, steps, raw_tokens, positions, flops) and the peak memory."""
        peak = (torch.cuda.max_memory_allocated(self.rt.device) if self.rt.device.type == "cuda"  # else: peak RSS, KiB
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
        self.update(**counters, peak_memory_mib=round(peak, 1), world_size=self.rt.world)
        if final and "last_val_loss" in self.summary:
            self.summary["final_val_loss"] = self.summary.pop("last_val_loss")
        val = self.summary.get("final_val_loss", self.summary.get("last_val_loss", float("nan")))
        self.line(SEPARATOR)
        self.line(f"summary: {'final_val_loss' if final else 'last_val_loss'}:{val:.4f} "
                  f"train_time:{counters['train_time_ms']:.0f}ms steps:{counters['steps']} "
                  f"raw_tokens:{counters['raw_tokens']} positions:{counters['positions']} flops:{counters['flops']:.3e} "
                  f"peak_memory:{peak:.0f}MiB compile_time:{self.summary.get('compile_time_ms', 0):.0f}ms")

    def close(self, status, reason=None):
        """The ``status:`` line and the JSON summary (written to a temporary file, then renamed); best effort on a
        full disk (said on stderr)."""
        if self.file is None or self.file.closed:
            return
        self.summary.update(status=status, **({"reason": reason} if reason else {}))
        tmp = self.json_path + ".tmp"
        try:
            self.line(f"status:{status}" + (f" reason:{reason}" if reason else ""), echo=False)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.summary, f, indent=1)
            os.replace(tmp, self.json_path)
        except (OSError, ConfigError) as e:
            if str(e) != reason:  # a write to this log that failed is the run's reason already: said once
                print(f"train_gpt.py: could not finish the log {self.path} ({e})", file=sys.stderr)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
            self.file.close()
            self.release()

    def release(self):
        """Remove this run's lock file (see ``take_lock``)."""
        if self.lock is not None:
            try:
                os.remove(self.lock)
            except OSError:
                pass
            self.lock = None

    def mark_for_rank_0(self, status, reason):
        """A rank other than 0 ends the log rank 0 cannot (it stalled): the status line and a JSON summary."""
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"status:{status} reason:{reason} (written by rank {self.rt.rank})\n")
            with open(self.json_path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(dict(self.summary, status=status, reason=reason, written_by_rank=self.rt.rank), f, indent=1)
            os.replace(self.json_path + ".tmp", self.json_path)
        except OSError as e:
            print(f"train_gpt.py: could not mark the log {self.path} ({e})", file=sys.stderr)
            return False
        return True


def take_lock(path, run_id):
    """Create ``<log_dir>/<run_id>.lock`` atomically (O_EXCL) holding this host and pid: one run id, one run at a time.
    A lock whose process is gone (this host, no such pid) is stale and taken over; a live one is a ConfigError."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path, encoding="utf-8") as f:
                    host, pid = (f.read().split() + ["", ""])[:2]
            except OSError:
                continue  # removed meanwhile: try again
            if host == platform.node() and not pid_alive(int(pid) if pid.isdigit() else 0):
                try:
                    os.remove(path)  # its process ended without removing it (killed): stale
                except FileNotFoundError:
                    pass
                continue
            raise ConfigError(f"--run-id {run_id}: another process (pid {pid or '?'} on {host or '?'}) is running "
                              f"this run ({path}); wait for it to end, or choose another --run-id") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{platform.node()} {os.getpid()}\n")
        return path
    raise ConfigError(f"--run-id {run_id}: cannot take the lock {path}; remove it if no run of this id is running")


def pid_alive(pid):
    """Whether a process of this host has ``pid`` (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def log_header(log, cfg, rt, data, streams):
    """What every start (a resume too, maybe elsewhere) records: environment, command, config, git, data files."""
    for text in environment_lines(rt):
        log.line(text, echo=False)
    log.line("command: " + " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), echo=False)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        log.line(f"launcher: torchrun, world size {rt.world}", echo=False)
    commit = run_quiet(["git", "rev-parse", "HEAD"])
    dirty = commit and run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    log.line(f"git: {commit or 'none (not a git checkout)'}{' (uncommitted changes)' if dirty else ''}", echo=False)
    log.line(f"preset: {log.summary.get('preset')}", echo=False)
    log.line("config: " + json.dumps(dataclasses.asdict(cfg), sort_keys=True), echo=False)
    for kind, stream in zip(("train", "val"), streams):
        for (f, fp), n in zip(data[kind], stream.sizes):
            log.line(f"data {kind}: {f} tokens:{n} bytes:{os.path.getsize(f)} fingerprint:{fp}", echo=False)
    log.line(f"data tokenizer: data/gpt2_bpe/encoder.json fingerprint:{fingerprint(GPT2_ENCODER_JSON)}", echo=False)


def step_line(step, n_steps, what, value, train_time_ms):
    """``step:{n}/{N} {what}:{x:.4f} train_time:{ms}ms step_avg:{ms:.2f}ms`` (modded-nanogpt's shape)."""
    return (f"step:{step}/{n_steps} {what}:{value:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{train_time_ms / max(step, 1):.2f}ms")


# ----------------------------------------------------------------------------------------------
# Checkpoints: one file per save, written to a temporary name and renamed (a full disk leaves nothing behind)

def rank_buffers(model):
    """The buffers that differ between ranks: the FP8 delayed scales (each rank's last forward set its own)."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if k.endswith("down_scales")}


def save_checkpoint(state, model, opts, loader, rt, path, log):
    """Write ``state`` plus the weights, optimizer states, stream position and RNG to ``path`` (rank 0; every rank
    waits). ConfigError naming --checkpoint-dir when the write fails; the temporary file is removed."""
    ranks = [rank_buffers(model)]
    if rt.distributed and ranks[0]:  # every rank's own FP8 scales (a collective: every rank is here)
        ranks = [None] * rt.world
        dist.all_gather_object(ranks, rank_buffers(model))
    optimizers = [o.state_dict() for o in opts]  # on every rank: a sharded optimizer gathers its state
    if rt.master:
        state = dict(state, model=model.state_dict(), optimizers=optimizers, rank_buffers=ranks,
                     loader_position=loader.position, rng=dict(torch=torch.get_rng_state(), cuda=(
                         torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])))
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # torch.save wraps a failed write (ENOSPC too) in a RuntimeError
            if isinstance(e, RuntimeError) and not TORCH_WRITE_FAILED.search(str(e)):
                raise  # not the disk: a bug
            if os.path.exists(tmp):
                os.remove(tmp)  # first, so the free space below is what a retry would have
            raise ConfigError(checkpoint_write_error(path, e, state_bytes(state))) from None
        finally:  # a failed write, or a signal during it, leaves no temporary file
            if os.path.exists(tmp):
                os.remove(tmp)
        log.line(f"checkpoint: {path}")
    if rt.distributed:
        dist.barrier()


TORCH_WRITE_FAILED = re.compile(r"inline_container|file write failed|unexpected pos|PytorchStreamWriter")


def state_bytes(obj):
    """Bytes of the tensors in a nested dict/list/tuple (what a checkpoint of it writes, less its small framing)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def checkpoint_write_error(path, err, need):
    """The one line of a checkpoint that could not be written: the cause, the space it needs and has."""
    folder = os.path.dirname(path)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    why = err.strerror if isinstance(err, OSError) and err.strerror else None
    if why is None:
        why = "No space left on device" if free is not None and free < need else " ".join(str(err).split())[:120]
    room = f"; it needs about {need / 2**20:,.1f} MiB" + (f", {free / 2**20:,.1f} MiB are free" if free is not None else "")
    return (f"--checkpoint-dir: cannot write {path} ({why}{room}); free space there or choose another "
            f"--checkpoint-dir")


def load_resume(cfg, data, operational):
    """The checkpoint --resume names (``auto``: the newest step_*.pt of --run-id, or of the one run, under
    --checkpoint-dir), checked against this run: ConfigError naming every config field and data file that differs
    (fields in ``operational`` may differ) or a file that is not a checkpoint."""
    path = cfg.resume
    if path == "auto":
        where = os.path.join(cfg.checkpoint_dir, cfg.run_id)
        found = glob.glob(os.path.join(glob.escape(where), "**", "step_*.pt"), recursive=True)
        runs = {os.path.dirname(p) for p in found}
        if len(runs) != 1:
            raise ConfigError(f"--resume auto: {'no checkpoint' if not runs else 'checkpoints of several runs'} under "
                              f"{where!r}; name the run with --run-id, or give --resume a step_*.pt file")
        path = max(found, key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert isinstance(state, dict) and "config" in state and "model" in state
    except Exception as e:  # noqa: BLE001 -- torch raises several kinds for a missing, truncated or foreign file
        raise ConfigError(f"--resume {path}: not a readable train_gpt.py checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100] if str(e) else 'not a checkpoint'}); give a "
                          f"<checkpoint-dir>/<run-id>/step_N.pt file") from None
    saved = state["config"]
    diffs = [f"{flag_of(k)} {saved.get(k)!r} -> {v!r}" for k, v in dataclasses.asdict(cfg).items()
             if k not in operational and saved.get(k) != v]
    diffs += [f"{kind} data ({len(state['data'][kind])} files -> {len(data[kind])}, other contents)"
              for kind in ("train", "val") if [fp for _, fp in state["data"][kind]] != [fp for _, fp in data[kind]]]
    if diffs:
        raise ConfigError(f"--resume {path}: this run differs from the checkpoint's in {'; '.join(diffs)}; resume "
                          f"with the checkpoint's flags and shards")
    return dict(state, path=path)


def restore(state, model, opts, loader, rt):
    """Load a checkpoint's weights (this rank's FP8 scales), optimizer states, stream position and RNG; its step."""
    ranks = state["rank_buffers"]
    saved = {**state["model"], **ranks[rt.rank if len(ranks) == rt.world else 0]}
    own = model.state_dict()  # why: --fp8 may differ on resume (a CPU turns it off): only its down_scales may not match
    model.load_state_dict({k: v for k, v in saved.items() if k in own or not k.endswith("down_scales")},
                          strict=not any(k.endswith("down_scales") and k not in saved for k in own))
    for opt, saved in zip(opts, state["optimizers"]):
        opt.load_state_dict(saved)
    loader.position = state["loader_position"]
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and rt.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


# ----------------------------------------------------------------------------------------------
# The loop's clock, NaN guard and signals

class Clock:
    """train_time: the device synchronized before each reading; pauses (val, logs, checkpoints) excluded."""

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
    """The first step whose loss was not finite, kept on the device (no host sync per step); ``check`` syncs."""

    def __init__(self, device):
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, loss, step):
        self.first_bad.masked_fill_((self.first_bad == 0) & ~torch.isfinite(loss), step)

    def check(self, step):
        bad = int(self.first_bad)
        if bad:
            raise FloatingPointError(f"train loss is not finite since step {bad} (checked at {step}); lower "
                                     f"--matrix-lr or --adam-lr, or check the data")


class StopFlag:
    """SIGINT, SIGTERM and SIGHUP (the terminal closed) only set ``signal``: the loop finishes its step, checkpoints
    when checkpoints are on, and the run ends with status interrupted (``exit_code``: 129 for SIGHUP, else 130).
    ``restore`` puts the previous handlers back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signal = None
        self.previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name
        if signum == signal.SIGHUP:  # the terminal is gone: its writes would fail (EIO); the log keeps every line
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (isatty itself fails on a hung-up one)
                    os.dup2(devnull, fd)
            os.close(devnull)

    @property
    def exit_code(self):
        return signal_exit_code(self.signal)

    def agreed(self, rt):
        """Whether any rank got a signal (an all-reduce under torchrun: every rank stops after the same step)."""
        if rt.distributed:
            flag = torch.tensor(float(self.signal is not None), device=rt.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and self.signal is None:
                self.signal = "SIGTERM (on another rank)"
        return self.signal is not None

    def raise_if_set(self):
        if self.signal is not None:
            raise StopRequested(f"interrupted by {self.signal} before step 0")

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------
# Memory, failures and the end of a run

def memory_line(n_params, positions, spec, val_seqs, val_chunk, val_piece):
    """``--describe``'s peak-memory estimate per GPU (docs/OPTIMIZERS.md): float32 weights, gradients and 3 optimizer
    copies; per trained position of a micro-batch 3 float32 vocabulary rows (logits, softmax, gradient) and 25 saved
    bf16 activations of model_dim per layer; the validation forward's head piece and 16 + n_layer live rows."""
    gib, d, V, n = 2**30, spec.model_dim, spec.vocab_size, spec.n_layer
    state = 5 * 4 * n_params
    train = positions * (3 * V * 4 + 25 * n * d * 2)
    val = val_seqs * (min(val_chunk, max(1, val_piece // val_seqs)) * 2 * V * 4 + val_chunk * (16 + n) * d * 2)
    return (f"memory_estimate: per GPU, weights, gradients and optimizer state {state / gib:.1f} GiB + a train "
            f"micro-batch of {positions:,} positions {train / gib:.1f} GiB (the validation forward: {val / gib:.1f}): "
            f"peak about {(state + max(train, val)) / gib:.1f} GiB; lower it with --micro-batch-seqs or --seq-len")


# Dense bf16 peak TFLOP/s (NVIDIA datasheets, SXM) and the utilization modded-nanogpt's records reach: record #21
# (2025-01-26) trained 5.517e17 model FLOPs (train_gpt.py's count) in 175.98 s on 8 x H100: 39.6% of peak.
PEAK_TFLOPS, RECORD_MFU = {"H100": 989.0, "H200": 989.0, "B200": 2250.0}, 0.396


def projection_lines(flops, machines):
    """``--describe``'s projected train time of ``flops`` on each ``(n_gpus, gpu)`` at record #21's utilization."""
    return [f"projected_train_time: {n} x {gpu}: {flops / (n * RECORD_MFU * PEAK_TFLOPS[gpu] * 1e12) / 60:.1f} min at "
            f"{100 * RECORD_MFU:.1f}% of its {PEAK_TFLOPS[gpu]:g} TFLOP/s bf16 peak (record #21's utilization), compile "
            f"not included" for n, gpu in machines]


def signal_exit_code(name):
    """The exit status of a run a signal stopped: 129 for SIGHUP (128 + 1, as the shell reports it), 130 else (SIGINT,
    SIGTERM: the trainer's 'interrupted')."""
    return 129 if str(name or "").startswith("SIGHUP") else 130


def failure(err, stop, log):
    """``(status, reason, exit code)`` of an exception that ended a run, its one line printed on stderr: a refusal
    (ConfigError, DataError) 2, a non-finite loss 1, a signal 130 (129 SIGHUP), out of memory or a missing compiler
    toolchain 2 (naming the flag that helps), a collective that timed out or lost a rank 1 (``collective_failure``);
    anything else is a bug: the log is closed incomplete, then it is raised. Under torchrun a refusal, which comes
    from the flags and the data and so is the same on every rank, is printed by rank 0 alone."""
    chain, e = [], err
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names, text = {type(e).__name__ for e in chain}, " ".join(str(e) for e in chain)
    marked = False  # a collective failure's: this rank ended rank 0's log
    if isinstance(err, SystemExit):  # --help, or argparse's own one line
        return "refused", None, err.code if isinstance(err.code, int) else 2
    if isinstance(err, (ConfigError, DataError, FloatingPointError)):
        status, reason, code = ("refused" if log is None else "incomplete"), str(err), 1 + (
            not isinstance(err, FloatingPointError))
    elif names & {"StopRequested", "KeyboardInterrupt"} or stop.signal:
        status, reason, code = "interrupted", f"interrupted by {stop.signal or 'KeyboardInterrupt'}", stop.exit_code
    elif names & {"OutOfMemoryError", "MemoryError"} or re.search("out of memory|can't allocate memory", text.lower()):
        status, code = "incomplete", 2
        reason = "out of memory; lower --micro-batch-seqs (or --val-batch-seqs, --seq-len)"
    elif names & {"InvalidCxxCompiler", "CppCompileError", "BackendCompilerFailed"}:
        status, code = "incomplete", 2
        reason = "torch.compile could not build the model (no working C/C++ compiler?); install one or run --no-compile"
    elif dist.is_available() and dist.is_initialized() and COLLECTIVE_BROKE.search(text):
        status, code, (reason, marked) = "incomplete", 1, collective_failure(err, log)
    else:
        finish(log, "incomplete", f"{type(err).__name__}: {err}")
        raise err
    if code != 2 or int(os.environ.get("RANK", "0")) == 0:
        sys.stderr.write(f"train_gpt.py: {'error: ' if code == 2 else ''}{reason}\n")  # one write: lines stay whole
    if code == 1 and marked:
        print(f"log: {log.path} ({status}, marked by rank {log.rt.rank} for rank 0)", file=sys.stderr)
    return status, reason, code


# gloo's words for a collective that waited past the process group's timeout, or whose peer went away (NCCL's
# watchdog aborts the process instead: that path shows on GPUs only)
COLLECTIVE_BROKE = re.compile(r"Timed out waiting|timed out|Connection closed by peer|Connection reset by peer")


def collective_failure(err, log):
    """The one line of a collective that failed: which one (the innermost torch.distributed call, else the trainer's
    function that waited), after how long (--dist-timeout), and the ranks that never reached it. Those are asked of
    the process group's store: each rank whose collective timed out says so there; a rank that says nothing within
    a few seconds stalled before it. When rank 0 is one of them, the lowest live rank marks the log."""
    rank, world = dist.get_rank(), dist.get_world_size()
    frames = [(frame.f_code, line) for frame, line in traceback.walk_tb(err.__traceback__)]
    c10d = [code.co_name for code, _ in frames if code.co_filename.endswith("distributed_c10d.py")]
    ours = [f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{line})" for code, line in frames
            if os.path.dirname(os.path.abspath(code.co_filename)) == HERE]
    what = (c10d[-1] if c10d else "the wait for a collective") + (f" in {ours[-1]}" if ours else "")
    if re.search("Connection (closed|reset) by peer", str(err)):
        return f"rank {rank}: {what} failed: another rank left the run (its own line says why)", False
    waited = re.search(r"waiting (\d+)ms", str(err))
    absent = absent_ranks(rank, world)
    reason = (f"rank {rank}: {what} timed out after --dist-timeout" + (f" {int(waited[1]) / 1000:g} s" if waited else "")
              + (f"; rank(s) {', '.join(map(str, absent))} never reached it (stalled or hung)" if absent else
                 "; which ranks did not reach it is unknown") + "; raise --dist-timeout if a rank is only slow")
    live = [r for r in range(world) if absent and r not in absent]
    marked = bool(absent) and 0 in absent and rank == min(live, default=-1) and log is not None
    return reason, marked and log.mark_for_rank_0("incomplete", reason)


def absent_ranks(rank, world, grace_s=3.0):
    """The ranks that did not report a broken collective to the process group's store within ``grace_s`` of this
    one (the live ranks time out at about the same moment), or None when the store cannot be reached."""
    key = "train_gpt/collective_timed_out/{}".format
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))  # a store hosted by a stalled rank 0 does not answer
        store.set(key(rank), "1")
        time.sleep(grace_s)
        return [r for r in range(world) if not store.check([key(r)])]
    except Exception:  # noqa: BLE001 -- the store went with a rank: the ranks cannot be named
        return None


def finish(log, status, reason=None):
    """Close the log with its status (the path printed), then leave the process group together (a barrier first:
    a rank that tears down its gloo pairs while another still reads them can abort that one)."""
    if log is not None and log.file is not None and not log.file.closed:
        log.close(status, reason)
        print(f"log: {log.path} ({status})", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        if status in ("complete", "stopped_early") or " after step " in str(reason):  # every rank ended here
            dist.barrier()  # rank 0's log closed first: torchrun kills the other ranks when one exits non-zero
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# torchrun, quietly: the ranks' own line and exit code (run.sh launches several processes through this)

def launch(argv):
    """``python harness.py [torchrun flags] train_gpt.py [flags]``: ``torch.distributed.run`` (torchrun) as it is, but
    a failed rank's exit status is the launcher's (2 a refusal, 1 a failure) instead of torchrun's 1 and traceback,
    and a signal (Ctrl-C, SIGTERM, SIGHUP) is passed to the ranks, which finish their step and checkpoint, then
    129/130. torchrun's own log lines, which restate the ranks' one line, are left out."""
    import logging
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read as torchrun's loggers are made (at import, below)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")  # a signalled rank's checkpoint: time to write it
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        _, first = e.get_first_failure()  # the rank that failed first: the others were stopped because of it
        return first.exitcode if first.exitcode >= 0 else 128 - first.exitcode  # -N: killed by signal N
    except SignalException as e:
        return signal_exit_code(e.sigval.name)
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
