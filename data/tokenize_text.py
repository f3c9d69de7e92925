"""Turn text into GPT-2 token shards, or check shards (``--check``).

Tokenize (inputs are files or globs, read in the order given; globs expand sorted):

    python data/tokenize_text.py docs.jsonl --output-dir out --prefix mytext --val-docs 100
    python data/tokenize_text.py docs.jsonl --split-key split --output-dir out --prefix mytext
    python data/tokenize_text.py 'books/*.txt' --output-dir out --prefix books
    python data/tokenize_text.py data.parquet --filter lang=en --output-dir out --prefix web

* ``.jsonl``: one JSON object a line, its ``text`` field is a document (a line that is not a
  JSON object, e.g. ``[1, 2]`` or ``"text"``, is an error naming ``file:line``). ``--filter key=value``
  (repeatable, all must hold) keeps only rows whose ``key`` equals ``value`` (strings compare as
  is, other JSON values by their JSON text: ``--filter year=2020``, ``--filter ok=true``).
* ``.txt``: each file is one document (UTF-8).
* ``.parquet``: a ``text`` column, rows filtered like jsonl; needs ``pyarrow``.

Every document becomes ``<|endoftext|>`` (50256) followed by its GPT-2 BPE tokens
(``encode_ordinary``: special-token text in a document is ordinary text). Documents with no text
(empty or only whitespace) are kept and counted in a note; inputs with no text at all are an
error. ``--prefix`` is a plain name (no path separator or glob character). The GPT-2 BPE files are
read from ``data/gpt2_bpe/`` (shipped with the repository, checked against their published sha256),
so tokenizing needs neither network nor tiktoken's download cache; the ids are those of
``tiktoken.get_encoding("gpt2")``. Documents keep input order. Without ``--val-docs`` all go to train shards
``<prefix>_train_000001.bin``, ``_000002`` ...; with ``--val-docs K`` the first K documents go to
``<prefix>_val_000000.bin`` and the rest to the train shards. K larger than the number of
documents (or ``--val-docs all``) puts every document in the val shard and writes no train shard.
``--split-key KEY`` instead routes each row by its field KEY (``"val"`` or ``"train"``).
Each shard holds ``--shard-size`` tokens (default 100,000,000, as FineWeb) except the last of its
split; like llm.c's fineweb.py a document may continue in the next shard. Extra shards of a split,
if any, are numbered on (``_val_000001`` ...).

All or nothing: every shard is first written under a temporary name
(``<final name>.tmp<pid>``, which no ``*.bin`` glob matches); only when every shard of the run is
written are they renamed (``os.replace``) to their final names. A run that fails (bad input line,
tokenizer error, a worker process killed, Ctrl-C) removes its temporary files (and the output
folder, if it made it) and changes nothing else. Existing ``<prefix>_val_*.bin`` /
``<prefix>_train_*.bin`` in the output folder stop the run unless ``--overwrite``: then the old
set stays untouched until the new set is complete, is replaced by it, and old shards the new set
does not have are removed.

Check shards (the same as ``python data/check_shards.py``):

    python data/tokenize_text.py --check 'data/fineweb10B/*.bin' 'data/sample/*.bin'

Exit status: 0 on success, 1 on a data/input error (one message, no traceback) or any bad shard
or empty glob in ``--check``, 2 on bad arguments, 130 when interrupted.
"""
import argparse
import collections
import contextlib
import ctypes
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from tqdm import tqdm

from check_shards import check_shards
from shard_format import EOT_TOKEN, GPT2_MAX_ID, not_a_file, write_shard

DEFAULT_SHARD_SIZE = 100_000_000  # tokens, as the FineWeb-10B shards
MAX_TOKEN_ID = np.iinfo(np.uint16).max  # shards store uint16 tokens
TEXT_FIELD = "text"
ALL = "all"  # --val-docs all
SPLITS = ("val", "train")  # the values --split-key accepts
BPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_bpe")
# sha256 of the BPE files as published with GPT-2 (the hashes tiktoken checks its own download against)
BPE_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
              "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
BATCH_DOCS = 16  # documents per task sent to a worker process
IN_FLIGHT_PER_WORKER = 4  # tasks queued per worker: bounds memory whatever the input size
DEAD_WORKER_GRACE_S = 1.0  # a worker dead this long without the pool breaking: break it (``_result``)


class TokenizeError(Exception):
    """An input or tokenizer problem; the message names the file/flag and the fix."""


# ----------------------------------------------------------------------------------------------
# Reading documents

def expand_inputs(patterns):
    """Files for each path/glob, in the order given (each glob sorted).

    Raises TokenizeError when a pattern matches nothing or a match is not a regular file (a
    folder; a FIFO or a device, whose reading would block or never end).
    """
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise TokenizeError(f"input {pattern!r}: no file matches")
        for path in matches:
            kind = not_a_file(path)
            if kind:
                raise TokenizeError(f"input {path}: is {kind}, not a file; pass .jsonl/.txt/.parquet files "
                                    "(a folder's files as a quoted glob, e.g. 'books/*.txt')")
        files.extend(matches)
    return files


def check_prefix(prefix):
    """Raise TokenizeError unless ``prefix`` is a plain file-name start: no path separator (a shard
    would land outside --output-dir), no glob character (the trainer finds shards by glob)."""
    bad = [c for c in ("/", os.sep, os.altsep or "/", "*", "?", "[", "]") if c in prefix]
    if not prefix or bad or prefix in (".", ".."):
        why = f"contains {bad[0]!r}" if bad else "is empty" if not prefix else f"is {prefix!r}"
        raise TokenizeError(f"--prefix {prefix!r}: {why}; give a plain name such as 'mytext' (the shards are "
                            "<prefix>_train_000001.bin ... inside --output-dir; choose the folder with --output-dir)")


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


def _document(where, row, split_key):
    """``(where, text, split)`` of a row: split is None without ``split_key``. Raises TokenizeError."""
    text = row.get(TEXT_FIELD)
    if not isinstance(text, str):
        raise TokenizeError(f"{where}: no string {TEXT_FIELD!r} field in this row")
    if split_key is None:
        return where, text, None
    split = row.get(split_key)
    if split not in SPLITS:
        got = json.dumps(split) if split_key in row else "missing"
        raise TokenizeError(f"{where}: field {split_key!r} is {got}; --split-key {split_key} needs "
                            f'"val" or "train" in every row (or use --val-docs)')
    return where, text, split


def _read_jsonl(path, filters):
    """``(where, row)`` for each row of a .jsonl file that passes the filters."""
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
                yield where, row


def _read_parquet(path, filters, split_key):
    """``(where, row)`` for each row of a .parquet file that passes the filters."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to .jsonl") from None
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    columns = list(dict.fromkeys([TEXT_FIELD, *filters, *([split_key] if split_key else [])]))
    missing = [c for c in columns if c not in names]
    if missing:
        raise TokenizeError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(names)})")
    row_index = 0
    for batch in pf.iter_batches(columns=columns, batch_size=1024):
        for row in batch.to_pylist():
            where = f"{path} row {row_index}"
            row_index += 1
            if _matches(row, filters):
                yield where, row


def iter_documents(files, filters=None, split_key=None, empty=None):
    """Yield ``(where, text, split)`` for each document of ``files`` in order.

    ``where`` ("file:line", "file row i" or "file") locates the document in error messages;
    ``split`` is the row's ``split_key`` field ("val" or "train"), None without ``split_key``.
    The ``where`` of each document with no text (empty or only whitespace) is appended to the
    list ``empty`` when one is given (the document is still yielded: input order is kept).
    Raises TokenizeError on an unknown extension, bad JSON/UTF-8, an unreadable file, a missing
    text field, a split field that is not "val"/"train", or a filter or split key given with
    .txt inputs.
    """
    filters = filters or {}
    for path in files:
        ext = os.path.splitext(path)[1].lower()
        try:
            if ext == ".jsonl":
                rows = _read_jsonl(path, filters)
            elif ext == ".parquet":
                rows = _read_parquet(path, filters, split_key)
            elif ext == ".txt":
                if filters or split_key:
                    raise TokenizeError(f"{path}: --filter and --split-key select .jsonl/.parquet rows; "
                                        "a .txt file has none")
                with open(path, encoding="utf-8") as f:
                    rows = [(path, {TEXT_FIELD: f.read()})]
            else:
                raise TokenizeError(f"{path}: unsupported input type {ext or '(none)'!r}; "
                                    "use .jsonl (a 'text' field a line), .txt (one document a file) or .parquet")
            for where, row in rows:
                doc = _document(where, row, split_key)
                if empty is not None and not doc[1].strip():
                    empty.append(where)
                yield doc
        except UnicodeDecodeError as e:
            raise TokenizeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise TokenizeError(f"{path}: cannot read it ({e.strerror or e}); check the path and its "
                                "permissions") from None


# ----------------------------------------------------------------------------------------------
# Encoding (runs in worker processes)

_ENCODER = None


def _bpe_paths(bpe_dir):
    """``{name: path}`` of the GPT-2 BPE files, each checked against its published sha256."""
    paths = {}
    for name, expected in BPE_SHA256.items():
        path = os.path.join(bpe_dir, name)
        fix = f"restore it from the repository (git checkout -- {os.path.relpath(path)})"
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            raise TokenizeError(f"{path}: cannot read the GPT-2 BPE file ({e.strerror}); {fix}") from None
        if digest != expected:
            raise TokenizeError(f"{path}: not the GPT-2 BPE file (sha256 {digest[:12]}..., expected "
                                f"{expected[:12]}...); {fix}")
        paths[name] = path
    return paths


def load_encoder(bpe_dir=BPE_DIR):
    """GPT-2's tiktoken encoding built from the BPE files in ``bpe_dir``: no network, no cache.

    The merges of ``vocab.bpe`` (checked against ``encoder.json`` by tiktoken's own
    ``data_gym_to_mergeable_bpe_ranks``), tiktoken's GPT-2 split pattern ``r50k_pat_str`` and
    ``<|endoftext|>`` = 50256: the definition of ``tiktoken.get_encoding("gpt2")``, so the ids are
    the same (tested). Raises TokenizeError when tiktoken is missing or a file is missing or altered.
    """
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
    except ImportError as e:
        raise TokenizeError(f"cannot import tiktoken ({e}); install it: pip install -r requirements.txt") from None
    paths = _bpe_paths(bpe_dir)
    # Read the files in place: otherwise tiktoken keeps a copy in its cache, keyed by the path, and
    # reads that copy from then on.
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(paths["vocab.bpe"], paths["encoder.json"])
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: EOT_TOKEN}, explicit_n_vocab=EOT_TOKEN + 1)


def get_encoder():
    """The process-wide encoder, loaded on first use (once per worker process)."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = load_encoder()
    return _ENCODER


def encode_document(where, text):
    """uint16 array ``[EOT_TOKEN, *encode_ordinary(text)]``, shape (1 + n,).

    Raises TokenizeError naming ``where`` when a token id does not fit in uint16 (>= 65536) or
    the tokenizer fails on the text.
    """
    try:
        ids = np.asarray(get_encoder().encode_ordinary(text), dtype=np.int64)
    except TokenizeError:
        raise
    except Exception as e:  # reported as one line in the main process, not a worker's traceback
        first = str(e).strip().splitlines()
        raise TokenizeError(f"{where}: the tokenizer failed on this document: {type(e).__name__}: "
                            f"{first[0] if first else ''}") from None
    if ids.size and ids.max() > MAX_TOKEN_ID:
        raise TokenizeError(f"{where}: token id {ids.max()} does not fit in a uint16 shard (ids must be "
                            f"0..{MAX_TOKEN_ID}); this format needs a tokenizer of under 65536 tokens, like GPT-2's")
    tokens = np.empty(ids.size + 1, dtype=np.uint16)
    tokens[0] = EOT_TOKEN
    tokens[1:] = ids
    return tokens


def encode_batch(docs):
    """``[(split, tokens)]`` for a list of ``(where, text, split)`` documents (one worker task)."""
    return [(split, encode_document(where, text)) for where, text, split in docs]


class _RecordingContext:
    """The default multiprocessing context, keeping the processes it starts so that a broken pool
    can say how its worker ended (ProcessPoolExecutor only says that one did)."""

    def __init__(self):
        self._base = multiprocessing.get_context()
        self.processes = []

    def __getattr__(self, name):
        return getattr(self._base, name)

    def Process(self, *args, **kwargs):  # noqa: N802 (the multiprocessing name)
        process = self._base.Process(*args, **kwargs)
        self.processes.append(process)
        return process


def _worker_died(processes):
    """One line on how a pool worker ended; the pool itself SIGTERMs the others after one dies."""
    codes = sorted((p.exitcode for p in processes if p.exitcode), key=lambda c: c == -signal.SIGTERM)
    if codes and codes[0] < 0:
        try:
            how = f"was killed (signal {signal.Signals(-codes[0]).name})"
        except ValueError:
            how = f"was killed (signal {-codes[0]})"
    else:
        how = f"exited unexpectedly (exit status {codes[0]})" if codes else "stopped unexpectedly"
    return f"a tokenizer worker {how}; use fewer --workers or free memory"


def _worker_init():
    """Worker initializer. Ctrl-C (SIGINT, sent to the whole foreground process group) is the main
    process's to handle: it removes the temporary shards and stops the workers. SIGTERM keeps its
    default action, death: when one worker dies the pool stops the others with SIGTERM, and a
    worker ignoring it can block forever on a queue lock the dead worker held (the pool then never
    shuts down). A SIGTERM sent to the whole group also reaches the main process, which reports an
    interruption (see ``encode_stream``). A worker whose main process dies dies too (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's handler, inherited by fork
    try:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux/glibc: orphans end when their queue closes
        pass


_STOP_SIGNALS = []  # signals the main process received (``_raise_interrupt``)
_MAIN_PID = os.getpid()  # forked workers inherit this value, not the pid


def _raise_interrupt(signum, frame):
    """Ctrl-C and SIGTERM (a scheduler, ``timeout``, ``docker stop``) stop the run: nothing written.

    A worker inherits this handler when it is forked and keeps it until its initializer runs. In
    that window a SIGTERM (the pool stopping it because another worker died) ends it as the
    default action would, and a Ctrl-C is left to the main process, as after the initializer;
    neither raises KeyboardInterrupt inside the new process."""
    if os.getpid() != _MAIN_PID:
        if signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return
    _STOP_SIGNALS.append(signum)
    raise KeyboardInterrupt


def _result(future, executor, processes):
    """``future.result()``, which also ends when a worker was killed while writing a result.

    The pool's reader thread then waits forever for the rest of that message (the main process
    holds a write end of the result pipe too), so the pool never notices the death. A worker
    found dead for ``DEAD_WORKER_GRACE_S`` seconds with the pool unbroken: kill the other workers
    and close the main process's write end (``executor._result_queue``, a private attribute of
    ProcessPoolExecutor); the reader meets end-of-file and the pool breaks as usual. Raises
    BrokenProcessPool then, or whatever the task raised.
    """
    dead_since = None
    while True:
        try:
            return future.result(timeout=0.25)
        except FutureTimeout:
            pass
        if not any(p.exitcode for p in processes):
            continue
        dead_since = dead_since or time.monotonic()
        if time.monotonic() - dead_since >= DEAD_WORKER_GRACE_S:
            for p in processes:
                if p.exitcode is None:
                    p.kill()
            executor._result_queue._writer.close()


def encode_stream(docs, workers):
    """Yield ``(split, tokens)`` for every document of ``docs``, in order.

    ``workers`` > 1 encodes in that many processes, at most ``IN_FLIGHT_PER_WORKER`` batches of
    ``BATCH_DOCS`` documents each in flight, so memory stays bounded. A worker that dies (e.g.
    SIGKILLed by the out-of-memory killer) raises TokenizeError saying so within about a second;
    closing the generator shuts the workers down.
    """
    if workers <= 1:
        for where, text, split in docs:
            yield split, encode_document(where, text)
        return
    context = _RecordingContext()
    executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init)
    in_flight = collections.deque()
    try:
        batches = iter(lambda: list(itertools.islice(docs, BATCH_DOCS)), [])
        for batch in batches:
            in_flight.append(executor.submit(encode_batch, batch))
            if len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                yield from _result(in_flight.popleft(), executor, context.processes)
        while in_flight:
            yield from _result(in_flight.popleft(), executor, context.processes)
    except BrokenProcessPool:
        executor.shutdown(wait=True, cancel_futures=True)  # joins the workers: exit codes are known
        if _STOP_SIGNALS:  # a SIGTERM to the whole process group ended the workers too: an interruption
            raise KeyboardInterrupt from None
        raise TokenizeError(_worker_died(context.processes)) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Writing shards

def shard_path(output_dir, prefix, split, index):
    """``<output_dir>/<prefix>_<split>_<index:06d>.bin``."""
    return os.path.join(output_dir, f"{prefix}_{split}_{index:06d}.bin")


def temp_path(path):
    """The temporary name a shard is written under until the whole run has succeeded."""
    return f"{path}.tmp{os.getpid()}"


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
    """Create ``output_dir`` (and its parents) if missing; TokenizeError naming --output-dir if it cannot be.

    Returns the folders created, innermost first (``[]`` when it existed), so that a failed run
    can remove them again.
    """
    fix = "pick a folder path (it is created if missing)"
    created, path = [], os.path.abspath(output_dir)
    while not os.path.exists(path) and path != os.path.dirname(path):
        created.append(path)
        path = os.path.dirname(path)
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
    return created


def remove_empty_folders(folders):
    """Remove each of ``folders`` (innermost first) that is empty: a failed run leaves no folder it made."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (another writer) or already gone
            return


def _write_split_shards(encoded, val, train, n_val, by_key, progress, desc):
    """Route each encoded document to the val or train writer; returns the number of documents."""
    n_docs = 0
    with tqdm(unit="tok", unit_scale=True, desc=desc, disable=not progress) as bar:
        for split, tokens in encoded:
            to_val = split == "val" if by_key else n_docs < n_val
            (val if to_val else train).add(tokens)
            n_docs += 1
            bar.update(len(tokens))
    return n_docs


def tokenize_to_shards(inputs, output_dir, prefix, shard_size=DEFAULT_SHARD_SIZE, val_docs=None,
                       filters=None, workers=None, overwrite=False, progress=True, split_key=None, empty=None):
    """Tokenize ``inputs`` (paths/globs) into shards; return ``[(path, n_tokens, n_documents)]``.

    ``val_docs``: None (all train), an int K (first K documents to val) or "all".
    ``empty``: a list that receives the ``where`` of each document with no text (empty or only
    whitespace); such a document is written like any other, but inputs with no text at all are
    an error.
    ``split_key``: route each row by this field ("val" or "train") instead of ``val_docs``.
    ``workers``: encoder processes (default: CPU count); 1 encodes in this process.
    All or nothing: shards are written under temporary names and renamed only when all are
    written; on any failure the temporary files are removed and the output folder is as before
    (with ``overwrite``, the old shards stay untouched until the new set replaces them), and
    folders it created for ``output_dir`` are removed again.
    Raises TokenizeError (inputs, tokenizer, a worker killed, uint16 overflow, existing shards,
    --output-dir not a folder, a --prefix with a path separator or glob character, no document
    with text) or OSError.
    """
    if shard_size < 1 or shard_size > np.iinfo(np.int32).max:
        raise TokenizeError(f"--shard-size {shard_size}: must be 1..{np.iinfo(np.int32).max} tokens")
    check_prefix(prefix)
    files = expand_inputs(inputs)
    filters = filters or {}
    empty = [] if empty is None else empty
    created = make_output_dir(output_dir)
    try:
        return _tokenize_into(files, output_dir, prefix, shard_size, val_docs, filters, workers, overwrite,
                              progress, split_key, empty)
    except BaseException:
        remove_empty_folders(created)
        raise


def _tokenize_into(files, output_dir, prefix, shard_size, val_docs, filters, workers, overwrite, progress,
                   split_key, empty):
    """``tokenize_to_shards`` once its arguments are checked and ``output_dir`` exists."""
    old = existing_shards(output_dir, prefix)
    if old and not overwrite:
        raise TokenizeError(f"{output_dir} already holds {len(old)} shard(s) of prefix {prefix!r} "
                            f"({os.path.basename(old[0])} ...); pass --overwrite to replace them or pick "
                            "another --output-dir/--prefix")
    get_encoder()  # fail here, with the fix, rather than in every worker
    n_val = float("inf") if val_docs == ALL else (val_docs or 0)
    val = ShardWriter(output_dir, prefix, "val", 0, shard_size)
    train = ShardWriter(output_dir, prefix, "train", 1, shard_size)
    done = False
    try:
        docs = iter_documents(files, filters, split_key, empty)
        with contextlib.closing(encode_stream(docs, workers or os.cpu_count() or 1)) as encoded:
            n_docs = _write_split_shards(encoded, val, train, n_val, split_key is not None, progress,
                                         f"tokenizing {prefix}")
        if n_docs == len(empty):  # nothing but empty documents: a shard of lone <|endoftext|> tokens
            raise TokenizeError(f"no text in {', '.join(files)}"
                                + (f" with --filter {filters}" if filters else "")
                                + (f": {len(empty)} document(s), all empty or only whitespace (first: {empty[0]})"
                                   if empty else ": no documents"))
        val.close()
        train.close()
        done = True
    finally:
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
    p.add_argument("--prefix", help="shard name prefix, a plain name (no '/' or glob characters): "
                                    "<prefix>_val_000000.bin, <prefix>_train_000001.bin ...")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard")
    p.add_argument("--val-docs", type=_val_docs, default=None, metavar="K",
                   help=f"first K documents go to the val shard; K >= #documents or '{ALL}': all of them; "
                        "unset: no val shard")
    p.add_argument("--split-key", metavar="KEY",
                   help='route each .jsonl/.parquet row by its field KEY, "val" or "train" (instead of --val-docs)')
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
    if args.split_key is not None and args.val_docs is not None:
        parser.error("--split-key and --val-docs both choose the val documents; give one of them")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with SIGINT ignored
        signal.signal(signal.SIGINT, _raise_interrupt)
    empty = []
    try:
        written = tokenize_to_shards(args.inputs, args.output_dir, args.prefix, args.shard_size, args.val_docs,
                                     parse_filters(args.filter), args.workers, args.overwrite,
                                     split_key=args.split_key, empty=empty)
    except (TokenizeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: no shard written, temporary files removed, {args.output_dir} as it was",
              file=sys.stderr)
        return 130
    for path, n_tokens, n_docs in written:
        print(f"wrote {path}: {n_tokens:,} tokens, {n_docs:,} document starts")
    if empty:
        print(f"note: {len(empty):,} document(s) with no text (empty or only whitespace), written as they are: "
              f"{', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}")
    if args.val_docs not in (None, 0) and not any(
            os.path.basename(p).startswith(f"{args.prefix}_train_") for p, _, _ in written):
        print(f"note: --val-docs {args.val_docs} covers every document; all went to the val shard, no train shard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
