"""Streaming corpus preparation (issue 29): worker-count-independent token shards, resume from finished shards, the
bounded tokenizer sample, the input formats (text, JSONL --text-field, Parquet, datasets save_to_disk), reading
across shards and a rank's rows of a batch, and (where installed) the opt-in large Debian sources."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _extras import need

from gated_attention import data as D
from gated_attention.data import formats, stream

WORDS = "the quick brown fox jumps over a lazy dog café 国王 naïve def return".split()


def _text(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
                       for _ in range(paragraphs)) + "\n"


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 7 chunks and tasks of 3, so a small corpus has several shards and several tasks per shard."""
    monkeypatch.setattr(stream, "SHARD_CHUNKS", 7)
    monkeypatch.setattr(stream, "BATCH_CHUNKS", 3)


@pytest.fixture
def src(tmp_path):
    (tmp_path / "prose").mkdir()
    for i in range(5):
        (tmp_path / "prose" / f"doc{i}.txt").write_text(_text(i, 25), encoding="utf-8")
    with open(tmp_path / "notes.jsonl", "w", encoding="utf-8") as f:
        for i in range(30):
            f.write(json.dumps({"body": _text(50 + i, 3), "id": i}) + "\n")
    return tmp_path


def _cfg(out: Path, extra, **kw) -> D.PrepareConfig:
    base = dict(data_dir=str(out), vocab_size=300, sources=(), extra=tuple(str(e) for e in extra),
                val_fraction=0.2, chunk_chars=200, text_field="body")
    return D.PrepareConfig(**{**base, **kw})


def _token_bytes(data_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(data_dir).as_posix(): p.read_bytes() for p in sorted((data_dir / "tokens").rglob("*.bin"))}


def test_one_and_two_workers_give_identical_token_files(tmp_path, src, small_shards):
    # JSONL text from a non-default field (--text-field body); the text folder without a JSONL file
    m1 = D.prepare(_cfg(tmp_path / "w1", [src / "prose"], workers=1, text_field="text"))
    m2 = D.prepare(_cfg(tmp_path / "w2", [src / "prose"], workers=2, text_field="text"))
    assert len(m1["domains"]["prose"]["token_files"]["train"]) >= 3  # several shards
    b1, b2 = _token_bytes(tmp_path / "w1"), _token_bytes(tmp_path / "w2")
    assert b1 == b2 and len(b1) >= 6
    assert m1["domains"] == m2["domains"]
    for split in ("train", "val"):  # the shards concatenated = the unsharded stream: each chunk's ids, then eos
        recs = D.read_raw(tmp_path / "w1" / "raw" / "prose.jsonl")
        labels = D.assign_splits(recs, "prose", 0, 0.2)
        tok = D.get_tokenizer(tmp_path / "w1")
        want = [i for r, l in zip(recs, labels) if l == split for i in D.encode(tok, r["text"]) + [tok.eos_token_id]]
        assert np.asarray(D.Corpus(tmp_path / "w1").tokens("prose", split)).tolist() == want


def test_killed_prepare_continues_from_finished_shards(tmp_path, src, small_shards, monkeypatch, capsys):
    clean = D.prepare(_cfg(tmp_path / "clean", [src / "prose", src / "notes.jsonl"], workers=1))
    real = stream._encode_task
    calls = {"n": 0}

    def dies_after_five(task):
        calls["n"] += 1
        if calls["n"] > 5:  # the third shard of the first domain (7 chunks = 3 tasks a shard) is never finished
            raise KeyboardInterrupt("killed")
        return real(task)

    monkeypatch.setattr(stream, "_encode_task", dies_after_five)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        D.prepare(_cfg(out, [src / "prose", src / "notes.jsonl"], workers=1))
    assert not (out / "manifest.json").exists()
    first = {p.name: p.stat().st_mtime_ns for p in (out / "tokens" / "prose").glob("*-00000.bin")}
    assert len(first) == 2
    monkeypatch.setattr(stream, "_encode_task", real)
    capsys.readouterr()
    m = D.prepare(_cfg(out, [src / "prose", src / "notes.jsonl"], workers=1))
    assert "tokenizer: reusing" in capsys.readouterr().err  # the trained tokenizer survived the kill too
    assert {p.name: p.stat().st_mtime_ns for p in (out / "tokens" / "prose").glob("*-00000.bin")} == first
    assert _token_bytes(out) == _token_bytes(tmp_path / "clean")
    assert m["domains"] == clean["domains"]
    assert D.Corpus(out).verify() == []


def test_tokenizer_sample_is_bounded_and_uniform():
    s = stream.TokenizerSample(max_bytes=1000)
    rng = random.Random(0)
    offered = [(rng.random(), 0, i, "x" * 50) for i in range(200)]  # 10 kB offered, 1 kB kept
    for u, d, i, t in offered:
        s.offer(u, d, i, t)
    assert s.nbytes <= 1000 and len(s.texts()) == 20
    kept = sorted(offered)[:20]  # the 20 smallest hashes, whatever the order they came in
    s2 = stream.TokenizerSample(max_bytes=1000)
    for u, d, i, t in reversed(offered):
        s2.offer(u, d, i, t)
    assert s2._heap and sorted(-e[0] for e in s2._heap) == [u for u, *_ in kept]
    big = stream.TokenizerSample(max_bytes=10**6)  # everything fits: all of it, in corpus order
    for u, d, i, t in offered:
        big.offer(u, d, i, f"{i}")
    assert big.texts() == [str(i) for i in range(200)]


def test_tokenizer_trained_on_a_sample_when_the_corpus_is_bigger(tmp_path, src):
    m = D.prepare(_cfg(tmp_path / "d", [src / "prose"], tokenizer_sample_mb=0.003, text_field="text"))
    assert m["tokenizer"]["sample_mb"] == 0.003 and 2500 < m["tokenizer"]["sample_bytes"] <= 3000
    assert m["domains"]["prose"]["bytes"] > 3 * 3000  # most of the corpus was not read for BPE training
    full = D.prepare(_cfg(tmp_path / "all", [src / "prose"], text_field="text"))
    recs = D.read_raw(tmp_path / "all" / "raw" / "prose.jsonl")
    train = [r for r, l in zip(recs, D.assign_splits(recs, "prose", 0, 0.2)) if l == "train"]
    assert full["tokenizer"]["sample_bytes"] == sum(len(r["text"].encode()) for r in train)  # fits: all of it


def test_text_file_lines_stream_like_splitlines(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "BLOCK", 7)  # blocks cut through "\r\n", multi-byte characters and long lines
    text = "a\r\nbé国\r\n\r\n" + "long line " * 9 + "\n\rx\u2028y\n\x0cz\r" + "\n" + "end"
    raw = text.encode("utf-8") + b"\xff\xc3\n tail"  # invalid UTF-8 too
    p = tmp_path / "t.txt"
    p.write_bytes(raw)
    info = {"replaced_chars": 0}
    want, n = D.decode_utf8(raw)
    assert list(formats.text_file_lines(p, info)) == want.splitlines(keepends=True) and info["replaced_chars"] == n


def _rows(n: int) -> list[str]:
    return [_text(200 + i, 2) for i in range(n)]


def test_parquet_and_saved_dataset_inputs(tmp_path):
    pa = need("pyarrow", "pip install -e '.[data]'")
    pq = need("pyarrow.parquet", "pip install -e '.[data]'")
    datasets = need("datasets", "pip install -e '.[data]'")
    texts = _rows(12)
    pq.write_table(pa.table({"content": texts, "n": list(range(12))}), tmp_path / "pq.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"content": texts[:5]}).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts[5:9]}),
                          "test": datasets.Dataset.from_dict({"content": texts[9:]})}).save_to_disk(str(tmp_path / "hfd"))
    for path, want in ((tmp_path / "pq.parquet", texts), (tmp_path / "hf", texts[:5]),
                       (tmp_path / "hfd", texts[9:] + texts[5:9])):  # DatasetDict: splits in sorted order
        _, docs, _ = formats.iter_extra(path, "content")
        assert [t for _, t in docs] == want
    m = D.prepare(_cfg(tmp_path / "d", [tmp_path / "pq.parquet", tmp_path / "hf"], text_field="content"))
    assert list(m["domains"]) == ["pq", "hf"] and m["domains"]["hf"]["documents"] == 5
    raw = "".join(r["text"] for r in D.read_raw(tmp_path / "d" / "raw" / "pq.jsonl"))
    assert raw == "".join(texts)
    with pytest.raises(ValueError, match="no column 'text'.*--text-field"):
        list(formats.iter_extra(tmp_path / "pq.parquet")[1])


def test_missing_data_extra_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_dict.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    for p in (tmp_path / "x.parquet", tmp_path / "hf"):
        with pytest.raises(D.SourceUnavailable, match=r"gated-attention\[data\]"):
            formats.iter_extra(p)


def test_jsonl_text_field_errors_name_the_flag(tmp_path, src):
    with pytest.raises(ValueError, match='"text" field.*--text-field'):
        list(formats.iter_extra(src / "notes.jsonl")[1])
    _, docs, _ = formats.iter_extra(src / "notes.jsonl", "body")
    assert len(list(docs)) == 30


def test_token_shards_read_across_boundaries_and_rank_rows(tmp_path, src, small_shards):
    D.prepare(_cfg(tmp_path / "d", [src / "prose"], text_field="text"))
    corpus = D.Corpus(tmp_path / "d")
    shards = corpus.tokens("prose", "train")
    full = np.asarray(shards)
    assert len(shards.shards) >= 3 and len(shards) == len(full)
    edge = int(shards.offsets[1])
    for a, b in ((0, 5), (edge - 3, edge + 4), (edge - 1, int(shards.offsets[2]) + 2), (len(full) - 2, len(full))):
        assert np.array_equal(shards[a:b], full[a:b])
    assert shards[edge] == full[edge] and shards[-1] == full[-1]
    batch = D.sample_batch(corpus, "train", 8, 40, seed=2, step=5)
    for lo, hi in ((0, 4), (4, 8), (3, 5)):  # a rank's rows = those rows of the global batch, reading only them
        assert torch.equal(D.sample_batch(corpus, "train", 8, 40, seed=2, step=5, rows=slice(lo, hi)), batch[lo:hi])


@pytest.mark.skipif(not Path(D.large_sources.GCIDE_DICT).exists(), reason="Debian dict-gcide not installed")
def test_real_gcide_entries_stream(tmp_path):
    docs, info = D.SOURCES["gcide"](tmp_path)
    first = [next(docs) for _ in range(3)]
    assert all(t.strip() and ":" in d for d, t in first)
    assert "GPL" in info["licence"] and "gcide" not in D.DEFAULT_SOURCES
