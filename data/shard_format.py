"""The token shard format, as the data tools read and write it (no torch needed).

A shard is a 256 x int32 little-endian header, ``[0]`` magic 20240520, ``[1]`` version 1,
``[2]`` number of tokens, the rest zero; then the tokens as little-endian uint16. The file is
exactly ``1024 + 2 * n_tokens`` bytes. This is the format of llm.c and modded-nanogpt, so their
shards work unchanged. ``train_gpt.read_shard_header`` checks the same rules on the trainer's
side; tests/test_data_tools.py proves both sides accept and refuse the same files.
"""
import os
import stat

import numpy as np

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
EOT_TOKEN = 50256  # GPT-2 <|endoftext|>, placed before every document; also the largest GPT-2 id
REDO = "re-download or re-tokenize it (data/cached_fineweb10B.py, data/tokenize_text.py)"


class ShardError(ValueError):
    """A file that is not a valid shard; the message names the file and the fix."""


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
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
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
