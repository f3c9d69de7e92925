"""Aurora and Muon against float64 references (docs/METHODS.md §2), robustness, and the sharded update."""
import math
import os
import subprocess
import sys

import pytest
import torch

import aurora_opt as A
import optim_reference as R
from conftest import REPO, run_torchrun, subprocess_env

SHAPES = [(64, 64), (256, 64), (64, 256), (192, 48), (48, 192)]  # last two: 3072x768-like 4:1


def with_condition_number(shape, cond, seed=0, dtype=torch.float64):
    """Random matrix whose singular values are log-spaced from 1 down to 1/cond."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g, dtype=dtype))
    v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g, dtype=dtype))
    s = torch.logspace(0, -math.log10(cond), min(m, n), dtype=dtype)
    return u @ torch.diag(s) @ v.T


def svd_polar(X):
    """Exact polar factor U V^T in float64."""
    u, _, vh = torch.linalg.svd(X.double(), full_matrices=False)
    return u @ vh


def rows_scaled(shape, ratio=30.0, seed=0):
    """Gaussian matrix whose rows *in the tall orientation* differ in scale by `ratio` (log-spaced)."""
    g = torch.Generator().manual_seed(seed)
    M, N = max(shape), min(shape)
    scales = torch.logspace(0, math.log10(ratio), M)[torch.randperm(M, generator=g)]
    T = torch.randn(M, N, generator=g) * scales[:, None]
    return T if shape[0] >= shape[1] else T.T


def tall_row_norms(O, shape):
    T = O if shape[0] >= shape[1] else O.T
    return T.double().norm(dim=1)


# ---------------------------------------------------------------------------------------------
# Newton-Schulz


@pytest.mark.parametrize("ns, lo, hi", [("quintic5", 0.6, 1.25), ("polar_express", 0.8, 1.2),
                                        ("simple12", 0.98, 1.02)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cond", [1.5, 10, 100])
def test_newton_schulz_singular_values_in_bf16(ns, lo, hi, shape, cond):
    X = with_condition_number(shape, cond).float()
    O = A.polar(X, ns)
    assert O.dtype == torch.float32 and O.shape == X.shape
    sv = torch.linalg.svdvals(O.double())
    assert lo <= sv.min() and sv.max() <= hi, (sv.min().item(), sv.max().item())


@pytest.mark.parametrize("shape", SHAPES)
def test_simple12_converges_to_the_exact_polar_factor_in_float64(shape):
    X = with_condition_number(shape, 20, seed=1)
    torch.testing.assert_close(A.polar(X, "simple12", dtype=torch.float64), svd_polar(X), rtol=0, atol=1e-6)


def test_polar_is_batched_and_handles_zero():
    X = torch.randn(3, 32, 48)
    batched = A.polar(X, "polar_express")
    for i in range(3):
        torch.testing.assert_close(batched[i], A.polar(X[i], "polar_express"), rtol=0, atol=1e-6)
    assert torch.equal(A.polar(torch.zeros(16, 8)), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="unknown ns"):
        A.polar(X, "cubic")
    with pytest.raises(ValueError):
        A.polar(torch.randn(5))


# ---------------------------------------------------------------------------------------------
# Aurora's direction


def aurora_reference(U, K, beta, eps=1e-7):
    """docs/METHODS.md pseudo-code in float64 with the exact (SVD) polar factor."""
    U = U.double()
    m, n = U.shape
    if K == 0 or m == n:
        return svd_polar(U) * math.sqrt(max(1, m / n))
    V = U if m > n else U.T
    M, N = V.shape
    D = 1.0 / V.norm(dim=1).clamp_min(eps)
    for k in range(1, K + 1):
        P = svd_polar(D[:, None] * V)
        if k < K:
            D = D * ((N / M) / P.square().sum(1).clamp_min(eps ** 2)) ** beta
    O = P if m > n else P.T
    return O * math.sqrt(max(1, m / n))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("K, beta", [(0, 0.5), (1, 0.5), (2, 0.5), (3, 0.3)])
def test_aurora_direction_matches_float64_reference(shape, K, beta):
    # well conditioned (so 12 float64 Newton-Schulz steps converge), rows scaled up to 3x
    scales = torch.logspace(0, math.log10(3), shape[0], dtype=torch.float64)[:, None]
    U = with_condition_number(shape, 10, seed=K) * scales
    ref = aurora_reference(U, K, beta)
    # float64 Newton-Schulz: must agree with the SVD reference to high precision
    got = A.aurora_direction(U, K, beta, "simple12", dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the production setting (bfloat16 Polar Express): close in relative Frobenius norm
    fast = A.aurora_direction(U.float(), K, beta, "polar_express")
    assert fast.dtype == torch.float32
    assert (fast.double() - ref).norm() / ref.norm() < 0.12


# Measured spread, 6 seeds: simple12 <= 4%, polar_express 5-7.4% at >= 64 columns. With only 48
# columns polar_express reaches 9.5% on one seed in six, in float32 as in bfloat16: it is Polar
# Express's approximation of the polar factor, not rounding; hence shapes of 64+ columns here.
@pytest.mark.parametrize("ns, tol", [("simple12", 0.05), ("polar_express", 0.08)])
@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (384, 96), (96, 384)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aurora_equalizes_row_norms_where_muon_does_not(ns, tol, shape, seed):
    U = rows_scaled(shape, ratio=30.0, seed=seed)
    M, N = max(shape), min(shape)
    target = math.sqrt(N / M)
    aspect = math.sqrt(max(1, shape[0] / shape[1]))  # undo the aspect scaling
    aurora = tall_row_norms(A.aurora_direction(U, 2, 0.5, ns) / aspect, shape)
    assert (aurora / target - 1).abs().max() < tol
    muon = tall_row_norms(A.aurora_direction(U, 0, 0.5, ns) / aspect, shape)
    assert muon.max() / muon.min() > 5 * (aurora.max() / aurora.min())
    assert (muon / target - 1).abs().max() > 0.5


def test_square_input_is_exactly_muon():
    U = torch.randn(48, 48) * torch.logspace(0, 1.5, 48)[:, None]
    for K in (1, 2, 3):
        assert torch.equal(A.aurora_direction(U, K, 0.5), A.aurora_direction(U, 0, 0.5))
    assert torch.equal(A.aurora_direction(U, 0, 0.5), A.polar(U, "polar_express"))


def test_aspect_scaling_and_batching():
    torch.manual_seed(0)
    U = torch.randn(4, 96, 24)
    O = A.aurora_direction(U, 2, 0.5, "simple12")
    for i in range(4):
        torch.testing.assert_close(O[i], A.aurora_direction(U[i], 2, 0.5, "simple12"), rtol=0, atol=1e-6)
    # tall 96x24: P has 24 unit singular values, |P|_F^2 = 24, times the aspect factor^2 96/24
    frob_sq = O.double().square().sum(dim=(-2, -1))
    torch.testing.assert_close(frob_sq, torch.full((4,), 96.0, dtype=torch.float64), rtol=0.03, atol=0)
    wide = A.aurora_direction(U.mT, 2, 0.5, "simple12")  # wide: no aspect factor
    torch.testing.assert_close(wide.double().square().sum(dim=(-2, -1)),
                               torch.full((4,), 24.0, dtype=torch.float64), rtol=0.03, atol=0)


# ---------------------------------------------------------------------------------------------
# the optimizer step


@pytest.fixture
def exact_polar(monkeypatch):
    """Make the optimizer's direction exact (SVD polar in float64) so steps can be checked tightly."""
    monkeypatch.setattr(A, "polar", lambda U, ns="polar_express", dtype=None: svd_polar(U).to(U.dtype))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("K", [0, 2])
def test_optimizer_step_matches_reference_update(exact_polar, nesterov, K):
    torch.manual_seed(0)
    shapes = [(32, 32), (64, 16), (16, 64), (64, 16)]
    params = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    ref_w = [p.detach().clone() for p in params]
    ref_m = [torch.zeros_like(w) for w in ref_w]
    lr, wd, mu = 0.04, 0.1, 0.9
    opt = A.Aurora(params, lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov, pp_iterations=K)
    for step in range(4):
        grads = [torch.randn_like(w) for w in ref_w]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            ref_m[i] = mu * ref_m[i] + (1 - mu) * g
            U = (1 - mu) * g + mu * ref_m[i] if nesterov else ref_m[i]
            ref_w[i] = ref_w[i] * (1 - lr * wd) - lr * aurora_reference(U, K, 0.5)
        for p, w in zip(params, ref_w):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-9)


def train_one_matrix(shape, steps=3, **kw):
    """Weights of one matrix after a few Aurora steps on seeded random gradients."""
    torch.manual_seed(0)
    p = torch.randn(*shape, requires_grad=True)
    opt = A.Aurora([p], **kw)
    for _ in range(steps):
        p.grad = torch.randn(*shape)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("ns_dtype, expected", [(None, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float64, torch.float64)])
def test_newton_schulz_dtype_follows_the_device(monkeypatch, ns_dtype, expected):
    # default: float32 on a CPU (bf16 matmuls are emulated there), bf16 on CUDA (checked by _dtype below)
    seen = []
    real = A.polar
    monkeypatch.setattr(A, "polar", lambda U, ns="polar_express", dtype=None: seen.append(dtype) or real(U, ns, dtype))
    p = torch.randn(16, 64, requires_grad=True)
    opt = A.Aurora([p], ns_dtype=ns_dtype)
    p.grad = torch.randn(16, 64)
    opt.step()
    assert seen and set(seen) == {expected}
    assert opt._dtype(torch.device("cuda")) == (ns_dtype or torch.bfloat16)


@pytest.mark.parametrize("bad", ["bfloat16", torch.int64, torch.float16, torch.complex64, 3])
def test_aurora_refuses_a_newton_schulz_dtype_it_cannot_use(bad):
    with pytest.raises(ValueError, match="ns_dtype"):
        A.Aurora([torch.randn(4, 4, requires_grad=True)], ns_dtype=bad)


def test_nesterov_changes_the_update():
    a, b = train_one_matrix((32, 16), nesterov=True), train_one_matrix((32, 16), nesterov=False)
    assert (a - b).abs().max() > 1e-3


def test_square_matrices_train_exactly_like_muon():
    assert torch.equal(train_one_matrix((40, 40), pp_iterations=2), train_one_matrix((40, 40), pp_iterations=0))


def test_zero_gradient_gives_zero_update_only_decay():
    p = torch.randn(48, 12, requires_grad=True)
    w0 = p.detach().clone()
    opt = A.Aurora([p], lr=0.05, weight_decay=0.1)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.detach(), w0 * (1 - 0.05 * 0.1), rtol=0, atol=0)
    q = torch.randn(48, 12, requires_grad=True)  # a zero row among non-zero ones stays finite
    q.grad = torch.randn(48, 12)
    q.grad[3] = 0
    A.Aurora([q]).step()
    assert torch.isfinite(q).all()


def test_same_shape_groups_are_built_once_and_follow_param_order():
    ps = [torch.randn(*shape, requires_grad=True) for shape in ((8, 4), (4, 8), (8, 4), (4, 4), (4, 8))]
    opt = A.Aurora(ps)
    assert opt._by_shape == [{(8, 4): [0, 2], (4, 8): [1, 4], (4, 4): [3]}]


def test_bad_hyperparameters_and_shapes_raise_value_error():
    p = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="2-D"):
        A.Aurora([dict(params=[torch.randn(8, requires_grad=True)], names=["blocks.0.norm"])])
    for kw in (dict(lr=-1), dict(momentum=1.0), dict(pp_iterations=-1), dict(pp_beta=0), dict(ns="x"),
               dict(eps=0), dict(weight_decay=-0.1)):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"^{name} must"):  # the message starts with the argument
            A.Aurora([p], **kw)


# ---------------------------------------------------------------------------------------------
# distributed: each rank orthogonalizes its share, then all-gathers; same weights as one process


def test_two_process_update_equals_single_process(tmp_path):
    worker = os.path.join(REPO, "tests", "dist_aurora_worker.py")
    single = tmp_path / "single.pt"
    out = subprocess.run([sys.executable, worker, str(single)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    multi = tmp_path / "multi.pt"
    run_torchrun([worker, str(multi)], subprocess_env(), timeout=300)
    a, b = torch.load(single), torch.load(multi)
    assert a["world"] == 1 and b["world"] == 2
    for wa, wb in zip(a["weights"], b["weights"]):
        torch.testing.assert_close(wb, wa, rtol=0, atol=1e-6)
    # shapes: 3 x (32,32), 1 x (64,16), 2 x (16,64): per rank ceil(k/2) of each, padded
    assert b["shares"] == {0: [2, 1, 1] * 4, 1: [2, 1, 1] * 4}
    assert a["shares"] == {0: [3, 1, 2] * 4}
    for saved in (a, b):  # 1 process and 2: as the per-matrix step of e6fff65 (issue 44's batching changes no bit)
        R.assert_equals_the_per_matrix_reference(saved)
