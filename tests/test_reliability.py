"""Reliability (issue 14): every observed bad input is one line + exit 2; checkpoints survive damage, kills and full
disks; one writer per folder; no pickle from user paths; HF-style weight folders; strict JSON out.

CLI cases run in-process (`gated_attention.cli.main(argv)`); faults that need a real process (SIGKILL, a file-size
limit, two processes) run `python -m gated_attention.cli` in a subprocess.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gated_attention.cli import main
from gated_attention.util.io import json_dumps, lock_dir, lock_path_for, strict_loads, to_strict
from gated_attention.train import checkpoint as ckpt_mod
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.trainer import train
from harness import gattn_argv, run_gattn, torchrun_argv
from probes.kill_hooks import nan_at_steps

SRC = Path(__file__).resolve().parents[1] / "src" / "gated_attention"
TINY = ["--preset", "tiny", "--set", "steps=4", "--set", "ckpt_every=2", "--set", "eval_batches=1"]


def one_line_error(capsys, cmd: str, *needles: str) -> str:
    """stderr is exactly one `gattn CMD: error: ...` line containing every needle, and no traceback."""
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert "Traceback" not in err, err
    errs = [l for l in lines if l.startswith(f"gattn {cmd}") and "error:" in l]
    assert len(errs) == 1, err
    for n in needles:
        assert n.lower() in errs[0].lower(), errs[0]
    return errs[0]


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def run_dir(tmp_path_factory) -> Path:
    """A finished tiny run (synthetic data): final/, checkpoints at steps 2 and 4, log.jsonl, summary.json."""
    out = tmp_path_factory.mktemp("run")
    train(apply_overrides(tiny(), ["steps=4", "ckpt_every=2", "eval_batches=1"]), out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------ observed failures

def test_train_out_names_a_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--out", str(f)])
    assert e.value.code == 2
    one_line_error(capsys, "train", "is a file")


def test_zero_kv_heads(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *TINY, "--set", "model.num_key_value_heads=0", "--out", str(out)]) == 2
    one_line_error(capsys, "train", "num_key_value_heads=0", ">= 1")
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("flag,value", [("--factor", "inf"), ("--rope-theta", "nan"), ("--factor", "-2"),
                                        ("--rope-theta", "0")])
def test_extend_non_finite(run_dir, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["extend", str(run_dir / "final"), flag, value, "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    one_line_error(capsys, "extend", flag, value)
    assert not (tmp_path / "x").exists()


def test_convert_corrupt_safetensors(run_dir, tmp_path, capsys):
    src = _copy(run_dir / "final", tmp_path / "src")
    w = src / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # truncated
    assert main(["convert", str(src), str(tmp_path / "dst"), "--from", "native"]) == 2
    one_line_error(capsys, "convert", "model.safetensors", "truncated")
    w.write_bytes(b"\xff" * 64)  # garbage header
    assert main(["convert", str(src), str(tmp_path / "dst"), "--from", "native"]) == 2
    one_line_error(capsys, "convert", "model.safetensors", "corrupt")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("args,needle", [(["--seq-len", "-1"], "--seq-len"), (["--batches", "0"], "--batches"),
                                         (["--batch-size", "nan"], "--batch-size")])
def test_eval_bad_numbers(run_dir, capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        main(["eval", str(run_dir), *args])
    assert e.value.code == 2
    one_line_error(capsys, "eval", needle)


def test_eval_longer_than_the_model(run_dir, capsys):
    assert main(["eval", str(run_dir), "--seq-len", "100000", "--batches", "1"]) == 2
    one_line_error(capsys, "eval", "max_position_embeddings", "lower --seq-len")


def test_resume_empty_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", *TINY, "--out", str(tmp_path / "empty"), "--resume"]) == 2
    one_line_error(capsys, "train", "nothing to resume")
    assert list((tmp_path / "empty").iterdir()) == []


def test_analyze_config_not_json(run_dir, tmp_path, capsys):
    m = _copy(run_dir / "final", tmp_path / "m")
    (m / "config.json").write_text("{not json")
    assert main(["analyze", str(m), "--text", str(m / "config.json"), "--out", str(tmp_path / "a")]) == 2
    one_line_error(capsys, "analyze", "config.json", "not valid JSON")


def test_data_prepare_data_dir_is_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["data", "prepare", "--data-dir", str(f), "--sources", "--extra", str(f)]) == 2
    one_line_error(capsys, "data", "is a file")
    assert f.read_text() == "x"


def test_extra_files_never_skipped_silently(tmp_path, capsys):
    words = " ".join(f"word{i % 97} line{i % 13}" for i in range(3000))
    u16 = tmp_path / "texts"
    u16.mkdir()
    (u16 / "utf16.txt").write_bytes("\n\n".join(["hello utf sixteen " * 40] * 30).encode("utf-16"))
    (u16 / "plain.txt").write_text(words)
    (u16 / "binary.dat").write_bytes(b"abc\x00\x01\x02" * 100)
    small = tmp_path / "small.txt"
    small.write_text("too small to split\n")
    data = tmp_path / "data"
    assert main(["data", "prepare", "--data-dir", str(data), "--sources", "--extra", str(u16), str(small),
                 "--vocab-size", "300", "--chunk-chars", "2000"]) == 0
    err = capsys.readouterr().err
    man = json.loads((data / "manifest.json").read_text())
    texts = man["domains"]["texts"]
    assert texts["documents"] == 2  # the UTF-16 file was decoded, not dropped
    assert texts["skipped_files"] == ["binary.dat (NUL bytes: binary or UTF-16/32 without a BOM)"]
    assert "binary.dat" in err and "NUL" in err
    assert "no val split" in man["domains"]["small"]["warning"] and "small: warning" in err
    raw = (data / "raw" / "texts.jsonl").read_text()
    assert "hello utf sixteen" in raw


def test_debug_traceback_and_bugs_still_raise(tmp_path, capsys, monkeypatch):
    import gated_attention.cli.model as gc

    monkeypatch.setenv("GATTN_DEBUG", "1")
    assert main(["eval", str(tmp_path)]) == 2  # a user error: the line, plus the traceback on request
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("gattn eval: error:")
    monkeypatch.delenv("GATTN_DEBUG")

    def bug(args):
        raise TypeError("an internal bug")

    monkeypatch.setattr(gc, "run_gates", bug)
    with pytest.raises(TypeError, match="internal bug"):  # bugs are not dressed up as user errors
        main(["gates"])


# ------------------------------------------------------------------------------------------------ resume consistency

def test_resume_with_other_gate_or_data_dir(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path / "r")
    assert main(["train", "--out", str(run), "--resume", "--gate", "sdpa_headwise"]) == 2
    one_line_error(capsys, "train", "--gate", "saved run has gate")
    assert main(["train", "--out", str(run), "--resume", "--data-dir", str(tmp_path)]) == 2
    one_line_error(capsys, "train", "--data-dir", "data_dir")


# ------------------------------------------------------------------------------------------------ checkpoints

def test_manifest_written_and_verified(run_dir):
    ckpts = ckpt_mod.list_checkpoints(run_dir)
    assert [s for s, _ in ckpts] == [2, 4]
    for _, p in ckpts:
        man = json.loads((p / "manifest.json").read_text())
        assert set(man["files"]) == {"state.pt", "meta.json", "rng_rank0.pt"}
        assert ckpt_mod.verify(p) is None


def _losses(run: Path) -> list:
    return [json.loads(l)["loss"] for l in (run / "log.jsonl").read_text().splitlines()]


def test_truncated_newest_checkpoint_falls_back(tmp_path, capsys):
    sets = ["steps=6", "ckpt_every=2", "keep_checkpoints=3", "eval_batches=1"]
    ref = tmp_path / "ref"
    train(apply_overrides(tiny(), sets), ref)
    run = tmp_path / "run"
    p = run_gattn("train", "--preset", "tiny", "--out", run, *sum((["--set", s] for s in sets), []),
                  env={"GATTN_TEST_KILL_AT_STEP": "4"}, timeout=300, kill_hooks=True)
    assert p.returncode == -9, p.stderr[-2000:]
    assert [s for s, _ in ckpt_mod.list_checkpoints(run)] == [2, 4]
    newest = run / "checkpoints" / "step_00000004" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    assert main(["train", "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: skipping checkpoint step_00000004: state\.pt has 1000 bytes", err), err
    assert (run / "checkpoints" / "corrupt-step_00000004").is_dir()  # kept aside, named in the warning
    assert _losses(run) == _losses(ref)  # resumed from step 2: same numbers as an undisturbed run
    assert [s for s, _ in ckpt_mod.list_checkpoints(run)] == [2, 4, 6]


def test_no_valid_checkpoint_is_an_error(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path / "r")
    for _, p in ckpt_mod.list_checkpoints(run):
        (p / "manifest.json").unlink()
    assert main(["train", "--out", str(run), "--resume"]) == 2
    one_line_error(capsys, "train", "no valid checkpoint")


def test_resave_keeps_old_copy_until_new_is_complete(run_dir, tmp_path, monkeypatch):
    run = _copy(run_dir, tmp_path / "r")
    final = run / "checkpoints" / "step_00000004"
    before = (final / "state.pt").read_bytes()
    tmp = ckpt_mod.tmp_dir_for(run, 4)
    ckpt_mod.write_files(tmp, {"state.pt": {"x": torch.ones(2)}, "meta.json": {"state": {}}})
    ckpt_mod.write_manifest(tmp)
    real_rename = os.rename

    def crash_on_new(src, dst):  # die right after the old copy was moved aside
        if Path(src) == tmp:
            raise OSError(5, "simulated crash")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_new)
    with pytest.raises(OSError):
        ckpt_mod.commit(run, 4, keep=2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (run / "checkpoints" / ".old-step_00000004" / "state.pt").read_bytes() == before  # not deleted
    ckpt_mod.clean_stale(run)  # the next start restores it
    assert (final / "state.pt").read_bytes() == before and ckpt_mod.verify(final) is None


def test_disk_full_keeps_previous_checkpoints(tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored so writes fail with EFBIG) during a checkpoint."""
    sets = ["steps=6", "ckpt_every=2", "keep_checkpoints=3", "eval_batches=1"]
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--out", str(run), *sum((["--set", s] for s in sets), [])]
    p = run_gattn(*args, env={"GATTN_TEST_KILL_AT_STEP": "4"}, timeout=300, kill_hooks=True)
    assert p.returncode == -9
    size = (run / "checkpoints" / "step_00000004" / "state.pt").stat().st_size
    before = {s: (p_ / "state.pt").read_bytes() for s, p_ in ckpt_mod.list_checkpoints(run)}
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({size // 2}, {size // 2}))
        os.execv(sys.executable, {gattn_argv(*args, '--resume')!r})
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and re.search(r"gattn train: error: disk full", p.stderr), p.stderr[-2000:]
    after = {s: (p_ / "state.pt").read_bytes() for s, p_ in ckpt_mod.list_checkpoints(run)}
    assert after == before  # steps 2 and 4 intact
    assert all(ckpt_mod.verify(p_) is None for _, p_ in ckpt_mod.list_checkpoints(run))
    assert not [x.name for x in (run / "checkpoints").iterdir() if x.name.startswith(".")]  # temp folder removed


def test_resume_never_unpickles_code(run_dir, tmp_path, capsys):
    """A state.pt carrying a pickle payload (with a valid manifest) is refused, and the payload never runs."""
    run = _copy(run_dir, tmp_path / "r")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ck = run / "checkpoints" / "step_00000004"
    torch.save({"model": {}, "optimizer": {}, "evil": Evil()}, ck / "state.pt")
    ckpt_mod.write_manifest(ck)
    assert ckpt_mod.verify(ck) is None
    assert main(["train", "--out", str(run), "--resume", "--set", "steps=4"]) == 2
    one_line_error(capsys, "train", "could not be loaded")
    assert not marker.exists()


def test_no_pickle_reads_anywhere_in_the_project():
    """Every torch.load in src/ passes weights_only=True; nothing calls pickle.load(s) / numpy allow_pickle."""
    offenders = []
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                offenders.append(f"{f.name}: {m.group(0)}")
        for bad in ("pickle.load", "allow_pickle=True", "weights_only=False", "import dill", "joblib.load"):
            if bad in text:
                offenders.append(f"{f.name}: {bad}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------------ locks

LOCKED_COMMANDS = {
    "train": lambda out, src: ["train", *TINY, "--out", str(out)],
    "compare": lambda out, src: ["compare", "--out", str(out)],
    "longctx": lambda out, src: ["longctx", "--out", str(out.parent), "--gates", out.name],
    "extend": lambda out, src: ["extend", str(src), "--out", str(out)],
    "lab-sinks": lambda out, src: ["lab", "sinks", "--budget", "small", "--out", str(out)],
    "lab-stability": lambda out, src: ["lab", "stability", "--budget", "small", "--out", str(out)],
    "lab-streaming": lambda out, src: ["lab", "streaming", "--models", str(src), "--window", "8", "--out", str(out)],
    "lab-retrofit": lambda out, src: ["lab", "retrofit", "--from", str(src), "--steps", "1", "--out", str(out)],
    "ruler": lambda out, src: ["ruler", str(src), "--lengths", "64", "--out", str(out)],
}


# The lock holders below are plain Python processes that import util/io.py alone: the package's __init__ (the HF
# model's registration: transformers, ~5 s a process on a 2-core CPU) is not what they test.
_PKG = Path(sys.modules["gated_attention.util.io"].__file__).parents[1]  # src/gated_attention
LIGHT_IO = ("import sys, types\n"
            f"pkg = types.ModuleType('gated_attention'); pkg.__path__ = [{str(_PKG)!r}]\n"
            "sys.modules['gated_attention'] = pkg\n"
            "from gated_attention.util.io import lock_dir\n")


@pytest.fixture
def holder(tmp_path, request):
    """Another process holding the lock on tmp_path/out (as a running command would). For longctx the locked folder
    is OUT/gates-<gate set>.seed<seed>x<seeds> (gate sets and seeds may share OUT in parallel), so OUT=tmp_path and
    the gate set is "out" (seed 0, the default budget's one seed)."""
    from gated_attention.longctx.pipeline import lock_path

    out = lock_path(tmp_path, ["out"], 0, 1) if "longctx" in request.node.name else tmp_path / "out"
    code = (LIGHT_IO + "import time\n"
            f"with lock_dir({str(out)!r}):\n    print('locked', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    yield out, p.pid
    p.kill()
    p.wait()


@pytest.mark.parametrize("cmd", list(LOCKED_COMMANDS))
def test_second_writer_gets_exit_2_naming_the_holder(holder, run_dir, capsys, cmd):
    out, pid = holder
    if cmd == "longctx":
        out = out.with_name("out")  # --gates out -> lock folder OUT/gates-out.seed0x1
    assert main(LOCKED_COMMANDS[cmd](out, run_dir / "final")) == 2
    one_line_error(capsys, cmd.split("-")[0], "in use by another", f"PID {pid}")


def test_two_concurrent_trainings(tmp_path):
    """Two real `gattn train` processes on one folder: the second stops with exit 2 naming the first's PID."""
    out = tmp_path / "run"
    first = subprocess.Popen(gattn_argv("train", "--preset", "tiny", "--set", "steps=100000", "--set", "ckpt_every=5",
                                        "--out", out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not list(ckpt_mod.list_checkpoints(out)) and time.time() - t0 < 240:  # first is writing checkpoints
            time.sleep(0.2)
        assert first.poll() is None
        second = run_gattn("train", *TINY, "--out", out, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by another gattn train process (PID {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the holder was not disturbed
    finally:
        first.kill()
        first.wait()
    assert all(ckpt_mod.verify(p) is None for _, p in ckpt_mod.list_checkpoints(out))
    with lock_dir(out):  # the dead holder's lock is gone
        pass


def _try_lock(out) -> subprocess.CompletedProcess:
    """Another process trying to take the lock on `out` once: exit 0 with "acquired", or the UserError's line."""
    code = (LIGHT_IO + f"with lock_dir({str(out)!r}, 'gattn test'):\n"
            "    print('acquired', flush=True)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_lock_is_exclusive_and_released_when_the_holder_is_sigkilled(tmp_path):
    """The lock really excludes another process while its holder lives (also while the holder re-enters it), and a
    SIGKILL frees it for the next one: no cleanup code runs, only the kernel's release, and the lock file the dead
    holder left behind does not block."""
    out = tmp_path / "o"
    code = (LIGHT_IO + f"import time\nwith lock_dir({str(out)!r}):\n"
            f"    with lock_dir({str(out)!r}):\n        pass\n"  # re-entrant (compare -> train); leaving keeps it
            "    print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = _try_lock(out)
        assert busy.returncode != 0 and "acquired" not in busy.stdout
        assert f"in use by another gattn test process (PID {holder.pid}" in busy.stderr, busy.stderr[-2000:]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert lock_path_for(out).exists()  # the dead holder's lock file is still there ...
    again = _try_lock(out)  # ... and does not block the next process
    assert again.returncode == 0 and again.stdout.strip() == "acquired", again.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ HF weight folders

def test_convert_ignores_stray_safetensors_and_reads_shards(run_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _copy(run_dir / "final", tmp_path / "src")
    save_file({"junk": torch.zeros(3)}, src / "optimizer_extra.safetensors")  # not weights by HF naming: ignored
    assert main(["convert", str(src), str(tmp_path / "a"), "--from", "native"]) == 0
    # sharded: two shards + index
    sd = load_file(src / "model.safetensors")
    keys = sorted(sd)
    sh = _copy(run_dir / "final", tmp_path / "sh")
    (sh / "model.safetensors").unlink()
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, sh / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in keys[half:]}, sh / "model-00002-of-00002.safetensors")
    wm = {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (sh / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert main(["convert", str(sh), str(tmp_path / "b"), "--from", "native"]) == 0
    assert load_file(tmp_path / "b" / "model.safetensors").keys() == load_file(tmp_path / "a" / "model.safetensors").keys()


def test_shard_paths_confined_to_the_folder(run_dir, tmp_path, capsys):
    sh = _copy(run_dir / "final", tmp_path / "sh")
    os.replace(sh / "model.safetensors", tmp_path / "outside.safetensors")
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    assert main(["convert", str(sh), str(tmp_path / "b"), "--from", "native"]) == 2
    one_line_error(capsys, "convert", "outside the checkpoint folder")
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    assert main(["retrofit", str(sh), "--gate", "sdpa_elementwise", "--init", "identity",
                 "--out", str(tmp_path / "c")]) == 2
    one_line_error(capsys, "retrofit", "missing")


# ------------------------------------------------------------------------------------------------ strict JSON, NaN

def test_strict_json_helper():
    obj = {"loss": float("nan"), "g": float("inf"), "acts": [1.0, float("-inf")], "ok": 1.5, "n": {"x": float("nan")}}
    s = to_strict(obj)
    assert s == {"loss": None, "g": None, "acts": [1.0, None], "ok": 1.5, "n": {"x": None, "nonfinite": {"x": "nan"}},
                 "nonfinite": {"loss": "nan", "g": "inf", "acts": "-inf"}}
    assert strict_loads(json_dumps(obj)) == s
    from gated_attention.util.io import from_strict

    back = from_strict(s)
    assert back["loss"] != back["loss"] and back["g"] == float("inf") and back["acts"][1] == float("-inf")
    assert back["n"]["x"] != back["n"]["x"] and "nonfinite" not in back
    with pytest.raises(ValueError):
        strict_loads('{"a": NaN}')


def test_nan_mid_run_logs_strict_json(tmp_path):
    out = tmp_path / "r"
    with nan_at_steps({2, 3}):
        s = train(apply_overrides(tiny(), ["steps=6", "eval_batches=1", "ckpt_every=0"]), out)
    lines = [strict_loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    bad = [r for r in lines if r["step"] in (2, 3)]
    assert all(r["loss"] is None and r["nonfinite"]["loss"] == "nan" and r["skipped"] for r in bad)
    assert all(r["loss"] is not None and "nonfinite" not in r for r in lines if r["step"] not in (2, 3))
    assert s["skipped_steps"] == 2 and not s["diverged"]
    strict_loads((out / "summary.json").read_text())
    # a run that diverges: its final loss is NaN -> null with the reason, in a strictly parseable summary
    with nan_at_steps({1, 2, 3}):
        d = train(apply_overrides(tiny(), ["steps=8", "max_bad_steps=3", "eval_batches=1", "ckpt_every=0"]),
                  tmp_path / "d")
    summ = strict_loads((tmp_path / "d" / "summary.json").read_text())
    assert d["diverged"] and summ["final_loss"] is None and summ["nonfinite"]["final_loss"] == "nan"


def test_nan_in_analysis_is_reported(run_dir, tmp_path):
    """A NaN activation shows up as NaN in M-Act (max() would have hidden it) and as null + "nonfinite" in JSON."""
    from safetensors.torch import load_file, save_file

    from gated_attention.analysis import AnalysisConfig, analyze_model, load_model
    from gated_attention.util.io import atomic_write_json, nonfinite_paths

    m = _copy(run_dir / "final", tmp_path / "m")
    sd = load_file(m / "model.safetensors")
    k = next(k for k in sd if k.endswith("layers.1.mlp.down_proj.weight"))
    sd[k][0, 0] = float("nan")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    model, kind = load_model(m)
    batches = [torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))]
    res = analyze_model(model, batches, AnalysisConfig(map_len=8), kind)
    assert res["layers"][0]["max_abs_hidden"] == res["layers"][0]["max_abs_hidden"]  # layer 0 is finite
    assert res["max_abs_hidden"] != res["max_abs_hidden"]  # NaN propagated, not max()'d away
    bad = nonfinite_paths(res)
    assert "max_abs_hidden" in bad
    atomic_write_json(tmp_path / "analysis.json", res)
    back = strict_loads((tmp_path / "analysis.json").read_text())
    assert back["max_abs_hidden"] is None and back["nonfinite"]["max_abs_hidden"] == "nan"


def test_agree_stops_every_rank(tmp_path):
    """Under DDP (gloo, 2 processes) an error on rank 0 makes rank 1 raise too instead of waiting in a barrier."""
    code = textwrap.dedent(f"""
        import os, sys, torch.distributed as dist
        from gated_attention.train import dist as D
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=rank, world_size=2)
        info = D.DistInfo(rank=rank, world_size=2, mode="ddp")
        try:
            D.agree(info, OSError(28, "No space left on device") if rank == 0 else None)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
            dist.barrier()  # both ranks reach here: nobody is stuck
            sys.exit(3)
    """)
    ps = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in ps]
    assert [p.returncode for p in ps] == [3, 3]
    assert "No space left" in outs[0] and "rank 0 stopped" in outs[1]


@pytest.mark.slow
def test_disk_full_under_ddp_stops_every_rank(tmp_path):
    """torchrun, 2 gloo ranks, a file-size limit only rank 0's state.pt exceeds: both ranks exit, none hangs."""
    run = tmp_path / "run"
    ref = tmp_path / "ref"
    train(apply_overrides(tiny(), ["steps=2", "ckpt_every=0", "eval_batches=1"]), ref)
    size = (ckpt_mod.latest_checkpoint(ref) / "state.pt").stat().st_size
    argv = torchrun_argv("train", "--preset", "tiny", "--set", "steps=4", "--set", "ckpt_every=2", "--set",
                         "precision=fp32", "--out", run)
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited by torchrun and both ranks
        resource.setrlimit(resource.RLIMIT_FSIZE, ({size // 2}, {size // 2}))
        os.execv(sys.executable, {argv!r})
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert "gattn train: error: disk full" in p.stderr and "rank 0 stopped with an error" in p.stderr, p.stderr[-3000:]
    assert ckpt_mod.list_checkpoints(run) == []
    assert not [x.name for x in (run / "checkpoints").iterdir()]  # the temp folder was removed


class FakeCudaRng:
    """torch.cuda's RNG functions as on a host with `n` GPUs, for a CPU test: each device's generator state is a
    tensor here, and a device this host does not have fails as CUDA does (invalid device ordinal)."""

    def __init__(self, n: int):
        self.n, self.states = n, {i: torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(n)}

    def _index(self, device) -> int:
        i = 0 if device in ("cuda", None) else (device if isinstance(device, int) else torch.device(device).index or 0)
        if i >= self.n:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return i

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def install(self, monkeypatch) -> "FakeCudaRng":
        for name, fn in (("is_available", lambda: True), ("device_count", lambda: self.n),
                         ("current_device", lambda: 0), ("get_rng_state", self.get), ("set_rng_state", self.set),
                         ("get_rng_state_all", lambda: [self.get(i) for i in range(self.n)]),
                         ("set_rng_state_all", lambda states: [self.set(s, i) for i, s in enumerate(states)])):
            monkeypatch.setattr(torch.cuda, name, fn)
        return self


def test_a_checkpoint_from_a_host_with_more_gpus_resumes(tmp_path, monkeypatch):
    """A rank's checkpoint holds its own device's CUDA RNG state only, and a checkpoint holding a state for every
    device of a 4-GPU host (the old layout) resumes on a 1-GPU host with device 0's state (before: set_rng_state_all
    failed on device 1). CUDA's RNG functions are faked on this CPU machine (FakeCudaRng)."""
    from gated_attention.train.checkpoint import latest_checkpoint, verify, write_manifest
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.trainer import train

    cfg = apply_overrides(tiny(), ["steps=4", "ckpt_every=2", "precision=fp32", "compile=false", "device=cpu"])
    out = tmp_path / "run"
    train(cfg, out)
    ck = latest_checkpoint(out)
    rng = torch.load(ck / "rng_rank0.pt", weights_only=True)
    four = [torch.full((16,), 7 + i, dtype=torch.uint8) for i in range(4)]  # written on a 4-GPU host
    torch.save({**rng, "cuda": four}, ck / "rng_rank0.pt")
    write_manifest(ck)
    assert verify(ck) is None
    fake = FakeCudaRng(1).install(monkeypatch)
    train(cfg, out, resume=True)  # restores from step 4, writes its final checkpoint again
    assert torch.equal(fake.states[0], four[0])
    saved = torch.load(latest_checkpoint(out) / "rng_rank0.pt", weights_only=True)["cuda"]
    assert isinstance(saved, torch.Tensor) and torch.equal(saved, four[0])  # this device's state, not a list


def test_a_filesystem_without_flock_is_one_clear_error(tmp_path, monkeypatch):
    """Lustre without -o flock answers flock with ENOLCK: one UserError naming the problem and the fix (before: a
    bare OSError traceback), and the lock file's descriptor is closed."""
    import errno
    import fcntl

    from gated_attention.util.errors import UserError
    from gated_attention.util.io import lock_dir

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(UserError) as err:
        with lock_dir(tmp_path / "run", "gattn train"):
            pass
    msg = str(err.value)
    assert "does not support flock" in msg and "-o flock" in msg and str(tmp_path / "run") in msg
    assert len(os.listdir("/proc/self/fd")) == before
