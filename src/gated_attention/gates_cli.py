"""`gattn gates`: every gate variant (and baseline mechanism, where registered) with the parameters it adds."""
from __future__ import annotations

import json

from .gates import ALIASES, GATES
from .presets import PRESETS, model_config, param_report


def configure(parser):
    parser.add_argument("--shape", default="15a2b", choices=list(PRESETS),
                        help="model preset whose shape sizes the added parameters (default: the paper's 15A2B MoE)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def rows(shape: str) -> list[dict]:
    out = []
    base = model_config(shape)
    for name, spec in GATES.items():
        cfg = model_config(shape, name, match_params=False)
        rep = param_report(cfg)
        axes = "-" if spec is None else "/".join(v.value for v in (spec.position, spec.granularity, spec.sharing,
                                                                     spec.combine, spec.activation, spec.source))
        out.append({"name": name, "kind": "gate", "axes": axes, "added_params": rep["total"] - param_report(base)["total"],
                    "added_per_layer": rep["gate_per_layer"], "paper": "" if spec is None else spec.paper})
    try:
        from .baselines import BASELINES, added_params  # the paper's comparison mechanisms, when present
    except ImportError:
        BASELINES = {}
    for name, spec in BASELINES.items():
        kind = getattr(spec, "kind", "")
        out.append({"name": name, "kind": "baseline", "axes": getattr(kind, "value", str(kind)),
                    "added_params": added_params(spec, base), "added_per_layer": None,
                    "paper": getattr(spec, "paper", "")})
    return out


def run(args) -> int:
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
