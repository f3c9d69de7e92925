"""train_gpt.main under torchrun, with rank 1's loader failing at its third batch (a bad shard)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402  (the tiny model's spec)
import train_gpt  # noqa: E402

if os.environ.get("RANK") == "1":
    real_next_batch = train_gpt.PackedLoader.next_batch
    calls = []

    def failing_next_batch(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise train_gpt.DataError("fake_train_000002.bin: injected read failure; re-download it")
        return real_next_batch(self, *args)
    train_gpt.PackedLoader.next_batch = failing_next_batch

sys.exit(train_gpt.main(sys.argv[1:], models=conftest.SPECS))
