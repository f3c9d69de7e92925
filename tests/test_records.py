"""records/compare.py and records/verify.py on real logs: ours (made here) and modded-nanogpt's.

One short real run (cpu_smoke, 6 steps) is made once per session from a copy of the trainer
taken at the start, so that edits to the working tree during the session cannot make the
snapshot and the "working tree" disagree; verify compares against that copy (``--repo``).
"""
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(REPO, "records")
PEER = os.path.join(REPO, "..", "shared", "peer_logs")
DATA = "../shared/data/realtext"  # relative to the repo root, where runs are launched
sys.path.insert(0, RECORDS)

import compare  # noqa: E402
import verify  # noqa: E402

ENV = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="100000000000")
UNET = "2024-12-08_UNetValueEmbedsTweaks__2024-12-08_UNetValueEmbedsTweaks"


def run_tool(script, *args):
    """Run records/<script> as a user would (from the repo root); returns the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(RECORDS, script), *map(str, args)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    """A real complete log: dict(log=path, tree=dir with the exact code it ran, json=summary)."""
    root = tmp_path_factory.mktemp("fresh")
    tree = root / "tree"
    tree.mkdir()
    for name in ("train_gpt.py", "aurora_opt.py"):
        shutil.copyfile(os.path.join(REPO, name), tree / name)
    cmd = [sys.executable, str(tree / "train_gpt.py"), "--preset", "cpu_smoke",
           "--train-files", f"{DATA}/*_train_*.bin", "--val-files", f"{DATA}/*_val_*.bin",
           "--num-iterations", "6", "--val-every", "3", "--val-tokens", "2048",
           "--device", "cpu", "--no-compile", "--log-dir", str(root / "logs"), "--run-id", "fresh"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
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
        if ln.startswith("python: ") and lines[i - 1] == "=" * 100:
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
    # tokens/FLOPs of a val line are those of the train line of the same step
    v3 = run.val[1]
    t3 = [p for p in run.train if p["step"] == 3][0]
    assert (v3["tokens"], v3["flops"]) == (t3["tokens"], t3["flops"]) and v3["tokens"] > 0
    assert (run.val[0]["tokens"], run.val[0]["flops"]) == (0, 0)


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
    write_text(tmp_path / "m.txt", "".join(code + ["=" * 100 + "\n", "Running pytorch\n"] + steps))
    run = compare.parse_log(str(tmp_path / "m.txt"))
    assert run.fmt == "modded" and run.complete
    assert [p["step"] for p in run.val] == [0, 20] and run.final["val_loss"] == 3.2750
    assert run.final["train_time_ms"] == 1800 and run.total_steps == 20


# ----------------------------------------------------------------------------------------------
# modded-nanogpt's real logs


def grep_final(path):
    """Final val loss and train time of a peer log by a plain reading: its last 'val_loss:' line."""
    with open(path) as f:
        last = [ln for ln in f if "val_loss:" in ln][-1]
    m = re.match(r"step:(\d+)/(\d+) val_loss:([\d.]+) train_time:(\d+)ms", last)
    return int(m[1]), int(m[2]), float(m[3]), int(m[4])


def test_peer_logs_grouped_by_prefix():
    runs = compare.collect([PEER], group_by="prefix")
    rows = {r["group"]: r for r in compare.group_stats(runs)}
    assert {g: r["runs"] for g, r in rows.items()} == {
        "2024-11-03_UntieEmbed__2024-11-03_UntieEmbed": 1, UNET: 12,
        "2026-07-13_PrefixTokenPrediction__baseline-1375": 10,
        "2026-07-13_PrefixTokenPrediction__baseline-1390-8x": 2}
    assert all(not r["incomplete"] for r in rows.values())

    files = sorted(glob.glob(os.path.join(PEER, UNET + "__*.txt")))
    assert len(files) == 12
    expected = {os.path.basename(f)[:-4]: grep_final(f) for f in files}
    for r in runs:
        if r.group == UNET:
            step, total, loss, ms = expected[r.name]
            assert (r.final["step"], r.total_steps, r.final["val_loss"], r.final["train_time_ms"]) == \
                (step, total, loss, ms) and step == total == 1480
    losses = [v[2] for v in expected.values()]
    row = rows[UNET]
    assert row["steps"] == 1480
    assert row["mean_val_loss"] == pytest.approx(np.mean(losses), abs=1e-12)
    assert row["std_val_loss"] == pytest.approx(np.std(losses, ddof=1), rel=1e-9)
    assert row["mean_train_time_ms"] == pytest.approx(np.mean([v[3] for v in expected.values()]))
    assert row["p_value"] < 0.01 and row["tokens"] is None and row["flops"] is None
    untie = rows["2024-11-03_UntieEmbed__2024-11-03_UntieEmbed"]
    assert (untie["mean_val_loss"], untie["mean_train_time_ms"], untie["steps"]) == (3.2762, 648063, 4578)


def test_truncated_peer_log_is_incomplete(tmp_path):
    src = sorted(glob.glob(os.path.join(PEER, UNET + "__*.txt")))[:2]
    shutil.copyfile(src[0], tmp_path / os.path.basename(src[0]))
    with open(src[1]) as f:
        lines = f.readlines()
    last_val = max(i for i, ln in enumerate(lines) if "val_loss:" in ln)
    (tmp_path / os.path.basename(src[1])).write_text("".join(lines[:last_val - 3]))
    [row] = compare.group_stats(compare.collect([str(tmp_path)]))
    assert row["runs"] == 1 and len(row["incomplete"]) == 1
    assert "step 1375 of 1480" in row["incomplete"][0]  # the val line before the last one
    assert row["mean_val_loss"] == grep_final(src[0])[2]
    # cut in the middle of the final val line's number: that partial line must not count
    text = "".join(lines)
    partial = text[:text.index("step:1480/1480 val_loss:") + len("step:1480/1480 val_loss:3.2")]
    (tmp_path / "partial.txt").write_text(partial)
    run = compare.parse_log(str(tmp_path / "partial.txt"))
    assert not run.complete and run.final["step"] == 1375


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


def test_json_output_keys_and_values():
    proc = run_tool("compare.py", "--json", "--group-by", "prefix", PEER)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    for key in ("group", "runs", "mean_val_loss", "std_val_loss", "p_value", "mean_train_time_ms", "steps",
                "incomplete", "tokens", "flops"):
        assert all(key in r for r in rows), key
    by = {r["group"]: r for r in rows}
    assert by[UNET]["runs"] == 12 and by[UNET]["steps"] == 1480
    assert by["2024-11-03_UntieEmbed__2024-11-03_UntieEmbed"]["p_value"] is None  # nan -> null
    # the table holds the same numbers
    table = run_tool("compare.py", "--group-by", "prefix", PEER).stdout
    assert f"{by[UNET]['mean_val_loss']:.4f}" in table and UNET in table


def test_folder_and_file_grouping(fresh, tmp_path):
    f = tmp_path / "fresh.txt"  # a copy: the same file named twice counts once
    shutil.copyfile(fresh["log"], f)
    rows = compare.group_stats(compare.collect([str(f), os.path.dirname(fresh["log"])]))
    assert [r["group"] for r in rows] == ["fresh", "logs"]  # a file alone; a folder as one group
    assert rows[0]["tokens"] == fresh["json"]["raw_tokens"]
    assert rows[0]["flops"] == pytest.approx(fresh["json"]["flops"], rel=1e-3)


# ----------------------------------------------------------------------------------------------
# plot


def test_plot_writes_a_png(fresh, tmp_path):
    out = tmp_path / "curves.png"
    proc = run_tool("compare.py", "--group-by", "prefix", "--plot", out, PEER, fresh["log"])
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    # by tokens: the modded-nanogpt runs have none and are skipped with a note, ours is drawn
    out2 = tmp_path / "tokens.png"
    proc = run_tool("compare.py", "--group-by", "prefix", "--plot", out2, "--x", "tokens", PEER, fresh["log"])
    assert proc.returncode == 0 and out2.stat().st_size > 20_000
    assert proc.stderr.count("plot: skipped") == 25 and "skipped fresh" not in proc.stderr


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
    for name in ("train_gpt.py", "aurora_opt.py"):
        got, want = (out / name).read_bytes(), open(os.path.join(fresh["tree"], name), "rb").read()
        assert got == want, name
        header = [ln for ln in read_text(fresh["log"]).splitlines() if ln.startswith(f"### file {name} ")][0]
        assert header.endswith("sha256=" + hashlib.sha256(got).hexdigest())


def test_verify_extract_undoes_the_newline_added_to_a_file_without_one():
    """The trainer appends "\n" to a file without a final newline; the sha256 tells verify to drop it."""
    a, b = "x = 1\ny = 2", "print('hi')\n"
    log = [f"### file train_gpt.py lines=2 sha256={hashlib.sha256(a.encode()).hexdigest()}\n", "x = 1\n", "y = 2\n",
           f"### file aurora_opt.py lines=1 sha256={hashlib.sha256(b.encode()).hexdigest()}\n", b,
           "=" * 100 + "\n", "python: 3\n"]
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
                    "--train-files", f"{DATA}/*_train_000002.bin")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the data differ from the logged run's" in proc.stdout
    row = re.search(r"^\s+1\s+([\d.]+)\s+([\d.]+)\s+(\S+)  > tol$", proc.stdout, re.M)
    assert row and float(row[1]) == pytest.approx(changed) and float(row[3]) == pytest.approx(0.01, abs=2e-4)
    assert "train losses NOT reproduced" in proc.stdout and proc.stdout.strip().endswith("FAILED")
    kept = re.search(r"^rerun: code and log in (\S+)$", proc.stdout, re.M)[1]  # kept for inspection
    assert os.path.exists(os.path.join(kept, "verify.txt"))
    shutil.rmtree(kept)


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
        assert "train_gpt.py equal to the log's snapshot" in proc.stdout  # the complete file is still checked
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
    rows = [ln.split()[0] for ln in proc.stdout.splitlines()[2:] if ln.strip()]
    assert rows == ["a"]
