"""precision="auto": the resolution rule with a faked CPU of each kind (bf16 fast / bf16 emulated), the forced-bf16
warning, the per-process cache, the cache-key separation of every job (trainer runs, train_or_reuse, the sink and
stability labs), and `resolved_precision` in what each job writes."""
from __future__ import annotations

import argparse

import json

import pytest
import torch

from gated_attention.util import precision as P
from gated_attention.train.config import TrainConfig
from gated_attention.train.train_presets import tiny
from gated_attention.train.resume_rule import changed_settings, describe_changes, run_precision

FAST, SLOW = "2.0", "0.02"  # fp32 time / bf16 time: an AMX/AVX512-BF16 CPU, and an AVX2-only one (emulated bf16)


@pytest.fixture
def cpu_kind(monkeypatch):
    """cpu_kind(FAST | SLOW | None): fake the measured bf16 speed-up (None: measure), with a fresh per-process cache."""
    def set_kind(value):
        monkeypatch.setattr(P, "_cache", {})
        monkeypatch.setattr(P, "_warned", set())
        if value is None:
            monkeypatch.delenv("GATTN_BF16_SPEEDUP", raising=False)
        else:
            monkeypatch.setenv("GATTN_BF16_SPEEDUP", value)
    return set_kind


def test_auto_resolves_by_the_measured_speed(cpu_kind):
    cpu_kind(FAST)
    assert P.resolve("auto", "cpu") == "bf16"
    cpu_kind(SLOW)
    assert P.resolve("auto", "cpu") == "fp32"
    cpu_kind("1.1")  # bf16 GEMM only marginally faster: the casts around it eat the gain
    assert P.resolve("auto", "cpu") == "fp32"
    for kind in (FAST, SLOW):  # a forced choice is kept on either kind of CPU
        cpu_kind(kind)
        assert P.resolve("fp32", "cpu") == "fp32" and P.resolve("bf16", "cpu") == "bf16"
    resolved, line = P.decide("auto", "cpu")
    assert resolved == "fp32" and line.startswith("precision auto -> fp32 (bf16 matmul 0.02x")
    with pytest.raises(ValueError, match="fp16.*not supported"):
        P.resolve("fp16", "cpu")
    with pytest.raises(ValueError, match="use one of auto, bf16, bf16-params, fp32"):
        P.resolve("half", "cpu")


def test_forced_bf16_on_a_slow_cpu_says_once_that_gemms_are_emulated(cpu_kind, capsys, monkeypatch):
    cpu_kind(SLOW)
    P.resolve("bf16", "cpu")
    P.resolve("bf16-params", "cpu")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "precision=bf16" in err[0] and "0.02x" in err[0] and "emulated" in err[0]
    cpu_kind(SLOW)
    monkeypatch.setenv("GATTN_BF16_GEMM", "native")  # emulation refused: the old warning with the cost
    P.resolve("bf16", "cpu")
    err = capsys.readouterr().err
    assert "warning: precision=bf16 is forced" in err and "50x slower" in err
    monkeypatch.delenv("GATTN_BF16_GEMM")
    cpu_kind(FAST)
    P.resolve("bf16", "cpu")
    P.resolve("auto", "cpu")
    assert capsys.readouterr().err == ""  # nothing to say where bf16 is fast, nor for auto


def test_gemm_mode_and_auto_with_the_dist_mode(cpu_kind, monkeypatch):
    cpu_kind(SLOW)
    assert P.gemm_mode("cpu") == "emulated"
    cpu_kind(FAST)
    assert P.gemm_mode("cpu") == "native"
    monkeypatch.setenv("GATTN_BF16_GEMM", "emulated")
    assert P.gemm_mode("cpu") == "emulated" and P.gemm_mode("cuda") == "native"
    monkeypatch.setenv("GATTN_BF16_GEMM", "fake")
    with pytest.raises(ValueError, match="GATTN_BF16_GEMM='fake'; use one of native, emulated"):
        P.gemm_mode("cpu")
    monkeypatch.delenv("GATTN_BF16_GEMM")
    # CUDA with bf16: FSDP runs train in bf16-params (the paper's numerics), others in autocast
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert P.resolve("auto", "cuda", "fsdp") == "bf16-params" and P.resolve("auto", "cuda", "ddp") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert P.resolve("auto", "cuda", "fsdp") == "fp32"
    cpu_kind(FAST)  # a CPU keeps autocast for auto whatever the dist mode; bf16-params only when asked for
    assert P.resolve("auto", "cpu", "fsdp") == "bf16" and P.resolve("bf16-params", "cpu") == "bf16-params"
    assert P.param_dtype("bf16-params") == torch.bfloat16 and P.param_dtype("bf16") == torch.float32


def test_numerics_context_of_each_precision(cpu_kind):
    a = torch.randn(8, 8)
    ab = a.to(torch.bfloat16)
    cpu_kind(SLOW)
    with P.numerics("bf16-params", "cpu"):  # no autocast: fp32 stays fp32; bf16 GEMMs are emulated
        assert (a @ a).dtype == torch.float32
        assert torch.equal(ab @ ab, (ab.float() @ ab.float()).to(torch.bfloat16))
    with P.numerics("bf16", "cpu"):  # autocast, emulated: the fp32 GEMM of the bf16-rounded inputs
        assert torch.equal(a @ a, (ab.float() @ ab.float()).to(torch.bfloat16))
    with P.numerics("fp32", "cpu"):
        assert torch.equal(ab @ ab, ab @ ab) and (a @ a).dtype == torch.float32


def test_every_parser_offers_the_one_set_of_choices():
    """One definition: every --precision of the CLI has exactly PRECISIONS as its choices."""
    from gated_attention.cli import COMMANDS, command_parser

    found = []

    def walk(parser):
        for action in parser._actions:
            if "--precision" in action.option_strings:
                found.append(tuple(action.choices))
            if isinstance(action.choices, dict):  # subcommands (gattn lab sinks / stability / ...)
                for sub in action.choices.values():
                    if isinstance(sub, argparse.ArgumentParser):  # (a choices dict of plain values is no subcommand)
                        walk(sub)

    for name in COMMANDS:
        walk(command_parser(name)[1])
    assert len(found) >= 5 and set(found) == {P.PRECISIONS}


def test_no_parser_types_out_the_precision_choices():
    """One definition of the choices: every `--precision` option of the package, the benches and the scripts comes
    from util.precision.add_argument (the benches' through bench/common.precision_arg), never a literal
    add_argument("--precision", choices=...) of its own."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bad = []
    for path in [*(repo / "src").rglob("*.py"), *(repo / "bench").glob("*.py"), *(repo / "scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "add_argument" and any(isinstance(a, ast.Constant) and a.value == "--precision"
                                                             for a in node.args):
                bad.append(f"{path.relative_to(repo)}:{node.lineno}")
    assert not bad, "use util.precision.add_argument:\n" + "\n".join(bad)
    import argparse

    parser = argparse.ArgumentParser()
    P.add_argument(parser, choices=("fp32", "auto", "bf16"))  # a subset, in the one order
    action = parser._actions[-1]
    assert action.choices == ("auto", "bf16", "fp32") and "bf16-params =" not in action.help
    with pytest.raises(ValueError, match="fp16"):
        P.add_argument(argparse.ArgumentParser(), choices=("fp16",))


def test_one_precision_decision_per_process(cpu_kind, monkeypatch, tiny_corpus, tmp_path):
    """A command decides the precision once, where its run is configured, and passes the resolved value down: a whole
    tiny `gattn compare` (its LM runs, their reuse checks, the sink lab's units and lab.json), a sink lab and a
    stability lab each resolve "auto" once, and the bf16 GEMM speed is measured at most once in the process
    (everything in-process: jobs=1); a rerun, which checks every stored run against its settings, decides once too."""
    from gated_attention.compare import job as C
    from gated_attention.labs.sinks import sink_lab
    from gated_attention.labs.stability import stability_lab

    cpu_kind(None)  # really measured (faked by the counter below), once per process
    measured, decided = [], []
    monkeypatch.setattr(P, "_measure_cpu_speedup", lambda: measured.append(1) or 2.0)
    real = P.resolve

    def counting(precision="auto", device=None, dist="none"):
        if precision not in P.RESOLVED:  # a decision; a resolved value passed down is only checked
            decided.append(precision)
        return real(precision, device, dist)

    monkeypatch.setattr(P, "resolve", counting)
    quiet = lambda m: None
    for _ in range(2):  # trains, then reuses everything
        res = C.run_compare(tmp_path / "cmp", tiny_corpus, "small", variants=["baseline", "sdpa_elementwise"],
                            sets=["steps=4", "ckpt_every=0", "stats_every=2"], log=quiet, jobs=1, streaming=False,
                            stability_lab=None, longctx=None,
                            sink_lab_changes={"seeds": 1, "steps": 4, "eval_every": 2, "ckpt_every": 0})
        assert res["resolved_precision"] == "bf16" and res["sink_lab"]["config"]["resolved_precision"] == "bf16"
        assert len(decided) == 1 and len(measured) == 1, (decided, measured)
        decided.clear()
    sink_lab.run_lab(sink_lab.budget_config("small", variants=["baseline"], seeds=1, steps=4, eval_every=2),
                     tmp_path / "sinks", log=quiet)
    assert len(decided) == 1
    decided.clear()
    lab = stability_lab.LabConfig(out=str(tmp_path / "stab"), budget="small", variants=("baseline",), qk_norm="on",
                                  lrs=(1e-3,), train={"steps": 3, "data_dir": str(tiny_corpus)})
    assert stability_lab.run_lab(lab, log=quiet)["config"]["resolved_precision"] == "bf16"
    assert len(decided) == 1 and len(measured) == 1


def test_measurement_runs_once_per_process_and_env_is_checked(cpu_kind, monkeypatch):
    cpu_kind(None)
    calls = []
    monkeypatch.setattr(P, "_measure_cpu_speedup", lambda: calls.append(1) or 0.05)
    assert P.resolve("auto", "cpu") == "fp32" and P.resolve("auto", "cpu") == "fp32"
    assert P.bf16_speedup("cpu") == 0.05 and len(calls) == 1
    cpu_kind("fast")
    with pytest.raises(ValueError, match="GATTN_BF16_SPEEDUP='fast' must be a number"):
        P.resolve("auto", "cpu")
    cpu_kind("0")
    with pytest.raises(ValueError, match="must be > 0"):
        P.resolve("auto", "cpu")


def test_the_measurement_is_best_fp32_over_best_bf16_on_one_thread(cpu_kind, monkeypatch):
    """What _measure_cpu_speedup computes, with the GEMM timer replaced by a scripted one (a test never asserts on a
    timing): fp32 and bf16 calls interleaved, the best of each compared, on one thread, the thread count restored;
    and the timer's bf16 call really runs the GEMM in bf16 (autocast), its fp32 call in fp32."""
    cpu_kind(None)
    real_timer, threads_before = P._time_gemm, torch.get_num_threads()
    times = {False: iter([9.0, 4.0, 6.0, 5.0] + [7.0] * 30), True: iter([3.0, 2.5, 1.0, 4.0] + [2.0] * 30)}
    calls = []

    def fake(a, b, bf16):
        calls.append((bf16, torch.get_num_threads()))
        return next(times[bf16])

    monkeypatch.setattr(P, "_time_gemm", fake)
    torch.set_num_threads(2)
    try:
        ratio = P._measure_cpu_speedup()
        assert torch.get_num_threads() == 2  # restored after the one-thread timing
    finally:
        torch.set_num_threads(threads_before)
    kinds = [bf16 for bf16, _ in calls]
    assert kinds[:2] == [False, True] and all(kinds[i] != kinds[i + 1] for i in range(len(kinds) - 1))  # interleaved
    assert {threads for _, threads in calls} == {1}
    assert ratio == pytest.approx(4.0 / 1.0)  # min(fp32) / min(bf16): > 1 when bf16 is faster
    a = torch.ones(8, 8)
    seen = []
    real_matmul = torch.Tensor.__matmul__

    def spy(x, y):
        out = real_matmul(x, y)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    real_timer(a, a, True), real_timer(a, a, False)
    assert seen == [torch.bfloat16, torch.float32]


def test_autocast_of_each_precision(cpu_kind):
    cpu_kind(FAST)
    a = torch.randn(4, 4)
    with P.numerics("bf16", "cpu"):
        assert (a @ a).dtype == torch.bfloat16
    with P.numerics("fp32", "cpu"):
        assert (a @ a).dtype == torch.float32
    with P.numerics("auto", "cpu"):
        assert (a @ a).dtype == torch.bfloat16
    cpu_kind(SLOW)
    with P.numerics("auto", "cpu"):
        assert (a @ a).dtype == torch.float32


def test_train_config_default_is_auto_and_precision_compares_by_resolution(cpu_kind):
    assert TrainConfig().precision == "auto" and tiny().precision == "auto"
    auto = tiny().to_dict()
    bf16_run = {**auto, "resolved_precision": "bf16"}  # an "auto" run that trained in bf16
    legacy_bf16 = {**auto, "precision": "bf16"}  # a run from before auto existed (no record)
    cpu_kind(FAST)
    assert run_precision(auto) == "bf16"
    assert changed_settings(bf16_run, auto) == [] and changed_settings(legacy_bf16, auto) == []
    cpu_kind(SLOW)  # the same folders on a CPU where auto means fp32: never reused as fp32 runs
    assert changed_settings(bf16_run, auto) == ["precision"] and changed_settings(legacy_bf16, auto) == ["precision"]
    assert "precision: saved 'auto' (bf16) vs requested 'auto' (fp32)" in describe_changes(bf16_run, auto)
    assert changed_settings(bf16_run, {**auto, "precision": "bf16"}) == []  # forcing bf16 continues it
    # train_config.json's record is not a setting: it round-trips through from_dict
    assert TrainConfig.from_dict(bf16_run).precision == "auto"


def _tiny_cfg(**kw):
    from dataclasses import replace

    return replace(tiny(), steps=3, ckpt_every=0, stats_every=0, eval_batches=1, compile="false", **kw).validate()


def test_trainer_records_and_refuses_another_resolution(cpu_kind, tmp_path, capsys):
    from gated_attention import experiment
    from gated_attention.util.errors import UserError

    cpu_kind(SLOW)
    run = tmp_path / "run"
    summary = experiment.train_or_reuse(_tiny_cfg(), run, log=lambda m: None)
    assert summary["resolved_precision"] == "fp32"
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["precision"] == "auto" and saved["resolved_precision"] == "fp32"
    meta = sorted((run / "checkpoints").glob("*/meta.json"))[-1]
    assert json.loads(meta.read_text())["resolved_precision"] == "fp32"
    assert "precision auto -> fp32" in capsys.readouterr().err  # logged at the start of the run
    assert experiment.train_or_reuse(_tiny_cfg(), run, log=lambda m: None)["resolved_precision"] == "fp32"  # reused
    cpu_kind(FAST)  # the same request on a bf16-fast machine is another run
    with pytest.raises(UserError, match=r"precision: saved 'auto' \(fp32\) vs requested 'auto' \(bf16\)"):
        experiment.train_or_reuse(_tiny_cfg(), run, log=lambda m: None)
    assert experiment.train_or_reuse(_tiny_cfg(precision="fp32"), run, log=lambda m: None)  # forcing fp32 reuses it


def test_sink_lab_units_are_keyed_on_the_resolved_precision(cpu_kind):
    from gated_attention.labs.sinks.sink_lab import SinkLabConfig, _unit_key

    cfg = SinkLabConfig()
    assert cfg.train.precision == "auto"
    cpu_kind(FAST)
    fast = _unit_key(cfg, "baseline", 0)
    assert fast["precision"] == "bf16" and _unit_key(cfg.changed(precision="bf16"), "baseline", 0) == fast
    cpu_kind(SLOW)
    slow = _unit_key(cfg, "baseline", 0)
    assert slow["precision"] == "fp32" and slow != fast


def test_stability_runs_carry_a_concrete_precision(cpu_kind):
    from gated_attention.labs.stability import stability_lab

    lab = stability_lab.LabConfig(budget="small").validate()
    cpu_kind(FAST)
    fast = stability_lab.train_config(lab, "data", "baseline", True, 1e-3, 0)
    cpu_kind(SLOW)
    slow = stability_lab.train_config(lab, "data", "baseline", True, 1e-3, 0)
    assert (fast.precision, slow.precision) == ("bf16", "fp32")  # the run's key (its TrainConfig dict) differs
    with pytest.raises(ValueError, match="fp16"):
        stability_lab.LabConfig(train={"precision": "fp16"}).validate()


def _worker_resolution(_):
    return P.bf16_speedup("cpu"), P.resolve("auto", "cpu")


def test_worker_processes_adopt_the_parents_measurement(cpu_kind, monkeypatch):
    """Every unit of one job resolves "auto" alike: spawned workers (experiment.run_units) take the parent's measured
    speed-up instead of timing a GEMM on whatever core they land on (a loaded core could flip the answer)."""
    from gated_attention import experiment

    cpu_kind(None)
    monkeypatch.setattr(P, "_cache", {"cpu": 0.37})  # as if this process had measured an emulated-bf16 CPU
    assert P.shared_measurement() == 0.37
    assert experiment.run_units(_worker_resolution, [0, 1], jobs=2) == [(0.37, "fp32")] * 2
    P.adopt_measurement(None)  # nothing measured in the parent: the worker keeps its own (measures if asked)
    assert P.shared_measurement() == 0.37
