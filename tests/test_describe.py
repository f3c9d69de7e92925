"""--describe: the plan of a run without data or a GPU (parameters split, stage rows, totals, memory, projected time),
its figures for baseline_h200 written out by hand, TST and Aurora where they change them, and the memory estimate
against a CPU run's peak."""
import math
import re
import subprocess
import sys
import types

import pytest
import torch

import harness as H
import train_gpt as T
from conftest import REPO, subprocess_env

RECORD = T.MODELS["record"]  # the defaults' spec (T.Config().model)


def describe(capsys, *argv, machines=None):
    """``{first word: line}`` of ``train_gpt.py argv --describe [machines]``'s output (steps: the stage rows,
    projected: the projected times)."""
    assert T.main([*argv, "--describe", *([machines] if machines else [])]) == 0
    lines = capsys.readouterr().out.splitlines()
    out = {ln.split(":")[0]: ln for ln in lines if not ln.startswith(("steps ", "projected_train_time"))}
    return dict(out, steps=[ln for ln in lines if ln.startswith("steps ")],
                projected=[ln for ln in lines if ln.startswith("projected_train_time")])


def polar(m, n):
    """FLOPs of 5 Polar Express iterations on an m x n block: 4 a^2 b + 2 a^3 each, a = min(m, n), b = max."""
    a, b = min(m, n), max(m, n)
    return 5 * (4 * a * a * b + 2 * a ** 3)


def test_baseline_h200s_plan_by_hand(capsys):
    d, V, layers, attn = 768, 50304, 11, 10  # record #89: 11 layers of 768, layer 6 without attention
    out = describe(capsys, "--preset", "baseline_h200")
    tables = (1 + 5 + 1) * V * d + 377_280 * d  # embedding, 5 value embeddings, the head; the bigram hash table
    matrices = attn * 4 * d * d + layers * 2 * 4 * d * d  # q, k, v, o; the MLP's two
    assert (tables, matrices) == (560_185_344, 75_497_472)
    assert out["parameters"] == ("parameters: 635,886,937 = embedding tables and head 560,185,344 + block matrices "
                                 "75,497,472 (NorMuon) + gates and scalars 204,121 (CautiousAdam)")
    assert out["totals"] == ("totals: 1,285 steps, 338,821,120 positions, 338,821,120 tokens of text, 2.5124e+17 model "
                             "FLOPs + 1.592e+15 in the optimizer's orthogonalizations")
    opt = attn * 2 * 3 * polar(256, d) + attn * 2 * polar(d, d) + layers * 2 * polar(4 * d, d)  # Q, K in head pairs
    assert T.optimizer_flops(T.Config(), RECORD) == opt and f"{1285 * opt:.3e}" == "1.592e+15"
    assert [ln.split(":")[0] for ln in out["steps"]] == [f"steps [{a}, {b}) next-token" for a, b in
                                                         ((0, 423), (423, 847), (847, 1270), (1270, 1285))]
    assert out["steps"][2].startswith("steps [847, 1270) next-token: 8 x 49,152 positions, 393,216 tokens of text, "
                                      "windows (1408, 640), cap 2048, lr x1.73, ")
    # the peak: float32 weights, gradients and 3 optimizer copies, then stage 3's micro-batch of 49,152 positions: 3
    # float32 vocabulary rows and 25 bf16 rows of d per layer a position (docs/OPTIMIZERS.md, "Memory per GPU"), float64 by hand
    state, train = 5 * 4 * 635_886_937 / 2**30, 49_152 * (3 * V * 4 + 25 * layers * d * 2) / 2**30
    assert round(state + train, 1) == 58.8
    assert out["memory_estimate"] == (f"memory_estimate: per GPU, weights, gradients and optimizer state {state:.1f} "
                                      f"GiB + a train micro-batch of 49,152 positions {train:.1f} GiB (the validation "
                                      f"forward: 16.3): peak about 58.8 GiB; lower it with --micro-batch-seqs or "
                                      f"--seq-len")
    assert out["validation"].startswith("validation: 10,485,760 tokens in 40 document-masked chunks of 262,144, ")
    assert [ln.split(":")[1] for ln in out["projected"]] == [" 1 x H200", " 8 x B200"]


def test_tst_and_aurora_change_the_text_read_and_the_optimizers_flops_not_the_positions(capsys):
    base, ours = describe(capsys, "--preset", "baseline_h200"), describe(capsys, "--preset", "record_h200")
    assert ours["describe"] == "describe: preset record_h200: model record, aurora_normuon, TST full s=4 for 386 steps"
    assert ours["steps"][0].startswith("steps [0, 386) TST phase 1, full s=4: 8 x 16,384 positions, 524,288 tokens "
                                       "of text, ")  # s x the text of a latent position, at its FLOPs
    assert ours["steps"][0].split(", ")[-1] == base["steps"][0].split(", ")[-1]
    text = 386 * 4 * 131_072 + 37 * 131_072 + 424 * 262_144 + 438 * 393_216
    d = 768  # Aurora: K = 2 polar iterations on the 11 layers' 2 MLP matrices
    opt = T.optimizer_flops(T.Config(), RECORD) + 11 * 2 * polar(4 * d, d)
    assert T.optimizer_flops(T.Config(**T.OUR_METHODS), RECORD) == opt
    assert ours["totals"] == (f"totals: 1,285 steps, 338,821,120 positions, {text:,} tokens of text, 2.5124e+17 model "
                              f"FLOPs + {1285 * opt:.3e} in the optimizer's orthogonalizations")
    assert text == 490_602_496 and ours["parameters"] == base["parameters"]


def test_record_89s_utilization_is_its_time_over_its_flops():
    # record #89's table time (1.23 min on 8 x H100, 989 TFLOP/s each) over baseline_h200's FLOPs is 43.0% of peak;
    # the projection uses record #21's 39.6% (RECORD_MFU)
    table = T.Schedule(T.Config(), RECORD)
    flops = sum(r.flops_per_position * r.stage.batch_tokens for r in table.rows[:1285])
    assert f"{flops:.4e}" == "2.5124e+17" and round(flops / (1.23 * 60 * 8 * 989e12), 3) == 0.430
    assert H.RECORD_MFU == 0.396 and H.PEAK_TFLOPS["H200"] == 989.0


@pytest.mark.parametrize("argv, chunk", [(["--preset", "record_h200", "--val-tokens", "1000"], 1000),
                                         (["--preset", "cpu_smoke", "--val-seq-len", "99999999"], 16384),
                                         (["--preset", "record_h200"], 262_144)])
def test_the_val_chunk_is_never_longer_than_the_val_tokens(capsys, argv, chunk):
    line = describe(capsys, *argv)["validation"]
    cfg = H.parse_flags(T.Config, T.PRESETS, argv)[0]
    n = -(-cfg.val_tokens // chunk)
    assert T.val_chunk(cfg) == chunk and f"in {n:,} document-masked chunks of {chunk:,}, " in line, line
    if cfg.val_tokens <= 16384:  # the batches themselves: every label scored once
        val = object.__new__(T.ValData)
        val.n_tokens, val.tokens = cfg.val_tokens, torch.randint(0, 50257, (cfg.val_tokens + 1,))
        batches = list(val.batches("full", 1, T.val_chunk(cfg), 1, types.SimpleNamespace(rank=0, world=1)))
        assert len(batches) == n and batches[0][0].shape[1] == chunk
        assert sum(int((t != T.IGNORE_INDEX).sum()) for _, t in batches) == cfg.val_tokens


def test_describe_names_the_one_machine_asked_for(capsys):
    [line] = describe(capsys, machines="4xH100")["projected"]
    table = T.Schedule(T.Config(), RECORD)
    flops = sum(r.flops_per_position * r.stage.batch_tokens for r in table.rows[:1285])
    seconds = (flops + 1285 * T.optimizer_flops(T.Config(), RECORD)) / (4 * 0.396 * 989e12)
    assert line == (f"projected_train_time: 4 x H100: {seconds / 60:.1f} min at 39.6% of its 989 TFLOP/s bf16 peak "
                    f"(record #21's utilization), compile not included")


# ---------------------------------------------------------------------------------------------
# the memory estimate against a CPU run's peak

PEAK_PROBE = """
import sys, torch
import harness as H, train_gpt as T
torch.set_num_threads(1)
cfg = H.parse_flags(T.Config, T.PRESETS, ["--preset", "cpu_smoke"])[0]
torch.manual_seed(0)
def hwm():  # this process's peak resident KiB (ru_maxrss would start at the forking parent's peak)
    return int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:")))
before = hwm()
model = T.build_model(cfg, T.MODELS[cfg.model])
opts = T.build_optimizers(model, cfg)
n = 3 * cfg.seq_len  # stage 3's micro-batch: one sequence of 3 x --seq-len
ids = torch.randint(0, 50257, (1, n + 1))
for _ in range(2):  # the second step: every optimizer state exists (Adam's from its first update)
    model(ids[:, :-1].reshape(1, n, 1), ids[:, 1:].reshape(1, n, 1)).backward()
    for opt in opts:
        opt.step()
print(sum(p.numel() for p in model.parameters()), (hwm() - before) * 1024)
"""


@pytest.mark.slow  # a CPU run measured against the estimate
def test_the_memory_estimate_is_within_15_percent_of_a_cpu_runs_peak(capsys):
    """Measured on an Intel Xeon (1 thread): cpu_smoke (28.7M parameters, stage 3's 2,304 positions) peaks 1,928 MiB
    above the process's start, estimated 1,878 MiB (the issue 45 core: the same formula)."""
    with open("/proc/meminfo") as f:  # resident memory reads low when the machine is short of it (pages reclaimed)
        roomy = int(next(ln.split()[1] for ln in f if ln.startswith("MemAvailable:"))) > 8 * 2**20
    proc = subprocess.run([sys.executable, "-c", PEAK_PROBE], env=dict(subprocess_env(), OMP_NUM_THREADS="1"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_params, peak = map(int, proc.stdout.split()[-2:])
    spec = T.MODELS["smoke"]
    d, V, n = spec.model_dim, spec.vocab_size, spec.n_layer
    est = 5 * 4 * n_params + 2304 * (3 * V * 4 + 25 * n * d * 2)  # bytes, as --describe counts them
    line = describe(capsys, "--preset", "cpu_smoke")["memory_estimate"]
    assert f"peak about {est / 2**30:.1f} GiB" in line, line
    assert 0.85 < est / peak and (est / peak < 1.15 or not roomy), (est, peak)
    assert math.isclose(n_params, 28_675_853)
    assert re.search(r"a train micro-batch of 2,304 positions", line)
