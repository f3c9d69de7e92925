"""Does it work? Equal-FLOP evidence for TST and Aurora at small scale, on real text.

What it measures
----------------
A small GPT (the ``cpu_smoke`` preset's shape, see MODEL below) is trained on the real-text
shards (``../shared/data/realtext``: ~1.02M train tokens, 100k val tokens) once per *arm* and
seed, every arm with the **same number of steps, the same latent positions per step and so
the same FLOPs per step**; only what a step reads (TST reads ``s`` times more text per step in
phase 1 -- that is the method) and the optimizer differ:

  adamw          AdamW on the block matrices, no TST            (the baseline)
  muon           Muon on the block matrices, no TST
  aurora         Aurora on the block matrices, no TST
  aurora_tst     Aurora + TST full, s=4, r=0.3
  aurora_tst_s2 / _s8      s in {2, 8}, r=0.3
  aurora_tst_r0.2 / _r0.4  r in {0.2, 0.4}, s=4
  aurora_tst_input / _output  the two ablation modes (--tst-mode input/output), s=4, r=0.3

The lr of the block matrices is tuned per optimizer family first, by a small sweep that this
script runs and reports (one seed, no TST, best final val loss wins; if the best is at the edge
of the grid the grid is extended by one factor-2 step, ``--sweep-extend`` times):
``--adamw-lr`` for adamw, ``--matrix-lr`` for muon and for aurora (every aurora+TST arm uses
aurora's). The Adam lrs of the embedding, head and scalars stay at the ``cpu_smoke`` preset
values for every arm. The sweep run at the chosen lr *is* seed 0 of that arm (same flags, so
bit-identical on CPU): it is copied into the arm's folder instead of being trained twice.

Reported, per arm: mean +- sample std over seeds of the final val loss; its difference to the
adamw baseline and to plain aurora, called "no measurable difference" when below twice the
seed-to-seed std (pooled over all arms); the FLOPs and the train time (validation excluded) at
which the arm's seed-mean val curve first reaches the baseline's mean final val loss, as a
ratio to the baseline (linear interpolation between val points; "not reached" if never); the
text tokens read and whether that is more than the corpus (the trainer then wraps around and
repeats data). Written as ``results.md`` (+ ``results.json``) in the output folder together
with one folder of logs per arm (``<out>/<arm>/<arm>_seed<k>.txt`` + ``.json``, the
trainer's own log and summary), the sweep's logs (``<out>/lr_sweep/``) and plots of val loss vs
FLOPs and vs train time drawn by ``records/compare.py`` (or by this script if that fails).

How to run (from the repo root)
-------------------------------
    python bench/small_scale.py --quick   # adamw, aurora, aurora_tst; 2 seeds; short sweep
                                          # -> bench/out/small_scale_quick/   (<= 20 min)
    python bench/small_scale.py           # every arm, full sweep, 2 seeds
                                          # -> records/cpu/<today>_small_scale/  (<= 2 h)

Budget (2-core CPU; torch CPU, float32, no compile; ``--jobs 2`` trainer processes at a time,
each on ``--threads 1``): the full mode trains 4 layers x 128 wide, seq 128, 1024 positions/step,
300 steps for 26 runs (9 sweep + 20 arm runs - 3 reused; up to 3 more if a sweep optimum is at
a grid edge). Two runs side by side take ~7 min each (~1.4 s/step; one run alone on an idle
machine ~1.1 s/step), so the full mode takes ~1.5-1.7 h, more when other jobs load the cores.
The quick mode trains 150 steps x 512 positions for 8 runs (2-value sweeps for adamw and aurora;
adamw, aurora, aurora_tst x 2 seeds): ~7 min. The 1-minute load average at the start and end
of each run goes into results.md.
The glibc malloc settings that keep the CPU step time from doubling
(``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000``) are set for the trainer
subprocesses by this script. Resumable: a run whose JSON says ``complete`` (with the same
run-defining config) is skipped, so rerunning the same command after a crash continues where
it stopped; for a run started on an earlier day pass its folder with ``--out``.
"""
import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}

# Model shape (on top of --preset cpu_smoke, which also sets embed_lr 0.3, head_lr 0.02, no
# momentum warmup). GPT-2's 50304-row head dominates at this width: 6.4M of the 7.2M matmul
# weights, ~44M training FLOPs per position. seq_len 128 = the latent length L in every phase.
MODEL = dict(n_layer=4, n_head=4, model_dim=128, seq_len=128)

# arm name -> (optimizer family whose tuned lr it uses, trainer flags)
ARMS = {
    "adamw": ("adamw", ["--optimizer", "adamw", "--tst-frac", "0"]),
    "muon": ("muon", ["--optimizer", "muon", "--tst-frac", "0"]),
    "aurora": ("aurora", ["--optimizer", "aurora", "--tst-frac", "0"]),
    "aurora_tst": ("aurora", ["--optimizer", "aurora", "--tst-mode", "full", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
    "aurora_tst_s2": ("aurora", ["--optimizer", "aurora", "--tst-mode", "full", "--tst-bag-size", "2", "--tst-frac", "0.3"]),
    "aurora_tst_s8": ("aurora", ["--optimizer", "aurora", "--tst-mode", "full", "--tst-bag-size", "8", "--tst-frac", "0.3"]),
    "aurora_tst_r0.2": ("aurora", ["--optimizer", "aurora", "--tst-mode", "full", "--tst-bag-size", "4", "--tst-frac", "0.2"]),
    "aurora_tst_r0.4": ("aurora", ["--optimizer", "aurora", "--tst-mode", "full", "--tst-bag-size", "4", "--tst-frac", "0.4"]),
    "aurora_tst_input": ("aurora", ["--optimizer", "aurora", "--tst-mode", "input", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
    "aurora_tst_output": ("aurora", ["--optimizer", "aurora", "--tst-mode", "output", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
}
BASELINE, REFERENCE = "adamw", "aurora"  # deltas are given against both

# optimizer family -> (lr flag, the no-TST arm whose seed 0 the sweep run doubles as)
FAMILIES = {"adamw": ("--adamw-lr", "adamw"), "muon": ("--matrix-lr", "muon"), "aurora": ("--matrix-lr", "aurora")}

MODES = {
    "full": dict(
        arms=list(ARMS), seeds=2, steps=300, batch_tokens=1024, val_tokens=16384, val_every=60,
        sweep={"adamw": [0.002, 0.004, 0.008], "muon": [0.025, 0.05, 0.1], "aurora": [0.025, 0.05, 0.1]},
        sweep_extend=1, out=os.path.join("records", "cpu", "{date}_small_scale")),
    "quick": dict(
        arms=["adamw", "aurora", "aurora_tst"], seeds=2, steps=150, batch_tokens=512, val_tokens=4096,
        val_every=50,
        sweep={"adamw": [0.004, 0.008], "aurora": [0.05, 0.1]},
        sweep_extend=0, out=os.path.join("bench", "out", "small_scale_quick")),
}

VAL_RE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms")
FIELD_RE = re.compile(r"(\w+):(\S+)")


# ----------------------------------------------------------------------------------------------
# Running one training run


def trainer_argv(spec, run_dir, run_id, seed, extra):
    """The trainer command line of one run (base flags of the mode, then the arm/lr ``extra``)."""
    seqs = spec["batch_tokens"] // MODEL["seq_len"]  # one micro-batch when <= 16 sequences
    argv = [sys.executable, spec["trainer"], "--preset", "cpu_smoke", "--device", "cpu", "--no-compile", "--no-bf16",
            "--train-files", spec["train_files"], "--val-files", spec["val_files"],
            "--num-iterations", str(spec["steps"]), "--batch-tokens", str(spec["batch_tokens"]),
            "--micro-batch-seqs", str(seqs if seqs <= 16 else 16), "--val-tokens", str(spec["val_tokens"]),
            "--val-every", str(spec["val_every"]), "--log-every", "5", "--seed", str(seed),
            "--log-dir", run_dir, "--run-id", run_id]
    for k, v in MODEL.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv + list(extra) + spec["trainer_args"]


def read_log(path):
    """Parse a trainer log: ``dict(config, val=[{step, val_loss, train_time_ms, flops, tokens}], status)``."""
    out = dict(config=None, val=[], status=None)
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    try:  # step-like text inside the source snapshot must not count: start after the separator
        lines = lines[lines.index("=" * 100) + 1:]
    except ValueError:
        pass
    for ln in lines:
        m = VAL_RE.match(ln)
        if m:
            fields = dict(FIELD_RE.findall(ln))
            point = dict(step=int(m[1]), val_loss=float(m[3]), train_time_ms=float(m[4]),
                         flops=float(fields.get("flops", "nan")), tokens=int(fields.get("tokens", "0")))
            out["val"] = [p for p in out["val"] if p["step"] < point["step"]] + [point]
        elif ln.startswith("config: {"):
            out["config"] = json.loads(ln[len("config: "):])
        elif ln.startswith("status:"):
            out["status"] = ln[len("status:"):].split()[0]
    return out


def expected_config(argv):
    """The resolved trainer config of a command line, for the resume check.

    Parsed by the working tree's ``train_gpt.parse_config`` (a snapshot with other defaults
    then looks changed, and its runs are retrained: the safe side).
    """
    train_gpt = trainer_module()
    cfg, _ = train_gpt.parse_config(argv[2:])
    keys = list(train_gpt.RUN_DEFINING) + ["train_files", "val_files", "val_every"]
    return {k: getattr(cfg, k) for k in keys}


def is_done(run_dir, run_id, argv):
    """True if ``<run_dir>/<run_id>.json`` says complete and its log was made with the same config."""
    js = os.path.join(run_dir, run_id + ".json")
    if not os.path.exists(js):
        return False
    with open(js, encoding="utf-8") as f:
        if json.load(f).get("status") != "complete":
            return False
    logged = read_log(os.path.join(run_dir, run_id + ".txt"))["config"] or {}
    diff = {k: (logged.get(k), v) for k, v in expected_config(argv).items() if logged.get(k, v) != v}
    if diff:
        print(f"  {run_id}: complete but made with other flags {diff}; training it again", flush=True)
    return not diff


def train(argv, run_dir, run_id, ledger):
    """Train one run as a subprocess unless already done; return its JSON summary (+ parsed log).

    Progress (val lines) is echoed; on failure the trainer's last stderr lines are printed and
    the summary says ``status`` != ``complete``. ``ledger`` collects wall times of runs trained now.
    """
    os.makedirs(run_dir, exist_ok=True)
    js = os.path.join(run_dir, run_id + ".json")
    if is_done(run_dir, run_id, argv):
        print(f"  {run_id}: complete, skipped", flush=True)
    else:
        set_aside(run_dir, run_id)
        env = dict(os.environ, **MALLOC_ENV)
        if ledger.get("threads"):
            env["OMP_NUM_THREADS"] = str(ledger["threads"])
        print(f"  {run_id}: training ... ({shlex.join(argv)})" if ledger.get("verbose")
              else f"  {run_id}: training ...", flush=True)
        t0, load0 = time.time(), load_average()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, bufsize=1)
        for ln in proc.stdout:
            if " val_loss:" in ln:
                print("    " + ln.rstrip()[:110], flush=True)
        err = proc.stderr.read()
        rc = proc.wait()
        wall = time.time() - t0
        load1 = load_average()
        record_timing(ledger, dict(run=os.path.relpath(os.path.join(run_dir, run_id), ledger["out"]), wall_s=round(wall, 1),
                                   load_start=load0, load_end=load1, exit=rc,
                                   finished=datetime.datetime.now().isoformat(timespec="seconds")))
        print(f"  {run_id}: exit {rc}, {wall:.0f}s wall (1-min load average {load0:.1f} -> {load1:.1f})",
              flush=True)
        if rc != 0:
            print("    " + "\n    ".join(err.strip().splitlines()[-5:]), flush=True)
    summary = dict(status="missing")
    if os.path.exists(js):
        with open(js, encoding="utf-8") as f:
            summary = json.load(f)
    summary["log"] = read_log(os.path.join(run_dir, run_id + ".txt"))
    summary["argv"] = argv
    return summary


def record_timing(ledger, entry):
    """Append one trained run's wall time and load to ``<out>/timing.json`` (kept across invocations)."""
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
    """Copy train_gpt.py and aurora_opt.py to ``<out>/code/`` once and train every run from there.

    Other people edit the trainer while a benchmark runs for hours; the snapshot keeps every run
    of one output folder on the same code (each log still holds its full source). A resumed
    benchmark keeps using the snapshot it started with; delete ``<out>/code/`` to take the
    current code (the resume check then retrains runs whose run-defining config changed).
    """
    code = os.path.join(out, "code")
    if not os.path.exists(os.path.join(code, "train_gpt.py")):
        os.makedirs(code, exist_ok=True)
        for name in ("aurora_opt.py", "train_gpt.py"):
            shutil.copyfile(os.path.join(REPO, name), os.path.join(code, name))
        print(f"trainer snapshot: {code}", flush=True)
    else:
        print(f"trainer snapshot: {code} (from an earlier invocation; delete it to use the current code)", flush=True)
    with open(os.path.join(code, "train_gpt.py"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return os.path.join(code, "train_gpt.py"), digest


def copy_run(src_dir, src_id, dst_dir, dst_id):
    """Copy a finished run's log and JSON under another name (the sweep run reused as seed 0)."""
    os.makedirs(dst_dir, exist_ok=True)
    for ext in (".txt", ".json"):
        shutil.copyfile(os.path.join(src_dir, src_id + ext), os.path.join(dst_dir, dst_id + ext))


# ----------------------------------------------------------------------------------------------
# LR sweep


def fmt_lr(lr):
    return f"{lr:.6g}"


def run_all(jobs, ledger):
    """Train ``jobs`` (a list of ``(argv, run_dir, run_id)``) ``ledger['jobs']`` at a time; summaries in order."""
    if ledger.get("jobs", 1) <= 1 or len(jobs) <= 1:
        return [train(*j, ledger) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=ledger["jobs"]) as pool:
        return list(pool.map(lambda j: train(*j, ledger), jobs))


def lr_sweep(spec, out, ledger):
    """Per family: train the grid (seed 0, no TST), extend past an edge optimum, pick the best.

    Every family's grid is trained first (``--jobs`` runs at a time), then the extensions, one
    round per ``sweep_extend``. Returns ``{family: dict(flag, chosen, rows=[(lr, final val loss or
    None, train_time_ms)], edge)}``.
    """
    sweep_dir = os.path.join(out, "lr_sweep")
    fams = [f for f in spec["sweep"] if any(ARMS[a][0] == f for a in spec["arms"])]
    rows = {fam: {} for fam in fams}

    def job(fam, lr):
        flag, arm = FAMILIES[fam]
        rid = f"{fam}_lr{fmt_lr(lr)}_seed0"
        return trainer_argv(spec, sweep_dir, rid, 0, ARMS[arm][1] + [flag, fmt_lr(lr)]), sweep_dir, rid

    def run(pairs):
        jobs = [job(f, lr) for f, lr in pairs]
        for (fam, lr), (_, _, rid), s in zip(pairs, jobs, run_all(jobs, ledger)):
            ok = s.get("status") == "complete" and math.isfinite(s.get("final_val_loss", math.nan))
            rows[fam][lr] = (s["final_val_loss"] if ok else None, s.get("train_time_ms"), rid)

    def best_of(fam):
        lrs = sorted(rows[fam])
        return lrs, min(lrs, key=lambda x: rows[fam][x][0] if rows[fam][x][0] is not None else math.inf)

    for fam in fams:
        print(f"lr sweep {fam} ({FAMILIES[fam][0]}): {', '.join(map(fmt_lr, spec['sweep'][fam]))}", flush=True)
    run([(fam, lr) for fam in fams for lr in spec["sweep"][fam]])
    for _ in range(spec["sweep_extend"]):
        more = []
        for fam in fams:
            lrs, best = best_of(fam)
            if rows[fam][best][0] is not None and best in (lrs[0], lrs[-1]):
                more.append((fam, best / 2 if best == lrs[0] else best * 2))
                print(f"  best {fam} lr {fmt_lr(best)} is at the edge of the grid: also trying "
                      f"{fmt_lr(more[-1][1])}", flush=True)
        if not more:
            break
        run(more)
    result = {}
    for fam in fams:
        lrs, best = best_of(fam)
        if rows[fam][best][0] is None:
            raise SystemExit(f"lr sweep {fam}: every run failed; see the logs in {sweep_dir}")
        flag = FAMILIES[fam][0]
        result[fam] = dict(flag=flag, chosen=best, edge=best in (lrs[0], lrs[-1]) and len(lrs) > 1,
                           rows=[(lr,) + rows[fam][lr] for lr in lrs])
        print(f"  -> {fam}: {flag} {fmt_lr(best)} (final val loss {rows[fam][best][0]:.4f})", flush=True)
    return result


# ----------------------------------------------------------------------------------------------
# Analysis


def crossing(xs, ys, target):
    """First x where the piecewise-linear curve (xs, ys) reaches ``target`` or below; None if never."""
    if len(ys) and ys[0] <= target:
        return xs[0]
    for i in range(1, len(ys)):
        if ys[i] <= target:
            return xs[i - 1] + (ys[i - 1] - target) / (ys[i - 1] - ys[i]) * (xs[i] - xs[i - 1])
    return None


def arm_stats(runs):
    """Seed statistics and the seed-mean val curve of one arm's complete runs."""
    done = [r for r in runs if r.get("status") == "complete" and r["log"]["val"]]
    out = dict(n=len(done), n_runs=len(runs), finals=[r["final_val_loss"] for r in done])
    if not done:
        return out
    out["mean"] = float(np.mean(out["finals"]))
    out["std"] = float(np.std(out["finals"], ddof=1)) if len(done) > 1 else math.nan
    steps = [p["step"] for p in done[0]["log"]["val"]]
    same = all([p["step"] for p in r["log"]["val"]] == steps for r in done)
    curves = [r["log"]["val"] for r in done] if same else [done[0]["log"]["val"]]
    out["curve"] = dict(step=steps,
                        loss=np.mean([[p["val_loss"] for p in c] for c in curves], axis=0).tolist(),
                        flops=np.mean([[p["flops"] for p in c] for c in curves], axis=0).tolist(),
                        time_ms=np.mean([[p["train_time_ms"] for p in c] for c in curves], axis=0).tolist())
    out["train_time_ms"] = float(np.mean([r["train_time_ms"] for r in done]))
    out["flops"] = float(np.mean([r["flops"] for r in done]))
    out["raw_tokens"] = int(np.mean([r["raw_tokens"] for r in done]))
    out["seed_curves"] = [([p["step"] for p in r["log"]["val"]], [p["val_loss"] for p in r["log"]["val"]])
                          for r in done]
    return out


def corpus_tokens(pattern, flag):
    """Tokens in the shards of a glob (validated by the trainer's own header check); SystemExit naming ``flag``."""
    import glob
    tg = trainer_module()
    files = sorted(glob.glob(pattern if os.path.isabs(pattern) else os.path.join(REPO, pattern)))
    if not files:
        raise SystemExit(f"{flag} {pattern!r}: no shard found (relative to {REPO}); check the glob")
    try:
        return sum(tg.read_shard_header(f) for f in files)
    except tg.DataError as e:
        raise SystemExit(f"{flag}: {e}") from None


def trainer_module():
    """The working tree's train_gpt, imported once (its config parser and shard check)."""
    if "train_gpt" not in sys.modules:
        sys.path.insert(0, REPO)
    import train_gpt
    return train_gpt


def parse_list(text, flag, kind):
    """A non-empty comma list without repeats; floats must be finite and > 0. SystemExit naming ``flag``."""
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise SystemExit(f"{flag} {text!r}: give a comma list without empty items, e.g. "
                         + ("adamw,aurora" if kind is str else "0.002,0.004"))
    if len(set(words)) != len(words):
        raise SystemExit(f"{flag} {text!r}: an item is repeated")
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
    """Parse every planned trainer command with the trainer's own parser before anything runs.

    A bad value (e.g. from ``--trainer-args``) stops here with the trainer's one-line message
    instead of failing every run of a sweep one by one.
    """
    import io
    tg = trainer_module()
    spec = dict(spec, trainer=os.path.join(REPO, "train_gpt.py"))
    for arm in spec["arms"]:
        fam, flags = ARMS[arm]
        for lr in spec["sweep"][fam]:
            argv = trainer_argv(spec, "/nonexistent", "check", 0, flags + [FAMILIES[fam][0], fmt_lr(lr)])
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    tg.parse_config(argv[2:])
            except (tg.ConfigError, SystemExit) as e:
                msg = str(e) if isinstance(e, tg.ConfigError) else err.getvalue().strip().splitlines()[-1]
                raise SystemExit(f"arm {arm} (lr {fmt_lr(lr)}): the trainer rejects its command: {msg} "
                                 "(set by this script's flags or --trainer-args)") from None


def analyse(stats, corpus):
    """Add deltas, verdicts, time/FLOPs-to-baseline ratios and data repetition to each arm's stats."""
    base = stats.get(BASELINE, {})
    variances = [s["std"] ** 2 for s in stats.values() if s.get("n", 0) > 1]
    dofs = [s["n"] - 1 for s in stats.values() if s.get("n", 0) > 1]
    pooled = math.sqrt(sum(v * d for v, d in zip(variances, dofs)) / sum(dofs)) if dofs else math.nan
    noise = dict(pooled_std=pooled, dof=sum(dofs), max_std=max((math.sqrt(v) for v in variances), default=math.nan),
                 threshold=2 * pooled)
    target = base.get("mean")
    for name, s in stats.items():
        if not s.get("n"):
            continue
        for ref in (BASELINE, REFERENCE):
            r = stats.get(ref, {})
            if r.get("n") and name != ref:
                d = s["mean"] - r["mean"]
                word = ("no measurable difference" if not abs(d) >= noise["threshold"]
                        else "better" if d < 0 else "worse")
                s[f"delta_{ref}"] = (d, word)
        if target is not None and base.get("n"):
            c = s["curve"]
            f_hit = crossing(c["flops"], c["loss"], target)
            t_hit = crossing(c["time_ms"], c["loss"], target)
            s["flops_to_base"] = None if f_hit is None else f_hit / base["curve"]["flops"][-1]
            s["time_to_base"] = None if t_hit is None else t_hit / base["curve"]["time_ms"][-1]
            s["seeds_reaching_base"] = sum(crossing(st, ls, target) is not None for st, ls in s["seed_curves"])
        s["epochs"] = s["raw_tokens"] / corpus if corpus else math.nan
    return noise


# ----------------------------------------------------------------------------------------------
# Report


def fmt_ratio(x):
    return "not reached" if x is None else f"{x:.2f}x"


def fmt_delta(v):
    if v is None:
        return "-"
    d, word = v
    return f"{d:+.4f} ({'n.m.d.' if word.startswith('no') else word})"


def report(spec, sweep, stats, noise, corpus, timing, plots, compare_text):
    """The markdown of results.md (printed too)."""
    base = stats.get(BASELINE, {})
    shape = (f"{MODEL['n_layer']} layers x {MODEL['model_dim']} wide ({MODEL['n_head']} heads), seq_len "
             f"{MODEL['seq_len']}, vocab 50304 (GPT-2), {spec['batch_tokens']} positions/step, {spec['steps']} steps")
    L = [f"# Small-scale equal-FLOP benchmark: TST and Aurora on real text ({spec['mode']} mode)", ""]
    if spec["mode"] == "quick":
        L += ["**Quick mode checks the pipeline; its runs are far too short (and its val set too small) "
              "to be evidence for or against any method. The full mode is the benchmark.**", ""]
    L += [
         f"Made by `{spec['command']}` on {spec['date']}: {spec['machine']}. Trainer: `code/train_gpt.py` "
         f"(snapshot of the repo's at the start, sha256 {spec['trainer_sha256']}..., not kept in git: every "
         "log holds its source, `python records/verify.py LOG --extract DIR` writes it out).", "",
         f"* Model: {shape}; every arm the same steps and FLOPs per step "
         f"({base.get('flops', math.nan) / max(spec['steps'], 1):.3g} FLOPs/step, "
         f"{base.get('flops', math.nan):.3g} in all); `--preset cpu_smoke` otherwise: lr flat, then linear decay "
         f"to 0 over the last 40% of steps, no warmup; float32, no compile.",
         f"* Data: `{spec['train_files']}` ({corpus:,} train tokens), val loss on the first "
         f"{spec['val_tokens']:,} tokens of `{spec['val_files']}`, every {spec['val_every']} steps.",
         "* lr: block-matrix lr tuned per optimizer family by the sweep below (seed 0, no TST); "
         "the Adam lrs of embedding (0.3), head (0.02) and scalars (0.04) are the `cpu_smoke` preset's, "
         "unchanged in every arm. TST arms use aurora's tuned `--matrix-lr`.",
         f"* Noise: seed-to-seed std of the final val loss, pooled over arms: **{noise['pooled_std']:.4f}** "
         f"({noise['dof']} dof; largest single-arm std {noise['max_std']:.4f}). A difference below "
         f"2 x pooled std = {noise['threshold']:.4f} is called *no measurable difference* (n.m.d.).",
         f"* \"to adamw loss\": FLOPs and train time (validation excluded) at which the arm's seed-mean val "
         f"curve first reaches the adamw baseline's mean final val loss ({base.get('mean', math.nan):.4f}), as a "
         f"ratio to the baseline's (linear interpolation between val points; < 1 = faster).", "",
         "| arm | settings | final val loss (mean ± std, n) | Δ vs adamw | Δ vs aurora | FLOPs to adamw loss "
         "| train time to adamw loss | train time (full run) | text tokens read | repeats data |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for name in spec["arms"]:
        s = stats.get(name, {})
        fam, flags = ARMS[name]
        lr = sweep.get(fam)
        settings = " ".join(flags).replace("--optimizer ", "").replace("--", "")
        if lr:
            settings += f" {lr['flag'][2:]} {fmt_lr(lr['chosen'])}"
        if not s.get("n"):
            L.append(f"| {name} | {settings} | no complete run ({s.get('n_runs', 0)} tried) | | | | | | | |")
            continue
        std = "n/a" if math.isnan(s["std"]) else f"{s['std']:.4f}"
        rep = "yes ({:.2f} epochs)".format(s["epochs"]) if s["epochs"] > 1 else "no ({:.2f} epochs)".format(s["epochs"])
        L.append(f"| {name} | {settings} | {s['mean']:.4f} ± {std} (n={s['n']}) | "
                 f"{fmt_delta(s.get('delta_' + BASELINE)) if name != BASELINE else '—'} | "
                 f"{fmt_delta(s.get('delta_' + REFERENCE)) if name != REFERENCE else '—'} | "
                 f"{fmt_ratio(s.get('flops_to_base'))} ({s.get('seeds_reaching_base', 0)}/{s['n']} seeds) | "
                 f"{fmt_ratio(s.get('time_to_base'))} | "
                 f"{s['train_time_ms'] / 1000:.0f} s | {s['raw_tokens']:,} | {rep} |")
    steps = next((stats[n]["curve"]["step"] for n in spec["arms"] if stats.get(n, {}).get("n")), [])
    L += ["", "Seed-mean val loss at each val point (step):", "",
          "| arm | " + " | ".join(str(x) for x in steps) + " |", "|---|" + "---|" * len(steps)]
    for name in spec["arms"]:
        c = stats.get(name, {}).get("curve")
        if c and c["step"] == steps:
            L.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in c["loss"]) + " |")
    L += ["", "Per-seed final val losses: " + "; ".join(
        f"{n}: " + ", ".join(f"{x:.4f}" for x in stats[n]["finals"]) for n in spec["arms"] if stats.get(n, {}).get("n")), ""]
    L += ["## LR sweep (seed 0, no TST, final val loss; chosen = lowest)", "",
          "| family | flag | lr | final val loss | train time | |", "|---|---|---|---|---|---|"]
    for fam, sw in sweep.items():
        for lr, loss, t, rid in sw["rows"]:
            mark = "**chosen**" + (" (edge of grid)" if sw["edge"] else "") if lr == sw["chosen"] else ""
            L.append(f"| {fam} | `{sw['flag']}` | {fmt_lr(lr)} | {'failed' if loss is None else f'{loss:.4f}'} | "
                     f"{'-' if t is None else f'{t / 1000:.0f} s'} | {mark} |")
    reused = [FAMILIES[f][1] for f in sweep if FAMILIES[f][1] in spec["arms"]]
    if reused:
        L += ["", f"Seed 0 of {', '.join(reused)} is the sweep run at the chosen lr (same flags; its log, "
                  "copied from `lr_sweep/`, keeps the sweep's run id)."]
    L += ["", "## Plots", ""] + [f"* `{os.path.basename(p)}`: {what}" for p, what in plots]
    tr, inv = timing["runs"], timing["invocations"]
    loads = [max(r["load_start"], r["load_end"]) for r in tr]
    L += ["", "## Timing (from `timing.json`, all invocations on this folder)", "",
          f"* {len(tr)} runs trained, {sum(r['wall_s'] for r in tr) / 60:.1f} min of trainer wall time "
          f"(incl. startup and val), mean {np.mean([r['wall_s'] for r in tr]) if tr else math.nan:.0f} s per run; "
          f"{len(inv)} invocation(s) of this script, {sum(i['wall_s'] for i in inv) / 60:.1f} min in all "
          f"(the last: {inv[-1]['wall_s'] / 60:.1f} min).",
          f"* 1-min load average at the start/end of the runs: median {np.median(loads) if loads else math.nan:.1f}, "
          f"max {max(loads, default=math.nan):.1f}; {sum(x > 2.5 for x in loads)} of {len(tr)} runs saw > 2.5 "
          "(other jobs on the 2 cores slow a run down: train times, and so the train-time ratios, carry that "
          "noise; the FLOPs ratios do not)."]
    if compare_text:
        L += ["", "## `records/compare.py` on the arm folders", "", "```", compare_text.rstrip(), "```"]
    return "\n".join(L) + "\n"


def own_plot(stats, arms, path, x, target):
    """Fallback plot (matplotlib) of every arm's seed-mean val curve, when compare.py is unavailable."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    key, label = dict(flops=("flops", "training FLOPs"), time=("time_ms", "train time (ms)"))[x]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=110)
    lo, hi = math.inf, -math.inf
    for name in arms:
        c = stats.get(name, {}).get("curve")
        if c:
            ax.plot(c[key], c["loss"], marker="o", ms=3, label=name)
            lo, hi = min(lo, min(c["loss"])), max(hi, c["loss"][1] if len(c["loss"]) > 1 else c["loss"][0])
    if target:
        ax.axhline(target, color="black", ls="--", lw=1, label=f"adamw mean final {target:.4f}")
    if math.isfinite(lo):
        ax.set_ylim(lo - 0.05, hi + 0.05)
    ax.set_xlabel(label)
    ax.set_ylabel("val loss (seed mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def make_plots(out, arms, stats, target):
    """val loss vs FLOPs and vs train time via records/compare.py (one arm folder = one group)."""
    plots, compare_text = [], ""
    folders = [os.path.join(out, a) for a in arms if stats.get(a, {}).get("n")]
    tool = os.path.join(REPO, "records", "compare.py")
    for x in ("flops", "time"):
        path = os.path.join(out, f"val_loss_vs_{x}.png")
        what = f"val loss vs {'training FLOPs' if x == 'flops' else 'train time'}, every run"
        ok = False
        if os.path.exists(tool) and folders:
            cmd = [sys.executable, tool, *folders, "--plot", path, "--x", x]
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
            what += " (records/compare.py; dashed line: adamw mean final loss)"
        else:
            own_plot(stats, arms, path, x, target)
            what += " (seed means, drawn by small_scale.py: records/compare.py was unavailable or failed)"
        plots.append((path, what))
    return plots, compare_text


# ----------------------------------------------------------------------------------------------
# Main


def machine_line():
    import platform
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "?"
    return f"{os.cpu_count()}-core CPU ({cpu or platform.machine()}), torch {tv}, Python {platform.python_version()}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--quick", action="store_true", help="the <= 20 min subset (3 arms, short sweep, smaller runs)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: 2)")
    ap.add_argument("--arms", default=None, help=f"comma list of arms (default: the mode's); from {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the mode's)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="latent positions per step (default: the mode's)")
    ap.add_argument("--val-tokens", type=int, default=None, help="val tokens per eval (default: the mode's)")
    ap.add_argument("--val-every", type=int, default=None, help="val every this many steps (default: the mode's)")
    ap.add_argument("--adamw-lrs", default=None, help="comma list: the adamw sweep grid of --adamw-lr")
    ap.add_argument("--muon-lrs", default=None, help="comma list: the muon sweep grid of --matrix-lr")
    ap.add_argument("--aurora-lrs", default=None, help="comma list: the aurora sweep grid of --matrix-lr")
    ap.add_argument("--sweep-extend", type=int, default=None,
                    help="extend the grid by a factor 2 past an edge optimum at most this many times")
    ap.add_argument("--train-files", default="../shared/data/realtext/*_train_*.bin", help="train shards (glob)")
    ap.add_argument("--val-files", default="../shared/data/realtext/*_val_*.bin", help="val shards (glob)")
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
    ap.add_argument("--dry-run", action="store_true", help="print the run plan and the commands, train nothing")
    ap.add_argument("--verbose", action="store_true", help="print every trainer command line")
    return ap.parse_args(argv)


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    spec = dict(MODES[mode], mode=mode)
    date = datetime.date.today().isoformat()
    for k in ("seeds", "steps", "batch_tokens", "val_tokens", "val_every", "sweep_extend"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    spec["arms"] = parse_list(args.arms, "--arms", str) if args.arms is not None else spec["arms"]
    bad = [a for a in spec["arms"] if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    spec["sweep"] = dict(spec["sweep"])
    for fam in FAMILIES:
        given = getattr(args, f"{fam}_lrs")
        if given is not None:
            spec["sweep"][fam] = parse_list(given, f"--{fam}-lrs", float)
        elif fam not in spec["sweep"] and any(ARMS[a][0] == fam for a in spec["arms"]):
            spec["sweep"][fam] = MODES["full"]["sweep"][fam]
    for flag, key, low in (("--seeds", "seeds", 1), ("--steps", "steps", 1), ("--batch-tokens", "batch_tokens", 1),
                           ("--val-tokens", "val_tokens", 1), ("--val-every", "val_every", 1),
                           ("--sweep-extend", "sweep_extend", 0)):
        if spec[key] < low:
            raise SystemExit(f"{flag} must be >= {low} (got {spec[key]})")
    if args.jobs < 1 or args.threads < 0:
        raise SystemExit(f"--jobs must be >= 1 and --threads >= 0 (got --jobs {args.jobs}, --threads {args.threads})")
    seqs = spec["batch_tokens"] // MODEL["seq_len"]
    if spec["batch_tokens"] % MODEL["seq_len"] or (seqs > 16 and seqs % 16):
        raise SystemExit(f"--batch-tokens must be a multiple of seq_len {MODEL['seq_len']} "
                         f"(and of 16 x {MODEL['seq_len']} above 16 sequences)")
    try:
        trainer_args = shlex.split(args.trainer_args)
    except ValueError as e:
        raise SystemExit(f"--trainer-args {args.trainer_args!r}: {e}; quote it as one shell word") from None
    spec.update(train_files=args.train_files, val_files=args.val_files, date=date,
                machine=machine_line() + (f", trainer on {args.threads} thread(s)" if args.threads else "")
                + (f", {args.jobs} runs at a time" if args.jobs > 1 else ""),
                trainer_args=trainer_args,
                command="python bench/small_scale.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    out = args.out or spec["out"].format(date=date)
    out = out if os.path.isabs(out) else os.path.join(REPO, out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"--out {out}: exists and is not a folder; name a folder")
    corpus = corpus_tokens(spec["train_files"], "--train-files")
    corpus_tokens(spec["val_files"], "--val-files")
    check_commands(spec)
    n_sweep = sum(len(v) for f, v in spec["sweep"].items() if any(ARMS[a][0] == f for a in spec["arms"]))
    n_arm = len(spec["arms"]) * spec["seeds"] - sum(1 for f in spec["sweep"] if FAMILIES[f][1] in spec["arms"])
    print(f"small_scale ({mode}): {len(spec['arms'])} arms x {spec['seeds']} seeds, {spec['steps']} steps x "
          f"{spec['batch_tokens']} positions; {n_sweep} sweep runs + {n_arm} arm runs (+ sweep extensions); "
          f"output {out}", flush=True)
    if args.dry_run:  # creates nothing: a later real run must snapshot the code of its own time
        spec["trainer"] = os.path.join(REPO, "train_gpt.py")
        for a in spec["arms"]:
            print(shlex.join(trainer_argv(spec, os.path.join(out, a), f"{a}_seed0", 0, ARMS[a][1] + ["<lr>"])))
        return 0
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot create it ({e.strerror}); name a writable folder") from None
    spec["trainer"], spec["trainer_sha256"] = snapshot_trainer(out)
    ledger = dict(verbose=args.verbose, threads=args.threads, out=out, jobs=args.jobs, lock=threading.Lock())

    sweep = lr_sweep(spec, out, ledger)
    jobs, owner = [], []
    for name in spec["arms"]:
        fam, flags = ARMS[name]
        lr = sweep[fam]
        print(f"arm {name}: {' '.join(flags)} {lr['flag']} {fmt_lr(lr['chosen'])}", flush=True)
        arm_dir = os.path.join(out, name)
        for seed in range(spec["seeds"]):
            rid = f"{name}_seed{seed}"
            argv_ = trainer_argv(spec, arm_dir, rid, seed, flags + [lr["flag"], fmt_lr(lr["chosen"])])
            if seed == 0 and FAMILIES[fam][1] == name and not is_done(arm_dir, rid, argv_):
                src = next(r[3] for r in lr["rows"] if r[0] == lr["chosen"])
                copy_run(os.path.join(out, "lr_sweep"), src, arm_dir, rid)
                print(f"  {rid}: = lr_sweep/{src} (same flags), copied", flush=True)
            jobs.append((argv_, arm_dir, rid))
            owner.append(name)
    runs = {name: [] for name in spec["arms"]}
    for name, summary in zip(owner, run_all(jobs, ledger)):
        runs[name].append(summary)

    stats = {name: arm_stats(rs) for name, rs in runs.items()}
    noise = analyse(stats, corpus)
    target = stats.get(BASELINE, {}).get("mean")
    plots, compare_text = make_plots(out, spec["arms"], stats, target)
    timing = record_timing(ledger, dict(invocation=dict(
        started=datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
        wall_s=round(time.time() - t_start, 1), command=spec["command"])))
    md = report(spec, sweep, stats, noise, corpus, timing, plots, compare_text)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    strip = lambda s: {k: v for k, v in s.items() if k not in ("argv",)}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(spec=spec, model=MODEL, corpus_tokens=corpus, noise=noise, sweep=sweep,
                       arms={k: strip(v) for k, v in stats.items()}, timing=timing), f, indent=1, default=str)
    print("\n" + md)
    print(f"results: {os.path.join(out, 'results.md')}; this invocation {(time.time() - t_start) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
