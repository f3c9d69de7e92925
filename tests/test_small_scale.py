"""bench/small_scale.py: data orders, paired statistics, planning and flag checks (no training here)."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOT = 50256


@pytest.fixture(scope="module")
def ss():
    spec = importlib.util.spec_from_file_location("small_scale", os.path.join(REPO, "bench", "small_scale.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sst(ss):
    return ss.sst


@pytest.fixture(scope="module")
def ssd(ss):
    return ss.small_scale_data


# ----------------------------------------------------------------------------------------------
# Paired statistics against slow float64 references


def t_pdf(x, dof):
    """Student's t density (float64 numpy array in, out)."""
    c = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    return c * (1 + x * x / dof) ** (-(dof + 1) / 2)


def t_cdf_by_hand(x, dof, n=20001):
    """P(T <= x) for Student's t: 1/2 + Simpson's rule on the density from 0 to |x|."""
    grid = np.linspace(0.0, abs(x), n)
    y = t_pdf(grid, dof)
    h = grid[1] - grid[0]
    half = h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())
    return 0.5 + math.copysign(half, x)


def t_quantile_by_hand(q, dof):
    lo, hi = 0.0, 200.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_by_hand(mid, dof) < q else (lo, mid)
    return (lo + hi) / 2


def paired_by_hand(pairs):
    """Mean, sample std, 95% interval and two-sided p of the differences, in plain float64 loops."""
    d = [float(a) - float(b) for a, b in pairs]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile_by_hand(0.975, n - 1) * se
    t = mean / se
    p = 2 * (1 - t_cdf_by_hand(abs(t), n - 1))
    return mean, sd, (mean - half, mean + half), p


@pytest.mark.parametrize("n", [2, 3, 6, 11])
def test_paired_difference_matches_hand_computation(sst, n):
    rng = np.random.default_rng(n)
    for _ in range(3):
        keys = [(o, s) for o in range(n) for s in range(1)]
        a = {k: 7.0 + rng.normal(0, 0.1) for k in keys}
        b = {k: a[k] + rng.normal(0.03, 0.05) for k in keys}
        got = sst.paired_difference(a, b)
        mean, sd, ci, p = paired_by_hand([(a[k], b[k]) for k in keys])
        assert got["n"] == n and got["mean"] == pytest.approx(mean, abs=1e-12)
        assert got["std"] == pytest.approx(sd, rel=1e-10)
        assert got["ci"][0] == pytest.approx(ci[0], abs=1e-7) and got["ci"][1] == pytest.approx(ci[1], abs=1e-7)
        assert got["p"] == pytest.approx(p, abs=1e-7)


def test_pairing_is_by_key_not_by_order(sst):
    a = {(0, 0): 7.0, (0, 1): 7.5, (1, 0): 6.0, (1, 1): 8.0}
    b = {(1, 1): 7.9, (1, 0): 6.2, (0, 1): 7.2, (0, 0): 7.1}  # same keys, other insertion order
    got = sst.paired_difference(a, b)
    mean, sd, ci, p = paired_by_hand([(a[k], b[k]) for k in a])
    assert got["mean"] == pytest.approx(mean) and got["p"] == pytest.approx(p, abs=1e-7)
    assert sorted(got["keys"]) == sorted(a)
    # pairing by list order would pair 7.0 with 7.9 etc.: the same mean, another spread and p
    by_order = paired_by_hand(list(zip(a.values(), b.values())))
    assert abs(by_order[1] - got["std"]) > 0.1 and abs(by_order[3] - got["p"]) > 0.1


def test_missing_pairs_are_excluded_and_named(sst):
    a = {(0, 0): 7.0, (0, 1): 7.4, (1, 0): 6.9, (2, 0): 7.2}
    b = {(0, 0): 7.1, (0, 1): 7.6, (1, 0): 7.0, (3, 0): 7.0, (2, 0): math.nan}
    got = sst.paired_difference(a, b)
    assert got["keys"] == [(0, 0), (0, 1), (1, 0)]
    assert dict(got["excluded"]) == {(2, 0): "non-finite value", (3, 0): "only in the second arm"}
    assert got["mean"] == pytest.approx(paired_by_hand([(7.0, 7.1), (7.4, 7.6), (6.9, 7.0)])[0])


@pytest.mark.parametrize("diffs, word", [
    ([-0.10, -0.12, -0.09, -0.11], "better"),
    ([0.10, 0.12, 0.09, 0.11], "worse"),
    ([-0.10, 0.12, -0.09, 0.11], "no measurable difference"),
    ([-0.10], "too few pairs"),
])
def test_verdict_needs_the_interval_to_exclude_zero(sst, diffs, word):
    got = sst.paired_difference({i: 7.0 + d for i, d in enumerate(diffs)}, {i: 7.0 for i in range(len(diffs))})
    assert got["verdict"] == word
    if word == "too few pairs":
        assert math.isnan(got["ci"][0]) and math.isnan(got["p"])
    else:
        assert (got["ci"][1] < 0) == (word == "better") and (got["ci"][0] > 0) == (word == "worse")


def test_spread_and_value_at(sst):
    sp = sst.spread([7.0, 7.3, math.nan, 7.1])
    assert sp["n"] == 3 and sp["range"] == pytest.approx(0.3)
    m = 0.4 / 3  # mean offset from 7 of 7.0, 7.3, 7.1
    assert sp["mean"] == pytest.approx(7 + m)
    assert sp["std"] == pytest.approx(math.sqrt((m ** 2 + (0.3 - m) ** 2 + (0.1 - m) ** 2) / 2))
    assert sst.value_at([0, 10, 30], [10.0, 8.0, 6.0], 20) == pytest.approx(7.0)
    assert sst.value_at([0, 10], [10.0, 8.0], 11) is None


# ----------------------------------------------------------------------------------------------
# Data orders


def corpus(tmp_path, docs, lead=()):
    """Two shards holding ``lead`` (a partial first document) and then ``docs``, each after an EOT."""
    stream = list(lead) + [t for d in docs for t in [EOT] + list(d)]
    cut = len(stream) // 2
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    write_shard(d / "c_train_000001.bin", stream[:cut])
    write_shard(d / "c_train_000002.bin", stream[cut:])
    return str(d / "c_train_*.bin"), np.array(stream, dtype=np.uint16)


def split_docs(tokens):
    starts = [i for i, t in enumerate(tokens) if t == EOT] + [len(tokens)]
    head = [tuple(tokens[:starts[0]])] if starts[0] else []
    return head + [tuple(tokens[starts[i]:starts[i + 1]]) for i in range(len(starts) - 1)]


def test_docs_order_permutes_whole_documents(ssd, tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=rng.integers(1, 30)).tolist() for _ in range(40)]
    pattern, stream = corpus(tmp_path, docs, lead=[5, 6, 7])
    tokens = ssd.read_corpus(pattern)
    assert np.array_equal(tokens, stream)  # both shards, in order
    orders = [ssd.ordered_tokens(tokens, "docs", k, 128, EOT) for k in range(3)]
    pieces = split_docs(stream.tolist())  # the lead piece (no EOT before it) counts as a document
    assert len(pieces) == 41
    for k, out in enumerate(orders):
        assert out.dtype == np.uint16
        want = [t for i in np.random.default_rng(k).permutation(len(pieces)) for t in pieces[i]]
        assert out.tolist() == want  # order k: the documents in the permutation drawn from seed k
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert np.array_equal(orders[1], ssd.ordered_tokens(tokens, "docs", 1, 128, EOT))  # reproducible


def test_mix_order_permutes_chunks_and_keeps_the_tail_last(ssd, tmp_path):
    pattern, stream = corpus(tmp_path, [list(range(i, i + 50)) for i in range(0, 2000, 50)])
    tokens = ssd.read_corpus(pattern)
    chunk = 16
    out = ssd.ordered_tokens(tokens, "mix", 2, chunk, EOT)
    n_full = len(stream) // chunk
    got = [tuple(out[i * chunk:(i + 1) * chunk]) for i in range(n_full)]
    want = [tuple(stream[i * chunk:(i + 1) * chunk]) for i in range(n_full)]
    assert sorted(got) == sorted(want) and got != want
    assert np.array_equal(out[n_full * chunk:], stream[n_full * chunk:])
    perm = np.random.default_rng(2).permutation(n_full)  # order k = the permutation drawn from seed k
    assert got == [want[i] for i in perm]


def test_build_orders_writes_valid_shards_once_and_names_them_by_content(ssd, tmp_path):
    sys.path.insert(0, REPO)
    import harness
    pattern, stream = corpus(tmp_path, [[1, 2, 3, 4]] * 3 + [list(range(100, 160))] * 4)
    root = tmp_path / "out" / "data"
    named = ssd.build_orders(pattern, str(root), ["mix", "docs"], 2, 8, write=False)
    assert not root.exists()  # naming creates nothing
    globs = ssd.build_orders(pattern, str(root), ["mix", "docs"], 2, 8)
    assert globs == named and set(globs) == {("mix", 0), ("mix", 1), ("docs", 0), ("docs", 1)}
    assert (root / ".gitignore").read_text().splitlines()[-1] == "*"
    path = globs[("mix", 1)].replace("*_train_*.bin", "mix_o1_train_000001.bin")
    assert harness.read_shard_header(path) == len(stream)
    assert np.array_equal(harness.load_shard(path), ssd.ordered_tokens(stream, "mix", 1, 8, EOT))
    stamp = os.stat(path).st_mtime_ns
    assert ssd.build_orders(pattern, str(root), ["mix"], 2, 8)[("mix", 1)] == globs[("mix", 1)]
    assert os.stat(path).st_mtime_ns == stamp  # same tokens: not written again
    write_shard(tmp_path / "corpus" / "c_train_000002.bin", [EOT, 9, 9, 9])  # another corpus: another folder
    assert ssd.build_orders(pattern, str(root), ["mix"], 2, 8)[("mix", 1)] != globs[("mix", 1)]
    assert not [p for p in root.rglob("*") if ".tmp" in p.name]


def test_orders_refuse_a_corpus_they_cannot_permute(ssd, tmp_path):
    pattern, _ = corpus(tmp_path, [list(range(40))])
    with pytest.raises(ssd.OrderError, match="at least 2"):
        ssd.ordered_tokens(ssd.read_corpus(pattern), "docs", 0, 8, EOT)
    with pytest.raises(ssd.OrderError, match="no shard found"):
        ssd.read_corpus(str(tmp_path / "nothing_*.bin"))


# ----------------------------------------------------------------------------------------------
# Analysis of finished runs (synthetic summaries)


def summary(final, flops, steps=(0, 5, 10), losses=None):
    losses = losses or [10.0, (10.0 + final) / 2, final]
    val = [dict(step=s, val_loss=v, flops=flops * s / steps[-1], train_time_ms=10.0 * s) for s, v in zip(steps, losses)]
    return dict(status="complete", final_val_loss=final, flops=flops, train_time_ms=100.0, raw_tokens=640, val=val)


def test_comparisons_pair_by_order_and_seed_and_name_missing_pairs(ss, capsys):
    spec = dict(arms=["aurora", "aurora_tst", "aurora_eqtext"], orders=2, seeds=2)
    finals = {"aurora": [7.0, 7.2, 6.9, 7.1], "aurora_tst": [6.8, 7.1, 6.9, 6.9], "aurora_eqtext": [6.7, 6.8, 6.6, 6.7]}
    results = {}
    for arm, vals in finals.items():
        for (o, s), v in zip([(0, 0), (0, 1), (1, 0), (1, 1)], vals):
            # control: 1.9x the FLOPs; its val curve is linear in FLOPs from 9.0 at 0.5e9 to its final at 1.9e9
            results[(arm, "mix", o, s)] = (summary(v, 1.9e9, steps=(0, 5, 19), losses=[10.0, 9.0, v])
                                           if arm == "aurora_eqtext" else summary(v, 1e9))
    results[("aurora", "mix", 1, 1)]["status"] = "incomplete"
    rows = {(r["a"], r["b"], r["at"]): r for r in ss.comparisons(spec, results)}
    r = rows[("aurora_tst", "aurora", "final")]
    assert r["n"] == 3 and r["left_out"] == [((1, 1), "no complete run of aurora")]
    assert "order 1, seed 1" in capsys.readouterr().out
    assert r["mean"] == pytest.approx(np.mean([6.8 - 7.0, 7.1 - 7.2, 6.9 - 6.9]))
    eq = rows[("aurora_tst", "aurora_eqtext", "final")]
    assert eq["n"] == 4 and "equal text" in eq["what"]
    at = rows[("aurora_tst", "aurora_eqtext", "flops")]
    # the control at 1e9 FLOPs: (1e9 - 0.5e9) / (1.9e9 - 0.5e9) of the way from 9.0 to its final
    want = [t - (9.0 + (c - 9.0) * 0.5 / 1.4) for t, c in zip(finals["aurora_tst"], finals["aurora_eqtext"])]
    assert at["n"] == 4 and at["mean"] == pytest.approx(np.mean(want))


def test_differences_plot_draws_each_pair_its_mean_and_interval(ss, sst, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dict(sst.paired_difference({k: a for k, a in enumerate(xa)}, {k: b for k, b in enumerate(xb)}),
                 a=name, b="aurora", at="final")
            for name, xa, xb in (("adamw", [7.3, 7.4, 7.35], [7.2, 7.28, 7.26]),
                                 ("muon", [7.1, 7.2, 7.0], [7.2, 7.3, 7.15]), ("lone", [7.0], [7.1]))]
    saved = {}
    real_close = plt.close
    plt.close = lambda fig: saved.setdefault("fig", fig)  # keep the figure to inspect it
    try:
        assert ss.differences_plot(rows, str(tmp_path / "d.png")) and os.path.getsize(tmp_path / "d.png") > 0
    finally:
        plt.close = real_close
    fig = saved["fig"]
    try:
        [ax] = fig.axes
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == ["muon - aurora", "adamw - aurora"]  # top row first; the 1-pair row is left out
        dots = [c.get_offsets() for c in ax.collections if len(c.get_offsets()) == 3]
        for y, r in ((1, rows[0]), (0, rows[1])):  # every pair drawn at its row
            assert any(np.allclose(np.sort(d[:, 0]), np.sort(r["diffs"])) and np.all(np.abs(d[:, 1] - y) < 0.5) for d in dots)
        means = [ln.get_xydata()[0] for ln in ax.get_lines() if ln.get_marker() == "o"]
        assert sorted(map(tuple, np.round(means, 12))) == sorted(
            (round(r["mean"], 12), float(y)) for y, r in ((1, rows[0]), (0, rows[1])))
        colour = {int(ln.get_xydata()[0][1]): ln.get_color() for ln in ax.get_lines() if ln.get_marker() == "o"}
        assert rows[0]["verdict"] == sst.WORSE and rows[1]["verdict"] == sst.BETTER
        assert colour == {1: "tab:red", 0: "tab:green"}  # worse red, better green
    finally:
        real_close(fig)
    assert not ss.differences_plot(rows[2:], str(tmp_path / "none.png")) and not os.path.exists(tmp_path / "none.png")


def test_arm_plots_pool_each_arm_over_its_data_orders(ss, tmp_path, monkeypatch):
    for arm in ("adamw", "aurora"):
        (tmp_path / arm).mkdir()
    calls = []

    def fake_run(cmd, **kw):  # records/compare.py's command line; writes the image it was asked for
        calls.append(cmd)
        open(cmd[cmd.index("--plot") + 1], "wb").close()
        return subprocess.CompletedProcess(cmd, 0, stdout="table", stderr="")

    monkeypatch.setattr(ss.subprocess, "run", fake_run)
    stats = {"adamw": {"n": 6}, "aurora": {"n": 6}, "muon": {"n": 0}}
    plots, text = ss.make_plots(str(tmp_path), ["adamw", "aurora", "muon"], stats, 7.3)
    assert len(calls) == 2 and text == "table" and [os.path.basename(p) for p, _ in plots] == [
        "val_loss_vs_flops.png", "val_loss_vs_time.png"]
    for cmd in calls:
        assert "--pool-train-data" in cmd and cmd[cmd.index("--target") + 1] == "7.3000"
        assert [c for c in cmd if c.startswith(str(tmp_path))][:2] == [str(tmp_path / "adamw"), str(tmp_path / "aurora")]


def test_arm_stats_and_recency_spread(ss):
    results = {("adamw", "mix", o, 0): summary(v, 1e9) for o, v in enumerate([7.0, 7.1, 7.3])}
    results.update({("adamw", "docs", o, 0): summary(v, 1e9) for o, v in enumerate([7.0, 7.5, 7.2])})
    st = ss.arm_stats(results, "adamw", corpus=6400)
    assert st["n"] == 3 and st["mean"] == pytest.approx((7.0 + 7.1 + 7.3) / 3)
    assert st["epochs"] == pytest.approx(0.1) and st["finals"] == {"o0s0": 7.0, "o1s0": 7.1, "o2s0": 7.3}
    assert st["curve"]["step"] == [0, 5, 10] and st["curve"]["loss"][-1] == pytest.approx(st["mean"])
    rec = ss.recency(dict(recency_arm="adamw"), results)
    assert rec["docs"]["spread"]["range"] == pytest.approx(0.5) and rec["mix"]["spread"]["range"] == pytest.approx(0.3)


# ----------------------------------------------------------------------------------------------
# Planning


def plan_spec(ss, tmp_path, **kw):
    spec = dict(ss.MODES["full"], mode="full", out=str(tmp_path / "o"), trainer="train_gpt.py", trainer_args=[],
                val_files="v.bin", val_tokens=1000, sweep=dict(ss.MODES["full"]["sweep"]))
    spec.update(kw)
    spec["val_every"] = spec["val_every"] or spec["steps"]
    spec["order_globs"] = {(k, o): f"{k}{o}.bin" for k in ("mix", "docs") for o in range(spec["orders"])}
    return spec


def test_eqtext_control_reads_tst_text_and_has_a_val_point_at_equal_flops(ss, tmp_path):
    spec = plan_spec(ss, tmp_path, steps=300, batch_tokens=512)
    eq = ss.eqtext_plan(spec, "aurora_eqtext")
    assert eq == dict(bag_size=4, switch=90, big_batch=2048, flops_step=75)
    job = ss.make_job(spec, "aurora_eqtext", "mix", 1, 0, ["--matrix-lr", "0.05"])
    first, rest = job.argvs
    assert first[first.index("--batch-tokens") + 1] == "2048" and first[first.index("--max-steps") + 1] == "90"
    assert rest[rest.index("--batch-tokens") + 1] == "512" and rest[rest.index("--resume") + 1] == job.checkpoint
    assert first[first.index("--val-every") + 1] == "75" and first[first.index("--train-files") + 1] == "mix1.bin"
    assert rest[rest.index("--val-every") + 1] == "300"  # the rest only vals at the end
    # FLOPs of the control up to step 75 = 75 * 4 * 512 positions = those of the whole TST run, 300 * 512
    assert 75 * 2048 == 300 * 512
    with pytest.raises(SystemExit, match="--steps 302"):
        ss.eqtext_plan(plan_spec(ss, tmp_path, steps=302), "aurora_eqtext")


def test_cost_estimate_counts_every_val_point(ss, tmp_path, monkeypatch):
    monkeypatch.setattr(ss, "COST", dict(startup_s=1.0, s_per_train_flop=1.0, s_per_val_flop=0.0))
    spec = plan_spec(ss, tmp_path, steps=300, batch_tokens=512, val_every=150)
    tg = ss.trainer_module()
    cfg, _ = tg.parse_config(ss.make_job(spec, "aurora", "mix", 0, 1, []).argvs[0][2:])
    f = tg.model_flops_per_position(cfg)
    assert ss.est_seconds(ss.make_job(spec, "aurora", "mix", 0, 1, [])) == pytest.approx(1 + f * 300 * 512)
    control = ss.make_job(spec, "aurora_eqtext", "mix", 0, 1, [])
    assert ss.est_parts(control) == pytest.approx([1 + f * 90 * 2048, 1 + f * 210 * 512])
    monkeypatch.setattr(ss, "COST", dict(startup_s=0.0, s_per_train_flop=0.0, s_per_val_flop=1.0))
    val = f / 3 * 1000
    assert ss.est_seconds(ss.make_job(spec, "aurora", "mix", 0, 1, [])) == pytest.approx(3 * val)  # 0, 150, 300
    # TST: step 0 is in phase 1 and also scores the TST objective (1000 / 4 latent positions)
    assert ss.est_seconds(ss.make_job(spec, "aurora_tst", "mix", 0, 1, [])) == pytest.approx(3 * val + val / 4)
    assert ss.est_parts(control) == pytest.approx([2 * val, val])  # 0, 75 | 300
    adamw0 = ss.make_job(spec, "adamw", "mix", 0, 0, [])  # the recency arm's seed 0: every 75 steps
    assert ss.est_seconds(adamw0) == pytest.approx(5 * val)


def test_plan_reuses_sweep_runs_and_adds_recency_runs(ss, tmp_path):
    spec = plan_spec(ss, tmp_path)
    sweep, arms = ss.planned_jobs(spec)
    assert len(sweep) == 9 and len(arms) == 6 * 3 * 2 + 3
    reused = [j.run_id for j in arms if ss.is_reused(spec, j)]
    assert sorted(reused) == ["aurora_o0_seed0", "muon_o0_seed0"]  # not adamw: the recency arm vals more often
    assert sorted(j.run_id for j in arms if j.key[1] == "docs") == [f"adamw_docs_o{o}_seed0" for o in range(3)]
    assert len(arms[0].argvs) == 2  # the two-part control runs go first
    sweep_run = [j for j in sweep if j.run_id == "aurora_lr0.00625_seed0"][0]  # the first of the grid
    arm_run = [j for j in arms if j.run_id == "aurora_o0_seed0"][0]
    strip = lambda a: [w for w in a if "lr_sweep" not in w and "aurora_" not in w and not w.endswith("/aurora")]  # noqa
    assert strip(sweep_run.argvs[0]) == strip(arm_run.argvs[0])  # same flags but log dir and run id


def test_run_all_keeps_order_with_parallel_jobs(ss, monkeypatch):
    import threading
    import time
    seen = set()

    def fake_train(job, ledger):
        seen.add(threading.get_ident())
        time.sleep(0.05 * (5 - int(job.run_id)))  # later jobs finish first
        return dict(run_id=job.run_id)

    monkeypatch.setattr(ss, "train", fake_train)
    out = ss.run_all([ss.Job((), "d", str(i), [[]]) for i in range(5)], dict(jobs=2))
    assert [o["run_id"] for o in out] == ["0", "1", "2", "3", "4"]
    assert len(seen) == 2


def test_control_resumes_from_its_checkpoint_and_removes_it(ss, tmp_path, monkeypatch):
    calls = []
    run_dir, ckpt = tmp_path / "arm", tmp_path / "ck" / "r" / "step_000090.pt"
    job = ss.Job(("aurora_eqtext", "mix", 0, 0), str(run_dir), "r", [["a"], ["b"]], str(ckpt))

    def fake_trainer(argv, job_, part, ledger):
        calls.append(argv[0])
        status = "stopped_early" if argv == ["a"] else "complete"
        (run_dir / "r.json").write_text(json.dumps(dict(status=status, final_val_loss=7.0)))
        if argv == ["a"]:
            ckpt.parent.mkdir(parents=True)
            ckpt.write_text("weights")
        return 0

    monkeypatch.setattr(ss, "run_trainer", fake_trainer)
    monkeypatch.setattr(ss, "same_config", lambda *a, **k: True)
    assert ss.train(job, {})["status"] == "complete" and calls == ["a", "b"]
    assert not ckpt.parent.exists()
    # the big-batch part done, the rest not yet (the benchmark stopped in between): only the rest runs
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text("weights")
    (run_dir / "r.json").write_text(json.dumps(dict(status="stopped_early")))
    calls.clear()
    assert ss.train(job, {})["status"] == "complete" and calls == ["b"]
    calls.clear()
    assert ss.train(job, {})["status"] == "complete" and calls == []  # done: skipped


def test_resume_check_names_the_data_by_its_order_folder_and_the_code_by_its_hash(ss, tmp_path):
    import hashlib
    code = tmp_path / "out" / "code"
    code.mkdir(parents=True)
    for name in ("train_gpt.py", "aurora_opt.py"):
        (code / name).write_text(open(os.path.join(REPO, name), encoding="utf-8").read(), encoding="utf-8")
    flags = ["--preset", "cpu_smoke_r21", "--val-files", "data/sample/*_val_*.bin"]
    argv = [sys.executable, str(code / "train_gpt.py"), "--train-files",
            str(tmp_path / "out" / "data" / "mix_o0_0123456789" / "*_train_*.bin"), *flags]

    def write_log(run_id, config, edit_code=False):
        header = []
        for name in ("train_gpt.py", "aurora_opt.py"):
            text = (code / name).read_text(encoding="utf-8")
            text += "# edited\n" if edit_code and name == "aurora_opt.py" else ""
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            header += [f"### file {name} lines={len(text.splitlines())} sha256={digest}\n", text]
        (tmp_path / "arm" / f"{run_id}.txt").write_text("".join(header) + "config: " + json.dumps(config) + "\n",
                                                           encoding="utf-8")

    (tmp_path / "arm").mkdir()
    train_gpt = ss.trainer_module()
    cfg, _ = train_gpt.parse_config(argv[2:])
    config = {k: getattr(cfg, k) for k in list(train_gpt.RUN_DEFINING) + ["train_files", "val_files", "val_every"]}
    moved = dict(config, train_files="/elsewhere/out/data/mix_o0_0123456789/*_train_*.bin")
    write_log("same", moved)  # the output folder was moved: the same order folder, the same code
    assert ss.same_config(str(tmp_path / "arm"), "same", argv, say=False)
    write_log("other_order", dict(config, train_files="/x/data/mix_o1_9876543210/*_train_*.bin"))
    assert not ss.same_config(str(tmp_path / "arm"), "other_order", argv, say=False)
    write_log("other_val", dict(config, val_files="/other/corpus/data/sample/*_val_*.bin"))
    assert not ss.same_config(str(tmp_path / "arm"), "other_val", argv, say=False)  # val globs compare whole
    write_log("other_code", config, edit_code=True)  # a change no flag shows still retrains
    assert not ss.same_config(str(tmp_path / "arm"), "other_code", argv, say=False)
    write_log("other_lr", dict(config, matrix_lr=config["matrix_lr"] * 2))
    assert not ss.same_config(str(tmp_path / "arm"), "other_lr", argv, say=False)


# ----------------------------------------------------------------------------------------------
# Command line


def run_script(tmp_path, *args):
    # timeout: a hang guard only (a loaded machine took over 120 s for the dry run)
    return subprocess.run([sys.executable, "bench/small_scale.py", "--out", str(tmp_path / "o"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_dry_run_prints_the_plan_and_every_arm(tmp_path):
    res = run_script(tmp_path, "--dry-run")
    assert res.returncode == 0, res.stderr
    for arm in ("adamw", "muon", "aurora", "aurora_tst", "aurora_eqtext", "aurora_plain"):
        assert f"--run-id {arm}_o0_seed0" in res.stdout
    assert "--tst-mode full" in res.stdout and "--no-doc-mask" in res.stdout and "--resume-force" in res.stdout
    assert "--run-id adamw_docs_o0_seed0" in res.stdout
    assert "estimated wall time with --jobs 2" in res.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, says", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--orders", "0"], "--orders must be >= 1"),
    (["--arms", "adamw,lion"], "lion"),
    (["--recency-arm", "sgd"], "--recency-arm"),
    (["--adamw-lrs", "0.004,"], "--adamw-lrs"),
    (["--aurora-lrs", "nan"], "finite and > 0"),
    (["--arms", "adamw,adamw"], "adamw named more than once"),
    (["--out", "/proc/small_scale_out"], "name a writable folder"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--steps", "302"], "--steps 302"),
    (["--val-tokens", "10000000"], "--val-tokens 10000000"),
    (["--train-files", "README.md"], "not a token shard"),
    (["--trainer-args", "--tst-frac 2"], "--tst-frac must be in [0, 1)"),
])
def test_bad_arguments_stop_before_anything_runs(tmp_path, args, says):
    res = run_script(tmp_path, *args)
    [line] = res.stderr.strip().splitlines()
    assert res.returncode == 2 and line.startswith("small_scale.py: error: ") and says in line, res.stderr
    assert not (tmp_path / "o").exists()


def test_run_summary_reads_the_log_and_json(ss, tmp_path):
    job = ss.Job(("aurora", "mix", 1, 0), str(tmp_path), "r", [["x"]])
    assert ss.run_summary(job) == dict(status="missing", val=[], key=("aurora", "mix", 1, 0))
    (tmp_path / "r.txt").write_text("\n".join([
        ss.compare.SEPARATOR,
        'config: {"seed": 0}',
        "step:0/4 val_loss:10.8000 train_time:0ms step_avg:0.00ms phase:2 tokens:0 positions:0 flops:0.000e+00",
        "step:4/4 train_loss:8.0000 train_time:40ms step_avg:10.00ms phase:2 tokens:512 positions:512 flops:4.0e+09",
        "step:4/4 val_loss:8.1000 train_time:40ms step_avg:10.00ms phase:2 tokens:512 positions:512 flops:4.0e+09",
        "status:complete"]) + "\n")
    (tmp_path / "r.json").write_text(json.dumps(dict(status="complete", final_val_loss=8.1, flops=4e9)))
    got = ss.run_summary(job)
    assert got["status"] == "complete" and ss.complete(got)
    assert [(p["step"], p["val_loss"], p["flops"]) for p in got["val"]] == [(0, 10.8, 0.0), (4, 8.1, 4e9)]
