"""Overlapped communication on several processes (gloo), read from torch.profiler's record of one optimizer step
(tests/dist_order_worker.py): Adam's reduce-scatters run while NorMuon computes, NorMuon's gathers run while it
computes its next bucket, Adam's big all-gather goes last. The result is the same bits as before the reordering:
test_sharded (sharded == replicated), test_distributed (2 processes == 1 with accumulation)."""
import json
import os

import pytest

from conftest import REPO, run_torchrun, subprocess_env

WORKER = os.path.join(REPO, "tests", "dist_order_worker.py")


def step_events(tmp_path, world, mode):
    out = tmp_path / f"order_{world}_{mode}"
    run_torchrun([f"--nproc_per_node={world}", WORKER, str(out), mode], dict(subprocess_env(), OMP_NUM_THREADS="1"),
                 cwd=tmp_path)
    return [json.loads((tmp_path / f"order_{world}_{mode}.{r}.json").read_text()) for r in range(world)]


def overlap_us(spans, others):
    """Microseconds of ``spans`` during which one of ``others`` ran too."""
    return sum(max(0.0, min(e, e2) - max(s, s2)) for s, e in spans for s2, e2 in others)


@pytest.mark.parametrize("world, mode", [(2, "eager"), (4, "at_end")])
def test_adams_reduce_scatter_and_normuons_gathers_run_while_normuon_computes(tmp_path, world, mode):
    for rank, events in enumerate(step_events(tmp_path, world, mode)):
        named = lambda name: [(s, e) for n, s, e, _ in events if n == name]  # noqa: E731
        directions = named("optimizer: directions")  # one per NorMuon bucket of same-shape blocks
        [(wait_rs, _)] = named("optimizer: wait for Adam's reduce-scatter")
        scatters = named("c10d::_reduce_scatter_base_")
        gathers = named("c10d::_allgather_base_")
        normuon_gathers = [g for g in gathers if g[0] < wait_rs]
        adam_gathers = [g for g in gathers if g[0] > wait_rs]
        waits = named("optimizer: wait for the directions' gather")
        assert len(directions) >= 2 and scatters and adam_gathers, (rank, events)
        # Adam's gradients are in flight before NorMuon's first matrix and waited for only after its last
        assert max(s for s, _ in scatters) < directions[0][0] and wait_rs > directions[-1][1], rank
        # each bucket's gather starts before the next bucket's math; the first wait comes after all of it
        assert len(normuon_gathers) == len(directions) == len(waits), rank
        assert all(g[0] < d[0] for g, d in zip(normuon_gathers, directions[1:])), rank
        assert waits[0][0] > directions[-1][1], rank
        # the big banks last: Adam's all-gathers are issued after every NorMuon gather
        assert min(s for s, _ in adam_gathers) > max(s for s, _ in normuon_gathers), rank
        if mode == "at_end":  # every bucket starts after the backward: the all-reduced (matrices) before the scatters
            reduces = [s for s, _ in named("c10d::allreduce_")]
            assert max(reduces) < min(s for s, _ in scatters), rank
        # and they really overlap: gloo's threads move data while the main thread orthogonalizes
        comm = [(s, e) for n, s, e, thread in events if n.startswith("gloo:")]
        assert overlap_us(directions, comm) > 0, rank
