"""bench/gpu_check.py --dry-run: the one-shot GPU check runs end to end on CPU and reports sane numbers."""
import dataclasses
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from conftest import REPO, subprocess_env

sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402
import gpu_kernels  # noqa: E402
import kernels  # noqa: E402
import train_gpt as T  # noqa: E402

CHECK = gpu_check.CHECK  # the check model's spec (gpu_check.SPECS["check"])
EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU reference


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run as the GPU box runs it: results into $OUT; returns (process, JSON, the archive unpacked)."""
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--dry-run",
                           # the default 240 s (and 180 s for the agreement runs) fit an idle machine; CI may be loaded
                           "--budget-s", "600", "--correct-timeout-s", "450"],
                          cwd=REPO, env=dict(subprocess_env(), OUT=str(out)), capture_output=True, text=True,
                          timeout=700)
    files = sorted(os.listdir(out))
    assert files == ["gpu_check.json", "gpu_check_logs.tar.gz", "gpu_check_summary.txt"], files  # <= 6 files
    with open(out / "gpu_check.json", encoding="utf-8") as f:
        result = json.load(f)
    unpacked = tmp_path_factory.mktemp("gpu_check_logs")
    with tarfile.open(out / gpu_check.ARCHIVE) as tar:
        tar.extractall(unpacked, filter="data")
    return proc, result, unpacked


def test_the_summary_comes_last_and_short_with_the_timing_first(dry_run):
    proc, r, _ = dry_run
    tail = proc.stdout[-gpu_check.SUMMARY_CHARS:]
    summary = r["summary"]
    assert len(summary) <= gpu_check.SUMMARY_CHARS and proc.stdout.rstrip().endswith(summary.rstrip())
    order = [tail.index(s) for s in ("TIMING", "baseline_h200: 12 steps timed", "record_h200: 12 steps timed",
                                     "CHECKS", "CUT SHORT: nothing", "status ok")]
    assert order == sorted(order)
    for stage in r["timing"]["baseline_h200"]["stages"]:
        assert f"  {stage}: " in tail and "ms/step" in tail
    assert tail.count("projected full run (1285 steps)") == 2 and "record #89: 9.84 H100-min | goal: 8 min" in tail
    assert "PASS fp8_linear" in tail and "skip fp8_vs_bf16" in tail
    assert "PASS fp8_head_fixed_scales" in tail and "PASS fp8_down_delayed_scales" in tail
    assert "skip head_grad_layout: not run on the CPU: " in tail
    assert ("not run on the CPU (issue 46): attention_triton, attention_flash, reduce_scatter, all_gather, "
            "all_reduce, warm_up_skew") in tail
    tw = r["timing_window"]  # the window is said: until the budget less the reserve
    until, budget, reserve = (f"{tw[k]:.0f}" for k in ("timing_until_s", "budget_s", "reserve_s"))
    assert f"TIMING (until {until} s of {budget}, the last {reserve} s" in tail
    assert "baseline_h200: 12 steps timed; compile " in tail and "record_h200: 12 steps timed; no compile" in tail


def test_dry_run_exits_zero_and_prints_the_table(dry_run):
    proc, _, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary" in proc.stdout
    for row in ("ms/step (median after the first steps / mean)", "projected train time, FLOPs-weighted", "latent positions/s",
                "windows timed", "bf16_vs_fp32: cpu fp32 eager vs cpu bf16 eager", "flex_vs_sdpa (",
                "flex_vs_sdpa_model (", "compiled_vs_eager_fp32", "loss_vs_float64", "fp8_vs_bf16", "head_grad_layout",
                "fp32_cpu_vs_device", "one step: attention", "one step: optimizer", "max_memory_reserved",
                "pending | attention_flash", "pending | reduce_scatter", "wall time of this check / budget"):
        assert row in proc.stdout, row
    # order of value: the timing runs, then the kernel checks and profile, then the trainer agreement runs
    order = [proc.stdout.index(s) for s in ("timing run of baseline_h200", "timing run of record_h200",
                                            "kernel agreement (", "trainer agreement (")]
    assert order == sorted(order)
    # both columns of the agreement check are printed, and why the others did not run here
    assert "cpu fp32 eager (ref)" in proc.stdout and "bf16_vs_fp32: PASS" in proc.stdout
    assert f"fp8_vs_bf16: skipped ({T.fp8_unavailable_reason('cpu')})" in proc.stdout
    assert "fp32_cpu_vs_device: skipped (the device is the CPU" in proc.stdout


def test_the_check_model_is_the_smoke_models_roles_at_64_wide():
    cfg, preset = gpu_check.config_of(gpu_check.CHECK_MODEL)
    spec, smoke = gpu_check.spec_of(cfg), T.MODELS["smoke"]
    launched = {}
    exec(gpu_check.CHECK_SPECS, launched)  # noqa: S102 -- the specs the launcher patch gives a trainer run of it
    assert launched["SPECS"] == gpu_check.SPECS and gpu_check.SPECS["check"] == spec
    assert preset == "record_h200" and cfg.model == "check" and cfg.tst_frac > 0 and cfg.optimizer == "aurora_normuon"
    assert spec == dataclasses.replace(smoke, model_dim=64, bigram_vocab=4096, window_block=8) and spec.head_dim == 16
    for role in ("paired_heads", "xsa", "attn_gate", "dc", "ve_layers", "skip"):  # every role of record #89's model
        assert getattr(spec, role) == getattr(smoke, role) != (), role
    # windows in blocks of 8: in every stage both the short and the long window are shorter than its sequences
    for st in T.stages(cfg):
        assert max(st.blocks) * spec.window_block < st.seq_len, st


def test_dry_run_agreement_checks_ran_and_passed(dry_run):
    _, r, out = dry_run
    c = r["correctness"]
    assert c["passed"] is True and set(c["checks"]) == {"fp32_cpu_vs_device", "bf16_vs_fp32", "fp8_vs_bf16"}
    b = c["checks"]["bf16_vs_fp32"]
    cfg, preset = gpu_check.config_of(b["candidate_run"]["argv"])  # the check model, in record_h200's recipe
    assert (preset, cfg.model, cfg.num_iterations, cfg.max_steps) == ("record_h200", "check", 5, 2)
    assert c["model"] == gpu_check.CHECK_MODEL + gpu_check.CHECK_TRAIN and cfg.tst_frac > 0
    assert b["passed"] and b["steps_compared"] == 2 and b["tol"] == 2e-2 and 0 <= b["max_abs_diff"] <= b["tol"]
    assert b["reference_run"]["rc"] == b["candidate_run"]["rc"] == 0 and c["bf16_compiled"] is False
    assert "--no-bf16" in b["reference_run"]["argv"] and "--bf16" in b["candidate_run"]["argv"]
    assert "--no-fp8" in b["reference_run"]["argv"] and "--no-fp8" in b["candidate_run"]["argv"]
    with open(out / "logs" / os.path.basename(b["candidate_run"]["log"]), encoding="utf-8") as f:  # bf16 it was
        assert "bf16: True" in f.read().split(gpu_check.SEPARATOR)[1]
    assert c["checks"]["fp8_vs_bf16"] == dict(name="fp8_vs_bf16", passed=None, skipped=T.fp8_unavailable_reason("cpu"))
    assert c["checks"]["fp32_cpu_vs_device"]["passed"] is None


def test_the_record_presets_run_fp8_and_the_trainer_turns_it_off_on_a_cpu_with_a_note(dry_run):
    _, r, out = dry_run
    for preset in ("baseline_h200", "record_h200"):
        assert gpu_check.config_of(["--preset", preset])[0].fp8 is True, preset
    with open(out / "logs" / "timing_record_h200.txt", encoding="utf-8") as f:  # --dry-run's record_h200 run
        body = f.read().split(gpu_check.SEPARATOR)[1]
    assert f"fp8: off ({T.fp8_unavailable_reason('cpu')})" in body
    assert r["timing"]["record_h200"]["problems"] == []


def test_agreement_plan_on_each_device():
    runs, comps, skipped = gpu_check.agreement_plan("cuda", 5, True, None)
    assert list(runs) == ["check_ref_cpu", "check_cuda", "check_cuda_bf16", "check_cuda_fp8"]
    assert runs["check_ref_cpu"] == ("cpu", dict(max_steps=0)) and runs["check_cuda"] == ("cuda", {})
    assert runs["check_cuda_fp8"] == ("cuda", dict(bf16=True, compile_=True, max_steps=0, fp8=True))
    assert [(c[0], c[1], c[2], c[3], c[5]) for c in comps] == [
        ("fp32_cpu_vs_device", "check_ref_cpu", "check_cuda", "tol", 5),
        ("bf16_vs_fp32", "check_cuda", "check_cuda_bf16", "bf16_tol", 5),
        ("fp8_vs_bf16", "check_cuda_bf16", "check_cuda_fp8", "fp8_tol", 5)] and skipped == {}
    why = "fp8 matmuls need compute capability 8.9+"
    runs, comps, skipped = gpu_check.agreement_plan("cuda", 5, True, why)  # e.g. an A100
    assert "check_cuda_fp8" not in runs and skipped == {"fp8_vs_bf16": why} and len(comps) == 2
    runs, comps, skipped = gpu_check.agreement_plan("cpu", 5, False, why)  # --dry-run
    assert runs == {"check_ref_cpu": ("cpu", dict(max_steps=2)),
                    "check_cpu_bf16": ("cpu", dict(bf16=True, compile_=False, max_steps=2))}
    assert comps == [("bf16_vs_fp32", "check_ref_cpu", "check_cpu_bf16", "bf16_tol",
                      ("cpu fp32 eager", "cpu bf16 eager"), 2)]
    assert set(skipped) == {"fp32_cpu_vs_device", "fp8_vs_bf16"}
    args = gpu_check.parse_args([])  # every tolerance key names an argument
    assert (args.tol, args.bf16_tol, args.fp8_tol) == (1e-3, 2e-2, 5e-2)
    argv = gpu_check.check_argv(args, [], "cuda", "/tmp", "x", bf16=True, compile_=True, fp8=True)
    assert {"--bf16", "--fp8", "--compile", "--model"} <= set(argv) and "--no-fp8" not in argv
    cfg, _ = gpu_check.config_of(argv)  # the trainer takes every word
    assert (cfg.model, cfg.bf16, cfg.fp8, cfg.compile, cfg.device) == ("check", True, True, True, "cuda")


def test_the_float32_runs_polar_is_float32_on_every_device(monkeypatch):
    """FP32_POLAR, the agreement checks' float32 runs' patch: NorMuon's Newton-Schulz in float32 on CUDA too (the
    trainer's default there is bf16), an explicit dtype kept; a patched run's command runs it before the trainer."""
    import aurora_opt
    monkeypatch.setattr(aurora_opt, "ns_dtype_on", aurora_opt.ns_dtype_on)  # put back after the test
    cuda = torch.device("cuda")
    assert aurora_opt.ns_dtype_on(cuda) == torch.bfloat16
    exec(gpu_check.FP32_POLAR, {})
    assert aurora_opt.ns_dtype_on(cuda) == aurora_opt.ns_dtype_on(torch.device("cpu")) == torch.float32
    assert aurora_opt.ns_dtype_on(cuda, torch.bfloat16) == torch.bfloat16


def test_dry_run_times_every_stage_of_both_presets_and_projects_their_full_runs(dry_run):
    _, r, out = dry_run
    assert r["schema"] == gpu_check.SCHEMA and r["exit_code"] == 0 and r["status"] == "ok" and r["errors"] == []
    for key in ("env", "microbench", "correctness", "timing", "summary_table", "wall_s"):
        assert r[key] is not None, key
    assert r["env"]["torch"] and r["env"]["device"] == "cpu"
    assert r["microbench"]["matmul"]["tflops"] > 0 and r["microbench"]["copy"]["gbps"] > 0
    assert list(r["timing"]) == ["baseline_h200", "record_h200"]
    for preset, t in r["timing"].items():
        assert t["problems"] == [] and t["steps_logged"] == 12, (preset, t["problems"])
        cfg, _ = gpu_check.config_of(t["run"]["argv"])  # the preset at the check shape, N = 12, 1 extension step
        assert (cfg.model, cfg.num_iterations, cfg.extension_steps, cfg.seq_len) == ("check", 12, 1, 64)
        assert 0 < T.split_step(cfg) < 11  # tied, then untied inside the run: both sides run
        assert cfg.val_tokens == cfg.val_seq_len == 256  # one val chunk (CUDA: the record's 262,144)
        table = T.Schedule(cfg, gpu_check.spec_of(cfg))
        assert list(t["stages"]) == [gpu_check.stage_key(st) for st in table.stages]  # every stage was timed
        assert len(t["stages"]) == 4  # the three recipe stages and the extension
        for key, p in t["stages"].items():  # the median of each stage's steps after its first two
            ms = [row["ms"] for row in t["per_step"] if row["stage"] == key]
            assert p["ms_per_step"] == pytest.approx(float(np.median(ms[min(2, len(ms) - 1):])), abs=0.01)
            assert p["ms_per_step"] > 0 and p["positions_per_s"] > 0 and p["mfu_measured"] > 0
        for row in t["per_step"]:  # FLOPs, positions, window and stage of the optimizer step each log line reports
            step = table[row["step"] - 1]
            assert row["flops"] == step.flops_per_position * step.stage.batch_tokens
            assert tuple(row["window"]) == step.window and row["stage"] == gpu_check.stage_key(step.stage)
        assert [row["positions"] for row in t["per_step"]] == [table[i].stage.batch_tokens for i in range(12)]
        pj = t["projection"]  # the full run: the preset's own N and extension at the same shape
        full, _ = gpu_check.config_of(t["run"]["argv"][:t["run"]["argv"].index("--num-iterations")])
        switch = T.tst_switch_step(full)
        assert (pj["num_iterations"], pj["phase1_steps"], pj["phase2_steps"]) == (1285, switch, 1285 - switch)
        ftable = T.Schedule(full, gpu_check.spec_of(full))
        want = sum(row.flops_per_position * row.stage.batch_tokens for row in ftable.rows[:1285])
        assert pj["phase1_flops"] + pj["phase2_flops"] == pytest.approx(want, rel=1e-12)
        assert [s["stage"] for s in pj["stages"]] == [gpu_check.stage_key(st) for st in ftable.stages]
        weighted = sum(s["flops"] * t["stages"][s["timed_as"]]["ms_per_step"] / t["stages"][s["timed_as"]]["flops_per_step"]
                       for s in pj["stages"])
        assert abs(pj["projected_train_time_ms"] - weighted) <= 1 and pj["missing"] == []
        assert t["peak_memory_mib"] > 0 and (out / "logs" / f"timing_{preset}.txt").exists()
    rec, base = r["timing"]["record_h200"], r["timing"]["baseline_h200"]
    switch = T.tst_switch_step(gpu_check.config_of(rec["run"]["argv"])[0])
    assert rec["switch_step"] == switch > 2 and rec["phase1"]["steps_logged"] == switch and base["phase1"] is None
    # TST phase 1 reads s = 4 raw tokens per latent position (and the document tails it skips)
    assert rec["phase1"]["raw_tokens_per_step"] >= 4 * rec["phase1"]["positions_per_step"]
    # the full record run has stage 1 on both sides of the TST switch; the 12-step run only phase 1 of it
    p2s1 = [s for s in rec["projection"]["stages"] if s["stage"].startswith("phase 2") and "blocks (1, 3)" in s["stage"]]
    assert len(p2s1) == 1 and p2s1[0]["timed_as"].startswith("phase 1 s=4: 64 positions, blocks (1, 3)")
    assert any("was not in the timing run" in w for w in r["warnings"]) and base["projection"]["untimed"] == []
    assert sorted(os.listdir(out)) == ["kernels.json", "logs"]  # the archive: logs, no synthetic shards


def test_dry_run_json_holds_each_graphs_compile_time_and_the_timing_window(dry_run):
    _, r, out = dry_run
    base, rec = r["timing"]["baseline_h200"], r["timing"]["record_h200"]
    # the first preset's run compiled under Dynamo alone: the warm-up's items as the trainer logged them, each with
    # the moment its line came; both sides of the untie (train and val), the optimizers; none in the timed window
    graphs = base["compile_graphs"]
    whats = [g["what"] for g in graphs]
    assert {"train [1, 192, 1] -> [1, 192, 4] tied:1", "train [1, 192, 1] -> [1, 192, 4] tied:0",
            "val [1, 256, 1] -> [1, 256, 1] tied:1", "val [1, 256, 1] -> [1, 256, 1] tied:0",
            "optimizer CautiousAdam", "optimizer NorMuon"} <= set(whats), whats
    assert all(g["ms"] > 0 and g["graphs"] >= 1 for g in graphs)
    at = [g["at_s"] for g in graphs]
    assert at == sorted(at) and 0 < at[0] and at[-1] < base["run"]["wall_s"]
    assert base["compile_time_ms"] >= sum(g["ms"] for g in graphs) and base["graphs_compiled_during_training"] == 0
    assert base["warm_up_graphs"] == sum(g["graphs"] for g in graphs)  # the warm-up's closing line
    # the optimizers' graphs are warmed (and counted) too: CautiousAdam's exceed torch's default limit of 8, which the
    # warm-up raises (no recompile-limit warning), and nothing compiles after it
    per_kind = {g["what"]: g["graphs"] for g in graphs}
    assert per_kind["optimizer NorMuon"] > 0 and per_kind["optimizer CautiousAdam"] > 8, per_kind
    with open(out / "logs" / "timing_baseline_h200.console.txt", encoding="utf-8") as f:
        console = f.read()
    assert "recompile_limit" not in console and "cache_size_limit" not in console
    assert "--compile" in base["run"]["argv"] and "--no-compile" not in rec["run"]["argv"]
    assert rec["compile_graphs"] == [] and base["status"] == rec["status"] == "complete"
    split = T.split_step(gpu_check.config_of(base["run"]["argv"])[0])  # steps on both sides of the untie
    assert base["steps_logged"] == 12 > split + 1 and base["graphs_compiled_during_training"] == 0
    tw = r["timing_window"]
    assert (tw["budget_s"], tw["reserve_s"]) == (600.0, gpu_check.RESERVE_S[0]) and tw["started"] == r["started"]
    assert tw["timing_until_s"] == tw["budget_s"] - tw["reserve_s"]
    runs = tw["runs"]
    assert list(runs) == ["baseline_h200", "record_h200"] and not any(w["cut_short"] for w in runs.values())
    base_run, rec_run = runs["baseline_h200"], runs["record_h200"]
    assert 0 < base_run["started_s"] < base_run["stopped_s"] <= rec_run["started_s"]
    assert runs["record_h200"]["stopped_s"] < r["wall_s"]


def test_dry_run_json_names_issue_46s_rows_not_run_on_the_cpu(dry_run):
    _, r, _ = dry_run
    assert list(r["attention_backends"]) == ["triton", "flash"]
    assert list(r["communication"]) == ["reduce_scatter", "all_gather", "all_reduce", "warm_up_skew"]
    rows = [*r["attention_backends"].values(), *r["communication"].values()]
    for row in rows:
        assert row["passed"] is None and row["skipped"].startswith("not run on the CPU: "), row
    assert {"ms_forward", "ms_forward_backward", "max_rel_diff_vs_sdpa"} <= set(r["attention_backends"]["flash"])
    assert {"ms_per_step", "share_of_step", "per_rank"} <= set(r["communication"]["all_gather"])
    assert {"seconds", "per_rank"} <= set(r["communication"]["warm_up_skew"])
    assert r["args"]["nproc"] == 1 and r["communication_run"] is None


def test_on_a_gpu_the_rows_say_why_they_did_not_run(monkeypatch):
    """Before (or without) their measurement: one GPU has nothing to communicate; FLASH without its package says so."""
    cuda = torch.device("cuda")  # a device object only: nothing here touches a GPU
    monkeypatch.setattr(kernels, "flash_unavailable_reason", lambda device: "the flash-attn-4 package is not installed")
    for nproc, comm_why in ((1, "not run: one GPU"), (8, "not run: the communication profile did not run")):
        attention, comm = gpu_check.pending_rows(cuda, nproc)
        assert attention["flash"]["skipped"] == "not run: the flash-attn-4 package is not installed"
        assert attention["triton"]["skipped"].startswith("not run: the kernel section did not reach it")
        assert all(comm[c]["skipped"].startswith(comm_why) for c in gpu_check.COLLECTIVES)
    assert comm["warm_up_skew"]["skipped"] == "not run: the first timing run did not finish its warm-up"
    assert gpu_check.pending_rows(cuda, 1)[1]["warm_up_skew"]["skipped"] == "not run: one GPU"


def test_a_timing_run_rewrites_the_json_as_each_graph_compiles_and_a_cut_one_says_how_far(tmp_path, monkeypatch):
    """A stand-in trainer logs two warm-up items 2 s apart, then compiles on past the deadline: the JSON is rewritten
    with one item, then two, while it runs; stopped at the deadline, its summary says where the warm-up was."""
    fake = tmp_path / "trainer.py"
    fake.write_text("import time\n"
                    "print('compile: warm-up plan: 7 model graph keys, 2 optimizers', flush=True)\n"
                    "print('compile: train [1, 64, 1] -> [1, 64, 4] tied:1 took 1200ms, 1 graph(s)', flush=True)\n"
                    "time.sleep(2)\n"
                    "print('compile: val [1, 256, 1] -> [1, 256, 1] tied:1 took 800ms, 1 graph(s)', flush=True)\n"
                    "time.sleep(60)\n")
    monkeypatch.setattr(gpu_check, "TRAINER", str(fake))
    live = dict(preset="p", status="running", steps_requested=40, steps_logged=0, compile_time_ms=None,
                compile_graphs=[])
    written = []
    monkeypatch.setitem(gpu_check.SAVE, "fn", lambda archive=True: written.append(len(live["compile_graphs"])))
    monkeypatch.setitem(gpu_check.SAVE, "dirty", False)
    run = gpu_check.TrainerRun("t", [], str(tmp_path), echo=False,
                               on_line=lambda line: gpu_check.note_progress(live, line, run.t0))
    res = run.start().wait(gpu_check.time.monotonic() + 5)
    assert res["timed_out"] and res["rc"] != 0 and 5 <= res["stop_at_s"] < 7
    assert written[:2] == [1, 2]  # one rewrite per item, each within a second of its line (the plan with the first)
    assert live["warm_up_plan"] == dict(model_graphs=7, optimizers=2, items=9)
    assert [g["what"].split()[0] for g in live["compile_graphs"]] == ["train", "val"]
    assert live["compile_graphs"][1]["at_s"] - live["compile_graphs"][0]["at_s"] >= 1.9  # 2 s apart, to 0.1 s
    tm = dict(live, run=dict(res, compile_graphs=None))
    text = gpu_check.warm_up_text(tm)
    assert text.startswith("warm-up cut after 2 of 9 items, 2 graphs (train 1, val 1) in 2.0 s; the next item had "
                           "run ")
    assert gpu_check.warm_up_text(dict(tm, warm_up_plan=None)).startswith("warm-up cut after 2 items, 2 graphs")
    [head] = gpu_check.timing_summary("p", tm, False, dict(started_s=10.0, stopped_s=16.5, cut_short=True))
    assert head == f"p: 0 of 40 steps timed (stopped at the budget, 16 s after the start); {text}"
    assert gpu_check.warm_up_text(dict(tm, compile_graphs=[])).startswith("stopped before any graph compiled")
    done = dict(tm, compile_time_ms=2500.0, steps_logged=3)
    assert gpu_check.warm_up_text(done) == ("compile 2.5 s over 2 items, 2 graphs (slowest: train [1, 64, 1] -> "
                                            "[1, 64, 4] tied:1 1.2 s)")
    assert gpu_check.warm_up_text(dict(done, compile_time_ms=0.0, compile_graphs=[])) == "no compile"


def test_a_long_summary_loses_stage_lines_before_the_checks_and_what_was_cut():
    stages = [f"  phase 2 s=1: {i} positions: " + "9" * 150 for i in range(30)]
    lines = ["TIMING (...)", "baseline_h200: 40 steps timed", *stages, "CHECKS", "  FAIL fp8_head_fixed_scales",
             "CUT SHORT: timing record_h200 stopped at the budget (in its warm-up)", "status failed (exit 1)"]
    text = gpu_check.fit_summary(list(lines))
    kept = [line for line in stages if line in text]
    assert len(text) <= gpu_check.SUMMARY_CHARS and 0 < len(kept) < 30 and kept == stages[:len(kept)]
    assert text.endswith("\n".join(lines[-4:])) and f"({30 - len(kept)} stage lines left out for length" in text
    assert gpu_check.fit_summary(lines[:2] + lines[-4:]) == "\n".join(lines[:2] + lines[-4:])  # short: as it is


def test_projection_weights_each_stage_by_its_flops_at_its_timed_rate():
    # record_h200's table: TST for round(0.3 x 1285) = 386 steps, inside stage 1 (steps 0-422): stage 1 on both sides
    base = ["--preset", "record_h200"]
    cfg, _ = gpu_check.config_of(base)
    table, switch = T.Schedule(cfg, gpu_check.spec_of(cfg)), T.tst_switch_step(cfg)
    keys = [gpu_check.stage_key(st) for st in table.stages]
    assert switch == 386 and len(keys) == 5 and keys[0].startswith("phase 1") and keys[1].startswith("phase 2")
    rates = {k: dict(ms_per_step=100.0 * (i + 1), flops_per_step=1e14 * (i + 2)) for i, k in enumerate(keys)}
    flops = [sum(table[i].flops_per_position for i in range(st.start, st.end)) * st.batch_tokens for st in table.stages]
    pj = gpu_check.projection("record_h200", base, rates)
    assert pj["phase1_flops"] == pytest.approx(flops[0], rel=1e-12)
    assert pj["phase2_flops"] == pytest.approx(sum(flops[1:]), rel=1e-12)
    want = sum(f * rates[k]["ms_per_step"] / rates[k]["flops_per_step"] for f, k in zip(flops, keys))
    assert abs(pj["projected_train_time_ms"] - want) <= 1 and pj["untimed"] == [] and pj["missing"] == []
    assert pj["unweighted_train_time_ms"] == sum((st.end - st.start) * rates[k]["ms_per_step"]
                                                 for st, k in zip(table.stages, keys))
    del rates[keys[1]]  # phase 2 of stage 1 at phase 1's rate, said so
    pj = gpu_check.projection("record_h200", base, rates)
    assert pj["untimed"] == [f"{keys[1]} (projected at the rate of {keys[0]})"] and pj["missing"] == []
    want += flops[1] * (rates[keys[0]]["ms_per_step"] / rates[keys[0]]["flops_per_step"] - 200.0 / 3e14)
    assert abs(pj["projected_train_time_ms"] - want) <= 1
    pj = gpu_check.projection("record_h200", base, {})  # nothing timed: no projection
    assert pj["projected_train_time_ms"] is None and pj["missing"] == keys


def test_synthetic_documents_have_the_requested_mean_length():
    rng = np.random.default_rng(1)
    toks = gpu_check.synthetic_tokens(rng, 200_000, mean_doc=40, zipf=1.2)
    eot = toks == gpu_check.GPT2_VOCAB - 1
    assert toks.dtype == np.uint16 and eot[0] and toks.max() == gpu_check.GPT2_VOCAB - 1
    assert abs(len(toks) / eot.sum() - 40) < 2  # geometric lengths, mean 40 (+- ~5 standard errors)
    assert np.mean(toks[~eot] == 0) > 0.1  # Zipf(1.2): id 0 is ~1/zeta(1.2) = 18% of tokens


def test_log_parsing_and_phase_stats():
    text = "\n".join([
        "def f():  # source snapshot: nothing here is a step line",
        "    return 'step:1/4 train_loss:1.0000 train_time:1ms step_avg:1.00ms'",
        gpu_check.SEPARATOR,
        "compile: warm-up plan: 1 model graph key, 1 optimizer",
        "compile: train [1, 16384, 1] -> [1, 16384, 4] tied:1 attention:FLASH took 61234ms, 1 graph(s)",
        "compile: optimizer NorMuon took 9000ms, 8 graph(s)",
        "compile: warm-up took 71234ms (not in train_time), 9 graphs",
        "step:0/4 val_loss:10.0000 train_time:0ms step_avg:0.00ms phase:1 val_loss_tst:11.0000 tokens:0 flops:0.0e+00",
        "step:1/4 train_loss:9.0000 train_time:300ms step_avg:300.00ms phase:1 tokens:400 lr_scale:1.0000",
        "step:2/4 train_loss:8.0000 train_time:400ms step_avg:200.00ms phase:1 tokens:800 lr_scale:1.0000",
        "tst_switch: step 2: phase 1 -> 2",
        "step:3/4 train_loss:7.0000 train_time:450ms step_avg:150.00ms phase:2 tokens:900 lr_scale:1.0000",
        "step:4/4 train_loss:6.0000 train_time:500ms step_avg:125.00ms phase:2 tokens:1000 lr_scale:1.0000",
        "status:complete",
    ])
    p = gpu_check.parse_log(text)
    assert p["compile_graphs"] == [dict(what="train [1, 16384, 1] -> [1, 16384, 4] tied:1", attention="FLASH", ms=61234,
                                        graphs=1), dict(what="optimizer NorMuon", attention=None, ms=9000, graphs=8)]
    assert p["warm_up_plan"] == dict(model_graphs=1, optimizers=1, items=2)
    assert [r["step"] for r in p["train"]] == [1, 2, 3, 4]
    assert p["compile_ms"] == 71234 and p["warm_up_graphs"] == 9 and p["switch_step"] == 2
    assert p["val"] == [dict(step=0, loss=10.0, loss_tst=11.0)] and p["status"] == "complete"
    rows = gpu_check.step_times(p["train"], at=lambda i: (1e12, 100 * (i + 1)))  # positions from the stage table
    assert [round(r["ms"]) for r in rows] == [300, 100, 50, 50] and all(r["flops"] == 1e12 for r in rows)
    assert [r["positions"] for r in rows] == [100, 200, 300, 400]
    s1 = gpu_check.phase_stats(rows, 1, matmul_tflops=100.0, nominal_tflops=None)
    assert s1["ms_per_step"] == 100 and s1["first_steps_dropped"] == 1  # 2 steps: the first dropped, 1 left
    assert s1["raw_tokens_per_step"] == 400 and s1["positions_per_s"] == 2000
    assert s1["achieved_tflops"] == 10.0 and s1["mfu_measured"] == 0.1
    # a row covering two steps gets the mean FLOPs and positions of the steps it covers (log every 2 steps)
    two = gpu_check.step_times([dict(step=2, train_time_ms=400.0, phase=1, tokens=8)],
                               at=lambda i: ((i + 1) * 1e12, 10 * (i + 1)))
    assert two[0]["flops"] == 1.5e12 and two[0]["positions"] == 15 and two[0]["ms"] == 200
    rows = [dict(step=i, phase=1, ms=ms, tokens=4, positions=1, flops=f, window=[w, w // 2])
            for i, (ms, f, w) in enumerate([(900, 9e12, 8), (100, 1e12, 16), (200, 2e12, 24), (300, 3e12, 32)], 1)]
    s = gpu_check.phase_stats(rows, 1, None, None)
    assert s["first_steps_dropped"] == 2 and s["ms_per_step"] == 250 and s["steps_used"] == 2
    # the kept steps' FLOPs over their median time: the dropped first steps count in neither
    assert s["flops_per_step"] == 2.5e12 and s["achieved_tflops"] == 10.0
    assert s["windows_timed"] == [[24, 12], [32, 16]]
    assert gpu_check.phase_stats(rows, 2, None, None) is None


def test_correctness_comparison_flags_a_difference_and_a_missing_value():
    run = lambda losses, rc=0: dict(rc=rc, val=[], train=[dict(step=i, loss=v) for i, v in enumerate(losses, 1)])  # noqa: E731
    rows, passed, diff = gpu_check.compare_losses(run([10.0, 9.0]), run([10.0, 9.0005]), tol=1e-3)
    assert passed and abs(diff - 5e-4) < 1e-9
    assert not gpu_check.compare_losses(run([10.0, 9.0]), run([10.0, 9.002]), tol=1e-3)[1]
    # a candidate may stop early (--max-steps) but must log what was asked, and only losses the reference has
    assert gpu_check.compare_losses(run([10.0, 9.0]), run([10.0]), tol=1e-3, n_train=1)[1]
    assert not gpu_check.compare_losses(run([10.0, 9.0]), run([10.0]), tol=1e-3, n_train=2)[1]
    assert not gpu_check.compare_losses(run([10.0]), run([10.0, 9.0]), tol=1e-3)[1]
    assert not gpu_check.compare_losses(run([10.0]), run([10.0], rc=1), tol=1e-3)[1]


def test_a_failed_agreement_check_says_why():
    ok = dict(name="ref", argv=[], rc=0, timed_out=False, wall_s=1.0, log="", status="complete",
              train=[dict(step=1, loss=10.0)], val=[])
    check = gpu_check.agreement("bf16_vs_fp32", ok, dict(ok, name="dev", rc=-15, timed_out=True), 2e-2, ("a", "b"), 1)
    assert not check["passed"] and "dev exit status -15, stopped at its time limit" in gpu_check.failure_reason(check)
    check = gpu_check.agreement("bf16_vs_fp32", ok, dict(ok, train=[dict(step=1, loss=10.5)]), 2e-2, ("a", "b"), 1)
    assert not check["passed"] and "max |loss diff| 0.5 vs tolerance 0.02" in gpu_check.failure_reason(check)


def test_dry_run_kernel_checks_and_profile(dry_run):
    _, r, _ = dry_run
    k = r["kernels"]
    assert list(k) == ["fp8_linear", "fp8_head_fixed_scales", "fp8_down_delayed_scales", "head_grad_layout",
                       "flex_vs_sdpa", "loss_vs_float64", "flex_vs_sdpa_model", "compiled_vs_eager_fp32"]
    layout = k["head_grad_layout"]  # CUDA only: named, with why it did not run and the layout the trainer uses
    assert layout["passed"] is None and layout["skipped"].startswith("not run on the CPU: ")
    assert layout["current"] == kernels.HEAD_GRAD_LAYOUT
    assert k["fp8_linear"]["passed"] and k["fp8_linear"]["emulated"]
    head, down = k["fp8_head_fixed_scales"], k["fp8_down_delayed_scales"]  # the scales the presets give the op
    assert head["passed"] and down["passed"] and head["divisor"] == 8
    assert head["scales_expected"] == pytest.approx([100 / 448, 1.6 / 448, 0.75 / 448 / 8], rel=1e-12)
    assert head["scales_used"] == pytest.approx(head["scales_expected"], rel=1e-6)
    assert {"head_fixed_scale", "head_fixed_ref_out", "head_fixed_ref_dx", "head_fixed_ref_dw"} <= set(head["diffs"])
    assert set(down["scales_expected"]) == {"down_bootstrap", "down_delayed"}
    for c in (head, down):
        assert c["max_scale_diff"] <= c["scale_tol"] == 1e-5 and c["max_kernel_diff"] <= c["kernel_tol"]
    assert set(k["flex_vs_sdpa"]["diffs"]) == {"short_out", "paired_out", "long_out"}  # forward only on CPU
    assert set(k["loss_vs_float64"]["diffs"]) == {"value", "grad"}
    assert set(k["flex_vs_sdpa_model"]["diffs"]) == {"logits"}
    for name in ("flex_vs_sdpa", "loss_vs_float64", "flex_vs_sdpa_model"):
        assert k[name]["passed"] and k[name]["max_rel_diff"] < 1e-5, name
    # the model check ran the check model at its two stage-table rows: phase 1's windows, the final ones
    assert k["flex_vs_sdpa_model"]["windows"] == [[24, 8], [160, 48]]
    assert k["compiled_vs_eager_fp32"]["passed"] is None and "CUDA only" in k["compiled_vs_eager_fp32"]["skipped"]
    pf = r["profile"]
    assert set(pf["ms"]) == set(gpu_kernels.PROFILE_PARTS)
    assert all(pf["ms"][p] > 0 for p in ("attention", "MLP", "head + loss", "backward", "optimizer"))
    assert abs(sum(pf["share"].values()) - 1) < 0.01 and r["skipped"] == []
    assert r["wall_s"] <= r["args"]["budget_s"]


@pytest.fixture(scope="module")
def model_check_config():
    return gpu_check.check_model_config("cpu", *gpu_check.MODEL_CHECK_SHAPE)


def _wrong_window(original, paired_only=False):
    """``block_mask_from_bounds`` with the window one position too long (only in paired-head layers'
    doubled sequence with ``paired_only``): the bugs the checks must catch."""
    def wrong(doc_ids, window, block_size=128, paired=False):
        return original(doc_ids, window + 1 if paired or not paired_only else window, block_size, paired)
    return wrong


def test_attention_cases_cover_partial_and_full_blocks():
    cases = gpu_kernels.attention_cases(torch.Generator().manual_seed(0), 384, 48, "cpu")
    blocks = {}
    for name, (ids, window, paired) in cases.items():
        bm = kernels.block_mask_from_bounds(ids, window, paired=paired)
        assert bm.shape[-2:] == (384, 384), name  # one shape: one compiled kernel on CUDA
        blocks[name] = (int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum()))
    assert all(partial > 0 for partial, _ in blocks.values()) and blocks["long"][1] > 0  # full blocks too
    assert cases["paired"][2] and not cases["short"][2] and (cases["short"][0][:, 1:] > cases["short"][0][:, :-1]).any()


@EAGER_FLEX
def test_checks_fail_on_a_window_off_by_one(monkeypatch, model_check_config):
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "block_mask_from_bounds", _wrong_window(kernels.block_mask_from_bounds))
    bad = gpu_kernels.attention_check(T, cpu)
    assert not bad["passed"] and all(d > 100 * bad["tol"] for d in bad["diffs"].values())
    model = gpu_kernels.model_checks(T, model_check_config, CHECK, cpu)["flex_vs_sdpa_model"]
    assert not model["passed"] and model["max_rel_diff"] > 10 * model["tol"]
    assert gpu_kernels.loss_check(T, cpu)["passed"]  # only the broken kernel's checks fail


@EAGER_FLEX
def test_checks_fail_on_a_paired_head_mask_off_by_one(monkeypatch, model_check_config):
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "block_mask_from_bounds", _wrong_window(kernels.block_mask_from_bounds, paired_only=True))
    bad = gpu_kernels.attention_check(T, cpu)
    assert bad["diffs"]["paired_out"] > 100 * bad["tol"]
    assert bad["diffs"]["short_out"] < bad["tol"] and bad["diffs"]["long_out"] < bad["tol"]
    model = gpu_kernels.model_checks(T, model_check_config, CHECK, cpu)["flex_vs_sdpa_model"]
    assert not model["passed"] and model["max_rel_diff"] > 10 * model["tol"]


def test_the_cuda_branch_of_the_model_checks_runs(monkeypatch, model_check_config):
    # CUDA's path (losses, every gradient, the compiled model) with what a CPU runs in place of
    # FlexAttention (SDPA masks) and of the compiler (none): the same numbers, so both checks pass exactly
    original = gpu_kernels.masks_of_kind
    monkeypatch.setattr(gpu_kernels, "masks_of_kind", lambda model, use_flex: original(model, False))
    checks = gpu_kernels.model_checks(T, model_check_config, CHECK, torch.device("cpu"), compile_fn=lambda m: m,
                                      backward=True)
    assert list(checks) == ["flex_vs_sdpa_model", "compiled_vs_eager_fp32"]
    for c in checks.values():
        assert c["passed"] and c["diffs"] == dict(loss=0.0, grad=0.0) and c["grad_tol"] == 1e-3, c["name"]


def test_gradient_comparison_of_the_cuda_checks(monkeypatch, model_check_config):
    # the CUDA checks compare every gradient (FlexAttention has no CPU backward): on CPU's SDPA path,
    # every parameter but the tied embedding's copy is trained, and a window off by one fails them
    cpu = torch.device("cpu")
    model = gpu_kernels.check_model(T, model_check_config, CHECK, cpu)
    batches = gpu_kernels.check_batches(T, model_check_config, CHECK, cpu)
    with gpu_kernels.masks_of_kind(model, use_flex=False):
        ref = gpu_kernels.model_outputs(model, model, batches, grads=True)
        original = kernels.attention_mask
        monkeypatch.setattr(kernels, "attention_mask", lambda ids, window, paired=False: original(ids, window + 1, paired))
        bad = gpu_kernels.model_outputs(model, model, batches, grads=True)
    assert len(ref["loss"]) == 2 and not ref["logits"]
    assert [n for n, g in ref["grads"].items() if g is None] == ["embed.weight"]
    check = gpu_kernels._model_check("x", bad, ref, 1e-4, 1e-3)
    assert not check["passed"] and check["diffs"]["grad"] > 100 * check["grad_tol"]


FP8_SMALL = (64, 32, 128, 256)  # positions, model_dim, MLP hidden, vocab


def _fp8_rows(cfg):
    """The FP8 rows at the presets' scales on CPU (the emulation path), at a small shape."""
    cpu = torch.device("cpu")
    return (gpu_kernels.fp8_head_fixed_check(T, cpu, cfg, CHECK, FP8_SMALL, divisor=8),
            gpu_kernels.fp8_down_delayed_check(T, cpu, FP8_SMALL))


def test_the_fp8_rows_at_the_presets_scales_pass_and_check_the_delayed_rule(model_check_config):
    head, down = _fp8_rows(model_check_config)
    assert head["passed"] and down["passed"] and head["emulated"] and down["emulated"]
    assert max(v for k, v in {**head["diffs"], **down["diffs"]}.items() if "_mm" in k or "_ref_" in k) < 1e-5
    assert 5e-3 < head["diffs"]["head_fixed_out"] < 0.1 and 5e-3 < down["diffs"]["down_delayed_out"] < 0.1
    boot, late = down["scales_expected"]["down_bootstrap"], down["scales_expected"]["down_delayed"]
    assert late[1] / boot[1] == pytest.approx(1.12, rel=1e-9)  # the same weight's amax: x 1 at bootstrap, x 1.12 later
    assert down["scales_used"]["down_delayed"] == pytest.approx(late, rel=1e-6) and late[0] != boot[0]


def _double_arg(fn, i):
    return lambda *a, **k: fn(*[2 * v if j == i else v for j, v in enumerate(a)], **k)


# each: what is broken -> which rows fail (head, down)
FP8_BUGS = {
    "head scales doubled": (lambda mp: mp.setattr(T, "HEAD_SCALES", tuple(2 * v for v in T.HEAD_SCALES)), (1, 0)),
    "head input scale dropped": (lambda mp: mp.setattr(T, "HEAD_SCALES", (1.0, *T.HEAD_SCALES[1:])), (1, 0)),
    "head grad scale not divided": (lambda mp: mp.setattr(T.GPT, "set_loss_divisor", lambda self, d: None), (1, 0)),
    "product drops its scale": (lambda mp: mp.setattr(kernels, "fp8_mm", lambda a, s, b, t, *r, **k: kernels_mm(
        a, torch.ones_like(s), b, t, *r, **k)), (1, 1)),
    "quantized at twice the scale": (lambda mp: mp.setattr(kernels, "fp8_quantize", _double_arg(kernels_q, 1)), (1, 1)),
    "given scales ignored": (lambda mp: mp.setattr(kernels, "fp8_linear", lambda x, w, fp8_grad=False, emulate=False,
                                                   scales=None: kernels_linear(x, w, fp8_grad, emulate)), (1, 1)),
    "input scale doubled": (lambda mp: mp.setattr(kernels, "delay_input_scale_", lambda st, h: (
        kernels_delay(st, h), st[0].mul_(2))), (0, 1)),
    "weight scale dropped": (lambda mp: mp.setattr(kernels, "refresh_down_scales_", lambda st, w, bootstrap: None),
                             (0, 1)),
    "weight scale never delayed": (lambda mp: mp.setattr(kernels, "refresh_down_scales_", lambda st, w, bootstrap:
                                                         kernels_refresh(st, w, True)), (0, 1)),
}
kernels_mm, kernels_q, kernels_linear = kernels.fp8_mm, kernels.fp8_quantize, kernels.fp8_linear
kernels_delay, kernels_refresh = kernels.delay_input_scale_, kernels.refresh_down_scales_


def test_a_model_without_fixed_head_scales_fails_the_head_row(monkeypatch, model_check_config):
    """A model that gives its head no fixed scales leaves the op its current ones: the row fails, no exception."""
    class NoHeadScales(T.GPT):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.head_scales = None
    monkeypatch.setattr(T, "GPT", NoHeadScales)
    head = gpu_kernels.fp8_head_fixed_check(T, torch.device("cpu"), model_check_config, CHECK, FP8_SMALL, divisor=8)
    assert head["scales_used"] is None and not head["passed"] and head["max_scale_diff"] > 0.5


def test_the_head_gradient_layouts_row_times_both_and_fails_when_their_gradients_differ(monkeypatch):
    """head_grad_layout on a CPU's emulation path (``run_here``): both layouts timed at each shape, the same dx and
    dW; a layout that computes another dW (here: xg's product doubled) fails the row; the trainer's layout is put
    back either way."""
    cpu, shapes = torch.device("cpu"), [FP8_SMALL, (32, 32, 128, 256)]
    row = gpu_kernels.head_grad_layout_check(T, cpu, shapes, iters=1, run_here=True)
    assert row["passed"] and row["max_rel_diff"] < 1e-6 and row["current"] == kernels.HEAD_GRAD_LAYOUT == "gx"
    assert set(row["ms"]) == {64, 32} and all(set(ms) == {"gx", "xg"} and min(ms.values()) > 0
                                                for ms in row["ms"].values())
    assert set(row["diffs"]) == {"64_dx", "64_dw", "32_dx", "32_dw"} and set(row["faster"].values()) <= {"gx", "xg"}
    assert row["note"].startswith("faster: ") and "the trainer uses gx" in row["note"]

    def xg_doubled(a, a_s, b, b_s, out_dtype, *r, **k):  # xg's weight product: [in, out], M = model_dim
        out = kernels_mm(a, a_s, b, b_s, out_dtype, *r, **k)
        return 2 * out if kernels.HEAD_GRAD_LAYOUT == "xg" and out.shape == (FP8_SMALL[1], FP8_SMALL[3]) else out
    monkeypatch.setattr(kernels, "fp8_mm", xg_doubled)
    bad = gpu_kernels.head_grad_layout_check(T, cpu, [FP8_SMALL], iters=1, run_here=True)
    assert not bad["passed"] and bad["diffs"]["64_dw"] > 0.5 and bad["diffs"]["64_dx"] < 1e-6
    assert kernels.HEAD_GRAD_LAYOUT == "gx"


@pytest.mark.parametrize("bug", list(FP8_BUGS))
def test_a_doubled_or_dropped_scale_fails_the_fp8_rows(monkeypatch, model_check_config, bug):
    break_it, (head_fails, down_fails) = FP8_BUGS[bug]
    break_it(monkeypatch)
    for row, fails in zip(_fp8_rows(model_check_config), (head_fails, down_fails)):
        if not fails:
            assert row["passed"], (bug, row["name"])
            continue
        worst = max(row["max_scale_diff"] / row["scale_tol"], row["max_kernel_diff"] / row["kernel_tol"])
        assert not row["passed"] and worst > 5, (bug, row["name"], row["diffs"])  # far outside, not at the edge


def test_loss_check_fails_on_a_slightly_wrong_loss(monkeypatch):
    original = kernels.multi_target_loss
    monkeypatch.setattr(T, "multi_target_loss", lambda *a, **kw: original(*a, **kw) * (1 + 1e-4))
    c = gpu_kernels.loss_check(T, torch.device("cpu"))
    assert not c["passed"] and c["diffs"]["value"] > 5e-5


def test_reference_loss_under_the_sigmoid_cap():
    logits = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)
    A, B, C = T.SIGMOID_CAP
    z = [A / (1 + np.exp(-(x + B) / C)) for x in (1.0, 2.0, 0.5)]
    got = gpu_kernels.reference_loss(logits, torch.tensor([[2]]), torch.tensor([1.0]), sigmoid=T.SIGMOID_CAP)
    assert abs(float(got) - (np.log(sum(np.exp(z))) - z[2])) < 1e-12


def test_reference_loss_is_the_textbook_cross_entropy():
    logits = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)
    targets = torch.tensor([[1, -100]])
    got = gpu_kernels.reference_loss(logits, targets, torch.tensor([1.0, 1.0]))
    want = -(2.0 - np.log(np.exp(1.0) + np.exp(2.0) + np.exp(0.5)))
    assert abs(float(got) - want) < 1e-12


def test_sections_run_in_order_of_value_and_skip_what_the_budget_cannot_fit(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "timing", lambda *a: calls.append("timing") or dict(problems=[], warnings=[],
                                                                                      run=dict(wall_s=100.0)))
    monkeypatch.setattr(gpu_check, "kernels_and_profile", lambda *a: calls.append("kernels") or ({}, {}, None))
    monkeypatch.setattr(gpu_check, "correctness", lambda *a: calls.append("agreement") or dict(passed=True))
    section = lambda name, fn, *a: fn(*a)  # noqa: E731
    args = gpu_check.parse_args(["--dry-run"])
    assert args.presets == ["baseline_h200", "record_h200"]
    cpu = torch.device("cpu")
    need_k, need_a = gpu_check.MIN_SECTION_S["kernels"][0], gpu_check.MIN_SECTION_S["agreement"][0]
    assert need_k < need_a  # the cases below assume it
    reserve = gpu_check.RESERVE_S[0]
    assert gpu_check.RESERVE_S[1] <= 60  # the timing runs get all of the budget but a minute at most
    second = reserve + 1.25 * 100.0 + 5  # the first run's wall time x 1.25 is left
    for left, ran in ((second, ["timing", "timing", "kernels", "agreement"]),
                      (reserve + need_a + 5, ["timing", "kernels", "agreement"]),
                      (reserve + (need_k + need_a) / 2, ["timing", "kernels"]),
                      (reserve + need_k - 5, ["timing"]), (reserve - 5, ["timing"])):
        calls.clear()
        res = dict(microbench=None, env=None, errors=[], warnings=[], skipped=[], kernels=None, profile=None,
                   correctness=None, timing={}, timing_window=dict(runs={}))
        gpu_check.run_sections(section, res, cpu, args, [], [], "", gpu_check.time.monotonic() + left)
        assert calls == ran, (left, calls)
        assert len(res["skipped"]) == 4 - len(ran)  # each skipped section (or timing run) is named in the report
        assert res["timing_window"]["runs"]["baseline_h200"]["started_s"] == pytest.approx(args.budget_s - left, abs=1)


# ----------------------------------------------------------------------------------------------
# No compile inside the clock (aurora_opt.warm_step; train_gpt.warm_up: the dry run's compiled timing run), the
# compiled loss's memory

def test_warm_step_runs_the_optimizer_steps_and_changes_nothing():
    from aurora_opt import CautiousAdam, NorMuon, warm_step
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8, 8)),
          torch.nn.Parameter(torch.randn(8))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    make = lambda q: [NorMuon([dict(params=q[:2])]), CautiousAdam([dict(params=q[2:])], lr=0.05)]  # noqa: E731
    opts, ref = make(ps), make(twins)
    for step in range(3):  # state, an odd CautiousAdam call count and live grads at the warm-up
        for q in (ps, twins):
            for p in q:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        if step < 2:
            for o in opts + ref:
                o.step()
    for o in opts:
        warm_step(o)
    for o in opts + ref:
        o.step()
    for a, b in zip(ps, twins):
        assert torch.equal(a, b)
    assert opts[1].calls == ref[1].calls == 3


def test_the_compiled_loss_saves_no_float32_logits_for_the_backward():
    """Bytes the autograd graph keeps per position, compiled (inductor's decompositions and min-cut
    partitioner, without its code generation) vs eager, through ``loss_sum`` as the model calls it."""
    N, V = 256, 512
    logits = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    targets, weights = torch.randint(0, V, (N, 4)), torch.tensor([1.0, 0.5, 0.25, 0.25])

    def saved_per_position(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = fn(logits, targets, weights)
        loss.backward()
        return sum(sizes) / N, loss.detach()

    torch._dynamo.reset()
    compile = lambda f: torch.compile(f, dynamic=False, backend="aot_eager_decomp_partition")  # noqa: E731
    loss_fn = lambda x, t, w: T.loss_sum(x, t, w)  # noqa: E731
    eager, eager_loss = saved_per_position(loss_fn)
    compiled_fn = compile(loss_fn)
    compiled_fn(logits, targets, weights).backward()  # compile first
    compiled, compiled_loss = saved_per_position(compiled_fn)
    assert 2 * V <= eager < 2.2 * V  # the bf16 logits, plus small per-position tensors
    assert compiled <= eager and torch.allclose(compiled_loss, eager_loss, rtol=1e-5)
    # the measurement sees float32 copies: a partitioner that keeps the capped logits saves 4 bytes a logit more
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        compiled_fn(logits, targets, weights).backward()
    assert [t.dtype for t in saved if t.numel() >= N * V] == [torch.bfloat16]


def test_each_section_rewrites_the_json_so_a_stop_keeps_what_was_measured(tmp_path, monkeypatch):
    seen = {}

    def stopped(section, res, *a):  # the sections so far are on disk before the timing starts; then a SIGTERM
        with open(tmp_path / "gpu_check.json", encoding="utf-8") as f:
            seen.update(json.load(f))
        raise KeyboardInterrupt("signal SIGTERM")
    monkeypatch.setattr(gpu_check, "run_sections", stopped)
    monkeypatch.setattr(gpu_check, "data_args", lambda args, work: ([], [], []))  # no shards needed here
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_check.signal, "signal", lambda *a: None)  # pytest keeps its own SIGTERM handling
    for shared in (gpu_check.STOP, gpu_check.SAVE):  # module state main sets: put back after the test
        monkeypatch.setitem(shared, next(iter(shared)), next(iter(shared.values())))
    assert gpu_check.main(["--dry-run", "--matmul-n", "64"]) == 2
    assert seen["env"]["device"] == "cpu" and seen["microbench"]["matmul"]["tflops"] > 0
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check_logs.tar.gz", "gpu_check_summary.txt"]
    final = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "interrupted (signal SIGTERM)" in final["errors"] and "status failed (exit 2)" in final["summary"]


@pytest.mark.parametrize("preset", ["baseline_h200", "record_h200"])
def test_the_cuda_profile_config_is_valid_for_every_gpu_preset(preset):
    """The one-step profile (CUDA only, so the dry run never builds it) must pass the trainer's own checks, and its
    step: one sequence of 4,096 positions, stage 1's, next-token or TST bags as the preset's step 0."""
    cfg = gpu_check.profile_config(preset, torch.device("cpu"))
    row = T.Schedule(cfg, gpu_check.spec_of(cfg))[0]
    assert cfg.model == "record" and (cfg.seq_len, row.stage.seq_len, row.stage.batch_tokens) == (4096, 4096, 4096)
    inputs, targets, weights = gpu_kernels.step_batch(T, cfg, gpu_check.spec_of(cfg), row, torch.device("cpu"),
                                                      cfg.micro_batch_seqs)
    s = row.stage.bag_size
    assert inputs.shape == (1, 4096, s) and targets.shape == (1, 4096, 4 if s == 1 else s)
    assert (weights is None) == (preset == "record_h200") and (s == 4) == (preset == "record_h200")


@pytest.mark.parametrize("where", ["file", "under_a_file", "sys"])
@pytest.mark.parametrize("flag", ["--out", "$OUT"])
def test_an_unwritable_out_folder_is_refused_in_one_line_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                                             where, flag):
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "under_a_file": tmp_path / "f" / "sub", "sys": "/sys/kernel"}[where]
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda **kw: pytest.fail("a work folder was made"))
    monkeypatch.setattr(gpu_check, "environment", lambda *a: pytest.fail("the check ran"))
    monkeypatch.setattr(gpu_check.signal, "signal", lambda *a: None)
    if flag == "$OUT":
        monkeypatch.setenv("OUT", str(out))
    else:
        monkeypatch.delenv("OUT", raising=False)
    assert gpu_check.main(["--dry-run"] + (["--out", str(out)] if flag == "--out" else [])) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gpu_check.py: {flag} {out}: cannot write") and "Traceback" not in line
    assert (tmp_path / "f").read_text() == "x"


def test_a_budget_below_the_plans_minimum_is_refused_naming_the_minimum(capsys):
    for argv, least in ((["--dry-run"], gpu_check.min_budget_s(False)), ([], gpu_check.min_budget_s(True))):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(argv + ["--budget-s", str(least - 1)])
        assert e.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert f"--budget-s {least - 1:g}" in line and f"at least {least:g} s" in line, line
        assert gpu_check.parse_args(argv + ["--budget-s", str(least)]).budget_s == least


# ----------------------------------------------------------------------------------------------
# Issue 46's rows: several GPUs under torchrun (the command, the warm-up skew, the communication profile) and
# FlexAttention's two backends; what a CPU runs of them

import types  # noqa: E402

import gpu_comm  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
# a trainer process's tiny model: the patch binds SPECS, gpu_check.LAUNCH passes it to train_gpt.main
TINY_SPECS = f"import sys; sys.path.insert(0, {TESTS!r}); import conftest; SPECS = conftest.SPECS"


def test_n_gpus_time_under_torchrun_with_the_trainers_own_launch():
    assert [gpu_check.torchrun_procs(n) for n in range(11)] == [1, 1, 2, 2, 4, 4, 4, 4, 8, 8, 8]
    py, trainer, argv = sys.executable, gpu_check.TRAINER, ["--preset", "baseline_h200"]
    assert gpu_check.trainer_command(argv) == [py, "-u", trainer, *argv]
    torchrun = [py, "-u", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert gpu_check.trainer_command(argv, (), 8) == [*torchrun, trainer, *argv]  # run.sh's launch
    code = f"A; B; {gpu_check.LAUNCH}"
    assert gpu_check.trainer_command(argv, ["A", "B"], 1) == [py, "-u", "-c", code, trainer, *argv]
    assert gpu_check.trainer_command(argv, ["A", "B"], 8) == [*torchrun, "--no-python", py, "-u", "-c", code, trainer,
                                                              *argv]
    args = gpu_check.parse_args([])  # this machine has no GPU: one process
    assert args.nproc == 1 and gpu_check.parse_args(["--nproc", "4"]).nproc == 4


@pytest.mark.parametrize("argv", [["--nproc", "3"], ["--dry-run", "--nproc", "2"]])
def test_a_bad_process_count_is_refused_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--nproc {argv[-1]}: give 1, 2, 4 or 8" in line


@pytest.mark.parametrize("gpus, says", [(0, "this box has 0 GPU(s); run it on a GPU box (or --dry-run)"),
                                        (3, "this box has 3 GPU(s); give --nproc 2 or leave it out")])
def test_more_processes_than_gpus_is_refused_before_anything_runs(monkeypatch, capsys, gpus, says):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda **kw: pytest.fail("a work folder was made"))
    assert gpu_check.main(["--nproc", "4"]) == 2
    assert capsys.readouterr().err == f"gpu_check.py: --nproc 4: {says}\n"


def test_the_trainers_warm_up_skew_line_is_parsed_into_the_row(monkeypatch):
    """The line ``train_gpt.warm_up`` logs on several processes (here a one-process gloo group and no graph to
    compile) is the one gpu_check reads; a measured one becomes the ``warm_up_skew`` row."""
    import torch.distributed as dist
    lines = []
    monkeypatch.setattr(T, "graph_batches", lambda run: {})
    rt = types.SimpleNamespace(compile=True, distributed=True, world=1, device=torch.device("cpu"), sync=lambda: None)
    model = types.SimpleNamespace(tied=True, named_buffers=lambda: [], load_state_dict=lambda *a, **k: None)
    run = types.SimpleNamespace(rt=rt, model=model, opts=[], cfg=T.Config(), log=types.SimpleNamespace(line=lines.append))
    limit = torch._dynamo.config.recompile_limit  # warm_up raises it (monkeypatch cannot put a torch config back)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        T.warm_up(run, None)
    finally:
        dist.destroy_process_group()
        torch._dynamo.config.recompile_limit = limit
    skew = gpu_check.parse_log("\n".join(lines))["warm_up_skew"]
    assert skew["skew_ms"] == 0 and skew["min_ms"] == skew["max_ms"] and skew["dist_timeout_s"] == 600
    line = "compile: warm-up per rank 101234-113456ms, skew 12222ms (--dist-timeout 600s)"
    row = gpu_check.skew_row(gpu_check.parse_log(line)["warm_up_skew"], "baseline_h200")
    assert row == dict(name="warm_up_skew", passed=None, skipped=None, seconds=12.2, preset="baseline_h200",
                       per_rank=dict(min_s=101.2, max_s=113.5), dist_timeout_s=600.0, share_of_dist_timeout=0.0204)
    assert gpu_check.skew_row(None, "p")["skipped"].startswith("not run: the timing run of p logged no per-rank")


def fake_profiler(kernels_us):
    """A finished profiler's stand-in: ``key_averages()`` of device kernels ``{name: (us, calls)}`` plus what a real
    one lists beside them (host ops, a GPU annotation of the same collective, a compute kernel)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda key, us, n, kind: types.SimpleNamespace(key=key, device_time_total=us, count=n, device_type=kind)  # noqa: E731
    noise = [ev("nccl:all_reduce", 9e6, 3, cpu), ev("c10d::allreduce_", 9e6, 3, cpu), ev("nccl:all_gather", 9e6, 3, cuda),
             ev("void at::native::vectorized_elementwise_kernel<4>", 9e6, 3, cuda), ev("ncclCommInit", 9e6, 1, cpu)]
    return types.SimpleNamespace(key_averages=lambda: [ev(k, us, n, cuda) for k, (us, n) in kernels_us.items()] + noise)


def test_nccl_kernels_sum_into_each_collectives_share_per_rank():
    names = {"ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "reduce_scatter",
             "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)": "all_gather",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
             "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)": "all_reduce",
             "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "other",
             "void at::native::elementwise_kernel": None, "nccl:all_reduce": None}
    assert {n: gpu_comm.collective_of(n) for n in names} == names
    rs, ag, ar1, ar2, sr = list(names)[:5]
    ranks = []
    for rank, scale in ((0, 1.0), (1, 2.0)):  # rank 1's kernels take twice as long, its steps 1.5 times
        prof = fake_profiler({rs: (3000 * scale, 6), ag: (1500 * scale, 6), ar1: (600 * scale, 3), ar2: (300 * scale, 3),
                              sr: (30.0, 3)})
        steps = [40.0 * (1 + rank / 2), 38.0 * (1 + rank / 2), 41.0 * (1 + rank / 2)]
        ranks.append(gpu_comm.rank_result(rank, 2, 4, steps, gpu_comm.device_kernels(prof)))
    r0 = ranks[0]["collectives"]
    assert ranks[0]["ms_per_step"] == 40.0 and ranks[1]["ms_per_step"] == 60.0  # the median step
    assert r0["reduce_scatter"] == dict(ms_per_step=1.0, calls_per_step=2.0, share_of_step=0.025)  # 3 ms / 3 steps
    assert r0["all_reduce"] == dict(ms_per_step=0.3, calls_per_step=2.0, share_of_step=0.0075)  # both all-reduce kernels
    assert r0["other"]["ms_per_step"] == 0.01 and len(r0["kernel_names"]) == 5  # no annotation, host op or compute
    rows = gpu_comm.communication_rows(ranks[::-1], 2)
    assert list(rows) == list(gpu_comm.COLLECTIVES)
    ag_row = rows["all_gather"]  # 0.5 ms of 40 on rank 0, 1 ms of 60 on rank 1
    assert ag_row["ms_per_step"] == pytest.approx(0.75) and ag_row["share_of_step"] == pytest.approx((0.5 / 40 + 1 / 60) / 2,
                                                                                                     abs=1e-4)
    assert ag_row["spread"] == dict(ms_per_step=[0.5, 1.0], share_of_step=[0.0125, 0.0167])
    assert [p["rank"] for p in ag_row["per_rank"]] == [0, 1] and ag_row["per_rank"][1]["step_ms"] == 60.0
    assert ag_row["skipped"] is None and ag_row["passed"] is None and ag_row["ranks_measured"] == 2
    one = gpu_comm.communication_rows(ranks[:1], 2, "stopped at the budget")  # a rank without its file is said
    assert one["all_reduce"]["ranks_measured"] == 1 and one["all_reduce"]["problems"] == ["rank 1: stopped at the budget"]
    none = gpu_comm.communication_rows([dict(rank=0, error="boom", collectives=None)], 2, "gone")
    assert none["reduce_scatter"]["skipped"] == "not run: rank 0: boom; rank 1: gone"


def test_the_summary_shows_the_measured_issue_46_rows():
    comm = gpu_comm.communication_rows([gpu_comm.rank_result(r, 2, 4, [50.0], [("ncclDevKernel_AllGather_RING_LL", 5000.0,
                                                                              2)]) for r in (0, 1)], 2)
    res = dict(attention_backends=dict(
        triton=dict(name="attention_triton", backend="triton", passed=True, skipped=None, tol=0.03,
                    ms_forward={"16384x1408": 1.5}, ms_forward_backward={"16384x1408": 5.25},
                    max_rel_diff_vs_sdpa=0.004),
        flash=dict(name="attention_flash", backend="flash", passed=None, tol=0.03, ms_forward={"16384x1408": 1.0},
                   ms_forward_backward={}, max_rel_diff_vs_sdpa=0.003,
                   skipped="refused: NotImplementedError: no backward")),
        communication=dict(comm, warm_up_skew=gpu_check.skew_row(dict(min_ms=90_000, max_ms=100_000, skew_ms=10_000,
                                                                      dist_timeout_s=600.0), "baseline_h200")),
        communication_run=dict(world=2, preset="baseline_h200", profiled_steps=[4, 6], per_rank_ms_per_step={0: 50.0,
                                                                                                           1: 50.0},
                               other_nccl_ms_per_step={0: 0.0, 1: 0.5}))
    text = "\n".join(gpu_check.issue46_lines(res))
    assert "  PASS triton: 16384x1408: 1.50/5.25; max diff 4.000e-03 (tolerance 0.03)" in text
    assert "  flash: refused: NotImplementedError: no backward (timed before: 16384x1408: 1.00/-)" in text
    assert "COMMUNICATION (2 GPUs, torchrun; baseline_h200 steps 4-6 profiled;" in text
    assert "  ms/step per rank (profiled): 50.00-50.00; other NCCL kernels up to 0.50 ms a step" in text
    assert "  all_gather: 5.00-5.00 ms (10.0-10.0%)" in text and "  reduce_scatter: 0.00-0.00 ms (0.0-0.0%)" in text
    assert "  warm-up skew 10.00 s between ranks (90.00-100.00 s; --dist-timeout 600 s)" in text
    table = gpu_check.render_table([(s, i, gpu_check.fmt(v), u) for s, i, v, u in gpu_check.check_rows(res)])
    assert "attention_triton vs sdpa" in table and "all_gather: ms/step (share of the step), mean of 2 ranks" in table
    res["communication"] = gpu_check.pending_rows(torch.device("cuda"), 1)[1]
    assert "COMMUNICATION: not run: one GPU" in gpu_check.issue46_lines(res)
    res["attention_backends"]["triton"]["passed"] = False  # a backend off SDPA fails the check (exit 1)
    res.update(kernels=None, correctness=dict(passed=True), errors=[])
    gpu_check.final_status(res)
    assert res["exit_code"] == 1 and "kernel agreement: attention_triton failed" in res["errors"]


def test_the_communication_profile_runs_steps_of_the_first_stage_of_the_timing_run(tmp_path):
    args = gpu_check.parse_args(["--nproc", "8"])
    argv, warm, steps = gpu_check.comm_argv(args, "baseline_h200", ["--train-files", "t", "--val-files", "v"], "cuda",
                                            str(tmp_path))
    cfg = gpu_check.config_of(argv)[0]  # the last --max-steps and --run-id win
    assert (warm, steps, cfg.max_steps, cfg.run_id, cfg.num_iterations) == (3, 3, 6, "comm_baseline_h200", 40)
    assert T.Schedule(cfg, gpu_check.spec_of(cfg)).stages[0].end >= 6 and T.grad_accum_steps(cfg, 8) == 1
    short = dataclasses.replace(cfg, num_iterations=12)  # a first stage of 4 steps: one step recorded
    assert T.Schedule(short, gpu_check.spec_of(short)).stages[0].end == 4 and gpu_check.comm_window(short) == (3, 1)


def test_a_profiled_torchrun_run_reports_each_ranks_step_and_communication(tmp_path):
    """The profile's whole path on 2 gloo processes (the tiny model, 4 steps): torchrun with the launcher patches,
    ``gpu_comm.install`` on each rank, the ranks' files into rows (gloo runs no NCCL kernel: 0 ms, each rank's step
    measured)."""
    from conftest import tiny_args
    argv = tiny_args(tmp_path, "--batch-tokens", "384", "--val-every", "0", "--max-steps", "4", "--run-id", "comm_t")
    rows, meta = gpu_check.comm_profile("comm_t", argv, 2, 2, 2, str(tmp_path), gpu_check.time.monotonic() + 300,
                                        patches=[TINY_SPECS])
    assert meta["run"]["rc"] == 0 and meta["run"]["status"] == "stopped_early", meta
    assert meta["profiled_steps"] == [3, 4] and sorted(meta["per_rank_ms_per_step"]) == [0, 1]
    assert all(ms > 0 for ms in meta["per_rank_ms_per_step"].values())
    assert meta["other_nccl_ms_per_step"] == {0: 0.0, 1: 0.0}
    for c in gpu_comm.COLLECTIVES:
        row = rows[c]
        assert row["skipped"] is None and row["ranks_measured"] == 2 and row["ms_per_step"] == 0.0, row
        assert [len(json.loads((tmp_path / "logs" / f"comm_t.rank{r}.json").read_text())["step_ms"]) for r in (0, 1)] == [2, 2]


def test_stopping_a_torchrun_run_ends_every_process_it_started(tmp_path, monkeypatch):
    """Processes that ignore SIGTERM: torchrun's, then each rank's own session, are killed after the grace."""
    fake = tmp_path / "trainer.py"
    fake.write_text("import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                    f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                    "time.sleep(300)\n")
    monkeypatch.setattr(gpu_check, "TRAINER", str(fake))
    monkeypatch.setattr(gpu_check.TrainerRun, "STOP_GRACE_S", 2.0)
    run = gpu_check.TrainerRun("t", [], str(tmp_path), echo=False, nproc=2).start()
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    for _ in range(600):
        if all(p.exists() and p.read_text() for p in pids):
            break
        gpu_check.time.sleep(0.1)
    workers = [int(p.read_text()) for p in pids]
    res = run.wait(gpu_check.time.monotonic())

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
        except OSError:
            return False
    for _ in range(50):
        if not any(alive(p) for p in workers):
            break
        gpu_check.time.sleep(0.1)
    assert res["timed_out"] and not any(alive(p) for p in workers)


# FlexAttention's backends: the row on a CPU (eager, float32, forward), its refusals

def test_the_attention_rows_take_the_records_shapes():
    assert gpu_kernels.attention_shapes(T) == ((16384, 49152), (1408, 640), 6, 128, 0.1)


def test_attention_rows_on_a_cpu_and_without_flash_say_why_and_compile_nothing(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled"))
    for backend in gpu_check.ATTENTION_BACKENDS:
        row = gpu_kernels.attention_backend_check(T, torch.device("cpu"), backend)
        assert row["passed"] is None and row["skipped"] == gpu_kernels.ATTENTION_ON_CPU and row["ms_forward"] is None
    monkeypatch.setattr(kernels, "flash_unavailable_reason", lambda d: "the flash-attn-4 package is not installed")
    row = gpu_kernels.attention_backend_check(T, torch.device("cuda"), "flash")  # a device object: no GPU touched
    assert row["skipped"] == "not run: the flash-attn-4 package is not installed" and row["passed"] is None


SMALL_ATTENTION = dict(shapes=((256,), (48, 24), 2, 16, 0.25), ref_len=256, tol=1e-4, trials=1, iters=1,
                       dtype=torch.float32, compile_fn=lambda f: f, backward=False, run_here=True)


@EAGER_FLEX
def test_the_attention_row_times_each_shape_and_fails_on_a_window_off_by_one(monkeypatch):
    row = gpu_kernels.attention_backend_check(T, torch.device("cpu"), "triton", **SMALL_ATTENTION)
    assert row["passed"] is True and row["max_rel_diff_vs_sdpa"] < 1e-5 and set(row["diffs"]) == {"out_48", "out_24"}
    assert set(row["ms_forward"]) == {"256x48", "256x24"} and row["ms_forward_backward"] is None
    build = kernels.build_attention_mask
    monkeypatch.setattr(kernels, "build_attention_mask", lambda ids, w, flex: build(ids, w + 1, flex))
    bad = gpu_kernels.attention_backend_check(T, torch.device("cpu"), "triton", **SMALL_ATTENTION)
    assert bad["passed"] is False and bad["max_rel_diff_vs_sdpa"] > 1e-3


def test_a_backend_raising_at_compile_is_a_refused_row_not_a_crash():
    def compile_fn(f):
        def call(*a, **k):
            if f.keywords["backend"] == "FLASH":  # as Dynamo wraps inductor's refusal
                inner = RuntimeError("BACKEND='FLASH' but flash attention cannot be used: CUTE flash attention "
                                     "library is not available.\nmore")
                raise RuntimeError("backend='inductor' raised:\nRuntimeError: ...") from inner
            return f(*a, **k)
        return call
    row = gpu_kernels.attention_backend_check(T, torch.device("cpu"), "flash", **dict(SMALL_ATTENTION,
                                                                                        compile_fn=compile_fn))
    assert row["passed"] is None and row["ms_forward"] is None
    assert row["skipped"] == ("refused: RuntimeError: BACKEND='FLASH' but flash attention cannot be used: CUTE flash "
                              "attention library is not available.")


def test_several_gpus_profile_communication_after_the_first_timing_run(monkeypatch):
    calls = []
    skew = dict(min_ms=1000, max_ms=1500, skew_ms=500, dist_timeout_s=600.0)
    monkeypatch.setattr(gpu_check, "timing", lambda *a: calls.append("timing") or dict(
        problems=[], warnings=[], run=dict(wall_s=10.0), warm_up_skew=skew))
    comm_rows = {c: dict(name=c, skipped=None) for c in gpu_check.COLLECTIVES}
    monkeypatch.setattr(gpu_check, "communication", lambda *a: calls.append("communication") or (comm_rows, {"w": 2}))
    monkeypatch.setattr(gpu_check, "kernels_and_profile", lambda *a: calls.append("kernels") or ({}, {}, None))
    monkeypatch.setattr(gpu_check, "correctness", lambda *a: calls.append("agreement") or dict(passed=True))
    args = gpu_check.parse_args(["--dry-run"])
    args.nproc = 2
    cpu = torch.device("cpu")
    res = dict(microbench=None, env=None, errors=[], warnings=[], skipped=[], kernels=None, profile=None,
               correctness=None, timing={}, timing_window=dict(runs={}), communication_run=None)
    res["attention_backends"], res["communication"] = gpu_check.pending_rows(cpu, 2)
    gpu_check.run_sections(lambda name, fn, *a: fn(*a), res, cpu, args, [], [], "", gpu_check.time.monotonic() + 500)
    assert calls == ["timing", "communication", "timing", "kernels", "agreement"]
    assert res["communication"]["all_gather"] is comm_rows["all_gather"] and res["communication_run"] == {"w": 2}
    assert res["communication"]["warm_up_skew"]["seconds"] == 0.5
