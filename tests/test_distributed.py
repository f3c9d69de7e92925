"""torchrun on CPU (gloo): 2 processes train as 1 process with accumulation, a 2-process run stopped and resumed
repeats itself bit for bit, a signal to one rank stops every rank after the same step, a failing rank stops the
others quickly, a batch the processes cannot split is refused before anything is written."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, TORCHRUN, loss_lines, read_log, run_torchrun, subprocess_env, tiny_args

WORKER = os.path.join(REPO, "tests", "dist_train_worker.py")  # train_gpt.main, --model able to name the tiny one
ENV = dict(subprocess_env(), OMP_NUM_THREADS="1")  # torchrun's workers: one thread each; the single process too (the
# thread count changes the summation order of CPU matmuls: differences of ~1e-6 that training grows)


def dist_args(tmp_path, run_id, *extra):
    """The tiny run at 2 sequences a step (one per process of 2), TST phase 1 over steps 0-2, no val in between."""
    return tiny_args(tmp_path, "--batch-tokens", "384", "--tst-frac", "0.4", "--val-every", "0", "--run-id", run_id,
                     "--dist-timeout", "60", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``one``: 1 process, 2 micro-batches a step; ``two``: 2 processes; ``s``: 2 processes, rank 0 alone sent SIGTERM
    during step 3 (tests/dist_stop_worker.py: the ranks agree at the train-loss lines, every 4 steps), then resumed.
    The single process runs beside the first launch."""
    tmp = tmp_path_factory.mktemp("dist")
    with open(tmp / "one.err", "w") as err:  # a file, not a pipe: it cannot block on a full pipe
        one = subprocess.Popen([sys.executable, WORKER, *dist_args(tmp, "one")], stdout=subprocess.DEVNULL,
                               stderr=err, env=ENV, cwd=tmp)
    run_torchrun([WORKER, *dist_args(tmp, "two")], ENV, cwd=tmp, run_ids=["two"])
    assert one.wait(timeout=600) == 0, (tmp / "one.err").read_text()[-3000:]
    stop = os.path.join(REPO, "tests", "dist_stop_worker.py")
    proc = subprocess.run([*TORCHRUN, stop, str(tmp / "stop"), *dist_args(tmp, "s", "--log-every", "4",
                                                                          "--save-every", "1000")],
                          capture_output=True, text=True, env=ENV, cwd=tmp, timeout=600)
    stopped = read_log(tmp / "logs", "s")
    run_torchrun([WORKER, *dist_args(tmp, "s", "--save-every", "1000", "--resume", "auto")], ENV, cwd=tmp)
    return tmp, proc, stopped


def test_two_processes_match_one_process_with_accumulation(runs):
    logs = runs[0] / "logs"
    a, b = (json.loads((logs / f"{r}.json").read_text()) for r in ("one", "two"))
    assert (a["world_size"], b["world_size"]) == (1, 2) and a["raw_tokens"] == b["raw_tokens"]
    assert "; 2 micro-batch(es) x 1 sequence(s) x 1 process(es) a step" in read_log(logs, "one")
    text = read_log(logs, "two")
    assert "world_size: 2" in text and "; 1 micro-batch(es) x 1 sequence(s) x 2 process(es) a step" in text
    assert "\nlauncher: torchrun, world size 2\n" in text and "tst_switch: step 3" in text
    one, two = loss_lines(read_log(logs, "one")), loss_lines(text)
    assert sorted(one) == sorted(two) == list(range(1, 9))
    for step, loss in one.items():
        assert abs(loss - two[step]) <= 1e-5 * abs(loss), (step, loss, two[step])
    assert abs(a["final_val_loss"] - b["final_val_loss"]) <= 1e-5 * a["final_val_loss"]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(runs):
    """Rank 0 alone gets SIGTERM during step 3; the ranks agree (a MAX all-reduce) at the train-loss lines, every
    --log-every 4 steps: both stop after step 4, checkpoint it and exit 130."""
    tmp, proc, stopped = runs
    ranks = [json.loads((tmp / f"stop.{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in ranks] == [130, 130], proc.stderr[-3000:]
    assert [r["checks"] for r in ranks] == [[4], [4]]  # one agreement, at the first train-loss line after it
    assert stopped.splitlines()[-1] == "status:interrupted reason:SIGTERM after step 4; resume with --resume auto " \
                                       "--run-id s", stopped[-1000:]
    assert sorted(loss_lines(stopped)) == [4] and os.listdir(tmp / "ckpt" / "s") == ["step_000004.pt"]


def test_a_two_process_run_stopped_and_resumed_repeats_the_unbroken_run_bit_for_bit(runs):
    tmp = runs[0]
    straight, resumed = read_log(tmp / "logs", "two"), read_log(tmp / "logs", "s")
    assert "\nresume: from step 4 " in resumed and resumed.splitlines()[-1] == "status:complete"
    assert loss_lines(resumed) == {s: v for s, v in loss_lines(straight).items() if s in (4, 5, 6, 7, 8)}
    assert loss_lines(resumed, "val_loss") == loss_lines(straight, "val_loss")  # steps 0 and 8
    assert json.loads((tmp / "logs" / "s.json").read_text())["status"] == "complete"


def test_one_failing_rank_stops_every_rank_quickly_and_marks_the_log(tmp_path):
    worker = os.path.join(REPO, "tests", "dist_fail_worker.py")
    start = time.time()
    out = subprocess.run([*TORCHRUN, worker, *dist_args(tmp_path, "fail")], capture_output=True, text=True, env=ENV,
                         cwd=tmp_path, timeout=600)
    assert out.returncode != 0 and time.time() - start < 120  # seconds, not the process group's timeout
    assert "train_gpt.py: error: fake_train_000002.bin: injected read failure; re-download it\n" in out.stderr
    last = read_log(tmp_path / "logs", "fail").splitlines()[-1]
    assert last.startswith("status:incomplete reason:"), last  # rank 0's: its collective lost the other rank
    assert json.loads((tmp_path / "logs" / "fail.json").read_text())["status"] == "incomplete"


def test_a_micro_batch_the_processes_cannot_split_is_refused_before_anything_is_written(tmp_path):
    out = subprocess.run([*TORCHRUN, WORKER, *dist_args(tmp_path, "bad", "--micro-batch-seqs", "3")],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert out.returncode != 0  # plain torchrun exits 1 when a worker fails (run.sh's launcher: test_nothing_lost)
    line = ("train_gpt.py: error: 2 process(es) x --micro-batch-seqs 3 do not divide a step's 2 sequence(s) "
            "(--batch-tokens / (3 x --seq-len)); run 1 or 2 process(es) with --micro-batch-seqs 1 (run.sh's NPROC, "
            "torchrun's --nproc_per_node), or --micro-batch-seqs 1\n")
    assert out.stderr.startswith(line) and line not in out.stderr[len(line):], out.stderr  # rank 0's line alone
    assert 'train_gpt.py", line' not in out.stderr and "[rank" not in out.stderr  # no trainer traceback
    assert not (tmp_path / "logs").exists()


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
    args = [str(tmp_path / "w.py"), str(tmp_path), mode]
    with pytest.warns(UserWarning, match="(?s)relaunched once:.*rank 1 gives up"):
        if mode == "once":
            run_torchrun(args, ENV, cwd=tmp_path, run_ids=["r"])
        else:
            with pytest.raises(AssertionError, match="rank 1 gives up"):
                run_torchrun(args, ENV, cwd=tmp_path, run_ids=["r"])
    assert not (tmp_path / "logs" / "r.txt").exists()  # the aborted launch's run files went before the relaunch
