"""--attention-backend (issue 46): FlexAttention's FLASH backend (FlashAttention-4) where it can run, one line where
it cannot, and auto's fallback to the Triton kernels when FLASH refuses a graph at warm-up (before the clock)."""
import subprocess
import sys

import pytest
import torch

import harness as H
import kernels
import train_gpt as T
from conftest import REPO, SPECS, TINY, subprocess_env, tiny_args


def test_flash_without_flash_attn_4_is_one_line_naming_it(tmp_path):
    if kernels.flash_unavailable_reason("cuda") is None:
        pytest.skip("flash-attn-4 is installed and a Hopper/Blackwell GPU is here: nothing refuses")
    driver = "import conftest, train_gpt, sys; sys.exit(train_gpt.main(sys.argv[1:], models=conftest.SPECS))"
    done = subprocess.run([sys.executable, "-c", driver,
                           *tiny_args(tmp_path, "--attention-backend", "flash")], capture_output=True, text=True,
                          env=subprocess_env(), cwd=f"{REPO}/tests", timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--attention-backend flash" in lines[0] and "flash-attn-4" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_auto_on_a_cpu_runs_sdpa_without_a_word(tmp_path):
    cfg, _, _ = H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path))
    assert cfg.attention_backend == "auto"
    assert kernels.choose_flex_backend(cfg.attention_backend, "cpu", True) == ("TRITON", None)  # unused: SDPA
    assert T.main(tiny_args(tmp_path, "--max-steps", "1", "--run-id", "auto"), models=SPECS) == 0
    log = (tmp_path / "logs" / "auto.txt").read_text().split(H.SEPARATOR)[-2]  # the run, not its source
    assert "attention: SDPA" in log and "FLASH" not in log


def test_auto_falls_back_to_triton_when_flash_refuses_a_graph(tmp_path, monkeypatch):
    """A compiled warm-up where the (simulated) FLASH lowering refuses the first graph: one log line, the backend
    becomes TRITON, every graph is compiled again, and the run goes on."""
    cfg, _, _ = H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path, "--run-id", "fallback"))
    rt = H.Runtime(0, 1, torch.device("cpu"), compile=True)
    log = H.RunLog(cfg, rt, None)  # (the run's own log: the warm-up writes its lines there)
    run = T.build_run(cfg, TINY, rt, log, H.find_data(cfg.train_files, cfg.val_files), None)
    model, calls = run.model, []

    class Net(torch.nn.Module):  # what torch.compile raises when inductor's FLASH lowering refuses a mask
        def forward(self, *args):
            calls.append(model.flex_backend)
            if model.flex_backend == "FLASH":
                raise RuntimeError("BACKEND='FLASH' but flash attention cannot be used: NYI (simulated)")
            return model(*args)
    run.net = Net()
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(T, "warm_step", lambda opt: None)
    model.flex_backend = "FLASH"
    T.warm_up(run, H.StopFlag())
    backend = model.flex_backend
    log.close("complete")
    text = (tmp_path / "logs" / "fallback.txt").read_text().split(H.SEPARATOR)[-1]  # the run, not its source
    assert calls[:3] == ["FLASH", "reset", "TRITON"] and backend == "TRITON"
    assert text.count("attention: FLASH refused a graph") == 1 and "falls back to TRITON" in text
    assert "compile: train" in text


def test_flash_is_not_caught_when_the_user_asked_for_it(tmp_path):
    cfg, _, _ = H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path, "--attention-backend", "flash"))
    err = RuntimeError("BACKEND='FLASH' but flash attention cannot be used")
    assert not kernels.flash_refused(cfg.attention_backend, "FLASH", err)  # asked for by name: the error is the report
    auto = H.parse_flags(T.Config, T.PRESETS, tiny_args(tmp_path))[0].attention_backend
    assert kernels.flash_refused(auto, "FLASH", err) and not kernels.flash_refused(auto, "TRITON", err)


def test_a_torch_without_flexattentions_flash_backend_is_named_and_auto_takes_triton(monkeypatch):
    """An older torch's FlexAttention has no BACKEND "FLASH" (its ``_Backend`` lists the names it knows): with
    flash-attn-4 present, FLASH is refused naming the torch version, and auto takes TRITON."""
    import importlib.util
    import typing
    import kernels
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name.startswith("flash_attn")
                        else real(name, *a))
    monkeypatch.setattr(kernels.flex_module, "_Backend", typing.Literal["AUTO", "TRITON"])
    why = kernels.flash_unavailable_reason("cpu")
    assert why == f"torch {torch.__version__} has no FLASH backend in FlexAttention"
    cuda = torch.device("cuda")  # a device name only: nothing runs
    assert kernels.choose_flex_backend("auto", cuda, True) == ("TRITON", None)
    assert kernels.choose_flex_backend("flash", cuda, True) == ("TRITON", why)  # the trainer refuses, naming it
