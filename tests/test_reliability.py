"""Faults reported by people who train GPT-2-scale models, replayed: each stops with one clear line.

Val shards in the train stream, resume onto other data, a full disk, checkpoints copied without
their times, a missing C++ compiler, Ctrl-C during the compile warm-up or a validation, a signal
under torchrun, two starts of one run, a process group that cannot form.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple

import pytest

import harness as H
import train_gpt as T
from conftest import REPO, TORCHRUN, drop_flags, loss_lines, read_log, subprocess_env, tiny_args, write_shard


def error_lines(stderr):
    return [l for l in stderr.splitlines() if l.strip() and not l.startswith("log: ")]


def run_cli(tmp_path, *flags, env=None, preexec_fn=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), *tiny_args(tmp_path), *flags],
                          capture_output=True, text=True, env=env or subprocess_env(), cwd=tmp_path, timeout=600,
                          preexec_fn=preexec_fn)


def no_temp_files(*folders):
    return [os.path.join(d, n) for folder in folders if os.path.isdir(folder)
            for d, _, names in os.walk(folder) for n in names if ".tmp" in n]


# ---------------------------------------------------------------------------------------------
# the val shard must never train


@pytest.mark.parametrize("how", ["glob of every shard", "the val shard itself", "a copy under another name"])
def test_a_train_file_with_the_content_of_a_val_file_is_refused(tmp_path, shard_dir, capsys, how):
    val = shard_dir / "t_val_000000.bin"
    if how == "glob of every shard":
        train = str(shard_dir / "*.bin")
    elif how == "the val shard itself":
        train = str(val)
    else:
        shutil.copy(val, shard_dir / "t_train_000009.bin")
        train = str(shard_dir / "t_train_*.bin")
    code = T.main(tiny_args(tmp_path, "--train-files", train, "--val-files", str(val)))
    assert code == 2
    err = capsys.readouterr().err
    assert "--train-files" in err and str(val) in err and "content of val shard" in err
    assert not (tmp_path / "logs").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------
# resume: the data defines the run


def with_documents(tokens):
    """``tokens`` (a list) with every 40th an <|endoftext|>: documents for the packed loader."""
    return [T.EOT_TOKEN if i % 40 == 0 else t for i, t in enumerate(tokens)]


def test_resume_refuses_other_data_unless_forced(tmp_path, capsys):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    write_shard(shard_dir / "t_train_000001.bin", with_documents(list(range(3000))))
    write_shard(shard_dir / "t_val_000000.bin", list(range(600)))
    base = ["--train-files", str(shard_dir / "t_train_*.bin"), "--val-files", str(shard_dir / "t_val_*.bin"),
            "--tst-frac", "0"]
    assert T.main(tiny_args(tmp_path, *base, "--run-id", "d", "--max-steps", "2", "--save-final")) == 0
    other = tmp_path / "other"
    other.mkdir()
    write_shard(other / "o_train_000001.bin", with_documents(list(range(5, 4005))))
    write_shard(other / "o_val_000000.bin", list(range(7, 707)))
    for flags, what in ((["--train-files", str(other / "o_train_*.bin")], "train data"),
                        (["--val-files", str(other / "o_val_*.bin")], "val data")):
        argv = tiny_args(tmp_path, *base, "--resume", "auto", "--run-id", "d", *flags)
        assert T.main(argv) == 2
        err = capsys.readouterr().err
        assert what in err and "--resume-force" in err and "o_" in err
    # the same contents under another path is the same data
    moved = tmp_path / "moved"
    shutil.copytree(shard_dir, moved)
    assert T.main(tiny_args(tmp_path, "--train-files", str(moved / "t_train_*.bin"), "--val-files",
                            str(moved / "t_val_*.bin"), "--tst-frac", "0", "--resume", "auto", "--run-id", "d",
                            "--max-steps", "1", "--save-final")) == 0  # saved: the forced resume below starts at
    # its newest step (one from an older checkpoint into this log, which holds later steps, is refused)
    assert T.main(tiny_args(tmp_path, *base, "--train-files", str(other / "o_train_*.bin"), "--resume", "auto",
                            "--run-id", "d", "--resume-force", "--max-steps", "1")) == 0
    assert "resume_force: continuing despite differences: train data" in read_log(tmp_path / "logs", "d")


# ---------------------------------------------------------------------------------------------
# resume auto: by step, not by file time


def test_resume_auto_picks_the_highest_step_whatever_the_file_times(tmp_path):
    assert T.main(tiny_args(tmp_path, "--run-id", "m", "--num-iterations", "12", "--max-steps", "4",
                            "--save-every", "2")) == 0
    folder = tmp_path / "ckpt" / "m"
    assert sorted(os.listdir(folder)) == ["step_000002.pt", "step_000004.pt"]
    os.utime(folder / "step_000002.pt", (2_000_000_000, 2_000_000_000))  # a copy that lost its times
    os.utime(folder / "step_000004.pt", (1_000_000_000, 1_000_000_000))
    assert H.find_latest_checkpoint(str(tmp_path / "ckpt")) == str(folder / "step_000004.pt")
    (folder / "step_000010.pt").write_bytes((folder / "step_000004.pt").read_bytes())  # 10 > 4 as numbers
    assert H.find_latest_checkpoint(str(tmp_path / "ckpt"), "m") == str(folder / "step_000010.pt")


def test_resume_auto_without_run_id_refuses_to_guess_between_runs(tmp_path):
    for run_id in ("a", "b"):
        (tmp_path / "ckpt" / run_id).mkdir(parents=True)
        (tmp_path / "ckpt" / run_id / "step_000002.pt").write_bytes(b"x")
    with pytest.raises(T.ConfigError, match=r"checkpoints of 2 runs .*\(a, b\); name one with --run-id"):
        H.find_latest_checkpoint(str(tmp_path / "ckpt"))


# ---------------------------------------------------------------------------------------------
# a full disk: one line, the temporary file removed, the log marked incomplete


def limit_file_size(n_bytes):
    """preexec_fn: files this process writes may not grow past n_bytes (writes fail with EFBIG)."""
    def apply():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))
    return apply


def test_a_checkpoint_that_cannot_be_written_stops_cleanly(tmp_path):
    out = run_cli(tmp_path, "--run-id", "f", "--save-every", "2", "--val-every", "0",
                  preexec_fn=limit_file_size(4 << 20))  # the log fits, a ~75 MB checkpoint does not
    assert out.returncode == 2
    errors = error_lines(out.stderr)
    ckpt = os.path.join("ckpt", "f", "step_000002.pt")
    assert len(errors) == 1 and ckpt in errors[0] and "File too large" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert read_log(tmp_path / "logs", "f").splitlines()[-1].startswith("status:incomplete reason:")
    assert no_temp_files(tmp_path / "ckpt", tmp_path / "logs") == []
    assert not (tmp_path / "ckpt" / "f" / "step_000002.pt").exists()


def test_too_little_free_space_is_said_before_writing(tmp_path, monkeypatch, capsys):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(H.shutil, "disk_usage", lambda path: Usage(10 << 20, 9 << 20, 1 << 20))
    assert T.main(tiny_args(tmp_path, "--run-id", "s", "--save-every", "2", "--val-every", "0")) == 2
    err = capsys.readouterr().err
    assert "No space left" in err and "1 MB free" in err and "MB needed" in err and "--checkpoint-dir" in err
    assert no_temp_files(tmp_path / "ckpt") == []
    assert read_log(tmp_path / "logs", "s").splitlines()[-1].startswith("status:incomplete")
    summary = json.loads((tmp_path / "logs" / "s.json").read_text())  # failed after the step-0 val only
    assert summary["status"] == "incomplete" and "final_val_loss" not in summary
    assert summary["val_step"] == 0 and "last_val_loss" in summary


def test_a_log_that_cannot_be_written_stops_with_one_line(tmp_path):
    out = run_cli(tmp_path, "--run-id", "g", preexec_fn=limit_file_size(20_000))  # smaller than the snapshot
    assert out.returncode == 2
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and "--log-dir" in errors[0] and "File too large" in errors[0], out.stderr[-2000:]
    assert not (tmp_path / "logs").exists()  # no partial log, no temporary file, no lock (the folder it made goes too)


# ---------------------------------------------------------------------------------------------
# a broken compile toolchain


def test_compile_without_a_cxx_compiler_says_so_in_one_line(tmp_path):
    env = dict(subprocess_env(), CXX=str(tmp_path / "no-such-c++"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # no cached kernel may hide it
    out = run_cli(tmp_path, "--run-id", "c", "--compile", "--num-iterations", "2", env=env)
    assert out.returncode == 2
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and "no working C++ compiler" in errors[0] and "--no-compile" in errors[0], \
        out.stderr[-3000:]
    assert read_log(tmp_path / "logs", "c").splitlines()[-1].startswith("status:incomplete")


# ---------------------------------------------------------------------------------------------
# found by a bad-input review


def test_a_signal_during_a_checkpoint_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def interrupted_replace(src, dst):
        assert os.path.exists(src)  # the temporary file was fully written
        raise H.StopRequested("interrupted by SIGINT")
    monkeypatch.setattr(H.os, "replace", interrupted_replace)
    state = {"w": T.torch.zeros(1000)}
    with pytest.raises(H.StopRequested):
        H.save_checkpoint(state, str(tmp_path / "ckpt" / "step_000002.pt"))
    assert os.listdir(tmp_path / "ckpt") == []


@pytest.mark.parametrize("sign", [1, -1])  # a seed of -2**64 once reached torch.manual_seed (a traceback)
@pytest.mark.parametrize("flag", ["--seed", "--window", "--n-layer", "--vocab-size", "--num-iterations"])
def test_integers_too_large_for_the_machine_are_refused_naming_the_flag(flag, sign):
    with pytest.raises(T.ConfigError, match=f"^{flag} must be < 2\\*\\*31 in magnitude"):
        T.parse_config([flag, str(sign * 2**64)])


def test_out_of_memory_is_one_line_naming_the_flags_to_lower():
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 123456789012 bytes. Error code 12 (Cannot allocate memory)")
    line = H.known_failure(err)
    assert line.startswith("out of memory (tried to allocate 123456789012 bytes); lower --seq-len") and "\n" not in line
    assert H.known_failure(ValueError("something else")) is None


@pytest.mark.parametrize("preset", ["baseline_h200", "record_h200", "cpu_smoke"])
def test_out_of_memory_names_the_flags_that_lower_it_for_the_preset_with_the_whole_size(preset):
    cfg = T.parse_config(["--preset", preset, "--no-fp8"])[0]
    err = H.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 23.44 GiB. GPU 0 has a total capacity of "
                                   "23.55 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
                                   "has 22.48 GiB memory in use. Of the allocated memory 21.98 GiB is allocated")
    line = H.known_failure(err, cfg)
    assert line.startswith("out of memory (tried to allocate 23.44 GiB); lower --seq-len (now "), line
    assert ("--micro-batch-seqs" in line) == (cfg.micro_batch_seqs > 1)  # record #89's presets: 1 already
    assert (f"--bigram-vocab (now {cfg.bigram_vocab:,} rows" in line) == (cfg.bigram_vocab > 0) and "--fp8" in line


def test_out_of_memory_inside_compile_is_called_out_of_memory():
    class BackendCompilerFailed(RuntimeError):  # torch._dynamo's wrapper of an error raised while compiling
        pass
    try:
        try:
            raise H.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        except Exception as e:
            raise BackendCompilerFailed("backend='inductor' raised: OutOfMemoryError") from e
    except RuntimeError as err:
        line = H.known_failure(err)
    assert line.startswith("out of memory (tried to allocate 2.00 GiB)") and "C++" not in line, line


def test_a_damaged_summary_on_resume_is_named(tmp_path, capsys):
    assert T.main(tiny_args(tmp_path, "--run-id", "j", "--max-steps", "2", "--save-final")) == 0
    (tmp_path / "logs" / "j.json").write_text('{"run_id": "j", "stat')
    assert T.main(tiny_args(tmp_path, "--run-id", "j", "--resume", "auto", "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert "j.json is not valid JSON" in err and "--resume" in err


def test_resume_auto_names_nested_copies_of_one_run_by_their_paths(tmp_path):
    for sub in ("a", os.path.join("a", "a")):  # `cp -r` onto an existing folder nests the copy
        (tmp_path / "ckpt" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "ckpt" / sub / "step_000002.pt").write_bytes(b"x")
    with pytest.raises(T.ConfigError, match=r"2 runs under .*\(\., a\); keep one folder of step_\*\.pt files"):
        H.find_latest_checkpoint(str(tmp_path / "ckpt"), "a")


# ---------------------------------------------------------------------------------------------
# signals: a flag, read at safe points; never an exception inside library code


def wait_for(path, text, proc, seconds=300):
    """Poll a log until it holds ``text`` (or the process ended); True when it did."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.2)
    return False


def test_ctrl_c_during_the_compile_warm_up_stops_with_one_line_and_no_checkpoint(tmp_path):
    # a real compile, not a cache hit of the whole graph (the compiled C++ kernels may be reused)
    env = dict(subprocess_env(), TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt.py"),
                             *tiny_args(tmp_path, "--run-id", "w", "--compile")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "w.txt"
    assert wait_for(log, "\nmodel: ", proc)  # the line just before the warm-up
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    errors = error_lines(err)
    assert errors == ["train_gpt.py: rank 0: interrupted by SIGINT"], err[-3000:]
    text = log.read_text()
    assert "\ncompile: warm-up" not in text and "\nstep:1/" not in text  # it stopped inside the warm-up
    assert text.splitlines()[-1] == "status:incomplete reason:rank 0: interrupted by SIGINT"
    assert not (tmp_path / "ckpt").exists()
    assert os.listdir(tmp_path / "logs") == ["w.json", "w.txt"]  # the lock file went with the run


def test_an_exception_caused_by_an_interrupt_is_an_interrupt():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise RuntimeError("BackendCompilerFailed: compile worker died") from inner
    except RuntimeError as outer:
        err = outer
    assert isinstance(H.interrupt_in_chain(err), KeyboardInterrupt)
    assert H.interrupt_in_chain(RuntimeError("x")) is None
    stop = {"signal": None}
    reason, code = H.failure(err, 0, stop, None, "train_gpt.py")
    assert code == 130 and "interrupted" in reason


def test_a_signal_during_validation_stops_it_marks_the_log_then_checkpoints(tmp_path, monkeypatch):
    batches, calls = T.ValData.batches, []

    def signalled_batches(self, *args):
        calls.append(args)
        for i, batch in enumerate(batches(self, *args)):
            yield batch
            if len(calls) == 2 and i == 0:  # the step-4 validation, after its first batch
                os.kill(os.getpid(), signal.SIGTERM)

    saved_with = []

    def save_checkpoint(state, path):
        saved_with.append(read_log(tmp_path / "logs", "v").splitlines()[-1])
        return H_save(state, path)

    H_save = H.save_checkpoint
    monkeypatch.setattr(T.ValData, "batches", signalled_batches)
    monkeypatch.setattr(H, "save_checkpoint", save_checkpoint)
    code = T.main(tiny_args(tmp_path, "--run-id", "v", "--tst-frac", "0", "--save-on-interrupt"))
    assert code == 130
    text = read_log(tmp_path / "logs", "v")
    assert "step:0/8 val_loss" in text and "step:4/8 val_loss" not in text  # the cut validation is not logged
    path = str(tmp_path / "ckpt" / "v" / "step_000004.pt")
    status = f"status:interrupted reason:SIGTERM after step 4; checkpoint {path}; resume with --resume auto --run-id v"
    assert saved_with == [status]  # the log was marked before the checkpoint was written
    assert [l for l in text.splitlines() if l.startswith("status:")] == [status]
    assert H.load_checkpoint(path)["step"] == 4
    summary = json.loads((tmp_path / "logs" / "v.json").read_text())  # step 0's val loss is no final one
    assert summary["status"] == "interrupted" and "final_val_loss" not in summary
    assert summary["val_step"] == 0 and summary["last_val_loss"] == pytest.approx(loss_lines(text, "val_loss")[0],
                                                                                 abs=5e-5)


# ---------------------------------------------------------------------------------------------
# only a complete run names a final val loss: a log of a stopped run never shows step 0's as one


def test_a_run_stopped_by_max_steps_records_its_last_val_loss_not_a_final_one(tmp_path):
    """8 steps, val every 4: --max-steps 3 stops with step 0's val loss only, the complete run has step 8's;
    verify.py's full rerun of the stopped run compares the summary's val loss under its name."""
    assert T.main(tiny_args(tmp_path, "--run-id", "early", "--max-steps", "3")) == 0
    assert T.main(tiny_args(tmp_path, "--run-id", "full")) == 0
    logs = tmp_path / "logs"
    early, full = (json.loads((logs / f"{r}.json").read_text()) for r in ("early", "full"))
    text_early, text_full = read_log(logs, "early"), read_log(logs, "full")
    val_early, val_full = loss_lines(text_early, "val_loss"), loss_lines(text_full, "val_loss")
    assert sorted(val_early) == [0] and sorted(val_full) == [0, 4, 8]

    assert early["status"] == "stopped_early" and "final_val_loss" not in early and early["val_step"] == 0
    assert early["last_val_loss"] == pytest.approx(val_early[0], abs=5e-5)
    [summary] = [l for l in text_early.splitlines() if l.startswith("summary: ")]
    assert summary.startswith(f"summary: last_val_loss:{val_early[0]:.4f} val_step:0 train_time:"), summary
    assert "final_val_loss" not in text_early.split("=" * 100 + "\n")[-1]

    assert full["status"] == "complete" and "last_val_loss" not in full and full["val_step"] == 8
    assert full["final_val_loss"] == pytest.approx(val_full[8], abs=5e-5)
    [summary] = [l for l in text_full.splitlines() if l.startswith("summary: ")]
    assert summary.startswith(f"summary: final_val_loss:{val_full[8]:.4f} train_time:"), summary

    proc = subprocess.run([sys.executable, os.path.join(REPO, "records", "verify.py"), str(logs / "early.txt"),
                           "--rerun", "3"], cwd=REPO, env=dict(subprocess_env(), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"rerun: summary last_val_loss: logged {val_early[0]:.4f}, rerun {val_early[0]:.4f}" in proc.stdout
    assert "the summary's last_val_loss, steps" in " ".join(proc.stdout.split())


# ---------------------------------------------------------------------------------------------
# torchrun (2 gloo processes) through run.sh: the exit status of the trainer


def run_sh(tmp_path, *flags):
    env = dict(subprocess_env(), NPROC="2", DATA_DIR=os.path.join(REPO, "data", "sample"), OMP_NUM_THREADS="1")
    # run.sh's own preset (cpu_smoke) at a small shape: 2 -> 4 -> 6 sequences of 128, one per micro-step per process
    small = ["--model-dim", "64", "--seq-len", "128", "--batch-tokens", "768", "--micro-batch-seqs", "1",
             "--val-tokens", "512", "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    return subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), *small, "--dist-timeout", "120", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_run_sh_under_torchrun_exits_130_on_a_signal_with_the_checkpoint_and_2_on_a_refusal(tmp_path):
    proc = run_sh(tmp_path, "--run-id", "t", "--num-iterations", "400", "--val-every", "0", "--save-on-interrupt")
    log = tmp_path / "logs" / "t.txt"
    assert wait_for(log, "step:3/400 train_loss", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]  # not torchrun's own traceback
    last = log.read_text().splitlines()[-1]
    assert last.startswith("status:interrupted reason:SIGTERM after step "), last
    step = int(last.split(" after step ")[1].split(";")[0])
    assert H.load_checkpoint(str(tmp_path / "ckpt" / "t" / f"step_{step:06d}.pt"))["step"] == step
    again = run_sh(tmp_path, "--run-id", "t")  # a new run under the same id: refused
    _, err = again.communicate(timeout=600)
    assert again.returncode == 2, err[-3000:]
    assert "--run-id t:" in err and "already exists" in err


def test_save_on_interrupt_under_torchrun_agrees_every_few_steps_not_every_step(tmp_path):
    # rank 0 alone is signalled during step 12; the ranks agree (a MAX all-reduce) only at the
    # step-0 validation and after steps 10 and 20 (stop_check_every, --log-every 1), and stop after 20
    worker = os.path.join(REPO, "tests", "dist_stop_worker.py")
    out = tmp_path / "stop"
    cmd = [*TORCHRUN, worker, str(out),
           *tiny_args(tmp_path, "--batch-tokens", "512", "--num-iterations", "40", "--val-every", "0",
                      "--tst-frac", "0", "--run-id", "s", "--dist-timeout", "120", "--save-on-interrupt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(subprocess_env(), OMP_NUM_THREADS="1"),
                          cwd=tmp_path, timeout=600)
    ranks = [json.loads((tmp_path / f"stop.{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in ranks] == [130, 130], proc.stderr[-3000:]
    assert [r["checks"] for r in ranks] == [[0, 10, 20], [0, 10, 20]]
    last = read_log(tmp_path / "logs", "s").splitlines()[-1]
    assert last.startswith("status:interrupted reason:SIGTERM after step 20;"), last
    assert H.load_checkpoint(str(tmp_path / "ckpt" / "s" / "step_000020.pt"))["step"] == 20


def test_the_ranks_agree_on_a_signal_at_train_loss_lines_at_least_10_steps_apart():
    every = {n: H.stop_check_every(T.parse_config(["--log-every", str(n)])[0]) for n in (1, 3, 4, 10, 25)}
    assert every == {1: 10, 3: 12, 4: 12, 10: 10, 25: 25}


def test_an_eager_flex_attention_run_that_cannot_fit_the_gpu_is_refused_naming_compile():
    h200 = 150_000_000_000  # bytes (141 GiB): the check takes the device's memory as an argument
    r21, _ = T.parse_config(["--doc-mask", "--seq-len", "49152", "--batch-tokens", "393216", "--micro-batch-seqs", "1"])
    # record #21's shape: 1 sequence of 49,152 positions, 6 heads
    assert T.TRAINER.flex_attention(r21) and not T.TRAINER.flex_attention(T.parse_config(["--no-doc-mask"])[0])
    assert H.eager_attention_bytes(r21) == 4 * 1 * 6 * 49152 ** 2 * 4  # the backward's four fp32 [B, H, T, T]
    with pytest.raises(H.ConfigError) as e:
        H.check_eager_attention(r21, False, True, h200)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--no-compile: ") and "run with --compile" in msg and "216 GiB" in msg
    H.check_eager_attention(r21, True, True, h200)  # compiled: the fused kernel builds no scores
    H.check_eager_attention(r21, False, False, h200)  # no FlexAttention (plain causal SDPA)
    # HEAD's layout (third-stage sequences of 49,152) and val chunks (262,144 tokens) cannot run eager
    base, _ = T.parse_config(["--preset", "baseline_h200"])
    assert H.eager_attention_bytes(base) == 2 * 6 * 262144 ** 2 * 4  # the val chunk's two buffers: 3,072 GiB
    with pytest.raises(H.ConfigError, match="--compile"):
        H.check_eager_attention(base, False, True, h200)
    fixed = ["--preset", "baseline_h200", "--no-grow-seq-len", "--val-seq-len", "0"]  # sequences of 16,384
    H.check_eager_attention(T.parse_config(fixed)[0], False, True, h200)  # 24 GiB: it fits
    for val_seqs, refused in ((8, False), (16, True)):  # a validation forward holds two buffers per sequence
        cfg = T.parse_config([*fixed, "--val-batch-seqs", str(val_seqs)])[0]
        assert H.eager_attention_bytes(cfg) == max(4, 2 * val_seqs) * 6 * 16384 ** 2 * 4
        if refused:
            with pytest.raises(H.ConfigError, match="--compile"):
                H.check_eager_attention(cfg, False, True, h200)
        else:
            H.check_eager_attention(cfg, False, True, h200)


# ---------------------------------------------------------------------------------------------
# one run at a time per run id


def test_a_second_start_of_a_running_run_id_is_refused_naming_the_pid(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, harness; lock = harness.RunLock(sys.argv[1], 'r'); "
                               "print('locked', flush=True); time.sleep(600)", str(tmp_path / "logs")],
                              env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        for extra in ([], ["--resume", "auto"]):
            assert T.main(tiny_args(tmp_path, "--run-id", "r", "--max-steps", "2", "--save-final", *extra)) == 2
            err = error_lines(capsys.readouterr().err)
            assert len(err) == 1 and f"pid {holder.pid} holds" in err[0] and "--run-id r" in err[0], err
        assert sorted(os.listdir(tmp_path / "logs")) == ["r.lock"]  # nothing written by the refused starts
    finally:
        holder.kill()  # SIGKILL: the OS releases its lock; the file stays
        holder.wait()
    assert (tmp_path / "logs" / "r.lock").exists()
    assert T.main(tiny_args(tmp_path, "--run-id", "r", "--max-steps", "2", "--save-final")) == 0
    assert T.main(tiny_args(tmp_path, "--run-id", "r", "--resume", "auto", "--max-steps", "1")) == 0
    assert sorted(os.listdir(tmp_path / "logs")) == ["r.json", "r.txt"]  # a clean end leaves no lock file


# ---------------------------------------------------------------------------------------------
# the process group cannot form


def test_a_process_group_that_cannot_form_is_one_line_naming_what_to_check(tmp_path):
    with socket.socket() as s:  # a port nobody listens on, held for the run: no other process (another
        s.bind(("127.0.0.1", 0))  # test's gloo pair) can take it and receive the trainer's connection tries
        port = s.getsockname()[1]
        env = dict(subprocess_env(), WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        out = run_cli(tmp_path, "--dist-timeout", "2", "--micro-batch-seqs", "4", env=env)
    assert out.returncode == 2
    errors = error_lines(out.stderr)
    assert len(errors) == 1 and errors[0].startswith("train_gpt.py: error: rank 1: cannot join the gloo process group"), \
        out.stderr[-3000:]
    assert f"127.0.0.1:{port}" in errors[0] and "GLOO_SOCKET_IFNAME" in errors[0] and "--dist-timeout (2 s)" in errors[0]
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------
# run.sh: the start line names the preset that runs; more processes than GPUs is refused before torchrun


@pytest.mark.parametrize("form", ["--preset baseline_h200", "--preset=baseline_h200"])
def test_run_sh_start_line_names_the_preset_passed(tmp_path, form):
    args = drop_flags(tiny_args(tmp_path), "--embed-lr", "--head-lr")  # the preset in `form`, not run.sh's CPU
    assert "--preset" not in args                                        # default; its CautiousAdam: no Adam lrs
    env = dict(subprocess_env(), NPROC="3", OMP_NUM_THREADS="1")  # 3 processes cannot split the batch: refused
    res = subprocess.run(["bash", os.path.join(REPO, "run.sh"), *form.split(" "), *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("run.sh: preset ")]
    assert line.startswith("run.sh: preset baseline_h200, 3 processes on CPU"), line
    assert "has no effect" not in res.stderr, res.stderr  # refused for the 3 processes, not a flag


def test_preflight_refuses_more_processes_than_gpus_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(H.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(H.torch.cuda, "device_count", lambda: 2)
    argv = [a for a in tiny_args(tmp_path)]
    assert H.preflight(argv, T.TRAINER, 4) == 2
    err = capsys.readouterr().err
    assert err == ("run.sh: NPROC=4: 4 processes but 2 GPU(s) visible (one process per GPU); set NPROC to at most 2, "
                   "or unset it to use every GPU\n"), err
    assert not os.path.exists(tmp_path / "logs")  # refused before anything was written


# ---------------------------------------------------------------------------------------------
# --describe's memory estimate, against a CPU run's peak

PEAK_PROBE = """
import dataclasses, sys, torch
import train_gpt as T
torch.set_num_threads(1)
cfg = dataclasses.replace(T.parse_config(["--preset", "cpu_smoke", *sys.argv[1:]])[0], fp8=False)
torch.manual_seed(0)
def hwm():  # this process's peak resident KiB (ru_maxrss would start at the forking parent's peak)
    return int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:")))
before = hwm()
model = T.GPT(cfg)
opts = T.build_optimizers(model, cfg)
n = cfg.micro_batch_seqs * cfg.seq_len
ids = torch.randint(0, 50257, (1, n + 1))
for _ in range(2):  # the second step: every optimizer state exists
    model(ids[:, :-1].reshape(1, n, 1), ids[:, 1:].reshape(1, n, 1)).backward()
    for opt in opts:
        opt.step()
print(sum(p.numel() for p in model.parameters()), (hwm() - before) * 1024)
"""


@pytest.mark.parametrize("extra", [[], ["--seq-len", "2304", "--batch-tokens", "6912"]])
def test_memory_estimate_is_within_15_percent_of_a_cpu_runs_peak_at_the_smoke_shape(extra):
    """Measured on an Intel Xeon (1 thread): cpu_smoke (28.7M parameters, 768 positions) peaks 967 MiB above the
    process's start, estimated 917 MiB; at 2,304 positions 1,928 MiB, estimated 1,878 MiB."""
    with open("/proc/meminfo") as f:  # resident memory reads low when the machine is short of it (pages reclaimed)
        roomy = int(next(ln.split()[1] for ln in f if ln.startswith("MemAvailable:"))) > 8 * 2**20
    proc = subprocess.run([sys.executable, "-c", PEAK_PROBE, *extra], env=dict(subprocess_env(), OMP_NUM_THREADS="1"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_params, peak = map(int, proc.stdout.split()[-2:])
    cfg = T.parse_config(["--preset", "cpu_smoke", *extra])[0]
    est = H.memory_estimate(cfg, n_params, cuda=False)
    assert est["total"] == est["parameters"] * (2 + 3) + est["activations"]  # cpu_smoke: CautiousAdam's 3 copies
    assert 0.85 < est["total"] / peak and (est["total"] / peak < 1.15 or not roomy), (est, peak)


def test_describe_prints_the_memory_estimate_and_the_flags_that_lower_it(capsys):
    assert T.main(["--preset", "baseline_h200", "--describe"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("memory_estimate: ")]
    cfg = T.parse_config(["--preset", "baseline_h200"])[0]
    n_params = T.plan(cfg)[0]
    # the third stage's one sequence of 49,152 positions (--grow-seq-len) is the largest micro-batch
    total = (4 * n_params * 5 + 49152 * (3 * 50304 * 4 + 25 * 11 * 768 * 2)) / 2**30  # float64 by hand
    assert f"peak about {total:.1f} GiB" in line and "1 x 49,152 positions" in line, line
    assert "--seq-len (now 16,384" in line and "--bigram-vocab (now 377,280 rows" in line
    assert "--micro-batch-seqs" not in line and "--fp8" not in line  # 1 already, FP8 on already


def test_the_memory_estimate_counts_the_validation_forward_and_names_the_peak(capsys):
    # val_batch_seqs x the val chunk, no gradients: logits of one head piece, VAL_ROWS + n_layer rows a position
    argv = ["--preset", "cpu_smoke", "--val-batch-seqs", "64", "--val-seq-len", "16384"]
    cfg = T.parse_config(argv)[0]
    n_params = T.plan(cfg)[0]
    train = H.memory_estimate(cfg, n_params)
    est = H.memory_estimate(cfg, n_params, val=(T.val_chunk(cfg), T.VAL_PIECE))
    piece = 64 * (T.VAL_PIECE // 64)  # head_pieces: VAL_PIECE // B positions of each of the B sequences
    val = piece * 2 * cfg.vocab_size * 4 + 64 * 16384 * (16 + cfg.n_layer) * cfg.model_dim * 2  # by hand
    state = train["parameters"] + train["gradients"] + train["optimizer"]
    assert est["val_activations"] == val and est["total"] == state + val > train["total"] and est["peak"] == "val"
    assert T.main(argv + ["--describe"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("memory_estimate: ")]
    assert f"peak about {(state + val) / 2**30:.1f} GiB, in the validation forward" in line, line
    assert "64 x 16,384 positions, no gradients" in line and "--val-batch-seqs (now 64)" in line
    smoke = T.parse_config(["--preset", "cpu_smoke"])[0]  # 1 x 768 val positions
    small = H.memory_estimate(smoke, n_params, val=(T.val_chunk(smoke), T.VAL_PIECE))
    assert small["total"] == H.memory_estimate(smoke, n_params)["total"] and small["peak"] == "train"  # the train micro-batch stays the peak
