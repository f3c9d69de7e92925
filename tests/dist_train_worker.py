"""train_gpt.main(argv) with --model able to name the tests' tiny model (conftest.SPECS): ``torchrun ...
dist_train_worker.py FLAGS`` or ``python dist_train_worker.py FLAGS`` runs what ``train_gpt.py FLAGS`` would,
``--model tiny`` included."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (this script's folder, tests/, is on the path; the tiny model's spec)
import train_gpt  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_gpt.main(sys.argv[1:], models=conftest.SPECS))
