"""What a scaling-lab unit measures besides the trainer's summary: the training-loss curve from its log, the loss of
its final model on the user's held-out text, and the corpus's UTF-8 bytes per token (nats per token -> bits per
byte)."""
from __future__ import annotations

import math
from pathlib import Path


def loss_curve(log: list[dict], points: int, tokens_per_step: int) -> dict:
    """The training loss averaged over `points` equal bins of steps, at each bin's last step's tokens."""
    rows = [r for r in log if r.get("loss") is not None and math.isfinite(r["loss"])]
    if not rows:
        return {"tokens": [], "loss": []}
    n = len(rows)
    bins = [rows[i * n // points:(i + 1) * n // points] for i in range(points)]
    bins = [b for b in bins if b]
    return {"tokens": [(b[-1]["step"] + 1) * tokens_per_step for b in bins],
            "loss": [sum(r["loss"] for r in b) / len(b) for b in bins]}


def heldout_loss(model_dir: Path, data_dir: str, files: list[str], seq_len: int, max_windows: int = 256,
                 batch_size: int = 32) -> dict | None:
    """Mean loss in nats of the final model on the held-out files (the corpus's tokenizer, BOS-started windows of
    seq_len tokens, up to max_windows per file): {"mean", "per_file"}; None without files."""
    if not files:
        return None
    import numpy as np
    import torch
    import torch.nn.functional as F

    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
    from gated_attention import data
    from gated_attention.data.tokenizer import text_to_tokens
    from gated_attention.modeling import GatedQwen3ForCausalLM

    corpus = data.Corpus(data_dir)
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).eval()
    per_file = {}
    for f in files:
        arr = np.asarray(text_to_tokens(Path(f), corpus.tokenizer), dtype=np.int64)
        n = min(max_windows, len(arr) // seq_len)
        if n == 0:
            raise ValueError(f"--heldout {f}: fewer than {seq_len} tokens; give a longer text")
        total = count = 0.0
        for b0 in range(0, n, batch_size):
            rows = range(b0, min(n, b0 + batch_size))
            x = torch.tensor(np.stack([np.concatenate(([corpus.bos_id], arr[r * seq_len:(r + 1) * seq_len]))
                                       for r in rows]))  # (b, T+1)
            with torch.no_grad():
                logits = model(input_ids=x[:, :-1]).logits  # (b, T, V)
            ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += float(ce)
            count += x[:, 1:].numel()
        per_file[Path(f).name] = total / count
    return {"mean": sum(per_file.values()) / len(per_file), "per_file": per_file}


def bytes_per_token(data_dir: str, max_tokens: int = 200_000) -> dict[str, float]:
    """UTF-8 bytes per token of each domain's validation text (its first max_tokens tokens decoded; special tokens
    count 0 bytes): the factor that turns nats per token into bits per byte."""
    import numpy as np

    from gated_attention import data

    corpus = data.Corpus(data_dir)
    special = {corpus.bos_id, corpus.eos_id, corpus.pad_id}
    out = {}
    for d in corpus.domains:
        ids = [int(t) for t in np.asarray(corpus.tokens(d, "val")[:max_tokens]) if int(t) not in special]
        n = len(ids)
        out[d] = len(corpus.tokenizer.decode(ids).encode("utf-8")) / n if n else None
    return out
