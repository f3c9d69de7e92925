"""--describe's projections: at the utilization modded-nanogpt's records reached, and at the one
bench/gpu_check.py measured when a report exists."""
import dataclasses
import json
import os

import pytest
import torch

import harness as H
import train_gpt as T


def test_record_89s_utilization_is_its_time_over_its_flops():
    # RECORD_MFU is record #21's (its recipe left the code; the figure stays, see its comment); the comment's
    # check on record #89: baseline_h200's FLOPs over 1.23 min (its record table's) on 8 x H100 (989 TFLOP/s) is 43.0% of peak
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    flops = H.plan_summary(cfg, *T.plan(cfg))["flops_total"]
    assert f"{flops:.3e}" == "2.512e+17" and round(flops / (1.23 * 60 * 8 * 989e12), 3) == 0.430


def report(mode="cuda", nominal=979.0):
    # record_h200: stage A, 3 kept steps of 1e14 FLOPs in 400 ms; stage B, 5 of 3e14 in 1,000 ms
    stage = lambda flops, steps, ms: dict(flops_per_step=flops, steps_used=steps, ms_per_step=ms)  # noqa: E731
    return dict(mode=mode, env=dict(gpu="NVIDIA H200", nominal_bf16_tflops=nominal),
                timing=dict(record_h200=dict(stages={"A": stage(1e14, 3, 400.0), "B": stage(3e14, 5, 1000.0)}),
                            baseline_h200=None))  # a preset whose timing run did not run


def test_measured_utilization_is_the_timed_flops_over_the_timed_seconds_over_the_peak():
    mfu, gpu, presets = H.measured_mfu(report())
    assert mfu == pytest.approx((3e14 + 15e14) / (1.2 + 5.0) / 979e12, rel=1e-12)
    assert (gpu, presets) == ("NVIDIA H200", "record_h200")
    assert H.measured_mfu(report(mode="dry-run (cpu)")) is None  # CPU step times say nothing of a GPU
    assert H.measured_mfu(report(nominal=None)) is None
    assert H.measured_mfu(dict(report(), timing=dict(record_h200=dict(stages={"A": None})))) is None  # not timed


def test_describe_projects_at_the_records_and_the_measured_utilization(tmp_path, monkeypatch):
    cfg, _ = T.parse_config(["--preset", "baseline_h200"])
    total = 2.6e17  # a plan of that many FLOPs (the projections read only flops_total)
    trainer = dataclasses.replace(T.TRAINER, plan=lambda c: (1, None))  # (n_params, stage table): not read here
    monkeypatch.setattr(H, "plan_summary", lambda c, n_params, table: dict(
        lines=[], flops_total=total, tokens_total=1, positions_total=1, steps=1))
    monkeypatch.setattr(H, "GPU_CHECK_REPORTS", (str(tmp_path / "gpu_check*" / "gpu_check.json"),))
    lines = H.describe(cfg, "baseline_h200", trainer)
    projected = [l for l in lines if l.startswith("projected_train_time")]
    assert len(projected) == 2 * len(H.PEAK_BF16_TFLOPS)  # no report: no measured line
    minutes = total / (H.RECORD_MFU * 989e12) / 60
    assert (f"projected_train_time: 1 x H200 (989 TFLOP/s bf16 dense each): {minutes:.1f} min at 39.6% of peak "
            f"(modded-nanogpt record #21's utilization)") in lines
    old, new = tmp_path / "gpu_check_a" / "gpu_check.json", tmp_path / "gpu_check_b" / "gpu_check.json"
    for path, r in ((old, report()), (new, report(mode="dry-run (cpu)"))):
        path.parent.mkdir()
        path.write_text(json.dumps(r))
    os.utime(old, (1, 1))  # the newer one is a dry run: skipped
    mfu = H.measured_mfu(report())[0]
    want = (f"projected_train_time_measured: 1 x NVIDIA H200: {total / (mfu * 979e12) / 60:.1f} min at "
            f"{100 * mfu:.1f}% of peak (measured by gpu_check on record_h200: {old})")
    assert H.describe(cfg, "baseline_h200", trainer)[-1] == want
    assert H.describe(cfg, "baseline_h200", trainer, str(old))[-1] == want  # --gpu-check PATH
    for bad in (new, tmp_path / "missing.json"):
        with pytest.raises(H.ConfigError, match=f"--gpu-check {bad}: "):
            H.describe(cfg, "baseline_h200", trainer, str(bad))


def test_describe_flag_reads_the_report_named_by_gpu_check(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report()))
    assert T.main(["--preset", "baseline_h200", "--describe", "--gpu-check", str(path)]) == 0
    assert f"on record_h200: {path})" in capsys.readouterr().out


@pytest.mark.parametrize("argv, chunk", [(["--preset", "record_h200", "--val-tokens", "1000"], 1000),
                                         (["--preset", "cpu_smoke", "--val-seq-len", "99999999"], 16384),
                                         (["--preset", "record_h200"], 262_144)])
def test_the_val_chunk_is_never_longer_than_the_val_tokens(argv, chunk, capsys):
    import types
    assert T.main(argv + ["--describe"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validation: ")]
    cfg = T.parse_config(argv)[0]
    n = -(-cfg.val_tokens // chunk)
    assert T.val_chunk(cfg) == chunk and f"in {n:,} document-masked chunks of {chunk:,} tokens" in line, line
    if cfg.val_tokens <= 16384:  # the batches themselves: one chunk of val_tokens, every label scored once
        val = object.__new__(T.ValData)
        val.n_tokens, val.tokens = cfg.val_tokens, torch.randint(0, 50257, (cfg.val_tokens + 1,))
        batches = list(val.chunks(T.val_chunk(cfg), 1, types.SimpleNamespace(rank=0, world=1)))
        assert len(batches) == n and batches[0][0].shape[1] == chunk
        assert sum(int((t != T.IGNORE_INDEX).sum()) for _, t in batches) == cfg.val_tokens


def test_describe_counts_the_text_trained_on_and_the_log_the_text_read(tmp_path):
    """--describe's tokens_total is the text the steps train on; a packed loader reads past it (the rest of each
    sequence's last document, text past a cap) and the log's tokens count what was read: never less."""
    from conftest import tiny_args
    argv = tiny_args(tmp_path, "--no-compile", "--max-steps", "3", "--val-every", "0", "--run-id", "t")
    cfg, _ = T.parse_config(argv)
    plan = H.plan_summary(cfg, *T.plan(cfg))
    assert any(ln.startswith("tokens: a packed step also reads, and skips") for ln in plan["lines"])
    per_step = [int(m.replace(",", "")) for ln in plan["lines"] if "tokens of text trained on per step" in ln
                for m in [ln.split(") and ", 1)[1].split(" tokens of text trained on per step")[0]]]
    assert T.main(argv) == 0
    summary = json.loads((tmp_path / "logs" / "t.json").read_text())
    assert summary["raw_tokens"] >= 3 * per_step[0] > 0, (summary["raw_tokens"], per_step)


@pytest.mark.parametrize("preset, labels", [
    ("baseline_h200", ["next-token (no TST)"] * 4),  # no TST phase: the rows are not numbered as one
    ("record_h200", ["phase 1 (TST full s=4)"] + ["phase 2 (next-token)"] * 4),
    ("cpu_smoke", ["phase 1 (TST full s=4)"] + ["phase 2 (next-token)"] * 4)])
def test_describe_labels_a_baselines_stages_next_token_and_numbers_tst_phases(preset, labels):
    cfg, _ = T.parse_config(["--preset", preset])
    rows = [ln for ln in H.plan_summary(cfg, *T.plan(cfg))["lines"] if "tokens of text trained on per step" in ln]
    assert [ln.split(": steps [")[0] for ln in rows] == labels, rows
