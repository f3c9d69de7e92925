"""modded-nanogpt's validation chunks and gradient scale on 1 or 2 processes (gloo), float64 on CPU.

``python dist_head_worker.py OUT`` (one process) or under ``torchrun --nproc_per_node=2``: rank 0 saves the val loss
of ``evaluate`` (chunks on rank i mod world, several head pieces per chunk, padding chunks) and the gradients of one
``accumulate_gradients`` step with modded-nanogpt's scale (the step's sequence count) over 4 sequences of 16
positions with the multi-token and prefix columns: 4 micro-steps on one process, 2 on each of two.
tests/test_head_protocol.py compares them with float64 references written plainly.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (this script's folder, tests/, is on the path; the tiny model's spec)
import harness  # noqa: E402
import train_gpt as T  # noqa: E402

TINY = ["--model", "tiny", "--no-fp8", "--seq-len", "16"]
VAL_ARGS = [*TINY, "--val-seq-len", "40", "--val-batch-seqs", "3", "--val-tokens", "290"]
GRAD_ARGS = [*TINY, "--val-tokens", "64"]


class Tokens:
    """The part of a TokenStream that ValData reads, over a tensor."""

    def __init__(self, tokens):
        self.tokens, self.total, self.files = tokens, tokens.numel(), ["memory"]

    def read(self, start, n):
        return self.tokens[start:start + n].numpy()


def tokens(seed, n, p_eot=0.05):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 1000, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < p_eot, T.EOT_TOKEN, t)


def model_of(args):
    """The tiny model in float64, every weight moved off its init, at the final validation's windows."""
    cfg = harness.parse_flags(T.Config, T.PRESETS, args)[0]
    torch.manual_seed(0)
    model = T.build_model(cfg, conftest.TINY).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    row = T.Schedule(cfg, conftest.TINY)[cfg.num_iterations]
    model.set_window(row.window, row.yarn)
    return cfg, model


def grad_batch():
    """The step's 4 sequences of 16 positions: inputs [4, 16, 1] and targets [4, 16, 4] (3 multi-token + prefix)."""
    seqs = tokens(7, 4 * 17).view(4, 17)
    inputs, targets = T.make_batch(seqs, "full", 1)
    table = T.prefix_token_table(50304)
    return inputs, T.objective_targets(targets[..., 0], table), torch.tensor([1.0, 0.5, 0.25, 0.25]).double()


def main(out):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    rt = harness.Runtime(rank=rank, world=world, device=torch.device("cpu"), compile=False, accum=4 // world)
    T.VAL_PIECE = 16  # several head pieces per 40-token chunk
    cfg, model = model_of(VAL_ARGS)
    val = T.ValData(Tokens(tokens(3, 400)), cfg.val_tokens)
    val_loss = T.evaluate(model, val, "full", 1, cfg, rt)
    cfg, model = model_of(GRAD_ARGS)
    inputs, targets, weights = grad_batch()
    mine = range(rank * rt.accum, (rank + 1) * rt.accum)  # sequence rank * accum + micro, as the loaders
    buckets = T.GradBuckets(model.parameters(), rank, world) if world > 1 else None  # the run's all-reduce
    loss = T.accumulate_gradients(model, [(inputs[i:i + 1], targets[i:i + 1]) for i in mine], rt, weights, 4, buckets)
    if rank == 0:
        torch.save(dict(val_loss=val_loss, loss=loss,
                        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}), out)
    harness.finish(None, "complete")  # leave the group together, as the trainer does


if __name__ == "__main__":
    main(sys.argv[1])
