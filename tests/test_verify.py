"""records/verify.py --rerun: which logged numbers a rerun recomputes, and how closely it must match.

One tiny real run (8 steps, val only at steps 0 and 8, one torch thread) is made once per
session from a copy of the trainer that registers the tests' tiny model (``tiny_tree``), so that
its log re-runs by itself and edits to the working tree during the session cannot make the
snapshot and the "working tree" (``--repo``) disagree. Each test edits a copy of its log the way a
forged record would and checks what verify says. The logs under records/ re-run from their own
snapshots: one log of each era of the trainer (``ERAS``).
"""
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import REPO, loss_lines, subprocess_env, tiny_args
from tiny_tree import trainer_copy

sys.path.insert(0, os.path.join(REPO, "records"))
import verify  # noqa: E402


SEPARATOR = "\n" + "=" * 100 + "\n"


def run_verify(tiny, log, *args, threads="1", tmpdir=None, timeout=900, cwd=REPO):
    """``records/verify.py LOG --repo <the run's code> ARGS`` from ``cwd`` (the repo root), as a user runs
    it; ``tmpdir``: where its temp dirs go (``TMPDIR``)."""
    env = dict(subprocess_env(), OMP_NUM_THREADS=threads, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.run([sys.executable, os.path.join(REPO, "records", "verify.py"), str(log),
                           "--repo", str(tiny["tree"]), *map(str, args)],
                          cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)


def tiny_run(tree, run_id, compile_flag, steps=8, *extra):
    """Run the tiny 8-step config from a copy of the trainer in ``tree`` (``trainer_copy``), its first ``steps``
    (``extra``: flags); dict(log, tree, text, val): its log path, the folder with the code it ran, the log's text and
    its last val loss as printed."""
    trainer_copy(tree)
    args = tiny_args(tree, "--val-every", "0", *extra)
    cmd = [sys.executable, str(tree / "train_gpt.py"), *args, "--device", "cpu", compile_flag, "--run-id", run_id]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(subprocess_env(), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = tree / "logs" / f"{run_id}.txt"
    text = log.read_text()
    assert sorted(loss_lines(text, "val_loss")) == [0, steps] and "torch threads: 1" in text
    return dict(log=log, tree=tree, text=text, val=re.search(rf"^step:{steps}/\d+ val_loss:(\S+) ", text, re.M)[1])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny run, eager (``tiny_run``)."""
    return tiny_run(tmp_path_factory.mktemp("tiny"), "tiny", "--no-compile")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """The tiny run's first 2 steps compiled with torch.compile on the CPU (``tiny_run``): the warm-up compiles only
    stage 1's graphs, each rerun's too (inductor's compile on a CPU is minutes for the whole run)."""
    return tiny_run(tmp_path_factory.mktemp("compiled"), "compiled", "--compile", 2, "--max-steps", "2",
                    "--val-every", "2")


def edited(tiny, tmp_path, name, *subs):
    """A copy of the tiny log with each ``(pattern, replacement)`` applied once to the part after
    the source snapshot (each must match), as a forged record would be made."""
    code, run = tiny["text"].split(SEPARATOR, 1)
    for pattern, repl in subs:
        run, n = re.subn(pattern, repl, run, count=1, flags=re.M)
        assert n == 1, pattern
    path = tmp_path / name
    path.write_text(code + SEPARATOR + run)
    return path


FINAL_STEP = r"^(step:8/8 val_loss:)\S+"
FINAL_SUMMARY = r"^(summary: final_val_loss:)\S+"


# ----------------------------------------------------------------------------------------------
# val losses and the summary (a full rerun recomputes them)

def test_full_rerun_of_an_unedited_log_recomputes_val_and_summary(tiny):
    proc = run_verify(tiny, tiny["log"], "--rerun", 8, threads="2")  # the logged thread count wins
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "(OMP_NUM_THREADS=1)" in out and "same CPU model" in out and "thread count (1)" in out
    assert "exact match expected (tol 0.0001 = print rounding)" in out
    assert "covers steps 0..8 of 8, the whole run" in out
    assert f"val_loss at step 8: logged {tiny['val']}, rerun {tiny['val']}, diff 0.00e+00: reproduced" in out
    assert f"summary final_val_loss: logged {tiny['val']}, rerun {tiny['val']}" in out
    assert "summary counts equal (steps:8, raw_tokens:" in out and out.strip().endswith("OK")


def test_a_log_of_earlier_code_fails_the_tree_check_but_reruns_from_its_own_code(tiny, tmp_path):
    """The working tree has moved on since the log (a study made by its own snapshot, an old record):
    plain verify says the code differs and fails; --rerun notes it and re-runs the log's own code."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny["tree"], moved, ignore=shutil.ignore_patterns("logs"))
    with open(moved / "train_gpt.py", "a") as f:
        f.write("# a later commit\n")
    plain = run_verify(dict(tiny, tree=moved), tiny["log"])
    assert plain.returncode == 1 and "FAIL working tree: train_gpt.py: log has" in plain.stdout, plain.stdout
    proc = run_verify(dict(tiny, tree=moved), tiny["log"], "--rerun", 8)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: working tree: train_gpt.py: log has" in proc.stdout and "FAIL" not in proc.stdout
    assert "the rerun runs the log's own code" in proc.stdout
    assert f"val_loss at step 8: logged {tiny['val']}, rerun {tiny['val']}, diff 0.00e+00: reproduced" in proc.stdout


@pytest.mark.parametrize("where", ["step line and summary", pytest.param("step line", marks=pytest.mark.slow),
                                   pytest.param("summary", marks=pytest.mark.slow)])  # each alone: -m slow
def test_full_rerun_fails_an_edited_final_val_loss(tiny, tmp_path, where):
    subs = {"step line and summary": [(FINAL_STEP, r"\g<1>3.2000"), (FINAL_SUMMARY, r"\g<1>3.2000")],
            "step line": [(FINAL_STEP, r"\g<1>3.2000")], "summary": [(FINAL_SUMMARY, r"\g<1>3.2000")]}[where]
    proc = run_verify(tiny, edited(tiny, tmp_path, "forged.txt", *subs), "--rerun", 8)
    out = proc.stdout
    assert proc.returncode == 1 and out.strip().endswith("FAILED"), out + proc.stderr
    step_val = "3.2000" if "step" in where else tiny["val"]
    summary_val = "3.2000" if "summary" in where else tiny["val"]
    assert f"val_loss at step 8: logged {step_val}, rerun {tiny['val']}" in out
    assert (f"val_loss at step 8: logged {step_val}, rerun {tiny['val']}, diff 0.00e+00: reproduced" in out) == \
        (where == "summary")
    assert f"summary final_val_loss: logged {summary_val}, rerun {tiny['val']}" in out
    assert ("NOT reproduced (tol 1.00e-04)" in out.split("summary final_val_loss")[1]) == ("summary" in where)
    assert "train losses reproduced" in out  # the train losses were not touched


def test_full_rerun_fails_edited_summary_counts(tiny, tmp_path):
    raw = int(re.search(r" raw_tokens:(\d+)", tiny["text"])[1])
    bad = edited(tiny, tmp_path, "counts.txt", (r"( raw_tokens:)\d+", rf"\g<1>{raw * 2}"),
                 (r"^(summary: .* flops:)\S+", r"\g<1>9.999e+20"))
    proc = run_verify(tiny, bad, "--rerun", 8)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"raw_tokens logged {raw * 2} vs rerun {raw}" in proc.stdout
    assert "flops logged 9.999e+20 vs rerun" in proc.stdout and "steps logged" not in proc.stdout


def test_partial_rerun_checks_the_val_points_it_covers_and_says_what_it_cannot(tiny, tmp_path):
    # the final val loss is out of reach of a 2-step rerun: it passes, and says so
    forged = edited(tiny, tmp_path, "forged.txt", (FINAL_STEP, r"\g<1>3.2000"), (FINAL_SUMMARY, r"\g<1>3.2000"))
    proc = run_verify(tiny, forged, "--rerun", 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flat = " ".join(proc.stdout.split())
    assert "covers steps 0..2 of 8 only: a partial rerun cannot check the val losses after step 2 (so not " \
           "the final val loss at step 8, the number a record stands on), the train losses after step 2, " \
           "or the summary line; no rerun can check train_time" in flat
    assert "summary final_val_loss" not in proc.stdout
    # the step-0 val loss is in reach: an edit there fails, naming the step and both values
    step0 = re.search(r"^step:0/8 val_loss:(\S+) ", tiny["text"], re.M)[1]
    bad = edited(tiny, tmp_path, "step0.txt", (r"^(step:0/8 val_loss:)\S+", r"\g<1>9.0000"))
    proc = run_verify(tiny, bad, "--rerun", 2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"val_loss at step 0: logged 9.0000, rerun {step0}" in proc.stdout and "NOT reproduced" in proc.stdout


def test_rerun_is_capped_at_the_logged_steps(tiny):
    proc = run_verify(tiny, tiny["log"], "--rerun", 20)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--max-steps 8 " in proc.stdout and "covers steps 0..8 of 8, the whole run" in proc.stdout


# ----------------------------------------------------------------------------------------------
# machine cases: same CPU, another CPU / thread count, GPU log

@pytest.mark.slow  # two reruns; the drift rule itself: test_judgement_*
def test_another_cpu_model_gets_the_drift_a_rerun_at_another_thread_count_measures_and_fails_an_edit(tiny, tmp_path):
    cpu = (r"^cpu: .*?  cores:", "cpu: Some Other CPU  cores:")
    proc = run_verify(tiny, edited(tiny, tmp_path, "other_cpu.txt", cpu), "--rerun", 8)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "different CPU model (Some Other CPU vs " in proc.stdout
    assert re.search(r"^rerun \(\d threads?, to measure the drift\): .* --no-compile ", proc.stdout, re.M)
    assert "drift measured on this machine by a rerun at another thread count: tol(step) = max(0.0001 + 2 x the " \
           "measured |" in proc.stdout
    step8 = float(re.search(r"^step:8/8 train_loss:(\S+) ", tiny["text"], re.M)[1])
    bad = edited(tiny, tmp_path, "other_cpu_edit.txt", cpu,
                 (r"^(step:8/8 train_loss:)\S+", rf"\g<1>{step8 + 0.01:.4f}"))
    proc = run_verify(tiny, bad, "--rerun", 8)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(rf"^\s+8\s+{step8 + 0.01:.4f}\s+{step8:.4f}\s+1.00e-02  > tol$", proc.stdout, re.M)


@pytest.mark.slow  # three reruns
def test_gpu_log_shows_losses_without_judging_them_unless_tol_is_given(tiny, tmp_path):
    step8 = float(re.search(r"^step:8/8 train_loss:(\S+) ", tiny["text"], re.M)[1])
    gpu = edited(tiny, tmp_path, "gpu.txt", (r"device: cpu ", "device: cuda:0 "),
                 (r"^cpu: .*$", "gpus: 1 x NVIDIA H200"),
                 (r"^(step:8/8 train_loss:)\S+", rf"\g<1>{step8 + 0.05:.4f}"))
    proc = run_verify(tiny, gpu, "--rerun", 8)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU log (1 x NVIDIA H200): a CPU rerun cannot reproduce its losses" in proc.stdout
    assert "train losses shown, not judged" in proc.stdout and "summary counts equal" in proc.stdout
    proc = run_verify(tiny, gpu, "--rerun", 8, "--tol", "0.01")
    assert proc.returncode == 1 and "--tol 0.01 given instead" in proc.stdout, proc.stdout + proc.stderr
    assert "train losses NOT reproduced within 0.01" in proc.stdout


def test_a_log_reruns_from_a_folder_outside_the_repository_with_gpt2s_tokenizer(tiny, tmp_path):
    # the rerun's code lies in a temp folder: GPT-2's encoder.json (the prefix-token table) must be found
    assert "data tokenizer: data/gpt2_bpe/encoder.json " in tiny["text"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_verify(tiny, tiny["log"], "--rerun", 2, cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "covers steps 0..2 of 8 only" in proc.stdout and "train losses reproduced within 0.0001" in proc.stdout
    # a tokenizer that is not GPT-2's is refused in one line naming the file
    bad = tmp_path / "bad_repo"
    shutil.copytree(tiny["tree"], bad, ignore=shutil.ignore_patterns("logs", "ckpt"))
    (bad / "data" / "gpt2_bpe" / "encoder.json").write_text("{}")
    proc = run_verify(dict(tiny, tree=bad), tiny["log"], "--rerun", 1, cwd=elsewhere)
    assert proc.returncode == 1 and "encoder.json: not GPT-2's encoder.json" in proc.stdout, proc.stdout + proc.stderr


def test_a_compiled_log_is_rerun_compiled_exactly_on_its_machine_and_an_edit_of_0_01_fails(compiled, tmp_path):
    """One compiled rerun of the log with step 2's train loss edited by 0.01: the val losses and step 1 are bitwise
    the log's, the edit fails at the print rounding's tolerance."""
    assert '"compile": true' in compiled["text"] and "compile: warm-up plan: 2 model graph keys" in compiled["text"]
    step2, val = float(re.search(r"^step:2/8 train_loss:(\S+) ", compiled["text"], re.M)[1]), compiled["val"]
    bad = edited(compiled, tmp_path, "compiled_edit.txt", (r"^(step:2/8 train_loss:)\S+", rf"\g<1>{step2 + 0.01:.4f}"))
    proc = run_verify(compiled, bad, "--rerun", 2, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [case] = [ln for ln in proc.stdout.splitlines() if ln.startswith("rerun: machine: ")]
    assert case.startswith("rerun: machine: compiled run, compiled rerun: same CPU model"), case
    assert "exact match expected" in case and " --compile " in proc.stdout and "eager" not in proc.stdout
    assert f"val_loss at step 2: logged {val}, rerun {val}, diff 0.00e+00" in proc.stdout, proc.stdout
    assert re.search(rf"^\s+2\s+{step2 + 0.01:.4f}\s+{step2:.4f}\s+1.00e-02  > tol$", proc.stdout, re.M), proc.stdout
    assert proc.stdout.endswith("FAILED\n")


@pytest.mark.slow  # a compiled and an eager rerun
def test_a_compiled_log_of_another_cpu_is_judged_with_the_drift_an_eager_rerun_measures(compiled, tmp_path):
    cpu = (r"^cpu: .*?  cores:", "cpu: Some Other CPU  cores:")
    val = float(compiled["val"])
    bad = edited(compiled, tmp_path, "other_cpu_edit.txt", cpu, (r"^(step:2/8 val_loss:)\S+", rf"\g<1>{val - 0.01:.4f}"))
    proc = run_verify(compiled, bad, "--rerun", 2)
    out = proc.stdout
    [case] = [ln for ln in out.splitlines() if ln.startswith("rerun: machine: ")]
    assert case.startswith("rerun: machine: compiled run, compiled rerun: different CPU model (Some Other CPU vs "), case
    assert "rerun (eager, to measure the drift): " in out and " --no-compile " in out
    # the tolerance printed is 1e-4 + 2 x the measured |compiled - eager| difference at the last val step, at
    # least DRIFT's growth
    drift = float(re.search(r"largest measured: val (\S+) at step", case)[1])
    tol = max(verify.PRINT_TOL + verify.MEASURED_FACTOR * drift, verify.PRINT_TOL + verify.DRIFT_PER_STEP * 2)
    if tol <= verify.DRIFT_CAP:  # judged: the edit of 0.01 fails (the compiled rerun is bitwise the log here)
        assert f"val_loss at step 2: logged {val - 0.01:.4f}, rerun {val:.4f}, diff 1.00e-02: NOT reproduced (tol " \
               f"{tol:.2e})" in out and proc.returncode == 1, out + proc.stderr
    else:  # a drift as large as an edit: said, never passed as reproduced
        assert "shown, not judged (the measured drift here is as large as an edit)" in out, out


def machine(cpu="Intel(R) Xeon(R) Processor", threads=1, world=1, device="cpu", gpus=None):
    return dict(device=device, world=world, cpu=cpu, threads=threads, gpus=gpus)


@pytest.mark.parametrize("logged, here, case", [
    ([machine()], machine(), "same"),
    ([machine(threads=1)], machine(threads=2), "thread count (1 vs 2)"),
    ([machine()], machine(cpu="AMD EPYC"), "CPU model (Intel(R) Xeon(R) Processor vs AMD EPYC)"),
    ([machine(world=2)], machine(), "process count (2 vs 1)"),
    ([machine(cpu=None, threads=None)], machine(), "CPU model (not recorded in the log)"),
    ([machine(), machine(cpu="AMD EPYC")], machine(), "CPU model (AMD EPYC vs Intel(R) Xeon(R) Processor)"),
    ([], machine(), "machine (the log records none)"),
    ([machine(device="cuda", cpu=None, threads=None, gpus="8 x NVIDIA B200")], machine(), "gpu"),
])
def test_judgement_names_the_case_and_its_tolerance(logged, here, case):
    text, tol = verify.judgement(logged, here)
    if case == "same":
        assert text.startswith("same CPU model") and tol(0) == tol(10 ** 6) == verify.PRINT_TOL
    elif case == "gpu":
        assert text.startswith("GPU log (8 x NVIDIA B200)") and tol is None
    else:
        assert text.startswith("different ") and case in text and tol == verify.DRIFT
    text, tol = verify.judgement(logged, here, tol=0.02)  # --tol replaces the tolerance, not the case
    assert "--tol 0.02 given instead" in text and tol(0) == tol(10 ** 6) == 0.02


def test_judgement_of_a_compiled_log_is_exact_on_its_machine_and_measured_elsewhere():
    text, tol = verify.judgement([machine()], machine(), compiled=True)
    assert text.startswith("compiled run, compiled rerun: same CPU model") and tol(10 ** 6) == verify.PRINT_TOL
    measured = verify.measure_drift(points((1, 7.0), (2, 6.0), (3, 5.0)), points((1, 7.0003), (2, 6.004), (3, 5.001)))
    text, tol = verify.judgement([machine(threads=1)], machine(threads=2), compiled=True, measured=measured)
    assert text.startswith("compiled run, compiled rerun: different thread count (1 vs 2): ") and tol is measured
    assert "train losses after step 1 shown, not judged" in text
    text, tol = verify.judgement([machine()], machine(cpu="AMD EPYC"), tol=0.02, compiled=True)
    assert "--tol 0.02 given instead" in text and tol(0) == tol(10 ** 6) == 0.02
    # an eager log: the second rerun ran at another thread count
    measured = verify.measure_drift(points((5, 8.9216), (10, 9.8757)), points((5, 8.9205), (10, 9.8744)), "1 - 2 threads")
    text, tol = verify.judgement([machine(cpu="AMD EPYC")], machine(), measured=measured)
    assert text.startswith("different CPU model (AMD EPYC vs ") and "by a rerun at another thread count" in text
    assert "|1 - 2 threads|" in text and tol is measured
    assert tol.train(5) == pytest.approx(1e-4 + 2 * 1.1e-3) and tol.train(10) == pytest.approx(1e-4 + 2 * 1.3e-3)
    lines = ["world_size: 1  device: cpu  compile: True  bf16: False\n"]  # an unset --compile, resolved on
    assert verify.was_compiled(lines, 0, {"compile": None}) and verify.was_compiled([], 0, {"compile": True})
    assert not verify.was_compiled([lines[0].replace("True", "False", 1)], 0, {"compile": None})
    text, tol = verify.judgement([machine(device="cuda", gpus="1 x NVIDIA H200")], machine(), compiled=True)
    assert text.startswith("GPU log (1 x NVIDIA H200)") and tol is None  # a GPU log is not judged at all


def test_measured_tolerance_is_twice_the_running_maximum_of_the_two_reruns_difference():
    rng = __import__("random").Random(0)
    train = {s: rng.uniform(0, 3e-3) for s in range(1, 30)}
    val = {0: 0.0, 10: 4e-4, 20: 3e-3, 29: 1e-3}
    tol = verify.MeasuredTolerance(train, val)
    for s in range(30):  # float64 reference: the largest difference at or before the step, per kind
        ref_t = max(1e-4 + 2 * max([d for k, d in train.items() if k <= s], default=0.0), 1e-4 + 5e-5 * s)
        ref_v = max(1e-4 + 2 * max([d for k, d in val.items() if k <= s], default=0.0), 1e-4 + 5e-5 * s)
        assert tol.train(s) == pytest.approx(min(ref_t, verify.DRIFT_CAP), abs=1e-15)
        assert tol(s) == pytest.approx(min(ref_v, verify.DRIFT_CAP), abs=1e-15)
        assert tol.judges_train(s) == (ref_t <= verify.DRIFT_CAP) and tol.judges_val(s) == (ref_v <= verify.DRIFT_CAP)
    assert tol.judges_val(19) and not tol.judges_val(20) and not tol.judges_val(29)  # the maximum is kept
    # wherever judged, an edit of 0.01 fails even against a drift of the tolerance the other way
    assert all(0.01 - tol(s) > tol(s) for s in range(30) if tol.judges_val(s))
    ok, report = verify.compare_val(SimpleNamespace(val=[dict(step=20, val_loss=5.0)]),
                                    SimpleNamespace(val=[dict(step=20, val_loss=5.05)]), 20, tol)
    assert ok and report[0].endswith("shown, not judged (the measured drift here is as large as an edit)")


def test_drift_tolerance_grows_with_the_step_and_keeps_an_edit_of_0_01_failing():
    tol = verify.DRIFT
    steps = range(0, 100_000, 7)
    assert tol(0) == verify.PRINT_TOL and all(tol(a) <= tol(b) for a, b in zip(steps, steps[1:]))
    # worst case: the runs drift tol(s) apart in one direction and the edit goes the other way
    assert all(0.01 - tol(s) > tol(s) for s in steps)
    assert verify.same_loss(7.2512, 7.2512 + 0.9 * tol(40), tol(40))
    assert not verify.same_loss(7.2512, 7.2512 + 0.01 - tol(40), tol(40))
    last = tol.last_train_step
    assert tol.judges_train(last) and not tol.judges_train(last + 1)
    assert tol(last) <= verify.DRIFT_CAP < tol(last) + 1e-4


def points(*rows):
    """A stand-in for compare.Run with train points ``(step, train_loss)``."""
    return SimpleNamespace(train=[dict(step=s, train_loss=x, tokens=s, flops=s) for s, x in rows], val=[])


def test_train_losses_past_the_drift_cap_are_shown_not_judged():
    last = verify.DRIFT.last_train_step
    logged = points((last, 7.0), (last + 10, 7.0))
    ok, report = verify.compare_train(logged, points((last, 7.003), (last + 10, 7.05)), last + 10, verify.DRIFT)
    assert ok, report
    assert report[-1].endswith(f"(1 step(s) compared, 1 after step {last} shown, not judged)")
    assert report[2].endswith("5.00e-02  (not judged)")
    ok, report = verify.compare_train(logged, points((last, 7.01), (last + 10, 7.0)), last + 10, verify.DRIFT)
    assert not ok and report[1].endswith("1.00e-02  > tol") and "train losses NOT reproduced" in report[-1]
    ok, report = verify.compare_train(logged, points((last, 7.0), (last + 10, 7.0)), last + 10, None)
    assert ok and report[-1] == "rerun: train losses shown, not judged (2 step(s))"
    ok, report = verify.compare_train(logged, points((last, 7.0)), last + 10, verify.Tolerance(0.1))
    assert not ok and "missing" in report[2]


def test_machines_reads_every_start_of_a_log():
    lines = ["world_size: 1  device: cpu  compile: False  bf16: False\n",
             "cpu: Intel(R) Xeon(R) Processor  cores: 2  torch threads: 1\n",
             "step:1/8 train_loss:10.8258 train_time:1ms step_avg:1.00ms\n",
             "world_size: 8  device: cuda:0  compile: True  bf16: True\n", "gpus: 8 x NVIDIA B200\n"]
    assert verify.machines(lines) == [machine(), machine(device="cuda", world=8, cpu=None, threads=None,
                                                      gpus="8 x NVIDIA B200")]


# ----------------------------------------------------------------------------------------------
# the snapshot's file list comes from the logged code, not from a copy in verify.py

def test_snapshot_names_come_from_the_logged_train_gpt():
    listing = 'SOURCE_FILES = ("train_gpt.py", "aurora_opt.py", "extra.py")\n'
    assert verify.snapshot_names({"train_gpt.py": listing}, ["train_gpt.py", "aurora_opt.py"]) == \
        ["train_gpt.py", "aurora_opt.py", "extra.py"]
    # no readable list: the headers' files (and the entry point) are all that is known
    assert verify.snapshot_names({"train_gpt.py": "x = (\n"}, ["train_gpt.py", "a.py"]) == ["train_gpt.py", "a.py"]
    assert verify.snapshot_names({}, ["aurora_opt.py"]) == ["train_gpt.py", "aurora_opt.py"]


def test_a_file_the_logged_code_snapshots_but_the_log_lacks_is_missing():
    code = 'SOURCE_FILES = ("train_gpt.py", "aurora_opt.py", "extra.py")\n'
    b = "print('hi')\n"
    log = [f"### file train_gpt.py lines=1 sha256={hashlib.sha256(code.encode()).hexdigest()}\n", code,
           f"### file aurora_opt.py lines=1 sha256={hashlib.sha256(b.encode()).hexdigest()}\n", b,
           "=" * 100 + "\n", "python: 3\n"]
    sources, problems, rest = verify.extract(log)
    assert set(sources) == {"train_gpt.py", "aurora_opt.py"} and rest == 4
    assert problems == ["extra.py: missing from the snapshot"]


def test_threads_below_one_is_an_argument_error(tiny):
    proc = run_verify(tiny, tiny["log"], "--rerun", 1, "--threads", 0)
    assert proc.returncode == 2 and "--threads must be >= 1 (got 0)" in proc.stderr and "rerun:" not in proc.stdout


# ----------------------------------------------------------------------------------------------
# hostile input: nothing left behind, one line naming the flag or file


@pytest.mark.slow  # two reruns
def test_a_failed_rerun_leaves_no_temp_dir_and_keep_keeps_its_code_and_log(tiny, tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    forged = edited(tiny, tmp_path, "forged.txt", (r"^(step:1/8 train_loss:)\S+", r"\g<1>9.9999"))
    proc = run_verify(tiny, forged, "--rerun", 1, tmpdir=temp)
    assert proc.returncode == 1 and "train losses NOT reproduced" in proc.stdout, proc.stdout + proc.stderr
    assert "rerun: temp dir removed; pass --keep DIR to keep the rerun's code and log" in proc.stdout
    assert verify_dirs(temp) == []
    kept = tmp_path / "kept"
    proc = run_verify(tiny, forged, "--rerun", 1, "--keep", kept, tmpdir=temp)
    assert proc.returncode == 1 and f"rerun: code and log kept in {kept}" in proc.stdout
    assert verify_dirs(temp) == [] and {"train_gpt.py", "aurora_opt.py", "verify.txt"} <= set(os.listdir(kept))
    assert re.search(r"^step:1/8 train_loss:", (kept / "verify.txt").read_text(), re.M)
    # a trainer that stops at once (no data where the rerun runs): still nothing left
    proc = run_verify(tiny, tiny["log"], "--rerun", 1, "--train-files", tmp_path / "none_*.bin", tmpdir=temp)
    assert proc.returncode == 1 and f"exited with 2 (run from --run-dir {REPO}" in proc.stdout
    assert "no file matches" in proc.stdout and verify_dirs(temp) == []


def verify_dirs(folder):
    """verify.py's temp dirs in ``folder`` (torch may keep its own cache there)."""
    return [n for n in os.listdir(folder) if n.startswith("verify_")]


def _processes_naming(text):
    """Pids of the processes whose command line contains ``text``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_a_rerun_is_one_line_and_leaves_no_temp_dir_or_process(tiny, tmp_path, sig):
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(subprocess_env(), OMP_NUM_THREADS="1", TMPDIR=str(temp))
    # SIGINT back to its default in the child: a shell running the tests in the background
    # (``pytest &``) passes SIGINT on as ignored, and Python then never turns it into Ctrl-C
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "records", "verify.py"), str(tiny["log"]),
                             "--repo", str(tiny["tree"]), "--rerun", "8"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not any(_processes_naming(f"{temp}/verify_")):  # the trainer is running
        time.sleep(0.05)
    assert _processes_naming(f"{temp}/verify_"), "the rerun never started"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["verify.py: interrupted: no verdict; the rerun, if one was running, was "
                                        "stopped and its temp dir removed"]
    assert verify_dirs(temp) == []
    deadline = time.time() + 10
    while time.time() < deadline and _processes_naming(f"{temp}/verify_"):
        time.sleep(0.1)
    assert _processes_naming(f"{temp}/verify_") == []


def test_bad_paths_are_one_line_naming_the_flag_or_file(tiny, tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")  # reading it would wait for a writer forever
    (tmp_path / "a_file").write_text("x")
    log, fix = str(tiny["log"]), "pass a run log (<log-dir>/<run_id>.txt, written by train_gpt.py)"
    cases = [
        ([tmp_path / "pipe.txt"], f"{tmp_path / 'pipe.txt'}: not a regular file (a folder, FIFO or device); {fix}"),
        ([tmp_path], f"{tmp_path}: not a regular file (a folder, FIFO or device); {fix}"),
        ([tmp_path / "none.txt"], f"{tmp_path / 'none.txt'}: no such file; {fix}"),
        ([log, "--rerun", 1, "--run-dir", tmp_path / "none"],
         f"--run-dir {tmp_path / 'none'}: no such folder; pass the folder the run was launched from"),
        ([log, "--rerun", 1, "--keep", tmp_path / "a_file"],
         f"--keep {tmp_path / 'a_file'}: exists and is not a folder; pass a folder (created if missing)"),
    ]
    for args, message in cases:
        proc = run_verify(tiny, *args, tmpdir=tmp_path, timeout=60)  # reading the FIFO would never end
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"verify.py: error: {message}"), line
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "records", "verify.py"), log, "--repo",
                           tmp_path / "a_file"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (f"verify.py: error: --repo {tmp_path / 'a_file'}: not a "
                                                            "folder; pass a checkout of this repository")
    proc = run_verify(tiny, log, "--keep", tmp_path / "k")
    assert proc.returncode == 2 and f"--keep {tmp_path / 'k'}: keeps a rerun's code and log; add --rerun K" \
        in proc.stderr


@pytest.mark.parametrize("args, flags", [
    (["--tol", "0.1"], "--tol applies"),
    (["--threads", "2", "--train-files", "x_*.bin"], "--train-files, --threads apply"),
    (["--val-files", "x_*.bin"], "--val-files applies"),
    (["--run-dir", "."], "--run-dir applies"),
])
def test_rerun_only_flags_without_rerun_are_one_error_line(tiny, args, flags):
    proc = run_verify(tiny, tiny["log"], *args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"verify.py: error: {flags} to --rerun only and would be ignored without it; add "
                           "--rerun K or leave "), line


@pytest.mark.parametrize("flag", ["--extract", "--keep", "--train-files", "--val-files", "--run-dir"])
def test_an_empty_path_is_one_error_line_not_the_default(tiny, flag):
    proc = run_verify(tiny, tiny["log"], "--rerun", 1, f"{flag}=", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"verify.py: error: {flag} '': an empty path; pass a "
                                   f"{'glob' if 'files' in flag else 'folder'} or leave {flag} out")


def config_line_number(path):
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.startswith("config: {"))


@pytest.mark.parametrize("name, sub, says", [
    ("not_json.txt", (r'^(config: \{.*"num_iterations": \d+),', r"\1"),
     "the config line is not valid JSON (Expecting ',' delimiter at column "),
    ("missing.txt", (r'^(config: \{.*)"num_iterations": \d+, ', r"\1"),
     "the config line lacks num_iterations, which the logged code's Config has (a rerun would take its default)"),
    ("unknown.txt", (r"^config: \{", 'config: {"zeta": 1, "alpha": 2, '),
     "the config line has alpha, zeta, which the logged code's Config lacks (a rerun would ignore them)"),
    ("null.txt", (r'^(config: \{.*"num_iterations": )\d+', r"\1null"),
     "the config line holds null for num_iterations, which the logged code never writes (a rerun would take its "
     "default)"),
])
def test_a_damaged_config_line_is_one_error_line_naming_the_log_line_and_what_is_wrong(tiny, tmp_path, name, sub,
                                                                                      says):
    bad = edited(tiny, tmp_path, name, sub)
    proc = run_verify(tiny, bad, "--rerun", 1, tmpdir=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == (f"verify.py: error: {bad}: line {config_line_number(bad)}: {says}" + line.split(says, 1)[1]), line
    assert line.endswith("; restore the log's original copy (a rerun needs the config the run was made with)")
    assert verify_dirs(tmp_path) == []  # refused before any rerun


def test_a_not_json_config_line_names_the_column_of_the_fault(tiny, tmp_path):
    bad = edited(tiny, tmp_path, "bad.txt", (r'^(config: \{.*"num_iterations": \d+),', r"\1"))
    line = bad.read_text().splitlines()[config_line_number(bad) - 1]
    column = int(re.search(r"at column (\d+)\)", run_verify(tiny, bad, "--rerun", 1, timeout=120).stderr)[1])
    assert line[column - 1:].startswith('"') and line[:column - 1].rstrip().endswith(re.search(
        r'"num_iterations": \d+', line)[0])  # the 1-based column of the key after its value, where ',' is missing


def test_a_rerun_shorter_than_the_logs_train_loss_interval_names_the_k_that_works():
    """The study's logs write a train loss every 5 steps: --rerun 2 has nothing to compare, and says which K has."""
    log = os.path.join(REPO, "records", "cpu", "2026-12-03_small_scale_89", "baseline89", "baseline89_o0_seed0.txt")
    proc = run_verify(dict(tree=REPO), log, "--rerun", 2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no train_loss line of steps 1..2 in both logs to compare; the log's first is at step 5: pass --rerun 5 " \
           "or more" in proc.stdout, proc.stdout[-2000:]


def test_a_log_of_the_lean_trainer_reruns_and_verify_reads_its_lines(tiny):
    """The log of today's trainer (the tiny fixture): the header lines verify and compare read, and a full rerun."""
    lines = verify.read_log_lines(tiny["log"])
    sources, problems, rest = verify.extract(lines)
    assert problems == [] and list(sources) == list(__import__("harness").SOURCE_FILES)
    head = [ln.split(":", 1)[0] for ln in lines[rest + 1:] if not ln.startswith(("step:", "compile:"))][:16]
    assert {"python", "world_size", "command", "git", "preset", "config", "data train", "data val",
            "data tokenizer", "model"} <= set(head), head
    assert [k for k, _ in verify.data_fingerprints(lines, rest)] == ["data train"] * 3 + ["data val", "data tokenizer"]
    assert verify.logged_config(lines, rest, sources)["model"] == "tiny"
    assert lines[-1].startswith("status:complete") and any(ln.startswith("summary: final_val_loss:") for ln in lines)
    run = verify.parse_lines(lines)
    assert [p["step"] for p in run.val] == [0, 8] and len(run.train) == 8
    assert all(p["phase"] == 2 and p["tokens"] > 0 for p in run.train) and run.val[-1]["flops"] == run.flops > 0
