"""torchrun on CPU (gloo): same dynamics as gradient accumulation, and loud, fast failure."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, TORCHRUN, read_log, run_torchrun, subprocess_env, tiny_args


def dist_args(tmp_path, run_id, *extra):
    """5 steps of 16 sequences, TST switch after step 2, no val in between."""
    return tiny_args(tmp_path, "--batch-tokens", "512", "--num-iterations", "5", "--tst-frac", "0.4",
                     "--val-every", "0", "--run-id", run_id, "--dist-timeout", "60", *extra)


def run(cmd, tmp_path, threads="1"):
    # torchrun gives each worker one thread; the single process must match, since the number of
    # threads changes the summation order of CPU matmuls (differences of ~1e-6 that training grows)
    env = dict(subprocess_env(), OMP_NUM_THREADS=threads)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_two_processes_match_one_process_with_accumulation(tmp_path):
    script = os.path.join(REPO, "train_gpt.py")
    # both runs at once (one thread each, as torchrun's workers): their start-ups overlap
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    with open(tmp_path / "one.err", "w") as err:  # a file, not a pipe: it cannot block on a full pipe
        one = subprocess.Popen([sys.executable, script, *dist_args(tmp_path, "one", "--micro-batch-seqs", "8")],
                               stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path)
    run_torchrun([script, *dist_args(tmp_path, "two", "--micro-batch-seqs", "8")], env, cwd=tmp_path, run_ids=["two"])
    assert one.wait(timeout=600) == 0, (tmp_path / "one.err").read_text()[-3000:]
    logs = tmp_path / "logs"
    a, b = (json.loads((logs / f"{r}.json").read_text()) for r in ("one", "two"))
    assert a["world_size"] == 1 and b["world_size"] == 2
    assert "grad accumulation 2 x 8 seqs x 1 processes" in read_log(logs, "one")
    text = read_log(logs, "two")
    assert "world_size: 2" in text and "grad accumulation 1 x 8 seqs x 2 processes" in text
    assert "tst_switch: step 2" in text
    assert [s for s, _ in a["train_losses"]] == [1, 2, 3, 4, 5]
    for (sa, la), (sb, lb) in zip(a["train_losses"], b["train_losses"]):
        assert sa == sb and abs(la - lb) <= 1e-5 * abs(la), (sa, la, lb)
    assert abs(a["final_val_loss"] - b["final_val_loss"]) <= 1e-5 * a["final_val_loss"]


def test_one_failing_rank_stops_every_rank_quickly_and_marks_the_log(tmp_path):
    worker = os.path.join(REPO, "tests", "dist_fail_worker.py")
    start = time.time()
    out = run([*TORCHRUN, worker, *dist_args(tmp_path, "fail", "--micro-batch-seqs", "8")], tmp_path)
    elapsed = time.time() - start
    assert out.returncode != 0
    assert elapsed < 120  # seconds, not the process-group timeout of a hung collective
    assert "error: rank 1: fake_train_000002.bin: injected read failure" in out.stderr
    text = read_log(tmp_path / "logs", "fail")
    last = text.splitlines()[-1]
    assert last.startswith("status:incomplete reason:rank 0:")
    assert json.loads((tmp_path / "logs" / "fail.json").read_text())["status"] == "incomplete"


def test_micro_batch_must_divide_the_global_batch(tmp_path):
    script = os.path.join(REPO, "train_gpt.py")
    out = run([*TORCHRUN, script, *dist_args(tmp_path, "bad", "--micro-batch-seqs", "3")], tmp_path)
    assert out.returncode != 0  # torchrun exits 1 when a worker fails, whatever the worker's code
    assert "--micro-batch-seqs 3 x 2 process(es) does not divide the 16 sequences" in out.stderr
    assert "use one of [1, 2, 4, 8]" in out.stderr
    assert not (tmp_path / "logs").exists()  # refused before any log was written


ABORT_ONCE = """import os, sys
marker = os.path.join(sys.argv[1], "aborted")
if os.environ["RANK"] == "1" and (sys.argv[2] == "always" or not os.path.exists(marker)):
    open(marker, "w").close()
    sys.stderr.write("rank 1 gives up\\n"); sys.stderr.flush()
    os.abort()
"""


@pytest.mark.parametrize("mode", ["once", "always"])
def test_run_torchrun_relaunches_a_sigabrt_once_with_a_warning_and_fails_the_second(tmp_path, mode):
    # the guard of every torchrun test that expects success (conftest.run_torchrun): once, never twice
    (tmp_path / "w.py").write_text(ABORT_ONCE)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "r.txt").write_text("left by the aborted launch")
    args, env = [str(tmp_path / "w.py"), str(tmp_path), mode], dict(subprocess_env(), OMP_NUM_THREADS="1")
    with pytest.warns(UserWarning, match="(?s)relaunched once:.*rank 1 gives up"):
        if mode == "once":
            run_torchrun(args, env, cwd=tmp_path, run_ids=["r"])
        else:
            with pytest.raises(AssertionError, match="rank 1 gives up"):
                run_torchrun(args, env, cwd=tmp_path, run_ids=["r"])
    assert not (tmp_path / "logs" / "r.txt").exists()  # the aborted launch's run files went before the relaunch
