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
    (["--run-id", "a/b"], "--run-id 'a/b': use letters, digits, '.', '_' and '-' (it names files)"),
    (["--run-id", "../up"], "--run-id '../up': use letters, digits, '.', '_' and '-' (it names files)"),
    (["--run-id", ".hidden"], "--run-id '.hidden': use letters, digits, '.', '_' and '-' (it names files)"),
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
