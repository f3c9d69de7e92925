"""Download GPT-2-token FineWeb-10B shards from the Hugging Face Hub.

    python data/cached_fineweb10B.py            # val shard + all 103 train shards (~20.8 GB)
    python data/cached_fineweb10B.py 8          # val shard + the first 8 train shards (~1.8 GB)
    python data/cached_fineweb10B.py 8 --local-dir /big/disk/fineweb10B

Files come from the dataset repo ``kjj0/fineweb10B-gpt2``: ``fineweb_val_000000.bin`` and
``fineweb_train_000001.bin`` ... ``fineweb_train_000103.bin`` (100M tokens, ~200 MB each), into
``data/fineweb10B/`` (next to this script, whatever the cwd) unless ``--local-dir`` is given.

A file already there and valid (header, size and tokens, checked by ``shard_format.check_shard``:
no id above 50256, no zero-filled or single-id stretch left by a partial download that kept the
file's size) is skipped; an invalid one is reported and downloaded again. The check reads each
file once (well under a second per 100M-token shard from the page cache, at disk speed otherwise).
Each download lands in a hidden staging folder (``<dir>/.download/``, where the Hub also keeps its
``.incomplete`` partial files), is validated there, and only then moved under its final name
(``os.replace``), so an interrupted or corrupt download never appears as a ``.bin`` that the
trainer's globs would pick up. An invalid file already there is left as it is until its validated
replacement takes its name: when the Hub cannot be reached (checked first, only if something needs
downloading) or the download fails, nothing in the folder changes.

Exit status: 0 when every requested shard is present and valid, 1 otherwise (Hub unreachable,
Hub error, invalid download), 2 on bad arguments. Errors are one message, no traceback.
"""
import argparse
import os
import shutil
import sys
import threading

from huggingface_hub import constants as hub_constants
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from tqdm import tqdm

from shard_format import ShardError, check_shard

REPO_ID = "kjj0/fineweb10B-gpt2"
REPO_TYPE = "dataset"
NUM_TRAIN_SHARDS = 103
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B")
STAGING = ".download"
# Upper bound on the reachability check. The Hub's own HEAD retries with backoff (~23 s when DNS
# fails at once, longer when DNS or connect hangs), so one un-retried HEAD runs in a daemon thread
# and is abandoned after this many seconds: offline, the script fails well within 30 s.
PROBE_DEADLINE_S = 15.0

OFFLINE_HELP = (
    "Nothing partial was left under a .bin name. To train without the Hub, point the trainer at "
    "shards on disk instead:\n"
    "  DATA_DIR=/path/to/shards bash run.sh\n"
    "  python train_gpt.py --train-files '/path/to/shards/*_train_*.bin' "
    "--val-files '/path/to/shards/*_val_*.bin'\n"
    "(copy fineweb_*.bin shards from a machine with network, or make shards from your own text "
    "with data/tokenize_text.py; see data/README.md)")


class HubUnreachable(Exception):
    """The Hub cannot be reached (no network, DNS failure, timeout, HF_HUB_OFFLINE=1)."""


def shard_names(n_train):
    """File names to fetch: the val shard, then train shards 1..n_train (1-based, like the repo)."""
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def shard_status(path):
    """None when ``path`` is a valid shard, else why not (the ShardError message, or 'missing')."""
    if not os.path.exists(path):
        return "missing"
    try:
        check_shard(path)
    except ShardError as e:
        return str(e)
    return None


def _is_network_error(err):
    """True for errors meaning "could not talk to the Hub" rather than "the Hub said no"."""
    if isinstance(err, HfHubHTTPError):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, LocalEntryNotFoundError)):
        return True  # includes OfflineModeIsEnabled, a ConnectionError
    # Transport errors of the Hub's HTTP client (httpx/httpx2/requests/urllib3, by version).
    return any(c.__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "socket")
               for c in type(err).__mro__)


def _one_line(err):
    """``Type: first line of message`` for error reports."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_hub_reachable(filename, deadline_s=PROBE_DEADLINE_S):
    """One HEAD request for ``filename`` without retries, bounded by ``deadline_s`` seconds.

    Raises:
        HubUnreachable: no answer (network error, timeout, offline mode).
        HfHubHTTPError: the Hub answered with an error (missing repo/file, auth, ...).
    """
    url = hf_hub_url(REPO_ID, filename, repo_type=REPO_TYPE)
    outcome = {}

    def probe():
        try:
            get_hf_file_metadata(url, timeout=min(hub_constants.HF_HUB_ETAG_TIMEOUT, deadline_s))
        except Exception as e:  # handed to the caller below
            outcome["error"] = e

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise HubUnreachable(f"no answer from {hub_constants.ENDPOINT} within {deadline_s:.0f} s")
    err = outcome.get("error")
    if err is None:
        return
    if _is_network_error(err):
        raise HubUnreachable(_one_line(err)) from None
    raise err


def download_one(filename, local_dir):
    """Download ``filename`` via the staging folder, validate it, move it to ``local_dir``.

    The move (``os.replace``) is the only change under the final name: it replaces an invalid
    file of that name only with a validated download. Returns the final path. Raises
    ``ShardError`` (invalid download, already deleted; the final name is untouched), or whatever
    ``hf_hub_download`` raises.
    """
    staging = os.path.join(local_dir, STAGING)
    staged = hf_hub_download(REPO_ID, filename, repo_type=REPO_TYPE, local_dir=staging)
    try:
        check_shard(staged)
    except ShardError:
        os.remove(staged)
        raise
    final = os.path.join(local_dir, filename)
    os.replace(staged, final)
    return final


def download(n_train=NUM_TRAIN_SHARDS, local_dir=DEFAULT_DIR, log=print):
    """Make ``local_dir`` hold the val shard and the first ``n_train`` train shards, all valid.

    Returns the number of problems (0 on success); each is reported through ``log``.
    Raises ``HubUnreachable`` when a download is needed and the Hub cannot be reached; the Hub is
    checked before anything is written, and an invalid file already there is only ever replaced
    by a validated download (never deleted first).
    """
    names = shard_names(n_train)
    todo = []
    for name in names:
        why = shard_status(os.path.join(local_dir, name))
        if why is None:
            continue
        if why != "missing":
            log(f"invalid, to be replaced by a fresh download: {why}")
        todo.append(name)
    log(f"{len(names) - len(todo)} of {len(names)} shards already present and valid in {local_dir}")
    if not todo:
        return 0

    check_hub_reachable(todo[0])
    os.makedirs(local_dir, exist_ok=True)
    problems = 0
    with tqdm(total=len(names), initial=len(names) - len(todo), unit="shard", desc="fineweb10B") as bar:
        for name in todo:
            try:
                download_one(name, local_dir)
            except ShardError as e:
                problems += 1
                tqdm.write(f"invalid download, deleted: {e}")  # an invalid file already there stays
            except Exception as e:
                if _is_network_error(e):
                    raise HubUnreachable(f"while downloading {name}: {_one_line(e)}") from None
                problems += 1
                tqdm.write(f"download of {REPO_ID}/{name} failed: {_one_line(e)}")
            bar.update(1)
    if problems == 0:
        shutil.rmtree(os.path.join(local_dir, STAGING), ignore_errors=True)
    return problems


def build_parser():
    """argparse parser: ``[N] [--local-dir DIR]``."""
    p = argparse.ArgumentParser(
        description=f"Download the FineWeb-10B GPT-2 token shards of the Hub dataset {REPO_ID} "
                    "(val shard + the first N train shards, 100M tokens / ~200 MB each).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("n_train", nargs="?", type=int, default=NUM_TRAIN_SHARDS, metavar="N",
                   help=f"number of train shards, 0..{NUM_TRAIN_SHARDS}")
    p.add_argument("--local-dir", default=DEFAULT_DIR, help="where the shards go")
    return p


def main(argv=None):
    """CLI entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.n_train <= NUM_TRAIN_SHARDS:
        parser.error(f"N must be between 0 and {NUM_TRAIN_SHARDS}, got {args.n_train}")
    try:
        problems = download(args.n_train, os.path.abspath(args.local_dir))
    except HubUnreachable as e:
        print(f"error: cannot reach the Hugging Face Hub ({hub_constants.ENDPOINT}) to download "
              f"{REPO_ID}: {e}\n{OFFLINE_HELP}", file=sys.stderr)
        return 1
    except HfHubHTTPError as e:
        print(f"error: the Hugging Face Hub ({hub_constants.ENDPOINT}) refused {REPO_ID}: {_one_line(e)}\n"
              f"Check that the dataset still exists and, if it needs one, your HF_TOKEN.\n{OFFLINE_HELP}",
              file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if problems:
        print(f"error: {problems} shard(s) could not be downloaded (see above); run again to retry",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
