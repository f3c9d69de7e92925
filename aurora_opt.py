"""Aurora and Muon: orthogonalizing optimizers for the 2-D weight matrices of a Transformer.

Muon (K. Jordan et al., 2024, https://kellerjordan.github.io/posts/muon/) replaces the
momentum update U of a matrix by its polar factor polar(U) = U (U^T U)^{-1/2}, computed
with a few Newton-Schulz iterations in bfloat16 (float32 on a CPU: ``Aurora``'s ``ns_dtype``).
Aurora (Tilde Research, 2026, "Aurora: A Leverage-Aware Spectral Optimizer", arXiv
2606.27715) keeps the update (nearly)
orthogonal but also equalizes its row norms on non-square matrices, so that no row (an
MLP neuron) gets a much larger update than the others. On a square matrix Aurora is Muon;
with ``pp_iterations=0`` it is Muon everywhere.

This file has no dependency on train_gpt.py. Public API:

* ``polar(U, ns)``: approximate polar factor of ``[..., m, n]`` matrices.
* ``aurora_direction(U, pp_iterations, pp_beta, ns, eps)``: Aurora's update direction.
* ``Aurora``: the optimizer (a ``torch.optim.Optimizer``), sharded across processes
  when ``torch.distributed`` is initialized.
* ``ns_dtype_on(device, ns_dtype)``: the Newton-Schulz dtype Aurora uses on a device.
* ``equalized_polar(U, ...)``: Aurora's direction without the shape scale (plain polar at K = 0).
* ``NorMuon``: modded-nanogpt record #89's NorMuon (docs/METHODS.md §3), an ``Aurora`` subclass
  with the same sharding; a group's ``pp_iterations`` >= 1 gives Aurora's polar + NorMuon.
* ``CautiousAdam``: record #89's Adam, cautious decay, updating every other ``step()`` call.
* ``normuon_normalize``, ``cautious_update_``, ``normuon_finish_``: NorMuon's elementwise pieces.
"""
import math

import torch
import torch.distributed as dist

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
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


def polar(U, ns="polar_express", dtype=torch.bfloat16):
    """Approximate polar factor (nearest semi-orthogonal matrix) by Newton-Schulz.

    Args:
        U: ``[..., m, n]`` float tensor; leading dims are a batch of independent matrices.
        ns: iteration, one of ``NS_COEFFICIENTS`` (``quintic5``, ``simple12``, ``polar_express``).
        dtype: dtype of the iteration (bfloat16 by default, as in Muon; float64 for references).

    Returns:
        ``[..., m, n]`` tensor in ``U``'s dtype whose singular values are near 1 (how near
        depends on ``ns``). A zero matrix gives a zero matrix.

    Raises:
        ValueError: ``U`` has fewer than 2 dims, or ``ns`` is unknown.

    Each matrix is first divided by its Frobenius norm (``1.02 * norm + 1e-6`` for Polar
    Express, ``norm + 1e-7`` otherwise) so all singular values start in (0, 1]. The
    iteration runs on the wide orientation (``X X^T`` is the small ``min(m, n)`` square).
    """
    if U.ndim < 2:
        raise ValueError(f"polar: expected a [..., m, n] tensor, got shape {tuple(U.shape)}")
    if ns not in NS_COEFFICIENTS:
        raise ValueError(f"polar: unknown ns={ns!r}; choose one of {sorted(NS_COEFFICIENTS)}")
    tall = U.size(-2) > U.size(-1)
    X = U.mT if tall else U
    X = X.to(torch.promote_types(X.dtype, torch.float32))  # normalize in >= float32
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = (X / (1.02 * norm + 1e-6) if ns == "polar_express" else X / (norm + 1e-7)).to(dtype)
    for a, b, c in NS_COEFFICIENTS[ns]:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return (X.mT if tall else X).to(U.dtype)


def equalized_polar(U, pp_iterations=2, pp_beta=0.5, ns="polar_express", eps=1e-7, dtype=torch.bfloat16):
    """Aurora's row-equalized polar factor of ``[..., m, n]`` matrices, without a shape scale.

    Returns float32 (float64 if ``U`` is) ``[..., m, n]``: ``polar(U)`` when ``pp_iterations`` is 0
    or the matrix is square, else the (nearly) semi-orthogonal matrix whose rows in the tall
    orientation have near-equal norms (``aurora_direction`` documents the arguments and algorithm).
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


def aurora_direction(U, pp_iterations=2, pp_beta=0.5, ns="polar_express", eps=1e-7, dtype=torch.bfloat16):
    """Aurora's update direction O for a momentum matrix U (docs/METHODS.md §2).

    Args:
        U: ``[..., m, n]`` float tensor (a batch of same-shape matrices is fine).
        pp_iterations: K, rounds of row scaling + polar; 0 gives plain Muon.
        pp_beta: exponent of the row-scale correction (0.5 by default).
        ns: Newton-Schulz variant used for each polar factor (see ``polar``).
        eps: floor on row norms (and ``eps**2`` on squared row norms).
        dtype: dtype of the Newton-Schulz iterations (float64 for reference checks).

    Returns:
        float32 (float64 if ``U`` is) ``[..., m, n]``: the (nearly) semi-orthogonal direction, multiplied by
        ``sqrt(max(1, m / n))``. For a tall (or transposed wide) matrix with ``K >= 1`` its
        rows have near-equal norms; a square matrix, or ``K = 0``, gives Muon's ``polar(U)``.

    The hyperparameters are not checked here (this runs every step, possibly compiled):
    ``Aurora``'s constructor checks them with ``check_hparams``.

    Algorithm (tall orientation M > N, float32 outside the polar iterations):
    ``D = 1/max(|row_i(U)|, eps)``; for k = 1..K: ``P = polar(diag(D) U)``; if k < K:
    ``D *= ((N/M) / max(|row_i(P)|^2, eps^2)) ** beta``. The result is P.
    """
    m, n = U.shape[-2:]
    return equalized_polar(U, pp_iterations, pp_beta, ns, eps, dtype) * math.sqrt(max(1.0, m / n))


def ns_dtype_on(device, ns_dtype=None):
    """The Newton-Schulz dtype ``Aurora`` uses on ``device``: ``ns_dtype``, else bfloat16 on CUDA
    (as Muon) and float32 elsewhere (CPUs emulate bfloat16 matmuls, dozens of times slower)."""
    if ns_dtype is not None:
        return ns_dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_hparams(lr=0.05, weight_decay=0.025, momentum=0.95, ns="polar_express", pp_iterations=2,
                  pp_beta=0.5, eps=1e-7):
    """Raise ValueError for a value Aurora cannot use; the message starts with the argument's name."""
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
    """Aurora (arXiv 2606.27715) / Muon for 2-D weight matrices, sharded over processes.

    Per matrix W (m x n) with gradient G: ``M <- mu M + (1 - mu) G``; ``U = (1 - mu) G + mu M``
    with Nesterov (else ``U = M``); ``O = aurora_direction(U)``;
    ``W <- W (1 - lr wd) - lr O``. Same-shape matrices are orthogonalized as one batched
    ``[k, m, n]`` call. When ``torch.distributed`` is initialized with world size W, each
    shape's list of k matrices is padded to a multiple of W and cut into W equal chunks;
    rank r orthogonalizes chunk r only, then the directions are all-gathered, so every
    rank applies identical updates. Gradients must already be identical on every rank
    (all-reduced); the momentum buffers are kept (identically) on every rank.

    Args:
        params: 2-D parameters, or param groups (dicts). A group may carry ``names``, a list
            of the parameters' names in the model, used in error messages.
        lr: learning rate (default 0.05). weight_decay: decoupled, scaled by lr (0.025).
        momentum: mu (0.95). nesterov: Nesterov momentum (True).
        pp_iterations: K (2); 0 = Muon. pp_beta: row-scale exponent (0.5).
        ns: Newton-Schulz variant for ``polar`` ("polar_express"). eps: row-norm floor (1e-7).
        compile: run the direction computation through ``torch.compile``.
        ns_dtype: dtype of the Newton-Schulz iterations; None (default) = bfloat16 on CUDA (as
            Muon) and float32 elsewhere: most CPUs emulate bfloat16 matmuls (a [4, 128, 128] x [4, 128, 512]
            batch: 68x slower than float32 on a 2-core AMD EPYC), so bfloat16 would only cost time there.

    Raises:
        ValueError: a parameter is not 2-D, a hyperparameter is out of range, or ``ns_dtype``
            is not one of None, bfloat16, float32, float64.
    """

    def __init__(self, params, lr=0.05, weight_decay=0.025, momentum=0.95, nesterov=True,
                 pp_iterations=2, pp_beta=0.5, ns="polar_express", eps=1e-7, compile=False, ns_dtype=None):
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
        self._direction = torch.compile(aurora_direction, dynamic=False) if compile else aurora_direction
        if not (ns_dtype is None or (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point
                                     and ns_dtype.itemsize >= 2 and ns_dtype != torch.float16)):
            raise ValueError(f"ns_dtype must be None, torch.bfloat16, torch.float32 or torch.float64 "
                             f"(got {ns_dtype!r})")
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
    def warmup(self):
        """Run the direction computation once per matrix shape on zeros (compiles it, changes nothing)."""
        world, _ = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            for shape, index in by_shape.items():
                device = group["params"][0].device
                zeros = torch.zeros(-(-len(index) // world), *shape, device=device)
                self._direction(zeros, group["pp_iterations"], group["pp_beta"], group["ns"], group["eps"],
                                self._dtype(device))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter (a grad of None counts as zero), with no host sync.

        Non-finite gradients are not checked here (that would sync every step): the caller
        guards its loss on the device, as train_gpt.py does.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, rank = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            lr, wd = group["lr"], group["weight_decay"]
            for index in by_shape.values():
                params = [group["params"][i] for i in index]
                U = torch.stack([self._momentum_update(p, group) for p in params])  # [k, m, n]
                for p, o in zip(params, self._sharded_direction(U, group, world, rank)):
                    p.mul_(1 - lr * wd)
                    p.add_(o.to(p.dtype), alpha=-lr)
        return loss

    def _momentum_update(self, p, group):
        """``M <- mu M + (1 - mu) G``; returns ``(1 - mu) G + mu M`` (Nesterov) or ``M``."""
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - group["momentum"])
        return g.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _sharded_direction(self, U, group, world, rank):
        """Directions of ``U`` ``[k, m, n]``: this rank computes its equal chunk, then all ranks all-gather."""
        k, shape = U.size(0), U.shape[1:]
        chunk = -(-k // world)  # ceil(k / world) matrices per rank
        if world > 1 and chunk * world != k:  # pad so every rank gets an equal chunk
            U = torch.cat([U, U.new_zeros(chunk * world - k, *shape)])
        mine = self._direction(U[rank * chunk:(rank + 1) * chunk], group["pp_iterations"], group["pp_beta"],
                               group["ns"], group["eps"], self._dtype(U.device))
        if world == 1:
            return mine
        O = U.new_empty(chunk * world, *shape)
        _all_gather_single(O, mine.contiguous())
        return O[:k]


# ----------------------------------------------------------------------------------------------
# NorMuon and Adam as in modded-nanogpt record #89 (2026-07-17, HEAD train_gpt.py)

def normuon_normalize(O, second_moment, beta2):
    """NorMuon's per-neuron second-moment normalization (arXiv 2510.05491; records #41, 2025-10-24, and #48).

    Args:
        O: ``[..., m, n]`` float32/float64 orthogonalized updates (a batch of blocks).
        second_moment: ``[..., m, 1]`` if ``m >= n`` else ``[..., 1, n]``, same dtype; updated in place
            to ``beta2 * s + (1 - beta2) * mean_sq`` (no bias correction, as HEAD).
        beta2: EMA factor of the per-neuron mean square (0.9 in record #89).

    Returns:
        ``[..., m, n]``: ``O`` with each neuron divided by ``sqrt(max(s, 1e-10))``, then each block rescaled
        to ``O``'s Frobenius norm. A neuron is a row when ``m >= n``, else a column: the larger side,
        where the polar factor leaves uneven norms (its ``min(m, n)`` vectors on the smaller side are
        orthonormal, so normalizing them would do nothing).
    """
    red = -1 if O.size(-2) >= O.size(-1) else -2  # average over the smaller side: one stat per neuron
    second_moment.lerp_(O.square().mean(dim=red, keepdim=True), 1 - beta2)
    V = O * second_moment.clamp_min(1e-10).rsqrt()
    # why: keep the block's update size that of O, so lr keeps Muon's meaning (HEAD does the same)
    return V * (O.norm(dim=(-2, -1), keepdim=True) / V.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


def cautious_update_(p, update, lr, wd):
    """``p <- p - lr * (update + wd * [update * p >= 0] * p)``, in place (record #43, 2025-11-10, arXiv 2510.12402).

    Decay acts only on entries where the update pushes the weight toward zero (same sign as ``p``).
    ``p`` float32 or float64 (a bfloat16 ``p`` is updated in float32 and rounded once); ``update`` broadcastable.
    """
    P = p.to(torch.promote_types(p.dtype, torch.float32))
    mask = (update * P) >= 0  # HEAD's NorMuon mask (>=; its Adam uses > 0)
    P = P - lr * (update + wd * (mask * P))  # mask * P first: keeps P's dtype
    p.copy_(P)


def normuon_finish_(p, O, second_moment, beta2, lr_eff, wd_lr):
    """``normuon_normalize`` (skipped when ``second_moment`` is None), then ``cautious_update_`` of ``p``.

    ``lr_eff`` and ``wd_lr`` are floats, or 0-D float64 CPU tensors when compiled (a new lr then
    needs no new graph, record #48's trick). ``p`` ``[b, rows, cols]``, ``O`` the same shape.
    """
    if second_moment is not None:
        O = normuon_normalize(O, second_moment, beta2)
    cautious_update_(p, O, lr_eff, wd_lr)


class NorMuon(Aurora):
    """NorMuon of modded-nanogpt record #89 for hidden 2-D matrices; Aurora's direction per group on request.

    Per block ``W`` (``m x n``, float32) of a matrix with gradient ``G`` (records #41-#43, #48, #80):
    Nesterov momentum as ``Aurora``; ``O = equalized_polar(U)`` (plain Polar Express when the group's
    ``pp_iterations`` is 0, Aurora's row-equalized polar otherwise); ``V = normuon_normalize(O)``
    (skipped when the group's ``normalize`` is False); ``lr_eff = lr * lr_mul * sqrt(max(1, m/n))``;
    ``W <- W - lr_eff * (V + wd * lr * [V * W >= 0] * W)`` (cautious decay, scaled by ``lr_eff * lr``
    as HEAD: both follow the lr schedule). A matrix is cut into row blocks of ``block_rows`` rows
    (e.g. one Q or K head pair, record #80), each orthogonalized and normalized on its own.

    Sharding, batching and checks are ``Aurora``'s: blocks of equal shape (across the group's
    matrices) are orthogonalized as one batch, split over ranks, then all-gathered; the momentum
    and second-moment buffers stay identical on every rank. No host sync in ``step``.

    Args:
        params: 2-D parameters or param groups; a group may set any of the keyword arguments
            below (``lr``, ``weight_decay``, ``momentum``, ``beta2``, ``lr_mul``, ``block_rows``,
            ``pp_iterations``, ``normalize``...) and ``names``.
        lr: base learning rate (0.023, record #89); the caller scales it by the schedule.
        weight_decay: cautious decay factor (1.2, record #43). momentum: mu (0.95; HEAD schedules it).
        beta2: NorMuon's EMA factor (0.9). lr_mul: the group's lr multiplier (2 on the MLP output
            projection in HEAD). block_rows: rows per orthogonalized block, None = the whole matrix.
        normalize: apply ``normuon_normalize`` (True). pp_iterations: 0 = NorMuon (default); K >= 1
            uses Aurora's row-equalized polar (non-square blocks). compile: also compiles
            ``normuon_finish_`` (one graph per block shape). Others: see ``Aurora``.

    Raises:
        ValueError: as ``Aurora``, or ``beta2`` not in [0, 1), ``lr_mul`` < 0, or ``block_rows``
            does not divide a matrix's rows.
    """

    def __init__(self, params, lr=0.023, weight_decay=1.2, momentum=0.95, beta2=0.9, lr_mul=1.0, block_rows=None,
                 normalize=True, nesterov=True, pp_iterations=0, pp_beta=0.5, ns="polar_express", eps=1e-7,
                 compile=False, ns_dtype=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                         pp_iterations=pp_iterations, pp_beta=pp_beta, ns=ns, eps=eps, compile=compile,
                         ns_dtype=ns_dtype)
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
        # blocks of one shape are orthogonalized together: {block shape: [param index, ...]} per group
        self._by_shape = [self._block_shapes(group) for group in self.param_groups]
        self._direction = torch.compile(equalized_polar, dynamic=False) if compile else equalized_polar
        self._finish = torch.compile(normuon_finish_, dynamic=False) if compile else normuon_finish_
        # compiled: lr and wd * lr reach the graph as 0-D CPU tensors (filled on the host, no sync)
        self._scalars = (torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)) if compile else None

    @staticmethod
    def _block_shapes(group):
        """``{(rows, cols) of a block: [index of each param cut into such blocks]}`` for one group."""
        by_shape = {}
        for i, p in enumerate(group["params"]):
            rows = p.size(0) if group["block_rows"] is None else group["block_rows"]
            if not (isinstance(rows, int) and rows > 0 and p.size(0) % rows == 0):
                name = group["names"][i] or f"param {i}"
                raise ValueError(f"block_rows={group['block_rows']!r} must be a positive int dividing the "
                                 f"{p.size(0)} rows of {name}")
            by_shape.setdefault((rows, p.size(1)), []).append(i)
        return by_shape

    @torch.no_grad()
    def warmup(self):
        """Run the direction once per block shape and count on zeros (compiles it, changes nothing)."""
        world, _ = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            for (rows, cols), index in by_shape.items():
                p0 = group["params"][index[0]]
                k = sum(group["params"][i].size(0) // rows for i in index)
                zeros = torch.zeros(-(-k // world), rows, cols, device=p0.device)
                self._direction(zeros, group["pp_iterations"], group["pp_beta"], group["ns"], group["eps"],
                                self._dtype(p0.device))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every matrix (a grad of None counts as zero), with no host sync."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, rank = self._shards()
        for group, by_shape in zip(self.param_groups, self._by_shape):
            for (rows, cols), index in by_shape.items():
                params = [group["params"][i] for i in index]
                U = torch.cat([self._momentum_update(p, group).view(-1, rows, cols) for p in params])
                O = self._sharded_direction(U, group, world, rank)  # [k, rows, cols] float32
                start = 0
                for p in params:
                    blocks = p.size(0) // rows
                    self._apply(p, O[start:start + blocks], group)
                    start += blocks
        return loss

    def _apply(self, p, O, group):
        """Normalize one matrix's block directions ``O`` ``[b, rows, cols]`` and take the cautious step."""
        rows, cols = O.shape[-2:]
        second_moment = None
        if group["normalize"]:
            state = self.state[p]
            if "second_moment" not in state:
                shape = (O.size(0), rows, 1) if rows >= cols else (O.size(0), 1, cols)
                state["second_moment"] = torch.zeros(shape, device=O.device, dtype=O.dtype)
            second_moment = state["second_moment"]
        lr = group["lr"]
        lr_eff = lr * group["lr_mul"] * math.sqrt(max(1.0, rows / cols))  # record #42's shape factor
        scalars = (lr_eff, group["weight_decay"] * lr)
        if self._scalars is not None:
            for t, value in zip(self._scalars, scalars):
                t.fill_(value)
            scalars = self._scalars
        self._finish(p.view(-1, rows, cols), O, second_moment, group["beta2"], *scalars)


class CautiousAdam(torch.optim.Optimizer):
    """Adam with cautious weight decay, updating every ``every``-th step on the summed gradients.

    Modded-nanogpt record #89's Adam (records #39, 2025-09-30: every other step; #50, 2025-12-18:
    cautious decay). ``step()`` is called on every training step: it adds the gradient to a buffer
    and, on every ``every``-th call (the 2nd, 4th, ... for ``every=2``, HEAD's odd steps), updates
    with the sum ``g`` of the gradients since the last update (HEAD keeps them in ``.grad``; the
    buffer here lets the training loop zero its grads every step). Per parameter, ``t`` counting
    updates: ``m <- b1 m + (1-b1) g``; ``v <- b2 v + (1-b2) g^2``;
    ``u = lr sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)``; ``p <- p - u - lr^2 wd [u p > 0] p``
    (decay scaled by lr^2, as HEAD). The call count is a Python int: no host sync.

    Args:
        params: parameters or param groups; a group may set ``lr``, ``betas``, ``eps``, ``weight_decay``.
        lr: learning rate (0.008 in record #89, times each parameter's lr multiplier; the caller
            scales it by the schedule). betas: (b1, b2). eps: 1e-10 (HEAD).
        weight_decay: 0.005 times the parameter's wd multiplier (0 for scalars).
        every: update every this many calls (2, record #39); 1 = plain Adam every step.
        compile: compile the update (``adam_finish_``, one graph per shape and betas).

    Raises:
        ValueError: lr or weight_decay < 0, a beta not in [0, 1), eps <= 0, or every < 1.
    """

    def __init__(self, params, lr=0.008, betas=(0.9, 0.99), eps=1e-10, weight_decay=0.005, every=2, compile=False):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (got {every!r})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            b1, b2 = group["betas"]
            if not (group["lr"] >= 0 and group["weight_decay"] >= 0):
                raise ValueError(f"lr and weight_decay must be >= 0 (got {group['lr']!r}, {group['weight_decay']!r})")
            if not (0 <= b1 < 1 and 0 <= b2 < 1):
                raise ValueError(f"betas must be in [0, 1) (got {group['betas']!r})")
            if not group["eps"] > 0:
                raise ValueError(f"eps must be > 0 (got {group['eps']!r})")
        self.every = every
        self.calls = 0  # step() calls so far; saved in state_dict
        self._finish = torch.compile(adam_finish_, dynamic=False) if compile else adam_finish_
        # compiled: the step size and lr^2 wd reach the graph as 0-D CPU tensors (no recompile, no sync)
        self._scalars = (torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)) if compile else None

    @property
    def updates_next(self):
        """Whether the next ``step()`` updates the parameters (e.g. to untie a tied head on such a step)."""
        return (self.calls + 1) % self.every == 0

    def state_dict(self):
        state = super().state_dict()
        state["calls"] = self.calls
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.calls = state_dict.pop("calls", 0)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        """Accumulate this step's gradients (None counts as zero); update on every ``every``-th call."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                    if first:  # the sum restarts after each update
                        buf.copy_(g)
                    else:
                        buf.add_(g)
                    g = buf
                if update:
                    self._update(p, g.to(torch.promote_types(g.dtype, torch.float32)), group, state)
        return loss

    def _update(self, p, g, group, state):
        """One Adam update of ``p`` with the float32 (float64) gradient ``g``."""
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(g)  # float32 (float64 for a float64 p)
            state["exp_avg_sq"] = torch.zeros_like(g)
        state["step"] += 1
        t, (b1, b2), lr = state["step"], group["betas"], group["lr"]
        scalars = (lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t), lr * lr * group["weight_decay"])
        if self._scalars is not None:
            for s, value in zip(self._scalars, scalars):
                s.fill_(value)
            scalars = self._scalars
        self._finish(p, g, state["exp_avg"], state["exp_avg_sq"], b1, b2, group["eps"], *scalars)


def adam_finish_(p, g, exp_avg, exp_avg_sq, b1, b2, eps, step_size, wd_lr2):
    """One cautious Adam update of ``p`` in place (``CautiousAdam``); moments updated in place.

    ``step_size = lr sqrt(1-b2^t)/(1-b1^t)`` and ``wd_lr2 = lr^2 wd`` are floats, or 0-D float64 CPU
    tensors when compiled. ``g`` and the moments are float32 (float64 for a float64 ``p``).
    """
    exp_avg.lerp_(g, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
    u = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    P = p.to(g.dtype)
    u = u + wd_lr2 * (((u * P) > 0) * P)  # cautious decay (HEAD's Adam: strict > 0, scaled by lr^2)
    p.copy_(P - u)


# Record #89's Adam settings by parameter role: (betas, lr multiplier, wd multiplier) of HEAD's param table.
RECORD89_ADAM = {
    "embed": ((0.5, 0.95), 1.0, 150.0),          # token embedding (tied to the head until stage 3)
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "value_embeds": ((0.75, 0.95), 75.0, 5.0),
    "bigram_embed": ((0.75, 0.95), 75.0, 5.0),
    "scalars": ((0.9, 0.99), 5.0, 0.0),          # attention/skip lambdas (no decay: record #50)
    "smear_gate": ((0.9, 0.99), 0.01, 0.0),
    "ve_gates": ((0.9, 0.99), 1.0, 1.0),
    "post_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": ((0.9, 0.95), 5.0, 0.0),
    "mudd": ((0.9, 0.99), 0.25, 1.0),            # MUDD MLP weights (record #81)
    "mudd_bias": ((0.9, 0.99), 0.25, 0.0),
    "mudd_gate": ((0.9, 0.99), 0.1, 1.0),        # record #85's gate MLPs
    "mudd_gate_bias": ((0.9, 0.99), 0.1, 0.0),
}


def record89_adam_groups(roles, lr=0.008, weight_decay=0.005):
    """``CautiousAdam`` param groups with record #89's per-role betas, lr and wd (docs/METHODS.md §3).

    Args:
        roles: ``{role: [params]}`` with roles from ``RECORD89_ADAM``; empty lists are skipped.
        lr, weight_decay: HEAD's Adam base values, multiplied by each role's multipliers.

    Returns:
        A list of group dicts (``params``, ``betas``, ``lr``, ``weight_decay``, ``role``).

    Raises:
        ValueError: an unknown role.
    """
    groups = []
    for role, params in roles.items():
        if role not in RECORD89_ADAM:
            raise ValueError(f"unknown Adam role {role!r}; choose from {sorted(RECORD89_ADAM)}")
        betas, lr_mul, wd_mul = RECORD89_ADAM[role]
        if params:
            groups.append(dict(params=list(params), betas=betas, lr=lr * lr_mul, weight_decay=weight_decay * wd_mul,
                               role=role))
    return groups


def record89_matrix_groups(qk, vo, mlp_in, mlp_out, head_dim, aurora=False, pp_iterations=2):
    """``NorMuon`` param groups matching record #89's blocks and lr factors, for ``[out, in]`` matrices.

    Args:
        qk: ``[(name, W)]`` of the query and key matrices (``[n_head * head_dim, d]``), cut into head pairs.
        vo: ``[(name, W)]`` of the value and attention output matrices (whole blocks).
        mlp_in: ``[(name, W)]`` of the MLP input projections (``[hidden, d]``, tall).
        mlp_out: ``[(name, W)]`` of the MLP output projections (``[d, hidden]``, wide).
        head_dim: rows per head; a block is ``2 * head_dim`` rows (record #80).
        aurora: use Aurora's row-equalized polar (``pp_iterations``) on the MLP matrices, the tall
            ones in HEAD's layout (docs/METHODS.md §3); NorMuon's normalization stays on.

    Returns:
        A list of group dicts. The MLP output's ``lr_mul`` gives HEAD's total factor
        ``2 * sqrt(hidden / d)`` (HEAD stores it as ``[hidden, d]``; here the shape factor is 1).

    Raises:
        ValueError: ``2 * head_dim`` does not divide a Q/K matrix's rows (from ``NorMuon``), or
            the MLP output projections have different shapes.
    """
    K = pp_iterations if aurora else 0
    groups = [dict(params=[w for _, w in qk], names=[n for n, _ in qk], block_rows=2 * head_dim, pp_iterations=0),
              dict(params=[w for _, w in vo], names=[n for n, _ in vo], pp_iterations=0),
              dict(params=[w for _, w in mlp_in], names=[n for n, _ in mlp_in], pp_iterations=K)]
    shapes = {tuple(w.shape) for _, w in mlp_out}
    if len(shapes) > 1:
        raise ValueError(f"MLP output projections must share one shape (got {sorted(shapes)})")
    if mlp_out:
        m, n = shapes.pop()
        lr_mul = 2.0 * math.sqrt(max(m, n) / min(m, n)) / math.sqrt(max(1.0, m / n))
        groups.append(dict(params=[w for _, w in mlp_out], names=[n_ for n_, _ in mlp_out], pp_iterations=K,
                           lr_mul=lr_mul))
    return [g for g in groups if g["params"]]
