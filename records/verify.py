"""Check that a run log is a faithful snapshot of the code, and optionally that it reproduces.

    python records/verify.py LOG                     # snapshot consistent and equal to the working tree?
    python records/verify.py LOG --extract DIR       # write the logged train_gpt.py / aurora_opt.py to DIR
    python records/verify.py LOG --rerun 3           # + re-run the first 3 steps on CPU with the logged
                                                     #   code and config, compare the train losses
    python records/verify.py LOG --rerun 3 --train-files 'data/x/*_train_*.bin' --val-files '...'

Checks, in order:
1. the log starts with a ``### file <name> lines=<n> sha256=<hex>`` header for each source file,
   each followed by its n lines, then the separator line; every stored file's sha256 equals
   its header (a file edited inside the log no longer matches: reported, and the run fails). A
   log that ends before a header's n lines (a cut copy, an interrupted write) is reported as
   truncated; the cut file is then neither hashed, compared nor extracted;
2. (unless ``--extract``) each stored file equals the working tree's file (``--repo``, default
   the repository that holds this records/ folder), else the first differing line is reported;
3. with ``--rerun K``: the extracted code is written to a temp dir and run (from ``--run-dir``,
   default the repo root, as the log's data globs are relative to where the run was launched) as
   ``python <tmp>/train_gpt.py <config_to_argv(config)> --max-steps K --device cpu --no-compile
   --log-dir <tmp> --run-id verify``; each logged ``train_loss`` of steps 1..K must be reproduced
   within ``--tol`` (1e-4: float32 CPU runs, losses printed to 4 decimals), and the rerun must
   have read data with the same fingerprints as the logged run.

What it does NOT check: only the source snapshot carries checksums. Everything after the
separator (environment, config, data lines, step lines, val losses, train times, the summary and
the status line) is not checksummed: an edit there is caught only where ``--rerun K`` recomputes
it, i.e. the first K train losses and the data fingerprints. The val losses, the later train
losses, ``train_time`` and the summary/status lines (the numbers a record is judged on) are taken
on trust; only a full rerun checks them.

Exit status: 0 only if every check passed; 1 if one failed; 2 for a log that cannot be read (or
has no snapshot at all) and for bad arguments (e.g. ``--extract`` naming a file).
"""
import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import SEPARATOR, has_line_end, parse_lines, parse_log, read_log_lines, split_snapshot  # noqa: E402

SOURCE_FILES = ("train_gpt.py", "aurora_opt.py")  # what train_gpt.py snapshots, in this order
# Allocator settings of the CPU runs (also used by run.sh / the tests): keep the rerun identical.
RERUN_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


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
    for name in SOURCE_FILES:
        if name not in sources:
            problems.append(f"{name}: missing from the snapshot")
    if rest >= len(lines):
        problems.append("the log is truncated: it ends right after the snapshot (no separator line, no run)")
    elif lines[rest].rstrip("\r\n") != SEPARATOR:
        problems.append(f"line {rest + 1}: expected the separator line of 100 '=' after the snapshot")
    return sources, problems, rest


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


def compare_with_tree(sources, repo):
    """Messages for every stored file that differs from (or is missing in) the tree at ``repo``."""
    out = []
    for name, text in sources.items():
        path = os.path.join(repo, name)
        if not os.path.exists(path):
            out.append(f"{name}: not in the working tree {repo}")
            continue
        with open(path, encoding="utf-8", newline="") as f:
            diff = first_difference(name, text, f.read())
        if diff:
            out.append(diff)
    return out


def write_sources(sources, folder):
    """Write the extracted files byte for byte (no newline translation)."""
    os.makedirs(folder, exist_ok=True)
    for name, text in sources.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)


def logged_config(lines, rest):
    """The ``config: {...}`` dict written after the snapshot."""
    for ln in lines[rest:]:
        if ln.startswith("config: {"):
            return json.loads(ln[len("config: "):])
    raise ValueError("no 'config: {...}' line after the snapshot: the run cannot be repeated")


def data_fingerprints(lines, rest=0):
    """``[(kind, fingerprint), ...]`` of the ``data train:/data val:`` lines before the first step line.

    Only the first block counts: a resumed run lists its data again further down.
    """
    out = []
    for ln in lines[rest:]:
        if ln.startswith("step:"):
            break
        if ln.startswith(("data train:", "data val:")):
            kind = ln.split(":", 1)[0]
            fp = ln.rsplit("fingerprint:", 1)[-1].strip()
            out.append((kind, fp))
    return out


def rerun(lines, rest, sources, steps, train_files=None, val_files=None, run_dir=None, tol=1e-4):
    """Re-run the first ``steps`` steps with the extracted code; returns ``(ok, report lines)``."""
    config = logged_config(lines, rest)
    # Data globs are relative to where the run was launched (the repo root for run.sh);
    # overrides given to verify.py are relative to the caller, so make them absolute.
    if train_files:
        config["train_files"] = os.path.abspath(train_files)
    if val_files:
        config["val_files"] = os.path.abspath(val_files)
    tmp = tempfile.mkdtemp(prefix="verify_")
    write_sources(sources, tmp)
    # Never touch the logged run's checkpoints or resume from them; a short CPU run into tmp.
    for key, value in dict(resume="", checkpoint_dir=os.path.join(tmp, "checkpoints"), save_every=0,
                           save_final=False, save_on_interrupt=False, max_steps=steps, device="cpu",
                           compile=False, log_dir=tmp, run_id="verify").items():
        if key in config:
            config[key] = value
    # config_to_argv of the logged code: its flags are the ones that code understands.
    to_argv = ("import json, sys; sys.path.insert(0, sys.argv[1]); import train_gpt; "
               "print(json.dumps(train_gpt.config_to_argv(json.loads(sys.argv[2]))))")
    got = subprocess.run([sys.executable, "-c", to_argv, tmp, json.dumps(config)], cwd=tmp,
                         capture_output=True, text=True)
    if got.returncode != 0:
        return False, ["rerun: config_to_argv of the logged code failed:", got.stderr.strip()[-2000:]]
    argv = json.loads(got.stdout.strip().splitlines()[-1])
    cmd = [sys.executable, os.path.join(tmp, "train_gpt.py")] + argv
    env = dict(os.environ, **RERUN_ENV)
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True)
    new_log = os.path.join(tmp, "verify.txt")
    report = ["rerun: " + " ".join(shlex.quote(a) for a in cmd), f"rerun: code and log in {tmp}"]
    if proc.returncode != 0 or not os.path.exists(new_log):
        return False, report + [f"rerun: train_gpt.py exited with {proc.returncode}:",
                                (proc.stderr or proc.stdout).strip()[-3000:]]

    ok = True
    fresh_lines = read_log_lines(new_log)
    logged_fp, new_fp = data_fingerprints(lines, rest), data_fingerprints(fresh_lines)
    if logged_fp != new_fp:
        ok = False
        report.append(f"rerun: the data differ from the logged run's (fingerprints {logged_fp} vs {new_fp}); "
                      f"pass --train-files/--val-files pointing at the same shards")
    logged = {p["step"]: p["train_loss"] for p in parse_lines(lines).train if p.get("train_loss") is not None}
    fresh = {p["step"]: p["train_loss"] for p in parse_log(new_log).train if p.get("train_loss") is not None}
    common = [s for s in range(1, steps + 1) if s in logged and s in fresh]
    if not common:
        return False, report + ["rerun: no train_loss line of steps 1..K in both logs to compare"]
    report.append(f"{'step':>6}  {'logged':>10}  {'rerun':>10}  {'diff':>10}")
    losses_ok = True
    for s in common:
        d = abs(logged[s] - fresh[s])
        good = d <= tol + 1e-9  # slack: both values are decimal strings with 4 places
        losses_ok &= good
        report.append(f"{s:>6}  {logged[s]:>10.4f}  {fresh[s]:>10.4f}  {d:>10.2e}{'' if good else '  > tol'}")
    report.append(f"rerun: train losses {'reproduced' if losses_ok else 'NOT reproduced'} within {tol:g} "
                  f"({len(common)} step(s) compared)")
    ok &= losses_ok
    if ok:  # keep the code and log of a failed rerun for inspection only
        shutil.rmtree(tmp, ignore_errors=True)
        report[1] = "rerun: done (temp dir removed)"
    return ok, report


def main(argv=None):
    """Command line; returns the exit status (0 only if every check passed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("log", help="a run log (<run_id>.txt) written by train_gpt.py")
    ap.add_argument("--extract", metavar="DIR", help="write the logged source files to DIR instead of "
                                                     "comparing them with the working tree")
    ap.add_argument("--rerun", metavar="K", type=int, default=0,
                    help="re-run the first K steps on CPU with the logged code and config")
    ap.add_argument("--train-files", help="--rerun: train shards glob instead of the logged one")
    ap.add_argument("--val-files", help="--rerun: val shards glob instead of the logged one")
    ap.add_argument("--tol", type=float, default=1e-4, help="--rerun: allowed |logged - rerun| train loss")
    ap.add_argument("--repo", default=os.path.dirname(HERE),
                    help="the tree whose train_gpt.py/aurora_opt.py the snapshot is compared with; "
                         "default: the repo holding records/")
    ap.add_argument("--run-dir", default=os.path.dirname(HERE),
                    help="--rerun: where the rerun is launched, so where the log's relative data globs "
                         "resolve (runs are launched from the repo root); default: the repo holding records/")
    args = ap.parse_args(argv)
    if args.rerun < 0:
        ap.error("--rerun K needs K >= 1 (0, the default, skips the rerun)")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        ap.error(f"--tol must be a finite number >= 0 (got {args.tol})")

    def error(message):
        print(f"verify.py: error: {message}", file=sys.stderr)
        return 2

    if args.extract and os.path.exists(args.extract) and not os.path.isdir(args.extract):
        return error(f"--extract {args.extract}: exists and is not a folder; pass a folder (created if missing)")
    try:
        lines = read_log_lines(args.log)
    except OSError as e:
        return error(e)
    sources, problems, rest = extract(lines)
    if not split_snapshot(lines)[0]:
        return error(f"{args.log}: " + "; ".join(problems))

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
        try:
            write_sources(sources, args.extract)
        except OSError as e:
            return error(f"--extract {args.extract}: cannot write there ({e.strerror or e}); pass a folder "
                         "you can write (created if missing)")
        print(f"extracted {', '.join(sources) or 'nothing'} to {args.extract}")
    else:
        diffs = compare_with_tree(sources, os.path.abspath(args.repo))
        for d in diffs:
            print(f"FAIL working tree: {d}")
        if sources and not diffs:
            print(f"working tree: {', '.join(sources)} equal to the log's snapshot ({os.path.abspath(args.repo)})")
        failed |= bool(diffs)
    missing = [name for name in SOURCE_FILES if name not in sources]
    if args.rerun and missing:
        print(f"rerun: skipped: the log holds no complete {' / '.join(missing)} to run")
        failed = True
    elif args.rerun:
        try:
            ok, report = rerun(lines, rest, sources, args.rerun, args.train_files, args.val_files,
                               os.path.abspath(args.run_dir), args.tol)
        except ValueError as e:
            ok, report = False, [f"rerun: {e}"]
        print("\n".join(report))
        failed |= not ok
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
