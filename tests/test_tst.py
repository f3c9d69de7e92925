"""Token-Superposition Training against slow float64 references (docs/METHODS.md §1)."""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
import train_gpt as T
from conftest import PLAIN_ARCHITECTURE, SMALL_FLAGS, loss_lines, read_log, tiny_args

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
# whole model: loss and gradient w.r.t. the embeddings, float32 vs a float64 loop reference


def tiny_cfg(**kw):
    cfg, _ = T.parse_config([*SMALL_FLAGS, "--n-layer", "2", "--model-dim", "32", "--n-head", "2",
                             "--seq-len", "6", "--batch-tokens", "48"])
    return dataclasses.replace(cfg, **{**PLAIN_ARCHITECTURE, **kw})


def randomized_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = T.GPT(cfg)
    with torch.no_grad():  # non-zero output layers so every path carries gradient
        model.lm_head.weight.normal_(0, 0.05)
        for block in model.blocks:
            block.attn.proj.weight.normal_(0, 0.05)
            block.mlp.proj.weight.normal_(0, 0.05)
    return model


def reference_loss(model, tokens, mode, s):
    """float64 loop version of embedding (bag mean) -> Transformer -> MCE over the phase's labels."""
    B, L = tokens.size(0), model.cfg.seq_len
    E = model.embed.weight
    rows, labels = [], []
    for b in range(B):
        for i in range(L):
            if mode in ("full", "input") and s > 1:
                bag = tokens[b, i * s:(i + 1) * s]
                x = sum(E[t] for t in bag.tolist()) / s
                nxt = tokens[b, (i + 1) * s:(i + 2) * s].tolist()
                labels.append(nxt[:1] if mode == "input" else nxt)
            else:
                x = E[tokens[b, i]]
                labels.append(tokens[b, i + 1:i + 1 + s].tolist())
            rows.append(x)
    x = T.rms_norm(torch.stack(rows).view(B, L, -1))
    for block in model.blocks:
        x = block(x)
    z = model.lm_head(T.rms_norm(x))
    c = model.cfg.logit_softcap
    z = c * torch.tanh(z / c)
    return mce_reference(z, torch.tensor(labels).view(B, L, -1))


@pytest.mark.parametrize("mode", ["full", "input", "output"])
def test_model_loss_and_embedding_gradient_match_float64_reference(mode):
    s = 3
    cfg = tiny_cfg(tst_mode=mode, tst_bag_size=s)
    model = randomized_model(cfg)
    ref_model = randomized_model(cfg).double()
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    tokens = torch.randint(0, 200, (2, seq_tokens))
    tokens[0, :3] = 5  # repeated token inside a bag
    inputs, targets = T.make_batch(tokens, mode, s)
    loss = model(inputs, targets) / targets.numel()
    loss.backward()
    ref = reference_loss(ref_model, tokens, mode, s)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    g, g_ref = model.embed.weight.grad, ref_model.embed.weight.grad
    assert g_ref.abs().max() > 0
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# normalization across micro-batches


@pytest.mark.parametrize("mode", ["full", "output"])
def test_step_gradient_is_the_same_for_1_2_4_micro_batches_with_uneven_labels(mode):
    s = 4
    cfg = tiny_cfg(tst_mode=mode, tst_bag_size=s)
    seq_tokens, _ = T.sequence_layout(mode, s, cfg.seq_len)
    tokens = torch.randint(0, 300, (8, seq_tokens))
    inputs, targets = T.make_batch(tokens, mode, s)
    targets = targets.clone()
    targets[:2][torch.rand(2, cfg.seq_len, s) < 0.7] = -100  # first micro-batches lose most labels
    targets[5, 3:] = -100
    rt = T.Runtime(0, 1, torch.device("cpu"), False)

    def grads(n_micro, dtype):
        model = randomized_model(cfg).to(dtype)
        chunks = [(i, t) for i, t in zip(inputs.chunk(n_micro), targets.chunk(n_micro))]
        loss = T.accumulate_gradients(model, chunks, rt)
        return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters()])

    ref_loss, ref = grads(1, torch.float64)
    # the mean over all valid pairs of the whole batch, not a mean of per-micro-batch means
    model = randomized_model(cfg).double()
    assert ref_loss == pytest.approx(
        model(inputs, targets).item() / (targets != -100).sum().item(), rel=1e-6)
    for n_micro in (1, 2, 4):
        loss, g = grads(n_micro, torch.float32)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-7)
    per_micro_mean = sum(
        (model(i, t).item() / (t != -100).sum().item()) for i, t in zip(inputs.chunk(4), targets.chunk(4))) / 4
    assert abs(per_micro_mean - ref_loss) > 1e-3  # the uneven split really matters


# ---------------------------------------------------------------------------------------------
# the phases and the switch


def test_phase_shapes_and_switch_step():
    cfg = tiny_cfg(num_iterations=10, tst_frac=0.3)
    assert T.tst_switch_step(cfg) == 3
    table = T.Schedule(cfg)
    assert [table[i].stage.phase for i in range(11)] == [1] * 3 + [2] * 8  # row N: the final validation's
    assert table.stages == [T.Stage(0, 3, 1, cfg.tst_bag_size, cfg.tst_mode, cfg.batch_tokens),
                            T.Stage(3, 10, 2, 1, "full", cfg.batch_tokens)]
    assert table.graphs() == [(cfg.tst_bag_size, cfg.tst_mode), (1, "full")]
    assert T.tst_switch_step(dataclasses.replace(cfg, tst_frac=0.0)) == 0
    assert T.tst_switch_step(dataclasses.replace(cfg, num_iterations=3000)) == 900


# ---------------------------------------------------------------------------------------------
# runs


@pytest.fixture(scope="module")
def plain_log(tmp_path_factory):
    """The log of the tiny run without TST (one run for the three modes below)."""
    root = tmp_path_factory.mktemp("off")
    assert T.main(tiny_args(root, "--tst-frac", "0")) == 0
    return read_log(root / "logs")


@pytest.mark.parametrize("mode", ["full", "input", "output"])
def test_bag_size_1_repeats_plain_training_bit_for_bit(tmp_path, mode, plain_log):
    assert T.main(tiny_args(tmp_path / "s1", "--tst-bag-size", "1", "--tst-frac", "0.5",
                            "--tst-mode", mode)) == 0
    off, s1 = plain_log, read_log(tmp_path / "s1" / "logs")
    assert "tst_switch: step 4" in s1
    assert loss_lines(off) == loss_lines(s1) and len(loss_lines(off)) == 8
    assert loss_lines(off, "val_loss") == loss_lines(s1, "val_loss")


@pytest.mark.parametrize("mode", ["input", "output"])
def test_ablation_modes_run_to_completion(tmp_path, mode):
    assert T.main(tiny_args(tmp_path, "--tst-mode", mode, "--run-id", mode)) == 0
    text = read_log(tmp_path / "logs", mode)
    losses = loss_lines(text)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values())
    assert text.splitlines()[-1] == "status:complete"


def test_phase1_val_lines_also_report_the_tst_objective(tmp_path):
    assert T.main(tiny_args(tmp_path, "--tst-frac", "0.5", "--run-id", "v")) == 0
    text = read_log(tmp_path / "logs", "v")
    val = [l for l in text.splitlines() if " val_loss:" in l]
    assert [l.split()[0] for l in val] == ["step:0/8", "step:4/8", "step:8/8"]
    assert "val_loss_tst:" in val[0] and "val_loss_tst:" in val[1] and "val_loss_tst:" not in val[2]
    assert "phase:1" in val[1] and "phase:2" in val[2]
    for line in text.splitlines():  # accounting on every step line
        if line.startswith("step:"):
            for key in ("phase:", "tokens:", "positions:", "flops:"):
                assert key in line, line


def test_compiled_run_compiles_each_phase_once_and_never_during_training(tmp_path):
    torch._dynamo.reset()
    assert T.main(tiny_args(tmp_path, "--compile", "--tst-frac", "0.5", "--run-id", "c",
                            "--num-iterations", "6", "--val-every", "3")) == 0
    summary = json.loads((tmp_path / "logs" / "c.json").read_text())
    assert summary["graphs_compiled_during_training"] == 0
    assert summary["compile_time_ms"] > 0
    text = read_log(tmp_path / "logs", "c")
    assert "compile: warm-up of 2 phase graph(s)" in text


def test_a_three_bag_size_schedule_compiles_every_graph_before_the_clock(tmp_path, monkeypatch):
    """s = 8, then 4, then next-token: one edit (the stage rows) and every consumer follows the table."""
    def three_stages(cfg):
        b = cfg.batch_tokens
        return [T.Stage(0, 2, 1, 8, "full", b), T.Stage(2, 4, 1, 4, "full", b), T.Stage(4, 6, 2, 1, "full", b)]
    monkeypatch.setattr(T, "stages", three_stages)
    torch._dynamo.reset()
    assert T.main(tiny_args(tmp_path, "--compile", "--run-id", "b3", "--num-iterations", "6",
                            "--val-every", "2")) == 0
    summary = json.loads((tmp_path / "logs" / "b3.json").read_text())
    assert summary["graphs_compiled_during_training"] == 0
    text = read_log(tmp_path / "logs", "b3")
    assert "compile: warm-up of 3 phase graph(s)" in text
    assert "stage: step 2: bag_size 8 -> 4;" in text and "tst_switch: step 4: phase 1 -> 2" in text
    seq, steps = 32, 256 // 32  # sequences a step; each reads (L + 1) s tokens, plus the document tails it skips
    assert summary["raw_tokens"] >= 2 * steps * (seq + 1) * (8 + 4 + 1)
    planned = 2 * steps * seq * (8 + 4 + 1)  # L s per sequence: the stream advance without skipped tails
    assert T.train_tokens_needed(T.parse_config(tiny_args(tmp_path, "--num-iterations", "6"))[0]) == \
        math.ceil(T.PACKED_READ_MARGIN * planned) + 8 * seq  # + the last bag's labels
    val = [l for l in text.splitlines() if " val_loss:" in l]
    assert "val_loss_tst:" in val[1] and "val_loss_tst:" in val[2] and "val_loss_tst:" not in val[3]
