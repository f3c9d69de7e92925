#!/usr/bin/env bash
# The one command. With GPUs: baseline_h200 (record #89 as modded-nanogpt HEAD runs it) on all of them (torchrun):
# the small-scale study of 2026-12-03 found our methods (record_h200: TST + Aurora) no better at 3x its steps
# (README, "Results at small scale"), so they are one flag away: bash run.sh --preset record_h200.
# Without a GPU: the CPU smoke preset (record_h200's recipe at a tiny shape: every code path, TST's switch too).
#   bash run.sh                            # shards from $DATA_DIR; unset: data/fineweb10B with a GPU (downloaded
#                                          # if missing), the repository's sample data/sample without one
#   DATA_DIR=data/mytext bash run.sh       # any folder of *_train_*.bin / *_val_*.bin shards
#   bash run.sh --seed 3                   # extra arguments go to train_gpt.py
#   NPROC=2 bash run.sh --batch-tokens 4608  # that many processes under torchrun (gloo on CPU, for tests); on CPU
#                                          # cpu_smoke's stage 1 has 1 sequence: 2 need --batch-tokens 2 x 3 x 768
# Exit status as the trainer's: 0 only for a completed run (or one stopped by --max-steps), 2 for a refusal
# (a flag, the data, a run already going), 130 for SIGINT/SIGTERM; the log path is printed at the end.
# Under torchrun, a signal gives every rank SHUTDOWN_TIMEOUT seconds (default 120) to finish its step, write
# the checkpoint (--save-on-interrupt) and close the log before torchrun kills it.
set -euo pipefail
if [ -n "${DATA_DIR:-}" ] && [[ "$DATA_DIR" != /* ]]; then  # relative to where run.sh was started
    if [ -d "$DATA_DIR" ]; then DATA_DIR=$(cd "$DATA_DIR" && pwd); else DATA_DIR="$PWD/$DATA_DIR"; fi
fi
cd "$(dirname "$0")"
if [ -z "${PYTHON:-}" ]; then  # a venv's python, else python3 (stock Debian/Ubuntu have no plain python)
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi

if ! "$PYTHON" -c "import torch, numpy" 2>/dev/null; then
    echo "run.sh: torch/numpy not importable by '$PYTHON'; install first: pip install -r requirements.txt" >&2
    exit 2
fi

# GPUs torch can use (respects CUDA_VISIBLE_DEVICES).
n_gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$n_gpus" -eq 0 ]; then
    preset=cpu_smoke; nproc=0
else
    # every step's 8 packed sequences (16,384 -> 32,768 -> 49,152 positions each) split evenly over 1, 2, 4 or 8 processes
    nproc=1
    while [ $((nproc * 2)) -le "$n_gpus" ] && [ $((nproc * 2)) -le 8 ]; do nproc=$((nproc * 2)); done
    if [ "$nproc" -ne "$n_gpus" ]; then
        echo "run.sh: note: $n_gpus GPUs found; using $nproc so the global batch splits evenly" >&2
    fi
    preset=baseline_h200  # the same run on 1, 2, 4 or 8 GPUs (a fixed global batch)
fi
if [ -n "${NPROC:-}" ]; then
    if ! [[ "$NPROC" =~ ^[1-9][0-9]{0,3}$ ]]; then  # at most 4 digits: bash's integer tests stay in range
        echo "run.sh: NPROC=$NPROC: give a process count from 1 to 9999 (1, 2, 4, 8)" >&2
        exit 2
    fi
    nproc=$NPROC
fi
sample_note=""
# a DATA_DIR that is a file, or (without a GPU, where nothing is downloaded) a missing folder: one line
what=""
if [ -n "${DATA_DIR:-}" ] && [ -e "$DATA_DIR" ] && [ ! -d "$DATA_DIR" ]; then
    what="is not a folder"
elif [ -n "${DATA_DIR:-}" ] && [ ! -e "$DATA_DIR" ] && [ "$n_gpus" -eq 0 ]; then
    what="does not exist"
fi
if [ -n "$what" ]; then
    echo "run.sh: DATA_DIR=$DATA_DIR $what; point it at a folder of *_train_*.bin / *_val_*.bin shards$([ "$n_gpus" -eq 0 ] \
        && echo " or unset it for the repository's sample" || echo " (a missing or empty one gets FineWeb downloaded into it)")" >&2
    exit 2
fi
if [ -z "${DATA_DIR:-}" ]; then
    if [ "$n_gpus" -eq 0 ]; then
        DATA_DIR=data/sample
        sample_note=" (the repository's Wikipedia sample: no GPU and DATA_DIR not set)"
    else
        DATA_DIR=data/fineweb10B
    fi
fi

shopt -s nullglob
train_shards=("$DATA_DIR"/*_train_*.bin)
val_shards=("$DATA_DIR"/*_val_*.bin)
if [ ${#train_shards[@]} -eq 0 ] && [ ${#val_shards[@]} -eq 0 ] && [ "$n_gpus" -eq 0 ]; then
    # the CPU preset trains on the shards it is given: no download behind the user's back
    echo "run.sh: no *_train_*.bin / *_val_*.bin shards in $DATA_DIR; add some (python data/cached_fineweb10B.py 1" \
         "--local-dir '$DATA_DIR' downloads FineWeb's; data/tokenize_text.py makes them from text) or unset DATA_DIR" \
         "for the repository's sample" >&2
    exit 2
elif [ ${#train_shards[@]} -eq 0 ] && [ ${#val_shards[@]} -eq 0 ]; then
    # the train shards the run reads (0 for --help and --describe, which the trainer answers without data)
    need=$("$PYTHON" - "$preset" "$@" <<'PY'
import sys
import train_gpt as T
argv = ["--preset", sys.argv[1]] + sys.argv[2:]
if any(a in ("-h", "--help", "--describe") for a in argv):
    sys.exit(print(0))
try:
    cfg, _ = T.parse_config(argv)
except T.ConfigError as e:
    print(f"train_gpt.py: error: {e}", file=sys.stderr)
    sys.exit(2)
print(-(-T.train_tokens_needed(cfg) // 100_000_000))  # FineWeb shards hold 100M tokens
PY
) || exit $?
    if [ "$need" -gt 0 ]; then
        echo "run.sh: no shards in $DATA_DIR; downloading FineWeb val + $need train shard(s)" >&2
        "$PYTHON" data/cached_fineweb10B.py "$need" --local-dir "$DATA_DIR"
    fi
elif [ ${#train_shards[@]} -eq 0 ] || [ ${#val_shards[@]} -eq 0 ]; then
    missing=$([ ${#train_shards[@]} -eq 0 ] && echo "*_train_*.bin" || echo "*_val_*.bin")
    echo "run.sh: $DATA_DIR has no $missing shard; add it (data/cached_fineweb10B.py, data/tokenize_text.py) or point DATA_DIR elsewhere" >&2
    exit 2
fi

# the trainer takes globs: escape glob characters in the folder name itself
data_glob=$(printf '%s' "$DATA_DIR" | sed 's/[][*?]/[&]/g')
args=(--preset "$preset" --train-files "$data_glob/*_train_*.bin" --val-files "$data_glob/*_val_*.bin" "$@")
# where the trainer writes its log: the last --log-dir DIR or --log-dir=DIR among the arguments (the trainer takes
# no abbreviated flags), relative to this folder, where it runs; else logs/
# and the preset that runs: the last --preset X or --preset=X (the trainer's argparse takes the last)
log_dir=logs/ next_is_log_dir="" next_is_preset=""
for a in "$@"; do
    if [ -n "$next_is_log_dir" ]; then log_dir=$a; next_is_log_dir=""; continue; fi
    if [ -n "$next_is_preset" ]; then preset=$a; next_is_preset=""; continue; fi
    case "$a" in
        --log-dir) next_is_log_dir=1 ;;
        --log-dir=*) log_dir=${a#*=} ;;
        --preset) next_is_preset=1 ;;
        --preset=*) preset=${a#*=} ;;
    esac
done
if [ "$log_dir" != logs/ ]; then
    [[ "$log_dir" == /* ]] || log_dir="$PWD/$log_dir"
    log_dir="${log_dir%/}/"
fi
echo "run.sh: preset $preset, $([ "$nproc" -le 1 ] && echo "1 process" || echo "$nproc processes") on $([ "$n_gpus" -eq 0 ] && echo CPU || echo GPU), data $DATA_DIR$sample_note, logs in $log_dir" >&2
if [ "$nproc" -le 1 ]; then
    exec "$PYTHON" train_gpt.py "${args[@]}"
fi
# the flags and the start-up checks every rank would make (harness.preflight), once here: a refusal is one line
# rather than one per rank and torchrun's report; --help and --describe are answered here (its only stdout)
answer=$("$PYTHON" -c 'import sys, harness, train_gpt as T; sys.exit(harness.preflight(sys.argv[2:], T.TRAINER, int(sys.argv[1])))' \
    "$nproc" "${args[@]}") || exit $?
if [ -n "$answer" ]; then printf '%s\n' "$answer"; exit 0; fi

# torchrun exits 1 whatever its workers did: each rank leaves its exit status in a folder (harness.py,
# TRAIN_GPT_EXIT_CODE_DIR); torchrun runs in its own session so that a Ctrl-C reaches it once, from here,
# and it forwards one signal to every rank, waiting --shutdown-timeout seconds before SIGKILL.
TRAIN_GPT_EXIT_CODE_DIR=$(mktemp -d)
export TRAIN_GPT_EXIT_CODE_DIR
signalled=""
# torchrun's own traceback for the signal it was sent (SignalException) or for a failed rank (ChildFailedError:
# the rank said why, and torchrun's report after it names the exit codes) says nothing: drop that one block of
# its stderr, pass every other line on as it comes (the ranks' lines included)
drop_signal_traceback() {
    awk '/^Traceback \(most recent call last\):$/ { block = $0 "\n"; held = 1; next }
         held { block = block $0 "\n"
                if ($0 != "" && $0 !~ /^ /) { if ($0 !~ /(SignalException|ChildFailedError): /) printf "%s", block; held = 0; fflush() }
                next }
         { print; fflush() }
         END { if (held) printf "%s", block }'
}
# torchrun's own log folder goes with the exit codes (its default is a new /tmp/torchelastic_* each launch)
setsid "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" --log-dir "$TRAIN_GPT_EXIT_CODE_DIR/torchrun" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}" train_gpt.py "${args[@]}" 2> >(trap "" INT TERM; drop_signal_traceback >&2) &
launcher=$!
forward() { signalled=$1; kill -s "$1" "$launcher" 2>/dev/null || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
rc=0
while :; do
    wait "$launcher" && rc=0 || rc=$?
    kill -0 "$launcher" 2>/dev/null || break  # wait returned for a signal, not for torchrun's end
done
codes=$(cat "$TRAIN_GPT_EXIT_CODE_DIR"/rank* 2>/dev/null || true)
rm -rf "$TRAIN_GPT_EXIT_CODE_DIR"
# a refusal first: the other ranks were stopped because of it; 130 when every rank saw a signal
# (one rank's crash also gets the others SIGTERMed by torchrun: that stays a failure)
if grep -qx 2 <<<"$codes"; then exit 2; fi
if [ -n "$signalled" ] || { [ -n "$codes" ] && ! grep -qvx 130 <<<"$codes"; }; then
    echo "run.sh: stopped by ${signalled:+SIG}${signalled:-a signal to a rank} (exit 130)" >&2
    exit 130
fi
exit "$rc"
