"""Sharded CautiousAdam under torchrun (gloo): a few optimizer steps of the tiny model on fixed random batches.

Run under ``torchrun --nproc_per_node=W`` (or alone: W = 1, no process group). Each rank trains on its share of the
same global batch (rank r: sequences r, r + W, ...), reduce-scatters the Adam gradients and all-reduces NorMuon's
(``kernels.GradBuckets``), updates its shards, all-gathers; rank 0 saves the weights, the whole Adam state
(``state_dict``, a collective) and every rank's own Adam state bytes to ``argv[1]``. ``argv[2]``: ``replicated``
(Adam unsharded) or ``compiled`` (the sharded Adam compiled as the trainer compiles it; the graph count per step kept).
"""
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
import train_gpt as T  # noqa: E402
from conftest import TINY, tiny_args  # noqa: E402  (this folder is the script's: on the path)

GLOBAL_SEQS, SEQ_LEN, STEPS = 4, 32, 6


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def main(out, mode):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    cfg, _, _ = harness.parse_flags(T.Config, T.PRESETS, tiny_args(pathlib.Path(tempfile.gettempdir())))  # no files
    rt = harness.Runtime(rank, world, torch.device("cpu"), False)
    torch.manual_seed(0)
    model = T.build_model(cfg, TINY)
    model.flex = False
    buckets = None
    if world > 1:
        sharded = [p for p in model.parameters() if p.opt_group == "adam"] if mode != "replicated" else []
        buckets = T.GradBuckets(model.parameters(), rank, world, sharded)
    opts = T.build_optimizers(model, cfg, shard=None if mode == "replicated" else buckets)
    if mode == "compiled":  # Adam compiled as the trainer compiles it; NorMuon eager, so both runs get the same grads
        opts[0] = T.build_optimizers(model, cfg, compile=True, shard=buckets)[0]
    graphs = []
    g = torch.Generator().manual_seed(1)
    row = T.Schedule(cfg, TINY)[0]
    model.set_window(row.window, row.yarn)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, 50257, (GLOBAL_SEQS, SEQ_LEN + 1), generator=g)
        tokens[:, ::7] = T.EOT_TOKEN
        inputs, targets = T.make_batch(tokens[rank::world], "full", 1)  # this rank's sequences, one micro-batch each
        micro = [(inputs[i:i + 1], targets[i:i + 1]) for i in range(inputs.size(0))]
        losses.append(T.accumulate_gradients(model, micro, rt, None, GLOBAL_SEQS, buckets).item())
        for opt in opts:
            opt.step()
        opts[0].wait_gather()
        if step == 1:
            first_update = {k: v.clone() for k, v in model.state_dict().items()}  # only the optimizer's math so far
            T.untie(model, opts[0])  # the untie copies the head's (sharded) state to the embedding's
        model.zero_grad(set_to_none=True)
        graphs.append(harness.compiled_graphs())
    own = state_bytes(opts[0])
    owns = [None] * world
    if world > 1:
        dist.all_gather_object(owns, own)
    else:
        owns = [own]
    adam = opts[0].state_dict()  # whole tensors: a collective under several processes
    if rank == 0:
        torch.save(dict(model={k: v.clone() for k, v in model.state_dict().items()}, adam=adam, state_bytes=owns,
                        losses=losses, graphs=graphs, first_update=first_update), out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "sharded")
