"""Context extension of an HF checkpoint: rewrite config.json's `rope_parameters` (linear / dynamic NTK / YaRN, or
`default` = only a new RoPE base), copy everything else (weights, tokenizer, generation config) unchanged, and
optionally continue training at the new length.

The new `rope_parameters` follow the HF schema, so transformers' own models and ours (rope.py) read them identically.
`max_position_embeddings` is what each method expects it to be:
  - yarn / linear / default: original length x factor (HF checks yarn's factor against this ratio; for `default`
    the factor only states the new context length);
  - dynamic: left at the original length, because dynamic NTK measures growth relative to it.
The destination is written into a temporary sibling directory and renamed into place, so an interrupted run never
leaves a half-written checkpoint. CLI: `gattn extend DIR --method yarn --factor 4 --out DST`.

`--finetune-steps N --seq-len L` then continues training the extended model at length L through the ordinary trainer
(the paper's long-context step is `--method default --rope-theta 1e6` plus training at the longer length, paper map §4).
The run lives in the sibling folder DST.finetune/ (log, checkpoints; a killed run resumes there), and only its final
model is published to DST, so DST never holds an untrained checkpoint that looks fine-tuned.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from gated_attention.util.io import atomic_dir, check_hf_dir, json_dumps, locks_output, read_json_object

METHODS = ("default", "linear", "dynamic", "yarn")


def extended_config(config: dict, method: str = "yarn", factor: float = 4.0, rope_theta: float | None = None,
                    original_max_position_embeddings: int | None = None) -> dict:
    """A copy of an HF config dict with rope_parameters (and max_position_embeddings) set for the extension."""
    from gated_attention.rope import compute_rope_parameters  # torch: imported here, `gattn extend`'s options need none

    if method not in METHODS:
        raise ValueError(f"unknown extension method {method!r}; valid: {', '.join(METHODS)}")
    old = config.get("rope_parameters")
    if not isinstance(old, dict):
        raise ValueError("config.json has no rope_parameters dict (HF >= 5 schema); re-save the checkpoint with "
                         "transformers >= 5 or add rope_parameters={'rope_type': 'default', 'rope_theta': ...}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1.0:
        raise ValueError(f"--factor must be a number >= 1; got {factor!r}")
    old_type = old.get("rope_type", old.get("type", "default"))
    if old_type != "default" and original_max_position_embeddings is None:
        raise ValueError(f"checkpoint is already extended (rope_type={old_type!r}); extend the original checkpoint, "
                         f"or pass original_max_position_embeddings explicitly")
    original = int(original_max_position_embeddings or config["max_position_embeddings"])
    theta = rope_theta if rope_theta is not None else old.get("rope_theta")
    if theta is None:
        raise ValueError("rope_parameters has no rope_theta; pass --rope-theta")
    from gated_attention.util.errors import check_number

    check_number("--factor", factor, max=1e6)  # finite: inf would be written into config.json
    check_number("--rope-theta", theta, min=0.0, min_open=True)
    rp = {"rope_type": method, "rope_theta": float(theta)}
    if method != "default":  # HF's default RoPE takes no factor
        rp["factor"] = float(factor)
    if "partial_rotary_factor" in old:
        rp["partial_rotary_factor"] = old["partial_rotary_factor"]
    if method == "yarn":
        rp["original_max_position_embeddings"] = original
    new = dict(config)
    new["rope_parameters"] = rp
    new["max_position_embeddings"] = original if method == "dynamic" else int(round(original * factor))
    # fail here, not at load time, if the result is not computable
    head_dim = new.get("head_dim") or new["hidden_size"] // new["num_attention_heads"]
    compute_rope_parameters(SimpleNamespace(rope_parameters=rp, head_dim=head_dim,
                                            max_position_embeddings=new["max_position_embeddings"]))
    return new


@locks_output("dst_dir", "gattn extend")  # one writer per output folder
def extend_checkpoint(src_dir, dst_dir, method: str = "yarn", factor: float = 4.0, rope_theta: float | None = None,
                      original_max_position_embeddings: int | None = None, overwrite: bool = False) -> dict:
    """Write an extended copy of the checkpoint in `src_dir` to `dst_dir`; returns the new config dict."""
    src, dst = Path(src_dir), Path(dst_dir)
    cfg_path = src / "config.json"
    check_hf_dir(src, "source checkpoint")  # config.json parses, weights present and intact: else one line, no copy
    if src.resolve() == dst.resolve():
        raise ValueError("--out must differ from the source checkpoint (the source is kept untouched)")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"{dst} exists and is not empty; choose another --out or pass --overwrite")
    new = extended_config(read_json_object(cfg_path, "config", "pass a checkpoint folder written by save_pretrained"),
                          method, factor, rope_theta,
                          original_max_position_embeddings)
    with atomic_dir(dst, overwrite=True) as tmp:
        for item in src.iterdir():
            if item.name == "config.json":
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        (tmp / "config.json").write_text(json_dumps(new, indent=2, sort_keys=True) + "\n")
    return new


def _base_train_config(src: Path):
    """The training settings to continue with: the source run's (DIR/../train_config.json, as `gattn train` writes
    beside final/), else the `small` preset."""
    from gated_attention.train.config import TrainConfig
    from gated_attention.train.train_presets import train_preset

    for cand in (src / "train_config.json", src.parent / "train_config.json"):
        if cand.is_file():
            return TrainConfig.from_dict(read_json_object(cand, "run settings", "restore it or remove it"))
    return train_preset("small")


@locks_output("dst_dir", "gattn extend")
def finetune_checkpoint(src_dir, dst_dir, steps: int, seq_len: int, method: str = "yarn", factor: float = 4.0,
                        rope_theta: float | None = None, original_max_position_embeddings: int | None = None,
                        data_dir: str | None = None, sets=(), overwrite: bool = False) -> dict:
    """Extend `src_dir`, train it `steps` more steps at `seq_len` tokens, publish the result to `dst_dir`.

    Training settings: the source run's train_config.json (else the `small` preset) with steps/seq_len replaced, a
    warm-up of at most a tenth of the steps, then `sets` ("key=value", as `gattn train --set`). Returns the trainer's
    summary plus "config" (the published config.json).
    """
    from dataclasses import replace

    import torch

    from gated_attention.train.checkpoint import latest_checkpoint
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.trainer import train

    src, dst = Path(src_dir), Path(dst_dir)
    if steps < 1 or seq_len is None or seq_len < 1:
        raise ValueError(f"--finetune-steps needs a positive step count and --seq-len L (got {steps}, {seq_len})")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"{dst} exists and is not empty; choose another --out or pass --overwrite")
    run_dir = dst.with_name(dst.name + ".finetune")
    extended = run_dir / "extended"
    new_cfg = extend_checkpoint(src, extended, method, factor, rope_theta, original_max_position_embeddings,
                                overwrite=True)
    base = _base_train_config(src)
    cfg = replace(base, data="corpus", steps=int(steps), seq_len=int(seq_len), eval_every=0,
                  warmup_steps=min(base.warmup_steps, steps // 10),
                  ckpt_every=base.ckpt_every if base.ckpt_every < steps else 0)
    if data_dir is not None:
        cfg = replace(cfg, data_dir=str(data_dir))
    cfg = apply_overrides(cfg, list(sets))

    def load_extended(_cfg, vocab_size):
        from gated_attention.modeling import GatedQwen3ForCausalLM

        model = GatedQwen3ForCausalLM.from_pretrained(extended, dtype=torch.float32)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise ValueError(f"the corpus tokenizer has {vocab_size} tokens but the checkpoint only "
                             f"{model.config.vocab_size}; pass the --data-dir the model was trained on")
        return model

    resume = run_dir.exists() and latest_checkpoint(run_dir) is not None
    summary = train(cfg, run_dir, resume=resume, model_factory=load_extended, overwrite=True)  # holds extended/
    if summary.get("diverged"):
        raise ValueError(f"fine-tuning diverged ({summary.get('stop_reason')}); lower lr with --set lr=...")
    final = run_dir / "final"
    saved = read_json_object(final / "config.json", "fine-tuned model config")
    if saved.get("rope_parameters") != new_cfg["rope_parameters"]:
        raise RuntimeError(f"the fine-tuned model saved rope_parameters={saved.get('rope_parameters')}, expected "
                           f"{new_cfg['rope_parameters']}")
    # publish: copy beside DST, then swap it in, so DST is either the old folder or the complete new one
    with atomic_dir(dst, overwrite=True) as tmp:
        shutil.copytree(final, tmp, dirs_exist_ok=True)
    return {**summary, "config": saved, "run_dir": str(run_dir)}
