"""Checkpoints: exact resume in either TST phase, refusal of bad checkpoints, save on interrupt."""
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import harness as H
import train_gpt as T
from conftest import REPO, loss_lines, read_log, subprocess_env, tiny_args


def run(tmp_path, *extra):
    return T.main(tiny_args(tmp_path, "--num-iterations", "12", *extra))


@pytest.mark.parametrize("tst_frac, switch", [(0.25, 2), (0.75, 6)])
def test_resume_repeats_the_straight_run_exactly(tmp_path, tst_frac, switch):
    # 8 steps, saved and resumed at step 4 (a val step): in phase 2 (switch 2) or in phase 1 (switch 6)
    frac, n = str(tst_frac), ["--num-iterations", "8"]
    assert run(tmp_path / "straight", "--tst-frac", frac, "--run-id", "s", *n) == 0
    assert run(tmp_path / "split", "--tst-frac", frac, "--run-id", "r", "--max-steps", "4", "--save-final", *n) == 0
    ckpt = tmp_path / "split" / "ckpt" / "r" / "step_000004.pt"
    assert ckpt.exists()
    state = H.load_checkpoint(str(ckpt))
    assert state["step"] == 4 and state["phase"] == (1 if switch > 4 else 2)
    assert state["loader_position"] == state["counters"]["raw_tokens"]
    assert run(tmp_path / "split", "--tst-frac", frac, "--resume", "auto", *n) == 0  # same run id, same log
    straight = read_log(tmp_path / "straight" / "logs", "s")
    resumed = read_log(tmp_path / "split" / "logs", "r")
    assert f"tst_switch: step {switch}" in straight and f"tst_switch: step {switch}" in resumed
    assert loss_lines(resumed) == loss_lines(straight) and len(loss_lines(straight)) == 8
    assert loss_lines(resumed, "val_loss") == loss_lines(straight, "val_loss")
    assert sorted(loss_lines(straight, "val_loss")) == [0, 4, 8]
    lines = resumed.splitlines()
    resume_at = next(i for i, l in enumerate(lines) if l.startswith("resume: from "))
    assert "at step 4" in lines[resume_at] and lines[-1] == "status:complete"
    assert lines.index("status:stopped_early reason:--max-steps 4") < resume_at  # appended to the same log
    a = json.loads((tmp_path / "straight" / "logs" / "s.json").read_text())
    b = json.loads((tmp_path / "split" / "logs" / "r.json").read_text())
    assert a["train_losses"] == b["train_losses"] and a["raw_tokens"] == b["raw_tokens"]
    assert b["status"] == "complete" and b["steps"] == 8
    assert b["final_val_loss"] == a["final_val_loss"] and "last_val_loss" not in b  # step 4's was only the last


def steps_in(folder):
    return sorted(int(n[len("step_"):-len(".pt")]) for n in os.listdir(folder))


def test_save_every_keeps_the_newest_checkpoints_and_a_resume_from_them_repeats_the_straight_run(tmp_path):
    # --save-every 1 for 5 of 8 steps: --keep-checkpoints 2 (the default) leaves steps 4 and 5, 0 leaves all five
    n = ["--num-iterations", "8"]
    assert run(tmp_path / "straight", "--run-id", "s", *n) == 0
    assert run(tmp_path / "kept", "--run-id", "k", "--save-every", "1", "--max-steps", "5", *n) == 0
    assert run(tmp_path / "all", "--run-id", "a", "--save-every", "1", "--max-steps", "5", "--keep-checkpoints", "0",
               *n) == 0
    folder = tmp_path / "kept" / "ckpt" / "k"
    assert steps_in(folder) == [4, 5] and steps_in(tmp_path / "all" / "ckpt" / "a") == [1, 2, 3, 4, 5]
    text = read_log(tmp_path / "kept" / "logs", "k")
    assert [l for l in text.splitlines() if l.startswith("checkpoint: removed")] == [
        f"checkpoint: removed {folder / f'step_{s:06d}.pt'} (--keep-checkpoints 2)" for s in (1, 2, 3)]
    assert not [l for l in read_log(tmp_path / "all" / "logs", "a").splitlines() if l.startswith("checkpoint: removed")]
    # the resume picks step 5; it deletes only what it wrote itself, never the checkpoints it found
    assert run(tmp_path / "kept", "--resume", "auto", "--save-every", "1", *n) == 0
    assert "resume: from " + str(folder / "step_000005.pt") in read_log(tmp_path / "kept" / "logs", "k")
    assert steps_in(folder) == [4, 5, 7, 8]
    straight, resumed = read_log(tmp_path / "straight" / "logs", "s"), read_log(tmp_path / "kept" / "logs", "k")
    assert loss_lines(resumed) == loss_lines(straight) and len(loss_lines(straight)) == 8
    assert loss_lines(resumed, "val_loss") == loss_lines(straight, "val_loss")


def test_keep_checkpoints_never_counts_or_deletes_the_final_or_interrupt_checkpoint(tmp_path, monkeypatch):
    # --keep-checkpoints 1: of the periodic ones only the newest stays, beside step 5's --save-final one
    assert run(tmp_path, "--run-id", "f", "--save-every", "1", "--keep-checkpoints", "1", "--max-steps", "5",
               "--save-final") == 0
    assert steps_in(tmp_path / "ckpt" / "f") == [4, 5]
    # a SIGTERM during the step-4 validation: the --save-on-interrupt checkpoint of step 4 beside step 3's
    batches, calls = T.ValData.batches, []

    def signalled_batches(self, *args):
        calls.append(args)
        for i, batch in enumerate(batches(self, *args)):
            yield batch
            if len(calls) == 2 and i == 0:  # the step-4 validation (no TST: one per val), after its first batch
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(T.ValData, "batches", signalled_batches)
    assert run(tmp_path, "--run-id", "i", "--tst-frac", "0", "--save-every", "1", "--keep-checkpoints", "1",
               "--save-on-interrupt") == 130
    assert steps_in(tmp_path / "ckpt" / "i") == [3, 4]
    assert "status:interrupted reason:SIGTERM after step 4" in read_log(tmp_path / "logs", "i")



def test_a_new_run_never_overwrites_or_prunes_checkpoints_left_under_its_run_id(tmp_path, capsys):
    # the same --run-id and --checkpoint-dir from another --log-dir (so no log is in the way): a new run, or
    # another run's checkpoint resumed under that id, is refused before step 0; the folder stays as it was
    assert run(tmp_path, "--run-id", "x", "--save-every", "1", "--max-steps", "3") == 0
    assert run(tmp_path, "--run-id", "y", "--max-steps", "1", "--save-final") == 0
    folder = tmp_path / "ckpt" / "x"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert sorted(before) == ["step_000002.pt", "step_000003.pt"]
    capsys.readouterr()
    other = ["--log-dir", str(tmp_path / "other_logs")]
    for extra in ([], ["--resume", str(tmp_path / "ckpt" / "y" / "step_000001.pt")]):
        assert run(tmp_path, "--run-id", "x", "--save-every", "1", "--max-steps", "2", *other, *extra) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert f"--run-id x: {folder} already holds checkpoints" in line and "--resume auto --run-id x" in line, line
        assert "step_000002.pt" in line and "Traceback" not in line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not (tmp_path / "other_logs").exists()
    # continuing that run is what the folder is for
    assert run(tmp_path, "--run-id", "x", "--resume", "auto", "--save-every", "1", "--max-steps", "1") == 0
    assert steps_in(folder) == [2, 3, 4]

def test_checkpoint_holds_everything_a_run_needs(tmp_path):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "3", "--save-every", "3") == 0
    state = H.load_checkpoint(str(tmp_path / "ckpt" / "c" / "step_000003.pt"))
    for key in ("model", "optimizers", "step", "phase", "loader_position", "rng", "config", "run_id", "counters"):
        assert key in state
    assert len(state["optimizers"]) == 2 and state["run_id"] == "c" and state["config"]["num_iterations"] == 12
    assert not [n for n in os.listdir(tmp_path / "ckpt" / "c") if ".tmp" in n]  # written atomically


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, needle", [("truncated", "truncated or unreadable"), ("flipped", "sha256 mismatch")])
def test_corrupt_checkpoint_is_refused_with_a_clear_message(tmp_path, capsys, how, needle):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    ckpt = tmp_path / "ckpt" / "c" / "step_000002.pt"
    corrupt(ckpt, how)
    with pytest.raises(T.ConfigError, match=needle):
        H.load_checkpoint(str(ckpt))
    assert run(tmp_path, "--resume", str(ckpt)) == 2
    err = capsys.readouterr().err
    assert needle in err and str(ckpt) in err


def test_a_refused_resume_writes_nothing(tmp_path):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    (tmp_path / "logs" / "c.txt").write_text((tmp_path / "logs" / "c.txt").read_text())  # stable mtime/content
    before = {p.name: p.read_bytes() for p in (tmp_path / "logs").iterdir()}
    ckpt = tmp_path / "ckpt" / "c" / "step_000002.pt"
    assert run(tmp_path, "--resume", str(ckpt).replace("000002", "00002")) == 2  # a typo
    assert run(tmp_path, "--resume", str(ckpt), "--seed", "5") == 2  # another config
    assert {p.name: p.read_bytes() for p in (tmp_path / "logs").iterdir()} == before


@pytest.mark.parametrize("content", [b"", b"hello\n", b"\x00" * 2000])
def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, capsys, content):
    bogus = tmp_path / "bogus.pt"
    bogus.write_bytes(content)
    assert run(tmp_path, "--resume", str(bogus)) == 2
    assert "not a train_gpt.py checkpoint" in capsys.readouterr().err


def test_resume_force_cannot_change_the_model_shape(tmp_path, capsys):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    assert run(tmp_path, "--resume", "auto", "--n-layer", "3", "--resume-force") == 2
    assert "another shape" in capsys.readouterr().err


def test_resume_into_a_new_run_id_writes_a_full_snapshot_header(tmp_path):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "3", "--save-final") == 0
    assert run(tmp_path, "--run-id", "branch", "--resume", str(tmp_path / "ckpt" / "c" / "step_000003.pt")) == 0
    text = read_log(tmp_path / "logs", "branch")
    assert text.startswith("### file train_gpt.py") and "\nconfig: {" in text and "\nresume: from " in text


def test_resuming_another_runs_checkpoint_into_an_existing_log_is_refused(tmp_path, capsys):
    # run a's finished log must not receive run c's steps (nor its JSON summary be replaced)
    assert run(tmp_path, "--run-id", "c", "--max-steps", "3", "--save-final") == 0
    assert run(tmp_path, "--run-id", "a", "--max-steps", "2") == 0
    before = [(tmp_path / "logs" / f"a.{ext}").read_bytes() for ext in ("txt", "json")]
    capsys.readouterr()
    assert run(tmp_path, "--run-id", "a", "--resume", str(tmp_path / "ckpt" / "c" / "step_000003.pt")) == 2
    err = capsys.readouterr().err
    assert "--run-id a:" in err and "is the log of another run (the checkpoint is run c's)" in err, err
    assert [(tmp_path / "logs" / f"a.{ext}").read_bytes() for ext in ("txt", "json")] == before


def test_an_unwritable_checkpoint_dir_fails_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert run(tmp_path, "--save-final", "--checkpoint-dir", str(tmp_path / "afile")) == 2
    assert "--checkpoint-dir" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # refused before any log was written


def test_missing_checkpoint_and_empty_dir_are_clear(tmp_path, capsys):
    assert run(tmp_path, "--resume", str(tmp_path / "nope.pt")) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert run(tmp_path, "--resume", "auto") == 2
    assert "no checkpoint under" in capsys.readouterr().err


def test_resume_auto_with_a_run_id_picks_that_runs_newest_checkpoint(tmp_path):
    assert run(tmp_path, "--run-id", "a", "--max-steps", "2", "--save-final") == 0
    assert run(tmp_path, "--run-id", "b", "--max-steps", "3", "--save-final") == 0  # newer, other run
    assert run(tmp_path, "--run-id", "a", "--resume", "auto", "--max-steps", "1") == 0
    assert "resume: from " + str(tmp_path / "ckpt" / "a" / "step_000002.pt") in read_log(tmp_path / "logs", "a")


def test_resume_refuses_a_different_run_config_unless_forced(tmp_path, capsys):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    assert run(tmp_path, "--resume", "auto", "--tst-bag-size", "2", "--batch-tokens", "512") == 2
    err = capsys.readouterr().err
    assert "--resume-force" in err and "tst_bag_size" in err and "batch_tokens" in err
    assert run(tmp_path, "--resume", "auto", "--seed", "5", "--resume-force") == 0
    assert "resume_force: continuing despite differences: seed" in read_log(tmp_path / "logs", "c")


def interrupt_run(tmp_path, run_id, sig, after_step, *extra):
    """Start a 400-step run, send ``sig`` once its log shows ``after_step``; (exit code, log path)."""
    args = tiny_args(tmp_path, "--num-iterations", "400", "--val-every", "0", "--run-id", run_id, *extra)
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt.py"), *args], cwd=tmp_path,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / f"{run_id}.txt"
    deadline = time.time() + 240
    while time.time() < deadline and not (log.exists() and f"step:{after_step}/400 train_loss" in log.read_text()):
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, log, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_saves_a_checkpoint_marks_the_log_and_resumes(tmp_path, sig):
    code, log, err = interrupt_run(tmp_path, "i", sig, 3, "--save-on-interrupt")
    assert code == 130, err
    text = log.read_text()
    assert text.splitlines()[-1].startswith("status:interrupted reason:" + signal.Signals(sig).name)
    saved = [n for n in os.listdir(tmp_path / "ckpt" / "i") if n.endswith(".pt")]
    assert len(saved) == 1
    step = H.load_checkpoint(str(tmp_path / "ckpt" / "i" / saved[0]))["step"]
    assert 3 <= step < 400 and f"step:{step}/400 train_loss" in text
    assert T.main(tiny_args(tmp_path, "--num-iterations", "400", "--val-every", "0", "--resume", "auto",
                            "--max-steps", "2")) == 0
    assert f"step:{step + 2}/400 train_loss" in log.read_text()


def test_interrupt_without_save_marks_the_log_incomplete(tmp_path):
    code, log, _ = interrupt_run(tmp_path, "n", signal.SIGINT, 2)
    assert code != 0
    assert log.read_text().splitlines()[-1].startswith("status:incomplete")
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_from_before_a_new_flag_resumes_as_that_flags_default(tmp_path):
    no_masks = ["--no-doc-mask", "--window", "0", "--short-window-layers", ""]
    assert run(tmp_path, "--run-id", "o", "--max-steps", "2", "--save-final", *no_masks) == 0
    path = tmp_path / "ckpt" / "o" / "step_000002.pt"
    state = H.load_checkpoint(str(path))
    del state["config"]["window"], state["config"]["doc_mask"]  # as an older trainer saved it
    H.save_checkpoint(state, str(path))
    assert run(tmp_path, "--resume", "auto", "--max-steps", "1", *no_masks) == 0
    with pytest.raises(T.ConfigError, match="window: checkpoint 0 vs now 4"):
        H.check_resume(state, T.parse_config(tiny_args(tmp_path, "--num-iterations", "12", *no_masks,
                                                       "--window", "4"))[0], state["data"], T.TRAINER)


def test_the_preflight_reads_a_checkpoints_header_without_its_tensors(tmp_path):
    """``header_only``: run id, step, phase, config and data from the file's header, the payload (weights,
    optimizer states) memory-mapped and never read: a payload with flipped bytes still gives the header,
    which the full load refuses as corrupt."""
    state = dict(run_id="r", step=3, phase=2, config=dict(seed=1), data=dict(train=[], val=[]),
                 model=dict(w=torch.randn(1_000_000)))
    H.save_checkpoint(state, str(tmp_path / "ok.pt"))
    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    middle = len(raw) // 2  # inside the payload: 4 MB of the file's ~4 MB
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    (tmp_path / "bad.pt").write_bytes(bytes(raw))
    header = H.load_checkpoint(str(tmp_path / "bad.pt"), header_only=True)
    assert header == {k: state[k] for k in H.CHECKPOINT_HEADER}  # nothing else: no tensor came back
    with pytest.raises(H.ConfigError, match="corrupt checkpoint"):
        H.load_checkpoint(str(tmp_path / "bad.pt"))
    full = H.load_checkpoint(str(tmp_path / "ok.pt"))
    assert torch.equal(full["model"]["w"], state["model"]["w"])


def test_a_checkpoint_without_a_header_is_read_whole_by_the_preflight(tmp_path):
    """A checkpoint written before the header existed: ``header_only`` falls back to the full, checked load."""
    state = dict(run_id="old", step=2, phase=1, config={}, data={}, model={})
    inner = io.BytesIO()
    torch.save(state, inner)
    payload = inner.getbuffer()
    torch.save(dict(format=H.CHECKPOINT_FORMAT, sha256=hashlib.sha256(payload).hexdigest(),
                    payload=torch.frombuffer(payload, dtype=torch.uint8)), str(tmp_path / "old.pt"))
    assert H.load_checkpoint(str(tmp_path / "old.pt"), header_only=True) == state


def test_resume_force_applies_a_new_lr_and_the_log_names_it(tmp_path):
    # the optimizer state carries its lr: the new --matrix-lr must replace it, or the run repeats the old one
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    ckpt = str(tmp_path / "ckpt" / "c" / "step_000002.pt")
    old_lr = T.parse_config(tiny_args(tmp_path))[0].matrix_lr
    assert run(tmp_path, "--run-id", "same", "--resume", ckpt, "--max-steps", "2") == 0
    assert run(tmp_path, "--run-id", "lr", "--resume", ckpt, "--max-steps", "2", "--resume-force",
               "--matrix-lr", str(old_lr * 20)) == 0
    same, new = (loss_lines(read_log(tmp_path / "logs", r)) for r in ("same", "lr"))
    assert same[3] == new[3] and abs(same[4] - new[4]) > 1e-3, (same, new)  # step 3 runs on step 2's weights
    text = read_log(tmp_path / "logs", "lr")
    [line] = [ln for ln in text.splitlines() if ln.startswith("resume_force: the new optimizer settings apply: ")]
    assert f".initial_lr: {old_lr!r} -> {old_lr * 20!r}" in line, line
    assert "\nresume_force: the new optimizer settings apply" not in read_log(tmp_path / "logs", "same")


def test_resume_force_across_an_architecture_flag_is_one_line_naming_the_tensors(tmp_path, capsys):
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    assert run(tmp_path, "--run-id", "c", "--resume", "auto", "--value-embeds", "0", "--resume-force") == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("log: ")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert re.search(r"only in the checkpoint \d+: value_embeds\.0\.weight", err[0]), err[0]
    assert "use the checkpoint's model flags" in err[0]


@pytest.mark.parametrize("preset", sorted(T.PRESETS))
def test_the_non_finite_loss_message_names_only_lr_flags_the_preset_reads(preset):
    cfg, _ = T.parse_config(["--preset", preset])
    flags = H.lr_flags(cfg)
    record89 = cfg.optimizer in ("normuon", "aurora_normuon")  # CautiousAdam's lrs are record #89's constants
    assert flags == ("--matrix-lr" if record89 else "--matrix-lr, --embed-lr, --head-lr"), flags
    guard = H.NanGuard("cpu", flags)
    guard.first_bad.fill_(5)
    with pytest.raises(FloatingPointError, match=r"since step 5; lower the lr \(" + flags + "; with --resume-force"):
        guard.check()


def test_restore_optimizers_keeps_this_runs_settings_and_names_only_what_the_config_changed(tmp_path):
    from types import SimpleNamespace
    cfg = T.parse_config(tiny_args(tmp_path))[0]
    old = T.build_optimizers(T.GPT(cfg), cfg)
    for opt in old:  # mid-run: the schedule has scaled every lr and moved the momentum
        for g in opt.param_groups:
            g["lr"] *= 0.3
            if "momentum" in g:
                g["momentum"] = 0.42
    saved = [opt.state_dict() for opt in old]
    same = T.build_optimizers(T.GPT(cfg), cfg)
    assert H.restore_optimizers(SimpleNamespace(opts=same), saved) == []  # a plain resume changes nothing
    new_cfg = T.parse_config(tiny_args(tmp_path, "--matrix-lr", str(cfg.matrix_lr * 2)))[0]
    new = T.build_optimizers(T.GPT(new_cfg), new_cfg)
    changed = H.restore_optimizers(SimpleNamespace(opts=new), saved)
    assert changed == [f"{type(new[1]).__name__}.initial_lr: {cfg.matrix_lr!r} -> {cfg.matrix_lr * 2!r}"], changed
    assert all(g["initial_lr"] == new_cfg.matrix_lr for g in new[1].param_groups)


@pytest.mark.parametrize("flag", [("--attn-lambdas",), ("--xsa-layers", "1"), ("--attn-gate-layers", "0")])
def test_resume_force_across_a_model_structure_flag_refuses_before_the_log(tmp_path, capsys, flag):
    # HEAD's flags that add tensors (not n_layer/model_dim): refused up front, the original log untouched
    assert run(tmp_path, "--run-id", "c", "--max-steps", "2", "--save-final") == 0
    log = tmp_path / "logs" / "c.txt"
    before = log.read_bytes()
    capsys.readouterr()
    assert run(tmp_path, "--run-id", "c", "--resume", "auto", *flag, "--resume-force") == 2
    out, err = capsys.readouterr()
    assert log.read_bytes() == before and "continuing despite" not in out + err
    [line] = [ln for ln in err.splitlines() if ln.strip()]
    assert flag[0][2:].replace("-", "_") in line and "only in this run's model" in line, line


def test_resume_force_from_an_older_checkpoint_never_overwrites_the_later_ones(tmp_path, capsys):
    # steps 3-4 again under another lr would replace step_000004.pt's weights with another trajectory's
    assert run(tmp_path, "--run-id", "o", "--max-steps", "4", "--save-every", "2") == 0
    folder = tmp_path / "ckpt" / "o"
    before = {f: (folder / f).read_bytes() for f in os.listdir(folder)}
    assert sorted(before) == ["step_000002.pt", "step_000004.pt"]
    older, lr = str(folder / "step_000002.pt"), str(T.parse_config(tiny_args(tmp_path))[0].matrix_lr * 2)
    capsys.readouterr()
    # its log elsewhere (the log's own later steps are refused first, test below): the checkpoints alone
    assert run(tmp_path, "--run-id", "o", "--resume", older, "--max-steps", "2", "--save-every", "2",
               "--resume-force", "--matrix-lr", lr, "--log-dir", str(tmp_path / "logs2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume-force:" in err[0] and "after step 2 (step_000004.pt)" in err[0], err
    assert "give it a new --run-id" in err[0]
    assert {f: (folder / f).read_bytes() for f in os.listdir(folder)} == before
    # another run id keeps the forced trajectory apart (--max-steps counts the steps after the resume)
    assert run(tmp_path, "--run-id", "o2", "--resume", older, "--max-steps", "2", "--save-every", "2",
               "--resume-force", "--matrix-lr", lr) == 0
    assert sorted(os.listdir(tmp_path / "ckpt" / "o2")) == ["step_000004.pt"]
    assert {f: (folder / f).read_bytes() for f in os.listdir(folder)} == before


def test_resume_force_into_its_own_log_with_later_steps_is_refused_whatever_it_saves(tmp_path, capsys):
    # without --save-*: no checkpoint is in the way, but the log already holds steps 3-4 of the first trajectory
    assert run(tmp_path, "--run-id", "f", "--max-steps", "4", "--save-every", "2") == 0
    log = tmp_path / "logs" / "f.txt"
    before = log.read_bytes()
    older = str(tmp_path / "ckpt" / "f" / "step_000002.pt")
    capsys.readouterr()
    assert run(tmp_path, "--run-id", "f", "--resume", older, "--max-steps", "2", "--resume-force", "--seed", "7") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume-force:" in err[0] and "already logs steps 3..4 of this run" in err[0], err
    assert log.read_bytes() == before
    assert run(tmp_path, "--run-id", "f", "--resume", "auto", "--max-steps", "1", "--resume-force", "--seed", "7") == 0
