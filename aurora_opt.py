"""Aurora and Muon: orthogonalizing optimizers for the 2-D weight matrices of a Transformer.

Muon (K. Jordan et al., 2024, https://kellerjordan.github.io/posts/muon/) replaces a matrix's
momentum update U by its polar factor U (U^T U)^{-1/2}, by a few Newton-Schulz iterations.
Aurora (Tilde Research, 2026, arXiv 2606.27715) also equalizes the row norms of non-square
updates, so no MLP neuron gets a much larger update than the others; on a square matrix, or
with ``pp_iterations=0``, it is Muon. ``NorMuon`` and ``CautiousAdam`` are modded-nanogpt record
#89's optimizers (docs/METHODS.md §2-§3). Nothing here imports train_gpt.py.
"""
import math

import torch
import torch.distributed as dist

# The defaults of this file's functions and of Aurora, defined once; NorMuon takes pp_beta, ns and
# eps from here, matrix_groups pp_iterations. train_gpt.Config does not read them: it has its own
# lr, wd, momentum, pp_iterations and pp_beta (passed to NorMuon and matrix_groups), so only ns and
# eps reach the trainer from here. Why these values: lr, wd and momentum are Muon's as tuned in
# record #21 (2025-01-26); K and beta are arXiv 2606.27715's; Polar Express is the most accurate
# 5-step variant; eps floors a row norm, so a zero row does not divide by zero.
DEFAULTS = dict(lr=0.05, weight_decay=0.025, momentum=0.95, pp_iterations=2, pp_beta=0.5,
                ns="polar_express", eps=1e-7)

# Newton-Schulz iterations X <- a X + (b A + c A^2) X with A = X X^T, one (a, b, c) per step.
NS_COEFFICIENTS = {
    # Muon's tuned quintic: fast, converges only to singular values in about [0.7, 1.2].
    "quintic5": [(3.4445, -4.7750, 2.0315)] * 5,
    # Plain cubic-in-A iteration: converges to the exact polar factor, needs more steps.
    "simple12": [(2.0, -1.5, 0.5)] * 12,
    # Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932): per-step optimal.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ],
}


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same semantics); older torch
# (e.g. 2.11 on some GPU images) only has the old name.
_all_gather_single = (getattr(dist, "all_gather_single", None)
                      or getattr(dist, "all_gather_into_tensor", None))


def polar(U, ns=DEFAULTS["ns"], dtype=torch.bfloat16):
    """Approximate polar factor of ``[..., m, n]`` matrices by Newton-Schulz in ``dtype``.

    The result has ``U``'s shape and dtype. Singular values end near 1 (how near depends on
    ``ns``); zero stays zero. ValueError for a bad shape or ``ns``.
    """
    if U.ndim < 2:
        raise ValueError(f"polar: expected a [..., m, n] tensor, got shape {tuple(U.shape)}")
    if ns not in NS_COEFFICIENTS:
        raise ValueError(f"polar: unknown ns={ns!r}; choose one of {sorted(NS_COEFFICIENTS)}")
    tall = U.size(-2) > U.size(-1)
    X = U.mT if tall else U  # wide orientation: X X^T is the small square
    X = X.to(torch.promote_types(X.dtype, torch.float32))  # normalize in >= float32
    # the Frobenius norm bounds the spectral norm: singular values start in (0, 1]; Polar Express's
    # coefficients assume <= 1, so it keeps a 2% margin for rounding
    norm = X.norm(dim=(-2, -1), keepdim=True)
    if ns == "polar_express":
        X = X / (1.02 * norm + 1e-6)
    else:
        X = X / (norm + 1e-7)
    X = X.to(dtype)
    for a, b, c in NS_COEFFICIENTS[ns]:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return (X.mT if tall else X).to(U.dtype)


def equalized_polar(U, pp_iterations=DEFAULTS["pp_iterations"], pp_beta=DEFAULTS["pp_beta"],
                    ns=DEFAULTS["ns"], eps=DEFAULTS["eps"], dtype=torch.bfloat16):
    """Aurora's row-equalized polar factor of ``[..., m, n]`` without the shape scale.

    Float32 (float64 if ``U`` is). Tall orientation M > N: ``D = 1/max(|row_i(U)|, eps)``; K times
    ``P = polar(diag(D) U)``, between rounds ``D *= ((N/M) / max(|row_i(P)|^2, eps^2)) ** beta``.
    Square or K = 0: ``polar(U)``.
    """
    m, n = U.shape[-2:]
    U = U if U.dtype == torch.float64 else U.float()
    if pp_iterations == 0 or m == n:
        return polar(U, ns, dtype)
    tall = m > n
    V = U if tall else U.mT  # [..., M, N] with M > N
    M, N = V.shape[-2:]
    D = 1.0 / V.norm(dim=-1).clamp_min(eps)  # one scale per row, [..., M]
    for k in range(pp_iterations):
        P = polar(D.unsqueeze(-1) * V, ns, dtype)
        if k < pp_iterations - 1:
            row_sq = P.square().sum(dim=-1).clamp_min(eps * eps)
            D = D * ((N / M) / row_sq) ** pp_beta
    return P if tall else P.mT


def aurora_direction(U, pp_iterations=DEFAULTS["pp_iterations"], pp_beta=DEFAULTS["pp_beta"],
                     ns=DEFAULTS["ns"], eps=DEFAULTS["eps"], dtype=torch.bfloat16):
    """Aurora's direction for momentum ``[..., m, n]`` (docs/METHODS.md §2).

    ``equalized_polar(U) sqrt(max(1, m/n))``. Unchecked (it runs every step, maybe compiled):
    ``Aurora``'s constructor checks the hyperparameters.
    """
    m, n = U.shape[-2:]
    direction = equalized_polar(U, pp_iterations, pp_beta, ns, eps, dtype)
    return direction * math.sqrt(max(1.0, m / n))


def ns_dtype_on(device, ns_dtype=None):
    """Newton-Schulz dtype on ``device``: ``ns_dtype`` if given.

    Else bfloat16 on CUDA (as Muon), float32 elsewhere.
    """
    if ns_dtype is not None:
        return ns_dtype
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float32  # CPUs emulate bf16 matmuls: ~68x slower


def compiled_if(fn, compile):
    """``fn``, or its graph compiled once per shape (``dynamic=False``) when ``compile``."""
    return torch.compile(fn, dynamic=False) if compile else fn


def host_scalars():
    """Two 0-D float64 CPU tensors a compiled step reads its per-step scalars from."""
    return torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)


def to_host_scalars(held, values):
    """``values`` (floats) as they go to the step's graph: written into ``held`` (``host_scalars``)
    when compiled, else as they are."""
    if held is None:
        return values
    for t, value in zip(held, values):
        t.fill_(value)
    return held


def check_hparams(lr=DEFAULTS["lr"], weight_decay=DEFAULTS["weight_decay"],
                  momentum=DEFAULTS["momentum"], ns=DEFAULTS["ns"],
                  pp_iterations=DEFAULTS["pp_iterations"], pp_beta=DEFAULTS["pp_beta"],
                  eps=DEFAULTS["eps"]):
    """Raise ValueError for a value Aurora cannot use; the message starts with the argument name."""
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0 (got {lr!r})")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0 (got {weight_decay!r})")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1) (got {momentum!r})")
    if ns not in NS_COEFFICIENTS:
        raise ValueError(f"ns must be one of {sorted(NS_COEFFICIENTS)} (got {ns!r})")
    if not isinstance(pp_iterations, int) or pp_iterations < 0:
        raise ValueError(f"pp_iterations must be an int >= 0, 0 = Muon (got {pp_iterations!r})")
    if not pp_beta > 0:
        raise ValueError(f"pp_beta must be > 0 (got {pp_beta!r})")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (got {eps!r})")


class Aurora(torch.optim.Optimizer):
    """Aurora (arXiv 2606.27715) / Muon for 2-D matrices (groups may carry ``names`` for messages).

    Per matrix: ``M <- mu M + (1 - mu) G``; ``U = (1 - mu) G + mu M`` (Nesterov, else M);
    ``W <- W (1 - lr wd) - lr aurora_direction(U)``. Same-shape matrices form one ``[k, m, n]``
    batch, padded to a multiple of the world size and split over ranks, then all-gathered:
    every rank applies the same update (gradients must be all-reduced already). ``ns_dtype``:
    see ``ns_dtype_on``.
    """

    def __init__(self, params, lr=DEFAULTS["lr"], weight_decay=DEFAULTS["weight_decay"],
                 momentum=DEFAULTS["momentum"], nesterov=True,
                 pp_iterations=DEFAULTS["pp_iterations"], pp_beta=DEFAULTS["pp_beta"],
                 ns=DEFAULTS["ns"], eps=DEFAULTS["eps"], compile=False, ns_dtype=None):
        check_hparams(lr, weight_decay, momentum, ns, pp_iterations, pp_beta, eps)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        pp_iterations=pp_iterations, pp_beta=pp_beta, ns=ns, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            names = group.setdefault("names", [None] * len(group["params"]))
            if len(names) != len(group["params"]):
                raise ValueError("param group 'names' must have one name per parameter")
            for i, p in enumerate(group["params"]):
                if p.ndim != 2:
                    name = names[i] or f"param {i}"
                    raise ValueError(f"Aurora handles 2-D matrices only; {name} has shape "
                                     f"{tuple(p.shape)} (give it to Adam)")
        # same-shape matrices are orthogonalized together: the groups are fixed, so build them once
        self._by_shape = []
        for group in self.param_groups:
            by_shape = {}
            for i, p in enumerate(group["params"]):
                by_shape.setdefault(tuple(p.shape), []).append(i)
            self._by_shape.append(by_shape)
        self._direction = compiled_if(aurora_direction, compile)
        floating = isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point
        usable = floating and ns_dtype.itemsize >= 2 and ns_dtype != torch.float16
        if not (ns_dtype is None or usable):
            raise ValueError(f"ns_dtype must be None, torch.bfloat16, torch.float32 or "
                             f"torch.float64 (got {ns_dtype!r})")
        self._ns_dtype = ns_dtype

    def _dtype(self, device):
        """Newton-Schulz dtype on ``device`` (``ns_dtype_on``)."""
        return ns_dtype_on(device, self._ns_dtype)

    def _shards(self):
        """(world, rank) of the process group, (1, 0) without one."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter (a None grad counts as zero).

        No host sync, so no finiteness check.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, rank = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            lr = group["lr"]
            wd = group["weight_decay"]
            for index in by_shape.values():
                params = [group["params"][i] for i in index]
                U = torch.stack(self._momenta(params, group))
                O = self._sharded_direction(U, group, world, rank)
                torch._foreach_mul_(params, 1 - lr * wd)  # one multi-tensor kernel per op on CUDA
                torch._foreach_add_(params, [o.to(p.dtype) for p, o in zip(params, O)], alpha=-lr)
        return loss

    def _momenta(self, params, group):
        """``M <- mu M + (1 - mu) G`` for each of ``params``; returns the list of their ``U``.

        ``U = (1 - mu) G + mu M`` with Nesterov, else the buffer ``M`` itself.

        Per-parameter buffers (``state_dict`` as before) updated by foreach ops: one multi-tensor
        kernel per op on CUDA for the whole list, on a CPU a loop of the same ATen lerp (the same
        bits as one by one). Eager, not compiled: inductor's lerp rounds differently from ATen's (it
        skips the fma), so compiling it would change every compiled step's result.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        return torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs

    def _sharded_direction(self, U, group, world, rank):
        """Directions of ``U`` ``[k, m, n]``: each rank does an equal chunk, then all gather."""
        return self._start_direction(U, group, world, rank)()

    def _start_direction(self, U, group, world, rank):
        """``_sharded_direction`` in two halves: compute this rank's chunk, start the all-gather.

        The gather is async; the function returned waits for it and gives the ``[k, m, n]``
        directions. NorMuon computes the next bucket's chunk while this one's gather is under way.
        """
        k = U.size(0)
        shape = U.shape[1:]
        chunk = -(-k // world)  # ceil(k / world) matrices per rank
        if world > 1 and chunk * world != k:  # pad so every rank gets an equal chunk
            U = torch.cat([U, U.new_zeros(chunk * world - k, *shape)])
        with torch.profiler.record_function("optimizer: directions"):
            ours = U[rank * chunk:(rank + 1) * chunk]
            mine = self._direction(ours, group["pp_iterations"], group["pp_beta"], group["ns"],
                                   group["eps"], self._dtype(U.device))
        if world == 1:
            return lambda: mine
        O = U.new_empty(chunk * world, *shape)
        work = _all_gather_single(O, mine.contiguous(), async_op=True)

        def gathered():
            with torch.profiler.record_function("optimizer: wait for the directions' gather"):
                work.wait()
            return O[:k]
        return gathered


# ----------------------------------------------------------------------------------------------
# NorMuon and Adam as in modded-nanogpt record #89 (2026-07-17, its train_gpt.py)

def normuon_normalize(O, second_moment, beta2):
    """NorMuon's per-neuron normalization (arXiv 2510.05491; records #41, 2025-10-24, and #48).

    Of ``[..., m, n]``: a neuron is a row if m >= n, else a column (the side the polar factor
    leaves uneven); each is divided by ``sqrt(s)``, ``s`` (``[..., m, 1]`` or ``[..., 1, n]``) its
    mean-square EMA updated in place with ``beta2`` (no bias correction, as modded-nanogpt); each
    block is then rescaled to ``O``'s Frobenius norm.
    """
    red = -1 if O.size(-2) >= O.size(-1) else -2  # mean over the smaller side: one stat per neuron
    second_moment.lerp_(O.square().mean(dim=red, keepdim=True), 1 - beta2)
    V = O * second_moment.clamp_min(1e-10).rsqrt()
    # why: keep the block's update size that of O, so lr keeps Muon's meaning (as modded-nanogpt)
    O_norm = O.norm(dim=(-2, -1), keepdim=True)
    V_norm = V.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return V * (O_norm / V_norm)


def cautious_update_(p, update, lr, wd):
    """``p <- p - lr (update + wd [update p >= 0] p)`` in place, in >= float32 (record #43).

    Cautious weight decay (arXiv 2510.12402): decay acts only where the update pushes the weight
    toward zero; ``update`` broadcasts to ``p``.
    """
    P = p.to(torch.promote_types(p.dtype, torch.float32))
    mask = (update * P) >= 0  # >=, not > (as record #89's NorMuon): a zero update still decays
    P = P - lr * (update + wd * (mask * P))  # mask * P first: keeps P's dtype
    p.copy_(P)


def normuon_finish_(params, O, second_moments, beta2, lr_eff, wd_lr):
    """One bucket of same-shape blocks: normalize, then step each matrix with its blocks.

    ``normuon_normalize`` of ``O`` ``[B, rows, cols]`` (unless ``second_moments`` is None), then
    ``cautious_update_`` of each of ``params`` ``[b_i rows, cols]`` with its ``b_i`` blocks of
    ``O``. ``second_moments``: each matrix's ``[b_i, rows, 1]`` or ``[b_i, 1, cols]`` state,
    updated in place (sum b_i = B). ``lr_eff``, ``wd_lr``: floats, or 0-D float64 CPU tensors
    when compiled (no new graph per lr, record #48). Compiled, one call (graph) per bucket, not
    per matrix: the host cost of a call is paid once per shape.
    """
    rows, cols = O.shape[-2:]
    blocks = [p.size(0) // rows for p in params]
    if second_moments is not None:
        S = torch.cat(second_moments)  # the bucket's statistics stacked: one reduction for all
        O = normuon_normalize(O, S, beta2)
        for s, new in zip(second_moments, S.split(blocks)):
            s.copy_(new)
    for p, o in zip(params, O.split(blocks)):
        cautious_update_(p.view(-1, rows, cols), o, lr_eff, wd_lr)


class NorMuon(Aurora):
    """NorMuon of modded-nanogpt record #89 (records #41-#43, #48, #80) for hidden 2-D matrices.

    A matrix is cut into row blocks of ``block_rows`` (a Q or K head pair, record #80); per block
    ``m x n``: momentum as ``Aurora``, ``O = equalized_polar(U)`` (Polar Express at the group's
    ``pp_iterations`` 0, Aurora's polar otherwise), ``V = normuon_normalize(O)`` (if
    ``normalize``), ``W <- W - lr_eff (V + wd lr [V W >= 0] W)`` with
    ``lr_eff = lr lr_mul sqrt(max(1, m/n))``, as record #89. Batching, sharding and checks are
    ``Aurora``'s; a group may set any keyword below.
    """

    def __init__(self, params, lr=0.023, weight_decay=1.2, momentum=0.95, beta2=0.9, lr_mul=1.0,
                 block_rows=None, normalize=True, nesterov=True, pp_iterations=0,
                 pp_beta=DEFAULTS["pp_beta"], ns=DEFAULTS["ns"], eps=DEFAULTS["eps"],
                 compile=False, ns_dtype=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                         nesterov=nesterov, pp_iterations=pp_iterations, pp_beta=pp_beta, ns=ns,
                         eps=eps, compile=compile, ns_dtype=ns_dtype)
        extra = dict(beta2=beta2, lr_mul=lr_mul, block_rows=block_rows, normalize=normalize)
        self.defaults.update(extra)
        for group in self.param_groups:
            for key, value in extra.items():
                group.setdefault(key, value)
            check_hparams(group["lr"], group["weight_decay"], group["momentum"], group["ns"],
                          group["pp_iterations"], group["pp_beta"], group["eps"])
            if not 0 <= group["beta2"] < 1:
                raise ValueError(f"beta2 must be in [0, 1) (got {group['beta2']!r})")
            if not group["lr_mul"] >= 0:
                raise ValueError(f"lr_mul must be >= 0 (got {group['lr_mul']!r})")
        # blocks of one shape are orthogonalized together: per group {block shape: [param index]}
        self._by_shape = [self._block_shapes(group) for group in self.param_groups]
        self._direction = compiled_if(equalized_polar, compile)
        self._finish = compiled_if(normuon_finish_, compile)
        # lr and wd * lr reach the graph as 0-D CPU tensors, filled on the host: a new lr
        # neither recompiles nor syncs
        self._scalars = host_scalars() if compile else None

    @staticmethod
    def _block_shapes(group):
        """One group's ``{(rows, cols) of a block: [index of each param cut into such blocks]}``."""
        by_shape = {}
        for i, p in enumerate(group["params"]):
            rows = p.size(0) if group["block_rows"] is None else group["block_rows"]
            if not (isinstance(rows, int) and rows > 0 and p.size(0) % rows == 0):
                name = group["names"][i] or f"param {i}"
                raise ValueError(f"block_rows={group['block_rows']!r} must be a positive int "
                                 f"dividing the {p.size(0)} rows of {name}")
            by_shape.setdefault((rows, p.size(1)), []).append(i)
        return by_shape

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every matrix (a grad of None counts as zero), with no host sync."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, rank = self._shards()
        # every bucket's directions first: its gather runs while the next bucket's are computed
        pending = []
        for group, by_shape in zip(self.param_groups, self._by_shape):
            for (rows, cols), index in by_shape.items():
                params = [group["params"][i] for i in index]
                # why per-matrix state, stacked each step: stacked persistent buffers would spare
                # only this cat (the grads and weights are the model's separate tensors anyway)
                # and would need their own state_dict; foreach ops read a list in one CUDA
                # launch, and U is allocated each step as the polar needs it
                momenta = self._momenta(params, group)
                U = torch.cat(momenta).view(-1, rows, cols)  # [sum b_i, rows, cols], one view
                pending.append((params, self._start_direction(U, group, world, rank), group))
        # the updates read only the directions: the same bits in any order
        for params, gathered, group in pending:
            self._apply(params, gathered(), group)
        return loss

    def _apply(self, params, O, group):
        """Normalize a bucket's block directions ``O`` ``[B, rows, cols]``; take the cautious steps.

        One ``_finish`` call for the whole bucket.
        """
        rows, cols = O.shape[-2:]
        second_moments = None
        if group["normalize"]:
            second_moments = []
            for p in params:
                state = self.state[p]
                # per matrix, as before: state_dict and checkpoints unchanged
                if "second_moment" not in state:
                    b = p.size(0) // rows
                    shape = (b, rows, 1) if rows >= cols else (b, 1, cols)
                    state["second_moment"] = torch.zeros(shape, device=O.device, dtype=O.dtype)
                second_moments.append(state["second_moment"])
        lr = group["lr"]
        # a tall block's polar factor has entries of RMS 1/sqrt(rows); sqrt(rows / cols) lifts them
        # to a square or wide block's 1/sqrt(cols) (record #42)
        lr_eff = lr * group["lr_mul"] * math.sqrt(max(1.0, rows / cols))
        scalars = to_host_scalars(self._scalars, (lr_eff, group["weight_decay"] * lr))
        self._finish(params, O, second_moments, group["beta2"], *scalars)


class CautiousAdam(torch.optim.Optimizer):
    """Adam with cautious weight decay, updating each ``every``-th ``step()`` with the grads since.

    Record #89's Adam (records #39, 2025-09-30: every other step; #50, 2025-12-18: cautious
    decay): ``u = lr sqrt(1-b2^t)/(1-b1^t) m/(sqrt(v)+eps)``; ``p <- p - u - lr^2 wd [u p > 0] p``
    (as record #89). The sum lives in a buffer (modded-nanogpt keeps it in ``.grad``), so the loop
    zeroes grads every step; the call count is a Python int: no host sync. Defaults: record #89's
    (lr 0.008, wd 0.005, eps 1e-10).

    ``shard`` (several processes: ``kernels.GradBuckets``): each rank keeps the state of, and
    updates, only its shard of each parameter (flat elements ``shard.shard_range(p)``), from
    ``shard.grad_shard(p)`` (reduce-scattered); an update step then starts the parameters'
    all-gather, which ``wait_gather`` finishes (ZeRO-2, as modded-nanogpt's Adam). ``state_dict``
    holds whole tensors (a collective then), whatever the process count.
    """

    def __init__(self, params, lr=0.008, betas=(0.9, 0.99), eps=1e-10, weight_decay=0.005,
                 every=2, compile=False, shard=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (got {every!r})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            if not (group["lr"] >= 0 and group["weight_decay"] >= 0):
                raise ValueError(f"lr and weight_decay must be >= 0 "
                                 f"(got {group['lr']!r}, {group['weight_decay']!r})")
            if not (0 <= b1 < 1 and 0 <= b2 < 1):
                raise ValueError(f"betas must be in [0, 1) (got {group['betas']!r})")
            if not group["eps"] > 0:
                raise ValueError(f"eps must be > 0 (got {group['eps']!r})")
        self.every = every
        self.shard = shard
        self.calls = 0  # step() calls so far; saved in state_dict
        self._finish = compiled_if(adam_finish_, compile)
        self._accumulate = compiled_if(grad_sum_, compile)
        # the step size and lr^2 wd reach the graph as 0-D CPU tensors: no recompile, no sync
        self._scalars = host_scalars() if compile else None

    @property
    def updates_next(self):
        """Whether the next ``step()`` updates the parameters (e.g. to untie a tied head then)."""
        return (self.calls + 1) % self.every == 0

    def state_dict(self):
        """The state with whole tensors (call it on every rank).

        Sharded, every rank all-gathers each shard.
        """
        state = super().state_dict()
        state["calls"] = self.calls
        if self.shard is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            whole = {}
            for i, s in state["state"].items():
                p = params[i]
                whole[i] = {k: self._whole(p, v) if torch.is_tensor(v) and v.ndim else v
                            for k, v in s.items()}
            state["state"] = whole
        return state

    def _whole(self, p, piece):
        """A parameter's whole state tensor: every rank's ``piece`` of its shard, all-gathered."""
        world = self.shard.world
        k = -(-p.numel() // world)  # ceil(numel / world) elements per rank
        out = piece.new_empty(world * k)
        padded = torch.cat([piece, piece.new_zeros(k - piece.numel())])  # a last shard may be short
        dist.all_gather_into_tensor(out, padded)
        return out[:p.numel()].view(p.shape)

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.calls = state_dict.pop("calls", 0)
        super().load_state_dict(state_dict)
        # why: torch casts loaded state to its parameter's dtype, so an --adam-bf16 run resumed
        # with its float32 moments and gradient sum rounded to bf16; put the saved tensors back in
        # their own dtype (sharded: its piece)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(ids, [p for group in self.param_groups for p in group["params"]]):
            for key, value in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(value):
                    value = value.to(device=p.device)
                    if self.shard is not None:
                        lo, hi = self.shard.shard_range(p)
                        value = value.reshape(-1)[lo:hi].clone()
                    self.state[p][key] = value

    @torch.no_grad()
    def step(self, closure=None):
        """Accumulate this step's gradients (None counts as zero); update on each ``every``-th call.

        Compiled calls: one for every parameter on a step that only accumulates (the sum has
        no hyperparameter), one per group on an update step (which adds its own gradients in
        that call).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = self.updates_next
        first = self.calls % self.every == 0
        self.calls += 1
        if self.shard is not None:
            # the reduce-scattered gradients (started after NorMuon's, waited for here)
            with torch.profiler.record_function("optimizer: wait for Adam's reduce-scatter"):
                self.shard.wait("scatter")
        if not update:
            params = [p for group in self.param_groups for p in group["params"]]
            self._accumulate(self._grad_sums(params), self._grads(params), first)
            return loss
        for group in self.param_groups:
            self._update(group, first)
        if self.shard is not None:
            # every rank's updated shards to every rank: it overlaps what runs before the wait
            self.shard.gather()
        return loss

    def wait_gather(self):
        """Wait for the parameters' all-gather an update step started (if several processes)."""
        if self.shard is not None:
            self.shard.wait_gather()

    def _own(self, p):
        """The elements of ``p`` this rank updates: ``p``, or sharded its flat shard (a view)."""
        if self.shard is None:
            return p
        lo, hi = self.shard.shard_range(p)
        return p.detach().view(-1)[lo:hi]

    def _grads(self, params):
        """Each parameter's gradient (zeros where it has none); sharded, its shard's reduced one."""
        if self.shard is None:
            return _grads(params)
        return [self.shard.grad_shard(p) for p in params]

    def _grad_sums(self, params):
        """Each parameter's float32 (float64) gradient sum over the every-k steps, zero at first."""
        sums = []
        for p in params:
            state = self.state[p]
            if "grad_sum" not in state:
                dtype = torch.promote_types(p.dtype, torch.float32)
                state["grad_sum"] = torch.zeros_like(self._own(p), dtype=dtype)
            sums.append(state["grad_sum"])
        return sums

    def _update(self, group, first):
        """One Adam update of ``group``: an ``adam_finish_`` call per step count (normally one)."""
        params = group["params"]
        sums = self._grad_sums(params) if self.every > 1 else [None] * len(params)
        # {t: [(p, grad, sum, exp_avg, exp_avg_sq)]}: t differs only if parameters joined late
        by_step = {}
        for p, g, s in zip(params, self._grads(params), sums):
            state = self.state[p]
            own = self._own(p)
            # per parameter, as before: state_dict and checkpoints unchanged
            if "exp_avg" not in state:
                dtype = torch.promote_types(p.dtype, torch.float32)  # float64 for a float64 p
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(own, dtype=dtype)
                state["exp_avg_sq"] = torch.zeros_like(own, dtype=dtype)
            state["step"] += 1
            entry = (own, g, s, state["exp_avg"], state["exp_avg_sq"])
            by_step.setdefault(state["step"], []).append(entry)
        b1, b2 = group["betas"]
        lr = group["lr"]
        for t, entries in by_step.items():
            ps, gs, ss, ms, vs = map(list, zip(*entries))
            step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            scalars = to_host_scalars(self._scalars, (step_size, lr * lr * group["weight_decay"]))
            # every == 1 keeps no sums: the gradients are used as they are
            sums_or_none = None if self.every == 1 else ss
            self._finish(ps, gs, sums_or_none, ms, vs, first, b1, b2, group["eps"], *scalars)


def _grads(params):
    """Each parameter's gradient, zeros where it has none."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def grad_sum_(sums, grads, first):
    """The every-k gradient sums in place: ``sums = grads`` first after an update, else ``+=``.

    Float32 (float64) sums of bf16 or float32 grads. Foreach ops: compiled, one call for the
    whole list.
    """
    if first:
        torch._foreach_copy_(sums, grads)
    else:
        torch._foreach_add_(sums, grads)


def adam_finish_(params, grads, sums, exp_avgs, exp_avg_sqs, first, b1, b2, eps, step_size, wd_lr2):
    """Cautious Adam updates of ``params`` and their moments in place.

    ``params``: any shapes, bf16 or float32; moments float32 (float64). One group's
    hyperparameters and step count. ``sums``: the every-k gradient sums, finished here with
    ``grads`` (``grad_sum_``) and used as the gradients; None: ``grads`` are. ``step_size`` and
    ``wd_lr2`` (lr^2 wd): floats, or 0-D float64 CPU tensors when compiled. Compiled, one call
    (graph) per group, not one per parameter.
    """
    if sums is not None:
        grad_sum_(sums, grads, first)
        grads = sums
    for p, g, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        exp_avg.lerp_(g, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        u = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
        P = p.to(g.dtype)
        # cautious decay: only where the step already shrinks |p| (u p > 0, strict as record #89's
        # Adam; scaled by lr^2 there too)
        u = u + wd_lr2 * (((u * P) > 0) * P)
        p.copy_(P - u)


@torch.no_grad()
def warm_step(opt):
    """Run ``opt.step()`` through every compiled graph it will use, then restore ``opt`` and params.

    One graph per bucket of same-shape matrices or per Adam group; the sum-only and update
    calls of an every-k optimizer. The steps run at lr 0 with no gradients, which changes no
    parameter (every update here is ``p - lr * (...)`` or ``p (1 - lr wd)``); the state the
    steps create or move is put back (clones taken before), and so are grads, lrs and
    ``CautiousAdam``'s call count.
    """
    saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                   for p, s in opt.state.items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    calls = getattr(opt, "calls", None)
    for p in params:
        p.grad = None
    for g in opt.param_groups:
        g["lr"] = 0.0
    for _ in range(getattr(opt, "every", 1)):  # CautiousAdam updates on its every-th call only
        opt.step()
    if hasattr(opt, "wait_gather"):  # a sharded update's all-gather (lr 0: the same parameters)
        opt.wait_gather()
    opt.state.clear()
    opt.state.update(saved_state)
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    if calls is not None:
        opt.calls = calls


# Record #89's Adam settings by parameter role, (betas, lr multiplier, wd multiplier), copied from
# modded-nanogpt's param table so our runs compare to its record.
ADAM_ROLES = {
    "embed": ((0.5, 0.95), 1.0, 150.0),          # token embedding (tied to the head until stage 3)
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "value_embeds": ((0.75, 0.95), 75.0, 5.0),
    "bigram_embed": ((0.75, 0.95), 75.0, 5.0),
    "scalars": ((0.9, 0.99), 5.0, 0.0),          # attention/skip lambdas: decay would shrink them
    "smear_gate": ((0.9, 0.99), 0.01, 0.0),
    "ve_gates": ((0.9, 0.99), 1.0, 1.0),
    "post_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": ((0.9, 0.95), 5.0, 0.0),
    "mudd": ((0.9, 0.99), 0.25, 1.0),            # MUDD MLP weights (record #81)
    "mudd_bias": ((0.9, 0.99), 0.25, 0.0),
    "mudd_gate": ((0.9, 0.99), 0.1, 1.0),        # MUDD's gate MLPs (record #85)
    "mudd_gate_bias": ((0.9, 0.99), 0.1, 0.0),
}


def adam_groups(roles, lr=0.008, weight_decay=0.005):
    """``CautiousAdam`` groups from ``{role: [params]}`` with record #89's per-role betas and lr,
    wd multipliers (``ADAM_ROLES``; docs/METHODS.md §3); empty roles are skipped, an unknown one
    is a ValueError."""
    groups = []
    for role, params in roles.items():
        if role not in ADAM_ROLES:
            raise ValueError(f"unknown Adam role {role!r}; choose from {sorted(ADAM_ROLES)}")
        betas, lr_mul, wd_mul = ADAM_ROLES[role]
        if params:
            groups.append(dict(params=list(params), betas=betas, lr=lr * lr_mul,
                               weight_decay=weight_decay * wd_mul, role=role))
    return groups


def matrix_groups(qk, vo, mlp_in, mlp_out, head_dim, aurora=False,
                  pp_iterations=DEFAULTS["pp_iterations"]):
    """``NorMuon`` groups of record #89 from ``[(name, W [out, in])]``.

    Q and K cut into head pairs (record #80), V and the attention output whole, the MLP input and
    output (with ``aurora``, Aurora's polar on them). The MLP output's ``lr_mul`` gives record
    #89's factor ``2 sqrt(hidden / d)`` (modded-nanogpt stores it as ``[hidden, d]``; here the
    shape factor is 1). ValueError if the MLP outputs differ in shape.
    """
    K = pp_iterations if aurora else 0
    groups = [
        dict(params=[w for _, w in qk], names=[n for n, _ in qk], block_rows=2 * head_dim,
             pp_iterations=0),
        dict(params=[w for _, w in vo], names=[n for n, _ in vo], pp_iterations=0),
        dict(params=[w for _, w in mlp_in], names=[n for n, _ in mlp_in], pp_iterations=K),
    ]
    shapes = {tuple(w.shape) for _, w in mlp_out}
    if len(shapes) > 1:
        raise ValueError(f"MLP output projections must share one shape (got {sorted(shapes)})")
    if mlp_out:
        m, n = shapes.pop()
        lr_mul = 2.0 * math.sqrt(max(m, n) / min(m, n)) / math.sqrt(max(1.0, m / n))
        groups.append(dict(params=[w for _, w in mlp_out], names=[n_ for n_, _ in mlp_out],
                           pp_iterations=K, lr_mul=lr_mul))
    return [g for g in groups if g["params"]]
