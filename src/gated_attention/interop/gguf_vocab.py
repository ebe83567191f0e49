"""The tokenizer of a GGUF file: a HF `tokenizer.json` (byte-level BPE, what `gattn data prepare` trains) read into
llama.cpp's `tokenizer.ggml.*` keys (model "gpt2", tokens by id, token types, merges, special ids).

Only tokenizers llama.cpp reproduces exactly are taken: BPE with a pre-tokenizer in `gguf_map.PRE_TOKENIZERS` and no
normalizer. Anything else fails with one line naming what differs (a GGUF that tokenizes differently from training
would run, and silently degrade every prompt).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .gguf_map import PRE_TOKENIZERS
from .layouts import ConversionError

# llama.cpp token types (gguf-py TokenType): normal, control (special tokens), unused (padding rows past the vocab)
NORMAL, CONTROL, UNUSED = 1, 3, 5


@dataclass(frozen=True)
class GGUFVocab:
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]  # by id, padded to the model's vocab_size
    types: list[int]
    merges: list[str]  # "left right", in merge order
    special: dict[str, int]  # bos / eos / pad -> id (those the tokenizer names)


def find_tokenizer_json(where: str | os.PathLike) -> Path:
    """tokenizer.json in `where`: a checkpoint dir, a tokenizer dir or a prepared data dir (its tokenizer/)."""
    p = Path(where)
    for cand in (p, p / "tokenizer.json", p / "tokenizer" / "tokenizer.json"):
        if cand.is_file() and cand.name == "tokenizer.json":
            return cand
    raise ConversionError(f"no tokenizer.json in {where}; pass --tokenizer DIR (a checkpoint, tokenizer or prepared "
                          "data dir holding the model's tokenizer): a GGUF file carries its tokenizer")


def read_vocab(tokenizer_json: str | os.PathLike, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of a tokenizer.json for a model with `vocab_size` embedding rows."""
    path = Path(tokenizer_json)
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"{path}: tokenizer model {model.get('type')!r}; GGUF export takes byte-level BPE "
                              "tokenizers (what `gattn data prepare` trains)")
    if spec.get("normalizer") is not None:
        raise ConversionError(f"{path}: has a normalizer ({spec['normalizer'].get('type')}), which llama.cpp's BPE "
                              "does not apply; the GGUF would tokenize differently")
    pre_spec = spec.get("pre_tokenizer") or {}
    pre_keys = {k: pre_spec.get(k) for k in ("type", "add_prefix_space", "use_regex")}
    pre = next((name for name, want in PRE_TOKENIZERS.items() if pre_keys == want), None)
    if pre is None:
        raise ConversionError(f"{path}: pre-tokenizer {pre_keys} is not one llama.cpp reproduces here (known: "
                              f"{', '.join(f'{n} = {w}' for n, w in PRE_TOKENIZERS.items())})")
    id_to_tok: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    specials = {}
    for added in spec.get("added_tokens") or []:
        id_to_tok[int(added["id"])] = added["content"]
        if added.get("special"):
            specials[int(added["id"])] = added["content"]
    n = max(id_to_tok) + 1
    if n > vocab_size:
        raise ConversionError(f"{path}: the tokenizer has {n} tokens but the model only {vocab_size} embedding rows; "
                              "pass the model's own tokenizer (--tokenizer)")
    missing = [i for i in range(n) if i not in id_to_tok]
    if missing:
        raise ConversionError(f"{path}: token ids {missing[:5]} are unassigned; the vocabulary must be dense")
    tokens = [id_to_tok[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    types = [CONTROL if i in specials else NORMAL for i in range(n)] + [UNUSED] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    config = _tokenizer_config(path.parent)
    special = {}
    for role in ("bos", "eos", "pad"):
        name = config.get(f"{role}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if name is not None and (name in model["vocab"] or name in specials.values()):
            special[role] = next(i for i, t in id_to_tok.items() if t == name)
    return GGUFVocab(pre, tokens, types, merges, special)


def _tokenizer_config(folder: Path) -> dict:
    f = folder / "tokenizer_config.json"
    return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}


def add_vocab(writer, vocab: GGUFVocab) -> None:
    """Write the tokenizer.ggml.* keys. llama.cpp prepends BOS to a text prompt when the tokenizer has one: every
    training window here starts with BOS (data/corpus.py), so a prompt should too."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for role, idx in vocab.special.items():
        getattr(writer, f"add_{role}_token_id")(idx)
    writer.add_add_bos_token("bos" in vocab.special)
    writer.add_add_eos_token(False)
