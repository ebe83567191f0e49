"""The epoch sampler (data/epoch.py, issue 38 item 7): every window once per epoch, a new order per epoch and seed,
rows of one global batch whatever the world size, exact resume, and the packing semantics.

Most tests read a stand-in corpus whose tokens name their own position (token = BASE + stream position, documents
ended by EOS), so a row says exactly which stream positions it holds; one test trains on a prepared corpus."""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from gated_attention.data.epoch import EpochSampler, permute, _keys

# The shared tiny corpus may already hold a document index another test built: copies leave it out so the cache
# tests start from a corpus that was never scanned.
_NO_INDEX = shutil.ignore_patterns("index")

BOS, EOS, BASE = 1, 2, 1000


class PositionCorpus:
    """Domains whose train stream holds BASE + position, with an EOS ending each document (doc_lens tokens each,
    the EOS included)."""

    def __init__(self, doc_lens: dict[str, list[int]]):
        self.domains, self.bos_id, self.eos_id, self.streams = list(doc_lens), BOS, EOS, {}
        for d, lens in doc_lens.items():
            s = BASE + np.arange(sum(lens), dtype=np.int64)
            s[np.cumsum(lens) - 1] = EOS
            self.streams[d] = s

    def _check(self, domain, split):
        assert domain in self.streams and split == "train"

    def tokens(self, domain, split):
        return self.streams[domain]


def _epoch_rows(sampler: EpochSampler, seed: int, epoch: int) -> list[tuple[int, int]]:
    k = np.arange(epoch * sampler.size, (epoch + 1) * sampler.size)
    dom, start = sampler.windows(seed, k)
    return list(zip(dom.tolist(), start.tolist()))


def test_permute_is_a_bijection_for_any_size():
    for size in (1, 2, 3, 5, 16, 17, 1000, 4097):
        out = permute(np.arange(size), size, _keys(0, 0, "train", 6))
        assert sorted(out.tolist()) == list(range(size)), size
    big = 10**12  # evaluated at a few indices only: no permutation is ever stored
    out = permute(np.array([0, 1, big - 1]), big, _keys(3, 1, "train", 6))
    assert ((out >= 0) & (out < big)).all() and len(set(out.tolist())) == 3


@pytest.mark.parametrize("pack", [False, True])
def test_every_window_exactly_once_per_epoch(pack):
    corpus = PositionCorpus({"a": [50, 7, 90, 33], "b": [64, 64, 5]})
    s = EpochSampler(corpus, seq_len=8, pack_documents=pack)
    need = 9 if pack else 8
    for d, dom in enumerate(s.domains):
        assert s.counts[d] == (dom.length - need) // 8 + 1
    for epoch in range(3):
        seen = _epoch_rows(s, seed=5, epoch=epoch)
        counts = Counter(seen)
        assert len(seen) == s.size and max(counts.values()) == 1  # no window twice
        offs = s.offsets(5, epoch)
        expected = {(d, int(offs[d]) + 8 * i) for d in range(2) for i in range(s.counts[d])}
        assert set(seen) == expected  # ... and every window of the epoch's grid


def test_targets_cover_the_stream_once_per_epoch():
    """Every stored token in the epoch's window range is a target exactly once (unpacked: BOS + T tokens)."""
    corpus = PositionCorpus({"a": [40, 41, 19]})
    s = EpochSampler(corpus, seq_len=10)
    rows = s.batch(s.size, seed=2, step=0)  # one batch = one epoch
    targets = rows[:, 1:].flatten().tolist()
    assert (rows[:, 0] == BOS).all()
    off = int(s.offsets(2, 0)[0])
    want = corpus.streams["a"][off:off + 10 * s.size].tolist()
    assert sorted(targets) == sorted(want)
    assert len(corpus.streams["a"]) - len(want) < 10 + 10  # at most the slack and a partial window are left out


def test_order_differs_per_epoch_and_per_seed_and_offsets_move():
    corpus = PositionCorpus({"a": [503] * 8, "b": [257] * 8})
    s = EpochSampler(corpus, seq_len=16)
    orders = {(seed, e): _epoch_rows(s, seed, e) for seed in (0, 1) for e in (0, 1, 2)}
    keys = list(orders)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            same = sum(x == y for x, y in zip(orders[a], orders[b]))
            assert same < 0.1 * s.size, (a, b, same)  # different permutations (a random pair shares ~1 position)
    assert len({tuple(s.offsets(0, e)) for e in range(8)}) > 1  # the window grid moves between epochs
    assert _epoch_rows(s, 0, 1) == _epoch_rows(EpochSampler(corpus, seq_len=16), 0, 1)  # a pure function


def test_domains_share_an_epoch_by_their_window_counts():
    corpus = PositionCorpus({"big": [1000] * 6, "small": [1000] * 2})
    s = EpochSampler(corpus, seq_len=20)
    dom, _ = s.windows(0, np.arange(s.size))
    assert np.bincount(dom).tolist() == s.counts.tolist()  # the whole epoch: each domain's windows, no weighting
    first_quarter = np.bincount(dom[:s.size // 4], minlength=2) / (s.size // 4)
    assert abs(first_quarter[0] - s.counts[0] / s.size) < 0.1  # mixed along the epoch, not one domain after another
    only = EpochSampler(corpus, seq_len=20, domains=["small"])
    assert only.size == s.counts[1]


def test_rank_rows_concatenate_to_the_global_batch_across_epoch_boundaries():
    corpus = PositionCorpus({"a": [37, 80, 41], "b": [66]})
    s = EpochSampler(corpus, seq_len=6, pack_documents=True)
    B = 8
    assert s.size % B  # so batches straddle epoch ends
    for step in range(3 * s.size // B + 2):
        full = s.batch(B, seed=4, step=step)
        for world in (2, 4):
            n = B // world
            parts = [s.batch(B, 4, step, rows=slice(r * n, (r + 1) * n)) for r in range(world)]
            assert torch.equal(torch.cat(parts), full)


def test_a_run_continued_from_any_step_sees_the_same_batches():
    corpus = PositionCorpus({"a": [100] * 5, "b": [30] * 4})
    s = EpochSampler(corpus, seq_len=8)
    straight = [s.batch(6, 9, step) for step in range(20)]
    resumed = EpochSampler(corpus, seq_len=8)  # a new process: nothing carried over but the step
    assert all(torch.equal(resumed.batch(6, 9, step), straight[step]) for step in range(11, 20))
    samples = torch.cat(straight)  # 120 samples: more than one epoch
    assert s.size < 120 and len({tuple(r.tolist()) for r in samples[:s.size]}) == s.size


def _decode_packed(row: list[int], corpus: PositionCorpus, domain: str) -> list[int]:
    """The packed stream of a domain (BOS before every document) as a list, for reference."""
    out = []
    for t in corpus.streams[domain].tolist():
        if not out or out[-1] == EOS:
            out.append(BOS)
        out.append(t)
    return out


def test_packed_rows_are_windows_of_the_bos_separated_stream():
    corpus = PositionCorpus({"a": [5, 12, 3, 30, 1, 9]})
    s = EpochSampler(corpus, seq_len=7, pack_documents=True)
    packed = _decode_packed([], corpus, "a")
    assert s.domains[0].length == len(packed) == 60 + 6
    for seed in range(3):
        dom, start = s.windows(seed, np.arange(s.size))
        rows = s.batch(s.size, seed, 0)
        for (st, row) in zip(start.tolist(), rows.tolist()):
            assert row == packed[st:st + 8]  # T + 1 tokens; consecutive windows share one token
        targets = sorted(t for r in rows.tolist() for t in r[1:])
        off = int(s.offsets(seed, 0)[0])
        assert targets == sorted(packed[off + 1:off + 1 + 7 * s.size])  # each token a target once
    # every document is preceded by its BOS (also when a row starts inside it), and EOS is always followed by BOS
    for row in s.batch(s.size, 0, 0).tolist():
        for a, b in zip(row, row[1:]):
            assert (a == EOS) == (b == BOS)


def test_unpacked_rows_are_bos_plus_stored_windows():
    corpus = PositionCorpus({"a": [13, 40, 11]})
    s = EpochSampler(corpus, seq_len=9)
    _, start = s.windows(1, np.arange(s.size))
    for st, row in zip(start.tolist(), s.batch(s.size, 1, 0).tolist()):
        assert row == [BOS] + corpus.streams["a"][st:st + 9].tolist()


def test_too_small_a_corpus_is_one_clear_error():
    with pytest.raises(ValueError, match="shorter --seq-len"):
        EpochSampler(PositionCorpus({"a": [10]}), seq_len=64)


def test_config_selects_the_sampler_and_rejects_bad_combinations():
    from gated_attention.train.config import TrainConfig
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.util.errors import UserError

    assert TrainConfig().sampler == "random" and TrainConfig().pack_documents is False  # recorded results unchanged
    cfg = apply_overrides(tiny(), ["data=corpus", "sampler=epoch", "pack_documents=true"])
    assert (cfg.sampler, cfg.pack_documents) == ("epoch", True)
    for sets, msg in ((["sampler=shuffle"], "sampler="), (["data=corpus", "pack_documents=true"], "needs sampler"),
                      (["sampler=epoch"], "needs data='corpus'")):
        with pytest.raises(UserError, match=msg):
            apply_overrides(tiny(), sets)


def _losses(out):
    return [json.loads(l)["loss"] for l in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("pack", ["false", "true"])
def test_training_resumed_mid_epoch_equals_uninterrupted(tiny_corpus, tmp_path, monkeypatch, pack):
    """The trainer wiring: a run stopped after its step-3 checkpoint and resumed logs the losses of an uninterrupted
    one, over an epoch boundary (the code domain at seq_len 160 has fewer windows than the run draws)."""
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.data_source import CorpusSource
    from gated_attention.train.trainer import train

    sets = ["data=corpus", f"data_dir={tiny_corpus}", "domains=[\"code\"]", "sampler=epoch",
            f"pack_documents={pack}", "steps=6", "ckpt_every=3", "seq_len=160", "batch_size=8", "precision=fp32",
            "compile=false", "eval_batches=1", "stats_every=0"]
    cfg = apply_overrides(tiny(), sets)
    size = CorpusSource(tiny_corpus, ["code"], "epoch", pack == "true").epoch_sampler(160).size
    assert 8 * 3 < size < 8 * 6, size  # the checkpoint is mid-epoch and the run crosses into epoch 2
    drawn, batch = [], EpochSampler.batch

    def spy(self, batch_size, seed, step, rows=None):
        drawn.append(step)
        return batch(self, batch_size, seed, step, rows)

    monkeypatch.setattr(EpochSampler, "batch", spy)
    train(cfg, tmp_path / "straight")
    assert drawn == list(range(6))  # the trainer's batches came from the epoch sampler

    def crash(steps_done, model):
        if steps_done == 4:
            raise RuntimeError("crash after the step-3 checkpoint")

    with pytest.raises(RuntimeError, match="crash"):
        train(apply_overrides(tiny(), sets), tmp_path / "resumed", step_hook=crash)
    train(apply_overrides(tiny(), sets), tmp_path / "resumed", resume=True)
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(tmp_path / "straight"), abs=1e-6)


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_in_one_process_see_the_same_batches(tiny_corpus, tmp_path):
    """Exact on resume at another world size: 2 ranks (torchrun, gloo, DDP) SIGKILLed after the step-3 checkpoint,
    resumed in one process, log the losses of an uninterrupted one-process run (packed epoch sampler)."""
    import os
    import subprocess

    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.trainer import train
    from harness import run_gattn, torchrun_argv

    sets = ["data=corpus", f"data_dir={tiny_corpus}", 'domains=["code"]', "sampler=epoch", "pack_documents=true",
            "steps=6", "ckpt_every=3", "seq_len=160", "batch_size=8", "precision=fp32", "compile=false",
            "eval_batches=1", "stats_every=0", "seed=1"]
    train(apply_overrides(tiny(), sets), tmp_path / "straight")
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "resumed"), *sum((["--set", s] for s in sets), [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(torchrun_argv(*args, nproc=2, kill_hooks=True), capture_output=True, text=True, timeout=600,
                       env={**env, "GATTN_TEST_KILL_AT_STEP": "4"})
    assert p.returncode != 0 and (tmp_path / "resumed" / "checkpoints").exists(), p.stderr[-2000:]
    p = run_gattn(*args, "--resume", env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert _losses(tmp_path / "resumed") == pytest.approx(_losses(tmp_path / "straight"), abs=1e-5)


def test_packed_document_index_is_built_once_per_corpus_and_reused(tiny_corpus, tmp_path, monkeypatch):
    """pack_documents finds a corpus's documents once: the index is cached beside the corpus and later samplers read
    it (no scan) and draw the same batches; a changed token file, or a damaged index, is scanned again."""
    import shutil

    from gated_attention.data import Corpus
    from gated_attention.data import epoch as E

    data = tmp_path / "data"
    shutil.copytree(tiny_corpus, data, ignore=_NO_INDEX)
    scans = []
    real = E._doc_starts
    monkeypatch.setattr(E, "_doc_starts", lambda arr, eos: scans.append(len(arr)) or real(arr, eos))

    def batches():
        s = EpochSampler(Corpus(data), "train", 16, pack_documents=True)
        return torch.cat([s.batch(8, 0, step) for step in range(3)])

    first = batches()
    assert len(scans) == 2  # prose and code, once each
    index = sorted((data / "index").glob("docs-*.npy"))
    assert [p.name.split("-")[1] for p in index] == ["code", "prose"]
    assert torch.equal(batches(), first) and len(scans) == 2  # read back: nothing scanned
    assert torch.equal(EpochSampler(Corpus(data), "train", 16, pack_documents=False).batch(8, 0, 0),
                       EpochSampler(Corpus(data), "train", 16).batch(8, 0, 0)) and len(scans) == 2  # unpacked: none

    index[0].write_bytes(index[0].read_bytes()[:40])  # damaged (a crash cannot leave this: the write is atomic)
    assert torch.equal(batches(), first) and len(scans) == 3  # that stream scanned again, and rewritten
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / manifest["domains"]["prose"]["token_files"]["train"][0]["path"]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the corpus changed on disk
    assert torch.equal(batches(), first) and len(scans) == 4
    assert len(list((data / "index").glob("docs-prose-train-*.npy"))) == 1  # the stale index went


def test_a_corpus_folder_that_cannot_be_written_is_scanned_without_a_cache(tiny_corpus, tmp_path, monkeypatch):
    import shutil

    from gated_attention.data import Corpus
    from gated_attention.util import io

    data, ref_dir = tmp_path / "data", tmp_path / "ref"
    shutil.copytree(tiny_corpus, data, ignore=_NO_INDEX)
    shutil.copytree(tiny_corpus, ref_dir, ignore=_NO_INDEX)
    ref = EpochSampler(Corpus(ref_dir), "train", 16, pack_documents=True).batch(8, 0, 1)

    def denied(path, write):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(io, "atomic_write_with", denied)  # a read-only corpus folder (even for root)
    assert torch.equal(EpochSampler(Corpus(data), "train", 16, pack_documents=True).batch(8, 0, 1), ref)
    assert not list(data.glob("index/*.npy"))
