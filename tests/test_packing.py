"""Document-packed train batches (PackedLoader) against a brute-force packer written plainly."""
import glob
import os

import numpy as np
import pytest
import torch

import harness as H
import train_gpt as T
from conftest import SAMPLE_DIR, write_shard

EOT = T.EOT_TOKEN


# ---------------------------------------------------------------------------------------------
# the reference: one document at a time, one token at a time


def brute_documents(tokens, position):
    """(start, end) of every document from ``position`` on, over the stream repeated forever.

    A document starts at an EOT and ends before the next EOT or at the end of a pass; tokens
    before a pass's first EOT belong to no document.
    """
    total = len(tokens)
    q = position
    while True:
        while tokens[q % total] != EOT:
            q += 1
        start = q
        q += 1
        while q % total != 0 and tokens[q % total] != EOT:
            q += 1
        yield start, q


def brute_pack(tokens, position, n_seqs, seq_tokens, cap):
    """The packed sequences of one step and the end of the last document used."""
    total = len(tokens)
    docs = brute_documents(tokens, position)
    seqs, end = [], position
    for _ in range(n_seqs):
        seq = []
        while len(seq) < seq_tokens:
            start, end = next(docs)
            take = min(end - start, cap, seq_tokens - len(seq))
            for i in range(take):
                seq.append(int(tokens[(start + i) % total]))
        seqs.append(seq)
    return seqs, end


# ---------------------------------------------------------------------------------------------
# random streams


def random_tokens(rng, n_docs, prefix=0, huge=0):
    """A stream of n_docs documents (EOT first) of random lengths: 1-token documents, short ones,
    ones longer than any cap used here, and ``huge`` of 4,000 tokens (beyond the first read-ahead);
    ``prefix`` tokens of a cut document come first (a stream that does not start with an EOT)."""
    lengths = rng.choice([1, 1, 2, 3, 5, 8, 13, 30, 50, 90, 200], size=n_docs)
    lengths[rng.choice(n_docs, size=huge, replace=False)] = 4000
    parts = [rng.integers(0, EOT, size=prefix)]
    for n in lengths:
        parts += [np.array([EOT]), rng.integers(0, EOT, size=n - 1)]
    return np.concatenate(parts).astype(np.int64)


def open_stream(tmp_path, tokens, rng, n_shards=3, wrap=True):
    """The tokens written as n_shards shards cut at random places (documents cross shard ends)."""
    cuts = np.sort(rng.choice(np.arange(1, len(tokens)), size=n_shards - 1, replace=False))
    files = [write_shard(tmp_path / f"p_train_{i:06d}.bin", part)
             for i, part in enumerate(np.split(tokens, cuts))]
    return H.TokenStream(files, wrap=wrap)


def check_step(loader, tokens, global_seqs, micro_seqs, seq_len, cap, bag_size=1, mode="full"):
    """One step of a one-process loader against the brute force; returns the step's tensor."""
    seq_tokens, _ = T.sequence_layout(mode, bag_size, seq_len)
    old = loader.position
    want, end = brute_pack(tokens, old, global_seqs, seq_tokens, cap)
    micro, raw = loader.next_batch(global_seqs, micro_seqs, seq_len, cap, bag_size, mode)
    assert len(micro) == global_seqs // micro_seqs
    for m in micro:
        assert m.dtype == torch.int64 and m.shape == (micro_seqs, seq_tokens)
    got = torch.cat(micro)
    assert got.tolist() == want
    assert loader.position == end and raw == end - old
    before = max([p // len(tokens) for p in range(old)] or [0])  # the last pass the earlier steps reached
    assert loader.wrapped == (max(p // len(tokens) for p in range(old, end)) > before)
    return got


# ---------------------------------------------------------------------------------------------
# against the brute force


@pytest.mark.parametrize("seed, prefix, huge", [(0, 0, 0), (1, 7, 1), (2, 0, 2), (3, 1, 0)])
def test_packing_matches_brute_force_across_stages_and_wraps(tmp_path, seed, prefix, huge):
    """Random sizes each step (a new stage every step): caps 1..1000, T 8..64, TST layouts."""
    rng = np.random.default_rng(seed)
    tokens = random_tokens(rng, 120, prefix=prefix, huge=huge)
    loader = T.PackedLoader(open_stream(tmp_path, tokens, rng), rank=0, world=1)
    wraps = 0
    for _ in range(40):
        seq_len = int(rng.choice([8, 17, 64]))
        cap = int(rng.choice([1, 3, 16, 40, 1000]))
        bag, mode = [(1, "full"), (4, "full"), (2, "input"), (3, "output")][rng.integers(4)]
        micro_seqs = int(rng.choice([1, 2]))
        check_step(loader, tokens, micro_seqs * int(rng.integers(1, 4)), micro_seqs, seq_len, cap, bag, mode)
        wraps += loader.wrapped
    assert wraps >= 2  # the runs went round the stream more than once


@pytest.mark.parametrize("seed", [4, 5])
def test_packing_from_any_position(tmp_path, seed):
    """A loader set to any position (mid-document, a later pass) packs from the next EOT on."""
    rng = np.random.default_rng(seed)
    tokens = random_tokens(rng, 80, prefix=5, huge=1)
    stream = open_stream(tmp_path, tokens, rng)
    for position in rng.integers(0, 3 * len(tokens), size=12):
        loader = T.PackedLoader(stream, rank=0, world=1)
        loader.position = int(position)
        check_step(loader, tokens, 6, 3, 20, int(rng.choice([2, 9, 50])))


def test_packing_rules_by_hand(tmp_path):
    """Documents of 1, 5, 3 and 9 tokens, cap 4, T + 1 = 6: clip, cut at the end, skip the rest."""
    docs = [[EOT], [EOT, 1, 2, 3, 4], [EOT, 5, 6], [EOT, 7, 8, 9, 10, 11, 12, 13, 14]]
    tokens = np.array([99, 98] + sum(docs, []))       # starts mid-document: 99, 98 skipped
    loader = T.PackedLoader(H.TokenStream([write_shard(tmp_path / "h.bin", tokens)], wrap=True), 0, 1)
    (batch,), raw = loader.next_batch(2, 2, 5, cap=4)
    assert batch.tolist() == [[EOT, EOT, 1, 2, 3, EOT],       # doc 2 clipped to 4, doc 3 cut at 1
                              [EOT, 7, 8, 9, EOT, EOT]]       # doc 4 clipped; the next pass's docs 1, 2
    assert raw == len(tokens) + 2 + 1 + 5 and loader.wrapped  # to the end of the next pass's doc 2
    (batch,), _ = loader.next_batch(1, 1, 5, cap=4)
    assert batch.tolist() == [[EOT, 5, 6, EOT, 7, 8]]


def test_packing_real_text_sample():
    """The repository's Wikipedia sample (shards 2 and 3 start mid-document), cap 896 and 2048."""
    files = sorted(glob.glob(os.path.join(SAMPLE_DIR, "*_train_*.bin")))
    stream = H.TokenStream(files, wrap=True)
    tokens = stream.read(0, stream.total)
    loader = T.PackedLoader(stream, rank=0, world=1)
    wraps = 0
    for step in range(16):
        got = check_step(loader, tokens, 4, 2, 1024, 896 if step < 8 else 2048)
        assert (got[:, 0] == EOT).all()
        wraps += loader.wrapped
    assert wraps >= 1


def test_tst_sequences_cut_into_bags(tmp_path):
    """Phase-1 layout: (L + 1) * s raw tokens a sequence; each sequence's first bag opens with an EOT."""
    rng = np.random.default_rng(13)
    tokens = random_tokens(rng, 80)
    loader = T.PackedLoader(open_stream(tmp_path, tokens, rng), 0, 1)
    micro, _ = loader.next_batch(4, 2, 16, 24, bag_size=4, mode="full")
    for m in micro:
        bags, targets = T.make_batch(m, "full", 4)
        assert bags.shape == targets.shape == (2, 16, 4)
        assert (bags[:, 0, 0] == EOT).all()


# ---------------------------------------------------------------------------------------------
# properties the training loop relies on

STAGES = [(8, 32, 12)] * 3 + [(16, 32, 40)] * 3 + [(24, 16, 2048)] * 2   # (global_seqs, seq_len, cap)


def run_stages(stream, rank, world, micro_seqs, stages=STAGES, position=0):
    loader = T.PackedLoader(stream, rank=rank, world=world)
    loader.position = position
    out = []
    for global_seqs, seq_len, cap in stages:
        micro, raw = loader.next_batch(global_seqs, micro_seqs, seq_len, cap)
        out.append((micro, raw, loader.position, loader.wrapped))
    return out


@pytest.mark.parametrize("world, micro_seqs", [(2, 1), (2, 2), (4, 1), (1, 4)])
def test_ranks_and_accumulation_see_the_one_process_batch(tmp_path, world, micro_seqs):
    """Ranks' micro-batches, concatenated in rank order, are the one-process batch, across stage changes."""
    rng = np.random.default_rng(6)
    tokens = random_tokens(rng, 150, huge=1)
    stream = open_stream(tmp_path, tokens, rng)
    ref = run_stages(stream, 0, 1, 1)
    ranks = [run_stages(stream, rank, world, micro_seqs) for rank in range(world)]
    for step, (micro, raw, position, wrapped) in enumerate(ref):
        assert sum(len(r[step][0]) for r in ranks) * micro_seqs == len(micro)    # accum * world * micro
        assert torch.equal(torch.cat([m for r in ranks for m in r[step][0]]), torch.cat(micro))
        for r in ranks:
            assert r[step][1:] == (raw, position, wrapped)


def test_resume_yields_the_same_batches(tmp_path):
    """A new loader at a saved position yields the same next batches, across a stage change."""
    rng = np.random.default_rng(7)
    tokens = random_tokens(rng, 150, prefix=3)
    stream = open_stream(tmp_path, tokens, rng)
    full = run_stages(stream, 0, 1, 2)
    for k in (2, 3, 5):
        resumed = run_stages(stream, 0, 1, 2, STAGES[k:], position=full[k - 1][2])
        for a, b in zip(full[k:], resumed):
            assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def test_raw_tokens_account_for_the_stream(tmp_path):
    """Raw tokens add up to the position; each is at least the packed tokens of the step (no padding)."""
    rng = np.random.default_rng(8)
    tokens = random_tokens(rng, 100, prefix=2)
    stream = open_stream(tmp_path, tokens, rng)
    out = run_stages(stream, 0, 1, 1)
    assert sum(o[1] for o in out) == out[-1][2]
    for (global_seqs, seq_len, cap), (micro, raw, _, _) in zip(STAGES, out):
        assert sum(m.numel() for m in micro) == global_seqs * (seq_len + 1)  # L + 1 tokens a sequence
        assert raw >= sum(m.numel() for m in micro)  # distinct stream positions in [old, new position)


def test_every_sequence_starts_at_an_eot_and_respects_the_cap(tmp_path):
    rng = np.random.default_rng(9)
    tokens = random_tokens(rng, 200, prefix=4, huge=1)
    loader = T.PackedLoader(open_stream(tmp_path, tokens, rng), rank=0, world=1)
    for cap in (5, 33, 100):
        (batch,), _ = loader.next_batch(8, 8, 63, cap)
        assert (batch[:, 0] == EOT).all()
        for row in batch.tolist():
            starts = [i for i, t in enumerate(row) if t == EOT] + [len(row)]
            assert max(b - a for a, b in zip(starts, starts[1:])) <= cap


# ---------------------------------------------------------------------------------------------
# bad input


def test_stream_without_eot_is_one_clear_error(tmp_path):
    stream = H.TokenStream([write_shard(tmp_path / "x_train_000000.bin", np.arange(500))], wrap=True)
    with pytest.raises(T.DataError, match=r"x_train_000000.bin: no <\|endoftext\|>"):
        T.PackedLoader(stream, 0, 1).next_batch(4, 4, 16, 8)


def test_stream_end_without_wrap_is_one_clear_error(tmp_path):
    rng = np.random.default_rng(10)
    tokens = random_tokens(rng, 20)
    loader = T.PackedLoader(open_stream(tmp_path, tokens, rng, wrap=False), 0, 1)
    with pytest.raises(T.DataError, match=r"the shards hold \d+ .*; add shards"):
        for _ in range(len(tokens)):
            check_step(loader, tokens, 2, 2, 16, 8)   # the steps before the end match the brute force


def test_a_new_pass_is_reported_once_also_from_an_exact_pass_boundary(tmp_path):
    """enters_new_pass against the set of passes each step touches (a step from an exact pass boundary
    once looked like the old pass and reported no wrap at all)."""
    for total in range(1, 6):
        for old in range(13):
            for new in range(old, 16):
                before = max([p // total for p in range(old)] or [0])
                want = new > old and max(p // total for p in range(old, new)) > before
                assert T.enters_new_pass(old, new, total) == want, (old, new, total)

