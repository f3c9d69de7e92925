"""Data orders of the small-scale benchmark: the same training tokens, reordered reproducibly.

A *data order* is a permutation of the benchmark's training corpus (the shards of
``--train-files``, read as one stream in sorted file order), written as a new shard that the
trainer then reads as its usual in-order stream. Two kinds:

* ``docs``: whole documents (each starts at token 50256, GPT-2 ``<|endoftext|>``) in a random
  order. Every document stays contiguous, so what a run read last is a handful of documents:
  the val loss at a small scale tracks them (the recency effect this kind shows).
* ``mix``: the stream cut into chunks of ``chunk`` tokens (the benchmark uses its ``seq_len``,
  so every next-token sequence is one chunk), the chunks in a random order, the shorter tail
  chunk last. An i.i.d.-like mix: the last steps read pieces of many documents. A chunk boundary
  joins two unrelated pieces without a 50256 between them, so a sequence that spans a boundary
  (TST phase 1 reads ``s`` chunks per sequence) attends across it; one label in ``chunk`` is the
  first token of an unrelated chunk.

Order ``k`` of a kind is the permutation drawn by ``numpy.random.default_rng(k)``, so the same
corpus gives the same shards on every machine. Each order is written to
``<root>/<kind>_o<k>_<sha>/<kind>_o<k>_train_000001.bin`` where ``<sha>`` is the first 10 hex
digits of the sha256 of its tokens: another corpus gives another folder, hence another
``--train-files`` in the runs' configs, hence no stale run counted as done.
"""
import glob
import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import _paths  # noqa: E402,F401  (data/ on the path)
import shard_format  # noqa: E402  (data/shard_format.py: the shard format, defined once)

KINDS = ("mix", "docs")
MAX_CORPUS_TOKENS = 200_000_000  # the whole corpus is permuted in memory (uint16: 400 MB)


class OrderError(ValueError):
    """A corpus that cannot be reordered as asked; the message names the flag and the fix."""


def read_corpus(pattern, flag="--train-files"):
    """The train stream of a glob: one uint16 array of shape ``(n_tokens,)``, shards in sorted order.

    Each shard is validated and memory-mapped by ``data/shard_format.read_tokens``.

    Raises:
        OrderError: no file matches, a bad shard, no tokens, or more than MAX_CORPUS_TOKENS.
    """
    files = sorted(glob.glob(os.path.expanduser(pattern)))
    if not files:
        raise OrderError(f"{flag} {pattern!r}: no shard found; check the glob")
    try:
        counts = [shard_format.read_header(f) for f in files]
    except shard_format.ShardError as e:
        raise OrderError(f"{flag}: {e}") from None
    if not 0 < sum(counts) <= MAX_CORPUS_TOKENS:
        raise OrderError(f"{flag} {pattern!r}: {sum(counts):,} tokens; the benchmark reorders the whole corpus "
                         f"in memory and needs 1 to {MAX_CORPUS_TOKENS:,} tokens: pass fewer or other shards")
    return np.concatenate([shard_format.read_tokens(f) for f in files])


def document_bounds(tokens, eot):
    """Start indices of the documents plus ``len(tokens)`` at the end, int64 shape ``(n_docs + 1,)``.

    A document starts at each ``eot`` token; tokens before the first ``eot`` (if any) count as a
    document of their own.
    """
    starts = np.flatnonzero(tokens == eot)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.concatenate([starts, [len(tokens)]]).astype(np.int64)


def ordered_tokens(tokens, kind, order, chunk, eot):
    """The corpus ``tokens`` (uint16, shape ``(n,)``) in data order ``order`` of ``kind``.

    Returns a new uint16 array, a permutation of ``tokens`` (same multiset, same length).

    Raises:
        OrderError: fewer than 2 documents (``docs``) or 2 chunks (``mix``) to permute.
    """
    rng = np.random.default_rng(order)
    if kind == "docs":
        bounds = document_bounds(tokens, eot)
        if len(bounds) < 3:
            raise OrderError(f"--train-files: the corpus holds {len(bounds) - 1} document(s) (each starts at token "
                             f"{eot}); the docs orders need at least 2: pass shards with more documents")
        pieces = [tokens[bounds[i]:bounds[i + 1]] for i in rng.permutation(len(bounds) - 1)]
        return np.concatenate(pieces).astype(np.uint16)
    if kind == "mix":
        n_full = len(tokens) // chunk
        if n_full < 2:
            raise OrderError(f"--train-files: {len(tokens)} tokens make fewer than 2 chunks of {chunk}; "
                             "pass more text")
        perm = rng.permutation(n_full)
        body = np.asarray(tokens[:n_full * chunk]).reshape(n_full, chunk)[perm].reshape(-1)
        return np.concatenate([body, tokens[n_full * chunk:]]).astype(np.uint16)
    raise ValueError(f"unknown data-order kind {kind!r}; one of {KINDS}")


def write_shard_atomic(path, tokens):
    """Write a shard under a temporary name, then rename it: no half-written shard under ``path``."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        shard_format.write_shard(tmp, tokens)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_order(tokens, root, kind, order, chunk, write=True):
    """Write data order ``order`` of ``kind`` under ``root`` unless already there; return its shard glob.

    The shard is (re)written only if missing or different (its folder name carries the hash of
    its tokens, so an existing file of that name holds those tokens unless damaged: checked).
    ``write=False`` only names it (a dry run creates nothing).
    """
    out = ordered_tokens(tokens, kind, order, chunk, shard_format.EOT_TOKEN)
    sha = hashlib.sha256(out.tobytes()).hexdigest()[:10]
    name = f"{kind}_o{order}"
    folder = os.path.join(root, f"{name}_{sha}")
    path = os.path.join(folder, f"{name}_train_000001.bin")
    if write and not (os.path.exists(path) and _same_tokens(path, out)):
        os.makedirs(folder, exist_ok=True)
        write_shard_atomic(path, out)
    return os.path.join(folder, "*_train_*.bin")


def _same_tokens(path, tokens):
    try:
        return np.array_equal(shard_format.read_tokens(path), tokens)
    except shard_format.ShardError:
        return False


def build_orders(pattern, root, kinds, n_orders, chunk, write=True):
    """Data orders ``0..n_orders-1`` of each kind in ``kinds``: ``{(kind, k): shard glob}``.

    ``root`` gets a ``.gitignore`` of ``*``: the shards are rebuilt from the corpus on demand.

    Raises:
        OrderError: see ``read_corpus`` and ``ordered_tokens``.
    """
    tokens = read_corpus(pattern)
    if write:
        os.makedirs(root, exist_ok=True)
    ignore = os.path.join(root, ".gitignore")
    if write and not os.path.exists(ignore):
        with open(ignore, "w", encoding="utf-8") as f:
            f.write("# rebuilt by bench/small_scale.py from --train-files (same shards on every machine)\n*\n")
    return {(kind, k): build_order(tokens, root, kind, k, chunk, write) for kind in kinds for k in range(n_orders)}
