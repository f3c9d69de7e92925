"""modded-nanogpt HEAD's validation chunks, gradient scale and train layout (issue 36), against float64 references.

The val loss: chunk i of --val-seq-len tokens on process i mod world, document-masked, the head scored in
pieces; equal on 1 and 2 processes and to a loop that scores each document of each chunk alone. The
gradient: the sum over the step's labels (multi-token and prefix columns weighted, unnormalized) over its
sequence count, equal with 4 micro-steps on one process and 2 on each of two processes.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_torchrun, subprocess_env
import train_gpt as T

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
    """Each chunk's documents scored one at a time (plain logits, float64 cross-entropy), over the val tokens."""
    cfg, model = W.model_of(W.VAL_ARGS)
    toks, n, C = W.tokens(3, 400), cfg.val_tokens, cfg.val_seq_len
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for lo in range(0, n, C):
            hi = min(lo + C, n)
            inputs, targets = toks[lo:hi], toks[lo + 1:hi + 1]
            starts = sorted({0, *(i for i in range(hi - lo) if inputs[i] == T.EOT_TOKEN)}) + [hi - lo]
            for a, b in zip(starts, starts[1:]):
                if b > a:
                    logits = model(inputs[a:b].view(1, -1, 1)).double()[0]
                    total += F.cross_entropy(logits, targets[a:b], reduction="sum")
    return (total / n).item()


def test_val_loss_is_the_same_chunks_on_one_and_two_processes_and_matches_a_per_document_loop(runs):
    ref = reference_val_loss()
    one, two = runs["one"]["val_loss"], runs["two"]["val_loss"]
    assert abs(one - two) <= 1e-12 * ref
    assert abs(one - ref) <= 1e-10 * ref, (one, ref)


def test_val_loss_differs_when_chunks_are_cut_elsewhere():
    """The reference can fail: chunks of 41 tokens give another val loss (contexts cut elsewhere)."""
    cfg, model = W.model_of(W.VAL_ARGS + ["--val-seq-len", "41"])
    rt = T.Runtime(rank=0, world=1, device=torch.device("cpu"), compile=False)
    loss = T.evaluate(model, T.ValData(W.Tokens(W.tokens(3, 400)), cfg.val_tokens), "full", 1, cfg, rt)
    assert abs(loss - reference_val_loss()) > 1e-6


def reference_grads():
    """d/dW of (1/4) sum over the 4 sequences, positions and columns j of w_j CE(column j), float64; a multi-token
    column past the sequence's end adds only HEAD's softmax term w_j p to the gradient (its loss: none)."""
    cfg, model = W.model_of(W.GRAD_ARGS)
    inputs, targets, weights = W.grad_batch()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(4):
        logits = model(inputs[i:i + 1]).double()[0]   # [16, V]
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


def test_gradient_is_heads_per_sequence_sum_on_one_process_with_accumulation_and_on_two(runs):
    ref = reference_grads()
    top = max(g.abs().max().item() for g in ref.values())  # float64 noise floor: 1e-12 of the largest gradient
    for name in ("one", "two"):
        grads = runs[name]["grads"]
        assert set(grads) == set(ref)
        for n, g in ref.items():
            assert (grads[n] - g).abs().max().item() <= 1e-9 * g.abs().max().item() + 1e-12 * top, (name, n)
    big = max(ref, key=lambda n: ref[n].abs().max())
    assert runs["one"]["grads"][big].abs().max() > 0.5 * ref[big].abs().max()  # a mean over the 64 labels is 16x smaller


def test_record_presets_use_heads_train_layout_and_gradient_scale():
    """baseline_h200: 8 flat sequences a step of 16,384 -> 32,768 -> 49,152 positions; the gradient's
    sequence count stays 8, so it doubles at stage 2 and grows 1.5x at stage 3 as HEAD's."""
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    stages = [st for st in T.Schedule(cfg).stages]
    assert [st.length(cfg.seq_len) for st in stages] == [16384, 32768, 49152, 49152]
    assert [T.grad_divisor(cfg, st) for st in stages] == [8, 8, 8, 8]
    assert T.longest_sequence(cfg) == 262_144 and T.val_chunk(cfg) == 262_144
    smoke, _ = T.parse_config(["--preset", "cpu_smoke"])
    assert {st.length(smoke.seq_len) for st in T.Schedule(smoke).stages} == {768}
    assert T.val_chunk(smoke) == 768


def test_describe_prints_the_validation_layout_and_each_stages_train_layout():
    import harness
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    lines = harness.plan_summary(cfg, *T.plan(cfg))["lines"]
    assert any(ln.startswith("validation: 10,485,760 tokens in 40 document-masked chunks of 262,144 tokens")
               and "5 per process on 8, 40 on 1" in ln for ln in lines)
    stage_lines = [ln for ln in lines if ln.startswith("next-token (no TST): ")]  # the baseline: no TST phases
    assert ["(8 sequence(s) of 16,384)" in stage_lines[0], "(8 sequence(s) of 32,768)" in stage_lines[1],
            "(8 sequence(s) of 49,152)" in stage_lines[2]] == [True] * 3
