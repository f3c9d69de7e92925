"""bench/gpu_check.py --dry-run: the one-shot GPU check runs end to end on CPU and reports sane numbers."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env

sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    with open(out / "gpu_check.json", encoding="utf-8") as f:
        result = json.load(f)
    return proc, result, out


def test_dry_run_exits_zero_and_prints_the_table(dry_run):
    proc, _, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary" in proc.stdout
    for row in ("ms/step (mean / median)", "projected train time", "latent positions/s", "PASS"):
        assert row in proc.stdout
    # both columns of the correctness check are printed
    assert "cpu (ref)" in proc.stdout and "train_loss        5" in proc.stdout


def test_dry_run_json_has_the_expected_keys_and_plausible_values(dry_run):
    _, r, out = dry_run
    assert r["schema"] == gpu_check.SCHEMA and r["exit_code"] == 0 and r["status"] == "ok"
    assert r["errors"] == []
    for key in ("env", "microbench", "correctness", "timing", "summary_table", "wall_s"):
        assert r[key] is not None, key
    assert r["env"]["torch"] and r["env"]["device"] == "cpu"
    assert r["microbench"]["matmul"]["tflops"] > 0 and r["microbench"]["copy"]["gbps"] > 0
    c = r["correctness"]
    assert c["passed"] is True and c["max_abs_diff"] == 0.0  # CPU vs CPU is bit for bit
    assert sum(row["what"] == "train_loss" for row in c["rows"]) == 5
    t = r["timing"]
    assert t["switch_step"] == 3 and t["steps_logged"] == 6 and t["problems"] == []
    for name in ("phase1", "phase2"):
        p = t[name]
        assert p["ms_per_step"] > 0 and p["positions_per_s"] > 0 and p["raw_tokens_per_s"] > 0
        assert p["flops_per_step"] == t["flops_per_step"] > 0
        assert 0 < p["mfu_measured"]
    # TST phase 1 reads s = 4 raw tokens per latent position, phase 2 one
    assert t["phase1"]["raw_tokens_per_step"] == 4 * t["phase1"]["positions_per_step"]
    assert t["phase2"]["raw_tokens_per_step"] == t["phase2"]["positions_per_step"]
    pj = t["projection"]
    assert (pj["num_iterations"], pj["phase1_steps"], pj["phase2_steps"]) == (120, 36, 84)  # cpu_smoke: r = 0.3
    expected = 36 * t["phase1"]["ms_per_step"] + 84 * t["phase2"]["ms_per_step"]
    assert pj["projected_train_time_ms"] > 0 and abs(pj["projected_train_time_ms"] - expected) <= 1
    assert t["peak_memory_mib"] > 0
    assert (out / "gpu_check_summary.txt").exists() and (out / "logs" / "timing.txt").exists()
    assert not (out / "synthetic_data").exists()  # removed without --keep-data


def test_log_parsing_and_phase_stats():
    text = "\n".join([
        "def f():  # source snapshot: nothing here is a step line",
        "    return 'step:1/4 train_loss:1.0000 train_time:1ms step_avg:1.00ms'",
        gpu_check.SEPARATOR,
        "compile: warm-up of 2 phase graph(s) took 51234ms (not in train_time)",
        "step:0/4 val_loss:10.0000 train_time:0ms step_avg:0.00ms phase:1 val_loss_tst:11.0000 tokens:0",
        "step:1/4 train_loss:9.0000 train_time:300ms step_avg:300.00ms phase:1 tokens:400 positions:100",
        "step:2/4 train_loss:8.0000 train_time:400ms step_avg:200.00ms phase:1 tokens:800 positions:200",
        "tst_switch: step 2: phase 1 -> 2",
        "step:3/4 train_loss:7.0000 train_time:450ms step_avg:150.00ms phase:2 tokens:900 positions:300",
        "step:4/4 train_loss:6.0000 train_time:500ms step_avg:125.00ms phase:2 tokens:1000 positions:400",
        "status:complete",
    ])
    p = gpu_check.parse_log(text)
    assert [r["step"] for r in p["train"]] == [1, 2, 3, 4]
    assert p["compile_ms"] == 51234 and p["n_compiled_phases"] == 2 and p["switch_step"] == 2
    assert p["val"] == [dict(step=0, loss=10.0, loss_tst=11.0)] and p["status"] == "complete"
    rows = gpu_check.step_times(p["train"])
    assert [round(r["ms"]) for r in rows] == [300, 100, 50, 50]
    s1 = gpu_check.phase_stats(rows, 1, flops_per_step=1e12, matmul_tflops=100.0, nominal_tflops=None)
    assert s1["ms_per_step"] == 200 and not s1["first_step_dropped"]  # fewer than 3 steps: nothing dropped
    assert s1["raw_tokens_per_step"] == 400 and s1["positions_per_s"] == 500
    assert s1["achieved_tflops"] == 5.0 and s1["mfu_measured"] == 0.05
    rows = [dict(step=i, phase=1, ms=ms, tokens=4, positions=1) for i, ms in enumerate([900, 100, 110, 90], 1)]
    s = gpu_check.phase_stats(rows, 1, 0, None, None)
    assert s["first_step_dropped"] and s["ms_per_step"] == 100 and s["steps_used"] == 3
    assert gpu_check.phase_stats(rows, 2, 0, None, None) is None


def test_correctness_comparison_flags_a_difference_and_a_missing_value():
    run = lambda losses, rc=0: dict(rc=rc, val=[], train=[dict(step=i, loss=v) for i, v in enumerate(losses, 1)])  # noqa: E731
    rows, passed, diff = gpu_check.compare_losses(run([10.0, 9.0]), run([10.0, 9.0005]), tol=1e-3)
    assert passed and abs(diff - 5e-4) < 1e-9
    assert not gpu_check.compare_losses(run([10.0, 9.0]), run([10.0, 9.002]), tol=1e-3)[1]
    assert not gpu_check.compare_losses(run([10.0, 9.0]), run([10.0]), tol=1e-3)[1]
    assert not gpu_check.compare_losses(run([10.0]), run([10.0], rc=1), tol=1e-3)[1]
