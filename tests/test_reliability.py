"""The failures users meet (issue 45 item 5), each replayed: one stderr line naming the flag or file and the fix, the
exit status, no traceback, and nothing lost (a log that had started is kept and marked; no temporary file left).

A failure before the log exists writes nothing; one after it ends the log with ``status:incomplete reason:<line>``.
Resumes whose config or data differ and signals are in test_checkpoint.py, torchrun in test_distributed.py.
"""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import harness as H
import train_gpt as T
from conftest import REPO, SPECS, read_log, subprocess_env, tiny_args, write_shard


def error_lines(err):
    """stderr less the ``log: <path> (<status>)`` line every run that had a log ends with."""
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("log: ")]


def one_line(capsys, code, argv):
    """Run ``T.main(argv)`` (--model may name the tiny spec); assert its exit status, one error line and no
    traceback; return the line."""
    assert T.main(argv, models=SPECS) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def nothing_written(tmp_path):
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()


def marked(tmp_path, line, status="incomplete"):
    """The run's log (the only one) ends with its status and the reason, the JSON agrees, no temporary file."""
    text = read_log(tmp_path / "logs")
    assert text.startswith("### file train_gpt.py")  # the snapshot kept
    reason = line.removeprefix("train_gpt.py: ").removeprefix("error: ")
    assert text.splitlines()[-1] == f"status:{status} reason:{reason}"
    [summary] = [p for p in (tmp_path / "logs").iterdir() if p.suffix == ".json"]
    assert json.loads(summary.read_text())["status"] == status
    assert no_temp_files(tmp_path) == []
    return text


def no_temp_files(tmp_path):
    return [os.path.join(d, n) for d, _, names in os.walk(tmp_path) for n in names if ".tmp" in n]


def data_flags(folder, train="t_train_*.bin"):
    return ["--train-files", str(folder / train), "--val-files", str(folder / "t_val_*.bin")]


# ---------------------------------------------------------------------------------------------
# data: globs, shards, ids, overlap


@pytest.mark.parametrize("flag", ["--train-files", "--val-files"])
@pytest.mark.parametrize("where", ["missing folder", "empty folder"])
def test_a_glob_that_matches_nothing_names_the_flag_and_writes_nothing(tmp_path, capsys, flag, where):
    folder = tmp_path / "data"
    if where == "empty folder":
        folder.mkdir()
    glob = str(folder / "*.bin")
    line = one_line(capsys, 2, tiny_args(tmp_path, flag, glob))
    assert line == (f"train_gpt.py: error: {flag} {glob!r}: no file matches; download shards with `python "
                    f"data/cached_fineweb10B.py` or point {flag} (or DATA_DIR for run.sh) at shards")
    nothing_written(tmp_path)


def test_shards_that_hold_no_tokens_are_named(tmp_path, shard_dir, capsys):
    empty = write_shard(shard_dir / "e_train_000001.bin", [])
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir, "e_train_*.bin")))
    assert line == f"train_gpt.py: error: {empty}: the shards hold no tokens; point the glob at other shards"
    marked(tmp_path, line)


@pytest.mark.parametrize("kind, broken, says", [
    ("bad header", dict(magic=7), "bad magic 7 (expected 20240520); not a token shard, re-download"),
    ("truncated", dict(truncate=5), "file is 1219 bytes but its header says 100 tokens (1224 bytes); truncated or "
                                    "corrupt, re-download"),
    ("short", dict(truncate=1223), "1 bytes is shorter than the 1024-byte shard header; re-download")])
def test_a_broken_shard_is_named_with_the_fix_and_the_log_marked(tmp_path, shard_dir, capsys, kind, broken, says):
    bad = write_shard(shard_dir / "t_train_000003.bin", list(range(100)), **broken)
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir)))
    assert line.startswith(f"train_gpt.py: error: {bad}: ") and says in line, line
    assert line.endswith("(data/cached_fineweb10B.py, data/tokenize_text.py)")
    marked(tmp_path, line)


@pytest.mark.parametrize("bad_id", [50257, 65535])  # a padding row of the embedding; the largest uint16
def test_a_token_id_beyond_gpt2s_vocabulary_names_the_shard_and_the_position(tmp_path, shard_dir, capsys, bad_id):
    tokens = np.arange(0, 1300) % 50000
    tokens[100] = bad_id
    bad = write_shard(shard_dir / "t_train_000002.bin", tokens)
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir)))
    assert line == (f"train_gpt.py: error: {bad}: token id {bad_id} > 50256 (the first at token 100): not GPT-2 BPE "
                    f"ids; re-tokenize with data/tokenize_text.py")
    marked(tmp_path, line)


def test_a_bad_id_past_the_first_scan_chunk_is_found(tmp_path, shard_dir, capsys):
    """The whole shard is scanned before step 0, not its first bytes: an id of another tokenizer in its last token,
    past the first chunk of the scan (``shard_format.SCAN_CHUNK`` tokens)."""
    import shard_format
    n = shard_format.SCAN_CHUNK + 1000
    tokens = np.arange(n) % 50000
    tokens[::700] = 50256
    tokens[-1] = 50300  # below the embedding's 50,304 rows: only the check can tell
    bad = write_shard(shard_dir / "t_train_000002.bin", tokens)
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir)))
    assert line == (f"train_gpt.py: error: {bad}: token id 50300 > 50256 (the first at token {n - 1:,}): not GPT-2 "
                    f"BPE ids; re-tokenize with data/tokenize_text.py")
    marked(tmp_path, line)


@pytest.mark.parametrize("kind", ["val", "train"])
def test_a_zero_filled_tail_is_refused_as_check_shards_refuses_it(tmp_path, shard_dir, capsys, kind):
    """A download or copy cut short that kept its size: real tokens, then zeros to the end. The trainer refuses it
    in the line data/check_shards.py prints for it, naming the file and where the zeros start."""
    import check_shards
    tokens = np.concatenate([np.arange(1000) % 50000, np.zeros(9000, dtype=np.int64)])
    tokens[0] = 50256
    bad = write_shard(shard_dir / f"t_{kind}_00000{3 if kind == 'train' else 0}.bin", tokens)
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir)))
    row, refused = check_shards.shard_row(bad)
    assert refused and line == f"train_gpt.py: error: {bad}: {row[4]}"
    assert "9,000 tokens from token 1,000 are zero-filled" in line, line
    marked(tmp_path, line)


@pytest.mark.parametrize("how", ["glob of every shard", "the val shard itself", "a copy under another name"])
def test_a_train_file_with_the_contents_of_a_val_file_is_refused(tmp_path, shard_dir, capsys, how):
    val = shard_dir / "t_val_000000.bin"
    train = {"glob of every shard": str(shard_dir / "*.bin"), "the val shard itself": str(val),
             "a copy under another name": str(shard_dir / "t_train_*.bin")}[how]
    if how == "a copy under another name":
        shutil.copy(val, shard_dir / "t_train_000009.bin")
    line = one_line(capsys, 2, tiny_args(tmp_path, "--train-files", train, "--val-files", str(val)))
    assert line.startswith(f"train_gpt.py: error: --train-files {train!r}: ") and f"has the contents of val shard " \
        f"{val}; exclude it (e.g. '<dir>/*_train_*.bin')" in line, line
    nothing_written(tmp_path)


def test_too_few_val_tokens_names_the_flag(tmp_path, shard_dir, capsys):
    line = one_line(capsys, 2, tiny_args(tmp_path, *data_flags(shard_dir), "--val-tokens", "5000"))
    assert "--val-tokens 5000: the val shards" in line and "hold only 600 tokens" in line, line
    marked(tmp_path, line)


# ---------------------------------------------------------------------------------------------
# processes


def test_a_process_count_that_does_not_split_the_batch_names_the_counts_that_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it: refused before joining the group
    line = one_line(capsys, 2, tiny_args(tmp_path, "--batch-tokens", "768"))  # 4 sequences a step
    assert line == ("train_gpt.py: error: 3 process(es) x --micro-batch-seqs 1 do not divide a step's 4 sequence(s) "
                    "(--batch-tokens / (3 x --seq-len)); run 1 or 2 or 4 process(es) (run.sh's NPROC, torchrun's "
                    "--nproc_per_node)")
    nothing_written(tmp_path)
    assert T.grad_accum_steps(H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path, "--batch-tokens", "768",
                                                                           "--micro-batch-seqs", "2"))[0], 2) == 1


def test_a_process_group_that_cannot_form_is_one_line_naming_what_to_check(tmp_path):
    with socket.socket() as s:  # a port nobody listens on, held for the run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        env = dict(subprocess_env(), WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        out = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), "--preset", "cpu_smoke",
                              "--batch-tokens", "4608", "--dist-timeout", "2", "--log-dir", str(tmp_path / "logs")],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = error_lines(out.stderr)[-1]  # after c10d's own C++ log of each failed try (torch's, not ours)
    assert line.startswith("train_gpt.py: error: cannot join the process group (") and \
        line.endswith(f"check MASTER_ADDR:MASTER_PORT and --dist-timeout (2 s)"), line
    nothing_written(tmp_path)


# ---------------------------------------------------------------------------------------------
# a full disk: the checkpoint, the log, the JSON summary


def enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_under_the_log_stops_in_one_line_and_keeps_what_was_written(tmp_path, capsys, monkeypatch):
    class FullFile:
        """A log file on a disk that is full: every write fails."""
        def __init__(self, f):
            self.f, self.closed = f, False

        def write(self, text):
            raise enospc()

        def close(self):
            self.closed = True
            self.f.close()

    real_write = H.RunLog.write

    def write(self, text):
        if text.startswith("step:3/"):
            self.file = FullFile(self.file)
        return real_write(self, text)
    monkeypatch.setattr(H.RunLog, "write", write)
    line = one_line(capsys, 2, tiny_args(tmp_path, "--run-id", "f"))
    path = tmp_path / "logs" / "f.txt"
    assert line == (f"train_gpt.py: error: --log-dir: cannot write {path} (No space left on device); free space "
                    f"there or choose another --log-dir")
    text = path.read_text()
    assert text.startswith("### file train_gpt.py") and "\nstep:2/8 train_loss" in text and "step:3/" not in text
    assert no_temp_files(tmp_path) == [] and not (tmp_path / "logs" / "f.json").exists()


def test_a_full_disk_for_the_summary_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    def dump_half(obj, f, **kw):
        f.write('{"run_id": ')
        raise enospc()
    monkeypatch.setattr(H.json, "dump", dump_half)
    line = one_line(capsys, 0, tiny_args(tmp_path, "--run-id", "j", "--max-steps", "1", "--val-every", "0"))
    assert line == (f"train_gpt.py: could not finish the log {tmp_path / 'logs' / 'j.txt'} ([Errno 28] No space left "
                    f"on device)")
    assert read_log(tmp_path / "logs", "j").splitlines()[-1] == "status:stopped_early reason:--max-steps 1"
    assert os.listdir(tmp_path / "logs") == ["j.txt"]


def test_a_log_dir_that_cannot_be_written_is_one_line_and_an_existing_run_id_keeps_its_log(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    line = one_line(capsys, 2, tiny_args(tmp_path, "--log-dir", str(tmp_path / "afile" / "logs")))
    assert line.startswith(f"train_gpt.py: error: --log-dir {str(tmp_path / 'afile' / 'logs')!r}: cannot write the "
                           f"log there (") and line.endswith("choose another --log-dir"), line
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "x.txt").write_text("an earlier run's log\n")
    line = one_line(capsys, 2, tiny_args(tmp_path, "--run-id", "x"))
    assert line == (f"train_gpt.py: error: --run-id x: {tmp_path / 'logs' / 'x.txt'} already exists; choose another "
                    f"--run-id")  # no checkpoint of it to continue from (test_bad_inputs: one with)
    assert os.listdir(tmp_path / "logs") == ["x.txt"] and (tmp_path / "logs" / "x.txt").read_text() == \
        "an earlier run's log\n"


# ---------------------------------------------------------------------------------------------
# the compiler, memory, a non-finite loss


def test_a_missing_compiler_toolchain_is_one_line_naming_no_compile(tmp_path, capsys, monkeypatch):
    from torch._inductor.exc import InvalidCxxCompiler

    def compile_without_a_compiler(fn=None, **kw):
        def compiled(*args, **kwargs):  # as inductor fails: at the first call, inside dynamo's wrapper
            try:
                raise InvalidCxxCompiler()
            except InvalidCxxCompiler as e:
                raise RuntimeError("backend='inductor' raised: InvalidCxxCompiler") from e
        return compiled
    monkeypatch.setattr(torch, "compile", compile_without_a_compiler)
    line = one_line(capsys, 2, tiny_args(tmp_path, "--compile"))
    assert line == ("train_gpt.py: error: torch.compile could not build the model (no working C/C++ compiler?); "
                    "install one or run --no-compile")
    text = marked(tmp_path, line)
    assert "\nstep:" not in text  # it failed in the warm-up, before the first step


OOM = "out of memory; lower --micro-batch-seqs (or --val-batch-seqs, --seq-len)"


def test_out_of_memory_is_one_line_naming_the_flag_that_lowers_it(tmp_path, capsys, monkeypatch):
    real, calls = T.accumulate_gradients, []

    def accumulate(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 23.44 GiB. GPU 0 has a total "
                                         "capacity of 139.81 GiB of which 1.06 GiB is free.")
        return real(*args)
    monkeypatch.setattr(T, "accumulate_gradients", accumulate)
    line = one_line(capsys, 2, tiny_args(tmp_path, "--val-every", "0"))
    assert line == f"train_gpt.py: error: {OOM}"
    text = marked(tmp_path, line)
    assert "step:1/8 train_loss" in text and "step:2/8" not in text


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 123456789012 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError()], ids=["cpu", "python"])
def test_a_cpus_out_of_memory_is_the_same_line(capsys, error):
    try:
        try:
            raise error
        except Exception as e:  # as torch.compile's wrapper raises what its backend raised
            raise RuntimeError("backend='inductor' raised") from e
    except RuntimeError as wrapped:
        assert H.failure(wrapped, SimpleNamespace(signal=None), None)[1:] == (OOM, 2)  # no log: none to mark
    assert capsys.readouterr().err == f"train_gpt.py: error: {OOM}\n"


def test_a_non_finite_loss_names_its_first_step_and_the_lr_flags(tmp_path, capsys, monkeypatch):
    real, calls = T.accumulate_gradients, []

    def accumulate(*args):
        calls.append(1)
        loss = real(*args)
        return loss * float("nan") if len(calls) >= 2 else loss  # from step 2 on
    monkeypatch.setattr(T, "accumulate_gradients", accumulate)
    line = one_line(capsys, 1, tiny_args(tmp_path, "--log-every", "4", "--val-every", "0"))
    assert line == ("train_gpt.py: train loss is not finite since step 2 (checked at 4); lower --matrix-lr or "
                    "--adam-lr, or check the data")  # the first bad step, not the log step that saw it
    marked(tmp_path, line)


# ---------------------------------------------------------------------------------------------
# a signal inside the compile warm-up: nothing to finish, nothing to save


def test_a_signal_during_the_compile_warm_up_stops_with_status_interrupted(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)  # the warm-up's calls, eager
    real_forward, calls = T.GPT.forward, []

    def forward(self, *args):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets the flag: this graph finishes
        return real_forward(self, *args)
    monkeypatch.setattr(T.GPT, "forward", forward)
    line = one_line(capsys, 130, tiny_args(tmp_path, "--compile", "--save-every", "1"))
    assert line == "train_gpt.py: interrupted by SIGINT"
    text = marked(tmp_path, line, "interrupted")
    assert len(calls) == 1 and "\ncompile: train [1, 64, 1]" in text and "\nstep:" not in text
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------------
# flags


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("flag", ["--seed", "--num-iterations", "--val-tokens"])
def test_integers_too_large_for_the_machine_are_refused_naming_the_flag(flag, sign):
    with pytest.raises(H.ConfigError, match=f"^{flag} must be < 2\\*\\*31 in magnitude"):
        H.parse_flags(T.Config, T.PRESETS, [flag, str(sign * 2**64)])


# ---------------------------------------------------------------------------------------------
# run.sh: the CPU path for real, the GPU path with a stand-in python that reports GPUs


def run_sh(tmp_path, *args, **env):
    return subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args], env={**subprocess_env(), **env},
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # test_data_tools runs run.sh on the CPU too
def test_run_sh_on_a_cpu_trains_cpu_smoke_on_the_sample(tmp_path):
    small = ["--seq-len", "128", "--batch-tokens", "384", "--num-iterations", "5", "--val-tokens", "1024",
             "--run-id", "c", "--log-dir", str(tmp_path / "logs")]
    out = run_sh(tmp_path, *small, OMP_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.startswith("run.sh: preset cpu_smoke on 1 CPU process(es), data data/sample\n")
    text = read_log(tmp_path / "logs", "c")
    assert "\npreset: cpu_smoke\n" in text and text.splitlines()[-1] == "status:complete"
    assert "\ndata train: data/sample/wikipedia_train_000001.bin tokens:" in text, text[-3000:]
    config = json.loads(next(ln for ln in text.splitlines() if ln.startswith("config: "))[8:])
    assert (config["model"], config["optimizer"], config["tst_frac"]) == ("smoke", "aurora_normuon", 0.3)


STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then echo "$GPUS"; exit 0; fi
echo "$*" >> "$CALLS"
"""


@pytest.mark.parametrize("gpus, nproc, want", [("8", "", 8), ("3", "", 2), ("1", "", 1), ("8", "4", 4)])
def test_run_sh_with_gpus_downloads_when_empty_then_runs_baseline_h200_under_torchrun(tmp_path, gpus, nproc, want):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    data = tmp_path / "my data[1]"  # a folder name with glob characters
    data.mkdir()
    env = dict(PYTHON=str(python), GPUS=gpus, CALLS=str(tmp_path / "calls"), DATA_DIR="my data[1]",
               **({"NPROC": nproc} if nproc else {}))
    out = run_sh(tmp_path, "--max-steps", "3", **env)
    assert out.returncode == 0, out.stderr
    glob = str(data).replace("[1]", "[[]1[]]")
    run = (f"--preset baseline_h200 --train-files {glob}/*_train_*.bin --val-files {glob}/*_val_*.bin --max-steps 3")
    launch = ([f"train_gpt.py {run}"] if want == 1 else  # several: the split checked (--describe), then torchrun
              [f"train_gpt.py {run} --describe", f"harness.py --standalone --nproc_per_node={want} train_gpt.py {run}"])
    assert (tmp_path / "calls").read_text().splitlines() == [f"data/cached_fineweb10B.py 10 --local-dir {data}",
                                                             *launch]
    assert f"run.sh: preset baseline_h200 on {want} GPU process(es), data {data}" in out.stderr
    (data / "f_train_000001.bin").write_bytes(b"")  # shards there: no download
    (tmp_path / "calls").unlink()
    assert run_sh(tmp_path, "--max-steps", "3", **env).returncode == 0
    assert (tmp_path / "calls").read_text().splitlines() == launch


def test_run_sh_refuses_more_processes_than_gpus_before_torchrun(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f_train_000001.bin").write_bytes(b"")
    out = run_sh(tmp_path, PYTHON=str(python), GPUS="2", CALLS=str(tmp_path / "calls"), DATA_DIR="d", NPROC="4")
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "run.sh: NPROC=4 but 2 GPU(s) are visible; set NPROC to at most 2"], out.stderr
    assert not (tmp_path / "calls").exists()  # nothing launched


@pytest.mark.parametrize("env, says", [
    (dict(NPROC="two"), "run.sh: NPROC=two: give a process count (1, 2, 4, 8)"),
    (dict(DATA_DIR="nowhere"), "run.sh: DATA_DIR={tmp}/nowhere holds no *_train_*.bin shards; point it at a folder of "
                               "shards (data/tokenize_text.py makes them from text) or unset it for data/sample"),
    (dict(PYTHON="false"), "run.sh: torch is not importable by false; first: pip install -r requirements.txt")])
def test_run_sh_refuses_in_one_line(tmp_path, env, says):
    out = run_sh(tmp_path, **env)
    assert out.returncode == 2 and out.stderr.splitlines() == [says.format(tmp=tmp_path)], out.stderr


def test_run_sh_with_a_python_without_torch_is_one_line_not_its_traceback(tmp_path):
    python = tmp_path / "python"  # this python without its site-packages: no torch to import
    python.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    out = run_sh(tmp_path, PYTHON=str(python))
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"run.sh: torch is not importable by {python}; first: pip install -r requirements.txt"], out.stderr
