"""Does our method beat the baseline? Paired equal-FLOP evidence for TST and Aurora on record #89's recipe.

A small GPT (``--preset cpu_baseline``: record #89's recipe -- the stage table, packed batches,
multi-token and prefix objectives, NorMuon and CautiousAdam, the model's layer roles at the smoke
shape) is trained on a real-text corpus (default ``data/sample``) once per *arm* (``baseline``: the
preset as it is; ``tst``, ``aurora``, ``tst_aurora``: with TST, with Aurora, with both, as
``cpu_smoke`` and ``record_h200`` add them), *data order* (``--orders`` shuffles written by
``bench/small_scale_data.py``) and *init seed* (``--seeds``), every arm at the same FLOPs. NorMuon's
lr is swept on the baseline first. Comparisons are paired per (order, seed)
(``bench/small_scale_stats.py``): mean difference of final val losses, 95% t-interval, paired t-test
p; and each arm's first val step whose mean is below the baseline's final mean at p < 0.01
(``records/compare.py --first-passing``), with the steps saved.

    python bench/small_scale.py           # the study: records/cpu/<today>_small_scale/ (about an hour, 2 idle cores)
    python bench/small_scale.py --quick   # the pipeline end to end in tiny runs (the test suite's)

It prints its plan and time estimate before running, and resumes after a crash (a complete run
is skipped). The detail (arms, data orders, the sweep, first-passing, the budget): docs/RESULTS.md.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from _paths import BENCH, RECORDS, REPO, glue_option, use  # noqa: E402
use(RECORDS, BENCH)  # records/compare.py and bench's modules, by name
import compare  # noqa: E402  (records/compare.py: the reader of trainer logs, defined once)
import harness  # noqa: E402  (its SOURCE_FILES: what a log snapshots)
import shard_format  # noqa: E402  (data/shard_format.py)
import small_scale_data  # noqa: E402
import small_scale_stats as sst  # noqa: E402

SAMPLE = os.path.join("data", "sample")  # the repository's real-text sample: the default corpus
PRESET = "cpu_baseline"  # record #89's recipe and model roles at the smoke shape, without our methods


def _methods(*names):
    """Trainer flags of ``train_gpt.OUR_METHODS``' fields ``names`` (TST: tst_frac and tst_bag_size; Aurora: the
    optimizer), as cpu_smoke and record_h200 set them."""
    return [w for k in names for w in ("--" + k.replace("_", "-"), str(trainer_module().OUR_METHODS[k]))]


# arm name -> trainer flags on top of the preset: the baseline is cpu_baseline itself
ARMS = {"baseline": (), "tst": ("tst_frac", "tst_bag_size"), "aurora": ("optimizer",),
        "tst_aurora": ("tst_frac", "tst_bag_size", "optimizer")}
LABELS = {"baseline": "baseline", "tst": "+tst", "aurora": "+aurora", "tst_aurora": "+tst+aurora"}
BASELINE = "baseline"  # every arm is paired with it (same steps, orders and seeds)
LR_FLAG = "--matrix-lr"  # NorMuon's (and aurora_normuon's) lr, swept on the baseline, used by every arm

# The study's shape is the preset's (the smoke model, seq_len 768, 2,304 positions per step, 100 steps), val on
# the preset's 16,384 tokens (the same in every run, so paired differences do not carry its sampling noise) at
# every 10% of the steps for the first-passing curve.
MODES = {
    "full": dict(
        # 4 arms x 3 orders x 2 seeds and a 3-point sweep: about an hour on 2 idle cores (COST)
        arms=list(ARMS), orders=3, seeds=2, steps=100, batch_tokens=2304, val_tokens=16384, val_frac=0.1,
        sweep=[0.023, 0.046, 0.092], sweep_extend=1, seq_len=None, record_schedule=False,
        out=os.path.join("records", "cpu", "{date}_small_scale")),
    "full_length": dict(
        # the record's 1,285 steps and its schedule (RECORD_SCHEDULE) on the smoke model; 128-position sequences
        # keep every arm under ~1.1 epochs of data/sample (TST's phase 1 reads 4 tokens per position): ~3 h
        arms=list(ARMS), orders=3, seeds=2, steps=1285, batch_tokens=384, val_tokens=16384, val_frac=0.05,
        sweep=[0.0115, 0.023, 0.046], sweep_extend=1, seq_len=128, record_schedule=True,
        out=os.path.join("records", "cpu", "{date}_full_length")),
    "quick": dict(  # the pipeline end to end in seconds (tests/test_small_scale.py): no evidence of anything
        arms=["baseline", "tst_aurora"], orders=2, seeds=1, steps=5, batch_tokens=48, val_tokens=256,
        val_frac=0.2, sweep=[0.046], sweep_extend=0, seq_len=16, record_schedule=False,
        out=os.path.join("bench", "out", "small_scale_quick")),
}

# The schedule fields cpu_baseline shortens for its 100 steps; full_length sets them back to the trainer's defaults
# (the record's: 15 extension steps, 300 of momentum warmup, 50 of cooldown) so the stage table, warmups, cooldown,
# extension and TST switch are the 1,285-step record's own.
RECORD_SCHEDULE = ("extension_steps", "momentum_warmup_steps", "momentum_cooldown_steps")

# Cost model of one trainer process, for the plan printed before anything runs: start-up + seconds per
# training FLOP + seconds per val (forward) FLOP, on one thread of a 2-core Intel Xeon (torch 2.13.0 CPU,
# float32), measured on 2026-12-03 with the machine shared (load 3-14) as CPU-seconds per FLOP (3.8e-11
# to 4.3e-11) plus ~15% for two runs sharing the memory bus: docs/RESULTS.md. results.md
# reports the measured time / this estimate of every run. Plus the optimizer's elementwise work, which the FLOPs
# do not count: per step and parameter, measured on 2026-12-07 at the full-length shape (563 ms a step of 128
# positions, 253 ms of it the FLOP term, over the smoke model's 28.7M parameters; idle machine).
COST = dict(startup_s=6.0, s_per_train_flop=4.5e-11, s_per_val_flop=4.5e-11, s_per_param_step=1.1e-8)


# ----------------------------------------------------------------------------------------------
# Planning the runs


@dataclasses.dataclass
class Job:
    """One training run: its key (arm, data-order kind, order, seed), where its log goes, its trainer command."""
    key: tuple
    run_dir: str
    run_id: str
    argvs: list  # one trainer command line


def run_name(arm, order, seed):
    return f"{arm}_o{order}_seed{seed}"


def val_every_of(spec):
    """Val every ``val_frac`` of the steps (at least every step): first-passing needs the curve."""
    return max(1, int(round(spec["steps"] * spec["val_frac"])))


def trainer_argv(spec, run_dir, run_id, seed, arm, lr, train_files):
    """The trainer command line of one run: the preset, the shape, the mode's base flags, the arm, the lr."""
    argv = [sys.executable, spec["trainer"], "--preset", PRESET, "--device", "cpu", "--no-compile", "--no-bf16",
            "--train-files", train_files, "--val-files", spec["val_files"],
            "--num-iterations", str(spec["steps"]), "--batch-tokens", str(spec["batch_tokens"]),
            "--val-tokens", str(spec["val_tokens"]), "--val-every", str(val_every_of(spec)),
            "--log-every", "5", "--seed", str(seed), "--log-dir", run_dir, "--run-id", run_id]
    if spec["seq_len"] is not None:
        argv += ["--seq-len", str(spec["seq_len"])]
    if spec["record_schedule"]:
        defaults = {f.name: f.default for f in dataclasses.fields(trainer_module().Config)}
        argv += [w for k in RECORD_SCHEDULE for w in ("--" + k.replace("_", "-"), str(defaults[k]))]
    return argv + _methods(*ARMS[arm]) + [LR_FLAG, fmt_lr(lr)] + spec["trainer_args"]


def make_job(spec, arm, order, seed, lr, run_dir=None, run_id=None):
    """The Job of one run of ``arm`` on data order ``order`` from init ``seed`` at NorMuon lr ``lr``."""
    run_dir = run_dir or os.path.join(spec["out"], arm)
    run_id = run_id or run_name(arm, order, seed)
    argv = trainer_argv(spec, run_dir, run_id, seed, arm, lr, spec["order_globs"][order])
    return Job((arm, "pieces", order, seed), run_dir, run_id, [argv])


def sweep_job(spec, lr):
    """The lr-sweep run at ``lr``: the baseline on data order 0, seed 0 (the same flags as its arm run)."""
    return make_job(spec, BASELINE, 0, 0, lr, os.path.join(spec["out"], "lr_sweep"), f"{BASELINE}_lr{fmt_lr(lr)}_seed0")


def arm_jobs(spec, lr):
    """Every arm x order x seed."""
    return [make_job(spec, arm, order, seed, lr)
            for arm in spec["arms"] for order in range(spec["orders"]) for seed in range(spec["seeds"])]


def planned_jobs(spec, lr=None):
    """``(sweep jobs, arm jobs)`` of the plan; the arms at ``lr`` (default: the grid's first)."""
    return [sweep_job(spec, x) for x in spec["sweep"]], arm_jobs(spec, spec["sweep"][0] if lr is None else lr)


def is_reused(spec, job):
    """True for the baseline's (order 0, seed 0) run: the sweep run at the chosen lr, copied, not trained twice."""
    return job.key[0] == BASELINE and job.key[2:] == (0, 0) and BASELINE in spec["arms"]


def est_seconds(job):
    """Estimated wall seconds of a Job from the COST model (start-up, training and val FLOPs)."""
    return sum(est_parts(job))


def est_parts(job):
    """Estimated wall seconds of each trainer command of a Job (a list, one per ``job.argvs``).

    Training FLOPs summed over the stage table's steps (the batch and windows change by stage); a
    val pass costs its tokens' forward FLOPs (a third of training's), a TST run's val in phase 1
    adds the bag objective's pass over ``val_tokens / s`` latent positions.
    """
    tg, parts = trainer_module(), []
    for argv in job.argvs:
        cfg = parse_config(argv[2:])
        n, sched = cfg.num_iterations, tg.Schedule(cfg, tg.MODELS[cfg.model])
        train = sum(sched[t].stage.batch_tokens * sched[t].flops_per_position for t in range(n))
        points = {0, n} | {t for t in range(1, n + 1) if cfg.val_every and t % cfg.val_every == 0}
        switch = tg.tst_switch_step(cfg)
        per_val = sched[0].flops_per_position / 3 * cfg.val_tokens
        tst_val = per_val / cfg.tst_bag_size if cfg.tst_bag_size > 1 else 0.0
        val = sum(per_val + (tst_val if max(t - 1, 0) < switch else 0.0) for t in points)
        opt = COST["s_per_param_step"] * n * parameter_count(cfg.model)
        parts.append(COST["startup_s"] + COST["s_per_train_flop"] * train + COST["s_per_val_flop"] * val + opt)
    return parts


@functools.lru_cache(maxsize=None)
def parameter_count(model):
    """Parameters of the trainer's model spec ``model``, counted on the meta device (no memory)."""
    import torch
    tg = trainer_module()
    cfg = dataclasses.replace(tg.Config(), model=model)
    with torch.device("meta"):
        return sum(p.numel() for p in tg.build_model(cfg, tg.MODELS[model]).parameters())


def print_plan(spec, parallel):
    """Print every group of planned runs with its count and estimated time; return the estimate (s)."""
    sweep, arms = planned_jobs(spec)
    groups = {f"lr sweep ({BASELINE}, order 0, seed 0)": sweep}
    for job in arms:
        if not is_reused(spec, job):
            groups.setdefault(job.key[0], []).append(job)
    print(f"plan: {'group':<38} {'runs':>4} {'est. each':>10} {'est. total':>11}")
    total = 0.0
    for name, jobs in groups.items():
        each = [est_seconds(j) for j in jobs]
        total += sum(each)
        print(f"      {name:<38} {len(jobs):>4} {np.mean(each) / 60:>8.1f} m {sum(each) / 60:>9.1f} m")
    ext = spec["sweep_extend"] * est_seconds(sweep[0])
    if spec["sweep_extend"]:
        print(f"      {'lr sweep extensions (at most)':<38} {spec['sweep_extend']:>4} "
              f"{ext / spec['sweep_extend'] / 60:>8.1f} m {ext / 60:>9.1f} m")
    wall = (total + ext) / parallel
    print(f"      estimated wall time with --jobs {parallel}: {wall / 60:.0f} min ({wall / 3600:.2f} h; "
          f"cost model COST of measured runs; other load makes it longer)", flush=True)
    return wall

# ----------------------------------------------------------------------------------------------
# Running the runs


def expected_config(argv):
    """The resolved trainer config of a command line, for the resume check.

    Parsed by the working tree's trainer (``parse_config``; a snapshot with other defaults then looks
    changed, and its runs are retrained: the safe side): the fields that define the run, and the data.
    """
    train_gpt = trainer_module()
    cfg = parse_config(argv[2:])
    keys = [f.name for f in dataclasses.fields(cfg) if f.name not in train_gpt.OPERATIONAL]
    keys += ["train_files", "val_files", "val_every"]
    return {k: order_key(getattr(cfg, k)) if k == "train_files" else getattr(cfg, k) for k in keys}


def order_key(pattern):
    """A data order's shard glob by its last two parts (``mix_o0_<hash>/*_train_*.bin``).

    The order folders are named by the hash of the tokens they hold, so these two parts name
    the data wherever ``<out>`` lies: a moved output folder still resumes.
    """
    return "/".join(str(pattern).replace(os.sep, "/").rstrip("/").split("/")[-2:])


TRAINER_FILES = harness.SOURCE_FILES  # what a run's log snapshots
# GPT-2's tokenizer table, read beside the trainer (the prefix-token objective's table): copied too
TOKENIZER = os.path.relpath(harness.shard_format.GPT2_ENCODER_JSON, os.path.dirname(os.path.abspath(harness.__file__)))


def code_hashes(code_dir):
    """``{file name: sha256}`` of the trainer snapshot's files (what every run's log header records)."""
    out = {}
    for name in TRAINER_FILES:
        if name != "train_gpt.py" and not os.path.exists(os.path.join(code_dir, name)):
            continue  # a snapshot of the trainer from before this file moved out of train_gpt.py
        with open(os.path.join(code_dir, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_json(path):
    """A run's JSON summary, or {} when missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def logged_run(run_dir, run_id):
    """``(config, {file name: sha256} of its source snapshot)`` of a run's log; ``({}, {})`` if none."""
    path = os.path.join(run_dir, run_id + ".txt")
    if not os.path.exists(path):
        return {}, {}
    lines = compare.read_log_lines(path)  # read once: the config and the snapshot's hashes
    files, _, _ = compare.split_snapshot(lines)
    return compare.parse_lines(lines, path).config, {f.name: f.sha256 for f in files}


def same_config(run_dir, run_id, argv, say=True):
    """True if the run's log was made with the config of ``argv`` and by the code it runs (its
    ``argv[1]``'s folder: the snapshot), else says what differs. A code change that no flag
    shows (e.g. a numerics fix) thus retrains too: one folder's runs all share their code."""
    logged, logged_code = logged_run(run_dir, run_id)
    logged = {k: order_key(v) if k == "train_files" else v for k, v in logged.items()}
    diff = {k: (logged.get(k), v) for k, v in expected_config(argv).items() if logged.get(k, v) != v}
    if logged_code != code_hashes(os.path.dirname(argv[1])):
        diff["source (sha256)"] = ("the log's", "the snapshot's")
    if diff and say:
        print(f"  {run_id}: made with other flags {diff}; training it again", flush=True)
    return not diff


def is_done(job, say=True):
    """True if the Job's JSON says complete and its log was made with the same config."""
    status = read_json(os.path.join(job.run_dir, job.run_id + ".json")).get("status")
    return status == "complete" and same_config(job.run_dir, job.run_id, job.argvs[0], say)


class Progress:
    """One progress bar over the study, in estimated seconds (``est_seconds``), so its ETA weighs long runs more.

    A run advances it as the trainer prints its ``step:n/N`` lines; runs an earlier invocation finished
    (``count_done``) move its start too, so tqdm's rate, and the ETA, count only this invocation's work.
    """

    def __init__(self, jobs):
        self.lock, self.frac = threading.Lock(), {}
        self.est = {job.run_id: est_seconds(job) for job in jobs}
        self.bar = tqdm(total=round(sum(self.est.values())), unit="s", smoothing=0, mininterval=5.0,
                        dynamic_ncols=True, desc="study",
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, {remaining} left (est.)")

    def count_done(self, jobs):
        """Count the ``jobs`` an earlier invocation completed as done before this one started."""
        with self.lock:
            for job in jobs:
                if self.frac.get(job.run_id, 0.0) == 0.0 and is_done(job, say=False):
                    self.frac[job.run_id] = 1.0
                    step = round(self.est.get(job.run_id, 0.0))
                    self.bar.n += step
                    self.bar.initial += step  # tqdm's rate is (n - initial) / elapsed
            self.bar.refresh()

    def add(self, job):
        """A run planned after the bar started (an lr-sweep extension)."""
        with self.lock:
            if job.run_id not in self.est:
                self.est[job.run_id] = est_seconds(job)
                self.bar.total += round(self.est[job.run_id])
                self.bar.refresh()

    def advance(self, job, frac):
        """Set ``job``'s done fraction (0..1; it never goes back) and move the bar by the difference."""
        with self.lock:
            old = self.frac.get(job.run_id, 0.0)
            new = min(max(frac, old), 1.0)
            self.frac[job.run_id] = new
            self.bar.update(round(new * self.est.get(job.run_id, 0.0)) - round(old * self.est.get(job.run_id, 0.0)))

    def write(self, text):
        self.bar.write(text)

    def close(self):
        self.bar.close()


def say(ledger, text):
    """Print a line without breaking the progress bar."""
    progress = ledger.get("progress")
    if progress is None:
        print(text, flush=True)
    else:
        progress.write(text)


def train(job, ledger):
    """Train one Job unless already done; return its summary.

    Progress (val lines) is echoed; on failure the trainer's last stderr lines are printed and
    the summary's ``status`` is not ``complete``.
    """
    os.makedirs(job.run_dir, exist_ok=True)
    if is_done(job):
        say(ledger, f"  {job.run_id}: complete, skipped")
    else:
        set_aside(job.run_dir, job.run_id)
        run_trainer(job.argvs[0], job, 0, ledger)
    if ledger.get("progress"):
        ledger["progress"].advance(job, 1.0)
    return run_summary(job)


def run_summary(job):
    """The Job's JSON summary plus ``key`` and ``val`` (the val points of its log, via records/compare.py)."""
    summary = read_json(os.path.join(job.run_dir, job.run_id + ".json")) or dict(status="missing")
    log = os.path.join(job.run_dir, job.run_id + ".txt")
    summary["val"] = compare.parse_log(log).val if os.path.exists(log) else []
    summary["key"] = job.key
    return summary


def run_trainer(argv, job, part, ledger):
    """Run one trainer command as a subprocess, echo its val lines, record its time; return the exit code."""
    env = dict(os.environ)
    if ledger.get("threads"):
        env["OMP_NUM_THREADS"] = str(ledger["threads"])
    what = job.run_id + (f" (part {part + 1} of {len(job.argvs)})" if len(job.argvs) > 1 else "")
    say(ledger, f"  {what}: training ... ({shlex.join(argv)})" if ledger.get("verbose") else f"  {what}: training ...")
    t0, load0 = time.time(), load_average()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    for ln in proc.stdout:
        if " val_loss:" in ln:
            say(ledger, f"    {job.run_id} " + ln.rstrip()[:110])
        step = STEP_LINE.match(ln)
        if step and ledger.get("progress"):
            ledger["progress"].advance(job, int(step[1]) / int(step[2]))
    err = proc.stderr.read()
    rc = proc.wait()
    wall, load1 = time.time() - t0, load_average()
    name = os.path.relpath(os.path.join(job.run_dir, job.run_id), ledger["out"]) + (f"#{part + 1}" if part else "")
    record_timing(ledger, dict(run=name, wall_s=round(wall, 1), est_s=round(est_parts(job)[part], 1),
                               load_start=load0, load_end=load1, exit=rc,
                               finished=datetime.datetime.now().isoformat(timespec="seconds")))
    say(ledger, f"  {what}: exit {rc}, {wall:.0f}s wall (1-min load average {load0:.1f} -> {load1:.1f})")
    if rc != 0:
        say(ledger, "    " + "\n    ".join(err.strip().splitlines()[-5:]))
    return rc


STEP_LINE = re.compile(r"step:(\d+)/(\d+) ")  # the trainer's train and val lines: how far a run is


def record_timing(ledger, entry):
    """Append one trainer process's wall time and load to ``<out>/timing.json`` (kept across invocations)."""
    with ledger.get("lock") or contextlib.nullcontext():  # concurrent runs (--jobs) finish at any time
        return _record_timing(ledger, entry)


def _record_timing(ledger, entry):
    path = os.path.join(ledger["out"], "timing.json")
    data = dict(invocations=[], runs=[])
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    if entry.get("invocation"):
        data["invocations"].append(entry["invocation"])
    else:
        data["runs"].append(entry)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)
    return data


def load_average():
    """1-minute load average (other processes on the 2 cores slow CPU training several-fold)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError):
        return math.nan


def set_aside(run_dir, run_id):
    """Move an unfinished (or stale) log + JSON of a run to ``<run_dir>/incomplete/`` before retraining.

    The trainer never overwrites a log, and compare.py reads only the folder's own ``*.txt``.
    """
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    for ext in (".txt", ".json"):
        path = os.path.join(run_dir, run_id + ext)
        if os.path.exists(path):
            os.makedirs(os.path.join(run_dir, "incomplete"), exist_ok=True)
            os.replace(path, os.path.join(run_dir, "incomplete", f"{run_id}_{stamp}{ext}"))


def snapshot_trainer(out):
    """Copy the trainer's files (``TRAINER_FILES``) to ``<out>/code/`` once and train every run from there.

    Other people edit the trainer while a benchmark runs for hours; the snapshot keeps every run
    of one output folder on the same code (each log still holds its full source). A resumed
    benchmark keeps using the snapshot it started with; delete ``<out>/code/`` to take the
    current code (the resume check then retrains every run its logged source differs from).
    """
    code = os.path.join(out, "code")
    if not os.path.exists(os.path.join(code, "train_gpt.py")):
        os.makedirs(code, exist_ok=True)
        for name in TRAINER_FILES + (TOKENIZER,):
            os.makedirs(os.path.dirname(os.path.join(code, name)), exist_ok=True)
            shutil.copyfile(os.path.join(REPO, name), os.path.join(code, name))
        print(f"trainer snapshot: {code}", flush=True)
    else:
        print(f"trainer snapshot: {code} (from an earlier invocation; delete it to use the current code)", flush=True)
    with open(os.path.join(code, "train_gpt.py"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return os.path.join(code, "train_gpt.py"), digest


def copy_run(src, dst):
    """Copy a finished run's log and JSON under another name (the sweep run reused as order 0, seed 0)."""
    os.makedirs(dst.run_dir, exist_ok=True)
    for ext in (".txt", ".json"):
        shutil.copyfile(os.path.join(src.run_dir, src.run_id + ext), os.path.join(dst.run_dir, dst.run_id + ext))


def run_all(jobs, ledger):
    """Train ``jobs`` (Jobs) ``ledger['jobs']`` at a time; their summaries in the order given."""
    if ledger.get("jobs", 1) <= 1 or len(jobs) <= 1:
        return [train(j, ledger) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=ledger["jobs"]) as pool:
        return list(pool.map(lambda j: train(j, ledger), jobs))


# ----------------------------------------------------------------------------------------------
# LR sweep


def fmt_lr(lr):
    return f"{lr:.6g}"



def lr_sweep(spec, ledger):
    """NorMuon's lr on the baseline (data order 0, seed 0): the grid, then past an edge optimum, the lowest final.

    The rule: the lr of the lowest final val loss wins; when it is the grid's lowest or highest, the
    grid grows by one factor-2 step on that side and the rule is applied again, at most
    ``sweep_extend`` times. Returns ``dict(flag, chosen, edge, rows=[(lr, final val loss or None,
    train_time_ms, run id)])``.
    """
    rows = {}

    def run(lrs):
        jobs = [sweep_job(spec, lr) for lr in lrs]
        for job in jobs:
            if ledger.get("progress"):
                ledger["progress"].add(job)
        for lr, job, s in zip(lrs, jobs, run_all(jobs, ledger)):
            ok = s.get("status") == "complete" and math.isfinite(s.get("final_val_loss", math.nan))
            rows[lr] = (s["final_val_loss"] if ok else None, s.get("train_time_ms"), job.run_id)

    def best():
        lrs = sorted(rows)
        return lrs, min(lrs, key=lambda x: rows[x][0] if rows[x][0] is not None else math.inf)

    say(ledger, f"lr sweep {BASELINE} ({LR_FLAG}): {', '.join(map(fmt_lr, spec['sweep']))}")
    run(list(spec["sweep"]))
    for _ in range(spec["sweep_extend"]):
        lrs, top = best()
        if rows[top][0] is None or len(lrs) < 2 or top not in (lrs[0], lrs[-1]):
            break
        nxt = top / 2 if top == lrs[0] else top * 2
        say(ledger, f"  best lr {fmt_lr(top)} is at the edge of the grid: also trying {fmt_lr(nxt)}")
        run([nxt])
    lrs, top = best()
    if rows[top][0] is None:
        raise SystemExit(f"lr sweep: every run failed; see the logs in {os.path.join(spec['out'], 'lr_sweep')}")
    say(ledger, f"  -> {LR_FLAG} {fmt_lr(top)} (final val loss {rows[top][0]:.4f})")
    return dict(flag=LR_FLAG, chosen=top, edge=len(lrs) > 1 and top in (lrs[0], lrs[-1]),
                rows=[(lr,) + rows[lr] for lr in lrs])


# ----------------------------------------------------------------------------------------------
# Analysis


def complete(summary):
    return (summary.get("status") == "complete" and bool(summary.get("val"))
            and math.isfinite(summary.get("final_val_loss", math.nan)))


def finals(results, arm):
    """``{(order, seed): final val loss}`` of the complete runs of ``arm``."""
    return {(o, s): r["final_val_loss"] for (a, _, o, s), r in results.items() if a == arm and complete(r)}


def comparisons(spec, results):
    """Each planned arm against the baseline, paired per (order, seed); pairs left out are named."""
    keys = [(o, s) for o in range(spec["orders"]) for s in range(spec["seeds"])]
    rows = []
    for a in spec["arms"]:
        b = BASELINE
        if a == b or b not in spec["arms"]:
            continue
        va, vb = finals(results, a), finals(results, b)
        res = sst.paired_difference(va, vb)
        left_out = [(k, "no complete run of " + " nor ".join(x for x, v in ((a, va), (b, vb)) if k not in v))
                    for k in keys if k not in res["keys"]]
        for (o, s), why in left_out:
            print(f"WARNING: {a} vs {b}: pair (order {o}, seed {s}) left out: {why}", flush=True)
        rows.append(dict(res, a=a, b=b, at="final", what=f"equal FLOPs: {spec['steps']} steps of the same "
                                                         "positions", left_out=left_out))
    return rows


def first_passing(spec, stats):
    """Per arm, the first val step whose mean (over its runs) is below the baseline's final mean at p < 0.01.

    Asked of ``records/compare.py --first-passing --pool-train-data --json`` (one group per arm folder,
    the one-sided t-test rule) with the baseline's final mean as the target. ``steps_saved`` = the
    baseline's steps minus that step (positive: the arm needs fewer steps to reach the baseline's final
    val loss). Returns ``{arm: dict(target, step, val_loss, p, steps_saved, runs)}``, or ``{}`` with a
    warning when compare.py fails.
    """
    target = stats.get(BASELINE, {}).get("mean")
    arms = [a for a in spec["arms"] if stats.get(a, {}).get("n")]
    if BASELINE not in spec["arms"] or target is None or not math.isfinite(target) or not arms:
        return {}
    cmd = [sys.executable, os.path.join(REPO, "records", "compare.py"), "--first-passing", "--pool-train-data",
           "--json", "--target", repr(target), *[os.path.join(spec["out"], a) for a in arms]]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        groups = json.loads(p.stdout) if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        p, groups = None, None
        print(f"WARNING: compare.py --first-passing failed: {e}", flush=True)
    if groups is None:
        if p is not None:
            print(f"WARNING: compare.py --first-passing failed (exit {p.returncode}): {p.stderr.strip()[-300:]}",
                  flush=True)
        return {}
    out = {}
    for g in groups:
        arm = os.path.basename(g["group"].split(" [")[0].rstrip("/"))
        step = g.get("first_passing_step")
        out[arm] = dict(target=target, step=step, val_loss=g.get("first_passing_val_loss"),
                        p=g.get("first_passing_p"), runs=g.get("first_passing_runs"), steps=spec["steps"],
                        steps_saved=None if step is None else spec["steps"] - step)
    return out


def mean_curve(runs):
    """Mean val curve of runs over the val steps they all have: dict(step, loss, flops, time_ms) lists."""
    common = sorted(set.intersection(*[{p["step"] for p in r["val"]} for r in runs]))
    pts = [{p["step"]: p for p in r["val"]} for r in runs]
    mean = lambda key: [float(np.mean([pt[t][key] for pt in pts])) for t in common]  # noqa: E731
    return dict(step=common, loss=mean("val_loss"), flops=mean("flops"), time_ms=mean("train_time_ms"))


def arm_stats(results, arm, corpus):
    """Final val loss over the arm's (order, seed) runs, its mean curve, time, FLOPs, text read."""
    runs = {(o, s): r for (a, _, o, s), r in sorted(results.items()) if a == arm}
    done = [r for r in runs.values() if complete(r)]
    out = dict(sst.spread([r["final_val_loss"] for r in done]), n_runs=len(runs),
               finals={f"o{o}s{s}": r["final_val_loss"] for (o, s), r in runs.items() if complete(r)})
    if done:
        out.update(curve=mean_curve(done), train_time_ms=float(np.mean([r["train_time_ms"] for r in done])),
                   flops=float(np.mean([r["flops"] for r in done])),
                   raw_tokens=int(np.mean([r["raw_tokens"] for r in done])))
        out["epochs"] = out["raw_tokens"] / corpus
    return out


# ----------------------------------------------------------------------------------------------
# Plots


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def curves_plot(stats, arms, passing, path):
    """Mean val curve of every arm over its runs, the baseline's final mean dashed, each arm's first-passing step
    marked; val loss from the second val point on."""
    plt = pyplot()
    shown = [a for a in arms if stats.get(a, {}).get("curve")]
    if not shown:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 5), dpi=110)
    later = []
    for arm in shown:
        c = stats[arm]["curve"]
        line, = ax.plot(c["step"][1:], c["loss"][1:], marker="o", ms=3, label=LABELS[arm])
        later += c["loss"][1:]
        fp = passing.get(arm, {})
        if fp.get("step") is not None:
            ax.plot([fp["step"]], [fp["val_loss"]], marker="*", ms=14, color=line.get_color(), zorder=4)
    if stats.get(BASELINE, {}).get("n"):
        ax.axhline(stats[BASELINE]["mean"], color="black", ls="--", lw=1,
                   label=f"{LABELS[BASELINE]} final mean {stats[BASELINE]['mean']:.4f}")
    ax.set_title(f"arms vs {LABELS[BASELINE]}", fontsize=10)
    ax.set_xlabel("step (star: first step below the dashed line at p < 0.01)")
    ax.set_ylabel("val loss, mean over data orders x seeds")
    if later:
        ax.set_ylim(min(later) - 0.02, np.percentile(later, 75) + 0.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True



def own_plot(stats, arms, path, x, target):
    """Fallback plot (matplotlib) of every arm's mean val curve, when compare.py is unavailable."""
    plt = pyplot()
    key, label = dict(flops=("flops", "training FLOPs"), time=("time_ms", "train time (ms)"))[x]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=110)
    for name in arms:
        c = stats.get(name, {}).get("curve")
        if c:
            ax.plot(c[key], c["loss"], marker="o", ms=3, label=name)
    if target:
        ax.axhline(target, color="black", ls="--", lw=1, label=f"{BASELINE} mean final {target:.4f}")
    ax.set_xlabel(label)
    ax.set_ylabel("val loss (mean over data orders and seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def differences_plot(rows, path):
    """Every comparison's paired differences ``a - b`` (one dot per (order, seed)), their mean and 95%
    interval, one row each: the figure of results.md's comparison table. Rows with under 2 pairs are left out."""
    rows = [r for r in rows if r["n"] >= 2]
    if not rows:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.42 * len(rows)), dpi=110)
    colours = {sst.BETTER: "tab:green", sst.WORSE: "tab:red"}
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        c = colours.get(r["verdict"], "tab:grey")
        ax.scatter(r["diffs"], np.full(len(r["diffs"]), y - 0.22), s=12, color=c, alpha=0.6, zorder=2)
        ax.errorbar(r["mean"], y, xerr=[[r["mean"] - r["ci"][0]], [r["ci"][1] - r["mean"]]], fmt="o",
                    color=c, ms=6, capsize=4, lw=2, zorder=3)
    ax.axvline(0.0, color="black", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['a']} - {r['b']}" + (" (at equal FLOPs, mid-run)" if r["at"] == "flops" else "")
                        for r in reversed(rows)], fontsize=8)
    ax.set_xlabel("val loss difference a - b (nats; < 0: a better; final vs final except where marked)\n"
                  "dots below: the (order, seed) pairs; bar: mean and 95% t-interval", fontsize=9)
    ax.set_title("paired differences: green better, red worse, grey no measurable difference", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


LOADED = 3.0  # a 1-min load average above this on the 2 cores: the run shared them with other jobs


def make_plots(out, arms, stats, target, timing):
    """val loss vs FLOPs and vs train time via records/compare.py (one arm folder = one group, pooled
    over the data orders); no time plot when some run shared the cores (``timing``'s load above LOADED):
    its curve would show the other jobs, not the arm. Returns ``(plots, notes, compare's table)``."""
    plots, compare_text = [], ""
    folders = [os.path.join(out, a) for a in arms if stats.get(a, {}).get("n")]
    tool = os.path.join(REPO, "records", "compare.py")
    loaded = [r["run"] for r in timing["runs"] if max(r["load_start"], r["load_end"]) > LOADED]
    notes = [f"No val loss vs train time plot: {len(loaded)} of {len(timing['runs'])} runs shared the 2 cores with "
             f"other jobs (1-min load above {LOADED:g}, e.g. `{loaded[0]}`), so their train times measure the load, "
             "not the arm."] if loaded else []
    for x in ("flops",) if loaded else ("flops", "time"):
        path = os.path.join(out, f"val_loss_vs_{x}.png")
        what = f"val loss vs {'training FLOPs' if x == 'flops' else 'train time'}, every run"
        ok = False
        if folders:
            cmd = [sys.executable, tool, *folders, "--pool-train-data", "--plot", path, "--x", x]
            if target is not None:
                cmd += ["--target", f"{target:.4f}"]
            try:
                p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
                ok = p.returncode == 0 and os.path.exists(path)
                if ok and x == "flops":
                    compare_text = p.stdout
                if not ok:
                    print(f"compare.py failed (exit {p.returncode}): {p.stderr.strip()[-300:]}", flush=True)
            except (OSError, subprocess.SubprocessError) as e:
                print(f"compare.py failed: {e}", flush=True)
        if ok:
            what += f" (records/compare.py; dashed line: {BASELINE}'s mean final loss)"
        else:
            own_plot(stats, arms, path, x, target)
            what += " (means, drawn by small_scale.py: records/compare.py was unavailable or failed)"
        plots.append((path, what))
    return plots, notes, compare_text




# ----------------------------------------------------------------------------------------------
# Report


def num(x, fmt):
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)




def comparison_table(rows):
    L = ["## Paired comparisons (a - b of the final val loss per data order and seed)", "",
         "| a vs b | held equal | pairs | mean a - b | 95% interval | p | verdict |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        left = f" ({len(r['left_out'])} left out)" if r["left_out"] else ""
        L.append(f"| {r['a']} vs {r['b']} | {r['what']} | {r['n']}{left} | {num(r['mean'], '+.4f')} | "
                 f"[{num(r['ci'][0], '+.4f')}, {num(r['ci'][1], '+.4f')}] | {num(r['p'], '.3g')} | "
                 f"{'**' + r['verdict'] + '**' if r['verdict'] in (sst.BETTER, sst.WORSE) else r['verdict']} |")
    gone = [f"{r['a']} vs {r['b']} ({r['at']}): order {o} seed {s}: {why}" for r in rows for (o, s), why in r["left_out"]]
    if gone:
        L += ["", "Pairs left out (a run failed or is missing):", ""] + [f"* {g}" for g in gone]
    return L + [""]




def detail_lines(spec, stats):
    """Per-run final losses and the mean val curves."""
    keys = [(o, s) for o in range(spec["orders"]) for s in range(spec["seeds"])]
    L = ["## Final val loss per run", "", "| arm | " + " | ".join(f"o{o} s{s}" for o, s in keys) + " |",
         "|---|" + "---|" * len(keys)]
    for arm in spec["arms"]:
        f = stats.get(arm, {}).get("finals", {})
        L.append(f"| {arm} | " + " | ".join(num(f.get(f"o{o}s{s}"), ".4f") for o, s in keys) + " |")
    curves = {a: dict(zip(stats[a]["curve"]["step"], stats[a]["curve"]["loss"]))
              for a in spec["arms"] if stats.get(a, {}).get("curve")}
    steps = sorted(set().union(*curves.values())) if curves else []
    L += ["", "Mean val loss over each arm's runs at the val steps they all have:", "",
          "| arm | " + " | ".join(str(t) for t in steps) + " |", "|---|" + "---|" * len(steps)]
    for arm, c in curves.items():
        L.append(f"| {arm} | " + " | ".join(num(c.get(t), ".3f") for t in steps) + " |")
    return L + [""]




def timing_lines(timing):
    tr, inv = timing["runs"], timing["invocations"]
    loads = [max(r["load_start"], r["load_end"]) for r in tr]
    walls = [r["wall_s"] for r in tr if r.get("exit") == 0]
    est = [r for r in tr if r.get("est_s")]
    ratio = sum(r["wall_s"] for r in est) / sum(r["est_s"] for r in est) if est else math.nan
    return ["## Timing (from `timing.json`, all invocations on this folder)", "",
            f"* {len(tr)} trainer processes, {sum(r['wall_s'] for r in tr) / 60:.1f} min of trainer wall time "
            f"(incl. start-up and val), {num(ratio, '.2f')} x the cost model's estimate; {len(inv)} invocation(s) "
            f"of this script, {sum(i['wall_s'] for i in inv) / 60:.1f} min in all "
            f"(the last: {inv[-1]['wall_s'] / 60:.1f} min).",
            f"* Wall time per trainer process: median {num(np.median(walls) / 60 if walls else None, '.1f')} min "
            f"(range {num(min(walls, default=math.nan) / 60, '.1f')} to {num(max(walls, default=math.nan) / 60, '.1f')} "
            "min), `--jobs` of them at a time on the 2 cores (and at times other jobs).",
            f"* 1-min load average at the start/end of the runs: median {num(np.median(loads) if loads else None, '.1f')}, "
            f"max {num(max(loads, default=math.nan), '.1f')}; {sum(x > 2.5 for x in loads)} of {len(tr)} runs saw > "
            "2.5 (other jobs on the 2 cores slow a run down: train times carry that noise, FLOPs do not).", ""]




def settings_of(arm, sweep):
    text = " ".join(_methods(*ARMS[arm])).replace("--optimizer ", "").replace("--", "") or "the preset"
    return text + (f", {LR_FLAG[2:]} {fmt_lr(sweep['chosen'])}" if sweep else "")


def val_what(spec):
    whole = spec["val_tokens"] == spec["val_total"] - 1
    return "the whole val shard" if whole else f"the first {spec['val_tokens']:,} val tokens"


def header_lines(spec, stats, corpus):
    """The title and the setup bullets of results.md."""
    tg = trainer_module()
    shape = tg.MODELS[tg.PRESETS[PRESET]["model"]]
    keys = spec["orders"] * spec["seeds"]
    title = ("at the record's length: 1,285 steps" if spec["mode"] == "full_length" else f"{spec['mode']} mode")
    L = ["# Small-scale study: TST and Aurora on record #89's recipe, paired over data orders and seeds "
         f"({title})", ""]
    if spec["mode"] == "quick":
        L += ["**Quick mode checks the pipeline; its runs are far too short (and its val set too small) "
              "to be evidence for or against any method. The full mode is the study.**", ""]
    return L + [
        f"Made by `{spec['command']}` on {spec['date']}: {spec['machine']}. Trainer: `code/` (snapshot of the "
        f"repo's at the start, train_gpt.py sha256 {spec['trainer_sha256']}..., not kept in git: every log holds "
        "its source, `python records/verify.py LOG --extract DIR` writes it out; `python records/verify.py LOG "
        "--rerun 10` re-runs a log, rebuilding its data order from `data_recipes.json`).", "",
        f"* Recipe: `--preset {PRESET}` (record #89's stage table, document-packed batches, multi-token and prefix "
        "objectives, NorMuon on the block matrices and CautiousAdam on the rest, the record's layer roles on "
        f"{shape.n_layer} layers) at {shape.model_dim} wide, {shape.n_head} heads, seq_len "
        f"{spec['seq_len'] or tg.PRESETS[PRESET]['seq_len']}, windows in blocks of {shape.window_block}; "
        f"{spec['batch_tokens']} positions per step in stage 3 (a third, two thirds in stages 1, 2); {spec['steps']} "
        f"steps; float32, no compile. `{BASELINE}` is the preset as it is; `tst_aurora` adds cpu_smoke's (= "
        "`record_h200`'s) methods, `tst` and `aurora` one of them each.",
        f"* Data: `{spec['train_files']}` ({corpus:,} train tokens) in {spec['orders']} data orders (`pieces`: "
        f"{spec['chunk'] - 1}-token pieces of the stream, each after an EOT, shuffled by the order's seed; recipes "
        f"in `data_recipes.json`), x {spec['seeds']} init seeds = {keys} runs per arm. Val loss on "
        f"{spec['val_tokens']:,} tokens of `{spec['val_files']}` ({val_what(spec)}), every "
        f"{spec['val_frac']:.0%} of a run's steps.",
        f"* lr: NorMuon's `{LR_FLAG}` (also aurora_normuon's) from the sweep below, the same in every arm; the "
        "Adam lrs are the preset's.",
        *schedule_lines(spec),
        *([f"* **Arms in this report: {', '.join(LABELS[a] for a in spec['arms'])}** (`--arms`); not yet in it: "
           f"{', '.join(LABELS[a] for a in ARMS if a not in spec['arms'])} (the command without `--arms` trains "
           "what is missing and reports every arm)."] if set(spec["arms"]) != set(ARMS) else []),
        "* Comparisons are paired per (order, seed) against the baseline: mean difference, 95% "
        "t-interval, paired t-test p (`scipy.stats.ttest_rel`); lower loss is better; *better*/*worse* only where "
        "the interval excludes 0, else *no measurable difference*. First-passing: `records/compare.py "
        "--first-passing` (one-sided t-test, p < 0.01) against the baseline's final mean.", ""]


def schedule_lines(spec):
    """The bullet naming the record's own schedule (full_length), else nothing."""
    if not spec["record_schedule"]:
        return []
    tg = trainer_module()
    defaults = {f.name: f.default for f in dataclasses.fields(tg.Config)}
    flags = ", ".join(f"`--{k.replace('_', '-')} {defaults[k]}`" for k in RECORD_SCHEDULE)
    cfg = parse_config(["--preset", PRESET, "--num-iterations", str(spec["steps"]),
                        *[w for k in RECORD_SCHEDULE for w in ("--" + k.replace("_", "-"), str(defaults[k]))]])
    cuts = ", ".join(str(st.start) for st in tg.recipe_stages(cfg)[1:])
    switch = tg.tst_switch_step(dataclasses.replace(cfg, **{k: trainer_module().OUR_METHODS[k] for k in
                                                            ("tst_frac", "tst_bag_size")}))
    return [f"* Schedule: the record's own at {spec['steps']} steps ({flags}, the preset's cooldown and lr floor): "
            f"stages from steps {cuts}, the TST arms' switch to next-token training at step {switch}."]


def arm_table(spec, sweep, stats):
    L = ["| arm | settings | final val loss (mean ± std, n) | train time | FLOPs | text tokens read | repeats data |",
         "|---|---|---|---|---|---|---|"]
    for arm in spec["arms"]:
        s = stats.get(arm, {})
        if not s.get("n"):
            L.append(f"| {LABELS[arm]} | {settings_of(arm, sweep)} | no complete run ({s.get('n_runs', 0)} tried) "
                     "| | | | |")
            continue
        rep = ("yes" if s["epochs"] > 1 else "no") + f" ({s['epochs']:.2f} epochs)"
        L.append(f"| {LABELS[arm]} | {settings_of(arm, sweep)} | {s['mean']:.4f} ± {num(s['std'], '.4f')} (n={s['n']}) "
                 f"| {s['train_time_ms'] / 1000:.0f} s | {s['flops']:.3g} | {s['raw_tokens']:,} | {rep} |")
    return L + [""]


def passing_lines(spec, passing):
    L = ["## First-passing step: the first val step whose mean is below the baseline's final mean at p < 0.01", "",
         "| arm | baseline (target: its final mean) | steps | first-passing step | mean val loss there | p | "
         "steps saved (+) or lost (-) |", "|---|---|---|---|---|---|---|"]
    for arm in spec["arms"]:
        fp = passing.get(arm)
        if fp is None:
            continue
        base = BASELINE
        if fp["step"] is None:
            step, saved = "never", f"none: not below it within {fp['steps']} steps"
        else:
            step, saved = str(fp["step"]), f"{fp['steps_saved']:+d}"
        L.append(f"| {LABELS[arm]} | {LABELS[base]} ({fp['target']:.4f}) | {fp['steps']} | {step} | "
                 f"{num(fp['val_loss'], '.4f')} | {num(fp['p'], '.2g')} | {saved} |")
    return L + ["", "A baseline never passes its own final mean (its final val point is that mean); an arm that "
                    "never passes reaches the baseline's final loss later than the baseline, or not at all.", ""]


def sweep_lines(spec, sweep):
    L = [f"## LR sweep ({BASELINE}, order 0, seed 0, final val loss; the lowest wins, an edge winner extends the grid "
         f"by x2 on its side, at most {spec['sweep_extend']} time(s))", "",
         "| flag | lr | final val loss | train time | |", "|---|---|---|---|---|"]
    for lr, loss, t, _ in sweep["rows"]:
        mark = "**chosen**" + (" (edge of grid)" if sweep["edge"] else "") if lr == sweep["chosen"] else ""
        L.append(f"| `{sweep['flag']}` | {fmt_lr(lr)} | {num(loss, '.4f')} | {'-' if t is None else f'{t / 1000:.0f} s'} "
                 f"| {mark} |")
    if BASELINE in spec["arms"]:
        L += ["", f"{BASELINE}'s order 0, seed 0 is the sweep run at the chosen lr (same flags; its log, copied from "
                  "`lr_sweep/`, keeps the sweep's run id)."]
    return L + [""]


def verdict_lines(spec, rows, passing):
    """What the study answers, in words: per arm, whether it reaches the baseline's final loss in fewer
    steps (first-passing, p < 0.01) and the paired final difference; the steps a shorter schedule keeps."""
    L = ["## What it answers", ""]
    by_arm = {r["a"]: r for r in rows}
    for arm in spec["arms"]:
        if arm == BASELINE or arm not in passing:
            continue
        fp, r = passing[arm], by_arm.get(arm)
        diff = (f"final val loss {num(r['mean'], '+.4f')} vs the baseline's [{num(r['ci'][0], '+.4f')}, "
                f"{num(r['ci'][1], '+.4f')}] (paired, p {num(r['p'], '.2g')}: {r['verdict']})") if r else ""
        if fp["step"] is None or fp["steps_saved"] <= 0:
            L.append(f"* **{LABELS[arm]}** does not reach the baseline's final mean ({fp['target']:.4f}) before step "
                     f"{fp['steps']} at p < 0.01: no steps saved; {diff}.")
        else:
            L.append(f"* **{LABELS[arm]}** passes the baseline's final mean ({fp['target']:.4f}) at step {fp['step']} "
                     f"of {fp['steps']} (p {num(fp['p'], '.2g')}): {fp['steps_saved']} steps saved, "
                     f"{fp['step'] / fp['steps']:.3f} of the schedule; {diff}.")
    return L + [""]


def report(spec, sweep, stats, rows, passing, corpus, timing, plots, compare_text, plot_notes=()):
    """The markdown of results.md (full_length: README.md; printed too)."""
    L = header_lines(spec, stats, corpus) + verdict_lines(spec, rows, passing)
    L += arm_table(spec, sweep, stats) + comparison_table(rows)
    L += passing_lines(spec, passing) + detail_lines(spec, stats) + sweep_lines(spec, sweep)
    L += ["## Plots", ""] + [f"* `{os.path.basename(p)}`: {what}" for p, what in plots] + [""]
    L += [*plot_notes, ""] if plot_notes else []
    L += timing_lines(timing)
    if compare_text:
        L += ["## `records/compare.py --pool-train-data` on the arm folders", "", "```", compare_text.rstrip(), "```"]
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------------------------
# Inputs and checks


def trainer_module():
    """The working tree's train_gpt, imported once (its config, presets and FLOP count)."""
    import train_gpt
    return train_gpt


def parse_config(words):
    """The trainer's ``Config`` of its command-line words (``harness.parse_flags`` with the trainer's presets, then
    ``check_config``); ConfigError or argparse's SystemExit as the trainer refuses them."""
    tg = trainer_module()
    cfg = harness.parse_flags(tg.Config, tg.PRESETS, words)[0]
    tg.check_config(cfg)
    return cfg


def shard_tokens(pattern, flag):
    """Tokens in the shards of a glob (relative to the repo root), each validated; SystemExit naming ``flag``."""
    import glob
    files = sorted(glob.glob(pattern if os.path.isabs(pattern) else os.path.join(REPO, pattern)))
    if not files:
        raise SystemExit(f"{flag} {pattern!r}: no shard found (relative to {REPO}); check the glob")
    try:
        return sum(shard_format.read_header(f) for f in files)
    except shard_format.ShardError as e:
        raise SystemExit(f"{flag}: {e}") from None




def prepare_data(spec, write):
    """Count the corpus and val tokens, and name (``write``: also write, with their recipes) the data orders."""
    spec["corpus"] = shard_tokens(spec["train_files"], "--train-files")
    spec["val_total"] = shard_tokens(spec["val_files"], "--val-files")
    if not 1 <= spec["val_tokens"] <= spec["val_total"] - 1:
        raise SystemExit(f"--val-tokens {spec['val_tokens']}: the val shards hold {spec['val_total']} tokens; "
                         f"use 1 to {spec['val_total'] - 1}")
    pattern = spec["train_files"] if os.path.isabs(spec["train_files"]) else os.path.join(REPO, spec["train_files"])
    try:
        tokens = small_scale_data.read_corpus(pattern)
        spec["order_globs"] = {k: small_scale_data.build_order(tokens, os.path.join(spec["out"], "data"), "pieces", k,
                                                               spec["chunk"], write) for k in range(spec["orders"])}
    except small_scale_data.OrderError as e:
        raise SystemExit(str(e)) from None
    if write:
        write_recipes(spec, tokens)


def write_recipes(spec, tokens):
    """``<out>/data_recipes.json``: each data order's recipe (``small_scale_data.recipe``) and the command that
    rebuilds it; the shards themselves (``<out>/data/``) are git-ignored. records/verify.py reads it."""
    folder = os.path.join(spec["out"], "data")
    with open(os.path.join(folder, ".gitignore"), "w", encoding="utf-8") as f:
        f.write("# rebuilt from ../data_recipes.json (python bench/small_scale_data.py ...; records/verify.py does it)\n*\n")
    recipes = {}
    for k, pattern in spec["order_globs"].items():
        rec = small_scale_data.recipe(spec["train_files"], tokens, pattern, "pieces", k, spec["chunk"])
        rec["command"] = small_scale_data.rebuild_command(rec, os.path.relpath(folder, REPO))
        recipes[rec["folder"]] = rec
    with open(os.path.join(spec["out"], "data_recipes.json"), "w", encoding="utf-8") as f:
        json.dump(recipes, f, indent=1)


def parse_list(text, flag, kind):
    """A non-empty comma list without repeats; floats must be finite and > 0. SystemExit naming ``flag``."""
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise SystemExit(f"{flag} {text!r}: give a comma list without empty items, e.g. "
                         + ("baseline,tst" if kind is str else "0.002,0.004"))
    repeated = sorted({w for w in words if words.count(w) > 1})
    if repeated:
        raise SystemExit(f"{flag} {text!r}: {', '.join(repeated)} named more than once; name each once")
    if kind is str:
        return words
    try:
        vals = [float(w) for w in words]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: not a list of numbers; e.g. 0.002,0.004") from None
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise SystemExit(f"{flag} {text!r}: learning rates must be finite and > 0")
    return vals


def check_commands(spec):
    """Parse every planned trainer command (every sweep lr) with the trainer's own parser before anything runs.

    A bad value (e.g. from ``--trainer-args``) stops here with the trainer's one-line message
    instead of failing every run one by one.
    """
    import io
    tg = trainer_module()
    sweep, arms = planned_jobs(spec)
    for job in sweep + arms:
        for argv in job.argvs:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parse_config(argv[2:])
            except (tg.ConfigError, SystemExit) as e:
                msg = str(e) if isinstance(e, tg.ConfigError) else err.getvalue().strip().splitlines()[-1]
                raise SystemExit(f"run {job.run_id}: the trainer rejects its command: {msg} "
                                 "(set by this script's flags or --trainer-args)") from None


def machine_line():
    """``N-core CPU (model), torch X, Python Y`` for the report (the CPU model: ``harness.cpu_model``)."""
    import platform
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "?"
    return f"{os.cpu_count()}-core CPU ({harness.cpu_model()}), torch {tv}, Python {platform.python_version()}"




def min_steps(spec):
    """Least --steps every arm's trainer run accepts: its stage table's 3 scheduled steps past --extension-steps
    (read from its parsed config)."""
    least = 1
    for arm in spec["arms"]:
        words = trainer_argv(dict(spec, steps=10**6, val_files="x"), "x", "x", 0, arm, 0.01, "x")[2:]
        least = max(least, parse_config(words).extension_steps + 3)
    return least


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the pipeline end to end in tiny runs (no evidence)")
    mode.add_argument("--full-length", action="store_true",
                      help="the record's length: 1,285 steps with its schedule (extension, momentum warmup and "
                           "cooldown), 128-position sequences, 384 positions per step in stage 3 (about 3 hours)")
    ap.add_argument("--orders", type=int, default=None, help="data orders per arm (default: 3)")
    ap.add_argument("--seeds", type=int, default=None, help="init seeds per arm and order (default: 2)")
    ap.add_argument("--arms", default=None, help=f"comma list of arms (default: all); from {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 100, the preset's)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="latent positions per step in stage 3 (a third and two thirds in stages 1, 2; default 2304, "
                         "the preset's)")
    ap.add_argument("--val-tokens", type=int, default=None, help="val tokens per eval (default: 16384, the preset's)")
    ap.add_argument("--lrs", default=None, help=f"comma list: the sweep grid of {LR_FLAG} (default 0.023,0.046,0.092)")
    ap.add_argument("--sweep-extend", type=int, default=None,
                    help="extend the grid by a factor 2 past an edge optimum at most this many times (default 1)")
    ap.add_argument("--train-files", default=os.path.join(SAMPLE, "*_train_*.bin"),
                    help="the corpus: train shards (glob) that the data orders are made from")
    ap.add_argument("--val-files", default=os.path.join(SAMPLE, "*_val_*.bin"), help="val shards (glob)")
    ap.add_argument("--out", default=None, help="output folder (default: records/cpu/<today>_small_scale, "
                                                "quick: bench/out/small_scale_quick); reuse it to resume")
    ap.add_argument("--trainer-args", default="", help="extra flags appended to every trainer command (quoted)")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the trainer; 0 = torch's default (one per core). 1 because the "
                         "2-core machine is shared: with other jobs running, 2 threads ran 3x slower than 1 "
                         "(each step waits at thread barriers for a descheduled thread); 2 wins only when idle")
    ap.add_argument("--jobs", type=int, default=2,
                    help="trainer processes at a time (each on --threads threads); 2 x 1 thread keeps both cores "
                         "of an otherwise idle 2-core machine busy. Timings of concurrent runs include their "
                         "contention for memory bandwidth, the same for every arm")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands, train nothing")
    ap.add_argument("--verbose", action="store_true", help="print every trainer command line")
    return ap.parse_args(glue_option(argv, "--trainer-args"))  # its value starts with '-'


def build_spec(args, argv):
    """The run specification from the mode and the flags; every flag checked (SystemExit, one message)."""
    mode = "quick" if args.quick else "full_length" if args.full_length else "full"
    spec = dict(MODES[mode], mode=mode)
    for k in ("orders", "seeds", "steps", "batch_tokens", "val_tokens", "sweep_extend"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    spec["arms"] = parse_list(args.arms, "--arms", str) if args.arms is not None else spec["arms"]
    bad = [a for a in spec["arms"] if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    if args.lrs is not None:
        spec["sweep"] = parse_list(args.lrs, "--lrs", float)
    for flag, key, low in (("--orders", "orders", 1), ("--seeds", "seeds", 1), ("--steps", "steps", 1),
                           ("--batch-tokens", "batch_tokens", 1), ("--val-tokens", "val_tokens", 1),
                           ("--sweep-extend", "sweep_extend", 0)):
        if spec[key] < low:
            raise SystemExit(f"{flag} must be >= {low} (got {spec[key]})")
    if args.jobs < 1 or args.threads < 0:
        raise SystemExit(f"--jobs must be >= 1 and --threads >= 0 (got --jobs {args.jobs}, --threads {args.threads})")
    seq_len = spec["seq_len"] or trainer_module().PRESETS[PRESET]["seq_len"]
    spec["chunk"] = seq_len + 1  # a next-token sequence holds seq_len + 1 tokens: one piece fills it
    if spec["batch_tokens"] % (3 * seq_len):
        raise SystemExit(f"--batch-tokens {spec['batch_tokens']}: must be a multiple of 3 x seq_len {seq_len} "
                         f"(stages 1, 2, 3 train a third, two thirds, all of it, in whole sequences); e.g. "
                         f"{max(1, round(spec['batch_tokens'] / (3 * seq_len))) * 3 * seq_len}")
    try:
        spec["trainer_args"] = shlex.split(args.trainer_args)
    except ValueError as e:
        raise SystemExit(f"--trainer-args {args.trainer_args!r}: {e}; quote it as one shell word") from None
    # the flags every run sets (and those that would stop or redirect it): appended after them, the last would win
    own = {w for w in trainer_argv(dict(spec, trainer="", val_files="", trainer_args=[]), "", "", 0, "tst_aurora", 0.1, "")
           if w.startswith("--")} | {"--preset", "--max-steps", "--describe", "--help", "--resume"}
    taken = [w for w in spec["trainer_args"] if w.split("=", 1)[0] in own]
    if taken:
        raise SystemExit(f"--trainer-args: {taken[0].split('=', 1)[0]} is set by the study itself (each arm, the lr sweep, "
                         "the seeds and orders, the shape); change it through this script's own flags, or add an arm")
    date = datetime.date.today().isoformat()
    if args.out is not None and not args.out.strip():  # '' would read as "not given": the default in silence
        raise SystemExit(f"--out {args.out!r}: an empty folder name; name a folder, or leave --out out for the "
                         f"default {spec['out'].format(date=date)}")
    out = args.out if args.out is not None else spec["out"].format(date=date)
    out = out if os.path.isabs(out) else os.path.join(REPO, out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"--out {out}: exists and is not a folder; name a folder")
    parent = out
    while not os.path.exists(parent):  # the folder that would hold it must take a new entry (--dry-run too)
        parent = os.path.dirname(parent)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_test.", dir=parent))  # a probe, removed at once
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot write in {parent} ({e.strerror}); name a writable folder") from None
    spec.update(out=out, train_files=args.train_files, val_files=args.val_files, date=date,
                trainer=os.path.join(REPO, "train_gpt.py"),
                machine=machine_line() + (f", trainer on {args.threads} thread(s)" if args.threads else "")
                + (f", {args.jobs} runs at a time" if args.jobs > 1 else ""),
                command="python bench/small_scale.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    try:
        least = min_steps(spec)
    except harness.ConfigError as e:
        raise SystemExit(f"--trainer-args: the trainer refuses the arms' flags: {e}") from None
    if spec["steps"] < least:
        raise SystemExit(f"--steps {spec['steps']}: the arms' stage table needs at least {least} steps (3 scheduled "
                         f"past the preset's extension steps); give --steps {least} or more")
    return spec


# ----------------------------------------------------------------------------------------------
# Main


def analyse_and_report(spec, sweep, results, timing_of):
    """Statistics, plots, results.md and results.json of a finished (or partly failed) study."""
    out = spec["out"]
    stats = {arm: arm_stats(results, arm, spec["corpus"]) for arm in spec["arms"]}
    rows = comparisons(spec, results)
    passing = first_passing(spec, stats)
    target = stats.get(BASELINE, {}).get("mean")
    target = target if target is not None and math.isfinite(target) else None
    plots = []
    if curves_plot(stats, spec["arms"], passing, os.path.join(out, "val_curves.png")):
        plots.append((os.path.join(out, "val_curves.png"), "mean val curve of every arm, its first-passing step "
                                                            "(star) and its baseline's final mean (dashed)"))
    if differences_plot(rows, os.path.join(out, "differences.png")):
        plots.append((os.path.join(out, "differences.png"), "the paired differences of every comparison in the table "
                                                             "above with at least 2 pairs, with their 95% intervals"))
    timing = timing_of()
    more, notes, compare_text = make_plots(out, spec["arms"], stats, target, timing)
    if notes and os.path.exists(os.path.join(out, "val_loss_vs_time.png")):  # drawn by an earlier invocation
        os.remove(os.path.join(out, "val_loss_vs_time.png"))
    md = report(spec, sweep, stats, rows, passing, spec["corpus"], timing, plots + more, compare_text, notes)
    name = "README.md" if spec["mode"] == "full_length" else "results.md"  # a folder of its own: its README
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
        f.write(md)
    for r in rows:
        r.update(keys=[list(k) for k in r["keys"]], diffs=r["diffs"].tolist(),
                 excluded=[[list(k), why] for k, why in r["excluded"]], left_out=[[list(k), why] for k, why in r["left_out"]])
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(spec={k: v for k, v in spec.items() if k != "order_globs"}, preset=PRESET, sweep=sweep,
                       arms=stats, comparisons=rows, first_passing=passing, timing=timing), f, indent=1, default=str)
    with open(os.path.join(out, "command.txt"), "w", encoding="utf-8") as f:
        f.write(spec["command"] + "\n")
    return md


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    spec = build_spec(args, argv)
    prepare_data(spec, write=False)  # names the data orders; creates nothing yet
    check_commands(spec)
    print(f"small_scale ({spec['mode']}): {len(spec['arms'])} arms x {spec['orders']} data orders x {spec['seeds']} "
          f"seeds, {spec['steps']} steps x {spec['batch_tokens']} positions, val on "
          f"{spec['val_tokens']:,} tokens; output {spec['out']}", flush=True)
    print_plan(spec, args.jobs)
    if args.dry_run:  # creates nothing: a later real run must snapshot the code of its own time
        for job in arm_jobs(spec, spec["sweep"][0]):
            if job.key[2:] == (0, 0):
                print(shlex.join(job.argvs[0]).replace(f"{LR_FLAG} {fmt_lr(spec['sweep'][0])}", f"{LR_FLAG} <lr>"))
        return 0
    try:
        os.makedirs(spec["out"], exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {spec['out']}: cannot create it ({e.strerror}); name a writable folder") from None
    spec["trainer"], spec["trainer_sha256"] = snapshot_trainer(spec["out"])
    try:
        prepare_data(spec, write=True)
    except OSError as e:
        raise SystemExit(f"--out {spec['out']}: cannot write the data orders there ({e.strerror}); "
                         "free some space or name another folder") from None
    ledger = dict(verbose=args.verbose, threads=args.threads, out=spec["out"], jobs=args.jobs, lock=threading.Lock())
    sweep_jobs, planned = planned_jobs(spec)
    ledger["progress"] = Progress(sweep_jobs + [j for j in planned if not is_reused(spec, j)])
    ledger["progress"].count_done(sweep_jobs)

    sweep = lr_sweep(spec, ledger)
    jobs = arm_jobs(spec, sweep["chosen"])
    ledger["progress"].count_done([j for j in jobs if not is_reused(spec, j)])
    for job in jobs:
        if is_reused(spec, job) and not is_done(job):
            set_aside(job.run_dir, job.run_id)
            copy_run(sweep_job(spec, sweep["chosen"]), job)
            say(ledger, f"  {job.run_id}: = lr_sweep/{BASELINE}_lr{fmt_lr(sweep['chosen'])}_seed0 (same flags), copied")
    results = {job.key: s for job, s in zip(jobs, run_all(jobs, ledger))}
    ledger.pop("progress").close()

    def timing_of():
        return record_timing(ledger, dict(invocation=dict(
            started=datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
            wall_s=round(time.time() - t_start, 1), command=spec["command"])))
    md = analyse_and_report(spec, sweep, results, timing_of)
    print("\n" + md)
    name = "README.md" if spec["mode"] == "full_length" else "results.md"
    print(f"results: {os.path.join(spec['out'], name)}; this invocation {(time.time() - t_start) / 60:.1f} min",
          flush=True)
    return 0


def cli(argv=None):
    """``main`` for the command line: a message-carrying SystemExit becomes one error line and exit 2."""
    try:
        return main(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(f"small_scale.py: error: {e.code}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
