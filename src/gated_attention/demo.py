"""`gattn demo`: list the variants, build a tiny gated model, save/load it through the Auto classes, generate."""
from __future__ import annotations

import tempfile

import torch


def configure(parser):
    from gated_attention import errors as E  # argparse types: numbers/paths checked where they enter

    parser.add_argument("--gate", default="sdpa_elementwise", help="gate name from `gattn gates` (default: G1 elementwise)")
    parser.add_argument("--tokens", type=E.positive_int, default=8, help="tokens to generate (default 8)")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="random seed for the untrained weights")


def run(args) -> int:
    from transformers import AutoModelForCausalLM

    import gated_attention  # noqa: F401
    from .gates import GATES
    from .modeling import GatedQwen3ForCausalLM
    from .presets import model_config, param_report

    print("gate variants:", ", ".join(GATES))
    torch.manual_seed(args.seed)
    cfg = model_config("tiny", args.gate)
    model = GatedQwen3ForCausalLM(cfg).eval()
    print(f"tiny model with gate {cfg.gate!r}: {param_report(cfg)['total']:,} parameters")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    print("greedy continuation of [1, 2, 3, 4] (untrained weights):", out[0].tolist())
    return 0
