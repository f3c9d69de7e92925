"""Where the tools find the repository, defined once (the tests use tests/conftest.py).

A tool in bench/ or records/ runs with only its own folder on ``sys.path``; its set-up is the line

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

and, when it needs more than the root's modules, ``import _paths``: that puts data/ on the path too
(its tools import each other by name, as ``python data/X.py`` runs them) and names the folders.
"""
import os
import sys

REPO = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(REPO, "data")
RECORDS = os.path.join(REPO, "records")
BENCH = os.path.join(REPO, "bench")


def use(*folders):
    """Put ``folders`` first on ``sys.path`` (the first named first), each once.

    Args:
        folders: absolute paths, e.g. ``RECORDS`` to import records/compare.py as ``compare``.
    """
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)


use(REPO, DATA)


def glue_option(argv, flag):
    """``[flag, value]`` as ``flag=value``, so argparse takes a value that starts with '-'.

    Args:
        argv: the command line's words (``sys.argv[1:]`` when None).
        flag: an option whose value is a quoted list of other flags, e.g. ``--trainer-args``.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    for i, word in enumerate(words[:-1]):
        if word == flag:
            words[i:i + 2] = [f"{flag}={words[i + 1]}"]
            break
    return words
