"""Does it work? Paired equal-FLOP evidence for TST and Aurora at small scale, over data orders and seeds.

A small GPT (``cpu_smoke_r21``: record #21's recipe at a tiny shape) is trained on a real-text
corpus (default ``data/sample``) once
per *arm* (an optimizer and TST setting: adamw, muon, aurora, aurora_tst, their variants, the
equal-text control aurora_eqtext, architecture ablations), *data order* (``--orders`` shuffled
mixes written by ``bench/small_scale_data.py``) and *init seed* (``--seeds``), every arm at the
same FLOPs per step. Block-matrix lrs are tuned per optimizer family by a small sweep first.
Comparisons are paired per (order, seed) (``bench/small_scale_stats.py``): mean difference of
final val losses, 95% t-interval, paired t-test p; a recency check compares document-ordered
with mixed data. Output: ``results.md``/``results.json``, logs per arm, plots.

    python bench/small_scale.py --quick   # pipeline check, ~4 min -> bench/out/small_scale_quick/
    python bench/small_scale.py           # every arm, 3 orders x 2 seeds (~95 min on 2 idle cores)

It prints its plan and time estimate before running, and resumes after a crash (a complete run
is skipped). The detail (arms, orders, the equal-text control, the recency check, the sweep,
the budget): docs/SMALL_SCALE.md.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from _paths import BENCH, RECORDS, REPO, use  # noqa: E402
use(RECORDS, BENCH)  # records/compare.py and bench's modules, by name
import compare  # noqa: E402  (records/compare.py: the reader of trainer logs, defined once)
import harness  # noqa: E402  (its SOURCE_FILES: what a log snapshots)
import shard_format  # noqa: E402  (data/shard_format.py)
import small_scale_data  # noqa: E402
import small_scale_stats as sst  # noqa: E402

SAMPLE = os.path.join("data", "sample")  # the repository's real-text sample: the default corpus

# Model shape (on top of --preset cpu_smoke_r21: embed_lr 0.3, head_lr 0.02, no momentum warmup).
# GPT-2's 50304-row head dominates at this width (3.2M of the 3.6M matmul weights); 64 wide keeps
# ~70 runs with whole-val evals inside 2 hours on 2 cores. seq_len 128 = the latent length L.
MODEL = dict(n_layer=4, n_head=2, model_dim=64, seq_len=128)

_TST = ["--optimizer", "aurora", "--tst-mode"]
# arm name -> (optimizer family whose tuned lr it uses, trainer flags)
ARMS = {
    "adamw": ("adamw", ["--optimizer", "adamw", "--tst-frac", "0"]),
    "muon": ("muon", ["--optimizer", "muon", "--tst-frac", "0"]),
    "aurora": ("aurora", ["--optimizer", "aurora", "--tst-frac", "0"]),
    "aurora_tst": ("aurora", _TST + ["full", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
    "aurora_tst_s2": ("aurora", _TST + ["full", "--tst-bag-size", "2", "--tst-frac", "0.3"]),
    "aurora_tst_s8": ("aurora", _TST + ["full", "--tst-bag-size", "8", "--tst-frac", "0.3"]),
    "aurora_tst_r0.2": ("aurora", _TST + ["full", "--tst-bag-size", "4", "--tst-frac", "0.2"]),
    "aurora_tst_r0.4": ("aurora", _TST + ["full", "--tst-bag-size", "4", "--tst-frac", "0.4"]),
    "aurora_tst_input": ("aurora", _TST + ["input", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
    "aurora_tst_output": ("aurora", _TST + ["output", "--tst-bag-size", "4", "--tst-frac", "0.3"]),
    "aurora_eqtext": ("aurora", ["--optimizer", "aurora", "--tst-frac", "0"]),
    "aurora_plain": ("aurora", ["--optimizer", "aurora", "--tst-frac", "0", "--no-doc-mask", "--window", "0",
                                "--window-start", "0", "--short-window-layers", "", "--no-attn-layers", "",
                                "--value-embeds", "0", "--no-unet", "--no-x0-mix", "--no-merged-qkv",
                                "--attn-scale", "0", "--logit-softcap", "30", "--lr-floor", "0"]),
}
# Ablations of record #21's architecture: aurora with one element set back to the old architecture's
# value, paired with aurora (all on). Merged QKV is left out: it computes the same function (tested).
_AURORA = ["--optimizer", "aurora", "--tst-frac", "0"]
ABLATIONS = {
    "aurora_no_value_embeds": ["--value-embeds", "0"],
    "aurora_no_unet": ["--no-unet"],
    "aurora_no_x0_mix": ["--no-x0-mix"],
    "aurora_softcap30": ["--logit-softcap", "30"],
    "aurora_no_doc_mask": ["--no-doc-mask"],
    "aurora_no_window": ["--window", "0", "--window-start", "0", "--short-window-layers", ""],
    "aurora_no_attn_scale": ["--attn-scale", "0"],
    "aurora_no_lr_floor": ["--lr-floor", "0"],
}
ARMS.update({arm: ("aurora", _AURORA + flags) for arm, flags in ABLATIONS.items()})


def _model89_flags():
    """Record #89's model (train_gpt's MODEL89 with cpu_smoke's 4-layer roles, SMOKE_MODEL89) as flags on
    this benchmark's base, its width and heads kept (MODEL): the model arm against record #21's."""
    import train_gpt
    flags = []
    for key, value in {**train_gpt.MODEL89, **train_gpt.SMOKE_MODEL89}.items():
        if key in MODEL:
            continue
        name = "--" + key.replace("_", "-")
        flags += ([name] if value else ["--no-" + name[2:]]) if isinstance(value, bool) else [name, str(value)]
    return flags


ARMS["aurora_model89"] = ("aurora", _AURORA + _model89_flags())
# equal-text control -> the TST arm whose phase-1 text (s * batch per step for round(r * N) steps) it reads
EQTEXT = {"aurora_eqtext": "aurora_tst"}
TST_VARIANTS = ["aurora_tst_s2", "aurora_tst_s8", "aurora_tst_r0.2", "aurora_tst_r0.4", "aurora_tst_input",
                "aurora_tst_output"]
# (arm a, arm b, at): paired a - b per (order, seed). "final": the two final val losses; "flops": a's
# final val loss against b's val loss at a's total FLOPs (interpolated on b's val curve)
COMPARISONS = ([("aurora", "adamw", "final"), ("muon", "adamw", "final"), ("aurora", "muon", "final"),
                ("aurora_tst", "aurora", "final")]
               + [(v, "aurora", "final") for v in TST_VARIANTS] + [(v, "aurora_tst", "final") for v in TST_VARIANTS]
               + [("aurora_eqtext", "aurora", "final"), ("aurora_tst", "aurora_eqtext", "final"),
                  ("aurora_tst", "aurora_eqtext", "flops"), ("aurora", "aurora_plain", "final"),
                  ("aurora_model89", "aurora", "final")]
               + [("aurora", arm, "final") for arm in ABLATIONS])
BASELINE = "adamw"

# optimizer family -> (lr flag, the no-TST arm whose (order 0, seed 0) run the sweep run doubles as)
FAMILIES = {"adamw": ("--adamw-lr", "adamw"), "muon": ("--matrix-lr", "muon"), "aurora": ("--matrix-lr", "aurora")}

MODES = {
    "full": dict(
        # 6 arms x 3 orders x 2 seeds at 256 positions per step: about 95 min on 2 idle cores (COST); the
        # TST variants (s, r, modes), ~68 min more, with --arms
        arms=["adamw", "muon", "aurora", "aurora_tst", "aurora_eqtext", "aurora_plain"], orders=3, seeds=2,
        steps=300, batch_tokens=256, val_tokens=None, val_every=None,
        sweep={"adamw": [0.002, 0.004, 0.008], "muon": [0.00625, 0.0125, 0.025], "aurora": [0.00625, 0.0125, 0.025]},
        sweep_extend=0, recency_arm="adamw", out=os.path.join("records", "cpu", "{date}_small_scale")),
    "quick": dict(
        arms=["adamw", "aurora", "aurora_tst", "aurora_eqtext"], orders=2, seeds=1, steps=40, batch_tokens=256,
        val_tokens=8192, val_every=None, sweep={"adamw": [0.004], "aurora": [0.05]},
        sweep_extend=0, recency_arm="adamw", out=os.path.join("bench", "out", "small_scale_quick")),
}

# Cost model of one trainer process, for the plan printed before anything runs: start-up + seconds per
# training FLOP + seconds per val (forward) FLOP, measured on a 2-core AMD EPYC (torch 2.13.0 CPU,
# float32, one thread) at the MODEL shape with the current trainer (float32 Newton-Schulz on the CPU,
# the softcap inside the fused loss), two aurora runs at a time on otherwise idle cores: 0.42 s per
# 256-position step (127 s of train time for 1.59e12 FLOPs: 8.0e-11 s per training FLOP), 38 s per
# eval of the 63,483-token val shard (0.61 ms a position: half a training position, not the third of
# its FLOPs, since the 50304-wide softmax dominates at this width), 8 s start-up; 216 s a run in all
# (the model says 211). The trainer of 2026-11-29 (bf16 Newton-Schulz on the CPU) took 0.60 s a step.
# results.md reports the measured time / this estimate of every run.
COST = dict(startup_s=8.0, s_per_train_flop=8.0e-11, s_per_val_flop=8.75e-11)


# ----------------------------------------------------------------------------------------------
# Planning the runs


@dataclasses.dataclass
class Job:
    """One training run: its key, where its log goes, and the trainer command(s) that make it.

    ``argvs`` is one command, or for the equal-text control two: the big-batch part (stops at
    ``--max-steps`` with a checkpoint) and the rest (resumes from ``checkpoint`` into the same log).
    """
    key: tuple  # (arm, data-order kind, order, seed)
    run_dir: str
    run_id: str
    argvs: list
    checkpoint: str = ""


def run_name(arm, kind, order, seed):
    return f"{arm}_o{order}_seed{seed}" if kind == "mix" else f"{arm}_{kind}_o{order}_seed{seed}"


def trainer_argv(spec, run_dir, run_id, seed, extra, train_files, val_every, batch_tokens=None):
    """The trainer command line of one run (the mode's base flags, then the arm/lr ``extra``)."""
    batch_tokens = batch_tokens or spec["batch_tokens"]
    seqs = batch_tokens // MODEL["seq_len"]  # one micro-batch when <= 16 sequences
    argv = [sys.executable, spec["trainer"], "--preset", "cpu_smoke_r21", "--device", "cpu", "--no-compile", "--no-bf16",
            "--train-files", train_files, "--val-files", spec["val_files"],
            "--num-iterations", str(spec["steps"]), "--batch-tokens", str(batch_tokens),
            "--micro-batch-seqs", str(min(seqs, 16)), "--val-tokens", str(spec["val_tokens"]),
            "--val-every", str(val_every), "--log-every", "5", "--seed", str(seed),
            "--log-dir", run_dir, "--run-id", run_id]
    for k, v in MODEL.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv + list(extra) + spec["trainer_args"]


def flag_value(flags, name):
    return flags[flags.index(name) + 1]


def eqtext_plan(spec, arm):
    """The equal-text control's schedule: dict(bag_size s, switch k = round(r*N), big_batch s*B, flops_step).

    ``flops_step`` is the step at which the control has spent the FLOPs of the whole TST run
    (``N * B`` positions): ``N/s`` when that lies in its big-batch part, else ``N - k*(s-1)``.

    Raises:
        SystemExit: ``N/s`` is not a whole step (no val point could sit at equal FLOPs).
    """
    tst_flags = ARMS[EQTEXT[arm]][1]
    s, r = int(flag_value(tst_flags, "--tst-bag-size")), float(flag_value(tst_flags, "--tst-frac"))
    n = spec["steps"]
    k = trainer_module().tst_switch_step(argparse.Namespace(tst_frac=r, num_iterations=n))
    if n <= s * k and n % s:
        raise SystemExit(f"--steps {n}: the equal-text control {arm} needs a multiple of {s} (its bag size) so that "
                         f"a val point falls at equal FLOPs; e.g. --steps {n - n % s}, or leave {arm} out (--arms)")
    return dict(bag_size=s, switch=k, big_batch=s * spec["batch_tokens"],
                flops_step=n // s if n <= s * k else n - k * (s - 1))


def val_every_of(spec, arm, seed):
    """Val cadence of a run: the control's at equal FLOPs, N/4 for the recency arm's seed 0, else the mode's.

    (The control's second part only vals at the end, or at equal FLOPs when that lies there.)
    """
    if arm in EQTEXT:
        return eqtext_plan(spec, arm)["flops_step"]
    if arm == spec["recency_arm"] and seed == 0:
        return max(1, spec["steps"] // 4)
    return spec["val_every"]


def make_job(spec, arm, kind, order, seed, lr_flags, run_dir=None, run_id=None, val_every=None):
    """The Job of one run of ``arm`` on data order ``(kind, order)`` from init ``seed``."""
    run_dir = run_dir or os.path.join(spec["out"], arm if kind == "mix" else f"recency_{kind}")
    run_id = run_id or run_name(arm, kind, order, seed)
    common = dict(train_files=spec["order_globs"][(kind, order)],
                  val_every=val_every or val_every_of(spec, arm, seed))
    extra = ARMS[arm][1] + list(lr_flags)
    key = (arm, kind, order, seed)
    if arm not in EQTEXT:
        return Job(key, run_dir, run_id, [trainer_argv(spec, run_dir, run_id, seed, extra, **common)])
    eq = eqtext_plan(spec, arm)
    ck_dir = os.path.join(spec["out"], "data", "checkpoints")
    ckpt = os.path.join(ck_dir, run_id, f"step_{eq['switch']:06d}.pt")
    first = trainer_argv(spec, run_dir, run_id, seed, extra, batch_tokens=eq["big_batch"], **common) + [
        "--max-steps", str(eq["switch"]), "--save-final", "--checkpoint-dir", ck_dir]
    if eq["flops_step"] <= eq["switch"]:  # the equal-FLOPs val point is in the first part: then only the end
        common["val_every"] = spec["steps"]
    rest = trainer_argv(spec, run_dir, run_id, seed, extra, **common) + [
        "--resume", ckpt, "--resume-force", "--checkpoint-dir", ck_dir]
    return Job(key, run_dir, run_id, [first, rest], ckpt)


def sweep_job(spec, fam, lr):
    """The lr-sweep run of a family at ``lr``: its no-TST arm on mix order 0, seed 0, the mode's val cadence."""
    flag, arm = FAMILIES[fam]
    return make_job(spec, arm, "mix", 0, 0, [flag, fmt_lr(lr)], os.path.join(spec["out"], "lr_sweep"),
                    f"{fam}_lr{fmt_lr(lr)}_seed0", val_every=spec["val_every"])


def arm_jobs(spec, lr_flags):
    """Every arm x order x seed, then the recency arm's extra runs; ``lr_flags`` maps family -> lr flags.

    The control's (two-part, longest) runs come first so that they do not finish last alone.
    """
    jobs = [make_job(spec, arm, "mix", order, seed, lr_flags[ARMS[arm][0]])
            for arm in spec["arms"] for order in range(spec["orders"]) for seed in range(spec["seeds"])]
    arm = spec["recency_arm"]
    if arm:
        if arm not in spec["arms"]:
            jobs += [make_job(spec, arm, "mix", o, 0, lr_flags[ARMS[arm][0]]) for o in range(spec["orders"])]
        jobs += [make_job(spec, arm, "docs", o, 0, lr_flags[ARMS[arm][0]]) for o in range(spec["orders"])]
    return sorted(jobs, key=lambda j: -len(j.argvs))


def families(spec):
    """Optimizer families whose lr the planned arms (and the recency arm) need, in FAMILIES order."""
    arms = set(spec["arms"]) | ({spec["recency_arm"]} if spec["recency_arm"] else set())
    return [f for f in FAMILIES if any(ARMS[a][0] == f for a in arms)]


def planned_jobs(spec, lr_of=None):
    """``(sweep jobs, arm jobs)`` of the plan; arm lrs from ``lr_of`` {family: lr} (default: each grid's first)."""
    fams = families(spec)
    sweep = [sweep_job(spec, f, lr) for f in fams for lr in spec["sweep"][f]]
    lr_of = lr_of or {f: spec["sweep"][f][0] for f in fams}
    return sweep, arm_jobs(spec, {f: [FAMILIES[f][0], fmt_lr(lr_of[f])] for f in fams})


def is_reused(spec, job):
    """True for the (order 0, seed 0) run of a family's no-TST arm: the sweep run at the chosen lr.

    Not for the recency arm, whose seed-0 runs val more often than the sweep's.
    """
    arm, kind, order, seed = job.key
    return (kind == "mix" and order == 0 and seed == 0 and arm != spec["recency_arm"]
            and FAMILIES.get(ARMS[arm][0], (None, None))[1] == arm)


def est_seconds(job):
    """Estimated wall seconds of a Job from the COST model (start-up, training and val FLOPs)."""
    return sum(est_parts(job))


def est_parts(job):
    """Estimated wall seconds of each trainer command of a Job (a list, one per ``job.argvs``)."""
    tg, parts, start = trainer_module(), [], 0
    for argv in job.argvs:
        cfg, _ = tg.parse_config(argv[2:])
        n = cfg.num_iterations
        end = min(n, start + cfg.max_steps) if cfg.max_steps else n
        flops = tg.model_flops_per_position(cfg)
        switch = tg.tst_switch_step(cfg)
        points = ({0} if start == 0 else set()) | {
            t for t in range(start + 1, end + 1) if (cfg.val_every and t % cfg.val_every == 0) or t == n}
        per_val = flops / 3 * cfg.val_tokens  # forward only
        tst_val = per_val / (cfg.tst_bag_size if cfg.tst_mode != "output" else 1)
        val = sum(per_val + (tst_val if max(t - 1, 0) < switch else 0.0) for t in points)
        parts.append(COST["startup_s"] + COST["s_per_train_flop"] * flops * cfg.batch_tokens * (end - start)
                     + COST["s_per_val_flop"] * val)
        start = end
    return parts


def print_plan(spec, parallel):
    """Print every group of planned runs with its count and estimated time; return the estimate (s)."""
    sweep, arms = planned_jobs(spec)
    n_ext = spec["sweep_extend"] * len(families(spec))
    groups = {}
    for job in sweep:
        groups.setdefault("lr sweep (mix order 0, seed 0)", []).append(job)
    for job in arms:
        arm, kind = job.key[:2]
        if not is_reused(spec, job):
            groups.setdefault(arm if kind == "mix" else f"recency: {arm} on {kind} orders", []).append(job)
    print(f"plan: {'group':<38} {'runs':>4} {'est. each':>10} {'est. total':>11}")
    total = 0.0
    for name, jobs in groups.items():
        each = [est_seconds(j) for j in jobs]
        total += sum(each)
        print(f"      {name:<38} {len(jobs):>4} {np.mean(each) / 60:>8.1f} m {sum(each) / 60:>9.1f} m")
    ext = n_ext * est_seconds(sweep[0]) if sweep else 0.0
    if n_ext:
        print(f"      {'lr sweep extensions (at most)':<38} {n_ext:>4} {ext / n_ext / 60:>8.1f} m {ext / 60:>9.1f} m")
    wall = (total + ext) / parallel
    print(f"      estimated wall time with --jobs {parallel}: {wall / 60:.0f} min ({wall / 3600:.2f} h; "
          f"cost model COST of measured runs on an idle 2-core CPU; other load makes it longer)", flush=True)
    return wall


# ----------------------------------------------------------------------------------------------
# Running the runs


def expected_config(argv):
    """The resolved trainer config of a command line, for the resume check.

    Parsed by the working tree's ``train_gpt.parse_config`` (a snapshot with other defaults
    then looks changed, and its runs are retrained: the safe side).
    """
    train_gpt = trainer_module()
    cfg, _ = train_gpt.parse_config(argv[2:])
    keys = list(train_gpt.RUN_DEFINING) + ["train_files", "val_files", "val_every"]
    return {k: order_key(getattr(cfg, k)) if k == "train_files" else getattr(cfg, k) for k in keys}


def order_key(pattern):
    """A data order's shard glob by its last two parts (``mix_o0_<hash>/*_train_*.bin``).

    The order folders are named by the hash of the tokens they hold, so these two parts name
    the data wherever ``<out>`` lies: a moved output folder still resumes.
    """
    return "/".join(str(pattern).replace(os.sep, "/").rstrip("/").split("/")[-2:])


TRAINER_FILES = harness.SOURCE_FILES  # what a run's log snapshots


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


def is_done(job):
    """True if the Job's JSON says complete and its log was made with the same config."""
    status = read_json(os.path.join(job.run_dir, job.run_id + ".json")).get("status")
    return status == "complete" and same_config(job.run_dir, job.run_id, job.argvs[0])


def handover_ready(job):
    """True when the control's big-batch part is done (its checkpoint there) and only the rest is left."""
    status = read_json(os.path.join(job.run_dir, job.run_id + ".json")).get("status")
    return (len(job.argvs) > 1 and status == "stopped_early" and os.path.exists(job.checkpoint)
            and same_config(job.run_dir, job.run_id, job.argvs[0], say=False))


def train(job, ledger):
    """Train one Job (each of its trainer commands in turn) unless already done; return its summary.

    Progress (val lines) is echoed; on failure the trainer's last stderr lines are printed and
    the summary's ``status`` is not ``complete``. The control's checkpoint is removed when its
    run ends either way.
    """
    os.makedirs(job.run_dir, exist_ok=True)
    if is_done(job):
        print(f"  {job.run_id}: complete, skipped", flush=True)
    else:
        first = 1 if handover_ready(job) else 0
        if first == 0:
            set_aside(job.run_dir, job.run_id)
        for part, argv in enumerate(job.argvs[first:], first):
            if run_trainer(argv, job, part, ledger) != 0:
                break
        if job.checkpoint:
            shutil.rmtree(os.path.dirname(job.checkpoint), ignore_errors=True)
            with contextlib.suppress(OSError):  # the shared checkpoints folder too, once empty
                os.rmdir(os.path.dirname(os.path.dirname(job.checkpoint)))
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
    print(f"  {what}: training ... ({shlex.join(argv)})" if ledger.get("verbose") else f"  {what}: training ...",
          flush=True)
    t0, load0 = time.time(), load_average()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    for ln in proc.stdout:
        if " val_loss:" in ln:
            print("    " + ln.rstrip()[:110], flush=True)
    err = proc.stderr.read()
    rc = proc.wait()
    wall, load1 = time.time() - t0, load_average()
    name = os.path.relpath(os.path.join(job.run_dir, job.run_id), ledger["out"]) + (f"#{part + 1}" if part else "")
    record_timing(ledger, dict(run=name, wall_s=round(wall, 1), est_s=round(est_parts(job)[part], 1),
                               load_start=load0, load_end=load1, exit=rc,
                               finished=datetime.datetime.now().isoformat(timespec="seconds")))
    print(f"  {what}: exit {rc}, {wall:.0f}s wall (1-min load average {load0:.1f} -> {load1:.1f})", flush=True)
    if rc != 0:
        print("    " + "\n    ".join(err.strip().splitlines()[-5:]), flush=True)
    return rc


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
        for name in TRAINER_FILES:
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
    """Per family: train the grid (mix order 0, seed 0, no TST), extend past an edge optimum, pick the best.

    Every family's grid is trained first (``--jobs`` runs at a time), then the extensions, one
    round per ``sweep_extend``. Returns ``{family: dict(flag, chosen, edge, rows=[(lr, final val
    loss or None, train_time_ms, run id)])}``.
    """
    fams = families(spec)
    rows = {fam: {} for fam in fams}

    def run(pairs):
        jobs = [sweep_job(spec, f, lr) for f, lr in pairs]
        for (fam, lr), job, s in zip(pairs, jobs, run_all(jobs, ledger)):
            ok = s.get("status") == "complete" and math.isfinite(s.get("final_val_loss", math.nan))
            rows[fam][lr] = (s["final_val_loss"] if ok else None, s.get("train_time_ms"), job.run_id)

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
            raise SystemExit(f"lr sweep {fam}: every run failed; see the logs in {os.path.join(spec['out'], 'lr_sweep')}")
        result[fam] = dict(flag=FAMILIES[fam][0], chosen=best, edge=best in (lrs[0], lrs[-1]) and len(lrs) > 1,
                           rows=[(lr,) + rows[fam][lr] for lr in lrs])
        print(f"  -> {fam}: {FAMILIES[fam][0]} {fmt_lr(best)} (final val loss {rows[fam][best][0]:.4f})", flush=True)
    return result


# ----------------------------------------------------------------------------------------------
# Analysis


def complete(summary):
    return (summary.get("status") == "complete" and bool(summary.get("val"))
            and math.isfinite(summary.get("final_val_loss", math.nan)))


def finals(results, arm, kind="mix"):
    """``{(order, seed): final val loss}`` of the complete runs of ``arm`` on ``kind`` orders."""
    return {(o, s): r["final_val_loss"] for (a, k, o, s), r in results.items() if a == arm and k == kind and complete(r)}


def values_at_flops(results, arm, ref):
    """``{(order, seed): val loss of arm at the total FLOPs of ref's run of that key}``, linear in FLOPs.

    Keys where either run is incomplete or the FLOPs lie outside ``arm``'s val curve are absent.
    """
    out = {}
    for (a, k, o, s), r in results.items():
        other = results.get((ref, k, o, s))
        if a == arm and k == "mix" and complete(r) and other and complete(other):
            v = sst.value_at([p["flops"] for p in r["val"]], [p["val_loss"] for p in r["val"]], other["flops"])
            if v is not None:
                out[(o, s)] = v
    return out


def describe(a, b, at):
    """What is held equal in a comparison (its column in results.md)."""
    if at == "flops":
        return f"equal FLOPs: {b}'s val loss at {a}'s total FLOPs (mid-run, lr not decayed)"
    if EQTEXT.get(b) == a or EQTEXT.get(a) == b:
        return "equal text: the same tokens at every step; the control costs more FLOPs"
    if a in EQTEXT or b in EQTEXT:
        return "equal steps; the control reads TST's phase-1 text at more FLOPs"
    return "equal FLOPs: same steps and positions per step"


def comparisons(spec, results):
    """Paired differences of COMPARISONS whose two arms were both planned; pairs left out are named."""
    keys = [(o, s) for o in range(spec["orders"]) for s in range(spec["seeds"])]
    rows = []
    for a, b, at in COMPARISONS:
        if a not in spec["arms"] or b not in spec["arms"]:
            continue
        va = finals(results, a)
        vb = finals(results, b) if at == "final" else values_at_flops(results, b, a)
        res = sst.paired_difference(va, vb)
        left_out = [(k, "no complete run of " + " nor ".join(x for x, v in ((a, va), (b, vb)) if k not in v))
                    for k in keys if k not in res["keys"]]
        for (o, s), why in left_out:
            print(f"WARNING: {a} vs {b} ({at}): pair (order {o}, seed {s}) left out: {why}", flush=True)
        rows.append(dict(res, a=a, b=b, at=at, what=describe(a, b, at), left_out=left_out))
    return rows


def mean_curve(runs):
    """Mean val curve of runs over the val steps they all have: dict(step, loss, flops, time_ms) lists."""
    common = sorted(set.intersection(*[{p["step"] for p in r["val"]} for r in runs]))
    pts = [{p["step"]: p for p in r["val"]} for r in runs]
    mean = lambda key: [float(np.mean([pt[t][key] for pt in pts])) for t in common]  # noqa: E731
    return dict(step=common, loss=mean("val_loss"), flops=mean("flops"), time_ms=mean("train_time_ms"))


def arm_stats(results, arm, corpus):
    """Final val loss over the arm's (order, seed) runs (mix orders), its mean curve, time, FLOPs, text read."""
    runs = {(o, s): r for (a, k, o, s), r in sorted(results.items()) if a == arm and k == "mix"}
    done = [r for r in runs.values() if complete(r)]
    out = dict(sst.spread([r["final_val_loss"] for r in done]), n_runs=len(runs),
               finals={f"o{o}s{s}": r["final_val_loss"] for (o, s), r in runs.items() if complete(r)})
    if done:
        out.update(curve=mean_curve(done), train_time_ms=float(np.mean([r["train_time_ms"] for r in done])),
                   flops=float(np.mean([r["flops"] for r in done])),
                   raw_tokens=int(np.mean([r["raw_tokens"] for r in done])))
        out["epochs"] = out["raw_tokens"] / corpus
    return out


def recency(spec, results):
    """The recency arm's seed-0 runs per order kind: ``{kind: dict(curves={order: (steps, losses)}, spread)}``."""
    out = {}
    for kind in ("docs", "mix"):
        runs = {o: r for (a, k, o, s), r in sorted(results.items())
                if a == spec["recency_arm"] and k == kind and s == 0 and complete(r)}
        out[kind] = dict(curves={o: ([p["step"] for p in r["val"]], [p["val_loss"] for p in r["val"]])
                                 for o, r in runs.items()},
                         finals={o: r["final_val_loss"] for o, r in runs.items()},
                         spread=sst.spread([r["final_val_loss"] for r in runs.values()]))
    return out


# ----------------------------------------------------------------------------------------------
# Plots


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def recency_plot(rec, arm, path, val_what):
    """Val curves of the recency arm over the data orders: docs orders (left) and mix orders (right)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), dpi=110, sharey=True)
    titles = dict(docs="before: whole documents, shuffled (in-order stream)",
                  mix="after: i.i.d.-like mix of seq_len chunks")
    later = [v for kind in rec for _, ys in rec[kind]["curves"].values() for v in ys[1:]]
    first = [ys[0] for kind in rec for _, ys in rec[kind]["curves"].values()]
    cut = bool(later) and min(first) > max(later) + 0.05  # the step-0 points lie above the frame
    for ax, kind in zip(axes, ("docs", "mix")):
        for order, (steps, losses) in sorted(rec[kind]["curves"].items()):
            ax.plot(steps, losses, marker="o", ms=3, label=f"order {order}")
        sp = rec[kind]["spread"]
        ax.set_title(f"{titles[kind]}\nfinal val loss over orders: std {sp['std']:.4f}, range {sp['range']:.4f}",
                     fontsize=10)
        ax.set_xlabel("step" + (f" (step 0, val loss {min(first):.1f}, is above the frame)" if cut else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"val loss ({arm}, seed 0, {val_what})")
    if later:  # frame the points after step 0 (~10.8 at init) so that the differences are visible
        axes[0].set_ylim(min(later) - 0.05, max(later) + 0.05)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
        ax.axhline(target, color="black", ls="--", lw=1, label=f"adamw mean final {target:.4f}")
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


def make_plots(out, arms, stats, target):
    """val loss vs FLOPs and vs train time via records/compare.py (one arm folder = one group, pooled
    over the data orders)."""
    plots, compare_text = [], ""
    folders = [os.path.join(out, a) for a in arms if stats.get(a, {}).get("n")]
    tool = os.path.join(REPO, "records", "compare.py")
    for x in ("flops", "time"):
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
            what += " (records/compare.py; dashed line: adamw mean final loss)"
        else:
            own_plot(stats, arms, path, x, target)
            what += " (means, drawn by small_scale.py: records/compare.py was unavailable or failed)"
        plots.append((path, what))
    return plots, compare_text


# ----------------------------------------------------------------------------------------------
# Report


def num(x, fmt):
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def settings_of(arm, sweep):
    fam, flags = ARMS[arm]
    text = " ".join(flags).replace("--optimizer ", "").replace("--", "")
    if arm in EQTEXT:
        text += f" + {EQTEXT[arm]}'s phase-1 text as a bigger batch"
    lr = sweep.get(fam)
    return text + (f" {lr['flag'][2:]} {fmt_lr(lr['chosen'])}" if lr else "")


def val_what(spec):
    whole = spec["val_tokens"] == spec["val_total"] - 1
    return "the whole val shard" if whole else f"the first {spec['val_tokens']:,} val tokens"


def header_lines(spec, stats, corpus):
    """The title and the setup bullets of results.md."""
    base = stats.get(BASELINE, stats.get(spec["arms"][0], {}))
    flops_step = base.get("flops", math.nan) / max(spec["steps"], 1)
    keys = spec["orders"] * spec["seeds"]
    L = [f"# Small-scale benchmark: TST and Aurora on real text, paired over data orders and seeds "
         f"({spec['mode']} mode)", ""]
    if spec["mode"] == "quick":
        L += ["**Quick mode checks the pipeline; its runs are far too short (and its val set too small) "
              "to be evidence for or against any method. The full mode is the benchmark.**", ""]
    return L + [
        f"Made by `{spec['command']}` on {spec['date']}: {spec['machine']}. Trainer: `code/train_gpt.py` "
        f"(snapshot of the repo's at the start, sha256 {spec['trainer_sha256']}..., not kept in git: every log "
        "holds its source, `python records/verify.py LOG --extract DIR` writes it out).", "",
        f"* Model: {MODEL['n_layer']} layers x {MODEL['model_dim']} wide ({MODEL['n_head']} heads), seq_len "
        f"{MODEL['seq_len']}, vocab 50304 (GPT-2), {spec['batch_tokens']} positions/step, {spec['steps']} steps, "
        f"{num(flops_step, '.3g')} FLOPs/step (every arm but the control); `--preset cpu_smoke_r21` otherwise: lr "
        "flat, then linear decay over the last 40% of steps to the preset lr floor (0.1x; 0 in aurora_no_lr_floor), no warmup; float32, no compile.",
        f"* Data: `{spec['train_files']}` ({corpus:,} train tokens) in {spec['orders']} data orders (`mix`: "
        f"{MODEL['seq_len']}-token chunks shuffled by the order's seed, `data/`), x {spec['seeds']} init seeds = "
        f"{keys} runs per arm. Val loss on {spec['val_tokens']:,} tokens of `{spec['val_files']}` "
        f"({val_what(spec)}).",
        "* lr: block-matrix lr tuned per optimizer family by the sweep below (mix order 0, seed 0, no TST); "
        "the Adam lrs of embedding (0.3), head (0.02) and scalars (0.04) are the `cpu_smoke_r21` preset's.",
        *[f"* {c}, the equal-text control of {t}: plain Aurora with {eqtext_plan(spec, c)['bag_size']}x the "
          f"batch for the first {eqtext_plan(spec, c)['switch']} steps, so it reads exactly {t}'s tokens at every "
          "step, at that many times the FLOPs there." for c, t in EQTEXT.items() if c in spec["arms"]],
        "* Comparisons are paired per (order, seed): mean difference, 95% t-interval, paired t-test p "
        "(`scipy.stats.ttest_rel`); lower loss is better; *better*/*worse* only where the interval excludes 0, "
        "else *no measurable difference*.", ""]


def arm_table(spec, sweep, stats):
    L = ["| arm | settings | final val loss (mean ± std, n) | train time | FLOPs | text tokens read | repeats data |",
         "|---|---|---|---|---|---|---|"]
    for arm in spec["arms"]:
        s = stats.get(arm, {})
        if not s.get("n"):
            L.append(f"| {arm} | {settings_of(arm, sweep)} | no complete run ({s.get('n_runs', 0)} tried) | | | | |")
            continue
        rep = ("yes" if s["epochs"] > 1 else "no") + f" ({s['epochs']:.2f} epochs)"
        L.append(f"| {arm} | {settings_of(arm, sweep)} | {s['mean']:.4f} ± {num(s['std'], '.4f')} (n={s['n']}) | "
                 f"{s['train_time_ms'] / 1000:.0f} s | {s['flops']:.3g} | {s['raw_tokens']:,} | {rep} |")
    return L + [""]


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


def recency_lines(spec, rec):
    arm = spec["recency_arm"]
    L = [f"## Recency: {arm}, seed 0, over the data orders", "",
         "Before: `docs` orders (whole documents shuffled, each read in one piece: the in-order stream with only "
         "the document order changed). After: the benchmark's `mix` orders. Plot: `recency.png`.", "",
         "| data orders | final val loss per order | mean | std | range |", "|---|---|---|---|---|"]
    for kind in ("docs", "mix"):
        r = rec[kind]
        per = ", ".join(f"o{o}: {v:.4f}" for o, v in sorted(r["finals"].items())) or "no complete run"
        sp = r["spread"]
        L.append(f"| {kind} | {per} | {num(sp['mean'], '.4f')} | {num(sp['std'], '.4f')} | {num(sp['range'], '.4f')} |")
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


def sweep_lines(spec, sweep):
    L = ["## LR sweep (mix order 0, seed 0, no TST, final val loss; chosen = lowest)", "",
         "| family | flag | lr | final val loss | train time | |", "|---|---|---|---|---|---|"]
    for fam, sw in sweep.items():
        for lr, loss, t, _ in sw["rows"]:
            mark = "**chosen**" + (" (edge of grid)" if sw["edge"] else "") if lr == sw["chosen"] else ""
            L.append(f"| {fam} | `{sw['flag']}` | {fmt_lr(lr)} | {num(loss, '.4f')} | "
                     f"{'-' if t is None else f'{t / 1000:.0f} s'} | {mark} |")
    reused = [FAMILIES[f][1] for f in sweep if FAMILIES[f][1] in spec["arms"]]
    if reused:
        L += ["", f"Order 0, seed 0 of {', '.join(reused)} is the sweep run at the chosen lr (same flags; its log, "
                  "copied from `lr_sweep/`, keeps the sweep's run id)."]
    return L + [""]


def timing_lines(timing):
    tr, inv = timing["runs"], timing["invocations"]
    loads = [max(r["load_start"], r["load_end"]) for r in tr]
    est = [r for r in tr if r.get("est_s")]
    ratio = sum(r["wall_s"] for r in est) / sum(r["est_s"] for r in est) if est else math.nan
    return ["## Timing (from `timing.json`, all invocations on this folder)", "",
            f"* {len(tr)} trainer processes, {sum(r['wall_s'] for r in tr) / 60:.1f} min of trainer wall time "
            f"(incl. start-up and val), {num(ratio, '.2f')} x the cost model's estimate; {len(inv)} invocation(s) "
            f"of this script, {sum(i['wall_s'] for i in inv) / 60:.1f} min in all "
            f"(the last: {inv[-1]['wall_s'] / 60:.1f} min).",
            f"* 1-min load average at the start/end of the runs: median {num(np.median(loads) if loads else None, '.1f')}, "
            f"max {num(max(loads, default=math.nan), '.1f')}; {sum(x > 2.5 for x in loads)} of {len(tr)} runs saw > "
            "2.5 (other jobs on the 2 cores slow a run down: train times carry that noise, FLOPs do not).", ""]


def report(spec, sweep, stats, rows, rec, corpus, timing, plots, compare_text):
    """The markdown of results.md (printed too)."""
    L = header_lines(spec, stats, corpus) + arm_table(spec, sweep, stats) + comparison_table(rows)
    if spec["recency_arm"]:
        L += recency_lines(spec, rec)
    L += detail_lines(spec, stats) + sweep_lines(spec, sweep)
    L += ["## Plots", ""] + [f"* `{os.path.basename(p)}`: {what}" for p, what in plots] + [""]
    L += timing_lines(timing)
    if compare_text:
        L += ["## `records/compare.py --pool-train-data` on the arm folders", "", "```", compare_text.rstrip(), "```"]
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------------------------
# Inputs and checks


def trainer_module():
    """The working tree's train_gpt, imported once (its config parser and FLOP count)."""
    import train_gpt
    return train_gpt


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
    """Count the corpus and val tokens, fix ``val_tokens``, and name (``write``: also write) the data orders."""
    spec["corpus"] = shard_tokens(spec["train_files"], "--train-files")
    spec["val_total"] = shard_tokens(spec["val_files"], "--val-files")
    if spec["val_tokens"] is None:
        spec["val_tokens"] = spec["val_total"] - 1  # the whole shard: the last token is only a label
    if not 1 <= spec["val_tokens"] <= spec["val_total"] - 1:
        raise SystemExit(f"--val-tokens {spec['val_tokens']}: the val shards hold {spec['val_total']} tokens; "
                         f"use 1 to {spec['val_total'] - 1} (the default is the whole shard)")
    kinds = ["mix"] + (["docs"] if spec["recency_arm"] else [])
    pattern = spec["train_files"] if os.path.isabs(spec["train_files"]) else os.path.join(REPO, spec["train_files"])
    try:
        spec["order_globs"] = small_scale_data.build_orders(pattern, os.path.join(spec["out"], "data"), kinds,
                                                            spec["orders"], MODEL["seq_len"], write)
    except small_scale_data.OrderError as e:
        raise SystemExit(str(e)) from None


def parse_list(text, flag, kind):
    """A non-empty comma list without repeats; floats must be finite and > 0. SystemExit naming ``flag``."""
    words = [w.strip() for w in text.split(",")]
    if not text.strip() or any(not w for w in words):
        raise SystemExit(f"{flag} {text!r}: give a comma list without empty items, e.g. "
                         + ("adamw,aurora" if kind is str else "0.002,0.004"))
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
                    tg.parse_config(argv[2:])
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--quick", action="store_true", help="the pipeline check (4 arms, 2 orders x 1 seed, tiny runs)")
    ap.add_argument("--orders", type=int, default=None, help="data orders per arm (default: 3)")
    ap.add_argument("--seeds", type=int, default=None, help="init seeds per arm and order (default: 2)")
    ap.add_argument("--arms", default=None, help=f"comma list of arms (default: the mode's); from {', '.join(ARMS)}")
    ap.add_argument("--recency-arm", default=None,
                    help="arm also trained on docs orders for the recency check, or 'none' (default: adamw)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the mode's)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="latent positions per step (default: the mode's)")
    ap.add_argument("--val-tokens", type=int, default=None,
                    help="val tokens per eval (default: the whole val shard; quick: 8192)")
    ap.add_argument("--val-every", type=int, default=None,
                    help="val every this many steps (default: at the start and the end only; the recency arm's "
                         "seed-0 runs every steps/4, the control at equal FLOPs)")
    ap.add_argument("--adamw-lrs", default=None, help="comma list: the adamw sweep grid of --adamw-lr")
    ap.add_argument("--muon-lrs", default=None, help="comma list: the muon sweep grid of --matrix-lr")
    ap.add_argument("--aurora-lrs", default=None, help="comma list: the aurora sweep grid of --matrix-lr")
    ap.add_argument("--sweep-extend", type=int, default=None,
                    help="extend the grid by a factor 2 past an edge optimum at most this many times")
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
    return ap.parse_args(argv)


def build_spec(args, argv):
    """The run specification from the mode and the flags; every flag checked (SystemExit, one message)."""
    mode = "quick" if args.quick else "full"
    spec = dict(MODES[mode], mode=mode, sweep=dict(MODES[mode]["sweep"]))
    for k in ("orders", "seeds", "steps", "batch_tokens", "val_tokens", "val_every", "sweep_extend", "recency_arm"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    spec["val_every"] = spec["val_every"] or spec["steps"]  # default: val at the start and the end only
    spec["arms"] = parse_list(args.arms, "--arms", str) if args.arms is not None else spec["arms"]
    spec["recency_arm"] = None if spec["recency_arm"] == "none" else spec["recency_arm"]
    for flag, names in (("--arms", spec["arms"]), ("--recency-arm", [spec["recency_arm"] or "adamw"])):
        bad = [a for a in names if a not in ARMS]
        if bad:
            raise SystemExit(f"{flag}: unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    for fam in FAMILIES:
        given = getattr(args, f"{fam}_lrs")
        if given is not None:
            spec["sweep"][fam] = parse_list(given, f"--{fam}-lrs", float)
        elif fam not in spec["sweep"]:
            spec["sweep"][fam] = MODES["full"]["sweep"][fam]
    for flag, key, low in (("--orders", "orders", 1), ("--seeds", "seeds", 1), ("--steps", "steps", 1),
                           ("--batch-tokens", "batch_tokens", 1), ("--val-every", "val_every", 1),
                           ("--sweep-extend", "sweep_extend", 0)):
        if spec[key] < low:
            raise SystemExit(f"{flag} must be >= {low} (got {spec[key]})")
    if spec["val_tokens"] is not None and spec["val_tokens"] < 1:
        raise SystemExit(f"--val-tokens must be >= 1 (got {spec['val_tokens']}); leave it out for the whole val shard")
    if args.jobs < 1 or args.threads < 0:
        raise SystemExit(f"--jobs must be >= 1 and --threads >= 0 (got --jobs {args.jobs}, --threads {args.threads})")
    check_batch(spec["batch_tokens"], "")
    try:
        spec["trainer_args"] = shlex.split(args.trainer_args)
    except ValueError as e:
        raise SystemExit(f"--trainer-args {args.trainer_args!r}: {e}; quote it as one shell word") from None
    date = datetime.date.today().isoformat()
    out = args.out or spec["out"].format(date=date)
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
    for arm in [a for a in spec["arms"] if a in EQTEXT]:
        eq = eqtext_plan(spec, arm)  # --steps that leave no val point at equal FLOPs stop here
        check_batch(eq["big_batch"], f" ({arm} trains {eq['bag_size']} x that in its first {eq['switch']} steps)")
    return spec


def check_batch(batch_tokens, why):
    """A batch the trainer can split: whole sequences, one micro-batch up to 16 sequences, else multiples of 16."""
    seqs = batch_tokens // MODEL["seq_len"]
    if batch_tokens % MODEL["seq_len"] or (seqs > 16 and seqs % 16):
        raise SystemExit(f"--batch-tokens: {batch_tokens}{why} must be a multiple of seq_len {MODEL['seq_len']} "
                         f"(and of 16 x {MODEL['seq_len']} above 16 sequences)")


# ----------------------------------------------------------------------------------------------
# Main


def analyse_and_report(spec, sweep, results, timing_of):
    """Statistics, plots, results.md and results.json of a finished (or partly failed) benchmark."""
    out = spec["out"]
    stats = {arm: arm_stats(results, arm, spec["corpus"]) for arm in spec["arms"]}
    rows = comparisons(spec, results)
    rec = recency(spec, results) if spec["recency_arm"] else {}
    if rec:
        recency_plot(rec, spec["recency_arm"], os.path.join(out, "recency.png"), val_what(spec))
    target = stats.get(BASELINE, {}).get("mean")
    target = target if target is not None and math.isfinite(target) else None
    plots, compare_text = make_plots(out, spec["arms"], stats, target)
    if differences_plot(rows, os.path.join(out, "differences.png")):
        plots.insert(0, (os.path.join(out, "differences.png"), "the paired differences of every comparison in the table above "
                                                               "with at least 2 pairs, with their 95% intervals"))
    if rec:
        plots.append((os.path.join(out, "recency.png"), f"val curves of {spec['recency_arm']} (seed 0) over the "
                                                        "data orders: docs orders vs mix orders"))
    timing = timing_of()
    md = report(spec, sweep, stats, rows, rec, spec["corpus"], timing, plots, compare_text)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    for r in rows:
        r.update(keys=[list(k) for k in r["keys"]], diffs=r["diffs"].tolist(),
                 excluded=[[list(k), why] for k, why in r["excluded"]], left_out=[[list(k), why] for k, why in r["left_out"]])
    for kind in rec.values():
        kind["curves"] = {str(o): c for o, c in kind["curves"].items()}
        kind["finals"] = {str(o): v for o, v in kind["finals"].items()}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(spec={k: v for k, v in spec.items() if k != "order_globs"}, model=MODEL, sweep=sweep,
                       arms=stats, comparisons=rows, recency=rec, timing=timing), f, indent=1, default=str)
    return md


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    spec = build_spec(args, argv)
    prepare_data(spec, write=False)  # names the data orders; creates nothing yet
    check_commands(spec)
    print(f"small_scale ({spec['mode']}): {len(spec['arms'])} arms x {spec['orders']} data orders x {spec['seeds']} "
          f"seeds, {spec['steps']} steps x {spec['batch_tokens']} positions, val on {spec['val_tokens']:,} tokens; "
          f"output {spec['out']}", flush=True)
    print_plan(spec, args.jobs)
    if args.dry_run:  # creates nothing: a later real run must snapshot the code of its own time
        for job in arm_jobs(spec, {f: [FAMILIES[f][0], "<lr>"] for f in families(spec)}):
            if job.key[2:] == (0, 0):
                print("\n".join(shlex.join(a) for a in job.argvs))
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

    sweep = lr_sweep(spec, ledger)
    jobs = arm_jobs(spec, {fam: [sw["flag"], fmt_lr(sw["chosen"])] for fam, sw in sweep.items()})
    for job in jobs:
        if is_reused(spec, job) and not is_done(job):
            fam = ARMS[job.key[0]][0]
            set_aside(job.run_dir, job.run_id)
            copy_run(sweep_job(spec, fam, sweep[fam]["chosen"]), job)
            print(f"  {job.run_id}: = lr_sweep/{fam}_lr{fmt_lr(sweep[fam]['chosen'])}_seed0 (same flags), copied",
                  flush=True)
    results = {job.key: s for job, s in zip(jobs, run_all(jobs, ledger))}

    def timing_of():
        return record_timing(ledger, dict(invocation=dict(
            started=datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
            wall_s=round(time.time() - t_start, 1), command=spec["command"])))
    md = analyse_and_report(spec, sweep, results, timing_of)
    print("\n" + md)
    print(f"results: {os.path.join(spec['out'], 'results.md')}; this invocation {(time.time() - t_start) / 60:.1f} min",
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
