"""Turn text into GPT-2 token shards, or check shards (``--check``).

Tokenize (inputs are files or globs, read in the order given; globs expand sorted):

    python data/tokenize.py docs.jsonl --output-dir out --prefix mytext --val-docs 100
    python data/tokenize.py 'books/*.txt' --output-dir out --prefix books
    python data/tokenize.py data.parquet --filter lang=en --output-dir out --prefix web

* ``.jsonl``: one JSON object a line, its ``text`` field is a document (a line that is not a
  JSON object, e.g. ``[1, 2]`` or ``"text"``, is an error naming ``file:line``). ``--filter key=value``
  (repeatable, all must hold) keeps only rows whose ``key`` equals ``value`` (strings compare as
  is, other JSON values by their JSON text: ``--filter year=2020``, ``--filter ok=true``).
* ``.txt``: each file is one document (UTF-8).
* ``.parquet``: a ``text`` column, rows filtered like jsonl; needs ``pyarrow``.

Every document becomes ``<|endoftext|>`` (50256) followed by its GPT-2 BPE tokens
(``tiktoken.get_encoding("gpt2").encode_ordinary``: special-token text in a document is
ordinary text). Documents keep input order. Without ``--val-docs`` all go to train shards
``<prefix>_train_000001.bin``, ``_000002`` ...; with ``--val-docs K`` the first K documents go to
``<prefix>_val_000000.bin`` and the rest to the train shards. K larger than the number of
documents (or ``--val-docs all``) puts every document in the val shard and writes no train shard.
Each shard holds ``--shard-size`` tokens (default 100,000,000, as FineWeb) except the last of its
split; like llm.c's fineweb.py a document may continue in the next shard. Extra shards of a split,
if any, are numbered on (``_val_000001`` ...).

All or nothing: every shard is first written under a temporary name
(``<final name>.tmp<pid>``, which no ``*.bin`` glob matches); only when every shard of the run is
written are they renamed (``os.replace``) to their final names. A run that fails (bad input line,
tokenizer error, Ctrl-C) removes its temporary files and changes nothing else. Existing
``<prefix>_val_*.bin`` / ``<prefix>_train_*.bin`` in the output folder stop the run unless
``--overwrite``: then the old set stays untouched until the new set is complete, is replaced by
it, and old shards the new set does not have are removed.

Check shards (header, size, tokens, documents = count of token 50256, largest token id; a shard
holding an id above 50256, the largest GPT-2 id, is not ok):

    python data/tokenize.py --check 'data/fineweb10B/*.bin' '../shared/data/realtext/*.bin'

Exit status: 0 on success, 1 on a data/input error (one message, no traceback) or any bad shard
or empty glob in ``--check``, 2 on bad arguments.

Offline, tiktoken needs its cached GPT-2 files: ``TIKTOKEN_CACHE_DIR=../shared/tokenizer/tiktoken_cache``.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# This file is named tokenize.py: run as `python data/tokenize.py`, sys.path[0] is data/ and the
# stdlib `tokenize` (imported by linecache, traceback, inspect, torch) would resolve to this file.
# Drop data/ from the path before anything imports it; the repo root gives train_gpt.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from train_gpt import (  # noqa: E402
    EOT_TOKEN, HEADER_BYTES, HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, DataError, read_shard_header)

DEFAULT_SHARD_SIZE = 100_000_000  # tokens, as the FineWeb-10B shards
MAX_TOKEN_ID = np.iinfo(np.uint16).max  # shards store uint16 tokens
GPT2_MAX_ID = EOT_TOKEN  # 50256: <|endoftext|> is the last of the 50257 GPT-2 tokens
TEXT_FIELD = "text"
ALL = "all"  # --val-docs all


class TokenizeError(Exception):
    """An input or tokenizer problem; the message names the file/flag and the fix."""


# ----------------------------------------------------------------------------------------------
# Reading documents

def expand_inputs(patterns):
    """Files for each path/glob, in the order given (each glob sorted). Raises TokenizeError."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise TokenizeError(f"input {pattern!r}: no file matches")
        files.extend(matches)
    return files


def parse_filters(items):
    """``["key=value", ...]`` -> ``{key: value}``. Raises TokenizeError on a missing '='."""
    filters = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TokenizeError(f"--filter {item!r}: expected key=value, e.g. --filter split=val")
        filters[key] = value
    return filters


def _matches(row, filters):
    """True when every filter key is in ``row`` with that value (non-strings as JSON text)."""
    for key, value in filters.items():
        if key not in row:
            return False
        got = row[key]
        if (got if isinstance(got, str) else json.dumps(got)) != value:
            return False
    return True


def _text_of(row, where):
    """The row's text field; TokenizeError when missing or not a string."""
    text = row.get(TEXT_FIELD) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise TokenizeError(f"{where}: no string {TEXT_FIELD!r} field in this row")
    return text


def _read_jsonl(path, filters):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TokenizeError(f"{where}: not valid JSON ({e.msg}); .jsonl wants one object a line") from None
            if not isinstance(row, dict):
                kind = "null" if row is None else type(row).__name__
                raise TokenizeError(f"{where}: a JSON {kind} row, not a JSON object; .jsonl wants one object "
                                    f'a line, like {{"{TEXT_FIELD}": "..."}}')
            if _matches(row, filters):
                yield where, _text_of(row, where)


def _read_parquet(path, filters):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to .jsonl") from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    missing = [c for c in [TEXT_FIELD, *filters] if c not in names]
    if missing:
        raise TokenizeError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")
    row_index = 0
    for batch in pf.iter_batches(columns=list(dict.fromkeys([TEXT_FIELD, *filters])), batch_size=1024):
        for row in batch.to_pylist():
            where = f"{path} row {row_index}"
            row_index += 1
            if _matches(row, filters):
                yield where, _text_of(row, where)


def iter_documents(files, filters=None):
    """Yield ``(where, text)`` for each document of ``files`` in order.

    ``where`` ("file:line", "file row i" or "file") locates the document in error messages.
    Raises TokenizeError on an unknown extension, bad JSON/UTF-8, a missing text field, or a
    filter given with .txt inputs.
    """
    filters = filters or {}
    for path in files:
        ext = os.path.splitext(path)[1].lower()
        try:
            if ext == ".jsonl":
                yield from _read_jsonl(path, filters)
            elif ext == ".parquet":
                yield from _read_parquet(path, filters)
            elif ext == ".txt":
                if filters:
                    raise TokenizeError(f"{path}: --filter selects .jsonl/.parquet rows; a .txt file has none")
                with open(path, encoding="utf-8") as f:
                    yield path, f.read()
            else:
                raise TokenizeError(f"{path}: unsupported input type {ext or '(none)'!r}; "
                                    "use .jsonl (a 'text' field a line), .txt (one document a file) or .parquet")
        except UnicodeDecodeError as e:
            raise TokenizeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# ----------------------------------------------------------------------------------------------
# Encoding (runs in worker processes)

_ENCODER = None


def load_encoder():
    """``tiktoken.get_encoding("gpt2")``; TokenizeError with the offline fix when it cannot load."""
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        cache = os.environ.get("TIKTOKEN_CACHE_DIR")
        if cache:
            fix = (f"TIKTOKEN_CACHE_DIR={cache} is set but does not hold tiktoken's gpt2 files "
                   "(vocab.bpe / encoder.json under their hashed names)")
        else:
            fix = ("TIKTOKEN_CACHE_DIR is not set, so tiktoken tried to download the gpt2 files; without network "
                   "set it to a folder holding them, e.g. TIKTOKEN_CACHE_DIR=../shared/tokenizer/tiktoken_cache")
        msg = str(e).strip().splitlines()
        raise TokenizeError(f"cannot load the GPT-2 tokenizer (tiktoken 'gpt2'): {type(e).__name__}: "
                            f"{msg[0] if msg else ''}. {fix}") from None


def get_encoder():
    """The process-wide encoder, loaded on first use (once per worker process)."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = load_encoder()
    return _ENCODER


def encode_document(item):
    """``(where, text)`` -> uint16 array ``[EOT_TOKEN, *encode_ordinary(text)]``, shape (1 + n,).

    Raises TokenizeError when a token id does not fit in uint16 (>= 65536).
    """
    where, text = item
    ids = np.asarray(get_encoder().encode_ordinary(text), dtype=np.int64)
    if ids.size and ids.max() > MAX_TOKEN_ID:
        raise TokenizeError(f"{where}: token id {ids.max()} does not fit in a uint16 shard (ids must be "
                            f"0..{MAX_TOKEN_ID}); this format needs a tokenizer of under 65536 tokens, like GPT-2's")
    tokens = np.empty(ids.size + 1, dtype=np.uint16)
    tokens[0] = EOT_TOKEN
    tokens[1:] = ids
    return tokens


# ----------------------------------------------------------------------------------------------
# Writing shards

def shard_path(output_dir, prefix, split, index):
    """``<output_dir>/<prefix>_<split>_<index:06d>.bin``."""
    return os.path.join(output_dir, f"{prefix}_{split}_{index:06d}.bin")


def temp_path(path):
    """The temporary name a shard is written under until the whole run has succeeded."""
    return f"{path}.tmp{os.getpid()}"


def write_shard(path, tokens):
    """Write header + uint16 ``tokens`` (shape (n,)) to ``path``."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


class ShardWriter:
    """Cuts a token stream into shards of ``shard_size`` tokens named ``<prefix>_<split>_NNNNNN.bin``.

    ``add`` takes uint16 arrays; a document may straddle two shards. ``close`` writes the last,
    partial shard. Shards are written under their ``temp_path`` name only: the caller renames them
    (``commit``) once every writer of the run is closed, or removes them (``discard``).
    ``written`` lists ``(final path, n_tokens, n_documents)``.
    """

    def __init__(self, output_dir, prefix, split, first_index, shard_size):
        self.output_dir, self.prefix, self.split = output_dir, prefix, split
        self.index, self.shard_size = first_index, shard_size
        self.buffer = None  # allocated on first use: a split may get no document
        self.fill = 0
        self.written = []
        self.pending = []  # (temporary path, final path) not renamed yet, a partly written one too

    def add(self, tokens):
        if self.buffer is None:
            self.buffer = np.empty(self.shard_size, dtype=np.uint16)
        while len(tokens):
            take = min(len(tokens), self.shard_size - self.fill)
            self.buffer[self.fill:self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self.shard_size:
                self._flush()

    def close(self):
        if self.fill:
            self._flush()

    def _flush(self):
        path = shard_path(self.output_dir, self.prefix, self.split, self.index)
        tokens = self.buffer[:self.fill]
        self.pending.append((temp_path(path), path))
        write_shard(self.pending[-1][0], tokens)
        self.written.append((path, self.fill, int(np.count_nonzero(tokens == EOT_TOKEN))))
        self.index += 1
        self.fill = 0

    def commit(self):
        """Rename every temporary shard to its final name (replacing an old shard of that name)."""
        while self.pending:
            os.replace(*self.pending[0])
            self.pending.pop(0)

    def discard(self):
        """Remove the temporary shards not renamed yet (after a failure); final names are never touched."""
        for tmp, _ in self.pending:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.pending = []


def existing_shards(output_dir, prefix):
    """Shards of this prefix already in ``output_dir`` (both splits), sorted."""
    return sorted(glob.glob(os.path.join(glob.escape(output_dir), f"{glob.escape(prefix)}_val_*.bin")) +
                  glob.glob(os.path.join(glob.escape(output_dir), f"{glob.escape(prefix)}_train_*.bin")))


def make_output_dir(output_dir):
    """Create ``output_dir`` (and its parents) if missing; TokenizeError naming --output-dir if it cannot be."""
    fix = "pick a folder path (it is created if missing)"
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise TokenizeError(f"--output-dir {output_dir}: exists and is not a folder; {fix}")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a parent is a file
        raise TokenizeError(f"--output-dir {output_dir}: cannot create it, a part of the path is not a folder; "
                            f"{fix}") from None
    except OSError as e:
        raise TokenizeError(f"--output-dir {output_dir}: cannot create it ({e.strerror}); {fix} "
                            "where you can write") from None


def tokenize_to_shards(inputs, output_dir, prefix, shard_size=DEFAULT_SHARD_SIZE, val_docs=None,
                       filters=None, workers=None, overwrite=False, progress=True):
    """Tokenize ``inputs`` (paths/globs) into shards; return ``[(path, n_tokens, n_documents)]``.

    ``val_docs``: None (all train), an int K (first K documents to val) or "all".
    ``workers``: encoder processes (default: CPU count); 1 encodes in this process.
    All or nothing: shards are written under temporary names and renamed only when all are
    written; on any failure the temporary files are removed and the output folder is as before
    (with ``overwrite``, the old shards stay untouched until the new set replaces them).
    Raises TokenizeError (inputs, tokenizer, uint16 overflow, existing shards, --output-dir not
    a folder) or OSError.
    """
    if shard_size < 1 or shard_size > np.iinfo(np.int32).max:
        raise TokenizeError(f"--shard-size {shard_size}: must be 1..{np.iinfo(np.int32).max} tokens")
    files = expand_inputs(inputs)
    filters = filters or {}
    make_output_dir(output_dir)
    old = existing_shards(output_dir, prefix)
    if old and not overwrite:
        raise TokenizeError(f"{output_dir} already holds {len(old)} shard(s) of prefix {prefix!r} "
                            f"({os.path.basename(old[0])} ...); pass --overwrite to replace them or pick "
                            "another --output-dir/--prefix")
    get_encoder()  # fail here, with the fix, rather than in every worker
    workers = workers or os.cpu_count() or 1
    n_val = float("inf") if val_docs == ALL else (val_docs or 0)

    val = ShardWriter(output_dir, prefix, "val", 0, shard_size)
    train = ShardWriter(output_dir, prefix, "train", 1, shard_size)
    docs = iter_documents(files, filters)
    pool = multiprocessing.Pool(workers) if workers > 1 else None
    n_docs, done = 0, False
    try:
        encoded = pool.imap(encode_document, docs, chunksize=16) if pool else map(encode_document, docs)
        with tqdm(unit="tok", unit_scale=True, desc=f"tokenizing {prefix}", disable=not progress) as bar:
            for tokens in encoded:
                (val if n_docs < n_val else train).add(tokens)
                n_docs += 1
                bar.update(len(tokens))
        if n_docs == 0:
            raise TokenizeError(f"no documents in {', '.join(inputs)}"
                                + (f" with --filter {filters}" if filters else ""))
        val.close()
        train.close()
        done = True
    finally:
        if pool:
            pool.terminate()
            pool.join()
        if not done:  # failed or interrupted: drop the partial new set, leave the folder as it was
            val.discard()
            train.discard()
    # Every new shard is written: swap the new set in, then remove old shards it does not replace.
    try:
        val.commit()
        train.commit()
    finally:  # a rename that failed (rare: same folder) leaves no temporary file behind
        val.discard()
        train.discard()
    written = val.written + train.written
    for path in set(old) - {p for p, _, _ in written}:
        os.remove(path)
    return written


# ----------------------------------------------------------------------------------------------
# Checking shards

def check_shards(patterns, out=sys.stdout):
    """Print a table (file, tokens, documents, max_id, ok or why not) for each shard.

    ``documents`` counts token 50256; ``max_id`` is the largest token id ("-" for an empty
    shard). A shard is not ok when its header/size is bad (the trainer's DataError message) or it
    holds an id above 50256 (not GPT-2 BPE ids, e.g. another tokenizer's). Returns the number of
    problems: bad shards plus globs that match nothing.
    """
    rows, problems = [], 0
    for pattern in patterns:
        files = sorted(glob.glob(os.path.expanduser(pattern)))
        if not files:
            rows.append((pattern, "-", "-", "-", "no file matches"))
            problems += 1
        for path in files:
            try:
                n = read_shard_header(path)
            except DataError as e:
                rows.append((path, "-", "-", "-", str(e)))
                problems += 1
                continue
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,)) if n else None
            docs = int(np.count_nonzero(tokens == EOT_TOKEN)) if n else 0
            max_id = int(tokens.max()) if n else None
            status = "ok"
            if max_id is not None and max_id > GPT2_MAX_ID:
                status = (f"token id {max_id} > {GPT2_MAX_ID}: not GPT-2 BPE ids; "
                          "re-tokenize with data/tokenize.py")
                problems += 1
            rows.append((path, f"{n:,}", f"{docs:,}", "-" if max_id is None else str(max_id), status))
    header = ("file", "tokens", "documents", "max_id", "status")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}",
              file=out)
    return problems


# ----------------------------------------------------------------------------------------------
# CLI

def _val_docs(value):
    if value == ALL:
        return ALL
    try:
        k = int(value)
    except ValueError:
        k = -1
    if k < 0:
        raise argparse.ArgumentTypeError(f"expected a number of documents >= 0 or '{ALL}', got {value!r}")
    return k


def build_parser():
    """argparse parser for both modes (tokenize, --check)."""
    p = argparse.ArgumentParser(
        description="Tokenize .jsonl/.txt/.parquet text into GPT-2 uint16 token shards "
                    "(256 x int32 header + tokens, <|endoftext|> before every document), "
                    "or check shards with --check.",
        epilog="--check GLOB... prints file, tokens, documents, max_id and ok/why-not for each shard "
               f"(an id above {GPT2_MAX_ID} is not ok).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="input files or globs (.jsonl, .txt, .parquet); with --check, shard globs")
    p.add_argument("--check", action="store_true", help="validate shards instead of tokenizing")
    p.add_argument("--output-dir", help="folder for the shards (created)")
    p.add_argument("--prefix", help="shard name prefix: <prefix>_val_000000.bin, <prefix>_train_000001.bin ...")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard")
    p.add_argument("--val-docs", type=_val_docs, default=None, metavar="K",
                   help=f"first K documents go to the val shard; K >= #documents or '{ALL}': all of them; "
                        "unset: no val shard")
    p.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only .jsonl/.parquet rows whose KEY equals VALUE (repeatable)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoder processes")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing shards of this prefix (only once the whole new set is written)")
    return p


def main(argv=None):
    """CLI entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check:
        return 1 if check_shards(args.inputs) else 0
    if not args.output_dir or not args.prefix:
        parser.error("tokenizing needs --output-dir and --prefix (or use --check GLOB...)")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    try:
        written = tokenize_to_shards(args.inputs, args.output_dir, args.prefix, args.shard_size, args.val_docs,
                                     parse_filters(args.filter), args.workers, args.overwrite)
    except (TokenizeError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path, n_tokens, n_docs in written:
        print(f"wrote {path}: {n_tokens:,} tokens, {n_docs:,} document starts")
    if args.val_docs not in (None, 0) and not any(
            os.path.basename(p).startswith(f"{args.prefix}_train_") for p, _, _ in written):
        print(f"note: --val-docs {args.val_docs} covers every document; all went to the val shard, no train shard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
