"""The communication share of a few training steps on each rank: ``bench/gpu_check.py``'s profile under torchrun.

gpu_check launches the trainer itself (``train_gpt.main`` under ``python -m torch.distributed.run``, N processes,
its timing run's words with ``--max-steps warm + steps``) with one more launcher patch, ``install(path, warm,
steps)``: ``train_gpt.train`` runs inside ``torch.profiler`` on every rank, steps ``warm + 1 .. warm + steps`` are
recorded (after the trainer's own warm-up compiled every graph), and each rank writes ``path.format(rank=r)``: its
wall ms of each recorded step (synchronized at the step's end) and the device time of its NCCL kernels summed per
collective (``nccl_totals``). ``communication_rows`` merges the ranks' files into gpu_check's ``communication`` rows.

An NCCL kernel runs from its launch until every rank has sent and received its part: its time includes waiting for
the slowest rank, and a collective that overlaps compute counts in full. The share of the step is therefore an upper
bound on the exposed communication.
"""
import json
import os
import statistics
import time

import torch

# The sharded optimizer's two (Adam-family gradients reduce-scattered, their parameters all-gathered) and the
# gradients' one (NorMuon's all-reduced), in kernels.GradBuckets' order
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")
KERNEL_WORDS = (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"))


def collective_of(name):
    """The collective of a device kernel named ``name`` (NCCL's ``ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL``,
    ``ncclKernel_AllReduce_RING_LL_Sum_float``, ...): one of ``COLLECTIVES``, "other" for another NCCL kernel
    (send/receive, broadcast, a generic one), None for a kernel that is not NCCL's."""
    low = name.lower()
    if not (low.startswith("nccl") and "kernel" in low):
        return None
    flat = low.replace("_", "")
    return next((c for word, c in KERNEL_WORDS if word in flat), "other")


def device_kernels(prof):
    """``[(name, device us, calls)]`` of the device kernels ``prof`` (a finished ``torch.profiler.profile``)
    recorded, summed by name (``key_averages``; host ops and annotations left out)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.key, float(e.device_time_total), int(e.count)) for e in prof.key_averages()
            if getattr(e, "device_type", None) == cuda]


def nccl_totals(kernels, steps):
    """``{collective: {ms_per_step, calls_per_step}}`` for ``COLLECTIVES`` and "other" (NCCL kernels of no named
    collective) from ``kernels`` ``[(name, device us, calls)]`` over ``steps`` recorded steps; ``kernel_names``:
    the NCCL kernels seen, each with its collective and ms per step."""
    out = {c: dict(ms_per_step=0.0, calls_per_step=0.0) for c in (*COLLECTIVES, "other")}
    names = {}
    for name, us, calls in kernels:
        c = collective_of(name)
        if c is None:
            continue
        out[c]["ms_per_step"] += us / 1e3 / steps
        out[c]["calls_per_step"] += calls / steps
        names[name] = dict(collective=c, ms_per_step=round(us / 1e3 / steps, 4))
    out = {c: {k: round(v, 4) for k, v in row.items()} for c, row in out.items()}
    return dict(out, kernel_names=names)


def rank_result(rank, world, first_step, step_ms, kernels, error=None):
    """One rank's file: its ms of each recorded step (``first_step`` the first, 1-based), their median, and
    ``nccl_totals`` with each collective's share of that median."""
    steps = len(step_ms)
    ms = statistics.median(step_ms) if steps else None
    totals = nccl_totals(kernels, steps) if steps and kernels is not None else None
    if totals:
        for c in (*COLLECTIVES, "other"):
            totals[c]["share_of_step"] = round(totals[c]["ms_per_step"] / ms, 4) if ms else None
    return dict(rank=rank, world=world, first_step=first_step, steps=steps, step_ms=[round(m, 3) for m in step_ms],
                ms_per_step=None if ms is None else round(ms, 3), collectives=totals, error=error)


def install(path, warm=3, steps=3):
    """Launcher patch: ``train_gpt.train`` profiled on this rank (see the module's docstring); ``path`` a
    ``str.format`` pattern with ``{rank}``. ``warm`` >= 1 steps first, unrecorded (the first pays for lazy
    kernels and allocator growth), then ``steps`` recorded; the run's --max-steps should end there."""
    import train_gpt as T
    real_train, real_refresh = T.train, T.fp8_refresh

    def profiled_train(run, stop):
        rt, ends, found = run.rt, [], {}
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
        schedule = torch.profiler.schedule(wait=warm - 1, warmup=1, active=steps, repeat=1)

        def step_end(model, step):  # the loop calls it once a step, after the optimizers and their all-gather
            real_refresh(model, step)
            rt.sync()
            ends.append(time.perf_counter())
            prof.step()
        error = None
        T.fp8_refresh = step_end
        try:
            with torch.profiler.profile(activities=acts, schedule=schedule,
                                        on_trace_ready=lambda p: found.update(kernels=device_kernels(p))) as prof:
                return real_train(run, stop)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            T.fp8_refresh = real_refresh
            recorded = [1e3 * (b - a) for a, b in zip(ends[warm - 1:], ends[warm:warm + steps])]
            if error is None and len(recorded) < steps:
                error = f"the run ended after {len(ends)} steps, before the {warm + steps} the profile needs"
            out = rank_result(rt.rank, rt.world, warm + 1, recorded, found.get("kernels"), error)
            with open(path.format(rank=rt.rank), "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
    T.train = profiled_train


def _spread(values):
    """``[min, max]`` of the numbers in ``values`` (None left out), rounded; None when there are none."""
    xs = [v for v in values if v is not None]
    return [round(min(xs), 4), round(max(xs), 4)] if xs else None


def communication_rows(ranks, world, why_missing="its file is missing"):
    """gpu_check's ``communication`` rows of the collectives from the ranks' files (``rank_result`` dicts).

    Args:
        ranks: the files read, any order (a rank whose file is missing or holds an error counts as not measured).
        world: the process count launched.
        why_missing: said of a rank that wrote no file.

    Returns:
        ``{collective: row}`` for ``COLLECTIVES``: ms_per_step and share_of_step (the mean over ranks), spread
        (``[min, max]`` over ranks of both), per_rank ``[{rank, ms_per_step, share_of_step, calls_per_step,
        step_ms}]``; ``passed`` None (a measurement); ``skipped`` None, or why no rank measured it.
    """
    good = sorted((r for r in ranks if r.get("collectives") and not r.get("error")), key=lambda r: r["rank"])
    seen = {r["rank"] for r in ranks}
    problems = [f"rank {r['rank']}: {r['error']}" for r in ranks if r.get("error")]
    problems += [f"rank {r}: {why_missing}" for r in range(world) if r not in seen]
    rows = {}
    for c in COLLECTIVES:
        per_rank = [dict(rank=r["rank"], step_ms=r["ms_per_step"], **r["collectives"][c]) for r in good]
        ms = [p["ms_per_step"] for p in per_rank]
        share = [p.get("share_of_step") for p in per_rank]
        rows[c] = dict(name=c, passed=None, skipped=None if good else "not run: " + ("; ".join(problems) or "no rank"),
                       ms_per_step=round(statistics.fmean(ms), 4) if ms else None,
                       share_of_step=round(statistics.fmean(share), 4) if good and None not in share else None,
                       spread=dict(ms_per_step=_spread(ms), share_of_step=_spread(share)),
                       per_rank=per_rank, ranks_measured=len(good), world=world, problems=problems)
    return rows
