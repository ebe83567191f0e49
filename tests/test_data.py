"""Tests of gated_attention.data: splits, tokenizer round-trips, the invalid-UTF-8 policy, token storage, the sampler,
manifest checksums, skipped sources, and (where the Debian packages are installed) real sources."""
from __future__ import annotations

import gzip
import random
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gated_attention import data as D
from harness import write_text_domains

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex my jovial boxer "
         "def return import class lambda yield 国王 王子 café naïve").split()


def _fake_text(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(paragraphs)) + "\n"


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def small(tmp_path_factory):
    """A corpus from a folder of text files and a JSONL file (no built-in sources): fast to build."""
    root = tmp_path_factory.mktemp("src")
    extra = write_text_domains(root, {"prose": [_fake_text(i, 30) for i in range(6)],
                                      "notes": [{"text": _fake_text(100 + i, 4), "id": i} for i in range(20)]})
    cfg = D.PrepareConfig(data_dir=str(tmp_path_factory.mktemp("data")), vocab_size=400, sources=(), extra=extra,
                          val_fraction=0.2, chunk_chars=300)
    manifest = D.prepare(cfg)
    return cfg, manifest, root


def test_manifest_domains_and_files(small):
    cfg, manifest, _ = small
    assert list(manifest["domains"]) == ["prose", "notes"]
    corpus = D.Corpus(cfg.data_dir)
    # a tiny corpus runs out of merges before the requested size; the manifest records the real size
    assert manifest["dtype"] == "uint16" and 300 < manifest["vocab_size"] <= 400 == cfg.vocab_size
    assert corpus.vocab_size == len(corpus.tokenizer) == manifest["vocab_size"]
    for d in corpus.domains:
        e = manifest["domains"][d]
        assert e["chunks"]["train"] > 0 and e["chunks"]["val"] > 0
        for split in ("train", "val"):
            shards = corpus.tokens(d, split)
            assert isinstance(shards, D.TokenShards) and all(isinstance(a, np.memmap) for a in shards.shards)
            arr = np.asarray(shards)
            assert arr.dtype == np.uint16
            assert len(arr) == e["tokens"][split] and int(arr.max()) < corpus.vocab_size
            assert arr[-1] == corpus.eos_id  # every chunk ends with eos
            assert (arr == corpus.eos_id).sum() == e["chunks"][split]


def test_splits_deterministic_disjoint_and_stable(small):
    cfg, manifest, root = small
    recs = D.read_raw(Path(cfg.data_dir) / "raw" / "prose.jsonl")
    a = D.assign_splits(recs, "prose", cfg.seed, cfg.val_fraction)
    assert a == D.assign_splits(recs, "prose", cfg.seed, cfg.val_fraction)
    keys = {s: {(r["doc"], r["chunk"]) for r, l in zip(recs, a) if l == s} for s in ("train", "val")}
    assert keys["train"] and keys["val"] and not keys["train"] & keys["val"]
    assert len(keys["train"]) + len(keys["val"]) == len(recs)
    # the chunks reassemble the documents exactly (nothing lost or duplicated by chunking)
    for i in range(6):
        doc = "".join(r["text"] for r in recs if r["doc"] == f"doc{i}.txt")
        assert doc == (root / "prose" / f"doc{i}.txt").read_text(encoding="utf-8")
    # adding a document does not move any existing chunk across the split
    extra = recs + [{"doc": "new.txt", "chunk": j, "text": "x"} for j in range(5)]
    assert D.assign_splits(extra, "prose", cfg.seed, cfg.val_fraction)[: len(recs)] == a
    # another seed gives another split
    assert D.assign_splits(recs, "prose", cfg.seed + 1, cfg.val_fraction) != a


def test_rebuild_is_bit_identical_and_cache_reused(small, tmp_path):
    cfg, manifest, _ = small
    cfg2 = D.PrepareConfig(**{**cfg.__dict__, "data_dir": str(tmp_path / "again")})
    m2 = D.prepare(cfg2)
    assert m2["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]  # BPE training is deterministic
    for d in manifest["domains"]:
        assert m2["domains"][d]["token_files"] == manifest["domains"][d]["token_files"]
    tok_file = tmp_path / "again" / "tokenizer" / "tokenizer.json"
    mtime = tok_file.stat().st_mtime_ns
    m3 = D.prepare(cfg2)
    assert tok_file.stat().st_mtime_ns == mtime  # reused, not retrained
    assert m3["domains"] == m2["domains"]


def test_manifest_checksums_verify(small, tmp_path):
    cfg, manifest, _ = small
    copy = tmp_path / "copy"
    shutil.copytree(cfg.data_dir, copy)
    corpus = D.Corpus(copy)
    assert corpus.verify() == []
    path = copy / manifest["domains"]["notes"]["token_files"]["val"][0]["path"]
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    problems = corpus.verify()
    assert len(problems) == 1 and "notes/val-00000.bin" in problems[0]


UNICODE_SAMPLES = [
    "plain ASCII, with punctuation!?\n\ttabs and  double  spaces ",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽",
    "CJK 漢字かなカナ 한국어 中文測試",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 and Hangul jamo \u1100\u1161\u11a8",
    "RTL: שלום עולם مرحبا بالعالم; math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ",
    "controls \x00\x01\x7f\u200b\u200d\ufeff and a private use char \ue000 and U+FFFD \ufffd",
]


def test_tokenizer_roundtrips_unicode(small):
    cfg, _, _ = small
    tok = D.get_tokenizer(cfg.data_dir)
    rng = random.Random(0)
    # random code points from the whole range, skipping surrogates (not valid Unicode scalar values)
    random_text = "".join(chr(c) for c in (rng.randrange(0x110000) for _ in range(3000)) if not 0xD800 <= c < 0xE000)
    for text in UNICODE_SAMPLES + [random_text, "".join(UNICODE_SAMPLES)]:
        ids = D.encode(tok, text)
        assert tok.decode(ids) == text
        assert tok.unk_token_id is None or tok.unk_token_id not in ids


def test_tokenizer_loads_with_auto_and_special_tokens(small, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg, _, _ = small
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    out = D.save_tokenizer(D.get_tokenizer(cfg.data_dir), ckpt)  # into a checkpoint dir, beside the weights
    assert (ckpt / "model.safetensors").read_bytes() == b"weights"  # the checkpoint's own files are untouched
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no temp leftovers
    for tok in (AutoTokenizer.from_pretrained(str(out)), PreTrainedTokenizerFast.from_pretrained(str(out))):
        assert isinstance(tok, PreTrainedTokenizerFast)
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (D.BOS, D.EOS, D.PAD)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
        assert tok.convert_ids_to_tokens(D.encode(tok, "<|eos|>")) == ["<|eos|>"]


def test_invalid_utf8_replaced_and_counted(small, tmp_path):
    cfg, _, _ = small
    assert D.decode_utf8(b"ab\xff\xfecd\xe2\x82") == ("ab\ufffd\ufffdcd\ufffd", 3)
    assert D.decode_utf8("ok \ufffd".encode()) == ("ok \ufffd", 0)  # a real U+FFFD is not counted
    assert D.clean_text("x\udc80y") == ("x\ufffdy", 1)  # lone surrogate (e.g. from surrogateescape)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(_fake_text(7, 40).encode() + b"\n\xff broken \xc3( tail\n")
    with pytest.warns(UserWarning, match="2 invalid UTF-8"):
        m = D.prepare(D.PrepareConfig(data_dir=str(tmp_path / "d"), vocab_size=300, sources=(), extra=(str(bad),),
                                      chunk_chars=200))
    assert m["domains"]["bad"]["replaced_chars"] == 2
    raw = "".join(r["text"] for r in D.read_raw(tmp_path / "d" / "raw" / "bad.jsonl"))
    assert raw.endswith("\n\ufffd broken \ufffd( tail\n")
    tok = D.get_tokenizer(cfg.data_dir)
    with pytest.warns(UserWarning, match="1 invalid"):
        ids = D.text_to_tokens("a\udcffb", tok)
    assert tok.decode(ids[:-1].tolist()) == "a\ufffdb" and ids[-1] == tok.eos_token_id


def test_text_to_tokens_files_and_text(small):
    cfg, _, root = small
    tok = D.get_tokenizer(cfg.data_dir)
    ids = D.text_to_tokens([root / "prose" / "doc0.txt", "hello"], tok)
    assert ids.dtype == np.int64 and (ids == tok.eos_token_id).sum() == 2
    assert tok.decode(ids.tolist(), skip_special_tokens=True) == (root / "prose" / "doc0.txt").read_text() + "hello"


def test_sample_batch_deterministic_and_varies(small):
    cfg, _, _ = small
    corpus = D.Corpus(cfg.data_dir)
    b1 = D.sample_batch(corpus, "train", 4, 16, seed=3, step=7)
    b2 = D.sample_batch(D.Corpus(cfg.data_dir), "train", 4, 16, seed=3, step=7)  # fresh object: nothing cached
    assert b1.dtype == torch.long and b1.shape == (4, 17)
    assert torch.equal(b1, b2)
    assert not torch.equal(b1, D.sample_batch(corpus, "train", 4, 16, seed=3, step=8))
    assert not torch.equal(b1, D.sample_batch(corpus, "train", 4, 16, seed=4, step=7))
    assert (b1[:, 0] == corpus.bos_id).all()
    streams = {d: corpus.tokens(d, "train").astype(np.int64).tolist() for d in corpus.domains}
    for row in b1:  # every window is a contiguous run of one domain's tokens
        window = row[1:].tolist()
        assert any(_contains(s, window) for s in streams.values())
    nb = D.sample_batch(corpus, "train", 4, 16, seed=3, step=7, bos=False)
    assert nb.shape == (4, 17) and not (nb[:, 0] == corpus.bos_id).all()
    only = D.sample_batch(corpus, "val", 8, 8, seed=0, step=0, domains=["notes"])
    val = corpus.tokens("notes", "val").astype(np.int64).tolist()
    assert all(_contains(val, r[1:].tolist()) for r in only)
    with pytest.raises(ValueError, match="seq_len"):
        D.sample_batch(corpus, "val", 1, 10**7, seed=0, step=0)
    with pytest.raises(KeyError, match="unknown domain"):
        D.sample_batch(corpus, "train", 1, 8, seed=0, step=0, domains=["nope"])


def test_sample_batch_domain_proportions(small):
    cfg, manifest, _ = small
    corpus = D.Corpus(cfg.data_dir)
    prose = corpus.tokens("prose", "train").astype(np.int64).tolist()
    notes = corpus.tokens("notes", "train").astype(np.int64).tolist()
    hits = n = 0
    for step in range(20):
        for row in D.sample_batch(corpus, "train", 16, 24, seed=0, step=step):
            w = row[1:].tolist()
            in_p, in_n = _contains(prose, w), _contains(notes, w)
            if in_p != in_n:  # windows found in both streams are ambiguous; leave them out
                hits += in_p
                n += 1
    expected = manifest["domains"]["prose"]["tokens"]["train"] / sum(
        e["tokens"]["train"] for e in manifest["domains"].values())
    assert n > 250 and abs(hits / n - expected) < 0.12


def test_eval_batches_fixed_and_non_overlapping(small):
    cfg, _, _ = small
    corpus = D.Corpus(cfg.data_dir)
    val = corpus.tokens("prose", "val").astype(np.int64)
    batches = list(D.eval_batches(corpus, "prose", seq_len=8, max_batches=None, batch_size=3))
    assert batches and all(b.shape[1] == 9 and (b[:, 0] == corpus.bos_id).all() for b in batches)
    targets = torch.cat([b[:, 1:] for b in batches]).reshape(-1).numpy()  # (n_windows * 8,)
    assert np.array_equal(targets, val[: len(targets)]) and len(val) - len(targets) < 8
    again = list(D.eval_batches(corpus, "prose", seq_len=8, max_batches=2, batch_size=3))
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(again, batches))
    nb = torch.cat(list(D.eval_batches(corpus, "prose", seq_len=8, batch_size=4, bos=False)))
    assert np.array_equal(nb[:, 1:].reshape(-1).numpy(), val[1: 1 + nb.shape[0] * 8])


def test_missing_source_reported_and_skipped(small, tmp_path, monkeypatch, capsys):
    cfg, _, root = small
    monkeypatch.setenv("PATH", str(tmp_path))  # no dpkg here: the Debian sources must be skipped, not crash
    m = D.prepare(D.PrepareConfig(data_dir=str(tmp_path / "d"), vocab_size=300, sources=("austen", "bible"),
                                  extra=(str(root / "notes.jsonl"), str(tmp_path / "nope.txt")), chunk_chars=300))
    assert list(m["domains"]) == ["notes"]
    assert set(m["skipped"]) == {"austen", "bible", str(tmp_path / "nope.txt")}
    assert "dpkg" in m["skipped"]["austen"] and "no such file" in m["skipped"][str(tmp_path / "nope.txt")]
    assert "SKIPPED" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no corpus source"):
        D.prepare(D.PrepareConfig(data_dir=str(tmp_path / "e"), sources=("bible",)))
    with pytest.raises(ValueError, match="unknown source"):
        D.prepare(D.PrepareConfig(data_dir=str(tmp_path / "f"), sources=("wikipedia",)))


def test_cli_info(small, gattn_main):
    cfg, _, _ = small
    rc, out, _ = gattn_main("data", "info", "--data-dir", cfg.data_dir, "--verify")
    assert rc == 0
    assert "prose" in out and "notes" in out and "all checksums match" in out


def _installed(pkg: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.stdout == "install ok installed"


@pytest.mark.skipif(not _installed("r-cran-janeaustenr"), reason="Debian r-cran-janeaustenr not installed")
def test_real_austen_read_without_r(tmp_path):
    docs, info = D._source_austen(tmp_path)
    assert [d for d, _ in docs] == ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                                    "northangerabbey", "persuasion"]
    emma = dict(docs)["emma"]
    assert emma.count("\n") == 16235  # the R character vector's length (checked against R once)
    assert "half a day. It was a melancholy change; and Emma could not but sigh over" in emma


@pytest.mark.skipif(not _installed("bible-kjv"), reason="Debian bible-kjv not installed")
def test_real_bible(tmp_path):
    docs, _ = D._source_bible(tmp_path)
    assert len(docs) == 1189  # chapters
    assert docs[0][1].startswith("Ge 1\n1 In the beginning God created the heaven and the earth.\n")
    assert docs[-1][1].rstrip().endswith("21 The grace of our Lord Jesus Christ be with you all. Amen.")


def _contains(stream: list[int], window: list[int]) -> bool:
    n = len(window)
    first = window[0]
    return any(stream[i:i + n] == window for i, t in enumerate(stream[: len(stream) - n + 1]) if t == first)


# A hand-written R serialization stream (XDR, version 3), so the reader is tested even where R packages are absent.
def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _chars(s: str | None) -> bytes:
    if s is None:
        return _i(9) + _i(-1)  # NA_character_
    b = s.encode("utf-8")
    return _i(9 | ((1 << 3) << 12)) + _i(len(b)) + b  # CHARSXP flagged UTF-8


def _strsxp(items) -> bytes:
    return _i(16) + _i(len(items)) + b"".join(_chars(s) for s in items)


def _names_attr(names, first_use: bool) -> bytes:
    # pairlist cell with a tag: the symbol `names` (a reference to it after its first use), then the value, then NIL
    sym = _i(1) + _chars("names") if first_use else _i((1 << 8) | 255)
    return _i(2 | (1 << 10)) + sym + _strsxp(names) + _i(254)


def _stream(body: bytes) -> bytes:
    return b"X\n" + _i(3) + _i(0x040201) + _i(0x030500) + _i(5) + b"UTF-8" + body


def test_r_reader_synthetic(tmp_path):
    novel = ["Chapter 1", "", "It is a truth — universally acknowledged 😀", None]
    ints = _i(13) + _i(3) + _i(1) + _i(-7) + _i(42)
    # list(text = <character>, n = <integer>) as saveRDS writes it (gzip)
    data = _stream(_i(19 | (1 << 9)) + _i(2) + _strsxp(novel) + ints + _names_attr(["text", "n"], first_use=True))
    (tmp_path / "x.rds").write_bytes(gzip.compress(data))
    got = D.read_rds(tmp_path / "x.rds").named()
    assert got["text"].value == novel and got["n"].value == [1, -7, 42]

    # a lazy-load db: .rdb records (4-byte length + zlib) and an .rdx index, saveRDS of
    # list(variables = list(v = c(off, len), w = c(off, len)), compressed = TRUE)
    named_strs = _i(16 | (1 << 9)) + _i(3) + b"".join(_chars(x) for x in novel[:3]) + _names_attr(["x", "y", "z"], True)
    named_ints = _i(13 | (1 << 9)) + _i(3) + _i(1) + _i(-7) + _i(42) + _names_attr(["a", "b", "c"], True)
    rdb, locs = b"", []
    for rec in (_stream(named_strs), _stream(named_ints)):
        z = struct.pack(">I", len(rec)) + zlib.compress(rec)
        locs.append((len(rdb), len(z)))
        rdb += z

    def real(pair):
        return _i(14) + _i(2) + b"".join(struct.pack(">d", v) for v in pair)

    variables = _i(19 | (1 << 9)) + _i(2) + real(locs[0]) + real(locs[1]) + _names_attr(["v", "w"], first_use=True)
    # the outer names attribute refers back to the symbol `names` registered above (a REFSXP)
    index = _stream(_i(19 | (1 << 9)) + _i(2) + variables + _i(10) + _i(1) + _i(1)
                    + _names_attr(["variables", "compressed"], first_use=False))
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    db = D.read_lazyload_db(tmp_path / "Rdata.rdx")
    assert db["v"].value == novel[:3] and db["v"].named() == dict(zip("xyz", novel[:3]))
    assert db["w"].value == [1, -7, 42] and db["w"].named() == {"a": 1, "b": -7, "c": 42}
