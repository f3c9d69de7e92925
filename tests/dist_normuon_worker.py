"""Run 3 NorMuon steps (head-pair blocks, Aurora on one group) on fixed gradients; save weights and shares, and
the weights and state of the per-matrix reference (tests/optim_reference.py) run beside it on the same gradients.

Run as one process (``python dist_normuon_worker.py OUT``) or under torchrun; test_normuon compares.
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
    q, k = torch.randn(32, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    v, o = torch.randn(32, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    fc, proj = torch.randn(64, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    params = [q, k, v, o, fc, proj]
    groups = lambda ps: [dict(params=ps[:2], block_rows=8), dict(params=ps[2:4]),  # noqa: E731
                         dict(params=ps[4:], pp_iterations=2, lr_mul=2.0)]
    opt = aurora_opt.NorMuon(groups(params))
    old = [p.detach().clone().requires_grad_() for p in params]
    old_opt = optim_reference.OldNorMuon(groups(old))
    shares = []
    direction = opt._direction

    def counting(U, *args):
        shares.append(U.size(0))
        return direction(U, *args)
    opt._direction = counting

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("the sharded update must not all-reduce")
    real_all_reduce, dist.all_reduce = dist.all_reduce, no_all_reduce
    for step in range(3):
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
