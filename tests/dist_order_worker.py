"""The order of one optimizer step's collectives and math under torchrun (gloo), read from torch.profiler.

Two steps of the tiny model (sharded Adam, NorMuon) as the trainer runs them (``accumulate_gradients``, NorMuon's
step, Adam's step, its gather's wait); the second, an Adam update step, is profiled. ``argv[2]``: ``eager`` (the
gradient hooks start buckets during the backward) or ``at_end`` (no hooks: every bucket starts after the backward,
as under torch.compile, whose backward is one node). Each rank writes ``argv[1].<rank>.json``: the step's events,
``[name, start_us, end_us, thread]``: the collectives as issued (``c10d::*``, the main thread), as gloo ran them
(``gloo:*``, its threads), and the optimizers' labelled phases (``optimizer: *``).
"""
import json
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
import train_gpt as T  # noqa: E402
from conftest import TINY, tiny_args  # noqa: E402  (this folder is the script's: on the path)


def main(out, mode):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, _, _ = harness.parse_flags(T.Config, T.PRESETS, tiny_args(pathlib.Path(tempfile.gettempdir())))
    rt = harness.Runtime(rank, world, torch.device("cpu"), False)
    torch.manual_seed(0)
    model = T.build_model(cfg, TINY)
    buckets = T.GradBuckets(model.parameters(), rank, world, [p for p in model.parameters() if p.opt_group == "adam"])
    if mode == "at_end":
        buckets.hooks = lambda: []  # as compiled: no bucket starts inside the backward
    adam, normuon = T.build_optimizers(model, cfg, shard=buckets)
    row = T.Schedule(cfg, TINY)[0]
    model.set_window(row.window, row.yarn)
    g = torch.Generator().manual_seed(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(2):
            tokens = torch.randint(0, 50257, (world, 33), generator=g)
            tokens[:, ::7] = T.EOT_TOKEN
            inputs, targets = T.make_batch(tokens[rank:rank + 1], "full", 1)
            with record_function(f"step {step}"):
                T.accumulate_gradients(model, [(inputs, targets)], rt, None, world, buckets)
                normuon.step()
                adam.step()
                adam.wait_gather()
            model.zero_grad(set_to_none=True)
    events = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()]
    [(lo, hi)] = [(s, e) for name, s, e, _ in events if name == "step 1"]
    keep = [ev for ev in events if lo <= ev[1] <= hi and ev[0].startswith(("c10d::", "gloo:", "optimizer: "))]
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(sorted(keep, key=lambda ev: ev[1]), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
