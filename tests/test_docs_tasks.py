"""docs/common_tasks.md does what it says: each task's command sequence runs, in page order, in one fresh folder, as
written with the small settings of `tiny()` appended to each command (fewer steps, shorter windows, a model shrunk to
seconds, one worker, two ranks for torchrun's eight), on a generated `my_text.txt` / `my_corpus/` and a tiny
checkpoint in stock Qwen3's layout made here by the project's own code (`Qwen3-0.6B/`; nothing comes from a hub).
Appending only adds settings that argparse's last-one-wins rule applies: the page's own words all run. A line that is
not a `gattn`, `torchrun` or `python` command fails the page (everything on it must be runnable). The whole page runs
in seconds (tiny models, two steps each), so it is in the default run."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _extras
from gated_attention.cli import main
from harness import build_lm, gattn_argv, torchrun_argv

pytestmark = pytest.mark.xdist_group("docs_tasks")  # the tasks share one folder, built in page order

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "common_tasks.md"

TRAIN = ["steps=2", "seq_len=32", "batch_size=4", "warmup_steps=1", "eval_every=0", "eval_batches=1",
         "eval_batch_size=2", "ckpt_every=0", "stats_every=0", "compile=false", "progress=false", "tensorboard=false"]
PAPER_SHAPE = ["model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
               "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16"]


def tasks(text: str) -> dict[str, list[str]]:
    """{task heading: its commands in order}: the one ```bash block under each `## ` heading, `\\` continuations
    joined, comments and blank lines dropped."""
    out = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        blocks = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
        assert len(blocks) == 1, f"docs/common_tasks.md: '{title}' needs exactly one ```bash block"
        lines = blocks[0].replace("\\\n", " ").splitlines()
        out[title] = [shlex.join(shlex.split(line, comments=True)) for line in lines if shlex.split(line, comments=True)]
    return out


def tiny(words: list[str]) -> list[str]:
    """What the test appends to `gattn WORDS` (or torchrun's `-m gated_attention.cli WORDS`)."""
    def sets(items):
        return [w for s in items for w in ("--set", s)]

    if words[:2] == ["data", "prepare"]:
        return ["--workers", "1", "--vocab-size", "300"]
    if words[0] == "train":
        return sets(TRAIN + (PAPER_SHAPE if any(w.startswith("paper-") for w in words) else []))
    if words[0] in ("eval", "analyze"):
        return ["--seq-len", "32", "--batches", "1"]
    return []


def run(command: str, cwd: Path) -> str | None:
    """Run one command of the page in `cwd`; None when it succeeded, else why not."""
    words = shlex.split(command)
    if words[0] == "gattn":
        old = os.getcwd()
        os.chdir(cwd)
        try:
            code = main(words[1:] + tiny(words[1:]))
        except SystemExit as exc:  # argparse's own exit
            code = exc.code
        finally:
            os.chdir(old)
        return None if code == 0 else f"`{command}` exited {code}"
    if words[0] == "torchrun":
        start = words.index("-m")
        assert words[start:start + 2] == gattn_argv()[1:], f"`{command}`: torchrun of another program"
        args = words[start + 2:]
        argv = torchrun_argv(*args, *tiny(args), nproc=2)
    elif words[0] == "python":
        argv = [sys.executable, *words[1:]]
    else:
        return f"`{command}`: not a gattn, torchrun or python command"
    p = subprocess.run(argv, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    return None if p.returncode == 0 else f"`{command}` exited {p.returncode}: {p.stderr[-2000:]}"


def _qwen3_checkpoint(dst: Path, tokenizer_dir: Path, scratch: Path) -> None:
    """A tiny ungated model with `tokenizer_dir`'s vocabulary, written in stock Qwen3's layout with its tokenizer."""
    from gated_attention.data.tokenizer import get_tokenizer
    from gated_attention.presets import model_config

    native = scratch / "native"
    build_lm(model_config("tiny", "none", vocab_size=len(get_tokenizer(tokenizer_dir)))).save_pretrained(native)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, native / f.name)
    assert main(["convert", str(native), str(dst), "--from", "native", "--to", "qwen3"]) == 0


@pytest.fixture(scope="module")
def workspace(tiny_corpus, tmp_path_factory):
    """The reader's folder: the page's inputs, and the tasks done so far (each task runs after the ones above it)."""
    root = tmp_path_factory.mktemp("common_tasks")
    prose = sorted((Path(tiny_corpus).parent / "data_src" / "prose").glob("*.txt"))
    (root / "my_text.txt").write_text("\n\n".join(p.read_text(encoding="utf-8") for p in prose), encoding="utf-8")
    shutil.copytree(Path(tiny_corpus).parent / "data_src", root / "my_corpus")
    _qwen3_checkpoint(root / "Qwen3-0.6B", Path(tiny_corpus) / "tokenizer", tmp_path_factory.mktemp("qwen3_native"))
    return {"root": root, "done": []}


def do_task(workspace, title: str) -> None:
    page = tasks(PAGE.read_text(encoding="utf-8"))
    for name, commands in page.items():
        if name in workspace["done"]:
            if name == title:
                return
            continue
        if any("llama_cpp" in c for c in commands):
            _extras.need("llama_cpp", "install the serve extra (pip install -e '.[serve]')")
        for command in commands:
            why = run(command, workspace["root"])
            assert why is None, f"docs/common_tasks.md, '{name}': {why}"
        workspace["done"].append(name)
        if name == title:
            return
    raise AssertionError(f"no task '{title}' on docs/common_tasks.md")


TASKS = list(tasks(PAGE.read_text(encoding="utf-8")))


def test_the_page_holds_the_common_tasks_and_the_readme_links_it():
    assert TASKS == ["Train a gated model on your own text", "Add a gate to a Qwen3 or Llama checkpoint",
                     "Analyse a model", "Export to llama.cpp", "Run the paper's preset on a node"], TASKS
    assert "](docs/common_tasks.md)" in (REPO / "README.md").read_text(encoding="utf-8")
    text = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"issue \d|SPEC|/work/|\.\./shared", text)


def test_the_runner_reports_a_failing_command(tmp_path):
    """Positive control: a command that fails, and a line the runner cannot run, are reported, not passed."""
    assert "exited 2" in run("gattn train --preset tiny --set no_such_setting=1 --out x", tmp_path)
    assert "not a gattn" in run("curl https://example.com", tmp_path)
    assert tiny(["train", "--preset", "paper-dense-28l"])[-1] == "model.head_dim=16"


def _steps(run: Path) -> int:
    return len((run / "log.jsonl").read_text(encoding="utf-8").splitlines())


def test_train_on_your_own_text(workspace):
    do_task(workspace, TASKS[0])
    root = workspace["root"]
    manifest = json.loads((root / "my_data" / "manifest.json").read_text())
    assert list(manifest["domains"]) == ["my_text"]  # `--sources` with no names: the built-in corpus stays out
    assert _steps(root / "runs" / "mine") == 2 and (root / "runs" / "mine" / "final" / "config.json").exists()


def test_prepare_says_when_it_mixes_the_built_in_sources_into_yours(capsys):
    from gated_attention.cli.data import sources_of
    from gated_attention.data import DEFAULT_SOURCES

    assert sources_of(argparse.Namespace(sources=None, extra=["my_text.txt"])) == DEFAULT_SOURCES
    assert "--sources with no names" in capsys.readouterr().err
    assert sources_of(argparse.Namespace(sources=[], extra=["my_text.txt"])) == ()
    assert sources_of(argparse.Namespace(sources=None, extra=[])) == DEFAULT_SOURCES
    assert capsys.readouterr().err == ""  # only a mix is said


def test_add_a_gate_to_a_checkpoint(workspace, capsys):
    do_task(workspace, TASKS[1])  # the task runs here: the module runs in file order and only task 0 is done before
    root = workspace["root"]
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote qwen3-gated"))
    assert "--tokenizer qwen3-gated" in hint and "--data-dir DATA" in hint  # retrofit's next step names the data
    assert json.loads((root / "Qwen3-0.6B" / "config.json").read_text())["model_type"] == "qwen3"
    saved = json.loads((root / "runs" / "qwen3-gated" / "train_config.json").read_text())
    assert (saved["gate"], saved["trainable"], saved["init_from"]) == ("sdpa_elementwise", "gates", "qwen3-gated")
    assert _steps(root / "runs" / "qwen3-gated") == 2


def test_analyse_a_model(workspace):
    do_task(workspace, TASKS[2])
    assert (workspace["root"] / "runs" / "mine_analysis" / "analysis.json").exists()
    assert (workspace["root"] / "qwen3-analysis" / "analysis.json").exists()


def test_export_to_llama_cpp(workspace):
    do_task(workspace, TASKS[3])
    assert (workspace["root"] / "mine.gguf").stat().st_size > 0


def test_run_the_papers_preset_on_a_node(workspace):
    """Two torchrun ranks of the paper preset as it is (FSDP2, bf16-params, activation checkpointing, micro-batch 1)
    on its shape shrunk to seconds."""
    do_task(workspace, TASKS[4])
    run = workspace["root"] / "runs" / "p28"
    saved = json.loads((run / "train_config.json").read_text())
    assert (saved["gate"], saved["dist"], saved["grad_accum"]) == ("sdpa_elementwise", "fsdp", 2)
    assert _steps(run) == 2
