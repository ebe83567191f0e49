"""Where the dormant queries' attention goes after each retrofit recipe (a `gattn lab retrofit` OUT on sink-lab
starts): per start (retrofit seed 0) and recipe, the attention of dormant (non-trigger) queries on BOS, on themselves,
on the previous token and on the largest other key, the effective number of keys (exp of the entropy), and the norm
of the attention layer's output (after o_proj and the gate) at dormant vs active queries. Prints a markdown table.

    .venv/bin/python scripts/retrofit_where.py OUT [RECIPE ...]

Measured on the lab's own held-out set (starts.make_data), in fp32, layer 0 head 0 (the sink lab's default model
has one of each; a deeper model's other heads are not read).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gated_attention.capture import Recorder, capture
from gated_attention.labs.retrofit import starts as S
from gated_attention.labs.sinks.backcopy import BackcopyTask
from gated_attention.modeling import GatedQwen3ForCausalLM

DEFAULT = ("start", "control", "identity-gates", "bos-penalty", "penalty-nogate", "bos-penalty-release",
           "warmup-penalty")


def row(model_dir, start: dict) -> list[float]:
    model = GatedQwen3ForCausalLM.from_pretrained(model_dir).eval()
    task = BackcopyTask(**start["task"])
    data = S.make_data(S.Start(**{k: v for k, v in start.items() if k != "before"}), 32, 256,
                       model.config.vocab_size)
    x = data.eval_seqs[:, :-1]  # (B, T)
    masks = task.masks(x)
    dor, act = masks["dormant"], masks["active"]  # (B, T) bool
    rec = Recorder(names={"attn_probs", "attn_output"}, wants_probs=True)
    with torch.no_grad(), capture(model, rec):
        model(input_ids=x)
    p = rec.get(0, "attn_probs").float()[:, 0]  # (B, T, S): head 0
    pd = p[dor]  # (n, S): the dormant queries' rows
    q = torch.arange(x.shape[1]).expand_as(dor)[dor]  # (n,) their positions
    n = torch.arange(len(pd))
    other = pd.clone()
    other[:, 0] = 0
    eff = torch.exp(-(pd.clamp_min(1e-12).log() * pd).sum(-1))
    out = rec.get(0, "attn_output").float().norm(dim=-1)  # (B, T)
    return [float(pd[:, 0].mean()), float(pd[n, q].mean()), float(pd[n, (q - 1).clamp(min=0)].mean()),
            float(other.max(-1).values.mean()), float(eff.mean()), float(out[dor].mean()), float(out[act].mean())]


def main(argv: list[str]) -> None:
    lab_dir = Path(argv[0])
    recipes = argv[1:] or DEFAULT
    lab = json.loads((lab_dir / "lab.json").read_text())
    if lab["kind"] != "sink":
        raise SystemExit(f"{lab_dir}: a text lab; this reads the sink task's dormant queries")
    print("| start | recipe | BOS | self | prev | top other key | eff. keys | attn out norm dormant | active |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, start in lab["start"].items():
        for recipe in recipes:
            d = start["model_dir"] if recipe == "start" else lab_dir / "runs" / label / recipe / "seed0" / "model"
            v = row(d, start)
            print(f"| {label} | {recipe} | " + " | ".join(f"{x:.3f}" for x in v[:4]) + f" | {v[4]:.1f} | {v[5]:.2f} | "
                  f"{v[6]:.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
