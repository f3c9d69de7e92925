"""One-shot CUDA check of train_gpt.py for a short slot, ordered by value, inside a stated time budget.

    OUT=<folder> python bench/gpu_check.py    # on the GPU box: --budget-s 530 (fits a 570 s slot, cold cache)
    OUT=<folder> python bench/gpu_check.py --dry-run   # the same plan on CPU at the check model's shape (CI runs it)

Sections, in this order (each starts only while the budget leaves it room; everything stops RESERVE_S,
45 s, before the budget's end: the report's):
1. environment and micro-benchmarks (matmul TFLOP/s, copy GB/s, SDPA backends: seconds);
2. the timing runs, which may use the whole budget but the reserve: baseline_h200 (record #89 as
   modded-nanogpt runs it), then record_h200 only if the time the first one took is left; compiled, N =
   --steps steps covering every stage of the stage table, both TST phases and both sides of the head's
   untie, a 262,144-token val chunk at the start and the end; per stage the median ms/step without its
   first two steps, tokens/s, MFU, memory, the full run's time projected stage by stage; each warm-up
   item's compile time goes into the JSON as the trainer logs it (a run cut short says how far it got).
   On a box with N >= 2 GPUs (--nproc: the largest of 2, 4, 8 it has) each timing run is the trainer under
   torchrun with N processes, and after the first one its ranks' warm-up skew (the trainer's log line) and a
   communication profile: the same preset again under torchrun, steps 4-6 under torch.profiler on every rank,
   each collective's NCCL kernel time (reduce-scatter, all-gather, all-reduce) per step and share of the step
   (bench/gpu_comm.py);
3. kernel agreement (float32 or FP8, random inputs): fp8_linear vs float64 at current scales and at the
   presets' fixed head and delayed down-projection scales (record shapes on CUDA), the two FP8 head-gradient
   layouts timed (CUDA), FlexAttention vs masked SDPA, the trainer's loss vs float64, and on the check model
   (the smoke model's layer roles at 64 wide: CHECK_MODEL) FlexAttention vs SDPA and compiled vs eager (CUDA);
   then a one-step torch.profiler breakdown and max_memory_reserved; then on CUDA FlexAttention's TRITON and
   FLASH backends at the record's attention shapes (forward and forward + backward ms, difference vs SDPA);
4. trainer agreement runs of the check model: CPU fp32 vs device fp32, bf16 vs fp32, and bf16 + FP8
   vs bf16 where the GPU has FP8 (compute capability 8.9+; else said skipped);
5. report: three files in $OUT (else --out), the JSON and the logs' archive rewritten after every
   section and while a run is waited for (a kill keeps what was measured): gpu_check.json,
   gpu_check_summary.txt, gpu_check_logs.tar.gz; the summary (<= 3,000 characters: timing, PASS/FAIL,
   what was cut) printed last. Issue 46's rows (``attention_backends``, ``communication``) are in the JSON
   whatever ran, each saying why when it did not (``pending_rows``: on the CPU, on one GPU).
Exit status: 0 all passed, 1 an agreement check failed, 2 anything else (crash, budget, missing phase).
Details (what to read, tolerances, the projection, where the time goes): docs/GPU_CHECK.md.
"""
import argparse
import collections
import dataclasses
import datetime
import functools
import getpass
import glob
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
import tarfile
import tempfile
import threading
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from _paths import BENCH, REPO, glue_option, use  # noqa: E402
use(BENCH)  # this folder's tools by name, however this module was imported
TRAINER = os.path.join(REPO, "train_gpt.py")
import gpu_kernels  # noqa: E402 -- the in-process checks (run as a subprocess; here: why a row cannot run)
from gpu_comm import COLLECTIVES, communication_rows  # noqa: E402 -- the torchrun profile's rows
from data.shard_format import EOT_TOKEN, write_shard  # noqa: E402 -- the one shard writer
from records.compare import parse_step_line  # noqa: E402 -- the one step-line parser
try:  # a broken trainer must not stop the environment and device checks from reporting
    import harness as H
    import train_gpt as T
    TRAINER_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001
    H, T, TRAINER_IMPORT_ERROR = None, None, f"import train_gpt failed: {type(_e).__name__}: {_e}"

SEPARATOR = H.SEPARATOR if T else None  # the trainer log's line between source snapshot and run
SCHEMA = "gpu_check-2"

# The check model: record_h200's recipe (TST, the stage table, Aurora + NorMuon, the tied head, the sigmoid cap,
# the multi-token and prefix objectives) on the smoke model's layer roles (every role of record #89's model: paired
# heads, key offset, XSA, output gate, DC, gated value embeddings, the gated skip, attention from an earlier state,
# MUDD and its gate MLPs, bigram hash, smear, half RoPE + YaRN) at 64 wide, 4 heads of 16 (FlexAttention's smallest
# head), windows in blocks of 8 positions: ``CHECK``, named "check" in ``SPECS`` (the specs --model may name here,
# train_gpt.MODELS and it) and, in each trainer run of it, in the SPECS that the launcher patch CHECK_SPECS builds in
# the trainer's process and LAUNCH passes to ``train_gpt.main(argv, models=SPECS)``. 1 -> 2 -> 3 sequences of 64
# positions a step, one per micro-batch; (short, long) windows (8, 24), (24, 56), (40, 88), then (48, 104): each
# binds. --dry-run's timing runs use the shape.
CHECK_SPEC = dict(model_dim=64, bigram_vocab=4096, window_block=8)  # what differs from MODELS["smoke"]
CHECK = dataclasses.replace(T.MODELS["smoke"], **CHECK_SPEC) if T else None
SPECS = dict(T.MODELS, check=CHECK) if T else {}
CHECK_SPECS = ("import dataclasses, train_gpt; SPECS = dict(train_gpt.MODELS, check=dataclasses.replace("
               f"train_gpt.MODELS['smoke'], **{CHECK_SPEC!r}))")  # the same SPECS, in a trainer run's process
CHECK_SHAPE = ["--model", "check", "--seq-len", "64", "--batch-tokens", "192", "--micro-batch-seqs", "1",
               "--val-seq-len", "0"]
CHECK_MODEL = ["--preset", "record_h200", *CHECK_SHAPE, "--extension-steps", "1"]
# The in-process model checks (bench/gpu_kernels.py) at 128 positions: a 128-block (two in paired layers).
MODEL_CHECK_SHAPE = ["--seq-len", "128", "--batch-tokens", "384"]
# The checks' runs (--correct-steps, CHECK_STEPS): steps 1-2 in TST phase 1, 3-5 in phase 2 (the switch inside
# stage 2), the extension at step 5; the val loss drops on the Zipf-distributed check data.
CHECK_TRAIN = ["--tst-frac", "0.4", "--val-tokens", "512", "--val-every", "0", "--log-every", "1", "--seed", "0"]
CHECK_STEPS = 5
DROP_FIRST_STEPS = 2  # steps at the start of each stage (and phase) left out of its median ms/step
RECORD89_H100_MIN = 9.84  # record #89 (2026-07-17): 8 x H100 x its record table's 1.23 min (its logs' mean
                          # train_time, 79.7 s, would be 10.6; docs/RECORD89.md says why they differ)
GOAL_MIN = 8.0            # this repository's goal: the train time to 3.28 on one H200, minutes
SUMMARY_CHARS = 3000      # the summary printed last: what a job runner's output tail surely keeps
CHECK_MEAN_DOC = 40     # check data: short documents, so document masks and windows both bind
TIMING_MEAN_DOC = 1024  # timing data: documents of web-page scale
GPT2_VOCAB = 50257


def config_of(argv):
    """``(Config, preset)`` of trainer words, parsed and checked as ``train_gpt.main`` does (SystemExit 2 or
    ConfigError on words it refuses)."""
    cfg, preset, _ = H.parse_flags(T.Config, T.PRESETS, argv)
    T.check_config(cfg, SPECS)
    return cfg, preset


def spec_of(cfg):
    """The ModelSpec a Config's --model names (``SPECS``: the check model too)."""
    return SPECS[cfg.model]


# ----------------------------------------------------------------------------------------------
# Helpers: printing, running the trainer as a subprocess, reading its log

def banner(title):
    print(f"\n{'=' * 20} {title} {'=' * max(0, 70 - len(title))}", flush=True)


CHILD_THREADS = {}  # --dry-run: {"OMP_NUM_THREADS": "1"} unless set (main): runs side by side, not oversubscribed


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return {**CHILD_THREADS, **env}


# main's: SAVE["fn"](archive) rewrites the JSON (and with archive the logs' archive) in $OUT; "dirty": a running
# trainer logged something the JSON should hold (a warm-up item's compile time, a step), rewritten within a second
SAVE = {"fn": None, "dirty": False}
POLL_GPU = {"on": False}  # on CUDA (main): trainer runs sample nvidia-smi's memory in use
STOP = {"reason": None}  # set on Ctrl-C/SIGTERM: runs still going are stopped, no new section starts


# Patches a trainer run may be launched with (``python -c "PATCH; ...; LAUNCH" train_gpt.py ARGV``), each one
# statement: CHECK_SPECS (above), the check model's spec; EAGER_BACKEND: --dry-run's compiled timing run under
# torch.compile(backend="eager"), Dynamo's graphs, guards and recompiles as on CUDA (the warm-up's compile lines,
# graphs_compiled_during_training) without code generation; FP32_POLAR: the agreement checks' float32 runs with
# NorMuon's Newton-Schulz in float32 on every device (the trainer's is bf16 on CUDA, float32 on a CPU), so CPU and
# GPU float32 runs compute the same thing.
EAGER_BACKEND = "import functools, torch; torch.compile = functools.partial(torch.compile, backend='eager')"
FP32_POLAR = ("import aurora_opt, torch; "
              "aurora_opt.ns_dtype_on = lambda device, ns_dtype=None: ns_dtype or torch.float32")
# LAUNCH passes the SPECS a patch bound as the specs --model may name (none bound: the trainer's own MODELS)
LAUNCH = ("import sys, train_gpt; "  # argv: -c, train_gpt.py, ARGV
          "sys.exit(train_gpt.main(sys.argv[2:], models=globals().get('SPECS')))")


def torchrun_procs(n_gpus):
    """Processes of the timing runs on a box with ``n_gpus`` GPUs: the largest of 2, 4, 8 it has (a step's 8
    sequences split evenly, as run.sh), else 1 (no torchrun)."""
    return max((n for n in (2, 4, 8) if n <= n_gpus), default=1)


def trainer_command(argv, patches=(), nproc=1):
    """The command of one trainer run: ``python -u train_gpt.py ARGV``, or with ``patches`` (statements run first in
    the trainer's process) ``python -u -c "PATCHES; LAUNCH" train_gpt.py ARGV``; with ``nproc`` > 1 the same under
    ``python -m torch.distributed.run --standalone --nproc_per_node=N`` (the trainer's own launch, run.sh's; patched:
    torchrun's --no-python starting ``python -u -c ...`` in each process)."""
    launch = ["-c", "; ".join([*patches, LAUNCH])] if patches else []
    if nproc <= 1:
        return [sys.executable, "-u", *launch, TRAINER, *argv]
    torchrun = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if not patches:
        return [*torchrun, TRAINER, *argv]  # torchrun starts ``python -u train_gpt.py ARGV`` itself
    return [*torchrun, "--no-python", sys.executable, "-u", *launch, TRAINER, *argv]


def descendants(pid):
    """Process ids of ``pid``'s children, their children, ... (Linux ``/proc``; [] elsewhere or once gone)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(path, encoding="ascii") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


class TrainerRun:
    """``python -u train_gpt.py ARGV`` (``trainer_command``) in its own process group; its output is echoed with a
    prefix.

    ``wait(deadline)`` stops it at ``deadline`` (``time.monotonic()`` seconds): SIGTERM to its
    group (the trainer then closes its log as incomplete; torchrun passes it to its processes), SIGKILL 20 s later
    if needed, to torchrun's processes too (each leads its own session).
    ``on_line(line)``: called with each console line as it comes (from the reader thread).
    ``patches``: statements run before the trainer in its process (``EAGER_BACKEND``, ``FP32_POLAR``).
    ``nproc``: processes under torchrun (1: none); the console is rank 0's, the log is rank 0's.
    """

    running = []  # runs not yet waited for, stopped on Ctrl-C
    STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL this long after

    def __init__(self, name, argv, out_dir, echo=True, on_line=None, patches=(), nproc=1):
        self.name, self.argv, self.echo, self.on_line = name, list(argv), echo, on_line
        self.patches, self.nproc = list(patches), nproc
        self.log_dir = os.path.join(out_dir, "logs")
        self.console_path = os.path.join(self.log_dir, f"{name}.console.txt")
        self.proc, self.rc, self.timed_out, self.wall_s, self.stop_at_s = None, None, False, 0.0, None
        self.gpu_mem_mib = None  # the most GPU memory nvidia-smi saw in use during the run (POLL_GPU)

    def start(self):
        os.makedirs(self.log_dir, exist_ok=True)
        for ext in (".txt", ".json"):  # never read a stale log of an earlier check
            path = os.path.join(self.log_dir, self.name + ext)
            if os.path.exists(path):
                os.remove(path)
        cmd = trainer_command(self.argv, self.patches, self.nproc)
        print(f"[{self.name}] $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
        self.t0 = time.monotonic()
        self.console = open(self.console_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._tee, daemon=True)
        self.reader.start()
        if POLL_GPU["on"]:
            threading.Thread(target=self._poll_gpu, daemon=True).start()
        TrainerRun.running.append(self)
        return self

    def _tee(self):
        try:
            for line in iter(self.proc.stdout.readline, ""):
                self.console.write(line)
                self.console.flush()
                if self.on_line:
                    self.on_line(line.rstrip("\n"))
                if self.echo:
                    print(f"[{self.name} {time.monotonic() - self.t0:6.1f}s] {line.rstrip()}", flush=True)
        except (ValueError, OSError):  # console closed by wait() while a straggler still held the pipe
            pass

    def _poll_gpu(self):
        """Every second while the run lives: the GPU's memory in use (the trainer's reserved pool + context)."""
        while self.proc.poll() is None:
            used = _quiet(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]).splitlines()
            if used and used[0].strip().isdigit():
                self.gpu_mem_mib = max(self.gpu_mem_mib or 0, int(used[0]))
            time.sleep(1.0)

    def _signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)  # the group this run's own session leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self):
        if self.proc.poll() is None:
            workers = descendants(self.proc.pid) if self.nproc > 1 else []  # torchrun's: each its own session
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
            for pid in workers:  # none outlives the run (a GPU held by one would fail the next section)
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def wait(self, deadline):
        try:
            if STOP["reason"]:
                raise KeyboardInterrupt(STOP["reason"])
            archived = time.monotonic()
            while self.proc.poll() is None:  # the results rewritten as they come: a hard kill keeps them
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.name, deadline)
                try:
                    self.proc.wait(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    archived = refresh_results(archived)
        except subprocess.TimeoutExpired:
            self.timed_out, self.stop_at_s = True, round(time.monotonic() - self.t0, 1)
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
                   wall_s=round(self.wall_s, 1), stop_at_s=self.stop_at_s, log=log_path, console=self.console_path,
                   summary=summary, gpu_memory_used_max_mib=self.gpu_mem_mib)
        out.update(parse_log(text))
        return out


def refresh_results(archived, every_s=20.0):
    """While a subprocess is waited for: the JSON rewritten when a run logged something new (``SAVE["dirty"]``), the
    JSON and the logs' archive every ``every_s``; ``archived``: ``time.monotonic()`` of the last archive (returned,
    updated)."""
    now = time.monotonic()
    archive = now - archived >= every_s
    if SAVE["fn"] and (archive or SAVE["dirty"]):
        SAVE["dirty"] = False
        SAVE["fn"](archive)
    return now if archive else archived


# The trainer's warm-up lines (train_gpt.warm_up): one per item (a model graph key or an optimizer), then the total.
# PLAN_RE: a line announcing the items before the first, when the trainer logs one (cut short, the report then
# says "k of n items").
GRAPH_RE = re.compile(r"^compile: (train|val|optimizer) (.*?)(?: attention:(\S+))? took (\d+)ms, (\d+) graph")
COMPILE_RE = re.compile(r"^compile: warm-up took (\d+)ms \(not in train_time\), (\d+) graph")
PLAN_RE = re.compile(r"^compile: warm-up plan: (\d+) model graph keys?, (\d+) optimizers?")
SWITCH_RE = re.compile(r"^tst_switch: step (\d+)")
# several processes: each rank's warm-up time, gathered after the warm-up (the ranks meet at the first collective)
SKEW_RE = re.compile(r"^compile: warm-up per rank (\d+)-(\d+)ms, skew (\d+)ms \(--dist-timeout ([0-9.]+)s\)")


def skew_of(m):
    """The warm-up's spread over ranks (``SKEW_RE``'s match): {min_ms, max_ms, skew_ms, dist_timeout_s}."""
    return dict(min_ms=int(m.group(1)), max_ms=int(m.group(2)), skew_ms=int(m.group(3)),
                dist_timeout_s=float(m.group(4)))


def graph_item(m):
    """A warm-up item of the trainer log (``GRAPH_RE``'s match): {what, attention (a model graph's), ms, graphs}."""
    return dict(what=f"{m.group(1)} {m.group(2)}", attention=m.group(3), ms=int(m.group(4)), graphs=int(m.group(5)))


def plan_of(m):
    """The warm-up's plan (``PLAN_RE``'s match): {model_graphs, optimizers, items}."""
    model, opts = int(m.group(1)), int(m.group(2))
    return dict(model_graphs=model, optimizers=opts, items=model + opts)


def parse_log(text):
    """Step lines of a trainer log (after its source snapshot) -> train/val records.

    Returns dict ``train`` (list of {step, loss, train_time_ms, phase, tokens}), ``val`` (list of {step, loss,
    loss_tst}), ``compile_ms`` (the warm-up's total, float or None), ``warm_up_graphs`` (graphs it compiled, or
    None), ``warm_up_plan`` (``plan_of``, or None), ``switch_step`` (int or None), ``status`` (the ``status:``
    line), ``compile_graphs`` (the warm-up's items: {what, ms, graphs}), ``warm_up_skew`` (``skew_of``: several
    processes, or None). ``train_time_ms`` is ``step_avg * step`` (0.01 ms resolution per step) rather than the
    integer ``train_time`` field.
    """
    body = text.split(SEPARATOR + "\n", 1)[1] if SEPARATOR and SEPARATOR + "\n" in text else text
    out = dict(train=[], val=[], compile_ms=None, warm_up_graphs=None, warm_up_plan=None, switch_step=None,
               status=None, compile_graphs=[], warm_up_skew=None)
    for line in body.splitlines():
        parsed = parse_step_line(line)
        if parsed:
            step, _, f = parsed
            if "train_loss" in f:  # step_avg x step: 0.01 ms per step rather than train_time's 1 ms
                out["train"].append(dict(step=step, loss=float(f["train_loss"]), phase=int(f.get("phase", 0)),
                                         train_time_ms=float(f["step_avg"]) * step, tokens=int(f.get("tokens", 0))))
            elif "val_loss" in f:
                tst = f.get("val_loss_tst")
                out["val"].append(dict(step=step, loss=float(f["val_loss"]),
                                       loss_tst=float(tst) if tst is not None else None))
        elif m := GRAPH_RE.match(line):
            out["compile_graphs"].append(graph_item(m))
        elif m := COMPILE_RE.match(line):
            out["compile_ms"], out["warm_up_graphs"] = float(m.group(1)), int(m.group(2))
        elif m := PLAN_RE.match(line):
            out["warm_up_plan"] = plan_of(m)
        elif m := SWITCH_RE.match(line):
            out["switch_step"] = int(m.group(1))
        elif m := SKEW_RE.match(line):
            out["warm_up_skew"] = skew_of(m)
        elif line.startswith("status:"):
            out["status"] = line.split()[0].split(":", 1)[1]
    return out


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
    env["cpu"] = H.cpu_model() if H else platform.processor()
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
    # --describe's table (H.PEAK_TFLOPS): one datasheet figure per GPU
    env["nominal_bf16_tflops"] = next((v for k, v in H.PEAK_TFLOPS.items() if k in props.name), None) if H else None
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
                tflops=float(f"{rate(statistics.median(ms)):.4g}"), tflops_best=float(f"{rate(ms[0]):.4g}"))


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
# Data: synthetic shards (GPT-2 ids, documents of random length) unless real ones are given

def synthetic_tokens(rng, n, mean_doc, zipf=None):
    """uint16 ``[n]`` GPT-2 ids: uniform (``zipf`` None) or Zipf(``zipf``)-distributed (learnable
    in a few steps); each token starts a new document (an ``<|endoftext|>``) with probability
    1 / ``mean_doc``, so document lengths are geometric with mean ``mean_doc``."""
    eot = EOT_TOKEN
    if zipf:
        toks = ((rng.zipf(zipf, size=n) - 1) % eot).astype(np.uint16)
    else:
        toks = rng.integers(0, eot, size=n, dtype=np.uint16)
    toks[rng.random(n) < 1.0 / mean_doc] = eot
    toks[0] = eot
    return toks


def write_synthetic(d, n_train, n_val, mean_doc, zipf=None):
    """Two train shards of ``n_train`` tokens and one val shard of ``n_val`` under ``d``: data words."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in (1, 2):
        write_shard(os.path.join(d, f"synthetic_train_{i:06d}.bin"), synthetic_tokens(rng, n_train, mean_doc, zipf))
    write_shard(os.path.join(d, "synthetic_val_000000.bin"), synthetic_tokens(rng, n_val, mean_doc, zipf))
    print(f"synthetic shards in {d}: train 2 x {n_train:,} tokens, val {n_val:,} tokens, "
          f"mean document {mean_doc} tokens")
    return ["--train-files", os.path.join(d, "synthetic_train_*.bin"),
            "--val-files", os.path.join(d, "synthetic_val_*.bin")]


def train_tokens_needed(cfg):
    """Train tokens a run of ``cfg`` reads, with room: twice the text its steps train on (packing skips the tail of
    each document over the stage's cap and of each sequence's cut last document; geometric documents of mean 1,024
    tokens over a cap of 896 skip ~40%)."""
    return 2 * sum((st.end - st.start) * st.raw_tokens() for st in T.stages(cfg))


def data_args(args, out_dir):
    """Data words of the timing run (the given globs or synthetic shards) and of the checks (synthetic).

    Returns ``(timing words, check words, folders to remove)``.
    """
    check = write_synthetic(os.path.join(out_dir, "synthetic_check"), 20_000, 4096, CHECK_MEAN_DOC, zipf=1.2)
    dirs = [os.path.join(out_dir, "synthetic_check")]
    if args.train_files or args.val_files:
        if not (args.train_files and args.val_files):
            raise ValueError("give both --train-files and --val-files, or neither (synthetic shards)")
        return ["--train-files", args.train_files, "--val-files", args.val_files], check, dirs
    if T is None:
        raise RuntimeError(TRAINER_IMPORT_ERROR)
    # enough tokens for every timing run, so no read wraps around
    need = max(train_tokens_needed(config_of(timing_argv(args, p, [], "cpu", "")[1])[0]) for p in args.presets)
    per_shard = max(100_000, -(-need // 2))
    d = os.path.join(out_dir, "synthetic_data")
    timing_data = write_synthetic(d, per_shard, max(args.val_tokens, 4096) + 1024, TIMING_MEAN_DOC)
    return timing_data, check, dirs + [d]


# ----------------------------------------------------------------------------------------------
# 3. Agreement: the check model on CPU fp32, on the device fp32, bf16 (+ compile) and bf16 + FP8

def check_argv(args, data, device_kind, out_dir, run_id, bf16=False, compile_=False, max_steps=0, fp8=False):
    """Trainer words of one check run: ``CHECK_MODEL`` + ``CHECK_TRAIN`` + data, N = --correct-steps (a float32 run
    is launched with ``FP32_POLAR``: ``correctness``)."""
    return [*CHECK_MODEL, *CHECK_TRAIN, *data, "--num-iterations", str(args.correct_steps),
            "--max-steps", str(max_steps), "--bf16" if bf16 else "--no-bf16", "--fp8" if fp8 else "--no-fp8",
            "--compile" if compile_ else "--no-compile", "--device", device_kind,
            "--log-dir", os.path.join(out_dir, "logs"), "--run-id", run_id]


def check_model_config(device_kind, *extra):
    """The check model's float32 Config on ``device_kind`` (``extra`` words last), as the checks' runs train it."""
    argv = [*CHECK_MODEL, *CHECK_TRAIN, "--num-iterations", str(CHECK_STEPS), "--no-bf16", "--no-fp8",
            "--device", device_kind]
    return config_of(argv + list(extra))[0]


def agreement_plan(kind, steps, compile_, fp8_reason):
    """Section 5's trainer runs and comparisons on device ``kind`` (pure: the tests check both devices).

    Args:
        kind: "cuda" or "cpu" (--dry-run). steps: --correct-steps. compile_: compile the bf16 runs.
        fp8_reason: why FP8 cannot run on the device (``fp8_unavailable_reason``), or None.

    Returns:
        ``(runs, comparisons, skipped)``: runs ``{name: (device kind, check_argv keywords)}``;
        comparisons ``[(check, reference run, candidate run, tolerance key, labels, steps)]``;
        skipped ``{check: reason}``. On CPU the device is the CPU: no second fp32 run, and both runs
        stop after 2 steps (TST phase 1, stages 1 and 2; bf16 matmuls there are ~5x slower than float32).
    """
    cuda = kind == "cuda"
    n = steps if cuda else min(2, steps)
    stop = 0 if n == steps else n
    fp32 = "check_cuda" if cuda else "check_ref_cpu"
    mixed = "bf16 " + ("compiled" if compile_ else "eager")
    runs = {"check_ref_cpu": ("cpu", dict(max_steps=stop))}
    if cuda:
        runs["check_cuda"] = ("cuda", {})
    runs[f"check_{kind}_bf16"] = (kind, dict(bf16=True, compile_=compile_, max_steps=stop))
    comparisons = [("bf16_vs_fp32", fp32, f"check_{kind}_bf16", "bf16_tol", (f"{kind} fp32 eager", f"{kind} {mixed}"), n)]
    skipped = {}
    if cuda:
        comparisons.insert(0, ("fp32_cpu_vs_device", "check_ref_cpu", "check_cuda", "tol",
                               ("cpu fp32 eager", "cuda fp32 eager"), n))
    else:
        skipped["fp32_cpu_vs_device"] = "the device is the CPU: the reference run is the device run"
    if fp8_reason:
        skipped["fp8_vs_bf16"] = fp8_reason
    else:
        runs[f"check_{kind}_fp8"] = (kind, dict(bf16=True, compile_=compile_, max_steps=stop, fp8=True))
        comparisons.append(("fp8_vs_bf16", f"check_{kind}_bf16", f"check_{kind}_fp8", "fp8_tol",
                            (f"{kind} {mixed}", f"{kind} {mixed} + fp8"), n))
    return runs, comparisons, skipped


def compare_losses(ref, dev, tol, n_train=1):
    """Rows (what, step, reference, device, |diff|) of every loss the candidate ``dev`` logs; pass/fail.

    Every loss of ``dev`` must be in ``ref`` too (``ref`` may have more: a candidate stopped
    early by ``--max-steps``); a candidate with fewer than ``n_train`` train losses, or a run
    that failed, fails.
    """
    keyed = lambda r: {**{("train_loss", x["step"]): x["loss"] for x in r["train"]},  # noqa: E731
                       **{("val_loss", x["step"]): x["loss"] for x in r["val"]},
                       **{("val_loss_tst", x["step"]): x["loss_tst"] for x in r["val"] if x["loss_tst"] is not None}}
    a, b = keyed(ref), keyed(dev)
    rows = []
    for key in sorted(set(b) or set(a), key=lambda k: (k[0] != "train_loss", k[0], k[1])):
        x, y = a.get(key), b.get(key)
        diff = abs(x - y) if x is not None and y is not None else None
        rows.append(dict(what=key[0], step=key[1], reference=x, device=y, abs_diff=diff))
    diffs = [r["abs_diff"] for r in rows]
    complete = bool(rows) and all(d is not None for d in diffs)
    max_diff = max((d for d in diffs if d is not None), default=None)
    n_logged = sum(r["what"] == "train_loss" and r["device"] is not None for r in rows)
    passed = (ref["rc"] == 0 and dev["rc"] == 0 and complete and n_logged >= max(n_train, 1)
              and max_diff is not None and max_diff <= tol)
    return rows, passed, max_diff


def agreement(name, ref, dev, tol, labels, n_train):
    """Compare two finished runs' losses (``compare_losses``), print both columns, return the check's dict."""
    rows, passed, max_diff = compare_losses(ref, dev, tol, n_train)
    print(f"\n{name}: {labels[0]} vs {labels[1]}")
    print(f"{'loss':<14}{'step':>5}{labels[0] + ' (ref)':>22}{labels[1]:>22}{'|diff|':>12}")
    for r in rows:
        f = lambda v: f"{v:>22.4f}" if v is not None else f"{'missing':>22}"  # noqa: E731
        diff = format(r["abs_diff"], ".1e") if r["abs_diff"] is not None else "-"
        print(f"{r['what']:<14}{r['step']:>5}{f(r['reference'])}{f(r['device'])}{diff:>12}")
    print(f"{name}: {'PASS' if passed else 'FAIL'} (max |diff| {max_diff} vs tolerance {tol}; "
          f"exit codes {ref['rc']}, {dev['rc']})")
    strip = lambda r: {k: r[k] for k in ("name", "argv", "rc", "timed_out", "wall_s", "log", "status")}  # noqa: E731
    return dict(name=name, reference=labels[0], candidate=labels[1], passed=passed, tol=tol,
                max_abs_diff=max_diff, steps_compared=sum(r["what"] == "train_loss" for r in rows),
                rows=rows, reference_run=strip(ref), candidate_run=strip(dev))


def failure_reason(check):
    """One line saying why an agreement check failed: a run that did not finish, or the losses."""
    runs = [f"{r['name']} exit status {r['rc']}" + (", stopped at its time limit" if r["timed_out"] else "")
            for r in (check["reference_run"], check["candidate_run"]) if r["rc"] != 0]
    return f"{check['name']} failed (" + ("; ".join(runs) or f"max |loss diff| {check['max_abs_diff']} vs "
                                          f"tolerance {check['tol']}, or a loss missing") + ")"


def correctness(device, data, args, out_dir, deadline):
    """The check model's runs of section 5 (``agreement_plan``) and their comparisons.

    Args:
        device: the device checked. data: the check data's trainer words. args: this script's arguments.
        out_dir: the output folder. deadline: ``time.monotonic()`` seconds by which every run is stopped.

    Returns:
        dict: passed, cut_short, checks (name -> ``agreement``'s dict, or {name, passed None, skipped}),
        failures (one line each), the model's words.
    """
    kind = device.type
    compile_ = args.compile if args.compile is not None else kind == "cuda"
    plan, comparisons, skipped = agreement_plan(kind, args.correct_steps, compile_, T.fp8_unavailable_reason(device))
    runs = {name: TrainerRun(name, check_argv(args, data, k, out_dir, name, **kw), out_dir,
                             patches=[CHECK_SPECS] + ([] if kw.get("bf16") else [FP32_POLAR]))
            for name, (k, kw) in plan.items()}
    limit = min(deadline, time.monotonic() + args.correct_timeout_s)
    for r in runs.values():  # side by side: CPU, device and compile work overlap
        r.start()
    done = {name: r.wait(limit) for name, r in runs.items()}
    checks = {name: agreement(name, done[ref], done[cand], getattr(args, tol), labels, n)
              for name, ref, cand, tol, labels, n in comparisons}
    for name, why in skipped.items():
        checks[name] = dict(name=name, passed=None, skipped=why)
        print(f"\n{name}: skipped ({why})")
    passed = all(c["passed"] for c in checks.values() if not c.get("skipped"))
    print(f"\nagreement: {'PASS' if passed else 'FAIL'}")
    failures = [failure_reason(c) for c in checks.values() if c["passed"] is False]
    return dict(passed=passed, cut_short=any(r["timed_out"] for r in done.values()), device=kind,
                steps=args.correct_steps, bf16_compiled=compile_, model=CHECK_MODEL + CHECK_TRAIN,
                checks=checks, failures=failures)


# ----------------------------------------------------------------------------------------------
# 4. Timing run of the preset, and the projection of its full run

def step_times(train, at=None):
    """Per-step rows from cumulative logs: list of {step, phase, ms, tokens[, flops, positions]}.

    ``at(i)``: ``(model FLOPs, latent positions)`` of optimizer step index i (0-based: the stage table's row; the
    log's step lines carry neither); a row covering log steps ``prev+1..step`` gets the mean over those steps.
    """
    rows, prev = [], dict(step=0, train_time_ms=0.0, tokens=0)
    for r in sorted(train, key=lambda x: x["step"]):
        n = r["step"] - prev["step"]
        if n <= 0:
            continue
        row = dict(step=r["step"], phase=r["phase"], ms=(r["train_time_ms"] - prev["train_time_ms"]) / n,
                   tokens=(r["tokens"] - prev["tokens"]) / n)
        if at is not None:
            per_step = [at(i) for i in range(prev["step"], r["step"])]
            row["flops"], row["positions"] = (sum(x) / n for x in zip(*per_step))
        rows.append(row)
        prev = r
    return rows


def group_stats(rs, matmul_tflops, nominal_tflops, drop_first=DROP_FIRST_STEPS):
    """ms/step (the median of the kept steps; mean too), tokens/s, positions/s, FLOPs, TFLOP/s and MFU of rows
    ``rs`` (``step_times``' rows of one phase or one stage). None when ``rs`` is empty.

    The first ``drop_first`` rows of the group are dropped (a stage's first steps pay for its new batch
    shape, allocator growth and lazy kernel choices), fewer when that would leave none. FLOPs per
    step are the mean of the kept rows' ``flops``; achieved TFLOP/s = that / the median ms.
    """
    if not rs:
        return None
    ms = [r["ms"] for r in rs]
    n_drop = min(drop_first, len(rs) - 1)
    kept_rows = rs[n_drop:]
    kept = [r["ms"] for r in kept_rows]
    mean = statistics.median(kept)  # the step time every rate below is computed from
    tokens = sum(r["tokens"] for r in kept_rows) / len(kept_rows)
    positions = sum(r.get("positions", 0) for r in kept_rows) / len(kept_rows)
    flops = sum(r.get("flops", 0) for r in kept_rows) / len(kept_rows)
    achieved = flops / (mean / 1e3) / 1e12 if flops else None
    out = dict(steps_logged=len(ms), steps_used=len(kept), first_step=rs[0]["step"], last_step=rs[-1]["step"],
               first_step_ms=round(ms[0], 2), first_steps_dropped=n_drop, ms_per_step=round(mean, 2),
               ms_median=round(mean, 2), ms_mean=round(sum(kept) / len(kept), 2), ms_min=round(min(kept), 2),
               ms_max=round(max(kept), 2),
               raw_tokens_per_step=round(tokens), positions_per_step=round(positions),
               raw_tokens_per_s=round(tokens / (mean / 1e3)), positions_per_s=round(positions / (mean / 1e3)),
               flops_per_step=flops, achieved_tflops=float(f"{achieved:.4g}") if achieved else None,
               mfu_measured=round(achieved / matmul_tflops, 4) if achieved and matmul_tflops else None,
               mfu_nominal=round(achieved / nominal_tflops, 4) if achieved and nominal_tflops else None)
    if "window" in rs[0]:
        out["windows_timed"] = [kept_rows[0]["window"], kept_rows[-1]["window"]]
    return out


def phase_stats(rows, phase, matmul_tflops, nominal_tflops):
    """``group_stats`` of the rows of TST ``phase`` (1 or 2); None when no row is of this phase."""
    return group_stats([r for r in rows if r["phase"] == phase], matmul_tflops, nominal_tflops)


def stage_key(stage):
    """What makes two stage-table rows (``train_gpt.Stage``) time alike, as a label: TST phase, bag size,
    positions per step, window blocks and document cap (a timing run's stage stands for the full run's)."""
    blocks = f", blocks {stage.blocks}" if stage.blocks else ""
    cap = f", cap {stage.doc_cap}" if stage.doc_cap else ""
    return f"phase {stage.phase} s={stage.bag_size}: {stage.batch_tokens} positions{blocks}{cap}"


def eager_backend(args, preset):
    """Whether ``preset``'s timing run is compiled by Dynamo alone (``EAGER_BACKEND``): --dry-run's first preset,
    unless --compile/--no-compile says otherwise (its warm-up logs each graph's compile time, as on CUDA)."""
    return args.dry_run and args.compile is None and preset == args.presets[0]


def timing_argv(args, preset, data, device_kind, out_dir):
    """``(base, argv)``: the preset (+ --dry-run's small shape) + data + --trainer-args, then the timing flags.

    The timing run is the preset with N = --steps and its extension steps scaled to N (at least 1
    when it has some): the same stage table, TST phases, window blocks and tied head (untied at the split step
    inside the run, so both sides run and the warm-up compiles both), compressed; validation at the start and the
    end, one chunk of --val-tokens each (CUDA: 262,144, the record's chunk).
    """
    shape = CHECK_SHAPE if args.dry_run else []
    base = ["--preset", preset] + shape + data + shlex.split(args.trainer_args)
    cfg, _ = config_of(base)
    window = ["--num-iterations", str(args.steps), "--max-steps", "0", "--val-every", "0",
              "--val-tokens", str(args.val_tokens), "--val-seq-len", str(args.val_tokens), "--log-every", "1",
              "--device", device_kind, "--log-dir", os.path.join(out_dir, "logs"), "--run-id", f"timing_{preset}"]
    if cfg.extension_steps:
        window += ["--extension-steps", str(max(1, round(cfg.extension_steps * args.steps / cfg.num_iterations)))]
    if args.compile is not None or eager_backend(args, preset):
        window.append("--no-compile" if args.compile is False else "--compile")
    return base, base + window


def projection(preset, base_argv, stages):
    """Train time of the full preset run (its own stage table; timing flags not applied), ms.

    Args:
        preset: its name. base_argv: ``timing_argv``'s base words (the full run's flags).
        stages: ``{stage_key: group_stats}`` of the timing run.

    Each stage of the full run: its FLOPs / the FLOP rate of the timed stage of the same key (else of
    the same recipe stage in the other TST phase, with a note in ``untimed``), summed (FLOPs-weighted);
    and, for comparison, its steps x that stage's mean ms/step (unweighted). The projection is None
    when a stage has no timed counterpart (``missing``).
    """
    cfg, _ = config_of(base_argv)
    table, switch = T.Schedule(cfg, spec_of(cfg)), T.tst_switch_step(cfg)
    out = dict(preset=preset, num_iterations=cfg.num_iterations, tst_frac=cfg.tst_frac, switch_step=switch,
               phase1_steps=switch, phase2_steps=cfg.num_iterations - switch, phase1_flops=0, phase2_flops=0,
               stages=[], untimed=[], missing=[], projected_train_time_ms=None, projected_train_time_min=None,
               unweighted_train_time_ms=None)
    total = unweighted = 0.0
    for st in table.stages:
        key = stage_key(st)
        flops = sum(table[s].flops_per_position for s in range(st.start, st.end)) * st.batch_tokens
        out[f"phase{st.phase}_flops"] += flops
        same_recipe = key.split(": ", 1)[1]
        timed = key if stages.get(key) else next((k for k, p in stages.items() if p and k.split(": ", 1)[1] == same_recipe), None)
        out["stages"].append(dict(stage=key, steps=st.end - st.start, flops=flops, timed_as=timed,
                                  windows=[table[st.start].window, table[st.end - 1].window]))
        if timed is None or not stages[timed]["flops_per_step"]:
            out["missing"].append(key)
            continue
        if timed != key:
            out["untimed"].append(f"{key} (projected at the rate of {timed})")
        p = stages[timed]
        total += flops * p["ms_per_step"] / p["flops_per_step"]
        unweighted += (st.end - st.start) * p["ms_per_step"]
    if not out["missing"]:
        out.update(projected_train_time_ms=round(total), projected_train_time_min=round(total / 60e3, 2),
                   unweighted_train_time_ms=round(unweighted))
    return out


def timing_problems(res, p1, p2, pj):
    """What makes the timing section fail (problems) and what is only worth a look (warnings)."""
    problems, warnings = [], []
    if res["rc"] != 0:
        problems.append(f"trainer exit status {res['rc']}" + (" (stopped at the time budget)" if res["timed_out"] else ""))
    for name, p in (("phase 1", p1), ("phase 2", p2)):
        if p is None and pj[name.replace(" ", "") + "_steps"]:
            problems.append(f"no {name} step was logged" + (" (raise --steps: the timing run's phase 1 is "
                                                            "round(r x --steps) steps)" if name == "phase 1" else ""))
    if pj["projected_train_time_ms"] is None:
        problems.append("no projection (stages not timed: " + "; ".join(pj["missing"]) + ")")
    warnings += [f"stage {u} was not in the timing run" for u in pj["untimed"]]
    if res.get("graphs_compiled"):
        problems.append(f"{res['graphs_compiled']} graph(s) compiled inside the timed window "
                        f"(the warm-up missed them: the step times include compile time)")
    if p1 and p2 and p2["first_step_ms"] > 2 * p2["ms_median"]:
        warnings.append(f"the first phase-2 step (the TST switch) took {p2['first_step_ms']:.0f} ms vs "
                        f"{p2['ms_median']:.0f} ms median: something is (re)built at the switch")
    return problems, warnings


def note_progress(live, line, t0):
    """Update ``live`` (a running timing run's report entry) from one console line of its trainer: the warm-up's plan
    (when logged), a warm-up item's compile time (``at_s``: seconds into the run when it was logged), the warm-up's
    total, the last step logged; each marks the JSON for rewriting (``SAVE["dirty"]``): a run cut short, or a killed
    check, says how far it got."""
    if m := GRAPH_RE.match(line):
        live["compile_graphs"].append(dict(graph_item(m), at_s=round(time.monotonic() - t0, 1)))
    elif m := COMPILE_RE.match(line):
        live["compile_time_ms"], live["warm_up_graphs"] = float(m.group(1)), int(m.group(2))
    elif m := PLAN_RE.match(line):
        live["warm_up_plan"] = plan_of(m)
    else:
        parsed = parse_step_line(line)
        if not (parsed and "train_loss" in parsed[2]):
            return
        live["steps_logged"] = parsed[0]
    SAVE["dirty"] = True


def timing(device, data, args, preset, out_dir, end, micro, env, live, window):
    """``preset`` with N = --steps (every stage of its table, both TST phases); speed per phase and stage, projection.

    ``end``: ``time.monotonic()`` at which the run is stopped. ``live``: its entry of the report, kept up to date
    while it runs (``note_progress``) and completed in place with the results (returned). ``window``: its entry of
    the report's timing window (``started_s`` given; ``stopped_s``, ``cut_short`` set here). With ``args.nproc`` > 1
    the run is under torchrun (rank 0's log and clock; MFU against that many GPUs' rates).
    """
    base, argv = timing_argv(args, preset, data, device.type, out_dir)
    if T is None:
        raise RuntimeError(TRAINER_IMPORT_ERROR)
    cfg, _ = config_of(argv)
    T.grad_accum_steps(cfg, args.nproc)  # ConfigError naming what divides a step, before any process starts
    table = T.Schedule(cfg, spec_of(cfg))
    run = TrainerRun(f"timing_{preset}", argv, out_dir, on_line=lambda line: note_progress(live, line, run.t0),
                     patches=[CHECK_SPECS] * args.dry_run + [EAGER_BACKEND] * eager_backend(args, preset),
                     nproc=args.nproc)
    res = run.start().wait(end)  # stopping it (SIGTERM, 20 s, SIGKILL) and the report fit in the reserve
    window.update(stopped_s=round(window["started_s"] + res["wall_s"], 1), cut_short=res["timed_out"])
    if len(res["compile_graphs"]) < len(live["compile_graphs"]):  # a killed trainer's log may miss its last lines
        res["compile_graphs"] = live["compile_graphs"]
    for g, seen in zip(res["compile_graphs"], live["compile_graphs"]):  # when each item's line came
        if g["what"] == seen["what"]:
            g["at_s"] = seen["at_s"]
    per_gpu = lambda rate: rate * args.nproc if rate else None  # noqa: E731 -- a step's FLOPs are all ranks'
    matmul = per_gpu((micro or {}).get("matmul", {}).get("tflops"))
    nominal = per_gpu(env.get("nominal_bf16_tflops") if env else None)
    rows = step_times(res["train"], lambda i: (table[i].flops_per_position * table[i].stage.batch_tokens,
                                               table[i].stage.batch_tokens))
    for r in rows:
        r["window"], r["stage"] = list(table[r["step"] - 1].window), stage_key(table[r["step"] - 1].stage)
    p1, p2 = (phase_stats(rows, p, matmul, nominal) for p in (1, 2))
    stages = {stage_key(st): group_stats([r for r in rows if r["stage"] == stage_key(st)], matmul, nominal)
              for st in table.stages}
    s = res["summary"] or {}
    kept = ("name", "argv", "rc", "timed_out", "wall_s", "stop_at_s", "log", "status")
    out = dict(run={k: res[k] for k in kept}, nproc=args.nproc, warm_up_skew=res["warm_up_skew"],
               preset=preset, steps_requested=args.steps, steps_logged=len(rows),
               switch_step=res["switch_step"], compile_time_ms=s.get("compile_time_ms", res["compile_ms"]),
               warm_up_graphs=res["warm_up_graphs"], warm_up_plan=res["warm_up_plan"] or live.get("warm_up_plan"),
               compile_graphs=res["compile_graphs"],
               gpu_memory_used_max_mib=res.get("gpu_memory_used_max_mib"),
               graphs_compiled_during_training=s.get("graphs_compiled_during_training"),
               peak_memory_mib=s.get("peak_memory_mib"), final_val_loss=s.get("final_val_loss"),
               flops_per_position_step0=table[0].flops_per_position, micro_batch_seqs=cfg.micro_batch_seqs,
               phase1=p1, phase2=p2, stages=stages, per_step=[dict(r, ms=round(r["ms"], 3)) for r in rows],
               status="stopped at the budget" if res["timed_out"] else res["status"] or f"exit status {res['rc']}")
    out["projection"] = projection(preset, base, stages)
    out["problems"], out["warnings"] = timing_problems(
        dict(res, graphs_compiled=out["graphs_compiled_during_training"]), p1, p2, out["projection"])
    live.update(out)
    return live


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


def check_rows(res):
    """Summary rows of the kernel checks, the profile and the trainer agreement runs, in the order they run."""
    rows, cc = [], res.get("correctness") or {}
    for c in (res.get("kernels") or {}).values():
        if c.get("skipped"):
            rows.append(("kernel", c["name"], f"skipped: {c['skipped']}", ""))
            continue
        grad = f", gradients {c['grad_tol']}" if c.get("grad_tol") else ""
        rows.append(("kernel", f"{c['name']} (max rel diff; tolerance {c['tol']}{grad})",
                     f"{'PASS' if c['passed'] else 'FAIL'} {fmt(c['max_rel_diff'])}", ""))
        if c.get("scale_tol"):  # an FP8 op given its scales
            rows += [("kernel", f"  scales used vs record #89's (tolerance {c['scale_tol']})",
                      fmt(c["max_scale_diff"]), ""),
                     ("kernel", f"  results vs the fp8 reference at them (tolerance {c['kernel_tol']})",
                      fmt(c["max_kernel_diff"]), "")]
        rows += [("kernel", f"  {layout} forward + backward at {positions} positions", ms, "ms")  # head_grad_layout
                 for positions, per in (c.get("ms") or {}).items() for layout, ms in per.items()]
        if c.get("note"):
            rows.append(("kernel", "  " + c["note"], "", ""))
    if not res.get("kernels"):
        rows.append(("kernel", "kernel agreement checks", "did not run", ""))
    pf = res.get("profile") or {}
    for part, ms in (pf.get("ms") or {}).items():
        rows.append(("profile", f"one step: {part} ({pf['timer']} time)", f"{fmt(ms)} ({pct(pf['share'][part])}%)", "ms"))
    rows.append(("profile", "max_memory_reserved", pf.get("max_memory_reserved_mib"), "MiB"))
    for c in (cc.get("checks") or {}).values():
        if c.get("skipped"):
            rows.append(("correct", c["name"], f"skipped: {c['skipped']}", ""))
            continue
        rows += [("correct", f"{c['name']}: {c['reference']} vs {c['candidate']}, {c['steps_compared']} steps",
                  "PASS" if c["passed"] else "FAIL", ""),
                 ("correct", "  max |loss diff| (tolerance)", f"{fmt(c['max_abs_diff'])} ({c['tol']})", "")]
    if not cc.get("checks"):
        rows.append(("correct", "trainer agreement runs", "did not run", ""))
    for c in (res.get("attention_backends") or {}).values():  # issue 46's rows, named before they run
        if c.get("skipped") and not c.get("ms_forward"):
            rows.append(("pending", c["name"], "not run", ""))
            continue
        rows.append(("attention", f"{c['name']} vs sdpa (max rel diff; tolerance {c.get('tol')})",
                     f"{'PASS' if c['passed'] else 'FAIL' if c['passed'] is False else 'refused'} "
                     f"{fmt(c['max_rel_diff_vs_sdpa'])}", ""))
        rows += [("attention", f"  {shape} positions x window: forward / forward + backward",
                  slash(ms, (c.get("ms_forward_backward") or {}).get(shape)), "ms")
                 for shape, ms in (c.get("ms_forward") or {}).items()]
    for c in (res.get("communication") or {}).values():
        if c.get("skipped"):
            rows.append(("pending", c["name"], "not run", ""))
        elif c["name"] == "warm_up_skew":
            rows.append(("comm", "warm-up skew between ranks (per rank min / max)",
                         f"{fmt(c['seconds'])} ({slash(c['per_rank']['min_s'], c['per_rank']['max_s'])})", "s"))
        else:
            rows.append(("comm", f"{c['name']}: ms/step (share of the step), mean of {c['ranks_measured']} ranks",
                         f"{fmt(c['ms_per_step'])} ({pct(c['share_of_step'])}%)", "ms"))
    return rows


def timing_rows(preset, tm, dry_run):
    """Summary rows of one preset's timing run (``timing``'s result, {} if it did not run): per TST phase, per stage, projection."""
    rows = [("timing", "preset / steps logged", slash(preset, tm.get("steps_logged")), ""),
            ("timing", "compile warm-up (every model and optimizer graph)", tm.get("compile_time_ms"), "ms"),
            ("timing", "graphs compiled in timed window", tm.get("graphs_compiled_during_training"), "")]
    for name in ("phase1", "phase2"):
        p = tm.get(name) or {}
        rows += [(name, "ms/step (median after the first steps / mean)", slash(p.get("ms_per_step"), p.get("ms_mean")), "ms"),
                 (name, "first step (steps dropped)", f"{fmt(p.get('first_step_ms'))} ({fmt(p.get('first_steps_dropped'))})", "ms"),
                 (name, "raw text tokens/s", p.get("raw_tokens_per_s"), "tokens/s"),
                 (name, "latent positions/s", p.get("positions_per_s"), "positions/s"),
                 (name, "windows timed, first / last (long, short)",
                  " / ".join(str(tuple(w)) for w in p.get("windows_timed") or []) or "-", "positions"),
                 (name, "model FLOPs/step (mean of timed steps)",
                  float(p["flops_per_step"]) if p.get("flops_per_step") else None, "FLOP"),
                 (name, "achieved", p.get("achieved_tflops"), "TFLOP/s"),
                 (name, "MFU vs measured matmul (vs datasheet peak)",
                  f"{pct(p.get('mfu_measured'))} ({pct(p.get('mfu_nominal'))})", "%")]
    for key, p in (tm.get("stages") or {}).items():
        p = p or {}
        rows.append(("stage", f"{key}: ms/step, MFU vs matmul", f"{fmt(p.get('ms_per_step'))}, {pct(p.get('mfu_measured'))}%", ""))
    pj = tm.get("projection") or {}
    rows += [("timing", "peak memory", tm.get("peak_memory_mib"), "MiB"),
             ("project", f"full {preset}: N / phase 1 / phase 2 steps",
              slash(pj.get("num_iterations"), pj.get("phase1_steps"), pj.get("phase2_steps")), "steps"),
             ("project", "projected train time, FLOPs-weighted" + (" (dry run: the small model's step times)"
                                                                  if dry_run else ""),
              f"{fmt(pj.get('projected_train_time_ms'))} "
              f"({fmt(pj.get('projected_train_time_min'))} min)", "ms"),
             ("project", "  unweighted (steps x measured ms/step)", pj.get("unweighted_train_time_ms"), "ms")]
    return rows


def summary_rows(res):
    """(section, item, value, unit) rows of the final table."""
    env, mb = res.get("env") or {}, res.get("microbench") or {}
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
    for preset in res["args"]["presets"]:
        rows += timing_rows(preset, (res.get("timing") or {}).get(preset) or {}, res["args"].get("dry_run"))
    rows += check_rows(res)
    rows += [("result", "status / exit code", slash(res.get("status"), res.get("exit_code")), ""),
             ("result", "wall time of this check / budget", slash(res.get("wall_s"), res["args"].get("budget_s")), "s"),
             ("result", "skipped for the budget", ", ".join(res.get("skipped") or []) or "none", "")]
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


ARCHIVE = "gpu_check_logs.tar.gz"  # the trainer logs and consoles (logs/) and kernels.json, one file


def save(res, out_dir, work, archive=True):
    """The JSON and (``archive``) the logs' archive into ``out_dir``, each replaced whole: after every section and
    while a run is waited for (``refresh_results``), so a kill keeps what was measured."""
    write_json(os.path.join(out_dir, "gpu_check.json"), res)
    if not archive:
        return
    tmp = os.path.join(out_dir, ARCHIVE + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in ("logs", "kernels.json"):
            if os.path.exists(os.path.join(work, name)):
                tar.add(os.path.join(work, name), arcname=name)
    os.replace(tmp, os.path.join(out_dir, ARCHIVE))


def _stage_line(key, p):
    """One stage's timing: ms/step (median after its first steps), raw tokens/s, MFU (measured / datasheet)."""
    mfu = pct(p.get("mfu_measured")) + ("" if p.get("mfu_nominal") is None else f"/{pct(p['mfu_nominal'])}")
    return (f"  {key}: {fmt(p['ms_per_step'])} ms/step (n={p['steps_used']}), {fmt(p['raw_tokens_per_s'])} tok/s, "
            f"MFU {mfu}%")


def warm_up_text(tm):
    """The warm-up of a timing run (``timing``'s result, or its entry while it ran), in a few words: its compile time
    over its items and graphs (the slowest named); cut short, how far it got; else "no compile"."""
    graphs = tm.get("compile_graphs") or []
    count = f"{len(graphs)} items, {sum(g['graphs'] for g in graphs)} graphs"
    if tm.get("compile_time_ms"):  # the warm-up's closing line came
        slowest = max(graphs, key=lambda g: g["ms"], default=None)
        return f"compile {tm['compile_time_ms'] / 1e3:.1f} s over {count}" + (
            f" (slowest: {slowest['what']} {slowest['ms'] / 1e3:.1f} s)" if slowest else "")
    if tm.get("steps_logged"):  # steps without a warm-up: not compiled
        return "no compile"
    stop = (tm.get("run") or {}).get("stop_at_s")
    if not graphs:
        return "stopped before any graph compiled or step ran" + (f" ({stop:.0f} s into the run)" if stop else "")
    kinds = collections.Counter(g["what"].split()[0] for g in graphs)  # train, val, optimizer
    last = graphs[-1].get("at_s")
    busy = f"; the next item had run {stop - last:.0f} s when stopped" if stop is not None and last is not None else ""
    plan = tm.get("warm_up_plan")
    if plan:  # the trainer announced its items: say how many were left
        count = f"{len(graphs)} of {plan['items']} items, {sum(g['graphs'] for g in graphs)} graphs"
    return (f"warm-up cut after {count} (" + ", ".join(f"{k} {n}" for k, n in kinds.items())
            + f") in {sum(g['ms'] for g in graphs) / 1e3:.1f} s{busy}")


def timing_summary(preset, tm, dry_run, window=None):
    """Summary lines of one preset's timing run: steps timed, the warm-up (or how far it got), memory, each stage,
    the projection; ``window``: its ``timing_window.runs`` entry (when it stopped)."""
    run = tm.get("run") or {}
    cut = run.get("timed_out")
    steps = f"{tm.get('steps_logged')} of {tm.get('steps_requested')}" if cut else f"{tm.get('steps_logged')}"
    where = (f" (stopped at the budget, {window['stopped_s']:.0f} s after the start)"
             if cut and window and window.get("stopped_s") is not None else "")
    lines = [f"{preset}: {steps} steps timed{where}; {warm_up_text(tm)}"]
    if not run:  # the section failed before the run ended: its entry as it was then
        return lines + [f"  {tm.get('status')}"]
    if not tm.get("steps_logged"):  # nothing timed: no stage, no projection
        used = tm.get("gpu_memory_used_max_mib")
        return lines + ([f"  memory in use (nvidia-smi) up to {fmt(used, 0)} MiB"] if used else [])
    lines.append(f"  memory: peak allocated {fmt(tm.get('peak_memory_mib'), 0)} MiB, in use (nvidia-smi, reserved + "
                 f"context) {fmt(tm.get('gpu_memory_used_max_mib'), 0)} MiB; compiled in the timed window: "
                 f"{tm.get('graphs_compiled_during_training')}")
    lines += [_stage_line(k, p) for k, p in (tm.get("stages") or {}).items() if p]
    pj = tm.get("projection") or {}
    minutes = pj.get("projected_train_time_min")
    note = " (dry run: the tiny model's times)" if dry_run else ""
    lines.append(f"  projected full run ({pj.get('num_iterations')} steps): {fmt(minutes)} min on this device{note} | "
                 f"record #89: {RECORD89_H100_MIN} H100-min | goal: {GOAL_MIN:g} min"
                 + (f" | steps x median: {fmt(pj['unweighted_train_time_ms'] / 60e3)} min"
                    if pj.get("unweighted_train_time_ms") else ""))
    return lines


def check_line(c):
    """One summary line of a kernel check or an agreement run: PASS/FAIL/skip, its largest difference, tolerance."""
    if c.get("skipped"):
        return f"  skip {c['name']}: {c['skipped'][:90]}"
    diff = c.get("max_rel_diff", c.get("max_abs_diff"))
    scales = (f"; scales {fmt(c['max_scale_diff'])} ({c['scale_tol']}), vs fp8 ref {fmt(c['max_kernel_diff'])} "
              f"({c['kernel_tol']})" if c.get("scale_tol") else "")
    note = f"; {c['note']}" if c.get("note") else ""
    return (f"  {'PASS' if c['passed'] else 'FAIL'} {c['name']} (max diff {fmt(diff)}, tolerance {c['tol']}{scales})"
            f"{note}")


def issue46_lines(res):
    """Summary lines of issue 46's rows: one line naming them all when none ran on the CPU, else FlexAttention's
    backends (``attention_lines``) and the communication profile (``communication_lines``)."""
    rows = [c for group in ("attention_backends", "communication") for c in (res.get(group) or {}).values()]
    if not rows:
        return []
    if all((c.get("skipped") or "").startswith("not run on the CPU") for c in rows):
        return [f"  not run on the CPU (issue 46): {', '.join(c['name'] for c in rows)}"]
    return attention_lines(res) + communication_lines(res)


def attention_lines(res):
    """FlexAttention's backends: per backend ms forward / forward + backward at each shape and the difference
    against SDPA, or why it did not run."""
    lines = ["ATTENTION (FlexAttention bf16, ms forward / forward + backward at positions x window; max diff vs SDPA)"]
    for c in (res.get("attention_backends") or {}).values():
        timed = ", ".join(f"{k}: {fmt(v)}/{fmt((c.get('ms_forward_backward') or {}).get(k))}"
                          for k, v in (c.get("ms_forward") or {}).items())
        if c.get("skipped"):
            lines.append(f"  {c['backend']}: {c['skipped'][:150]}" + (f" (timed before: {timed})" if timed else ""))
            continue
        lines.append(f"  {'PASS' if c['passed'] else 'FAIL'} {c['backend']}: {timed}; max diff "
                     f"{fmt(c['max_rel_diff_vs_sdpa'])} (tolerance {c['tol']})")
    return lines


def communication_lines(res):
    """The communication profile: per collective its NCCL ms per step and share of the step, min-max over ranks;
    the ranks' ms/step; the warm-up's skew; or why they did not run (one line when all rows say the same)."""
    rows = list((res.get("communication") or {}).values())
    reasons = {c.get("skipped") for c in rows}
    if len(reasons) == 1 and None not in reasons:
        return [f"COMMUNICATION: {reasons.pop()[:150]}"]
    meta = res.get("communication_run") or {}
    first, last = meta.get("profiled_steps") or (None, None)
    lines = [f"COMMUNICATION ({meta.get('world', '?')} GPUs, torchrun; {meta.get('preset', '')} steps {first}-{last} "
             f"profiled; NCCL kernel ms a step, min-max over ranks, and share of the step)"]
    per_rank = [v for v in (meta.get("per_rank_ms_per_step") or {}).values() if v is not None]
    if per_rank:
        other = max((v for v in (meta.get("other_nccl_ms_per_step") or {}).values() if v), default=0.0)
        lines.append(f"  ms/step per rank (profiled): {fmt(min(per_rank))}-{fmt(max(per_rank))}"
                     + (f"; other NCCL kernels up to {fmt(other)} ms a step (names in the ranks' files)"
                        if other >= 0.01 else ""))
    for c in rows:
        if c.get("skipped"):
            lines.append(f"  {c['name']}: {c['skipped'][:150]}")
        elif c["name"] == "warm_up_skew":
            lines.append(f"  warm-up skew {fmt(c['seconds'])} s between ranks ({fmt(c['per_rank']['min_s'])}-"
                         f"{fmt(c['per_rank']['max_s'])} s; --dist-timeout {c['dist_timeout_s']:g} s)")
        else:
            ms, share = c["spread"]["ms_per_step"], c["spread"]["share_of_step"] or [None, None]
            lines.append(f"  {c['name']}: {fmt(ms[0])}-{fmt(ms[1])} ms ({pct(share[0])}-{pct(share[1])}%)")
    return lines


def short_summary(res):
    """At most ``SUMMARY_CHARS`` characters, printed last: timing first, then PASS/FAIL rows, then what was cut."""
    env, m = res.get("env") or {}, (res.get("microbench") or {}).get("matmul") or {}
    tw = res["timing_window"]
    lines = [f"==== gpu_check summary: {res['mode']}, {env.get('gpu') or env.get('cpu')}, torch {env.get('torch')}, "
             f"compile {'on' if str(env.get('compile', '')).startswith('on') else 'off'}, inductor cache warm before: "
             f"{fmt(env.get('inductor_cache_warm'))} ====",
             "TIMING" + (f" on {res['args']['nproc']} GPUs under torchrun, rank 0's clock, MFU per GPU"
                         if (res["args"].get("nproc") or 1) > 1 else "")
             + f" (until {tw['timing_until_s']:.0f} s of {tw['budget_s']:.0f}, the last {tw['reserve_s']:.0f} s "
             f"the report's; ms/step: stage median without its first {DROP_FIRST_STEPS} steps; MFU vs matmul "
             f"{m.get('tflops')} TFLOP/s / datasheet)"]
    for preset in res["args"]["presets"]:
        tm = (res.get("timing") or {}).get(preset)
        lines += (timing_summary(preset, tm, res["args"].get("dry_run"), tw["runs"].get(preset)) if tm
                  else [f"{preset}: not timed"])
    lines.append("CHECKS")
    agreement = ((res.get("correctness") or {}).get("checks") or {}).values()
    lines += [check_line(c) for c in list((res.get("kernels") or {}).values()) + list(agreement)]
    lines += issue46_lines(res)
    cut = list(res.get("skipped") or [])
    cut += [f"timing {p} stopped at the budget ("
            + ("in its warm-up" if not tm.get("steps_logged") else f"after {tm['steps_logged']} steps") + ")"
            for p, tm in (res.get("timing") or {}).items() if tm and (tm.get("run") or {}).get("timed_out")]
    lines.append("CUT SHORT: " + ("; ".join(cut) if cut else "nothing"))
    lines += [f"error: {e[:160]}" for e in res["errors"][:4]]
    lines.append(f"status {res.get('status')} (exit {res.get('exit_code')}); wall {res.get('wall_s')} s of "
                 f"{res['args'].get('budget_s'):.0f} s; files: gpu_check.json, gpu_check_summary.txt, {ARCHIVE}")
    return fit_summary(lines)


def fit_summary(lines):
    """``lines`` joined into at most ``SUMMARY_CHARS`` characters: stage lines dropped from the last up (a note before
    CHECKS says how many; the JSON has them all), then, if still too long, the middle cut (the status line kept)."""
    stages = [i for i, line in enumerate(lines) if line.startswith("  phase ")]
    dropped = 0
    note = lambda: f"  ({dropped} stage lines left out for length: gpu_check.json has every stage)"  # noqa: E731
    while stages and len("\n".join(lines)) + (len(note()) + 1 if dropped else 0) > SUMMARY_CHARS:
        del lines[stages.pop()]
        dropped += 1
    if dropped and "CHECKS" in lines:
        lines.insert(lines.index("CHECKS"), note())
    text = "\n".join(lines)
    if len(text) > SUMMARY_CHARS:  # keep the head (timing) and the status line
        text = text[:SUMMARY_CHARS - len(lines[-1]) - 5] + "\n...\n" + lines[-1]
    return text


def report(res, out_dir, work):
    """Print the long table, warnings and errors, then the short summary last; write the JSON, the summary and
    the logs' archive into ``out_dir``."""
    table = render_table(summary_rows(res))
    banner("details")
    print(table)
    for w in res["warnings"]:
        print(f"warning: {w}")
    for e in res["errors"]:
        print(f"error: {e}")
    res["summary_table"] = table
    summary = short_summary(res)
    res["summary"] = summary
    save(res, out_dir, work)
    with open(os.path.join(out_dir, "gpu_check_summary.txt"), "w", encoding="utf-8") as f:
        f.write(summary + "\n")
    print(f"\nwrote gpu_check.json, gpu_check_summary.txt and {ARCHIVE} (logs/, kernels.json) in {out_dir}\n")
    print(summary, flush=True)


# The last seconds of the budget (dry run, CUDA), the report's: every run and check is stopped by then; a trainer
# run stopped there gets SIGTERM, then SIGKILL 20 s later (TrainerRun.STOP_GRACE_S), and the report is written in
# the rest (parsing the logs, the JSON, the archive: seconds). The timing runs may use everything before it.
RESERVE_S = (30.0, 45.0)
# Seconds a later section needs at least to start (dry run, CUDA): a section that would not fit is
# skipped and named in the report. The kernel checks and the profile run as one subprocess stopped
# at the deadline, so no section outlives the budget. On CUDA they compile FlexAttention and the
# check model (cold: ~1-2 min): they run only in what the timing runs left. The communication profile (several
# GPUs only: never in a dry run) starts the first preset again on every GPU, its compile cache warm.
MIN_SECTION_S = {"kernels": (20.0, 100.0), "agreement": (40.0, 60.0), "communication": (60.0, 90.0)}


def min_budget_s(cuda):
    """Least --budget-s the plan needs (dry run, CUDA): the kernel checks' and agreement runs' least starts
    and the report's reserve; below it a section is skipped before anything ran."""
    return MIN_SECTION_S["kernels"][cuda] + MIN_SECTION_S["agreement"][cuda] + RESERVE_S[cuda]


KERNELS = os.path.join(REPO, "bench", "gpu_kernels.py")


def profile_config(preset, device):
    """Config of the profiled CUDA step: ``preset`` at --seq-len 4096 (eager FlexAttention fits), one sequence of
    4,096 positions per micro-batch (stage 1's; ``gpu_kernels.profile_step`` profiles stage 1's first step)."""
    return config_of(["--preset", preset, "--seq-len", "4096", "--batch-tokens", str(3 * 4096), "--micro-batch-seqs",
                      "1", "--device", device.type])[0]


def kernels_and_profile(device, args, out_dir, deadline):
    """Kernel agreement checks, then the one-step profile, then on CUDA FlexAttention's backends
    (``bench/gpu_kernels.py``), stopped at ``deadline``.

    Args:
        device: torch.device they run on. args: this script's arguments (--dry-run, --preset).
        out_dir: where ``kernels.json`` is written. deadline: ``time.monotonic()`` seconds.

    Returns:
        ``(kernels, profile, attention_backends)``: what the subprocess wrote (any may be None if cut short).

    Raises:
        RuntimeError: it failed without writing any result.
    """
    path = os.path.join(out_dir, "kernels.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-u", KERNELS, "--device", str(device), "--json", path, "--preset", args.presets[0],
           "--parts", "kernels,profile" + ",attention" * (device.type == "cuda")]
    proc = subprocess.Popen(cmd + (["--dry-run"] if args.dry_run else []), cwd=REPO, env=child_env(),
                            start_new_session=True)
    try:
        archived = time.monotonic()
        while proc.poll() is None:  # the archive refreshed every 20 s (kernels.json grows check by check)
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(cmd, deadline)
            try:
                proc.wait(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                archived = refresh_results(archived)
    except subprocess.TimeoutExpired:
        print("[kernels] time budget reached: stopping it, keeping the checks it finished", flush=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    if not out and proc.returncode != 0:
        raise RuntimeError(f"bench/gpu_kernels.py exit status {proc.returncode} before any result")
    return out.get("kernels"), out.get("profile"), out.get("attention_backends")


def timing_need_s(prev):
    """Seconds the next preset's timing run is expected to take: the previous run's wall time (its start-up,
    the measured compile of each of its graphs, its steps) x 1.25 for the TST phase's extra graphs; 0 if none."""
    return 1.25 * ((prev or {}).get("run") or {}).get("wall_s", 0.0)


# Issue 46's rows: FlexAttention's two CUDA backends (gpu_kernels.attention_backend_check, the kernel section's last
# part) and, on several GPUs, each collective's share of a step (gpu_comm: a profiled torchrun run of the first preset)
# and the warm-up's skew between ranks (its timing run's log)
ATTENTION_BACKENDS = ("triton", "flash")  # FlexAttention's own Triton kernels; its FLASH backend (flash-attn-4)
PROFILE_WARM, PROFILE_STEPS = 3, 3  # the communication profile: steps unrecorded first (the first after the warm-up
                                    # still grows the allocator), then recorded


def pending_rows(device, nproc=1):
    """``(attention_backends, communication)``: issue 46's rows before they run, each ``passed`` None and ``skipped``
    saying why (replaced by the measurement when it runs).

    attention_backends ``{backend: row}``: forward and forward + backward ms at the record's shapes and the max
    relative difference against masked SDPA, per backend (``gpu_kernels.attention_backend_check``). communication
    ``{collective or "warm_up_skew": row}``: per collective ms per step and share of the step on each rank
    (``gpu_comm.communication_rows``), and the warm-up's skew between ranks (``skew_row``); ``nproc``: processes of
    the timing runs (1: one GPU, nothing to communicate).
    """
    cpu = device.type != "cuda"
    attention = {b: _try(functools.partial(gpu_kernels.attention_unavailable, device, b))
                 or "not run: the kernel section did not reach it (the budget, or it failed before)"
                 for b in ATTENTION_BACKENDS}
    comm = ("not run on the CPU: NCCL collectives between GPUs under torchrun" if cpu else
            "not run: one GPU" if nproc <= 1 else "not run: the communication profile did not run (the budget)")
    skew = comm if cpu or nproc <= 1 else "not run: the first timing run did not finish its warm-up"
    backends = {b: dict(name=f"attention_{b}", passed=None, skipped=attention[b], backend=b, ms_forward=None,
                        ms_forward_backward=None, max_rel_diff_vs_sdpa=None) for b in ATTENTION_BACKENDS}
    collectives = {c: dict(name=c, passed=None, skipped=comm, ms_per_step=None, share_of_step=None, per_rank=None)
                   for c in COLLECTIVES}
    collectives["warm_up_skew"] = dict(name="warm_up_skew", passed=None, skipped=skew, seconds=None, per_rank=None)
    return backends, collectives


def skew_row(skew, preset):
    """The ``warm_up_skew`` row from a timing run's ``warm_up_skew`` (``skew_of``; None: not logged, and why)."""
    if not skew:
        return dict(name="warm_up_skew", passed=None, seconds=None, per_rank=None, preset=preset,
                    skipped=f"not run: the timing run of {preset} logged no per-rank warm-up line (stopped in its "
                            f"warm-up, or not compiled)")
    return dict(name="warm_up_skew", passed=None, skipped=None, seconds=round(skew["skew_ms"] / 1e3, 1),
                per_rank=dict(min_s=round(skew["min_ms"] / 1e3, 1), max_s=round(skew["max_ms"] / 1e3, 1)),
                dist_timeout_s=skew["dist_timeout_s"], preset=preset,
                share_of_dist_timeout=round(skew["skew_ms"] / 1e3 / skew["dist_timeout_s"], 4))


def comm_window(cfg, warm=PROFILE_WARM, steps=PROFILE_STEPS):
    """``(warm, steps)`` of the communication profile of a run of ``cfg``: ``steps`` recorded after ``warm``, all in
    its stage table's first stage (one graph shape) when it is long enough, else fewer (at least one)."""
    first = T.Schedule(cfg, spec_of(cfg)).stages[0]
    return warm, max(1, min(steps, first.end - warm))


def comm_argv(args, preset, data, device_kind, out_dir):
    """``(argv, warm, steps)``: ``preset``'s timing run (``timing_argv``: its stage table, its warm-up) stopped after
    ``comm_window``'s steps, as run ``comm_<preset>``."""
    _, argv = timing_argv(args, preset, data, device_kind, out_dir)
    warm, steps = comm_window(config_of(argv)[0])
    return argv + ["--max-steps", str(warm + steps), "--run-id", f"comm_{preset}"], warm, steps


def profile_patch(pattern, warm, steps):
    """The launcher patch of the communication profile (``gpu_comm.install``): each rank writes
    ``pattern.format(rank=r)``."""
    return (f"import sys; sys.path.insert(0, {BENCH!r}); import gpu_comm; "
            f"gpu_comm.install({pattern!r}, {warm}, {steps})")


def comm_profile(name, argv, nproc, warm, steps, out_dir, deadline, patches=()):
    """Run the trainer on ``argv`` (run id ``name``) under torchrun with ``nproc`` processes, profiled
    (``profile_patch``), until ``deadline``; the ranks' files merged into rows.

    Returns:
        ``(rows, meta)``: rows ``{collective: row}`` (``gpu_comm.communication_rows``); meta: the run (exit status,
        wall time, log), world, profiled_steps (first, last; 1-based), per_rank_ms_per_step, warm_up_skew (this
        run's own, its cache warm from the timing run).
    """
    pattern = os.path.join(out_dir, "logs", name + ".rank{rank}.json")
    os.makedirs(os.path.dirname(pattern), exist_ok=True)
    for r in range(nproc):  # never read a stale profile of an earlier check
        if os.path.exists(pattern.format(rank=r)):
            os.remove(pattern.format(rank=r))
    run = TrainerRun(name, argv, out_dir, patches=[*patches, profile_patch(pattern, warm, steps)], nproc=nproc)
    res = run.start().wait(deadline)
    ranks = []
    for r in range(nproc):
        if os.path.exists(pattern.format(rank=r)):
            with open(pattern.format(rank=r), encoding="utf-8") as f:
                ranks.append(json.load(f))
    why = ("stopped at the budget before writing its profile" if res["timed_out"] else
           f"no profile written (trainer exit status {res['rc']}; see logs/{name}.console.txt)")
    rows = communication_rows(ranks, nproc, why)
    ranks.sort(key=lambda r: r["rank"])
    meta = dict(run={k: res[k] for k in ("name", "argv", "rc", "timed_out", "wall_s", "log", "status")}, world=nproc,
                profiled_steps=[warm + 1, warm + steps], warm_up_skew=res["warm_up_skew"],
                per_rank_ms_per_step={r["rank"]: r["ms_per_step"] for r in ranks},
                # NCCL kernels of no named collective (gpu_comm.collective_of): their names are in the ranks' files
                other_nccl_ms_per_step={r["rank"]: (r.get("collectives") or {}).get("other", {}).get("ms_per_step")
                                        for r in ranks})
    return rows, meta


def communication(device, data, args, preset, out_dir, deadline):
    """Section: ``preset``'s timing run on ``args.nproc`` GPUs, a few steps profiled on every rank (``comm_profile``):
    each collective's NCCL kernel time per step and share of the step, per rank."""
    argv, warm, steps = comm_argv(args, preset, data, device.type, out_dir)
    print(f"profiling steps {warm + 1}-{warm + steps} of {preset} on {args.nproc} processes (torchrun)", flush=True)
    rows, meta = comm_profile(f"comm_{preset}", argv, args.nproc, warm, steps, out_dir, deadline)
    return rows, dict(meta, preset=preset)


def comm_section(section, res, device, args, data, out_dir, preset, end, room):
    """Several GPUs, after ``preset``'s timing run: the ``warm_up_skew`` row from its log, then (if ``room``) the
    communication profile (``communication``) into the ``communication`` rows and ``communication_run``; it leaves
    the kernel and agreement sections their minimums when all fit, else may take the time up to ``end``."""
    tm = res["timing"].get(preset) or {}
    res["communication"]["warm_up_skew"] = skew_row(tm.get("warm_up_skew"), preset)
    skew = res["communication"]["warm_up_skew"]
    if skew["seconds"] is not None and skew["share_of_dist_timeout"] > 0.5:
        res["warnings"].append(f"warm-up skew {skew['seconds']} s between ranks is over half of --dist-timeout "
                               f"({skew['dist_timeout_s']:g} s): a colder or busier box may time out")
    if not room("communication"):
        return
    cuda = device.type == "cuda"
    later = MIN_SECTION_S["kernels"][cuda] + MIN_SECTION_S["agreement"][cuda]
    comm_end = end - later if end - time.monotonic() >= MIN_SECTION_S["communication"][cuda] + later else end
    got = section(f"communication profile ({preset} on {args.nproc} GPUs: reduce-scatter, all-gather, all-reduce)",
                  communication, device, data, args, preset, out_dir, comm_end)
    if got:
        rows, res["communication_run"] = got
        res["communication"].update(rows)


def run_sections(section, res, device, args, data, check_data, out_dir, deadline):
    """The timing runs, kernel checks + profile, trainer agreement runs: in that order, each only if it fits.

    Args:
        section: ``section(title, fn, *args)`` runs ``fn`` and records its time and errors (``main``).
        res: the report dict, filled in (``timing``: ``{preset: timing result}``, ``timing_window.runs``: when each
            started and stopped, ``kernels``, ``profile``, ``correctness``, ``skipped``: the sections the budget left
            out, with the seconds that were left).
        device, args, data, check_data, out_dir: the device, arguments, data flags of the timing
            run and of the checks, output folder.
        deadline: ``time.monotonic()`` seconds at which the budget ends; everything stops ``RESERVE_S`` before.
    """
    cuda = device.type == "cuda"
    end, t0 = deadline - RESERVE_S[cuda], deadline - args.budget_s
    since_start = lambda: round(time.monotonic() - t0, 1)  # noqa: E731

    def room(name):
        left = end - time.monotonic()
        if STOP["reason"] or left < MIN_SECTION_S[name][cuda]:
            res["skipped"].append(f"{name} ({left:.0f} s of the budget left)")
            print(f"skipping {name}: {left:.0f} s of the budget left", flush=True)
            return False
        return True
    for i, preset in enumerate(args.presets):  # one after the other, each until the timing deadline
        left = end - time.monotonic()
        need = timing_need_s(res["timing"].get(args.presets[i - 1])) if i else 0.0
        if i and (STOP["reason"] or left < need):  # a later preset only with the time the earlier one took
            res["skipped"].append(f"timing {preset} (needs ~{need:.0f} s by {args.presets[i - 1]}'s compile and "
                                  f"steps, {left:.0f} s left)")
            print(f"skipping the timing run of {preset}: ~{need:.0f} s needed, {left:.0f} s left", flush=True)
            continue
        live = res["timing"][preset] = dict(preset=preset, status="running", steps_requested=args.steps,
                                            steps_logged=0, compile_time_ms=None, compile_graphs=[])
        window = res["timing_window"]["runs"][preset] = dict(started_s=since_start(), stopped_s=None,
                                                             cut_short=None)
        tm = section(f"timing run of {preset}", timing, device, data, args, preset, out_dir, end,
                     res["microbench"], res["env"], live, window)
        if tm:
            res["timing"][preset] = tm  # (``live``, completed)
            res["errors"] += [f"timing {preset}: {p}" for p in tm["problems"]]
            res["warnings"] += [f"timing {preset}: {w}" for w in tm["warnings"]]
        else:
            live["status"] = "failed (see errors)"
            window["stopped_s"] = window["stopped_s"] or since_start()
        if i == 0 and args.nproc > 1:  # several GPUs: the communication profile before a second timing run
            comm_section(section, res, device, args, data, out_dir, preset, end, room)
    if room("kernels"):
        # they leave the trainer agreement runs their minimum when both fit, else take it all
        need = MIN_SECTION_S["kernels"][cuda] + MIN_SECTION_S["agreement"][cuda]
        kernels_end = end - MIN_SECTION_S["agreement"][cuda] if end - time.monotonic() >= need else end
        got = section("kernel agreement (fp8 at current, fixed and delayed scales, the head-gradient layouts; flex "
                      "vs sdpa, loss vs float64; check model: flex vs sdpa, compiled vs eager), one-step profile"
                      + ", attention backends" * cuda, kernels_and_profile, device, args, out_dir, kernels_end)
        res["kernels"], res["profile"], attention = got or (None, None, None)
        if attention:  # measured (CUDA): each backend's row replaces its placeholder
            res["attention_backends"].update(attention)
    if room("agreement"):
        res["correctness"] = section("trainer agreement (cpu vs device fp32; bf16 vs fp32; bf16 + fp8 vs bf16)",
                                     correctness, device, check_data, args, out_dir, end)


# ----------------------------------------------------------------------------------------------
# Main

def parse_args(argv):
    parser = H._Parser if H else argparse.ArgumentParser  # the trainer's: a bad flag gets one line, not the usage
    p = parser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, the check model's shape, few steps: checks this script")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "out", "gpu_check"),
                   help="where the 3 result files go: gpu_check.json, gpu_check_summary.txt, gpu_check_logs.tar.gz "
                        "(default: $OUT when set); the work (logs, synthetic data) is in a temporary folder")
    p.add_argument("--preset", default="baseline_h200,record_h200",
                   help="trainer presets timed, comma-separated, in this order, a later one only if the time the "
                        "earlier one took is left (--dry-run: at a small shape); the first is profiled")
    p.add_argument("--steps", type=int, default=None,
                   help="steps N of the timing run, both TST phases (phase 1: round(r N)) over the whole window "
                        "schedule (default 40; 12 with --dry-run)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="hard wall-clock limit of the whole check, s (default 530: a 570 s slot less interpreter "
                        "start-up; 240 with --dry-run); the timing runs may use all of it but its last 45 s (30 s "
                        "with --dry-run), the report's")
    p.add_argument("--train-files", default=None, help="real train shards (glob); default: synthetic")
    p.add_argument("--val-files", default=None, help="real val shards (glob); default: synthetic")
    p.add_argument("--val-tokens", type=int, default=None,
                   help="val tokens of the timing run, one chunk at its start and end (default 262144: the record's "
                        "val chunk; 256 with --dry-run)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile in the timing run (default: the trainer's, on with CUDA; with --dry-run the "
                        "first preset's run under Dynamo alone, backend 'eager', the others off)")
    p.add_argument("--trainer-args", default="", help="extra train_gpt.py words for the timing run and projection")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (one GPU each) of the timing runs and the communication profile, under torchrun "
                        "when > 1: 1, 2, 4 or 8 (default: the largest of 2, 4, 8 GPUs the box has, else 1; 1 with "
                        "--dry-run)")
    p.add_argument("--matmul-n", type=int, default=8192, help="matmul size n of the n^3 benchmark")
    p.add_argument("--correct-steps", type=int, default=CHECK_STEPS, help="steps of the agreement checks' runs")
    p.add_argument("--correct-timeout-s", type=float, default=180.0,
                   help="limit of the agreement checks' runs (the compiled one included), s")
    p.add_argument("--tol", type=float, default=1e-3, help="absolute loss tolerance, fp32 cpu vs device")
    p.add_argument("--bf16-tol", type=float, default=2e-2, help="absolute loss tolerance, bf16 vs fp32")
    p.add_argument("--fp8-tol", type=float, default=5e-2, help="absolute loss tolerance, bf16 + FP8 vs bf16")
    p.add_argument("--keep-data", action="store_true", help="keep the work folder (logs, synthetic shards)")
    args = p.parse_args(glue_option(argv, "--trainer-args"))  # its value starts with '-'
    d = args.dry_run
    args.presets = [p for p in args.preset.split(",") if p]
    unknown = [p for p in args.presets if T is not None and p not in T.PRESETS]
    if unknown or not args.presets:
        p.error(f"--preset {args.preset!r}: give trainer presets, comma-separated, from {sorted(T.PRESETS) if T else []}")
    args.steps = args.steps or (12 if d else 40)
    args.budget_s = args.budget_s or (240.0 if d else 530.0)
    args.val_tokens = args.val_tokens or (256 if d else 262_144)
    if args.budget_s < min_budget_s(not d):
        p.error(f"--budget-s {args.budget_s:g}: the plan needs at least {min_budget_s(not d):g} s"
                f"{' with --dry-run' if d else ''} (kernel checks, agreement runs, report); give at least that")
    explicit = any(a == "--out" or a.startswith("--out=") for a in (sys.argv[1:] if argv is None else argv))
    args.out_flag = "$OUT" if os.environ.get("OUT") and not explicit else "--out"
    if args.nproc is not None and (args.nproc not in (1, 2, 4, 8) or (d and args.nproc != 1)):
        p.error(f"--nproc {args.nproc}: give 1, 2, 4 or 8" + (" (the dry run times one CPU process: 1)" if d else ""))
    args.nproc = args.nproc or (1 if d else torchrun_procs(torch.cuda.device_count()))
    if args.steps < 4 or args.correct_steps < 4:
        p.error("--steps and --correct-steps must be >= 4 (the stage table's three stages and its extension step)")
    return args


def check_out_dir(out, flag):
    """None when folder ``out`` can be created and written (a probe file written and removed), else one line
    naming ``flag`` ($OUT or --out) and the fix: checked before the check runs, so nothing is lost at the end."""
    probe = os.path.join(out, f".gpu_check_probe_{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        return (f"gpu_check.py: {flag} {out}: cannot write the result files there ({e.strerror or e}); "
                f"give {flag} a folder this user can create and write")
    return None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def final_status(res):
    """Set ``res``'s errors, ``exit_code`` and ``status`` from what the sections found: 1 for a disagreement
    (a kernel or the training runs), 2 for any other error (a run cut short by the budget among them), else 0."""
    if STOP["reason"]:
        res["errors"].append(STOP["reason"])
    kernels_failed = [c["name"] for c in [*(res["kernels"] or {}).values(), *(res.get("attention_backends") or {})
                                          .values()] if c["passed"] is False]  # a backend off SDPA fails too
    res["errors"] += [f"kernel agreement: {n} failed" for n in kernels_failed]
    if not (res["correctness"] and res["correctness"]["passed"]):
        res["errors"] += ([f"agreement: {f}" for f in res["correctness"]["failures"]] if res["correctness"]
                          else ["agreement: did not run"])
    # a run stopped by the budget did not disagree: that is exit status 2, not 1
    failed = kernels_failed or (res["correctness"] and not res["correctness"]["passed"]
                                and not res["correctness"].get("cut_short"))
    res["exit_code"] = 1 if failed else (2 if res["errors"] else 0)
    res["status"] = "ok" if res["exit_code"] == 0 else "failed"


def pick_device(args, res):
    """The device checked: the CPU (--dry-run), CUDA device 0 (its errors in ``res`` when there is none: None)."""
    if args.dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        res["errors"].append("no CUDA device visible (torch.cuda.is_available() is False); "
                             "use --dry-run to check this script on CPU")
        return None
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    POLL_GPU["on"] = True
    return device


def main(argv=None):
    args = parse_args(argv)
    have = torch.cuda.device_count()
    if args.nproc > max(1, have):  # before anything runs: one line, exit 2
        fix = f"give --nproc {torchrun_procs(have)} or leave it out" if have else "run it on a GPU box (or --dry-run)"
        print(f"gpu_check.py: --nproc {args.nproc}: this box has {have} GPU(s); {fix}", file=sys.stderr)
        return 2
    # SIGTERM/SIGHUP (a job runner's timeout) unwind like Ctrl-C: the trainer runs, which live in
    # their own sessions, are stopped and the report is still written.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if args.dry_run and "OMP_NUM_THREADS" not in os.environ:  # small CPU processes, some side by side
        CHILD_THREADS["OMP_NUM_THREADS"] = "1"
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out_dir = os.path.abspath(args.out)  # the result files only
    bad_out = check_out_dir(out_dir, args.out_flag)
    if bad_out:
        print(bad_out, file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="gpu_check_")  # logs, synthetic shards, kernels.json: archived into out_dir
    SAVE["fn"] = lambda archive=True: save(res, out_dir, work, archive)
    res = dict(schema=SCHEMA, mode="dry-run (cpu)" if args.dry_run else "cuda",
               started=datetime.datetime.now().isoformat(timespec="seconds"),
               command=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
               args=vars(args), errors=[], warnings=[], section_wall_s={}, env=None, microbench=None,
               correctness=None, timing={}, kernels=None, profile=None, skipped=[], attention_backends=None,
               communication=None, communication_run=None)
    reserve = RESERVE_S[not args.dry_run]  # seconds from the check's start, below: what a cut-short run reports
    res["timing_window"] = dict(started=res["started"], budget_s=args.budget_s, reserve_s=reserve,
                                timing_until_s=args.budget_s - reserve, runs={})
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
            save(res, out_dir, work)
    try:
        device = pick_device(args, res)
        use_compile = args.compile if args.compile is not None else (device is not None and device.type == "cuda")
        if device is not None:
            print(f"gpu_check: {res['mode']}, budget {args.budget_s:.0f} s, out {out_dir}"
                  + (f", timing on {args.nproc} GPUs under torchrun" if args.nproc > 1 else ""))
            res["attention_backends"], res["communication"] = pending_rows(device, args.nproc)
            res["env"] = section("environment", environment, device, use_compile)
            if res["env"] and eager_backend(args, args.presets[0]):
                res["env"]["compile"] += f"; the {args.presets[0]} timing run under Dynamo alone (backend 'eager')"
            if res["env"]:
                print(json.dumps(res["env"], indent=1, default=str))
            res["microbench"] = section("micro-benchmarks", microbench, device, args)
            data = section("data", data_args, args, work)
            if data:
                data, check_data, _ = data
                run_sections(section, res, device, args, data, check_data, work, deadline)
    except KeyboardInterrupt as e:
        STOP["reason"] = STOP["reason"] or f"interrupted ({e or 'KeyboardInterrupt'})"
        for run in list(TrainerRun.running):
            run.stop()

    final_status(res)
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    report(res, out_dir, work)
    if args.keep_data:
        print(f"kept the work folder (logs, synthetic shards): {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return res["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
