"""The fused multi-target loss (caps, weights, chunks), multi-token and prefix-token targets.

References are slow and plain: float64 sums of ``F.cross_entropy`` terms on capped logits, one
(position, label) at a time, with autograd through them; loops over positions for the targets;
a scan of the whole vocabulary for the prefix table.
"""
import math
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import harness
import kernels
import train_gpt as T
from conftest import REPO

SIGMOID = lambda x: 23 * torch.sigmoid((x + 5) / 7.5)  # noqa: E731  record #54's cap, as its README writes it


def capped(x, cap, c):
    if cap == "tanh":
        return c * torch.tanh(x / c)
    return SIGMOID(x) if cap == "sigmoid" else x


def naive_loss(x, targets, weights, cap, c):
    """sum_{n, j valid} w_j * CE(cap(x_n), y_nj), one cross-entropy term at a time (-100, PAST_END: no term)."""
    z = capped(x, cap, c)
    total = torch.zeros((), dtype=x.dtype)
    for n in range(targets.size(0)):
        for j in range(targets.size(1)):
            if targets[n, j] >= 0:
                total = total + weights[j] * F.cross_entropy(z[n:n + 1], targets[n, j:j + 1])
    return total


def random_case(N, V, J, seed):
    """float64 logits wide enough that the caps bend them, targets with ignored and repeated labels."""
    g = torch.Generator().manual_seed(seed)
    x = 6 * torch.randn(N, V, dtype=torch.float64, generator=g)
    y = torch.randint(0, V, (N, J), generator=g)
    y[torch.rand(N, J, generator=g) < 0.2] = -100
    if J > 1:
        y[1, 1] = y[1, 0] = 3          # a repeated label
        y[2, :] = -100                 # a position with no label
    w = torch.rand(J, dtype=torch.float64, generator=g) + 0.1
    if J > 2:
        w[2] = 0.0                      # a column turned off
    return x, y, w


@pytest.mark.parametrize("cap,c", [("none", 0.0), ("tanh", 5.0), ("sigmoid", 0.0)])
@pytest.mark.parametrize("J", [1, 3, 4])
@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
def test_fused_loss_and_gradient_match_a_float64_sum_of_cross_entropies(cap, c, J, chunk):
    x, y, w = random_case(13, 17, J, seed=J * 7 + chunk)
    scale = 0.37  # an incoming gradient other than 1
    xa = x.clone().requires_grad_()
    loss = kernels.multi_target_loss(xa, y, w, cap=cap, softcap=c, chunk=chunk)
    (loss * scale).backward()
    xr = x.clone().requires_grad_()
    ref = naive_loss(xr, y, w, cap, c)
    (ref * scale).backward()
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-10, atol=1e-13)


def test_leading_dims_are_flattened_and_a_batch_without_labels_costs_nothing():
    x, y, w = random_case(12, 9, 3, seed=1)
    flat = kernels.multi_target_loss(x, y, w, cap="sigmoid")
    assert kernels.multi_target_loss(x.view(3, 4, 9), y.view(3, 4, 3), w, cap="sigmoid").item() == flat.item()
    xa = x.clone().requires_grad_()
    none = kernels.multi_target_loss(xa, torch.full_like(y, -100), w, cap="sigmoid")
    none.backward()
    assert none.item() == 0.0 and xa.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_weights_of_one_are_todays_mce_sum(softcap):
    """TST's MCE: J = s targets of weight 1 (or 1/s, the sum divided by s), same sum and gradient."""
    torch.manual_seed(0)
    s, N, V = 4, 37, 301
    x = 8 * torch.randn(N, V)
    y = torch.randint(0, V, (N, s))
    y[-1, 2:] = -100
    y[0, 1] = y[0, 3]
    cap = "tanh" if softcap else "none"
    for w, factor in ((torch.ones(s), 1.0), (torch.full((s,), 1.0 / s), s)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        new = kernels.multi_target_loss(a, y, w, cap=cap, softcap=softcap, chunk=8) * factor
        old = kernels.mce_loss(b, y, reduction="sum", softcap=softcap)
        new.backward()
        old.backward()
        assert new.item() == pytest.approx(old.item(), rel=1e-6)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_bf16_logits_get_a_bf16_gradient_close_to_the_float64_one():
    x, y, w = random_case(40, 257, 4, seed=3)
    xb = x.bfloat16().requires_grad_()
    loss = kernels.multi_target_loss(xb, y, w.float(), cap="sigmoid", chunk=16)
    loss.backward()
    exact = x.bfloat16().double().requires_grad_()  # the same bf16 values, in float64
    ref = naive_loss(exact, y, w, "sigmoid", 0.0)
    ref.backward()
    assert loss.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xb.grad.double(), exact.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("kw", [dict(cap="soft"), dict(cap="tanh", softcap=0.0), dict(cap="tanh", softcap=float("inf")),
                                dict(chunk=0), dict(weights=torch.ones(2))])
def test_bad_arguments_are_one_clear_error(kw):
    args = dict(logits=torch.randn(4, 6), targets=torch.zeros(4, 3, dtype=torch.int64), weights=torch.ones(3),
                cap="none")
    args.update(kw)
    with pytest.raises(ValueError, match="cap|softcap|chunk|weights"):
        kernels.multi_target_loss(**args)


class OutputLog(TorchDispatchMode):
    """Records (op, shape, dtype, allocates) of every tensor an op returns (views and in-place ops do not allocate)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                allocates = not (func.is_view or func._schema.is_mutable)
                self.outputs.append((str(func), tuple(t.shape), t.dtype, allocates))
        return out


def test_no_float32_n_by_v_tensor_at_the_record_shape():
    """N = 49,152 positions, V = 50,304, bf16 logits, 4 weighted targets: traced with fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    N, V = 49152, 50304
    with FakeTensorMode():
        logits = torch.empty(N, V, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(N, 4, dtype=torch.int64)
        weights = torch.ones(4)
        with OutputLog() as log:
            kernels.multi_target_loss(logits, targets, weights, cap="sigmoid").backward()
        grad = logits.grad
    assert grad.dtype == torch.bfloat16 and tuple(grad.shape) == (N, V)
    numel = lambda shape: torch.Size(shape).numel()  # noqa: E731
    wide = [o for o in log.outputs if o[2] in (torch.float32, torch.float64)]
    assert max(numel(o[1]) for o in wide) == kernels.LOSS_CHUNK * V      # chunk temporaries only
    full = [o for o in log.outputs if numel(o[1]) >= N * V]
    assert {o[2] for o in full} == {torch.bfloat16}
    assert [o[0] for o in full if o[3]] == ["aten.empty_like.default"]   # the one gradient buffer


def test_the_loss_compiles_into_one_graph_with_the_eager_results():
    x, y, w = random_case(11, 23, 4, seed=5)
    x = x.float()
    fn = lambda x, y, w: kernels.multi_target_loss(x, y, w, cap="sigmoid", chunk=4)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager, comp = fn(a, y, w.float()), compiled(b, y, w.float())
    eager.backward()
    comp.backward()
    assert comp.item() == pytest.approx(eager.item(), rel=1e-6)
    torch.testing.assert_close(b.grad, a.grad)
    w2 = torch.rand(4)  # new weight values: the same graph
    torch.testing.assert_close(compiled(x, y, w2), fn(x, y, w2))


def past_end_case(N, V, seed):
    """``random_case`` (4 columns) with PAST_END labels in the last rows' later columns, as multi-token targets."""
    x, y, w = random_case(N, V, 4, seed)
    y[-1, 1:3] = y[-2, 2] = kernels.PAST_END
    return x, y, w


def past_end_reference(x, y, w, cap, c):
    """``(loss, gradient)``: the float64 loss of the valid labels; the gradient also carries each PAST_END
    column's ``w_j softmax(z_n) dz/dx`` (modded-nanogpt's softmax term), the autograd of ``w_j lse(z_n)``."""
    xr = x.detach().clone().requires_grad_()
    loss = naive_loss(xr, y, w, cap, c)
    past = (w * (y == kernels.PAST_END)).sum(1)                   # [N]
    (loss + (past * torch.logsumexp(capped(xr, cap, c), -1)).sum()).backward()
    return loss.detach(), xr.grad


CAPS = [("none", 0.0), ("tanh", 5.0), ("sigmoid", 0.0)]


@pytest.mark.parametrize("cap,c", CAPS)
def test_past_end_labels_keep_their_weight_in_the_softmax_term_only(cap, c):
    """Float64, 4 columns, a chunk that leaves a ragged tail (29 = 3 x 8 + 5 rows)."""
    x, y, w = past_end_case(29, 37, seed=11)
    xa = x.clone().requires_grad_()
    loss = kernels.multi_target_loss(xa, y, w, cap=cap, softcap=c, chunk=8)
    loss.backward()
    ref, grad = past_end_reference(x, y, w, cap, c)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(xa.grad, grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("cap,c", CAPS)
def test_the_compiled_loss_in_one_pass_matches_the_float64_reference(cap, c):
    """Compiled (decompositions and partitioner, run eagerly), the loss takes all rows in one pass whatever
    ``chunk``: float64 it is the reference's; bf16 logits get a bf16 gradient, within bf16 rounding of eager's."""
    x, y, w = past_end_case(29, 37, seed=12)
    torch._dynamo.reset()
    fn = lambda x, y, w: kernels.multi_target_loss(x, y, w, cap=cap, softcap=c, chunk=8)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
    xa = x.clone().requires_grad_()
    loss = compiled(xa, y, w)
    loss.backward()
    ref, grad = past_end_reference(x, y, w, cap, c)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(xa.grad, grad, rtol=1e-10, atol=1e-13)
    xb, xe = x.bfloat16().requires_grad_(), x.bfloat16().requires_grad_()
    got, want = compiled(xb, y, w.float()), fn(xe, y, w.float())
    got.backward()
    want.backward()
    assert got.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(xb.grad, xe.grad, rtol=8e-3, atol=1e-6)   # one bf16 rounding apart at most


def test_inductor_compiles_the_loss_to_the_float64_reference():
    """torch.compile's default backend (inductor's C++ kernels on the CPU), the record's cap, float64."""
    x, y, w = past_end_case(29, 37, seed=13)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y, w: kernels.multi_target_loss(x, y, w, cap="sigmoid"), fullgraph=True,
                             dynamic=False)
    xa = x.clone().requires_grad_()
    loss = compiled(xa, y, w)
    loss.backward()
    ref, grad = past_end_reference(x, y, w, "sigmoid", 0.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(xa.grad, grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("cap,c,scale", [("none", 0.0, 300.0), ("tanh", 40.0, 1e4), ("tanh", 50.0, 1e4),
                                         ("sigmoid", 0.0, 1e4)])
def test_float32_logsumexp_keeps_extreme_logits_finite(cap, c, scale):
    """A cap's bound shifts the logsumexp (tanh up to c = 40, sigmoid 23: every exp(z - b) >= exp(-80), a normal
    float32); a wider cap or none shifts by the row max. Logits of +-scale, a row of all -scale."""
    g = torch.Generator().manual_seed(7)
    x = scale * torch.randn(6, 50, dtype=torch.float64, generator=g)
    x[0] = -scale
    y = torch.randint(0, 50, (6, 2), generator=g)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    xa = x.float().requires_grad_()
    loss = kernels.multi_target_loss(xa, y, w.float(), cap=cap, softcap=c)
    loss.backward()
    ref, grad = past_end_reference(x.float().double(), y, w, cap, c)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(xa.grad.double(), grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Multi-token and prefix targets

@pytest.mark.parametrize("n_predict", [1, 2, 3, 4])
def test_multi_token_targets_match_a_loop(n_predict):
    g = torch.Generator().manual_seed(n_predict)
    targets = torch.randint(0, 50257, (3, 9), generator=g)
    targets[1, 4] = -100
    out = T.multi_token_targets(targets, n_predict)
    assert out.shape == (3, 9, n_predict) and out.dtype == torch.int64
    for b in range(3):
        for i in range(9):
            for k in range(n_predict):
                want = targets[b, i + k].item() if i + k < 9 else T.PAST_END
                assert out[b, i, k].item() == want


@pytest.fixture(scope="module")
def vocab():
    return harness.shard_format.gpt2_token_bytes()


@pytest.fixture(scope="module")
def table():
    return T.prefix_token_table(50304)


def test_token_bytes_are_tiktokens_gpt2_vocabulary(vocab):
    sys.path.insert(0, os.path.join(REPO, "data"))
    import tokenize_text
    ranks = tokenize_text.load_encoder()._mergeable_ranks
    assert len(vocab) == len(ranks) == 50256
    assert all(ranks[b] == i for i, b in vocab.items())


def test_prefix_table_matches_a_scan_of_the_vocabulary(vocab, table):
    ids = random.Random(0).sample(range(50256), 60) + [262, 31373, 50255]
    for i in ids:
        b = vocab[i]
        prefixes = [(len(p), j) for j, p in vocab.items() if len(p) < len(b) and b.startswith(p)]
        want = max(prefixes)[1] if prefixes else -100
        assert table[i].item() == want, (i, b)


def test_prefix_table_by_hand(vocab, table):
    ids = {b: i for i, b in vocab.items()}
    for token, prefix in [(b" the", b" th"), (b" th", b" t"), (b"hello", b"hell"), (b" Hello", b" Hell"),
                          (b"ing", b"in")]:
        assert table[ids[token]].item() == ids[prefix]
    assert table.shape == (50304,) and table.dtype == torch.int64
    singles = [i for i, b in vocab.items() if len(b) == 1]
    assert len(singles) == 256 and (table[singles] == -100).all()
    assert (table[50256:] == -100).all()                      # <|endoftext|> and the padding ids
    assert (table[:50256] >= 0).sum().item() == 50256 - 256   # every longer token starts with a byte token


def test_a_missing_encoder_json_is_one_clear_error(tmp_path):
    with pytest.raises(T.DataError, match="encoder.json.*restore"):
        T.prefix_token_table(50304, path=str(tmp_path / "encoder.json"))


def objective_weights(stage, progress, steps=100):
    """The weights of recipe stage ``stage`` (0-based) at ``progress`` in [0, 1] of it (``objective_at``)."""
    rows = T.OBJECTIVE_WEIGHTS[min(stage, len(T.OBJECTIVE_WEIGHTS) - 1)]
    st = T.Stage(0, steps, 2, 1, "full", 1024, 1024, 2048, 1.0, (1, 3), objective=rows, ramp=(0, steps))
    return list(T.objective_at(round(progress * steps), st))


def test_objective_weights_follow_the_stages():
    """Record #89's stage table (modded-nanogpt): MTP [1, .5, .25 -> 0], [1, .5 -> 0], [1]; prefix .25, .25 -> 0,
    0."""
    at = lambda stage, t: pytest.approx(objective_weights(stage, t))  # noqa: E731
    assert [1.0, 0.5, 0.25, 0.25] == at(0, 0.0)
    assert [1.0, 0.5, 0.125, 0.25] == at(0, 0.5)
    assert [1.0, 0.5, 0.0, 0.25] == at(0, 1.0)
    assert [1.0, 0.5, 0.0, 0.25] == at(1, 0.0)
    assert [1.0, 0.125, 0.0, 0.0625] == at(1, 0.75)
    assert [1.0, 0.0, 0.0, 0.0] == at(2, 0.3)
    assert [1.0, 0.0, 0.0, 0.0] == at(3, 0.9)   # the extension stage keeps the last row


def test_next_token_training_objective_matches_a_loop(table):
    """objective_targets + objective_weights: w_k CE(z_i, token i+1+k) + w_p CE(z_i, prefix(token i+1))."""
    g = torch.Generator().manual_seed(9)
    V, L = 50304, 10
    targets = torch.randint(0, 50257, (2, L), generator=g)
    targets[0, 3] = -100
    x = 4 * torch.randn(2, L, V, dtype=torch.float64, generator=g)
    w = torch.tensor(objective_weights(0, 0.4), dtype=torch.float64)
    cols = T.objective_targets(targets, table)
    assert cols.shape == (2, L, 4)
    loss = kernels.multi_target_loss(x, cols, w, cap="sigmoid")
    z, ref = SIGMOID(x), torch.zeros((), dtype=torch.float64)
    for b in range(2):
        for i in range(L):
            terms = [(w[k], targets[b, i + k]) for k in range(3) if i + k < L]
            terms.append((w[3], table[targets[b, i]] if targets[b, i] >= 0 else torch.tensor(-100)))
            for wk, y in terms:
                if y >= 0:
                    ref = ref + wk * F.cross_entropy(z[b, i:i + 1], y.view(1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


def test_multi_token_gradient_keeps_past_end_weights_in_the_softmax_term():
    """modded-nanogpt's kernel (record #53): loss terms only for targets inside the sequence, but the softmax term
    of the gradient weighs every column (S_w); an ignored label (no prefix) counts nowhere. Float64, sigmoid cap."""
    g = torch.Generator().manual_seed(2)
    L, V = 6, 40
    tokens = torch.randint(0, V, (1, L), generator=g)
    targets = T.multi_token_targets(tokens, 3)[0]                  # [L, 3], PAST_END in the last two rows
    prefix = torch.randint(0, V, (L, 1), generator=g)
    prefix[2] = kernels.IGNORE_INDEX
    targets = torch.cat((targets, prefix), 1)
    assert (targets == kernels.PAST_END).sum() == 3
    w = torch.tensor([1.0, 0.5, 0.25, 0.3], dtype=torch.float64)
    x = (3 * torch.randn(L, V, generator=g, dtype=torch.float64)).requires_grad_()
    loss = kernels.multi_target_loss(x, targets, w, cap="sigmoid")
    loss.backward()
    A, B, C = kernels.SIGMOID_CAP
    s = torch.sigmoid((x.detach() + B) / C)
    z, slope = A * s, A / C * s * (1 - s)
    ref_loss, ref_grad = 0.0, torch.zeros(L, V, dtype=torch.float64)
    for n in range(L):
        p = torch.softmax(z[n], 0)
        soft = sum(float(w[j]) for j in range(4) if targets[n, j] >= 0 or targets[n, j] == kernels.PAST_END)
        ref_grad[n] = soft * p
        for j in range(4):
            y = int(targets[n, j])
            if y >= 0:
                ref_loss += float(w[j]) * float(torch.logsumexp(z[n], 0) - z[n, y])
                ref_grad[n, y] -= float(w[j])
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(x.grad, ref_grad * slope, rtol=1e-10, atol=1e-12)


def test_train_gpt_loss_sum_is_the_sigmoid_capped_multi_target_loss():
    """``loss_sum``: the model's loss, under record #54's cap, each column weighted 1 unless weights are given."""
    x, y, w = random_case(13, 17, 3, seed=11)
    ones = torch.ones(3, dtype=torch.float64)
    assert T.loss_sum(x, y).item() == pytest.approx(naive_loss(x, y, ones, "sigmoid", 0.0).item(), rel=1e-12)
    assert T.loss_sum(x, y, w).item() == pytest.approx(naive_loss(x, y, w, "sigmoid", 0.0).item(), rel=1e-12)
