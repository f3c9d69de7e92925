"""Checkpoints: a resumed run repeats the unbroken one bit for bit (float32 CPU) across the TST switch, a stage change
and the untie; a checkpoint holds what that needs; a resume whose config, data or file is not this run's is refused
in one line before anything is written; SIGINT/SIGTERM finishes the step, checkpoints, exits 130."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import harness as H
import train_gpt as T
from conftest import REPO, SAMPLE_DIR, SPECS, loss_lines, read_log, subprocess_env, tiny_args

TST = ("--tst-frac", "0.5")  # phase 1 over steps 0-3, the switch at 4; stages [0, 2), [2, 5), [5, 7), [7, 8); untie
# after step 5; val at steps 0, 4 and 8


def run(tmp_path, *extra):
    return T.main(tiny_args(tmp_path, *TST, *extra), models=SPECS)


def cfg_of(tmp_path, *extra):
    return H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path, *TST, *extra))[0]


def error_lines(err):
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("log: ")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unbroken run ``s``; run ``r`` stopped after step 3 (--max-steps, --save-final) and resumed (--resume auto,
    checkpoints every 3 steps: 6 too); run ``b`` from r's step-6 checkpoint under a new run id."""
    tmp = tmp_path_factory.mktemp("ckpt")
    assert run(tmp, "--run-id", "s") == 0
    assert run(tmp, "--run-id", "r", "--max-steps", "3", "--save-final") == 0
    first = (tmp / "logs" / "r.txt").read_text()
    assert run(tmp, "--run-id", "r", "--resume", "auto", "--save-every", "3") == 0
    assert run(tmp, "--run-id", "b", "--resume", str(tmp / "ckpt" / "r" / "step_000006.pt")) == 0
    return tmp, first


def test_a_run_stopped_and_resumed_repeats_the_unbroken_run_bit_for_bit(runs):
    tmp, first = runs
    straight, resumed = read_log(tmp / "logs", "s"), read_log(tmp / "logs", "r")
    assert "tst_switch: step 4" in straight and "tst_switch: step 4" in resumed  # the switch after the resume
    assert loss_lines(resumed) == loss_lines(straight) and sorted(loss_lines(straight)) == list(range(1, 9))
    assert loss_lines(resumed, "val_loss") == loss_lines(straight, "val_loss")
    assert sorted(loss_lines(straight, "val_loss")) == [0, 4, 8]
    # one log: the first part, its status, then the resume appended (no second snapshot)
    assert resumed.startswith(first) and first.splitlines()[-1] == "status:stopped_early reason:--max-steps 3"
    assert first.splitlines()[-2].startswith("summary: last_val_loss:")  # step 0's val loss is no final one
    assert resumed.count("### file train_gpt.py") == 1
    lines = resumed.splitlines()
    assert lines[len(first.splitlines())].startswith("python: ")  # the resumed start's header
    [resume] = [ln for ln in lines if ln.startswith("resume: ")]
    assert resume.startswith("resume: from step 3 train_time:"), resume
    assert lines[-1] == "status:complete" and lines[-2].startswith("summary: final_val_loss:")
    a, b = (json.loads((tmp / "logs" / f"{r}.json").read_text()) for r in ("s", "r"))
    assert (b["status"], b["steps"]) == ("complete", 8)
    for key in ("final_val_loss", "raw_tokens", "positions", "flops"):
        assert a[key] == b[key], key
    assert "last_val_loss" not in b  # step 0's val was only the last one before the end


def test_a_resume_after_the_untie_into_a_new_run_id_repeats_the_unbroken_run(runs):
    tmp, _ = runs
    straight, branch = read_log(tmp / "logs", "s"), read_log(tmp / "logs", "b")
    assert branch.startswith("### file train_gpt.py") and "\nconfig: {" in branch  # a full snapshot and header
    assert "\nresume: from step 6 " in branch and sorted(loss_lines(branch)) == [7, 8]
    assert loss_lines(branch) == {s: v for s, v in loss_lines(straight).items() if s > 6}
    assert loss_lines(branch, "val_loss") == {8: loss_lines(straight, "val_loss")[8]}


def test_a_checkpoint_holds_everything_a_resume_needs_and_no_temporary_file_is_left(runs):
    tmp, _ = runs
    folder = tmp / "ckpt" / "r"
    assert sorted(os.listdir(folder)) == ["step_000003.pt", "step_000006.pt"]  # --save-final's, --save-every's
    state = torch.load(folder / "step_000003.pt", weights_only=True)
    assert set(state) == {"config", "step", "run_id", "data", "counters", "model", "optimizers", "rank_buffers",
                          "loader_position", "rng"}
    assert state["step"] == 3 and state["run_id"] == "r" and len(state["optimizers"]) == 2
    assert state["config"] == json.loads(next(ln for ln in read_log(tmp / "logs", "r").splitlines()
                                              if ln.startswith("config: "))[8:])
    assert state["loader_position"] == state["counters"]["raw_tokens"]  # the stream position is the text read
    assert [fp for _, fp in state["data"]["train"]] == [H.fingerprint(f) for f, _ in state["data"]["train"]]
    assert not [n for d in (tmp / "ckpt", tmp / "logs") for _, _, names in os.walk(d) for n in names if ".tmp" in n]


def test_resume_auto_picks_the_highest_step_of_the_run_named_by_number(runs, tmp_path):
    tmp, _ = runs
    data = H.find_data(*[a for a in tiny_args(tmp) if a.endswith(".bin")])
    cfg = cfg_of(tmp, "--run-id", "r", "--resume", "auto")
    assert H.load_resume(cfg, data, T.OPERATIONAL)["path"] == str(tmp / "ckpt" / "r" / "step_000006.pt")
    ckpt = tmp_path / "ckpt" / "r"
    ckpt.mkdir(parents=True)
    for step in (4, 10):  # 10 > 4 as numbers (not as strings); the file times do not count
        os.symlink(tmp / "ckpt" / "r" / "step_000003.pt", ckpt / f"step_{step:06d}.pt")
    os.utime(ckpt / "step_000004.pt", (2_000_000_000, 2_000_000_000), follow_symlinks=False)
    cfg = cfg_of(tmp_path, "--run-id", "r", "--resume", "auto")
    assert H.load_resume(cfg, data, T.OPERATIONAL)["path"] == str(ckpt / "step_000010.pt")
    (tmp_path / "ckpt" / "q").mkdir()
    os.symlink(tmp / "ckpt" / "r" / "step_000003.pt", tmp_path / "ckpt" / "q" / "step_000002.pt")
    with pytest.raises(H.ConfigError, match=r"^--resume auto: checkpoints of several runs under .*; name the run "
                                            r"with --run-id"):
        H.load_resume(cfg_of(tmp_path, "--resume", "auto"), data, T.OPERATIONAL)


def refused(tmp_path, capsys, *extra):
    """The one stderr line of a refused start (exit 2) that wrote no log."""
    capsys.readouterr()
    assert run(tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "logs").exists()
    [line] = error_lines(err)
    assert line.startswith("train_gpt.py: error: --resume "), line
    return line


def test_a_resume_whose_config_differs_is_refused_naming_every_field(runs, tmp_path, capsys):
    ckpt = runs[0] / "ckpt" / "r" / "step_000003.pt"
    line = refused(tmp_path, capsys, "--resume", str(ckpt), "--seed", "5", "--tst-bag-size", "2",
                   "--matrix-lr", "0.05")
    for diff in ("--seed 0 -> 5", "--tst-bag-size 4 -> 2", "--matrix-lr 0.023 -> 0.05"):
        assert diff in line, line
    assert line.endswith("resume with the checkpoint's flags and shards")
    # into the run's own log (--resume auto): refused before the log is opened, its files as they were
    before = {p.name: p.read_bytes() for p in (runs[0] / "logs").iterdir()}
    assert run(runs[0], "--run-id", "r", "--resume", "auto", "--seed", "5") == 2
    assert {p.name: p.read_bytes() for p in (runs[0] / "logs").iterdir()} == before
    # what only changes how the run executes may differ: logs, checkpoints, the micro-batch, --max-steps
    cfg = cfg_of(tmp_path, "--resume", str(ckpt), "--val-every", "2", "--log-every", "3", "--max-steps", "1",
                 "--save-every", "1")
    data = H.find_data(cfg.train_files, cfg.val_files)
    assert H.load_resume(cfg, data, T.OPERATIONAL)["step"] == 3


def test_a_resume_onto_other_data_is_refused_and_the_same_shards_elsewhere_are_not(runs, tmp_path, capsys):
    ckpt = str(runs[0] / "ckpt" / "r" / "step_000003.pt")
    fewer = os.path.join(SAMPLE_DIR, "*_train_00000[12].bin")
    line = refused(tmp_path, capsys, "--resume", ckpt, "--train-files", fewer)
    n = len([f for f in os.listdir(SAMPLE_DIR) if "_train_" in f])
    assert f"train data ({n} files -> 2, other contents)" in line and "val data" not in line, line
    moved = tmp_path / "moved"
    shutil.copytree(SAMPLE_DIR, moved)
    cfg = cfg_of(tmp_path, "--resume", ckpt, "--train-files", str(moved / "*_train_*.bin"),
                 "--val-files", str(moved / "*_val_*.bin"))
    assert H.load_resume(cfg, H.find_data(cfg.train_files, cfg.val_files), T.OPERATIONAL)["step"] == 3


@pytest.mark.parametrize("content", [b"", b"hello\n", b"\x00" * 2000, "truncated"])
def test_a_file_that_is_not_a_checkpoint_is_refused_in_one_line(runs, tmp_path, capsys, content):
    bogus = tmp_path / "bogus.pt"
    if content == "truncated":
        data = (runs[0] / "ckpt" / "r" / "step_000003.pt").read_bytes()
        content = data[:len(data) // 2]
    bogus.write_bytes(content)
    line = refused(tmp_path, capsys, "--resume", str(bogus))
    assert f"--resume {bogus}: not a readable train_gpt.py checkpoint (" in line, line
    assert "give a <checkpoint-dir>/<run-id>/step_N.pt file" in line


def test_a_missing_checkpoint_and_an_empty_folder_are_one_line(tmp_path, capsys):
    line = refused(tmp_path, capsys, "--resume", str(tmp_path / "nope.pt"))
    assert "nope.pt: not a readable train_gpt.py checkpoint (FileNotFoundError" in line, line
    line = refused(tmp_path, capsys, "--resume", "auto", "--run-id", "x")
    assert line.startswith(f"train_gpt.py: error: --resume auto: no checkpoint under {str(tmp_path / 'ckpt' / 'x')!r}")


def test_a_signal_during_a_checkpoint_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def interrupted_replace(src, dst):
        assert os.path.getsize(src) > 0  # the temporary file was written
        raise KeyboardInterrupt
    monkeypatch.setattr(H.os, "replace", interrupted_replace)
    model = torch.nn.Linear(3, 2)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    rt = H.Runtime(0, 1, torch.device("cpu"), False)
    with pytest.raises(KeyboardInterrupt):
        H.save_checkpoint({}, model, opts, SimpleNamespace(position=0), rt, str(tmp_path / "c" / "step_000002.pt"),
                          SimpleNamespace(line=print))
    assert os.listdir(tmp_path / "c") == []


# ----------------------------------------------------------------------------------------------
# Signals: a subprocess of 400 steps, signalled once its log shows step 3


TINY_MAIN = os.path.join(REPO, "tests", "dist_train_worker.py")  # train_gpt.py, --model able to name the tiny one


def interrupt_run(tmp_path, run_id, sig, *extra):
    """(exit code, log text, stderr) of a tiny run sent ``sig`` after its step 3."""
    args = tiny_args(tmp_path, "--num-iterations", "400", "--val-every", "0", "--run-id", run_id, *extra)
    proc = subprocess.Popen([sys.executable, TINY_MAIN, *args], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / f"{run_id}.txt"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            log.exists() and "step:3/400 train_loss" in log.read_text()):
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, log.read_text(), err


def test_sigterm_finishes_the_step_checkpoints_marks_the_log_and_the_run_resumes(tmp_path):
    code, text, err = interrupt_run(tmp_path, "i", signal.SIGTERM, "--save-every", "1000")
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and error_lines(err) == [], err[-3000:]
    last = text.splitlines()[-1]
    assert last.startswith("status:interrupted reason:SIGTERM after step "), last
    step = int(last.split(" after step ")[1].split(";")[0])
    assert last.endswith(f"; resume with --resume auto --run-id i") and 3 <= step < 400
    steps = sorted(loss_lines(text))
    assert steps == list(range(1, step + 1))  # the step it was in finished and was logged, no later one began
    assert os.listdir(tmp_path / "ckpt" / "i") == [f"step_{step:06d}.pt"]
    assert T.main(tiny_args(tmp_path, "--num-iterations", "400", "--val-every", "0", "--run-id", "i",
                            "--save-every", "1000", "--resume", "auto", "--max-steps", "2"), models=SPECS) == 0
    assert sorted(loss_lines(read_log(tmp_path / "logs", "i")))[-1] == step + 2


def test_sigint_without_checkpoints_finishes_the_step_marks_the_log_interrupted_and_saves_nothing(tmp_path):
    code, text, err = interrupt_run(tmp_path, "n", signal.SIGINT)  # Ctrl-C
    assert code == 130 and "Traceback" not in err and error_lines(err) == [], err[-3000:]
    last = text.splitlines()[-1]
    assert last.startswith("status:interrupted reason:SIGINT after step ") and "--resume" not in last, last
    step = int(last.split(" after step ")[1])
    assert sorted(loss_lines(text)) == list(range(1, step + 1)) and step >= 3
    assert json.loads((tmp_path / "logs" / "n.json").read_text())["status"] == "interrupted"
    assert not (tmp_path / "ckpt").exists()
