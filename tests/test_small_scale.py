"""bench/small_scale.py: data orders, paired statistics, planning, flag checks, and the study's pipeline end to
end at a tiny shape (--quick), with records/verify.py rebuilding a study log's data."""
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

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
    assert len(harness.read_shard(path)) == len(stream)
    assert np.array_equal(harness.TokenStream([path]).read(0, len(stream)), ssd.ordered_tokens(stream, "mix", 1, 8, EOT))
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


def test_pieces_order_puts_every_piece_after_an_eot_and_keeps_the_tail_last(ssd):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, size=103).astype(np.uint16)
    chunk = 9  # pieces of 8 text tokens, each after an EOT: 13 pieces, the last one 7 tokens
    for k in range(3):
        out = ssd.ordered_tokens(tokens, "pieces", k, chunk, EOT)
        pieces = [tokens[i:i + 8].tolist() for i in range(0, 103, 8)]
        perm = np.random.default_rng(k).permutation(12).tolist() + [12]  # order k's draw; the short tail last
        want = [t for i in perm for t in [EOT] + pieces[i]]
        assert out.dtype == np.uint16 and out.tolist() == want
        assert len(out) == 103 + 13
    assert not np.array_equal(ssd.ordered_tokens(tokens, "pieces", 0, chunk, EOT),
                              ssd.ordered_tokens(tokens, "pieces", 1, chunk, EOT))
    with pytest.raises(ssd.OrderError, match="fewer than 2 pieces"):
        ssd.ordered_tokens(tokens[:5], "pieces", 0, chunk, EOT)


def test_a_packed_loader_reads_what_it_trains_on_from_pieces_of_seq_len_plus_1(ssd):
    """Record #89's packed loader on pieces of seq_len + 1 tokens: every sequence is one piece, nothing skipped
    (on whole Wikipedia documents at seq_len 256 it skipped 24 tokens in 25)."""
    sys.path.insert(0, REPO)
    import train_gpt
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=5000).astype(np.uint16)
    seq_len = 16
    out = ssd.ordered_tokens(tokens, "pieces", 0, seq_len + 1, EOT)

    class Stream:
        total, wrap, files = len(out), False, []

        def read(self, start, n):
            return out[start:start + n].astype(np.int64)

    loader = train_gpt.PackedLoader(Stream(), 0, 1)
    micro, raw = loader.next_batch(6, 2, seq_len, 896)
    assert raw == 6 * (seq_len + 1) and len(micro) == 3  # 3 micro-batches of 2 sequences of seq_len + 1 tokens
    got = torch_cat(micro).reshape(6, seq_len + 1)
    assert np.array_equal(got, out[:6 * (seq_len + 1)].reshape(6, seq_len + 1))  # each row: one piece, in order


def torch_cat(micro):
    return np.concatenate([m.numpy().reshape(-1) for m in micro])


def test_a_recipe_rebuilds_its_order_and_refuses_another_corpus(ssd, tmp_path):
    pattern, stream = corpus(tmp_path, [list(range(i, i + 30)) for i in range(0, 900, 30)])
    tokens = ssd.read_corpus(pattern)
    made = ssd.build_order(tokens, str(tmp_path / "study" / "data"), "pieces", 1, 17)
    rec = ssd.recipe(pattern, tokens, made, "pieces", 1, 17)
    assert rec["sha10"] == os.path.basename(os.path.dirname(made)).split("_")[-1] and rec["order"] == 1
    import hashlib
    assert rec["corpus_sha256"] == hashlib.sha256(stream.astype("<u2").tobytes()).hexdigest()
    again = ssd.rebuild(rec, str(tmp_path / "elsewhere"), str(tmp_path))
    assert os.path.basename(os.path.dirname(again)) == rec["folder"]
    import glob
    [a], [b] = glob.glob(made), glob.glob(again)
    assert open(a, "rb").read() == open(b, "rb").read()
    # the command line says the same and rebuilds it from the shell
    cmd = ssd.rebuild_command(rec, str(tmp_path / "cli"))
    assert cmd.startswith("python bench/small_scale_data.py ") and f"--expect {rec['sha10']}" in cmd
    res = subprocess.run([sys.executable] + shlex_split(cmd)[1:], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    [c] = glob.glob(res.stdout.strip())
    assert open(c, "rb").read() == open(a, "rb").read()
    write_shard(tmp_path / "corpus" / "c_train_000002.bin", [EOT, 9, 9, 9])  # another corpus: refused, named
    with pytest.raises(ssd.OrderError, match=f"recipe's are {rec['sha10']}"):
        ssd.rebuild(rec, str(tmp_path / "third"), str(tmp_path))
    assert not (tmp_path / "third" / rec["folder"]).exists()
    res = subprocess.run([sys.executable] + shlex_split(cmd)[1:], cwd=REPO, capture_output=True, text=True, timeout=120)
    [line] = res.stderr.strip().splitlines()
    assert res.returncode == 1 and line.startswith("small_scale_data.py: error: --train-files")


def shlex_split(cmd):
    import shlex
    return shlex.split(cmd)


# ----------------------------------------------------------------------------------------------
# Analysis of finished runs (synthetic summaries)


def summary(final, flops, steps=(0, 5, 10), losses=None):
    losses = losses or [10.0, (10.0 + final) / 2, final]
    val = [dict(step=s, val_loss=v, flops=flops * s / steps[-1], train_time_ms=10.0 * s) for s, v in zip(steps, losses)]
    return dict(status="complete", final_val_loss=final, flops=flops, train_time_ms=100.0, raw_tokens=640, val=val)


def test_every_arm_is_paired_with_the_baseline_by_order_and_seed(ss, capsys):
    spec = dict(arms=["baseline", "tst", "aurora", "tst_aurora"], orders=2, seeds=2, steps=10)
    finals = {"baseline": [7.0, 7.2, 6.9, 7.1], "tst": [6.8, 7.1, 6.9, 6.9], "aurora": [6.0, 6.1, 6.2, 6.0],
              "tst_aurora": [7.1, 7.25, 7.05, 7.2]}
    results = {}
    for arm, vals in finals.items():
        for (o, s), v in zip([(0, 0), (0, 1), (1, 0), (1, 1)], vals):
            results[(arm, "pieces", o, s)] = summary(v, 1e9)
    results[("baseline", "pieces", 1, 1)]["status"] = "incomplete"
    rows = {(r["a"], r["b"]): r for r in ss.comparisons(spec, results)}
    assert set(rows) == {("tst", "baseline"), ("aurora", "baseline"), ("tst_aurora", "baseline")}
    r = rows[("tst", "baseline")]
    assert r["n"] == 3 and r["left_out"] == [((1, 1), "no complete run of baseline")]
    assert "order 1, seed 1" in capsys.readouterr().out
    assert r["mean"] == pytest.approx(np.mean([6.8 - 7.0, 7.1 - 7.2, 6.9 - 6.9]))
    both = rows[("tst_aurora", "baseline")]
    assert both["n"] == 3 and both["mean"] == pytest.approx(0.1) and "10 steps" in both["what"]


def test_first_passing_asks_compare_py_against_the_baselines_final_mean(ss, tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        folders = [c for c in cmd if c.startswith(str(tmp_path))]
        groups = [dict(group=os.path.basename(f), first_passing_step={"tst": 6, "aurora": None}.get(
            os.path.basename(f)), first_passing_val_loss=6.9, first_passing_p=0.004, first_passing_runs=6)
            for f in folders]
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(groups), stderr="")

    monkeypatch.setattr(ss.subprocess, "run", fake_run)
    spec = dict(arms=["baseline", "tst", "aurora"], out=str(tmp_path), steps=10)
    stats = {a: dict(n=6, mean=m) for a, m in (("baseline", 7.0), ("tst", 6.9), ("aurora", 7.1))}
    got = ss.first_passing(spec, stats)
    [cmd] = calls
    assert "--first-passing" in cmd and "--pool-train-data" in cmd and "--json" in cmd
    assert float(cmd[cmd.index("--target") + 1]) == 7.0
    assert got["tst"]["step"] == 6 and got["tst"]["steps_saved"] == 10 - 6 and got["tst"]["target"] == 7.0
    assert got["aurora"]["step"] is None and got["aurora"]["steps_saved"] is None and got["aurora"]["steps"] == 10


def test_first_passing_of_real_logs_through_compare_py(ss, tmp_path):
    """compare.py --first-passing --pool-train-data on logs of two arms: the step where a t-test says below."""
    def log(folder, name, losses):
        (tmp_path / folder).mkdir(exist_ok=True)
        lines = [ss.compare.SEPARATOR, 'config: {"seed": 0}']
        lines += [f"step:{t}/10 val_loss:{v:.4f} train_time:{t}ms step_avg:1.00ms phase:2 tokens:{t} positions:{t} "
                  f"flops:{t}.0e+09" for t, v in zip((0, 5, 10), losses)]
        (tmp_path / folder / f"{name}.txt").write_text("\n".join(lines + ["status:complete"]) + "\n")

    for i, d in enumerate((0.00, 0.01, -0.01)):
        log("baseline", f"b{i}", [10.8, 8.0 + d, 7.0 + d])
        log("tst", f"t{i}", [10.8, 6.9 + d / 2, 6.5 + d])
    spec = dict(arms=["baseline", "tst"], out=str(tmp_path), steps=10)
    got = ss.first_passing(spec, {"baseline": dict(n=3, mean=7.0), "tst": dict(n=3, mean=6.5)})
    assert got["tst"]["step"] == 5 and got["tst"]["steps_saved"] == 5
    assert got["tst"]["p"] < 0.01 and got["tst"]["val_loss"] == pytest.approx(6.9)
    assert got["baseline"]["step"] is None  # its final mean is the target: never below it


def test_arm_stats_over_orders_and_seeds(ss):
    results = {("baseline", "pieces", o, 0): summary(v, 1e9) for o, v in enumerate([7.0, 7.1, 7.3])}
    st = ss.arm_stats(results, "baseline", corpus=6400)
    assert st["n"] == 3 and st["mean"] == pytest.approx((7.0 + 7.1 + 7.3) / 3)
    assert st["epochs"] == pytest.approx(0.1) and st["finals"] == {"o0s0": 7.0, "o1s0": 7.1, "o2s0": 7.3}
    assert st["curve"]["step"] == [0, 5, 10] and st["curve"]["loss"][-1] == pytest.approx(st["mean"])


# ----------------------------------------------------------------------------------------------
# Planning


def plan_spec(ss, tmp_path, **kw):
    spec = dict(ss.MODES["full"], mode="full", out=str(tmp_path / "o"), trainer="train_gpt.py", trainer_args=[],
                val_files="v.bin")
    spec.update(kw)
    spec["order_globs"] = {o: f"pieces{o}.bin" for o in range(spec["orders"])}
    return spec


def test_arms_are_the_preset_without_and_with_our_methods(ss, tmp_path):
    tg = ss.trainer_module()
    spec = plan_spec(ss, tmp_path)
    cfg = {arm: ss.parse_config(ss.make_job(spec, arm, 0, 0, 0.05).argvs[0][2:]) for arm in ss.ARMS}
    base = dict(tg.PRESETS["cpu_baseline"], matrix_lr=0.05, num_iterations=100, val_every=10, log_every=5, seed=0)
    ours = tg.PRESETS["record_h200"]
    for arm, c in cfg.items():  # cpu_baseline's every field but the study's own (data, lr, val cadence, logs)
        assert {k: getattr(c, k) for k in base if "files" not in k} == {k: v for k, v in base.items()
                                                                        if "files" not in k}, arm
        assert c.model == "smoke" and c.seq_len == 768 and c.batch_tokens == 2304
        assert (c.tst_frac > 0, c.optimizer == ours["optimizer"]) == ("tst" in arm, "aurora" in arm), arm
    assert (cfg["baseline"].optimizer, cfg["baseline"].tst_frac) == ("normuon", 0.0)
    assert (cfg["tst_aurora"].optimizer, cfg["tst_aurora"].tst_frac, cfg["tst_aurora"].tst_bag_size) == (
        ours["optimizer"], ours["tst_frac"], ours["tst_bag_size"])  # record_h200's (= cpu_smoke's) methods
    # equal FLOPs: every arm's schedule trains the same positions with the same FLOPs per position
    flops = {arm: sum(r.stage.batch_tokens * r.flops_per_position for r in tg.Schedule(c, tg.MODELS[c.model]).rows[:-1])
             for arm, c in cfg.items()}
    assert max(flops.values()) == pytest.approx(min(flops.values()), rel=1e-12)


def test_cost_estimate_sums_the_stage_table_and_every_val_point(ss, tmp_path, monkeypatch):
    tg = ss.trainer_module()
    spec = plan_spec(ss, tmp_path)
    job = ss.make_job(spec, "baseline", 0, 1, 0.02)
    cfg = ss.parse_config(job.argvs[0][2:])
    rows = tg.Schedule(cfg, tg.MODELS[cfg.model]).rows
    monkeypatch.setattr(ss, "COST", dict(startup_s=1.0, s_per_train_flop=1.0, s_per_val_flop=0.0, s_per_param_step=0.0))
    by_hand = 1.0
    for t in range(100):  # stages 1, 2, 3: a third, two thirds, all of 2,304 positions
        by_hand += rows[t].stage.batch_tokens * rows[t].flops_per_position
    assert ss.est_seconds(job) == pytest.approx(by_hand)
    assert {r.stage.batch_tokens for r in rows} == {768, 1536, 2304}
    monkeypatch.setattr(ss, "COST", dict(startup_s=0.0, s_per_train_flop=0.0, s_per_val_flop=1.0, s_per_param_step=0.0))
    val = rows[0].flops_per_position / 3 * 16384
    assert ss.est_seconds(job) == pytest.approx(11 * val)  # steps 0, 10, ..., 100
    tst = ss.make_job(spec, "tst", 0, 1, 0.02)  # + the bag objective's val in phase 1 (steps 0, 10, 20, 30)
    assert ss.est_seconds(tst) == pytest.approx(11 * val + 4 * val / 4)
    monkeypatch.setattr(ss, "COST", dict(startup_s=0.0, s_per_train_flop=0.0, s_per_val_flop=0.0, s_per_param_step=1.0))
    with torch.device("meta"):  # the optimizer term: every parameter, every step
        n_params = sum(p.numel() for p in tg.build_model(cfg, tg.MODELS[cfg.model]).parameters())
    assert ss.est_seconds(job) == pytest.approx(100 * n_params)


def test_plan_reuses_the_sweep_run_as_the_baselines_first(ss, tmp_path):
    spec = plan_spec(ss, tmp_path)
    sweep, arms = ss.planned_jobs(spec)
    assert len(sweep) == 3 and len(arms) == 4 * 3 * 2
    assert [j.run_id for j in arms if ss.is_reused(spec, j)] == ["baseline_o0_seed0"]
    chosen = [j for j in sweep if j.run_id == "baseline_lr0.023_seed0"][0]
    arm_run = [j for j in arms if j.run_id == "baseline_o0_seed0"][0]
    strip = lambda a: [w for w in a if "lr_sweep" not in w and "baseline" not in w]  # noqa: E731
    assert strip(chosen.argvs[0]) == strip(arm_run.argvs[0])  # same flags but log dir and run id


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
    idle = dict(runs=[dict(run="adamw/a_o0_seed0", load_start=1.0, load_end=2.0)] * 2)
    plots, notes, text = ss.make_plots(str(tmp_path), ["adamw", "aurora", "muon"], stats, 7.3, idle)
    assert len(calls) == 2 and text == "table" and notes == [] and [os.path.basename(p) for p, _ in plots] == [
        "val_loss_vs_flops.png", "val_loss_vs_time.png"]
    for cmd in calls:
        assert "--pool-train-data" in cmd and cmd[cmd.index("--target") + 1] == "7.3000"
        assert [c for c in cmd if c.startswith(str(tmp_path))][:2] == [str(tmp_path / "adamw"), str(tmp_path / "aurora")]
    # one run on loaded cores: its train time measures the other jobs, so no time plot, and the note says why
    loaded = dict(runs=idle["runs"] + [dict(run="aurora/a_o1_seed0", load_start=7.5, load_end=5.0)])
    calls.clear()
    plots, notes, _ = ss.make_plots(str(tmp_path), ["adamw", "aurora", "muon"], stats, 7.3, loaded)
    assert [os.path.basename(p) for p, _ in plots] == ["val_loss_vs_flops.png"] and len(calls) == 1
    assert notes and "1 of 3 runs shared the 2 cores" in notes[0] and "`aurora/a_o1_seed0`" in notes[0], notes



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



def test_resume_check_names_the_data_by_its_order_folder_and_the_code_by_its_hash(ss, tmp_path):
    import hashlib
    code = tmp_path / "out" / "code"
    code.mkdir(parents=True)
    for name in ("train_gpt.py", "aurora_opt.py"):
        (code / name).write_text(open(os.path.join(REPO, name), encoding="utf-8").read(), encoding="utf-8")
    flags = ["--preset", "cpu_baseline", "--val-files", "data/sample/*_val_*.bin"]
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
    cfg = ss.parse_config(argv[2:])
    config = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in train_gpt.OPERATIONAL or k in ("train_files", "val_files", "val_every")}
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


# ----------------------------------------------------------------------------------------------
# Command line


def run_script(tmp_path, *args, timeout=600):
    # timeout: a hang guard only (a loaded machine took over 120 s for the dry run)
    return subprocess.run([sys.executable, "bench/small_scale.py", "--out", str(tmp_path / "o"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_plan_and_every_arm(tmp_path):
    res = run_script(tmp_path, "--dry-run")
    assert res.returncode == 0, res.stderr
    for arm in ("baseline", "tst", "aurora", "tst_aurora"):
        assert f"--run-id {arm}_o0_seed0" in res.stdout
    assert "--preset cpu_baseline " in res.stdout and "--optimizer aurora_normuon" in res.stdout
    assert "estimated wall time with --jobs 2" in res.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, says", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--orders", "0"], "--orders must be >= 1"),
    (["--arms", "baseline,lion"], "lion"),
    (["--lrs", "0.004,"], "--lrs"),
    (["--lrs", "nan"], "finite and > 0"),
    (["--arms", "tst,tst"], "tst named more than once"),
    (["--out", "/proc/small_scale_out"], "name a writable folder"),
    # --dry-run: were '' taken as "not given", the study would plan in the default folder, not run there
    (["--out", "", "--dry-run"], "--out '': an empty folder name; name a folder, or leave --out out for the default "
                                 "records/cpu/"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--batch-tokens", "700"], "multiple of 3 x seq_len 768"),
    (["--val-tokens", "10000000"], "--val-tokens 10000000"),
    (["--train-files", "README.md"], "not a token shard"),
    (["--trainer-args", "--cooldown-frac 2"], "--cooldown-frac must be >= 0.0 and < 1.0"),
    # a flag the study sets itself would override every arm, the sweep or the seeds (the last one wins)
    (["--trainer-args", "--tst-frac 0.2"], "--tst-frac is set by the study itself"),
    (["--trainer-args=--seed=3"], "--seed is set by the study itself"),
    (["--trainer-args", "--preset baseline_h200"], "--preset is set by the study itself"),
    (["--steps", "1"], "--steps 1: the arms' stage table needs at least 5 steps"),  # cpu_baseline: 2 extension steps
    (["--steps", "4"], "give --steps 5 or more"),
])
def test_bad_arguments_stop_before_anything_runs(ss, tmp_path, capsys, args, says):
    rc = ss.cli(["--out", str(tmp_path / "o"), *args])  # in process: the command line's own path, no start-up
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert rc == 2 and line.startswith("small_scale.py: error: ") and says in line, err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The study's pipeline end to end at the quick mode's tiny shape (4 trainer processes, 2 at a time)."""
    out = tmp_path_factory.mktemp("quick") / "study"
    res = subprocess.run([sys.executable, "bench/small_scale.py", "--quick", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


@pytest.mark.slow  # the study's pipeline end to end (the quick fixture's trainer runs)
def test_quick_study_writes_results_plots_recipes_and_its_command(quick):
    md = (quick / "results.md").read_text()
    for arm in ("baseline", "+tst+aurora"):
        assert f"| {arm} |" in md
    assert "| tst_aurora vs baseline |" in md
    assert "## First-passing step" in md and "--first-passing" in md
    assert (quick / "command.txt").read_text().startswith("python bench/small_scale.py --quick --out ")
    for png in ("val_curves.png", "differences.png", "val_loss_vs_flops.png"):
        assert (quick / png).stat().st_size > 0 and f"`{png}`" in md
    res = json.loads((quick / "results.json").read_text())
    assert set(res["first_passing"]) == {"baseline", "tst_aurora"}
    assert res["first_passing"]["tst_aurora"]["target"] == pytest.approx(res["arms"]["baseline"]["mean"])
    recipes = json.loads((quick / "data_recipes.json").read_text())
    assert sorted(r["order"] for r in recipes.values()) == [0, 1]
    for folder, r in recipes.items():
        assert r["kind"] == "pieces" and r["chunk"] == 17 and (quick / "data" / folder).is_dir()
        assert r["command"].startswith("python bench/small_scale_data.py ")
    logs = sorted((quick / "tst_aurora").glob("*.txt"))
    assert len(logs) == 2 and all('"optimizer": "aurora_normuon"' in p.read_text() for p in logs)


@contextlib.contextmanager
def study_copy(quick, tmp_path):
    """The quick study without data/ and code/ (git-ignored: what a fresh clone holds) and verify's command on a
    log of it; the study's own data/ (where its logs' data globs point) is moved aside meanwhile."""
    import shutil
    study = tmp_path / "study"
    shutil.copytree(quick, study, ignore=shutil.ignore_patterns("data", "code"))
    log = study / "tst_aurora" / "tst_aurora_o1_seed0.txt"  # 5 steps, a train line at step 5
    (quick / "data").rename(quick / "data.aside")
    try:
        yield study, [sys.executable, os.path.join(REPO, "records", "verify.py"), str(log), "--rerun", "5",
                      "--extract", str(tmp_path / "src")]
    finally:
        (quick / "data.aside").rename(quick / "data")


@pytest.mark.slow  # the study's pipeline end to end (the quick fixture's trainer runs)
def test_verify_rebuilds_a_study_logs_missing_data_from_its_recipe(quick, tmp_path):
    with study_copy(quick, tmp_path) as (_, verify):
        res = subprocess.run(verify, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "was missing: rebuilt from its recipe" in res.stdout and "OK" in res.stdout.splitlines()[-1]


@pytest.mark.slow  # the study's pipeline end to end (the quick fixture's trainer runs)
def test_verify_names_the_command_when_a_study_order_cannot_be_rebuilt(quick, tmp_path):
    with study_copy(quick, tmp_path) as (study, verify):
        recipes = json.loads((study / "data_recipes.json").read_text())
        for r in recipes.values():
            r["train_files"] = "data/nowhere/*_train_*.bin"
        (study / "data_recipes.json").write_text(json.dumps(recipes))
        res = subprocess.run(verify, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    [line] = [ln for ln in res.stdout.splitlines() if "cannot be rebuilt" in ln]
    assert res.returncode == 1 and "python bench/small_scale_data.py --train-files 'data/nowhere/*_train_*.bin'" in line
    assert "--kind pieces --order 1 --chunk 17" in line and "Traceback" not in res.stdout + res.stderr
