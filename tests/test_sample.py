"""sample.py: text from the checkpoint of a few steps of the tests' tiny model (tests/conftest.py).

The tiny spec is passed in this process as ``models=conftest.SPECS``; a subprocess that samples it runs
sample.main through a driver that passes conftest.SPECS too (``run_sample``). The command line itself (``python
sample.py``) is run where no spec is needed, and on the tiny checkpoint to see it refused in one line (its spec is
not in train_gpt.MODELS).
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

import sample
import train_gpt as T
from conftest import REPO, SPECS, subprocess_env, tiny_args

DRIVER = "import sys, conftest, sample\n{patch}sys.exit(sample.main(sys.argv[1:], models=conftest.SPECS))\n"


def checkpoint(root, run_id, *extra):
    """Train the tiny model (8 steps; ``extra`` flags) with --save-final; returns the checkpoint's path."""
    assert T.main(tiny_args(root, "--run-id", run_id, "--save-final", *extra), models=SPECS) == 0
    [name] = os.listdir(root / "ckpt" / run_id)
    return str(root / "ckpt" / run_id / name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of 4 of 8 steps (stage 2, embedding still tied)."""
    return checkpoint(tmp_path_factory.mktemp("sample"), "s", "--max-steps", "4")


def driver_env():
    env = subprocess_env()
    env["PYTHONPATH"] = os.path.join(REPO, "tests") + os.pathsep + env["PYTHONPATH"]  # conftest: the tiny spec
    return env


def run_sample(*args, patch=""):
    """sample.main on ``args`` in a subprocess that knows the tiny spec; ``patch``: code run before it."""
    return subprocess.run([sys.executable, "-c", DRIVER.format(patch=patch), *map(str, args)], cwd=REPO,
                          env=driver_env(), capture_output=True, text=True, timeout=600)


def prompt_ids(text):
    return [T.EOT_TOKEN] + sample.load_encoder().encode_ordinary(text)


def test_same_seed_same_text_and_another_seed_other_text(ckpt):
    args = ("--checkpoint", ckpt, "--prompt", "The", "--max-new-tokens", 20, "--device", "cpu")
    a, b, c = run_sample(*args, "--seed", 0), run_sample(*args, "--seed", 0), run_sample(*args, "--seed", 1)
    for proc in (a, b, c):
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert a.stdout == b.stdout and a.stdout != c.stdout
    assert a.stdout.startswith("The") and a.stdout.endswith("\n")
    # the continuation is 20 tokens: re-encoding what was printed need not give them back (BPE merges
    # across the boundary), so count through the function the command line calls
    model, run = sample.load_model(ckpt, torch.device("cpu"), SPECS)
    new = sample.generate(model, prompt_ids("The"), 20, run.context, generator=torch.Generator().manual_seed(0))
    assert a.stdout == "The" + sample.load_encoder().decode(new) + "\n"


def test_the_model_has_its_steps_windows_tie_and_context(ckpt):
    model, run = sample.load_model(ckpt, torch.device("cpu"), SPECS)
    row = T.Schedule(run.cfg, SPECS["tiny"])[4]
    assert run.step == 4 and run.cfg.model == "tiny" and model.spec == SPECS["tiny"]
    assert model._window == row.window and model._yarn == row.yarn and model.tied
    assert run.context == row.stage.seq_len == 2 * 64  # stage 2 trains sequences of 2 x --seq-len
    assert not model.training


def test_greedy_tokens_are_the_argmax_of_one_float64_forward(ckpt):
    model, run = sample.load_model(ckpt, torch.device("cpu"), SPECS)
    ids = prompt_ids("The history of")
    n = run.context - len(ids)  # the whole sequence fits the context: one forward sees what each draw saw
    new = sample.generate(model, ids, n, run.context, temperature=0)
    reference = model.double()  # the same weights in float64: a tie between two ids would need 1e-12 apart
    with torch.no_grad():
        logits = reference(torch.tensor(ids + new).view(1, -1, 1))[0]  # [T, vocab] float64
    want = logits[len(ids) - 1:-1, :sample.GPT2_VOCAB].argmax(-1).tolist()
    assert len(new) == n and new == want


@pytest.mark.slow  # a forward per drawn token
def test_tokens_are_valid_ids_among_the_top_k_and_stop_at_n(ckpt):
    model, run = sample.load_model(ckpt, torch.device("cpu"), SPECS)
    ids = prompt_ids("The")
    for n, k in [(1, 0), (7, 5), (run.context + 2, 3)]:  # the last runs past the context: it is cut
        new = sample.generate(model, ids, n, run.context, temperature=1.0, top_k=k,
                              generator=torch.Generator().manual_seed(n))
        assert len(new) == n and all(isinstance(t, int) and 0 <= t < sample.GPT2_VOCAB for t in new)
        if not k:
            continue
        seq = ids + new
        with torch.no_grad():
            for i, token in enumerate(new):  # each drawn token is among the k most likely after its context
                context = seq[max(0, len(ids) + i - run.context):len(ids) + i]
                logits = model(torch.tensor(context).view(1, -1, 1))[0, -1, :sample.GPT2_VOCAB]
                assert logits[token] >= torch.topk(logits, k).values[-1]


def test_a_tst_phase_1_checkpoint_samples_in_next_token_mode(tmp_path):
    path = checkpoint(tmp_path, "p1", "--tst-frac", "0.75", "--max-steps", "3")
    model, run = sample.load_model(path, torch.device("cpu"), SPECS)
    assert run.step == 3 and T.Schedule(run.cfg, SPECS[run.cfg.model])[2].stage.phase == 1 and run.cfg.tst_bag_size > 1
    new = sample.generate(model, prompt_ids("The"), 5, run.context, generator=torch.Generator().manual_seed(0))
    assert len(new) == 5


@pytest.mark.parametrize("steps, tied", [(4, True), (8, False)])
def test_a_checkpoint_is_sampled_tied_or_untied_as_at_its_step(tmp_path, steps, tied):
    # the tiny run unties after step split_step = 5 (stage 3's first, odd): the embedding is then its own weight,
    # a copy of the head's until CautiousAdam's next update (every other step)
    path = checkpoint(tmp_path, "t", "--max-steps", str(steps))
    model, run = sample.load_model(path, torch.device("cpu"), SPECS)
    assert T.split_step(run.cfg) == 5 and run.step == steps and model.tied is tied
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    assert tied or not torch.equal(state["embed.weight"], state["lm_head.weight"])  # they differ after the untie
    # the logits are those of the model the run trained (tied as at its step), not of the other tie
    ids = torch.tensor([T.EOT_TOKEN, 464, 3290, 286, 262, 1578, 1829, 13]).view(1, -1, 1)  # [1, T, 1] as sample.py
    logits = {}
    row = T.Schedule(run.cfg, SPECS[run.cfg.model])[steps]
    for ref_tied in (True, False):
        ref = T.build_model(run.cfg, SPECS[run.cfg.model])
        ref.load_state_dict(state)
        ref.tied = ref_tied
        ref.set_window(row.window, row.yarn)
        with torch.no_grad():
            logits[ref_tied] = ref.eval()(ids)
    with torch.no_grad():
        got = model(ids)
    assert torch.equal(got, logits[tied])
    assert tied or (got - logits[True]).abs().max() > 1e-3  # the bug this guards: the head read as the embedding


def one_error_line(capsys, *argv):
    assert sample.main(list(map(str, argv)), models=SPECS) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("sample.py: error: ")
    return line


def test_bad_input_is_one_error_line(ckpt, tmp_path, capsys):
    missing = tmp_path / "nope.pt"
    assert f"--checkpoint {missing}: no such file" in one_error_line(capsys, "--checkpoint", missing)
    data = open(ckpt, "rb").read()
    for name, damaged in [("cut.pt", data[:len(data) // 2]), ("text.pt", b"not a checkpoint\n")]:
        (tmp_path / name).write_bytes(damaged)
        line = one_error_line(capsys, "--checkpoint", tmp_path / name)
        assert f"--checkpoint {tmp_path / name}: truncated or unreadable (" in line and "--resume" not in line, line
    torch.save({"step": 3}, tmp_path / "other.pt")  # a torch file, but no train_gpt.py checkpoint
    assert "holds no model weights and config" in one_error_line(capsys, "--checkpoint", tmp_path / "other.pt")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    torch.save(dict(state, config=dict(state["config"], n_layer=12)), tmp_path / "newer.pt")
    assert "config fields this one lacks (n_layer)" in one_error_line(capsys, "--checkpoint", tmp_path / "newer.pt")
    torch.save(dict(state, config=dict(state["config"], model="smoke")), tmp_path / "smoke.pt")
    assert "its weights do not fit its config (" in one_error_line(capsys, "--checkpoint", tmp_path / "smoke.pt")
    # a run's checkpoint folder instead of a file: the file to give is named
    folder = os.path.dirname(ckpt)
    line = one_error_line(capsys, "--checkpoint", folder)
    assert f"--checkpoint {folder}: a folder; give one of its checkpoint files (the newest: " in line, line
    assert "holds no step_N.pt" in one_error_line(capsys, "--checkpoint", tmp_path)
    assert "--prompt is empty" in one_error_line(capsys, "--checkpoint", ckpt, "--prompt", "  ")
    for flags, needle in [(("--max-new-tokens", 0), "--max-new-tokens must be at least 1"),
                          (("--temperature", -1), "--temperature must be"), (("--top-k", -2), "--top-k must be"),
                          (("--max-new-tokens", "many"), "--max-new-tokens: invalid int value")]:
        assert needle in one_error_line(capsys, "--checkpoint", ckpt, *flags)
    assert "--checkpoint" in one_error_line(capsys, "--prompt", "The")  # no checkpoint named


def test_the_command_line_refuses_a_spec_it_does_not_know_in_one_line(ckpt):
    # `python sample.py` knows record and smoke only: the tiny checkpoint names its spec, and the fix
    proc = subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), "--checkpoint", ckpt, "--device", "cpu"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"sample.py: error: --checkpoint {ckpt}: its model spec 'tiny' is not in "
                                   "train_gpt.MODELS (record, smoke); sample with the code that trained it")


def test_ctrl_c_while_generating_is_one_line_and_exit_130(ckpt):
    # sample.main as the command line runs it, its generate marked on stderr so that the signal lands mid-draw
    patch = ("draw = sample.generate\n"
             "def marked(*args, **kw):\n"
             "    print('generating', file=sys.stderr, flush=True)\n"
             "    return draw(*args, **kw)\n"
             "sample.generate = marked\n")
    # SIGINT back to its default in the child: a shell running the tests in the background passes it on as
    # ignored, and Python then never turns it into Ctrl-C
    proc = subprocess.Popen([sys.executable, "-c", DRIVER.format(patch=patch), "--checkpoint", ckpt,
                             "--max-new-tokens", "1000000", "--device", "cpu"], cwd=REPO, env=driver_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline() == "generating\n"  # blocks until the model is loaded and drawing
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert out == "" and err.strip().splitlines() == [
        "sample.py: interrupted: nothing printed (the text is printed once every token is drawn)"], err
