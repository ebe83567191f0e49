"""The byte-level BPE tokenizer of a prepared corpus: training, saving, loading, encoding user text."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..util.io import chmod_like_umask
from .sources import read_extra
from .text import BOS, EOS, PAD, SPECIAL_TOKENS, clean_text, _warn_replaced

# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Byte-level BPE (HF `tokenizers`) with <|bos|>=0, <|eos|>=1, <|pad|>=2; returns a PreTrainedTokenizerFast.

    Deterministic: the same texts in the same order give the same vocabulary and merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap_fast(tok)


def external_tokenizer(path: str):
    """(fast tokenizer, {BOS, EOS, PAD: id}) of an existing tokenizer dir; the manifest keeps our special-token names
    as keys. A tokenizer without BOS (Qwen2) starts windows with its EOS, as those models see documents in training."""
    from transformers import AutoTokenizer

    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there (a fast HF tokenizer dir is needed, "
                                "e.g. the checkpoint dir of a Llama / Mistral / Qwen2 model)")
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.eos_token_id
    if eos is None:
        raise ValueError(f"--tokenizer {path} has no eos_token; documents need a separator (set eos_token in its "
                         "tokenizer_config.json)")
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return tok, {BOS: bos, EOS: eos, PAD: pad}


def _wrap_fast(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   clean_up_tokenization_spaces=False)


def save_tokenizer(tok, directory: str | os.PathLike) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `directory`, e.g. a checkpoint or
    exported model dir, so it loads with AutoTokenizer. Other files there are left alone; each tokenizer file is
    written beside and renamed into place, so a crash never leaves a half-written one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=".tokenizer.", suffix=".tmp"))
    try:
        tok.save_pretrained(str(tmp))
        for f in sorted(tmp.iterdir()):
            chmod_like_umask(f)  # match the user's umask like any other file they keep
            os.replace(f, directory / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def get_tokenizer(data_dir: str | os.PathLike = "data"):
    """The corpus tokenizer (PreTrainedTokenizerFast) of a prepared data dir (or a tokenizer dir itself)."""
    from transformers import PreTrainedTokenizerFast

    d = Path(data_dir)
    if (d / "tokenizer" / "tokenizer.json").exists():
        d = d / "tokenizer"
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer in {data_dir}; run `gattn data prepare --data-dir {data_dir}` first")
    return PreTrainedTokenizerFast.from_pretrained(str(d))


def check_vocab_fits(data_vocab: int, model_vocab: int, data: str, model: str) -> None:
    """Raise one UserError line when token ids of a `data_vocab`-token tokenizer (`data`: a corpus or tokenizer, named
    in the message) can index past a model's `model_vocab` embedding rows: text tokenized for another model. A
    larger model vocabulary is fine (embedding rows are often padded)."""
    if data_vocab > model_vocab:
        from ..util.errors import UserError

        raise UserError(f"{data} has a {data_vocab}-token vocabulary but the model {model} has {model_vocab} "
                        "embedding rows, so its tokens do not fit the model; use the model's own tokenizer (the "
                        "corpus it was trained on, or one prepared with its tokenizer)")


def encode(tok, text: str) -> list[int]:
    """Token ids of text (no special tokens added) under the documented invalid-Unicode policy."""
    text, n = clean_text(text)
    _warn_replaced(n, "encode")
    return tok(text, add_special_tokens=False)["input_ids"]


def text_to_tokens(files_or_text: str | os.PathLike | Sequence[str | os.PathLike], tokenizer) -> np.ndarray:
    """Tokenize user eval text into one flat int64 array, each document followed by eos.

    A `str` is literal text; a `pathlib.Path` (or other PathLike) is a file or folder read like `--extra`
    (JSONL "text" fields, text files; invalid UTF-8 replaced with U+FFFD and warned about). A list mixes both.
    """
    items = [files_or_text] if isinstance(files_or_text, (str, os.PathLike)) else list(files_or_text)
    texts: list[str] = []
    for it in items:
        if isinstance(it, os.PathLike):
            _, docs, info = read_extra(it)
            _warn_replaced(info["replaced_chars"], str(it))
            texts.extend(t for _, t in docs)
        elif isinstance(it, str):
            t, n = clean_text(it)
            _warn_replaced(n, "text")
            texts.append(t)
        else:
            raise TypeError(f"text_to_tokens takes str (text) or PathLike (file/folder), got {type(it).__name__}")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    out: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        out.extend(ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int64)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)
