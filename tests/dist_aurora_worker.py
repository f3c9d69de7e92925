"""Run 4 Aurora steps on fixed matrices and gradients; save the weights and each rank's share, and the weights and
state of the per-matrix reference (tests/optim_reference.py) run beside it on the same gradients.

Run as one process (``python dist_aurora_worker.py OUT``) or under torchrun; the test compares.
All-reduce is disabled during the steps: the sharded update may only all-gather.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
import aurora_opt  # noqa: E402
import optim_reference  # noqa: E402  (this script's folder, tests/, is on the path)


def main(out):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    shapes = [(32, 32)] * 3 + [(64, 16)] + [(16, 64)] * 2
    params = [torch.randn(*s, requires_grad=True) for s in shapes]
    opt = aurora_opt.Aurora(params, lr=0.05, weight_decay=0.025)
    old = [p.detach().clone().requires_grad_() for p in params]
    old_opt = optim_reference.OldAurora(old, lr=0.05, weight_decay=0.025)
    shares = []
    direction = opt._direction

    def counting(U, *args):
        shares.append(U.size(0))
        return direction(U, *args)
    opt._direction = counting

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("the sharded update must not all-reduce")
    real_all_reduce, dist.all_reduce = dist.all_reduce, no_all_reduce
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)  # same gradients on every rank
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * torch.logspace(0, 1, p.size(0))[:, None]
        for p, r in zip(params, old):
            r.grad = p.grad.clone()
        opt.step()
        old_opt.step()
    dist.all_reduce = real_all_reduce
    all_shares = [None] * world
    if world > 1:
        dist.all_gather_object(all_shares, shares)
    else:
        all_shares = [shares]
    if rank == 0:
        torch.save(dict(world=world, weights=[p.detach() for p in params], shares=dict(enumerate(all_shares)),
                        state=[opt.state[p] for p in params], old_weights=[p.detach() for p in old],
                        old_state=[old_opt.state[p] for p in old]), out)
    if world > 1:
        harness.finish(None, "complete")  # leave the group together, as the trainer does


if __name__ == "__main__":
    main(sys.argv[1])
