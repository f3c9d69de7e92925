"""sample.py: text from a checkpoint of a few cpu_smoke steps (the tiny model of tests/conftest.py)."""
import os
import signal
import subprocess
import sys

import pytest
import torch

import sample
import harness
import train_gpt as T
from conftest import REPO, sample_args, subprocess_env, tiny_args


def checkpoint(root, run_id, *extra):
    """Train the tiny model a few steps with --save-final; returns the checkpoint's path."""
    assert T.main(tiny_args(root, "--run-id", run_id, "--save-final", *extra)) == 0
    [name] = os.listdir(root / "ckpt" / run_id)
    return str(root / "ckpt" / run_id / name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint of 4 of 8 steps, saved in TST phase 2 (the switch is at step 2)."""
    return checkpoint(tmp_path_factory.mktemp("sample"), "s", "--max-steps", "4")


def run_sample(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), *map(str, args)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)


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
    model, _, _ = sample.load_model(ckpt, torch.device("cpu"))
    new = sample.generate(model, prompt_ids("The"), 20, generator=torch.Generator().manual_seed(0))
    assert a.stdout == "The" + sample.load_encoder().decode(new) + "\n"


def test_greedy_tokens_are_the_argmax_of_one_full_forward(ckpt):
    model, cfg, _ = sample.load_model(ckpt, torch.device("cpu"))
    ids = prompt_ids("The history of")
    n = cfg.seq_len - len(ids)  # the whole sequence fits the context: one forward sees what each step saw
    new = sample.generate(model, ids, n, temperature=0)
    with torch.no_grad():
        logits = model(torch.tensor(ids + new).view(1, -1, 1))[0].double()  # [T, vocab] float64
    want = logits[len(ids) - 1:-1, :sample.GPT2_VOCAB].argmax(-1).tolist()
    assert len(new) == n and new == want


def test_tokens_are_valid_ids_among_the_top_k_and_stop_at_n(ckpt):
    model, cfg, _ = sample.load_model(ckpt, torch.device("cpu"))
    ids = prompt_ids("The")
    for n, k in [(1, 0), (7, 5), (cfg.seq_len + 9, 3)]:  # the last runs past the context: it is cut
        new = sample.generate(model, ids, n, temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(n))
        assert len(new) == n and all(isinstance(t, int) and 0 <= t < sample.GPT2_VOCAB for t in new)
        if not k:
            continue
        seq = ids + new
        with torch.no_grad():
            for i, token in enumerate(new):  # each drawn token is among the k most likely after its context
                context = seq[max(0, len(ids) + i - cfg.seq_len):len(ids) + i]
                logits = model(torch.tensor(context).view(1, -1, 1))[0, -1, :sample.GPT2_VOCAB]
                assert logits[token] >= torch.topk(logits, k).values[-1]


def test_a_phase_1_checkpoint_samples_in_next_token_mode(tmp_path):
    path = checkpoint(tmp_path, "p1", "--tst-frac", "0.75", "--max-steps", "3")
    assert harness.load_checkpoint(path)["phase"] == 1
    model, cfg, step = sample.load_model(path, torch.device("cpu"))
    assert step == 3 and cfg.tst_bag_size > 1 and model._window == T.flag_windows(cfg)
    new = sample.generate(model, prompt_ids("The"), 5, generator=torch.Generator().manual_seed(0))
    assert len(new) == 5


def one_error_line(capsys, *argv):
    assert sample.main(list(map(str, argv))) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("sample.py: error: ")
    return line


def test_bad_input_is_one_error_line(ckpt, tmp_path, capsys):
    missing = tmp_path / "nope.pt"
    assert f"--checkpoint {missing}: no such file" in one_error_line(capsys, "--checkpoint", missing)
    data = open(ckpt, "rb").read()
    for name, damaged in [("cut.pt", data[:len(data) // 2]),
                          ("flipped.pt", data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF])
                           + data[len(data) // 2 + 1:]),
                          ("text.pt", b"not a checkpoint\n")]:
        (tmp_path / name).write_bytes(damaged)
        line = one_error_line(capsys, "--checkpoint", tmp_path / name)
        assert f"--checkpoint {tmp_path / name}: " in line and "--resume" not in line, line
    assert "truncated or unreadable" in one_error_line(capsys, "--checkpoint", tmp_path / "cut.pt")
    flipped = one_error_line(capsys, "--checkpoint", tmp_path / "flipped.pt")
    assert "sha256 mismatch" in flipped and "sample an older one" in flipped and "resume" not in flipped, flipped
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


def test_ctrl_c_while_generating_is_one_line_and_exit_130(ckpt):
    # sample.main as the command line runs it, its generate marked on stderr so that the signal lands mid-draw
    driver = ("import sys, sample\n"
              "draw = sample.generate\n"
              "def marked(*args, **kw):\n"
              "    print('generating', file=sys.stderr, flush=True)\n"
              "    return draw(*args, **kw)\n"
              "sample.generate = marked\n"
              "sys.exit(sample.main(sys.argv[1:]))\n")
    # SIGINT back to its default in the child: a shell running the tests in the background passes it on as
    # ignored, and Python then never turns it into Ctrl-C
    proc = subprocess.Popen([sys.executable, "-c", driver, "--checkpoint", ckpt, "--max-new-tokens", "1000000",
                             "--device", "cpu"], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
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


@pytest.mark.parametrize("steps, tied", [(3, True), (6, False)])
def test_a_tied_embed_checkpoint_is_sampled_tied_or_untied_as_at_its_step(tmp_path, steps, tied):
    # cpu_smoke with --tied-embed over 6 steps unties after step 3 (split_step): the embedding is then its own weight,
    # updated at step 6 (CautiousAdam updates every other step)
    flags = ["--preset", "cpu_smoke", *sample_args(), "--tied-embed", "--num-iterations", "6", "--val-every", "0",
             "--val-tokens", "1536", "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert T.main([*flags, "--max-steps", str(steps), "--run-id", "t", "--save-final"]) == 0
    path = str(tmp_path / "ckpt" / "t" / f"step_{steps:06d}.pt")
    assert T.split_step(T.parse_config(flags)[0]) == 3
    model, _, step = sample.load_model(path, torch.device("cpu"))
    assert step == steps and model.tied is tied
    state = harness.load_checkpoint(path)["model"]
    assert tied or not torch.equal(state["embed.weight"], state["lm_head.weight"])  # they differ after the untie
    # the logits are those of the model the run trained (tied as at its step), not of the other tie
    ids = torch.tensor([T.EOT_TOKEN, 464, 3290, 286, 262, 1578, 1829, 13]).view(1, -1, 1)  # [1, T, 1] as sample.py
    logits = {}
    for ref_tied in (True, False):
        ref = T.GPT(model.cfg)
        ref.load_state_dict(state)
        ref.tied = ref_tied
        ref.set_window(*(lambda row: (row.window, row.yarn))(T.Schedule(model.cfg)[step]))
        with torch.no_grad():
            logits[ref_tied] = ref.eval()(ids)
    with torch.no_grad():
        got = model(ids)
    assert torch.equal(got, logits[tied])
    assert tied or (got - logits[True]).abs().max() > 1e-3  # the bug this guards: the head read as the embedding
