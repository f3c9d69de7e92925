"""bench/small_scale.py: the analysis behind the README's results table (no training here)."""
import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ss():
    spec = importlib.util.spec_from_file_location("small_scale", os.path.join(REPO, "bench", "small_scale.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dense_crossing(xs, ys, target, n=200001):
    """Reference: sample the piecewise-linear curve densely, first sample at or below target."""
    grid = np.linspace(xs[0], xs[-1], n)
    vals = np.interp(grid, xs, ys)
    hit = np.nonzero(vals <= target)[0]
    return None if len(hit) == 0 else grid[hit[0]]


def test_crossing_matches_dense_interpolation(ss):
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        xs = np.cumsum(rng.uniform(0.5, 2.0, size=6))
        ys = 10 - np.cumsum(rng.uniform(-0.3, 1.0, size=6))  # mostly falling, sometimes up
        target = rng.uniform(ys.min() - 0.5, ys.max())
        got, ref = ss.crossing(list(xs), list(ys), target), dense_crossing(xs, ys, target)
        if ref is None:
            assert got is None
        else:
            assert got is not None and abs(got - ref) <= 2 * (xs[-1] - xs[0]) / 200000
            checked += 1
    assert checked > 100


def _run(final, vals, steps=(0, 10, 20)):
    val = [dict(step=s, val_loss=v, train_time_ms=100.0 * s, flops=1e9 * s, tokens=64 * s) for s, v in zip(steps, vals)]
    return dict(status="complete", final_val_loss=final, train_time_ms=100.0 * steps[-1], flops=1e9 * steps[-1],
                raw_tokens=64 * steps[-1], log=dict(val=val))


def test_analyse_pooled_noise_deltas_and_ratios(ss):
    runs = {
        "adamw": [_run(8.0, [11, 9, 8.0]), _run(8.2, [11, 9, 8.2])],
        "aurora": [_run(7.0, [11, 8, 7.0]), _run(7.1, [11, 8, 7.1]), _run(6.9, [11, 8, 6.9])],
        "muon": [_run(8.15, [11, 9.5, 8.15])],
    }
    stats = {k: ss.arm_stats(v) for k, v in runs.items()}
    noise = ss.analyse(stats, corpus=640)
    # pooled variance by hand: (1 dof * var(adamw) + 2 dof * var(aurora)) / 3
    v_a, v_b = np.var([8.0, 8.2], ddof=1), np.var([7.0, 7.1, 6.9], ddof=1)
    assert noise["dof"] == 3
    assert noise["pooled_std"] == pytest.approx(math.sqrt((v_a + 2 * v_b) / 3), rel=1e-12)
    assert noise["threshold"] == pytest.approx(2 * noise["pooled_std"])
    d, word = stats["aurora"]["delta_adamw"]
    assert d == pytest.approx(7.0 - 8.1) and word == "better"
    assert stats["muon"]["delta_adamw"][1] == "no measurable difference"  # |8.15 - 8.1| < 2 x pooled std
    # aurora's mean curve runs linearly from (step 0, 11) to (step 10, 8): adamw's mean final loss 8.1
    # is reached at step 10 * (11 - 8.1) / 3, of adamw's 20 steps
    assert stats["aurora"]["flops_to_base"] == pytest.approx(1e9 * 10 * 2.9 / 3 / (1e9 * 20))
    assert stats["aurora"]["time_to_base"] == pytest.approx(100 * 10 * 2.9 / 3 / (100 * 20))
    assert stats["adamw"]["flops_to_base"] == pytest.approx(1.0)
    assert stats["muon"]["flops_to_base"] is None and stats["muon"]["seeds_reaching_base"] == 0
    assert stats["aurora"]["epochs"] == pytest.approx(64 * 20 / 640)


def test_read_log_ignores_snapshot_and_keeps_last_val_per_step(ss, tmp_path):
    log = tmp_path / "r.txt"
    log.write_text("\n".join([
        "### train_gpt.py sha256=00",
        "step:5/9 val_loss:1.0 train_time:1ms",  # inside the snapshot: not a val point
        "=" * 100,
        'config: {"seed": 3}',
        "step:0/9 val_loss:10.5 train_time:0ms step_avg:0.00ms phase:1 tokens:0 positions:0 flops:0.000e+00",
        "step:3/9 val_loss:9.5 train_time:30ms step_avg:10.00ms phase:1 tokens:96 positions:24 flops:3.0e+06",
        "step:3/9 val_loss:9.25 train_time:31ms step_avg:10.00ms phase:1 tokens:96 positions:24 flops:3.0e+06",
        "status:incomplete (interrupted)",
    ]) + "\n")
    out = ss.read_log(str(log))
    assert out["config"] == {"seed": 3}
    assert out["status"] == "incomplete"
    assert [(p["step"], p["val_loss"], p["flops"], p["tokens"]) for p in out["val"]] == [
        (0, 10.5, 0.0, 0), (3, 9.25, 3.0e6, 96)]


def test_run_all_keeps_order_with_parallel_jobs(ss, monkeypatch):
    import threading
    import time
    seen = set()

    def fake_train(argv, run_dir, run_id, ledger):
        seen.add(threading.get_ident())
        time.sleep(0.05 * (5 - int(run_id)))  # later jobs finish first
        return dict(run_id=run_id)

    monkeypatch.setattr(ss, "train", fake_train)
    out = ss.run_all([([], "d", str(i)) for i in range(5)], dict(jobs=2))
    assert [o["run_id"] for o in out] == ["0", "1", "2", "3", "4"]
    assert len(seen) == 2


def test_dry_run_prints_every_arm(tmp_path):
    res = subprocess.run([sys.executable, "bench/small_scale.py", "--dry-run", "--out", str(tmp_path / "o")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for arm in ("adamw", "muon", "aurora", "aurora_tst_s8", "aurora_tst_r0.4", "aurora_tst_output"):
        assert f"--run-id {arm}_seed0" in res.stdout
    assert "--tst-mode output" in res.stdout and "--tst-bag-size 8" in res.stdout


def test_unknown_arm_is_named(tmp_path):
    res = subprocess.run([sys.executable, "bench/small_scale.py", "--arms", "adamw,lion", "--dry-run",
                          "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "lion" in res.stderr and "--arms" in res.stderr


@pytest.mark.parametrize("args, says", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--adamw-lrs", "0.004,"], "--adamw-lrs"),
    (["--aurora-lrs", "nan"], "finite and > 0"),
    (["--arms", "adamw,adamw"], "repeated"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--train-files", "README.md"], "not a token shard"),
    (["--trainer-args", "--tst-frac 2"], "--tst-frac must be in [0, 1)"),
])
def test_bad_arguments_stop_before_anything_runs(tmp_path, args, says):
    res = subprocess.run([sys.executable, "bench/small_scale.py", "--out", str(tmp_path / "o"), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and says in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()
