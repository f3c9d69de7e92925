"""Validate token shards: ``python data/check_shards.py GLOB...``.

Same as ``python data/tokenize.py --check GLOB...`` (the primary form): prints file, tokens,
documents (count of token 50256), max_id (the largest token id) and ok or why not. A shard is bad
when its header or size is wrong or it holds a token id above 50256 (not GPT-2 BPE ids). Exit
status 1 if any shard is bad or a glob matches nothing.
"""
import argparse
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# data/tokenize.py would shadow the stdlib `tokenize` while data/ is on sys.path; load it by path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_spec = importlib.util.spec_from_file_location("data_tokenize", os.path.join(_HERE, "tokenize.py"))
_tokenize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tokenize)


def main(argv=None):
    """Check the shards matching the globs in ``argv``; returns the exit status."""
    p = argparse.ArgumentParser(description="Validate token shards (header, size, token ids <= 50256) and "
                                            "count tokens and documents; same as `python data/tokenize.py "
                                            "--check`.")
    p.add_argument("globs", nargs="+", metavar="GLOB", help="shard files or globs (quote them)")
    return 1 if _tokenize.check_shards(p.parse_args(argv).globs) else 0


if __name__ == "__main__":
    sys.exit(main())
