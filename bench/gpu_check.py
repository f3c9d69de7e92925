"""One-shot CUDA check of train_gpt.py: environment, device speed, CPU/GPU agreement, step time.

Run it once on any new GPU box before a record attempt: in one command and under 8 minutes
it says whether the box computes what the CPU computes, how fast its matmuls and copies
are, and how long the record preset would take there.

    python bench/gpu_check.py                    # on the GPU box: about 4-7 minutes, hard limit 8
    python bench/gpu_check.py --dry-run          # anywhere, on CPU: 30-70 s on 2 cores (CI runs it)
    python bench/gpu_check.py --train-files 'data/fineweb10B/fineweb_train_*.bin' \\
                              --val-files 'data/fineweb10B/fineweb_val_*.bin'   # real shards

It downloads nothing and needs no internet (synthetic shards of random GPT-2 token ids are
written under --out unless real shards are given). Sections, in order:

1. environment: GPU name and memory, driver, CUDA, cuDNN, torch, Triton, SDPA backends,
   float32 matmul precision, what torch.compile will do.
2. micro-benchmarks: dense bf16 matmul rate of ``--matmul-n``^3 products (TFLOP/s, 2 n^3
   FLOPs per product; median and best of a few trials), device-to-device copy bandwidth
   (GB/s counting bytes read + bytes written), pinned host-to-device bandwidth (GB/s), and
   the forward time (ms) of the record model's attention shape under each SDPA backend.
3. correctness: a tiny model trained 5 steps (2 in TST phase 1, 3 in phase 2, grad
   accumulation 2) in float32 without compile, once on CPU and once on CUDA. The train
   losses, the val losses and the TST val loss must agree within ``--tol`` (absolute,
   default 1e-3; the log prints losses to 4 decimals). Both columns are printed. (Aurora's
   Newton-Schulz runs in bf16 on both devices, so they agree closely but not bit for bit.)
4. timing: the ``record_h200`` preset (bf16, compiled) for a short window: 2 x ``--steps``
   optimizer steps (default 30 + 30) with the TST switch in the middle. Reported: compile
   warm-up of all phase graphs (ms, excluded from train time as in a record), ms per step
   of each phase (from the trainer's own synchronized train_time; the first step of a phase
   is dropped when it is > 1.25 x the phase median, i.e. a warm-up), raw text tokens/s and
   latent positions/s (phase 1 reads s = 4 tokens per position), model FLOPs per step
   (``train_gpt.model_flops_per_position x batch_tokens``), achieved TFLOP/s, MFU against
   the *measured* matmul rate (and against the datasheet peak when the GPU is known), peak
   CUDA memory (MiB, ``max_memory_allocated``), graphs compiled inside the timed window
   (should be 0), and the projected train time of the full preset: its N steps split at
   round(r * N) into phase 1 and phase 2, each times its measured ms/step.
5. summary: one table on stdout; the same numbers as JSON in ``<out>/gpu_check.json`` (and
   the table in ``<out>/gpu_check_summary.txt``); the trainer's logs in ``<out>/logs/``.

Exit status: 0 when every section ran and the correctness check passed; 1 when the
correctness check failed; 2 when anything else failed (a crash, a timeout, a missing
phase). The table and JSON are written in every case. The whole script stops itself at
``--budget-s`` (default 470 s) after its start: a run still going is stopped (SIGTERM, then
SIGKILL) and what its log holds so far is reported; give a job runner's own limit at least
the budget plus a minute (e.g. ``timeout_s=560``). Where the time goes on an H200 (estimates,
the first run will tell): environment + micro-benchmarks ~15 s, correctness ~20-30 s, timing
run ~10 s start-up + compile warm-up (cold inductor cache: the biggest unknown, 1-4 min) +
60 steps x ~1-1.5 s. If the budget is too short, lower ``--steps`` or raise ``--budget-s``.

``--dry-run`` does all of the above on CPU with a tiny model, a few steps, no compile and
small CPU micro-benchmarks (fp32 matmul, RAM copy), comparing CPU with CPU; it calls
nothing CUDA-only, so CI finds a broken script before GPU minutes are spent.

The trainer runs as subprocesses (``python train_gpt.py ...``), not in-process through
``train_gpt.main``: a subprocess can be stopped at the time budget and still leave its log,
a crash in it (CUDA error, OOM, Triton) cannot take this script and its report down, each
run's peak-memory counter and in-memory compile state start clean (no matmul-benchmark
tensors counted; inductor's on-disk cache is shared, as between real runs), and the command
is exactly what a user runs. It costs a few seconds of import per run.
"""
import argparse
import datetime
import getpass
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(REPO, "train_gpt.py")
sys.path.insert(0, REPO)
try:  # a broken trainer must not stop the environment and device checks from reporting
    import train_gpt as T
    TRAINER_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001
    T, TRAINER_IMPORT_ERROR = None, f"import train_gpt failed: {type(_e).__name__}: {_e}"

SEPARATOR = T.SEPARATOR if T else None  # the trainer log's line between source snapshot and run
SCHEMA = "gpu_check-1"

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from NVIDIA datasheets (SXM parts);
# only for a second MFU column, the first one uses the measured matmul rate.
NOMINAL_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("B200", 2250.0))

# The tiny model of the correctness check (and of --dry-run's timing window).
# 8 sequences of 32 positions a step, 2 micro-batches of 4 (so grad accumulation is exercised).
TINY_MODEL = ["--preset", "cpu_smoke", "--n-layer", "2", "--model-dim", "64", "--n-head", "2",
              "--seq-len", "32", "--batch-tokens", "256", "--micro-batch-seqs", "4"]
GPT2_VOCAB = 50257


# ----------------------------------------------------------------------------------------------
# Helpers: printing, running the trainer as a subprocess, reading its log

def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * max(0, 70 - len(title))}", flush=True)


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


STOP = {"reason": None}  # set on Ctrl-C/SIGTERM: runs still going are stopped, no new section starts


class TrainerRun:
    """``python -u train_gpt.py ARGV`` in its own process group; its output is echoed with a prefix.

    ``wait(deadline)`` stops it at ``deadline`` (``time.monotonic()`` seconds): SIGTERM to its
    group (the trainer then closes its log as incomplete), SIGKILL 20 s later if needed.
    """

    running = []  # runs not yet waited for, stopped on Ctrl-C

    def __init__(self, name, argv, out_dir, echo=True):
        self.name, self.argv, self.echo = name, list(argv), echo
        self.log_dir = os.path.join(out_dir, "logs")
        self.console_path = os.path.join(self.log_dir, f"{name}.console.txt")
        self.proc, self.rc, self.timed_out, self.wall_s = None, None, False, 0.0

    def start(self):
        os.makedirs(self.log_dir, exist_ok=True)
        for ext in (".txt", ".json"):  # never read a stale log of an earlier check
            path = os.path.join(self.log_dir, self.name + ext)
            if os.path.exists(path):
                os.remove(path)
        cmd = [sys.executable, "-u", TRAINER, *self.argv]
        print(f"[{self.name}] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
        self.t0 = time.monotonic()
        self.console = open(self.console_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._tee, daemon=True)
        self.reader.start()
        TrainerRun.running.append(self)
        return self

    def _tee(self):
        try:
            for line in iter(self.proc.stdout.readline, ""):
                self.console.write(line)
                self.console.flush()
                if self.echo:
                    print(f"[{self.name} {time.monotonic() - self.t0:6.1f}s] {line.rstrip()}", flush=True)
        except (ValueError, OSError):  # console closed by wait() while a straggler still held the pipe
            pass

    def _signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)  # the group this run's own session leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self):
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()

    def wait(self, deadline):
        try:
            if STOP["reason"]:
                raise KeyboardInterrupt(STOP["reason"])
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            print(f"[{self.name}] time budget reached: stopping it and reporting what its log holds",
                  flush=True)
            self.stop()
        except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: stop the run, keep what its log holds
            STOP["reason"] = STOP["reason"] or f"interrupted ({e or 'KeyboardInterrupt'})"
            print(f"[{self.name}] {STOP['reason']}: stopping it", flush=True)
            self.stop()
        self.rc = self.proc.returncode
        self.wall_s = time.monotonic() - self.t0
        self.reader.join(timeout=10)
        self.console.close()
        if self in TrainerRun.running:
            TrainerRun.running.remove(self)
        return self.result()

    def result(self):
        """dict: rc, timed_out, wall_s, paths, the trainer's JSON summary, and its parsed log."""
        log_path = os.path.join(self.log_dir, self.name + ".txt")
        json_path = os.path.join(self.log_dir, self.name + ".json")
        text = ""
        if os.path.exists(log_path):
            with open(log_path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        summary = None
        if os.path.exists(json_path):
            with open(json_path, encoding="utf-8") as f:
                summary = json.load(f)
        out = dict(name=self.name, argv=self.argv, rc=self.rc, timed_out=self.timed_out,
                   wall_s=round(self.wall_s, 1), log=log_path, console=self.console_path,
                   summary=summary)
        out.update(parse_log(text))
        return out


STEP_RE = re.compile(r"^step:(\d+)/(\d+) (train_loss|val_loss):(\S+) train_time:(\d+)ms "
                     r"step_avg:([0-9.]+)ms(.*)$")
COMPILE_RE = re.compile(r"^compile: warm-up of (\d+) phase graph\(s\) took (\d+)ms")
SWITCH_RE = re.compile(r"^tst_switch: step (\d+)")


def parse_log(text):
    """Step lines of a trainer log (after its source snapshot) -> train/val records.

    Returns dict ``train`` (list of {step, loss, train_time_ms, phase, tokens, positions}),
    ``val`` (list of {step, loss, loss_tst}), ``compile_ms`` (float or None),
    ``n_compiled_phases`` and ``switch_step`` (ints or None), ``status`` (the ``status:`` line).
    ``train_time_ms`` is ``step_avg * step`` (0.01 ms resolution per step) rather than the
    integer ``train_time`` field.
    """
    body = text.split(SEPARATOR + "\n", 1)[1] if SEPARATOR and SEPARATOR + "\n" in text else text
    train, val, compile_ms, n_phases, switch, status = [], [], None, None, None, None
    for line in body.splitlines():
        m = STEP_RE.match(line)
        if m:
            step = int(m.group(1))
            extra = dict(kv.split(":", 1) for kv in m.group(7).split() if ":" in kv)
            if m.group(3) == "train_loss":
                train.append(dict(step=step, loss=float(m.group(4)),
                                  train_time_ms=float(m.group(6)) * step, phase=int(extra.get("phase", 0)),
                                  tokens=int(extra.get("tokens", 0)), positions=int(extra.get("positions", 0))))
            else:
                tst = extra.get("val_loss_tst")
                val.append(dict(step=step, loss=float(m.group(4)), loss_tst=float(tst) if tst else None))
            continue
        m = COMPILE_RE.match(line)
        if m:
            n_phases, compile_ms = int(m.group(1)), float(m.group(2))
        m = SWITCH_RE.match(line)
        if m:
            switch = int(m.group(1))
        if line.startswith("status:"):
            status = line.split()[0].split(":", 1)[1]
    return dict(train=train, val=val, compile_ms=compile_ms, n_compiled_phases=n_phases,
                switch_step=switch, status=status)


# ----------------------------------------------------------------------------------------------
# 1. Environment

def _quiet(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=15).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _try(fn, default=None):
    try:
        return fn()
    except Exception:  # noqa: BLE001 -- version-dependent APIs: report None rather than fail
        return default


def _cpu_model():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device, use_compile):
    """Versions, device and backend settings (plain values, JSON-ready)."""
    env = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
               torch_cuda=torch.version.cuda, torch_git=_try(lambda: torch.version.git_version),
               host=platform.node(), platform=platform.platform(), cpu_cores=os.cpu_count(),
               torch_threads=torch.get_num_threads(), device=str(device),
               float32_matmul_precision=_try(torch.get_float32_matmul_precision))
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    env["compile"] = ("on: torch.compile(model, dynamic=False), default mode, inductor; Aurora's "
                      "direction compiled too" if use_compile else "off (eager)")
    env["compile_env"] = {k: v for k, v in os.environ.items()
                          if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE", "TORCHDYNAMO_", "TRITON_"))}
    if use_compile:
        inductor = {}
        try:
            from torch._inductor import config as ic
            for k in ("max_autotune", "coordinate_descent_tuning", "triton.cudagraphs", "freezing"):
                obj = ic
                for part in k.split("."):
                    obj = getattr(obj, part)
                inductor[k] = obj
        except Exception:  # noqa: BLE001
            pass
        env["inductor_config"] = inductor
        # a warm cache (an earlier run on this box) makes the compile time much shorter
        cache = _try(lambda: __import__("torch._inductor.runtime.cache_dir_utils",
                                        fromlist=["default_cache_dir"]).default_cache_dir())
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache or os.path.join(
            tempfile.gettempdir(), "torchinductor_" + _try(getpass.getuser, "unknown"))
        env["inductor_cache_dir"] = cache
        env["inductor_cache_warm"] = os.path.isdir(cache) and bool(_try(lambda: os.listdir(cache), []))
    env["cpu"] = _cpu_model()
    if device.type != "cuda":
        return env

    props = torch.cuda.get_device_properties(device)
    env.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
               gpu_memory_gib=round(props.total_memory / 2**30, 1),
               compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
               cudnn=_try(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
               nccl=_try(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
               fp32_precision_cuda_matmul=_try(lambda: torch.backends.cuda.matmul.fp32_precision))  # torch >= 2.9
    free, total = _try(lambda: torch.cuda.mem_get_info(device), (None, None))
    env["gpu_memory_free_gib"] = round(free / 2**30, 1) if free else None
    env["driver"] = (_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                     .splitlines() or [None])[0]
    m = re.search(r"CUDA Version:\s*([0-9.]+)", _quiet(["nvidia-smi"]))
    env["driver_cuda"] = m.group(1) if m else None  # the newest CUDA the driver supports
    smi = _quiet(["nvidia-smi", "--query-gpu=clocks.max.sm,clocks.sm,power.limit,temperature.gpu",
                  "--format=csv,noheader"])
    env["nvidia_smi"] = dict(zip(("max_sm_clock", "sm_clock", "power_limit", "temperature"),
                                 (x.strip() for x in smi.splitlines()[0].split(",")))) if smi else None
    cb = torch.backends.cuda
    env["sdpa_enabled"] = {name: _try(getattr(cb, fn)) for name, fn in (
        ("flash", "flash_sdp_enabled"), ("mem_efficient", "mem_efficient_sdp_enabled"),
        ("math", "math_sdp_enabled"), ("cudnn", "cudnn_sdp_enabled")) if hasattr(cb, fn)}
    env["flash_attention_built"] = _try(cb.is_flash_attention_available) if hasattr(
        cb, "is_flash_attention_available") else None
    env["nominal_bf16_tflops"] = next((v for k, v in NOMINAL_BF16_TFLOPS if k in props.name), None)
    return env


# ----------------------------------------------------------------------------------------------
# 2. Micro-benchmarks

def time_ms(fn, iters, device):
    """Mean milliseconds per call of ``fn`` over ``iters`` calls (CUDA events on CUDA, wall clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1000 * (time.perf_counter() - t0) / iters


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_matmul(device, n, dtype, warmup=3, iters=10, trials=5):
    """Dense ``[n, n] @ [n, n]`` in ``dtype``: dict with TFLOP/s (median and best of ``trials``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
    for _ in range(warmup):
        fn()
    sync(device)
    ms = sorted(time_ms(fn, iters, device) for _ in range(trials))
    rate = lambda m: 2 * n ** 3 / (m / 1e3) / 1e12  # noqa: E731
    del a, b, c
    return dict(n=n, dtype=str(dtype).replace("torch.", ""), ms_per_matmul=round(statistics.median(ms), 4),
                tflops=round(rate(statistics.median(ms)), 2), tflops_best=round(rate(ms[0]), 2))


def bench_copy(device, nbytes, iters=10):
    """``dst.copy_(src)`` of ``nbytes`` on the device: GB/s counting bytes read + bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    fn()
    sync(device)
    ms = min(time_ms(fn, iters, device) for _ in range(3))
    del src, dst
    return dict(bytes=nbytes, ms=round(ms, 4), gbps=round(2 * nbytes / (ms / 1e3) / 1e9, 1))


def bench_h2d(device, nbytes, iters=10):
    """Pinned host -> device copy of ``nbytes`` (CUDA only): GB/s, one direction."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    fn = lambda: dst.copy_(host, non_blocking=True)  # noqa: E731
    fn()
    sync(device)
    ms = min(time_ms(fn, iters, device) for _ in range(3))
    del host, dst
    return dict(bytes=nbytes, ms=round(ms, 4), gbps=round(nbytes / (ms / 1e3) / 1e9, 1))


def bench_sdpa(device, batch=64, heads=6, seq=1024, head_dim=128, iters=5):
    """Causal bf16 SDPA forward at the record model's shape under each backend: ms or the error."""
    out = {}
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    call()
    sync(device)
    out["default"] = round(time_ms(call, iters, device), 3)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # torch >= 2.3
    except ImportError:
        return out
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel(backend):
                call()
                sync(device)
                out[name.lower()] = round(time_ms(call, iters, device), 3)
        except Exception as e:  # noqa: BLE001 -- unsupported backend for this shape/GPU
            out[name.lower()] = f"unavailable ({type(e).__name__})"
    del q, k, v
    return out


def _attempt(fn):
    """fn() or, when it raises, {"error": "..."} (one failed benchmark must not hide the others)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def microbench(device, args):
    """Device speed: matmul TFLOP/s, copy GB/s (and H2D GB/s, SDPA ms on CUDA).

    The matmul rate is the MFU denominator: a failure there fails the section; the others
    report ``{"error": ...}`` instead.
    """
    if device.type == "cuda":
        res = dict(matmul=bench_matmul(device, args.matmul_n, torch.bfloat16))
        res["copy"] = _attempt(lambda: bench_copy(device, 1 << 30))
        res["h2d"] = _attempt(lambda: bench_h2d(device, 256 << 20))
        res["sdpa_ms"] = _attempt(lambda: bench_sdpa(device))  # last: a bad kernel could break the context
        _try(torch.cuda.empty_cache)  # the trainer subprocesses get the memory back
    else:  # --dry-run: the trainer's CPU runs are float32
        res = dict(matmul=bench_matmul(device, min(args.matmul_n, 512), torch.float32, warmup=1, iters=3, trials=3),
                   copy=_attempt(lambda: bench_copy(device, 64 << 20, iters=3)), h2d=None, sdpa_ms=None)
    m = res["matmul"]
    print(f"matmul {m['n']}^3 {m['dtype']}: {m['tflops']} TFLOP/s (best {m['tflops_best']}), "
          f"{m['ms_per_matmul']} ms each")
    print(f"device copy (read + write): {json.dumps(res['copy'])}")
    if res["h2d"]:
        print(f"pinned host->device: {json.dumps(res['h2d'])}")
    if res["sdpa_ms"]:
        print("SDPA causal bf16 [64, 6, 1024, 128] forward ms: " + json.dumps(res["sdpa_ms"]))
    return res


# ----------------------------------------------------------------------------------------------
# Data: synthetic shards (random GPT-2 ids) unless real ones are given

def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = 20240520, 1, len(tokens)  # magic, version, n_tokens (SPEC.md)
    if T is not None:
        header[0], header[1] = T.SHARD_MAGIC, T.SHARD_VERSION
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())
    os.replace(tmp, path)


def window_train_tokens(args):
    """Raw train tokens the timing window reads (TST phase 1 reads s tokens per position)."""
    if T is None:
        return 100 << 20
    cfg, _ = T.parse_config(timing_argv(args, [], "cpu", "")[1])
    switch, seqs = T.tst_switch_step(cfg), cfg.batch_tokens // cfg.seq_len
    total = 0
    for steps, step in ((switch, 0), (cfg.num_iterations - switch, cfg.num_iterations - 1)):
        _, s, mode = T.phase_of(step, cfg)
        seq_tokens, advance = T.sequence_layout(mode, s, cfg.seq_len)
        total += steps * seqs * advance + seq_tokens
    return total


def data_args(args, out_dir):
    """``--train-files/--val-files`` words: the given globs, or freshly written synthetic shards."""
    if args.train_files or args.val_files:
        if not (args.train_files and args.val_files):
            raise ValueError("give both --train-files and --val-files, or neither (synthetic shards)")
        return ["--train-files", args.train_files, "--val-files", args.val_files], None
    d = os.path.join(out_dir, "synthetic_data")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    # enough tokens for the whole timing window, so no read wraps around (nor trips a check for it)
    per_shard = max(100_000, -(-int(1.1 * window_train_tokens(args)) // 2))
    for i in (1, 2):
        toks = rng.integers(0, GPT2_VOCAB, size=per_shard, dtype=np.uint16)
        toks[::1024] = 50256  # an <|endoftext|> now and then, as in real shards
        write_shard(os.path.join(d, f"synthetic_train_{i:06d}.bin"), toks)
    n_val = max(args.val_tokens, 4096) + 1024
    write_shard(os.path.join(d, "synthetic_val_000000.bin"), rng.integers(0, GPT2_VOCAB, size=n_val, dtype=np.uint16))
    print(f"synthetic shards in {d}: train 2 x {per_shard:,} tokens, val {n_val:,} tokens")
    return ["--train-files", os.path.join(d, "synthetic_train_*.bin"),
            "--val-files", os.path.join(d, "synthetic_val_*.bin")], d


# ----------------------------------------------------------------------------------------------
# 3. Correctness: the same tiny fp32 eager run on CPU and on the device

def correctness_argv(steps, data, device_kind, out_dir, run_id):
    return [*TINY_MODEL, *data, "--num-iterations", str(steps), "--tst-frac", "0.4", "--val-tokens", "1024",
            "--val-every", "0", "--log-every", "1", "--no-bf16", "--no-compile", "--seed", "0",
            "--device", device_kind, "--log-dir", os.path.join(out_dir, "logs"), "--run-id", run_id]


def compare_losses(ref, dev, tol):
    """Rows (what, step, reference, device, |diff|) of every loss both logs report; pass/fail."""
    keyed = lambda r: {**{("train_loss", x["step"]): x["loss"] for x in r["train"]},  # noqa: E731
                       **{("val_loss", x["step"]): x["loss"] for x in r["val"]},
                       **{("val_loss_tst", x["step"]): x["loss_tst"] for x in r["val"] if x["loss_tst"] is not None}}
    a, b = keyed(ref), keyed(dev)
    rows = []
    for key in sorted(set(a) | set(b), key=lambda k: (k[0] != "train_loss", k[0], k[1])):
        x, y = a.get(key), b.get(key)
        diff = abs(x - y) if x is not None and y is not None else None
        rows.append(dict(what=key[0], step=key[1], reference=x, device=y, abs_diff=diff))
    diffs = [r["abs_diff"] for r in rows]
    complete = bool(rows) and all(d is not None for d in diffs)
    max_diff = max((d for d in diffs if d is not None), default=None)
    n_train = sum(r["what"] == "train_loss" for r in rows)
    passed = (ref["rc"] == 0 and dev["rc"] == 0 and complete and n_train > 0
              and max_diff is not None and max_diff <= tol)
    return rows, passed, max_diff


def correctness(device, data, args, out_dir, deadline):
    """Train the tiny model ``--correct-steps`` steps on CPU and on ``device``; compare every loss."""
    dev_kind = device.type
    ref = TrainerRun("check_ref_cpu", correctness_argv(args.correct_steps, data, "cpu", out_dir, "check_ref_cpu"),
                     out_dir)
    dut = TrainerRun(f"check_{dev_kind}", correctness_argv(args.correct_steps, data, dev_kind, out_dir,
                                                           f"check_{dev_kind}"), out_dir)
    limit = min(deadline, time.monotonic() + args.correct_timeout_s)
    if dev_kind == "cuda":  # different devices: run both at once (the box has cores to spare)
        ref.start(), dut.start()
        r_ref, r_dut = ref.wait(limit), dut.wait(limit)
    else:  # --dry-run on a 2-core box: one after the other
        r_ref = ref.start().wait(limit)
        r_dut = dut.start().wait(limit)
    rows, passed, max_diff = compare_losses(r_ref, r_dut, args.tol)
    print(f"\n{'loss':<14}{'step':>5}{'cpu (ref)':>14}{dev_kind:>14}{'|diff|':>12}")
    for r in rows:
        f = lambda v, w: f"{v:>{w}.4f}" if v is not None else f"{'missing':>{w}}"  # noqa: E731
        diff = format(r["abs_diff"], ".1e") if r["abs_diff"] is not None else "-"
        print(f"{r['what']:<14}{r['step']:>5}{f(r['reference'], 14)}{f(r['device'], 14)}{diff:>12}")
    verdict = "PASS" if passed else "FAIL"
    print(f"correctness: {verdict} (max |diff| {max_diff} vs tolerance {args.tol}; "
          f"exit codes cpu {r_ref['rc']}, {dev_kind} {r_dut['rc']})")
    strip = lambda r: {k: r[k] for k in ("name", "argv", "rc", "timed_out", "wall_s", "log", "status")}  # noqa: E731
    return dict(passed=passed, tol=args.tol, max_abs_diff=max_diff, steps=args.correct_steps,
                device=dev_kind, rows=rows, reference_run=strip(r_ref), device_run=strip(r_dut))


# ----------------------------------------------------------------------------------------------
# 4. Timing window of the preset, and the projection of its full run

def step_times(train):
    """Per-step ms from cumulative train_time: list of {step, phase, ms, tokens, positions} per step."""
    rows, prev = [], dict(step=0, train_time_ms=0.0, tokens=0, positions=0)
    for r in sorted(train, key=lambda x: x["step"]):
        n = r["step"] - prev["step"]
        if n <= 0:
            continue
        rows.append(dict(step=r["step"], phase=r["phase"], ms=(r["train_time_ms"] - prev["train_time_ms"]) / n,
                         tokens=(r["tokens"] - prev["tokens"]) / n, positions=(r["positions"] - prev["positions"]) / n))
        prev = r
    return rows


def phase_stats(rows, phase, flops_per_step, matmul_tflops, nominal_tflops, warmup_ratio=1.25):
    """ms/step (mean over kept steps; median too), tokens/s, positions/s, TFLOP/s and MFU of a phase.

    The phase's first step is dropped when it is > ``warmup_ratio`` x the median of the others.
    Returns None when the log holds no step of this phase.
    """
    rs = [r for r in rows if r["phase"] == phase]
    if not rs:
        return None
    ms = [r["ms"] for r in rs]
    drop = len(ms) >= 3 and ms[0] > warmup_ratio * statistics.median(ms[1:])
    kept = ms[1:] if drop else ms
    mean = sum(kept) / len(kept)
    tokens, positions = rs[-1]["tokens"], rs[-1]["positions"]  # per step; constant within a phase
    achieved = flops_per_step / (mean / 1e3) / 1e12 if flops_per_step else None
    return dict(steps_logged=len(ms), steps_used=len(kept), first_step_ms=round(ms[0], 2),
                first_step_dropped=drop, ms_per_step=round(mean, 2), ms_median=round(statistics.median(kept), 2),
                ms_min=round(min(kept), 2), ms_max=round(max(kept), 2),
                raw_tokens_per_step=round(tokens), positions_per_step=round(positions),
                raw_tokens_per_s=round(tokens / (mean / 1e3)), positions_per_s=round(positions / (mean / 1e3)),
                flops_per_step=flops_per_step, achieved_tflops=round(achieved, 3) if achieved else None,
                mfu_measured=round(achieved / matmul_tflops, 4) if achieved and matmul_tflops else None,
                mfu_nominal=round(achieved / nominal_tflops, 4) if achieved and nominal_tflops else None)


def timing_argv(args, data, device_kind, out_dir):
    """Preset (+ --dry-run's tiny model) + data + --trainer-args, then the window flags (which win)."""
    base = ["--preset", args.preset] + (TINY_MODEL[2:] if args.dry_run else []) + data + shlex.split(args.trainer_args)
    window = ["--num-iterations", str(2 * args.steps), "--tst-frac", "0.5", "--max-steps", "0",
              "--val-every", "0", "--val-tokens", str(args.val_tokens), "--log-every", "1",
              "--device", device_kind, "--log-dir", os.path.join(out_dir, "logs"), "--run-id", "timing"]
    if args.compile is not None:
        window.append("--compile" if args.compile else "--no-compile")
    return base, base + window


def projection(args, base_argv, p1_ms, p2_ms):
    """Train time of the full preset run (its own N and r; window flags not applied), ms."""
    if T is None:
        raise RuntimeError(TRAINER_IMPORT_ERROR)
    cfg, _ = T.parse_config(base_argv)
    switch = T.tst_switch_step(cfg)
    n1, n2 = switch, cfg.num_iterations - switch
    out = dict(preset=args.preset, num_iterations=cfg.num_iterations, tst_frac=cfg.tst_frac, switch_step=switch,
               phase1_steps=n1, phase2_steps=n2, projected_train_time_ms=None, projected_train_time_min=None)
    if (n1 and p1_ms is None) or (n2 and p2_ms is None):
        return out  # a phase the full run needs was not measured
    ms = n1 * (p1_ms or 0.0) + n2 * (p2_ms or 0.0)
    out.update(projected_train_time_ms=round(ms), projected_train_time_min=round(ms / 60e3, 2))
    return out


def timing(device, data, args, out_dir, deadline, micro, env):
    """The preset for 2 x --steps steps (switch in the middle); per-phase speed and the projection."""
    base, argv = timing_argv(args, data, device.type, out_dir)
    run = TrainerRun("timing", argv, out_dir)
    res = run.start().wait(deadline - 25)  # leave time to stop it (SIGTERM, 20 s, SIGKILL) and summarize
    if T is None:
        raise RuntimeError(TRAINER_IMPORT_ERROR)
    cfg, _ = T.parse_config(argv)
    flops_per_step = T.model_flops_per_position(cfg) * cfg.batch_tokens
    matmul = (micro or {}).get("matmul", {}).get("tflops")
    nominal = env.get("nominal_bf16_tflops") if env else None
    rows = step_times(res["train"])
    p1 = phase_stats(rows, 1, flops_per_step, matmul, nominal)
    p2 = phase_stats(rows, 2, flops_per_step, matmul, nominal)
    s = res["summary"] or {}
    out = dict(run=dict((k, res[k]) for k in ("name", "argv", "rc", "timed_out", "wall_s", "log", "status")),
               preset=args.preset, steps_requested=2 * args.steps, steps_logged=len(rows),
               switch_step=res["switch_step"], compile_time_ms=s.get("compile_time_ms", res["compile_ms"]),
               compiled_phases=res["n_compiled_phases"],
               graphs_compiled_during_training=s.get("graphs_compiled_during_training"),
               peak_memory_mib=s.get("peak_memory_mib"), final_val_loss=s.get("final_val_loss"),
               flops_per_position=T.model_flops_per_position(cfg), flops_per_step=flops_per_step,
               batch_positions=cfg.batch_tokens, micro_batch_seqs=cfg.micro_batch_seqs,
               phase1=p1, phase2=p2, per_step=[dict(r, ms=round(r["ms"], 3)) for r in rows])
    out["projection"] = projection(args, base, p1 and p1["ms_per_step"], p2 and p2["ms_per_step"])
    problems = []
    if res["rc"] != 0:
        problems.append(f"trainer exit status {res['rc']}" + (" (stopped at the time budget)" if res["timed_out"] else ""))
    for name, p in (("phase 1", p1), ("phase 2", p2)):
        if p is None:
            problems.append(f"no {name} step was logged")
    if out["projection"]["projected_train_time_ms"] is None:
        problems.append("no projection (a phase is missing)")
    out["problems"] = problems
    warnings = []  # worth a look, but the numbers stand
    if out["graphs_compiled_during_training"]:
        warnings.append(f"{out['graphs_compiled_during_training']} graph(s) compiled inside the timed window "
                        f"(recompilation: the step times include compile time)")
    if p1 and p2 and p2["first_step_ms"] > 2 * p2["ms_median"]:
        warnings.append(f"the first phase-2 step (the TST switch) took {p2['first_step_ms']:.0f} ms vs "
                        f"{p2['ms_median']:.0f} ms median: something is (re)built at the switch")
    out["warnings"] = warnings
    return out


# ----------------------------------------------------------------------------------------------
# 5. Summary table and JSON

def fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-2):
            return f"{v:.3e}"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pct(fraction):
    return "-" if fraction is None else f"{100 * fraction:.1f}"


def slash(*values):
    return " / ".join(fmt(v) for v in values)


def summary_rows(res):
    """(section, item, value, unit) rows of the final table."""
    env, mb, cc, tm = res.get("env") or {}, res.get("microbench") or {}, res.get("correctness") or {}, res.get("timing") or {}
    rows = [("env", "device", env.get("gpu") or env.get("cpu") or env.get("device"), ""),
            ("env", "gpu memory", env.get("gpu_memory_gib"), "GiB"),
            ("env", "driver (its CUDA) / torch CUDA / cuDNN",
             f"{env.get('driver')} ({env.get('driver_cuda')}) / {env.get('torch_cuda')} / {env.get('cudnn')}", ""),
            ("env", "torch / triton / python", slash(env.get("torch"), env.get("triton"), env.get("python")), ""),
            ("env", "compile", "on" if str(env.get("compile", "")).startswith("on") else "off", ""),
            ("env", "inductor cache warm before", env.get("inductor_cache_warm"), "")]
    m = mb.get("matmul") or {}
    rows += [("micro", f"matmul {m.get('n')}^3 {m.get('dtype')} (median / best)",
              slash(m.get("tflops"), m.get("tflops_best")), "TFLOP/s"),
             ("micro", "device copy (read + write)", (mb.get("copy") or {}).get("gbps"), "GB/s"),
             ("micro", "pinned host -> device", (mb.get("h2d") or {}).get("gbps"), "GB/s")]
    rows += [("correct", f"cpu vs {cc.get('device')} fp32, {cc.get('steps')} steps",
              "PASS" if cc.get("passed") else "FAIL", ""),
             ("correct", "max |loss diff| (tolerance)", f"{fmt(cc.get('max_abs_diff'))} ({cc.get('tol')})", "")]
    rows += [("timing", "preset / steps logged", slash(tm.get("preset"), tm.get("steps_logged")), ""),
             ("timing", "compile warm-up (all phase graphs)", tm.get("compile_time_ms"), "ms"),
             ("timing", "graphs compiled in timed window", tm.get("graphs_compiled_during_training"), "")]
    for name in ("phase1", "phase2"):
        p = tm.get(name) or {}
        rows += [(name, "ms/step (mean / median)", slash(p.get("ms_per_step"), p.get("ms_median")), "ms"),
                 (name, "first step (dropped as warm-up?)", f"{fmt(p.get('first_step_ms'))} ({fmt(p.get('first_step_dropped'))})", "ms"),
                 (name, "raw text tokens/s", p.get("raw_tokens_per_s"), "tokens/s"),
                 (name, "latent positions/s", p.get("positions_per_s"), "positions/s"),
                 (name, "model FLOPs/step", float(p["flops_per_step"]) if p.get("flops_per_step") else None, "FLOP"),
                 (name, "achieved", p.get("achieved_tflops"), "TFLOP/s"),
                 (name, "MFU vs measured matmul (vs datasheet peak)",
                  f"{pct(p.get('mfu_measured'))} ({pct(p.get('mfu_nominal'))})", "%")]
    pj = tm.get("projection") or {}
    rows += [("timing", "peak memory", tm.get("peak_memory_mib"), "MiB"),
             ("project", f"full {pj.get('preset') or res['args']['preset']}: N / phase 1 / phase 2 steps",
              slash(pj.get("num_iterations"), pj.get("phase1_steps"), pj.get("phase2_steps")), "steps"),
             ("project", "projected train time" + (" (dry run: the tiny model's step times)"
                                                   if res["args"].get("dry_run") else ""),
              f"{fmt(pj.get('projected_train_time_ms'))} "
              f"({fmt(pj.get('projected_train_time_min'))} min)", "ms"),
             ("result", "status / exit code", slash(res.get("status"), res.get("exit_code")), ""),
             ("result", "wall time of this check", res.get("wall_s"), "s")]
    return [(s, i, fmt(v), u) for s, i, v, u in rows]


def render_table(rows):
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{'gpu_check summary':=^{sum(w) + 9}}"]
    lines += [f"{s:<{w[0]}} | {i:<{w[1]}} | {v:>{w[2]}} | {u}" for s, i, v, u in rows]
    return "\n".join(lines)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few steps: checks this script")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "out", "gpu_check"), help="output dir")
    p.add_argument("--preset", default=None, help="trainer preset timed (default record_h200; cpu_smoke with --dry-run)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per TST phase (default 30; 3 with --dry-run)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="hard wall-clock limit of the whole check, s (default 470; 170 with --dry-run)")
    p.add_argument("--train-files", default=None, help="real train shards (glob); default: synthetic")
    p.add_argument("--val-files", default=None, help="real val shards (glob); default: synthetic")
    p.add_argument("--val-tokens", type=int, default=None, help="val tokens of the timing run (default 65536; 1024 dry)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile in the timing run (default: the trainer's, on with CUDA; off with --dry-run)")
    p.add_argument("--trainer-args", default="", help="extra train_gpt.py words for the timing run and projection")
    p.add_argument("--matmul-n", type=int, default=8192, help="matmul size n of the n^3 benchmark")
    p.add_argument("--correct-steps", type=int, default=5, help="steps of the CPU-vs-device check")
    p.add_argument("--correct-timeout-s", type=float, default=120.0, help="limit of the correctness runs, s")
    p.add_argument("--tol", type=float, default=1e-3, help="absolute loss tolerance of the correctness check")
    p.add_argument("--keep-data", action="store_true", help="keep the synthetic shards under --out")
    args = p.parse_args(argv)
    d = args.dry_run
    args.preset = args.preset or ("cpu_smoke" if d else "record_h200")
    args.steps = args.steps or (3 if d else 30)
    args.budget_s = args.budget_s or (170.0 if d else 470.0)
    args.val_tokens = args.val_tokens or (1024 if d else 65536)
    if d and args.compile is None:
        args.compile = False
    if args.steps < 2 or args.correct_steps < 2:
        p.error("--steps and --correct-steps must be >= 2")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv=None):
    args = parse_args(argv)
    # SIGTERM/SIGHUP (a job runner's timeout) unwind like Ctrl-C: the trainer runs, which live in
    # their own sessions, are stopped and the report is still written.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    res = dict(schema=SCHEMA, mode="dry-run (cpu)" if args.dry_run else "cuda",
               started=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
               args=vars(args), errors=[], warnings=[], section_wall_s={}, env=None, microbench=None,
               correctness=None, timing=None)
    if TRAINER_IMPORT_ERROR:
        res["errors"].append(TRAINER_IMPORT_ERROR)

    def section(name, fn, *a):
        banner(name)
        t0 = time.monotonic()
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 -- report it and go on with the other sections
            traceback.print_exc()
            res["errors"].append(f"{name}: {type(e).__name__}: {e}")
            return None
        finally:
            res["section_wall_s"][name] = round(time.monotonic() - t0, 1)

    synthetic_dir = None
    try:
        if args.dry_run:
            device = torch.device("cpu")
        elif torch.cuda.is_available():
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        else:
            device = None
            res["errors"].append("no CUDA device visible (torch.cuda.is_available() is False); "
                                 "use --dry-run to check this script on CPU")
        use_compile = args.compile if args.compile is not None else (device is not None and device.type == "cuda")
        if device is not None:
            print(f"gpu_check: {res['mode']}, budget {args.budget_s:.0f} s, out {out_dir}")
            res["env"] = section("1. environment", environment, device, use_compile)
            if res["env"]:
                print(json.dumps(res["env"], indent=1, default=str))
            res["microbench"] = section("2. micro-benchmarks", microbench, device, args)
            data = section("data", data_args, args, out_dir)
            if data:
                data, synthetic_dir = data
                res["correctness"] = section("3. correctness (cpu vs device, fp32, no compile)",
                                             correctness, device, data, args, out_dir, deadline)
                if not STOP["reason"]:
                    res["timing"] = section(f"4. timing window of {args.preset}", timing, device, data,
                                            args, out_dir, deadline, res["microbench"], res["env"])
                if res["timing"]:
                    res["errors"] += [f"timing: {p}" for p in res["timing"]["problems"]]
                    res["warnings"] += res["timing"]["warnings"]
    except KeyboardInterrupt as e:
        STOP["reason"] = STOP["reason"] or f"interrupted ({e or 'KeyboardInterrupt'})"
        for run in list(TrainerRun.running):
            run.stop()
    finally:
        if synthetic_dir and not args.keep_data:
            shutil.rmtree(synthetic_dir, ignore_errors=True)

    if STOP["reason"]:
        res["errors"].append(STOP["reason"])
    passed = bool(res["correctness"] and res["correctness"]["passed"])
    if not passed:
        res["errors"].append("correctness: " + ("FAILED" if res["correctness"] else "did not run"))
    res["exit_code"] = 1 if (res["correctness"] and not passed) else (2 if res["errors"] else 0)
    res["status"] = "ok" if res["exit_code"] == 0 else "failed"
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    table = render_table(summary_rows(res))
    banner("5. summary")
    print(table)
    for w in res["warnings"]:
        print(f"warning: {w}")
    for e in res["errors"]:
        print(f"error: {e}")
    res["summary_table"] = table
    write_json(os.path.join(out_dir, "gpu_check.json"), res)
    with open(os.path.join(out_dir, "gpu_check_summary.txt"), "w", encoding="utf-8") as f:
        f.write(table + "\n" + "".join(f"warning: {w}\n" for w in res["warnings"])
                + "".join(f"error: {e}\n" for e in res["errors"]))
    print(f"\nwrote {os.path.join(out_dir, 'gpu_check.json')} and gpu_check_summary.txt "
          f"(trainer logs in {os.path.join(out_dir, 'logs')})")
    return res["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
