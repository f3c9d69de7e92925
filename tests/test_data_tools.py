"""The data tools: data/tokenize.py (text -> shards, --check), data/check_shards.py and
data/cached_fineweb10B.py (Hub download), on CPU and without network.

Real text and the offline tokenizer files come from ../shared (next to the repo root).
The CLIs run as subprocesses exactly as users run them (``python data/tokenize.py``), because
that file name shadows the stdlib ``tokenize`` unless the script guards against it.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(REPO, "..", "shared")
REALTEXT = os.path.join(SHARED, "data", "realtext")
TIKTOKEN_CACHE = os.path.join(SHARED, "tokenizer", "tiktoken_cache")
EOT = 50256


def _load(name, filename):
    """Import a data/ script by path (``import tokenize`` would give the stdlib module)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "data", filename))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tok = _load("data_tokenize", "tokenize.py")
dl = _load("data_cached_fineweb10B", "cached_fineweb10B.py")


@pytest.fixture(autouse=True)
def _offline_tokenizer(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", TIKTOKEN_CACHE)


@pytest.fixture(scope="module")
def enc():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", TIKTOKEN_CACHE)
        import tiktoken
        return tiktoken.get_encoding("gpt2")


def run_cli(script, *args, env=None, timeout=120):
    """Run ``python data/<script> args`` from the repo root; returns CompletedProcess (text)."""
    full_env = dict(os.environ, TIKTOKEN_CACHE_DIR=os.path.relpath(TIKTOKEN_CACHE, REPO), **(env or {}))
    return subprocess.run([sys.executable, os.path.join("data", script), *map(str, args)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def realtext_rows():
    with open(os.path.join(REALTEXT, "realtext.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def shard_tokens(path):
    """(header int32[256], tokens uint16[n]) of a shard file, read independently of the tools."""
    raw = open(path, "rb").read()
    return np.frombuffer(raw[:1024], dtype="<i4"), np.frombuffer(raw[1024:], dtype="<u2")


def stream(enc, texts):
    """Expected token stream: EOT before every document."""
    out = []
    for t in texts:
        out += [EOT, *enc.encode_ordinary(t)]
    return out


def bin_files(root):
    """Every *.bin under root, hidden folders included."""
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".bin"))


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


DOCS = ["First document.\nIt has two lines.", "Second one, with <|endoftext|> as plain text.",
        "Third: ünïcödé 漢字 🙂", "", "Fifth and last document of the little corpus."]


# ---------------------------------------------------------------------------------------------
# tokenizer: real text


def test_roundtrip_and_token_count_on_real_text(enc):
    rows = realtext_rows()
    assert len(rows) == 301
    for r in rows:
        assert enc.decode(enc.encode_ordinary(r["text"])) == r["text"]
    # one EOT per document + the BPE tokens == every token of the four shipped shards
    shipped = sum(len(shard_tokens(os.path.join(REALTEXT, n))[1]) for n in os.listdir(REALTEXT) if n.endswith(".bin"))
    assert sum(1 + len(enc.encode_ordinary(r["text"])) for r in rows) == shipped == 1_119_536


def test_cli_reproduces_realtext_val_shard_byte_for_byte(tmp_path):
    out = tmp_path / "out"
    res = run_cli("tokenize.py", os.path.join(REALTEXT, "realtext.jsonl"), "--filter", "split=val",
                  "--val-docs", "1000000", "--output-dir", out, "--prefix", "realtext", "--workers", "2")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "tok" in res.stderr  # the tqdm bar ran (and with it the stdlib `tokenize`-free path)
    assert sorted(os.listdir(out)) == ["realtext_val_000000.bin"]
    with open(out / "realtext_val_000000.bin", "rb") as a, \
            open(os.path.join(REALTEXT, "realtext_val_000000.bin"), "rb") as b:
        assert a.read() == b.read()


def test_cli_train_rows_split_by_shard_size_match_shipped_stream(tmp_path):
    out = tmp_path / "out"
    res = run_cli("tokenize.py", os.path.join(REALTEXT, "realtext.jsonl"), "--filter", "split=train",
                  "--shard-size", "400000", "--output-dir", out, "--prefix", "rt", "--workers", "2")
    assert res.returncode == 0, res.stderr
    names = sorted(os.listdir(out))
    assert names == ["rt_train_000001.bin", "rt_train_000002.bin", "rt_train_000003.bin"]
    shipped = np.concatenate([shard_tokens(os.path.join(REALTEXT, f"realtext_train_00000{i}.bin"))[1]
                              for i in (1, 2, 3)])
    parts = [shard_tokens(out / n) for n in names]
    assert [int(h[2]) for h, _ in parts] == [400_000, 400_000, len(shipped) - 800_000]
    for h, t in parts:
        assert list(h[:3]) == [20240520, 1, len(t)] and not h[3:].any()
    assert np.array_equal(np.concatenate([t for _, t in parts]), shipped)


# ---------------------------------------------------------------------------------------------
# tokenizer: inputs, splitting, val docs


def test_txt_inputs_keep_given_order_and_split_by_shard_size(tmp_path, enc):
    paths = []
    for i, text in enumerate(DOCS):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    order = paths[::-1]  # given order, not alphabetical
    written = tok.tokenize_to_shards(order, str(tmp_path / "out"), "t", shard_size=7, workers=1, progress=False)
    expected = stream(enc, DOCS[::-1])
    assert sum(n for _, n, _ in written) == len(expected)
    assert sum(d for _, _, d in written) == len(DOCS)
    assert [n for _, n, _ in written] == [7] * (len(expected) // 7) + ([len(expected) % 7] if len(expected) % 7 else [])
    got = []
    for i, (path, n, _) in enumerate(written, start=1):
        assert os.path.basename(path) == f"t_train_{i:06d}.bin"
        assert tok.read_shard_header(path) == n
        got += list(shard_tokens(path)[1])
    assert got == expected
    starts = [i for i, t in enumerate(got) if t == EOT] + [len(got)]
    assert [enc.decode(got[a + 1:b]) for a, b in zip(starts, starts[1:])] == DOCS[::-1]


def test_jsonl_filter_and_val_docs(tmp_path, enc):
    rows = [{"text": t, "split": "val" if i % 2 else "train", "n": i} for i, t in enumerate(DOCS)]
    src = write_jsonl(tmp_path / "d.jsonl", rows)

    w = tok.tokenize_to_shards([src], str(tmp_path / "a"), "p", val_docs=2, workers=1, progress=False)
    assert [os.path.basename(p) for p, _, _ in w] == ["p_val_000000.bin", "p_train_000001.bin"]
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, DOCS[:2])
    assert list(shard_tokens(w[1][0])[1]) == stream(enc, DOCS[2:])
    assert [d for _, _, d in w] == [2, 3]

    w = tok.tokenize_to_shards([src], str(tmp_path / "b"), "p", workers=1, progress=False)
    assert [os.path.basename(p) for p, _, _ in w] == ["p_train_000001.bin"]
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, DOCS)

    w = tok.tokenize_to_shards([src], str(tmp_path / "c"), "p", val_docs="all", filters={"split": "val"},
                               workers=1, progress=False)
    assert [os.path.basename(p) for p, _, _ in w] == ["p_val_000000.bin"]
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[1], DOCS[3]])

    # non-string values compare by their JSON text
    w = tok.tokenize_to_shards([src], str(tmp_path / "d"), "p", filters={"n": "4"}, workers=1, progress=False)
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[4]])


def test_existing_shards_need_overwrite_and_stale_ones_go(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    out = str(tmp_path / "out")
    tok.tokenize_to_shards([src], out, "p", shard_size=5, workers=1, progress=False)
    many = sorted(os.listdir(out))
    assert len(many) > 2
    with pytest.raises(tok.TokenizeError, match="--overwrite"):
        tok.tokenize_to_shards([src], out, "p", workers=1, progress=False)
    tok.tokenize_to_shards([src], out, "p", workers=1, overwrite=True, progress=False)
    assert sorted(os.listdir(out)) == ["p_train_000001.bin"]


def test_parquet_input_with_filter(tmp_path, enc):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": DOCS, "lang": ["en", "de", "en", "en", "de"]}), src, row_group_size=2)
    w = tok.tokenize_to_shards([src], str(tmp_path / "o"), "pq", filters={"lang": "en"}, val_docs=1,
                               workers=1, progress=False)
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[0]])
    assert list(shard_tokens(w[1][0])[1]) == stream(enc, [DOCS[2], DOCS[3]])

    pq.write_table(pa.table({"body": DOCS}), src)
    with pytest.raises(tok.TokenizeError, match="no column 'text'"):
        tok.tokenize_to_shards([src], str(tmp_path / "o2"), "pq", workers=1, progress=False)


def test_bad_inputs_get_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    res = run_cli("tokenize.py", bad, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "2")
    assert res.returncode == 1
    assert "bad.jsonl:2: not valid JSON" in res.stderr and "Traceback" not in res.stderr
    assert bin_files(tmp_path) == []
    for args, msg in [(["nothing*.jsonl"], "no file matches"), ([str(tmp_path / "bad.csv")], "unsupported input")]:
        (tmp_path / "bad.csv").write_text("a,b\n")
        with pytest.raises(tok.TokenizeError, match=msg):
            tok.tokenize_to_shards(args, str(tmp_path / "o"), "x", workers=1, progress=False)


@pytest.mark.parametrize("row", ["[1, 2, 3]", '"a string row"', "42", "null"])
def test_jsonl_rows_that_are_not_objects_are_an_error(tmp_path, row):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(f'{{"text": "fine"}}\n{row}\n{{"text": "also fine"}}\n', encoding="utf-8")
    with pytest.raises(tok.TokenizeError, match=r"rows\.jsonl:2: .*not a JSON object"):
        tok.tokenize_to_shards([str(bad)], str(tmp_path / "o"), "x", workers=1, progress=False)
    with pytest.raises(tok.TokenizeError, match=r"rows\.jsonl:2: "):  # also when a filter is given
        tok.tokenize_to_shards([str(bad)], str(tmp_path / "o"), "x", filters={"k": "v"}, workers=1,
                               progress=False)
    assert bin_files(tmp_path) == []


def _snapshot(folder):
    """{name: bytes} of every file in ``folder``."""
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


def test_overwrite_that_fails_partway_leaves_the_old_set_untouched(tmp_path):
    out = tmp_path / "out"
    old_src = write_jsonl(tmp_path / "old.jsonl", [{"text": t} for t in DOCS])
    tok.tokenize_to_shards([old_src], str(out), "p", shard_size=5, val_docs=1, workers=1, progress=False)
    before = _snapshot(out)
    assert len(before) > 4 and "p_val_000000.bin" in before
    # other documents (new shards get written and flushed), then a malformed line near the end
    new_src = tmp_path / "new.jsonl"
    new_src.write_text("".join(json.dumps({"text": t.upper() + " new"}) + "\n" for t in DOCS) + "{oops\n",
                       encoding="utf-8")
    for workers in (1, 2):
        with pytest.raises(tok.TokenizeError, match=r"new\.jsonl:6: not valid JSON"):
            tok.tokenize_to_shards([str(new_src)], str(out), "p", shard_size=5, workers=workers, overwrite=True,
                                   progress=False)
        assert _snapshot(out) == before  # same names, same bytes, no temporary file left
    res = run_cli("tokenize.py", new_src, "--output-dir", out, "--prefix", "p", "--shard-size", "5",
                  "--overwrite", "--workers", "2")
    assert res.returncode == 1 and "new.jsonl:6: not valid JSON" in res.stderr
    assert _snapshot(out) == before
    # the same input without the bad line: the new set replaces the old one entirely
    good_src = write_jsonl(tmp_path / "good.jsonl", [{"text": t.upper() + " new"} for t in DOCS])
    written = tok.tokenize_to_shards([good_src], str(out), "p", shard_size=7, workers=1, overwrite=True,
                                     progress=False)
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p, _, _ in written)
    assert "p_val_000000.bin" not in os.listdir(out)


def test_output_dir_that_is_a_file_gets_one_clear_error(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    (tmp_path / "out_is_file").write_text("not a folder")
    for out in (tmp_path / "out_is_file", tmp_path / "out_is_file" / "sub"):
        res = run_cli("tokenize.py", src, "--output-dir", out, "--prefix", "x", "--workers", "1")
        assert res.returncode == 1 and "Traceback" not in res.stderr
        [line] = res.stderr.strip().splitlines()
        assert line.startswith("error: --output-dir ") and str(tmp_path / "out_is_file") in line
        assert "not a folder" in line and "pick" in line, line
    assert (tmp_path / "out_is_file").read_text() == "not a folder"


class _WideEncoder:
    """Stands in for a tokenizer with more than 65536 tokens."""

    def encode_ordinary(self, text):
        return [1, 70000, 2]


def test_token_ids_that_do_not_fit_uint16_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tok, "_ENCODER", _WideEncoder())
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    with pytest.raises(tok.TokenizeError, match=r"d\.jsonl:1: token id 70000 does not fit in a uint16"):
        tok.tokenize_to_shards([src], str(tmp_path / "o"), "x", workers=1, progress=False)
    assert bin_files(tmp_path) == []


def test_uint16_refusal_from_worker_processes_via_cli(tmp_path):
    """The refusal raised inside a Pool worker (its traceback is formatted there, which needs the
    stdlib `tokenize`) reaches the user as one message."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import tiktoken\n"
        "class _Wide:\n"
        "    def encode_ordinary(self, text):\n"
        "        return [1, 70000]\n"
        "tiktoken.get_encoding = lambda name: _Wide()\n")
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    res = run_cli("tokenize.py", src, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "2",
                  env={"PYTHONPATH": str(site)})
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "token id 70000 does not fit in a uint16" in errors[0]
    assert "Traceback" not in res.stderr
    assert bin_files(tmp_path) == []


def test_tokenizer_that_cannot_load_names_tiktoken_cache_dir(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(tok, "_ENCODER", None)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    with pytest.raises(tok.TokenizeError,
                       match="TIKTOKEN_CACHE_DIR is not set.*TIKTOKEN_CACHE_DIR=../shared/tokenizer"):
        tok.get_encoder()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/nowhere")
    with pytest.raises(tok.TokenizeError, match="TIKTOKEN_CACHE_DIR=/nowhere is set but does not hold"):
        tok.get_encoder()


# ---------------------------------------------------------------------------------------------
# --check / check_shards.py


def _raw_shard(path, tokens, magic=20240520, version=1, n=None, cut=0, size=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if n is None else n
    data = header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()
    data = data[:size] if size is not None else data[:len(data) - cut]
    path.write_bytes(data)


@pytest.mark.parametrize("script,first", [("tokenize.py", ["--check"]), ("check_shards.py", [])])
def test_check_reports_each_bad_shard_kind(tmp_path, script, first):
    d = tmp_path / "s"
    d.mkdir()
    _raw_shard(d / "good.bin", [EOT, 1, 2, EOT, 3])
    _raw_shard(d / "magic.bin", [1, 2], magic=12345)
    _raw_shard(d / "version.bin", [1, 2], version=7)
    _raw_shard(d / "truncated.bin", [1, 2, 3], cut=2)
    _raw_shard(d / "short.bin", [], size=100)
    res = run_cli(script, *first, d / "*.bin")
    assert res.returncode == 1
    lines = {os.path.basename(line.split()[0]): line for line in res.stdout.splitlines()[1:]}
    assert res.stdout.splitlines()[0].split() == ["file", "tokens", "documents", "max_id", "status"]
    assert lines["good.bin"].split()[1:] == ["5", "2", "50256", "ok"]
    for name, why in [("magic.bin", "bad magic 12345"), ("version.bin", "version 7"),
                      ("truncated.bin", "header says 3 tokens"), ("short.bin", "shorter than the 1024-byte")]:
        assert why in lines[name] and str(d / name) in lines[name].split(None, 1)[1], lines[name]

    ok = run_cli(script, *first, d / "good.bin", os.path.join(REALTEXT, "*.bin"))
    assert ok.returncode == 0, ok.stdout
    assert "realtext_val_000000.bin" in ok.stdout and "100,483" in ok.stdout

    none = run_cli(script, *first, d / "nothing*.bin")
    assert none.returncode == 1 and "no file matches" in none.stdout


@pytest.mark.parametrize("script,first", [("tokenize.py", ["--check"]), ("check_shards.py", [])])
def test_check_reports_token_ids_above_gpt2(tmp_path, script, first):
    _raw_shard(tmp_path / "gpt2_max.bin", [EOT, 5, 50256, 17])
    _raw_shard(tmp_path / "wide.bin", [EOT, 5, 50257, 60000, 3])
    _raw_shard(tmp_path / "empty.bin", [])
    res = run_cli(script, *first, tmp_path / "*.bin")
    assert res.returncode == 1
    lines = {os.path.basename(line.split()[0]): line for line in res.stdout.splitlines()[1:]}
    assert lines["gpt2_max.bin"].split()[1:] == ["4", "2", "50256", "ok"]
    assert lines["empty.bin"].split()[1:] == ["0", "0", "-", "ok"]
    assert lines["wide.bin"].split()[1:4] == ["5", "1", "60000"]
    assert "token id 60000 > 50256: not GPT-2 BPE ids; re-tokenize with data/tokenize.py" in lines["wide.bin"]
    assert run_cli(script, *first, tmp_path / "gpt2_max.bin").returncode == 0


# ---------------------------------------------------------------------------------------------
# downloader


def _valid_shard_bytes(n=4):
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, n
    return header.tobytes() + np.arange(n, dtype="<u2").tobytes()


def test_download_default_dir_is_next_to_the_script():
    assert dl.DEFAULT_DIR == os.path.join(REPO, "data", "fineweb10B")
    assert dl.shard_names(2) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert len(dl.shard_names(103)) == 104


def test_download_offline_fails_fast_with_clear_message(tmp_path):
    t0 = time.time()
    res = run_cli("cached_fineweb10B.py", "1", "--local-dir", tmp_path / "fw", env={"HF_HUB_OFFLINE": "1"},
                  timeout=60)
    assert time.time() - t0 < 30
    assert res.returncode == 1
    assert "cannot reach the Hugging Face Hub" in res.stderr
    assert "DATA_DIR=/path/to/shards bash run.sh" in res.stderr and "--train-files" in res.stderr
    assert "Traceback" not in res.stderr
    assert bin_files(tmp_path) == []


def test_download_connection_error_during_download(tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise ConnectionError("connection refused")
    monkeypatch.setattr(dl, "check_hub_reachable", lambda filename: None)
    monkeypatch.setattr(dl, "hf_hub_download", fail)
    t0 = time.time()
    assert dl.main(["2", "--local-dir", str(tmp_path)]) == 1
    assert time.time() - t0 < 5
    err = capsys.readouterr().err
    assert "cannot reach the Hugging Face Hub" in err and "connection refused" in err and "DATA_DIR=" in err
    assert bin_files(tmp_path) == []


def test_download_probe_classifies_errors_and_has_a_deadline(monkeypatch):
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    def connect_error(url, timeout):
        raise httpx2.ConnectError("[Errno -2] Name or service not known")
    monkeypatch.setattr(dl, "get_hf_file_metadata", connect_error)
    with pytest.raises(dl.HubUnreachable, match="Name or service not known"):
        dl.check_hub_reachable("fineweb_val_000000.bin")

    def not_found(url, timeout):
        response = httpx2.Response(404, request=httpx2.Request("HEAD", url))
        raise HfHubHTTPError("404 Repository Not Found", response=response)
    monkeypatch.setattr(dl, "get_hf_file_metadata", not_found)
    with pytest.raises(HfHubHTTPError):
        dl.check_hub_reachable("fineweb_val_000000.bin")

    monkeypatch.setattr(dl, "get_hf_file_metadata", lambda url, timeout: time.sleep(3))
    t0 = time.time()
    with pytest.raises(dl.HubUnreachable, match="no answer"):
        dl.check_hub_reachable("fineweb_val_000000.bin", deadline_s=0.3)
    assert time.time() - t0 < 2


def test_download_skips_valid_and_redownloads_invalid(tmp_path, monkeypatch):
    fw = tmp_path / "fw"
    fw.mkdir()
    (fw / "fineweb_val_000000.bin").write_bytes(_valid_shard_bytes(7))
    (fw / "fineweb_train_000001.bin").write_bytes(_valid_shard_bytes(4)[:-3])  # truncated
    calls = []

    def fake_download(repo_id, filename, *, repo_type, local_dir):
        assert (repo_id, repo_type) == ("kjj0/fineweb10B-gpt2", "dataset")
        assert os.path.abspath(local_dir) != str(fw)  # never written under the final name directly
        calls.append(filename)
        os.makedirs(local_dir, exist_ok=True)
        path = os.path.join(local_dir, filename)
        with open(path, "wb") as f:
            f.write(_valid_shard_bytes(4))
        return path

    monkeypatch.setattr(dl, "check_hub_reachable", lambda filename: None)
    monkeypatch.setattr(dl, "hf_hub_download", fake_download)
    assert dl.main(["2", "--local-dir", str(fw)]) == 0
    assert calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert sorted(os.listdir(fw)) == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"]
    assert dl.read_shard_header(str(fw / "fineweb_val_000000.bin")) == 7  # untouched
    assert dl.read_shard_header(str(fw / "fineweb_train_000001.bin")) == 4
    calls.clear()
    assert dl.main(["2", "--local-dir", str(fw)]) == 0
    assert calls == []


def test_download_invalid_file_is_deleted_and_reported(tmp_path, monkeypatch, capsys):
    def bad_download(repo_id, filename, *, repo_type, local_dir):
        os.makedirs(local_dir, exist_ok=True)
        path = os.path.join(local_dir, filename)
        with open(path, "wb") as f:
            f.write(_valid_shard_bytes(4)[:-1])
        return path

    monkeypatch.setattr(dl, "check_hub_reachable", lambda filename: None)
    monkeypatch.setattr(dl, "hf_hub_download", bad_download)
    assert dl.main(["0", "--local-dir", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "invalid download, deleted" in out.out + out.err and "fineweb_val_000000.bin" in out.out + out.err
    assert bin_files(tmp_path) == []


def test_download_offline_keeps_an_invalid_file(tmp_path):
    """The invalid file is replaced only by a validated download, never deleted before the Hub answers."""
    fw = tmp_path / "fw"
    fw.mkdir()
    bad = _valid_shard_bytes(4)
    bad = b"\x00\x01\x02\x03" + bad[4:]  # bad magic
    (fw / "fineweb_val_000000.bin").write_bytes(bad)
    res = run_cli("cached_fineweb10B.py", "0", "--local-dir", fw, env={"HF_HUB_OFFLINE": "1"}, timeout=60)
    assert res.returncode == 1 and "cannot reach the Hugging Face Hub" in res.stderr
    assert "Traceback" not in res.stderr
    assert "fineweb_val_000000.bin" in res.stdout and "bad magic" in res.stdout
    assert os.listdir(fw) == ["fineweb_val_000000.bin"] and (fw / "fineweb_val_000000.bin").read_bytes() == bad


def test_download_replaces_an_invalid_file_only_with_a_valid_download(tmp_path, monkeypatch, capsys):
    fw = tmp_path / "fw"
    fw.mkdir()
    bad = _valid_shard_bytes(4)[:-1]
    (fw / "fineweb_val_000000.bin").write_bytes(bad)
    payload = {"data": _valid_shard_bytes(4)[:-3]}  # first try: an invalid download

    def fake_download(repo_id, filename, *, repo_type, local_dir):
        assert (fw / filename).read_bytes() == bad  # still there while the replacement downloads
        os.makedirs(local_dir, exist_ok=True)
        path = os.path.join(local_dir, filename)
        with open(path, "wb") as f:
            f.write(payload["data"])
        return path

    monkeypatch.setattr(dl, "check_hub_reachable", lambda filename: None)
    monkeypatch.setattr(dl, "hf_hub_download", fake_download)
    assert dl.main(["0", "--local-dir", str(fw)]) == 1
    assert "invalid download, deleted" in capsys.readouterr().out
    assert bin_files(tmp_path) == [str(fw / "fineweb_val_000000.bin")]
    assert (fw / "fineweb_val_000000.bin").read_bytes() == bad  # left as it was
    payload["data"] = _valid_shard_bytes(9)
    assert dl.main(["0", "--local-dir", str(fw)]) == 0
    assert dl.read_shard_header(str(fw / "fineweb_val_000000.bin")) == 9
    assert bin_files(tmp_path) == [str(fw / "fineweb_val_000000.bin")]
