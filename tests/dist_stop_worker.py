"""train_gpt.main under torchrun; rank 0 alone gets SIGTERM during step 3 (as a scheduler may signal one process).

Usage: dist_stop_worker.py OUT TRAINER-FLAGS... Each rank writes ``OUT.<rank>.json``: its exit status and, for every
MAX all-reduce it ran (the ranks' agreement on a signal), the number of steps begun at that moment.
"""
import json
import os
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (the tiny model's spec)
import train_gpt  # noqa: E402

out, argv = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
steps, checks = [0], []
real_all_reduce, real_apply_schedule = dist.all_reduce, train_gpt.apply_schedule


def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
    if op == dist.ReduceOp.MAX:
        checks.append(steps[0])
    return real_all_reduce(tensor, op, *args, **kwargs)


def apply_schedule(opts, row):  # once per step, before its forward
    steps[0] += 1
    if rank == 0 and steps[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # only this rank: the other learns it where they next agree
    return real_apply_schedule(opts, row)


dist.all_reduce, train_gpt.apply_schedule = counting_all_reduce, apply_schedule
code = train_gpt.main(argv, models=conftest.SPECS)
with open(f"{out}.{rank}.json", "w", encoding="utf-8") as f:
    json.dump(dict(code=code, checks=checks), f)
sys.exit(code)
