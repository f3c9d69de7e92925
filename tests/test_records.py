"""records/compare.py and records/verify.py on real logs of ours and on modded-nanogpt-shaped logs.

One short real run (cpu_smoke with the tests' tiny model, 6 steps, on the repository's data/sample
shards) is made once per session from a copy of the trainer taken at the start (``tiny_tree``: it
registers the tiny model, so the log re-runs by itself), so that edits to the working tree during
the session cannot make the snapshot and the "working tree" disagree; verify compares against
that copy (``--repo``). The modded-nanogpt-shaped logs are written here (``peer_logs``): invented
names, code and values in the shape of that repository's record logs.
"""
import glob
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import uuid

import numpy as np
import pytest
from scipy import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "records")
DATA = "data/sample"  # relative to the repo root, where runs are launched
sys.path.insert(0, RECORDS)

import compare  # noqa: E402
import harness  # noqa: E402
import verify  # noqa: E402
from tiny_tree import trainer_copy  # noqa: E402


def run_tool(script, *args):
    """Run records/<script> as a user would (from the repo root); returns the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(RECORDS, script), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    """A real complete log: dict(log=path, tree=dir with the exact code it ran, json=summary)."""
    root = tmp_path_factory.mktemp("fresh")
    tree = trainer_copy(root / "tree")
    cmd = [sys.executable, str(tree / "train_gpt.py"), "--preset", "cpu_smoke", "--model", "tiny",
           "--train-files", f"{DATA}/*_train_*.bin", "--val-files", f"{DATA}/*_val_*.bin",
           "--num-iterations", "6", "--val-every", "3", "--val-tokens", "1024", "--log-every", "1",
           "--seq-len", "64", "--batch-tokens", "192",  # stage k: one sequence of k x 64; TST phase 1 for 2 steps
           "--device", "cpu", "--no-compile", "--log-dir", str(root / "logs"), "--run-id", "fresh"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(root / "logs" / "fresh.json") as f:
        summary = json.load(f)
    return dict(log=str(root / "logs" / "fresh.txt"), tree=str(tree), json=summary, root=root)


def read_text(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def after_snapshot(text):
    """Our log's lines from the first environment line on, found without compare.py's parser."""
    lines = text.split("\n")
    for i, ln in enumerate(lines):
        if ln.startswith("python: ") and lines[i - 1] == compare.SEPARATOR:
            return lines[i:]
    raise AssertionError("no environment line after a separator")


# ----------------------------------------------------------------------------------------------
# Our format


def test_parse_our_log(fresh):
    run = compare.parse_log(fresh["log"])
    assert run.fmt == "ours" and run.complete and run.status == "complete"
    assert run.total_steps == 6
    assert [p["step"] for p in run.val] == [0, 3, 6]
    assert [p["step"] for p in run.train] == [1, 2, 3, 4, 5, 6]
    # against the JSON summary the trainer wrote beside the log (full precision there)
    js = fresh["json"]
    assert abs(run.final["val_loss"] - js["final_val_loss"]) <= 5e-5
    assert run.raw_tokens == js["raw_tokens"] and run.summary["positions"] == js["positions"]
    assert run.flops == pytest.approx(js["flops"], rel=1e-3)
    # against a plain reading of the step lines after the snapshot
    tail = after_snapshot(read_text(fresh["log"]))
    vals = [ln for ln in tail if ln.startswith("step:") and " val_loss:" in ln]
    last = dict(w.split(":", 1) for w in vals[-1].split()[1:])
    assert run.final["val_loss"] == float(last["val_loss"])
    assert run.final["train_time_ms"] == float(last["train_time"].removesuffix("ms"))
    trains = [ln for ln in tail if ln.startswith("step:") and " train_loss:" in ln]
    assert [p["train_loss"] for p in run.train] == [float(ln.split()[1].split(":")[1]) for ln in trains]
    # a val line's tokens are those of the train line of the same step; FLOPs are logged on val lines only
    v3 = run.val[1]
    t3 = [p for p in run.train if p["step"] == 3][0]
    assert v3["tokens"] == t3["tokens"] > 0 and v3["flops"] > 0 and t3["flops"] is None
    assert (run.val[0]["tokens"], run.val[0]["flops"]) == (0, 0) and run.val[-1]["flops"] == run.flops
    assert [p["phase"] for p in run.train] == [1, 1, 2, 2, 2, 2]  # cpu_smoke's TST: round(0.3 x 6) steps


def test_truncated_our_log_is_incomplete_and_not_counted(fresh, tmp_path):
    text = read_text(fresh["log"])
    lines = text.splitlines(keepends=True)
    cut = next(i for i, ln in enumerate(lines) if ln.startswith("step:4/6 train_loss:"))
    folder = tmp_path / "grp"
    folder.mkdir()
    write_text(folder / "a_complete.txt", text)
    write_text(folder / "b_cut_steps.txt", "".join(lines[:cut + 1]))
    write_text(folder / "c_cut_snapshot.txt", "".join(lines[:200]))
    write_text(folder / "d_cut_mid_line.txt", text[:text.index("step:6/6 val_loss:") + 12])
    runs = {r.name: r for r in compare.collect([str(folder)])}
    assert runs["a_complete"].complete
    assert not runs["b_cut_steps"].complete and "no status line" in runs["b_cut_steps"].reason
    assert runs["b_cut_steps"].val[-1]["step"] == 3
    assert not runs["c_cut_snapshot"].complete and "snapshot" in runs["c_cut_snapshot"].reason
    assert not runs["d_cut_mid_line"].complete
    [row] = compare.group_stats(list(runs.values()))
    assert row["group"] == "grp" and row["runs"] == 1 and len(row["incomplete"]) == 3
    assert row["mean_val_loss"] == runs["a_complete"].final["val_loss"]
    assert math.isnan(row["p_value"]) and math.isnan(row["std_val_loss"])  # one run: no test


def test_stopped_early_log_is_incomplete(fresh, tmp_path):
    text = read_text(fresh["log"]).replace("status:complete", "status:stopped_early reason:--max-steps 6")
    write_text(tmp_path / "stopped.txt", text)
    run = compare.parse_log(str(tmp_path / "stopped.txt"))
    assert not run.complete and "stopped_early" in run.reason and "--max-steps 6" in run.reason


def test_step_lines_inside_the_code_snapshot_are_not_read(fresh, tmp_path):
    """Fake step/summary/status lines inside train_gpt.py's snapshot must change nothing."""
    text = read_text(fresh["log"])
    lines = text.splitlines(keepends=True)
    header = compare.HEADER_RE.match(lines[0])
    fake = ["step:6/6 val_loss:0.1234 train_time:1ms step_avg:1.00ms\n",
            "step:7/6 train_loss:0.5000 train_time:1ms step_avg:1.00ms tokens:1 flops:1\n",
            "summary: final_val_loss:0.1234 train_time:1ms steps:6\n", "status:complete\n"]
    new_header = f"### file {header['name']} lines={int(header['lines']) + len(fake)} sha256={header['sha']}\n"
    edited = [new_header] + lines[1:11] + fake + lines[11:]
    write_text(tmp_path / "fake_in_code.txt", "".join(edited))
    good, bad = compare.parse_log(fresh["log"]), compare.parse_log(str(tmp_path / "fake_in_code.txt"))
    assert bad.complete and bad.final == good.final and bad.val == good.val and bad.train == good.train
    assert bad.summary == good.summary
    # cut after the snapshot, before the first real step line: the fake step:6/6 val line and
    # status:complete in the code must not make a complete run out of it
    cut = next(i for i, ln in enumerate(edited) if ln.startswith("model: "))
    write_text(tmp_path / "fake_cut.txt", "".join(edited[:cut]))
    cut_run = compare.parse_log(str(tmp_path / "fake_cut.txt"))
    assert not cut_run.complete and cut_run.val == [] and cut_run.status == ""


def test_modded_log_with_code_above_separator(tmp_path):
    code = ['import torch\n', 'step:1480/1480 val_loss:1.0000 train_time:5ms step_avg:1.00ms\n',
            'print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f}")\n']
    steps = ["step:0/20 val_loss:10.8258 train_time:0ms step_avg:nanms\n",
             "step:10/20 train_loss:4.0000 train_time:900ms step_avg:90.00ms\n",
             "step:20/20 val_loss:3.2750 train_time:1800ms step_avg:90.00ms\n",
             "peak memory allocated: 100 MiB reserved: 120 MiB\n"]
    write_text(tmp_path / "m.txt", "".join(code + [compare.SEPARATOR + "\n", "Running pytorch\n"] + steps))
    run = compare.parse_log(str(tmp_path / "m.txt"))
    assert run.fmt == "modded" and run.complete
    assert [p["step"] for p in run.val] == [0, 20] and run.final["val_loss"] == 3.2750
    assert run.final["train_time_ms"] == 1800 and run.total_steps == 20


# ----------------------------------------------------------------------------------------------
# Logs of the modded-nanogpt shape, written here: invented names, code and values

# A made-up training script as such logs carry it above the separator, with a line inside
# that looks like a step line (the parser must not read it).
MODDED_CODE = '''import os
import time

import torch


def report(step, total, loss, elapsed_ms):
    """Print one progress line, e.g.
step:3/3 val_loss:1.2345 train_time:30ms step_avg:10.00ms
    """
    avg = elapsed_ms / max(step, 1)
    print(f"step:{step}/{total} val_loss:{loss:.4f} train_time:{elapsed_ms:.0f}ms step_avg:{avg:.2f}ms")
'''
# group (the file-name part before the last "__"): runs, steps N, val every M steps, mean final val loss
PEER_GROUPS = {
    "2025-02-10_FastRun__2025-02-10_FastRun": (12, 600, 125, 3.2755),  # clearly below 3.28
    "2025-03-21_OneRun__2025-03-21_OneRun": (1, 800, 200, 3.2790),
    "2025-04-02_Tweak__2025-04-02_Tweak": (3, 500, 100, 3.2800),
}
FAST, ONE, TWEAK = PEER_GROUPS


def modded_run_text(rng, n, every, final):
    """One run's log: code, separator, environment, step lines (train every step, val every
    ``every`` and at ``n``), peak memory. ``final`` is the last val loss (4 decimals)."""
    step_ms = rng.uniform(55.0, 65.0)
    elapsed = np.concatenate([[0.0], np.cumsum(rng.normal(step_ms, 2.0, n).clip(min=1.0))])  # ms after step k
    lines = [MODDED_CODE, compare.SEPARATOR, "env: python 3.12.3 torch 2.6.0 world_size 8",
             f"step:0/{n} val_loss:{rng.normal(10.83, 0.002):.4f} train_time:0ms step_avg:nanms"]
    for k in range(1, n + 1):
        ms = int(elapsed[k])
        curve = final + (10.83 - final) * (1 - k / n) ** 3  # falls from ~10.8 to the final value
        lines.append(f"step:{k}/{n} train_loss:{curve + rng.normal(0, 0.05):.4f} train_time:{ms}ms "
                     f"step_avg:{ms / k:.2f}ms")
        if k == n:
            lines.append(f"step:{k}/{n} val_loss:{final:.4f} train_time:{ms}ms step_avg:{ms / k:.2f}ms")
        elif k % every == 0:
            lines.append(f"step:{k}/{n} val_loss:{curve + rng.normal(0, 0.003):.4f} train_time:{ms}ms "
                         f"step_avg:{ms / k:.2f}ms")
    lines.append(f"peak memory allocated: {int(rng.integers(20000, 30000))} MiB "
                 f"reserved: {int(rng.integers(30000, 40000))} MiB")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def peer_logs(tmp_path_factory):
    """A folder of modded-nanogpt-shaped logs named ``<date>_<Name>__<date>_<Name>__<uuid>.txt``
    (``PEER_GROUPS``); returns dict(dir=folder, files={group: sorted paths})."""
    folder = tmp_path_factory.mktemp("peer_logs")
    rng = np.random.default_rng(20250210)
    files = {}
    for group, (runs, n, every, mean) in PEER_GROUPS.items():
        for final in np.round(rng.normal(mean, 0.0012, runs), 4):
            path = folder / f"{group}__{uuid.UUID(bytes=rng.bytes(16), version=4)}.txt"
            write_text(path, modded_run_text(rng, n, every, float(final)))
            files.setdefault(group, []).append(str(path))
    return dict(dir=str(folder), files={g: sorted(f) for g, f in files.items()})


def grep_final(path):
    """(step, N, val loss, train time ms) of a log's final val line by a plain reading: the last
    line with 'val_loss:' in it."""
    with open(path) as f:
        last = [ln for ln in f if "val_loss:" in ln][-1]
    m = re.match(r"step:(\d+)/(\d+) val_loss:([\d.]+) train_time:(\d+)ms", last)
    return int(m[1]), int(m[2]), float(m[3]), int(m[4])


def test_peer_logs_grouped_by_prefix(peer_logs):
    runs = compare.collect([peer_logs["dir"]], group_by="prefix")
    rows = {r["group"]: r for r in compare.group_stats(runs)}
    assert {g: r["runs"] for g, r in rows.items()} == {FAST: 12, ONE: 1, TWEAK: 3}
    assert all(not r["incomplete"] for r in rows.values())

    for group, (_, n, every, _) in PEER_GROUPS.items():
        expected = {os.path.basename(f)[:-4]: grep_final(f) for f in peer_logs["files"][group]}
        mine = [r for r in runs if r.group == group]
        assert sorted(r.name for r in mine) == sorted(expected)
        for r in mine:
            step, total, loss, ms = expected[r.name]
            assert (r.final["step"], r.total_steps, r.final["val_loss"], r.final["train_time_ms"]) == \
                (step, total, loss, ms) and step == total == n
            assert [p["step"] for p in r.val] == sorted({*range(0, n, every), n}) and len(r.train) == n
        losses = [v[2] for v in expected.values()]
        row = rows[group]
        assert row["steps"] == n and row["tokens"] is None and row["flops"] is None
        assert row["mean_val_loss"] == pytest.approx(np.mean(losses), abs=1e-12)
        assert row["mean_train_time_ms"] == pytest.approx(np.mean([v[3] for v in expected.values()]))
        if len(losses) > 1:
            assert row["std_val_loss"] == pytest.approx(np.std(losses, ddof=1), rel=1e-9)
            assert row["p_value"] == pytest.approx(stats.ttest_1samp(losses, 3.28, alternative="less").pvalue,
                                                   rel=1e-9)
    assert rows[FAST]["p_value"] < 0.01 and rows[TWEAK]["p_value"] > 0.01
    one = rows[ONE]
    assert math.isnan(one["p_value"]) and math.isnan(one["std_val_loss"])
    _, _, loss, ms = grep_final(peer_logs["files"][ONE][0])
    assert (one["mean_val_loss"], one["mean_train_time_ms"], one["steps"]) == (loss, ms, 800)


def test_truncated_peer_log_is_incomplete(peer_logs, tmp_path):
    src = peer_logs["files"][FAST][:2]
    _, n, every, _ = PEER_GROUPS[FAST]
    shutil.copyfile(src[0], tmp_path / os.path.basename(src[0]))
    with open(src[1]) as f:
        lines = f.readlines()
    last_val = max(i for i, ln in enumerate(lines) if "val_loss:" in ln)
    (tmp_path / os.path.basename(src[1])).write_text("".join(lines[:last_val - 3]))
    [row] = compare.group_stats(compare.collect([str(tmp_path)]))
    before_last = (n - 1) // every * every  # the val line before the final one: step 500 of 600
    assert row["runs"] == 1 and len(row["incomplete"]) == 1
    assert f"step {before_last} of {n}" in row["incomplete"][0]
    assert row["mean_val_loss"] == grep_final(src[0])[2]
    # cut in the middle of the final val line's number: that partial line must not count
    text = "".join(lines)
    partial = text[:text.index(f"step:{n}/{n} val_loss:") + len(f"step:{n}/{n} val_loss:3.2")]
    (tmp_path / "partial.txt").write_text(partial)
    run = compare.parse_log(str(tmp_path / "partial.txt"))
    assert not run.complete and run.final["step"] == before_last and run.train[-1]["step"] == n


# ----------------------------------------------------------------------------------------------
# statistics


def modded_log(path, final_loss, n=100, ms=5000):
    write_text(path, f"step:0/{n} val_loss:10.8258 train_time:0ms step_avg:nanms\n"
                     f"step:{n}/{n} val_loss:{final_loss:.4f} train_time:{ms}ms step_avg:{ms / n:.2f}ms\n")


def test_statistics_match_hand_computed_values(tmp_path):
    # 3 runs 3.277, 3.278, 3.279: mean 3.278, std 0.001, t = -0.002/(0.001/sqrt(3)) = -2*sqrt(3);
    # Student t with 2 dof has cdf(t) = 1/2 + t / (2 sqrt(2 + t^2)) = 1/2 - sqrt(3)/sqrt(14).
    for i, x in enumerate([3.277, 3.278, 3.279]):
        modded_log(tmp_path / f"three__{i}.txt", x, ms=1000 * (i + 1))
    for i, x in enumerate([3.2770, 3.2781, 3.2795, 3.2760, 3.2802]):
        modded_log(tmp_path / f"five__{i}.txt", x)
    rows = {r["group"]: r for r in compare.group_stats(compare.collect([str(tmp_path)], "prefix"))}
    three = rows["three"]
    assert three["runs"] == 3 and three["steps"] == 100
    assert three["mean_val_loss"] == pytest.approx(3.278, abs=1e-12)
    assert three["std_val_loss"] == pytest.approx(0.001, rel=1e-6)
    assert three["p_value"] == pytest.approx(0.5 - math.sqrt(3) / math.sqrt(14), rel=1e-6)  # 0.0370899
    assert three["mean_train_time_ms"] == 2000
    five = rows["five"]
    x = np.array([3.2770, 3.2781, 3.2795, 3.2760, 3.2802])
    m, s = x.sum() / 5, math.sqrt(((x - x.sum() / 5) ** 2).sum() / 4)
    t = (m - 3.28) / (s / math.sqrt(5))
    assert five["mean_val_loss"] == pytest.approx(m, abs=1e-12)
    assert five["std_val_loss"] == pytest.approx(s, rel=1e-9)
    assert five["p_value"] == pytest.approx(stats.t.cdf(t, df=4), rel=1e-9)
    # another target moves the test
    other = compare.group_stats(compare.collect([str(tmp_path)], "prefix"), target=3.2785)
    assert other[0]["p_value"] > three["p_value"]


@pytest.mark.parametrize("bad", ["nan", "-inf", "inf"])
def test_non_finite_final_val_loss_is_incomplete(tmp_path, bad):
    for i, x in enumerate([3.277, 3.279]):
        modded_log(tmp_path / f"g__{i}.txt", x)
    write_text(tmp_path / "g__bad.txt", "step:0/100 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
                                        f"step:100/100 val_loss:{bad} train_time:5000ms step_avg:50.00ms\n")
    runs = compare.collect([str(tmp_path)], "prefix")
    bad_run = [r for r in runs if r.name == "g__bad"][0]
    assert not bad_run.complete and bad_run.reason == f"non-finite final val loss ({bad})"
    [row] = compare.group_stats(runs)
    assert row["runs"] == 2 and row["mean_val_loss"] == pytest.approx(3.278, abs=1e-12)
    assert row["incomplete"] == [f"g__bad (non-finite final val loss ({bad}))"]
    # our format: status:complete does not make a nan final val loss count either
    write_text(tmp_path / "ours.txt", "config: {}\nstep:0/2 val_loss:10.8 train_time:0ms\n"
                                      f"step:2/2 val_loss:{bad} train_time:9ms\nstatus:complete\n")
    assert compare.parse_log(str(tmp_path / "ours.txt")).reason == f"non-finite final val loss ({bad})"


def test_plot_skips_non_finite_points(tmp_path):
    write_text(tmp_path / "a.txt", "step:0/100 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
                                   "step:50/100 val_loss:nan train_time:2500ms step_avg:50.00ms\n"
                                   "step:100/100 val_loss:3.2790 train_time:5000ms step_avg:50.00ms\n")
    write_text(tmp_path / "b.txt", "step:0/100 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
                                   "step:50/100 val_loss:4.0000 train_time:2500ms step_avg:50.00ms\n"
                                   "step:60/100 val_loss:inf train_time:3000ms step_avg:50.00ms\n")
    write_text(tmp_path / "c.txt", "step:100/100 val_loss:-inf train_time:5000ms step_avg:50.00ms\n")
    out = tmp_path / "p.png"
    proc = run_tool("compare.py", tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt", "--plot", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot: a (a): left out 1 non-finite point" in proc.stderr
    assert "plot: b (b): left out 1 non-finite point" in proc.stderr
    assert "plot: skipped c (c): no finite val point" in proc.stderr


@pytest.mark.parametrize("target", ["inf", "nan", "-inf"])
def test_target_must_be_finite(tmp_path, target):
    modded_log(tmp_path / "a.txt", 3.27)
    proc = run_tool("compare.py", tmp_path / "a.txt", f"--target={target}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"argument --target: expected a finite number, got {target!r}" in proc.stderr


def test_plot_into_a_missing_folder_is_one_error_line(tmp_path):
    modded_log(tmp_path / "a.txt", 3.27)
    for out in ("/nonexistent/dir/p.png", str(tmp_path / "a.txt" / "p.png")):
        proc = run_tool("compare.py", tmp_path / "a.txt", "--plot", out)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"compare.py: error: --plot {out}: ") and "no folder" in line, line


def test_unreadable_entries_are_listed_and_the_rest_compared(tmp_path, monkeypatch):
    grp = tmp_path / "grp"
    grp.mkdir()
    for i, x in enumerate([3.277, 3.279]):
        modded_log(grp / f"r{i}.txt", x)
    (grp / "sub.txt").mkdir()
    os.symlink("self.txt", grp / "self.txt")
    proc = run_tool("compare.py", grp)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 2 and all(w.startswith("compare.py: warning: cannot read ") for w in warnings)
    assert any("sub.txt" in w for w in warnings) and any("self.txt" in w for w in warnings)
    row = proc.stdout.splitlines()[2].split()
    assert row[:4] == ["grp", "2", "2", "3.2780"]
    assert "grp: self (unreadable:" in proc.stdout and "grp: sub (unreadable:" in proc.stdout
    js = json.loads(run_tool("compare.py", "--json", grp).stdout)
    assert js[0]["runs"] == 2 and len(js[0]["incomplete"]) == 2
    assert run_tool("compare.py", "--plot", tmp_path / "p.png", grp).returncode == 0
    # nothing readable at all: an error
    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    (only_bad / "sub.txt").mkdir()
    proc = run_tool("compare.py", only_bad)
    assert proc.returncode == 2 and "no log could be read" in proc.stderr
    # a file without read permission (simulated: the tests may run as root)
    real = compare.read_log_lines

    def deny(path):
        if path.endswith("r1.txt"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)
    monkeypatch.setattr(compare, "read_log_lines", deny)
    runs = {r.name: r for r in compare.collect([str(grp)])}
    assert runs["r1"].reason == "unreadable: Permission denied" and runs["r0"].complete


def test_json_output_keys_and_values(peer_logs):
    proc = run_tool("compare.py", "--json", "--group-by", "prefix", peer_logs["dir"])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    for key in ("group", "runs", "mean_val_loss", "std_val_loss", "p_value", "mean_train_time_ms", "steps",
                "incomplete", "tokens", "flops"):
        assert all(key in r for r in rows), key
    by = {r["group"]: r for r in rows}
    assert by[FAST]["runs"] == 12 and by[FAST]["steps"] == PEER_GROUPS[FAST][1]
    assert by[FAST]["mean_val_loss"] == pytest.approx(np.mean([grep_final(f)[2] for f in peer_logs["files"][FAST]]))
    assert by[ONE]["p_value"] is None and by[ONE]["std_val_loss"] is None  # nan -> null
    # the table holds the same numbers
    table = run_tool("compare.py", "--group-by", "prefix", peer_logs["dir"]).stdout
    assert re.search(rf"^{FAST}\s+12\s+.*{by[FAST]['mean_val_loss']:.4f}", table, re.M), table


def test_folder_and_file_grouping(fresh, tmp_path):
    f = tmp_path / "fresh.txt"  # not byte-identical (a byte-identical copy counts once): one more newline
    write_text(f, read_text(fresh["log"]) + "\n")
    rows = compare.group_stats(compare.collect([str(f), os.path.dirname(fresh["log"])]))
    assert [r["group"] for r in rows] == ["fresh", "logs"]  # a file alone; a folder as one group
    assert rows[0]["tokens"] == fresh["json"]["raw_tokens"]
    assert rows[0]["flops"] == pytest.approx(fresh["json"]["flops"], rel=1e-3)


# ----------------------------------------------------------------------------------------------
# plot


def test_plot_writes_a_png(fresh, peer_logs, tmp_path):
    out = tmp_path / "curves.png"
    proc = run_tool("compare.py", "--group-by", "prefix", "--plot", out, peer_logs["dir"], fresh["log"])
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    # by tokens: the modded-nanogpt-shaped runs have none and are skipped with a note, ours is drawn
    out2 = tmp_path / "tokens.png"
    proc = run_tool("compare.py", "--group-by", "prefix", "--plot", out2, "--x", "tokens", peer_logs["dir"],
                    fresh["log"])
    assert proc.returncode == 0 and out2.stat().st_size > 20_000
    n_peer = sum(len(f) for f in peer_logs["files"].values())
    assert proc.stderr.count("plot: skipped") == n_peer == 16 and "skipped fresh" not in proc.stderr
    assert proc.stderr.count("its val lines have no tokens values") == n_peer


# ----------------------------------------------------------------------------------------------
# verify.py


def test_verify_passes_on_a_fresh_log(fresh):
    proc = run_tool("verify.py", fresh["log"], "--repo", fresh["tree"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal" in proc.stdout and proc.stdout.strip().endswith("OK")


def test_verify_names_an_edited_snapshot_line(fresh, tmp_path):
    text = read_text(fresh["log"])
    lines = text.splitlines(keepends=True)
    # one line of aurora_opt.py's stored text: its 5th line
    start = next(i for i, ln in enumerate(lines) if ln.startswith("### file aurora_opt.py"))
    original = lines[start + 5]
    lines[start + 5] = original.rstrip("\n") + "  # edited\n"
    bad = tmp_path / "edited.txt"
    write_text(bad, "".join(lines))
    proc = run_tool("verify.py", bad, "--repo", fresh["tree"])
    assert proc.returncode == 1
    out = proc.stdout
    assert "aurora_opt.py: sha256" in out and "does not match its header" in out
    assert "aurora_opt.py line 5 differs" in out
    assert repr(original) in out and repr(lines[start + 5]) in out
    assert "train_gpt.py line" not in out and out.strip().endswith("FAILED")


def test_verify_fails_against_a_changed_tree(fresh, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(fresh["tree"], tree)
    src = (tree / "train_gpt.py").read_text().splitlines(keepends=True)
    src[9] = "# changed\n"
    (tree / "train_gpt.py").write_text("".join(src))
    proc = run_tool("verify.py", fresh["log"], "--repo", tree)
    assert proc.returncode == 1 and "train_gpt.py line 10 differs" in proc.stdout
    assert "sha256" not in proc.stdout.split("FAIL", 1)[1]  # the log itself is consistent


def test_verify_extract_is_byte_identical(fresh, tmp_path):
    out = tmp_path / "extracted"
    proc = run_tool("verify.py", fresh["log"], "--extract", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in harness.SOURCE_FILES:
        got, want = (out / name).read_bytes(), open(os.path.join(fresh["tree"], name), "rb").read()
        assert got == want, name
        header = [ln for ln in read_text(fresh["log"]).splitlines() if ln.startswith(f"### file {name} ")][0]
        assert header.endswith("sha256=" + hashlib.sha256(got).hexdigest())


def test_verify_extract_undoes_the_newline_added_to_a_file_without_one():
    """The trainer appends "\n" to a file without a final newline; the sha256 tells verify to drop it."""
    a, b = "x = 1\ny = 2", "print('hi')\n"
    log = [f"### file train_gpt.py lines=2 sha256={hashlib.sha256(a.encode()).hexdigest()}\n", "x = 1\n", "y = 2\n",
           f"### file aurora_opt.py lines=1 sha256={hashlib.sha256(b.encode()).hexdigest()}\n", b,
           compare.SEPARATOR + "\n", "python: 3\n"]
    sources, problems, rest = verify.extract(log)
    assert sources == {"train_gpt.py": a, "aurora_opt.py": b} and problems == [] and rest == 5
    assert verify.first_difference("f.py", "a\nb\nc\n", "a\nB\nc\n") == \
        "f.py line 2 differs:\n    log:          'b\\n'\n    working tree: 'B\\n'"
    assert "log has 3 lines, working tree 2" in verify.first_difference("f.py", "a\nb\nc\n", "a\nb\n")


def test_verify_rerun_reproduces_the_first_steps(fresh):
    proc = run_tool("verify.py", fresh["log"], "--repo", fresh["tree"], "--rerun", 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)$", proc.stdout, re.M)
    assert [int(r[0]) for r in table] == [1, 2, 3]
    logged = {p["step"]: p["train_loss"] for p in compare.parse_log(fresh["log"]).train}
    for step, a, b, _ in table:
        assert float(a) == logged[int(step)] and abs(float(a) - float(b)) <= 1e-4
    assert "train losses reproduced within 0.0001 (3 step(s) compared)" in proc.stdout


def test_verify_rerun_catches_other_data_and_other_losses(fresh, tmp_path):
    """A log whose step-1 loss was changed, rerun on other train shards: both are reported."""
    text = read_text(fresh["log"])
    m = re.search(r"^step:1/6 train_loss:([\d.]+) ", text, re.M)
    changed = float(m[1]) + 0.01
    bad = tmp_path / "other_loss.txt"
    write_text(bad, text[:m.start(1)] + f"{changed:.4f}" + text[m.end(1):])
    proc = run_tool("verify.py", bad, "--repo", fresh["tree"], "--rerun", 1,
                    "--train-files", f"{DATA}/*_train_000002.bin", "--keep", tmp_path / "kept")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the data differ from the logged run's" in proc.stdout
    row = re.search(r"^\s+1\s+([\d.]+)\s+([\d.]+)\s+(\S+)  > tol$", proc.stdout, re.M)
    assert row and float(row[1]) == pytest.approx(changed) and float(row[3]) > 1e-4  # other data, other loss too
    assert "train losses NOT reproduced" in proc.stdout and proc.stdout.strip().endswith("FAILED")
    assert f"rerun: code and log kept in {tmp_path / 'kept'}" in proc.stdout  # kept for inspection
    assert os.path.exists(tmp_path / "kept" / "verify.txt")


def test_verify_says_truncated_not_edited(fresh, tmp_path):
    lines = read_text(fresh["log"]).splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("### file aurora_opt.py"))
    n = int(compare.HEADER_RE.match(lines[start].rstrip("\n"))["lines"])
    for name, text, promised in [
            ("cut_lines.txt", "".join(lines[:start + 11]), f"promises {n} lines, but the log ends after 10"),
            ("cut_mid_line.txt", "".join(lines[:start + n]) + lines[start + n][:5],
             f"promises {n} lines, but the log ends after {n - 1}")]:
        write_text(tmp_path / name, text)
        proc = run_tool("verify.py", tmp_path / name, "--repo", fresh["tree"])
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "edited after the run" not in proc.stdout
        assert f"FAIL snapshot: the log is truncated: the header of aurora_opt.py (log line {start + 1}) " \
               f"{promised}" in proc.stdout, proc.stdout
        assert "train_gpt.py, kernels.py equal to the log's snapshot" in proc.stdout  # the complete files: checked
        assert "aurora_opt.py line" not in proc.stdout  # the cut copy is not diffed against the tree
    # cut right after the snapshot: no separator and no run
    write_text(tmp_path / "no_run.txt", "".join(lines[:start + 1 + n]))
    proc = run_tool("verify.py", tmp_path / "no_run.txt", "--repo", fresh["tree"])
    assert proc.returncode == 1 and "the log is truncated: it ends right after the snapshot" in proc.stdout


def test_verify_extract_onto_a_file_is_one_error_line(fresh, tmp_path):
    target = tmp_path / "existing_file"
    target.write_text("keep me")
    proc = run_tool("verify.py", fresh["log"], "--extract", target)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"verify.py: error: --extract {target}: ") and "not a folder" in line, line
    assert target.read_text() == "keep me"


def test_verify_extract_never_overwrites_other_content(fresh, tmp_path):
    out = tmp_path / "code"
    out.mkdir()
    (out / "train_gpt.py").write_text("mine\n")
    proc = run_tool("verify.py", fresh["log"], "--extract", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == f"verify.py: error: --extract {out}: would overwrite train_gpt.py there (different content); " \
                   "pass an empty or new folder", line
    assert (out / "train_gpt.py").read_text() == "mine\n" and not (out / "aurora_opt.py").exists()
    (out / "train_gpt.py").unlink()
    assert run_tool("verify.py", fresh["log"], "--extract", out).returncode == 0
    again = run_tool("verify.py", fresh["log"], "--extract", out)  # the same content again: allowed
    assert again.returncode == 0 and again.stdout.strip().endswith("OK"), again.stdout + again.stderr
    assert "not checked: the numbers after the snapshot" in again.stdout


def test_verify_extracting_nothing_makes_no_folder(tmp_path):
    log = tmp_path / "no_snapshot_files.txt"
    write_text(log, "### file train_gpt.py lines=3 sha256=" + "0" * 64 + "\nx = 1\n")  # cut inside its file
    proc = run_tool("verify.py", log, "--extract", tmp_path / "out")
    assert proc.returncode == 1 and "extracted nothing" in proc.stdout and not (tmp_path / "out").exists()


def test_verify_documents_what_it_does_not_check():
    readme = read_text(os.path.join(RECORDS, "README.md"))
    for text in (verify.__doc__, readme):
        flat = " ".join(text.split())
        assert "not checksummed" in flat and "first K" in flat


def test_the_same_log_named_twice_counts_once(tmp_path):
    for i, x in enumerate([3.277, 3.279]):
        modded_log(tmp_path / f"g__{i}.txt", x)
    warnings = []
    runs = compare.collect([str(tmp_path), str(tmp_path / "g__0.txt"), str(tmp_path)], "prefix",
                           warn=warnings.append)
    assert len(runs) == 2 and len(warnings) == 3 and all("counted once" in w for w in warnings)
    assert compare.group_stats(runs)[0]["std_val_loss"] == pytest.approx(math.sqrt(2e-6), rel=1e-6)


@pytest.mark.parametrize("tol", ["inf", "nan", "-1e-4"])
def test_verify_rejects_a_tolerance_that_cannot_judge(fresh, tol):
    proc = run_tool("verify.py", fresh["log"], "--rerun", "1", "--tol", tol)
    assert proc.returncode == 2 and "--tol" in proc.stderr and "rerun:" not in proc.stdout


def test_verify_notes_an_unfinished_run(fresh, tmp_path):
    cut = tmp_path / "cut.txt"
    lines = read_text(fresh["log"]).splitlines(keepends=True)
    write_text(cut, "".join(ln for ln in lines if not ln.startswith(("status:", "summary:"))))
    proc = run_tool("verify.py", str(cut), "--repo", fresh["tree"])
    assert proc.returncode == 0 and "note: the run did not finish (no status line)" in proc.stdout
    assert "did not finish" not in run_tool("verify.py", fresh["log"], "--repo", fresh["tree"]).stdout


def test_shell_glob_over_records_skips_plots_and_points_into_nested_folders(tmp_path):
    (tmp_path / "a").mkdir()
    modded_log(tmp_path / "a" / "r__0.txt", 3.2771)
    (tmp_path / "nested" / "arm").mkdir(parents=True)
    modded_log(tmp_path / "nested" / "arm" / "x.txt", 3.29)
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    proc = run_tool("compare.py", *sorted(str(p) for p in tmp_path.iterdir()))
    assert proc.returncode == 0, proc.stderr
    assert "plot.png: not a log (.png), skipped" in proc.stderr
    assert "nested: no .txt logs in it, but in its subfolders" in proc.stderr
    rows = [ln.split()[0] for ln in proc.stdout.split("\n\n")[0].splitlines()[2:]]  # the main table
    assert rows == ["a"]


# ----------------------------------------------------------------------------------------------
# time to target, A/B against a baseline, Markdown


def curve_log(path, vals, train=()):
    """A modded-nanogpt-shape log: ``vals`` = [(step, val_loss, train_time_ms)], N = the last step."""
    n = vals[-1][0]
    lines = [f"step:{s}/{n} train_loss:{loss:.4f} train_time:{ms}ms step_avg:1.00ms" for s, loss, ms in train]
    lines += [f"step:{s}/{n} val_loss:{loss:.4f} train_time:{ms}ms step_avg:1.00ms" for s, loss, ms in vals]
    write_text(path, "\n".join(lines) + "\n")


def interp_reference(points, target):
    """Slow reference of reach_target: scan for the first point at or below target, np.interp on its segment."""
    for i, p in enumerate(points):
        if p["val_loss"] <= target:
            if i == 0:
                return {k: p[k] for k in ("train_time_ms", "step", "tokens", "flops")}
            q = points[i - 1]  # np.interp needs increasing xp: the loss falls from q to p
            return {k: float(np.interp(target, [p["val_loss"], q["val_loss"]], [p[k], q[k]]))
                    for k in ("train_time_ms", "step", "tokens", "flops")}
    return None


def test_reach_target_matches_a_slow_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 12))
        steps = np.cumsum(rng.integers(1, 50, n))
        losses = 10.0 - np.cumsum(rng.uniform(-0.3, 1.0, n))  # mostly falling, sometimes rising
        points = [dict(step=int(s), val_loss=float(v), train_time_ms=float(s * rng.uniform(90, 110)),
                       tokens=int(s) * 1024, flops=float(s) * 3.1e11) for s, v in zip(steps, losses)]
        target = float(rng.uniform(losses.min() - 0.5, losses.max()))
        got, want = compare.reach_target(points, target), interp_reference(points, target)
        if want is None:
            assert got is None
        else:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-9)
            assert points[0]["step"] <= got["step"] <= points[-1]["step"]
    pts = [dict(step=0, val_loss=10.0, train_time_ms=0, tokens=0, flops=0.0),
           dict(step=10, val_loss=float("nan"), train_time_ms=50, tokens=100, flops=1.0),
           dict(step=20, val_loss=4.0, train_time_ms=100, tokens=None, flops=2.0),
           dict(step=30, val_loss=3.0, train_time_ms=150, tokens=300, flops=3.0)]
    # the nan point is left out: 5.0 lies between step 0 (10.0) and step 20 (4.0)
    assert compare.reach_target(pts, 5.0) == dict(train_time_ms=pytest.approx(250 / 3), step=pytest.approx(50 / 3),
                                                  tokens=None, flops=pytest.approx(5 / 3))
    assert compare.reach_target(pts, 4.0)["step"] == 20  # reached exactly at a val point
    assert compare.reach_target(pts, 12.0)["step"] == 0   # already at the first point
    assert compare.reach_target(pts, 2.9) is None


def test_time_to_target_per_run_and_per_group(tmp_path):
    # run a: 3.30 at 1000 ms -> 3.26 at 2000 ms: 3.28 at 1500 ms, step 150; run b: 1100 -> 2100 ms, 3.29 -> 3.27:
    # 1600 ms, step 150; run c never gets below 3.29
    curve_log(tmp_path / "g__a.txt", [(0, 10.8, 0), (100, 3.30, 1000), (200, 3.26, 2000)])
    curve_log(tmp_path / "g__b.txt", [(0, 10.8, 0), (100, 3.29, 1100), (200, 3.27, 2100)])
    curve_log(tmp_path / "g__c.txt", [(0, 10.8, 0), (100, 3.35, 1000), (200, 3.29, 2000)])
    curve_log(tmp_path / "h__a.txt", [(0, 10.8, 0), (50, 3.28, 400), (100, 3.20, 800)])
    proc = run_tool("compare.py", "--group-by", "prefix", "--json", tmp_path, "--baseline", "h")
    assert proc.returncode == 0, proc.stderr
    g, h = json.loads(proc.stdout)
    assert g["run_names"] == ["g__a", "g__b", "g__c"] and g["reached_target"] == 2
    assert g["time_to_target_ms"][:2] == pytest.approx([1500, 1600], rel=1e-12) and g["time_to_target_ms"][2] is None
    assert g["step_to_target"][:2] == pytest.approx([150, 150]) and g["tokens_to_target"] == [None] * 3
    assert g["mean_time_to_target_ms"] == pytest.approx(1550) and g["std_time_to_target_ms"] == pytest.approx(50 * 2 ** 0.5)
    assert h["time_to_target_ms"] == [400] and h["std_time_to_target_ms"] is None
    assert g["time_to_target_ratio"] is None  # run c never got there: no ratio of a survivors' mean
    table = run_tool("compare.py", "--group-by", "prefix", tmp_path).stdout
    assert re.search(r"^g\s+2/3\s+1\.55s ± 0\.07s\s+150 ± 0\s+-\s+-$", table, re.M), table
    curve_log(tmp_path / "g__c.txt", [(0, 10.8, 0), (100, 3.30, 1000), (200, 3.20, 2000)])  # now at 1200 ms
    g, h = json.loads(run_tool("compare.py", "--group-by", "prefix", "--json", tmp_path, "--baseline", "h").stdout)
    assert g["time_to_target_ratio"] == pytest.approx(np.mean([1500, 1600, 1200]) / 400)
    out = run_tool("compare.py", "--group-by", "prefix", tmp_path, "--target", "2").stdout
    assert "time to 2.0: no run reached it" in out


def welch_reference(a, b):
    """delta, 95% CI and two-sided p of Welch's test of mean(b) - mean(a), by hand in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    delta = b.mean() - a.mean()
    half = stats.t.ppf(0.975, dof) * se
    return delta, [delta - half, delta + half], 2 * stats.t.sf(abs(delta / se), dof), dof


def test_welch_matches_a_hand_computation():
    rng = np.random.default_rng(1)
    for na, nb in [(2, 2), (2, 5), (3, 12), (12, 3), (10, 10)]:
        for _ in range(20):
            a = rng.normal(3.28, rng.uniform(5e-4, 5e-3), na)
            b = rng.normal(3.28 + rng.uniform(-0.004, 0.004), rng.uniform(5e-4, 5e-3), nb)
            got = compare.welch(list(a), list(b))
            delta, ci, p, dof = welch_reference(a, b)
            assert got["delta_mean"] == pytest.approx(delta, rel=1e-9, abs=1e-13)
            assert got["delta_ci95"] == pytest.approx(ci, rel=1e-9, abs=1e-13)
            assert got["p_welch"] == pytest.approx(p, rel=1e-9) and got["welch_dof"] == pytest.approx(dof, rel=1e-9)
            assert "welch_note" not in got and (ci[0] < 0 < ci[1]) == (p > 0.05)


def test_baseline_json_table_and_ratios(tmp_path):
    rng = np.random.default_rng(2)
    losses = {"A": np.round(rng.normal(3.279, 0.0015, 5), 4), "B": np.round(rng.normal(3.276, 0.002, 4), 4),
              "C": [3.2801]}
    times = {"A": [5000, 5100, 4900, 5050, 4950], "B": [4000, 4100, 3950, 4020], "C": [6000]}
    for g in losses:
        for i, (x, ms) in enumerate(zip(losses[g], times[g])):
            modded_log(tmp_path / f"{g}__{i}.txt", float(x), ms=ms)
    proc = run_tool("compare.py", "--group-by", "prefix", "--json", "--baseline", "A", tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["group"]: r for r in json.loads(proc.stdout)}
    assert not {"delta_mean", "delta_ci95", "p_welch"} & set(rows["A"])  # the baseline has no test against itself
    delta, ci, p, _ = welch_reference(losses["A"], losses["B"])
    b = rows["B"]
    assert b["baseline"] == "A" and b["delta_mean"] == pytest.approx(delta, abs=1e-12)
    assert b["delta_ci95"] == pytest.approx(ci, rel=1e-9) and b["p_welch"] == pytest.approx(p, rel=1e-9)
    assert b["train_time_ratio"] == pytest.approx(np.mean(times["B"]) / np.mean(times["A"]), rel=1e-12)
    assert b["flops_ratio"] is None and b["tokens_ratio"] is None  # modded-nanogpt logs have neither
    c = rows["C"]  # one run: the difference, but no test
    assert c["delta_mean"] == pytest.approx(3.2801 - np.mean(losses["A"]), abs=1e-12)
    assert c["delta_ci95"] is None and c["p_welch"] is None and "two complete runs" in c["welch_note"]
    out = run_tool("compare.py", "--group-by", "prefix", "--baseline", "A", tmp_path).stdout
    line = [ln for ln in out.split("against the baseline A")[1].splitlines() if ln.startswith("B ")][0].split()
    assert line[1:6] == [f"{delta:+.4f}", f"[{ci[0]:+.4f},", f"{ci[1]:+.4f}]", f"{p:.3g}",
                         f"{np.mean(times['B']) / np.mean(times['A']):.3f}x"]
    assert "C: Welch's t-test needs at least two complete runs in each group (this group has 1, the baseline 5)" in out
    # both groups without spread: no test, said so
    for i in range(2):
        modded_log(tmp_path / f"D__{i}.txt", 3.2770)
        modded_log(tmp_path / f"E__{i}.txt", 3.2790)
    d = {r["group"]: r for r in json.loads(run_tool("compare.py", "--group-by", "prefix", "--json", "--baseline",
                                                    "E", tmp_path).stdout)}["D"]
    assert d["p_welch"] is None and "no spread" in d["welch_note"] and d["delta_mean"] == pytest.approx(-0.002)


def test_baseline_names_a_group_or_a_unique_start(tmp_path):
    for g in ("run_a", "run_b", "other"):
        for i in range(2):
            modded_log(tmp_path / f"{g}__{i}.txt", 3.277 + 0.001 * i)
    ok = run_tool("compare.py", "--group-by", "prefix", "--json", "--baseline", "oth", tmp_path)
    assert ok.returncode == 0 and all(r["baseline"] == "other" for r in json.loads(ok.stdout) if r["group"] != "other")
    folders = [tmp_path / "A", tmp_path / "B"]  # a folder as given on the command line names its group
    for f in folders:
        f.mkdir()
        for i in range(2):
            modded_log(f / f"{i}.txt", 3.277 + 0.001 * i)
    ok = run_tool("compare.py", "--json", *folders, "--baseline", f"{folders[0]}/")
    assert ok.returncode == 0 and json.loads(ok.stdout)[1]["baseline"] == "A"
    for name, what in [("run", "more than one group starts with 'run'"), ("nope", "no group is named 'nope'")]:
        proc = run_tool("compare.py", "--group-by", "prefix", "--baseline", name, tmp_path)
        assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line == f"compare.py: error: --baseline: {what}; the groups are: other, run_a, run_b", line


def test_markdown_holds_the_same_tables(tmp_path):
    for g, xs in (("A", [3.2770, 3.2790]), ("B", [3.2750, 3.2760, 3.2781])):
        for i, x in enumerate(xs):
            modded_log(tmp_path / f"{g}__{i}.txt", x)
    args = ("--group-by", "prefix", "--baseline", "A", tmp_path)
    text, md = run_tool("compare.py", *args).stdout, run_tool("compare.py", "--markdown", *args).stdout
    tables = [b for b in md.split("\n\n") if b.startswith("|")]
    assert len(tables) == 3  # per group, time to target, against the baseline
    for table in tables:
        rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines()]
        assert set(rows[1]) == {"---"} and all(len(r) == len(rows[0]) for r in rows)
        for r in rows[2:]:  # every row of the Markdown table is a row of the text table
            assert re.search(r"^" + r"\s+".join(map(re.escape, " ".join(r).split())) + r"$", text, re.M), r
    proc = run_tool("compare.py", "--markdown", "--json", *args)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


# ----------------------------------------------------------------------------------------------
# runs that measured different things are not pooled

CPU = os.path.join(RECORDS, "cpu")
TST = os.path.join(CPU, "2026-11-29_cpu_smoke_tst")


def with_config(src, dst, **changes):
    """Copy a log of records/cpu, changing fields of its config line (None: remove the field)."""
    lines = read_text(src).splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith("config: {"))
    cfg = json.loads(lines[i][len("config: "):])
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    lines[i] = "config: " + json.dumps(cfg, sort_keys=True) + "\n"
    write_text(dst, "".join(lines))


def test_runs_differing_in_a_run_defining_field_are_not_pooled(tmp_path):
    grp = tmp_path / "grp"
    grp.mkdir()
    for seed in (0, 1):  # differ in seed and run_id only: one group
        shutil.copyfile(os.path.join(TST, f"tst_seed{seed}.txt"), grp / f"s{seed}.txt")
    with_config(os.path.join(TST, "tst_seed1.txt"), grp / "s1_ops.txt", val_every=7, micro_batch_seqs=2,
                log_dir="elsewhere", device="cpu")  # operational fields only: still the same experiment
    warnings = []
    runs = compare.collect([str(grp)], warn=warnings.append)
    assert warnings == [] and {r.group for r in runs} == {"grp"}
    finals = {r.name: r.final["val_loss"] for r in runs}
    with_config(os.path.join(TST, "tst_seed1.txt"), grp / "vt.txt", val_tokens=4096)  # measured on other tokens
    runs = compare.collect([str(grp)], warn=warnings.append)
    [w] = warnings
    assert "group grp: its runs differ in val_tokens" in w and "grp [val_tokens=16384], grp [val_tokens=4096]" in w
    rows = {r["group"]: r for r in compare.group_stats(runs)}
    assert set(rows) == {"grp [val_tokens=16384]", "grp [val_tokens=4096]"}
    assert rows["grp [val_tokens=16384]"]["val_losses"] == [finals["s0"], finals["s1"], finals["s1_ops"]]
    assert rows["grp [val_tokens=4096]"]["runs"] == 1
    # through the command line: the warning on stderr, the baseline must name one of the parts
    proc = run_tool("compare.py", grp, "--baseline", "grp")
    assert proc.returncode == 2 and "more than one group starts with 'grp'" in proc.stderr
    assert "compare.py: warning: group grp: its runs differ in val_tokens" in proc.stderr


def test_a_copy_counts_once_and_damaged_step_lines_are_named(tmp_path):
    src = os.path.join(TST, "tst_seed0.txt")
    for name in ("a.txt", "b.txt"):  # the same bytes in two files: one run
        shutil.copyfile(src, tmp_path / name)
    lines = read_text(src).splitlines(keepends=True)
    train = next(i for i, ln in enumerate(lines) if re.match(r"step:\d+/120 train_loss:", ln))
    final = next(i for i, ln in enumerate(lines) if ln.startswith("step:120/120 val_loss:"))
    damaged = list(lines)
    damaged[train] = re.sub(r"train_loss:[0-9.]+", "train_loss:GARBAGE!!", damaged[train])
    write_text(tmp_path / "c_train.txt", "".join(damaged))
    damaged[final] = damaged[final].replace("val_loss:7.", "val_loss:7.2x#")
    write_text(tmp_path / "d_final.txt", "".join(damaged))
    write_text(tmp_path / "e_empty.txt", "")
    warnings = []
    runs = {r.name: r for r in compare.collect([str(tmp_path)], warn=warnings.append)}
    assert sorted(runs) == ["a", "c_train", "d_final", "e_empty"]
    assert f"b.txt: the same bytes as {tmp_path / 'a.txt'} (a copy); counted once" in warnings[0]
    assert runs["c_train"].complete and runs["c_train"].unreadable == [(train + 1, damaged[train].rstrip("\n"))]
    assert len(runs["c_train"].train) == len(runs["a"].train) - 1  # the damaged point alone is left out
    assert any(f"c_train.txt: 1 step line(s) cannot be read and are skipped (line {train + 1}:" in w
               for w in warnings)
    assert not runs["d_final"].complete and f"line {final + 1} is a step line that cannot be read" \
        in runs["d_final"].reason
    assert runs["e_empty"].reason == "empty file (0 bytes)"


def test_the_operational_fields_are_the_trainers_and_a_trainer_without_them_is_one_error_line(tmp_path, monkeypatch,
                                                                                                  capsys):
    sys.path.insert(0, REPO)
    import train_gpt
    assert compare.operational_fields() == train_gpt.OPERATIONAL  # read from its source: no torch import
    shutil.copyfile(os.path.join(TST, "tst_seed0.txt"), tmp_path / "a.txt")
    (tmp_path / "train_gpt.py").write_text("OPERATIONAL = set(x for x in 'ab')\n")  # not a literal
    monkeypatch.setattr(compare.operational_fields, "__defaults__", (str(tmp_path / "train_gpt.py"),))
    assert compare.main([str(tmp_path / "a.txt")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("compare.py: error: cannot read train_gpt.py's OPERATIONAL beside records/") and \
        f"{tmp_path / 'train_gpt.py'} holds no literal OPERATIONAL" in line, line
    modded_log(tmp_path / "m.txt", 3.27)  # modded-nanogpt logs (no config line) do not need the trainer
    assert compare.main([str(tmp_path / "m.txt")]) == 0


def test_unknown_missing_and_several_fields_split_too(tmp_path):
    grp = tmp_path / "grp"
    grp.mkdir()
    with_config(os.path.join(TST, "tst_seed0.txt"), grp / "a.txt", new_knob=1)
    with_config(os.path.join(TST, "tst_seed1.txt"), grp / "b.txt", new_knob=2)
    with_config(os.path.join(TST, "tst_seed1.txt"), grp / "c.txt", tst_frac=0.0)  # no new_knob at all
    warnings = []
    groups = [r.group for r in compare.collect([str(grp)], warn=warnings.append)]
    assert groups == ["grp [new_knob=1 tst_frac=0.3]", "grp [new_knob=2 tst_frac=0.3]",
                      "grp [new_knob=<missing> tst_frac=0.0]"]
    assert "differ in new_knob, tst_frac" in warnings[0]
    # a modded-nanogpt log (no config line) among ours is not pooled with them either
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copyfile(os.path.join(TST, "tst_seed0.txt"), mixed / "ours.txt")
    modded_log(mixed / "theirs.txt", 3.2770)
    runs = compare.collect([str(mixed)], warn=warnings.append)
    assert {r.name: r.group for r in runs} == {"ours": "mixed", "theirs": "mixed [no config line]"}
    assert "mix logs with and without a config line" in warnings[-1]
    # modded-nanogpt logs alone group as given
    plain = tmp_path / "plain"
    plain.mkdir()
    for i in range(2):
        modded_log(plain / f"{i}.txt", 3.2770 + i * 1e-3)
    assert {r.group for r in compare.collect([str(plain)], warn=warnings.append)} == {"plain"} and len(warnings) == 2


def with_data(src, dst, kind, edit, repeat=False):
    """Copy a log of records/cpu, changing its ``data <kind>:`` lines: ``edit(index, path, fingerprint)``
    returns the new ``(path, fingerprint)``. ``repeat``: also log the data block again before the
    status line, as a resumed run does at its second start."""
    lines = read_text(src).splitlines(keepends=True)
    block = []
    for i, ln in enumerate(lines):
        m = re.match(r"^data (train|val): (.*) (tokens:\d+ bytes:\d+) fingerprint:([0-9a-f]{16})\n$", ln)
        if m and m[1] == kind:
            path, fp = edit(len([b for b in block if b.startswith(f"data {kind}:")]), m[2], m[4])
            lines[i] = f"data {kind}: {path} {m[3]} fingerprint:{fp}\n"
        if m:
            block.append(lines[i])
    assert block, src
    if repeat:
        end = next(i for i, ln in enumerate(lines) if ln.startswith("status:"))
        lines[end:end] = ["resume: from checkpoints/x/step_60.pt at step 60\n"] + block
    write_text(dst, "".join(lines))


def logged_fingerprints(path, kind):
    """The fingerprints of a log's ``data <kind>:`` lines, by a plain reading."""
    return [ln.rsplit("fingerprint:", 1)[1].strip() for ln in read_text(path).splitlines()
            if ln.startswith(f"data {kind}: ")]


def test_runs_that_read_other_data_are_not_pooled(tmp_path):
    src = {seed: os.path.join(TST, f"tst_seed{seed}.txt") for seed in (0, 1)}
    grp = tmp_path / "grp"
    grp.mkdir()
    for seed in (0, 1):
        shutil.copyfile(src[seed], grp / f"s{seed}.txt")
    # the same shards under other paths, and a resumed run that logged the same data twice: one experiment
    with_data(src[1], grp / "moved.txt", "train", lambda i, path, fp: (f"/mnt/other place/t{i}.bin", fp))
    with_data(src[0], grp / "resumed.txt", "val", lambda i, path, fp: (path, fp), repeat=True)
    warnings = []
    runs = compare.collect([str(grp)], warn=warnings.append)
    assert warnings == [] and {r.group for r in runs} == {"grp"} and len(runs) == 4
    assert compare.data_identity(runs[1])["val data"] == compare.data_identity(runs[2])["val data"]
    finals = {r.name: r.final["val_loss"] for r in runs}
    # other val tokens: measured on something else
    [val_fp] = logged_fingerprints(src[1], "val")
    with_data(src[1], grp / "other_val.txt", "val", lambda i, path, fp: (path, "1a2b3c4d5e6f7a8b"))
    runs = compare.collect([str(grp)], warn=warnings.append)
    [w] = warnings
    same, other = f"grp [val data {val_fp[:8]}]", "grp [val data 1a2b3c4d]"
    assert "group grp: its runs differ in val data" in w and f"split into {same}, {other}" in w
    rows = {r["group"]: r for r in compare.group_stats(runs)}
    assert set(rows) == {same, other} and rows[other]["runs"] == 1
    assert rows[same]["val_losses"] == [finals[n] for n in ("moved", "resumed", "s0", "s1")]
    # one train shard of three with other contents; with a config difference too
    train = tmp_path / "train"
    train.mkdir()
    shutil.copyfile(src[0], train / "a.txt")
    with_data(src[1], train / "b.txt", "train", lambda i, path, fp: (path, "0" * 16 if i == 1 else fp))
    with_config(train / "b.txt", train / "c.txt", val_tokens=4096)
    groups = {r.name: r.group for r in compare.collect([str(train)], warn=warnings.append)}
    assert "its runs differ in val_tokens, train data" in warnings[-1]
    labels = {n: re.fullmatch(r"train \[val_tokens=(\d+) train data ([0-9a-f]{8})\]", g).groups()
              for n, g in groups.items()}
    assert labels["a"][0] == labels["b"][0] == "16384" and labels["c"][0] == "4096"
    assert labels["a"][1] != labels["b"][1] == labels["c"][1]
    # a resume onto other val data (--resume-force) is not the same data either
    forced = tmp_path / "forced"
    forced.mkdir()
    shutil.copyfile(src[0], forced / "a.txt")
    with_data(src[1], forced / "b.txt", "val", lambda i, path, fp: (path, fp), repeat=True)
    lines = read_text(forced / "b.txt").splitlines(keepends=True)
    last = max(i for i, ln in enumerate(lines) if ln.startswith("data val: "))
    lines[last] = lines[last].replace(val_fp, "f" * 16)
    write_text(forced / "b.txt", "".join(lines))
    assert len({r.group for r in compare.collect([str(forced)], warn=warnings.append)}) == 2
    # through the command line: the warning on stderr
    proc = run_tool("compare.py", grp)
    assert proc.returncode == 0 and "compare.py: warning: group grp: its runs differ in val data" in proc.stderr
    assert re.search(rf"^{re.escape(other)}\s+1\s", proc.stdout, re.M), proc.stdout


# ----------------------------------------------------------------------------------------------
# plot: mean curve with its band, fitted range


def test_mean_curve_and_smoothing_match_slow_references():
    rng = np.random.default_rng(3)
    curves = []
    for k in range(3):
        steps = sorted(set(range(0, 100, 10)) | set(rng.integers(0, 100, 4).tolist()))  # extra steps per run
        curves.append(dict(step=np.array(steps), x=np.array(steps) * (1.0 + 0.1 * k), y=rng.normal(5, 1, len(steps)),
                           phase1=np.array(steps) < 30))
    m = compare.mean_curve(curves)
    common = sorted(set.intersection(*(set(c["step"].tolist()) for c in curves)))
    assert m["step"].tolist() == common
    for j, s in enumerate(common):
        ys = [float(c["y"][c["step"].tolist().index(s)]) for c in curves]
        xs = [float(c["x"][c["step"].tolist().index(s)]) for c in curves]
        assert m["y"][j] == pytest.approx(sum(ys) / 3, rel=1e-12) and m["x"][j] == pytest.approx(sum(xs) / 3)
        assert m["std"][j] == pytest.approx(statistics.stdev(ys), rel=1e-9)
    assert compare.mean_curve([dict(step=np.array([0, 1]), x=np.zeros(2), y=np.zeros(2), phase1=np.zeros(2, bool)),
                               dict(step=np.array([1, 2]), x=np.zeros(2), y=np.zeros(2), phase1=np.zeros(2, bool))]) is None
    # segments shorter than the window too (a run with 2 train lines in TST's phase 1)
    y, seg = rng.normal(0, 1, 60), np.array([1] * 20 + [2] * 37 + [3] * 2 + [4])
    for w in (1, 4, 5, 8):
        got = compare.smooth(y, w, seg)
        for i in range(len(y)):  # the mean of the points within the window and the same segment
            lo, hi = i - w // 2, i - w // 2 + w
            near = [y[j] for j in range(max(lo, 0), min(hi, len(y))) if seg[j] == seg[i]]
            assert got[i] == pytest.approx(sum(near) / len(near), rel=1e-12, abs=1e-12)


def group_band(folder):
    """Mean ± std (ddof=1) of the val losses of a records/cpu folder's runs at each val step after step 0."""
    runs = [compare.parse_log(f) for f in sorted(glob.glob(os.path.join(folder, "*.txt")))]
    ys = np.array([[p["val_loss"] for p in r.val] for r in runs])[:, 1:]
    return ys.mean(0) - ys.std(0, ddof=1), ys.mean(0) + ys.std(0, ddof=1)


def test_pool_train_data_keeps_data_orders_in_one_group_but_not_other_val_data(tmp_path):
    src = {seed: os.path.join(TST, f"tst_seed{seed}.txt") for seed in (0, 1)}
    grp = tmp_path / "arm"
    grp.mkdir()
    shutil.copyfile(src[0], grp / "o0.txt")  # two data orders: other training shards, same val shard
    with_data(src[1], grp / "o1.txt", "train", lambda i, path, fp: (path, "0123456789abcdef"))
    warnings = []
    assert len({r.group for r in compare.collect([str(grp)], warn=warnings.append)}) == 2 and len(warnings) == 1
    assert "differ in train data" in warnings[0] and "--pool-train-data keeps them in one group" in warnings[0]
    runs = compare.collect([str(grp)], warn=warnings.append, pool_train_data=True)
    assert {r.group for r in runs} == {"arm"} and len(warnings) == 2  # pooled, and said so
    assert warnings[1] == "group arm: pools runs on 2 different training data (--pool-train-data)"
    [row] = compare.group_stats(runs)
    assert row["runs"] == 2
    # other val data still splits: the val loss measured something else
    with_data(src[1], grp / "v.txt", "val", lambda i, path, fp: (path, "fedcba9876543210"))
    groups = {r.name: r.group for r in compare.collect([str(grp)], warn=warnings.append, pool_train_data=True)}
    assert groups["o0"] == groups["o1"] != groups["v"] and "differ in val data" in warnings[-1]
    assert "train data" not in warnings[-1] and "--pool-train-data" not in warnings[-1]
    proc = run_tool("compare.py", grp, "--pool-train-data")
    assert proc.returncode == 0 and "differ in val data" in proc.stderr and "split into" in proc.stderr
    assert "pools runs on 2 different training data" in proc.stderr


def test_plot_legend_moves_outside_the_curves_for_many_groups(tmp_path):
    import matplotlib.pyplot as plt

    def legend_right_of_axes(n):
        folder = tmp_path / f"n{n}"
        folder.mkdir()
        paths = []
        for g in range(n):
            curve_log(folder / f"g{g}.txt", [(0, 10.8, 0), (100, 4.0 + 0.1 * g, 1000), (200, 3.5 + 0.1 * g, 2000)])
            paths.append(str(folder / f"g{g}.txt"))
        fig, _ = compare.draw_figure(compare.collect(paths), "time", 3.28)
        try:
            fig.canvas.draw()
            ax = fig.axes[0]
            [legend] = [ax.get_legend()] if ax.get_legend() else fig.legends
            box, frame, page = legend.get_window_extent(), ax.get_window_extent(), fig.bbox
            assert len([t for t in legend.get_texts() if t.get_text().startswith("g")]) == n
            # every entry on the page, none cut off; the panel keeps a usable height
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
            assert frame.height > 0.5 * page.height
            colours = {tuple(ln.get_color()) for ln in ax.get_lines() if ln.get_label().startswith("g")}
            assert len(colours) == n  # distinct up to 60 groups
            return box.x0 >= frame.x1
        finally:
            plt.close(fig)

    assert not legend_right_of_axes(compare.LEGEND_INSIDE_MAX)
    assert legend_right_of_axes(compare.LEGEND_INSIDE_MAX + 1)
    assert legend_right_of_axes(45)  # the small-scale folder's arms split by data order


def test_plot_fits_the_range_to_the_curves_and_draws_the_target_only_inside(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    folders = [os.path.join(CPU, "2026-11-29_cpu_smoke_no_tst"), TST]
    runs = compare.collect(folders)
    bands = [group_band(f) for f in folders]
    lo, hi = min(b[0].min() for b in bands), max(b[1].max() for b in bands)
    fig, notes = compare.draw_figure(runs, "flops", 3.28)
    try:
        val_ax, train_ax = fig.axes
        y0, y1 = val_ax.get_ylim()
        assert y0 < lo and y1 > hi and (y1 - y0) < 1.15 * (hi - lo)  # the curves fill the panel
        assert "target 3.28 is below the range shown" in val_ax.get_title()
        assert not [ln for ln in val_ax.get_lines() if list(ln.get_ydata()) == [3.28, 3.28]]
        assert len([c for c in val_ax.collections if isinstance(c, PolyCollection)]) == 2  # one band per group
        assert "train loss" in train_ax.get_title() and notes == []
    finally:
        plt.close(fig)
    target = round((lo + hi) / 2, 2)  # inside the range: drawn, not mentioned
    fig, _ = compare.draw_figure(runs, "step", target)
    try:
        assert [ln for ln in fig.axes[0].get_lines() if list(ln.get_ydata()) == [target, target]]
        assert "range shown" not in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    # logs without train losses: no train panel; a single run is drawn as its own line (no band)
    curve_log(tmp_path / "m.txt", [(0, 10.8, 0), (100, 3.5, 1000), (200, 3.25, 2000)])
    fig, _ = compare.draw_figure(compare.collect([str(tmp_path / "m.txt")]), "time", 3.28)
    try:
        [ax] = fig.axes
        assert ax.get_ylim()[0] < 3.28 < ax.get_ylim()[1] and not ax.collections
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------------------------
# first-passing step


def val_lines(path):
    """{step: val loss} of a log's val lines, by a plain reading: those of the last part between separator
    lines that has any (the code above the first separator may hold step-like lines)."""
    parts = [re.findall(r"^step:(\d+)/\d+ val_loss:([0-9.]+) ", part, re.M)
             for part in read_text(path).split(compare.SEPARATOR)]
    return {int(a): float(b) for a, b in [p for p in parts if p][-1]}


def hand_first_passing(curves, target, rule="ttest", sigma=0.0013, margin=0.004):
    """Slow reference: the first step every run logged whose runs' mean passes the rule, in float64.

    ttest: t = (mean - target) / (s / sqrt(n)) with the sample std s, p = Student-t cdf(t, n - 1) < 0.01;
    ztest: (target - mean) * sqrt(n) >= margin. Returns (step or None, mean, p) there."""
    common = sorted(set.intersection(*(set(c) for c in curves)))
    for step in common:
        x = np.array([c[step] for c in curves], dtype=np.float64)
        n, mean = len(x), float(x.sum() / len(x))
        if rule == "ttest" and n < 2:  # no spread to test against: never passes
            continue
        if rule == "ttest":
            s = math.sqrt(float(((x - mean) ** 2).sum()) / (n - 1))
            if s:
                p = float(stats.t.cdf((mean - target) / (s / math.sqrt(n)), n - 1))
            else:  # equal losses (the untrained step 0): t is -inf or +inf
                p = 0.0 if mean < target else 1.0
            ok = p < 0.01
        else:
            p = float(stats.norm.sf((target - mean) * math.sqrt(n) / sigma))
            ok = (target - mean) * math.sqrt(n) >= margin
        if ok:
            return step, mean, p
    return None, None, None


def passing_json(*args):
    proc = run_tool("compare.py", "--first-passing", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return {r["group"]: r for r in json.loads(proc.stdout)}, proc.stderr


def test_first_passing_matches_a_hand_computation(tmp_path):
    rng = np.random.default_rng(29)
    steps = list(range(0, 1001, 100))
    curves = {}
    for g, (runs, end) in {"A": (4, 3.2790), "B": (5, 3.2740), "C": (3, 3.2760)}.items():
        for i in range(runs):  # falls to about `end`; noise 0.0015 per val point
            vals = [(s, float(end + 0.3 * (1 - s / 1000) ** 2 + rng.normal(0, 0.0015)), 7 * s + i) for s in steps]
            curve_log(tmp_path / f"{g}__{i}.txt", vals)
            curves.setdefault(g, []).append(val_lines(tmp_path / f"{g}__{i}.txt"))
    checked = 0
    for target in (3.29, 3.30, 3.28):
        for rule, extra in (("ttest", ()), ("ztest", ()), ("ztest", ("--z-sigma", "0.002", "--z-margin", "0.01"))):
            sigma, margin = (0.002, 0.01) if extra else (0.0013, 0.004)
            runs = compare.collect([str(tmp_path)], "prefix")
            rows = compare.group_stats(runs, target, compare.PassRule(rule, sigma=sigma, margin=margin))
            compare.add_baseline(rows, "A")
            rows = {r["group"]: r for r in rows}
            want = {g: hand_first_passing(c, target, rule, sigma, margin) for g, c in curves.items()}
            for g, (step, mean, p) in want.items():
                r = rows[g]
                assert r["first_passing_step"] == step and r["first_passing_runs"] == len(curves[g])
                if step is None:
                    assert r["first_passing_val_loss"] is None and r["first_passing_p"] is None
                    continue
                checked += 1
                assert r["first_passing_val_loss"] == pytest.approx(mean, abs=1e-12)
                assert r["first_passing_p"] == pytest.approx(p, rel=1e-9, abs=1e-300)
                times = [7 * step + i for i in range(len(curves[g]))]
                assert r["first_passing_train_time_ms"] == pytest.approx(np.mean(times))
                assert (r["first_passing_z"] is None) == (rule == "ttest")
            for g in ("B", "C"):
                a, b = want["A"][0], want[g][0]
                assert rows[g]["steps_saved"] == (None if a is None or b is None else a - b)
                if a is not None and b is not None:
                    assert rows[g]["time_saved_ms"] == pytest.approx(7 * (a - b) + (4 - 1) / 2 - (len(curves[g]) - 1) / 2)
                else:
                    assert "never" in rows[g]["passing_note"]
    assert checked >= 8  # most cases pass somewhere: the test compares numbers, not only "never"
    cli, _ = passing_json("--group-by", "prefix", "--target", 3.28, "--rule", "ztest", "--z-sigma", "0.002",
                          "--z-margin", "0.01", "--baseline", "A", tmp_path)
    assert {g: r["first_passing_step"] for g, r in cli.items()} == {g: r["first_passing_step"] for g, r in rows.items()}
    assert {g: r.get("steps_saved") for g, r in cli.items()} == {g: r.get("steps_saved") for g, r in rows.items()}


def test_first_passing_only_at_steps_every_run_logged(tmp_path):
    # step 50 is logged by two runs only: there the mean is far below the target, but it does not count
    curve_log(tmp_path / "g__a.txt", [(0, 10.8, 0), (50, 3.10, 500), (100, 3.2701, 1000), (200, 3.2600, 2000)])
    curve_log(tmp_path / "g__b.txt", [(0, 10.8, 0), (50, 3.11, 510), (100, 3.2722, 1010), (200, 3.2610, 2010)])
    curve_log(tmp_path / "g__c.txt", [(0, 10.8, 0), (100, 3.2712, 1020), (200, 3.2605, 2020)])
    rows, err = passing_json("--group-by", "prefix", tmp_path)
    g = rows["g"]
    x = np.array([3.2701, 3.2722, 3.2712])
    t = (x.mean() - 3.28) / (x.std(ddof=1) / math.sqrt(3))
    assert stats.t.cdf(t, 2) < 0.01 and g["first_passing_step"] == 100
    assert g["first_passing_p"] == pytest.approx(stats.t.cdf(t, 2), rel=1e-9)
    assert g["val_steps_missing"] == {"g__c": [50]}
    assert "warning: group g: its runs logged val losses at different steps" in err and "g__c lacks step 50" in err
    assert "g__a" not in err.split("at different steps")[1]  # only the run that lacks a step is named
    # one run: a t-test cannot be made; the z-test can
    one, _ = passing_json(str(tmp_path / "g__a.txt"))
    assert one["g__a"]["first_passing_step"] is None
    one, _ = passing_json("--rule", "ztest", str(tmp_path / "g__a.txt"))
    assert one["g__a"]["first_passing_step"] == 50 and one["g__a"]["first_passing_z"] == pytest.approx(0.18 / 0.0013)


def test_first_passing_on_the_small_scale_records():
    # the command of the README: aurora against adamw at 7.3, over data orders
    small = os.path.join(CPU, "2026-11-30_small_scale")
    args = ["--target", "7.3", "--pool-train-data", os.path.join(small, "aurora"), os.path.join(small, "adamw"),
            "--baseline", "adamw"]
    rows, err = passing_json(*args)
    files = {g: sorted(glob.glob(os.path.join(small, g, "*.txt"))) for g in ("aurora", "adamw")}
    for g, paths in files.items():
        step, mean, p = hand_first_passing([val_lines(f) for f in paths], 7.3)
        assert rows[g]["first_passing_step"] == step and rows[g]["first_passing_runs"] == len(paths) == 6
        if step is not None:
            assert rows[g]["first_passing_p"] == pytest.approx(p, rel=1e-9)
            assert rows[g]["first_passing_val_loss"] == pytest.approx(mean, abs=1e-12)
    assert (rows["aurora"]["first_passing_step"], rows["adamw"]["first_passing_step"]) == (300, None)
    assert rows["aurora"]["steps_saved"] is None and "adamw never passes" in rows["aurora"]["passing_note"]
    assert "adamw_o0_seed1 lacks steps 75, 150, 225" in err  # three adamw runs logged val every 75 steps
    proc = run_tool("compare.py", "--first-passing", *args)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^aurora\s+6\s+300\s+7\.2780\s", proc.stdout, re.M), proc.stdout
    assert re.search(r"^adamw\s+6\s+never\s", proc.stdout, re.M) and "aurora: no saving: adamw never passes" in proc.stdout


def test_first_passing_on_peer_logs(peer_logs):
    rows, _ = passing_json("--group-by", "prefix", peer_logs["dir"])
    for group, files in peer_logs["files"].items():
        step, mean, _ = hand_first_passing([val_lines(f) for f in files], 3.28)
        assert rows[group]["first_passing_step"] == step
    assert rows[FAST]["first_passing_step"] == PEER_GROUPS[FAST][1] and rows[ONE]["first_passing_step"] is None


@pytest.mark.parametrize("args, needle", [
    (("--rule", "ztest"), "--rule sets how --first-passing judges a step; add --first-passing"),
    (("--first-passing", "--z-margin", "0.01"), "--z-sigma and --z-margin belong to --rule ztest"),
])
def test_first_passing_flags_without_their_mode_are_one_error_line(tmp_path, args, needle):
    modded_log(tmp_path / "a.txt", 3.27)
    proc = run_tool("compare.py", *args, tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"compare.py: error: {needle}" + ("" if "belong" not in needle else
                                                                     "; add --rule ztest or leave them out")


@pytest.mark.parametrize("args, line", [
    (("--x", "tokens"), "--x tokens sets the x axis of --plot; add --plot OUT.png or leave --x out"),
    (("--x", "time"), "--x time sets the x axis of --plot; add --plot OUT.png or leave --x out"),  # the default too
    (("--plot=",), "--plot '': an empty file name; name the image to write (e.g. --plot curves.png)"),
])
def test_plot_flags_that_would_be_ignored_are_one_error_line(tmp_path, args, line):
    modded_log(tmp_path / "a.txt", 3.27)
    proc = run_tool("compare.py", *args, tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.strip() == f"compare.py: error: {line}"
    if args[0] == "--x":  # with --plot the same --x draws
        drawn = run_tool("compare.py", *args, tmp_path, "--plot", tmp_path / "p.png")
        assert drawn.returncode == 0 and (tmp_path / "p.png").exists(), drawn.stderr


def with_code(src, dst, name, old, new):
    """Copy a log of records/cpu whose snapshot of ``name`` has its first line ``old`` replaced by ``new``,
    with the header's line count and sha256 made to match (an honest log of other code)."""
    lines = read_text(src).splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"### file {name} "))
    n = int(re.search(r"lines=(\d+)", lines[start])[1])
    body = lines[start + 1:start + 1 + n]
    i = body.index(old + "\n")
    body[i] = new + "\n"
    digest = hashlib.sha256("".join(body).encode()).hexdigest()
    lines[start] = f"### file {name} lines={n} sha256={digest}\n"
    write_text(dst, "".join(lines[:start + 1] + body + lines[start + 1 + n:]))
    return digest


def test_runs_of_other_code_are_not_pooled(tmp_path):
    src = {seed: os.path.join(TST, f"tst_seed{seed}.txt") for seed in (0, 1)}
    grp = tmp_path / "grp"
    grp.mkdir()
    shutil.copyfile(src[0], grp / "a.txt")
    shutil.copyfile(src[1], grp / "b.txt")
    old = next(ln.rstrip("\n") for ln in read_text(src[1]).splitlines(keepends=True) if ln.startswith("EOT_TOKEN = "))
    digest = with_code(src[1], grp / "c.txt", "train_gpt.py", old, old + "  # the same run, one line of other code")
    assert verify.extract(read_text(grp / "c.txt").splitlines(keepends=True))[1] == []  # an honest snapshot
    warnings = []
    runs = compare.collect([str(grp)], warn=warnings.append)
    [w] = warnings
    logged = re.search(r"^### file train_gpt\.py lines=\d+ sha256=([0-9a-f]+)$", read_text(src[0]), re.M)[1]
    same, other = f"grp [code train_gpt.py {logged[:8]}]", f"grp [code train_gpt.py {digest[:8]}]"
    assert {r.name: r.group for r in runs} == {"a": same, "b": same, "c": other}
    assert f"group grp: its runs differ in code train_gpt.py (they measured different things); split into " \
           f"{same}, {other}" in w and "verify.py" in w
    rows = {r["group"]: r for r in compare.group_stats(runs)}
    assert rows[same]["runs"] == 2 and rows[other]["runs"] == 1
    # other code in the optimizer file and another config field: all named, config fields first
    first = next(ln.rstrip("\n") for ln in read_text(src[1]).split("### file aurora_opt.py ")[1].splitlines()[1:]
                 if ln.startswith("import "))
    with_code(src[1], tmp_path / "d.txt", "aurora_opt.py", first, first + "  # other code")
    with_config(tmp_path / "d.txt", grp / "d.txt", val_tokens=4096)
    compare.collect([str(grp)], warn=warnings.append)
    assert "its runs differ in val_tokens, code aurora_opt.py, code train_gpt.py (" in warnings[-1]
    proc = run_tool("compare.py", grp)  # through the command line: the warning on stderr
    assert proc.returncode == 0 and "compare.py: warning: group grp: its runs differ in val_tokens, code aurora_opt.py" \
        in proc.stderr
    # a snapshot without one of the files: <missing>
    lines = read_text(src[1]).splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("### file aurora_opt.py "))
    n = int(re.search(r"lines=(\d+)", lines[start])[1])
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copyfile(src[0], alone / "a.txt")
    write_text(alone / "b.txt", "".join(lines[:start] + lines[start + 1 + n:]))
    groups = {r.name: r.group for r in compare.collect([str(alone)], warn=warnings.append)}
    assert groups["b"] == "alone [code aurora_opt.py <missing>]" and "differ in code aurora_opt.py" in warnings[-1]


def test_tools_find_the_repository_one_way():
    """Every tool's sys.path set-up is the root line (then ``_paths`` for data/, records/, bench/), nothing else (the
    code a tool hands a subprocess in a string sets up that process, not the tool)."""
    root_line = "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))"
    tools = glob.glob(os.path.join(REPO, "bench", "*.py")) + glob.glob(os.path.join(RECORDS, "*.py"))
    setups = {}
    for path in tools + [os.path.join(REPO, "sample.py")]:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if re.match(r"\s*sys\.path(\.insert|\.append|\[)", line):  # a statement (not code in a string)
                    setups.setdefault(os.path.relpath(path, REPO), []).append(line.split("#")[0].strip())
    assert setups, "no tool sets up sys.path: the scan is broken"
    odd = {p: lines for p, lines in setups.items()
           if any(line not in (root_line, "sys.path.insert(0, root)") for line in lines)}
    assert not odd, odd


@pytest.mark.parametrize("changes, field", [  # a config field and the data in the default suite; the rest: -m slow
    (dict(val_tokens=8192), "val_tokens: 16384 vs 8192"), pytest.param(dict(seq_len=384), "seq_len: ", marks=pytest.mark.slow),
    pytest.param(dict(vocab_size=50432), "vocab_size: ", marks=pytest.mark.slow), ("val data", "val data: ")])
def test_groups_that_differ_in_what_decides_the_val_loss_get_no_number_against_the_baseline(tmp_path, changes, field):
    # same model, same data, same losses; only what the val loss is measured on differs: no delta, CI or p
    for g in ("A", "B"):
        (tmp_path / g).mkdir()
    for seed in (0, 1):
        src = os.path.join(TST, f"tst_seed{seed}.txt")
        shutil.copyfile(src, tmp_path / "A" / f"s{seed}.txt")
        if changes == "val data":
            text = re.sub(r"^(data val: .* fingerprint:)([0-9a-f]+)$", lambda m: m[1] + "0" * len(m[2]),
                          read_text(src), flags=re.M)
            write_text(tmp_path / "B" / f"s{seed}.txt", text)
        else:
            with_config(src, tmp_path / "B" / f"s{seed}.txt", **changes)
    proc = run_tool("compare.py", "--json", tmp_path / "A", tmp_path / "B", "--baseline", "A")
    assert proc.returncode == 0, proc.stderr
    b = {r["group"]: r for r in json.loads(proc.stdout)}["B"]
    assert b["delta_mean"] is None and b["delta_ci95"] is None and b["p_welch"] is None, b
    assert b["time_to_target_ratio"] is None and any(d.startswith(field) for d in b["val_differs"]), b
    assert f"compare.py: warning: group B: not compared with the baseline: the groups differ in what decides the val " \
           f"loss ({field}" in proc.stderr
    out = run_tool("compare.py", tmp_path / "A", tmp_path / "B", "--baseline", "A").stdout
    [line] = [ln for ln in out.split("against the baseline A")[1].splitlines() if ln.startswith("B ")]
    assert line.split()[1:4] == ["-", "-", "-"], line  # no difference, CI or p-value in the table
    assert "B: not compared with the baseline" in out
    # two folders without --baseline are an A/B (A the baseline): the same refusal
    ab = run_tool("compare.py", tmp_path / "A", tmp_path / "B")
    assert ab.returncode == 0 and "group B: not compared with the baseline" in ab.stderr, ab.stderr
    # three groups without a baseline stand side by side in the table: the same fields are named, per group
    shutil.copytree(tmp_path / "A", tmp_path / "C")
    plain = run_tool("compare.py", tmp_path / "A", tmp_path / "B", tmp_path / "C")
    assert plain.returncode == 0 and "compare.py: warning: the groups differ in what decides the val loss (" \
        f"{field.split(':')[0]}: " in plain.stderr and "(A), " in plain.stderr and "are not comparable" in plain.stderr
    same = run_tool("compare.py", tmp_path / "A", tmp_path / "C")
    assert "differ in what decides" not in same.stderr


def test_val_differences_names_val_protocol_fields_and_ignores_what_one_side_does_not_record():
    run = lambda cfg: compare.Run(path="x", name="x", config=cfg)  # noqa: E731
    a = dict(val_tokens=16384, seq_len=768, vocab_size=50304, val_every=50, val_batch_seqs=0, val_mode="next")
    rows = [dict(val_setup=compare.group_val_setup([run(c)])) for c in
            (a, dict(a, val_every=7, val_batch_seqs=4), dict(a, val_mode="tst"), {k: a[k] for k in ("seq_len",)})]
    assert compare.val_differences(rows[0], rows[1]) == []  # how often and in what batches: the same val loss
    assert compare.val_differences(rows[0], rows[2]) == ["val_mode: next vs tst"]
    assert compare.val_differences(rows[0], rows[3]) == []  # val tokens unknown on one side: not a difference


def test_compare_skips_files_that_are_not_run_logs_and_refuses_when_none_is_left(tmp_path, capsys):
    hello, noise = tmp_path / "hello.txt", tmp_path / "noise.txt"
    hello.write_text("hello\n")
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    assert compare.main([str(hello), str(noise)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert f"compare.py: warning: {hello}: not a train_gpt.py or modded-nanogpt log; skipped" in err
    assert f"compare.py: warning: {noise}: not a train_gpt.py or modded-nanogpt log; skipped" in err
    assert err[-1].startswith("compare.py: error: no train_gpt.py or modded-nanogpt log found in ")
    # beside a real log: the log is compared, the others named and not counted as incomplete runs
    log = sorted(glob.glob(os.path.join(os.path.dirname(compare.__file__), "**", "*.txt"), recursive=True))
    log = [f for f in log if compare.is_log(compare.parse_log(f))][0]
    assert compare.main(["--json", log, str(hello)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["runs"] + len(json.loads(out.out)[0]["incomplete"]) == 1
    assert "hello.txt: not a train_gpt.py" in out.err


def test_compare_skips_a_fifo_instead_of_blocking_on_it(tmp_path):
    os.mkfifo(tmp_path / "fifo.txt")
    for target in (tmp_path / "fifo.txt", tmp_path):
        proc = run_tool("compare.py", target)  # would block forever reading the FIFO
        assert proc.returncode == 2 and "fifo.txt: not a regular file (a FIFO or device), skipped" in proc.stderr


# ----------------------------------------------------------------------------------------------
# A/B: an edit against the cpu_baseline preset, two folders of seeds (README, "Try your own idea")

def seeds_of(fresh, folder, finals):
    """Copies of the fresh log in ``folder``, one per final val loss in ``finals`` (its step-6 val line and summary
    edited, its seed set to the copy's number), as a few seeds of one setting would log."""
    text = read_text(fresh["log"])
    folder.mkdir()
    for seed, x in enumerate(finals):
        t = re.sub(r"^(step:6/6 val_loss:)\S+", rf"\g<1>{x:.4f}", text, count=1, flags=re.M)
        t = re.sub(r"^(summary: final_val_loss:)\S+", rf"\g<1>{x:.4f}", t, count=1, flags=re.M)
        t = re.sub(r'^(config: \{.*"seed": )\d+', rf"\g<1>{seed}", t, count=1, flags=re.M)
        write_text(folder / f"s{seed}.txt", t)


def test_two_folders_are_an_ab_comparison_with_the_difference_and_its_significance(fresh, tmp_path):
    a, b = [7.3012, 7.2950, 7.3101, 7.2987], [7.2601, 7.2655, 7.2580, 7.2702]
    seeds_of(fresh, tmp_path / "logs_a", a)
    seeds_of(fresh, tmp_path / "logs_b", b)
    proc = run_tool("compare.py", tmp_path / "logs_a", tmp_path / "logs_b")  # no --baseline: the first is A
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    out = proc.stdout
    delta, ci, p, _ = welch_reference(a, b)  # float64 by hand
    table = out.split("against the baseline logs_a")[1]
    [line] = [ln for ln in table.splitlines() if ln.startswith("logs_b ")]
    assert line.split()[1:5] == [f"{delta:+.4f}", f"[{ci[0]:+.4f},", f"{ci[1]:+.4f}]", f"{p:.3g}"], line
    assert (f"logs_b: mean final val loss lower (better) than logs_a's by {-delta:.4f} (95% CI of the difference "
            f"[{ci[0]:+.4f}, {ci[1]:+.4f}]), Welch p = {p:.3g}: a real difference at p < 0.05") in out
    for g, xs in (("logs_a", a), ("logs_b", b)):  # the means and stds of the main table
        [row] = [ln for ln in out.split("\n\n")[0].splitlines() if ln.startswith(g + " ")]
        n, incomplete, mean, std = row.split()[1:5]
        assert (n, incomplete) == ("4", "0") and float(mean) == pytest.approx(statistics.mean(xs), abs=5.1e-5), row
        assert float(std) == pytest.approx(statistics.stdev(xs), abs=5.1e-5), row
    # within the noise: said so, not called a difference
    seeds_of(fresh, tmp_path / "logs_c", [x + 0.0005 * (-1) ** i for i, x in enumerate(a)])
    out = run_tool("compare.py", tmp_path / "logs_a", tmp_path / "logs_c").stdout
    assert "logs_c: mean final val loss" in out and "not distinguishable from seed noise at p < 0.05" in out
    # three folders: no baseline unless one is named
    three = run_tool("compare.py", tmp_path / "logs_a", tmp_path / "logs_b", tmp_path / "logs_c").stdout
    assert "against the baseline" not in three
    assert "against the baseline logs_b" in run_tool("compare.py", tmp_path / "logs_a", tmp_path / "logs_b",
                                                     tmp_path / "logs_c", "--baseline", "logs_b").stdout
