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
    U = U if U.dtype == torch.float64 else U.float()
    if pp_iterations == 0 or m == n:
        O = polar(U, ns, dtype)
    else:
        tall = m > n
        V = U if tall else U.mT  # [..., M, N] with M > N
        M, N = V.shape[-2:]
        D = 1.0 / V.norm(dim=-1).clamp_min(eps)  # one scale per row, [..., M]
        for k in range(pp_iterations):
            P = polar(D.unsqueeze(-1) * V, ns, dtype)
            if k < pp_iterations - 1:
                row_sq = P.square().sum(dim=-1).clamp_min(eps * eps)
                D = D * ((N / M) / row_sq) ** pp_beta
        O = P if tall else P.mT
    return O * math.sqrt(max(1.0, m / n))


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
