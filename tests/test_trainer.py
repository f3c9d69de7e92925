"""The trainer end to end: the CLI built from Config, the presets, shards and streams, the batch split, a run's log,
the loop in train_gpt.py (no harness frame under an optimizer step) and harness.py as a toolbox."""
import ast
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import aurora_opt as A
import harness as H
import train_gpt as T
from conftest import REPO, SPECS, TINY, loss_lines, read_log, subprocess_env, tiny_args, write_shard


def config(*argv):
    cfg, preset, _ = H.parse_flags(T.Config, T.PRESETS, list(argv))
    T.check_config(cfg, SPECS)
    return cfg, preset


DEFAULTS = {f.name: f.default for f in dataclasses.fields(T.Config)}

# ---------------------------------------------------------------------------------------------
# the CLI and the presets


def test_help_lists_at_most_45_flags_each_a_config_field_with_its_default():
    out = subprocess.run([sys.executable, "train_gpt.py", "--help"], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stderr == ""
    options = re.findall(r"^  (-[-\w]+(?:, --[-\w]+)*)", out.stdout, flags=re.M)
    assert len(options) <= 45, options  # one a line: "-h, --help", "--fp8, --no-fp8", "--seed SEED", ...
    flags = {name for group in options for name in group.split(", ") if not name.startswith("--no-")}
    fields = {H.flag_of(f.name) for f in dataclasses.fields(T.Config)}
    assert flags == fields | {"-h", "--help", "--preset", "--describe"} and len(options) == len(fields) + 3
    text = " ".join(out.stdout.split())
    for f in dataclasses.fields(T.Config):  # the record's defaults are what --help shows
        if f.default not in (None, ""):
            assert f"(default: {f.default})" in text, f.name


def test_presets_are_the_defaults_plus_what_differs():
    """baseline_h200 is the defaults, record_h200 adds TST and Aurora; cpu_smoke is cpu_baseline plus the same; a
    preset names no value equal to Config's default (it would read as a change)."""
    assert T.PRESETS["baseline_h200"] == {} and T.PRESETS["record_h200"] == T.OUR_METHODS
    assert T.PRESETS["cpu_smoke"] == {**T.PRESETS["cpu_baseline"], **T.OUR_METHODS}
    assert T.OUR_METHODS == dict(tst_frac=0.3, tst_bag_size=4, optimizer="aurora_normuon")
    for name, preset in T.PRESETS.items():
        same = [k for k, v in preset.items() if type(v) is type(DEFAULTS[k]) and v == DEFAULTS[k]
                and k != "tst_bag_size"]  # OUR_METHODS names its bag size beside its fraction on purpose
        assert same == [], (name, same)
        cfg, got = config("--preset", name)
        assert got == name and cfg == dataclasses.replace(T.Config(), **preset)


def test_a_typed_flag_beats_the_preset_and_the_preset_beats_the_default():
    cfg, _ = config("--num-iterations", "7", "--preset", "cpu_smoke")
    assert cfg.num_iterations == 7 and cfg.model == "smoke" and cfg.seq_len == 768
    assert config()[0] == T.Config() and config()[0].model == "record"


def test_config_to_argv_round_trips_a_config_and_a_logs_config_dict():
    cfg, _ = config("--preset", "cpu_smoke", "--tst-mode", "output", "--compile", "--no-fp8", "--run-id", "x")
    assert config(*H.config_to_argv(cfg))[0] == cfg
    logged = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as a log's config: line holds it
    assert config(*H.config_to_argv(logged))[0] == cfg
    assert "--compile" in H.config_to_argv(cfg) and "--no-fp8" in H.config_to_argv(cfg)
    assert "--bf16" not in " ".join(H.config_to_argv(cfg))  # unset (None): the device decides


# ---------------------------------------------------------------------------------------------
# shards, streams, fingerprints


def test_a_good_shard_reads_back(tmp_path):
    path = write_shard(tmp_path / "good.bin", [50256, 1, 2, 3])
    assert len(H.read_shard(path)) == 4
    assert H.TokenStream([path]).read(0, 4).tolist() == [50256, 1, 2, 3]


def test_the_token_stream_reads_across_shards_and_wraps_only_the_train_stream(shard_dir):
    files = sorted(str(p) for p in shard_dir.glob("t_train_*.bin"))
    stream = H.TokenStream(files, wrap=True)
    assert stream.total == 3000 and stream.read(0, 3).dtype == np.int64
    assert stream.read(1690, 20).tolist() == list(range(1690, 1710))
    assert stream.read(2995, 10).tolist() == [2995, 2996, 2997, 2998, 2999, 0, 1, 2, 3, 4]
    assert stream.read(6001, 2).tolist() == [1, 2]  # the third pass
    with pytest.raises(H.DataError, match=r"asked for tokens \[2995, 3005\) but the shards hold 3000 "
                                          r"\(t_train_000001.bin, t_train_000002.bin\.\.\.\); add shards"):
        H.TokenStream(files).read(2995, 10)


def test_a_fingerprint_names_the_contents_not_the_path(shard_dir, tmp_path):
    a = shard_dir / "t_train_000001.bin"
    (tmp_path / "copy.bin").write_bytes(a.read_bytes())
    assert H.fingerprint(str(a)) == H.fingerprint(str(tmp_path / "copy.bin")) != H.fingerprint(
        str(shard_dir / "t_train_000002.bin"))
    data = H.find_data(str(shard_dir / "t_train_*.bin"), str(shard_dir / "t_val_*.bin"))
    assert [f for f, _ in data["train"]] == sorted(str(p) for p in shard_dir.glob("t_train_*.bin"))
    assert [fp for _, fp in data["val"]] == [H.fingerprint(str(shard_dir / "t_val_000000.bin"))]


def test_a_folder_or_fifo_among_the_matches_is_refused_not_read(shard_dir):
    os.mkfifo(shard_dir / "t_train_000009.bin")  # opening it for reading would block forever
    with pytest.raises(H.DataError, match=r"t_train_000009.bin is not a file \(a folder\?\); give a glob of shard "
                                          r"files"):
        H.find_data(str(shard_dir / "t_train_*.bin"), str(shard_dir / "t_val_*.bin"))
    with pytest.raises(H.DataError, match=rf"--val-files '{shard_dir}': {shard_dir} is not a file"):
        H.resolve_files(str(shard_dir), "--val-files")


# ---------------------------------------------------------------------------------------------
# the batch split


@pytest.mark.parametrize("argv, world, accum", [
    (["--preset", "baseline_h200"], 1, 8), (["--preset", "record_h200"], 8, 1), (["--preset", "baseline_h200"], 2, 4),
    (["--preset", "baseline_h200", "--micro-batch-seqs", "2"], 2, 2), (["--preset", "cpu_smoke"], 1, 1)])
def test_every_step_has_stage_1s_sequence_count_split_over_processes_and_micro_batches(argv, world, accum):
    cfg, _ = config(*argv)
    assert T.grad_accum_steps(cfg, world) == accum
    assert {st.batch_tokens // st.seq_len for st in T.stages(cfg)} == {accum * cfg.micro_batch_seqs * world}


@pytest.mark.parametrize("world, fits", [(3, "1 or 2 or 4 or 8"), (16, "1 or 2 or 4 or 8")])  # the 4 largest that do
def test_a_process_count_that_cannot_split_the_batch_names_those_that_can(world, fits):
    cfg, _ = config("--preset", "baseline_h200")
    with pytest.raises(H.ConfigError, match=rf"^{world} process\(es\) x --micro-batch-seqs 1 do not divide a step's 8 "
                                            rf"sequence\(s\) .*; run {fits} process\(es\) \(run.sh's NPROC"):
        T.grad_accum_steps(cfg, world)


# ---------------------------------------------------------------------------------------------
# a run, end to end: cpu_smoke's recipe (TST, aurora_normuon) on the tiny model


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A cpu_smoke-shaped run (its preset, the tiny model and batch: TST phase 1 over steps 0-1), the file names of
    the call stack at its first optimizer step, and its log."""
    tmp = tmp_path_factory.mktemp("e2e")
    stacks, real_steps = [], {cls: cls.step for cls in (A.CautiousAdam, A.NorMuon)}

    def recording(cls):
        def step(self, *args, **kw):
            if not stacks:
                stacks.append([(os.path.basename(f.filename), f.function) for f in inspect.stack()])
            return real_steps[cls](self, *args, **kw)
        return step
    for cls in real_steps:
        cls.step = recording(cls)
    try:
        assert T.main(tiny_args(tmp, "--preset", "cpu_smoke", "--run-id", "e2e"), models=SPECS) == 0
    finally:
        for cls, step in real_steps.items():
            cls.step = step
    return tmp, stacks[0], read_log(tmp / "logs", "e2e")


def test_the_first_optimizer_step_runs_under_train_gpts_loop_with_no_harness_frame(smoke_run):
    _, stack, _ = smoke_run
    files = [f for f, _ in stack]
    assert "harness.py" not in files, stack
    ours = [(f, fn) for f, fn in stack if f in ("train_gpt.py", "harness.py", "aurora_opt.py", "kernels.py")]
    assert ours == [("train_gpt.py", "train"), ("train_gpt.py", "main")], stack  # main -> train -> opt.step


def test_harness_imports_nothing_from_train_gpt_and_importing_trains_nothing():
    tree = ast.parse(open(os.path.join(REPO, "harness.py"), encoding="utf-8").read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.split(".")[0] in ("train_gpt", "aurora_opt", "kernels")}, imported
    code = "import sys, harness; print('train_gpt' in sys.modules); import train_gpt, aurora_opt; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=REPO,
                         timeout=300)
    assert out.stdout.split() == ["False", "ok"] and out.stderr == ""


def test_the_log_is_a_snapshot_then_the_header_steps_phases_and_summary(smoke_run):
    tmp, _, text = smoke_run
    head, rest = text.split(H.SEPARATOR + "\n", 1)
    assert [ln.split()[2] for ln in head.splitlines() if ln.startswith("### file ")] == list(H.SOURCE_FILES)
    assert H.SOURCE_FILES == ("train_gpt.py", "kernels.py", "aurora_opt.py", "harness.py", "data/shard_format.py")
    assert head == H.source_snapshot()  # every file the run imports, exactly
    lines = rest.splitlines()
    assert lines[0].startswith("python: ") and "\npreset: cpu_smoke\n" in rest
    config = json.loads(next(ln for ln in lines if ln.startswith("config: "))[8:])
    assert config == dataclasses.asdict(config_of(tmp)) and config["optimizer"] == "aurora_normuon"
    for needle in ("world_size: 1", "\ncommand: ", "\ngit: ", "\ndata train: ", "fingerprint:", "\ndata val: ",
                   "\ndata tokenizer: data/gpt2_bpe/encoder.json fingerprint:"):
        assert needle in rest, needle
    train = [ln for ln in lines if " train_loss:" in ln]
    assert [ln.split()[0] for ln in train] == [f"step:{i}/8" for i in range(1, 9)]
    assert all("phase:1" in ln for ln in train[:2]) and all("phase:2" in ln for ln in train[2:])
    switch = next(i for i, ln in enumerate(lines) if ln.startswith("tst_switch: step 2: phase 1 -> 2"))
    assert lines[switch - 1].startswith("step:2/8 train_loss")
    val = loss_lines(text, "val_loss")
    assert sorted(val) == [0, 4, 8]
    assert "val_loss_tst:" in next(ln for ln in lines if ln.startswith("step:0/8 val_loss"))  # phase 1: its own too
    assert lines[-1] == "status:complete" and lines[-2].startswith("summary: final_val_loss:")
    summary = json.loads((tmp / "logs" / "e2e.json").read_text())
    assert (summary["status"], summary["steps"], summary["preset"]) == ("complete", 8, "cpu_smoke")
    assert summary["final_val_loss"] == pytest.approx(val[8], abs=1e-4)
    # accounting: phase 1 reads s = 4 times the text of a latent position; the summary's count is the last line's
    tokens = [int(ln.split("tokens:")[1].split()[0]) for ln in train]
    steps = [b - a for a, b in zip([0] + tokens, tokens)]
    assert all(n >= 65 * 4 for n in steps[:2]) and all(n >= 129 for n in steps[2:])
    assert summary["raw_tokens"] == tokens[-1] and summary["positions"] == 2 * 64 + 3 * 128 + 3 * 192
    table = T.Schedule(config_of(tmp), TINY)
    assert summary["flops"] == pytest.approx(sum(r.flops_per_position * r.stage.batch_tokens
                                                 for r in table.rows[:8]), rel=1e-12)
    # --describe's tokens of text are what the steps train on; the packed loader reads more (cut documents, caps)
    assert summary["raw_tokens"] >= sum((st.end - st.start) * st.raw_tokens() for st in table.stages) > 0


def config_of(tmp):
    return config(*tiny_args(tmp, "--preset", "cpu_smoke", "--run-id", "e2e"))[0]


def test_a_cpu_run_repeats_exactly_with_the_same_seed(smoke_run, tmp_path):
    _, _, text = smoke_run
    assert T.main(tiny_args(tmp_path / "b", "--preset", "cpu_smoke", "--max-steps", "2"), models=SPECS) == 0
    again = read_log(tmp_path / "b" / "logs")
    assert loss_lines(again) == {s: v for s, v in loss_lines(text).items() if s <= 2}
    assert loss_lines(again, "val_loss") == {0: loss_lines(text, "val_loss")[0]}
    assert T.main(tiny_args(tmp_path / "c", "--preset", "cpu_smoke", "--max-steps", "1", "--seed", "1"),
                  models=SPECS) == 0
    assert loss_lines(read_log(tmp_path / "c" / "logs"))[1] != loss_lines(text)[1]


def test_reading_past_the_end_of_the_train_shards_is_logged_once(tmp_path, shard_dir):
    # 300 one-token documents (every token an <|endoftext|>): a sequence of L positions reads exactly its L + 1
    # tokens, skipping none: 65, 65, 129, 129 a step, 259 after step 3, past 300 during step 4, 388 after it
    eot = tmp_path / "eot"
    eot.mkdir()
    write_shard(eot / "e_train_000001.bin", np.full(300, T.EOT_TOKEN))
    flags = ["--train-files", str(eot / "e_train_*.bin"), "--val-files", str(shard_dir / "t_val_*.bin")]
    assert T.main(tiny_args(tmp_path, *flags, "--run-id", "w", "--max-steps", "4"), models=SPECS) == 0
    text = read_log(tmp_path / "logs", "w").split(H.SEPARATOR)[1]
    assert [ln for ln in text.splitlines() if ln.startswith("data: ")] == [
        "data: the train stream wrapped around during step 4; tokens are read again"]
    assert json.loads((tmp_path / "logs" / "w.json").read_text())["raw_tokens"] == 2 * 65 + 2 * 129


# ---------------------------------------------------------------------------------------------
# the model's parameters: every one in exactly one optimizer group


def test_every_parameter_is_routed_where_it_is_created_to_one_optimizer(tmp_path):
    cfg, _ = config(*tiny_args(tmp_path))
    model = T.build_model(cfg, TINY)
    adam, normuon = T.build_optimizers(model, cfg)
    seen = [id(p) for opt in (adam, normuon) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each once
    matrices = {id(p) for g in normuon.param_groups for p in g["params"]}
    assert matrices == {id(p) for p in model.parameters() if p.opt_group == "matrix"}
    assert matrices == {id(p) for n, p in model.blocks.named_parameters() if p.ndim == 2 and p.opt_group == "matrix"}
    assert {p.adam_role for p in model.parameters() if p.opt_group == "adam"} <= set(A.ADAM_ROLES)
    assert {g["role"] for g in adam.param_groups} == {p.adam_role for p in model.parameters()
                                                     if p.opt_group == "adam"}
    assert torch.equal(model.embed.weight, model.lm_head.weight) and model.tied  # until the untie


@pytest.mark.parametrize("tst", [False, True])
def test_each_validation_evaluates_the_val_set_once_and_the_tst_objective_once_more_in_phase_1(tmp_path, monkeypatch,
                                                                                              tst):
    """A val line costs one pass over the val tokens for the metric, plus, in TST phase 1 only, one for the TST
    objective's own val loss (step 0 of 8 here: the switch is at step 3 with --tst-frac 0.4)."""
    calls = []
    real = T.evaluate

    def counted(model, val, mode, bag_size, cfg, rt):
        calls.append((mode, bag_size))
        return real(model, val, mode, bag_size, cfg, rt)
    monkeypatch.setattr(T, "evaluate", counted)
    extra = ["--tst-frac", "0.4"] if tst else ["--tst-frac", "0"]
    assert T.main(tiny_args(tmp_path, *extra, "--run-id", "v"), models=SPECS) == 0
    vals = [ln for ln in read_log(tmp_path / "logs", "v").splitlines() if " val_loss:" in ln]
    assert [ln.split()[0] for ln in vals] == ["step:0/8", "step:4/8", "step:8/8"]
    assert calls.count(("full", 1)) == 3 and len(calls) == 3 + (1 if tst else 0), calls
    assert sum(" val_loss_tst:" in ln for ln in vals) == (1 if tst else 0)
