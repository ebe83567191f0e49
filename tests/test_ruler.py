"""RULER-style tasks: exact token lengths, needles planted exactly once, determinism, string-match scoring on planted
answers, evaluation plumbing (oracle model = 100, greedy+KV cache = plain greedy), training samples."""
from __future__ import annotations

import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from gated_attention.longctx import ruler
from harness import stock_lm

CORPUS = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
          "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors of Victory "
          "Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along with him! "
          "The hallway smelt of boiled cabbage and old rag mats? At one end of it a coloured poster, too large for "
          "indoor display, had been tacked to the wall.")


def make_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE trained on the tasks' own vocabulary (built here: nothing is downloaded)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = [ruler.NOISE, CORPUS, " ".join(ruler.ADJECTIVES), " ".join(ruler.NOUNS),
            "One of the special magic numbers for is: 0123456789. The pass key is VAR = Answer: Question: What"]
    tok.train_from_iterator(text * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


@pytest.fixture(scope="session")  # built once per worker (tests/conftest.py: scheduling)
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_lengths_needles_determinism(tok, task):
    target = 640
    s = ruler.generate_sample(task, tok, target, seed=3, index=1, corpus=CORPUS)
    assert s["length"] == len(tok.encode(s["prompt"])) <= target
    # needle haystacks grow by whole needle lines (~40 tokens here); word-level haystacks by one word
    slack = 120 if ruler.TASKS[task].haystack == "needle" else 40
    assert s["length"] >= target - slack, (s["length"], target)
    for needle in s["needles"]:
        assert s["prompt"].count(needle) == 1
    if ruler.TASKS[task].family == "niah":
        assert all(s["prompt"].count(a) == 1 for a in s["answers"])
        assert len(s["needles"]) == max(ruler.TASKS[task].num_keys, ruler.TASKS[task].num_queries) * \
            ruler.TASKS[task].num_values
    assert s["answers"] and all(a in s["prompt"] for a in s["answers"])
    assert s == ruler.generate_sample(task, tok, target, seed=3, index=1, corpus=CORPUS)  # deterministic
    assert s["prompt"] != ruler.generate_sample(task, tok, target, seed=4, index=1, corpus=CORPUS)["prompt"]


def test_fit_is_tight_with_a_byte_tokenizer():
    """A plain callable (UTF-8 bytes) works, and the fitted noise haystack is the longest that fits: one more word
    would overflow."""
    def byte_tok(text):
        return list(text.encode())

    for target in (700, 1000, 1733):
        s = ruler.generate_sample("niah_single_1", byte_tok, target, seed=0)
        assert s["length"] == len(s["prompt"].encode()) <= target
        longest_word = max(len(w) for w in ruler.NOISE.split()) + 1
        assert target - s["length"] <= longest_word
    n, prompt, length = ruler._fit(lambda n: "ab" * n, byte_tok, 101, "toy")
    assert (n, length) == (50, 100)


def test_task_semantics(tok):
    vt = ruler.generate_sample("vt", tok, 600, seed=1)
    chain = vt["answers"]
    assert len(chain) == 5 and f"VAR {chain[0]} = {vt['value']}." in vt["prompt"]
    order = [vt["prompt"].index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
    assert order == sorted(order) and vt["prompt"].index(f"VAR {chain[0]} =") < order[0]  # chain kept in order
    cwe = ruler.generate_sample("cwe", tok, 2000, seed=1)
    items = re.findall(r"^\d+\. (\S+)$", cwe["prompt"], flags=re.M)
    counts = {w: items.count(w) for w in set(items)}
    assert len(cwe["answers"]) == cwe["num_cw"]
    assert min(counts[w] for w in cwe["answers"]) > max(c for w, c in counts.items() if w not in cwe["answers"])
    fwe = ruler.generate_sample("fwe", tok, 1500, seed=1)
    words = fwe["prompt"].split("\n")[1].replace(" .... ", " ").split()
    top = sorted(set(words), key=words.count, reverse=True)
    assert fwe["answers"] == top[:3] and words.count(top[2]) > words.count(top[3])
    mq = ruler.generate_sample("niah_multiquery", tok, 800, corpus=CORPUS)
    assert all(k in mq["prompt"].split("\n")[-1] for k in mq["keys"])


def test_errors(tok):
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.generate_sample("qa_1", tok, 512)
    with pytest.raises(ValueError, match="corpus"):
        ruler.generate_sample("niah_single_2", tok, 512)
    with pytest.raises(ValueError, match="empty haystack"):
        ruler.generate_sample("niah_multivalue", tok, 40, corpus=CORPUS)


def test_scoring_on_planted_answers():
    refs = [["1234567", "7654321"], ["ivory-ember"]]
    assert ruler.score(["The numbers are 1234567 and 7654321.", "IVORY-EMBER"], refs) == 100.0
    assert ruler.score(["only 1234567", "nothing"], refs, "all") == 25.0
    assert ruler.score(["only 1234567", "nothing"], refs, "part") == 50.0
    assert ruler.score(["", ""], refs) == 0.0
    with pytest.raises(ValueError, match="metric"):
        ruler.score(["x"], [["x"]], "exact")


class Oracle(torch.nn.Module):
    """Answers NIAH prompts by reading the needle back (or not at all): checks evaluate's bookkeeping end to end."""

    def __init__(self, tok, correct=True):
        super().__init__()
        self.tok, self.correct, self.w = tok, correct, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, max_new_tokens, **kw):
        prompt = self.tok.decode(input_ids[0], skip_special_tokens=True)
        key = re.search(r"for (\S+) mentioned in the text above\? ", prompt).group(1)
        value = re.search(rf"for {re.escape(key)} is: (\S+)\.", prompt).group(1) if self.correct else "none"
        new = torch.tensor([self.tok.encode(f" {value}.\nnext", add_special_tokens=False)])  # (1, new)
        return torch.cat([input_ids, new[:, :max_new_tokens]], dim=1)


def test_evaluate_with_oracle(tok):
    res = ruler.evaluate(Oracle(tok), tok, ["niah_single_1", "niah_multikey_2"], [512, 700], samples=2, seed=0)
    assert res["scores"] == {"niah_single_1": {512: 100.0, 700: 100.0}, "niah_multikey_2": {512: 100.0, 700: 100.0}}
    assert res["average"] == {512: 100.0, 700: 100.0} and len(res["records"]) == 8
    bad = ruler.evaluate(Oracle(tok, correct=False), tok, ["niah_single_1"], [512], samples=2)
    assert bad["scores"]["niah_single_1"][512] == 0.0


def test_evaluate_tiny_llama_greedy_kv_cache(tok):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = stock_lm(cfg)
    res = ruler.evaluate(model, tok, ["passkey", "vt"], [600], samples=1, max_new_tokens=6, seed=0)
    assert set(res["scores"]) == {"passkey", "vt"} and 0.0 <= res["average"][600] <= 100.0
    assert [(r["task"], r["target_length"]) for r in res["records"]] == [("passkey", 600), ("vt", 600)]
    # greedy with the KV cache == greedy recomputing the whole sequence each step
    prompt = ruler.generate_sample("passkey", tok, 300)["prompt"]
    ids = torch.tensor([tok.encode(prompt)])  # (1, T)
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    expected = tok.decode(ids[0, -5:], skip_special_tokens=True)
    assert ruler.predict(model, tok, prompt, 5) == expected


def test_training_samples(tok):
    samples = ruler.training_samples(tok, 12, max_len=400, seed=7)
    assert len(samples) == 12
    assert [s["task"] for s in samples] == [ruler.NO_CORPUS_TASKS[i % len(ruler.NO_CORPUS_TASKS)] for i in range(12)]
    for s in samples:
        assert s["text"].startswith(s["prompt"]) and s["text_length"] == len(tok.encode(s["text"])) <= 400
        assert all(a in s["text"][len(s["prompt"]):] for a in s["answers"])
    assert [s["text"] for s in samples] == [s["text"] for s in ruler.training_samples(tok, 12, max_len=400, seed=7)]
    evals = {ruler.generate_sample(s["task"], tok, s["target_length"], 7, s["index"])["prompt"] for s in samples}
    assert not evals & {s["prompt"] for s in samples}  # training prompts never equal evaluation prompts


def test_ruler_cli_on_tiny_model(tmp_path, tok, gattn_main):
    import json

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    stock_lm(cfg).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "hay.txt").write_text(CORPUS)
    out = tmp_path / "out"
    rc, table, _ = gattn_main("ruler", tmp_path / "ckpt", "--lengths", "400", "600", "--tasks", "passkey",
                              "niah_single_2", "--samples", "1", "--max-new-tokens", "4", "--haystack-file",
                              tmp_path / "hay.txt", "--out", out)
    assert rc == 0
    res = json.loads((out / "ruler.json").read_text())
    assert set(res["scores"]) == {"passkey", "niah_single_2"} and set(res["scores"]["passkey"]) == {"400", "600"}
    assert len(res["records"]) == 4 and (out / "ruler.png").stat().st_size > 1000
    assert "average" in table and "niah_single_2" in table
