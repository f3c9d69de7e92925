"""Bad values of record #89's model flags and presets: each gives one ConfigError line naming the flag
and the fix (exit status 2 from the CLI), never a traceback from deep in the model."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import harness as H
import train_gpt as T
from conftest import sample_args

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


# ---------------------------------------------------------------------------------------------
# A typed flag the config does not read is refused, not accepted to do nothing (harness.unread_fields)

# (words after train_gpt.py, the flag the one line names, words it must hold besides)
UNREAD = [
    (SMOKE + ["--embed-lr", "0.3"], "--embed-lr", "--optimizer aurora_normuon"),
    (SMOKE + ["--head-lr", "0.3"], "--head-lr", "--optimizer aurora, muon or adamw"),
    (SMOKE + ["--scalar-lr", "0.3"], "--scalar-lr", "CautiousAdam"),
    (SMOKE + ["--adam-beta1", "0.9"], "--adam-beta1", "drop it"),
    (SMOKE + ["--adam-beta2", "0.99"], "--adam-beta2", "drop it"),
    (SMOKE + ["--adamw-lr", "0.01"], "--adamw-lr", "--optimizer adamw"),
    (SMOKE + ["--adamw-wd", "0.1"], "--adamw-wd", "--optimizer adamw"),
    (["--preset", "baseline_h200", "--embed-lr", "0.3"], "--embed-lr", "--optimizer normuon"),
    (SMOKE + ["--optimizer", "normuon", "--pp-iterations", "3"], "--pp-iterations", "aurora or aurora_normuon"),
    (["--optimizer", "muon", "--pp-beta", "0.3"], "--pp-beta", "--optimizer muon"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum", "--adamw-lr"),
    (["--optimizer", "adamw", "--matrix-lr", "0.01"], "--matrix-lr", "--optimizer adamw"),
    (["--optimizer", "aurora", "--adamw-lr", "0.01"], "--adamw-lr", "--optimizer aurora"),
    (SMOKE + ["--warmup-steps", "5"], "--warmup-steps", "--stages record89"),
    (SMOKE + ["--tst-frac", "0", "--tst-bag-size", "8"], "--tst-bag-size", "--tst-frac 0"),
    (["--preset", "baseline_h200", "--tst-bag-size", "4"], "--tst-bag-size", "add --tst-frac r > 0"),
    (SMOKE + ["--tst-frac", "0", "--tst-mode", "input"], "--tst-mode", "--tst-frac 0"),
    (SMOKE + ["--resume-force"], "--resume-force", "add --resume"),
    (SMOKE + ["--keep-checkpoints", "3"], "--keep-checkpoints", "add --save-every"),
    (["--optimizer", "aurora", "--pp-iterations", "1", "--pp-beta", "0.3"], "--pp-beta", "--pp-iterations 1"),
    (["--momentum-warmup-steps", "0", "--momentum-start", "0.5"], "--momentum-start", "momentum is --momentum"),
]


@pytest.mark.parametrize("argv, flag, says", UNREAD, ids=[" ".join(c[0]) for c in UNREAD])
def test_a_typed_flag_the_config_does_not_read_exits_2_in_one_line(tmp_path, capsys, argv, flag, says):
    assert T.main(argv + ["--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_gpt.py: error: "), err
    assert f"{flag} has no effect" in err[0] and says in err[0], err
    assert not (tmp_path / "logs").exists()  # refused before anything is written


def test_the_cli_refuses_an_unread_flag_with_exit_2():
    proc = subprocess.run([sys.executable, "train_gpt.py", *SMOKE, "--embed-lr", "0.3", "--describe"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("train_gpt.py: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_every_preset_the_studies_and_gpu_check_and_read_flags_are_accepted():
    """Only typed flags count: a preset's value of a field its family does not read (baseline_h200's head_lr,
    the other families' Adam lrs) is no refusal, and neither are the small-scale arms' and gpu_check's words."""
    import small_scale as ss
    for name in T.PRESETS:
        T.parse_config(["--preset", name])
    for spec in ss.MODES.values():
        spec = dict(spec, val_files="v", trainer="train_gpt.py", order_globs=["o"] * 3, trainer_args=[])
        for arm in ss.ARMS:
            T.parse_config(ss.trainer_argv(spec, "out", "r", 0, arm, spec["sweep"][0], "t")[2:])
    for name in T.PRESETS:
        for dry in ([], ["--dry-run"]):
            args = gpu_check.parse_args([*dry, "--preset", name])
            T.parse_config(gpu_check.timing_argv(args, name, [], "cpu", "out")[1])
    T.parse_config(gpu_check.check_argv(gpu_check.parse_args(["--dry-run"]), [], "cpu", "out", "c", bf16=True))
    read = [SMOKE + ["--optimizer", "aurora", "--embed-lr", "0.3", "--adam-beta1", "0.9"],
            ["--optimizer", "adamw", "--adamw-lr", "0.01", "--embed-lr", "0.3"],
            SMOKE + ["--optimizer", "normuon", "--matrix-lr", "0.02", "--momentum", "0.9", "--adam-eps", "1e-8"],
            SMOKE + ["--pp-iterations", "3"], ["--warmup-steps", "5"],
            SMOKE + ["--tst-frac", "0", "--tst-bag-size", "1"],
            SMOKE + ["--save-every", "5", "--keep-checkpoints", "3"], ["--resume", "auto", "--resume-force"]]
    for argv in read:
        T.parse_config(argv)


# A tiny model with every Adam group (embedding, value embedding, head, the x0 gates' scalars): 4 steps, momentum
# ramping up over the first 2, so that every optimizer field a family reads changes the weights.
TINY = dict(n_layer=2, model_dim=32, n_head=2, seq_len=16, batch_tokens=32, micro_batch_seqs=2, num_iterations=4,
            val_tokens=64, value_embeds=1, x0_gates=True, momentum_warmup_steps=2)
OTHER = dict(embed_lr=1.2, head_lr=0.02, scalar_lr=0.08, adam_beta1=0.5, adam_beta2=0.8, adamw_lr=0.01, adamw_wd=0.1,
             matrix_lr=0.01, matrix_wd=0.5, momentum=0.9, momentum_start=0.5, momentum_warmup_steps=1,
             momentum_cooldown_steps=2, nesterov=False, ns="quintic5", ns_dtype="bfloat16", pp_iterations=1,
             pp_beta=0.9)


def trained_weights(cfg):
    """The weights after N steps of ``T.build_optimizers`` on fixed random gradients, each step's lr and momentum
    from the stage table (``T.apply_schedule``), as the trainer's loop steps them."""
    torch.manual_seed(0)
    model = T.GPT(cfg)
    opts, table, g = T.build_optimizers(model, cfg), T.Schedule(cfg), torch.Generator().manual_seed(1)
    for step in range(cfg.num_iterations):
        T.apply_schedule(opts, table[step])
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for opt in opts:
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("optimizer", sorted(H.OPTIMIZER_READS))
def test_the_optimizer_fields_a_family_does_not_read_change_nothing_and_the_others_do(optimizer):
    """The refusal's table (harness.OPTIMIZER_READS) against the optimizers: each field it calls unread leaves
    the weights bit for bit; each field it calls read moves them (so neither list can be wrong unseen)."""
    assert set(OTHER) == {f for names, _ in H._UNREAD_WHY for f in names}
    base = T.Config(**TINY, optimizer=optimizer)
    H.validate_config(base)
    ref = trained_weights(base)
    unread = {f for f in H.unread_fields(base) if f in OTHER}
    assert unread == set(OTHER) - set(H.OPTIMIZER_READS[optimizer])
    for name, value in OTHER.items():
        assert getattr(base, name) != value, name
        same = torch.equal(trained_weights(dataclasses.replace(base, **{name: value})), ref)
        assert same == (name in unread), (name, "unread" if name in unread else "read")


def test_warmup_steps_under_the_stage_table_and_tst_flags_without_tst_change_no_step():
    base, _ = T.parse_config(SMOKE + ["--tst-frac", "0"])
    for kw in (dict(warmup_steps=5), dict(tst_bag_size=8), dict(tst_mode="input")):
        assert set(kw) <= set(H.unread_fields(base))
        assert T.Schedule(dataclasses.replace(base, **kw)).rows == T.Schedule(base).rows, kw
    flags, _ = T.parse_config(["--warmup-steps", "5"])  # --stages flags: the warm-up is the lr's first rows
    assert T.Schedule(flags).rows[0].lr_scale == 0.2 and "warmup_steps" not in H.unread_fields(flags)


def test_resume_of_a_folder_names_a_checkpoint_file_in_it(tmp_path, capsys):
    run = tmp_path / "ckpt" / "r"
    run.mkdir(parents=True)
    argv = SMOKE + [*sample_args(), "--log-dir", str(tmp_path / "logs"), "--resume", str(run)]
    assert T.main(argv) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert f"--resume {run}: a folder; give one of its checkpoint files (it holds no step_N.pt)" in err, err
    assert "--resume auto" in err and not (tmp_path / "logs").exists()
    for step in (2, 10):
        (run / f"step_{step:06d}.pt").write_bytes(b"")
    assert T.main(argv) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert f"(the newest: {run / 'step_000010.pt'})" in err, err


def test_gpu_check_without_describe_is_refused_in_one_line(tmp_path, capsys):
    # the report only projects --describe's times: a run would ignore it
    assert T.main(SMOKE + ["--gpu-check", str(tmp_path / "r.json"), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-check " in err[0] and "applies to --describe only" in err[0], err
    assert not (tmp_path / "logs").exists()
