"""modded-nanogpt's validation chunks, gradient scale and train layout (issue 36), against float64 references.

The val loss: chunk i of --val-seq-len tokens on process i mod world, document-masked, the head scored in pieces;
equal on 1 and 2 processes and to a loop that scores each chunk alone. The gradient: the sum over the step's labels
(multi-token and prefix columns weighted, unnormalized) over its sequence count, equal with 4 micro-steps on one
process and 2 on each of two processes.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import harness as H
import train_gpt as T
from conftest import REPO, run_torchrun, subprocess_env

sys.path.insert(0, os.path.join(REPO, "tests"))
import dist_head_worker as W  # noqa: E402

WORKER = os.path.join(REPO, "tests", "dist_head_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker's results on one process and on two (both started at once, one thread each)."""
    tmp = tmp_path_factory.mktemp("head")
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")
    with open(tmp / "one.err", "w") as err:  # a file, not a pipe: it cannot block on a full pipe
        one = subprocess.Popen([sys.executable, WORKER, str(tmp / "one.pt")], env=env, cwd=tmp, stderr=err)
    run_torchrun([WORKER, str(tmp / "two.pt")], env, cwd=tmp)
    assert one.wait(timeout=600) == 0, (tmp / "one.err").read_text()[-3000:]
    return {n: torch.load(tmp / f"{n}.pt") for n in ("one", "two")}


def reference_val_loss():
    """Each chunk scored alone (the capped logits, float64 cross-entropy over its labels), over the val tokens."""
    cfg, model = W.model_of(W.VAL_ARGS)
    toks, n, C = W.tokens(3, 400), cfg.val_tokens, cfg.val_seq_len
    total = torch.zeros((), dtype=torch.float64)
    with T.eval_mode(model):
        for lo in range(0, n, C):
            hi = min(lo + C, n)
            logits = model(toks[lo:hi].view(1, -1, 1)).double()[0]
            total += F.cross_entropy(logits, toks[lo + 1:hi + 1], reduction="sum")
    return (total / n).item()


def test_val_loss_is_the_same_chunks_on_one_and_two_processes_and_matches_a_per_chunk_loop(runs):
    ref = reference_val_loss()
    one, two = runs["one"]["val_loss"], runs["two"]["val_loss"]
    assert abs(one - two) <= 1e-12 * ref
    assert abs(one - ref) <= 1e-10 * ref, (one, ref)


def test_val_loss_differs_when_chunks_are_cut_elsewhere():
    """The reference can fail: chunks of 41 tokens give another val loss (contexts cut elsewhere)."""
    cfg, model = W.model_of(W.VAL_ARGS + ["--val-seq-len", "41"])
    rt = H.Runtime(rank=0, world=1, device=torch.device("cpu"), compile=False)
    loss = T.evaluate(model, T.ValData(W.Tokens(W.tokens(3, 400)), cfg.val_tokens), "full", 1, cfg, rt)
    assert abs(loss - reference_val_loss()) > 1e-6


def reference_grads():
    """d/dW of (1/4) sum over the 4 sequences, positions and columns j of w_j CE(column j), float64; a multi-token
    column past the sequence's end adds only modded-nanogpt's softmax term w_j p to the gradient (its loss: none)."""
    cfg, model = W.model_of(W.GRAD_ARGS)
    inputs, targets, weights = W.grad_batch()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(4):
        logits = model(inputs[i:i + 1]).double()[0]   # [16, V], capped
        logp, lse = F.log_softmax(logits, dim=-1), torch.logsumexp(logits, dim=-1)
        for j in range(targets.size(-1)):
            for t in range(targets.size(1)):
                y = int(targets[i, t, j])
                if y == T.PAST_END:
                    total = total + weights[j] * (lse[t] - lse[t].detach())
                elif y != T.IGNORE_INDEX:
                    total = total - weights[j] * logp[t, y]
    (total / 4).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_is_modded_nanogpts_per_sequence_sum_with_accumulation_and_on_two_processes(runs):
    ref = reference_grads()
    top = max(g.abs().max().item() for g in ref.values())  # float64 noise floor: 1e-12 of the largest gradient
    for name in ("one", "two"):
        grads = runs[name]["grads"]
        assert set(grads) == set(ref) and "embed.weight" not in ref  # tied: the head's weight takes both
        for n, g in ref.items():
            assert (grads[n] - g).abs().max().item() <= 1e-9 * g.abs().max().item() + 1e-12 * top, (name, n)
    big = max(ref, key=lambda n: ref[n].abs().max())
    assert runs["one"]["grads"][big].abs().max() > 0.5 * ref[big].abs().max()  # a mean over 64 labels: 16x smaller


def test_the_presets_use_modded_nanogpts_train_layout_and_gradient_scale():
    """baseline_h200: 8 packed sequences a step of 16,384 -> 32,768 -> 49,152 positions; the gradient's divisor
    stays the sequence count, 8, so it doubles at stage 2 and grows 1.5x at stage 3 as modded-nanogpt's; TST phase
    1 divides by s labels more a position (full and output modes)."""
    cfg = H.parse_flags(T.Config, T.PRESETS, ["--preset", "baseline_h200"])[0]
    stages = T.stages(cfg)
    assert [st.seq_len for st in stages] == [16384, 32768, 49152, 49152]
    assert [T.grad_divisor(st) for st in stages] == [8, 8, 8, 8]
    assert 3 * cfg.seq_len < T.val_chunk(cfg) == 262_144  # the val chunk is the longest sequence
    for mode, divisor in (("full", 32), ("output", 32), ("input", 8)):
        tst = H.parse_flags(T.Config, T.PRESETS, ["--preset", "record_h200", "--tst-mode", mode])[0]
        assert [T.grad_divisor(st) for st in T.stages(tst)[:2]] == [divisor, 8]
    smoke = H.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])[0]
    assert [st.seq_len for st in T.stages(smoke)] == [768, 768, 1536, 2304, 2304] and T.val_chunk(smoke) == 768
