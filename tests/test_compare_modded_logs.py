"""records/compare.py reads modded-nanogpt record logs (record #89's shape) and gives the per-step reference.

The excerpt is synthetic, in the shape of record #89's 13 logs (2026-07-17_FP8DownProjection/this_pr): the
code snapshot above a line of 100 ``=``, environment lines, ``step:N/M val_loss:X train_time:Tms step_avg:Sms``
lines every few steps and train lines without a loss between them. The per-step statistics are checked
against a plain computation over the same numbers.
"""
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "records"))
import compare  # noqa: E402

N = 20
VAL = {  # run -> val loss at steps 0, 10, 20 (20 = N: a complete run)
    "11cb620c": (10.8311, 4.4888, 3.2775),
    "24746179": (10.8300, 4.4512, 3.2791),
    "24d675a3": (10.8290, 4.4601, 3.2783),
}


def write_log(path, losses, last=N):
    code = ["import os", "    if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):",
            '        print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:...")']
    lines = code + ["=" * 100, "Running Python 3.12", "Running PyTorch 2.10.0+cu128", "=" * 100,
                    "Sampling steps [0, 1, 6, 7] for warmup"]
    t = 0
    for step in range(last + 1):
        if step % 10 == 0:
            lines.append(f"step:{step}/{N} val_loss:{losses[step // 10]:.4f} train_time:{t}ms "
                         f"step_avg:{t / max(step, 1):.2f}ms")
        if step < last:
            t += 31
            lines.append(f"step:{step + 1}/{N} train_time:{t}ms step_avg:{t / (step + 1):.2f}ms")
    lines.append("peak memory allocated: 30000 MiB reserved: 31000 MiB")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "r89"
    d.mkdir()
    for name, losses in VAL.items():
        write_log(d / f"{name}.txt", losses)
    write_log(d / "cut.txt", (10.83, 4.47, 3.3), last=14)  # stopped before step N: not counted
    return d


def test_per_step_statistics_of_modded_logs_match_a_plain_computation(folder):
    runs = compare.collect([str(folder)])
    [row] = compare.group_stats(runs, per_step=True)
    assert row["runs"] == 3 and row["steps"] == N and len(row["incomplete"]) == 1
    got = {q["step"]: q for q in row["val_by_step"]}
    assert sorted(got) == [0, 10, 20]
    for i, step in enumerate((0, 10, 20)):
        losses = [v[i] for v in VAL.values()]
        assert got[step]["runs"] == 3
        assert got[step]["mean"] == pytest.approx(statistics.mean(losses), abs=1e-12)
        assert got[step]["std"] == pytest.approx(statistics.stdev(losses), abs=1e-12)
        assert (got[step]["min"], got[step]["max"]) == (min(losses), max(losses))
    assert row["mean_val_loss"] == pytest.approx(statistics.mean(v[2] for v in VAL.values()), abs=1e-12)


def test_per_step_table_on_the_command_line(folder):
    out = subprocess.run([sys.executable, os.path.join(REPO, "records", "compare.py"), "--per-step", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mean10 = statistics.mean(v[1] for v in VAL.values())
    line = next(ln for ln in out.stdout.splitlines() if ln.split()[:3] == ["r89", "10", "3"])
    assert f"{mean10:.4f}" in line and f"{statistics.stdev(v[1] for v in VAL.values()):.4f}" in line
