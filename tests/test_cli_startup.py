"""The newcomer's CLI: every parser is built without torch or transformers (what makes `gattn --help`, any `--help`
and a mistyped name answer at once; bench/bench_cli.py times it), "did you mean" for a mistyped command, preset or
lab, `--version`, `gattn settings` (every TrainConfig field, its default, and the `--set` vocabulary) and `gattn
train --dry-run` (the plan, nothing written)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gated_attention import cli
from gated_attention.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")

# In a fresh interpreter: build the top-level parser and every command's (the labs' included), run `--help` through
# main for each, then report which heavy libraries were imported. The positive control at the end imports the model
# and must see torch, so a check that could not see an import fails.
_PROBE = """
import contextlib, io, json, sys
from gated_attention import cli
cli.build_parser()
helps = [[name, "--help"] for name in cli.COMMANDS] + [["lab", "scaling", "--help"], ["data", "prepare", "--help"]]
for argv in helps:
    for name in cli.COMMANDS:
        cli.command_parser(name)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
assert cli.main(["trian"]) == 2
before = sorted(m for m in %r if m in sys.modules)
import gated_attention.modeling
after = sorted(m for m in %r if m in sys.modules)
print(json.dumps({"before": before, "after": after}))
""" % (HEAVY, HEAVY)


def test_every_parser_and_help_imports_no_torch_or_transformers():
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["before"] == [], f"building the parsers imported {seen['before']}"
    assert seen["after"] == sorted(HEAVY)  # positive control: the check sees them once the model is imported


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_a_mistyped_command_gets_the_closest_one(capsys):
    assert cli.main(["trian"]) == 2
    assert "did you mean `train`?" in _one_error_line(capsys)
    assert cli.main(["--verison"]) == 2
    assert "did you mean `--version`?" in _one_error_line(capsys)
    assert cli.main(["qwertyuiop"]) == 2  # nothing close: the valid commands instead
    line = _one_error_line(capsys)
    assert "did you mean" not in line and all(name in line for name in cli.COMMANDS)


@pytest.mark.parametrize("argv, suggestion", [
    (["train", "--preset", "smal", "--out", "unused"], "`small`"),  # a training preset
    (["plan", "--preset", "paper-dense-28"], "`paper-dense-28l`"),
    (["lab", "scalng"], "`scaling`"),  # a lab (a subcommand of a group)
])
def test_a_mistyped_choice_gets_the_closest_one(capsys, argv, suggestion):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    line = _one_error_line(capsys)
    assert f"did you mean {suggestion}?" in line, line


def test_version_is_the_packages(capsys):
    assert cli.main(["--version"]) == 0
    declared = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert capsys.readouterr().out.strip() == f"gattn {declared}"


def _defaults() -> dict:
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(TrainConfig)}


def test_settings_lists_every_trainconfig_field_with_its_default(capsys):
    assert cli.main(["settings", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert {r["name"]: r["default"] for r in rows} == _defaults()
    assert all(r["meaning"].strip() for r in rows), [r["name"] for r in rows if not r["meaning"].strip()]
    by_name = {r["name"]: r for r in rows}
    assert by_name["schedule"]["choices"] == ["cosine", "wsd"] and by_name["fast"]["choices"] == ["true", "false"]
    assert by_name["seq_len"]["meaning"].startswith("tokens per sequence")  # the comment beside the field
    # the continuation lines of a comment belong to its field, a `# ---` header opens the next group
    assert "every:N" in by_name["activation_checkpointing"]["meaning"]
    assert by_name["lr"]["group"].startswith("optimizer") and not by_name["steps"]["meaning"].count("AdamW")

    assert cli.main(["settings"]) == 0
    text = capsys.readouterr().out
    from gated_attention.train.settings import show

    for name, default in _defaults().items():
        assert f"  {name} = {show(default) or '(empty)'}   (" in text, name


def test_settings_speak_the_set_vocabulary():
    """Every name `gattn settings` prints is a `--set` key, and the default it prints is a value `--set` takes
    back unchanged."""
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.settings import settings, show

    base = TrainConfig().validate()
    for s in settings():
        if s.name == "model_overrides":  # set field by field with --set model.KEY=VALUE
            continue
        cfg = apply_overrides(TrainConfig(), [f"{s.name}={show(s.default)}"])
        assert getattr(cfg, s.name) == getattr(base, s.name), s.name
    with pytest.raises(ValueError, match="did you mean `min_lr`"):
        apply_overrides(TrainConfig(), ["min_lrr=1e-4"])


def test_train_dry_run_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GATTN_BF16_SPEEDUP", "0.5")  # no GEMM timing: auto resolves to fp32 here
    out = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--set", "steps=7", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written, not even the run folder
    assert "* steps = 7" in text and " seq_len = " in text  # the resolved settings, the changed ones marked
    assert "gattn plan: tiny" in text and "memory / GPU (GB)" in text and "tokens/s" in text  # the plan's table
    assert "this machine (cpu, fp32): fits" in text


def test_importing_the_model_registers_the_auto_classes():
    """The package's names load on first use; the README's first line, `from gated_attention import
    GatedQwen3ForCausalLM`, still registers model_type gated_qwen3 with the Auto classes (in a fresh interpreter,
    where nothing else imported the model)."""
    code = ("import torch\nfrom gated_attention import GatedQwen3ForCausalLM\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            "with torch.device('meta'):\n"
            "    model = AutoModelForCausalLM.from_config(AutoConfig.for_model('gated_qwen3', num_hidden_layers=1))\n"
            "print(type(model) is GatedQwen3ForCausalLM)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]
