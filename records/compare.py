"""Compare groups of speedrun logs: is B better than A, and when does each reach the target?

Reads this repo's logs (source snapshot, separator, environment, config, step lines, summary,
``status:`` line) and logs of the modded-nanogpt shape (``step:{n}/{N} val_loss:...
train_time:...ms ...`` lines, with or without a code snapshot above), ignoring every line it
does not know.

    python records/compare.py records/2026-01-01_MyRecord          # a folder = one group of runs
    python records/compare.py A_DIR B_DIR                           # A/B: B against A (Welch, CI, ratios)
    python records/compare.py A_DIR B_DIR C_DIR --baseline A_DIR    # every group against A
    python records/compare.py --group-by prefix MODDED_LOGS        # <group>__<run id>.txt names
    python records/compare.py --json DIR                            # the tables as JSON
    python records/compare.py --markdown DIR...                     # the tables as Markdown
    python records/compare.py --plot curves.png --x tokens DIR...   # val (and train) loss curves
    python records/compare.py --pool-train-data ARM_DIR...          # one group over data orders
    python records/compare.py --first-passing A_DIR B_DIR --baseline A_DIR  # earliest passing val step, steps saved
    python records/compare.py --per-step MODDED_RECORD_DIR          # mean ± std at each val step (docs/RECORD89.md)

Grouping (``--group-by``):
  auto    a folder given on the command line is one group (its ``*.txt`` files, not recursive);
          a file given directly is a group of its own (named by its file stem).
  prefix  every file is grouped by its file-name part before the last ``__`` (copied modded-nanogpt
          record logs: ``<record folder>__<run subfolder>__<run id>.txt``); a name without ``__``
          falls back to ``auto``.
  folder  every file is grouped by the name of the folder it lies in.
Runs of one group must have measured the same thing: where their logged configs differ in a
field that defines the run (any field but the seed and ``train_gpt.OPERATIONAL``), or their
``data train:`` / ``data val:`` lines name other data (other fingerprints; other paths to the
same shards do not count), or their source snapshots differ (the sha256 of a ``### file`` header:
other code), the group is split into ``<group> [field=value ... code <file> <sha> val data <id>]``,
with a warning naming what differs. ``--pool-train-data`` keeps runs that differ only in their
training data in one group: for a benchmark whose noise deliberately includes the data order
(bench/small_scale.py's orders), where the spread over orders is what the group measures.
modded-nanogpt logs have no config line (and no ``### file`` headers) and are grouped as given.

A run counts only if it is complete: for our logs a final ``status:complete`` line (and a val
line at step N); for modded-nanogpt logs, which have no status line, the last ``val_loss`` line
must be at step N of N; in both, the final val loss must be finite (not nan/inf). A last line
without its newline (cut while being written) is ignored. Incomplete runs are listed, never
counted. Per group: mean and sample std (ddof=1) of the final val loss, and the one-sided
one-sample t-test p-value that the mean is below ``--target`` (a finite number;
``scipy.stats.ttest_1samp(..., alternative="less")``; nan/null for fewer than two runs).

Time to target: per run, the train time, step, raw tokens and FLOPs at which its val curve
first reaches ``--target`` (linear interpolation between the two val points around it), and
per group how many runs reached it and the mean and std over those. With ``--baseline A``
every other group B also gets mean(B) - mean(A) of the final val loss, its 95% confidence
interval and two-sided p-value from Welch's t-test (``scipy.stats.ttest_ind(B, A,
equal_var=False)``; at least two runs in each group), B/A ratios of mean train time,
FLOPs, tokens and time to target, and one line reading the test (which way, by how much, and
whether p < 0.05 or the difference is within the seed-to-seed noise). Exactly two PATHs that are one
group each (``A_DIR B_DIR``: an edit A/B-tested over a few seeds) take the first as the baseline
without ``--baseline``.

First-passing step (``--first-passing``): per group, the earliest val step at which the mean
val loss of its complete runs at that step is below ``--target`` at the required significance,
sought only at the val steps every one of those runs logged (a warning names the runs that lack
steps others logged). ``--rule ttest`` (default; modded-nanogpt's main track): the one-sided
t-test above at p < 0.01, two runs at least. ``--rule ztest`` (its optimization track, the
"first-passing step" of its PR #321): ``(target - mean) * sqrt(n) >= --z-margin`` (0.004), i.e.
``z = (target - mean) * sqrt(n) / --z-sigma >= margin / sigma`` with the per-run std taken as
known (0.0013); z and its one-sided p are reported. Per group: that step (or "never"), the
mean val loss, p (and z) there, and the mean train time, tokens and FLOPs of the runs' val lines
at that step; with ``--baseline`` the baseline's first-passing step minus the group's
(``steps_saved``, positive: fewer steps) and the same for the mean train time
(``time_saved_ms``); both null, with a note, when either group never passes.

Per step (``--per-step``): per group, the mean, sample std, min and max of the val loss at each
val step every complete run logged (``per_step_stats``; JSON: ``val_by_step``), e.g. the reference
curve of modded-nanogpt record #89's 13 logs (docs/RECORD89.md).

A log that cannot be read (a folder named ``*.txt``, a symlink loop, no read permission, ...) is
listed as an incomplete run of its group with the reason ``unreadable: ...`` and a warning on
stderr; the other logs are compared as usual. A PATH argument that does not exist is an error.

Exit status: 0 when the table (or JSON, plot) was made from at least one complete log, even if some
logs were unreadable or incomplete; 1 when every log found is incomplete (the table lists them); 2 on bad arguments (no such PATH, ``--target`` not finite, ``--baseline`` naming
no group or several, ``--plot`` into a missing folder, an unknown image type or an empty name,
``--x`` without ``--plot``, ``--rule`` or the z-test's flags without ``--first-passing``), or when
no log at all could be read.
"""
import argparse
import ast
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import stat
import signal
import sys
import warnings

SEPARATOR = "=" * 100  # the line between the source snapshot and the run (same as train_gpt.py)
HEADER_RE = re.compile(r"^### file (?P<name>\S+) lines=(?P<lines>\d+) sha256=(?P<sha>[0-9a-f]{64})\s*$")
STEP_RE = re.compile(r"^step:(?P<step>\d+)/(?P<total>\d+)\s+(?P<rest>.*?)\s*$")
FIELD_RE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<value>\S*)$")
DATA_RE = re.compile(r"^data (?P<kind>train|val): .* tokens:\d+ bytes:\d+ fingerprint:(?P<fp>[0-9a-f]+)$")
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
    val: list = dataclasses.field(default_factory=list)    # dicts: step, val_loss, train_time_ms, tokens, flops, phase
    train: list = dataclasses.field(default_factory=list)  # dicts: step, train_loss, train_time_ms, tokens, flops, phase
    status: str = ""             # our status line (``complete`` ...); "" if none
    reason: str = ""             # why it is incomplete
    summary: dict = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    data: list = dataclasses.field(default_factory=list)  # per start: {"train": [fingerprint, ...], "val": [...]}
    group: str = ""
    unreadable: list = dataclasses.field(default_factory=list)  # (line number, text) of step lines not parsed
    snapshot: dict = dataclasses.field(default_factory=dict)  # {file name: sha256} of our log's source snapshot

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


def is_log(run):
    """Whether a parsed file is a run log at all: ours (a snapshot or our marker lines) or one with step lines
    (a text file "hello" or random bytes is neither, and is skipped, not listed as an incomplete run); an empty
    file stays listed (a run killed before its first line)."""
    return (run.fmt == "ours" or bool(run.val or run.train or run.unreadable or run.total_steps)
            or run.reason.startswith("empty file"))


def parse_log(path, group=""):
    """Parse one log file (our format or the modded-nanogpt shape) into a ``Run``."""
    return parse_lines(read_log_lines(path), path, group)


def parse_lines(lines, path="", group=""):
    """Parse a log given as its lines (see ``read_log_lines``) into a ``Run``."""
    run = Run(path=path, name=os.path.splitext(os.path.basename(path))[0], group=group)
    files, start, truncated = split_snapshot(lines)
    run.snapshot = {f.name: f.sha256 for f in files}
    body = [ln.rstrip("\r\n") for ln in lines[start:]]
    first_line = start + 1  # the line number of body[0] in the file
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
            body, first_line = body[first + 1:], first_line + first + 1

    status_reason = ""
    last_train = None  # nearest preceding train line: gives tokens/FLOPs to the val lines
    in_data = False  # every start (a resume too) logs its data files as one block of lines
    for number, ln in enumerate(body, first_line):
        m = DATA_RE.match(ln)
        if m and not in_data:
            run.data.append({"train": [], "val": []})
        if m:
            run.data[-1][m["kind"]].append(m["fp"])
        in_data = bool(m)
        parsed = parse_step_line(ln)
        if parsed:
            step, total, f = parsed
            run.total_steps = total
            point = dict(step=step, train_time_ms=f.get("train_time"),
                         tokens=f.get("tokens"), flops=f.get("flops"), phase=f.get("phase"))
            if not all(isinstance(f.get(k, 0.0), (int, float)) for k in ("val_loss", "train_loss", "train_time")):
                run.unreadable.append((number, ln))  # a non-numeric loss/time: an edited or damaged line
                continue
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
        if run.fmt == "ours" and ln.startswith("step:"):  # our step lines all parse; this one is damaged
            run.unreadable.append((number, ln))
        elif ln.startswith("status:"):
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

    run.reason = incomplete_reason(run, lines, truncated, status_reason)
    return run


def incomplete_reason(run, lines, truncated, status_reason):
    """Why a parsed run does not count ("" if it does): our logs need status:complete; every log
    needs its last val line at step N of N, with a finite loss."""
    if not lines:
        return "empty file (0 bytes)"
    if truncated:
        return "log ends inside its source snapshot"
    if run.fmt == "ours" and not run.status:
        return "no status line (truncated, crashed or killed)"
    if run.fmt == "ours" and run.status != "complete":
        return f"status:{run.status}" + (f" reason:{status_reason}" if status_reason else "")
    if not run.val:
        return "no val_loss line"
    if run.val[-1]["step"] != run.total_steps:
        damaged = f" (line {run.unreadable[-1][0]} is a step line that cannot be read)" if run.unreadable else ""
        return f"last val_loss line is at step {run.val[-1]['step']} of {run.total_steps}{damaged}"
    if not math.isfinite(run.final["val_loss"]):  # a diverged run: its nan/inf would poison the mean
        return f"non-finite final val loss ({run.final['val_loss']})"
    return ""


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


def file_digest(path):
    """sha256 of a file's bytes (a copy of a log elsewhere is the same run), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def collect(paths, group_by="auto", warn=None, pool_train_data=False):
    """Parse every log named by ``paths`` (files, or folders of ``*.txt``); runs in a stable order.

    Groups are then split by ``split_mixed_groups(runs, warn, pool_train_data)``.

    A log that cannot be read (``OSError``: a folder named ``*.txt``, a symlink loop, no
    permission) becomes an incomplete run with reason ``unreadable: ...`` and is reported through
    ``warn(message)`` if given, as are a log named twice or a byte-identical copy of one of our
    logs already read (counted once) and step lines that cannot be parsed (skipped). Raises
    FileNotFoundError for a path that does not exist.
    """
    runs, seen, seen_content = [], set(), {}
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
            mode = os.stat(f).st_mode if os.path.exists(f) else 0
            if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):  # reading it would block forever
                if warn:
                    warn(f"{f}: not a regular file (a FIFO or device), skipped")
                continue
            group = group_of(f, as_folder, group_by)
            try:
                runs.append(parse_log(f, group))
            except OSError as e:
                runs.append(unreadable_run(f, group, e))
                if warn:
                    warn(f"cannot read {f} ({runs[-1].reason[len('unreadable: '):]}); "
                         "listed as unreadable, not counted")
                continue
            if not is_log(runs[-1]):
                runs.pop()
                if warn:
                    warn(f"{f}: not a train_gpt.py or modded-nanogpt log; skipped")
                continue
            digest = file_digest(f) if runs[-1].fmt == "ours" else None  # ours hold a run id and start time:
            if digest is not None and digest in seen_content:            # equal bytes can only be a copy
                runs.pop()
                if warn:
                    warn(f"{f}: the same bytes as {seen_content[digest]} (a copy); counted once")
                continue
            seen_content.setdefault(digest, f)
            if runs[-1].unreadable and warn:
                number, text = runs[-1].unreadable[0]
                warn(f"{f}: {len(runs[-1].unreadable)} step line(s) cannot be read and are skipped "
                     f"(line {number}: {text[:80]!r})")
    split_mixed_groups(runs, warn, pool_train_data)
    return runs


# ----------------------------------------------------------------------------------------------
# Runs that measured different things are never pooled

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_gpt.py")


def operational_fields(path=TRAINER):
    """``train_gpt.OPERATIONAL``: the config fields that change how a run executes, not what it computes.

    Read from the trainer's source with ``ast`` (its literal set, never run: importing train_gpt would import
    torch, seconds per call), only when a log has a config line. Raises ImportError naming the file when it
    cannot be read or holds no literal ``OPERATIONAL = frozenset({...})``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            body = ast.parse(f.read()).body
    except (OSError, SyntaxError, ValueError) as e:
        raise ImportError(f"cannot read {path} ({e})") from None
    for node in body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "OPERATIONAL" for t in node.targets):
            value = node.value.args[0] if isinstance(node.value, ast.Call) and node.value.args else node.value
            try:
                return frozenset(ast.literal_eval(value))
            except ValueError:
                break
    raise ImportError(f"{path} holds no literal OPERATIONAL = frozenset({{...}})")


def run_defining(config, operational):
    """The fields of a logged config that define the run: all but the operational ones and the seed.

    Decided from the log's own config, not from ``train_gpt.RUN_DEFINING`` (the fields of today's
    Config): a field that today's trainer does not know (a log of an older or newer trainer) then
    still keeps runs apart instead of being ignored, which errs towards two groups, never
    towards pooling two different experiments. It is the rule ``--resume`` applies, less the seed.
    """
    return {k: v for k, v in config.items() if k not in operational and k != "seed"}


DATA_KINDS = ("train data", "val data")
CODE = "code "  # a split's entry for a source file: "code <file name>"


def data_identity(run):
    """``{"train data": key, "val data": key}``: what data the run read, by content, not by path.

    A key is the tuple, over the run's starts (a resume logs its data again), of the ordered
    fingerprints of that start's ``data <kind>:`` lines, equal consecutive starts merged; None
    when the log has no data line. Two runs read the same data when their keys are equal: the
    comparison ``--resume`` makes between a checkpoint and a restart.
    """
    out = {}
    for kind in DATA_KINDS:
        starts = [tuple(d[kind.split()[0]]) for d in run.data]
        out[kind] = tuple(x for i, x in enumerate(starts) if i == 0 or x != starts[i - 1]) or None
    return out


def data_labels(keys):
    """Short distinct names of ``data_identity`` keys: the fingerprint of a run's single shard, else
    a sha256 of its ordered fingerprints; 8 hex digits unless those would name two keys alike."""
    def name(key, n):
        if key is None:
            return "<missing>"
        if len(key) == 1 and len(key[0]) == 1:
            return key[0][0][:n]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:n]
    for n in (8, 64):
        names = {k: name(k, n) for k in keys}
        if len(set(names.values())) == len(names):
            break
    return names


def code_identity(run, names):
    """``{"code <name>": key}`` of a run's source snapshot for each file name in ``names``: the key is
    ``((sha256,),)`` from the file's ``### file`` header (the shape ``data_labels`` names), None
    when the snapshot lacks the file."""
    return {CODE + n: ((run.snapshot[n],),) if n in run.snapshot else None for n in names}


def split_mixed_groups(runs, warn=None, pool_train_data=False):
    """Split every group whose runs differ in a run-defining config field, their code or their data; renames ``run.group``.

    The runs of a group ``g`` that differ in fields ``f1, f2`` go to groups named
    ``g [f1=v1 f2=v2]`` (their own values; ``<missing>`` for a field a log lacks); runs whose
    source snapshots differ in a file (its ``### file`` header's sha256) add ``code <file> <sha>``
    (``<missing>`` for a file a snapshot lacks); runs that read other data (``data_identity``;
    paths alone do not count) add ``train data <id>`` or ``val data <id>`` (``data_labels``).
    Complete runs without a config line (modded-nanogpt logs) mixed with ours go to
    ``g [no config line]``. Each split is reported through ``warn(message)``, naming the fields
    and files. Runs without a config line alone are grouped as given.
    With ``pool_train_data`` other training data alone splits nothing (the benchmark's data orders:
    the spread over them is part of what the group measures); other val data still does.
    Returns the list of ``(group, fields)`` that were split (data as ``train data``/``val data``,
    source files as ``code <file>``).
    """
    kinds = [k for k in DATA_KINDS if not (pool_train_data and k == "train data")]
    operational = None
    split = []
    for g in list(dict.fromkeys(r.group for r in runs)):
        members = [r for r in runs if r.group == g]
        configured = [r for r in members if r.config]
        if not configured:
            continue
        if operational is None:
            operational = operational_fields()
        defs = {id(r): run_defining(r.config, operational) for r in configured}
        keys = sorted({k for d in defs.values() for k in d})
        differ = [k for k in keys if len({json.dumps(d.get(k, "<missing>")) for d in defs.values()}) > 1]
        code = sorted({n for r in configured for n in r.snapshot})  # none: logs without a snapshot, as given
        data = {id(r): {**code_identity(r, code), **data_identity(r)} for r in configured}
        labels = {kind: data_labels({d[kind] for d in data.values()}) for kind in data[id(configured[0])]}
        differ += [CODE + n for n in code if len(labels[CODE + n]) > 1]
        differ += [kind for kind in kinds if len(labels[kind]) > 1]
        if warn and pool_train_data and len(labels["train data"]) > 1:
            warn(f"group {g}: pools runs on {len(labels['train data'])} different training data (--pool-train-data)")
        bare = any(r.complete and not r.config for r in members)
        if not differ and not bare:
            continue
        for r in members:
            if not r.config:
                r.group = f"{g} [no config line]"
            elif differ:
                r.group = g + " [" + " ".join(f"{k} {labels[k][data[id(r)][k]]}" if k in labels else
                                              f"{k}={defs[id(r)].get(k, '<missing>')}" for k in differ) + "]"
        split.append((g, differ))
        if warn:
            why = f"differ in {', '.join(differ)}" if differ else "mix logs with and without a config line"
            parts = ", ".join(dict.fromkeys(r.group for r in members))
            hint = ("; --pool-train-data keeps them in one group where the data order is part of the noise "
                    "measured" if differ == ["train data"] else "")
            if any(k.startswith(CODE) for k in differ):
                hint += "; records/verify.py LOG names the first line where a log's code differs from the working tree"
            warn(f"group {g}: its runs {why} (they measured different things); split into {parts}{hint}")
    return split


def _mean_if_all(values):
    """Mean of the values if every one is known, else None (a mean over some runs would mislead)."""
    if not values or any(v is None or isinstance(v, str) for v in values):
        return None
    return sum(values) / len(values)


def _std(values):
    """Sample standard deviation (ddof=1), nan for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))


# where a val curve reaches the target: (key of a val point, JSON name of the per-run list, column)
TO_TARGET = (("train_time_ms", "time_to_target_ms", "train_time"), ("step", "step_to_target", "step"),
             ("tokens", "tokens_to_target", "tokens"), ("flops", "flops_to_target", "flops"))


def reach_target(val, target):
    """Where a val curve first reaches ``target`` (val_loss <= target), or None if it never does.

    ``val``: a run's val points (dicts with ``val_loss`` and the ``TO_TARGET`` keys), in step
    order; non-finite losses are left out. Between the last point above the target and the first
    at or below it, every ``TO_TARGET`` key is interpolated linearly in the loss (the speedrun's
    time to target between two val lines); a key that either point lacks is None. Returns a dict
    of the ``TO_TARGET`` keys (floats; the step may be fractional).
    """
    points = [p for p in val if isinstance(p["val_loss"], (int, float)) and math.isfinite(p["val_loss"])]
    for i, p in enumerate(points):
        if p["val_loss"] > target:
            continue
        q = points[i - 1] if i else p
        w = (q["val_loss"] - target) / (q["val_loss"] - p["val_loss"]) if i else 1.0
        out = {}
        for key, _, _ in TO_TARGET:
            a, b = q.get(key), p.get(key)
            known = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b))
            out[key] = float(a + w * (b - a)) if known else None
        return out
    return None


def _to_target_stats(done, target):
    """Per-run time/step/tokens/FLOPs to the target, and their mean and std over the runs that reached it.

    JSON fields: ``reached_target`` (how many runs did), per ``TO_TARGET`` name the per-run list
    (None: not reached, or the log lacks that quantity) and ``mean_<name>``, ``std_<name>``
    (None/nan unless every run that reached the target has the quantity).
    """
    hits = [h for h in (reach_target(r.val, target) for r in done)]
    reached = [h for h in hits if h is not None]
    out = dict(reached_target=len(reached))
    for key, name, _ in TO_TARGET:
        out[name] = [None if h is None else h[key] for h in hits]
        values = [h[key] for h in reached]
        out["mean_" + name] = _mean_if_all(values)
        out["std_" + name] = _std(values) if out["mean_" + name] is not None else math.nan
    return out


def p_below(losses, target):
    """One-sided one-sample t-test that the mean of ``losses`` is below ``target``: its p-value.

    ``scipy.stats.ttest_1samp(losses, target, alternative="less").pvalue`` as a float; nan for
    fewer than two losses (no spread to test against) or a non-finite loss among them.
    """
    from scipy import stats  # imported here so that parsing alone needs no scipy

    if len(losses) < 2:
        return math.nan
    with warnings.catch_warnings():  # scipy warns when the losses agree to many digits; the result holds
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_1samp(losses, target, alternative="less").pvalue)


# ----------------------------------------------------------------------------------------------
# First-passing step: the earliest val step at which a group's mean clears the target

PASS_ALPHA = 0.01  # ttest: one-sided p below this (modded-nanogpt README, rules of the main track)
Z_SIGMA = 0.0013  # ztest: the per-run std of the val loss taken as known (modded-nanogpt optimization track)
Z_MARGIN = 0.004  # ztest: pass when (target - mean) * sqrt(n) >= this (= 3.08 sigma: one-sided p 0.001)
RULES = ("ttest", "ztest")


@dataclasses.dataclass(frozen=True)
class PassRule:
    """How a group's val losses at one step are judged against the target (``--rule`` and its flags).

    ``ttest``: the one-sided t-test of ``p_below`` at p < ``alpha`` (two runs at least).
    ``ztest``: ``(target - mean) * sqrt(n) >= margin``; with the known per-run std ``sigma``
    that is ``z = (target - mean) * sqrt(n) / sigma >= margin / sigma``, and ``z`` and its
    one-sided p ``1 - Phi(z)`` are reported (sigma changes them, not the decision).
    """
    name: str = "ttest"
    alpha: float = PASS_ALPHA
    sigma: float = Z_SIGMA
    margin: float = Z_MARGIN

    def judge(self, losses, target):
        """``(passed, p, z)`` for the val losses of a group's runs at one step (z is None for ttest)."""
        from scipy import stats

        n, mean = len(losses), sum(losses) / len(losses)
        if self.name == "ttest":
            p = p_below(losses, target)
            return p < self.alpha, p, None  # nan (one run, a nan loss) never passes
        gap = (target - mean) * math.sqrt(n)
        z = gap / self.sigma
        # 1e-12: the losses are 4-decimal prints; a gap equal to the margin passes
        return bool(gap >= self.margin - 1e-12), float(stats.norm.sf(z)), z

    def __str__(self):
        if self.name == "ttest":
            return f"one-sided t-test, p < {self.alpha:g}"
        return (f"z-test, sigma {self.sigma:g}: (target - mean) * sqrt(n) >= {self.margin:g}, "
                f"i.e. z >= {self.margin / self.sigma:.2f}")


def shared_val_steps(done):
    """The val steps every run of ``done`` logged, and the runs that lack some another one logged.

    Returns ``(steps, short)``: the sorted common steps, and ``{run name: [steps it lacks]}`` for
    each run without all the steps of the union (empty when every run logged the same steps).
    """
    logged = {r.name: {p["step"] for p in r.val} for r in done}
    if not logged:
        return [], {}
    union, common = set().union(*logged.values()), set.intersection(*logged.values())
    short = {name: sorted(union - steps) for name, steps in logged.items() if union - steps}
    return sorted(common), short


def first_passing(done, target, rule):
    """The earliest val step at which the mean val loss of the runs ``done`` passes ``rule`` (a ``PassRule``).

    Only the steps every run logged count (``shared_val_steps``). Returns the JSON fields
    ``first_passing_step`` (int, or None: no step passes), ``first_passing_val_loss`` (the
    runs' mean there), ``first_passing_p`` and ``first_passing_z`` (of ``rule.judge``), the
    mean ``first_passing_train_time_ms``, ``first_passing_tokens`` and ``first_passing_flops``
    over the runs at that val line (None unless every run logs it), ``first_passing_runs``,
    ``first_passing_rule`` (``ttest``/``ztest``), ``first_passing_rule_text`` (the rule in words) and
    ``val_steps_missing`` (``{run: [steps]}``, the runs that lack steps another run logged).
    """
    steps, short = shared_val_steps(done)
    out = dict(first_passing_step=None, first_passing_val_loss=None, first_passing_p=None, first_passing_z=None,
               first_passing_train_time_ms=None, first_passing_tokens=None, first_passing_flops=None,
               first_passing_runs=len(done), first_passing_rule=rule.name, first_passing_rule_text=str(rule),
               val_steps_missing=short)
    at = [{p["step"]: p for p in r.val} for r in done]
    for step in steps:
        points = [a[step] for a in at]
        losses = [p["val_loss"] for p in points]
        passed, p, z = rule.judge(losses, target)
        if passed:
            out.update(first_passing_step=step, first_passing_val_loss=sum(losses) / len(losses),
                       first_passing_p=p, first_passing_z=z,
                       first_passing_train_time_ms=_mean_if_all([q["train_time_ms"] for q in points]),
                       first_passing_tokens=_mean_if_all([q["tokens"] for q in points]),
                       first_passing_flops=_mean_if_all([q["flops"] for q in points]))
            break
    return out


def per_step_stats(done):
    """The val loss at each val step every run of ``done`` logged (``shared_val_steps``): a list of dicts
    ``step``, ``runs``, ``mean``, ``std`` (sample, ddof=1; nan for one run), ``min``, ``max``."""
    steps, _ = shared_val_steps(done)
    at = [{p["step"]: p["val_loss"] for p in r.val} for r in done]
    out = []
    for step in steps:
        losses = [a[step] for a in at]
        out.append(dict(step=step, runs=len(losses), mean=sum(losses) / len(losses), std=_std(losses),
                        min=min(losses), max=max(losses)))
    return out


def per_step_block(rows, markdown=False):
    """The ``--per-step`` table: one line per group and shared val step."""
    body = [[r["group"], str(q["step"]), str(q["runs"]), f"{q['mean']:.4f}", _num(q["std"], ".4f"),
             f"{q['min']:.4f}", f"{q['max']:.4f}"] for r in rows for q in r["val_by_step"]]
    return render(["group", "step", "runs", "mean_val_loss", "std", "min", "max"], body, markdown)


def group_stats(runs, target=3.28, rule=None, per_step=False):
    """One dict per group (in order of first appearance): the columns of the table / JSON.

    Final val loss statistics over the complete runs (mean, sample std, the one-sided
    ``p_below`` p-value against ``target``), their mean train time, tokens and FLOPs, and where
    each run first reaches ``target`` (``reach_target``; lists in ``run_names`` order, None where
    not reached). With ``rule`` (a ``PassRule``), also the group's ``first_passing`` fields; with
    ``per_step``, ``val_by_step`` (``per_step_stats``).
    """
    out = []
    for g in dict.fromkeys(r.group for r in runs):
        members = [r for r in runs if r.group == g]
        done = [r for r in members if r.complete]
        losses = [r.final["val_loss"] for r in done]
        n = len(losses)
        p = p_below(losses, target)
        steps = sorted({r.total_steps for r in done})
        row = dict(
            group=g, runs=n,
            incomplete=[f"{r.name} ({r.reason})" for r in members if not r.complete],
            mean_val_loss=sum(losses) / n if n else math.nan, std_val_loss=_std(losses), p_value=p,
            target=target,
            mean_train_time_ms=_mean_if_all([r.final["train_time_ms"] for r in done]) if n else None,
            steps=steps[0] if len(steps) == 1 else (steps or None),
            tokens=_mean_if_all([r.raw_tokens for r in done]),
            flops=_mean_if_all([r.flops for r in done]),
            val_losses=losses, run_names=[r.name for r in done], val_setup=group_val_setup(done))
        row.update(_to_target_stats(done, target))
        if rule is not None:
            row.update(first_passing(done, target, rule))
        if per_step:
            row["val_by_step"] = per_step_stats(done)
        out.append(row)
    return out


# Config fields that decide what a final val loss measures (on which tokens, at which context, over which
# ids), besides the val data's fingerprints and any non-operational ``val_*`` field (the val protocol).
VAL_DECIDING = ("val_tokens", "seq_len", "vocab_size")
VAL_OPERATIONAL = ("val_files", "val_every", "val_batch_seqs")  # where the shards are, how often, batch size


def val_setup(run):
    """``{field: value}`` of what decides ``run``'s val loss (``VAL_DECIDING``, other ``val_*`` config fields,
    ``val data`` by fingerprints); a field the log does not record is left out (unknown, not different)."""
    cfg = run.config or {}
    out = {k: cfg[k] for k in VAL_DECIDING if k in cfg}
    out.update({k: v for k, v in cfg.items() if k.startswith("val_") and k not in VAL_OPERATIONAL})
    fp = data_identity(run)["val data"]
    if fp is not None:
        out["val data"] = data_labels({fp})[fp]
    return out


def group_val_setup(runs):
    """``{field: value}`` shared by ``runs`` (``val_setup``); a field on which they disagree gets the list of
    their values (only with --pool-train-data can a group hold such runs: other val data splits it)."""
    setups = [val_setup(r) for r in runs]
    out = {}
    for k in dict.fromkeys(k for s in setups for k in s):
        values = list(dict.fromkeys(json.dumps(s[k]) for s in setups if k in s))
        out[k] = json.loads(values[0]) if len(values) == 1 else [json.loads(v) for v in values]
    return out


def val_differences(base, row):
    """``["field: baseline value vs group value", ...]`` for the fields of ``val_setup`` known on both sides
    that differ between two ``group_stats`` rows: a difference of their val losses measures nothing."""
    a, b = base.get("val_setup") or {}, row.get("val_setup") or {}
    return [f"{k}: {a[k]} vs {b[k]}" for k in a if k in b and json.dumps(a[k]) != json.dumps(b[k])]


def val_setup_warning(rows):
    """Without a baseline: one line naming each field of ``val_setup`` on which the groups disagree (with
    each group's value), or None when they agree: side by side, such val losses measure different things."""
    fields = {}
    for r in rows:
        for k, v in (r.get("val_setup") or {}).items():
            fields.setdefault(k, {})[r["group"]] = json.dumps(v)
    differ = ["{}: {}".format(k, ", ".join(f"{v} ({g})" for g, v in by.items()))
              for k, by in fields.items() if len(set(by.values())) > 1]
    if not differ:
        return None
    return ("the groups differ in what decides the val loss (" + "; ".join(differ) + "): their val losses "
            "measure different things and are not comparable")


def welch(base, other):
    """Welch's t-test of ``mean(other) - mean(base)`` (final val losses, two lists of floats).

    Returns the JSON fields ``delta_mean``, ``delta_ci95`` ([low, high], the 95% confidence
    interval of the difference with the Welch-Satterthwaite degrees of freedom), ``p_welch``
    (two-sided) and ``welch_dof``, from ``scipy.stats.ttest_ind(other, base, equal_var=False)``
    and its ``confidence_interval(0.95)``. With fewer than two runs in a group, or no spread in
    either, the test cannot be made: CI, p and dof are None and ``welch_note`` says why.
    """
    from scipy import stats

    delta = sum(other) / len(other) - sum(base) / len(base) if base and other else math.nan
    out = dict(delta_mean=delta, delta_ci95=None, p_welch=math.nan, welch_dof=math.nan)
    if len(base) < 2 or len(other) < 2:
        out["welch_note"] = (f"Welch's t-test needs at least two complete runs in each group "
                             f"(this group has {len(other)}, the baseline {len(base)})")
    elif _std(base) == 0 and _std(other) == 0:
        out["welch_note"] = "every run of both groups has the same final val loss: no spread to test against"
    else:
        with warnings.catch_warnings():  # scipy warns when values agree to many digits; the result holds
            warnings.simplefilter("ignore", RuntimeWarning)
            res = stats.ttest_ind(other, base, equal_var=False)
            ci = res.confidence_interval(0.95)
        out.update(delta_ci95=[float(ci.low), float(ci.high)], p_welch=float(res.pvalue), welch_dof=float(res.df))
    return out


# ratios to the baseline: (row key, JSON name)
RATIOS = (("mean_train_time_ms", "train_time_ratio"), ("flops", "flops_ratio"), ("tokens", "tokens_ratio"),
          ("mean_time_to_target_ms", "time_to_target_ratio"))


def add_baseline(rows, baseline):
    """Add to every row but the baseline's its Welch test against it and the ratios of ``RATIOS``.

    ``rows``: ``group_stats`` output, changed in place; ``baseline``: a group name, a folder path
    (its last part names the group), or the start of exactly one group's name (peer-log groups are
    long). Groups that differ in what decides the val loss (``val_differences``: val tokens, seq len, val
    protocol, vocabulary, val data) get no difference, CI, p-value or time-to-target ratio, and a ``welch_note``
    naming the fields. A ratio is None when either side is
    unknown (or the baseline's is 0); that of the time to target also unless every run of both
    groups reached the target. Returns the baseline's group name. Raises KeyError (its
    message lists the groups) when no group, or more than one, matches.
    """
    exact = [r for r in rows if r["group"] in (baseline, os.path.basename(os.path.normpath(baseline)))]
    found = exact or [r for r in rows if r["group"].startswith(baseline)]
    if len(found) != 1:
        what = "more than one group starts with" if found else "no group is named"
        raise KeyError(f"{what} {baseline!r}; the groups are: " + ", ".join(r["group"] for r in rows))
    base = found[0]
    for r in rows:
        if r is base:
            continue
        r["baseline"] = base["group"]
        differ = val_differences(base, r)
        if differ:  # other val tokens, context, vocabulary or data: no number on the difference
            r.update(delta_mean=None, delta_ci95=None, p_welch=None, welch_dof=None, val_differs=differ,
                     welch_note=f"not compared with the baseline: the groups differ in what decides the val loss "
                                f"({'; '.join(differ)}); no difference, CI or p-value")
        else:
            r.update(welch(base["val_losses"], r["val_losses"]))
        for key, name in RATIOS:
            a, b = base[key], r[key]
            r[name] = b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        if differ or not all(x["runs"] and x["reached_target"] == x["runs"] for x in (base, r)):
            r["time_to_target_ratio"] = None  # a mean over the runs that got there is biased low: no ratio of two
        if "first_passing_step" in base:
            r.update(passing_saved(base, r) if not differ else
                     dict(steps_saved=None, time_saved_ms=None, passing_note="no saving: " + r["welch_note"]))
    return base["group"]


def passing_saved(base, row):
    """What ``row``'s group saves against the baseline's first-passing step (``first_passing`` rows).

    Returns the JSON fields ``steps_saved`` (baseline's first-passing step minus the group's:
    positive = fewer steps) and ``time_saved_ms`` (the same for the mean train time there; None
    unless both are known), both None with a ``passing_note`` when either group never passes.
    """
    never = [x["group"] for x in (row, base) if x["first_passing_step"] is None]
    if never:
        return dict(steps_saved=None, time_saved_ms=None,
                    passing_note=f"no saving: {' and '.join(never)} never pass{'es' * (len(never) == 1)} "
                                 "at the val steps logged")
    a, b = base["first_passing_train_time_ms"], row["first_passing_train_time_ms"]
    return dict(steps_saved=base["first_passing_step"] - row["first_passing_step"],
                time_saved_ms=a - b if a is not None and b is not None else None)


def _jsonable(x):
    """NaN -> None so that the output is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------
# Tables

def render(head, body, markdown=False):
    """Rows of strings as an aligned text table (first column left, the rest right) or Markdown."""
    if markdown:
        esc = [[c.replace("|", "\\|") for c in row] for row in [head] + body]
        return "\n".join(["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(row) + " |" for row in esc[1:]])
    width = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, width)))
             for row in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in width))
    return "\n".join(lines)


def _num(x, fmt):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _spread(mean, std, fmt, unit=""):
    """``mean ± std`` with a unit; ``mean`` alone without a std; ``-`` when unknown."""
    if mean is None:
        return "-"
    text = format(mean, fmt) + unit
    return text if math.isnan(std) else f"{text} ± {format(std, fmt)}{unit}"


def main_table(rows, markdown=False):
    """The per-group table: runs, final val loss statistics, train time, steps, tokens, FLOPs."""
    target = rows[0]["target"] if rows else 3.28
    head = ["group", "runs", "incompl", "mean_val_loss", "std", f"p(mean<{target})",
            "mean_train_time", "steps", "tokens", "flops"]
    body = []
    for r in rows:
        t, steps = r["mean_train_time_ms"], r["steps"]
        body.append([r["group"], str(r["runs"]), str(len(r["incomplete"])),
                     _num(r["mean_val_loss"], ".4f"), _num(r["std_val_loss"], ".4f"), _num(r["p_value"], ".3g"),
                     "-" if t is None else f"{t:.0f}ms ({t / 60000:.2f}min)",
                     "-" if steps is None else (str(steps) if isinstance(steps, int) else ",".join(map(str, steps))),
                     _num(r["tokens"], ".4g"), _num(r["flops"], ".4g")])
    return render(head, body, markdown)


def target_table(rows, markdown=False):
    """Where the runs first reach the target: how many did, and the mean ± std over those of the
    train time, step, tokens and FLOPs at that point."""
    head = ["group", "reached", "train_time", "step", "tokens", "flops"]
    body = []
    for r in rows:
        t, s = r["mean_time_to_target_ms"], r["std_time_to_target_ms"]
        body.append([r["group"], f"{r['reached_target']}/{r['runs']}",
                     _spread(None if t is None else t / 1000, s / 1000, ".2f", "s"),
                     _spread(r["mean_step_to_target"], r["std_step_to_target"], ".0f"),
                     _spread(r["mean_tokens_to_target"], r["std_tokens_to_target"], ".4g"),
                     _spread(r["mean_flops_to_target"], r["std_flops_to_target"], ".4g")])
    return render(head, body, markdown)


def baseline_table(rows, markdown=False):
    """Every group against the baseline: difference, its 95% CI, Welch's p, and the ratios."""
    head = ["group", "delta_mean", "95% CI", "p(Welch)", "train_time", "flops", "tokens", "time_to_target"]
    body = []
    for r in rows:
        if "baseline" not in r:
            continue
        ci = r["delta_ci95"]
        body.append([r["group"], _num(r["delta_mean"], "+.4f"),
                     "-" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]", _num(r["p_welch"], ".3g")]
                    + [_num(r[name], ".3f") + ("x" if r[name] is not None else "") for _, name in RATIOS])
    return render(head, body, markdown)


def passing_table(rows, markdown=False):
    """Per group: its first-passing step (or never), the mean val loss, p (and z) there, the mean
    train time, tokens and FLOPs at that val line, and against a baseline the steps and time saved."""
    based = any("steps_saved" in r for r in rows)
    z = rows[0]["first_passing_rule"] == "ztest"
    head = ["group", "runs", "first_passing_step", "mean_val_loss", "p"] + ["z"] * z
    head += ["train_time", "tokens", "flops"] + ["steps_saved", "time_saved"] * based
    body = []
    for r in rows:
        t = r["first_passing_train_time_ms"]
        row = [r["group"], str(r["first_passing_runs"]),
               "never" if r["first_passing_step"] is None else str(r["first_passing_step"]),
               _num(r["first_passing_val_loss"], ".4f"), _num(r["first_passing_p"], ".3g")]
        row += [_num(r["first_passing_z"], ".2f")] * z
        row += ["-" if t is None else f"{t / 1000:.2f}s", _num(r["first_passing_tokens"], ".4g"),
                _num(r["first_passing_flops"], ".4g")]
        if based:
            saved = r.get("time_saved_ms")
            row += ["-" if r.get("steps_saved") is None else f"{r['steps_saved']:+d}",
                    "-" if saved is None else f"{saved / 1000:+.2f}s"]
        body.append(row)
    return render(head, body, markdown)


def passing_block(rows, markdown=False):
    """The first-passing table with its heading, and the notes on savings that cannot be computed."""
    bullet, gap = ("* ", "\n\n") if markdown else ("  ", "\n")
    target = rows[0]["target"]
    notes = [f"{bullet}{r['group']}: {r['passing_note']}" for r in rows if r.get("passing_note")]
    base = next((r["baseline"] for r in rows if "baseline" in r), None)
    saved = (f"; saved against the baseline {base}: its first-passing step (and mean train time there) minus "
             "the group's" if base else "")
    return (f"first-passing step: the earliest val step at which the mean val loss of the group's complete runs "
            f"is below {target} by the rule {rows[0]['first_passing_rule_text']} (at the val steps all of them "
            f"logged; train time, tokens and FLOPs: means at that val line){saved}:" + gap
            + passing_table(rows, markdown) + (gap + "\n".join(notes) if notes else ""))


AB_ALPHA = 0.05  # the A/B reading: a difference at two-sided p below this is named a difference


def verdict(row):
    """One sentence reading a group's Welch test against its baseline (``add_baseline``): which way the mean final
    val loss moved, by how much, and whether that stands out of the seed-to-seed noise at p < ``AB_ALPHA``."""
    delta, p, (lo, hi) = row["delta_mean"], row["p_welch"], row["delta_ci95"]
    way = "lower (better)" if delta < 0 else "higher (worse)" if delta > 0 else "equal"
    judged = (f"a real difference at p < {AB_ALPHA:g}" if p < AB_ALPHA else
              f"not distinguishable from seed noise at p < {AB_ALPHA:g} (more seeds, or a larger effect, to tell)")
    return (f"mean final val loss {way} than {row['baseline']}'s by {abs(delta):.4f} (95% CI of the difference "
            f"[{lo:+.4f}, {hi:+.4f}]), Welch p = {p:.3g}: {judged}")


def format_table(rows, markdown=False):
    """Everything the command line prints: the tables, then the incomplete runs (listed, not counted).

    Text (aligned columns) or, with ``markdown``, Markdown tables and lists to paste into a README.
    """
    target = rows[0]["target"] if rows else 3.28
    bullet, gap = ("* ", "\n\n") if markdown else ("  ", "\n")  # Markdown: a table needs a blank line above
    blocks = [main_table(rows, markdown)]
    if any(r["reached_target"] for r in rows):
        blocks.append(f"time to {target} (first val point at or below it, linear interpolation between val "
                      "points; mean ± std over the runs that reached it):" + gap + target_table(rows, markdown))
    else:
        blocks.append(f"time to {target}: no run reached it")
    if rows and "first_passing_step" in rows[0]:
        blocks.append(passing_block(rows, markdown))
    if rows and "val_by_step" in rows[0]:
        blocks.append("val loss at each val step all complete runs of a group logged (mean, sample std, min, max "
                      "over the runs):" + gap + per_step_block(rows, markdown))
    based = [r for r in rows if "baseline" in r]
    if based:
        notes = [f"{bullet}{r['group']}: {r['welch_note'] if r.get('welch_note') else verdict(r)}" for r in based]
        blocks.append(f"against the baseline {based[0]['baseline']}: difference of mean final val loss "
                      "(group - baseline) with the 95% CI and two-sided p of Welch's t-test; ratios group / "
                      "baseline of mean train time, FLOPs, tokens and time to target:" + gap
                      + baseline_table(rows, markdown) + (gap + "\n".join(notes) if notes else ""))
    bad = [f"{bullet}{r['group']}: {name}" for r in rows for name in r["incomplete"]]
    if bad:
        blocks.append("incomplete runs (not counted):" + gap + "\n".join(bad))
    return "\n\n".join(blocks)


# ----------------------------------------------------------------------------------------------
# Plot

X_AXES = {  # --x: point key, axis label
    "time": ("train_time_ms", "train time"),
    "tokens": ("tokens", "raw train tokens read"),
    "flops": ("flops", "training FLOPs (model estimate)"),
    "step": ("step", "step"),
}
SMOOTH_FRAC = 0.1  # a step's train loss swings with its batch's text: running mean over this fraction of the steps


def run_curve(points, key, loss):
    """A run's finite points as numpy arrays ``step``, ``x``, ``y`` (the loss) and ``phase1`` (bool).

    ``points``: ``Run.val`` or ``Run.train``; only points with a number under ``loss`` count.
    ``phase1`` marks the TST phase-1 points (``phase:1``). Returns None when one of them has no
    number under ``key`` (e.g. tokens in a modded-nanogpt log).
    """
    import numpy as np
    pts = [p for p in points if isinstance(p.get(loss), (int, float))]
    if any(not isinstance(p.get(key), (int, float)) for p in pts):
        return None
    pts = [p for p in pts if math.isfinite(p[key]) and math.isfinite(p[loss])]
    return dict(step=np.array([p["step"] for p in pts], dtype=np.int64),
                x=np.array([p[key] for p in pts], dtype=np.float64),
                y=np.array([p[loss] for p in pts], dtype=np.float64),
                phase1=np.array([p.get("phase") == 1 for p in pts], dtype=bool))


def smooth(y, window, segments):
    """Centered running mean of ``y`` over ``window`` points (fewer at the ends), within each segment.

    ``segments``: a label per point (e.g. the TST phase); the mean never mixes two labels.
    """
    import numpy as np
    out = np.array(y, dtype=np.float64)
    if window <= 1:
        return out
    kernel, lo = np.ones(window), (window - 1) // 2
    for label in np.unique(segments):
        m = segments == label
        n = int(m.sum())
        # the full convolution, sliced: numpy's "same" is as long as the kernel when a segment is shorter
        out[m] = (np.convolve(out[m], kernel, "full")[lo:lo + n]
                  / np.convolve(np.ones(n), kernel, "full")[lo:lo + n])
    return out


def mean_curve(curves):
    """The mean curve of one group's runs and its spread, at the steps every run has.

    ``curves``: ``run_curve`` dicts. Returns a dict with ``x`` and ``y`` (means over the runs:
    their train times differ a little between seeds), ``std`` (sample std of y, ddof=1),
    ``step`` and ``phase1`` (of the first run), or None when fewer than two steps are shared.
    """
    import numpy as np
    common = sorted(set.intersection(*(set(c["step"].tolist()) for c in curves)))
    if len(common) < 2:
        return None
    idx = [np.searchsorted(c["step"], common) for c in curves]
    xs = np.stack([c["x"][i] for c, i in zip(curves, idx)])
    ys = np.stack([c["y"][i] for c, i in zip(curves, idx)])
    return dict(step=np.array(common), x=xs.mean(0), y=ys.mean(0), std=ys.std(0, ddof=1),
                phase1=curves[0]["phase1"][idx[0]])


def _line(ax, c, scale, faint_phase1, **kw):
    """Draw a curve (and its ±1 std band if it has one); with ``faint_phase1`` its TST phase-1 part
    (a bag loss, not next-token CE) faint and dashed, without a band."""
    x, y = c["x"] / scale, c["y"]
    p1 = c["phase1"] if faint_phase1 else c["phase1"] & False  # val in phase 1 is next-token CE: drawn plain
    if p1.any():
        end = min(int(p1.nonzero()[0].max()) + 2, len(x))  # up to the first phase-2 point: no gap
        ax.plot(x[:end], y[:end], **dict(kw, label=None, alpha=0.35, ls="--"))
    ax.plot(x[~p1], y[~p1], **kw)
    if "std" in c:
        ax.fill_between(x[~p1], (y - c["std"])[~p1], (y + c["std"])[~p1], color=kw["color"], alpha=0.2, lw=0)


def draw_panel(ax, runs, curves, colour, scale, train=False):
    """One panel: per group the mean curve with a ±1 std band over its complete runs (a single run:
    its own line), incomplete runs dotted; labelled for the legend in the val panel only (the train
    panel shares its colours). Returns the y values to fit the range to: the val curves after their
    first point; the train curves after the first tenth of the steps, TST phase 1 left out.
    """
    import numpy as np
    fit = []
    for g in dict.fromkeys(r.group for r in runs):
        done = [curves[id(r)] for r in runs if r.group == g and r.complete and id(r) in curves]
        rest = [(r, curves[id(r)]) for r in runs if r.group == g and not r.complete and id(r) in curves]
        m = mean_curve(done) if len(done) > 1 else None
        shown = [m] if m else done
        for i, c in enumerate(shown):
            label = None if i or train else (f"{g} (mean ± 1 std of {len(done)} runs)" if m else
                                             f"{g} ({len(done)} complete run{'s' * (len(done) != 1)})")
            _line(ax, c, scale, train, color=colour[g], lw=1.6 if m else 1.2, label=label,
                  marker="o" if not train and len(c["x"]) <= 30 else None, ms=3)  # few val points: show them
        for i, (r, c) in enumerate(rest):
            _line(ax, c, scale, train, color=colour[g], lw=1.0, ls=":", alpha=0.6,
                  label=None if done or i or train else f"{g} (incomplete)")
        for c in shown + [c for _, c in rest]:
            keep = (c["step"] >= 0.1 * c["step"].max()) & ~c["phase1"] if train else np.arange(len(c["y"])) >= 1
            std = c.get("std", 0.0)
            fit += [(c["y"] - std)[keep], (c["y"] + std)[keep]]
    return np.concatenate(fit) if fit else np.zeros(0)


def _train_curves(runs, drawn, key):
    """Smoothed train-loss curves of the runs whose val curve is drawn and whose train lines have ``key``."""
    out = {}
    for r in runs:
        c = run_curve(r.train, key, "train_loss") if id(r) in drawn else None
        if c is not None and len(c["y"]) > 1:
            c["y"] = smooth(c["y"], max(1, round(SMOOTH_FRAC * len(c["y"]))), c["phase1"])
            out[id(r)] = c
    return out


def _val_curves(runs, key, x):
    """Val curves of the runs that can be drawn against ``x``, and notes on those left out."""
    curves, notes = {}, []
    for r in runs:
        where = f"{r.name} ({r.group})"
        c = run_curve(r.val, key, "val_loss") if r.val else None
        if not r.val:
            notes.append(f"plot: skipped {where}: {r.reason or 'no val_loss line'}")
        elif c is None:
            notes.append(f"plot: skipped {where}: its val lines have no {x} values")
        elif not len(c["y"]):  # nan/inf points cannot be drawn and would break the axis limits
            notes.append(f"plot: skipped {where}: no finite val point")
        else:
            k = len(r.val) - len(c["y"])
            if k:
                notes.append(f"plot: {where}: left out {k} non-finite point{'s' * (k != 1)}")
            curves[id(r)] = c
    return curves, notes


def _fit_ylim(ax, ys):
    """Fit the y range to ``ys`` with a margin; returns (low, high)."""
    lo, hi = (float(ys.min()), float(ys.max())) if len(ys) else (0.0, 1.0)
    pad = max(0.05 * (hi - lo), 0.01)
    ax.set_ylim(lo - pad, hi + pad)
    return lo - pad, hi + pad


LEGEND_INSIDE_MAX = 8  # groups whose legend fits inside the val panel; more go to its right
LEGEND_ENTRY_IN = 0.2  # inches of figure height per legend entry at font size 8 (with its spacing)
LEGEND_CHAR_IN = 0.065  # inches of width per character of a legend entry at font size 8 (DejaVu Sans)
PANEL_WIDTH_IN = 11  # width of the panels in inches; a legend column beside them widens the figure
PHASE1_LABEL = "TST phase 1: bag loss (MCE), not next-token CE"


def group_colours(plt, n):
    """``n`` colours, distinct up to 60 groups (tab10; tab20; then tab20, tab20b and tab20c), repeating after."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    pool = [plt.get_cmap(name)(i) for name in ("tab20", "tab20b", "tab20c") for i in range(20)]
    return [pool[i % len(pool)] for i in range(n)]


def draw_figure(runs, x="time", target=3.28):
    """The figure of ``plot`` (matplotlib, Agg), unsaved: returns ``(fig, notes)``; close it after use.

    Top panel: val loss against ``x`` per group, the mean curve with a ±1 std band over its
    complete runs. Its y range is fitted to the curves after their first val point (the untrained
    ~10.8 would squash the rest); the target line is drawn only when it lies in that range,
    otherwise the title says where it is. Bottom panel (only when a drawn run logs train losses):
    the train loss, a centered running mean over ``SMOOTH_FRAC`` of each run's steps, y fitted
    after the first tenth of the steps, the TST phase-1 part (a bag loss, not comparable with
    next-token CE) faint and dashed. More than ``LEGEND_INSIDE_MAX`` groups put the legend to the
    right of the panels (a figure legend in a column as wide as its longest entry), in a figure tall
    enough for all its entries.
    ``notes``: the runs left out and why.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = X_AXES[x]
    curves, notes = _val_curves(runs, key, x)
    train = _train_curves(runs, curves, key)
    scale = 1.0
    if x == "time":
        longest = max((c["x"].max() for c in curves.values()), default=0)
        scale, unit = (60000.0, "min") if longest > 10 * 60000 else (1000.0, "s")
        label = f"train time ({unit}, validation and compile excluded)"
    groups = list(dict.fromkeys(r.group for r in runs))
    colour = dict(zip(groups, group_colours(plt, len(groups))))
    outside = len(groups) > LEGEND_INSIDE_MAX  # a long legend would cover the curves: put it to the right
    height = 9.5 if train else 6.5
    if outside:  # tall enough for one legend entry per group (and the target line) in one column
        height = max(height, LEGEND_ENTRY_IN * (len(groups) + 2) + 1.0)
    fig, axes = plt.subplots(2 if train else 1, 1, sharex=True, squeeze=False, dpi=110,
                             figsize=(PANEL_WIDTH_IN, height), height_ratios=[3, 2] if train else [1])
    phase1 = bool(train) and any(c["phase1"].any() for c in train.values())
    ax = axes[0, 0]
    lo, hi = _fit_ylim(ax, draw_panel(ax, runs, curves, colour, scale))
    title = f"val loss vs {x}"
    if lo <= target <= hi:
        ax.axhline(target, color="black", ls="--", lw=1.2, label=f"target {target}")
    elif curves:
        title += f" (target {target} is {'below' if target < lo else 'above'} the range shown)"
    ax.set_title(title + ("; y fitted after the first val point" if curves else ""))
    ax.set_ylabel("val loss (cross-entropy, nats/token)")
    if phase1 and outside:  # one legend to the right, not two that overlap
        ax.plot([], [], color="grey", ls="--", alpha=0.5, label=PHASE1_LABEL + " (train panel)")
    if not outside:
        ax.legend(fontsize=8, loc="best")
    if train:
        tax = axes[1, 0]
        _fit_ylim(tax, draw_panel(tax, runs, train, colour, scale, train=True))
        only = f"; {len(train)} of {len(curves)} runs log train losses" if len(train) < len(curves) else ""
        tax.set_title(f"train loss (running mean over {SMOOTH_FRAC:.0%} of the steps; y fitted after the "
                      f"first 10%{only})", fontsize=10)
        tax.set_ylabel("train loss")
        if phase1 and not outside:
            tax.plot([], [], color="grey", ls="--", alpha=0.5, label=PHASE1_LABEL)
            tax.legend(fontsize=8, loc="upper right")
    for a in axes[:, 0]:
        a.grid(True, alpha=0.3)
        a.set_xlim(left=0)
    axes[-1, 0].set_xlabel(label)
    if outside:  # a figure legend in a column of its own to the right of the panels, as wide as its longest entry
        handles, labels = ax.get_legend_handles_labels()
        width = LEGEND_CHAR_IN * max(len(t) for t in labels) + 0.8
        right = PANEL_WIDTH_IN / (PANEL_WIDTH_IN + width)  # where the panels end, as a fraction of the figure
        fig.set_size_inches(PANEL_WIDTH_IN + width, height)
        fig.tight_layout(rect=(0, 0, right, 1))
        fig.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(right, 0.99))
    else:
        fig.tight_layout()
    return fig, notes


def plot(runs, out, x="time", target=3.28):
    """Draw ``draw_figure(runs, x, target)`` into the image file ``out``; returns the notes on runs left out."""
    import matplotlib.pyplot as plt

    fig, notes = draw_figure(runs, x, target)
    try:
        fig.savefig(out)
    finally:
        plt.close(fig)
    return notes


# ----------------------------------------------------------------------------------------------

def short_runs_warning(row):
    """The warning for a group whose runs logged val losses at different steps (``first_passing``), or None."""
    missing = row.get("val_steps_missing")
    if not missing:
        return None
    lacks = "; ".join(f"{name} lacks step{'s' * (len(s) > 1)} {', '.join(map(str, s))}" for name, s in missing.items())
    return (f"group {row['group']}: its runs logged val losses at different steps; the first-passing step is "
            f"sought only at the steps all {row['first_passing_runs']} runs logged ({lacks})")


def ab_baseline(paths, rows):
    """The baseline of an A/B comparison: the first of exactly two PATHs when each is one group (``A_DIR B_DIR``,
    unsplit), else None (no difference is computed without ``--baseline``)."""
    names = [os.path.basename(os.path.normpath(os.path.abspath(p))) if os.path.isdir(p)
             else os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(paths) == 2 and len(set(names)) == 2 and [r["group"] for r in rows] == names:
        return names[0]
    return None


def positive_float(text):
    """argparse type: a finite number above 0 (``--z-sigma``, ``--z-margin``)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


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
    """Why ``--plot out`` cannot be written (an empty name, a missing folder, an unknown image type), or None."""
    if not out.strip():  # '' would read as "no --plot" and be skipped in silence
        return "an empty file name; name the image to write (e.g. --plot curves.png)"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return f"no folder {folder} to write it in; create it or pick another path"
    ext = os.path.splitext(out)[1].lower().lstrip(".")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    types = FigureCanvasAgg.get_supported_filetypes()
    if ext not in types:
        return f"unknown image type {ext or '(none)'!r}; end the name with one of {', '.join(sorted(types))}"
    return None


def build_parser():
    """The command line's ``argparse`` parser (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Table columns are described in records/README.md.")
    ap.add_argument("paths", nargs="+", help="log files, or folders of .txt logs")
    ap.add_argument("--group-by", choices=("auto", "prefix", "folder"), default="auto",
                    help="auto: a folder is one group, a file its own group; prefix: by the file-name part "
                         "before the last '__' (names of copied modded-nanogpt record logs); folder: by the folder a file lies in")
    ap.add_argument("--pool-train-data", action="store_true",
                    help="keep runs that differ only in their training data (e.g. a benchmark's data orders) in one group")
    ap.add_argument("--target", type=finite_float, default=3.28,
                    help="val loss to beat (one-sided t-test, time to target)")
    ap.add_argument("--baseline", metavar="GROUP",
                    help="compare every other group against this one (difference of mean final val loss with "
                         "95%% CI and Welch's t-test; ratios of time, FLOPs, tokens)")
    ap.add_argument("--first-passing", action="store_true",
                    help="per group, the earliest val step at which the mean val loss of its runs is below "
                         "--target at the significance of --rule (and, with --baseline, the steps saved)")
    ap.add_argument("--rule", choices=RULES, default="ttest",
                    help=f"--first-passing: ttest = one-sided t-test at p < {PASS_ALPHA:g} (the main track's rule); "
                         "ztest = (target - mean) * sqrt(n) >= --z-margin (the optimization track's z-test)")
    ap.add_argument("--z-sigma", type=positive_float, default=Z_SIGMA,
                    help="--rule ztest: the per-run std of the val loss taken as known (reported z and p)")
    ap.add_argument("--z-margin", type=positive_float, default=Z_MARGIN,
                    help="--rule ztest: pass when (target - mean) * sqrt(n) >= this")
    out = ap.add_mutually_exclusive_group()
    ap.add_argument("--per-step", action="store_true",
                    help="also the mean ± std of the val loss at each val step every complete run of a group logged")
    out.add_argument("--json", action="store_true", help="print the groups as JSON instead of the table")
    out.add_argument("--markdown", action="store_true",
                     help="print the tables as Markdown (to paste into a README)")
    ap.add_argument("--plot", metavar="OUT.png",
                    help="draw the val (and train) loss curves of every group to this file")
    ap.add_argument("--x", choices=sorted(X_AXES), help="x axis of --plot (default: time)")
    return ap


def main(argv=None):
    """Command line: print the table (or JSON) and optionally draw the plot; see the module docstring."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that left (`| head`): stop quietly
    args = build_parser().parse_args(argv)

    def error(message):
        print(f"compare.py: error: {message}", file=sys.stderr)
        return 2

    given = [flag for flag, on in (("--rule", args.rule != "ttest"), ("--z-sigma", args.z_sigma != Z_SIGMA),
                                   ("--z-margin", args.z_margin != Z_MARGIN)) if on]
    if given and not args.first_passing:
        return error(f"{given[0]} sets how --first-passing judges a step; add --first-passing")
    if args.rule == "ttest" and (args.z_sigma != Z_SIGMA or args.z_margin != Z_MARGIN):
        return error("--z-sigma and --z-margin belong to --rule ztest; add --rule ztest or leave them out")

    if args.x is not None and args.plot is None:  # the only plot-only flag; else it would be ignored in silence
        return error(f"--x {args.x} sets the x axis of --plot; add --plot OUT.png or leave --x out")
    args.x = args.x or "time"
    problem = plot_problem(args.plot) if args.plot is not None else None  # before the work, not after the table
    if problem:
        return error(f"--plot {args.plot if args.plot.strip() else repr(args.plot)}: {problem}")
    try:
        runs = collect(args.paths, args.group_by,
                       warn=lambda message: print(f"compare.py: warning: {message}", file=sys.stderr),
                       pool_train_data=args.pool_train_data)
    except OSError as e:
        return error(e)
    except ImportError as e:  # train_gpt.OPERATIONAL is needed to compare configs (see run_defining)
        return error(f"cannot read train_gpt.py's OPERATIONAL beside records/ to tell run-defining config fields "
                     f"from operational ones ({e}); run compare.py from a checkout of this repository")
    if not runs:
        return error("no train_gpt.py or modded-nanogpt log found in " + ", ".join(args.paths)
                     + " (see the warnings above)")
    if all(r.reason.startswith("unreadable:") for r in runs):
        return error("no log could be read (see the warnings above)")
    rule = PassRule(args.rule, sigma=args.z_sigma, margin=args.z_margin) if args.first_passing else None
    rows = group_stats(runs, args.target, rule, args.per_step)
    for row in rows:
        if short_runs_warning(row):
            print(f"compare.py: warning: {short_runs_warning(row)}", file=sys.stderr)
    baseline = args.baseline if args.baseline is not None else ab_baseline(args.paths, rows)
    if baseline is not None:
        try:
            add_baseline(rows, baseline)
        except KeyError as e:
            return error(f"--baseline: {e.args[0]}")
        for row in rows:
            if row.get("val_differs"):
                print(f"compare.py: warning: group {row['group']}: {row['welch_note']}", file=sys.stderr)
    elif val_setup_warning(rows):
        print(f"compare.py: warning: {val_setup_warning(rows)}", file=sys.stderr)
    if args.json:
        print(json.dumps(_jsonable(rows), indent=1))
    else:
        print(format_table(rows, args.markdown))
    if args.plot is not None:
        try:
            notes = plot(runs, args.plot, args.x, args.target)
        except OSError as e:  # e.g. no write permission (folder and image type were checked up front)
            return error(f"--plot {args.plot}: cannot write it: {e}")
        for note in notes:
            print(note, file=sys.stderr)
        print(f"plot: {args.plot}", file=sys.stderr)
    if not any(r.complete for r in runs):  # a table of incomplete runs only: nothing was compared
        print(f"compare.py: error: none of the {len(runs)} log(s) is complete (listed above with why); nothing "
              "was compared", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
