"""Validate token shards: ``python data/check_shards.py GLOB...``.

Prints file, tokens, documents (count of token 50256), max_id (the largest token id) and ok or
why not for each shard. A shard is bad when its header or size is wrong (see shard_format.py), it
holds a token id above 50256 (not GPT-2 BPE ids), or a run of 8,192 or more copies of one id other
than <|endoftext|> (a zero-filled or single-id stretch: a partial download or write that kept its
size; ``shard_format.CORRUPT_RUN``). ``python data/tokenize_text.py --check``
does the same. Exit status 1 if any shard is bad, a glob matches nothing or no shard holds an
<|endoftext|> (the trainer needs documents), 2 on bad arguments.
"""
import argparse
import glob
import os
import sys

from shard_format import GPT2_MAX_ID, ShardError, read_tokens, scan_tokens, token_problem


def shard_row(path):
    """``(path, tokens, documents, max_id, status)`` strings for one shard, and whether it is bad."""
    try:
        tokens = read_tokens(path)
    except ShardError as e:
        return (path, "-", "-", "-", str(e)), True
    if len(tokens) == 0:
        return (path, "0", "0", "-", "ok"), False
    docs, max_id, run = scan_tokens(tokens)
    why = token_problem(max_id, run, tokens)
    return (path, f"{len(tokens):,}", f"{docs:,}", str(max_id), why or "ok"), why is not None


def check_shards(patterns, out=sys.stdout):
    """Print a table (file, tokens, documents, max_id, ok or why not) for each shard of the globs.

    ``documents`` counts token 50256; ``max_id`` is the largest token id ("-" for an empty
    shard). Returns the number of problems: bad shards plus globs that match nothing.
    """
    rows, problems = [], 0
    for pattern in patterns:
        files = sorted(glob.glob(os.path.expanduser(pattern)))
        if not files:
            rows.append((pattern, "-", "-", "-", "no file matches"))
            problems += 1
        for path in files:
            row, bad = shard_row(path)
            rows.append(row)
            problems += bad
    header = ("file", "tokens", "documents", "max_id", "status")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}",
              file=out)
    read = [r for r in rows if r[4] == "ok"]
    if read and all(r[2] == "0" for r in read):  # the trainer's stream needs a document start
        print(f"no <|endoftext|> (id {GPT2_MAX_ID}) in any of these shards: train_gpt.py refuses them "
              f"(each document starts with one); re-tokenize with data/tokenize_text.py", file=out)
        problems += 1
    return problems


def main(argv=None):
    """Check the shards matching the globs in ``argv``; returns the exit status."""
    p = argparse.ArgumentParser(description="Validate token shards (header, size, token ids <= 50256, no "
                                            "zero-filled or single-id stretch) and "
                                            "count tokens and documents; same as `python data/tokenize_text.py "
                                            "--check`.")
    p.add_argument("globs", nargs="+", metavar="GLOB", help="shard files or globs (quote them)")
    return 1 if check_shards(p.parse_args(argv).globs) else 0


if __name__ == "__main__":
    sys.exit(main())
