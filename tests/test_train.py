"""Training harness: schedules, --set overrides, loss falls, NaN skipping, spikes, exact SIGKILL resume, eval."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gated_attention.train.checkpoint import list_checkpoints
from gated_attention.train.train_presets import tiny
from gated_attention.train.overrides import apply_overrides
from gated_attention.train.schedule import lr_at
from gated_attention.train.monitors import SpikeDetector
from gated_attention.train.model_setup import param_groups
from gated_attention.train.trainer import train
from harness import build_lm, run_gattn
from probes.kill_hooks import nan_at_steps


def losses(run: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run / "log.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- schedules

def test_cosine_schedule_known_steps():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, steps=111, schedule="cosine")
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # halfway through the cosine: (1 + 0.1) / 2
    assert lr_at(110, **kw) == pytest.approx(0.1)


def test_wsd_schedule_known_steps():
    kw = dict(lr=1.0, min_lr=0.0, warmup_steps=4, steps=100, schedule="wsd", wsd_decay_frac=0.2)
    assert lr_at(1, **kw) == pytest.approx(0.5)
    assert lr_at(50, **kw) == pytest.approx(1.0)
    assert lr_at(79, **kw) == pytest.approx(1.0)
    assert lr_at(80, **kw) == pytest.approx(1 - 1 / 20)
    assert lr_at(89, **kw) == pytest.approx(0.5)
    assert lr_at(99, **kw) == pytest.approx(0.0)
    assert lr_at(89, **{**kw, "wsd_decay_shape": "sqrt"}) == pytest.approx(1 - math.sqrt(0.5))


# ---------------------------------------------------------------- config

def test_settings_stored_under_retired_names_are_read():
    """A train_config.json / lab.json written before a setting was renamed or retired reads as today's settings."""
    from gated_attention.train.config import RENAMED_KEYS, TrainConfig

    old = {**tiny().to_dict(), "inject_nan_steps": []}  # retired: fault injection is the tests' hook now
    assert RENAMED_KEYS["inject_nan_steps"] is None and TrainConfig.from_dict(old) == tiny()
    with pytest.raises(ValueError, match="unknown TrainConfig keys"):
        TrainConfig.from_dict({**tiny().to_dict(), "bogus": 1})


def test_set_overrides_typed_and_checked():
    cfg = apply_overrides(tiny(), ["lr=1e-2", "steps=7", "compile=false", "retrieval_tasks=a,b", "domains=none",
                                   "model.num_hidden_layers=3"], model_fields={"num_hidden_layers": 2})
    assert cfg.lr == 1e-2 and cfg.steps == 7 and cfg.compile == "false" and cfg.retrieval_tasks == ["a", "b"]
    assert cfg.domains is None and cfg.model_overrides == {"num_hidden_layers": 3}
    with pytest.raises(ValueError, match="unknown training setting.*valid:.*warmup_steps"):
        apply_overrides(tiny(), ["lrr=1"])
    with pytest.raises(ValueError, match="unknown model-config field 'n_layers'.*num_hidden_layers"):
        apply_overrides(tiny(), ["model.n_layers=2"], model_fields={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="fp16"):
        apply_overrides(tiny(), ["precision=fp16"])
    with pytest.raises(ValueError, match="steps"):
        apply_overrides(tiny(), ["steps=abc"])


def test_param_groups_no_decay_on_norms_biases_embeddings():
    from gated_attention.train.model_setup import build_model_config

    cfg = tiny()
    model = build_lm(build_model_config(cfg), seed=None, eval=False)
    decay, no_decay = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any("embed_tokens" in names[id(p)] for p in no_decay["params"])
    n_unique = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_unique


# ---------------------------------------------------------------- training

def test_loss_falls_and_outputs(tmp_path):
    cfg = apply_overrides(tiny(), ["steps=30", "lr=1e-2"])
    s = train(cfg, tmp_path)
    ls = losses(tmp_path)
    assert len(ls) == 30
    assert sum(ls[-5:]) / 5 < ls[0] - 0.5, ls
    rec = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "update_ratio", "max_act", "lost_update_share"):
        assert key in rec
    assert len(rec["max_act"]) == 2 and rec["update_ratio"] > 0
    assert len(rec["lost_update_share"]) == 2 and all(0 <= x <= 1 for x in rec["lost_update_share"])
    for key in ("final_loss", "val_losses", "spikes", "skipped_steps", "diverged", "tokens", "wall_time_s"):
        assert key in s
    assert s["tokens"] == 30 * cfg.batch_size * cfg.seq_len and not s["diverged"]
    assert (tmp_path / "final" / "config.json").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == ls[-1]


def test_nan_steps_skipped_and_counted(tmp_path):
    cfg = apply_overrides(tiny(), ["steps=10", "stats_every=1"])
    with nan_at_steps({3, 4}):
        s = train(cfg, tmp_path)
    recs = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert s["skipped_steps"] == 2 and not s["diverged"]
    assert [r["skipped"] for r in recs] == [i in (3, 4) for i in range(10)]
    assert recs[3]["update_ratio"] == 0.0  # no update on a skipped step
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(recs) if i not in (3, 4))


def test_nan_run_stops_after_k_in_a_row(tmp_path):
    cfg = apply_overrides(tiny(), ["steps=20", "max_bad_steps=3"])
    with nan_at_steps({2, 3, 4, 5, 6, 7}):
        s = train(cfg, tmp_path)
    assert s["diverged"] and s["skipped_steps"] == 3 and s["steps"] == 5
    assert "3 non-finite steps in a row" in s["stop_reason"]


def test_spike_detector():
    det = SpikeDetector(window=5, delta=0.1, noise_k=0.0)  # the plain 0.1-nat rule
    seq = [3.0, 2.9, 2.95, 2.9, 2.92, 3.05, 2.9, 3.5, float("nan"), 2.9]
    flags = [det.update(i, v) for i, v in enumerate(seq)]
    assert flags == [False] * 5 + [True, False, True, False, False]
    assert [s["step"] for s in det.spikes] == [5, 7]
    det2 = SpikeDetector()
    det2.load_state_dict(det.state_dict())
    assert det2.update(10, 5.0) and len(det2.spikes) == 3


def test_spike_detector_scales_with_small_batch_noise():
    # a window whose step-to-step noise (MAD 0.2 nats) is larger than delta: +0.3 is noise, +2.0 is a spike
    window = [3.0, 3.2, 2.8, 3.25, 2.75, 3.0, 3.2, 2.8, 3.0, 3.2]
    plain, robust = SpikeDetector(window=10, delta=0.1, noise_k=0.0), SpikeDetector(window=10, delta=0.1)
    for i, v in enumerate(window):
        plain.update(i, v), robust.update(i, v)
    median, margin = robust.threshold()
    assert median == 3.0 and margin == pytest.approx(6 * 1.4826 * 0.2)
    assert plain.update(10, 3.3) and not robust.update(10, 3.3)
    assert robust.update(11, 5.0)


# ---------------------------------------------------------------- exact resume after SIGKILL

def _gattn_train(out: Path, sets: list[str], env_extra: dict | None = None, resume: bool = False):
    args = ["train", "--preset", "tiny", "--out", out, *sum((["--set", s] for s in sets), [])]
    return run_gattn(*args, *(["--resume"] if resume else []), env=env_extra, timeout=300, kill_hooks=True)


RESUME_SETS = ["steps=12", "ckpt_every=4", "keep_checkpoints=2", "stats_every=5"]


def test_sigkill_resume_is_exact(tmp_path):
    ref = tmp_path / "ref"
    train(apply_overrides(tiny(), RESUME_SETS), ref)
    # killed after step 9 (checkpoint at 8 exists), then resumed
    run = tmp_path / "killed"
    p = _gattn_train(run, RESUME_SETS, {"GATTN_TEST_KILL_AT_STEP": "9"})
    assert p.returncode == -9, p.stderr[-2000:]
    assert len(losses(run)) == 10
    p = _gattn_train(run, RESUME_SETS, resume=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert losses(run) == losses(ref)  # bitwise: same batches, same state, same order
    assert [s for s, _ in list_checkpoints(run)] == [8, 12]  # rotation kept the last 2
    # killed inside the 2nd checkpoint write (step 8): the partial write is invisible, resume from step 4
    run2 = tmp_path / "killed_in_write"
    p = _gattn_train(run2, RESUME_SETS, {"GATTN_TEST_KILL_IN_CKPT_WRITE": "2"})
    assert p.returncode == -9, p.stderr[-2000:]
    assert [s for s, _ in list_checkpoints(run2)] == [4]
    assert any(x.name.startswith(".tmp-") for x in (run2 / "checkpoints").iterdir())
    p = _gattn_train(run2, RESUME_SETS, resume=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert losses(run2) == losses(ref)
    assert not any(x.name.startswith(".tmp-") for x in (run2 / "checkpoints").iterdir())


class _Recorder:
    """A step hook with state that draws from the global RNG (as a probe on random inputs would)."""

    def __init__(self, fail_at: int | None = None):
        self.records, self.fail_at = [], fail_at

    def __call__(self, steps_done, model):
        import torch

        if steps_done == self.fail_at:
            raise KeyboardInterrupt("stopped")  # the process dies here, before this step's checkpoint
        self.records.append([steps_done, float(torch.rand(()))])

    def state_dict(self):
        return {"records": self.records}

    def load_state_dict(self, st):
        self.records = [list(r) for r in st["records"]]


def test_step_hook_state_resumes_with_the_run(tmp_path):
    """A stateful step hook ends a killed-and-resumed run holding what it holds after an uninterrupted one, the losses
    stay the same although it draws random numbers (the checkpoint is written after the step's hook: it holds the
    hook's records and the RNG after its draws), and a reused finished run restores it from the final checkpoint."""
    from gated_attention.experiment.runs import train_or_reuse

    cfg = apply_overrides(tiny(), ["steps=8", "ckpt_every=4"])
    ref = _Recorder()
    train(cfg, tmp_path / "ref", step_hook=ref)
    assert [r[0] for r in ref.records] == list(range(1, 9))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", step_hook=_Recorder(fail_at=6))
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [4]
    again = _Recorder()
    train_or_reuse(cfg, tmp_path / "run", lambda m: None, step_hook=again)  # resumes from step 4
    assert again.records == ref.records and losses(tmp_path / "run") == losses(tmp_path / "ref")
    reused = _Recorder()
    train_or_reuse(cfg, tmp_path / "run", lambda m: None, step_hook=reused)
    assert reused.records == ref.records


def test_fresh_run_refuses_existing_checkpoints(tmp_path):
    cfg = apply_overrides(tiny(), ["steps=2"])
    train(cfg, tmp_path)
    with pytest.raises(ValueError, match="--resume"):
        train(cfg, tmp_path)
    with pytest.raises(ValueError, match=r"differ.*lr: saved"):
        train(apply_overrides(cfg, ["lr=5e-3"]), tmp_path, resume=True)


# ---------------------------------------------------------------- a lab's plug-ins (train/plugins.py)

class _Batches:
    """A custom source: the synthetic chain's batches, counted."""

    domains: list = []
    tokenizer = None

    def __init__(self, vocab: int):
        from gated_attention.train.data_source import SyntheticSource

        self.inner, self.vocab_size, self.calls = SyntheticSource(vocab), vocab, []

    def train_batch(self, batch_size, seq_len, seed, step, rows=None):
        self.calls.append(step)
        return self.inner.train_batch(batch_size, seq_len, seed, step, rows=rows)

    def eval_batches(self, *a):
        return iter(())


class _Push:
    """Extra loss: +10 x sum of the final norm's weight (Adam then lowers every entry by ~lr per step); logs it."""

    needs_logits = True

    def __init__(self):
        self.model, self.seen, self.contexts = None, [], 0

    def forward_context(self, step, model):
        from contextlib import nullcontext

        self.model, self.contexts = model, self.contexts + 1
        return nullcontext()

    def __call__(self, step, inputs, targets, output, ce):
        self.seen.append((step, tuple(output.logits.shape), float(ce.detach())))
        w = self.model.model.norm.weight
        return 10.0 * w.sum(), {"norm_sum": float(w.detach().sum())}


class _Snapshots:
    """Step hook with begin(): the weights as built and after each step."""

    def __init__(self):
        self.at = {}

    def begin(self, model):
        self.at[0] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def __call__(self, steps_done, model):
        self.at[steps_done] = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plugins_source_groups_phases_extra_loss_and_begin(tmp_path):
    from gated_attention.train.plugins import Plugins

    cfg = apply_overrides(tiny(), ["steps=4", "lr=1e-2", "warmup_steps=0", "min_lr=1e-2", "grad_accum=2",
                                   "data=custom", "stats_every=0", "fast=false"])
    source, push, snaps = _Batches(256), _Push(), _Snapshots()
    emb, norm = "model.embed_tokens.weight", "model.norm.weight"

    def groups(m):  # the (tied) embedding at lr_mult 0 (never moves); everything else at the full LR, no decay
        return [{"params": [p for n, p in m.named_parameters() if n != emb], "weight_decay": 0.0},
                {"params": [p for n, p in m.named_parameters() if n == emb], "weight_decay": 0.0, "lr_mult": 0.0}]

    def phase(step, m):  # the first two steps train only the final norm
        for n, p in m.named_parameters():
            p.requires_grad_(step >= 2 or n == norm)

    train(cfg, tmp_path, step_hook=snaps,
          plugins=Plugins(source=source, param_groups=groups, trainable_at=phase, extra_loss=push))
    assert source.calls == [0, 1, 2, 3] and sorted(snaps.at) == [0, 1, 2, 3, 4]
    b = cfg.batch_size // cfg.grad_accum
    assert push.contexts == 8 and [s for s, _, _ in push.seen] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(shape[:2] == (b, cfg.seq_len) for _, shape, _ in push.seen)  # full logits: needs_logits
    recs = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in recs] == pytest.approx([(a + c) / 2 for (_, _, a), (_, _, c) in
                                                      zip(push.seen[::2], push.seen[1::2])])  # the CE, not + extra
    assert all("norm_sum" in r["extra"] for r in recs)
    w0, w2, w4 = (snaps.at[k] for k in (0, 2, 4))
    assert torch.equal(w0[emb], w4[emb])  # lr_mult 0
    moved = [n for n in w0 if n not in (norm, emb) and not torch.equal(w0[n], w2[n])]
    assert not moved, moved  # the first phase trains the norm only
    assert all(not torch.equal(w2[n], w4[n]) for n in w0 if n != emb)  # then everything trains
    assert bool(((w0[norm] - w4[norm]) > 0.5 * 4 * 1e-2).all())  # the extra term: Adam lowers each entry ~lr a step
    with pytest.raises(ValueError, match="data='custom' without a plug-in source"):
        train(cfg, tmp_path / "nosource")
    with pytest.raises(ValueError, match="data='synthetic' with a plug-in source"):
        train(apply_overrides(cfg, ["data=synthetic"]), tmp_path / "mixed", plugins=Plugins(source=source))


# ---------------------------------------------------------------- eval CLI

def test_eval_cli(tmp_path, capsys):
    from gated_attention.cli import main

    train(apply_overrides(tiny(), ["steps=3"]), tmp_path)
    assert main(["eval", str(tmp_path), "--batches", "2", "--batch-size", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["losses"]) == {"synthetic"} and len(res["pos_loss"]) == tiny().seq_len
    assert res["avg_ppl"] == pytest.approx(sum(res["ppl"].values()) / len(res["ppl"]))
    assert res["ppl"]["synthetic"] == pytest.approx(math.exp(res["losses"]["synthetic"]))
    assert main(["eval", str(tmp_path), "--batches", "1", "--batch-size", "2"]) == 0
    assert "Avg PPL" in capsys.readouterr().out


class _Watch:
    """An observe plug-in: records what it sees of every micro-batch's forward and logs one float."""

    def __init__(self, needs_logits: bool):
        self.needs_logits, self.seen = needs_logits, []

    def __call__(self, step, fwd):
        logits = fwd.output.logits
        self.seen.append((step, tuple(fwd.inputs.shape), None if logits is None else tuple(logits.shape),
                          float(fwd.ce), fwd.ce.requires_grad))
        return {"watched": float(fwd.inputs.float().mean())}


def test_observe_plugin_watches_without_changing_the_run(tmp_path):
    """observe(step, fwd) sees each micro-batch (inputs, output, detached CE) and logs under "extra"; the run's losses
    and weights are those of the run without it, bit for bit. Without needs_logits the chunked fused loss stays on
    (no logits); with it the forward returns the full logits."""
    from safetensors.torch import load_file

    from gated_attention.train.plugins import Plugins

    cfg = apply_overrides(tiny(), ["steps=3", "grad_accum=2", "stats_every=0", "fast=true", "compile=false",
                                   "precision=fp32"])
    train(cfg, tmp_path / "plain")
    b = cfg.batch_size // cfg.grad_accum
    for needs in (False, True):
        watch = _Watch(needs)
        run = tmp_path / f"watched{needs}"
        train(cfg, run, plugins=Plugins(observe=watch))
        assert [s for s, *_ in watch.seen] == [0, 0, 1, 1, 2, 2]
        assert all(shape == (b, cfg.seq_len) and not grad for _, shape, _, _, grad in watch.seen)
        recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in recs] == pytest.approx([(a[3] + c[3]) / 2 for a, c in
                                                          zip(watch.seen[::2], watch.seen[1::2])], abs=1e-6)
        assert all("watched" in r["extra"] for r in recs)
        if not needs:  # the chunked loss kept, and the observer changes nothing
            assert all(lg is None for _, _, lg, _, _ in watch.seen)
            plain = [json.loads(line)["loss"] for line in (tmp_path / "plain" / "log.jsonl").read_text().splitlines()]
            assert [r["loss"] for r in recs] == plain
            a, c = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "plain", run))
            assert all(torch.equal(a[k], c[k]) for k in a)
        else:
            assert all(lg is not None and lg[:2] == (b, cfg.seq_len) for _, _, lg, _, _ in watch.seen)



def test_a_data_dir_means_training_on_that_corpus():
    """`gattn train --preset tiny --data-dir DIR` trains on DIR (the tiny preset's synthetic data used to ignore it
    silently unless --set data=corpus was added too); data=synthetic with a corpus folder is one clear error."""
    from gated_attention.train.overrides import config_from_args

    assert config_from_args("tiny", None, [], "data").data == "corpus"
    assert config_from_args("tiny", None, [], None).data == "synthetic"
    assert config_from_args("tiny", None, ["data=corpus"], "data").data == "corpus"
    with pytest.raises(ValueError, match="synthetic data reads no corpus"):
        config_from_args("tiny", None, ["data=synthetic"], "data")
