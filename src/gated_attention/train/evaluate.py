"""Held-out evaluation: per-domain loss and perplexity, the paper's "Avg PPL", and a loss-by-position curve.

"Avg PPL" (paper Table 1/2) is the mean over domains of each domain's perplexity, exp(mean token loss in that domain),
not exp of the pooled loss. `gattn eval DIR` prints a table and writes/prints JSON.
"""
from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ..modeling import GatedQwen3ForCausalLM
from ..util.precision import numerics


def token_losses(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each position's cross-entropy (B, T) fp32 of inputs x (B, T) against targets y (B, T). Our LM scores them chunk
    by chunk through lm_head (fused.chunked_lm_loss, the training loss's own kernel): no (B, T, V) logits, so an
    evaluation holds no more than a training step does; any other model through its logits."""
    if isinstance(model, GatedQwen3ForCausalLM):  # FSDP2's wrapper class included (a subclass)
        return model(input_ids=x, shift_labels=y, fused_loss=True, loss_reduction="none", use_cache=False).loss
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)


@torch.no_grad()
def domain_losses(model, source, *, seq_len: int, max_batches: int, batch_size: int, device: torch.device,
                  precision: str = "auto", positions: bool = False) -> dict:
    """{"losses": {domain: mean nats/token}, "ppl": {...}, "avg_ppl", "pos_loss": [T] (if positions)}."""
    was_training = model.training
    model.eval()
    losses, ppl = {}, {}
    pos_sum = torch.zeros(seq_len, dtype=torch.float64)
    pos_count = 0
    for domain in source.domains:
        total, count = 0.0, 0
        for batch in source.eval_batches(domain, seq_len, max_batches, batch_size):
            batch = batch.to(device)  # (B, T+1)
            x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
            with numerics(precision, device):
                ce = token_losses(model, x, y)  # (B, T)
            total += float(ce.double().sum())
            count += ce.numel()
            if positions:
                pos_sum[: ce.shape[1]] += ce.double().sum(0).cpu()
                pos_count += ce.shape[0]
        if count == 0:
            continue
        losses[domain] = total / count
        ppl[domain] = math.exp(min(losses[domain], 700.0))
    model.train(was_training)
    out = {"losses": losses, "ppl": ppl, "avg_ppl": sum(ppl.values()) / len(ppl) if ppl else float("nan")}
    if positions and pos_count:
        out["pos_loss"] = (pos_sum / pos_count).tolist()
    return out


def evaluate_folder(folder, data_dir: str | None = None, seq_len: int | None = None, batches: int = 8,
                    batch_size: int = 8, precision: str = "auto", out: str | None = None) -> dict:
    """`gattn eval DIR`: per-domain loss and PPL and the loss by position of a training run folder (its final/ model
    and, unless data_dir is given, the corpus and length it trained with) or any save_pretrained folder. Writes the
    result to `out` (strict JSON, atomically) when given; returns it."""
    from pathlib import Path

    from ..util.errors import UserError
    from ..util.io import atomic_write_json, check_hf_dir, read_json_object
    from ..util.precision import param_dtype, resolve
    from .config import TrainConfig
    from .data_source import make_source

    root = Path(folder)
    model_dir = root / "final" if (root / "final" / "config.json").exists() else root
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"no model in {root} (expected {root}/final/config.json or {root}/config.json)")
    check_hf_dir(model_dir, "model folder")  # config.json parses, weights present and intact
    cfg_path = root / "train_config.json"
    cfg = (TrainConfig.from_dict(read_json_object(cfg_path, "run settings", "restore it or pass --data-dir"))
           if cfg_path.exists() else TrainConfig())
    if data_dir is not None:
        cfg.data_dir, cfg.data = data_dir, "corpus"
    seq_len = seq_len or cfg.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve(precision, device)
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).to(device)
    with torch.no_grad():  # bf16-params evaluates bf16 weights (buffers such as RoPE frequencies stay fp32)
        for p in model.parameters():
            p.data = p.data.to(param_dtype(precision))
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}; lower --seq-len "
                        "(or extend the model first with `gattn extend`)")
    source = make_source(cfg, model.config.vocab_size)
    if cfg.data == "corpus":  # synthetic tokens are drawn from the model's own vocabulary
        from ..data.tokenizer import check_vocab_fits

        check_vocab_fits(source.vocab_size, model.get_input_embeddings().num_embeddings,
                         f"the corpus {cfg.data_dir or 'data'}", str(model_dir))
    res = domain_losses(model, source, seq_len=seq_len, max_batches=batches,
                        batch_size=batch_size, device=device, precision=precision, positions=True)
    if not res["losses"]:  # otherwise "Avg PPL nan" and exit 0
        raise UserError(f"no validation window of {seq_len} tokens in any domain of the corpus; lower --seq-len")
    res.update({"model": str(model_dir), "seq_len": seq_len, "batches": batches, "batch_size": batch_size,
                "resolved_precision": precision})
    if out:
        atomic_write_json(out, res)
    return res
