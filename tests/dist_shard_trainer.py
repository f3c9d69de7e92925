"""train_gpt.main with --model able to name the tests' tiny model (conftest.SPECS), for torchrun or a plain
subprocess."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (this folder is the script's: on the path; the tiny model's spec)
import train_gpt  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_gpt.main(sys.argv[1:], models=conftest.SPECS))
