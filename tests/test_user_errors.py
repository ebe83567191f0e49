"""Bad input is one line and exit 2, never a traceback (util/errors.py): a fuzz of model/data mismatches over every
command a model or a corpus goes into, and the run-folder rules around it — `gattn train` into a folder of other
files, a run that fails before its first checkpoint, the lock files a command leaves, the many-epochs warning.

Everything runs in-process (`cli.main`) on tiny models saved in a tmp folder and the session's tiny corpus, except
the first report's reproduction, which checks a real process's stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gated_attention.cli import main
from harness import run_gattn, tiny_lm

pytestmark = pytest.mark.xdist_group("user_errors")  # the module's kit (models, corpus copies) is built once
TINY = ["--preset", "tiny", "--set", "steps=2", "--set", "eval_batches=1", "--set", "precision=fp32"]


def only_line(capsys, cmd: str, *needles: str) -> str:
    """stderr is exactly one line, `gattn CMD: error: ...`, holding every needle; stdout has no traceback either."""
    cap = capsys.readouterr()
    lines = [l for l in cap.err.splitlines() if l.strip()]
    assert "Traceback" not in cap.err + cap.out, cap.err
    assert len(lines) == 1 and lines[0].startswith(f"gattn {cmd}: error: "), cap.err
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]
    return lines[0]


def call(argv) -> int:
    """main(argv) as the `gattn` process ends: argparse's exit is its status."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_corpus) -> dict[str, Path]:
    """Model folders and corpora, each wrong in one way: `good` is an ungated tiny model in the corpus's 300-token
    vocabulary with its tokenizer; `small_vocab` the tiny preset's 128-token model (what `gattn train --preset tiny`
    makes); `small_vocab_tok` that model beside the corpus's tokenizer; `no_config` / `no_weights` a good model with
    config.json / model.safetensors gone; `run_only` a failed run's folder (train_config.json, no model);
    `data_no_tok` the corpus without its tokenizer; `data_empty` an empty folder."""
    from gated_attention.data import get_tokenizer

    root = tmp_path_factory.mktemp("kit")
    tok = get_tokenizer(tiny_corpus)
    k = {"corpus": Path(tiny_corpus)}
    tiny_lm("baseline", vocab_size=300).save_pretrained(root / "good")
    tok.save_pretrained(root / "good")
    tiny_lm("baseline").save_pretrained(root / "small_vocab")
    shutil.copytree(root / "small_vocab", root / "small_vocab_tok")
    tok.save_pretrained(root / "small_vocab_tok")
    for name, drop in (("no_config", "config.json"), ("no_weights", "model.safetensors")):
        shutil.copytree(root / "good", root / name)
        (root / name / drop).unlink()
    (root / "run_only").mkdir()
    (root / "run_only" / "train_config.json").write_text("{}")
    shutil.copytree(tiny_corpus, root / "data_no_tok")
    shutil.rmtree(root / "data_no_tok" / "tokenizer")
    (root / "data_empty").mkdir()
    (root / "text.txt").write_text("the of and to in is was that he it with as his on be at by " * 40)
    k.update({n: root / n for n in ("good", "small_vocab", "small_vocab_tok", "no_config", "no_weights", "run_only",
                                    "data_no_tok", "data_empty")})
    k["text"] = root / "text.txt"
    return k


# (case id, argv builder over (kit, out), words the one line must hold): every command that reads a model or a corpus
CASES = [
    # gattn eval
    ("eval-no-config", lambda k, o: ["eval", k["no_config"]], ["config.json"]),
    ("eval-no-weights", lambda k, o: ["eval", k["no_weights"]], ["model.safetensors"]),
    ("eval-run-without-model", lambda k, o: ["eval", k["run_only"]], ["no model"]),
    ("eval-vocab", lambda k, o: ["eval", k["small_vocab"], "--data-dir", k["corpus"]], ["300", "128", "tokenizer"]),
    ("eval-data-no-tokenizer", lambda k, o: ["eval", k["good"], "--data-dir", k["data_no_tok"]], ["tokenizer"]),
    ("eval-data-empty", lambda k, o: ["eval", k["good"], "--data-dir", k["data_empty"]], ["manifest.json"]),
    # gattn analyze
    ("analyze-no-config", lambda k, o: ["analyze", k["no_config"], "--text", k["text"], "--out", o], ["config.json"]),
    ("analyze-no-weights", lambda k, o: ["analyze", k["no_weights"], "--text", k["text"], "--out", o],
     ["model.safetensors"]),
    ("analyze-vocab-corpus", lambda k, o: ["analyze", k["small_vocab"], "--domain", "prose", "--data-dir",
                                           k["corpus"], "--seq-len", "32", "--out", o], ["300", "128", "tokenizer"]),
    ("analyze-vocab-tokenizer", lambda k, o: ["analyze", k["small_vocab_tok"], "--text", k["text"], "--seq-len", "32",
                                              "--out", o], ["300", "128", "tokenizer"]),
    ("analyze-no-tokenizer", lambda k, o: ["analyze", k["small_vocab"], "--text", k["text"], "--out", o],
     ["tokenizer", "--data-dir"]),
    ("analyze-data-no-tokenizer", lambda k, o: ["analyze", k["small_vocab"], "--text", k["text"], "--data-dir",
                                                k["data_no_tok"], "--out", o], ["tokenizer"]),
    ("analyze-data-empty", lambda k, o: ["analyze", k["good"], "--domain", "prose", "--data-dir", k["data_empty"],
                                         "--out", o], ["manifest.json"]),
    # gattn convert / export / retrofit / extend
    ("convert-no-config", lambda k, o: ["convert", k["no_config"], o, "--from", "native"], ["config.json"]),
    ("convert-no-weights", lambda k, o: ["convert", k["no_weights"], o, "--from", "native"], ["model.safetensors"]),
    ("export-not-a-model", lambda k, o: ["export", "--to", "gguf", k["data_empty"], f"{o}.gguf"],
     ["no config.json", "checkpoint"]),
    ("export-run-folder", lambda k, o: ["export", "--to", "gguf", k["run_only"], f"{o}.gguf"], ["no config.json"]),
    ("export-no-weights", lambda k, o: ["export", "--to", "gguf", k["no_weights"], f"{o}.gguf"],
     ["model.safetensors"]),
    ("export-no-tokenizer", lambda k, o: ["export", "--to", "gguf", k["small_vocab"], f"{o}.gguf"],
     ["tokenizer.json", "--tokenizer"]),
    ("export-vocab", lambda k, o: ["export", "--to", "gguf", k["small_vocab"], f"{o}.gguf", "--tokenizer",
                                   k["corpus"]], ["300", "128"]),
    ("retrofit-no-config", lambda k, o: ["retrofit", k["no_config"], "--gate", "sdpa_elementwise", "--init",
                                         "identity", "--out", o], ["config.json"]),
    ("retrofit-no-weights", lambda k, o: ["retrofit", k["no_weights"], "--gate", "sdpa_elementwise", "--init",
                                          "identity", "--out", o], ["model.safetensors"]),
    ("extend-no-config", lambda k, o: ["extend", k["no_config"], "--out", o], ["config.json"]),
    ("extend-no-weights", lambda k, o: ["extend", k["no_weights"], "--out", o], ["model.safetensors"]),
    ("extend-finetune-vocab", lambda k, o: ["extend", k["small_vocab"], "--out", o, "--finetune-steps", "1",
                                            "--seq-len", "32", "--data-dir", k["corpus"]], ["300", "128"]),
    # gattn ruler
    ("ruler-no-config", lambda k, o: ["ruler", k["no_config"], "--lengths", "64", "--out", o], ["config.json"]),
    ("ruler-no-weights", lambda k, o: ["ruler", k["no_weights"], "--lengths", "64", "--out", o],
     ["model.safetensors"]),
    ("ruler-no-tokenizer", lambda k, o: ["ruler", k["small_vocab"], "--lengths", "64", "--out", o], ["tokenizer"]),
    ("ruler-vocab", lambda k, o: ["ruler", k["small_vocab_tok"], "--lengths", "64", "--samples", "1", "--out", o],
     ["300", "128"]),
    # gattn train: a model to start from, a corpus
    ("train-init-no-config", lambda k, o: ["train", *TINY, "--set", f"init_from={k['no_config']}", "--out", o],
     ["config.json"]),
    ("train-init-no-weights", lambda k, o: ["train", *TINY, "--set", f"init_from={k['no_weights']}", "--out", o],
     ["model.safetensors"]),
    ("train-init-vocab", lambda k, o: ["train", *TINY, "--set", f"init_from={k['small_vocab']}", "--data-dir",
                                       k["corpus"], "--out", o], ["300", "128"]),
    ("train-data-no-tokenizer", lambda k, o: ["train", *TINY, "--data-dir", k["data_no_tok"], "--out", o],
     ["tokenizer"]),
    ("train-data-empty", lambda k, o: ["train", *TINY, "--data-dir", k["data_empty"], "--out", o], ["manifest.json"]),
    # gattn lm-eval (a local model folder is checked before lm-eval runs)
    ("lm-eval-no-config", lambda k, o: ["lm-eval", "run", "--model", "hf", "--model_args",
                                        f"pretrained={k['no_config']},dtype=float32", "--tasks", "x"],
     ["config.json"]),
    ("lm-eval-no-weights", lambda k, o: ["lm-eval", "run", "--model", "hf", f"--model_args=pretrained={k['no_weights']}",
                                         "--tasks", "x"], ["model.safetensors"]),
    # gattn data info
    ("data-info-empty", lambda k, o: ["data", "info", "--data-dir", k["data_empty"]], ["manifest.json"]),
    # the labs that measure given models
    ("lab-quant-no-config", lambda k, o: ["lab", "quant", "--models", k["no_config"], "--out", o], ["config.json"]),
    ("lab-quant-vocab", lambda k, o: ["lab", "quant", "--models", k["small_vocab"], "--data-dir", k["corpus"],
                                      "--out", o], ["300", "128"]),
    ("lab-streaming-no-weights", lambda k, o: ["lab", "streaming", "--models", k["no_weights"], "--window", "8",
                                               "--out", o], ["model.safetensors"]),
    ("lab-streaming-vocab", lambda k, o: ["lab", "streaming", "--models", k["small_vocab"], "--window", "8",
                                          "--data-dir", k["corpus"], "--out", o], ["300", "128"]),
    ("lab-retrofit-no-config", lambda k, o: ["lab", "retrofit", "--from", k["no_config"], "--steps", "1",
                                             "--out", o], ["config.json"]),
    ("lab-retrofit-vocab", lambda k, o: ["lab", "retrofit", "--from", k["small_vocab"], "--data-dir", k["corpus"],
                                         "--steps", "1", "--lr", "1e-3", "--out", o], ["300", "128"]),
]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_mismatch_is_one_line_and_exit_2(kit, tmp_path, capsys, case):
    _, argv, needles = next(c for c in CASES if c[0] == case)
    out = tmp_path / "out"
    assert call(argv(kit, out)) == 2
    only_line(capsys, argv(kit, out)[0], *needles)


@pytest.mark.slow  # a real process (~11 s); the fuzz above checks the same line in-process
def test_the_reported_vocab_mismatch_in_a_real_process(kit, tmp_path):
    """The first report: a tiny-preset model analysed on a prepared corpus ended in a 55-line IndexError."""
    p = run_gattn("analyze", kit["small_vocab"], "--domain", "prose", "--data-dir", kit["corpus"], "--seq-len", "32",
                  "--out", tmp_path / "a", timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "300-token vocabulary" in lines[0] and "128 embedding rows" in lines[0], p.stderr


# ------------------------------------------------------------------------------------------------ gattn train --out

def test_train_refuses_a_folder_of_other_files_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "log.jsonl").write_text("mine too\n")
    assert call(["train", *TINY, "--out", out]) == 2
    only_line(capsys, "train", "not a training run folder", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl", "notes.txt"]  # nothing written into it
    assert call(["train", *TINY, "--resume", "auto", "--out", out]) == 2  # auto would start a new run there too
    only_line(capsys, "train", "--overwrite")
    assert call(["train", *TINY, "--overwrite", "--out", out]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "final" / "config.json").exists()
    assert (out / "log.jsonl").read_text() != "mine too\n"  # the run's file of that name replaced it
    # a run folder resumes (and restarts) as before, without --overwrite
    assert call(["train", *TINY, "--resume", "--out", out]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert call(["train", *TINY, "--out", empty]) == 0  # an empty folder is a new run's


def test_a_run_failing_before_its_first_checkpoint_removes_only_what_it_created(kit, tmp_path, capsys):
    bad = ["--data-dir", kit["data_empty"]]  # fails while setting up, after the folder is checked and settings written
    made = tmp_path / "new" / "run"
    assert call(["train", *TINY, *bad, "--out", made]) == 2
    only_line(capsys, "train", "manifest.json", f"{made}, which this run created, was removed")
    assert not made.exists()
    kept = tmp_path / "kept"
    kept.mkdir()  # existed before the run (empty): kept, saying what it holds and how to go on
    assert call(["train", *TINY, *bad, "--out", kept]) == 2
    only_line(capsys, "train", "no checkpoint was written", "starts over")
    assert [p.name for p in kept.iterdir()] == ["train_config.json"]
    assert call(["train", *TINY, "--out", kept]) == 0  # ... and rerunning (the good corpus) starts over there
    capsys.readouterr()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.csv").write_text("1,2\n")
    assert call(["train", *TINY, *bad, "--overwrite", "--out", theirs]) == 2
    only_line(capsys, "train", "no checkpoint was written")
    assert (theirs / "data.csv").read_text() == "1,2\n"  # never the user's files


def test_a_failure_after_a_checkpoint_leaves_the_run_to_resume(tmp_path, capsys, monkeypatch):
    from gated_attention.train import trainer

    real = trainer._train_step

    def fail_at_3(run, step):
        if step == 3:
            raise ValueError("step 3 went wrong; fix it")
        return real(run, step)

    monkeypatch.setattr(trainer, "_train_step", fail_at_3)
    out = tmp_path / "r"
    assert call(["train", *TINY, "--set", "steps=6", "--set", "ckpt_every=1", "--out", out]) == 2
    err = capsys.readouterr().err  # the started run's own lines (precision, speed plan), then its error
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("gattn train: error: step 3 went wrong") and err.count("error:") == 1, err
    assert "removed" not in line and "no checkpoint" not in line
    assert [p.name for p in (out / "checkpoints").iterdir()] and (out / "train_config.json").exists()
    monkeypatch.setattr(trainer, "_train_step", real)
    assert call(["train", *TINY, "--set", "steps=6", "--set", "ckpt_every=1", "--resume", "--out", out]) == 0


# ------------------------------------------------------------------------------------------------ lock files

def test_no_lock_file_is_left_after_a_run_or_an_error(tmp_path, capsys):
    from gated_attention.util.io import lock_path_for

    out = tmp_path / "run"
    assert call(["train", *TINY, "--out", out]) == 0
    assert call(["train", *TINY, "--out", out]) == 2  # refused (it holds checkpoints): an error while locked
    capsys.readouterr()
    assert not lock_path_for(out).exists() and sorted(os.listdir(tmp_path)) == ["run"]


def test_lock_taken_on_a_file_its_holder_unlinked_is_taken_again(tmp_path, monkeypatch):
    """The race removing lock files opens: a process opens the lock file, its holder unlinks it and releases, the
    process then wins the flock of a file no one else can see. lock_dir must notice and lock the linked file, so a
    second process is still excluded."""
    import fcntl

    from gated_attention.util.io import lock_dir, lock_path_for

    out = tmp_path / "o"
    lp = lock_path_for(out)
    real, raced = fcntl.flock, []

    def flock_after_release(fd, op):
        if op & fcntl.LOCK_EX and not raced:  # the holder's release lands between our open and our flock
            raced.append(True)
            os.unlink(lp)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_release)
    with lock_dir(out, "gattn test"):
        assert raced and lp.exists()
        code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
        assert subprocess.run([sys.executable, "-c", code, str(lp)]).returncode == 3  # held: excluded
    assert not lp.exists()


# ------------------------------------------------------------------------------------------------ many epochs

def test_a_budget_of_many_epochs_warns_once(tiny_corpus, tmp_path, capsys):
    from gated_attention.data import Corpus

    c = Corpus(tiny_corpus)
    have = sum(c.num_tokens(d, "train") for d in c.domains)
    per_step = 64 * 128  # --set batch_size=64, seq_len=128
    sets = ["--set", "batch_size=64", "--set", "seq_len=128", "--set", "eval_batches=1", "--set", "precision=fp32",
            "--set", "ckpt_every=0", "--set", "eval_every=0", "--set", "stats_every=0", "--data-dir", tiny_corpus]
    many = 5 * have // per_step + 1  # just over 5 epochs
    few = 4 * have // per_step  # at most 4: no warning
    assert call(["train", "--preset", "tiny", *sets, "--set", f"steps={many}", "--out", tmp_path / "many"]) == 0
    warned = [l for l in capsys.readouterr().err.splitlines() if "epochs" in l]
    assert len(warned) == 1 and warned[0].startswith("gattn train: warning: "), warned
    assert f"{many * per_step / have:.1f} epochs" in warned[0] and f"{have:,}" in warned[0]
    assert "--data-dir" in warned[0]
    assert call(["train", "--preset", "tiny", *sets, "--set", f"steps={few}", "--out", tmp_path / "few"]) == 0
    assert "epochs" not in capsys.readouterr().err


def test_a_paper_presets_budget_on_a_small_corpus_warns(tiny_corpus):
    """The warning follows the preset's own budget (the paper's ~400B tokens here), not only --set steps=."""
    from types import SimpleNamespace

    from gated_attention.data import Corpus
    from gated_attention.train.data_source import epochs_note
    from gated_attention.train.train_presets import train_preset

    corpus = Corpus(tiny_corpus)
    source = SimpleNamespace(corpus=corpus, train_domains=None)
    have = sum(corpus.num_tokens(d, "train") for d in corpus.domains)
    note = epochs_note(train_preset("paper-dense-28l"), source)
    assert note and f"{95_367 * 1024 * 4096:,} training tokens" in note and f"{have:,}" in note
    tiny = train_preset("tiny")  # 40 steps of 8 x 32 tokens: a few epochs of the tiny corpus at most
    assert (epochs_note(tiny, source) is None) == (tiny.steps * tiny.batch_size * tiny.seq_len <= 4 * have)
