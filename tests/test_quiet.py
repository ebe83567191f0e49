"""Dependencies' progress bars stay off inside the project's commands, in worker processes too (issue 27 item 9)."""
from __future__ import annotations

import os
import sys

from gated_attention.experiment.runs import run_units


def _save_and_load(path: str) -> bool:
    """A worker's unit: save and reload a tiny model (transformers draws a bar for each, unless switched off)."""
    from transformers.utils import logging as hf_logging

    from gated_attention import GatedQwen3ForCausalLM
    from harness import tiny_lm

    tiny_lm("sdpa_elementwise").save_pretrained(path)
    GatedQwen3ForCausalLM.from_pretrained(path)
    print("unit done", file=sys.stderr, flush=True)
    return hf_logging.is_progress_bar_enabled()


def test_spawned_workers_draw_no_dependency_bars(tmp_path, capfd):
    # two spawned workers (the pool of compare and the labs): fd-level capture sees the children's stderr too
    enabled = run_units(_save_and_load, [str(tmp_path / "a"), str(tmp_path / "b")], jobs=2, log=lambda m: None)
    err = capfd.readouterr().err
    assert err.count("unit done") == 2  # the capture does see the workers' output ...
    assert enabled == [False, False]
    assert "Writing model shards" not in err and "Loading weights" not in err and "it/s]" not in err  # ... but no bar


def test_cli_switches_them_off_for_itself_and_its_children(monkeypatch):
    from transformers.utils import logging as hf_logging

    from gated_attention import cli

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        assert cli.main(["gates"]) == 0
        assert not hf_logging.is_progress_bar_enabled()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # what spawned workers and torchrun ranks inherit
    finally:
        hf_logging.disable_progress_bar()


def test_a_users_explicit_setting_is_kept(monkeypatch):
    from gated_attention.util.quiet import quiet_dependencies

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    quiet_dependencies()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
