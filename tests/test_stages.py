"""Record #89's stage table (``--stages record89``) against modded-nanogpt HEAD's formulas, written out
plainly here: TrainingSchedule (boundaries, get_lr, MTP / prefix ramps, windows), get_muon_momentum."""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import harness as H
import train_gpt as T
from conftest import REPO, SMALL_FLAGS, drop_flags, read_log, run_torchrun, subprocess_env, tiny_args

N_SCHED, N_EXT = 1270, 15
TOTAL = N_SCHED + N_EXT
# HEAD's TRAINING_STAGES: (batch, cap, (short, long), lr_mul, mtp start, mtp end, prefix start, prefix end)
HEAD = [(131072, 896, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 0.25, 0.25),
        (262144, 2048, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], 0.25, 0.0),
        (393216, 2048, (5, 11), 1.73, [1.0], [1.0], 0.0, 0.0),
        (393216, 2048, (6, 13), 1.0, [1.0], [1.0], 0.0, 0.0)]


def head_boundaries():
    ends = [0, round(1 / 3 * N_SCHED), round(2 / 3 * N_SCHED), N_SCHED, TOTAL]
    return list(zip(ends, ends[1:]))


def head_lookup(step):
    for i, (start, end) in enumerate(head_boundaries()):
        if step < end:
            return i, (step - start) / (end - start)
    return 3, 1.0


def head_lr(step):
    i, _ = head_lookup(step)
    lr = HEAD[i][3]
    cd_start = int(N_SCHED * (1 - 0.6))
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / (N_SCHED - cd_start))
        lr = lr * (1 - t) + 0.15 * t
    return lr


def head_momentum(step):
    cd_start = TOTAL - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cd_start:
        return 0.95 - (step - cd_start) / 50 * (0.95 - 0.85)
    return 0.95


def head_weights(step):
    """MTP weights padded to 3 columns, then the prefix weight."""
    i, t = head_lookup(step)
    _, _, _, _, m0, m1, p0, p1 = HEAD[i]
    mtp = [a + (b - a) * t for a, b in zip(m0, m1)] + [0.0] * (3 - len(m0))
    return mtp + [p0 + (p1 - p0) * t]


def head_window(step):
    """(long, short) latent positions; after the last step HEAD's final validation uses long 20."""
    i, _ = head_lookup(step)
    short, long = HEAD[i][2]
    return (20 if step >= TOTAL else long) * 128, short * 128


def record89(*flags):
    return T.parse_config(["--preset", "baseline_h200", *flags])[0]


def boundary_steps():
    steps = {0, 1, TOTAL - 1, TOTAL, 300, 299, 301, TOTAL - 50, TOTAL - 49, int(N_SCHED * 0.4)}
    for b in (423, 847, 1270):
        steps |= {b - 1, b, b + 1}
    return sorted(s for s in steps if 0 <= s <= TOTAL)


def test_boundaries_are_heads():
    assert [(st.start, st.end) for st in T.stages(record89())] == head_boundaries()
    assert head_boundaries()[1] == (423, 847)


@pytest.mark.parametrize("step", boundary_steps())
def test_every_column_at_every_boundary_matches_head(step):
    row = T.Schedule(record89())[step]
    i, _ = head_lookup(min(step, TOTAL - 1))
    batch, cap = HEAD[i][:2]
    assert (row.stage.batch_tokens, row.stage.doc_cap) == (batch, cap)
    assert row.lr_scale == pytest.approx(head_lr(step), abs=1e-12)
    assert row.momentum == pytest.approx(head_momentum(step), abs=1e-12)
    assert row.window == head_window(step)
    assert row.objective == pytest.approx(head_weights(step), abs=1e-12)


def test_positions_total_and_steps_of_the_baseline():
    plan = H.plan_summary(record89(), *T.plan(record89()))
    assert plan["steps"] == TOTAL
    assert plan["positions_total"] == 423 * 131072 + 424 * 262144 + 438 * 393216 == 338821120
    assert T.train_tokens_needed(record89()) >= plan["positions_total"]


def test_tst_splits_the_stage_its_switch_falls_in():
    cfg = record89("--tst-frac", "0.3", "--tst-bag-size", "4")
    switch = round(0.3 * TOTAL)
    table = T.stages(cfg)
    assert [(st.start, st.end, st.phase) for st in table] == \
        [(0, switch, 1), (switch, 423, 2), (423, 847, 2), (847, 1270, 2), (1270, TOTAL, 2)]
    assert table[0].bag_size == 4 and table[1].bag_size == 1
    # both halves keep the recipe stage's columns and ramp over the whole recipe stage
    plain, split = T.Schedule(record89()), T.Schedule(cfg)
    for step in (0, switch - 1, switch, 422):
        a, b = plain[step], split[step]
        assert (a.lr_scale, a.momentum, a.window, a.objective, a.stage.doc_cap) == \
            (b.lr_scale, b.momentum, b.window, b.objective, b.stage.doc_cap)


def test_a_switch_past_the_first_stage_splits_the_second():
    cfg = record89("--tst-frac", "0.5", "--tst-bag-size", "2")
    switch = round(0.5 * TOTAL)
    assert [(st.start, st.end, st.phase, st.batch_tokens) for st in T.stages(cfg)][:3] == \
        [(0, 423, 1, 131072), (423, switch, 1, 262144), (switch, 847, 2, 262144)]


def test_flags_table_is_unchanged_by_the_new_columns():
    """The default table: one stage, no cap, no objective columns, lr and windows from the flags."""
    cfg = T.parse_config([*SMALL_FLAGS, "--num-iterations", "100"])[0]
    table = T.Schedule(cfg)
    for step in range(cfg.num_iterations + 1):
        row = table[step]
        assert row.stage.doc_cap == 0 and row.objective == ()
        assert row.lr_scale == T.lr_scale(step, cfg) and row.window == T.flag_windows(cfg)
        assert row.momentum == T.momentum_at(step, cfg)


def test_record89_needs_thirds_of_the_batch():
    with pytest.raises(T.ConfigError, match="--stages record89 needs --batch-tokens"):
        T.parse_config(["--preset", "baseline_h200", "--batch-tokens", str(16384 * 4)])


# ----------------------------------------------------------------------------------------------
# Training on the record #89 table: document-packed batches per stage, resume and processes


def recipe_args(tmp_path, run_id, *extra):
    """8 steps of the record #89 table at a tiny shape: stages [0, 2), [2, 4), [4, 6) of 4, 8, 12
    packed sequences of 32 positions, extension [6, 8); no TST."""
    args = tiny_args(tmp_path, "--stages", "record89", "--batch-tokens", "384", "--micro-batch-seqs", "2",
                     "--num-iterations", "8", "--extension-steps", "2", "--window", "0",
                     "--window-block", "8", "--tst-frac", "0", "--val-every", "0", "--run-id", run_id, *extra)
    return drop_flags(args, "--embed-lr", "--head-lr") if {"normuon", "aurora_normuon"} & set(extra) else args


def summary(tmp_path, run_id):
    return json.loads((tmp_path / "logs" / f"{run_id}.json").read_text())


NORMUON = ("--optimizer", "normuon", "--matrix-lr", "0.023", "--matrix-wd", "1.2")
# Record #89's model with cpu_smoke's 4-layer layer roles (every MODEL89 element on), 64 wide
MODEL89 = tuple(T.config_to_argv({**T.MODEL89, **T.SMOKE_MODEL89, "model_dim": 64, "n_head": 4, "bigram_vocab": 512}))


@pytest.mark.parametrize("extra", [(), ("--objectives", "--logit-cap", "sigmoid"), NORMUON,
                                   ("--optimizer", "aurora_normuon", "--matrix-lr", "0.023", "--matrix-wd", "1.2")])
def test_packed_stages_log_raw_tokens_and_positions(tmp_path, extra):
    assert T.main(recipe_args(tmp_path, "p", *extra)) == 0
    s = summary(tmp_path, "p")
    assert s["positions"] == 32 * (2 * 4 + 2 * 8 + 4 * 12)
    assert s["raw_tokens"] > s["positions"]  # clipped and cut document tails are read, not trained
    text = read_log(tmp_path / "logs", "p")
    assert "stage: step 2" in text and "stage: step 4" in text and "stage: step 6" in text


@pytest.mark.parametrize("stop, extra", [(3, ()), (4, ()), (3, NORMUON + ("--objectives",)),
                                         (3, NORMUON + ("--objectives",) + MODEL89)])
def test_resume_across_a_stage_change_repeats_the_straight_run(tmp_path, stop, extra):
    """Stop after step 3 (mid stage 2; with NorMuon, Adam holds one step's gradient) or 4 (a boundary)."""
    assert T.main(recipe_args(tmp_path / "a", "s", *extra)) == 0
    assert T.main(recipe_args(tmp_path / "b", "r", "--max-steps", str(stop), "--save-final", *extra)) == 0
    state = H.load_checkpoint(str(tmp_path / "b" / "ckpt" / "r" / f"step_{stop:06d}.pt"))
    assert state["loader_position"] == state["counters"]["raw_tokens"]
    assert T.main(recipe_args(tmp_path / "b", "r", "--resume", "auto", *extra)) == 0
    a, b = summary(tmp_path / "a", "s"), summary(tmp_path / "b", "r")
    assert a["train_losses"] == b["train_losses"] and len(a["train_losses"]) == 8
    assert (a["raw_tokens"], a["final_val_loss"]) == (b["raw_tokens"], b["final_val_loss"])


@pytest.mark.parametrize("extra", [(), MODEL89])
def test_two_processes_match_one_process_across_stage_changes(tmp_path, extra):
    script = os.path.join(REPO, "train_gpt.py")
    env = dict(subprocess_env(), OMP_NUM_THREADS="1")  # one thread each: the same summation order
    out = subprocess.run([sys.executable, script, *recipe_args(tmp_path, "one", "--dist-timeout", "60", *extra)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    run_torchrun([script, *recipe_args(tmp_path, "two", "--dist-timeout", "60", *extra)], env, cwd=tmp_path,
                 run_ids=["two"])
    a, b = summary(tmp_path, "one"), summary(tmp_path, "two")
    assert (a["world_size"], b["world_size"]) == (1, 2) and a["raw_tokens"] == b["raw_tokens"]
    assert [s for s, _ in a["train_losses"]] == list(range(1, 9))
    for (sa, la), (sb, lb) in zip(a["train_losses"], b["train_losses"]):
        assert sa == sb and abs(la - lb) <= 1e-5 * abs(la), (sa, la, lb)
    assert abs(a["final_val_loss"] - b["final_val_loss"]) <= 1e-5 * a["final_val_loss"]


# ----------------------------------------------------------------------------------------------
# --objectives: multi-token and prefix columns in the training forward, the metric unchanged


def small_model(cap, seed=0):
    cfg = T.parse_config(["--preset", "cpu_smoke", "--stages", "record89", "--model-dim", "32", "--bigram-vocab", "512",
                          "--seq-len", "16", "--batch-tokens", "96", "--micro-batch-seqs", "2",
                          "--window", "0", "--window-block", "4", "--tst-frac", "0",
                          "--num-iterations", "9", "--extension-steps", "0", "--objectives", "--logit-cap", cap])[0]
    torch.manual_seed(seed)
    model = T.GPT(cfg)
    for p in model.parameters():  # the head starts at zero: give every weight a value
        torch.nn.init.normal_(p, std=0.3)
    return cfg, model


@pytest.mark.parametrize("cap", ["tanh", "sigmoid"])
def test_objective_step_matches_naive_cross_entropies(cap):
    """accumulate_gradients with Objectives == sum_j w_j CE(column j) / (valid next-token labels), float64; the
    gradient also has HEAD's softmax term w_j softmax(z) of the columns past the sequence end (no loss term)."""
    cfg, model = small_model(cap)
    table = T.Schedule(cfg)
    objectives = T.Objectives(table, cfg.vocab_size, "cpu")
    g = torch.Generator().manual_seed(3)
    micro = [T.make_batch(torch.randint(0, 50257, (2, 17), generator=g), "full", 1) for _ in range(2)]
    step = 1  # stage 1, weights (1, .5, .25 -> 0, .25) partly ramped
    cols, weights = objectives.batches(micro, table[step], step)
    rt = type("RT", (), dict(device="cpu", distributed=False, autocast=staticmethod(contextlib.nullcontext)))()
    model.double()
    loss = T.accumulate_gradients(lambda i, t, w=None: model(i, t, w), cols, rt, weights.double())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref, extra, count = torch.zeros((), dtype=torch.float64), 0.0, 0
    w = weights.double().tolist()  # the step's float32 weights
    assert w == pytest.approx(table[step].objective, rel=1e-7)
    for (inputs, targets), (_, c) in zip(micro, cols):
        z = model(inputs).reshape(-1, cfg.vocab_size)
        y = c.reshape(-1, 4)
        for j in range(4):
            ok = y[:, j] >= 0
            ref = ref + w[j] * F.cross_entropy(z[ok], y[ok, j], reduction="sum")
            extra = extra + w[j] * torch.logsumexp(z[y[:, j] == T.PAST_END], -1).sum()  # its gradient: w_j p
        count += int((targets != -100).sum())
    ((ref + extra) / count).backward()
    assert loss.item() == pytest.approx(ref.item() / count, rel=1e-6)  # the step total is float32
    for a, p in zip(grads, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-8, atol=1e-12), (a - p.grad).abs().max()
    assert w[1] == 0.5 and 0 < w[2] < 0.25 and w[3] == 0.25


def test_objective_columns_are_next_tokens_and_prefixes():
    cfg, _ = small_model("tanh")
    table = T.Schedule(cfg)
    objectives = T.Objectives(table, cfg.vocab_size, "cpu")
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(1))
    (inputs, targets), = [T.make_batch(tokens, "full", 1)]
    (_, cols), = objectives.batches([(inputs, targets)], table[0], 0)[0]
    prefix = T.prefix_token_table(cfg.vocab_size)
    for b in range(2):
        for i in range(16):
            for k in range(3):
                assert cols[b, i, k] == (tokens[b, i + 1 + k] if i + k < 16 else T.PAST_END)
            assert cols[b, i, 3] == prefix[tokens[b, i + 1]]
    step = T.stages(cfg)[1].start  # a TST-free run: every row is next-token with an objective
    assert objectives.batches([(inputs, targets)], table[step], step)[1].tolist() == \
        pytest.approx(list(table[step].objective))


def test_eval_stays_next_token_ce_under_the_sigmoid_cap():
    cfg, model = small_model("sigmoid")
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(2))
    inputs, targets = T.make_batch(tokens, "full", 1)
    with torch.no_grad():
        z = model(inputs).double()
        ref = F.cross_entropy(z.reshape(-1, cfg.vocab_size), targets.reshape(-1), reduction="sum")
        got = model(inputs, targets)
    x = model.lm_head.weight  # z = 23 sigmoid((x + 5) / 7.5) bounds the logits in (0, 23)
    assert 0 < z.min() and z.max() < 23 and x is not None
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# --tied-embed: the head's weight is the embedding until the split step, then a copy with its Adam state


def test_split_step_is_the_odd_start_of_stage_3():
    cfg = record89(*NORMUON, "--tied-embed")
    assert T.split_step(cfg) == 847 | 1 == 847
    assert T.split_step(record89("--tied-embed", "--num-iterations", "1288", "--extension-steps", "15")) == 849
    with pytest.raises(T.ConfigError, match="--tied-embed needs --stages record89"):
        T.parse_config([*SMALL_FLAGS, "--tied-embed"])


def test_untie_copies_the_weight_and_the_head_adam_state():
    cfg, model = small_model("tanh")
    cfg = dataclasses.replace(cfg, tied_embed=True, optimizer="normuon")
    torch.manual_seed(0)
    model = T.GPT(cfg)
    assert model.tied and torch.equal(model.embed.weight, model.lm_head.weight)
    adam, _ = T.build_optimizers(model, cfg)
    tokens = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(4))
    for _ in range(2):  # one Adam update (every other step)
        inputs, targets = T.make_batch(tokens, "full", 1)
        model(inputs, targets).backward()
        assert model.embed.weight.grad is None and model.lm_head.weight.grad is not None
        adam.step()
        model.zero_grad(set_to_none=True)
    head = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in adam.state[model.lm_head.weight].items()}
    T.untie(model, adam)
    assert not model.tied and torch.equal(model.embed.weight, model.lm_head.weight)
    embed = adam.state[model.embed.weight]
    assert head["step"] == embed["step"] == 1
    for key in ("exp_avg", "exp_avg_sq", "grad_sum"):
        assert torch.equal(head[key], embed[key]) and embed[key] is not adam.state[model.lm_head.weight][key]
    inputs, targets = T.make_batch(tokens, "full", 1)
    model(inputs, targets).backward()
    assert model.embed.weight.grad is not None  # untied: the embedding has its own gradient


def test_resume_across_the_untie_step_repeats_the_straight_run(tmp_path):
    """Split step of the tiny table: stage 3 starts at step 4, so the untie follows step 5 (4 | 1)."""
    extra = NORMUON + ("--tied-embed",)
    assert T.split_step(T.parse_config(recipe_args(tmp_path, "x", *extra))[0]) == 5
    assert T.main(recipe_args(tmp_path / "a", "s", *extra)) == 0
    assert T.main(recipe_args(tmp_path / "b", "r", "--max-steps", "5", "--save-final", *extra)) == 0
    assert T.main(recipe_args(tmp_path / "b", "r", "--resume", "auto", *extra)) == 0
    a, b = summary(tmp_path / "a", "s"), summary(tmp_path / "b", "r")
    assert a["train_losses"] == b["train_losses"] and len(a["train_losses"]) == 8
    assert a["final_val_loss"] == b["final_val_loss"]
