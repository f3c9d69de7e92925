"""Cost of the shard checks at record scale: the trainer's start-up scan and data/check_shards.py's full check.

    python bench/shard_checks.py                 # 2 synthetic 100M-token shards in /tmp, deleted after
    python bench/shard_checks.py --shards 1 --tokens 10000000 --dir /big/disk

Record #89's runs read up to 14 train shards of 100M tokens (1.4B tokens, 2.8 GB). This writes ``--shards``
synthetic shards of ``--tokens`` tokens (GPT-2 ids; documents with lognormal lengths, mean ~1,000 tokens like
FineWeb's, the longest tens of thousands) and times, per shard: ``trainer`` (``harness.TokenStream``: what
train_gpt.py checks before step 0, the header and size, then the largest id per 16M tokens) and ``check_shard``
(data/shard_format.py, as data/check_shards.py and the downloader's check run it: header, then one chunked pass for
the max id and the <|endoftext|> gaps, then the run scan inside the EOT-free spans of ``CORRUPT_RUN`` tokens or
more), each from the page cache (the best of ``--repeats``) and once after dropping the file from the page cache
(``posix_fadvise DONTNEED``: a read at disk speed). It prints the per-shard times and the total for 14 shards. The
files are deleted at the end, also on error or Ctrl-C.
"""
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import _paths  # noqa: E402,F401  (data/ on the path)
import harness  # noqa: E402
from shard_format import EOT_TOKEN, check_shard, write_shard  # noqa: E402

RECORD_SHARDS = 14  # train shards of 100M tokens: the most a record #89 run reads


def synthetic_tokens(n, seed):
    """``n`` uint16 GPT-2 ids: documents of lognormal length (median 600, mean ~1,000 tokens), each
    starting with <|endoftext|>, the other ids uniform in 0..50255."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOT_TOKEN, n, dtype=np.uint16)
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, n // 300).astype(np.int64))
    starts = np.cumsum(lengths) - lengths
    tokens[starts[starts < n]] = EOT_TOKEN
    return tokens


def drop_from_cache(path):
    """Ask the kernel to forget the file's cached pages, so that the next read comes from disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn, path, repeats):
    """(seconds from disk, best seconds from the page cache) of ``fn(path)``."""
    drop_from_cache(path)
    t0 = time.perf_counter()
    fn(path)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(path)
        warm.append(time.perf_counter() - t0)
    return cold, min(warm)


def main(argv=None):
    p = harness._Parser(prog="shard_checks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="synthetic shards to write and check")
    p.add_argument("--tokens", type=int, default=100_000_000, help="tokens per shard (the record's: 100M)")
    p.add_argument("--repeats", type=int, default=3, help="page-cache timings per check (the best is kept)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the shards are written (then deleted)")
    args = p.parse_args(argv)
    if args.shards < 1 or args.tokens < 1 or args.repeats < 1:
        p.error("--shards, --tokens and --repeats must be >= 1")
    if not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir!r}: not a folder; give one with room for {args.shards} x {2 * args.tokens:,} bytes")
    paths = [os.path.join(args.dir, f"bench_shard_checks_{os.getpid()}_{i}.bin") for i in range(args.shards)]
    checks = {"trainer": lambda path: harness.TokenStream([path]), "check_shard": check_shard}
    rows = {name: [] for name in checks}
    try:
        for i, path in enumerate(paths):
            write_shard(path, synthetic_tokens(args.tokens, seed=i))
            for name, fn in checks.items():
                rows[name].append(timed(fn, path, args.repeats))
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
    scale = RECORD_SHARDS * 100_000_000 / args.tokens
    print(f"{args.shards} shard(s) of {args.tokens:,} tokens; seconds per shard (disk / page cache) and for "
          f"the record's {RECORD_SHARDS} x 100M-token train shards")
    for name, times in rows.items():
        cold, warm = np.mean([t[0] for t in times]), np.mean([t[1] for t in times])
        print(f"{name:<13} {cold:6.3f} / {warm:6.3f} s per shard   {RECORD_SHARDS} shards: "
              f"{cold * scale:5.1f} s from disk, {warm * scale:5.1f} s from the page cache")


if __name__ == "__main__":
    main()
