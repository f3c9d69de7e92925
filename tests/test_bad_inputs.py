"""Bad flag values: each gives one line naming the flag and the fix (exit status 2), before anything is written,
never a traceback. The failures of a run that has started (data, disk, memory, signals) are in test_reliability.py."""
import subprocess
import sys

import pytest

import harness as H
import train_gpt as T
from conftest import REPO, SPECS, subprocess_env, tiny_args


def refused(tmp_path, capsys, *argv):
    """The one stderr line of ``train_gpt.py argv`` (tiny_args, then ``argv``; --model may name the product's specs
    and the tiny one, ``SPECS``): exit 2, nothing written."""
    assert T.main(tiny_args(tmp_path, *argv), models=SPECS) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()
    [line] = err.splitlines()
    return line


CASES = [  # (flags, the line after "train_gpt.py: error: ")
    (["--tst-bag-size", "0"], "--tst-bag-size must be >= 1 (got 0)"),
    (["--tst-frac", "1.0"], "--tst-frac must be >= 0.0 and < 1.0 (got 1.0)"),
    (["--seq-len", "0"], "--seq-len must be >= 1 (got 0)"),
    (["--momentum", "1.5"], "--momentum must be >= 0.0 and < 1.0 (got 1.5)"),
    (["--matrix-lr", "inf"], "--matrix-lr must be finite (got inf)"),
    (["--adam-lr", "nan"], "--adam-lr must be finite (got nan)"),
    (["--num-iterations", "3"], "--num-iterations must be >= 4 (got 3)"),
    (["--batch-tokens", "200"], "--batch-tokens 200 must be a multiple of 3 x --seq-len (192): stage k trains k "
                                "thirds of it in sequences of k x --seq-len"),
    (["--extension-steps", "6"], "--extension-steps 6 leaves fewer than 3 of --num-iterations 8 for the three stages"),
    (["--tst-frac", "0.5", "--tst-bag-size", "600", "--val-tokens", "1000"],
     "--tst-bag-size 600 needs --val-tokens >= 1200 (a bag and its next bag); lower the bag size"),
    (["--model", "huge"], "--model 'huge': choose one of record, smoke, tiny"),
    (["--run-id", "a/b"], "--run-id 'a/b': use up to 200 letters, digits, '.', '_' and '-' (it names files)"),
    (["--run-id", "../up"], "--run-id '../up': use up to 200 letters, digits, '.', '_' and '-' (it names files)"),
    (["--run-id", ".hidden"], "--run-id '.hidden': use up to 200 letters, digits, '.', '_' and '-' (it names files)"),
    (["--log-dir", ""], "--log-dir '': name a folder (default 'logs')"),
    (["--checkpoint-dir", ""], "--checkpoint-dir '': name a folder (default 'checkpoints')"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible; use --device cpu"),
    (["--describe", "9xA100"], "--describe '9xA100': give GPUs as NxGPU, e.g. 8xB200 (H100, H200 or B200)"),
    (["--seq-len", "abc"], "argument --seq-len: invalid int value: 'abc' (--help lists every flag)"),
    (["--tst-mode", "bags"], "argument --tst-mode: invalid choice: 'bags' (choose from full, input, output) (--help "
                             "lists every flag)"),
    (["--optimizer", "adamw"], "argument --optimizer: invalid choice: 'adamw' (choose from normuon, aurora_normuon) "
                               "(--help lists every flag)"),
    # flags are matched whole: argparse would read --lr as --lr-floor, its only completion
    (["--lr", "0.05"], "unrecognized arguments: --lr 0.05 (--help lists every flag)"),
    (["--log-d=x"], "unrecognized arguments: --log-d=x (--help lists every flag)"),
    (["--resume-force"], "unrecognized arguments: --resume-force (--help lists every flag)"),
]


@pytest.mark.parametrize("flags, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_flag_value_is_one_line_naming_the_flag(tmp_path, capsys, monkeypatch, flags, says):
    if flags[0] == "--device":
        monkeypatch.setattr(H.torch.cuda, "is_available", lambda: False)
    assert unquoted(refused(tmp_path, capsys, *flags)) == unquoted(f"train_gpt.py: error: {says}")


def unquoted(line):
    """argparse quotes the choices it lists in some Python versions (3.11), not in others: compare without quotes."""
    return line.replace("'", "")


def test_a_resume_of_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    line = refused(tmp_path, capsys, "--resume", str(tmp_path / "r"))
    assert line.startswith(f"train_gpt.py: error: --resume {tmp_path / 'r'}: not a readable train_gpt.py checkpoint "
                           f"(IsADirectoryError: ") and line.endswith("give a <checkpoint-dir>/<run-id>/step_N.pt file")


@pytest.mark.parametrize("argv, says", [
    (["--seq-len", "-1", "--describe"], "train_gpt.py: error: --seq-len must be >= 1 (got -1)"),
    (["--preset", "nosuch"], "train_gpt.py: error: argument --preset: invalid choice: 'nosuch' (choose from "
                             "baseline_h200, record_h200, cpu_baseline, cpu_smoke) (--help lists every flag)")])
def test_the_command_line_exits_2_with_one_line(argv, says):
    out = subprocess.run([sys.executable, "train_gpt.py", *argv], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=300)
    assert (out.returncode, out.stdout, unquoted(out.stderr)) == (2, "", unquoted(says) + "\n")


# ---------------------------------------------------------------------------------------------
# found by a hostile-input pass: each failed on main f2b9ef6 (a traceback, a wrong diagnosis or a fix that cannot work)


def test_a_run_id_too_long_for_a_file_name_names_the_run_id(tmp_path, capsys):
    line = refused(tmp_path, capsys, "--run-id", "a" * 300)
    assert line == f"train_gpt.py: error: --run-id {'a' * 40!r}: use up to 200 letters, digits, '.', '_' and '-' " \
                   f"(it names files)", line


def test_a_log_dir_that_is_a_file_is_named_as_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert T.main(tiny_args(tmp_path, "--log-dir", str(tmp_path / "afile"), "--run-id", "r"), models=SPECS) == 2
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("log: ")]
    assert line == f"train_gpt.py: error: --log-dir {str(tmp_path / 'afile')!r} is a file; choose another --log-dir"


@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_used_run_id_suggests_resume_only_when_there_is_a_checkpoint(tmp_path, capsys, checkpoints):
    save = ["--save-every", "2"] if checkpoints else []
    assert T.main(tiny_args(tmp_path, "--run-id", "dup", "--max-steps", "2", *save), models=SPECS) == 0
    capsys.readouterr()
    assert T.main(tiny_args(tmp_path, "--run-id", "dup"), models=SPECS) == 2
    [line] = capsys.readouterr().err.splitlines()
    says = f"train_gpt.py: error: --run-id dup: {tmp_path / 'logs' / 'dup.txt'} already exists; choose another --run-id"
    assert line == says + (", or continue that run with --resume auto --run-id dup" if checkpoints else "")
    assert not (tmp_path / "logs" / "dup.lock").exists()


@pytest.mark.parametrize("damage", ["a weight gone", "no data", "no optimizer state"])
def test_a_damaged_checkpoint_is_one_line_and_leaves_its_run_complete(tmp_path, capsys, damage):
    assert T.main(tiny_args(tmp_path, "--run-id", "ck", "--max-steps", "2", "--save-every", "2"), models=SPECS) == 0
    state = H.torch.load(tmp_path / "ckpt" / "ck" / "step_000002.pt", weights_only=True)
    if damage == "a weight gone":
        state["model"].pop(next(iter(state["model"])))
    else:
        state.pop("data" if damage == "no data" else "optimizers")
    H.torch.save(state, tmp_path / "bad.pt")
    capsys.readouterr()
    code = T.main(tiny_args(tmp_path, "--run-id", "ck2", "--resume", str(tmp_path / "bad.pt")), models=SPECS)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = [ln for ln in err.splitlines() if not ln.startswith("log: ")]
    assert line.startswith(f"train_gpt.py: error: --resume {tmp_path / 'bad.pt'}: "), line
    assert ("not a readable train_gpt.py checkpoint" if damage == "no data" else "does not fit this run") in line
    assert "status:stopped_early" in (tmp_path / "logs" / "ck.txt").read_text()  # the first run's log untouched


def test_a_reader_that_leaves_does_not_stop_the_run(tmp_path):
    """``train_gpt.py ... | head -1``: the run goes on to its end, its log complete."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, train_gpt as T; from conftest import SPECS; "
                             "sys.exit(T.main(sys.argv[1:], models=SPECS))", *tiny_args(tmp_path, "--run-id", "p")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(subprocess_env(), PYTHONPATH=f"{REPO}:{REPO}/tests"))
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0 and "Traceback" not in err, err
    assert (tmp_path / "logs" / "p.txt").read_text().splitlines()[-1] == "status:complete"


def test_check_shards_refuses_shards_without_a_document_start(tmp_path):
    sys.path.insert(0, f"{REPO}/data")
    import shard_format
    shard_format.write_shard(str(tmp_path / "x_train_000001.bin"), list(range(100)))
    out = subprocess.run([sys.executable, f"{REPO}/data/check_shards.py", str(tmp_path / "x_train_000001.bin")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "no <|endoftext|> (id 50256) in any of these shards" in out.stdout, out.stdout


def test_a_quoted_list_of_trainer_flags_is_taken_whole():
    sys.path.insert(0, REPO)
    from _paths import glue_option
    assert glue_option(["--quick", "--trainer-args", "--no-fp8 --seed 3", "--jobs", "1"], "--trainer-args") == [
        "--quick", "--trainer-args=--no-fp8 --seed 3", "--jobs", "1"]
    assert glue_option(["--trainer-args"], "--trainer-args") == ["--trainer-args"]  # argparse names the missing value
