"""Long context, parts 3-4: retrieval mixing in training batches, `gattn extend --finetune-steps`, `gattn longctx`.

Everything runs on a corpus prepared from a few generated text files (small BPE vocabulary) and the tiny model preset.
"""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from gated_attention import data as D
from gated_attention.cli import main
from harness import prepare_text_corpus
from gated_attention.longctx import pipeline as P
from gated_attention.longctx import ruler
from gated_attention.train import retrieval_mix as M
from gated_attention.train.config import TrainConfig
from gated_attention.train.train_presets import tiny
from gated_attention.train.data_source import CorpusSource, make_source

# words of the prompts and of ruler's noise haystack, so the small BPE vocabulary holds them as few tokens
WORDS = ("the grass is green sky blue sun yellow here we go there and back again what pass key remember it "
         "special magic numbers for hidden in text below memorize them afterwards you will be asked about "
         "important piece of information inside lot irrelevant find a king queen river castle night day old new "
         "light dark walked spoke said to from with on at by this that one two three").split()


def _text(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    paras = []
    for _ in range(paragraphs):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
                 for _ in range(rng.randint(3, 8))]
        paras.append(" ".join(sents))
    return "\n\n".join(paras) + "\n"


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    return prepare_text_corpus(out, {"prose": [_text(i, 60) for i in range(8)]}, vocab_size=600,
                               src=tmp_path_factory.mktemp("src"), val_fraction=0.3, chunk_chars=2000)


# ---------------------------------------------------------------------------------------------------------------------
# retrieval mixing
def test_retrieval_mix_deterministic_by_seed_and_step(corpus_dir):
    source = CorpusSource(corpus_dir, None)
    corpus = source.corpus
    mixed = M.RetrievalMixSource(source, 0.5, ["passkey", "niah_single_1"])
    plain = source.train_batch(8, 160, 3, 5)  # (B, T+1)
    a = mixed.train_batch(8, 160, 3, 5)
    b = M.RetrievalMixSource(CorpusSource(corpus_dir, None), 0.5, ["passkey", "niah_single_1"]).train_batch(8, 160, 3, 5)
    assert a.shape == plain.shape == (8, 161) and a.dtype == plain.dtype
    assert torch.equal(a, b)  # a fresh process-equivalent source gives the same batch
    changed = (a != plain).any(1)
    assert int(changed.sum()) == 4  # round(0.5 * 8) rows replaced, the others untouched
    assert torch.equal(a[~changed], plain[~changed])
    for row in a[changed]:
        ids = row.tolist()
        assert ids[0] == corpus.bos_id and corpus.eos_id in ids
        cut = ids.index(corpus.eos_id)
        text = corpus.tokenizer.decode(ids[1:cut])
        # the row is a whole sample: its prompt and its answer, then corpus text fills the rest of the length
        assert "pass key" in text or "special magic numbers" in text
        answer = text.rsplit("are:" if "magic" in text else "pass key is", 1)[1].strip().rstrip(".")
        assert answer.isdigit() and text.count(answer) >= 2  # planted in the haystack and given as the answer
    # another step, or another seed, draws other rows/samples
    assert not torch.equal(mixed.train_batch(8, 160, 3, 6)[changed], a[changed])
    assert not torch.equal(mixed.train_batch(8, 160, 4, 5), a)
    # fraction 0 leaves the batch alone; eval batches are never mixed (validation PPL stays corpus text)
    assert torch.equal(M.mix_retrieval(plain, mixed.mix_tokenizer, 0.0, 3, 5), plain)
    assert torch.equal(next(mixed.eval_batches("prose", 64, 1, 2)), next(source.eval_batches("prose", 64, 1, 2)))


def test_retrieval_mix_config_hook(corpus_dir):
    cfg = dataclasses.replace(tiny(), data="corpus", data_dir=corpus_dir, retrieval_mix=0.25).validate()
    src = make_source(cfg)
    assert isinstance(src, M.RetrievalMixSource) and src.tasks == M.DEFAULT_MIX_TASKS
    assert not isinstance(make_source(dataclasses.replace(cfg, retrieval_mix=0.0)), M.RetrievalMixSource)
    with pytest.raises(ValueError, match="needs data='corpus'"):
        dataclasses.replace(tiny(), retrieval_mix=0.5).validate()  # tiny trains on synthetic tokens
    with pytest.raises(ValueError, match="needs a corpus haystack"):
        dataclasses.replace(cfg, retrieval_tasks=["niah_single_2"]).validate()
    with pytest.raises(ValueError, match="unknown"):
        dataclasses.replace(cfg, retrieval_tasks=["nope"]).validate()
    with pytest.raises(ValueError, match=r"retrieval_mix=1.5 must be in \[0, 1\]"):
        dataclasses.replace(cfg, retrieval_mix=1.5).validate()
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_bos_tokenizer_prompt_lengths(corpus_dir):
    corpus = D.Corpus(corpus_dir)
    tok = M.BosTokenizer(corpus.tokenizer, corpus.bos_id)
    s = ruler.generate_sample("passkey", tok, 200, seed=1)
    ids = ruler.encode(tok, s["prompt"])
    assert ids[0] == corpus.bos_id and len(ids) == s["length"] <= 200
    assert ruler.decode(tok, ids) == s["prompt"]


# ---------------------------------------------------------------------------------------------------------------------
# gattn extend --finetune-steps
@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def trained(corpus_dir, tmp_path_factory):
    from gated_attention.train.trainer import train

    run = tmp_path_factory.mktemp("run")
    cfg = dataclasses.replace(tiny(), data="corpus", data_dir=corpus_dir, steps=3, seq_len=32, batch_size=4,
                              ckpt_every=0, precision="fp32", model_overrides={"max_position_embeddings": 32})
    train(cfg, run)
    return run


def test_extend_finetune_steps(trained, tmp_path):
    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from gated_attention.longctx.extend import extended_config
    from gated_attention.modeling import GatedQwen3ForCausalLM

    src = trained / "final"
    dst = tmp_path / "ext"
    rc = main(["extend", str(src), "--method", "yarn", "--factor", "2", "--rope-theta", "50000",
               "--finetune-steps", "2", "--seq-len", "64", "--out", str(dst)])
    assert rc == 0
    cfg = json.loads((dst / "config.json").read_text())
    want = extended_config(json.loads((src / "config.json").read_text()), "yarn", 2.0, 50000.0)
    assert cfg["rope_parameters"] == want["rope_parameters"]
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["max_position_embeddings"] == 64
    # it trained: two more steps at the new length, from the extended weights
    log = [json.loads(line) for line in (tmp_path / "ext.finetune" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1]
    saved = json.loads((tmp_path / "ext.finetune" / "train_config.json").read_text())
    assert saved["seq_len"] == 64 and saved["steps"] == 2
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    # it loads (ours and through the Auto classes) with the new RoPE, and runs past the old length
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert isinstance(model, GatedQwen3ForCausalLM) and model.config.rope_parameters["rope_type"] == "yarn"
    assert torch.isfinite(model(input_ids=torch.randint(0, 100, (1, 64))).logits).all()
    assert (dst / "tokenizer.json").exists()
    # DST is published only once: a second run refuses to overwrite it, and --seq-len alone is an error
    assert main(["extend", str(src), "--finetune-steps", "1", "--seq-len", "64", "--out", str(dst)]) == 2
    assert main(["extend", str(src), "--seq-len", "64", "--out", str(tmp_path / "x")]) == 2


def test_extend_default_method_changes_only_the_base(trained, tmp_path):
    from gated_attention.longctx.extend import extend_checkpoint

    new = extend_checkpoint(trained / "final", tmp_path / "base", "default", 4.0, rope_theta=1e6)
    assert new["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert new["max_position_embeddings"] == 128


# ---------------------------------------------------------------------------------------------------------------------
# gattn longctx
def test_pipeline_small_budget_writes_report_and_reuses(corpus_dir, tmp_path):
    out = tmp_path / "lc"
    logs: list[str] = []
    b = dataclasses.replace(P.BUDGETS["small"], steps=4)
    rep = P.run_pipeline(out, b, corpus_dir, log=logs.append)
    for name in ("report.md", "report.html", "report.json", "report.png"):
        assert (out / name).stat().st_size > 0
    page = (out / "report.html").read_text()  # the same tables, one self-contained file (the figure embedded)
    assert "<table>" in page and "data:image/png;base64," in page and 'src="report.png"' not in page
    assert rep["lengths"] == [128, 256, 512, 1024]
    assert [(r["gate"], r["variant"]) for r in rep["rows"]] == [
        ("baseline", "none"), ("sdpa_elementwise", "none"), ("baseline", "yarn"), ("sdpa_elementwise", "yarn")]
    saved = json.loads((out / "report.json").read_text())
    assert len(saved["pos_loss"]["baseline-yarn"]) == 1024
    for row in saved["rows"]:
        assert set(row["average"]) == {"128", "256", "512", "1024"}
        assert all(0.0 <= v <= 100.0 for v in row["average"].values())
        assert all(p > 1.0 for p in row["ppl_buckets"].values())
    # the two models differ in their gate, were trained with the retrieval mix, and YaRN extends over L
    for gate in ("baseline", "sdpa_elementwise"):
        tc = json.loads((out / "runs" / gate / "seed0" / "train_config.json").read_text())
        assert tc["gate"] == gate and tc["retrieval_mix"] == b.retrieval_mix and tc["seq_len"] == 256
        ev = json.loads((out / "eval" / f"{gate}-seed0-yarn.json").read_text())
        assert ev["rope_parameters"]["rope_type"] == "yarn"
        assert ev["rope_parameters"]["original_max_position_embeddings"] == 256
        assert ev["rope_parameters"]["factor"] == 4.0
        assert len(ev["records"]) == len(b.mix_tasks) * 4 * b.samples
    for row in saved["rows"]:  # the continuous recall measure exists wherever a score does
        assert all(v > 0 and (row["average"][n] is not None) for n, v in row["answer_nll"].items() if v is not None)
    # answer NLL == cross-entropy of the answer tokens read off a full forward pass
    from gated_attention.modeling import GatedQwen3ForCausalLM

    model = GatedQwen3ForCausalLM.from_pretrained(out / "runs" / "baseline" / "seed0" / "final").eval()
    corpus = D.Corpus(corpus_dir)
    tok = M.BosTokenizer(corpus.tokenizer, corpus.bos_id)
    s = ruler.generate_sample("passkey", tok, 256, 0, 0)
    prompt = ruler.encode(tok, s["prompt"])
    answer = corpus.tokenizer.encode(ruler.completion(s), add_special_tokens=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]  # (T, V)
    ref = torch.nn.functional.cross_entropy(logits[len(prompt) - 1:-1], torch.tensor(answer))
    assert P.answer_nll(model, tok, s) == pytest.approx(float(ref), rel=1e-5)
    ev = json.loads((out / "eval" / "baseline-seed0-none.json").read_text())
    rec = next(r for r in ev["records"] if r["target_length"] == 256 and r["index"] == 0)
    assert rec["answer_nll"] == pytest.approx(float(ref), rel=1e-5)
    md = (out / "report.md").read_text()
    assert "| Baseline + YaRN -> 1024 |" in md and "| Gated (sdpa_elementwise) (256 model) |" in md
    # a re-run does no work: every stage is reused, the report is rewritten identically; data_dir=None means the
    # budget's corpus (here the same folder, already prepared, so nothing is prepared)
    logs.clear()
    P.run_pipeline(out, dataclasses.replace(b, data_dir=corpus_dir), log=logs.append)
    assert not any("not prepared" in m for m in logs)
    assert sum("reuse" in m for m in logs) == 2 + 2 + 4  # two runs, two YaRN copies, four evaluations
    assert not any("train " in m for m in logs)
    assert (out / "report.md").read_text() == md
    # a changed setting in the same folder fails loudly instead of mixing runs
    with pytest.raises(ValueError, match="other settings.*steps"):
        P.run_pipeline(out, dataclasses.replace(b, steps=5), corpus_dir, log=logs.append)


def test_pipeline_jobs_runs_cells_in_worker_processes_with_the_same_cache(corpus_dir, tmp_path):
    """--jobs 2: the (model, seed) cells train and score in two spawned workers; their stages are the same cached
    files, so a --jobs 1 re-run reuses every one and writes the same report."""
    out, logs = tmp_path / "lc", []
    b = dataclasses.replace(P.BUDGETS["small"], steps=2)
    rep = P.run_pipeline(out, b, corpus_dir, log=logs.append, jobs=2, threads=1)
    assert any("2 (model, seed) runs, 2 at a time" in m for m in logs)
    assert {(r["gate"], r["variant"]) for r in rep["rows"]} == {(g, v) for g in ("baseline", "sdpa_elementwise")
                                                                for v in ("none", "yarn")}
    md = (out / "report.md").read_text()
    logs.clear()
    P.run_pipeline(out, b, corpus_dir, log=logs.append, jobs=1)
    assert sum("reuse" in m for m in logs) == 2 + 2 + 4 and not any("train " in m for m in logs)
    assert (out / "report.md").read_text() == md


def test_trainer_step_hook_stops_and_pipeline_records_steps_to_skill(corpus_dir, tmp_path, monkeypatch):
    """The small budget with a stopper whose scorer says 'skilled' from the 3rd check: training ends at that step,
    the final checkpoint and summary say so, a re-run reuses it, and two seeds land in the report."""
    calls = []

    class Scorer:
        def __init__(self, tok, length, samples, seed, task="passkey"):
            self.seed = seed

        def __call__(self, model):
            calls.append(self.seed)
            n = sum(1 for c in calls if c == self.seed)
            return {"exact_match": 1.0 if n >= 3 else 0.0, "answer_nll": 0.1}

    from gated_attention.longctx import skill as S

    monkeypatch.setattr(S, "PasskeyScorer", Scorer)
    b = dataclasses.replace(P.BUDGETS["small"], steps=8, until_skill=0.9, skill_every=2, seeds=2,
                            models=("baseline",))
    out = tmp_path / "lc"
    logs: list[str] = []
    rep = P.run_pipeline(out, b, corpus_dir, factor=2, log=logs.append)
    for seed in (0, 1):
        run = out / "runs" / "baseline" / f"seed{seed}"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 6 and "skill reached" in summary["stop_reason"]
        assert (run / "final" / "model.safetensors").exists()
        assert [c["step"] for c in S.read_skill_log(run / "skill.jsonl")] == [2, 4, 6]
    assert [t["steps_to_skill"] for t in rep["training"]["baseline"]] == [6, 6]
    assert rep["seeds"] == [0, 1] and rep["lengths"] == [128, 256, 512]
    assert json.loads((out / "report.json").read_text())["claim"]["verdict"] == "not run here"  # no gated model
    logs.clear()
    P.run_pipeline(out, b, corpus_dir, factor=2, log=logs.append)
    assert not any(": training " in m or ": resuming " in m for m in logs) and sum("reuse" in m for m in logs) == 2 + 2 + 4
    with pytest.raises(ValueError, match="other settings.*stopping rule"):
        P.run_pipeline(out, dataclasses.replace(b, until_skill=0.5), corpus_dir, factor=2, log=logs.append)
    # a partial report: trains nothing, reports the finished baseline, lists the gated model as not started
    (out / "runs" / "sdpa_elementwise" / "seed0").mkdir(parents=True)
    (out / "runs" / "sdpa_elementwise" / "seed0" / "log.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (out / "runs" / "sdpa_elementwise" / "seed0" / "skill.jsonl").write_text('{"step": 2, "exact_match": 0.25}\n')
    rep = P.run_pipeline(out, b, corpus_dir, gates=["baseline", "sdpa_elementwise"], factor=2, log=logs.append,
                         report_only=True)
    assert not rep["complete"] and {r["model"] for r in rep["rows"]} == {"baseline"}
    assert [t["finished"] for t in rep["training"]["sdpa_elementwise"]] == [False]
    md = (out / "report.md").read_text()
    assert "**Partial report**" in md and "running (step 2, 25 % at step 2) | not started |" in md
    assert not (out / "runs" / "sdpa_elementwise" / "seed0" / "train_config.json").exists()


def test_missing_budget_corpus_is_prepared_with_its_vocabulary(tmp_path, monkeypatch):
    """The budget's corpus (experiment.ensure_corpus, tested on its own in test_experiment.py) is prepared with the
    budget's vocabulary before anything else runs."""
    calls = []
    monkeypatch.setattr(D, "prepare", lambda cfg: calls.append(cfg) or (_ for _ in ()).throw(RuntimeError("stop")))
    b = dataclasses.replace(P.BUDGETS["small"], data_dir=str(tmp_path / "v1k"), vocab_size=1024)
    with pytest.raises(RuntimeError, match="stop"):
        P.run_pipeline(tmp_path / "out", b, log=lambda m: None)
    assert [(c.data_dir, c.vocab_size) for c in calls] == [(str(tmp_path / "v1k"), 1024)]
    assert P.BUDGETS["default"].vocab_size == 1024 and P.BUDGETS["default"].data_dir == "data_v1k"


def test_budget_and_cli_errors(tmp_path, capsys):
    assert main(["longctx", "--budget", "small", "--tasks", "niah_single_2", "--out", str(tmp_path)]) == 2
    assert main(["longctx", "--budget", "small", "--factor", "3", "--out", str(tmp_path),
                 "--data-dir", str(tmp_path)]) == 2
    assert P.lengths_for(P.BUDGETS["default"], 4) == [128, 256, 512, 1024]
    for bad, msg in ((["--gates", "baseline:identity"], "no gate to initialise"),
                     (["--gates", "sdpa_elementwise:zeros"], "unknown gate init"),
                     (["--until-skill", "1.5"], "must be a fraction"), (["--seeds", "0"], "--seeds 0 must be"),
                     (["--gates", "baseline", "none"], "lists a model twice")):  # 'none' is the baseline's new name
        capsys.readouterr()
        assert main(["longctx", "--budget", "small", "--report-only", "--out", str(tmp_path), *bad]) == 2, bad
        assert msg in capsys.readouterr().err, bad


def test_stored_evaluation_follows_the_reuse_rule(tmp_path):
    """experiment.cache's policy on an evaluation: the same settings are reused, another setting stops the job with
    the setting named, a model trained again since (its file is newer) makes the stored result obsolete."""
    import os

    from gated_attention.experiment.cache import StaleResult

    model = tmp_path / "final"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    b, lengths, out_json = P.BUDGETS["small"], [128, 256], tmp_path / "eval.json"
    stored = P.experiment.cache.save(out_json, P.eval_settings(model, b, lengths, 0), {"average": {"128": 1.0}},
                                     key_field="settings")
    assert P.cached_eval(model, out_json, b, lengths, 0) == stored
    with pytest.raises(StaleResult, match="samples: saved 1 vs requested 5"):
        P.cached_eval(model, out_json, dataclasses.replace(b, samples=5), lengths, 0)
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # trained again
    assert P.cached_eval(model, out_json, b, lengths, 0) is None
