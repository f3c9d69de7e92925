"""The trainer end to end: config, shard reader, loader, model, schedule, log snapshot, bad input."""
import dataclasses
import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import harness as H
import train_gpt as T
from conftest import (REPO, SAMPLE_DIR, SMALL_FLAGS, drop_flags, loss_lines, read_log, subprocess_env, tiny_args,
                      write_shard)

# ---------------------------------------------------------------------------------------------
# config and CLI


def test_every_config_field_is_a_flag_with_its_default_in_help():
    text = H.build_parser(T.TRAINER).format_help()
    for f in dataclasses.fields(T.Config):
        assert "--" + f.name.replace("_", "-") in text


def test_preset_then_explicit_flags_override():
    cfg, preset = T.parse_config(["--preset", "cpu_smoke", "--num-iterations", "7"])
    assert preset == "cpu_smoke"
    assert cfg.num_iterations == 7  # explicit flag beats preset
    assert cfg.model_dim == T.PRESETS["cpu_smoke"]["model_dim"]  # preset beats default
    assert T.parse_config([])[0].model_dim == 768  # default


@pytest.mark.parametrize("words, means, whole", [
    (["--lr", "0.05"], "--lr-floor", ["--lr-floor", "0.05"]),
    (["--log-d=x"], "--log-dir", ["--log-dir=x"]),
    (["--tst-frac", "0", "--momentum-s", "0.9"], "--momentum-start", ["--tst-frac", "0", "--momentum-start", "0.9"])])
def test_a_flag_is_taken_whole_and_a_prefix_is_refused_with_what_it_could_mean(words, means, whole, capsys):
    """argparse would read --lr as --lr-floor, its only completion, and set the wrong field without a word."""
    with pytest.raises(SystemExit) as e:
        T.parse_config(words)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("train_gpt.py: error: unrecognized arguments: ") and f"did you mean {means}" in err
    cfg, _ = T.parse_config(whole)  # the whole flag sets its field
    assert str(getattr(cfg, means[2:].replace("-", "_"))) == whole[-1].split("=")[-1]


def test_record_presets_share_global_batch_and_dynamics():
    h200, _ = T.parse_config(["--preset", "record_h200"])
    b200, _ = T.parse_config(["--preset", "record_8xb200"])
    for name in T.RUN_DEFINING:
        assert getattr(h200, name) == getattr(b200, name), name
    # record #89's recipe and model (11 x 768): sequences of 16,384, 24 of them a step at the end (8, 16
    # before), 1,270 + 15 steps
    assert (h200.n_layer, h200.model_dim, h200.n_head, h200.seq_len) == (11, 768, 6, 16384)
    assert (h200.batch_tokens, h200.num_iterations, h200.stages) == (393_216, 1285, "record89")
    assert (h200.tst_bag_size, h200.tst_frac, h200.optimizer) == (4, 0.3, "aurora_normuon")

# Each preset dict and the dict it is built on (None: Config's defaults alone).
PRESET_PARENTS = [(T.MODEL89, None), (T.RECORD89, T.MODEL89), (T.RECORD89_OURS, T.RECORD89),
                  (T.PRESETS["cpu_smoke"], T.RECORD89_OURS)]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(T.Config)}


def restated_defaults(child, parent):
    """Keys ``child`` adds to ``parent`` at their Config default (the same type too: 1 is not True)."""
    return [k for k in child if k not in (parent or {})
            and type(child[k]) is type(DEFAULTS[k]) and child[k] == DEFAULTS[k]]


def test_presets_list_only_what_differs_from_the_defaults():
    """A key a preset adds must change Config's default; one it shares with its parent may only reset it."""
    assert {id(p) for p in T.PRESETS.values()} <= {id(child) for child, _ in PRESET_PARENTS}
    for child, parent in PRESET_PARENTS:
        assert set(parent or {}) <= set(child)
        assert restated_defaults(child, parent) == []


def test_the_preset_check_catches_a_restated_default():
    assert restated_defaults(dict(T.RECORD89, pp_beta=DEFAULTS["pp_beta"], head_lr=0.5), T.MODEL89) == ["pp_beta"]
    assert restated_defaults(dict(T.RECORD89_OURS, seq_len=1024), T.RECORD89) == []  # a reset of the parent's value


def test_unquoted_glob_gets_a_hint(tmp_path):
    files = [str(tmp_path / f"x_train_00000{i}.bin") for i in (1, 2)]
    for f in files:
        open(f, "wb").close()
    with pytest.raises(T.ConfigError, match="quote it"):
        T.parse_config(["--train-files", *files])


def test_config_to_argv_round_trips():
    """Every field the config reads comes back; those it does not read (cpu_smoke's head_lr of the other
    optimizer families among them) are left out, as typed they are refused, and come back as the defaults."""
    cfg, _ = T.parse_config(["--preset", "cpu_smoke", "--no-nesterov", "--tst-mode", "output", "--compile"])
    argv = T.config_to_argv(cfg)
    again, _ = T.parse_config(argv)
    unread = H.unread_fields(cfg)
    assert {"head_lr", "embed_lr", "adamw_lr", "warmup_steps", "resume_force", "keep_checkpoints"} <= set(unread)
    assert not {H.flag_of(f) for f in unread} & set(argv)
    assert again == T.dataclasses.replace(cfg, **{f: getattr(T.Config(), f) for f in unread})
    aurora, _ = T.parse_config(["--preset", "cpu_smoke", "--optimizer", "aurora"])  # reads the preset's head_lr
    assert T.parse_config(T.config_to_argv(aurora))[0].head_lr == aurora.head_lr == 0.22


@pytest.mark.parametrize("flags, needle", [
    (["--tst-bag-size", "0"], "--tst-bag-size"),
    (["--tst-frac", "1.0"], "--tst-frac"),
    (["--seq-len", "0"], "--seq-len"),
    (["--model-dim", "100", "--n-head", "3"], "--model-dim"),
    (["--batch-tokens", "1000", "--seq-len", "64"], "--batch-tokens"),
    (["--momentum", "1.5"], "--momentum"),
    (["--matrix-lr", "inf"], "--matrix-lr must be finite"),
    (["--adam-eps", "inf"], "--adam-eps must be finite"),
    (["--rope-base", "-1"], "--rope-base"),
    (["--warmup-steps", "500", "--num-iterations", "100"], "--warmup-steps"),
    (["--tst-bag-size", "600", "--val-tokens", "1000"], "--tst-bag-size 600 needs --val-tokens >= 1200"),
])
def test_bad_flag_values_raise_config_error_naming_the_flag(flags, needle):
    with pytest.raises(T.ConfigError, match=needle):
        T.parse_config(flags)


# ---------------------------------------------------------------------------------------------
# shards, stream, loader


def test_shard_reader_accepts_good_shard(tmp_path):
    path = write_shard(tmp_path / "good.bin", [50256, 1, 2, 3])
    assert H.read_shard_header(path) == 4
    assert H.load_shard(path).tolist() == [50256, 1, 2, 3]


@pytest.mark.parametrize("kind, kwargs, needle", [
    ("magic", dict(magic=1234), "bad magic"),
    ("version", dict(version=7), "version"),
    ("truncated", dict(truncate=3), "truncated"),
    ("count", dict(n_header=10), "header says 10 tokens"),
])
def test_shard_reader_rejects_each_bad_kind_naming_the_file(tmp_path, kind, kwargs, needle):
    path = write_shard(tmp_path / f"{kind}.bin", list(range(20)), **kwargs)
    with pytest.raises(T.DataError, match=needle) as err:
        H.read_shard_header(path)
    assert str(path) in str(err.value)


def test_shard_reader_rejects_file_shorter_than_header(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(T.DataError, match="shorter than the 1024-byte shard header"):
        H.read_shard_header(str(path))


def test_empty_glob_names_the_flag(tmp_path):
    with pytest.raises(T.DataError, match="--train-files"):
        H.resolve_files(str(tmp_path / "nothing_*.bin"), "--train-files")


def test_a_folder_for_the_glob_names_the_glob_it_meant_and_a_matched_folder_is_refused(tmp_path):
    for flag, kind in (("--train-files", "train"), ("--val-files", "val")):
        with pytest.raises(T.DataError) as e:
            H.resolve_files(str(tmp_path), flag)
        assert str(e.value) == f"{flag} {str(tmp_path)!r} is a folder; give a glob of its shard files, e.g. " \
                               f"'{tmp_path}/*_{kind}_*.bin'"
    (tmp_path / "x_train_000001.bin").mkdir()  # a folder the glob matches among the shards
    with pytest.raises(T.DataError, match=r"x_train_000001.bin: not a regular file .* --train-files must match"):
        H.resolve_files(str(tmp_path / "*_train_*.bin"), "--train-files")


def test_token_stream_reads_across_shards_and_wraps(shard_dir):
    files = sorted(str(p) for p in shard_dir.glob("t_train_*.bin"))
    stream = T.TokenStream(files, wrap=True)
    assert stream.total == 3000
    assert stream.read(1690, 20).tolist() == list(range(1690, 1710))
    assert stream.read(2995, 10).tolist() == [2995, 2996, 2997, 2998, 2999, 0, 1, 2, 3, 4]
    with pytest.raises(T.DataError, match="hold 3000"):
        T.TokenStream(files).read(2995, 10)


# A one-stage run of 16 sequences of 128 (2,048 positions) in micro-batches of 8, and record #21's batch
# shape: 8 sequences of 49,152, one per micro-batch.
FLAGS_16 = [*SMALL_FLAGS, "--seq-len", "128", "--batch-tokens", "2048", "--micro-batch-seqs", "8"]
FLAGS_8 = ["--seq-len", "49152", "--batch-tokens", "393216", "--micro-batch-seqs", "1"]


@pytest.mark.parametrize("argv, world, micro, accum", [
    (FLAGS_8, 1, None, 8), (["--preset", "record_h200"], 1, None, 8), (["--preset", "record_8xb200"], 8, None, 1),
    (FLAGS_16, 2, 8, 1), (FLAGS_16, 1, 4, 4)], ids=["flags8", "record_h200", "record_8xb200", "flags16-2", "flags16-1"])
def test_grad_accum_steps_fill_the_global_batch(argv, world, micro, accum):
    """Every step's sequences (record presets: HEAD's 8, growing in length by stage) split into micro-batches."""
    cfg, _ = T.parse_config(argv + (["--micro-batch-seqs", str(micro)] if micro else []))
    assert H.grad_accum_steps(cfg, world) == accum
    assert {st.batch_tokens // st.length(cfg.seq_len) for st in T.stages(cfg)} == {accum * cfg.micro_batch_seqs * world}


@pytest.mark.parametrize("argv, world", [(FLAGS_8, 3), (FLAGS_8, 5), (FLAGS_8, 6), (FLAGS_8, 7), (FLAGS_8, 12),
                                         (FLAGS_16, 3)], ids=["8-3", "8-5", "8-6", "8-7", "8-12", "16-3"])
def test_a_process_count_that_cannot_split_the_batch_names_the_counts_that_can(argv, world):
    cfg, _ = T.parse_config(argv)
    seqs = cfg.batch_tokens // cfg.seq_len
    with pytest.raises(T.ConfigError, match="run with a process count in") as err:
        H.grad_accum_steps(cfg, world)
    counts = [int(c) for c in str(err.value).split("[")[1].split("]")[0].split(",")]
    assert counts and all(seqs % c == 0 for c in counts) and world not in counts and 8 in counts
    assert "--micro-batch-seqs" not in str(err.value).split("whatever")[0]  # no flag value can fix it


def test_a_micro_batch_that_cannot_split_the_batch_names_the_values_that_can():
    cfg, _ = T.parse_config([*FLAGS_16, "--micro-batch-seqs", "3"])
    with pytest.raises(T.ConfigError, match=r"--micro-batch-seqs 3 x 2 .* use one of \[1, 2, 4, 8\]"):
        H.grad_accum_steps(cfg, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_record89_stages_split_stage_1s_third_of_the_batch_over_the_processes(world):
    """cpu_smoke's stage 1 trains 1 of its 3 sequences: 2 or 3 processes are refused before the run, not by the
    loader at step 1 (one traceback per rank)."""
    cfg, _ = T.parse_config(["--preset", "cpu_smoke"])
    with pytest.raises(T.ConfigError, match=rf"^{world} processes cannot share the 1 sequences of stage 1's steps "
                                            r".* run with a process count in \[1\] \(one that divides them\) or "
                                            rf"with --batch-tokens {world * 3 * 768} \(or a multiple\)"):
        H.grad_accum_steps(cfg, world)
    assert H.grad_accum_steps(T.parse_config(["--preset", "cpu_smoke", "--batch-tokens", str(world * 3 * 768)])[0],
                              world) == 3  # the hint's --batch-tokens works: 1, 2, 3 micro-steps of stages 1, 2, 3
    wide, _ = T.parse_config(["--preset", "cpu_smoke", "--batch-tokens", "4608", "--micro-batch-seqs", "2"])
    with pytest.raises(T.ConfigError, match=r"--micro-batch-seqs 2 x 2 .* stage 1's .* use one of \[1\]$"):
        H.grad_accum_steps(wide, 2)
    assert H.grad_accum_steps(wide, 1) == 3  # the full batch's 6 sequences in micro-batches of 2


# ---------------------------------------------------------------------------------------------
# model


def small_cfg(**kw):
    cfg, _ = T.parse_config([*SMALL_FLAGS, "--n-layer", "2", "--model-dim", "64", "--n-head", "2",
                             "--seq-len", "16"])
    return T.dataclasses.replace(cfg, **kw)


def test_model_output_shapes_and_zero_init_head():
    cfg = small_cfg()
    torch.manual_seed(0)
    model = T.GPT(cfg)
    tokens = torch.randint(0, 50257, (3, 16, 1))
    logits = model(tokens)
    assert logits.shape == (3, 16, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.all(logits == 0)  # zero-initialized head: uniform prediction, loss log(V)
    loss = model(tokens, torch.randint(0, 50257, (3, 16, 4)))
    assert loss.ndim == 0
    assert math.isclose(loss.item() / (3 * 16 * 4), math.log(cfg.vocab_size), rel_tol=1e-6)
    bags = torch.randint(0, 50257, (3, 16, 4))
    assert model(bags).shape == (3, 16, cfg.vocab_size)


def test_model_is_causal():
    cfg = small_cfg()
    torch.manual_seed(0)
    model = T.GPT(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_()
        for block in model.blocks:
            block.attn.proj.weight.normal_(0, 0.1)
            block.mlp.proj.weight.normal_(0, 0.1)
    a = torch.randint(0, 50257, (1, 16, 1))
    b = a.clone()
    b[0, 10:] = torch.randint(0, 50257, (6, 1))
    la, lb = model(a), model(b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-5)
    assert not torch.allclose(la[0, 10:], lb[0, 10:], atol=1e-3)


def test_logit_softcap_bounds_logits():
    cfg = small_cfg(logit_softcap=5.0)
    model = T.GPT(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 100)
    logits = model(torch.randint(0, 50257, (1, 16, 1)))
    assert logits.abs().max() <= 5.0 and logits.abs().max() > 4.9


def test_flops_formula_counts_matmul_weights():
    cfg = small_cfg()
    model = T.GPT(cfg)
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)
    attention = 12 * cfg.n_layer * cfg.model_dim * (cfg.seq_len + 1) / 2  # causal: query q attends q + 1 keys
    assert T.model_flops_per_position(cfg) == 6 * n_matmul + attention


# ---------------------------------------------------------------------------------------------
# schedule and optimizer split


def test_lr_schedule_warmup_flat_cooldown():
    cfg = small_cfg(num_iterations=100, warmup_steps=10, cooldown_frac=0.2, lr_floor=0.0)
    assert T.lr_scale(0, cfg) == pytest.approx(0.1)
    assert T.lr_scale(9, cfg) == pytest.approx(1.0)
    assert T.lr_scale(50, cfg) == 1.0
    assert T.lr_scale(80, cfg) == pytest.approx(1.0)
    assert T.lr_scale(90, cfg) == pytest.approx(0.5)
    assert T.lr_scale(99, cfg) == pytest.approx(0.05)
    floor = T.dataclasses.replace(cfg, lr_floor=0.1)  # the cooldown ends at 0.1 instead of 0
    assert T.lr_scale(50, floor) == 1.0 and T.lr_scale(90, floor) == pytest.approx(0.1 + 0.9 * 0.5)
    assert T.lr_scale(99, floor) == pytest.approx(0.1 + 0.9 * 0.05)


def test_optimizer_split_aurora_on_block_matrices_adam_elsewhere():
    cfg = small_cfg(x0_gates=True)
    model = T.GPT(cfg)
    adam, aurora = T.build_optimizers(model, cfg)
    assert isinstance(aurora, T.Aurora)
    aurora_params = {id(p) for g in aurora.param_groups for p in g["params"]}
    assert aurora_params == {id(p) for p in model.blocks.parameters() if p.ndim == 2}
    adam_params = {id(p) for g in adam.param_groups for p in g["params"]}
    embeds = {id(model.embed.weight)} | {id(t.weight) for t in model.value_embeds}
    scalars = {id(p) for p in model.parameters() if p.ndim < 2}
    assert len(model.value_embeds) == 1 and scalars  # SMALL_FLAGS's value embedding, the x0 gates
    assert adam_params == embeds | {id(model.lm_head.weight)} | scalars
    assert aurora.param_groups[0]["pp_iterations"] == cfg.pp_iterations
    muon = T.build_optimizers(model, T.dataclasses.replace(cfg, optimizer="muon"))[1]
    assert muon.param_groups[0]["pp_iterations"] == 0
    assert isinstance(T.build_optimizers(model, T.dataclasses.replace(cfg, optimizer="adamw"))[1],
                      torch.optim.AdamW)
    # --ns-dtype: auto follows the device (float32 on this CPU); a named dtype is used as given
    cpu = torch.device("cpu")
    assert aurora._dtype(cpu) == torch.float32 and aurora._dtype(torch.device("cuda")) == torch.bfloat16
    for name in ("bfloat16", "float32"):
        opt = T.build_optimizers(model, T.dataclasses.replace(cfg, ns_dtype=name))[1]
        assert opt._dtype(cpu) == opt._dtype(torch.device("cuda")) == getattr(torch, name)


# ---------------------------------------------------------------------------------------------
# end to end


def run_main(tmp_path, *extra):
    code = T.main(tiny_args(tmp_path, *extra))
    return code, read_log(tmp_path / "logs")


def test_end_to_end_log_is_a_snapshot_with_phases_and_switch(tmp_path):
    code, text = run_main(tmp_path, "--run-id", "e2e", "--tst-frac", "0.5")
    assert code == 0
    head, rest = text.split(H.SEPARATOR + "\n", 1)
    assert [l.split()[2] for l in head.splitlines() if l.startswith("### file ")] == list(H.SOURCE_FILES)
    assert H.SOURCE_FILES == ("train_gpt.py", "kernels.py", "aurora_opt.py", "harness.py")
    for name in H.SOURCE_FILES:  # the exact source of every snapshotted file
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            src = f.read()
        assert f"### file {name} lines={len(src.splitlines())}" in head
        assert src in head
    config = json.loads(next(l for l in rest.splitlines() if l.startswith("config: "))[8:])
    assert config["tst_bag_size"] == 4 and config["num_iterations"] == 8
    for needle in ("world_size: 1", "command: ", "git: ", "data train: ", "fingerprint:", "data val: "):
        assert needle in rest
    lines = rest.splitlines()
    train = [l for l in lines if " train_loss:" in l]
    assert [l.split()[0] for l in train] == [f"step:{i}/8" for i in range(1, 9)]
    assert all("phase:1" in l for l in train[:4]) and all("phase:2" in l for l in train[4:])
    switch = next(i for i, l in enumerate(lines) if l.startswith("tst_switch: step 4"))
    assert "step:4/8 train_loss" in lines[switch - 2] or "step:4/8 train_loss" in lines[switch - 1]
    val = loss_lines(text, "val_loss")
    assert sorted(val) == [0, 4, 8]
    assert lines[-1] == "status:complete" and lines[-2].startswith("summary: final_val_loss:")
    summary = json.loads((tmp_path / "logs" / "e2e.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 8
    assert summary["final_val_loss"] == pytest.approx(val[8], abs=1e-4)
    # accounting: a packed sequence reads its L + 1 tokens (phase 1: s = 4 times that) plus the document
    # tails it skips; the summary's count is the last step line's
    tokens = [int(l.split("tokens:")[1].split()[0]) for l in train]
    steps = [b - a for a, b in zip([0] + tokens, tokens)]
    assert all(n >= 8 * 33 * 4 for n in steps[:4]) and all(n >= 8 * 33 for n in steps[4:])
    assert summary["raw_tokens"] == tokens[-1]
    assert summary["positions"] == 8 * 256
    assert summary["flops"] == 8 * 256 * summary["flops_per_position"]


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_baseline_optimizers_train(tmp_path, optimizer):
    args = tiny_args(tmp_path, "--optimizer", optimizer, "--tst-frac", "0")
    if optimizer == "adamw":  # no momentum on the matrices: a typed ramp flag would be refused
        args = drop_flags(args, "--momentum-warmup-steps")
    code, text = T.main(args), read_log(tmp_path / "logs")
    assert code == 0
    losses = loss_lines(text)
    assert all(math.isfinite(v) for v in losses.values()) and losses[8] < losses[1]


def test_reading_past_the_end_of_the_train_shards_is_logged(tmp_path, shard_dir):
    # 3,000 one-token documents (every token an <|endoftext|>): a packed sequence of 32 positions reads exactly
    # its 33 tokens and skips none, 8 of them a step (264 tokens; 4 x 264 in TST phase 1)
    eot = tmp_path / "eot"
    eot.mkdir()
    write_shard(eot / "e_train_000001.bin", np.full(3000, T.EOT_TOKEN))
    flags = ["--train-files", str(eot / "e_train_*.bin"), "--val-files", str(shard_dir / "t_val_*.bin")]
    assert T.main(tiny_args(tmp_path, *flags, "--run-id", "w", "--tst-frac", "0")) == 0
    text = read_log(tmp_path / "logs", "w").split(H.SEPARATOR)[1]  # 3000 tokens; 8 steps read 2112
    summary = json.loads((tmp_path / "logs" / "w.json").read_text())
    assert summary["train_epochs"] == pytest.approx(8 * 264 / 3000, abs=1e-4)
    assert "wrapped around" not in text
    assert T.main(tiny_args(tmp_path, *flags, "--run-id", "w2", "--tst-frac", "0.5")) == 0
    text = read_log(tmp_path / "logs", "w2").split(H.SEPARATOR)[1]  # 4 x 1056 + 4 x 264 > 3000: step 3 wraps
    assert "wrapped around during step 3; from here on tokens are read again (epoch 2)" in text
    assert json.loads((tmp_path / "logs" / "w2.json").read_text())["train_epochs"] == pytest.approx(5280 / 3000,
                                                                                                    abs=1e-4)


def test_cpu_run_repeats_exactly_with_the_same_seed(tmp_path):
    a = loss_lines(run_main(tmp_path / "a", "--seed", "3")[1])
    b = loss_lines(run_main(tmp_path / "b", "--seed", "3")[1])
    c = loss_lines(run_main(tmp_path / "c", "--seed", "4")[1])
    assert a == b and a != c


def test_importing_does_not_train():
    out = subprocess.run([sys.executable, "-c", "import train_gpt, aurora_opt; print('ok')"],
                         capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=120)
    assert out.stdout.strip() == "ok" and out.stderr == ""


# ---------------------------------------------------------------------------------------------
# bad input: one line naming the file or flag, non-zero exit, the log kept and marked incomplete


def run_cli(tmp_path, *flags, drop=()):
    """train_gpt.py with tiny_args (less the flags ``drop``) and ``flags``, as a subprocess."""
    args = drop_flags(tiny_args(tmp_path), *drop)
    return subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), *args, *flags],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=300)


def error_lines(out):
    return [l for l in out.stderr.splitlines() if l.strip() and not l.startswith("log: ")]


@pytest.mark.parametrize("kind", ["bad_header", "truncated"])
def test_bad_shard_stops_the_run_naming_the_file(tmp_path, shard_dir, kind):
    bad = write_shard(shard_dir / "t_train_000003.bin", list(range(100)),
                      **({"magic": 7} if kind == "bad_header" else {"truncate": 5}))
    out = run_cli(tmp_path, "--train-files", str(shard_dir / "t_train_*.bin"),
                  "--val-files", str(shard_dir / "t_val_*.bin"))
    assert out.returncode != 0
    errors = error_lines(out)
    assert len(errors) == 1 and bad in errors[0] and "error" in errors[0]
    text = read_log(tmp_path / "logs")
    assert text.splitlines()[-1].startswith("status:incomplete") and bad in text.splitlines()[-1]


def test_empty_glob_stops_the_run_naming_the_flag(tmp_path):
    out = run_cli(tmp_path, "--train-files", str(tmp_path / "none_*.bin"))
    assert out.returncode != 0
    errors = error_lines(out)
    assert len(errors) == 1 and "--train-files" in errors[0]


def test_bag_size_zero_stops_at_once_naming_the_flag(tmp_path):
    out = run_cli(tmp_path, "--tst-bag-size", "0")
    assert out.returncode == 2
    errors = error_lines(out)
    assert len(errors) == 1 and "--tst-bag-size" in errors[0]


def test_too_few_val_tokens_names_the_flag(tmp_path, shard_dir):
    out = run_cli(tmp_path, "--train-files", str(shard_dir / "t_train_*.bin"),
                  "--val-files", str(shard_dir / "t_val_*.bin"), "--val-tokens", "5000")
    assert out.returncode != 0
    errors = error_lines(out)
    assert len(errors) == 1 and "--val-tokens 5000" in errors[0] and "600" in errors[0]


def test_non_finite_loss_stops_the_run_and_keeps_the_log(tmp_path):
    out = run_cli(tmp_path, "--embed-lr", "1e30", "--matrix-lr", "1e30", "--head-lr", "1e30")
    assert out.returncode != 0
    assert "loss is not finite since step" in out.stderr
    text = read_log(tmp_path / "logs")
    assert text.splitlines()[-1].startswith("status:incomplete")


# ---------------------------------------------------------------------------------------------
# found by adversarial review: each of these once failed silently or with a traceback


def test_an_existing_run_id_is_refused_and_its_log_kept(tmp_path):
    assert run_main(tmp_path, "--run-id", "x")[0] == 0
    before = (tmp_path / "logs" / "x.txt").read_text()
    assert T.main(tiny_args(tmp_path, "--run-id", "x", "--train-files", str(tmp_path / "none_*.bin"))) == 2
    assert (tmp_path / "logs" / "x.txt").read_text() == before


@pytest.mark.parametrize("run_id", ["a/b", "../escaped", ".hidden", "sp ace"])
def test_run_ids_that_are_not_plain_file_names_are_refused(run_id):
    with pytest.raises(T.ConfigError, match="--run-id"):
        T.parse_config(["--run-id", run_id])


@pytest.mark.parametrize("flag", ["--log-dir", "--checkpoint-dir"])
def test_an_empty_folder_flag_is_refused_naming_it(flag):
    # --checkpoint-dir '' once put the checkpoints in the folder the trainer was started from
    with pytest.raises(T.ConfigError, match=f"^{flag} '': name a folder"):
        T.parse_config([flag, ""])


def test_log_dir_that_is_a_file_names_the_flag(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert T.main(tiny_args(tmp_path, "--log-dir", str(tmp_path / "afile"))) == 2
    assert "--log-dir" in capsys.readouterr().err


@pytest.mark.parametrize("bad_id", [50257, 50304])  # a padding row of the embedding, past the embedding
def test_token_ids_beyond_the_vocabulary_name_the_shard(tmp_path, shard_dir, bad_id):
    tokens = np.arange(0, 3000) % 50000
    tokens[1800] = bad_id  # read during step 8 (tokens 1792..2048)
    bad = write_shard(shard_dir / "t_train_000002.bin", tokens[1700:])
    out = run_cli(tmp_path, "--train-files", str(shard_dir / "t_train_*.bin"),
                  "--val-files", str(shard_dir / "t_val_*.bin"), "--tst-frac", "0")
    assert out.returncode == 2
    errors = error_lines(out)
    assert len(errors) == 1 and bad in errors[0] and f"token id {bad_id} at token 100 is >= 50257" in errors[0]
    assert read_log(tmp_path / "logs").splitlines()[-1].startswith("status:incomplete")


def test_the_first_non_finite_step_is_reported_not_the_next_log_step(tmp_path):
    out = run_cli(tmp_path, "--logit-softcap", "0", "--optimizer", "adamw", "--adamw-lr", "1e20",
                  "--embed-lr", "1e20", "--head-lr", "1e20", "--val-every", "0", "--log-every", "5",
                  "--tst-frac", "0", drop=("--momentum-warmup-steps",))  # AdamW's matrices: no momentum ramp
    assert out.returncode == 1
    line = error_lines(out)[0]
    assert "not finite since step" in line and "--adamw-lr" in line
    step = int(line.split("since step ")[1].split(";")[0])
    assert step < 5


def test_a_fifo_among_the_shards_is_refused_at_once_not_read(tmp_path, shard_dir):
    os.mkfifo(shard_dir / "t_train_000009.bin")  # opening it for reading would block forever
    out = run_cli(tmp_path, "--train-files", str(shard_dir / "t_train_*.bin"),
                  "--val-files", str(shard_dir / "t_val_*.bin"))
    assert out.returncode == 2
    assert error_lines(out) == [f"train_gpt.py: error: rank 0: {shard_dir / 't_train_000009.bin'}: not a regular "
                                f"file (a folder, FIFO or device); --train-files must match shard files"]


# ---------------------------------------------------------------------------------------------
# train/eval split of the loss


def test_a_training_only_loss_term_never_reaches_the_val_loss(monkeypatch):
    cfg, _ = T.parse_config(["--preset", "cpu_smoke", "--model-dim", "32", "--bigram-vocab", "512",
                             "--seq-len", "16", "--val-tokens", "200", "--val-batch-seqs", "4"])
    torch.manual_seed(0)
    model = T.GPT(cfg)
    with torch.no_grad():  # a non-zero head, so the loss depends on the weights
        model.lm_head.weight.normal_(0, 0.05)
    val = T.ValData(T.TokenStream(sorted(glob.glob(os.path.join(SAMPLE_DIR, "*_val_*.bin")))), cfg.val_tokens)
    rt = T.Runtime(0, 1, torch.device("cpu"), False)
    inputs, targets = next(val.batches("full", 1, cfg.seq_len, 4, rt))
    plain_val, plain_train = T.evaluate(model, val, "full", 1, cfg, rt), model(inputs, targets)
    monkeypatch.setattr(T.GPT, "train_only_loss", lambda self, x, logits, targets: logits.float().square().sum())
    assert model.training
    assert model(inputs, targets).item() > plain_train.item() + 1.0  # the term is in the training loss
    assert T.evaluate(model, val, "full", 1, cfg, rt) == plain_val  # and nowhere in the metric
    assert model.training  # evaluate leaves the model as it found it


# ---------------------------------------------------------------------------------------------
# optimizer routing


def test_every_parameter_is_routed_where_it_is_created_and_an_untagged_one_stops_the_run():
    cfg, _ = T.parse_config([*SMALL_FLAGS, "--n-layer", "2", "--model-dim", "32", "--n-head", "2"])
    model = T.GPT(cfg)
    tags = {n: p.opt_group for n, p in model.named_parameters()}
    assert {n for n, g in tags.items() if g == "matrix"} == {
        f"blocks.{n}" for n, p in model.blocks.named_parameters() if p.ndim == 2}
    assert {n for n, g in tags.items() if g == "embed"} == {"embed.weight", "value_embeds.0.weight"}
    assert {n for n, g in tags.items() if g == "head"} == {"lm_head.weight"}
    assert all(p.ndim < 2 for n, p in model.named_parameters() if tags[n] == "scalar")
    adam, aurora = T.build_optimizers(model, cfg)
    assert [id(p) for p in aurora.param_groups[0]["params"]] == [
        id(p) for n, p in model.named_parameters() if tags[n] == "matrix"]
    model.blocks[0].gate = torch.nn.Linear(32, 2, bias=False)  # a new weight nobody routed
    with pytest.raises(T.ConfigError, match=r"parameter blocks\.0\.gate\.weight \(2, 32\) has no optimizer group"):
        T.build_optimizers(model, cfg)
