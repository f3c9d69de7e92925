"""Gradients of one step of a tiny GPT under torchrun (gloo): bucketed all-reduce vs per-tensor.

Run under ``torchrun --nproc_per_node=2``; rank 0 saves, for the test to check: the gradients and
loss of ``accumulate_gradients`` (buckets started during the last micro-batch's backward) and of
the per-tensor all-reduce after the whole backward it replaced, the order of forwards and
collectives, and when the tied head's gradient (the last the backward produces: the embedding reads it
first) was ready.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (this folder is the script's: on the path; the tiny model's spec)
import harness  # noqa: E402
import kernels  # noqa: E402
import train_gpt as T  # noqa: E402

DIVISOR = 4  # the step's sequence count: 2 ranks x 2 micro-batches of 1


def per_tensor_reference(model, micro_batches, rt):
    """The step as it was: local accumulation, then one all-reduce per gradient tensor."""
    n_valid = torch.zeros(())
    for _, targets in micro_batches:
        n_valid += (targets != T.IGNORE_INDEX).sum()
    total = torch.zeros(())
    for inputs, targets in micro_batches:
        loss_sum = model(inputs, targets)
        (loss_sum / DIVISOR).backward()
        total += loss_sum.detach()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters() if p.grad is not None]
    for w in works:
        w.wait()
    return T.all_reduce_sum(total, rt) / T.all_reduce_sum(n_valid, rt).clamp_min(1)


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = harness.parse_flags(T.Config, T.PRESETS, ["--model", "tiny", "--seq-len", "16", "--batch-tokens", "192",
                                                    "--val-tokens", "64", "--no-fp8"])[0]
    torch.manual_seed(0)
    model = T.build_model(cfg, conftest.TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rt = harness.Runtime(rank=rank, world=2, device=torch.device("cpu"), compile=False, accum=2)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    micro = [(torch.randint(0, 1000, (1, 16, 1), generator=g), torch.randint(0, 1000, (1, 16, 1), generator=g))
             for _ in range(2)]
    micro[1][1][0, :5] = T.IGNORE_INDEX

    ref_loss = per_tensor_reference(model, micro, rt)
    ref_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    buckets = kernels.GradBuckets(model.parameters(), rank, 2, cap_bytes=8 * 1024)  # several buckets, none sharded
    events = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(t, *args, **kwargs):
        flats = {b["flat"].data_ptr() for b in buckets.buckets if "flat" in b}
        events.append(("all_reduce", int(t.data_ptr() in flats)))  # 1: a bucket, 0: the loss and label sums
        return real_all_reduce(t, *args, **kwargs)

    model.register_forward_pre_hook(lambda m, args: events.append(("forward", 0)))
    model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: events.append(("head_ready", 0)))
    dist.all_reduce = recording_all_reduce
    loss = T.accumulate_gradients(model, micro, rt, None, DIVISOR, buckets)
    dist.all_reduce = real_all_reduce
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    if rank == 0:
        torch.save(dict(ref_loss=ref_loss, loss=loss, ref_grads=ref_grads, grads=grads, events=events,
                        n_buckets=len(buckets.buckets), n_params=len(list(model.parameters())),
                        hooks_left=sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())), out)
    harness.finish(None, "complete")  # leave the group together, as the trainer does


if __name__ == "__main__":
    main(sys.argv[1])
