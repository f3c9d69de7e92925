"""Text from a trained checkpoint: a GPT-2 BPE prompt in, sampled next tokens out.

    python sample.py --checkpoint checkpoints/<run_id>/step_000100.pt --prompt "The" --max-new-tokens 20 --seed 0

The checkpoint (written by ``train_gpt.py --save-every/--save-final``, or by a signal when checkpoints
are on) holds the weights and the run's config; the model is ``train_gpt.build_model`` of that config
and the spec its ``--model`` names in ``train_gpt.MODELS``. Whatever TST phase the run was saved in, the
model runs in next-token mode: one token per position (``[1, T, 1]`` inputs), the logits of the last
position give the next token. The attention windows and the tie of the embedding to the head are those
of the saved step (the stage table's row; the embedding unties after ``train_gpt.split_step``). The
prompt is encoded with GPT-2's BPE from the repository's own files (``data/gpt2_bpe``, no network) after
an ``<|endoftext|>``, as every training document starts; the context is cut to the newest tokens of the
sequence length the model was training at (the saved step's stage).

Each new token is drawn from ``softmax(logits / temperature)`` over GPT-2's 50,257 ids (the
padding rows of the embedding are never drawn), restricted to the ``--top-k`` most likely;
``--temperature 0`` takes the most likely token. ``--seed`` fixes the draw: the same checkpoint,
prompt, flags and device give the same text. Exactly ``--max-new-tokens`` tokens are drawn (an
``<|endoftext|>`` among them is printed as such). The text (prompt and continuation) goes to
stdout; bad input is one ``sample.py: error:`` line with exit status 2. Ctrl-C stops it with one
``sample.py: interrupted`` line (nothing printed to stdout) and exit status 130.
"""
import argparse
import dataclasses
import glob
import math
import os
import signal
import sys
from types import SimpleNamespace

INTERRUPTED = "sample.py: interrupted: nothing printed (the text is printed once every token is drawn)"
try:  # importing torch takes a second or more: a Ctrl-C during it is the same one line
    import torch

    # Everything taken from the trainer, in one place: the model, its config and specs, the stage table.
    from train_gpt import EOT_TOKEN, MODELS, Config, Schedule, build_model, split_step

    import _paths  # noqa: E402,F401  (data/ on the path: it is not a package)
    from tokenize_text import TokenizeError, load_encoder  # noqa: E402
except KeyboardInterrupt:
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(130)

GPT2_VOCAB = EOT_TOKEN + 1  # ids 0..50256 are GPT-2's; rows above are padding to a multiple of 128
WRITTEN_BY = "give a checkpoints/<run_id>/step_N.pt written by train_gpt.py --save-final or --save-every"


class SampleError(Exception):
    """Bad input to sample.py; the message names the flag or file and the fix."""


def read_checkpoint(path):
    """The dict a checkpoint file holds (``torch.load``, tensors only, on the CPU).

    Args:
        path: a ``step_N.pt`` file written by ``train_gpt.py``.
    Raises:
        SampleError: the path is a folder or missing, or the file is truncated, corrupt or not a checkpoint.
    """
    if os.path.isdir(path):  # a run's checkpoint folder: name the file to give
        newest = sorted(glob.glob(os.path.join(path, "step_*.pt")))
        raise SampleError(f"--checkpoint {path}: a folder; give one of its checkpoint files"
                          + (f" (the newest: {newest[-1]})" if newest else ": it holds no step_N.pt"))
    if not os.path.isfile(path):
        raise SampleError(f"--checkpoint {path}: no such file; {WRITTEN_BY}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch raises several kinds for a truncated or foreign file
        why = (str(e).splitlines() or [""])[0][:120] or type(e).__name__
        raise SampleError(f"--checkpoint {path}: truncated or unreadable ({type(e).__name__}: {why}); "
                          f"{WRITTEN_BY}") from None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "model" not in state:
        raise SampleError(f"--checkpoint {path}: holds no model weights and config; {WRITTEN_BY}")
    return state


def config_of(state, path, models=None):
    """The ``Config`` a checkpoint was trained with (its saved fields, defaults for fields newer than it).

    Args:
        state: the dict ``read_checkpoint`` returns.
        path: the checkpoint's path, for messages.
        models: the specs its ``--model`` may name (None: ``train_gpt.MODELS``).
    Raises:
        SampleError: fields this trainer does not know, or a ``--model`` spec that ``models`` lacks.
    """
    models = MODELS if models is None else models
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(state["config"]) - known)
    if unknown:
        raise SampleError(f"--checkpoint {path}: made by a trainer with config fields this one lacks "
                          f"({', '.join(unknown)}); sample with that trainer's version of the repository")
    cfg = Config(**state["config"])
    if cfg.model not in models:
        raise SampleError(f"--checkpoint {path}: its model spec {cfg.model!r} is not in train_gpt.MODELS "
                          f"({', '.join(models)}); sample with the code that trained it")
    return cfg


def state_dict_mismatch(own, saved, show=3):
    """What keeps ``saved`` from loading into a model whose state dict is ``own``, naming the first keys of each kind
    (missing, unexpected, another shape); "" when it fits."""
    def first(keys):
        keys = sorted(keys)
        return ", ".join(keys[:show]) + (f" and {len(keys) - show} more" if len(keys) > show else "")
    missing = set(own) - set(saved)
    extra = set(saved) - set(own)
    shapes = {k for k in set(own) & set(saved) if tuple(own[k].shape) != tuple(getattr(saved[k], "shape", ()))}
    parts = [f"{what} {first(keys)}" for what, keys in (("missing", missing), ("unexpected", extra)) if keys]
    if shapes:
        k = sorted(shapes)[0]
        parts.append(f"another shape {first(shapes)} ({k}: {list(saved[k].shape)} saved, {list(own[k].shape)} here)")
    return "; ".join(parts)


def load_model(path, device, models=None):
    """The model of a checkpoint on ``device``, in eval mode, with the attention windows of its step and its
    embedding tied to the head or not as at that step.

    Args:
        path: a ``step_N.pt`` file written by ``train_gpt.py``.
        device: a ``torch.device``.
        models: the specs its ``--model`` may name (None: ``train_gpt.MODELS``).
    Returns:
        ``(model, run)``: ``run.cfg`` the Config, ``run.step`` the saved step, ``run.context`` the positions a
        forward takes (the sequence length of that step's stage).
    Raises:
        SampleError: the file is missing, not a checkpoint, truncated or corrupt, names a spec ``models`` lacks,
            or its weights do not fit its config.
    """
    models = MODELS if models is None else models
    state = read_checkpoint(path)
    cfg = config_of(state, path, models)
    spec = models[cfg.model]
    model = build_model(cfg, spec)
    mismatch = state_dict_mismatch(model.state_dict(), state["model"])
    if mismatch:
        raise SampleError(f"--checkpoint {path}: its weights do not fit its config ({mismatch}); it was not written "
                          f"by this train_gpt.py, or was edited")
    model.load_state_dict(state["model"])
    step = min(int(state.get("step", 0)), cfg.num_iterations)
    model.tied = step <= split_step(cfg)  # the run unties after this step's update
    row = Schedule(cfg, spec)[step]  # the windows and RoPE history the weights were trained with
    model.set_window(row.window, row.yarn)
    return model.to(device).eval(), SimpleNamespace(cfg=cfg, step=step, context=row.stage.seq_len)


@torch.no_grad()
def generate(model, ids, max_new_tokens, context, temperature=1.0, top_k=0, generator=None):
    """Draw ``max_new_tokens`` tokens after ``ids``, one forward per token (no cache: a small tool).

    Args:
        model: a ``train_gpt.GPT`` in eval mode.
        ids: the prompt's token ids (ints), at least one.
        max_new_tokens: how many tokens to draw (>= 1).
        context: the most positions a forward sees (``load_model``'s ``run.context``); older tokens are cut.
        temperature: divides the logits; 0 takes the most likely token.
        top_k: draw among the k most likely ids only (0 = all of GPT-2's 50,257).
        generator: a ``torch.Generator`` on the model's device (the seed), or None.
    Returns:
        The list of new token ids, each in ``[0, 50257)``.
    """
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        inputs = torch.tensor(out[-context:], dtype=torch.int64, device=device).view(1, -1, 1)  # [1, T, 1]
        logits = model(inputs)[0, -1, :GPT2_VOCAB].float()  # padding ids are never drawn
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, GPT2_VOCAB)).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(token)
    return out[len(ids):]


def pick_device(name):
    """``torch.device`` of ``--device`` (auto: CUDA when there is one). Raises SampleError for cuda without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: no CUDA device visible to torch; use --device cpu")
    return torch.device(name)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are a ``SampleError`` (one line, no usage block)."""

    def error(self, message):
        raise SampleError(message)


def parse_args(argv):
    """The command line; a bad value is one error line naming the flag, exit status 2.

    Raises:
        SampleError: an unknown flag, a missing --checkpoint, or a value out of range.
    """
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, metavar="PATH", help="a step_N.pt written by train_gpt.py")
    ap.add_argument("--prompt", help="text to continue (default: start a new document)")
    ap.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to draw")
    ap.add_argument("--temperature", type=float, default=1.0, metavar="T",
                    help="softmax temperature; 0 = always the most likely token")
    ap.add_argument("--top-k", type=int, default=0, metavar="K", help="draw among the K most likely ids (0 = all)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the draw")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if there is one")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        raise SampleError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise SampleError(f"--temperature must be a finite number >= 0 (got {args.temperature})")
    if args.top_k < 0:
        raise SampleError(f"--top-k must be >= 0, 0 = no limit (got {args.top_k})")
    if args.prompt is not None and not args.prompt.strip():
        raise SampleError("--prompt is empty; give some text, or leave --prompt out to start a new document")
    return args


def main(argv=None, models=None):
    """Command line: print the prompt and its sampled continuation; returns the exit status (130: Ctrl-C).
    ``models``: the specs a checkpoint's ``--model`` may name (None: ``train_gpt.MODELS``)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that left (`| head`): stop quietly
    try:
        return _sample(argv, models)
    except KeyboardInterrupt:  # one line, not a traceback out of torch
        print(INTERRUPTED, file=sys.stderr)
        return 130


def _sample(argv, models=None):
    """``main`` without the Ctrl-C handling."""
    try:
        args = parse_args(argv)
        device = pick_device(args.device)
        encoder = load_encoder()
        model, run = load_model(args.checkpoint, device, models)
    except (SampleError, TokenizeError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt or ""
    ids = [EOT_TOKEN] + encoder.encode_ordinary(prompt)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new = generate(model, ids, args.max_new_tokens, run.context, args.temperature, args.top_k, generator)
    print(prompt + encoder.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
