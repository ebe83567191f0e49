"""lm-evaluation-harness on an exported checkpoint (runs only when the optional `eval` extra is installed).

A tiny model is trained on a tiny prepared corpus (so RUN/final holds weights AND tokenizer, as for real runs), then
`gattn lm-eval run --model hf ...` scores a local 5-question multiple-choice task (task YAML + JSONL in a temp dir,
fully offline). The harness's per-choice log-likelihoods must equal the ones computed here directly with the model,
and its accuracy must equal the accuracy those imply.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _extras import need  # noqa: E402

need("lm_eval", "pip install -e '.[eval]' (lm-evaluation-harness)")
need("accelerate", "lm-eval's HF model needs accelerate: pip install -e '.[eval]'")

from transformers import AutoTokenizer  # noqa: E402

from gated_attention import GatedQwen3ForCausalLM  # noqa: E402
from gated_attention.train.train_presets import tiny  # noqa: E402
from gated_attention.train.trainer import train  # noqa: E402
from harness import prepare_text_corpus, run_gattn  # noqa: E402

QUESTIONS = [
    {"question": "The cat sat on the", "choices": ["mat.", "moon.", "river."], "answer": 0},
    {"question": "The dog ran to the", "choices": ["sky.", "park.", "number."], "answer": 1},
    {"question": "One, two, three,", "choices": ["four.", "blue.", "cat."], "answer": 0},
    {"question": "Red, green,", "choices": ["seven.", "the.", "blue."], "answer": 2},
    {"question": "The bird flew over the", "choices": ["tree.", "spoon.", "idea."], "answer": 0},
]

TASK_YAML = """task: gattn_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _corpus_text() -> str:
    lines = ["The cat sat on the mat.", "The dog ran to the park.", "One, two, three, four.", "Red, green, blue.",
             "The bird flew over the tree."]
    g = torch.Generator().manual_seed(0)
    return "\n".join(lines[int(i)] for i in torch.randint(0, len(lines), (1500,), generator=g)) + "\n"


def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenised as lm-eval's HF model does: the pair is encoded whole and split at
    the context's token count (no BOS for this model type)."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    ids = torch.tensor([ctx + cont])  # (1, T)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), dim=-1)  # (1, T-1, V)
    picked = logp[0, len(ctx) - 1:].gather(-1, torch.tensor(cont)[:, None])  # (len(cont), 1)
    return picked.sum().item()


def test_lm_eval_hf_on_local_task(tmp_path):
    prepare_text_corpus(tmp_path / "data", {"text": [_corpus_text()]}, vocab_size=300, chunk_chars=2048,
                        val_fraction=0.2)
    cfg = tiny()
    cfg.data, cfg.data_dir, cfg.steps, cfg.ckpt_every, cfg.stats_every = "corpus", str(tmp_path / "data"), 30, 0, 0
    cfg.gate, cfg.precision = "sdpa_elementwise", "fp32"
    train(cfg, tmp_path / "run")
    final = tmp_path / "run" / "final"
    assert (final / "tokenizer.json").is_file() and (final / "config.json").is_file()

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tasks / "gattn_tiny_mc.yaml").write_text(TASK_YAML.format(data=tasks / "data.jsonl"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "HF_HOME": str(tmp_path / "hf_home")}
    proc = run_gattn("lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={final},dtype=float32",
                     "--tasks", "gattn_tiny_mc", "--include_path", tasks, "--device", "cpu", "--batch_size", "1",
                     "--output_path", tmp_path / "out", "--log_samples", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(l) for l in next((tmp_path / "out").rglob("samples_gattn_tiny_mc_*.jsonl")).read_text()
               .splitlines()]
    assert len(samples) == len(QUESTIONS)
    model = GatedQwen3ForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        q = QUESTIONS[s["doc_id"]]
        ours = [_loglikelihood(model, tok, q["question"], " " + c) for c in q["choices"]]  # lm-eval's " " delimiter
        theirs = [float(r[0][0]) for r in s["resps"]]  # one [loglikelihood, is_greedy] per choice
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-4)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == q["answer"])
    assert results["results"]["gattn_tiny_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))


def test_wrapper_needs_a_subcommand(capsys):
    from gated_attention.cli import main

    assert main(["lm-eval", "--", "--model", "hf"]) == 2
    assert "start with an lm-eval subcommand" in capsys.readouterr().err
