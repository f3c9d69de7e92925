"""Compare groups of speedrun logs: final val loss, its spread, the record t-test, time, tokens, FLOPs.

Reads this repo's logs (source snapshot, separator, environment, step lines, summary, ``status:``
line) and logs of the modded-nanogpt shape (``step:{n}/{N} val_loss:... train_time:...ms ...``
lines, with or without a code snapshot above), ignoring every line it does not know.

    python records/compare.py records/2026-01-01_MyRecord          # a folder = one group of runs
    python records/compare.py a.txt b.txt                           # each file its own group
    python records/compare.py --group-by prefix ../shared/peer_logs # <group>__<run id>.txt names
    python records/compare.py --json DIR                            # the table as JSON
    python records/compare.py --plot curves.png --x tokens DIR...   # val loss curves

Grouping (``--group-by``):
  auto    a folder given on the command line is one group (its ``*.txt`` files, not recursive);
          a file given directly is a group of its own (named by its file stem).
  prefix  every file is grouped by its file-name part before the last ``__`` (the peer_logs
          naming ``<record folder>__<run subfolder>__<run id>.txt``); a name without ``__``
          falls back to ``auto``.
  folder  every file is grouped by the name of the folder it lies in.

A run counts only if it is complete: for our logs a final ``status:complete`` line (and a val
line at step N); for modded-nanogpt logs, which have no status line, the last ``val_loss`` line
must be at step N of N; in both, the final val loss must be finite (not nan/inf). A last line
without its newline (cut while being written) is ignored. Incomplete runs are listed, never
counted. Per group: mean and sample std (ddof=1) of the final val loss, and the one-sided
one-sample t-test p-value that the mean is below ``--target`` (a finite number;
``scipy.stats.ttest_1samp(..., alternative="less")``; nan/null for fewer than two runs).

A log that cannot be read (a folder named ``*.txt``, a symlink loop, no read permission, ...) is
listed as an incomplete run of its group with the reason ``unreadable: ...`` and a warning on
stderr; the other logs are compared as usual. A PATH argument that does not exist is an error.

Exit status: 0 when the table (or JSON, plot) was made, even if some logs were unreadable or
incomplete; 2 on bad arguments (no such PATH, ``--target`` not finite, ``--plot`` into a missing
folder or an unknown image type), or when no log at all could be read.
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys

SEPARATOR = "=" * 100  # the line between the source snapshot and the run (same as train_gpt.py)
HEADER_RE = re.compile(r"^### file (?P<name>\S+) lines=(?P<lines>\d+) sha256=(?P<sha>[0-9a-f]{64})\s*$")
STEP_RE = re.compile(r"^step:(?P<step>\d+)/(?P<total>\d+)\s+(?P<rest>.*?)\s*$")
FIELD_RE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<value>\S*)$")
# Lines that only our trainer writes: they mark a log as "ours" even without the snapshot.
OURS_MARKERS = ("status:", "summary:", "config: {")


# ----------------------------------------------------------------------------------------------
# Reading one log

def read_log_lines(path):
    """The log's lines, split exactly as train_gpt.py counted them for its ``lines=<n>`` headers.

    The file is read without newline translation and split with ``str.splitlines(keepends=True)``
    (the same splitting the writer used), so the snapshot line counts line up byte for byte.
    """
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read().splitlines(keepends=True)


@dataclasses.dataclass
class SnapshotFile:
    """One source file as stored in a log: header fields and the stored lines (with line ends)."""
    name: str
    lines: int
    sha256: str
    body: list
    header_line: int  # 1-based line number of the ``### file`` header in the log


def has_line_end(line):
    """True when ``line`` (an element of ``splitlines(keepends=True)``) ends with its line break."""
    return bool(line) and line.splitlines()[0] != line


def split_snapshot(lines):
    """Split our log's leading source snapshot from the rest.

    Returns ``(files, rest_index, truncated)``: the ``SnapshotFile`` list (empty when the log
    does not start with a ``### file`` header), the index of the first line after the snapshot,
    and whether the log ended inside the snapshot (fewer lines than a header promised, or its
    last stored line cut before its line break). When truncated, the last file is the cut one.
    """
    files, i = [], 0
    while i < len(lines):
        m = HEADER_RE.match(lines[i].rstrip("\r\n"))
        if not m:
            break
        n = int(m["lines"])
        body = lines[i + 1:i + 1 + n]
        files.append(SnapshotFile(m["name"], n, m["sha"], body, i + 1))
        if len(body) < n or (body and not has_line_end(body[-1])):
            return files, len(lines), True
        i += 1 + n
    return files, i, False


def _value(text):
    """A field value as a number when it is one (``236843ms`` -> 236843.0, ``nanms`` -> nan)."""
    t = text[:-2] if text.endswith("ms") else text
    t = t[:-3] if t.endswith("MiB") else t
    try:
        if re.fullmatch(r"[+-]?\d+", t):
            return int(t)
        return float(t)
    except ValueError:
        return text


def parse_fields(text):
    """``key:value`` words of a line as a dict, or None if any word is not of that shape."""
    out = {}
    for word in text.split():
        m = FIELD_RE.match(word)
        if not m:
            return None
        out[m["key"]] = _value(m["value"])
    return out


def parse_step_line(line):
    """``(step, total, fields)`` of a ``step:n/N key:value ...`` line, else None."""
    m = STEP_RE.match(line.rstrip("\r\n"))
    if not m:
        return None
    fields = parse_fields(m["rest"])
    if not fields:
        return None
    return int(m["step"]), int(m["total"]), fields


@dataclasses.dataclass
class Run:
    """What one log says: its val/train points, whether it is complete, and its final numbers."""
    path: str
    name: str
    fmt: str = "modded"          # "ours" or "modded"
    total_steps: int = 0         # N of the step lines
    val: list = dataclasses.field(default_factory=list)    # dicts: step, val_loss, train_time_ms, tokens, flops
    train: list = dataclasses.field(default_factory=list)  # dicts: step, train_loss, train_time_ms, tokens, flops
    status: str = ""             # our status line (``complete`` ...); "" if none
    reason: str = ""             # why it is incomplete
    summary: dict = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    group: str = ""

    @property
    def complete(self):
        return not self.reason

    @property
    def final(self):
        """The last val point (the run's final val loss and train time), or None."""
        return self.val[-1] if self.val else None

    @property
    def raw_tokens(self):
        if "raw_tokens" in self.summary:
            return self.summary["raw_tokens"]
        return next((t["tokens"] for t in reversed(self.train) if t.get("tokens") is not None), None)

    @property
    def flops(self):
        if isinstance(self.summary.get("flops"), (int, float)):
            return self.summary["flops"]
        return next((t["flops"] for t in reversed(self.train) if t.get("flops") is not None), None)


def _append(points, point):
    """Append a step point; a step that goes back (a resumed run re-doing steps) replaces the later ones."""
    while points and points[-1]["step"] >= point["step"]:
        points.pop()
    points.append(point)


def parse_log(path, group=""):
    """Parse one log file (our format or the modded-nanogpt shape) into a ``Run``."""
    return parse_lines(read_log_lines(path), path, group)


def parse_lines(lines, path="", group=""):
    """Parse a log given as its lines (see ``read_log_lines``) into a ``Run``."""
    run = Run(path=path, name=os.path.splitext(os.path.basename(path))[0], group=group)
    files, start, truncated = split_snapshot(lines)
    body = [ln.rstrip("\r\n") for ln in lines[start:]]
    if body and not lines[-1].endswith(("\n", "\r")):
        body.pop()  # a last line without its newline was cut while being written: "3.27" of "3.2791"
    if files or any(ln.startswith(OURS_MARKERS) for ln in body):
        run.fmt = "ours"
    elif SEPARATOR in body:
        # modded-nanogpt logs put their code above the first separator line; skip it so that
        # step-like text in the code is never read, unless nothing step-like follows it
        # (then the separator was not a code/run boundary).
        first = body.index(SEPARATOR)
        if any(parse_step_line(ln) for ln in body[first + 1:]):
            body = body[first + 1:]

    status_reason = ""
    last_train = None  # nearest preceding train line: gives tokens/FLOPs to the val lines
    for ln in body:
        parsed = parse_step_line(ln)
        if parsed:
            step, total, f = parsed
            run.total_steps = total
            point = dict(step=step, train_time_ms=f.get("train_time"),
                         tokens=f.get("tokens"), flops=f.get("flops"))
            if not all(isinstance(f.get(k, 0.0), (int, float)) for k in ("val_loss", "train_loss", "train_time")):
                continue  # a step line with a non-numeric loss/time is not one we know
            if "val_loss" in f:
                for key in ("tokens", "flops"):  # val lines may lack them: take the train line's
                    if point[key] is None and step == 0:
                        point[key] = 0
                    elif point[key] is None and last_train is not None and run.fmt == "ours":
                        point[key] = last_train.get(key)
                point["val_loss"] = f["val_loss"]
                _append(run.val, point)
            elif "train_loss" in f or "train_time" in f:
                point["train_loss"] = f.get("train_loss")
                _append(run.train, point)
                last_train = point
            continue
        if ln.startswith("status:"):
            f = ln[len("status:"):].split(" reason:", 1)
            run.status = f[0].strip()  # the last one wins: a resumed run writes a later status
            status_reason = f[1].strip() if len(f) > 1 else ""
        elif ln.startswith("summary:"):
            run.summary = parse_fields(ln[len("summary:"):]) or {}
        elif ln.startswith("config: {"):
            try:
                run.config = json.loads(ln[len("config: "):])
            except json.JSONDecodeError:
                pass

    # Completeness: our logs need status:complete; every log needs its last val line at step N.
    if truncated:
        run.reason = "log ends inside its source snapshot"
    elif run.fmt == "ours" and not run.status:
        run.reason = "no status line (truncated, crashed or killed)"
    elif run.fmt == "ours" and run.status != "complete":
        run.reason = f"status:{run.status}" + (f" reason:{status_reason}" if status_reason else "")
    elif not run.val:
        run.reason = "no val_loss line"
    elif run.val[-1]["step"] != run.total_steps:
        run.reason = f"last val_loss line is at step {run.val[-1]['step']} of {run.total_steps}"
    elif not math.isfinite(run.final["val_loss"]):  # a diverged run: its nan/inf would poison the mean
        run.reason = f"non-finite final val loss ({run.final['val_loss']})"
    return run


# ----------------------------------------------------------------------------------------------
# Groups and statistics

def group_of(path, given_as_folder, mode):
    """The group name of a log file, by ``--group-by`` mode (see the module docstring)."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = os.path.splitext(os.path.basename(path))[0]
    if mode == "prefix" and "__" in stem:
        return stem.rsplit("__", 1)[0]
    if mode == "folder" or (mode in ("auto", "prefix") and given_as_folder):
        return folder
    return stem


def unreadable_run(path, group, err):
    """A ``Run`` standing for a log that could not be read (listed as incomplete, never counted)."""
    why = getattr(err, "strerror", None) or str(err)
    return Run(path=path, name=os.path.splitext(os.path.basename(path))[0], group=group,
               reason=f"unreadable: {why}")


NOT_LOGS = {".png", ".pdf", ".svg", ".jpg", ".json", ".md", ".py"}


def collect(paths, group_by="auto", warn=None):
    """Parse every log named by ``paths`` (files, or folders of ``*.txt``); runs in a stable order.

    A log that cannot be read (``OSError``: a folder named ``*.txt``, a symlink loop, no
    permission) becomes an incomplete run with reason ``unreadable: ...`` and is reported through
    ``warn(message)`` if given. Raises FileNotFoundError for a path that does not exist.
    """
    runs, seen = [], set()
    for p in paths:
        if os.path.isdir(p):
            files = sorted(f for f in glob.glob(os.path.join(p, "*.txt")) if os.path.basename(f) != "README.txt")
            as_folder = True
            if not files and warn and glob.glob(os.path.join(p, "*", "*.txt")):
                warn(f"{p}: no .txt logs in it, but in its subfolders: pass {os.path.join(p, '*')} "
                     "to compare them (one group per subfolder)")
        elif os.path.splitext(p)[1].lower() in NOT_LOGS:  # e.g. a plot or summary caught by a shell glob
            if warn:
                warn(f"{p}: not a log ({os.path.splitext(p)[1]}), skipped")
            continue
        elif os.path.lexists(p):  # a file, or an entry that will fail to read (listed as unreadable)
            files, as_folder = [p], False
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
        for f in files:
            if os.path.realpath(f) in seen:  # the same log named twice would count as two runs
                if warn:
                    warn(f"{f}: already read (named twice); counted once")
                continue
            seen.add(os.path.realpath(f))
            group = group_of(f, as_folder, group_by)
            try:
                runs.append(parse_log(f, group))
            except OSError as e:
                runs.append(unreadable_run(f, group, e))
                if warn:
                    warn(f"cannot read {f} ({runs[-1].reason[len('unreadable: '):]}); "
                         "listed as unreadable, not counted")
    return runs


def _mean_if_all(values):
    """Mean of the values if every one is known, else None (a mean over some runs would mislead)."""
    if not values or any(v is None or isinstance(v, str) for v in values):
        return None
    return sum(values) / len(values)


def group_stats(runs, target=3.28):
    """One dict per group (in order of first appearance): the columns of the table / JSON."""
    from scipy import stats  # imported here so that parsing alone needs no scipy

    order = []
    for r in runs:
        if r.group not in order:
            order.append(r.group)
    out = []
    for g in order:
        members = [r for r in runs if r.group == g]
        done = [r for r in members if r.complete]
        losses = [r.final["val_loss"] for r in done]
        n = len(losses)
        mean = sum(losses) / n if n else math.nan
        std = math.sqrt(sum((x - mean) ** 2 for x in losses) / (n - 1)) if n > 1 else math.nan
        p = float(stats.ttest_1samp(losses, target, alternative="less").pvalue) if n > 1 else math.nan
        steps = sorted({r.total_steps for r in done})
        out.append(dict(
            group=g, runs=n,
            incomplete=[f"{r.name} ({r.reason})" for r in members if not r.complete],
            mean_val_loss=mean, std_val_loss=std, p_value=p, target=target,
            mean_train_time_ms=_mean_if_all([r.final["train_time_ms"] for r in done]) if n else None,
            steps=steps[0] if len(steps) == 1 else (steps or None),
            tokens=_mean_if_all([r.raw_tokens for r in done]),
            flops=_mean_if_all([r.flops for r in done]),
            val_losses=losses, run_names=[r.name for r in done]))
    return out


def _jsonable(x):
    """NaN -> None so that the output is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def format_table(rows):
    """The per-group table as aligned text, then the incomplete runs (listed, not counted)."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    target = rows[0]["target"] if rows else 3.28
    head = ["group", "runs", "incompl", "mean_val_loss", "std", f"p(mean<{target})",
            "mean_train_time", "steps", "tokens", "flops"]
    body = []
    for r in rows:
        t = r["mean_train_time_ms"]
        steps = r["steps"]
        body.append([r["group"], str(r["runs"]), str(len(r["incomplete"])),
                     num(r["mean_val_loss"], ".4f"), num(r["std_val_loss"], ".4f"), num(r["p_value"], ".3g"),
                     "-" if t is None else f"{t:.0f}ms ({t / 60000:.2f}min)",
                     "-" if steps is None else (str(steps) if isinstance(steps, int) else ",".join(map(str, steps))),
                     num(r["tokens"], ".4g"), num(r["flops"], ".4g")])
    width = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, width)))
             for row in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in width))
    bad = [(r["group"], name) for r in rows for name in r["incomplete"]]
    if bad:
        lines += ["", "incomplete runs (not counted):"] + [f"  {g}: {name}" for g, name in bad]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plot

X_AXES = {  # --x: point key, axis label
    "time": ("train_time_ms", "train time"),
    "tokens": ("tokens", "raw train tokens read"),
    "flops": ("flops", "training FLOPs (model estimate)"),
    "step": ("step", "step"),
}


def plot(runs, out, x="time", target=3.28):
    """Val loss against ``x`` for every run, one colour per group; returns notes on skipped runs.

    Complete runs are solid lines, incomplete ones dotted. The y range is clipped to the
    interesting part (the first losses of ~10.8 would squash everything else): from just below
    the best loss (or the target) to a few tenths above the worst final loss (or the target).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = X_AXES[x]
    notes, curves = [], []
    for r in runs:
        if not r.val:
            notes.append(f"plot: skipped {r.name} ({r.group}): {r.reason or 'no val_loss line'}")
            continue
        pts = [p for p in r.val if isinstance(p.get(key), (int, float))]
        if len(pts) < len(r.val):
            notes.append(f"plot: skipped {r.name} ({r.group}): its val lines have no {x} values")
            continue
        # nan/inf points (a diverged run, "nanms" times) cannot be drawn and would break the axis limits
        finite = [p for p in pts if math.isfinite(p[key]) and math.isfinite(p["val_loss"])]
        if not finite:
            notes.append(f"plot: skipped {r.name} ({r.group}): no finite val point")
            continue
        if len(finite) < len(pts):
            k = len(pts) - len(finite)
            notes.append(f"plot: {r.name} ({r.group}): left out {k} non-finite point{'s' * (k != 1)}")
        curves.append((r, [p[key] for p in finite], [p["val_loss"] for p in finite]))
    scale, unit = 1.0, ""
    if x == "time":
        longest = max((max(xs) for _, xs, _ in curves), default=0)
        scale, unit = (60000.0, "min") if longest > 10 * 60000 else (1000.0, "s")
        label = f"train time ({unit}, validation and compile excluded)"

    groups = list(dict.fromkeys(r.group for r in runs))
    cmap = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    colour = {g: cmap(i % cmap.N) for i, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(11, 6.5), dpi=110)
    labelled = set()
    for r, xs, ys in curves:
        n = sum(1 for q in runs if q.group == r.group and q.complete)
        lab = None if r.group in labelled else f"{r.group} ({n} complete run{'s' * (n != 1)})"
        labelled.add(r.group)
        ax.plot([v / scale for v in xs], ys, color=colour[r.group], label=lab,
                lw=1.2 if r.complete else 1.0, ls="-" if r.complete else ":", alpha=0.85 if r.complete else 0.6,
                marker="o" if len(xs) <= 30 else None, ms=3)  # few val points: show where they are
    if any(not r.complete for r, _, _ in curves):
        ax.plot([], [], color="grey", ls=":", label="incomplete run (not counted)")
    ax.axhline(target, color="black", ls="--", lw=1.2, label=f"target {target}")

    if curves:
        lows = [min(ys) for _, _, ys in curves]
        finals = max(ys[-1] for _, _, ys in curves)
        # highest loss after the first val point (the untrained ~10.8 would dominate the axis)
        highs = max(max(ys[1:] or ys) for _, _, ys in curves)
        lo = min(min(lows), target) - 0.05
        # a few tenths above the worst final loss; more when runs end far from the target
        # (short CPU runs), but never above the highest loss worth showing
        hi = max(finals, target) + max(0.4, finals - lo)
        top = max(highs, target)
        hi = min(hi, top + max(0.05, 0.05 * (top - lo)))
        ax.set_ylim(lo, hi)
        ax.set_xlim(left=0)
    ax.set_xlabel(label)
    ax.set_ylabel("val loss (cross-entropy, nats/token)")
    ax.set_title(f"val loss vs {x}" + (" (y clipped: early losses are off the top)" if curves else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)
    return notes


# ----------------------------------------------------------------------------------------------

def finite_float(text):
    """argparse type: a finite float (``inf``/``nan`` would make every p-value meaningless)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def plot_problem(out):
    """Why ``--plot out`` cannot be written (missing folder, unknown image type), or None."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return f"no folder {folder} to write it in; create it or pick another path"
    ext = os.path.splitext(out)[1].lower().lstrip(".")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    types = FigureCanvasAgg.get_supported_filetypes()
    if ext not in types:
        return f"unknown image type {ext or '(none)'!r}; end the name with one of {', '.join(sorted(types))}"
    return None


def main(argv=None):
    """Command line: print the table (or JSON) and optionally draw the plot; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Table columns are described in records/README.md.")
    ap.add_argument("paths", nargs="+", help="log files, or folders of .txt logs")
    ap.add_argument("--group-by", choices=("auto", "prefix", "folder"), default="auto",
                    help="auto: a folder is one group, a file its own group; prefix: by the file-name part "
                         "before the last '__' (peer_logs naming); folder: by the folder a file lies in")
    ap.add_argument("--target", type=finite_float, default=3.28, help="val loss to beat (one-sided t-test)")
    ap.add_argument("--json", action="store_true", help="print the groups as JSON instead of the table")
    ap.add_argument("--plot", metavar="OUT.png", help="draw val loss curves of every run to this file")
    ap.add_argument("--x", choices=sorted(X_AXES), default="time", help="x axis of --plot")
    args = ap.parse_args(argv)

    def error(message):
        print(f"compare.py: error: {message}", file=sys.stderr)
        return 2

    problem = plot_problem(args.plot) if args.plot else None  # before the work, not after the table
    if problem:
        return error(f"--plot {args.plot}: {problem}")
    try:
        runs = collect(args.paths, args.group_by,
                       warn=lambda message: print(f"compare.py: warning: {message}", file=sys.stderr))
    except OSError as e:
        return error(e)
    if not runs:
        return error("no .txt logs found in " + ", ".join(args.paths))
    if all(r.reason.startswith("unreadable:") for r in runs):
        return error("no log could be read (see the warnings above)")
    rows = group_stats(runs, args.target)
    if args.json:
        print(json.dumps(_jsonable(rows), indent=1))
    else:
        print(format_table(rows))
    if args.plot:
        try:
            notes = plot(runs, args.plot, args.x, args.target)
        except OSError as e:  # e.g. no write permission (folder and image type were checked up front)
            return error(f"--plot {args.plot}: cannot write it: {e}")
        for note in notes:
            print(note, file=sys.stderr)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
