#!/usr/bin/env bash
# The one command. With GPUs: baseline_h200 (record #89's recipe) on 1, 2, 4 or 8 of them under torchrun, on
# FineWeb in $DATA_DIR (default data/fineweb10B, 10 train shards downloaded when it has none: about 2 GB).
# Without a GPU: cpu_smoke (record_h200's recipe at the smoke shape) on data/sample. Exit status: the trainer's.
# Extra arguments go to train_gpt.py (e.g. --preset record_h200); NPROC sets the process count, DATA_DIR the shards.
set -euo pipefail
if [ -n "${DATA_DIR:-}" ] && [[ "$DATA_DIR" != /* ]]; then DATA_DIR="$PWD/$DATA_DIR"; fi  # as given, from here
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
n_gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) || {
    echo "run.sh: torch is not importable by $PYTHON; first: pip install -r requirements.txt" >&2; exit 2; }
if [ "$n_gpus" -eq 0 ]; then
    preset=cpu_smoke; DATA_DIR=${DATA_DIR:-data/sample}; nproc=${NPROC:-1}
else
    preset=baseline_h200; DATA_DIR=${DATA_DIR:-data/fineweb10B}; nproc=1
    while [ $((nproc * 2)) -le "$n_gpus" ] && [ $((nproc * 2)) -le 8 ]; do nproc=$((nproc * 2)); done
    nproc=${NPROC:-$nproc}  # a step's 8 sequences split evenly over 1, 2, 4 or 8 processes
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]{0,2}$ ]]; then echo "run.sh: NPROC=$nproc: give a process count (1, 2, 4, 8)" >&2; exit 2; fi
if [ "$n_gpus" -gt 0 ] && [ "$nproc" -gt "$n_gpus" ]; then
    echo "run.sh: NPROC=$nproc but $n_gpus GPU(s) are visible; set NPROC to at most $n_gpus" >&2; exit 2
fi
shopt -s nullglob
shards=("$DATA_DIR"/*_train_*.bin)
if [ ${#shards[@]} -eq 0 ] && [ "$n_gpus" -gt 0 ]; then
    echo "run.sh: no shards in $DATA_DIR; downloading FineWeb's val shard and 10 train shards" >&2
    "$PYTHON" data/cached_fineweb10B.py 10 --local-dir "$DATA_DIR"
elif [ ${#shards[@]} -eq 0 ]; then
    echo "run.sh: DATA_DIR=$DATA_DIR holds no *_train_*.bin shards; point it at a folder of shards" \
         "(data/tokenize_text.py makes them from text) or unset it for data/sample" >&2; exit 2
fi
glob=$(printf '%s' "$DATA_DIR" | sed 's/[][*?]/[&]/g')  # the folder name's own glob characters, escaped
prev=; for a in "$@"; do [ "$prev" = --preset ] && preset=$a; [[ $a == --preset=* ]] && preset=${a#*=}; prev=$a; done
args=(--preset "$preset" --train-files "$glob/*_train_*.bin" --val-files "$glob/*_val_*.bin" "$@")
# before torchrun: a process count the step cannot split gets the trainer's one line (--describe)
if [ "$nproc" -gt 1 ]; then WORLD_SIZE=$nproc "$PYTHON" train_gpt.py "${args[@]}" --describe >/dev/null || exit $?; fi
echo "run.sh: preset $preset on $nproc $([ "$n_gpus" -eq 0 ] && echo CPU || echo GPU) process(es), data $DATA_DIR" >&2
if [ "$nproc" -eq 1 ]; then exec "$PYTHON" train_gpt.py "${args[@]}"; fi
# torchrun (torch.distributed.run) through harness.py: the ranks' one line and exit status, not torchrun's traceback
exec "$PYTHON" harness.py --standalone --nproc_per_node="$nproc" train_gpt.py "${args[@]}"
