"""Training-free context extension of an HF checkpoint: rewrite config.json's `rope_parameters` (linear / dynamic NTK /
YaRN), copy everything else (weights, tokenizer, generation config) unchanged.

The new `rope_parameters` follow the HF schema, so transformers' own models and ours (rope.py) read them identically.
`max_position_embeddings` is what each method expects it to be:
  - yarn / linear: original length x factor (HF checks yarn's factor against this ratio);
  - dynamic: left at the original length, because dynamic NTK measures growth relative to it.
The destination is written into a temporary sibling directory and renamed into place, so an interrupted run never
leaves a half-written checkpoint. CLI: `gattn extend DIR --method yarn --factor 4 --out DST`. (Continued training at
the new length, `--finetune-steps/--seq-len`, belongs to the trainer and is not here yet.)
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

from gated_attention.rope import compute_rope_parameters

METHODS = ("linear", "dynamic", "yarn")


def extended_config(config: dict, method: str = "yarn", factor: float = 4.0, rope_theta: float | None = None,
                    original_max_position_embeddings: int | None = None) -> dict:
    """A copy of an HF config dict with rope_parameters (and max_position_embeddings) set for the extension."""
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
    rp = {"rope_type": method, "rope_theta": float(theta), "factor": float(factor)}
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


def extend_checkpoint(src_dir, dst_dir, method: str = "yarn", factor: float = 4.0, rope_theta: float | None = None,
                      original_max_position_embeddings: int | None = None, overwrite: bool = False) -> dict:
    """Write an extended copy of the checkpoint in `src_dir` to `dst_dir`; returns the new config dict."""
    src, dst = Path(src_dir), Path(dst_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: SRC must be an HF checkpoint directory")
    if src.resolve() == dst.resolve():
        raise ValueError("--out must differ from the source checkpoint (the source is kept untouched)")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"{dst} exists and is not empty; choose another --out or pass --overwrite")
    new = extended_config(json.loads(cfg_path.read_text()), method, factor, rope_theta,
                          original_max_position_embeddings)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        for item in src.iterdir():
            if item.name == "config.json":
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return new


def configure(parser) -> None:
    parser.add_argument("dir", help="source HF checkpoint directory (config.json with rope_parameters)")
    parser.add_argument("--method", choices=METHODS, default="yarn", help="RoPE scaling method (default: yarn)")
    parser.add_argument("--factor", type=float, default=4.0, help="context extension factor, >= 1 (default: 4)")
    parser.add_argument("--rope-theta", type=float, default=None,
                        help="new RoPE base (e.g. 1e6, the paper's base change); default: keep the checkpoint's")
    parser.add_argument("--original-max-position-embeddings", type=int, default=None,
                        help="trained context length; default: the checkpoint's max_position_embeddings")
    parser.add_argument("--out", required=True, help="destination directory for the extended checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it already has files")


def run(args) -> int:
    new = extend_checkpoint(args.dir, args.out, args.method, args.factor, args.rope_theta,
                            args.original_max_position_embeddings, args.overwrite)
    print(f"wrote {args.out}: rope_parameters={json.dumps(new['rope_parameters'])} "
          f"max_position_embeddings={new['max_position_embeddings']}")
    return 0
