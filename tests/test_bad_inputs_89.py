"""Bad values of record #89's model flags and presets: each gives one ConfigError line naming the flag
and the fix (exit status 2 from the CLI), never a traceback from deep in the model."""
import os
import subprocess
import sys

import pytest
import torch

import train_gpt as T

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402

SMOKE = ["--preset", "cpu_smoke"]


def refusal(argv):
    """The ConfigError message that ``train_gpt.py argv`` gives (fails the test if the config is accepted)."""
    with pytest.raises(T.ConfigError) as e:
        T.parse_config(argv)
    return str(e.value)


# (extra flags on cpu_smoke (4 layers x 128), words the one-line message must hold)
CASES = [
    (["--ve-layers", "1,99"], ["--ve-layers '1,99'", "0..3"]),
    (["--ve-layers", "1,1"], ["--ve-layers '1,1'", "twice"]),
    (["--skip-gate", "3"], ["--skip-gate '3'", "two 0-based layer numbers 'a,b', e.g. 3,6"]),
    (["--skip-gate", "1,2,3"], ["--skip-gate '1,2,3'", "two 0-based layer numbers"]),
    (["--skip-gate", "a,b"], ["--skip-gate 'a,b'", "two 0-based layer numbers"]),
    (["--skip-gate=-1,2"], ["--skip-gate '-1,2'", "two 0-based layer numbers"]),
    (["--skip-gate", "3,2"], ["--skip-gate '3,2'", "a < b < n_layer (4)"]),
    (["--paired-head-layers", "0", "--n-head", "3", "--model-dim", "96", "--no-mudd"], ["--n-head 3 must be even"]),
    (["--rope-half", "--model-dim", "120", "--n-head", "4"], ["--rope-half", "multiple of 4"]),
    (["--bigram-vocab", "-1"], ["--bigram-vocab must be >= 0"]),
    (["--bigram-dim", "9999"], ["--bigram-dim 9999 exceeds --model-dim 128"]),
    (["--mudd-gates", "99"], ["--mudd-gates 99: give 0 (no gate MLPs) or 1..2", "--skip-gate '1,2'"]),  # 4 layers: no b >= 99
    (["--mudd-gates", "3"], ["--mudd-gates 3: give 0 (no gate MLPs) or 1..2"]),
    # a flag that only modifies another one is refused alone, not accepted to do nothing
    (["--no-key-offset", "--key-offset-docs"], ["--key-offset-docs", "needs --key-offset"]),
    (["--stages", "flags", "--window", "256", "--grow-seq-len"], ["--grow-seq-len", "needs --stages record89",
                                                                  "--no-grow-seq-len"]),
    (["--skip-gate", "", "--no-mudd"], ["--mudd-gates 2 needs", "--skip-gate 'a,b' with b >= 2"]),
    (["--attn-state-layer", "50"], ["--attn-state-layer 50", "below the last layer (3)"]),
    (["--xsa-layers", "x"], ["--xsa-layers 'x'", "0-based layer numbers"]),
    # a digit that int() does not read (superscript two) is a bad entry like any other
    (["--xsa-layers", "\u00b2"], ["--xsa-layers '\u00b2'", "0-based layer numbers"]),
    (["--ve-layers", "1,\u00b2"], ["--ve-layers '1,\u00b2'", "0-based layer numbers"]),
    (["--skip-gate", "1,\u00b2"], ["--skip-gate '1,\u00b2'", "two 0-based layer numbers"]),
    (["--attn-gate-layers", "1", "--model-dim", "8", "--n-head", "2", "--no-smear"], ["--attn-gate-layers", ">= 12"]),
    (["--smear", "--model-dim", "8", "--n-head", "2"], ["--smear reads 12 channels: --model-dim >= 12"]),
    (["--no-attn-layers", "0", "--attn-gate-layers", "3"], ["--bigram-vocab", "drop 0 from --no-attn-layers"]),
    (["--batch-tokens", "1000"], ["--batch-tokens 1000", "--seq-len 768"]),
    # an attention element on a layer without attention would be silently idle
    (["--no-attn-layers", "1", "--ve-layers", "3,2"], ["--xsa-layers names layer(s) [1]", "--no-attn-layers"]),
    (["--no-attn-layers", "2", "--ve-layers", "1,3"], ["--paired-head-layers names layer(s) [2]"]),
    (["--no-attn-layers", "2", "--ve-layers", "1,3", "--paired-head-layers", "0", "--attn-gate-layers", "2"],
     ["--attn-gate-layers names layer(s) [2]"]),
]


@pytest.mark.parametrize("extra,says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_model89_flag_is_refused_in_one_line(extra, says):
    msg = refusal(SMOKE + extra)
    assert "\n" not in msg
    for words in says:
        assert words in msg, msg
    assert "unpack" not in msg and "invalid literal" not in msg  # python's words, not the flag's fix


def test_mudd_alone_names_what_it_needs():
    msg = refusal(["--doc-mask", "--value-embeds", "1", "--mudd"])
    assert msg.startswith("--mudd needs --skip-gate, --attn-state-layer")


def test_a_preset_at_fewer_layers_names_every_layer_flag_at_once():
    msg = refusal(["--preset", "baseline_h200", "--n-layer", "4"])
    assert msg.startswith("--short-window-layers: there is no layer 4 (layers are 0..3); set ")
    for flag in ("--no-attn-layers", "--paired-head-layers", "--xsa-layers", "--attn-gate-layers", "--ve-layers",
                 "--skip-gate", "--attn-state-layer"):
        assert flag in msg, msg
    assert "for --n-layer 4 too" in msg


def test_refused_combinations_really_crash_the_model():
    """The two new refusals guard real failures: the model cannot run these configs."""
    bad = [dict(smear=True, model_dim=8, n_head=2), dict(bigram_vocab=7, no_attn_layers="0")]
    for kw in bad:
        cfg = T.Config(**{**dict(n_layer=2, n_head=2, model_dim=16, seq_len=8, batch_tokens=16, micro_batch_seqs=2,
                                 objectives=False), **kw})
        model = T.GPT(cfg)
        with pytest.raises((RuntimeError, TypeError)):
            model(torch.randint(0, 50257, (1, 8, 1)), torch.randint(0, 50257, (1, 8, 1)))


def test_gpu_check_bad_preset_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--dry-run", "--preset", "nosuch"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("gpu_check.py: error: --preset 'nosuch'"), err


@pytest.mark.parametrize("extra", [["--skip-gate", "3"], ["--smear", "--model-dim", "8", "--n-head", "2"]])
def test_cli_exits_2_with_one_line(extra):
    proc = subprocess.run([sys.executable, "train_gpt.py", *SMOKE, "--describe", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: ") and extra[0] in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("bad, says", [(["--train-files", "nowhere/*_train_*.bin"], "'nowhere/*_train_*.bin'"),
                                       (["--dist-timeout", "0"], "--dist-timeout must be >= 1"),
                                       (["--seq-len", "abc"], "argument --seq-len: invalid int value")],
                         ids=["glob", "value", "argparse"])
def test_under_torchrun_rank_0_alone_says_a_refusal_every_rank_makes(monkeypatch, capsys, bad, says):
    """A start-up refusal that every rank makes alike (the flags, harness.check_start): rank 0's one line, the
    other ranks exit 2 silently (torchrun would otherwise print one line per rank)."""
    argv = [*SMOKE, "--batch-tokens", "4608", "--micro-batch-seqs", "1", "--log-dir", "/nonexistent/logs", *bad]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        try:
            code = T.main(argv)
        except SystemExit as e:  # argparse's own refusal
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        if rank == "1":
            assert err == [], err
        else:
            assert len(err) == 1 and err[0].startswith("train_gpt.py: error: ") and says in err[0], err
