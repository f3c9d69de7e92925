"""Check that a run log is a faithful snapshot of the code, and optionally that it reproduces.

    python records/verify.py LOG                     # snapshot consistent and equal to the working tree?
    python records/verify.py LOG --extract DIR       # write the logged source files to DIR
    python records/verify.py LOG --rerun 3           # + re-run the first 3 steps on CPU with the logged
                                                     #   code and config, compare their losses
    python records/verify.py LOG --rerun 3 --train-files 'data/x/*_train_*.bin' --val-files '...'

Checks, in order:
1. the log starts with a ``### file <name> lines=<n> sha256=<hex>`` header for each source file,
   each followed by its n lines, then the separator line; every stored file's sha256 equals
   its header (a file edited inside the log no longer matches: reported, and the run fails). A
   log that ends before a header's n lines (a cut copy, an interrupted write) is reported as
   truncated; the cut file is then neither hashed, compared nor extracted. Which files a complete
   snapshot holds, the logged code says (its ``SOURCE_FILES``, read, never run: in train_gpt.py
   in logs of two files, in harness.py in logs of four);
2. (unless ``--extract``) each stored file equals the working tree's file (``--repo``, default
   the repository that holds this records/ folder), else the first differing line is reported: a
   failure without ``--rerun``, a note with it (the rerun runs the log's own code, so a log made by
   earlier code still re-runs);
3. with ``--rerun K``: the extracted code is written to a temp dir and run (from ``--run-dir``,
   default the repo root, as the log's data globs are relative to where the run was launched) as
   ``python <tmp>/train_gpt.py <config_to_argv(config)> --max-steps K --device cpu --log-dir <tmp>
   --run-id verify`` (``config_to_argv`` of the logged code: train_gpt.py's up to the 2026-12-03 logs,
   harness.py's since), compiled when the logged CPU run was (``--compile``; else ``--no-compile``), with
   the logged torch thread count (``--threads``); K is capped at the logged run's steps. GPT-2's
   ``data/gpt2_bpe/encoder.json`` (read by runs with the prefix-token objective, checked against its
   sha256 and, when the log records it, the ``data tokenizer:`` fingerprint) is copied from ``--repo`` (else this
   checkout) beside the code, so verify runs from any folder. The rerun must read data with the
   logged fingerprints, and it recomputes every number of steps 0..K: each logged ``train_loss`` and
   ``val_loss`` at a step <= K, and the step lines' token and FLOP counts. When K reaches the end of
   the run, also the summary line's ``final_val_loss`` (``last_val_loss`` of a run stopped by
   --max-steps), ``steps``, ``raw_tokens``, ``positions`` and ``flops``.
   A mismatch fails, naming the step (or field) and both values. The temp dir is removed whatever
   the outcome (Ctrl-C too); ``--keep DIR`` copies the rerun's code and log there first.
   A small-scale study log (bench/small_scale.py) whose data order is missing (it is git-ignored)
   gets it rebuilt into a temp dir from the study's ``data_recipes.json``; where the corpus is
   missing too, one line names the ``bench/small_scale_data.py`` command that rebuilds it.

How close is close enough depends on where the log was made, compared with the rerun's own
``cpu:`` / ``gpus:`` line (the case is printed; the method: docs/LOGS.md):
* same CPU model, thread count and process count, eager or compiled alike: float32 results are
  bitwise equal, so the losses must match to the print rounding (1e-4);
* another CPU model, thread count or process count (or a log that does not record its CPU), eager:
  the runs drift apart with the step: tol(step) = min(1e-4 + 5e-5 x step, 4.5e-3) for val
  losses; train losses (one batch each) after step 88 drift as much as an edit and are shown,
  not judged; an edit of 0.01 or more fails wherever it is judged;
* the same for a compiled CPU log: the drift is measured, not assumed: a second rerun, eager,
  differs from the compiled one only in the summation order; tol(step) = max(1e-4 + 2 x their
  largest |difference| up to the step, 1e-4 + 5e-5 x step), train and val apart; a loss whose
  tolerance passes 4.5e-3 is shown, not judged (so an edit of 0.01 fails wherever one is judged);
* a GPU log: a CPU rerun cannot reproduce GPU losses at all; only the data fingerprints and the
  counts are checked, the losses are shown, not judged.
``--tol X`` judges every loss within X instead.

What it does NOT check: only the source snapshot carries checksums. Everything after the
separator (environment, config, data lines, step lines, val losses, train times, the summary and
the status line) is not checksummed: an edit there is caught only where ``--rerun K`` recomputes
it, i.e. the numbers of the first K steps and the data fingerprints. A partial rerun (K below the
run's steps) cannot check the val losses after step K (so not the final val loss, the number a
record stands on), the train losses after step K, or the summary line; it says so. No rerun
checks ``train_time``, ``step_avg``, ``peak_memory`` or ``compile_time`` (timings and memory of
the logged machine), the JSON summary beside the log, or the losses of a GPU log.

Exit status: 0 only if every check passed; 1 if one failed; 2 for a log that cannot be read (or
has no snapshot at all) and for bad arguments (e.g. ``--extract`` naming a file, an empty path, a
flag of the rerun (``--train-files``, ``--val-files``, ``--tol``, ``--threads``, ``--keep``,
``--run-dir``) without ``--rerun``), each one line; with ``--rerun``, also for a config line the
rerun cannot trust, named by its log line: not JSON, or lacking a field of the logged code's
``Config`` or holding a key it lacks (the logged trainer writes exactly its fields; a log of older
code lacks the fields added since, and so does the older code its rerun runs); 130 when
interrupted (Ctrl-C or SIGTERM: the rerun is stopped, its temp dir removed).
"""
import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
from compare import SEPARATOR, has_line_end, parse_lines, read_log_lines, split_snapshot  # noqa: E402

ENTRY = "train_gpt.py"  # the file a rerun runs; which files a snapshot holds, the log itself says
SOURCE_LIST_HOLDERS = (ENTRY, "harness.py")  # where a logged trainer keeps its SOURCE_FILES
PRINT_TOL = 1e-4  # losses are printed with 4 decimals
# A rerun on another CPU model, thread count or process count sums float32 in another order, and
# the two runs drift apart as training goes on (measured: records/README.md, "Tolerances of
# --rerun"). Allowed |logged - rerun| at step s: PRINT_TOL + DRIFT_PER_STEP * s, at most DRIFT_CAP,
# so that an edit of 0.01 fails even against a drift of DRIFT_CAP the other way. A train loss
# (one batch) whose allowance would pass the cap is shown, not judged: there the measured drift is
# as large as an edit. Val losses (a mean over the val tokens) drift far less: judged at every step.
DRIFT_PER_STEP = 5e-5
DRIFT_CAP = 4.5e-3
SUMMARY_COUNTS = ("steps", "raw_tokens", "positions", "flops")  # summary fields a full rerun recomputes
NOT_RERUNNABLE = "train_time, step_avg, peak_memory and compile_time (timings and memory of the logged machine)"
COMPILED = "compiled run, compiled rerun"  # the case of a compiled CPU log
# GPT-2's tokenizer table, read by runs with the prefix-token objective (logs with a "data tokenizer:" line, or of
# --objectives before that line existed): not in a log's snapshot, so a rerun takes it from --repo, checked against
# the one file GPT-2 published (openai/gpt-2, encoder.json).
TOKENIZER = os.path.join("data", "gpt2_bpe", "encoder.json")
TOKENIZER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
CPU_RE = re.compile(r"^cpu: (?P<model>.*?)\s+cores: (?P<cores>\d+)\s+torch threads: (?P<threads>\d+)\s*$")


def sha256(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def truncation_problem(f):
    """The message for a snapshot file ``f`` that the log's end cuts short."""
    complete = sum(1 for ln in f.body if has_line_end(ln))
    part = " and part of the next" if complete < len(f.body) else ""
    return (f"the log is truncated: the header of {f.name} (log line {f.header_line}) promises {f.lines} "
            f"lines, but the log ends after {complete} of them{part} (cut copy or interrupted write; "
            "not checked further)")


def extract(lines):
    """The source files stored in a log's snapshot.

    Returns ``(sources, problems, rest_index)``: ``{name: text}`` with each complete file's
    exact text (a file the log's end cuts short is left out), a list of consistency problems
    (sha256 mismatch, missing file, truncation, no separator), and the index of the first line
    after the snapshot.
    """
    files, rest, truncated = split_snapshot(lines)
    problems, sources = [], {}
    if not files:
        return {}, ["the log does not start with a '### file <name> lines=<n> sha256=<hex>' header "
                    "(not a log of this repository, or its snapshot was removed)"], 0
    if truncated:  # the last file is cut: its hash cannot match, which says nothing about edits
        problems.append(truncation_problem(files[-1]))
        files = files[:-1]
    for f in files:
        text = "".join(f.body)
        # train_gpt.py appends one "\n" to a file without a final newline: undo it if the hash says so
        if sha256(text) != f.sha256 and text.endswith("\n") and sha256(text[:-1]) == f.sha256:
            text = text[:-1]
        sources[f.name] = text
        if sha256(text) != f.sha256:
            problems.append(f"{f.name}: sha256 of the stored text ({sha256(text)[:16]}...) does not match its "
                            f"header at log line {f.header_line} ({f.sha256[:16]}...): the snapshot was edited "
                            f"after the run")
    if truncated:  # the files after the cut are missing because of it: said once above
        return sources, problems, rest
    for name in snapshot_names(sources, [f.name for f in files]):
        if name not in sources:
            problems.append(f"{name}: missing from the snapshot")
    if rest >= len(lines):
        problems.append("the log is truncated: it ends right after the snapshot (no separator line, no run)")
    elif lines[rest].rstrip("\r\n") != SEPARATOR:
        problems.append(f"line {rest + 1}: expected the separator line of 100 '=' after the snapshot")
    return sources, problems, rest


def snapshot_names(sources, header_names):
    """The files a complete snapshot holds: those the logged code lists in its own
    ``SOURCE_FILES = (...)`` (read with ``ast``, never run), then any other header's file.

    The list lives in the logged train_gpt.py (logs of two files) or, since the harness moved
    out of it, in the logged harness.py (logs of three or four files); the first file that defines it
    counts. ``sources`` is ``{name: text}`` as ``extract`` returns it; without a readable list
    (an old or edited trainer) the headers' names and ``train_gpt.py`` are all that is known.
    """
    names = [ENTRY]
    for holder in SOURCE_LIST_HOLDERS:
        listed = source_files_listed(sources.get(holder, ""))
        if listed is not None:
            names += listed
            break
    return list(dict.fromkeys(names + list(header_names)))


def source_files_listed(text):
    """The names of a module-level ``SOURCE_FILES = (...)`` in source ``text`` (never run), or None."""
    try:
        for node in ast.parse(text).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SOURCE_FILES" for t in node.targets):
                return [n for n in ast.literal_eval(node.value) if isinstance(n, str)]
    except (SyntaxError, ValueError, TypeError):
        pass
    return None


def first_difference(name, logged, current):
    """None if equal, else a message with the first differing line (1-based) and both versions."""
    if logged == current:
        return None
    a, b = logged.splitlines(keepends=True), current.splitlines(keepends=True)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"{name} line {i + 1} differs:\n    log:          {x!r}\n    working tree: {y!r}"
    i = min(len(a), len(b))
    if len(a) != len(b):
        extra = (f"log line {i + 1}: {a[i]!r}" if len(a) > len(b) else f"working tree line {i + 1}: {b[i]!r}")
        return f"{name}: log has {len(a)} lines, working tree {len(b)}; first extra {extra}"
    return f"{name}: differs only in line endings"


def read_text(path):
    """A source file's text as written (no newline translation), to compare with a snapshot's."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def same_text(path, text):
    """True if the file at ``path`` holds exactly ``text`` (False if it cannot be read as UTF-8)."""
    try:
        return read_text(path) == text
    except (OSError, UnicodeDecodeError):
        return False


def compare_with_tree(sources, repo):
    """Messages for every stored file that differs from (or is missing in) the tree at ``repo``."""
    out = []
    for name, text in sources.items():
        path = os.path.join(repo, name)
        if not os.path.exists(path):
            out.append(f"{name}: not in the working tree {repo}")
            continue
        diff = first_difference(name, text, read_text(path))
        if diff:
            out.append(diff)
    return out


def write_sources(sources, folder):
    """Write the extracted files byte for byte (no newline translation); no folder for no files."""
    if sources:
        os.makedirs(folder, exist_ok=True)
    for name, text in sources.items():
        path = os.path.normpath(os.path.join(folder, name))
        if os.path.isabs(name) or not path.startswith(os.path.normpath(folder) + os.sep):
            raise ValueError(f"the snapshot names a file outside its folder ({name!r}); the log was edited")
        os.makedirs(os.path.dirname(path), exist_ok=True)  # data/shard_format.py
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)


NO_CONFIG = "no 'config: {...}' line after the snapshot: the run cannot be repeated"
RESTORE = "restore the log's original copy (a rerun needs the config the run was made with)"


def logged_config(lines, rest, sources):
    """The ``config: {...}`` dict written after the snapshot, checked against the logged code; None if the log
    has no such line.

    The logged trainer writes every field of its own ``Config`` (``sources``' dataclass, read with ``ast``, never
    run), so the line must hold exactly those: a log of older code lacks the fields added since, and its rerun
    runs that older code, which lacks them too. Raises ValueError (the log line's number and what is wrong) for a
    line that is not JSON, lacks a field of the logged ``Config`` (the rerun would take the default in silence)
    or holds a key it does not know (the rerun would ignore it).
    """
    for number, ln in enumerate(lines[rest:], rest + 1):
        if not ln.startswith("config: {"):
            continue
        try:
            config = json.loads(ln[len("config: "):])
        except ValueError as e:  # JSONDecodeError: its position within the JSON text, made one within the line
            raise ValueError(f"line {number}: the config line is not valid JSON ({e.msg} at column "
                             f"{e.pos + len('config: ') + 1}); {RESTORE}") from None
        fields = config_fields(sources)
        if fields is not None:
            missing = [f for f in fields if f not in config]
            unknown = sorted(set(config) - set(fields))
            if missing:  # the logged code writes every field of its Config: the line was edited
                raise ValueError(f"line {number}: the config line lacks {', '.join(missing)}, which the logged code's "
                                 f"Config has (a rerun would take {'its' if len(missing) == 1 else 'their'} default); "
                                 f"{RESTORE}")
            if unknown:
                raise ValueError(f"line {number}: the config line has {', '.join(unknown)}, which the logged code's "
                                 f"Config lacks (a rerun would ignore {'it' if len(unknown) == 1 else 'them'}); "
                                 f"{RESTORE}")
            null = [f for f, nullable in fields.items() if config[f] is None and not nullable]
            if null:  # config_to_argv leaves a None out: the rerun would take the default in silence
                raise ValueError(f"line {number}: the config line holds null for {', '.join(null)}, which the logged "
                                 f"code never writes (a rerun would take {'its' if len(null) == 1 else 'their'} "
                                 f"default); {RESTORE}")
        return config
    return None


def config_fields(sources):
    """``{field name: whether its default is None}`` of the logged code's ``Config`` dataclass (``train_gpt.py``,
    else ``harness.py``, read with ``ast``, never run), in order; None when neither defines a ``class Config``."""
    for holder in SOURCE_LIST_HOLDERS:
        try:
            body = ast.parse(sources.get(holder, "")).body
        except SyntaxError:
            continue
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                return {n.target.id: default_is_none(n.value) for n in node.body if isinstance(n, ast.AnnAssign)
                        and isinstance(n.target, ast.Name)
                        and "ClassVar" not in ast.unparse(n.annotation)}  # a ClassVar is no dataclass field
    return None


def default_is_none(value):
    """Whether a Config field's default (its AnnAssign value: ``None``, ``_f(None, "help")``, ``field(default=None)``)
    is None: such a field may be logged as null (unset: decided at run time)."""
    if isinstance(value, ast.Constant):
        return value.value is None
    if isinstance(value, ast.Call):
        first = value.args[0] if value.args else next((k.value for k in value.keywords if k.arg == "default"), None)
        return isinstance(first, ast.Constant) and first.value is None
    return False


def data_fingerprints(lines, rest=0):
    """``[(kind, fingerprint), ...]`` of the ``data train:/val:/tokenizer:`` lines before the first step line.

    Only the first block counts: a resumed run lists its data again further down.
    """
    out = []
    for ln in lines[rest:]:
        if ln.startswith("step:"):
            break
        if ln.startswith(("data train:", "data val:", "data tokenizer:")):
            kind = ln.split(":", 1)[0]
            fp = ln.rsplit("fingerprint:", 1)[-1].strip()
            out.append((kind, fp))
    return out


def machines(lines, rest=0):
    """The machine of each environment block after the snapshot (a resumed run logs one per start).

    Returns a list of dicts: ``device`` (``cpu``, ``cuda``, ...), ``world`` (processes, int),
    ``cpu`` (model name, None if not logged), ``threads`` (torch threads, int or None), ``gpus``
    (the ``gpus:`` text or None), read from the ``world_size:``, ``cpu:`` and ``gpus:`` lines.
    """
    out = []
    for ln in lines[rest:]:
        ln = ln.rstrip("\r\n")
        if ln.startswith("world_size:"):
            f = dict(re.findall(r"(\w+): (\S+)", ln))
            world = f.get("world_size", "1")
            out.append(dict(device=f.get("device", "?").split(":")[0], world=int(world) if world.isdigit() else None,
                            cpu=None, threads=None, gpus=None))
        elif out and CPU_RE.match(ln):
            m = CPU_RE.match(ln)
            out[-1].update(cpu=m["model"], threads=int(m["threads"]))
        elif out and ln.startswith("gpus:"):
            out[-1]["gpus"] = ln[len("gpus:"):].strip()
    return out


def was_compiled(lines, rest, config):
    """True when the logged run was compiled: a start's environment line says ``compile: True``
    (the resolved value: an unset ``--compile`` is on with CUDA), or its config says ``compile: true``."""
    for ln in lines[rest:]:
        if ln.startswith("world_size:") and re.search(r"\bcompile: True\b", ln):
            return True
    return config.get("compile") is True


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed |logged - rerun| loss at step s: ``min(base + per_step * s, cap)``."""
    base: float
    per_step: float = 0.0
    cap: float = math.inf

    def __call__(self, step):
        return min(self.base + self.per_step * step, self.cap)

    def train(self, step):
        return self(step)

    def judges_val(self, step):
        return True  # val losses are judged at every step, at most at the cap

    def judges_train(self, step):
        """False where the allowance would pass the cap: a train loss there is shown, not judged."""
        return self.base + self.per_step * step <= self.cap + 1e-12  # slack: 1e-4 + 5e-5 * 88 > 4.5e-3 in floats

    @property
    def last_train_step(self):
        """The last step whose train loss is judged (None: every step)."""
        return math.floor((self.cap - self.base) / self.per_step + 1e-9) if self.per_step else None

    def __str__(self):
        if not self.per_step:
            return f"{self.base:g}"
        return f"tol(step) = min({self.base:g} + {self.per_step:g} x step, {self.cap:g})"


DRIFT = Tolerance(PRINT_TOL, DRIFT_PER_STEP, DRIFT_CAP)
# On another machine (CPU model, threads, processes) a rerun sums in another order, and how fast a run
# amplifies that depends on the run: one AMD machine's calibration of inductor's kernels failed an honest
# compiled log on an Intel Xeon, and an AdamW study log drifts 1e-3 by step 5 eager, 6x DRIFT. So the
# rerun measures it: a second rerun of the same log that differs from the first only in the summation
# order (a compiled log: eager; an eager log: another thread count); MEASURED_FACTOR x their |difference|
# (running maximum up to the step, train and val apart) bounds the drift, capped at DRIFT_CAP so that an
# edit of 0.01 fails.
MEASURED_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class MeasuredTolerance:
    """Allowed |logged - rerun| at step s: ``PRINT_TOL + MEASURED_FACTOR x`` the largest difference between
    two honest reruns (compiled and eager) up to step s, per kind, at least ``DRIFT``'s growth (the spread
    of eager runs on two CPU models); a loss whose allowance passes ``DRIFT_CAP`` is shown, not judged
    (there an edit could hide in the measured drift).

    ``train``/``val``: ``{step: |first - second|}`` of the two reruns' losses; ``between``: what differs
    between them ("compiled - eager", "1 - 2 threads").
    """
    train_diffs: dict
    val_diffs: dict
    between: str = "compiled - eager"
    cap: float = DRIFT_CAP

    @staticmethod
    def envelope(diffs, step):
        return max([d for s, d in diffs.items() if s <= step], default=0.0)

    def raw(self, step, kind="val"):
        diffs = self.train_diffs if kind == "train" else self.val_diffs
        # at least the spread measured between eager runs on two CPU models (DRIFT): a model whose compiled and
        # eager runs agree to the print still drifts on other kernels
        return max(PRINT_TOL + MEASURED_FACTOR * self.envelope(diffs, step), PRINT_TOL + DRIFT_PER_STEP * step)

    def __call__(self, step):
        return min(self.raw(step), self.cap)

    def train(self, step):
        return min(self.raw(step, "train"), self.cap)

    def judges_train(self, step):
        return self.raw(step, "train") <= self.cap + 1e-12

    def judges_val(self, step):
        return self.raw(step) <= self.cap + 1e-12

    @property
    def last_train_step(self):
        judged = [s for s in self.train_diffs if self.judges_train(s)]
        return None if len(judged) == len(self.train_diffs) else max([s for s in judged] or [0])

    def __str__(self):
        top = max(self.val_diffs.items(), key=lambda kv: kv[1], default=(0, 0.0))
        top_t = max(self.train_diffs.items(), key=lambda kv: kv[1], default=(0, 0.0))
        return (f"tol(step) = max({PRINT_TOL:g} + {MEASURED_FACTOR:g} x the measured |{self.between}| rerun "
                f"difference up to the step, {PRINT_TOL:g} + {DRIFT_PER_STEP:g} x step) (largest measured: val "
                f"{top[1]:.2e} at step {top[0]}, train {top_t[1]:.2e} at step {top_t[0]}), judged where at most "
                f"{self.cap:g}")


def measure_drift(compiled_run, eager_run, between="compiled - eager"):
    """``MeasuredTolerance`` from two reruns of one log (``compare.Run``s) that differ in ``between`` only."""
    def diffs(a, b, key):
        other = {p["step"]: p[key] for p in b if p.get(key) is not None}
        return {p["step"]: abs(p[key] - other[p["step"]]) for p in a
                if p.get(key) is not None and p["step"] in other and math.isfinite(p[key] - other[p["step"]])}
    return MeasuredTolerance(diffs(compiled_run.train, eager_run.train, "train_loss"),
                             diffs(compiled_run.val, eager_run.val, "val_loss"), between)


def machine_differences(logged, here):
    """What differs between the machines of a log's starts (``machines()``) and the rerun's ``here``."""
    differs = [] if logged else ["machine (the log records none)"]
    for m in logged:
        if m["cpu"] is None or here.get("cpu") is None:
            differs.append("CPU model (not recorded in the log)" if m["cpu"] is None else
                           "CPU model (not recorded by the rerun)")
        elif m["cpu"] != here["cpu"]:
            differs.append(f"CPU model ({m['cpu']} vs {here['cpu']})")
        if m["threads"] is not None and m["threads"] != here.get("threads"):
            differs.append(f"thread count ({m['threads']} vs {here.get('threads')})")
        if m["world"] != here.get("world"):
            differs.append(f"process count ({m['world']} vs {here.get('world')})")
    return list(dict.fromkeys(differs))


def is_gpu_log(logged):
    return any(m["device"] not in ("cpu", "?") for m in logged)


def judgement(logged, here, tol=None, compiled=False, measured=None):
    """How closely a rerun on the machine ``here`` can reproduce a log made on ``logged``.

    ``logged``: ``machines()`` of the log (one entry per start); ``here``: the rerun's entry;
    ``tol``: a ``--tol`` that replaces the case's tolerance; ``compiled``: the logged CPU run was
    compiled, and so is the rerun; ``measured``: for a CPU log made on another machine, the
    ``MeasuredTolerance`` of a second rerun (``measure_drift``; eager for a compiled log, another thread
    count for an eager one; None: ``DRIFT``). Returns ``(text, tolerance or
    None)``; None means the losses are shown, not judged. Float32 CPU results are bitwise equal only
    on the same CPU model, thread count and process count, compiled or eager both times. GPU runs are
    not bitwise repeatable.
    """
    given = f"; --tol {tol:g} given instead" if tol is not None else ""
    gpus = [m["gpus"] or m["device"] for m in logged if m["device"] not in ("cpu", "?")]
    if gpus:
        text = (f"GPU log ({gpus[0]}): a CPU rerun cannot reproduce its losses (other kernels, and GPU runs are "
                "not bitwise repeatable); checked: the data fingerprints and the token, position, FLOP and step "
                "counts; the losses are shown, not judged")
        return text + given, (Tolerance(tol) if tol is not None else None)
    differs = machine_differences(logged, here)
    how = f"{COMPILED}: " if compiled else ""
    if not differs:
        text = (f"{how}same CPU model ({here['cpu']}), thread count ({here['threads']}) and process count "
                f"({here['world']}): exact match expected (tol {PRINT_TOL:g} = print rounding)")
        return text + given, Tolerance(PRINT_TOL if tol is None else tol)
    if compiled and measured is None:  # only with --tol: no second rerun was made
        return f"{how}different {', '.join(differs)}" + given, Tolerance(tol)
    if measured is not None:
        why, by = (("inductor's kernels sum in another order", "an eager rerun of the same log") if compiled else
                   ("float32 sums in another order, the runs drift apart with the step", "a rerun at another thread count"))
        after = measured.last_train_step
        text = (f"{how}different {', '.join(differs)}: {why}; drift measured on this machine by {by}: {measured}"
                + (f"; train losses after step {after} shown, not judged" if after is not None else "")
                + " (docs/LOGS.md)")
        return text + given, (measured if tol is None else Tolerance(tol))
    text = (f"different {', '.join(differs)}: float32 sums in another order, the runs drift apart with the step: "
            f"{DRIFT}, train losses after step {DRIFT.last_train_step} shown, not judged (docs/LOGS.md)")
    return text + given, (DRIFT if tol is None else Tolerance(tol))


def place_tokenizer(repo, tmp):
    """Copy GPT-2's encoder.json from ``repo`` (else the checkout holding records/) to where the logged
    code in ``tmp`` reads it; an error line (naming the file and the fix) if it is missing or not
    GPT-2's, else None."""
    src = next((c for c in (os.path.join(repo, TOKENIZER), os.path.join(os.path.dirname(HERE), TOKENIZER))
                if os.path.exists(c)), os.path.join(repo, TOKENIZER))
    try:
        with open(src, "rb") as f:
            data = f.read()
    except OSError as e:
        return (f"{src}: cannot read GPT-2's encoder.json ({e.strerror or e}), which the logged run read; "
                f"pass --repo a checkout of this repository (git checkout -- data/gpt2_bpe)")
    if hashlib.sha256(data).hexdigest() != TOKENIZER_SHA256:
        return (f"{src}: not GPT-2's encoder.json (sha256 {hashlib.sha256(data).hexdigest()[:16]}..., expected "
                f"{TOKENIZER_SHA256[:16]}...); restore it (git checkout -- data/gpt2_bpe)")
    os.makedirs(os.path.join(tmp, os.path.dirname(TOKENIZER)), exist_ok=True)
    with open(os.path.join(tmp, TOKENIZER), "wb") as f:
        f.write(data)
    return None


ARGV_MARK = "verify argv: "
# The rerun's process: the logged code's folder first on sys.path (not the launch folder: nothing there may shadow
# it), its config_to_argv (in train_gpt.py up to the 2026-12-03 logs, in harness.py since), the flags on stderr's
# first line, then its train_gpt.py run as __main__ with them.
RUNNER = ("import json, os, runpy, sys; code = sys.argv[1]; "
          "sys.path[:] = [code] + [p for p in sys.path if p not in ('', os.getcwd())]; import train_gpt; "
          "to_argv = getattr(train_gpt, 'config_to_argv', None) or __import__('harness').config_to_argv; "
          "argv = to_argv(json.loads(sys.argv[2])); "
          f"print({ARGV_MARK!r} + json.dumps(argv), file=sys.stderr, flush=True); "
          "sys.argv = [os.path.join(code, 'train_gpt.py')] + argv; runpy.run_path(sys.argv[0], run_name='__main__')")


def run_logged_code(config, sources, steps, run_dir, threads, tmp, compile=False, run_id="verify"):
    """Run the first ``steps`` steps of the logged ``config`` with the logged ``sources`` on CPU
    (compiled with ``compile``), its log ``tmp/<run_id>.txt``.

    The code is written to the folder ``tmp`` (the rerun's log goes there too) and run from
    ``run_dir`` with ``threads`` torch threads (``OMP_NUM_THREADS``; None keeps the caller's).
    Returns ``(cmd, proc, error)``; ``error`` is a message when the logged code could not turn
    the config into flags. Ctrl-C kills the rerun (``subprocess.run``) and propagates.

    One process (``RUNNER``) turns the config into the logged code's flags and runs its train_gpt.py as
    ``__main__`` with them, as ``python <tmp>/train_gpt.py <flags>`` would (torch is imported once, not twice).
    """
    # Never touch the logged run's checkpoints or resume from them; a short CPU run into tmp.
    for key, value in dict(resume="", checkpoint_dir=os.path.join(tmp, "checkpoints"), save_every=0,
                           save_final=False, save_on_interrupt=False, max_steps=steps, device="cpu",
                           compile=compile, log_dir=tmp, run_id=run_id).items():
        if key in config:
            config[key] = value
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.run([sys.executable, "-c", RUNNER, tmp, json.dumps(config)], cwd=run_dir, env=env,
                          capture_output=True, text=True)
    first, _, rest = proc.stderr.partition("\n")
    if not first.startswith(ARGV_MARK):
        return None, None, "config_to_argv of the logged code failed:\n" + proc.stderr.strip()[-2000:]
    proc.stderr = rest
    return [sys.executable, os.path.join(tmp, ENTRY)] + json.loads(first[len(ARGV_MARK):]), proc, None


def same_loss(a, b, tol):
    """True when two printed losses agree within ``tol`` (nan only matches nan, inf only itself)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= tol + 1e-9  # slack: both are decimal strings with 4 places


def compare_train(old, new, last, tol):
    """Every logged train_loss at steps 1..``last`` against the rerun's: ``(ok, report lines)``.

    ``old``/``new``: ``compare.Run`` of the log and of the rerun; ``tol``: a ``Tolerance``, or
    None to show the losses without judging them. The step lines' token and FLOP counts must be
    equal whatever the tolerance.
    """
    fresh = {p["step"]: p for p in new.train if p.get("train_loss") is not None}
    logged = [p for p in old.train if 1 <= p["step"] <= last and p.get("train_loss") is not None]
    if not any(p["step"] in fresh for p in logged):
        later = [p["step"] for p in old.train if p["step"] > last and p.get("train_loss") is not None]
        fix = f"; the log's first is at step {later[0]}: pass --rerun {later[0]} or more" if later else ""
        return False, [f"rerun: no train_loss line of steps 1..{last} in both logs to compare{fix}"]
    report = [f"{'step':>6}  {'logged':>10}  {'rerun':>10}  {'diff':>10}"]
    losses_ok, judged, counts_bad = True, 0, []
    for p in logged:
        q = fresh.get(p["step"])
        if q is None:
            losses_ok = False
            report.append(f"{p['step']:>6}  {p['train_loss']:>10.4f}  {'missing':>10}  {'-':>10}  > tol")
            continue
        judge = tol is not None and tol.judges_train(p["step"])
        good = not judge or same_loss(p["train_loss"], q["train_loss"], tol.train(p["step"]))
        losses_ok, judged = losses_ok and good, judged + judge
        mark = "" if good and judge else "  > tol" if judge else "  (not judged)"
        report.append(f"{p['step']:>6}  {p['train_loss']:>10.4f}  {q['train_loss']:>10.4f}  "
                      f"{abs(p['train_loss'] - q['train_loss']):>10.2e}{mark}")
        if (p.get("tokens"), p.get("flops")) != (q.get("tokens"), q.get("flops")):
            counts_bad.append(f"step {p['step']}: logged tokens:{p.get('tokens')} flops:{p.get('flops')}, "
                              f"rerun tokens:{q.get('tokens')} flops:{q.get('flops')}")
    if tol is None:
        report.append(f"rerun: train losses shown, not judged ({len(logged)} step(s))")
    else:
        shown = (f", {len(logged) - judged} after step {tol.last_train_step} shown, not judged"
                 if judged < len(logged) else "")
        report.append(f"rerun: train losses {'reproduced' if losses_ok else 'NOT reproduced'} within {tol} "
                      f"({judged} step(s) compared{shown})")
    report += [f"rerun: token/FLOP counts differ at {c}" for c in counts_bad]
    return losses_ok and not counts_bad, report


def compare_val(old, new, last, tol):
    """Every logged val_loss at steps <= ``last`` against the rerun's: ``(ok, report lines)``;
    ``tol`` as in ``compare_train`` (val losses are judged at every step, capped)."""
    ok, report = True, []
    fresh = {p["step"]: p["val_loss"] for p in new.val}
    for p in (p for p in old.val if p["step"] <= last):
        a, b = p["val_loss"], fresh.get(p["step"])
        if b is None:
            ok = False
            report.append(f"rerun: val_loss at step {p['step']}: logged {a:.4f}, the rerun has no val line there: "
                          "NOT reproduced")
            continue
        judged = tol is not None and tol.judges_val(p["step"])
        good = not judged or same_loss(a, b, tol(p["step"]))
        ok &= good
        verdict = ("shown" if tol is None else "shown, not judged (the measured drift here is as large as an edit)"
                   if not judged else "reproduced" if good else f"NOT reproduced (tol {tol(p['step']):.2e})")
        report.append(f"rerun: val_loss at step {p['step']}: logged {a:.4f}, rerun {b:.4f}, diff {abs(a - b):.2e}: "
                      f"{verdict}")
    return ok, report


def compare_summary(old, new, tol):
    """The summary line of a log against that of a rerun of the whole run: ``(ok, report lines)``.

    Its val loss (``summary_val_key``) within ``tol`` at the last step (None: shown, not judged);
    the counts ``SUMMARY_COUNTS`` must be equal.
    """
    key = summary_val_key(old)
    a, b = old.summary.get(key), new.summary.get(key)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        ok, line = False, f"rerun: summary {key}: logged {a}, rerun {b}: NOT reproduced"
    else:
        step = new.summary.get("steps", 0)
        t = tol(step) if tol is not None and tol.judges_val(step) else None
        ok = t is None or same_loss(a, b, t)
        verdict = ("shown" if tol is None else "shown, not judged (the measured drift here is as large as an edit)"
                   if t is None else "reproduced" if ok else f"NOT reproduced (tol {t:.2e})")
        line = f"rerun: summary {key}: logged {a:.4f}, rerun {b:.4f}, diff {abs(a - b):.2e}: {verdict}"
    report = [line]
    def show(run, key):  # as the summary line prints it
        v = run.summary.get(key, "missing")
        return f"{v:.3e}" if isinstance(v, float) else str(v)
    differ = [f"{k} logged {show(old, k)} vs rerun {show(new, k)}"
              for k in SUMMARY_COUNTS if old.summary.get(k) != new.summary.get(k)]
    same = ", ".join(f"{k}:{show(old, k)}" for k in SUMMARY_COUNTS)
    report.append("rerun: summary " + (f"counts differ: {'; '.join(differ)}" if differ else f"counts equal ({same})"))
    return ok and not differ, report


def summary_val_key(run):
    """The val loss a summary line names: ``final_val_loss``, or ``last_val_loss`` where a run stopped
    by --max-steps logged it under that name (older trainers called every one final)."""
    return "last_val_loss" if "last_val_loss" in run.summary else "final_val_loss"


def coverage(old, last):
    """The report line saying which numbers of the log a rerun of steps 1..``last`` can check."""
    total = old.summary.get("steps") if isinstance(old.summary.get("steps"), int) else None
    if total is not None and last >= total:
        return (f"rerun: covers steps 0..{last} of {total}, the whole run: every val_loss and train_loss line "
                f"and the summary's {summary_val_key(old)}, {', '.join(SUMMARY_COUNTS)} are recomputed; no rerun can "
                f"check {NOT_RERUNNABLE}")
    end = f"of {total}" if total is not None else "(the log has no summary line: the run did not finish)"
    final = f" (so not the final val loss at step {total}, the number a record stands on)" if total else ""
    return (f"rerun: covers steps 0..{last} {end} only: a partial rerun cannot check the val losses after step "
            f"{last}{final}, the train losses after step {last}, or the summary line; no rerun can check "
            f"{NOT_RERUNNABLE}")


def rerun(lines, rest, sources, config, steps, train_files=None, val_files=None, run_dir=None, tol=None,
          threads=None, keep=None, repo=None):
    """Re-run the first ``steps`` steps with the extracted code and compare; returns ``(ok, report lines)``.

    ``config``: the logged config (``logged_config``; None: the log has none, a failure).
    ``tol`` (None: by the machine case, see ``judgement``) bounds |logged - rerun| of the losses;
    ``threads`` (None: the logged run's) sets the rerun's torch threads; ``repo``: the checkout whose
    data/gpt2_bpe/encoder.json the rerun reads (default: the one holding records/). The rerun works in a
    temp dir that is always removed, also on Ctrl-C (which propagates); ``keep``: a folder that
    receives its code and log (``verify.txt``) first.
    """
    if config is None:
        return False, [f"rerun: {NO_CONFIG}"]
    logged = [p["step"] for p in parse_lines(lines).train if p.get("train_loss") is not None]
    if logged and logged[0] > steps:  # nothing to compare: said before minutes of running
        return False, [f"rerun: no train_loss line of steps 1..{steps} in both logs to compare; the log's first is at "
                       f"step {logged[0]}: pass --rerun {logged[0]} or more"]
    config = dict(config)  # the rerun overrides some fields (device, log dir, ...) in place
    tmp = tempfile.mkdtemp(prefix="verify_")
    try:
        ok, report = _rerun_in(tmp, lines, rest, sources, config, steps, (train_files, val_files), run_dir,
                               tol, threads, repo or os.path.dirname(HERE))
        if keep:
            shutil.copytree(tmp, keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = (f"rerun: code and log kept in {keep}" if keep else
             "rerun: temp dir removed" + ("" if ok else "; pass --keep DIR to keep the rerun's code and log"))
    return ok, report[:1] + [where] + report[1:]


def launch(config, sources, last, run_dir, threads, tmp, compile, run_id):
    """One rerun: ``(report lines, its log as compare.Run's lines or None when it failed)``."""
    cmd, proc, error = run_logged_code(dict(config), sources, last, run_dir, threads, tmp, compile, run_id)
    if error:
        return [f"rerun: {error}"], None
    report = ["rerun: " + " ".join(shlex.quote(a) for a in cmd) + (f"  (OMP_NUM_THREADS={threads})" if threads else "")]
    new_log = os.path.join(tmp, f"{run_id}.txt")
    if proc.returncode != 0 or not os.path.exists(new_log):
        return report + [f"rerun: {ENTRY} exited with {proc.returncode} (run from --run-dir {run_dir}, where the "
                         "logged data globs resolve):", (proc.stderr or proc.stdout).strip()[-3000:]], None
    return report, read_log_lines(new_log)


def second_rerun(config, sources, last, run_dir, threads, tmp, compiled, here, first):
    """``(ok, report lines, MeasuredTolerance)``: the log re-run again in another summation order only (a
    compiled log: eager, same threads; an eager one: 2 threads, or 1 where the first had more), to measure how
    fast this run amplifies a reordering on this machine (``first``: the first rerun's ``compare.Run``)."""
    n = here.get("threads") or 1
    other = threads if compiled else (2 if n == 1 else 1)
    between = "compiled - eager" if compiled else f"{n} - {other} threads"
    label = "eager" if compiled else f"{other} thread{'s' if other > 1 else ''}"
    more, lines = launch(config, sources, last, run_dir, other, tmp, False, "verify_eager" if compiled else "verify_threads")
    more = [ln.replace("rerun: ", f"rerun ({label}, to measure the drift): ", 1) for ln in more]
    if lines is None:
        return False, more, None
    return True, more, measure_drift(first, parse_lines(lines), between)


def _rerun_in(tmp, lines, rest, sources, config, steps, files, run_dir, tol, threads, repo):
    """``rerun`` with the folder ``tmp`` to work in."""
    # Data globs are relative to where the run was launched (the repo root for run.sh);
    # overrides given to verify.py are relative to the caller, so make them absolute.
    for key, value in zip(("train_files", "val_files"), files):
        if value:
            config[key] = os.path.abspath(value)
    old, logged_machines = parse_lines(lines), machines(lines, rest)
    # a compiled CPU log is re-run compiled (the same kind of device); a GPU log's CPU rerun is eager
    compiled = was_compiled(lines, rest, config) and not is_gpu_log(logged_machines)
    total = old.summary.get("steps")
    last = min(steps, total) if isinstance(total, int) and total > 0 else steps
    cpu_threads = [m["threads"] for m in logged_machines if m["threads"]]
    threads = threads or (cpu_threads[0] if cpu_threads else None)
    try:
        write_sources(sources, tmp)
    except ValueError as e:
        return False, [f"rerun: {e}"]
    reads_tokenizer = config.get("objectives") or any(k == "data tokenizer" for k, _ in data_fingerprints(lines, rest))
    if reads_tokenizer and (error := place_tokenizer(repo, tmp)):
        return False, [f"rerun: {error}"]
    report, fresh_lines = launch(config, sources, last, run_dir, threads, tmp, compiled, "verify")
    if fresh_lines is None:
        return False, report
    ok = True
    logged_fp, new_fp = data_fingerprints(lines, rest), data_fingerprints(fresh_lines)
    if logged_fp != new_fp:
        ok = False
        report.append(f"rerun: the data differ from the logged run's (fingerprints {logged_fp} vs {new_fp}); "
                      f"pass --train-files/--val-files pointing at the same shards")
    here = (machines(fresh_lines) or [dict(device="cpu", world=1, cpu=None, threads=None, gpus=None)])[0]
    new, measured = parse_lines(fresh_lines), None
    if tol is None and not is_gpu_log(logged_machines) and machine_differences(logged_machines, here):
        ok_second, more, measured = second_rerun(config, sources, last, run_dir, threads, tmp, compiled, here, new)
        report += more
        if not ok_second:
            return False, report
    text, rule = judgement(logged_machines, here, tol, compiled, measured)
    report += [f"rerun: machine: {text}", coverage(old, last)]
    checks = [compare_train(old, new, last, rule), compare_val(old, new, last, rule)]
    if isinstance(total, int) and last >= total:
        checks.append(compare_summary(old, new, rule))
    for check_ok, lines_out in checks:
        ok &= check_ok
        report += lines_out
    return ok, report


def study_order(log, train_files, run_dir, seq_len):
    """The recipe of the small-scale study's data order that ``train_files`` names when no shard matches it.

    bench/small_scale.py trains on orders of a corpus in ``<study>/data/<kind>_o<k>_<sha10>/`` (git-
    ignored). The recipe comes from ``data_recipes.json`` beside the log's arm folder; a study older
    than that file used the benchmark's defaults then (data/sample, chunks of the logged ``seq_len``),
    checked against the folder's sha when rebuilt. None for any other glob, or one that matches shards.
    """
    import glob
    pattern = train_files if os.path.isabs(train_files) else os.path.join(run_dir, train_files)
    folder = os.path.basename(os.path.dirname(pattern))
    m = re.match(r"^(?P<kind>mix|docs|pieces)_o(?P<order>\d+)_(?P<sha10>[0-9a-f]{10})$", folder)
    if not m or glob.glob(pattern):
        return None
    for d in (os.path.dirname(os.path.abspath(log)), os.path.dirname(os.path.dirname(os.path.abspath(log)))):
        try:
            with open(os.path.join(d, "data_recipes.json"), encoding="utf-8") as f:
                recipes = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(recipes, dict) and folder in recipes:
            return recipes[folder]
    return dict(folder=folder, train_files=os.path.join("data", "sample", "*_train_*.bin"), kind=m["kind"],
                order=int(m["order"]), chunk=seq_len, sha10=m["sha10"])


def rebuild_study_order(rec, run_dir, tmp):
    """Rebuild a study's data order (``study_order``) under ``tmp``: ``(shard glob, None)`` or ``(None, one line)``
    naming the command that rebuilds it (bench/small_scale_data.py, the recipe's arguments)."""
    path = os.path.join(os.path.dirname(HERE), "bench", "small_scale_data.py")  # loaded by path: sys.path unchanged
    spec = importlib.util.spec_from_file_location("small_scale_data", path)
    small_scale_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(small_scale_data)
    try:
        return small_scale_data.rebuild(rec, os.path.join(tmp, "data"), run_dir), None
    except (small_scale_data.OrderError, OSError) as e:
        command = small_scale_data.rebuild_command(rec, "DIR")
        return None, (f"the study's data order {rec['folder']} is missing and cannot be rebuilt here ({e}); "
                      f"rebuild it with `{command}` (from the repository root) and pass --train-files "
                      f"'DIR/{rec['folder']}/*_train_*.bin'")


def study_data(args, config, tmp):
    """``(train_files for the rerun, a line to print or None)``: ``--train-files``, else a small-scale study's
    missing data order (named by the logged ``config``) rebuilt under ``tmp`` from its recipe; ``False`` as the
    glob when that fails."""
    if args.train_files:
        return args.train_files, None
    if config is None:
        return None, None  # the rerun names the missing config line
    rec = study_order(args.log, str(config.get("train_files", "")), os.path.abspath(args.run_dir),
                      int(config.get("seq_len", 0) or 0))
    if rec is None:
        return None, None
    got, problem = rebuild_study_order(rec, os.path.abspath(args.run_dir), tmp)
    if problem:
        return False, f"rerun: {problem}"
    return got, f"data: {rec['folder']} (a small-scale study's data order) was missing: rebuilt from its recipe"


class _Parser(argparse.ArgumentParser):
    """A bad argument is one error line (exit status 2), not the usage block above it."""

    def error(self, message):
        self.exit(2, f"verify.py: error: {message}\n")


RERUN_ONLY = ("--train-files", "--val-files", "--tol", "--threads", "--run-dir")  # and --keep, with its own message


def parse_args(argv):
    """The command line's arguments; a bad value exits with status 2 and one message naming the flag."""
    ap = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog=__doc__)
    ap.add_argument("log", help="a run log (<run_id>.txt) written by train_gpt.py")
    ap.add_argument("--extract", metavar="DIR", help="write the logged source files to DIR instead of "
                                                     "comparing them with the working tree")
    ap.add_argument("--rerun", metavar="K", type=int, default=0,
                    help="re-run the first K steps on CPU with the logged code and config")
    ap.add_argument("--train-files", help="--rerun: train shards glob instead of the logged one")
    ap.add_argument("--val-files", help="--rerun: val shards glob instead of the logged one")
    ap.add_argument("--tol", type=float, help="--rerun: allowed |logged - rerun| of every loss, instead of the "
                                              "tolerance of the machine case (see below)")
    ap.add_argument("--threads", type=int, help="--rerun: torch threads of the rerun (OMP_NUM_THREADS); "
                                                "default: the logged run's")
    ap.add_argument("--keep", metavar="DIR", help="--rerun: copy the rerun's code and log (verify.txt) to DIR "
                                                  "(created if missing); without it nothing of the rerun is kept")
    ap.add_argument("--repo", default=os.path.dirname(HERE),
                    help="the tree whose train_gpt.py/aurora_opt.py the snapshot is compared with; "
                         "default: the repo holding records/")
    ap.add_argument("--run-dir", help="--rerun: where the rerun is launched, so where the log's relative data globs "
                                      "resolve (runs are launched from the repo root); default: the repo holding "
                                      "records/")
    args = ap.parse_args(argv)
    if args.rerun < 0:
        ap.error("--rerun K needs K >= 1 (0, the default, skips the rerun)")
    if args.keep and not args.rerun:
        ap.error(f"--keep {args.keep}: keeps a rerun's code and log; add --rerun K")
    empty = [flag for flag in ("--extract", "--keep", "--repo", "--run-dir", "--train-files", "--val-files")
             if getattr(args, flag[2:].replace("-", "_")) == ""]
    if empty:  # '' reads as "not given" further on: it would be ignored in silence
        ap.error(f"{empty[0]} '': an empty path; pass a {'glob' if 'files' in empty[0] else 'folder'} or leave "
                 f"{empty[0]} out")
    ignored = [flag for flag in RERUN_ONLY if getattr(args, flag[2:].replace("-", "_")) is not None]
    if ignored and not args.rerun:  # else they would be ignored in silence
        one = len(ignored) == 1
        ap.error(f"{', '.join(ignored)} {'applies' if one else 'apply'} to --rerun only and would be ignored without "
                 f"it; add --rerun K or leave {'it' if one else 'them'} out")
    args.run_dir = os.path.dirname(HERE) if args.run_dir is None else args.run_dir
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1 (got {args.threads})")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol >= 0):
        ap.error(f"--tol must be a finite number >= 0 (got {args.tol})")
    return args


def path_problem(args):
    """One line naming the flag and the fix for a path argument that cannot work, else None."""
    for flag, folder in (("--extract", args.extract), ("--keep", args.keep)):
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            return f"{flag} {folder}: exists and is not a folder; pass a folder (created if missing)"
    for flag, folder, fix in (("--repo", args.repo, "a checkout of this repository"),
                              ("--run-dir", args.run_dir, "the folder the run was launched from (its data globs "
                                                          "are relative to it)")):
        if not os.path.isdir(folder):
            return f"{flag} {folder}: {'not a folder' if os.path.exists(folder) else 'no such folder'}; pass {fix}"
    if not os.path.isfile(args.log):  # a FIFO or device would block or never end
        what = "no such file" if not os.path.exists(args.log) else "not a regular file (a folder, FIFO or device)"
        return f"{args.log}: {what}; pass a run log (<log-dir>/<run_id>.txt, written by train_gpt.py)"
    return None


def extract_to(folder, sources):
    """Write the snapshot's ``sources`` into ``folder`` (--extract) and say so; the error line instead (a
    file there with other content, a folder that cannot be written), with nothing overwritten."""
    clash = [n for n in sources if os.path.lexists(os.path.join(folder, n))
             and not same_text(os.path.join(folder, n), sources[n])]
    if clash:
        return f"--extract {folder}: would overwrite {', '.join(clash)} there (different content); pass an empty or new folder"
    try:
        write_sources(sources, folder)
    except ValueError as e:
        return f"--extract {folder}: {e}"
    except OSError as e:
        return (f"--extract {folder}: cannot write there ({e.strerror or e}); pass a folder you can write "
                "(created if missing)")
    print(f"extracted {', '.join(sources)} to {folder}" if sources else
          f"extracted nothing: the snapshot holds no complete file (nothing written to {folder})")
    return None


def main(argv=None):
    """Command line; returns the exit status (0 only if every check passed)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that left (`| head`): stop quietly
    args = parse_args(argv)

    def error(message):
        print(f"verify.py: error: {message}", file=sys.stderr)
        return 2

    if path_problem(args):
        return error(path_problem(args))
    try:
        lines = read_log_lines(args.log)
    except OSError as e:
        return error(f"{args.log}: cannot read it ({e.strerror or e}); check its permissions")
    sources, problems, rest = extract(lines)
    if not split_snapshot(lines)[0]:
        return error(f"{args.log}: " + "; ".join(problems))
    try:
        config = logged_config(lines, rest, sources) if args.rerun else None
    except ValueError as e:
        return error(f"{args.log}: {e}")

    print(f"log: {args.log}")
    status = [ln for ln in lines[rest:] if ln.startswith("status:")]
    if not status or not status[-1].startswith("status:complete"):
        print(f"note: the run did not finish ({status[-1].strip() if status else 'no status line'}); "
              "the checks below cover its code and first steps only")
    headers = {f.name: f.sha256 for f in split_snapshot(lines)[0]}
    for name, text in sources.items():
        match = "matches its header" if sha256(text) == headers[name] else "DOES NOT match its header"
        print(f"snapshot: {name} {len(text.splitlines())} lines, sha256 {sha256(text)[:16]}... {match}")
    for p in problems:
        print(f"FAIL snapshot: {p}")
    failed = bool(problems)
    if args.extract:
        if (problem := extract_to(args.extract, sources)):
            return error(problem)
    else:
        diffs = compare_with_tree(sources, os.path.abspath(args.repo))
        # a rerun asks "does this log reproduce?", which the log's own code answers: code that has moved on
        # since (an older record, a study made by its own snapshot) is said, not failed
        for d in diffs:
            print(f"note: working tree: {d}" if args.rerun else f"FAIL working tree: {d}")
        if diffs and args.rerun:
            print("note: the log was made by other code than this working tree's; the rerun runs the log's own code")
        if sources and not diffs:
            print(f"working tree: {', '.join(sources)} equal to the log's snapshot ({os.path.abspath(args.repo)})")
        failed |= bool(diffs) and not args.rerun
    missing = [n for n in snapshot_names(sources, [f.name for f in split_snapshot(lines)[0]]) if n not in sources]
    if args.rerun and missing:
        print(f"rerun: skipped: the log holds no complete {' / '.join(missing)} to run")
        failed = True
    elif args.rerun:
        try:
            with tempfile.TemporaryDirectory(prefix="verify_data_") as data_tmp:
                train_files, note = study_data(args, config, data_tmp)
                if note:
                    print(note)
                ok, report = (rerun(lines, rest, sources, config, args.rerun, train_files, args.val_files,
                                    os.path.abspath(args.run_dir), args.tol, args.threads, args.keep,
                                    os.path.abspath(args.repo))
                              if train_files is not False else (False, []))
        except ValueError as e:
            ok, report = False, [f"rerun: {e}"]
        except OSError as e:  # --keep not writable (the temp dir is removed all the same)
            ok, report = False, [f"rerun: --keep {args.keep}: cannot write there ({e.strerror or e}); pass a "
                                 "folder you can write"]
        print("\n".join(report))
        failed |= not ok
    if not args.rerun and not failed:
        print("not checked: the numbers after the snapshot (losses, counts, summary) carry no checksum; "
              "--rerun K recomputes those of the first K steps")
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


def _raise_interrupt(signum, frame):
    """SIGTERM (``timeout``, a scheduler) stops verify like Ctrl-C."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the rerun (if any) is killed and its temp dir removed on the way out
        print("verify.py: interrupted: no verdict; the rerun, if one was running, was stopped and its temp dir "
              "removed", file=sys.stderr)
        sys.exit(130)
