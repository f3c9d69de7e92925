"""NorMuon, cautious weight decay and every-other-step Adam (record #89) against float64 references."""
import math
import os
import subprocess
import sys

import pytest
import torch

import aurora_opt as A
import optim_reference as R
from conftest import REPO, run_torchrun, subprocess_env


def svd_polar(X):
    """Exact polar factor U V^T in float64."""
    u, _, vh = torch.linalg.svd(X.double(), full_matrices=False)
    return u @ vh


@pytest.fixture
def exact_polar(monkeypatch):
    """Make the optimizer's orthogonalization exact (SVD polar in float64) so steps can be checked tightly."""
    monkeypatch.setattr(A, "polar", lambda U, ns="polar_express", dtype=None: svd_polar(U).to(U.dtype))


def equalized_reference(U, K, beta=0.5, eps=1e-7):
    """Aurora's row-equalized polar (docs/METHODS.md §2) in float64, exact polar, no shape scale."""
    m, n = U.shape
    if K == 0 or m == n:
        return svd_polar(U)
    V = U if m > n else U.T
    M, N = V.shape
    D = 1.0 / V.norm(dim=1).clamp_min(eps)
    for k in range(1, K + 1):
        P = svd_polar(D[:, None] * V)
        if k < K:
            D = D * ((N / M) / P.square().sum(1).clamp_min(eps ** 2)) ** beta
    return P if m > n else P.T


def normalize_reference(O, s, beta2):
    """NorMuon's normalization of one block ``O`` written neuron by neuron; returns (V, new s)."""
    m, n = O.shape
    if m >= n:  # one statistic per row
        mean_sq = torch.stack([sum(O[i, j] ** 2 for j in range(n)) / n for i in range(m)])
        s = beta2 * s + (1 - beta2) * mean_sq
        V = torch.stack([O[i] / math.sqrt(max(s[i].item(), 1e-10)) for i in range(m)])
    else:  # one statistic per column
        mean_sq = torch.stack([sum(O[i, j] ** 2 for i in range(m)) / m for j in range(n)])
        s = beta2 * s + (1 - beta2) * mean_sq
        V = torch.stack([O[:, j] / math.sqrt(max(s[j].item(), 1e-10)) for j in range(n)], dim=1)
    return V * (O.norm() / V.norm()), s


def cautious_reference(w, u, lr, wd, strict=False):
    """``w - lr*u - lr*wd*w`` on entries where ``u*w >= 0`` (``> 0`` if strict), else ``w - lr*u``; entry by entry."""
    out = w.clone()
    for idx in range(w.numel()):
        wi, ui = w.view(-1)[idx].item(), u.view(-1)[idx].item()
        agree = ui * wi > 0 if strict else ui * wi >= 0
        out.view(-1)[idx] = wi - lr * ui - (lr * wd * wi if agree else 0.0)
    return out


class NorMuonReference:
    """One matrix under NorMuon, in float64, block by block, from the math in docs/METHODS.md §3."""

    def __init__(self, w, block_rows=None, lr_mul=1.0, K=0, normalize=True):
        self.w, self.m = w.clone(), torch.zeros_like(w)
        self.rows = block_rows or w.size(0)
        self.lr_mul, self.K, self.normalize = lr_mul, K, normalize
        r, c = self.rows, w.size(1)
        self.s = [torch.zeros(r if r >= c else c, dtype=torch.float64) for _ in range(w.size(0) // r)]

    def step(self, g, lr, wd, mu, beta2):
        self.m = mu * self.m + (1 - mu) * g
        U = (1 - mu) * g + mu * self.m  # Nesterov
        r, c = self.rows, self.w.size(1)
        for b in range(self.w.size(0) // r):
            O = equalized_reference(U[b * r:(b + 1) * r], self.K)
            if self.normalize:
                O, self.s[b] = normalize_reference(O, self.s[b], beta2)
            lr_eff = lr * self.lr_mul * math.sqrt(max(1.0, r / c))
            self.w[b * r:(b + 1) * r] = cautious_reference(self.w[b * r:(b + 1) * r], O, lr_eff, wd * lr)


# ---------------------------------------------------------------------------------------------
# pieces


@pytest.mark.parametrize("shape", [(24, 24), (40, 10), (10, 40), (3, 16, 48), (2, 48, 16)])
def test_normuon_normalize_matches_reference_over_steps(shape):
    g = torch.Generator().manual_seed(0)
    m, n = shape[-2:]
    batch = shape[:-2]
    s = torch.zeros(*batch, m, 1, dtype=torch.float64) if m >= n else torch.zeros(*batch, 1, n, dtype=torch.float64)
    flat_s = [torch.zeros(max(m, n), dtype=torch.float64) for _ in range(math.prod(batch))]
    for _ in range(3):
        scales = torch.logspace(0, 1, max(m, n), dtype=torch.float64)
        O = torch.randn(*shape, generator=g, dtype=torch.float64)
        O = O * (scales[:, None] if m >= n else scales[None, :])  # uneven neurons
        got = A.normuon_normalize(O, s, 0.9)
        for b, Ob in enumerate(O.reshape(-1, m, n)):
            ref, flat_s[b] = normalize_reference(Ob, flat_s[b], 0.9)
            torch.testing.assert_close(got.reshape(-1, m, n)[b], ref, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(s.reshape(-1, max(m, n))[b], flat_s[b], rtol=1e-12, atol=0)


def test_normuon_normalize_equalizes_neurons_and_keeps_the_norm():
    O = torch.randn(64, 16, dtype=torch.float64) * torch.logspace(0, 1, 64, dtype=torch.float64)[:, None]
    V = A.normuon_normalize(O, torch.zeros(64, 1, dtype=torch.float64), 0.9)  # first step: s = 0.1 * mean_sq
    rows = V.norm(dim=1)
    torch.testing.assert_close(rows, rows.mean().expand(64), rtol=1e-12, atol=0)
    torch.testing.assert_close(V.norm(), O.norm(), rtol=1e-12, atol=0)


def test_cautious_update_matches_reference_with_sign_disagreements():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 9, generator=g, dtype=torch.float64)
    u = torch.randn(12, 9, generator=g, dtype=torch.float64)
    u[0, :3] = 0.0  # zero update: decays (>= 0, as modded-nanogpt's NorMuon)
    w[1, :3] = 0.0  # zero weight: nothing to decay
    agree, disagree = (u * w > 0), (u * w < 0)
    assert agree.sum() > 20 and disagree.sum() > 20  # both cases are exercised
    ref = cautious_reference(w, u, 0.1, 0.3)
    p = w.clone()
    A.cautious_update_(p, u, 0.1, 0.3)
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-15)
    # where signs disagree the decay is off: the step is exactly -lr * u
    torch.testing.assert_close(p[disagree], (w - 0.1 * u)[disagree], rtol=0, atol=1e-15)
    torch.testing.assert_close(p[0, :3], w[0, :3] * (1 - 0.1 * 0.3), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# the NorMuon step


CASES = [  # (shape, block_rows, lr_mul, K, normalize)
    ((32, 32), None, 1.0, 0, True),    # square: per-row statistics
    ((16, 48), None, 1.0, 0, True),    # wide: per-column statistics, no shape factor
    ((48, 16), None, 2.0, 0, True),    # tall: per-row statistics, sqrt(3) shape factor, lr x2
    ((64, 32), 16, 1.0, 0, True),      # Q/K-like: 4 head-pair blocks of 16 x 32, each on its own
    ((96, 24), 48, 1.0, 0, True),      # tall blocks
    ((48, 16), None, 1.0, 2, True),    # Aurora's polar (tall), then NorMuon
    ((16, 48), None, 1.0, 2, True),    # Aurora's polar (wide)
    ((48, 16), None, 1.0, 2, False),   # Aurora's polar alone, cautious decay
]


@pytest.mark.parametrize("shape, block_rows, lr_mul, K, normalize", CASES)
def test_normuon_step_matches_float64_reference(exact_polar, shape, block_rows, lr_mul, K, normalize):
    torch.manual_seed(0)
    p = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    ref = NorMuonReference(p.detach(), block_rows, lr_mul, K, normalize)
    opt = A.NorMuon([dict(params=[p], lr_mul=lr_mul, block_rows=block_rows, pp_iterations=K, normalize=normalize)],
                    lr=0.023, weight_decay=1.2, beta2=0.9)
    for step in range(5):
        lr, mu = 0.023 * (1 - 0.1 * step), 0.85 + 0.02 * step  # the caller's schedules
        for group in opt.param_groups:
            group["lr"], group["momentum"] = lr, mu
        grad = torch.randn(*shape, dtype=torch.float64) * torch.logspace(0, 1, shape[0], dtype=torch.float64)[:, None]
        p.grad = grad.clone()
        opt.step()
        ref.step(grad, lr, 1.2, mu, 0.9)
        torch.testing.assert_close(p.detach(), ref.w, rtol=0, atol=1e-10)


def test_head_pair_blocks_equal_separate_matrices(exact_polar):
    torch.manual_seed(0)
    w = torch.randn(64, 32, dtype=torch.float64)
    whole = w.clone().requires_grad_()
    parts = [w[i * 16:(i + 1) * 16].clone().requires_grad_() for i in range(4)]
    opt_whole = A.NorMuon([whole], block_rows=16)
    opt_parts = A.NorMuon(parts)
    for _ in range(3):
        grad = torch.randn(64, 32, dtype=torch.float64)
        whole.grad = grad.clone()
        for i, q in enumerate(parts):
            q.grad = grad[i * 16:(i + 1) * 16].clone()
        opt_whole.step()
        opt_parts.step()
    torch.testing.assert_close(whole.detach(), torch.cat([q.detach() for q in parts]), rtol=0, atol=1e-12)
    # and it differs from orthogonalizing the whole 64 x 32 matrix at once
    one = w.clone().requires_grad_()
    opt_one = A.NorMuon([one])
    one.grad = grad.clone()
    opt_one.step()
    assert (one.detach() - whole.detach()).abs().max() > 1e-3


def test_lr_multiplier_scales_the_step_exactly():
    torch.manual_seed(0)
    w, grad = torch.randn(48, 16, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64)
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt = A.NorMuon([dict(params=[a]), dict(params=[b], lr_mul=2.0)], weight_decay=0.0, ns_dtype=torch.float64)
    a.grad, b.grad = grad.clone(), grad.clone()
    opt.step()
    torch.testing.assert_close(b.detach() - w, 2 * (a.detach() - w), rtol=1e-12, atol=1e-14)
    # tall 48 x 16: the first step's update has Frobenius norm lr * sqrt(3) * |polar|_F = lr * sqrt(3) * 4
    assert abs((a.detach() - w).norm().item() / (0.023 * math.sqrt(3) * 4) - 1) < 0.2  # Polar Express ~ polar


def test_normuon_with_polar_express_is_near_the_exact_step():
    torch.manual_seed(0)
    shape = (96, 24)
    p = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    ref = NorMuonReference(p.detach())
    opt = A.NorMuon([p], ns_dtype=torch.float32)  # production Newton-Schulz on a CPU
    for _ in range(3):
        grad = torch.randn(*shape, dtype=torch.float64)
        p.grad = grad.clone()
        w0 = p.detach().clone()
        opt.step()
        r0 = ref.w.clone()
        ref.step(grad, 0.023, 1.2, 0.95, 0.9)
        du, dr = p.detach() - w0, ref.w - r0
        assert (du - dr).norm() / dr.norm() < 0.12


@pytest.mark.parametrize("kw, match", [(dict(block_rows=5), "block_rows=5"), (dict(block_rows=0), "block_rows"),
                                       (dict(beta2=1.0), "beta2"), (dict(lr_mul=-1.0), "lr_mul"),
                                       (dict(momentum=1.0), "momentum")])
def test_normuon_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        A.NorMuon([dict(params=[torch.randn(32, 8, requires_grad=True)], names=["blocks.0.attn.q.weight"], **kw)])


def test_normuon_names_the_matrix_with_bad_block_rows():
    with pytest.raises(ValueError, match="blocks.0.attn.q.weight"):
        A.NorMuon([dict(params=[torch.randn(30, 8, requires_grad=True)], names=["blocks.0.attn.q.weight"],
                        block_rows=8)])


def test_normuon_warm_step_changes_nothing():
    p = torch.randn(32, 8, requires_grad=True)
    w = p.detach().clone()
    opt = A.NorMuon([dict(params=[p], block_rows=16)])
    A.warm_step(opt)
    assert torch.equal(p.detach(), w) and not opt.state


# ---------------------------------------------------------------------------------------------
# Adam every other step with cautious decay


def adam_reference(ws, grads_per_step, groups, every, eps=1e-10):
    """Float64 Adam updating on every ``every``-th step with the summed grads; cautious decay lr^2 wd."""
    ws = [w.clone() for w in ws]
    m = [torch.zeros_like(w) for w in ws]
    v = [torch.zeros_like(w) for w in ws]
    acc = [torch.zeros_like(w) for w in ws]
    t = 0
    history = []
    for call, grads in enumerate(grads_per_step):
        acc = [a + g for a, g in zip(acc, grads)]
        if (call + 1) % every == 0:
            t += 1
            for i, (lr, (b1, b2), wd) in enumerate(groups):
                g = acc[i]
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[i] / (v[i].sqrt() + eps)
                ws[i] = cautious_reference(ws[i], u, 1.0, lr * lr * wd, strict=True)
            acc = [torch.zeros_like(w) for w in ws]
        history.append([w.clone() for w in ws])
    return history


@pytest.mark.parametrize("every", [1, 2, 3])
def test_cautious_adam_matches_float64_reference(every):
    torch.manual_seed(0)
    shapes = [(6, 5), (7,)]
    settings = [(0.05, (0.5, 0.95), 0.75), (0.3, (0.9, 0.99), 0.0)]  # lr, betas, wd (times wd_mul)
    ws = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    params = [w.clone().requires_grad_() for w in ws]
    groups = [dict(params=[p], lr=lr, betas=b, weight_decay=wd) for p, (lr, b, wd) in zip(params, settings)]
    opt = A.CautiousAdam(groups, every=every)
    grads_per_step = [[torch.randn(*s, dtype=torch.float64) for s in shapes] for _ in range(7)]
    history = adam_reference(ws, grads_per_step, settings, every)
    for call, grads in enumerate(grads_per_step):
        assert opt.updates_next == ((call + 1) % every == 0)
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()  # the loop zeroes its grads every step: fresh grads each call
        opt.step()
        for p, w in zip(params, history[call]):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
        if (call + 1) % every:  # not an update step: bit-identical weights
            assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_cautious_adam_decays_only_where_update_and_weight_agree():
    p = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    opt = A.CautiousAdam([p], lr=0.1, weight_decay=2.0, every=1)
    p.grad = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    opt.step()  # first step: u = lr * sign(g) (up to eps)
    expected = torch.tensor([1 - 0.1 - 0.02, 1 + 0.1, -1 - 0.1, -1 + 0.1 + 0.02], dtype=torch.float64)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-9)


def test_cautious_adam_resumes_mid_accumulation():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) for _ in range(6)]

    def run(split):
        p = torch.ones(5, 3, requires_grad=True)
        opt = A.CautiousAdam([p], lr=0.01, every=2)
        for i, g in enumerate(grads):
            if i == split:  # a new optimizer from the saved state, as a resumed run
                saved = opt.state_dict()
                opt = A.CautiousAdam([p], lr=0.01, every=2)
                opt.load_state_dict(saved)
            p.grad = g.clone()
            opt.step()
        return p.detach()

    assert torch.equal(run(split=3), run(split=None))  # call 3 follows an accumulating call


@pytest.mark.parametrize("kw, match", [(dict(every=0), "every"), (dict(lr=-1.0), "lr"),
                                       (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=0.0), "eps")])
def test_cautious_adam_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        A.CautiousAdam([torch.randn(3, requires_grad=True)], **kw)


# ---------------------------------------------------------------------------------------------
# 2 processes == 1 process


def test_two_processes_match_one(tmp_path):
    worker = os.path.join(REPO, "tests", "dist_normuon_worker.py")
    single, multi = tmp_path / "single.pt", tmp_path / "multi.pt"
    subprocess.run([sys.executable, worker, str(single)], check=True, env=subprocess_env(), timeout=300)
    run_torchrun([worker, str(multi)], subprocess_env(), timeout=300)
    a, b = torch.load(single), torch.load(multi)
    assert a["world"] == 1 and b["world"] == 2
    for wa, wb in zip(a["weights"], b["weights"]):
        torch.testing.assert_close(wb, wa, rtol=0, atol=1e-6)
    # blocks per shape: 4 head-pair blocks of (8, 32) from q and k, 2 x (32, 32), 1 x (64, 32), 1 x (32, 64)
    assert b["shares"] == {0: [4, 1, 1, 1] * 3, 1: [4, 1, 1, 1] * 3}
    assert a["shares"] == {0: [8, 2, 1, 1] * 3}
    for saved in (a, b):  # 1 process and 2: as the per-matrix step of e6fff65 (issue 44's batching changes no bit)
        R.assert_equals_the_per_matrix_reference(saved)


# ---------------------------------------------------------------------------------------------
# the groups of the record's parameter roles (record #89)


def test_matrix_groups_give_modded_nanogpts_lr_factors_and_blocks():
    d, hidden, head_dim = 32, 128, 4
    mats = {n: torch.randn(*s, requires_grad=True) for n, s in
            [("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("fc", (hidden, d)), ("proj", (d, hidden))]}
    for aurora in (False, True):
        groups = A.matrix_groups([("q", mats["q"]), ("k", mats["k"])], [("v", mats["v"]), ("o", mats["o"])],
                                 [("fc", mats["fc"])], [("proj", mats["proj"])], head_dim, aurora=aurora)
        opt = A.NorMuon(groups, pp_iterations=2)  # a stray default must not turn Aurora on for attention
        total = {}  # total lr factor: lr_mul * sqrt(max(1, rows/cols)) of the block, as modded-nanogpt's table
        for g, by_shape in zip(opt.param_groups, opt._by_shape):
            for (rows, cols), index in by_shape.items():
                for i in index:
                    total[g["names"][i]] = (g["lr_mul"] * math.sqrt(max(1, rows / cols)), rows, g["pp_iterations"])
        assert {n: round(t[0], 12) for n, t in total.items()} == dict(q=1, k=1, v=1, o=1, fc=2, proj=4)
        assert total["q"][1] == total["k"][1] == 2 * head_dim and total["v"][1] == d
        K = 2 if aurora else 0
        assert [total[n][2] for n in ("q", "k", "v", "o", "fc", "proj")] == [0, 0, 0, 0, K, K]


def test_adam_groups():
    e, s = torch.randn(10, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    groups = A.adam_groups({"embed": [e], "scalars": [s], "smear_gate": []})
    assert [(g["role"], g["betas"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("embed", (0.5, 0.95), 0.008, 0.005 * 150), ("scalars", (0.9, 0.99), 0.008 * 5, 0.0)]
    A.CautiousAdam(groups)  # accepted as they are
    with pytest.raises(ValueError, match="unknown Adam role 'gates'"):
        A.adam_groups({"gates": [s]})


def test_compiled_normuon_matches_eager():
    torch.manual_seed(0)
    shapes = [(32, 16), (16, 32)]
    eager = [torch.randn(*s, requires_grad=True) for s in shapes]
    compiled = [p.detach().clone().requires_grad_() for p in eager]
    opts = [A.NorMuon([dict(params=eager[:1], block_rows=8), dict(params=eager[1:], lr_mul=2.0)]),
            A.NorMuon([dict(params=compiled[:1], block_rows=8), dict(params=compiled[1:], lr_mul=2.0)], compile=True)]
    for step in range(3):
        grads = [torch.randn(*s) for s in shapes]
        for params, opt in zip((eager, compiled), opts):
            for group in opt.param_groups:
                group["lr"] = 0.023 * (1 - 0.2 * step)  # a new lr each step: no recompile needed
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


def test_compiled_cautious_adam_matches_eager():
    torch.manual_seed(0)
    eager = [torch.randn(6, 5, requires_grad=True), torch.randn(7, requires_grad=True)]
    compiled = [p.detach().clone().requires_grad_() for p in eager]
    opts = [A.CautiousAdam(eager, lr=0.05, weight_decay=0.5), A.CautiousAdam(compiled, lr=0.05, weight_decay=0.5,
                                                                               compile=True)]
    for step in range(4):
        grads = [torch.randn_like(p) for p in eager]
        for params, opt in zip((eager, compiled), opts):
            opt.param_groups[0]["lr"] = 0.05 * (1 - 0.2 * step)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


def test_cautious_adam_resume_keeps_the_float32_state_of_bf16_parameters():
    """--adam-bf16: torch's load_state_dict casts state to the parameter's dtype; the moments must stay float32."""
    p = torch.randn(4, 3).bfloat16().requires_grad_()
    opt = A.CautiousAdam([p], every=2)
    for _ in range(3):
        p.grad = torch.randn(4, 3).bfloat16()
        opt.step()
    saved = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    resumed = A.CautiousAdam([p], every=2)
    resumed.load_state_dict(opt.state_dict())
    assert set(saved) == {"grad_sum", "exp_avg", "exp_avg_sq"}
    for key, value in saved.items():
        assert resumed.state[p][key].dtype == torch.float32 and torch.equal(resumed.state[p][key], value), key
