"""Text from a trained checkpoint: a GPT-2 BPE prompt in, sampled next tokens out.

    python sample.py --checkpoint checkpoints/<run_id>/step_000100.pt --prompt "The" --max-new-tokens 20 --seed 0

The checkpoint (written by ``train_gpt.py --save-every/--save-final/--save-on-interrupt``) holds
the weights and the run's config; the model is ``train_gpt.GPT`` built from that config, so a
checkpoint of any trainer version whose config fields this one knows can be read. Whatever TST
phase the run was saved in, the model runs in next-token mode: one token per position
(``[1, T, 1]`` inputs), the logits of the last position give the next token. The attention
window is the one of the saved step. The prompt is encoded with GPT-2's BPE from the
repository's own files (``data/gpt2_bpe``, no network) after an ``<|endoftext|>``, as every
training document starts; the context is cut to the run's ``seq_len`` newest tokens.

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
import sys

INTERRUPTED = "sample.py: interrupted: nothing printed (the text is printed once every token is drawn)"
try:  # importing torch takes a second or more: a Ctrl-C during it is the same one line
    import torch

    # Everything taken from the trainer, in one place: the model, its config, the checkpoint reader.
    from harness import ConfigError, load_checkpoint
    from train_gpt import EOT_TOKEN, GPT, Config, Schedule, split_step

    import _paths  # noqa: E402,F401  (data/ on the path: it is not a package)
    from tokenize_text import TokenizeError, load_encoder  # noqa: E402
except KeyboardInterrupt:
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(130)

GPT2_VOCAB = EOT_TOKEN + 1  # ids 0..50256 are GPT-2's; rows above are padding to a multiple of 128


class SampleError(Exception):
    """Bad input to sample.py; the message names the flag or file and the fix."""


def config_of(state, path):
    """The ``Config`` a checkpoint was trained with: its saved fields, defaults for fields newer than it.

    Args:
        state: the dict ``load_checkpoint`` returns.
        path: the checkpoint's path, for messages.
    Raises:
        SampleError: the checkpoint has no config or weights, or fields this trainer does not know.
    """
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "model" not in state:
        raise SampleError(f"--checkpoint {path}: holds no model weights and config; give a checkpoint written "
                          "by train_gpt.py (checkpoints/<run_id>/step_N.pt)")
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(state["config"]) - known)
    if unknown:
        raise SampleError(f"--checkpoint {path}: made by a trainer with config fields this one lacks "
                          f"({', '.join(unknown)}); sample with that trainer's version of the repository")
    return Config(**state["config"])


def load_model(path, device):
    """The model of a checkpoint on ``device``, in eval mode, with the attention window of its step and
    its embedding tied to the head or not as at that step (``--tied-embed`` unties at ``split_step``).

    Args:
        path: a ``step_N.pt`` file written by ``train_gpt.py``.
        device: a ``torch.device``.
    Returns:
        ``(model, cfg, step)``.
    Raises:
        SampleError: the file is missing, not a checkpoint, truncated or corrupt, or its weights
            do not fit its config.
    """
    if os.path.isdir(path):  # a run's checkpoint folder: name the file to give
        newest = sorted(glob.glob(os.path.join(path, "step_*.pt")))
        raise SampleError(f"--checkpoint {path}: a folder; give one of its checkpoint files"
                          + (f" (the newest: {newest[-1]})" if newest else ": it holds no step_N.pt"))
    if not os.path.isfile(path):
        raise SampleError(f"--checkpoint {path}: no such file; give a checkpoints/<run_id>/step_N.pt "
                          "written by train_gpt.py --save-final or --save-every")
    try:
        state = load_checkpoint(path)
    except ConfigError as e:  # its message names the trainer's --resume flag and resuming: say ours instead
        text = str(e).split(": ", 1)[-1].replace("resume from an older one", "sample an older one")
        raise SampleError(f"--checkpoint {path}: {text}") from None
    cfg = config_of(state, path)
    if cfg.vocab_size < GPT2_VOCAB:
        raise SampleError(f"--checkpoint {path}: vocab_size {cfg.vocab_size} is below GPT-2's {GPT2_VOCAB} ids; "
                          "this sampler speaks GPT-2 BPE only")
    model = GPT(cfg)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise SampleError(f"--checkpoint {path}: its weights do not fit its config ({first})") from None
    step = int(state.get("step", 0))
    split = split_step(cfg)  # --tied-embed: after this step the embedding is its own weight, as the trainer runs it
    model.tied = split is not None and step <= split
    # the window grows over a run: use the stage table's window at the step the weights were saved
    row = Schedule(cfg)[min(step, cfg.num_iterations)]
    model.set_window(row.window, row.yarn)
    return model.to(device).eval(), cfg, step


@torch.no_grad()
def generate(model, ids, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """Draw ``max_new_tokens`` tokens after ``ids``, one forward per token (no cache: a small tool).

    Args:
        model: a ``train_gpt.GPT`` in eval mode.
        ids: the prompt's token ids (ints), at least one.
        max_new_tokens: how many tokens to draw (>= 1).
        temperature: divides the logits; 0 takes the most likely token.
        top_k: draw among the k most likely ids only (0 = all of GPT-2's 50,257).
        generator: a ``torch.Generator`` on the model's device (the seed), or None.
    Returns:
        The list of new token ids, each in ``[0, 50257)``.
    """
    device = next(model.parameters()).device
    seq_len = model.cfg.seq_len
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor(out[-seq_len:], dtype=torch.int64, device=device).view(1, -1, 1)  # [1, T, 1]
        logits = model(context)[0, -1, :GPT2_VOCAB].float()  # padding ids are never drawn
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


def main(argv=None):
    """Command line: print the prompt and its sampled continuation; returns the exit status (130: Ctrl-C)."""
    try:
        return _sample(argv)
    except KeyboardInterrupt:  # one line, not a traceback out of torch
        print(INTERRUPTED, file=sys.stderr)
        return 130


def _sample(argv):
    """``main`` without the Ctrl-C handling."""
    try:
        args = parse_args(argv)
        device = pick_device(args.device)
        encoder = load_encoder()
        model, _, _ = load_model(args.checkpoint, device)
    except (SampleError, TokenizeError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt or ""
    ids = [EOT_TOKEN] + encoder.encode_ordinary(prompt)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, generator)
    print(prompt + encoder.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
