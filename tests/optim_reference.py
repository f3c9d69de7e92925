"""The per-parameter optimizer steps of aurora_opt.py at e6fff65 (before issue 44's batching by shape), kept
unchanged as the bit-exact reference of tests/test_optim_batched.py: one compiled call per parameter.

Each class subclasses today's optimizer and puts back the old ``step`` (and its helpers), so the constructor,
the checks, the sharded direction and ``state_dict`` are today's, and only the update path is the old one.
"""
import math

import torch

import aurora_opt as A


def normuon_finish_(p, O, second_moment, beta2, lr_eff, wd_lr):
    """e6fff65's per-matrix finish: ``normuon_normalize`` then ``cautious_update_`` of ``p`` ``[b, rows, cols]``."""
    if second_moment is not None:
        O = A.normuon_normalize(O, second_moment, beta2)
    A.cautious_update_(p, O, lr_eff, wd_lr)


def adam_finish_(p, g, exp_avg, exp_avg_sq, b1, b2, eps, step_size, wd_lr2):
    """e6fff65's per-parameter cautious Adam update."""
    exp_avg.lerp_(g, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
    u = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    P = p.to(g.dtype)
    u = u + wd_lr2 * (((u * P) > 0) * P)
    p.copy_(P - u)


def _momentum_update(opt, p, group):
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    state = opt.state[p]
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    buf = state["momentum_buffer"]
    buf.lerp_(g, 1 - group["momentum"])
    return g.lerp(buf, group["momentum"]) if group["nesterov"] else buf


class OldAurora(A.Aurora):
    @torch.no_grad()
    def step(self, closure=None):
        world, rank = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            lr, wd = group["lr"], group["weight_decay"]
            for index in by_shape.values():
                params = [group["params"][i] for i in index]
                U = torch.stack([_momentum_update(self, p, group) for p in params])
                for p, o in zip(params, self._sharded_direction(U, group, world, rank)):
                    p.mul_(1 - lr * wd)
                    p.add_(o.to(p.dtype), alpha=-lr)


class OldNorMuon(A.NorMuon):
    def __init__(self, params, compile=False, **kw):
        super().__init__(params, compile=compile, **kw)
        self._finish = torch.compile(normuon_finish_, dynamic=False) if compile else normuon_finish_

    @torch.no_grad()
    def step(self, closure=None):
        world, rank = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            for (rows, cols), index in by_shape.items():
                params = [group["params"][i] for i in index]
                U = torch.cat([_momentum_update(self, p, group).view(-1, rows, cols) for p in params])
                O = self._sharded_direction(U, group, world, rank)
                start = 0
                for p in params:
                    blocks = p.size(0) // rows
                    self._apply_one(p, O[start:start + blocks], group)
                    start += blocks

    def _apply_one(self, p, O, group):
        rows, cols = O.shape[-2:]
        second_moment = None
        if group["normalize"]:
            state = self.state[p]
            if "second_moment" not in state:
                shape = (O.size(0), rows, 1) if rows >= cols else (O.size(0), 1, cols)
                state["second_moment"] = torch.zeros(shape, device=O.device, dtype=O.dtype)
            second_moment = state["second_moment"]
        lr = group["lr"]
        lr_eff = lr * group["lr_mul"] * math.sqrt(max(1.0, rows / cols))
        scalars = (lr_eff, group["weight_decay"] * lr)
        if self._scalars is not None:
            for t, value in zip(self._scalars, scalars):
                t.fill_(value)
            scalars = self._scalars
        self._finish(p.view(-1, rows, cols), O, second_moment, group["beta2"], *scalars)


class OldCautiousAdam(A.CautiousAdam):
    def __init__(self, params, compile=False, **kw):
        super().__init__(params, compile=compile, **kw)
        self._finish = torch.compile(adam_finish_, dynamic=False) if compile else adam_finish_

    @torch.no_grad()
    def step(self, closure=None):
        update, first = self.updates_next, self.calls % self.every == 0
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                state = self.state[p]
                if self.every > 1:
                    if "grad_sum" not in state:
                        state["grad_sum"] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                    buf = state["grad_sum"]
                    if first:
                        buf.copy_(g)
                    else:
                        buf.add_(g)
                    g = buf
                if update:
                    self._update_one(p, g.to(torch.promote_types(g.dtype, torch.float32)), group, state)

    def _update_one(self, p, g, group, state):
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(g)
            state["exp_avg_sq"] = torch.zeros_like(g)
        state["step"] += 1
        t, (b1, b2), lr = state["step"], group["betas"], group["lr"]
        scalars = (lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t), lr * lr * group["weight_decay"])
        if self._scalars is not None:
            for s, value in zip(self._scalars, scalars):
                s.fill_(value)
            scalars = self._scalars
        self._finish(p, g, state["exp_avg"], state["exp_avg_sq"], b1, b2, group["eps"], *scalars)


def assert_equals_the_per_matrix_reference(saved):
    """A worker's batched weights and state equal those of tests/optim_reference.py's per-matrix step, bit for bit."""
    for w, old in zip(saved["weights"], saved["old_weights"]):
        assert torch.equal(w, old)
    for s, old in zip(saved["state"], saved["old_state"]):
        assert set(s) == set(old) and all(torch.equal(s[k], old[k]) for k in s)
