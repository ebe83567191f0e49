"""A training run folder damaged the ways a crash or a careless user leaves it — a piece missing, truncated or
foreign, a file where a folder belongs or a folder where a file belongs, a stray entry — is resumed from what is
intact or refused with one line and exit 2, never a traceback.

The oracle is an undamaged run: a resume that succeeds must end as that run did (every logged loss the same, step
for step: an exact resume from whichever checkpoint was intact, or a fresh start that draws the same numbers), and a
refusal must be exactly one `gattn train: error:` line naming the damaged piece (or a folder holding it). Every
(piece, damage) pair is tried, each foreign file in several variants (JSON of other shapes, other tensors, bytes).
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from gated_attention.cli import main
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train

SETS = ["steps=4", "ckpt_every=2", "keep_checkpoints=2", "eval_batches=1"]
DAMAGES = ("missing", "truncated", "foreign", "file_for_folder", "folder_for_file")
# stray entries a user or another tool may leave beside the run's own
STRAYS = ("checkpoints/step_00000099", "checkpoints/step_00000003.txt", "checkpoints/.old-step_00000004",
          "checkpoints/.tmp-step_00000006", "checkpoints/corrupt-step_00000004", "checkpoints/step_00000006")


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def finished(tmp_path_factory) -> tuple[Path, dict]:
    """A finished tiny run (checkpoints at steps 2 and 4, final/, summary.json, log.jsonl) and its losses by step."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    train(apply_overrides(tiny(), SETS), out)
    return out, _losses(out)


def _losses(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _pieces(run: Path) -> list[str]:
    """Every file and folder of the run folder (relative), the folder itself as ""."""
    return [""] + sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def foreign(p: Path, variant: int) -> bytes:
    """Another program's file in place of `p`: JSON of other shapes for a .json, other tensors for a .pt, else
    bytes that are not text — the same size as the file where it can be (so only the contents differ)."""
    size = max(1, p.stat().st_size)
    if p.suffix == ".json":
        texts = ['{"files": [1, 2], "state": 3, "config": []}', "[1, 2, 3]", '{"version": 99, "files": {"x": 1}}',
                 "null", '{"steps": "many"}']
        return texts[variant % len(texts)].encode()
    if p.suffix == ".pt":
        import io

        buf = io.BytesIO()
        torch.save([{"model": {"x": torch.ones(2)}, "torch": 1}, {"state": torch.zeros(3)}][variant % 2], buf)
        return buf.getvalue()
    return random.Random(variant).randbytes(size)


FOREIGN_VARIANTS = 5


def damage(run: Path, piece: str, kind: str, rng: random.Random, variant: int = 0) -> bool:
    """Apply `kind` to `piece` of `run` (or a stray entry at `piece`; `variant`: which foreign contents); False where
    it does not apply."""
    p = run / piece
    if kind == "stray":
        if p.exists():
            return False
        if rng.random() < 0.5:
            p.mkdir(parents=True)
            (p / "state.pt").write_bytes(rng.randbytes(64))
        else:
            p.write_bytes(rng.randbytes(64))
        return True
    if kind == "missing":
        _remove(p)
    elif kind == "truncated":
        if not p.is_file():
            return False
        data = p.read_bytes()
        p.write_bytes(data[:rng.randrange(len(data))] if data else b"")
    elif kind == "foreign":
        if p.is_dir():  # another folder's contents in its place
            _remove(p)
            p.mkdir()
            (p / "notes.txt").write_text("not a run's\n")
        else:
            p.write_bytes(foreign(p, variant))
    elif kind == "file_for_folder":
        if not p.is_dir():
            return False
        _remove(p)
        p.write_text("a file where a folder was\n")
    elif kind == "folder_for_file":
        if not p.is_file():
            return False
        _remove(p)
        p.mkdir()
    return True


def cases(run: Path, variants: range = range(1)) -> list[tuple[str, str, int]]:
    """(piece, damage, variant): every damage of every piece (a foreign file in each of `variants`; the default run
    tries the first, `pytest -m slow` the other FOREIGN_VARIANTS - 1) and every stray entry (with the first)."""
    out = []
    for piece in _pieces(run):
        for kind in DAMAGES:
            several = kind == "foreign" and (run / piece).is_file()
            out += [(piece, kind, v) for v in (variants if several else range(1)) if several or 0 in variants]
    return out + [(s, "stray", 0) for s in STRAYS if 0 in variants]


def gattn(argv: list[str]) -> int:
    """`gattn ARGV` in this process: its exit status (argparse's own errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def check_case(finished, tmp_path, capsys, piece: str, kind: str, seed: int, variant: int = 0) -> str:
    """Damage a copy of the finished run, resume it; returns "resumed", "refused" or "n/a"."""
    src, ref = finished
    run = tmp_path / f"case{seed}" / "run"
    shutil.copytree(src, run)
    rng = random.Random(seed)
    if not damage(run, piece, kind, rng, variant):
        return "n/a"
    capsys.readouterr()
    mode = ["--resume"] if seed % 2 else ["--resume", "auto"]
    code = gattn(["train", "--out", str(run), *mode])
    err = capsys.readouterr().err
    what = f"{kind} {piece or '(the run folder)'} {' '.join(mode)}: rc={code}\n{err[-3000:]}"
    assert "Traceback" not in err, what
    if code == 2:
        errors = [x for x in err.splitlines() if x.startswith("gattn train: error:")]
        assert len(errors) == 1, what
        named = {"run", *Path(piece).parts, *Path(piece).stem.split(".")}  # the piece, or a folder holding it
        assert any(n in errors[0] for n in named), f"the line does not name {piece!r}: {what}"
        return "refused"
    assert code == 0, what
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == ref[3], what
    got = _losses(run)  # the lines the log kept or logged anew (a damaged log loses its lines, never the run's)
    assert all(got[s] == ref[s] for s in got), f"{what}\nlogged {got}\nreference {ref}"
    return "resumed"




def test_a_damaged_newest_checkpoint_resumes_from_the_older_one(finished, tmp_path, capsys):
    for i, kind in enumerate(("missing", "truncated", "foreign", "folder_for_file")):
        piece = "checkpoints/step_00000004/state.pt"
        assert check_case(finished, tmp_path, capsys, piece, kind, 2 * i + 1) == "resumed", kind
    # nothing valid left: --resume refuses with its line, --resume auto starts over
    for seed, want in ((1, "refused"), (2, "resumed")):
        run = tmp_path / f"none{seed}" / "run"
        shutil.copytree(finished[0], run)
        for step in ("step_00000002", "step_00000004"):
            (run / "checkpoints" / step / "manifest.json").unlink()
        mode = ["--resume"] if seed % 2 else ["--resume", "auto"]
        code = gattn(["train", "--out", str(run), *mode])
        assert code == {"refused": 2, "resumed": 0}[want], capsys.readouterr().err
        if want == "resumed":
            assert _losses(run) == finished[1]


@pytest.mark.parametrize("variants", [range(1), pytest.param(range(1, FOREIGN_VARIANTS), marks=pytest.mark.slow)],
                         ids=["every-damage", "other-foreign-files"])
def test_every_damage_resumes_or_is_one_line(finished, tmp_path, capsys, variants):
    failures, outcomes = [], {}
    for i, (piece, kind, variant) in enumerate(cases(finished[0], variants)):
        try:
            outcomes[(piece, kind, variant)] = check_case(finished, tmp_path, capsys, piece, kind, i, variant)
        except AssertionError as exc:  # every case is tried: the report lists them all
            failures.append(str(exc)[:1500])
    assert not failures, f"{len(failures)} of {len(outcomes) + len(failures)} cases:\n\n" + "\n\n".join(failures)
    if variants == range(1):
        # the damage reached the run: some is survived (an older checkpoint resumes), some refused with its line
        assert {"resumed", "refused"} <= set(outcomes.values()), outcomes
        assert {k for _, k, _ in outcomes} == {*DAMAGES, "stray"}  # every damage and every stray entry was tried
    else:  # the other foreign files reached the run too: each case was applied (none "n/a")
        assert outcomes and "n/a" not in outcomes.values(), outcomes


# ------------------------------------------------------------------------------------------------ verification

def _checkpoint_of(tmp_path: Path, size: int) -> Path:
    """A checkpoint folder with a `size`-byte state.pt (random bytes) and its manifest."""
    from gated_attention.train import checkpoint as ckpt_mod

    ck = tmp_path / "step_00000001"
    ck.mkdir()
    (ck / "state.pt").write_bytes(random.Random(0).randbytes(size))
    (ck / "meta.json").write_text("{}")
    ckpt_mod.write_manifest(ck)
    return ck


def test_resume_verification_reads_sizes_and_sampled_pieces(tmp_path, monkeypatch):
    """verify() checks every size and, of a file of many pieces, the first, the last and SAMPLED drawn ones — not the
    whole file —; verify(full=True) every piece. Damage at either end is always caught; in the middle, by the full
    check (and by a sampled one only when a drawn piece covers it)."""
    from gated_attention.train import checkpoint as ckpt_mod

    pieces = 12
    ck = _checkpoint_of(tmp_path, pieces * ckpt_mod.PIECE + 5)  # 13 pieces: the last one 5 bytes
    read = []
    real = ckpt_mod._piece_hash
    monkeypatch.setattr(ckpt_mod, "_piece_hash", lambda fh, i, step: read.append((fh.name, i)) or real(fh, i, step))
    assert ckpt_mod.verify(ck) is None
    state = [i for name, i in read if name.endswith("state.pt")]
    assert len(state) == ckpt_mod.SAMPLED + 2 and {0, pieces} <= set(state)  # 6 of 13 pieces read
    read.clear()
    assert ckpt_mod.verify(ck, full=True) is None
    assert sorted(i for name, i in read if name.endswith("state.pt")) == list(range(pieces + 1))

    data = bytearray((ck / "state.pt").read_bytes())
    for where, piece in ((0, 0), (len(data) - 1, pieces), (5 * ckpt_mod.PIECE + 7, 5)):
        damaged = bytearray(data)
        damaged[where] ^= 0xFF  # one flipped byte, the size unchanged
        (ck / "state.pt").write_bytes(bytes(damaged))
        want = f"state.pt piece {piece} of {pieces + 1} does not match the manifest (corrupt)"
        assert ckpt_mod.verify(ck, full=True) == want
        if piece != 5:
            assert "does not match" in (ckpt_mod.verify(ck) or "")
    (ck / "state.pt").write_bytes(bytes(data[:-1]))
    assert "truncated" in ckpt_mod.verify(ck)


def test_a_version_1_manifest_still_verifies(tmp_path):
    """Checkpoints written before per-piece hashes (one SHA-256 per file) verify by that hash."""
    import hashlib

    from gated_attention.train import checkpoint as ckpt_mod

    ck = _checkpoint_of(tmp_path, 1000)
    files = {n: {"size": (ck / n).stat().st_size, "sha256": hashlib.sha256((ck / n).read_bytes()).hexdigest()}
             for n in ("state.pt", "meta.json")}
    (ck / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))
    assert ckpt_mod.verify(ck) is None
    (ck / "state.pt").write_bytes(b"x" * 1000)
    assert "checksum does not match" in ckpt_mod.verify(ck)
