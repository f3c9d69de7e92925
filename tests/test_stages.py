"""The stage table (record #89's, the one recipe) against modded-nanogpt's formulas, written out plainly here:
TrainingSchedule (boundaries, get_lr, multi-token and prefix ramps, windows) and get_muon_momentum; the objective
columns against float64 cross-entropies; the untie of embedding and head."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import harness as H
import train_gpt as T
from conftest import SPECS, TINY, read_log, spec_of, tiny_args

N_SCHED, N_EXT = 1270, 15
TOTAL = N_SCHED + N_EXT
# modded-nanogpt's TRAINING_STAGES (record #89): (batch, cap, (short, long), lr_mul, multi-token weights at the
# stage's start and end, prefix weight at its start and end)
MNG = [(131072, 896, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 0.25, 0.25),
       (262144, 2048, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], 0.25, 0.0),
       (393216, 2048, (5, 11), 1.73, [1.0], [1.0], 0.0, 0.0),
       (393216, 2048, (6, 13), 1.0, [1.0], [1.0], 0.0, 0.0)]


def config(*argv):
    """The checked Config of command-line words (--model may name the tiny spec)."""
    cfg = H.parse_flags(T.Config, T.PRESETS, list(argv))[0]
    T.check_config(cfg, SPECS)
    return cfg


def mng_boundaries():
    ends = [0, round(1 / 3 * N_SCHED), round(2 / 3 * N_SCHED), N_SCHED, TOTAL]
    return list(zip(ends, ends[1:]))


def mng_lookup(step):
    for i, (start, end) in enumerate(mng_boundaries()):
        if step < end:
            return i, (step - start) / (end - start)
    return 3, 1.0


def mng_lr(step):
    i, _ = mng_lookup(step)
    lr = MNG[i][3]
    cd_start = int(N_SCHED * (1 - 0.6))
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / (N_SCHED - cd_start))
        lr = lr * (1 - t) + 0.15 * t
    return lr


def mng_momentum(step):
    cd_start = TOTAL - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cd_start:
        return 0.95 - (step - cd_start) / 50 * (0.95 - 0.85)
    return 0.95


def mng_weights(step):
    """Multi-token weights padded to 3 columns, then the prefix weight."""
    i, t = mng_lookup(step)
    _, _, _, _, m0, m1, p0, p1 = MNG[i]
    mtp = [a + (b - a) * t for a, b in zip(m0, m1)] + [0.0] * (3 - len(m0))
    return mtp + [p0 + (p1 - p0) * t]


def mng_window(step):
    """(long, short) latent positions; after the last step the final validation's long window is 20 blocks."""
    i, _ = mng_lookup(step)
    short, long = MNG[i][2]
    return (20 if step >= TOTAL else long) * 128, short * 128


def boundary_steps():
    steps = {0, 1, TOTAL - 1, TOTAL, 300, 299, 301, TOTAL - 50, TOTAL - 49, int(N_SCHED * 0.4)}
    for b in (423, 847, 1270):
        steps |= {b - 1, b, b + 1}
    return sorted(s for s in steps if 0 <= s <= TOTAL)


def test_boundaries_are_modded_nanogpts():
    assert [(st.start, st.end) for st in T.stages(config())] == mng_boundaries()
    assert mng_boundaries()[1] == (423, 847)


@pytest.fixture(scope="module")
def baseline_table():
    cfg = config("--preset", "baseline_h200")
    return T.Schedule(cfg, spec_of(cfg))


@pytest.mark.parametrize("step", boundary_steps())
def test_every_column_at_every_boundary_matches_modded_nanogpt(baseline_table, step):
    row = baseline_table[step]
    i, _ = mng_lookup(min(step, TOTAL - 1))
    batch, cap = MNG[i][:2]
    assert (row.stage.batch_tokens, row.stage.doc_cap) == (batch, cap)
    assert row.stage.seq_len == 16384 * batch // 131072  # stage k: sequences of k x --seq-len (record #89)
    assert row.lr_scale == pytest.approx(mng_lr(step), abs=1e-12)
    assert row.momentum == pytest.approx(mng_momentum(step), abs=1e-12)
    assert row.window == mng_window(step)
    assert row.objective == pytest.approx(mng_weights(step), abs=1e-12)


def test_positions_total_and_steps_of_the_baseline(baseline_table):
    rows = baseline_table.rows[:TOTAL]
    assert len(baseline_table.rows) == TOTAL + 1  # row N: the final validation's windows
    assert sum(r.stage.batch_tokens for r in rows) == 423 * 131072 + 424 * 262144 + 438 * 393216 == 338_821_120
    # every step trains 8 sequences, one per process of 8 (record #89's layout)
    assert {r.stage.batch_tokens // r.stage.seq_len for r in rows} == {8}


def test_tst_splits_the_stage_its_switch_falls_in():
    cfg = config("--tst-frac", "0.3", "--tst-bag-size", "4")
    switch = round(0.3 * TOTAL)
    table = T.stages(cfg)
    assert [(st.start, st.end, st.phase) for st in table] == \
        [(0, switch, 1), (switch, 423, 2), (423, 847, 2), (847, 1270, 2), (1270, TOTAL, 2)]
    assert table[0].bag_size == 4 and table[1].bag_size == 1
    # both halves keep the recipe stage's columns and ramp over the whole recipe stage
    base = config()
    plain, split = T.Schedule(base, spec_of(base)), T.Schedule(cfg, spec_of(cfg))
    for step in (0, switch - 1, switch, 422):
        a, b = plain[step], split[step]
        assert (a.lr_scale, a.momentum, a.window, a.objective, a.stage.doc_cap) == \
            (b.lr_scale, b.momentum, b.window, b.objective, b.stage.doc_cap)
    # phase 1 reads s x the text of a latent position: (L + 1) s tokens a sequence, L s of them new
    assert table[0].raw_tokens() == 8 * 16384 * 4 and table[1].raw_tokens() == 8 * 16384


def test_a_switch_past_the_first_stage_splits_the_second():
    cfg = config("--tst-frac", "0.5", "--tst-bag-size", "2")
    switch = round(0.5 * TOTAL)
    assert [(st.start, st.end, st.phase, st.batch_tokens) for st in T.stages(cfg)][:3] == \
        [(0, 423, 1, 131072), (423, switch, 1, 262144), (switch, 847, 2, 262144)]


def test_the_stages_need_thirds_of_the_batch():
    with pytest.raises(H.ConfigError, match=r"--batch-tokens 65536 must be a multiple of 3 x --seq-len \(49152\)"):
        config("--batch-tokens", str(16384 * 4))


# ----------------------------------------------------------------------------------------------
# Training on the table at the tiny shape: stages [0, 2), [2, 5), [5, 7) of 1, 2, 3 sequences of 64, 128, 192
# positions, the extension [7, 8)


def test_packed_stages_log_raw_tokens_positions_and_stage_changes(tmp_path):
    assert T.main(tiny_args(tmp_path, "--run-id", "p", "--val-every", "0"), models=SPECS) == 0
    s = json.loads((tmp_path / "logs" / "p.json").read_text())
    assert s["positions"] == 2 * 64 + 3 * 128 + 3 * 192
    assert s["raw_tokens"] > s["positions"]  # clipped and cut document tails are read, not trained
    assert s["flops"] == pytest.approx(sum(r.flops_per_position * r.stage.batch_tokens
                                           for r in T.Schedule(config(*tiny_args(tmp_path)), TINY).rows[:8]), rel=1e-12)
    text = read_log(tmp_path / "logs", "p")
    for line in ("stage: step 2: batch_tokens 64 -> 128, seq_len 64 -> 128, doc_cap 896 -> 2048, blocks (1, 3) -> "
                 "(3, 7), lr_mul 1.0 -> 1.52;", "stage: step 5: batch_tokens 128 -> 192, seq_len 128 -> 192, "
                 "blocks (3, 7) -> (5, 11), lr_mul 1.52 -> 1.73;", "stage: step 7: blocks (5, 11) -> (6, 13), "
                 "lr_mul 1.73 -> 1.0;"):
        assert "\n" + line in text, line


# ----------------------------------------------------------------------------------------------
# The objective: multi-token and prefix columns in the training forward, the metric unchanged


def tiny_model(seed=0):
    """The tiny spec in float64, every weight moved off its init (a zero projection would hide a column)."""
    cfg = config("--model", "tiny", "--seq-len", "16", "--batch-tokens", "96", "--num-iterations", "9",
                 "--extension-steps", "0", "--val-tokens", "64", "--no-fp8")
    torch.manual_seed(seed)
    model = T.build_model(cfg, TINY).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, model


def test_objective_step_matches_naive_cross_entropies():
    """accumulate_gradients with Objectives: loss = sum_j w_j CE(column j) / (valid next-token labels), gradient =
    that sum / the step's sequence count (modded-nanogpt's scale), plus its softmax term w_j softmax(z) for the
    multi-token columns past the sequence end (no loss term), float64."""
    cfg, model = tiny_model()
    table = T.Schedule(cfg, TINY)
    objectives = T.Objectives(table, model.spec.vocab_size, "cpu")
    g = torch.Generator().manual_seed(3)
    micro = [T.make_batch(torch.randint(0, 50257, (2, 17), generator=g), "full", 1) for _ in range(2)]
    step = 1  # stage 1, weights (1, .5, .25 -> 0, .25) partly ramped
    cols, weights = objectives.batches(micro, step, table[step].stage)
    rt = H.Runtime(0, 1, torch.device("cpu"), False)
    loss = T.accumulate_gradients(model, cols, rt, weights.double(), divisor=4)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "embed.weight" not in grads and len(grads) > 30  # tied: the embedding's gradient is the head's
    model.zero_grad(set_to_none=True)
    ref, extra, count = torch.zeros((), dtype=torch.float64), 0.0, 0
    w = weights.double().tolist()  # the step's float32 weights
    assert w == pytest.approx(table[step].objective, rel=1e-7)
    V = model.spec.vocab_size
    for (inputs, targets), (_, c) in zip(micro, cols):
        z = model(inputs).reshape(-1, V)  # the sigmoid-capped logits
        y = c.reshape(-1, 4)
        for j in range(4):
            ok = y[:, j] >= 0
            ref = ref + w[j] * F.cross_entropy(z[ok], y[ok, j], reduction="sum")
            extra = extra + w[j] * torch.logsumexp(z[y[:, j] == T.PAST_END], -1).sum()  # its gradient: w_j p
        count += int((targets != -100).sum())
    ((ref + extra) / 4).backward()
    assert loss.item() == pytest.approx(ref.item() / count, rel=1e-6)  # the step total is float32
    for n, p in model.named_parameters():
        assert (n in grads) == (p.grad is not None), n
        if n in grads:
            assert torch.allclose(grads[n], p.grad, rtol=1e-8, atol=1e-12), (n, (grads[n] - p.grad).abs().max())
    assert w[1] == 0.5 and 0 < w[2] < 0.25 and w[3] == 0.25


def test_objective_columns_are_next_tokens_and_prefixes():
    cfg, _ = tiny_model()
    table = T.Schedule(cfg, TINY)
    objectives = T.Objectives(table, 50304, "cpu")
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = T.make_batch(tokens, "full", 1)
    [(_, cols)], _ = objectives.batches([(inputs, targets)], 0, table[0].stage)
    prefix = T.prefix_token_table(50304)
    for b in range(2):
        for i in range(16):
            for k in range(3):
                assert cols[b, i, k] == (tokens[b, i + 1 + k] if i + k < 16 else T.PAST_END)
            assert cols[b, i, 3] == prefix[tokens[b, i + 1]]
    step = T.stages(cfg)[1].start
    assert objectives.batches([(inputs, targets)], step, table[step].stage)[1].tolist() == \
        pytest.approx(list(table[step].objective))
    tst = T.Schedule(dataclasses.replace(cfg, tst_frac=0.5), TINY)  # TST phase 1 trains its own objective
    assert objectives.batches([(inputs, targets)], 0, tst[0].stage) == ([(inputs, targets)], None)


def test_eval_is_next_token_cross_entropy_under_the_sigmoid_cap():
    _, model = tiny_model()
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(2))
    inputs, targets = T.make_batch(tokens, "full", 1)
    with T.eval_mode(model):
        z = model(inputs)
        got = model(inputs, targets)
    assert 0 < z.min() and z.max() < T.SIGMOID_CAP[0]  # z = 23 sigmoid((x + 5) / 7.5): logits in (0, 23)
    ref = F.cross_entropy(z.reshape(-1, z.size(-1)), targets.reshape(-1), reduction="sum")
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)


# ----------------------------------------------------------------------------------------------
# The tie: the head's weight is the embedding until the split step, then a copy with its Adam state


def test_split_step_is_the_odd_start_of_stage_3(tmp_path):
    assert T.split_step(config()) == 847 | 1 == 847
    assert T.split_step(config("--num-iterations", "1288")) == 849  # stage 3 starts at 848
    assert T.split_step(config(*tiny_args(tmp_path))) == 5  # the tiny table's stage 3 starts at step 5


def test_untie_copies_the_weight_and_the_head_adam_state():
    cfg, _ = tiny_model()
    torch.manual_seed(0)
    model = T.build_model(cfg, TINY)
    assert model.tied
    adam, _ = T.build_optimizers(model, cfg)
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(4))
    for _ in range(2):  # one Adam update (every other step)
        inputs, targets = T.make_batch(tokens, "full", 1)
        model(inputs, targets).backward()
        assert model.embed.weight.grad is None and model.lm_head.weight.grad is not None  # tied: the head's
        adam.step()
        model.zero_grad(set_to_none=True)
    head = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in adam.state[model.lm_head.weight].items()}
    T.untie(model, adam)
    assert not model.tied and torch.equal(model.embed.weight, model.lm_head.weight)
    embed = adam.state[model.embed.weight]
    assert set(head) == set(embed) >= {"exp_avg", "exp_avg_sq", "grad_sum"}
    for key, value in head.items():
        if torch.is_tensor(value):
            assert torch.equal(value, embed[key]) and embed[key] is not adam.state[model.lm_head.weight][key]
        else:
            assert value == embed[key]
    inputs, targets = T.make_batch(tokens, "full", 1)
    model(inputs, targets).backward()
    assert model.embed.weight.grad is not None  # untied: the embedding has its own gradient
