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
