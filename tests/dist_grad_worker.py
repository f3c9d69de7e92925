"""Gradients of one step of a tiny GPT under torchrun (gloo): bucketed all-reduce vs per-tensor.

Run under ``torchrun --nproc_per_node=2``; rank 0 saves, for the test to check: the gradients and
loss of ``accumulate_gradients`` (buckets started during the last micro-batch's backward) and of
the per-tensor all-reduce after the whole backward it replaced, the order of forwards and
collectives, and when the first parameter's gradient (the last the backward produces) was ready.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
import kernels  # noqa: E402
import train_gpt as T  # noqa: E402
from conftest import SMALL_FLAGS  # noqa: E402  (this folder is the script's: on the path)


def per_tensor_reference(model, micro_batches, rt):
    """The step as it was: local accumulation, then one all-reduce per gradient tensor."""
    n_valid = T.all_reduce_sum(sum((t != T.IGNORE_INDEX).sum() for _, t in micro_batches).float(), rt).clamp_min(1)
    total = torch.zeros(())
    for inputs, targets in micro_batches:
        loss_sum = model(inputs, targets)
        (loss_sum / n_valid).backward()
        total += loss_sum.detach()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters() if p.grad is not None]
    for w in works:
        w.wait()
    return T.all_reduce_sum(total, rt) / n_valid


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg, _ = T.parse_config([*SMALL_FLAGS, "--n-layer", "3", "--model-dim", "32", "--n-head", "2",
                             "--seq-len", "16", "--batch-tokens", "128"])
    torch.manual_seed(0)
    model = T.GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rt = T.Runtime(rank=rank, world=2, device=torch.device("cpu"), compile=False, accum=2)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    micro = [(torch.randint(0, 1000, (2, 16, 1), generator=g), torch.randint(0, 1000, (2, 16, 1), generator=g))
             for _ in range(2)]
    micro[1][1][0, :5] = T.IGNORE_INDEX

    ref_loss = per_tensor_reference(model, micro, rt)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    kernels.GRAD_BUCKET_BYTES = 8 * 1024  # several buckets in a tiny model
    events = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(t, *args, **kwargs):
        events.append(("all_reduce", t.ndim))  # 0-d: label count, loss; 1-d: a bucket
        return real_all_reduce(t, *args, **kwargs)

    model.register_forward_pre_hook(lambda m, args: events.append(("forward", 0)))
    model.embed.weight.register_post_accumulate_grad_hook(lambda p: events.append(("embed_ready", 0)))
    dist.all_reduce = recording_all_reduce
    loss = T.accumulate_gradients(model, micro, rt)
    dist.all_reduce = real_all_reduce
    grads = [p.grad.clone() for p in model.parameters()]
    buckets = kernels.grad_buckets(model)
    if rank == 0:
        torch.save(dict(ref_loss=ref_loss, loss=loss, ref_grads=ref_grads, grads=grads, events=events,
                        n_buckets=len(buckets.buckets), n_params=len(list(model.parameters())),
                        hooks_left=sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())), out)
    harness.leave_process_group()  # tear down together, as the trainer does


if __name__ == "__main__":
    main(sys.argv[1])
