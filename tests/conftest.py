"""Shared fixtures: paths, a tiny config that trains in about a second, shard writers.

Everything the tests read is inside the repository: the real text is data/sample/ (English
Wikipedia in GPT-2 token shards, see data/sample/README.md).
"""
import atexit
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import torch
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_DIR = os.path.join(REPO, "data", "sample")
sys.path.insert(0, REPO)

# pytest-xdist runs the suite in 2 worker processes (pytest.ini) on CI's 2 cores: one thread each, and
# one for every process a test starts (the environment is inherited), so that no two fight over a core.
# A test that needs another thread count sets OMP_NUM_THREADS in its subprocess's environment itself.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import train_gpt as T  # noqa: E402

# The tests' model: the record's layer roles at the smallest shape that keeps them (half-truncated RoPE needs a
# head_dim divisible by 4, paired heads an even head count). train_gpt.MODELS holds the product's two shapes, and
# only train_gpt.py writes it; the tests' runs name this third one through SPECS, passed to the trainer as
# ``T.main(argv, models=SPECS)`` (tests/dist_*_worker.py too) and to the model and stage table as a spec.
TINY = T.ModelSpec(n_layer=4, n_head=2, model_dim=32, no_attn=(), short_window=(0, 1, 2), paired_heads=(0, 2),
                   xsa=(1,), attn_gate=(3,), dc=(3,), ve_layers=(1, 3), value_embeds=2, skip=(1, 2),
                   attn_state_layer=2, bigram_vocab=1024, mudd_gates=2, window_block=8)
SPECS = {**T.MODELS, "tiny": TINY}  # what --model may name in the tests: the product's specs and the tiny one


def spec_of(cfg):
    """The ModelSpec a config's --model names (``SPECS``: the tiny one too)."""
    return SPECS[cfg.model]


def sample_args():
    """--train-files / --val-files of the repository's real-text sample."""
    return ["--train-files", os.path.join(SAMPLE_DIR, "*_train_*.bin"),
            "--val-files", os.path.join(SAMPLE_DIR, "*_val_*.bin")]


def tiny_args(tmp_path, *extra):
    """Flags of a run of the tiny model on real text: 8 steps of 64 -> 128 -> 192 positions (one packed sequence a
    step, stage k of k x 64), val on 512 tokens every 4 steps, float32, no compile, logs and checkpoints in tmp."""
    return ["--model", "tiny", *sample_args(), "--seq-len", "64", "--batch-tokens", "192", "--num-iterations", "8",
            "--extension-steps", "1", "--val-tokens", "512", "--val-seq-len", "0", "--val-every", "4", "--log-every",
            "1", "--momentum-warmup-steps", "2", "--momentum-cooldown-steps", "1", "--no-fp8", "--device", "cpu",
            "--log-dir", str(tmp_path / "logs"), "--checkpoint-dir", str(tmp_path / "ckpt"), *extra]


def random_tokens(shape, seed, p_eot):
    """int64 ids in [0, 1000) of ``shape``, each an <|endoftext|> (50256) with probability ``p_eot``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < p_eot, 50256, tokens)


def subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


# torchrun's log folder: one per test process, removed at its exit (torchrun's default is a new
# /tmp/torchelastic_* folder at every launch, never removed); none in a rank torchrun started
TORCHRUN_LOGS = "" if "TORCHELASTIC_RUN_ID" in os.environ else tempfile.mkdtemp(prefix="tests_torchrun_")
if TORCHRUN_LOGS:
    atexit.register(shutil.rmtree, TORCHRUN_LOGS, ignore_errors=True)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--log-dir", TORCHRUN_LOGS]


def ranks_output(stderr):
    """torchrun's stderr cut before its own failure report (a page of launcher frames that would push the
    failing rank's message out of an assertion's tail): the ranks' last lines, then the report's first."""
    at = stderr.find("] failed (exitcode")
    if at < 0:
        return stderr[-3000:]
    at = stderr.rfind("\n", 0, at) + 1
    return stderr[:at][-3000:] + "[torchrun] " + stderr[at:].split("\n", 1)[0][-300:]


def run_torchrun(args, env, cwd=None, timeout=600, run_ids=()):
    """``torchrun`` with 2 gloo processes on ``args``, relaunched once if a rank died of SIGABRT.

    Rarely a rank dies in gloo's C++ (std::terminate, no Python error; seen in CI, not reproduced
    locally in 80 launches): one relaunch, with a warning that shows the ranks' output, tells that from a
    real failure, which fails twice. ``run_ids``: trainer runs (under ``cwd``/logs and ``cwd``/ckpt)
    whose files the aborted launch left, removed before the relaunch so its run ids can start again.
    """
    out = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if out.returncode != 0 and "SIGABRT" in out.stderr:
        warnings.warn(f"a torchrun rank aborted (SIGABRT), relaunched once:\n{ranks_output(out.stderr)}")
        for run_id in run_ids:
            for path in glob.glob(os.path.join(cwd, "logs", f"{run_id}.*")):
                os.remove(path)
            shutil.rmtree(os.path.join(cwd, "ckpt", run_id), ignore_errors=True)
        out = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert out.returncode == 0, ranks_output(out.stderr)
    return out


def write_shard(path, tokens, magic=20240520, version=1, n_header=None, truncate=0):
    """Write a shard (optionally broken: wrong magic/version/count, or truncated by some bytes)."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1] = magic, version
    header[2] = len(tokens) if n_header is None else n_header
    data = header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()
    with open(path, "wb") as f:
        f.write(data[:len(data) - truncate] if truncate else data)
    return str(path)


def read_log(log_dir, run_id=None):
    """Text of the (only, or named) run log in a log dir."""
    names = sorted(n for n in os.listdir(log_dir) if n.endswith(".txt"))
    name = f"{run_id}.txt" if run_id else names[-1]
    with open(os.path.join(log_dir, name), encoding="utf-8") as f:
        return f.read()


def loss_lines(text, kind="train_loss"):
    """{step: value} of the train_loss (or val_loss) lines of a log."""
    out = {}
    for line in text.splitlines():
        if line.startswith("step:") and f" {kind}:" in line:
            step = int(line.split()[0].split(":")[1].split("/")[0])
            out[step] = float(line.split(f"{kind}:")[1].split()[0])
    return out


def shares_a_fixture(path):
    """True if the test file defines a module- or session-scoped fixture (a trainer run that several of
    its tests read, say)."""
    with open(path, encoding="utf-8") as f:
        return re.search(r'@pytest\.fixture\(scope="(module|package|session)"', f.read()) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup (pytest.ini): a file that shares a fixture between its tests runs whole on one xdist
    worker, so that the fixture is computed once, not once per worker; every other test goes alone to
    whichever worker is free. The files come first, the most tests first (xdist's LoadScopeScheduling)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    root = str(config.rootpath)

    class SharedFixtureFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if grouped(path) else nodeid

    @functools.lru_cache(maxsize=None)
    def grouped(path):
        return shares_a_fixture(os.path.join(root, path))

    return SharedFixtureFiles(config, log)


@pytest.fixture
def shard_dir(tmp_path):
    """A folder with 2 small train shards (tokens 0..2999 in order) and a val shard."""
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "t_train_000001.bin", np.arange(0, 1700))
    write_shard(d / "t_train_000002.bin", np.arange(1700, 3000))
    write_shard(d / "t_val_000000.bin", np.arange(0, 600) % 50257)
    return d
