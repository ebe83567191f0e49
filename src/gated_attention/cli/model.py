"""Model commands: `gattn gates` (every gate variant and baseline mechanism with the parameters it adds) and
`gattn demo` (build a tiny gated model, save/load it through the Auto classes, generate)."""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import json
import tempfile

from ..gates import ALIASES, GATES
from ..presets import PRESETS, added_params, model_config, param_report  # (sizing a model imports transformers)


def configure_gates(parser):
    parser.add_argument("--shape", default="15a2b", choices=list(PRESETS),
                        help="model preset whose shape sizes the added parameters (default: the paper's 15A2B MoE)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def rows(shape: str) -> list[dict]:
    from ..mechanisms import MECHANISMS

    out = []
    base = model_config(shape)
    for name, spec in GATES.items():
        cfg = model_config(shape, name, match_params=False)
        rep = param_report(cfg)
        axes = "-" if spec is None else "/".join(v.value for v in (spec.position, spec.granularity, spec.sharing,
                                                                     spec.combine, spec.activation, spec.source))
        out.append({"name": name, "kind": "gate", "axes": axes, "added_params": rep["total"] - param_report(base)["total"],
                    "added_per_layer": rep["gate_per_layer"], "paper": "" if spec is None else spec.paper})
    for name, spec in MECHANISMS.items():
        kind = getattr(spec, "kind", "")
        out.append({"name": name, "kind": "baseline", "axes": getattr(kind, "value", str(kind)),
                    "added_params": added_params(spec, base), "added_per_layer": None,
                    "paper": getattr(spec, "paper", "")})
    return out


def run_gates(args) -> int:
    table = rows(args.shape)
    if args.json:
        print(json.dumps({"shape": args.shape, "variants": table, "aliases": ALIASES}, indent=2))
        return 0
    rep = param_report(model_config(args.shape))
    print(f"shape {args.shape}: {rep['total'] / 1e6:,.1f}M parameters ({rep['activated'] / 1e6:,.1f}M activated), "
          f"added parameters without FFN shrinking\n")
    print(f"{'name':30s} {'kind':8s} {'added (M)':>10s}  {'position/gran/sharing/combine/act/source':48s} paper")
    for r in table:
        print(f"{r['name']:30s} {r['kind']:8s} {r['added_params'] / 1e6:10.2f}  {r['axes']:48s} {r['paper']}")
    print(f"\naliases: {', '.join(f'{k}={v}' for k, v in ALIASES.items())}")
    return 0


def configure_demo(parser):
    parser.add_argument("--gate", default="sdpa_elementwise", help="gate name from `gattn gates` (default: G1 elementwise)")
    parser.add_argument("--tokens", type=E.positive_int, default=8, help="tokens to generate (default 8)")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="random seed for the untrained weights")


def run_demo(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from ..modeling import GatedQwen3ForCausalLM

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
