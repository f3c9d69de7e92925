"""bench/codegen.py: the Triton code inductor writes for the loss on a GPU, generated on the CPU (triton's
interpreter stands in for the driver; no kernel runs). Needs triton (requirements.txt), never skipped."""
import json
import subprocess
import sys

import kernels
from conftest import REPO, subprocess_env


def test_the_compiled_loss_is_one_pass_each_way_and_keeps_no_float32_logits(tmp_path):
    """The training loss (the record's sigmoid cap, 4 weighted columns, bf16 logits) at 8 x ``LOSS_CHUNK`` rows and
    the eval piece: no kernel repeats per chunk of rows (a chunk loop fused into one kernel evaluates every chunk's
    branch at every logit: 8 nested where and 8 exp here), no graph allocates float32 logits, the backward reads
    the logits and writes their gradient once."""
    n, v = 8 * kernels.LOSS_CHUNK, 128
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/codegen.py", "--loss", f"{n}x{v}", "--no-model",
                           "--json", str(out)], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["case"].split()[0], r["backward"]) for r in rows] == [("loss", False), ("loss", True), ("eval", False)]
    for r in rows:
        assert r["exp"] <= 4 and r["where"] <= 3, r                   # sigmoid + exp, per element
        assert r["f32_big"] == 0 and r["f32_all_nv"] <= 0.25, r        # [N] and [N, J] vectors only
    backward = rows[1]
    assert backward["gb"] * 1e9 <= 4 * n * v + 128 * n, backward      # bf16 in, bf16 out, small per-row vectors
    assert "loss" in proc.stdout and "bwd" in proc.stdout              # the table
