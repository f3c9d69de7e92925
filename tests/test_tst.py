"""Token-Superposition Training against slow float64 references (docs/METHODS.md §1)."""
import dataclasses
import math
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import harness
import kernels
import train_gpt as T
from conftest import SPECS, loss_lines, read_log, tiny_args
from model_reference import TINY, config, random_tokens

V = 50304

# ---------------------------------------------------------------------------------------------
# batches


def test_make_tst_batch_hand_example():
    tokens = torch.arange(24).view(2, 12)  # L = 3 latent positions, s = 3, plus the next bag
    bags, targets = T.make_tst_batch(tokens, 3)
    assert bags.shape == targets.shape == (2, 3, 3)
    assert bags[0].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert targets[0].tolist() == [[3, 4, 5], [6, 7, 8], [9, 10, 11]]  # last position: the extra bag
    assert targets[1, 2].tolist() == [21, 22, 23]
    with pytest.raises(ValueError):
        T.make_tst_batch(torch.arange(10).view(1, 10), 3)


@pytest.mark.parametrize("mode", ["full", "input", "output"])
@pytest.mark.parametrize("s", [1, 2, 5])
def test_make_batch_matches_loop_reference(mode, s):
    L, B = 7, 3
    seq_tokens, advance = T.sequence_layout(mode, s, L)
    tokens = torch.randint(0, 50257, (B, seq_tokens))
    inputs, targets = T.make_batch(tokens, mode, s)
    for b in range(B):
        for i in range(L):
            if s == 1:
                want_in, want_out = [tokens[b, i]], [tokens[b, i + 1]]
            elif mode == "full":
                want_in, want_out = tokens[b, i * s:(i + 1) * s], tokens[b, (i + 1) * s:(i + 2) * s]
            elif mode == "input":
                want_in, want_out = tokens[b, i * s:(i + 1) * s], [tokens[b, (i + 1) * s]]
            else:
                want_in, want_out = [tokens[b, i]], tokens[b, i + 1:i + 1 + s]
            assert inputs[b, i].tolist() == [int(t) for t in want_in]
            assert targets[b, i].tolist() == [int(t) for t in want_out]
    # every raw token is an input exactly once per sequence advance
    assert advance == (L * s if (mode in ("full", "input") and s > 1) else L)


# ---------------------------------------------------------------------------------------------
# MCE loss and its gradient


def mce_reference(logits, targets):
    """Slow float64 MCE: mean over valid (position, label) pairs of logsumexp(z) - z[y], by loops."""
    z = logits.double()
    total, count = 0.0, 0
    flat_z, flat_y = z.reshape(-1, z.size(-1)), targets.reshape(-1, targets.size(-1))
    for i in range(flat_z.size(0)):
        lse = torch.logsumexp(flat_z[i], 0)
        for y in flat_y[i].tolist():
            if y != -100:
                total = total + (lse - flat_z[i, y])
                count += 1
    return total / max(count, 1)


def random_targets(shape, vocab, repeat=True, ignore_frac=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=g)
    if repeat:  # repeated ids inside a bag count each time
        t[..., 1] = t[..., 0]
    t[torch.rand(shape, generator=g) < ignore_frac] = -100
    return t


@pytest.mark.parametrize("s", [1, 3, 8])
def test_mce_loss_and_gradient_match_float64_loop(s):
    torch.manual_seed(s)
    logits = (3 * torch.randn(2, 5, 97)).requires_grad_()
    targets = random_targets((2, 5, s), 97, repeat=s > 1, seed=s)
    targets[0, 0] = -100  # a position with no valid label at all
    ref_logits = logits.detach().double().requires_grad_()
    ref = mce_reference(ref_logits, targets)
    ref.backward()
    loss = kernels.mce_loss(logits, targets)
    loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-8)
    total = kernels.mce_loss(logits.detach(), targets, reduction="sum")
    assert total.item() == pytest.approx(ref.item() * (targets != -100).sum().item(), rel=1e-6)


@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("softcap", [2.0, 15.0])
def test_softcapped_mce_matches_float64_autograd_of_the_capped_logits(s, softcap):
    # the cap lives inside the fused loss: value and gradient = autograd through c * tanh(x / c)
    torch.manual_seed(10 + s)
    logits = (8 * torch.randn(3, 4, 61)).requires_grad_()  # big enough that the cap bends them
    targets = random_targets((3, 4, s), 61, repeat=s > 1, seed=s)
    targets[1, 2] = -100
    ref_logits = logits.detach().double().requires_grad_()
    ref = mce_reference(softcap * torch.tanh(ref_logits / softcap), targets)
    ref.backward()
    loss = kernels.mce_loss(logits, targets, softcap=softcap)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-8)
    exact = logits.detach().double().requires_grad_()
    kernels.mce_loss(exact, targets, reduction="sum", softcap=softcap).backward()  # float64 in, float64 math
    ref_sum = mce_reference(softcap * torch.tanh(exact.detach() / softcap), targets) * (targets != -100).sum()
    assert kernels.mce_loss(exact.detach(), targets, reduction="sum", softcap=softcap).item() == pytest.approx(
        ref_sum.item(), rel=1e-12)
    torch.testing.assert_close(exact.grad, ref_logits.grad * (targets != -100).sum(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "15"])
def test_mce_loss_refuses_a_bad_softcap(bad):
    with pytest.raises(ValueError, match="softcap"):
        kernels.mce_loss(torch.randn(2, 5), torch.zeros(2, 1, dtype=torch.int64), softcap=bad)


def test_mce_gradient_is_softmax_minus_mean_onehot_for_full_bags():
    s = 4
    logits = torch.randn(6, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (6, s))
    targets[0] = torch.tensor([7, 7, 7, 3])  # repeated token: weight 3/s
    kernels.mce_loss(logits, targets, reduction="sum").backward()
    onehot = torch.zeros(6, 50, dtype=torch.float64)
    for i in range(6):
        for y in targets[i].tolist():
            onehot[i, y] += 1.0 / s
    expected = s * (torch.softmax(logits.detach(), -1) - onehot)  # sum reduction: s pairs per position
    torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12)


def test_mce_with_one_label_is_cross_entropy():
    logits = torch.randn(64, 300)
    targets = torch.randint(0, 300, (64,))
    targets[::5] = -100
    assert kernels.mce_loss(logits, targets[:, None]).item() == pytest.approx(
        F.cross_entropy(logits, targets, ignore_index=-100).item(), rel=1e-6)


def test_ignored_labels_add_nothing():
    logits = torch.randn(4, 30, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (4, 3))
    padded = torch.cat([targets, torch.full((4, 2), -100)], dim=1)  # no stray lse/s terms
    assert kernels.mce_loss(logits, padded).item() == pytest.approx(kernels.mce_loss(logits, targets).item(), rel=1e-12)
    kernels.mce_loss(logits, padded, reduction="sum").backward()
    g1 = logits.grad.clone()
    logits.grad = None
    kernels.mce_loss(logits, targets, reduction="sum").backward()
    torch.testing.assert_close(g1, logits.grad)


# ---------------------------------------------------------------------------------------------
# the whole model on bags: tests/test_model.py's float64 reference (test_tst_bags_equal_reference)
# normalization across micro-batches


def model_in(dtype, cfg, seed=0):
    """The tiny model with every weight off its init, in ``dtype`` (float64 RoPE tables for a float64 one)."""
    torch.manual_seed(seed)
    model = T.build_model(cfg, TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = model.to(dtype)
    model.set_window((12, 5), ())
    model.rotary.set_history(())
    return model


@pytest.mark.parametrize("mode", ["full", "output"])
def test_step_gradient_is_the_same_for_1_2_4_micro_batches_with_uneven_labels(mode):
    """The step's loss is the mean over all its valid labels (not a mean of micro-batch means), its gradient that of
    the label sum over the step's divisor, whatever the split: float64 to 1e-10; float32 near it."""
    s, divisor = 4, 8 * 4
    cfg = config(TINY, seq_len=6)
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    tokens = torch.randint(0, 300, (8, seq_tokens), generator=torch.Generator().manual_seed(0))
    inputs, targets = T.make_batch(tokens, mode, s)
    targets = targets.clone()
    targets[:2][torch.rand(2, cfg.seq_len, s, generator=torch.Generator().manual_seed(1)) < 0.7] = -100
    targets[5, 3:] = -100  # the first micro-batches lose most labels
    rt = harness.Runtime(0, 1, torch.device("cpu"), False)

    def grads(model, n_micro):
        model.zero_grad(set_to_none=True)
        chunks = list(zip(inputs.chunk(n_micro), targets.chunk(n_micro)))
        loss = T.accumulate_gradients(model, chunks, rt, None, divisor)
        return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])

    model = model_in(torch.float64, cfg)
    model(inputs, targets).div(divisor).backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    with torch.no_grad():
        ref_loss = model(inputs, targets).item() / (targets != -100).sum().item()
        per_micro_mean = sum(model(i, t).item() / (t != -100).sum().item()
                             for i, t in zip(inputs.chunk(4), targets.chunk(4))) / 4
    assert abs(per_micro_mean - ref_loss) > 1e-3  # the uneven split really matters
    for n_micro in (1, 2, 4):
        loss, g = grads(model, n_micro)
        assert loss == pytest.approx(ref_loss, rel=1e-6)  # summed in float32
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-14)
    loss, g = grads(model_in(torch.float32, cfg), 2)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    # float32 rounding through the 4 layers: measured 5e-5 of the largest gradient (the head's, 0.17)
    assert (g - ref).abs().max() < 3e-4 * ref.abs().max()


# ---------------------------------------------------------------------------------------------
# the phases and the switch


def test_phase_1_covers_the_first_round_r_n_steps_and_splits_the_stage_it_ends_in():
    cfg = config(TINY, num_iterations=10, extension_steps=1, tst_frac=0.4, tst_bag_size=3, tst_mode="output")
    assert T.tst_switch_step(cfg) == 4
    table = T.Schedule(cfg, TINY)
    assert [table[i].stage.phase for i in range(11)] == [1] * 4 + [2] * 7  # row N: the final validation's
    rows = [(st.start, st.end, st.phase, st.bag_size, st.mode) for st in table.stages]
    assert rows == [(0, 3, 1, 3, "output"), (3, 4, 1, 3, "output"), (4, 6, 2, 1, "full"), (6, 9, 2, 1, "full"),
                    (9, 10, 2, 1, "full")]
    split = table.stages[1:3]  # recipe stage 2, split at the switch: its columns and ramp kept
    assert split[0].ramp == split[1].ramp == (3, 6) and split[0].blocks == split[1].blocks
    assert T.tst_switch_step(dataclasses.replace(cfg, tst_frac=0.0)) == 0
    assert T.tst_switch_step(dataclasses.replace(cfg, num_iterations=3000)) == 1200


# ---------------------------------------------------------------------------------------------
# runs: 4 steps of the tiny model, TST phase 1 over steps [0, 2), val at 0, 2 and 4 (a compiled run with TST:
# tests/test_gpu_check.py's cpu_smoke run, no graph compiled during training)


def short_run(root, *extra):
    """``T.main`` of a 4-step tiny run (one step per recipe stage and the extension), TST to step 2; its log."""
    assert T.main(tiny_args(root, "--num-iterations", "4", "--val-every", "2", "--val-tokens", "256", "--tst-frac", "0.5",
                            *extra), models=SPECS) == 0
    return read_log(root / "logs")


def test_phase1_val_lines_also_report_the_tst_objective(tmp_path):
    """A run with bags of 1: phase 1's val lines add the TST objective's val loss, here the metric itself."""
    text = short_run(tmp_path, "--tst-bag-size", "1")
    val = [line for line in text.splitlines() if " val_loss:" in line]
    assert [line.split()[0] for line in val] == ["step:0/4", "step:2/4", "step:4/4"]
    assert "val_loss_tst:" in val[0] and "val_loss_tst:" in val[1] and "val_loss_tst:" not in val[2]
    assert "phase:1" in val[1] and "phase:2" in val[2] and "tst_switch: step 2" in text
    for line in val[:2]:
        assert line.split("val_loss:")[1].split()[0] == line.split("val_loss_tst:")[1].split()[0], line
    for line in text.splitlines():  # accounting on every step line
        if line.startswith("step:"):
            assert "phase:" in line and "tokens:" in line, line
            assert "flops:" in line or "lr_scale:" in line, line


def test_bags_of_one_are_next_token_training_in_every_mode():
    """With s = 1 every mode reads, batches, divides and validates as next-token training (so a run repeats)."""
    cfg = config(TINY, seq_len=8, val_tokens=40, tst_bag_size=1)
    tokens = random_tokens((3, 9), seed=2, p_eot=0.1)
    val = T.ValData(types.SimpleNamespace(total=64, read=lambda start, n: np.arange(start, start + n) % 50),
                    cfg.val_tokens)
    rt = harness.Runtime(0, 1, torch.device("cpu"), False)
    want = None
    for mode in ("full", "input", "output"):
        stage = dataclasses.replace(T.stages(cfg)[0], phase=1, bag_size=1, mode=mode)
        got = (T.sequence_layout(mode, 1, 8), [t.tolist() for t in T.make_batch(tokens, mode, 1)],
               T.grad_divisor(stage), [[t.tolist() for t in b] for b in val.batches(mode, 1, 8, 2, rt)])
        assert got[3] and (want is None or got == want), mode
        want = got


@pytest.mark.parametrize("mode", ["input", "output"])
def test_ablation_modes_run_to_completion(tmp_path, mode):
    text = short_run(tmp_path, "--tst-mode", mode)
    losses = loss_lines(text)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses.values())
    assert "tst_switch: step 2: phase 1 -> 2 (bag_size 4 -> 1, mode " + mode in text
    assert text.splitlines()[-1] == "status:complete"
