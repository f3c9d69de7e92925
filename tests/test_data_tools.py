"""The data tools: data/tokenize_text.py (text -> shards, --check), data/check_shards.py,
data/cached_fineweb10B.py (Hub download) and data/shard_format.py, on CPU and without network.

Everything comes from the repository: the real text is data/sample/, the GPT-2 BPE files are
data/gpt2_bpe/. The reference tokenizer is tiktoken's own ``gpt2`` definition, fed those files
through a tiktoken cache made in a temporary folder (tiktoken checks their published sha256).
The CLIs run as subprocesses exactly as users run them (``python data/tokenize_text.py``), with
``torch`` and ``train_gpt`` made unimportable: the data tools must not need them.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import harness
from conftest import REPO, SAMPLE_DIR, read_log

DATA = os.path.join(REPO, "data")
sys.path.append(DATA)  # the tools import each other as `python data/X.py` runs them: data/ first on the path
import cached_fineweb10B as dl  # noqa: E402
import check_shards as chk  # noqa: E402
import tokenize_text as tok  # noqa: E402
import shard_format as sf  # noqa: E402
from shard_format import ShardError, read_header  # noqa: E402

EOT = 50256
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"  # tiktoken's gpt2 source
TOOLS = ["tokenize_text.py", "check_shards.py", "cached_fineweb10B.py"]


@pytest.fixture(scope="session")
def no_torch(tmp_path_factory):
    """A folder that, first on PYTHONPATH, makes `import torch` and `import train_gpt` fail."""
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    (d / "train_gpt.py").write_text("raise ImportError('train_gpt is blocked in this test')\n")
    return str(d)


@pytest.fixture(scope="session")
def enc(tmp_path_factory):
    """tiktoken's own ``gpt2`` encoding (its definition, its sha256 checks), from the repository's files.

    The files go into a fresh tiktoken cache under the names tiktoken gives its downloads, so
    nothing is fetched and no cache outside the test is read.
    """
    import tiktoken
    from tiktoken_ext import openai_public
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name in ("vocab.bpe", "encoder.json"):
        key = hashlib.sha1((GPT2_URL + name).encode()).hexdigest()
        shutil.copy(os.path.join(DATA, "gpt2_bpe", name), cache / key)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        return tiktoken.Encoding(**openai_public.gpt2())


@pytest.fixture(scope="session")
def sample_docs():
    """{"val": [...], "train": [...]} texts of the sample's documents, decoded from its shards."""
    encoder = tok.load_encoder()
    out = {}
    for split in ("val", "train"):
        files = sorted(os.path.join(SAMPLE_DIR, n) for n in os.listdir(SAMPLE_DIR) if f"_{split}_" in n)
        stream = np.concatenate([shard_tokens(f)[1] for f in files]).tolist()
        assert stream[0] == EOT
        starts = [i for i, t in enumerate(stream) if t == EOT] + [len(stream)]
        out[split] = [encoder.decode(stream[a + 1:b]) for a, b in zip(starts, starts[1:])]
    return out


def run_cli(script, *args, env=None, timeout=300, no_torch=None):
    """Run ``python data/<script> args`` from the repo root; returns CompletedProcess (text).

    ``no_torch``: a folder put first on PYTHONPATH (the ``no_torch`` fixture) so the tool runs
    without torch; ``env`` entries are added (a PYTHONPATH there comes after it).
    """
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in [no_torch, (env or {}).get("PYTHONPATH")] if p)
    return subprocess.run([sys.executable, os.path.join("data", script), *map(str, args)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


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
# the repository's GPT-2 BPE files and its sample


def test_repository_bpe_files_encode_like_tiktoken_gpt2(enc, sample_docs):
    ours = tok.load_encoder()
    assert (ours.n_vocab, ours.eot_token, ours.special_tokens_set) == (enc.n_vocab, enc.eot_token,
                                                                       enc.special_tokens_set) == (50257, EOT,
                                                                                                   {"<|endoftext|>"})
    texts = DOCS + sample_docs["val"] + sample_docs["train"][:20] + [" ".join(DOCS) * 3, "  \n\t x's 've 1234567 !?"]
    for text in texts:
        assert ours.encode_ordinary(text) == enc.encode_ordinary(text)
    assert ours.encode("a<|endoftext|>b", allowed_special="all") == enc.encode("a<|endoftext|>b",
                                                                                allowed_special="all")


def test_altered_or_missing_bpe_file_is_one_clear_error(tmp_path):
    bpe = tmp_path / "bpe"
    shutil.copytree(os.path.join(DATA, "gpt2_bpe"), bpe)
    with open(bpe / "vocab.bpe", "ab") as f:
        f.write(b"x y\n")
    with pytest.raises(tok.TokenizeError, match=r"vocab\.bpe: not the GPT-2 BPE file \(sha256 .*restore it"):
        tok.load_encoder(str(bpe))
    os.remove(bpe / "encoder.json")
    shutil.copy(os.path.join(DATA, "gpt2_bpe", "vocab.bpe"), bpe / "vocab.bpe")
    with pytest.raises(tok.TokenizeError, match=r"encoder\.json: cannot read the GPT-2 BPE file .*git checkout"):
        tok.load_encoder(str(bpe))


def test_tokenizer_runs_offline_without_tiktoken_cache(tmp_path, enc, no_torch):
    """No TIKTOKEN_CACHE_DIR, the Hub offline and every socket refused: the tool still tokenizes,
    and writes nothing into tiktoken's cache."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import socket\n"
        "def _refuse(*args, **kwargs):\n"
        "    raise OSError('network disabled in this test')\n"
        "socket.socket.connect = socket.create_connection = socket.getaddrinfo = _refuse\n")
    cache = tmp_path / "data_gym_cache"  # where tiktoken would cache downloads without TIKTOKEN_CACHE_DIR
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env.update(HF_HUB_OFFLINE="1", DATA_GYM_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([no_torch, str(site)]))
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    res = subprocess.run([sys.executable, "data/tokenize_text.py", src, "--output-dir", str(tmp_path / "o"),
                          "--prefix", "x", "--workers", "2"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert list(shard_tokens(tmp_path / "o" / "x_train_000001.bin")[1]) == stream(enc, DOCS)
    assert os.listdir(cache) == []


def test_sample_is_what_its_readme_says():
    with open(os.path.join(SAMPLE_DIR, "README.md"), encoding="utf-8") as f:
        table = dict(re.findall(r"^\| `(\w+\.bin)` \| ([\d,]+) \|", f.read(), flags=re.M))
    names = sorted(n for n in os.listdir(SAMPLE_DIR) if n.endswith(".bin"))
    assert sorted(table) == names and len(names) == 4
    for name in names:
        assert read_header(os.path.join(SAMPLE_DIR, name)) == int(table[name].replace(",", ""))
    assert chk.check_shards([os.path.join(SAMPLE_DIR, "*.bin")], out=open(os.devnull, "w")) == 0


def test_cli_rebuilds_the_sample_byte_for_byte_from_its_text(tmp_path, sample_docs, no_torch):
    """The sample's documents as .jsonl rows (interleaved, with rows of another source that the
    filter drops), through the command in data/sample/README.md, give the same bytes."""
    rows, val = [], list(sample_docs["val"])
    for i, text in enumerate(sample_docs["train"]):
        if i % 6 == 0 and val:
            rows.append({"source": "wikipedia", "split": "val", "text": val.pop(0)})
        rows.append({"source": "other", "split": "train", "text": f"not in the sample {i}"})
        rows.append({"source": "wikipedia", "split": "train", "text": text})
    rows += [{"source": "wikipedia", "split": "val", "text": t} for t in val]
    src = write_jsonl(tmp_path / "corpus.jsonl", rows)
    out = tmp_path / "sample"
    res = run_cli("tokenize_text.py", src, "--filter", "source=wikipedia", "--split-key", "split",
                  "--shard-size", "200000", "--output-dir", out, "--prefix", "wikipedia", "--workers", "2",
                  no_torch=no_torch)
    assert res.returncode == 0, res.stderr
    names = sorted(n for n in os.listdir(SAMPLE_DIR) if n.endswith(".bin"))
    assert sorted(os.listdir(out)) == names
    for name in names:
        assert (out / name).read_bytes() == open(os.path.join(SAMPLE_DIR, name), "rb").read(), name


# ---------------------------------------------------------------------------------------------
# the tools stand alone: no torch, no train_gpt


@pytest.mark.parametrize("script", TOOLS)
def test_tool_help_works_without_torch(script, no_torch):
    res = run_cli(script, "--help", no_torch=no_torch)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_no_torch_folder_does_block_torch(no_torch):
    res = subprocess.run([sys.executable, "-c", "import torch"], env=dict(os.environ, PYTHONPATH=no_torch),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "torch is blocked" in res.stderr


# ---------------------------------------------------------------------------------------------
# one shard format on both sides: what the tools write the trainer reads, what it refuses they refuse


def test_tool_written_shards_are_read_by_the_trainer(tmp_path, enc):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS * 3])
    written = tok.tokenize_to_shards([src], str(tmp_path / "o"), "t", shard_size=11, val_docs=4, workers=1,
                                     progress=False)
    val = [p for p, _, _ in written if "_val_" in p]
    train = [p for p, _, _ in written if "_train_" in p]
    assert len(val) > 1 and len(train) > 1
    for path, n, _ in written:
        assert len(harness.read_shard(path)) == n == read_header(path)
    for files, texts in [(val, (DOCS * 3)[:4]), (train, (DOCS * 3)[4:])]:
        expected = stream(enc, texts)
        ts = harness.TokenStream(files)
        assert ts.total == len(expected)
        assert ts.read(0, ts.total).tolist() == expected


def _shard_bytes(tokens=(EOT, 1, 2), magic=20240520, version=1, n=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if n is None else n
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


BROKEN_SHARDS = {  # name: (file bytes, what the message says: the tools' and the trainer's, one reader)
    "bad_magic": (_shard_bytes(magic=12345), "bad magic 12345"),
    "bad_version": (_shard_bytes(version=7), "unsupported shard version 7"),
    "truncated": (_shard_bytes()[:-2], "header says 3 tokens"),
    "extra_bytes": (_shard_bytes() + b"\0\0", "header says 3 tokens"),
    "short_header": (_shard_bytes()[:100], "shorter than the 1024-byte"),
    "empty_file": (b"", "0 bytes is shorter than the 1024-byte"),
    "one_byte": (b"\x01", "1 bytes is shorter than the 1024-byte"),  # not a whole int of the header
    "negative_count": (_shard_bytes(tokens=(), n=-1), "header says -1 tokens"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_SHARDS))
def test_every_shard_the_trainer_refuses_the_tools_refuse(tmp_path, name):
    data, why = BROKEN_SHARDS[name]
    path = tmp_path / f"{name}.bin"
    path.write_bytes(data)
    with pytest.raises(harness.DataError, match=re.escape(why)) as trainer:
        harness.TokenStream([str(path)])
    with pytest.raises(ShardError, match=re.escape(why)) as tools:
        read_header(str(path))
    assert str(trainer.value) == str(tools.value) and str(path) in str(tools.value)
    row, bad = chk.shard_row(str(path))
    assert bad and row[4] == str(tools.value)
    assert dl.shard_status(str(path)) == str(tools.value)


def test_good_shards_pass_on_both_sides(tmp_path):
    for name, tokens in [("empty", ()), ("one", (EOT,)), ("max_id", (EOT, 50256, 0, 65535))]:
        path = str(tmp_path / f"{name}.bin")
        with open(path, "wb") as f:
            f.write(_shard_bytes(tokens))
        assert read_header(path) == len(tokens)
        # the downloader also checks the tokens: an id above 50256 is another tokenizer's
        assert dl.shard_status(path) == (f"{path}: token id 65535 > 50256 (the first at token 3): not GPT-2 BPE "
                                         "ids; re-tokenize with "
                                         "data/tokenize_text.py" if name == "max_id" else None)


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
        assert read_header(path) == n
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


@pytest.mark.parametrize("workers", [1, 2])
def test_split_key_routes_rows_by_their_field(tmp_path, enc, workers):
    splits = ["train", "val", "train", "val", "train"]
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "part": s} for t, s in zip(DOCS, splits)])
    w = tok.tokenize_to_shards([src], str(tmp_path / "o"), "p", split_key="part", workers=workers, progress=False)
    assert [os.path.basename(p) for p, _, _ in w] == ["p_val_000000.bin", "p_train_000001.bin"]
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[1], DOCS[3]])
    assert list(shard_tokens(w[1][0])[1]) == stream(enc, [DOCS[0], DOCS[2], DOCS[4]])


@pytest.mark.parametrize("row,why", [({"text": "x", "part": "test"}, 'field \'part\' is "test"'),
                                     ({"text": "x"}, "field 'part' is missing"),
                                     ({"text": "x", "part": 1}, "field 'part' is 1")], ids=["other", "missing", "number"])
def test_split_key_values_other_than_val_or_train_are_an_error(tmp_path, row, why):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine", "part": "val"}, row])
    with pytest.raises(tok.TokenizeError, match=re.escape(f"d.jsonl:2: {why}; --split-key part needs")):
        tok.tokenize_to_shards([src], str(tmp_path / "o"), "p", split_key="part", shard_size=1, workers=1,
                               progress=False)
    assert not (tmp_path / "o").exists()  # no shard, and the folder the run made is gone


def test_split_key_with_val_docs_or_txt_is_refused(tmp_path, no_torch):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x", "split": "val"}])
    res = run_cli("tokenize_text.py", src, "--split-key", "split", "--val-docs", "1", "--output-dir",
                  tmp_path / "o", "--prefix", "p", no_torch=no_torch)
    assert res.returncode == 2 and "--split-key and --val-docs" in res.stderr
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(tok.TokenizeError, match=r"a\.txt: --filter and --split-key select"):
        tok.tokenize_to_shards([str(tmp_path / "a.txt")], str(tmp_path / "o"), "p", split_key="split", workers=1,
                               progress=False)


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


def test_parquet_input_with_filter_and_split_key(tmp_path, enc):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": DOCS, "lang": ["en", "de", "en", "en", "de"],
                             "split": ["train", "val", "val", "train", "val"]}), src, row_group_size=2)
    w = tok.tokenize_to_shards([src], str(tmp_path / "o"), "pq", filters={"lang": "en"}, val_docs=1,
                               workers=1, progress=False)
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[0]])
    assert list(shard_tokens(w[1][0])[1]) == stream(enc, [DOCS[2], DOCS[3]])

    w = tok.tokenize_to_shards([src], str(tmp_path / "s"), "pq", filters={"lang": "en"}, split_key="split",
                               workers=1, progress=False)
    assert list(shard_tokens(w[0][0])[1]) == stream(enc, [DOCS[2]])
    assert list(shard_tokens(w[1][0])[1]) == stream(enc, [DOCS[0], DOCS[3]])

    pq.write_table(pa.table({"body": DOCS}), src)
    with pytest.raises(tok.TokenizeError, match="no column 'text'"):
        tok.tokenize_to_shards([src], str(tmp_path / "o2"), "pq", workers=1, progress=False)


def test_bad_inputs_get_one_clear_error(tmp_path, no_torch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    res = run_cli("tokenize_text.py", bad, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "2",
                  no_torch=no_torch)
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


def test_overwrite_that_fails_partway_leaves_the_old_set_untouched(tmp_path, no_torch):
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
    res = run_cli("tokenize_text.py", new_src, "--output-dir", out, "--prefix", "p", "--shard-size", "5",
                  "--overwrite", "--workers", "2", no_torch=no_torch)
    assert res.returncode == 1 and "new.jsonl:6: not valid JSON" in res.stderr
    assert _snapshot(out) == before
    # the same input without the bad line: the new set replaces the old one entirely
    good_src = write_jsonl(tmp_path / "good.jsonl", [{"text": t.upper() + " new"} for t in DOCS])
    written = tok.tokenize_to_shards([good_src], str(out), "p", shard_size=7, workers=1, overwrite=True,
                                     progress=False)
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p, _, _ in written)
    assert "p_val_000000.bin" not in os.listdir(out)


def test_output_dir_that_is_a_file_gets_one_clear_error(tmp_path, no_torch):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    (tmp_path / "out_is_file").write_text("not a folder")
    for out in (tmp_path / "out_is_file", tmp_path / "out_is_file" / "sub"):
        res = run_cli("tokenize_text.py", src, "--output-dir", out, "--prefix", "x", "--workers", "1",
                      no_torch=no_torch)
        assert res.returncode == 1 and "Traceback" not in res.stderr
        [line] = res.stderr.strip().splitlines()
        assert line.startswith("error: --output-dir ") and str(tmp_path / "out_is_file") in line
        assert "not a folder" in line and "pick" in line, line
    assert (tmp_path / "out_is_file").read_text() == "not a folder"


@pytest.mark.parametrize("prefix,why", [("../x", "contains '/'"), ("sub/x", "contains '/'"), ("..", "is '..'"),
                                        ("x*", "contains '*'"), ("x[1]", "contains '['")])
def test_prefix_that_would_leave_the_output_dir_or_act_as_a_glob_is_refused(tmp_path, no_torch, prefix, why):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "some text"}])
    out = tmp_path / "a" / "out"
    res = run_cli("tokenize_text.py", src, "--output-dir", out, "--prefix", prefix, "--workers", "1",
                  no_torch=no_torch)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith(f"error: --prefix {prefix!r}: {why}") and "plain name" in line, line
    assert bin_files(tmp_path) == [] and not (tmp_path / "a").exists()


@pytest.mark.parametrize("texts", [[""], ["  \n\t\n"], ["", " "]])
def test_inputs_with_no_text_are_an_error_not_a_shard_of_lone_eot(tmp_path, no_torch, texts):
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    out = tmp_path / "new" / "out"
    res = run_cli("tokenize_text.py", *files, "--output-dir", out, "--prefix", "x", "--workers", "1",
                  no_torch=no_torch)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [line] = [ln for ln in res.stderr.splitlines() if ln and not ln.startswith("tokenizing x:")]  # the bar aside
    assert line.startswith("error: no text in ") and str(files[0]) in line
    assert f"{len(texts)} document(s), all empty or only whitespace (first: {files[0]})" in line, line
    assert bin_files(tmp_path) == [] and not (tmp_path / "new").exists()  # the folders it made are gone


def test_documents_with_no_text_among_others_are_kept_and_counted(tmp_path, enc, no_torch):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS + ["  \n"]])
    res = run_cli("tokenize_text.py", src, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "1",
                  no_torch=no_torch)
    assert res.returncode == 0, res.stderr
    assert (f"note: 2 document(s) with no text (empty or only whitespace), written as they are: {src}:4, {src}:6"
            in res.stdout), res.stdout
    assert list(shard_tokens(tmp_path / "o" / "x_train_000001.bin")[1]) == stream(enc, DOCS + ["  \n"])


def _fifo(path):
    os.mkfifo(path)
    return path


def test_fifo_folder_or_device_input_is_refused_at_once(tmp_path, no_torch):
    (tmp_path / "folder.txt").mkdir()
    for path, kind in [(_fifo(tmp_path / "pipe.txt"), "a FIFO (named pipe)"), (tmp_path / "folder.txt", "a folder"),
                       ("/dev/zero", "a device")]:
        res = run_cli("tokenize_text.py", path, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "1",
                      no_torch=no_torch, timeout=60)  # reading the FIFO or /dev/zero would never end
        assert res.returncode == 1 and "Traceback" not in res.stderr
        [line] = res.stderr.strip().splitlines()
        assert line == (f"error: input {path}: is {kind}, not a file; pass .jsonl/.txt/.parquet files (a "
                        "folder's files as a quoted glob, e.g. 'books/*.txt')"), line
    assert not (tmp_path / "o").exists()


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


class _InterruptingEncoder:
    """Encodes two documents, then acts as if Ctrl-C was pressed."""

    def __init__(self):
        self.calls = 0

    def encode_ordinary(self, text):
        self.calls += 1
        if self.calls > 2:
            raise KeyboardInterrupt
        return [1, 2, 3]


def test_ctrl_c_leaves_nothing_and_exits_130(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tok, "_ENCODER", _InterruptingEncoder())
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    out = tmp_path / "o"
    assert tok.main([src, "--output-dir", str(out), "--prefix", "x", "--shard-size", "2", "--workers", "1"]) == 130
    assert "interrupted: no shard written" in capsys.readouterr().err
    assert not out.exists()  # the folder it made is removed too: "as it was"
    out.mkdir()  # a folder that existed stays
    monkeypatch.setattr(tok, "_ENCODER", _InterruptingEncoder())
    assert tok.main([src, "--output-dir", str(out), "--prefix", "x", "--shard-size", "2", "--workers", "1"]) == 130
    assert os.listdir(out) == []


# ---------------------------------------------------------------------------------------------
# tokenizer: a worker process that dies or fails


# Installed as sitecustomize in the tool's processes: the worker (not the main process) that meets
# the marked document kills itself with SIGKILL, as the out-of-memory killer would, or raises.
_FAULTY_WORKER = """
import multiprocessing, os, signal
import tiktoken.core
_encode = tiktoken.core.Encoding.encode_ordinary
def encode_ordinary(self, text):
    if "FAULT-HERE" in text and multiprocessing.parent_process() is not None:
        with open(os.environ["FAULT_LOG"], "w") as f:  # what the output folder held at that moment
            f.write("\\n".join(sorted(os.listdir(os.environ["FAULT_OUT"]))))
        if os.environ["FAULT"] == "term":  # a scheduler stops the main process
            with open(os.environ["FAULT_LOG"] + ".pid", "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getppid(), signal.SIGTERM)
            return _encode(self, text)
        if os.environ["FAULT"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("simulated tokenizer bug")
    return _encode(self, text)
tiktoken.core.Encoding.encode_ordinary = encode_ordinary
"""


def run_faulty_tool(tmp_path, no_torch, fault):
    """The tokenizer on ~3.5 MB of jsonl whose document 1801 triggers ``fault`` in a worker: (proc, stderr, src)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FAULTY_WORKER)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "token", "shard", "speed", "run", "the", "of"]
    rows = [{"text": " ".join(rng.choice(words, size=300)) + f" doc {i}."} for i in range(2000)]
    rows[1800]["text"] += " FAULT-HERE"
    src = write_jsonl(tmp_path / "big.jsonl", rows)  # ~3.5 MB, ~600k tokens
    out, log = tmp_path / "out", tmp_path / "seen.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([no_torch, str(site)]), FAULT=fault, FAULT_LOG=str(log),
               FAULT_OUT=str(out))
    proc = subprocess.Popen([sys.executable, "data/tokenize_text.py", src, "--output-dir", str(out), "--prefix",
                             "big", "--shard-size", "20000", "--workers", "2"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a hang: end the tool and its workers, then fail
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the tokenizer did not stop after the fault {fault!r}")
    return proc, stderr, src


@pytest.mark.parametrize("fault,message", [
    ("kill", "error: a tokenizer worker was killed (signal SIGKILL); use fewer --workers or free memory"),
    ("raise", "error: {src}:1801: the tokenizer failed on this document: RuntimeError: simulated tokenizer bug"),
], ids=["killed", "raises"])
def test_worker_that_dies_or_fails_stops_the_run_with_one_line(tmp_path, no_torch, fault, message):
    proc, stderr, src = run_faulty_tool(tmp_path, no_torch, fault)
    out, log = tmp_path / "out", tmp_path / "seen.txt"
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [message.format(src=src)], stderr
    assert any(".tmp" in name for name in log.read_text().split()), "no shard was being written: test too small"
    assert not out.exists()  # no *.bin, no *.tmp<pid>, and the folder the run made is gone


def test_sigterm_stops_like_ctrl_c_and_takes_the_workers_along(tmp_path, no_torch):
    proc, stderr, _ = run_faulty_tool(tmp_path, no_torch, "term")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted: no shard written, temporary files removed" in stderr
    assert not (tmp_path / "out").exists()
    worker = int((tmp_path / "seen.txt.pid").read_text())
    deadline = time.time() + 20
    while time.time() < deadline and os.path.exists(f"/proc/{worker}") and \
            "zombie" not in open(f"/proc/{worker}/status").read():
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{worker}") or "zombie" in open(f"/proc/{worker}/status").read()


# Installed as sitecustomize: the worker that meets the marked document writes its pid, then stalls
# (as on a very long document), so that the test can SIGKILL a worker at a chosen moment; or, with
# PARTIAL set, it SIGKILLs itself once it has written part of that batch's result to the pool.
_STALLING_WORKER = """
import concurrent.futures.process as cfp, multiprocessing, os, signal, struct, time
import tiktoken.core
_encode, _sendback, _marked = tiktoken.core.Encoding.encode_ordinary, cfp._sendback_result, []
def encode_ordinary(self, text):
    if "STALL-HERE" in text and multiprocessing.parent_process() is not None:
        if os.environ.get("PARTIAL"):
            _marked.append(True)
            return _encode(self, text)
        with open(os.environ["STALL_PID"] + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["STALL_PID"] + ".part", os.environ["STALL_PID"])
        time.sleep(30)
    return _encode(self, text)
def _sendback_result(result_queue, *args, **kwargs):
    if _marked:  # a 1 MiB message announced, 1,000 bytes of it written
        result_queue._writer._send(struct.pack("!i", 1 << 20) + b"x" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
    return _sendback(result_queue, *args, **kwargs)
tiktoken.core.Encoding.encode_ordinary = encode_ordinary
cfp._sendback_result = _sendback_result
"""
KILL_MOMENTS = ("before-first-batch", "mid-batch", "main-waits-on-it", "other-idle-queue-full",
                "writing-its-result")


def _proc_stat(pid):
    """(state, ppid, pgid) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _processes(match):
    """Pids of the live (non-zombie) processes whose (ppid, pgid) satisfy ``match``."""
    out = []
    for name in os.listdir("/proc"):
        st = _proc_stat(name) if name.isdigit() else None
        if st and st[0] != "Z" and match(st[1], st[2]):
            out.append(int(name))
    return out


def _kill_a_worker_at(proc, moment, stall_pid, pause):
    """SIGKILL one worker of the tool ``proc`` at ``moment`` (one of KILL_MOMENTS); returns its pid."""
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and moment != "writing-its-result":  # that one kills itself
        if moment == "before-first-batch":
            workers = _processes(lambda ppid, _: ppid == proc.pid)
            if workers:  # the first worker as soon as it exists: it has not finished a batch yet
                os.kill(min(workers), signal.SIGKILL)
                return min(workers)
        elif os.path.exists(stall_pid):  # a worker is inside its batch (stalled on the marked document)
            stalled = int(open(stall_pid).read())
            if moment != "mid-batch":  # the other worker drains the in-flight batches; the main process waits
                time.sleep(pause)
            others = [p for p in _processes(lambda ppid, _: ppid == proc.pid) if p != stalled]
            victim = others[0] if moment == "other-idle-queue-full" and others else stalled
            os.kill(victim, signal.SIGKILL)
            return victim
        time.sleep(0.002)
    if moment != "writing-its-result":
        pytest.fail(f"{moment}: the tool ended or never started a worker: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow  # kills a worker at many moments
def test_worker_killed_at_any_moment_ends_the_run_with_one_line(tmp_path, no_torch):
    """A worker SIGKILLed (as by the out-of-memory killer) before its first batch, mid-batch, while
    the main process waits on its result, idle while the in-flight window is full, or while it
    writes a result: each time the run ends (no hang), exit 1, one error line, no shard or
    temporary file, no process left."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_STALLING_WORKER)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "token", "shard", "speed", "run", "the", "of"]
    rows = [{"text": " ".join(rng.choice(words, size=200)) + f" doc {i}."} for i in range(600)]
    rows[100]["text"] += " STALL-HERE"  # batch 7: the in-flight window (8 batches) is full when it stalls
    src = write_jsonl(tmp_path / "docs.jsonl", rows)
    message = "error: a tokenizer worker was killed (signal SIGKILL); use fewer --workers or free memory"
    for attempt in range(3 * len(KILL_MOMENTS)):
        moment, pause = KILL_MOMENTS[attempt % len(KILL_MOMENTS)], (0.3, 0.6, 1.0)[attempt // len(KILL_MOMENTS)]
        out, stall_pid = tmp_path / f"out{attempt}", tmp_path / f"stall{attempt}.pid"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([no_torch, str(site)]), STALL_PID=str(stall_pid),
                   PARTIAL="1" if moment == "writing-its-result" else "")
        proc = subprocess.Popen([sys.executable, "data/tokenize_text.py", src, "--output-dir", str(out),
                                 "--prefix", "k", "--shard-size", "5000", "--workers", "2"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _kill_a_worker_at(proc, moment, str(stall_pid), pause)
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # the hang: end the tool and its workers, then fail
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"try {attempt}: a worker killed at {moment!r} left the tokenizer hanging")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        where = f"try {attempt}, killed at {moment!r}: {stderr[-1500:]}"
        assert proc.returncode == 1 and "Traceback" not in stderr, where
        assert [line for line in stderr.splitlines() if line.startswith("error:")] == [message], where
        assert not out.exists(), where  # no shard, no *.tmp<pid>, not even the folder the run made
        deadline = time.time() + 10  # the survivors end (SIGTERM from the pool, or SIGKILL at parent death)
        while _processes(lambda _, pgid: pgid == proc.pid) and time.time() < deadline:
            time.sleep(0.05)
        assert _processes(lambda _, pgid: pgid == proc.pid) == [], f"{where}: processes left behind"


def test_uint16_refusal_from_worker_processes_via_cli(tmp_path, no_torch):
    """The refusal raised inside a worker process reaches the user as one message."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import tiktoken.core\n"
        "tiktoken.core.Encoding.encode_ordinary = lambda self, text: [1, 70000]\n")
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    res = run_cli("tokenize_text.py", src, "--output-dir", tmp_path / "o", "--prefix", "x", "--workers", "2",
                  env={"PYTHONPATH": str(site)}, no_torch=no_torch)
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "token id 70000 does not fit in a uint16" in errors[0]
    assert "Traceback" not in res.stderr
    assert bin_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# --check / check_shards.py


def _raw_shard(path, tokens, magic=20240520, version=1, n=None, cut=0, size=None):
    data = _shard_bytes(tokens, magic, version, n)
    data = data[:size] if size is not None else data[:len(data) - cut]
    path.write_bytes(data)


@pytest.mark.parametrize("script,first", [("tokenize_text.py", ["--check"]), ("check_shards.py", [])])
def test_check_reports_each_bad_shard_kind(tmp_path, script, first, no_torch):
    d = tmp_path / "s"
    d.mkdir()
    _raw_shard(d / "good.bin", [EOT, 1, 2, EOT, 3])
    _raw_shard(d / "magic.bin", [1, 2], magic=12345)
    _raw_shard(d / "version.bin", [1, 2], version=7)
    _raw_shard(d / "truncated.bin", [1, 2, 3], cut=2)
    _raw_shard(d / "short.bin", [], size=100)
    res = run_cli(script, *first, d / "*.bin", no_torch=no_torch)
    assert res.returncode == 1
    lines = {os.path.basename(line.split()[0]): line for line in res.stdout.splitlines()[1:]}
    assert res.stdout.splitlines()[0].split() == ["file", "tokens", "documents", "max_id", "status"]
    assert lines["good.bin"].split()[1:] == ["5", "2", "50256", "ok"]
    for name, why in [("magic.bin", "bad magic 12345"), ("version.bin", "version 7"),
                      ("truncated.bin", "header says 3 tokens"), ("short.bin", "shorter than the 1024-byte")]:
        assert why in lines[name] and str(d / name) in lines[name].split(None, 1)[1], lines[name]

    ok = run_cli(script, *first, d / "good.bin", os.path.join(SAMPLE_DIR, "*.bin"), no_torch=no_torch)
    assert ok.returncode == 0, ok.stdout
    assert "wikipedia_val_000000.bin" in ok.stdout and "63,484" in ok.stdout

    none = run_cli(script, *first, d / "nothing*.bin", no_torch=no_torch)
    assert none.returncode == 1 and "no file matches" in none.stdout


@pytest.mark.parametrize("script,first", [("tokenize_text.py", ["--check"]), ("check_shards.py", [])])
def test_check_refuses_a_fifo_folder_or_device_at_once(tmp_path, script, first, no_torch):
    _fifo(tmp_path / "x_train_000001.bin")  # opening it would wait for a writer forever
    (tmp_path / "x_train_000002.bin").mkdir()
    _raw_shard(tmp_path / "x_val_000000.bin", [EOT, 1])
    res = run_cli(script, *first, tmp_path / "x_*.bin", "/dev/zero", no_torch=no_torch, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    for path, kind in [(tmp_path / "x_train_000001.bin", "a FIFO (named pipe)"),
                       (tmp_path / "x_train_000002.bin", "a folder"), ("/dev/zero", "a device")]:
        assert f"{path}: is {kind}, not a shard file; pass shard files (*.bin)" in lines[str(path)], lines
    assert lines[str(tmp_path / "x_val_000000.bin")].split()[1:] == ["2", "1", "50256", "ok"]


@pytest.mark.parametrize("script,first", [("tokenize_text.py", ["--check"]), ("check_shards.py", [])])
def test_check_reports_token_ids_above_gpt2(tmp_path, script, first, no_torch):
    _raw_shard(tmp_path / "gpt2_max.bin", [EOT, 5, 50256, 17])
    _raw_shard(tmp_path / "wide.bin", [EOT, 5, 50257, 60000, 3])
    _raw_shard(tmp_path / "empty.bin", [])
    res = run_cli(script, *first, tmp_path / "*.bin", no_torch=no_torch)
    assert res.returncode == 1
    lines = {os.path.basename(line.split()[0]): line for line in res.stdout.splitlines()[1:]}
    assert lines["gpt2_max.bin"].split()[1:] == ["4", "2", "50256", "ok"]
    assert lines["empty.bin"].split()[1:] == ["0", "0", "-", "ok"]
    assert lines["wide.bin"].split()[1:4] == ["5", "1", "60000"]
    assert ("token id 60000 > 50256 (the first at token 2): not GPT-2 BPE ids; re-tokenize with "
            "data/tokenize_text.py") in lines["wide.bin"]
    assert run_cli(script, *first, tmp_path / "gpt2_max.bin", no_torch=no_torch).returncode == 0


# ---------------------------------------------------------------------------------------------
# token checks: ids of another tokenizer, zero-filled or single-id stretches (shard_format)


def _slow_runs(tokens):
    """Every run of one repeated id as (length, start, id), in order: an obviously-right loop."""
    runs, i = [], 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and tokens[j] == tokens[i]:
            j += 1
        runs.append((j - i, i, int(tokens[i])))
        i = j
    return runs


def _random_tokens(rng, n):
    """Random GPT-2 ids with ~1 EOT in 300 tokens and a few planted runs of one id (zero, EOT, any),
    some just under and some at or above CORRUPT_RUN, some at the tail."""
    tokens = rng.integers(0, EOT, n, dtype=np.uint16)
    tokens[rng.random(n) < 1 / 300] = EOT
    for _ in range(rng.integers(0, 4)):
        length = min(n, int(rng.choice([sf.CORRUPT_RUN - 1, sf.CORRUPT_RUN, sf.CORRUPT_RUN + 5, 50])))
        start = n - length if rng.random() < 0.3 else int(rng.integers(0, n - length + 1))
        tokens[start:start + length] = rng.choice([0, EOT, int(rng.integers(1, EOT))])
    return tokens


def test_token_scan_matches_a_slow_reference_on_random_shards():
    rng = np.random.default_rng(28)
    for case in range(24):
        tokens = _random_tokens(rng, int(rng.integers(1, 3 * sf.CORRUPT_RUN)) if case else 5)
        chunk = int(rng.choice([1, 7, 1000, sf.CORRUPT_RUN + 3, sf.SCAN_CHUNK]))  # runs cross chunk edges
        runs = _slow_runs(tokens.tolist())
        longest = max(runs, key=lambda r: (r[0], -r[1]))  # the first of the longest
        corrupt = [r for r in runs if r[2] != EOT and r[0] >= sf.CORRUPT_RUN]
        expected_run = max(corrupt, key=lambda r: (r[0], -r[1])) if corrupt else (0, 0, -1)
        where = f"case {case}, chunk {chunk}, n {len(tokens)}"
        assert sf.max_token_id(tokens, chunk) == max(tokens.tolist()), where
        assert sf.longest_run(tokens, chunk) == longest, where
        assert sf.scan_tokens(tokens, chunk) == (tokens.tolist().count(EOT), max(tokens.tolist()), expected_run), where
    assert sf.max_token_id(np.zeros(0, np.uint16)) == -1 and sf.longest_run(np.zeros(0, np.uint16)) == (0, 0, -1)
    assert sf.scan_tokens(np.zeros(0, np.uint16)) == (0, -1, (0, 0, -1))


def test_real_text_never_trips_the_token_checks():
    """The repository's sample: documents up to ~20k tokens, no run of one id longer than a few tokens."""
    for name in sorted(os.listdir(SAMPLE_DIR)):
        if name.endswith(".bin"):
            path = os.path.join(SAMPLE_DIR, name)
            n_docs, top, run = sf.scan_tokens(sf.read_tokens(path))
            assert top == EOT and n_docs > 0 and run == (0, 0, -1), name
            assert sf.check_shard(path) == read_header(path)
            assert sf.longest_run(sf.read_tokens(path))[0] < sf.CORRUPT_RUN // 100, name  # far from the limit


# A sample shard whose tail was overwritten, keeping its size (as a partial download or write leaves it)
TAILS = {"zero_tail": (0, "are zero-filled, with no <|endoftext|>: a partial download or write that kept its size"),
         "one_id_tail": (1234, "are one id (1234) repeated, with no <|endoftext|>"),
         "foreign_ids": (60000, "token id 60000 > 50256 (the first at token "),
         }


def _damaged_sample(path, kind, length):
    """Copy the sample's last train shard to ``path`` with its last ``length`` tokens set to TAILS[kind]'s id."""
    raw = bytearray(open(os.path.join(SAMPLE_DIR, "wikipedia_train_000003.bin"), "rb").read())
    tokens = np.frombuffer(raw, dtype="<u2", offset=1024)
    tokens[len(tokens) - length:] = TAILS[kind][0]
    path.write_bytes(bytes(raw))
    return str(path)


@pytest.mark.parametrize("kind", sorted(TAILS))
def test_damaged_shard_is_refused_by_every_tool(tmp_path, kind, no_torch):
    path = _damaged_sample(tmp_path / "x_train_000001.bin", kind, 50_000)
    with pytest.raises(ShardError) as err:
        sf.check_shard(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and TAILS[kind][1] in message and "\n" not in message
    if kind != "foreign_ids":
        assert "50,000 tokens from token 120,284" in message and message.endswith(sf.REDO)
    assert dl.shard_status(path) == message
    row, bad = chk.shard_row(path)
    assert bad and row[4] == message[len(path) + 2:]
    res = run_cli("check_shards.py", path, os.path.join(SAMPLE_DIR, "*.bin"), no_torch=no_torch)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [bad_line] = [line for line in res.stdout.splitlines() if not line.endswith(" ok")][1:]
    assert bad_line.startswith(path) and bad_line.endswith(message[len(path) + 2:])
    if kind != "foreign_ids":  # one token short of the limit is left alone
        assert sf.check_shard(_damaged_sample(tmp_path / "y.bin", kind, sf.CORRUPT_RUN - 1)) == 170_284


@pytest.mark.parametrize("kind", sorted(TAILS))
def test_download_refetches_a_damaged_shard_and_refuses_a_damaged_download(tmp_path, monkeypatch, capsys, kind):
    fw = tmp_path / "fw"
    fw.mkdir()
    damaged = _damaged_sample(fw / "fineweb_val_000000.bin", kind, 20_000)
    good = open(os.path.join(SAMPLE_DIR, "wikipedia_train_000003.bin"), "rb").read()
    payload = {"data": open(damaged, "rb").read()}  # first the Hub serves a damaged file too

    def fake_download(repo_id, filename, *, repo_type, local_dir):
        os.makedirs(local_dir, exist_ok=True)
        path = os.path.join(local_dir, filename)
        with open(path, "wb") as f:
            f.write(payload["data"])
        return path

    monkeypatch.setattr(dl, "check_hub_reachable", lambda filename: None)
    monkeypatch.setattr(dl, "hf_hub_download", fake_download)
    assert dl.main(["0", "--local-dir", str(fw)]) == 1
    out = capsys.readouterr().out
    assert f"invalid, to be replaced by a fresh download: {damaged}: " in out and TAILS[kind][1] in out
    assert "0 of 1 shards already present and valid" in out and "invalid download, deleted" in out
    assert bin_files(tmp_path) == [damaged]  # kept until a valid replacement arrives
    payload["data"] = good
    assert dl.main(["0", "--local-dir", str(fw)]) == 0
    assert open(damaged, "rb").read() == good
    assert "1 of 1 shards already present and valid" in (dl.main(["0", "--local-dir", str(fw)]) == 0 and
                                                         capsys.readouterr().out)


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


def test_download_offline_fails_fast_with_clear_message(tmp_path, no_torch):
    t0 = time.time()
    res = run_cli("cached_fineweb10B.py", "1", "--local-dir", tmp_path / "fw", env={"HF_HUB_OFFLINE": "1"},
                  timeout=60, no_torch=no_torch)
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
    assert read_header(str(fw / "fineweb_val_000000.bin")) == 7  # untouched
    assert read_header(str(fw / "fineweb_train_000001.bin")) == 4
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


def test_download_offline_keeps_an_invalid_file(tmp_path, no_torch):
    """The invalid file is replaced only by a validated download, never deleted before the Hub answers."""
    fw = tmp_path / "fw"
    fw.mkdir()
    bad = _valid_shard_bytes(4)
    bad = b"\x00\x01\x02\x03" + bad[4:]  # bad magic
    (fw / "fineweb_val_000000.bin").write_bytes(bad)
    res = run_cli("cached_fineweb10B.py", "0", "--local-dir", fw, env={"HF_HUB_OFFLINE": "1"}, timeout=60,
                  no_torch=no_torch)
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
    assert read_header(str(fw / "fineweb_val_000000.bin")) == 9
    assert bin_files(tmp_path) == [str(fw / "fineweb_val_000000.bin")]


# ---------------------------------------------------------------------------------------------
# run.sh: the process count, DATA_DIR (data/sample without a GPU; FineWeb downloaded when empty), python or torchrun


def _run_sh(tmp_path, env, *args, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "NPROC")} | {"CUDA_VISIBLE_DEVICES": ""} | env
    return subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _fake_python(tmp_path, gpus):
    """A python that answers run.sh's GPU count with ``gpus`` and records every other call in ``tmp_path/calls``
    instead of running it (a download, the trainer, torchrun): ``(calls, python)``."""
    calls, python = tmp_path / "calls", tmp_path / "python"
    python.write_text(f'#!/usr/bin/env bash\nif [[ "$*" == *device_count* ]]; then echo {gpus}; exit 0; fi\n'
                      f'echo "$*" >> "{calls}"\n')
    python.chmod(0o755)
    return calls, python


@pytest.mark.parametrize("typed", [["--preset", "record_h200"], ["--preset=cpu_baseline"]])
def test_run_sh_names_the_preset_the_arguments_give(tmp_path, typed):
    calls, python = _fake_python(tmp_path, 0)
    res = _run_sh(tmp_path, {"PYTHON": str(python)}, *typed)
    preset = typed[-1].split("=")[-1]
    assert res.returncode == 0 and res.stderr.splitlines() == [
        f"run.sh: preset {preset} on 1 CPU process(es), data data/sample"], res.stderr
    assert calls.read_text().split().count(preset) >= 1  # and the trainer gets it, after run.sh's default


def test_run_sh_without_gpu_or_data_dir_trains_cpu_smoke_on_the_sample(tmp_path):
    # cpu_smoke (record #89's recipe at the smoke shape, TST and Aurora) cut to 4 steps of 1 -> 2 -> 3 x 32 positions
    small = ["--seq-len", "32", "--batch-tokens", "96", "--num-iterations", "4", "--extension-steps", "0",
             "--val-tokens", "512", "--val-every", "0"]
    res = _run_sh(tmp_path, {"OMP_NUM_THREADS": "1"}, *small, "--log-dir", str(tmp_path / "logs"))
    assert res.returncode == 0, res.stderr
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("run.sh:")]
    assert line == "run.sh: preset cpu_smoke on 1 CPU process(es), data data/sample", line
    log = read_log(tmp_path / "logs")
    assert "preset: cpu_smoke" in log and "data/sample/wikipedia_val_000000.bin" in log and "status:complete" in log


@pytest.mark.parametrize("kind", ["only_val", "file", "missing", "empty"])
def test_run_sh_refuses_a_data_dir_without_train_shards_in_one_line_and_downloads_nothing(tmp_path, kind):
    """Without a GPU a DATA_DIR that holds no train shard (only a val shard, a file, missing, empty) is one refusal
    line naming it (a relative one from where run.sh was started) and the fix, exit 2; nothing is created."""
    if kind == "only_val":
        (tmp_path / "my data").mkdir()
        (tmp_path / "my data" / "x_val_000000.bin").write_bytes(_shard_bytes())
    elif kind == "file":
        (tmp_path / "my data").write_text("x")
    elif kind == "empty":
        (tmp_path / "my data").mkdir()
    res = _run_sh(tmp_path, {"DATA_DIR": "my data"}, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"run.sh: DATA_DIR={tmp_path / 'my data'} holds no *_train_*.bin shards; point it at a folder of shards "
        "(data/tokenize_text.py makes them from text) or unset it for data/sample"], res.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == {"only_val": ["my data", "x_val_000000.bin"],
                                                          "missing": []}.get(kind, ["my data"])


@pytest.mark.parametrize("nproc", ["99999999999999999999", "0", "two", "1000"])
def test_run_sh_refuses_a_process_count_that_is_not_one_in_one_line(tmp_path, nproc):
    res = _run_sh(tmp_path, {"NPROC": nproc, "OMP_NUM_THREADS": "1"}, "--log-dir", str(tmp_path / "logs"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"run.sh: NPROC={nproc}: give a process count (1, 2, 4, 8)"], res.stderr
    assert "integer expression" not in res.stdout + res.stderr and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("gpus, nproc", [(1, 1), (3, 2), (8, 8), (12, 8)])
def test_run_sh_on_gpus_runs_baseline_h200_on_the_most_processes_that_split_a_step(tmp_path, gpus, nproc):
    """The GPU default: baseline_h200 on 1, 2, 4 or 8 processes (a step's 8 sequences split evenly), python for one,
    torchrun for more; flags after run.sh's own override them (--preset record_h200)."""
    calls, python = _fake_python(tmp_path, gpus)
    data = os.path.join(REPO, "data", "sample")
    res = _run_sh(tmp_path, {"PYTHON": str(python), "DATA_DIR": data}, "--preset", "record_h200", "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == f"run.sh: preset record_h200 on {nproc} GPU process(es), data {data}", res.stderr
    args = (f"--preset record_h200 --train-files {data}/*_train_*.bin --val-files {data}/*_val_*.bin "
            "--preset record_h200 --seed 3")
    # more than one process: the trainer's --describe checks the count first, then harness.py launches torchrun
    expected = [f"train_gpt.py {args}"] if nproc == 1 else [
        f"train_gpt.py {args} --describe", f"harness.py --standalone --nproc_per_node={nproc} train_gpt.py {args}"]
    assert calls.read_text().splitlines() == expected


def test_run_sh_on_a_gpu_downloads_fineweb_into_an_empty_data_dir_then_trains(tmp_path):
    calls, python = _fake_python(tmp_path, 1)
    (tmp_path / "fw [1]").mkdir()  # glob characters in the folder's name reach the trainer escaped
    res = _run_sh(tmp_path, {"PYTHON": str(python), "DATA_DIR": str(tmp_path / "fw [1]")})
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == (f"run.sh: no shards in {tmp_path / 'fw [1]'}; downloading FineWeb's val "
                                          "shard and 10 train shards")
    download, train = calls.read_text().splitlines()
    assert download == f"data/cached_fineweb10B.py 10 --local-dir {tmp_path / 'fw [1]'}"
    assert train.startswith(f"train_gpt.py --preset baseline_h200 --train-files {tmp_path / 'fw [[]1[]]'}/*_train_*.bin")


def test_trainer_refuses_what_the_data_tools_refuse_in_a_shards_tokens(tmp_path):
    """An id >= 50,257 (another tokenizer's) at a random place of a shard, or none: the trainer's TokenStream (its
    start-up scan, in blocks of 16M tokens) refuses it in one line naming the file, the id and its first position
    (a plain argmax as the reference), exactly when data/shard_format's scan does."""
    rng = np.random.default_rng(0)
    for case in range(8):
        tokens = rng.integers(0, 50257, size=int(rng.integers(10, 5000))).astype(np.uint16)
        tokens[rng.integers(0, len(tokens), 20)] = EOT
        if case % 2:
            tokens[rng.integers(0, len(tokens), int(rng.integers(1, 4)))] = rng.integers(50257, 65536)
        path = str(tmp_path / f"c{case}_train_000001.bin")
        sf.write_shard(path, tokens)
        _, top, run = sf.scan_tokens(tokens)
        tools = sf.token_problem(top, run)
        try:
            harness.TokenStream([path])
            refused = None
        except harness.DataError as e:
            refused = str(e)
        assert (refused is not None) == (tools is not None) == bool(case % 2), (case, refused, tools)
        if refused:
            at = int(np.argmax(tokens >= 50257))
            assert refused == (f"{path}: token id {tokens.max()} > 50256 (the first at token {at:,}): not GPT-2 BPE "
                               f"ids; re-tokenize with data/tokenize_text.py")
