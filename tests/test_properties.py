"""Property-based tests (hypothesis): the gate/config space and every subcommand's arguments.

1. Gate specs: every point of the six-axis GateSpec space either builds a model that runs, decodes with the KV cache
   exactly as without it, and round-trips through save_pretrained/from_pretrained — or is refused with a clean
   ValueError (never another exception). Model shapes (heads, KV heads, head_dim, widths) are drawn the same way.
2. Training settings: random `--set key=value` strings (bad values mixed with valid ones) are refused with one
   ValueError line naming the key, or applied exactly: every value given (the last per key) and the preset's
   everywhere else — not merely "valid", which apply_overrides checks itself.
3. Command lines: random mutations of a valid command line per subcommand (bad numbers, NaN/inf, negatives, empty
   strings, missing/swapped paths, files where folders go and the reverse, dropped/duplicated/unknown flags) end in
   exit status 0, 1 (a diverged run) or 2 with one error line — never a traceback. Run in-process via
   `gated_attention.cli.main(argv)`. The distinct bad command lines tried and the tracebacks seen are printed at the
   end (`pytest -s tests/test_properties.py`); GATTN_FUZZ_SCALE=N multiplies the example counts.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from _extras import need  # noqa: E402

hypothesis = need("hypothesis", "pip install -e '.[dev]' (property-based tests)")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gated_attention import gates as G  # noqa: E402
from gated_attention.cli import COMMANDS, main  # noqa: E402

SCALE = float(os.environ.get("GATTN_FUZZ_SCALE", "1"))


def n(k: int) -> int:
    return max(1, int(k * SCALE))


# ------------------------------------------------------------------------------------------------ 1. gate space

@contextlib.contextmanager
def registered(spec):
    """Register `spec` under a temporary gate name (the model reads gates by name from the registry)."""
    name = "hyp_gate"
    G.GATES[name] = spec
    try:
        yield name
    finally:
        G.GATES.pop(name, None)


AXIS = st.fixed_dictionaries({
    "position": st.sampled_from(list(G.Position)), "granularity": st.sampled_from(list(G.Granularity)),
    "sharing": st.sampled_from(list(G.Sharing)), "combine": st.sampled_from(list(G.Combine)),
    "activation": st.sampled_from(list(G.Activation)), "source": st.sampled_from(list(G.Source)),
})
SHAPE = st.fixed_dictionaries({
    "num_attention_heads": st.integers(0, 4), "num_key_value_heads": st.integers(0, 4),
    "head_dim": st.sampled_from([0, 2, 4, 8]), "hidden_size": st.sampled_from([0, 8, 16]),
    "num_hidden_layers": st.integers(0, 2), "use_qk_norm": st.booleans(), "attention_bias": st.booleans(),
    "tie_word_embeddings": st.booleans(), "gate_init": st.sampled_from(["normal", "identity", "bogus"]),
})


@settings(max_examples=n(30), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(axes=AXIS, shape=SHAPE, seed=st.integers(0, 2**16))
def test_gate_and_config_space(axes, shape, seed):
    from gated_attention.configuration import GatedQwen3Config
    from gated_attention.modeling import GatedQwen3ForCausalLM

    from harness import build_lm

    try:
        spec = G.GateSpec(**axes)
    except ValueError as exc:
        assert str(exc).startswith("invalid gate spec")
        return
    with registered(spec) as name:
        try:
            cfg = GatedQwen3Config(vocab_size=64, intermediate_size=16, max_position_embeddings=64, gate=name, **shape)
        except ValueError:
            return  # refused cleanly: zero sizes, KV heads that do not divide, an init the gate cannot have
        model = build_lm(cfg, seed=seed)
        prompt = torch.randint(1, 64, (1, 4))  # never the pad id 0: generate() would mask it and differ from forward
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=3, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            full = model(out.sequences).logits  # (1, T, V) without a cache
        assert torch.isfinite(full).all()
        for i, step in enumerate(out.logits):  # cached decoding == uncached forward
            torch.testing.assert_close(step[0], full[0, prompt.shape[1] - 1 + i], atol=1e-5, rtol=1e-5)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            back = GatedQwen3ForCausalLM.from_pretrained(d).eval()
            with torch.no_grad():
                torch.testing.assert_close(back(out.sequences).logits, full, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ 2. --set space

SET_KEYS = ["lr", "min_lr", "steps", "seq_len", "batch_size", "grad_accum", "warmup_steps", "beta1", "beta2", "eps",
            "grad_clip", "weight_decay", "schedule", "precision", "retrieval_tasks", "domains", "retrieval_mix",
            "model.num_key_value_heads", "model.head_dim", "model.rope_theta", "model.hidden_size", "bogus",
            "model.bogus", "wsd_decay_frac", "keep_checkpoints", "seed", "model_overrides"]
BAD_VALUES = ["nan", "inf", "-inf", "-1", "0", "-0.5", "1e999", "abc", "", "[1,", "{}", "[]", "true", "none", "1.5",
              "3", "1e-3", "0.999", "[1, -2]", "null", "\x00", "１"]


GOOD = [("lr", "1e-3"), ("lr", "0.02"), ("min_lr", "1e-5"), ("steps", "12"), ("seq_len", "64"), ("batch_size", "4"),
        ("warmup_steps", "2"), ("beta2", "0.99"), ("eps", "1e-6"), ("grad_clip", "0.5"), ("weight_decay", "0.05"),
        ("schedule", "cosine"), ("schedule", "wsd"), ("precision", "fp32"), ("wsd_decay_frac", "0.3"),
        ("keep_checkpoints", "2"), ("seed", "7"), ("model.rms_norm_eps", "1e-5"), ("model.hidden_size", "64"),
        ("model.num_key_value_heads", "4")]  # valid alone: accepted lines get drawn too, not only refusals


@settings(max_examples=n(150), deadline=None, derandomize=True)
@given(sets=st.lists(st.one_of(st.tuples(st.sampled_from(SET_KEYS), st.sampled_from(BAD_VALUES)),
                               st.sampled_from(GOOD)), min_size=1, max_size=3),
       eq=st.booleans())
@example(sets=[("model.rms_norm_eps", "1e-5"), ("lr", "1e-3")], eq=True)  # accepted lines, always tried
@example(sets=[("schedule", "cosine"), ("seed", "7"), ("seed", "8")], eq=True)
def test_set_overrides_space(sets, eq):
    """A refused line names what it refuses; an accepted one holds exactly the values given (the last one per key,
    parsed as written: finite numbers), in model_overrides for model.* keys, and the preset's value everywhere else."""
    import dataclasses
    import math

    from gated_attention.train.train_presets import train_preset
    from gated_attention.train.overrides import config_from_args

    items = [f"{k}={v}" if eq else f"{k}{v}" for k, v in sets]
    try:
        cfg = config_from_args("tiny", None, items, None)
    except ValueError as exc:
        msg = str(exc)
        assert any(k in msg for k, _ in sets) and len(msg.strip().splitlines()) == 1, msg
        return
    assert eq, items  # an item without '=' is never accepted
    given = dict(sets)  # the last value per key wins
    base = train_preset("tiny")
    for f in dataclasses.fields(cfg):
        if f.name not in given and f.name != "model_overrides":
            assert getattr(cfg, f.name) == getattr(base, f.name), f.name
    assert set(cfg.model_overrides) == {k[len("model."):] for k in given if k.startswith("model.")}
    for key, text in given.items():
        value = cfg.model_overrides[key[len("model."):]] if key.startswith("model.") else getattr(cfg, key)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            assert math.isfinite(value) and value == pytest.approx(float(text)), (key, text, value)
        elif isinstance(value, str):
            assert value == text.strip(), (key, text, value)


# ------------------------------------------------------------------------------------------------ 3. command lines

STATS = {"tried": set(), "tracebacks": [], "stub_calls": 0}


def _tiny_corpus(root: Path) -> Path:
    text = root / "corpus.txt"
    words = [f"w{i}" for i in range(60)]
    text.write_text("\n\n".join(" ".join(words[(i * 7 + j) % 60] for j in range(80)) for i in range(120)))
    data = root / "data"
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["data", "prepare", "--data-dir", str(data), "--sources", "--extra", str(text),
                     "--vocab-size", "300", "--chunk-chars", "400"]) == 0
    return data


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def world(tmp_path_factory):
    """A tiny corpus, a finished tiny run on it (final/ with tokenizer) and an ungated one, some files/folders."""
    root = tmp_path_factory.mktemp("fuzz")
    data = _tiny_corpus(root)
    run = root / "run"
    base = ["--preset", "tiny", "--set", "steps=2", "--set", "eval_batches=1", "--set", "ckpt_every=0",
            "--set", "data=corpus", "--data-dir", str(data)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", *base, "--gate", "sdpa_elementwise", "--out", str(run)]) == 0
        assert main(["train", *base, "--out", str(root / "plain")]) == 0
    (root / "afile.txt").write_text("just a file\n")
    (root / "adir").mkdir()
    (root / "notjson.json").write_text("{nope")
    return {"root": root, "data": data, "run": run, "final": run / "final", "plain": root / "plain" / "final",
            "file": root / "afile.txt", "dir": root / "adir", "notjson": root / "notjson.json",
            "missing": root / "does" / "not" / "exist"}


def bases(w) -> dict[str, list[str]]:
    """A valid, fast command line per subcommand. OUT is replaced by a fresh folder per example."""
    return {
        "gates": ["gates"],
        "demo": ["demo", "--tokens", "2", "--seed", "1"],
        "data": ["data", "info", "--data-dir", str(w["data"])],
        "train": ["train", "--preset", "tiny", "--set", "steps=2", "--set", "eval_batches=1", "--set", "ckpt_every=0",
                  "--out", "OUT"],
        "eval": ["eval", str(w["run"]), "--batches", "1", "--batch-size", "1", "--seq-len", "16"],
        "convert": ["convert", str(w["final"]), "OUT", "--from", "native", "--to", "qwen3-next"],
        "retrofit": ["retrofit", str(w["plain"]), "--gate", "sdpa_headwise", "--init", "identity", "--out", "OUT"],
        "analyze": ["analyze", str(w["final"]), "--domain", "corpus", "--data-dir", str(w["data"]), "--seq-len", "16",
                    "--batches", "1", "--batch-size", "1", "--map-len", "4", "--out", "OUT"],
        "compare": ["compare", "--budget", "small", "--variants", "baseline", "--out", "OUT"],
        "extend": ["extend", str(w["final"]), "--factor", "2", "--rope-theta", "5000", "--out", "OUT"],
        "ruler": ["ruler", str(w["final"]), "--lengths", "48", "--tasks", "niah_single_1", "--samples", "1",
                  "--max-new-tokens", "2", "--out", "OUT"],
        "longctx": ["longctx", "--budget", "small", "--gates", "baseline", "--steps", "2", "--out", "OUT"],
        "lm-eval": ["lm-eval", "validate", "--tasks", "definitely_not_a_task"],
    }


def bad_tokens(w) -> list[str]:
    return ["nan", "inf", "-inf", "-1", "0", "-0.5", "1e999", "abc", "", "--", "-", "1.5", "99999999999999999999",
            str(w["file"]), str(w["dir"]), str(w["missing"]), str(w["notjson"]), str(w["data"]), "steps=0",
            "lr=nan", "model.num_attention_heads=3", "--bogus", "☃", "/dev/null", "."]


@st.composite
def mutated(draw, base: list[str], bad: list[str]):
    argv = list(base)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace", "replace", "replace", "drop", "swap", "dup", "insert"]))
        if len(argv) < 2:
            op = "insert"
        i = draw(st.integers(1, max(1, len(argv) - 1)))
        if op == "replace":
            argv[i] = draw(st.sampled_from(bad))
        elif op == "drop":
            del argv[i]
        elif op == "swap":
            j = draw(st.integers(1, len(argv) - 1))
            argv[i], argv[j] = argv[j], argv[i]
        elif op == "dup":
            argv[i:i] = argv[i:i + 2]
        else:
            argv.insert(i, draw(st.sampled_from(bad)))
    return argv


# commands whose valid runs take minutes: the library entry is replaced by a stub AFTER argument parsing and the
# CLI's own checks, so the fuzz covers their argument handling (their jobs are tested in their own files)
STUBS = {"compare": ("gated_attention.compare.job", "run_compare"),  # the module the CLI calls it from
         "longctx": ("gated_attention.longctx.pipeline", "run_pipeline"),
         "lm-eval": ("gated_attention.cli.lm_eval", "lm_eval_main")}


def _run_one(cmd: str, argv: list[str], w, monkeypatch) -> None:
    import importlib
    import traceback

    out = Path(tempfile.mkdtemp(dir=w["root"], prefix=f"o_{cmd}_"))
    shutil.rmtree(out)  # a fresh path that does not exist yet
    argv = [str(out) if a == "OUT" else a for a in argv]
    if cmd in STUBS:
        mod, fn = STUBS[cmd]
        m = importlib.import_module(mod)
        result = {"run_compare": {"rows": {}, "wall_time_s": 0.0}, "run_pipeline": None, "lm_eval_main": 0}[fn]

        def stub(*a, **k):
            STATS["stub_calls"] += 1
            return result

        monkeypatch.setattr(m, fn, stub)
        if cmd == "compare":
            monkeypatch.setattr("gated_attention.compare.compare_report.render_table", lambda res: "")
    calls_before = STATS["stub_calls"]
    STATS["tried"].add((cmd, tuple(a.replace(str(w["root"]), "ROOT") for a in argv if not a.startswith(str(out)))))
    cwd = w["root"] / "cwd"  # a mutation can turn any token into a relative output path: keep it out of the repo
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception:  # noqa: BLE001 - exactly what this test hunts
        STATS["tracebacks"].append((argv, traceback.format_exc()))
        raise
    finally:
        monkeypatch.undo()
    assert code in (0, 1, 2, None), (argv, code, err.getvalue())
    if cmd in STUBS and code in (0, None):  # an accepted line reached the stub, never the real (minutes-long) job
        assert STATS["stub_calls"] > calls_before, (argv, "the stub was not called: is STUBS's module the CLI's?")
    assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
    if code == 2:
        lines = [l for l in err.getvalue().splitlines() if "error:" in l]
        assert lines, (argv, err.getvalue())


# examples per command: cheap commands get more; train valid runs take seconds
EXAMPLES = {"gates": 15, "demo": 15, "data": 20, "train": 18, "eval": 20, "convert": 20, "retrofit": 20,
            "analyze": 15, "compare": 20, "extend": 20, "ruler": 10, "longctx": 20, "lm-eval": 10}


@pytest.mark.parametrize("cmd", list(EXAMPLES))
def test_mutated_command_lines_never_traceback(cmd, world, monkeypatch):
    assert cmd in COMMANDS
    base = bases(world)[cmd]
    bad = bad_tokens(world)

    @settings(max_examples=n(EXAMPLES[cmd]), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])
    @given(argv=mutated(base, bad))
    def check(argv):
        _run_one(cmd, argv, world, monkeypatch)

    check()


@pytest.fixture(scope="module", autouse=True)
def fuzz_totals():
    """After this file's tests: the totals quoted in docs/reliability.md (`pytest -s tests/test_properties.py`)."""
    yield
    if STATS["tried"]:
        print(f"\n[fuzz] distinct mutated command lines tried: {len(STATS['tried'])}; ended in a traceback: "
              f"{len(STATS['tracebacks'])}")


def test_fuzz_check_fails_on_a_traceback_and_on_an_exit_2_without_an_error_line(world, monkeypatch):
    """The command-line check above must catch what it hunts: a command that raises (a bug: the CLI re-raises it),
    one that exits 2 without its one error line, and one that exits with another status; a clean run passes."""
    import gated_attention.cli.model as cli_model

    saved = {"tried": set(STATS["tried"]), "tracebacks": list(STATS["tracebacks"])}

    def bug(args):
        raise KeyError("a bug")

    def silent_2(args):
        return 2

    def status_3(args):
        return 3

    try:
        _run_one("gates", ["gates"], world, monkeypatch)  # the real command: passes
        for fake, caught in ((bug, KeyError), (silent_2, AssertionError), (status_3, AssertionError)):
            monkeypatch.setattr(cli_model, "run_gates", fake)  # undone by _run_one itself
            with pytest.raises(caught):
                _run_one("gates", ["gates"], world, monkeypatch)
        assert [argv for argv, _ in STATS["tracebacks"][len(saved["tracebacks"]):]] == [["gates"]]
    finally:
        STATS.update(saved)


def test_dense_constant_gate_with_hidden_size_unlike_heads_times_head_dim():
    """Found by the random search above (a fresh-clone CI run): a G5 (after o_proj) constant gate sized its theta per
    head, (H*D/D, D), which cannot broadcast over the hidden size when hidden_size != H*D."""
    from gated_attention.configuration import GatedQwen3Config

    from harness import build_lm

    spec = G.GateSpec(position=G.Position.DENSE, granularity=G.Granularity.ELEMENTWISE,
                      sharing=G.Sharing.HEAD_SPECIFIC, combine=G.Combine.MULTIPLY,
                      activation=G.Activation.SIGMOID, source=G.Source.CONSTANT)
    with registered(spec) as name:
        cfg = GatedQwen3Config(vocab_size=64, intermediate_size=16, max_position_embeddings=64, gate=name,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=2, hidden_size=8,
                               num_hidden_layers=1)
        model = build_lm(cfg, seed=None)
        with torch.no_grad():
            logits = model(torch.randint(1, 64, (1, 5))).logits  # (1, 5, V)
    assert logits.shape == (1, 5, 64) and torch.isfinite(logits).all()
