"""The token shard format, as the data tools read and write it (no torch needed).

A shard is a 256 x int32 little-endian header, ``[0]`` magic 20240520, ``[1]`` version 1,
``[2]`` number of tokens, the rest zero; then the tokens as little-endian uint16. The file is
exactly ``1024 + 2 * n_tokens`` bytes. This is the format of llm.c and modded-nanogpt, so their
shards work unchanged. It is the one reader: the data tools and the trainer (``harness.TokenStream``,
which snapshots this file in every run log) check shards here.

Beyond the header, ``check_shard_tokens`` (and ``check_shard``, which reads the file) refuses
tokens that no GPT-2 shard can hold: an id above 50256 (another tokenizer's ids) and a run of
``CORRUPT_RUN`` or more copies of one id other than ``<|endoftext|>`` (a zero-filled or
single-id stretch: a partial download or write that kept the file's size). Real text never has
such a run: the longest in data/sample and in a 1M-token Wikipedia + novels corpus is 25 tokens
(spaces), while documents there reach ~20k tokens; FineWeb's documents average ~1,000 tokens and
its repetition filters drop pages made of one repeated string. The scan reads the tokens once, in
chunks of ``SCAN_CHUNK`` (bounded memory on a memmapped 100M-token shard), and looks for runs only
inside the rare spans of ``CORRUPT_RUN`` tokens or more without ``<|endoftext|>``.
"""
import json
import os
import stat

import numpy as np

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document; also the largest GPT-2 id
GPT2_MAX_ID = EOT_TOKEN  # <|endoftext|> is the last of the 50257 GPT-2 tokens
REDO = "re-download or re-tokenize it (data/cached_fineweb10B.py, data/tokenize_text.py)"
CORRUPT_RUN = 8192  # tokens (16 KiB) of one repeated id, not <|endoftext|>: a zero-filled or lost stretch
SCAN_CHUNK = 1 << 22  # tokens read per step of a scan (8 MiB of uint16)


class ShardError(ValueError):
    """A file that is not a valid shard; the message names the file and the fix."""


GPT2_ENCODER_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_bpe", "encoder.json")


def gpt2_token_bytes(path=GPT2_ENCODER_JSON):
    """``{id: bytes}`` of GPT-2's ordinary tokens, from its encoder.json (no network): GPT-2 writes
    each byte as one printable character, the printable bytes as themselves, the other 68 bytes as
    chr(256 + i) in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    char_to_byte = {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}
    try:
        with open(path, encoding="utf-8") as f:
            encoder = json.load(f)
        return {i: bytes(char_to_byte[c] for c in s) for s, i in encoder.items() if s != "<|endoftext|>"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: cannot read GPT-2's encoder.json ({type(e).__name__}: {e}); "
                         f"restore it from the repository (git checkout -- data/gpt2_bpe)") from None


def not_a_file(path):
    """None for a regular file (or a link to one), else what ``path`` is: "a folder", "a FIFO
    (named pipe)", "a device", "a socket". Reading a FIFO or a device would block or never end,
    so the data tools refuse them before opening. A missing path is the caller's ``OSError``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


def read_header(path):
    """Validate a shard's header and size; return its number of tokens (int >= 0).

    Raises:
        ShardError: missing or unreadable file, shorter than the header, wrong magic or
            version, a negative token count, a size other than ``1024 + 2 * n_tokens``, or a
            path that is not a regular file (a folder, FIFO or device: refused without reading).
    """
    kind = not_a_file(path)
    if kind:
        raise ShardError(f"{path}: is {kind}, not a shard file; pass shard files (*.bin), or {REDO}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        header = np.frombuffer(raw[:len(raw) // 4 * 4], dtype="<i4")  # a short file: its whole ints
    except OSError as e:  # missing, a folder, unreadable
        raise ShardError(f"{path}: cannot read shard ({e.strerror}); check the path, or {REDO}") from None
    if header.size < HEADER_INTS:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; {REDO}")
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}); not a token shard, {REDO}")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION}); {REDO}")
    n = int(header[2])
    if n < 0 or size != HEADER_BYTES + 2 * n:
        raise ShardError(f"{path}: file is {size} bytes but its header says {n} tokens "
                         f"({HEADER_BYTES + 2 * n} bytes); truncated or corrupt, {REDO}")
    return n


def read_tokens(path):
    """The tokens of a validated shard: read-only uint16 array, shape (n_tokens,). Raises ShardError."""
    n = read_header(path)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


def write_shard(path, tokens):
    """Write the header and uint16 ``tokens`` (shape (n,), ids 0..65535) to ``path``."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def max_token_id(tokens, chunk=SCAN_CHUNK):
    """The largest id of ``tokens`` (uint16 array or memmap, shape (n,)), read ``chunk`` tokens at a
    time; -1 when empty. An id above ``GPT2_MAX_ID`` means the shard was made with another tokenizer."""
    top = -1
    for start in range(0, len(tokens), chunk):
        top = max(top, int(np.asarray(tokens[start:start + chunk]).max()))
    return top


def _eot_free_spans(tokens, min_len, chunk):
    """``(n_eot, max_id, spans)`` of ``tokens``: the count of EOT_TOKEN, the largest id (-1 when
    empty), and the ``(start, stop)`` index ranges of at least ``min_len`` tokens holding no
    EOT_TOKEN, in order. One pass in chunks; the spans are few on real text."""
    n_eot, top, last, spans = 0, -1, -1, []  # last: index of the previous EOT_TOKEN (-1: before the start)
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start:start + chunk])
        top = max(top, int(block.max()))  # max_token_id's job, done here too so the file is read once
        eots = np.flatnonzero(block == EOT_TOKEN) + start
        n_eot += len(eots)
        bounds = np.concatenate(([last], eots))
        for i in np.flatnonzero(np.diff(bounds) - 1 >= min_len):  # few: documents of min_len tokens or more
            spans.append((int(bounds[i]) + 1, int(bounds[i + 1])))
        last = int(bounds[-1])
    if len(tokens) - last - 1 >= min_len:
        spans.append((last + 1, len(tokens)))
    return n_eot, top, spans


def longest_run(tokens, chunk=SCAN_CHUNK):
    """``(length, start, token_id)`` of the longest run of one repeated id in ``tokens`` (the first
    such run on ties; ``(0, 0, -1)`` when empty), read ``chunk`` tokens at a time."""
    best, run_start, prev = (0, 0, -1), 0, None
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start:start + chunk])
        cuts = np.flatnonzero(block[1:] != block[:-1]) + 1 + start  # where a new run begins
        if prev is not None and block[0] != prev:
            cuts = np.concatenate(([start], cuts))
        starts = np.concatenate(([run_start], cuts))
        lengths = np.diff(np.concatenate((starts, [start + len(block)])))
        i = int(lengths.argmax())
        if lengths[i] > best[0]:
            best = (int(lengths[i]), int(starts[i]), int(tokens[starts[i]]))
        run_start, prev = int(starts[-1]), block[-1]
    return best


def scan_tokens(tokens, chunk=SCAN_CHUNK):
    """``(n_documents, max_id, (length, start, token_id))`` of a shard's ``tokens``: the count of
    EOT_TOKEN, the largest id (-1 when empty) and the longest run of one id other than EOT_TOKEN
    among runs of at least ``CORRUPT_RUN`` tokens (``(0, 0, -1)`` when there is none)."""
    n_eot, top, spans = _eot_free_spans(tokens, CORRUPT_RUN, chunk)
    best = (0, 0, -1)
    for a, b in spans:  # an EOT-free span: every run inside is of an id other than EOT_TOKEN
        length, start, token = longest_run(tokens[a:b], chunk)
        if length >= CORRUPT_RUN and length > best[0]:
            best = (length, a + start, token)
    return n_eot, top, best


def first_above(tokens, limit, chunk=SCAN_CHUNK):
    """Index of the first id above ``limit`` in ``tokens`` (read ``chunk`` at a time), or None."""
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start:start + chunk])
        if block.max() > limit:
            return start + int(np.argmax(block > limit))
    return None


def token_problem(max_id, run, tokens=None):
    """Why a shard's tokens are bad, from ``scan_tokens``'s ``max_id`` and ``run``; None when they are fine. Given
    ``tokens``, an id above 50256 is named at its first position (a second pass, only for a bad shard)."""
    if max_id > GPT2_MAX_ID:
        at = "" if tokens is None else f" (the first at token {first_above(tokens, GPT2_MAX_ID):,})"
        return (f"token id {max_id} > {GPT2_MAX_ID}{at}: not GPT-2 BPE ids; re-tokenize with "
                f"data/tokenize_text.py")
    length, start, token = run
    if length:
        what = "zero-filled" if token == 0 else f"one id ({token}) repeated"
        return (f"{length:,} tokens from token {start:,} are {what}, with no <|endoftext|>: a partial "
                f"download or write that kept its size; {REDO}")
    return None


def check_shard_tokens(path, tokens, chunk=SCAN_CHUNK):
    """Refuse the tokens of shard ``path`` (uint16 array or memmap, shape (n,)) that no GPT-2 shard holds.

    Args:
        path: the shard's file name, for the message.
        tokens: its tokens, e.g. ``read_tokens(path)``; read ``chunk`` at a time.
        chunk: tokens per step of the scan (memory bound).
    Raises:
        ShardError: an id above 50256, or a run of ``CORRUPT_RUN`` or more copies of one id other
            than <|endoftext|> (zero-filled or single-id stretch); the message names the file and the fix.
    """
    _, top, run = scan_tokens(tokens, chunk)
    why = token_problem(top, run, tokens)
    if why:
        raise ShardError(f"{path}: {why}")


def check_shard(path):
    """Validate a shard's header, size and tokens (``read_header`` then ``check_shard_tokens``);
    return its number of tokens. Raises ShardError naming the file and the fix."""
    tokens = read_tokens(path)
    check_shard_tokens(path, tokens)
    return len(tokens)
