"""A copy of the trainer that knows the tests' tiny model, for runs whose log must re-run by itself.

A log snapshots the code that ran; ``records/verify.py --rerun`` runs that snapshot in a fresh process. The tiny
spec (conftest.TINY) reaches the trainer only where the tests pass it (``train_gpt.main(argv, models=conftest.SPECS)``
in their own processes), so a log of a tiny run re-runs only if its snapshot holds the spec itself: ``trainer_copy``
writes the trainer's files into a folder with one line added to its train_gpt.py that puts it in its ``MODELS``.
"""
import os
import shutil

import harness
from conftest import REPO, TINY

REGISTER = f'MODELS["tiny"] = {TINY!r}  # the tests\' model (tests/conftest.py)\n'


def trainer_copy(tree):
    """Write harness.SOURCE_FILES into ``tree`` (made if missing), train_gpt.py registering ``MODELS["tiny"]``
    before its main guard, and GPT-2's encoder.json under data/gpt2_bpe; returns ``tree``."""
    os.makedirs(tree, exist_ok=True)
    for name in harness.SOURCE_FILES:
        os.makedirs(os.path.dirname(os.path.join(tree, name)), exist_ok=True)  # data/shard_format.py
        shutil.copyfile(os.path.join(REPO, name), os.path.join(tree, name))
    path = os.path.join(tree, "train_gpt.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    guard = '\nif __name__ == "__main__":'
    assert text.count(guard) == 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(guard, "\n" + REGISTER + guard))
    shutil.copytree(os.path.join(REPO, "data", "gpt2_bpe"), os.path.join(tree, "data", "gpt2_bpe"), dirs_exist_ok=True)
    return tree
