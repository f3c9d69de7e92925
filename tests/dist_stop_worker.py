"""train_gpt.main under torchrun with --save-on-interrupt; rank 0 alone gets SIGTERM during step 12.

Usage: dist_stop_worker.py OUT TRAINER-FLAGS... Each rank writes ``OUT.<rank>.json``: its exit
status and, for every MAX all-reduce it ran (the ranks' agreement on a signal), the number of
steps done at that moment.
"""
import json
import os
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402

out, argv = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
steps, checks = [0], []
real_all_reduce, real_count_step = dist.all_reduce, train_gpt.count_step


def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
    if op == dist.ReduceOp.MAX:
        checks.append(steps[0])
    return real_all_reduce(tensor, op, *args, **kwargs)


def count_step(progress, row, raw_tokens):
    steps[0] += 1
    if rank == 0 and steps[0] == 12:
        os.kill(os.getpid(), signal.SIGTERM)  # only this rank: the others learn it at the next check
    return real_count_step(progress, row, raw_tokens)


dist.all_reduce, train_gpt.count_step = counting_all_reduce, count_step
code = train_gpt.main(argv)
with open(f"{out}.{rank}.json", "w", encoding="utf-8") as f:
    json.dump(dict(code=code, checks=checks), f)
sys.exit(code)
