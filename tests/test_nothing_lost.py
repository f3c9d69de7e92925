"""Nothing lost, part 4: the failures of a real machine and of torchrun, each replayed for real.

A full disk is a real small filesystem (a tmpfs in a private mount namespace), a closed terminal is a pty whose
master end closes, Ctrl-C is SIGINT to the launcher run.sh execs, a stalled rank is a SIGSTOP'd process, a second run
of one --run-id is a second process. Each case: one line on stderr, the right exit status, no traceback, the log
kept and marked, no temporary file left.
"""
import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch

import harness as H
import train_gpt as T
from conftest import REPO, SPECS, TORCHRUN_LOGS, read_log, subprocess_env, tiny_args

WORKER = os.path.join(REPO, "tests", "dist_train_worker.py")  # train_gpt.main, --model able to name the tiny one
ENV = dict(subprocess_env(), OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")  # a stalled rank: 10 s, then
LAUNCH = [sys.executable, os.path.join(REPO, "harness.py"), "--standalone", "--log-dir", TORCHRUN_LOGS]  # SIGKILL


def error_lines(err):
    """stderr less the ``log: <path> (...)`` line every run that had a log ends with."""
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("log: ")]


def wait_for(predicate, timeout=300, what="the condition"):
    """Poll ``predicate`` every 0.2 s until it is true; fail after ``timeout`` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def logged_step(log, step):
    """Whether the log at ``log`` has a train-loss line at ``step`` or later."""
    try:
        text = open(log, encoding="utf-8").read()
    except OSError:
        return False
    steps = [int(ln.split()[0].split(":")[1].split("/")[0]) for ln in text.splitlines()
             if ln.startswith("step:") and " train_loss:" in ln]
    return bool(steps) and max(steps) >= step


def no_temp_files(root):
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if ".tmp" in n or n.endswith(".lock")]


def long_run(tmp_path, run_id, *extra):
    """The tiny model for many steps (a test stops it): no val in between, checkpoints on at the end."""
    return tiny_args(tmp_path, "--num-iterations", "400", "--val-every", "0", "--run-id", run_id, *extra)


# ---------------------------------------------------------------------------------------------
# a full disk at a checkpoint: a real tmpfs of 64 KiB under --checkpoint-dir


def in_small_filesystem(folder, argv, tmp_path, size="64k"):
    """Run ``argv`` with a 64 KiB tmpfs mounted on ``folder`` in a private mount namespace (unshare; root, or a user
    namespace otherwise); returns (CompletedProcess, the files left in the tmpfs). Skips where no namespace can be
    made (the test then reports skipped, never passed)."""
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    script = ('s="$1"; d="$2"; shift 2; mkdir -p "$d" && mount -t tmpfs -o size="$s" tmpfs "$d" || exit 99; "$@"; '
              'code=$?; '
              'find "$d" -type f > "$d.files"; exit $code')
    probe = subprocess.run([*unshare, "sh", "-c", script, "sh", size, str(tmp_path / "probe"), "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here ({probe.stderr.strip()[:200]})")
    out = subprocess.run([*unshare, "sh", "-c", script, "sh", size, str(folder), *argv], capture_output=True, text=True,
                         env=ENV, cwd=tmp_path, timeout=600)
    return out, open(f"{folder}.files").read().split()


def test_a_real_full_disk_at_a_checkpoint_is_one_line_naming_the_flag_and_the_space(tmp_path):
    ckpt = tmp_path / "ckpt"
    out, left = in_small_filesystem(ckpt, [sys.executable, WORKER, *tiny_args(
        tmp_path, "--save-every", "2", "--val-every", "0", "--run-id", "full")], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = error_lines(out.stderr)
    path = ckpt / "full" / "step_000002.pt"
    assert line.startswith(f"train_gpt.py: error: --checkpoint-dir: cannot write {path} (No space left on device; it "
                           f"needs about ") and line.endswith("MiB are free); free space there or choose another "
                                                             "--checkpoint-dir"), line
    assert left == []  # no temporary file in the full filesystem
    text = read_log(tmp_path / "logs", "full")
    assert "step:2/8 train_loss" in text and "step:3/8" not in text
    assert text.splitlines()[-1] == f"status:incomplete reason:{line.removeprefix('train_gpt.py: error: ')}"
    assert json.loads((tmp_path / "logs" / "full.json").read_text())["status"] == "incomplete"
    assert no_temp_files(tmp_path / "logs") == []


@pytest.mark.parametrize("when", ["at the start", "during the run"])
def test_a_log_disk_that_fills_is_one_line_exit_2_and_no_lock_left(tmp_path, when):
    logs = tmp_path / "logs"
    room = len(H.source_snapshot().encode()) + 12 * 1024  # the snapshot, the header and a few step lines
    size = "64k" if when == "at the start" else f"{-(-room // 4096) * 4}k"
    out, left = in_small_filesystem(logs, [sys.executable, WORKER, *long_run(tmp_path, "fill")], tmp_path, size)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = error_lines(out.stderr)
    assert line.startswith(f"train_gpt.py: error: --log-dir") and "choose another --log-dir" in line, line
    assert not [f for f in left if f.endswith((".lock", ".tmp"))], left
    if when == "during the run":  # the log holds the steps written before the disk filled
        assert any(f.endswith("fill.txt") for f in left), left


def test_the_space_a_checkpoint_needs_is_its_tensors_bytes():
    state = dict(a=torch.zeros(10), b=[torch.zeros(3, dtype=torch.float64), {"c": torch.zeros(2, dtype=torch.int8)}],
                 step=3, name="x")
    assert H.state_bytes(state) == 10 * 4 + 3 * 8 + 2 * 1


# ---------------------------------------------------------------------------------------------
# signals: the terminal closes (SIGHUP), Ctrl-C under run.sh's torchrun


def test_a_closed_terminal_finishes_the_step_checkpoints_marks_the_log_and_exits_129(tmp_path):
    """The trainer on a pty as its controlling terminal; the terminal's master end closes (an ssh session ends): the
    kernel sends SIGHUP, the run stops after its step with a checkpoint and the log and JSON say so."""
    master, slave = pty.openpty()

    def own_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen([sys.executable, WORKER, *long_run(tmp_path, "hup", "--save-final")], stdin=slave,
                            stdout=slave, stderr=slave, preexec_fn=own_terminal, env=ENV, cwd=tmp_path)
    os.close(slave)
    seen = []
    reader = threading.Thread(target=lambda: drain(master, seen), daemon=True)
    reader.start()
    try:
        wait_for(lambda: logged_step(tmp_path / "logs" / "hup.txt", 2), what="step 2")
        os.close(master)  # the hang-up
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert code == 129, b"".join(seen)[-2000:]
    text = read_log(tmp_path / "logs", "hup")
    step = int(text.splitlines()[-1].split("after step ")[1].split(";")[0])
    assert text.splitlines()[-1] == (f"status:interrupted reason:SIGHUP after step {step}; resume with --resume auto "
                                     f"--run-id hup")
    assert json.loads((tmp_path / "logs" / "hup.json").read_text())["status"] == "interrupted"
    assert os.listdir(tmp_path / "ckpt" / "hup") == [f"step_{step:06d}.pt"]
    assert no_temp_files(tmp_path) == []


def drain(fd, into):
    """Read a pty's output until it closes (so that the child never blocks on a full terminal)."""
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            into.append(chunk)
    except OSError:
        return


def smoke_under_run_sh(tmp_path, run_id, *extra):
    """run.sh's flags for cpu_smoke (the smoke model) at 2 sequences a step, as 2 processes can split."""
    return ["--seq-len", "128", "--batch-tokens", "768", "--num-iterations", "400", "--val-tokens", "512",
            "--val-every", "0", "--log-every", "1", "--run-id", run_id, "--log-dir", str(tmp_path / "logs"),
            "--checkpoint-dir", str(tmp_path / "ckpt"), *extra]


def test_ctrl_c_under_run_sh_with_two_processes_exits_130_without_torchruns_traceback(tmp_path):
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(["bash", os.path.join(REPO, "run.sh"), *smoke_under_run_sh(tmp_path, "cc",
                                                                                           "--save-final")],
                                env=dict(ENV, NPROC="2", TMPDIR=str(tmp_path)), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(lambda: logged_step(tmp_path / "logs" / "cc.txt", 2), what="step 2")
            proc.send_signal(signal.SIGINT)  # run.sh exec'd the launcher: this is the process Ctrl-C reaches
            code = proc.wait(timeout=300)
        finally:
            proc.kill()
    stderr = (tmp_path / "err").read_text()
    assert code == 130 and "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    text = read_log(tmp_path / "logs", "cc")
    step = int(text.splitlines()[-1].split("after step ")[1].split(";")[0])
    assert text.splitlines()[-1] == (f"status:interrupted reason:SIGINT after step {step}; resume with --resume auto "
                                     f"--run-id cc")
    assert os.listdir(tmp_path / "ckpt" / "cc") == [f"step_{step:06d}.pt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("torchelastic_", "torchrun_"))]  # torchrun's folder


# ---------------------------------------------------------------------------------------------
# process counts: refused before torchrun where run.sh can know, the trainer's one line and code where it cannot


def test_more_cpu_processes_than_a_step_holds_is_one_line_before_torchrun(tmp_path):
    out = subprocess.run(["bash", os.path.join(REPO, "run.sh")], env=dict(ENV, NPROC="8"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "train_gpt.py: error: 8 process(es) x --micro-batch-seqs 1 do not divide a step's 1 sequence(s) (--batch-tokens "
        "/ (3 x --seq-len)); run 1 process(es) (run.sh's NPROC, torchrun's --nproc_per_node)"], out.stderr
    assert not (tmp_path / "logs").exists()


def test_a_count_the_step_cannot_split_under_torchrun_is_rank_0s_line_and_exit_2(tmp_path):
    out = subprocess.run([*LAUNCH, "--nproc_per_node=3", WORKER, *tiny_args(tmp_path, "--batch-tokens", "768")],
                         env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "train_gpt.py: error: 3 process(es) x --micro-batch-seqs 1 do not divide a step's 4 sequence(s) (--batch-tokens "
        "/ (3 x --seq-len)); run 1 or 2 or 4 process(es) (run.sh's NPROC, torchrun's --nproc_per_node)"], out.stderr


@pytest.mark.parametrize("micro, world, says", [
    (1, 3, "run 1 or 2 or 4 process(es) (run.sh's NPROC, torchrun's --nproc_per_node)"),
    (4, 2, "run 1 process(es) (run.sh's NPROC, torchrun's --nproc_per_node), or --micro-batch-seqs 2 or 1"),
    (8, 1, "run 1 or 2 or 4 process(es) with --micro-batch-seqs 1 (run.sh's NPROC, torchrun's --nproc_per_node), or "
           "--micro-batch-seqs 4 or 2 or 1")])
def test_every_fix_a_refused_process_count_names_works(tmp_path, micro, world, says):
    cfg = H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path, "--batch-tokens", "768", "--micro-batch-seqs",
                                                       str(micro)))[0]
    with pytest.raises(H.ConfigError) as refused:
        T.grad_accum_steps(cfg, world)
    assert str(refused.value).endswith(says), str(refused.value)
    fixes = says.split(", or ")
    for count in fixes[0].split("run ")[1].split(" process")[0].split(" or "):  # each count named, at its micro
        m = 1 if "with --micro-batch-seqs 1" in fixes[0] else micro
        assert T.grad_accum_steps(T.dataclasses.replace(cfg, micro_batch_seqs=m), int(count)) >= 1
    for m in (fixes[1].split("--micro-batch-seqs ")[1].split(" or ") if len(fixes) > 1 else []):
        assert T.grad_accum_steps(T.dataclasses.replace(cfg, micro_batch_seqs=int(m)), world) >= 1


# ---------------------------------------------------------------------------------------------
# a rank that stalls: the live rank names --dist-timeout, the collective and the stalled rank


def rank_pids(launcher):
    """``{rank: pid}`` of the processes torchrun started under the launcher pid (read from /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and b"RANK" in env:
            out[int(env[b"RANK"])] = int(name)
    return out


@pytest.mark.parametrize("stalled", [0, 1])
def test_a_stalled_rank_is_named_by_the_live_one_and_the_log_marked(tmp_path, stalled):
    live = 1 - stalled
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([*LAUNCH, "--nproc_per_node=2", WORKER, *long_run(
            tmp_path, "stall", "--batch-tokens", "384", "--dist-timeout", "4")], env=ENV, cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(lambda: logged_step(tmp_path / "logs" / "stall.txt", 3), what="step 3")
            pids = rank_pids(proc.pid)
            os.kill(pids[stalled], signal.SIGSTOP)  # a hung rank: alive, never at the next collective
            code = proc.wait(timeout=300)
        finally:
            for pid in rank_pids(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            proc.kill()
    stderr = (tmp_path / "err").read_text()
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    [line] = error_lines(stderr)
    assert line.startswith(f"train_gpt.py: rank {live}: ") and " timed out after --dist-timeout 4 s; rank(s) " \
        f"{stalled} never reached it (stalled or hung); raise --dist-timeout if a rank is only slow" in line, line
    last = read_log(tmp_path / "logs", "stall").splitlines()[-1]
    assert last.startswith(f"status:incomplete reason:rank {live}: ") and f"rank(s) {stalled} never reached" in last
    assert last.endswith(" (written by rank 1)") == (stalled == 0), last  # rank 0 stalled: rank 1 wrote it
    assert json.loads((tmp_path / "logs" / "stall.json").read_text())["status"] == "incomplete"


# ---------------------------------------------------------------------------------------------
# one run id, one run


def test_a_second_process_with_the_same_run_id_is_refused_while_the_first_runs(tmp_path):
    with open(tmp_path / "err", "w") as err:
        first = subprocess.Popen([sys.executable, WORKER, *long_run(tmp_path, "one")], env=ENV, cwd=tmp_path,
                                 stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_for(lambda: logged_step(tmp_path / "logs" / "one.txt", 1), what="step 1")
            for again in ([], ["--resume", "auto", "--save-every", "100"]):
                second = subprocess.run([sys.executable, WORKER, *long_run(tmp_path, "one", *again)], env=ENV,
                                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
                assert second.returncode == 2, second.stderr[-2000:]
                if again:  # --resume auto needs a checkpoint first: refused for that, before the lock
                    continue
                assert second.stderr.splitlines() == [
                    f"train_gpt.py: error: --run-id one: another process (pid {first.pid} on {os.uname().nodename}) is "
                    f"running this run ({tmp_path / 'logs' / 'one.lock'}); wait for it to end, or choose another "
                    f"--run-id"], second.stderr
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=300) == 130
        finally:
            first.kill()
    text = read_log(tmp_path / "logs", "one")
    assert [ln for ln in text.splitlines() if ln.startswith("status:")] == [text.splitlines()[-1]]
    assert text.splitlines()[-1].startswith("status:interrupted reason:SIGTERM after step ")
    assert not (tmp_path / "logs" / "one.lock").exists()  # removed at its exit


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "st.lock").write_text(f"{os.uname().nodename} {gone.pid}\n")
    assert T.main(tiny_args(tmp_path, "--max-steps", "1", "--run-id", "st"), models=SPECS) == 0
    assert read_log(tmp_path / "logs", "st").splitlines()[-1] == "status:stopped_early reason:--max-steps 1"
    assert not (tmp_path / "logs" / "st.lock").exists()


# ---------------------------------------------------------------------------------------------
# the tools: compare.py with no complete log, sample.py's mismatch


def test_compare_exits_1_when_every_log_it_found_is_incomplete(tmp_path):
    assert T.main(tiny_args(tmp_path, "--max-steps", "1", "--run-id", "short"), models=SPECS) == 0
    out = subprocess.run([sys.executable, os.path.join(REPO, "records", "compare.py"), str(tmp_path / "logs")],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == ("compare.py: error: none of the 1 log(s) is complete (listed above with "
                                           "why); nothing was compared")
    assert "short" in out.stdout  # the table lists it, with why


def test_sample_names_the_first_keys_that_do_not_fit(tmp_path):
    import sample
    assert T.main(tiny_args(tmp_path, "--max-steps", "1", "--save-final", "--run-id", "s"), models=SPECS) == 0
    path = tmp_path / "ckpt" / "s" / "step_000001.pt"
    state = torch.load(path, weights_only=True)
    weights = state["model"]
    dropped = sorted(weights)[0]
    del weights[dropped]
    weights["extra.weight"] = torch.zeros(1)
    weights["lm_head.weight"] = torch.zeros(3, 32)
    torch.save(state, path)
    with pytest.raises(sample.SampleError) as err:
        sample.load_model(str(path), torch.device("cpu"), SPECS)
    assert str(err.value) == (f"--checkpoint {path}: its weights do not fit its config (missing {dropped}; unexpected "
                              f"extra.weight; another shape lm_head.weight (lm_head.weight: [3, 32] saved, [50304, 32] "
                              f"here)); it was not written by this train_gpt.py, or was edited")
