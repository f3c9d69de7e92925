"""Tools train_gpt.py calls; none changes what it computes, none calls back into it."""
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
import tempfile
import time
import traceback
import uuid
from contextlib import contextmanager, suppress

import numpy as np
import torch
import torch.distributed as dist

from data import shard_format  # shared with the data tools


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


class JoinError(ConfigError):
    """Joining the process group failed: each rank prints its own."""


DataError = shard_format.ShardError  # a shard, glob or tokenizer file; names it and the fix


class StopRequested(Exception):
    """A signal before step 0 (the compile warm-up)."""


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a run id: it names files
HERE = os.path.dirname(os.path.abspath(__file__))

# ---- Shards: a 256 x int32 header, then uint16 tokens

def read_shard(path):
    """A shard's tokens (read-only uint16 memmap), checked as the data tools do."""
    tokens = shard_format.read_tokens(path)
    shard_format.check_shard_tokens(path, tokens)  # one pass: about a second per 2 GB
    return tokens


def resolve_files(pattern, flag):
    """Sorted files matching a glob."""
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise DataError(f"{flag} {pattern!r}: no file matches; download shards with `python "
                        f"data/cached_fineweb10B.py` or point {flag} (or DATA_DIR for run.sh) at "
                        f"shards")
    bad = [f for f in files if not os.path.isfile(f)]
    if bad:
        raise DataError(f"{flag} {pattern!r}: {bad[0]} is not a file (a folder?); give a glob of "
                        f"shard files, e.g. '{os.path.join(bad[0], '*.bin')}'")
    return files


def fingerprint(path, n_bytes=1 << 20):
    """sha256 (16 hex) of a file's size, first and last MiB: fast."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256(str(size).encode())
            h.update(f.read(n_bytes))
            f.seek(max(0, size - n_bytes))
            h.update(f.read(n_bytes))
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror}); check the path, or "
                        f"{shard_format.REDO}") from None
    return h.hexdigest()[:16]


def find_data(train_files, val_files):
    """``{"train": [[path, fingerprint], ...], "val": [...]}``; no val shard may train."""
    globs = (("train", train_files, "--train-files"), ("val", val_files, "--val-files"))
    data = {kind: [[f, fingerprint(f)] for f in resolve_files(pattern, flag)]
            for kind, pattern, flag in globs}
    val_fps = {fp: f for f, fp in data["val"]}
    for f, fp in data["train"]:
        if fp in val_fps:
            raise DataError(f"--train-files {train_files!r}: {f} has the contents of val shard "
                            f"{val_fps[fp]}; exclude it (e.g. '<dir>/*_train_*.bin')")
    return data


class TokenStream:
    """Shards as one token stream; ``wrap``: reads past the end start over."""

    def __init__(self, files, wrap=False):
        self.files = list(files)
        self.shards = [read_shard(f) for f in self.files]
        self.sizes = [len(shard) for shard in self.shards]
        self.offsets = np.cumsum([0] + self.sizes)
        self.total = int(self.offsets[-1])
        self.wrap = wrap
        if self.total == 0:
            raise DataError(f"{', '.join(self.files)}: the shards hold no tokens; point the glob "
                            f"at other shards")

    def read(self, start, n):
        """int64 array of the n tokens from ``start``."""
        if not self.wrap and start + n > self.total:
            raise DataError(f"asked for tokens [{start}, {start + n}) but the shards hold {self.total} "
                            f"({', '.join(os.path.basename(f) for f in self.files[:3])}...); add shards")
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            pos = (start + done) % self.total
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            lo = pos - int(self.offsets[i])
            take = min(n - done, self.sizes[i] - lo)
            out[done:done + take] = self.shards[i][lo:lo + take]
            done += take
        return out


# ---- The runtime

@dataclasses.dataclass
class Runtime:
    """``accum``: micro-batches per process per step."""
    rank: int
    world: int
    device: torch.device
    compile: bool
    bf16: bool = False
    accum: int = 1
    dist_timeout: float = 0.0  # s

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
        """Contiguous: compiled graphs are specialized to strides."""
        t = t.contiguous()
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t


def setup_runtime(cfg, accum):
    """The device and, under torchrun, the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = kind == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    bf16 = cuda if cfg.bf16 is None else cfg.bf16
    if cuda:
        torch.cuda.set_device(device)
        if bf16:  # the float32 matmuls left (DC's scores) in TF32, as modded-nanogpt's
            torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        keep_freed_blocks()
    if world > 1:
        try:
            dist.init_process_group("nccl" if cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=cfg.dist_timeout),
                                    **({"device_id": device} if cuda else {}))
        except (RuntimeError, ValueError, OSError) as e:
            why = " ".join(str(e).split())[:160]
            raise JoinError(f"cannot join the process group ({why}); check MASTER_ADDR:MASTER_PORT "
                            f"and --dist-timeout ({cfg.dist_timeout} s)") from None
    return Runtime(rank, world, device, cuda if cfg.compile is None else cfg.compile, bf16, accum,
                   cfg.dist_timeout)


def keep_freed_blocks():
    """glibc keeps freed big blocks (the logits): faulting them in again doubles a CPU step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.mallopt(-4, 0)  # M_MMAP_MAX
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# ---- The CLI: a flag per Config field

class _Parser(argparse.ArgumentParser):
    """One line for a bad flag, not the usage; no flag matched by a prefix."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def flag_of(name):
    return "--" + name.replace("_", "-")


def machines_of(text):
    """``--describe``'s machines: "" -> 1 x H200 and 8 x B200; "8xB200" -> one."""
    if not text:
        return [(1, "H200"), (8, "B200")]
    m = re.fullmatch(r"(\d+)x(H100|H200|B200)", text.replace(" ", ""))
    if not m or int(m[1]) < 1:
        raise ConfigError(f"--describe {text!r}: give GPUs as NxGPU, e.g. 8xB200 (H100, H200 or B200)")
    return [(int(m[1]), m[2])]


def parse_flags(config, presets, argv=None):
    """``(Config, preset, machines)``: defaults < --preset < typed flags."""
    shown = "; ".join(f"{k}: " + (", ".join(f"{a}={b}" for a, b in v.items()) or "the defaults")
                      for k, v in presets.items())
    p = _Parser(prog="train_gpt.py", description="Train a GPT on FineWeb to 3.28 val loss: record "
                "#89 + TST + Aurora. Defaults are baseline_h200's; a preset sets several flags, "
                "typed flags override it.", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                epilog="presets: " + shown)
    p.add_argument("--preset", choices=list(presets), default=None, help="bundle of flags")
    p.add_argument("--describe", nargs="?", const="", default=None, metavar="NxGPU",
                   help="print what the run would do and its projected time (1xH200 and 8xB200, or "
                        "the one given), then exit; needs no data and no GPU")
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
        raise ConfigError(f"unexpected file arguments ({extra[0]} ...): the shell expanded a glob; "
                          f"quote it, e.g. --train-files 'data/fineweb10B/fineweb_train_*.bin'")
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    for f in dataclasses.fields(config):
        flag = flag_of(f.name)
        value, low, high = getattr(args, f.name), f.metadata.get("low"), f.metadata.get("high")
        if isinstance(value, float) and not np.isfinite(value):
            raise ConfigError(f"{flag} must be finite (got {value})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**31:
            raise ConfigError(f"{flag} must be < 2**31 in magnitude (got {value})")
        if (low is not None and value < low) or (high is not None and value >= high):
            below = f" and < {high}" if high is not None else ""
            raise ConfigError(f"{flag} must be >= {low}{below} (got {value})")
        if f.name.endswith("_dir") and not value:
            raise ConfigError(f"{flag} '': name a folder (default {f.default!r})")
    cfg = config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config)})
    return cfg, preset, None if args.describe is None else machines_of(args.describe)


def config_to_argv(config):
    """Words that reproduce a Config (or a log's ``config:`` dict)."""
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag_of(name) if value else "--no-" + flag_of(name)[2:])
        elif value is not None:
            argv += [flag_of(name), str(value)]
    return argv


# ---- The run log (docs/LOGS.md)

SEPARATOR = "=" * 100  # between the source snapshot and the run
SOURCE_FILES = ("train_gpt.py", "kernels.py", "aurora_opt.py", "harness.py", "data/shard_format.py")


def source_snapshot():
    """SOURCE_FILES, each after its ``### file`` line."""
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
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    return platform.processor() or platform.machine()


def environment_lines(rt):
    lines = [f"python: {platform.python_version()}  torch: {torch.__version__}  "
             f"cuda: {torch.version.cuda}  numpy: {np.__version__}",
             f"host: {platform.node()}  platform: {platform.platform()}",
             f"world_size: {rt.world}  device: {rt.device}  compile: {rt.compile}  bf16: {rt.bf16}"]
    if rt.device.type == "cuda":
        lines += [f"gpus: {torch.cuda.device_count()} x {torch.cuda.get_device_name(rt.device)}",
                  run_quiet(["nvidia-smi"])]
    else:
        lines.append(f"cpu: {cpu_model()}  cores: {os.cpu_count()}  "
                     f"torch threads: {torch.get_num_threads()}")
    return [line for line in lines if line]


def from_rank_0(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_json(path, obj):
    """Written whole (a temporary file, renamed) or not at all."""
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
        os.replace(path + ".tmp", path)
    finally:
        with suppress(FileNotFoundError):  # renamed, or half-written
            os.remove(path + ".tmp")


def echo_line(text):
    """print; a closed pipe (``| head``) silences the rest, not the run."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class RunLog:
    """``<log_dir>/<run_id>.txt`` and ``.json``: never replaced; a resume appends."""

    def __init__(self, cfg, rt, preset, resume=None):
        self.rt = rt
        self.file = self.lock = None
        stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S_") + uuid.uuid4().hex[:6]
        self.run_id = cfg.run_id or (resume["run_id"] if resume else stamp)
        if rt.distributed:  # one id: any rank can name, and mark, the log
            self.run_id = from_rank_0(self.run_id)
        self.summary = dict(run_id=self.run_id, preset=preset, status="running")
        self.path = os.path.join(cfg.log_dir, f"{self.run_id}.txt")
        self.json_path = self.path[:-4] + ".json"
        refused = None
        if rt.master:
            try:
                self._open(cfg, resume)
            except ConfigError as e:
                refused = str(e)
                self.release()
        if rt.distributed:  # every rank stops now, not at its next collective
            refused = from_rank_0(refused)
        if refused:
            raise ConfigError(refused)

    def _open(self, cfg, resume):
        """Rank 0: the run's lock, then its log."""
        append = resume is not None and os.path.exists(self.path)
        try:
            os.makedirs(cfg.log_dir, exist_ok=True)
            self.lock = take_lock(os.path.join(cfg.log_dir, f"{self.run_id}.lock"), self.run_id)
            if append and os.path.exists(self.json_path):
                with open(self.json_path, encoding="utf-8") as f:
                    self.summary = dict(json.load(f), status="running")
                self.summary.pop("reason", None)  # the last stop's
            self.file = open(self.path, "a" if append else "x", encoding="utf-8")
        except ConfigError:  # the lock's
            raise
        except FileExistsError as e:
            if e.filename != self.path:  # makedirs met a file
                raise ConfigError(f"--log-dir {cfg.log_dir!r} is a file; choose another --log-dir") from None
            saved = run_checkpoints(cfg.checkpoint_dir, self.run_id)
            more = f", or continue that run with --resume auto --run-id {self.run_id}" if saved else ""
            raise ConfigError(f"--run-id {self.run_id}: {self.path} already exists; choose another "
                              f"--run-id{more}") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"--log-dir {cfg.log_dir!r}: cannot write the log there ({e}); "
                              f"choose another --log-dir") from None
        if not append:
            self.write(source_snapshot() + SEPARATOR + "\n")

    def write(self, text):
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:
            raise ConfigError(f"--log-dir: cannot write {self.path} ({e.strerror}); free space "
                              f"there or choose another --log-dir") from None

    def line(self, text, echo=True):
        if self.file is None:
            return
        if echo:
            echo_line(text)
        self.write(text + "\n")

    def update(self, **kw):
        self.summary.update(kw)

    def summary_line(self, counters, final):
        """The last val loss (``final_val_loss`` at step N), counters, peak memory."""
        peak = (torch.cuda.max_memory_allocated(self.rt.device) if self.rt.device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20  # RSS: KiB
        self.update(**counters, peak_memory_mib=round(peak, 1), world_size=self.rt.world)
        if final and "last_val_loss" in self.summary:
            self.summary["final_val_loss"] = self.summary.pop("last_val_loss")
        val = self.summary.get("final_val_loss", self.summary.get("last_val_loss", float("nan")))
        self.line(SEPARATOR)
        self.line(f"summary: {'final_val_loss' if final else 'last_val_loss'}:{val:.4f} "
                  f"train_time:{counters['train_time_ms']:.0f}ms steps:{counters['steps']} "
                  f"raw_tokens:{counters['raw_tokens']} positions:{counters['positions']} "
                  f"flops:{counters['flops']:.3e} peak_memory:{peak:.0f}MiB "
                  f"compile_time:{self.summary.get('compile_time_ms', 0):.0f}ms")

    def close(self, status, reason=None):
        """The ``status:`` line and the JSON summary; best effort on a full disk."""
        if self.file is None or self.file.closed:
            return
        self.summary.update(status=status, **({"reason": reason} if reason else {}))
        try:
            self.line(f"status:{status}" + (f" reason:{reason}" if reason else ""), echo=False)
            write_json(self.json_path, self.summary)
        except (OSError, ConfigError) as e:
            if str(e) != reason:  # a failed log write is the run's reason already
                print(f"train_gpt.py: could not finish the log {self.path} ({e})", file=sys.stderr)
        finally:
            self.release()
            with suppress(OSError):  # full disk: the buffer's write fails again
                self.file.close()

    def release(self):
        if self.lock is not None:
            with suppress(OSError):
                os.remove(self.lock)
            self.lock = None

    def mark_for_rank_0(self, status, reason):
        """Another rank ends the log of a stalled rank 0."""
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"status:{status} reason:{reason} (written by rank {self.rt.rank})\n")
            write_json(self.json_path, dict(self.summary, status=status, reason=reason,
                                            written_by_rank=self.rt.rank))
        except OSError as e:
            print(f"train_gpt.py: could not mark the log {self.path} ({e})", file=sys.stderr)
            return False
        return True


def take_lock(path, run_id):
    """O_EXCL, holding host and pid: one run per run id (a dead pid's is taken over)."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path, encoding="utf-8") as f:
                    host, pid = (f.read().split() + ["", ""])[:2]
            except OSError:
                continue  # removed meanwhile
            if host == platform.node() and not pid_alive(int(pid) if pid.isdigit() else 0):
                with suppress(FileNotFoundError):
                    os.remove(path)  # stale: its process was killed
                continue
            raise ConfigError(f"--run-id {run_id}: another process (pid {pid or '?'} on "
                              f"{host or '?'}) is running this run ({path}); wait for it to end, "
                              f"or choose another --run-id") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{platform.node()} {os.getpid()}\n")
        return path
    raise ConfigError(f"--run-id {run_id}: cannot take the lock {path}; remove it if no run of "
                      f"this id is running")


def pid_alive(pid):
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0 sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def log_header(log, cfg, rt, data, streams):
    """What every start (a resume too) records."""
    def note(text):
        log.line(text, echo=False)
    for text in environment_lines(rt):
        note(text)
    note("command: " + " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        note(f"launcher: torchrun, world size {rt.world}")
    commit = run_quiet(["git", "rev-parse", "HEAD"])
    dirty = commit and run_quiet(["git", "status", "--porcelain", "--untracked-files=no"])
    note(f"git: {commit or 'none (not a git checkout)'}{' (uncommitted changes)' if dirty else ''}")
    note(f"preset: {log.summary.get('preset')}")
    note("config: " + json.dumps(dataclasses.asdict(cfg), sort_keys=True))
    for kind, stream in zip(("train", "val"), streams):
        for (f, fp), n in zip(data[kind], stream.sizes):
            note(f"data {kind}: {f} tokens:{n} bytes:{os.path.getsize(f)} fingerprint:{fp}")
    note(f"data tokenizer: data/gpt2_bpe/encoder.json fingerprint:{fingerprint(shard_format.GPT2_ENCODER_JSON)}")


def step_line(step, n_steps, what, value, train_time_ms):
    """modded-nanogpt's step line."""
    return (f"step:{step}/{n_steps} {what}:{value:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{train_time_ms / max(step, 1):.2f}ms")


# ---- Checkpoints

def rank_buffers(model):
    """The FP8 delayed scales: each rank's own."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if k.endswith("down_scales")}


def save_checkpoint(state, model, opts, loader, rt, path, log):
    """Rank 0 writes; ConfigError naming --checkpoint-dir when it cannot."""
    ranks = [rank_buffers(model)]
    if rt.distributed and ranks[0]:
        ranks = [None] * rt.world
        dist.all_gather_object(ranks, rank_buffers(model))
    optimizers = [o.state_dict() for o in opts]  # every rank: a sharded optimizer gathers
    if rt.master:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        state = dict(state, model=model.state_dict(), optimizers=optimizers, rank_buffers=ranks,
                     loader_position=loader.position, rng=dict(torch=torch.get_rng_state(), cuda=cuda))
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # torch.save wraps a failed write (ENOSPC too)
            if isinstance(e, RuntimeError) and not TORCH_WRITE_FAILED.search(str(e)):
                raise  # not the disk: a bug
            if os.path.exists(tmp):
                os.remove(tmp)  # first: the free space below is a retry's
            raise ConfigError(checkpoint_write_error(path, e, state_bytes(state))) from None
        finally:  # a failure or a signal leaves no temporary file
            if os.path.exists(tmp):
                os.remove(tmp)
        log.line(f"checkpoint: {path}")
    if rt.distributed:
        dist.barrier()


TORCH_WRITE_FAILED = re.compile(r"inline_container|file write failed|unexpected pos|PytorchStreamWriter")


def state_bytes(obj):
    """Bytes of the tensors in a nested dict/list/tuple."""
    leaves = torch.utils._pytree.tree_leaves(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def checkpoint_write_error(path, err, need):
    """The cause, the space needed and free."""
    try:
        free = shutil.disk_usage(os.path.dirname(path)).free
    except OSError:
        free = None
    why = err.strerror if isinstance(err, OSError) else None
    if not why:
        why = "No space left on device" if free is not None and free < need else " ".join(str(err).split())[:120]
    room = f"; it needs about {need / 2**20:,.1f} MiB"
    if free is not None:
        room += f", {free / 2**20:,.1f} MiB are free"
    return (f"--checkpoint-dir: cannot write {path} ({why}{room}); free space there or choose "
            f"another --checkpoint-dir")


def run_checkpoints(checkpoint_dir, run_id):
    """``<checkpoint_dir>/<run_id>/**/step_*.pt``."""
    where = glob.escape(os.path.join(checkpoint_dir, run_id))
    return glob.glob(os.path.join(where, "**", "step_*.pt"), recursive=True)


def load_resume(cfg, data, operational):
    """The checkpoint --resume names; ConfigError naming each field and data file that differs."""
    path = cfg.resume
    if path == "auto":
        where = os.path.join(cfg.checkpoint_dir, cfg.run_id)
        found = run_checkpoints(cfg.checkpoint_dir, cfg.run_id)
        runs = {os.path.dirname(p) for p in found}
        if len(runs) != 1:
            raise ConfigError(f"--resume auto: {'no checkpoint' if not runs else 'checkpoints of several runs'} under "
                              f"{where!r}; name the run with --run-id, or give --resume a step_*.pt file")
        path = max(found, key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert isinstance(state, dict) and {"config", "model", "data", "counters"} <= state.keys()
    except Exception as e:  # noqa: BLE001 -- torch raises several kinds
        first = str(e).splitlines()[0][:100] if str(e) else "not a checkpoint"
        raise ConfigError(f"--resume {path}: not a readable train_gpt.py checkpoint "
                          f"({type(e).__name__}: {first}); give a "
                          f"<checkpoint-dir>/<run-id>/step_N.pt file") from None
    saved = state["config"]
    diffs = [f"{flag_of(k)} {saved.get(k)!r} -> {v!r}" for k, v in dataclasses.asdict(cfg).items()
             if k not in operational and saved.get(k) != v]
    for kind in ("train", "val"):
        if [fp for _, fp in state["data"][kind]] != [fp for _, fp in data[kind]]:
            diffs.append(f"{kind} data ({len(state['data'][kind])} files -> {len(data[kind])}, other contents)")
    if diffs:
        raise ConfigError(f"--resume {path}: this run differs from the checkpoint's in "
                          f"{'; '.join(diffs)}; resume with the checkpoint's flags and shards")
    return dict(state, path=path)


def restore(state, model, opts, loader, rt):
    """Load a checkpoint into the run; its step."""
    own = model.state_dict()  # --fp8 may differ on resume: only down_scales may not match
    try:
        ranks = state["rank_buffers"]
        saved = {**state["model"], **ranks[rt.rank if len(ranks) == rt.world else 0]}
        model.load_state_dict({k: v for k, v in saved.items() if k in own or not k.endswith("down_scales")},
                              strict=not any(k.endswith("down_scales") and k not in saved for k in own))
        for opt, saved in zip(opts, state["optimizers"]):
            opt.load_state_dict(saved)
        loader.position = state["loader_position"]
        rng = state["rng"]
    except (RuntimeError, KeyError, ValueError) as e:  # its config fits: a damaged or hand-made file
        raise ConfigError(f"--resume {state['path']}: does not fit this run "
                          f"({' '.join(str(e).split())[:150]})") from None
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and rt.device.type == "cuda":
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


# ---- The loop's clock, NaN guard and signals

class Clock:
    """train_time: the device synced before each reading; pauses excluded."""

    def __init__(self, rt, progress):
        self.rt = rt
        self.progress = progress
        self.t0 = None

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
    """The first step whose loss was not finite, kept on the device: no sync per step."""

    def __init__(self, device):
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, loss, step):
        self.first_bad.masked_fill_((self.first_bad == 0) & ~torch.isfinite(loss), step)

    def check(self, step):
        bad = int(self.first_bad)
        if bad:
            raise FloatingPointError(f"train loss is not finite since step {bad} (checked at "
                                     f"{step}); lower --matrix-lr or --adam-lr, or check the data")


class StopFlag:
    """SIGINT, SIGTERM, SIGHUP set ``signal``: the loop finishes its step, checkpoints, and ends."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signal = None
        self.previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name
        if signum == signal.SIGHUP:  # the terminal is gone: writes to it fail (EIO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (isatty fails on a hung-up one)
                    os.dup2(devnull, fd)
            os.close(devnull)

    @property
    def exit_code(self):
        return signal_exit_code(self.signal)

    def agreed(self, rt):
        """Any rank's signal: every rank stops after the same step."""
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


# ---- Failures and the end of a run

def memory_line(n_params, positions, spec, val_seqs, val_chunk, val_piece):
    """``--describe``'s peak memory per GPU (docs/OPTIMIZERS.md): float32 weights, grads, 3
    optimizer copies; per position 3 float32 vocabulary rows and 25 bf16 activations per layer."""
    gib = 2**30
    d, V, n = spec.model_dim, spec.vocab_size, spec.n_layer
    state = 5 * 4 * n_params
    train = positions * (3 * V * 4 + 25 * n * d * 2)
    val = val_seqs * (min(val_chunk, max(1, val_piece // val_seqs)) * 2 * V * 4 + val_chunk * (16 + n) * d * 2)
    return (f"memory_estimate: per GPU, weights, gradients and optimizer state {state / gib:.1f} "
            f"GiB + a train micro-batch of {positions:,} positions {train / gib:.1f} GiB (the "
            f"validation forward: {val / gib:.1f}): peak about {(state + max(train, val)) / gib:.1f} "
            f"GiB; lower it with --micro-batch-seqs or --seq-len")


# dense bf16 peak TFLOP/s (SXM); record #21: 5.517e17 FLOPs in 175.98 s on 8 x H100
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0}
RECORD_MFU = 0.396


def projection_lines(flops, machines):
    """``--describe``'s train time at record #21's utilization."""
    return [f"projected_train_time: {n} x {gpu}: "
            f"{flops / (n * RECORD_MFU * PEAK_TFLOPS[gpu] * 1e12) / 60:.1f} min at "
            f"{100 * RECORD_MFU:.1f}% of its {PEAK_TFLOPS[gpu]:g} TFLOP/s bf16 peak (record #21's "
            f"utilization), compile not included" for n, gpu in machines]


def signal_exit_code(name):
    """129 for SIGHUP (128 + 1, as a shell says), else 130."""
    return 129 if str(name or "").startswith("SIGHUP") else 130


def failure(err, stop, log):
    """``(status, reason, exit code)``, its line on stderr (rank 0's for a refusal, each rank's
    JoinError): a refusal, memory or compiler 2, a NaN or collective 1, a signal 130/129; a bug raises."""
    chain = []
    e = err
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    marked = False  # this rank ended rank 0's log
    status = "incomplete"
    code = 2
    if isinstance(err, SystemExit):  # --help, or argparse's line
        return "refused", None, err.code if isinstance(err.code, int) else 2
    if isinstance(err, (ConfigError, DataError, FloatingPointError)):
        status = "refused" if log is None else "incomplete"
        reason = str(err)
        code = 1 if isinstance(err, FloatingPointError) else 2
    elif names & {"StopRequested", "KeyboardInterrupt"} or stop.signal:
        status = "interrupted"
        reason = f"interrupted by {stop.signal or 'KeyboardInterrupt'}"
        code = stop.exit_code
    elif names & {"OutOfMemoryError", "MemoryError"} or re.search("out of memory|can't allocate memory", text.lower()):
        reason = "out of memory; lower --micro-batch-seqs (or --val-batch-seqs, --seq-len)"
    elif names & {"InvalidCxxCompiler", "CppCompileError", "BackendCompilerFailed"}:
        reason = ("torch.compile could not build the model (no working C/C++ compiler?); install "
                  "one or run --no-compile")
    elif dist.is_available() and dist.is_initialized() and COLLECTIVE_BROKE.search(text):
        code = 1
        reason, marked = collective_failure(err, log)
    else:
        finish(log, "incomplete", f"{type(err).__name__}: {err}")
        raise err
    if status != "refused" or isinstance(err, JoinError) or int(os.environ.get("RANK", "0")) == 0:
        # one write: lines stay whole
        sys.stderr.write(f"train_gpt.py: {'error: ' if code == 2 else ''}{reason}\n")
    else:  # torchrun stops all when one exits: rank 0 first
        time.sleep(3)
    if marked:
        print(f"log: {log.path} ({status}, marked by rank {log.rt.rank} for rank 0)", file=sys.stderr)
    return status, reason, code


# gloo's: a collective timed out or lost its peer (NCCL's watchdog aborts instead)
COLLECTIVE_BROKE = re.compile(r"Timed out waiting|timed out|Connection closed by peer|"
                              r"Connection reset by peer|caused pair closure")


def collective_failure(err, log):
    """``(reason, marked)``: the collective, its wait, the ranks that never reached it."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    frames = [(frame.f_code, line) for frame, line in traceback.walk_tb(err.__traceback__)]
    c10d = [code.co_name for code, _ in frames if code.co_filename.endswith("distributed_c10d.py")]
    ours = [f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{line})" for code, line in frames
            if os.path.dirname(os.path.abspath(code.co_filename)) == HERE]
    what = (c10d[-1] if c10d else "the wait for a collective") + (f" in {ours[-1]}" if ours else "")
    if re.search("Connection (closed|reset) by peer", str(err)):
        return f"rank {rank}: {what} failed: another rank left the run (its own line says why)", False
    waited = re.search(r"waiting (\d+)ms", str(err))  # else the group's
    timeout = int(waited[1]) / 1000 if waited else (log.rt.dist_timeout if log is not None else 0)
    absent = absent_ranks(rank, world)
    reason = (f"rank {rank}: {what} timed out after --dist-timeout"
              + (f" {timeout:g} s" if timeout else "")
              + (f"; rank(s) {', '.join(map(str, absent))} never reached it (stalled or hung)"
                 if absent else "; which ranks did not reach it is unknown")
              + "; raise --dist-timeout if a rank is only slow")
    live = [r for r in range(world) if absent and r not in absent]
    marked = bool(absent) and 0 in absent and rank == min(live, default=-1) and log is not None
    return reason, marked and log.mark_for_rank_0("incomplete", reason)


def absent_ranks(rank, world, grace_s=3.0):
    """Ranks that did not tell the store of a broken collective within ``grace_s``, or None."""
    key = "train_gpt/collective_timed_out/{}".format
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))  # a stalled rank 0's store does not answer
        store.set(key(rank), "1")
        time.sleep(grace_s)
        return [r for r in range(world) if not store.check([key(r)])]
    except Exception:  # noqa: BLE001 -- the store went with a rank
        return None


def finish(log, status, reason=None):
    """Close the log, then leave the process group together (a rank tearing down its gloo pairs
    while another reads them can abort that one)."""
    if log is not None and log.file is not None and not log.file.closed:
        log.close(status, reason)
        print(f"log: {log.path} ({status})", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        if status in ("complete", "stopped_early") or " after step " in str(reason):  # all end here
            dist.barrier()  # rank 0's log first: torchrun kills the rest when one exits non-zero
        dist.destroy_process_group()


# ---- torchrun, quietly

def launch(argv):
    """``python harness.py [torchrun flags] train_gpt.py [flags]``: torchrun, quiet, exiting with
    the first failed rank's status, not 1 and a traceback (a signal: 129/130)."""
    import logging
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read when torchrun's loggers are made
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")  # a stopped rank's checkpoint
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logs = tempfile.mkdtemp(prefix="torchrun_")  # torchrun's own folder (its default is kept)
    try:
        run(parse_args(["--log-dir", logs] + argv))
    except ChildFailedError as e:
        _, first = e.get_first_failure()  # the others were stopped because of it
        return first.exitcode if first.exitcode >= 0 else 128 - first.exitcode  # -N: signal N
    except SignalException as e:
        return signal_exit_code(e.sigval.name)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
