"""Bucketed gradient all-reduce started during the last micro-batch's backward (GradBuckets).

Two processes on gloo: the gradients and loss equal those of the per-tensor all-reduce after
the whole backward (bit for bit: a sum of two numbers does not depend on the bucketing), no
gradient collective runs before the last micro-batch, buckets start before the backward ends.
"""
import os

import torch

import harness as H
import kernels
import train_gpt as T
from conftest import REPO, TINY, run_torchrun, subprocess_env


def run_worker(out):
    worker = os.path.join(REPO, "tests", "dist_grad_worker.py")
    run_torchrun([worker, str(out)], dict(subprocess_env(), OMP_NUM_THREADS="1"), timeout=300)
    return torch.load(out)


def test_bucketed_all_reduce_equals_per_tensor_and_overlaps_the_last_backward(tmp_path):
    r = run_worker(tmp_path / "grads.pt")
    assert torch.equal(r["loss"], r["ref_loss"])
    assert len(r["grads"]) == len(r["ref_grads"]) == r["n_params"]
    for got, ref in zip(r["grads"], r["ref_grads"]):
        assert (got is None and ref is None) or torch.equal(got, ref)
    assert sum(g is None for g in r["grads"]) == 1  # the tied embedding's: its gradient is the head's
    assert any(g.abs().sum() > 0 for g in r["grads"] if g is not None)
    events = r["events"]
    forwards = [i for i, (kind, _) in enumerate(events) if kind == "forward"]
    grad_reduces = [i for i, (kind, n) in enumerate(events) if kind == "all_reduce" and n == 1]
    assert len(forwards) == 2
    assert all(i > forwards[-1] for i in grad_reduces)          # nothing during the first micro-batch
    # one collective per bucket, but for the tied embedding's (a bucket of its own: 6 MB over the 8 KB cap)
    assert 1 < len(grad_reduces) == r["n_buckets"] - 1 < r["n_params"]
    ready = max(i for i, e in enumerate(events) if e == ("head_ready", 0))  # the last micro-batch's last gradient
    assert ready > forwards[-1]
    assert grad_reduces[0] < ready                               # buckets started before the backward ended
    assert r["hooks_left"] == 1                                   # the worker's own hook; the step's are removed


def test_buckets_follow_the_backward_order_and_the_cap():
    model = T.build_model(H.parse_flags(T.Config, T.PRESETS, ["--model", "tiny", "--seq-len", "16", "--batch-tokens",
                                                               "48", "--val-tokens", "64", "--no-fp8"])[0], TINY)
    params = list(model.parameters())
    b = kernels.GradBuckets(params, cap_bytes=16 * 1024)
    flat = [p for bucket in b.buckets for p in bucket["params"]]
    assert len(flat) == len(params) and all(p is q for p, q in zip(flat, reversed(params)))
    for bucket in b.buckets:
        size = sum(p.numel() * 4 for p in bucket["params"])
        assert bucket["bytes"] == size and bucket["flat"].numel() * 4 == size
        assert size <= 16 * 1024 or len(bucket["params"]) == 1    # one tensor over the cap is its own bucket
