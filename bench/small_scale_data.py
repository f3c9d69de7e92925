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
* ``pieces``: the stream cut into pieces of ``chunk - 1`` tokens, each written after an EOT, the
  pieces in a random order (the shorter tail piece last). Record #89's document-packed loader
  starts every sequence at an EOT and skips the rest of a sequence's last document: on ``mix`` or
  ``docs`` orders of Wikipedia text at a small ``seq_len`` it skips most of the text (25 tokens read
  per trained position at seq_len 256 on data/sample). With ``chunk`` = ``seq_len`` every piece
  fills one sequence exactly, so a run reads what it trains on; a model sees ``chunk``-token
  excerpts (record #89 clips documents at 896 tokens in its first stage). Adds one token in
  ``chunk - 1`` (an EOT) to the corpus.

Order ``k`` of a kind is the permutation drawn by ``numpy.random.default_rng(k)``, so the same
corpus gives the same shards on every machine. Each order is written to
``<root>/<kind>_o<k>_<sha>/<kind>_o<k>_train_000001.bin`` where ``<sha>`` is the first 10 hex
digits of the sha256 of its tokens: another corpus gives another folder, hence another
``--train-files`` in the runs' configs, hence no stale run counted as done.

The benchmark records each order's *recipe* (corpus glob and sha256, kind, order, chunk, the
order's sha256) in ``<study>/data_recipes.json``; this file's command line rebuilds one order
anywhere (``records/verify.py`` does it itself for a study log whose data are missing):

    python bench/small_scale_data.py --train-files 'data/sample/*_train_*.bin' --kind pieces --order 0 \
        --chunk 256 --out DIR --expect 0123456789   # prints the shard glob; exit 1 if the sha differs
"""
import argparse
import glob
import hashlib
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import _paths  # noqa: E402,F401  (data/ on the path)
import shard_format  # noqa: E402  (data/shard_format.py: the shard format, defined once)

KINDS = ("mix", "docs", "pieces")
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

    Returns a new uint16 array: a permutation of ``tokens`` (``mix``, ``docs``: same multiset and
    length), or of its ``chunk - 1``-token pieces each after an EOT (``pieces``).

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
    if kind == "pieces":
        body = chunk - 1
        n_pieces = -(-len(tokens) // body)
        if chunk < 2 or n_pieces < 2:
            raise OrderError(f"--train-files: {len(tokens)} tokens make fewer than 2 pieces of {chunk} tokens; "
                             "pass more text")
        perm = np.concatenate([rng.permutation(n_pieces - 1), [n_pieces - 1]])  # the tail piece last
        starts = perm * body
        return np.concatenate([np.concatenate([[eot], tokens[a:a + body]]) for a in starts]).astype(np.uint16)
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


def corpus_sha256(tokens):
    """sha256 hex digest of a corpus's tokens (uint16 array): its fingerprint in a recipe."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.uint16).tobytes()).hexdigest()


def recipe(pattern, tokens, glob_of_order, kind, order, chunk):
    """The recipe of one written order: what ``rebuild_command`` needs, and the fingerprints to check."""
    folder = os.path.basename(os.path.dirname(glob_of_order))
    return dict(folder=folder, train_files=pattern, corpus_sha256=corpus_sha256(tokens), kind=kind, order=order,
                chunk=chunk, sha10=folder.rsplit("_", 1)[-1])


def rebuild_command(rec, out):
    """The one-line shell command that rebuilds the order of recipe ``rec`` under folder ``out``."""
    import shlex
    return (f"python bench/small_scale_data.py --train-files {shlex.quote(rec['train_files'])} --kind {rec['kind']} "
            f"--order {rec['order']} --chunk {rec['chunk']} --out {shlex.quote(out)} --expect {rec['sha10']}")


def rebuild(rec, out, repo):
    """Rebuild the order of recipe ``rec`` under ``out`` (the corpus glob relative to ``repo``); its shard glob.

    Raises:
        OrderError: the corpus is missing, or gives other tokens than the recipe's (sha256 named).
    """
    pattern = rec["train_files"] if os.path.isabs(rec["train_files"]) else os.path.join(repo, rec["train_files"])
    tokens = read_corpus(pattern)
    got = build_order(tokens, out, rec["kind"], int(rec["order"]), int(rec["chunk"]))
    sha = os.path.basename(os.path.dirname(got)).rsplit("_", 1)[-1]
    if sha != rec["sha10"]:
        shutil.rmtree(os.path.dirname(got), ignore_errors=True)
        raise OrderError(f"--train-files {rec['train_files']!r}: gives order tokens {sha}..., the recipe's are "
                         f"{rec['sha10']}... (corpus sha256 {corpus_sha256(tokens)[:16]}..., the recipe's "
                         f"{str(rec.get('corpus_sha256') or '?')[:16]}...): point --train-files at the study's corpus")
    return got


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


def main(argv=None):
    """Command line: rebuild one data order (see the module docstring); prints its shard glob."""
    ap = argparse.ArgumentParser(description="Rebuild one data order of bench/small_scale.py from its recipe.")
    ap.add_argument("--train-files", required=True, help="the corpus: train shards (glob), as the recipe names")
    ap.add_argument("--kind", required=True, choices=KINDS)
    ap.add_argument("--order", type=int, required=True, help="the order's number k (its permutation's seed)")
    ap.add_argument("--chunk", type=int, required=True, help="tokens per chunk (mix) or piece (pieces)")
    ap.add_argument("--out", required=True, help="folder that receives <kind>_o<k>_<sha>/")
    ap.add_argument("--expect", help="the recipe's 10-hex sha of the order: exit 1 if the rebuilt one differs")
    args = ap.parse_args(argv)
    if args.order < 0 or args.chunk < 2:
        ap.error(f"--order must be >= 0 and --chunk >= 2 (got {args.order}, {args.chunk})")
    rec = dict(train_files=args.train_files, kind=args.kind, order=args.order, chunk=args.chunk, sha10=args.expect)
    try:
        if args.expect:
            print(rebuild(rec, args.out, os.getcwd()))
        else:
            print(build_order(read_corpus(args.train_files), args.out, args.kind, args.order, args.chunk))
    except OrderError as e:
        print(f"small_scale_data.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"small_scale_data.py: error: --out {args.out}: cannot write there ({e.strerror}); name a writable "
              "folder", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
