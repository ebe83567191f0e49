"""The retrofit lab's recipes: named, documented ways to add a gate to a trained ungated model and train it further,
and the two extra loss terms some of them use (a penalty on attention to the first token, sparsity pressure on gate
scores).

A recipe says which gate is added and how (`gattn retrofit`'s identity or official normal init), which parameters
train at which learning rate (multiples of the lab's `--lr`; 0 = frozen), whether the gates train alone for a first
share of the steps (the rest frozen), and the weights of the extra loss terms. `control` is the ungated model trained
the same steps on the same batches with the pretrained weights' LR of the recipes that train them (REST_LR), so every
recipe's cost and effect is read against training alone.

Why a penalty is needed at all (measured, see results/retrofit_lab.md): the next-token loss of a trained
model gives an added gate no reason to take the sink's job — the sink already works — and a gates-only recipe cannot
change a layer's own attention map (its probabilities are a function of frozen q/k weights; a G1 gate acts after
them), only a later layer's, through its input. The penalty makes parking attention on the first token cost
something; the gate was meant to make not parking it cheap (on the sink lab the penalty alone does as well).

BOS attention of the penalty: mean over layers, heads, batch rows and query positions t >= 1 of p(t -> key 0), from
the queries and keys the attention layers emit (capture.py's "q"/"k"/"scale" points, with their autograd graph) and
`analysis.attention_sinks.key_probs_chunked` (exp(q.k0 * scale - logsumexp)), so the penalty never needs a T x T
map per head and works under any attention backend. Query 0 is left out: it can only see itself.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# torch is imported inside the functions that touch a model: the recipes' names and settings (`gattn lab retrofit`'s
# options) load without it

REST_LR = 0.1  # the "lower LR" of the pretrained weights (x --lr) in every recipe that trains them, and the control's
GATE_PARAM = ".self_attn.gate."  # the gate's parameters (train.model_setup.apply_trainable uses the same rule)


@dataclass(frozen=True)
class Recipe:
    """One way to retrofit a gate (every field is part of the unit's cache key)."""

    help: str  # what the recipe is and why it is in the lab (the report and --help print it)
    gate: str | None = "sdpa_elementwise"  # gate added (`gattn gates` name); None = the ungated model (control)
    init: str = "identity"  # identity: exact identity at step 0 (2*sigmoid, zero weights) | random: official N(0, 0.02)
    gate_lr: float = 1.0  # gate parameters' LR = gate_lr x --lr
    rest_lr: float = 0.0  # every pretrained parameter's LR = rest_lr x --lr; 0 = frozen (never touched, not even decay)
    gates_first: float = 0.0  # share of the steps at the start during which only the gates train (the rest frozen)
    bos_penalty: float = 0.0  # loss weight of the mean attention on the first token (all layers, heads, queries t >= 1)
    gate_l1: float = 0.0  # loss weight of the mean gate score (sparsity pressure: a gate closes where it is not needed)
    penalty_until: float = 1.0  # share of the steps after which both extra terms stop (does the sink come back?)

    def validate(self, name: str) -> "Recipe":
        from gated_attention.gates import canonical_name, get_gate
        from gated_attention.interop.retrofit import INITS

        if self.gate is not None and get_gate(canonical_name(self.gate)) is None:
            raise ValueError(f"recipe {name!r}: gate {self.gate!r} adds nothing; name a gate from `gattn gates`")
        if self.init not in INITS:
            raise ValueError(f"recipe {name!r}: init must be one of {', '.join(INITS)}; got {self.init!r}")
        for k in ("gate_lr", "rest_lr", "bos_penalty", "gate_l1"):
            if getattr(self, k) < 0:
                raise ValueError(f"recipe {name!r}: {k} must be >= 0; got {getattr(self, k)}")
        for k in ("gates_first", "penalty_until"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ValueError(f"recipe {name!r}: {k} is a share of the steps, in [0, 1]; got {getattr(self, k)}")
        if self.gate is None and (self.gate_l1 or self.gates_first):
            raise ValueError(f"recipe {name!r}: gate_l1 / gates_first need a gate")
        if self.rest_lr == 0 and (self.gate is None or self.gate_lr == 0):
            raise ValueError(f"recipe {name!r} trains nothing (rest_lr 0 and no trainable gate)")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def uses_tap(self) -> bool:
        """Whether training needs the q/k/gate tensors with their graph (an extra loss term)."""
        return self.bos_penalty > 0 or self.gate_l1 > 0


CONTROL = "control"
RECIPES: dict[str, Recipe] = {
    CONTROL: Recipe("the ungated model, every weight at the lower LR (REST_LR x --lr): what training alone does",
                    gate=None, rest_lr=REST_LR),
    "identity-gates": Recipe("identity init (the model starts unchanged), only the gates train (the official "
                             "maintainer's continued-pretraining setting, gates only)"),
    "identity-all": Recipe("identity init, every parameter (gates included) at the lower LR: plain continued "
                           "pretraining of the retrofitted model", gate_lr=REST_LR, rest_lr=REST_LR),
    "normal-gates": Recipe("the official from-scratch init (gate ~0.5 at start: a loss spike), only the gates train",
                           init="random"),
    "gate-lr10": Recipe("identity init, every parameter trains, the gates at 10x the rest's LR (a gate-LR multiplier)",
                        rest_lr=REST_LR),
    "gate-sparsity": Recipe("identity init, only the gates train, with sparsity pressure on the gate score (mean "
                            "score x 0.1): the gates close where the model does not need them", gate_l1=0.1),
    "bos-penalty": Recipe("identity init, every parameter trains (gates at 10x), plus a penalty on the mean attention "
                          "to the first token (x 1.0): a reason to drop the sink, and a gate that makes it cheap",
                          rest_lr=REST_LR, bos_penalty=1.0),
    "penalty-nogate": Recipe("the control plus the same first-token penalty, no gate: is the gate what makes dropping "
                             "the sink cheap?", gate=None, rest_lr=REST_LR, bos_penalty=1.0),
    "warmup-penalty": Recipe("identity init; the first 25 % of the steps only the gates train with sparsity pressure "
                             "(they learn to close on idle queries), then every parameter with the first-token penalty",
                             rest_lr=REST_LR, gates_first=0.25, gate_l1=0.1, bos_penalty=1.0),
    "bos-penalty-release": Recipe("bos-penalty for the first half of the steps, then plain training: does the sink come "
                                  "back once nothing asks it to stay away?", rest_lr=REST_LR, bos_penalty=1.0,
                                  penalty_until=0.5),
    "penalty-nogate-release": Recipe("penalty-nogate for the first half of the steps, then plain training (the "
                                     "ungated answer to bos-penalty-release)", gate=None, rest_lr=REST_LR,
                                     bos_penalty=1.0, penalty_until=0.5),
    "warmup-penalty-release": Recipe("warmup-penalty with both extra terms stopped at half of the steps: does a "
                                     "gate that has taken over the idle queries keep the sink away?",
                                     rest_lr=REST_LR, gates_first=0.25, gate_l1=0.1, bos_penalty=1.0,
                                     penalty_until=0.5),
}
DEFAULT_RECIPES = ("identity-gates", "identity-all", "normal-gates", "bos-penalty", "penalty-nogate")


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(RECIPES)}")
    return RECIPES[name].validate(name)


def recipe_from_dict(d: dict) -> Recipe:
    return Recipe(**{f.name: d[f.name] for f in fields(Recipe) if f.name in d})


# ---------------------------------------------------------------- which parameters train, at which LR

def is_gate_param(name: str) -> bool:
    return GATE_PARAM in f".{name}"


def set_phase(model: nn.Module, recipe: Recipe, gates_only: bool) -> None:
    """requires_grad per parameter for the current phase: a frozen parameter gets no gradient, so AdamW skips it
    entirely (no update, no weight decay, no state)."""
    for name, p in model.named_parameters():
        if is_gate_param(name):
            p.requires_grad_(recipe.gate_lr > 0)
        else:
            p.requires_grad_(recipe.rest_lr > 0 and not gates_only)


def param_groups(model: nn.Module, recipe: Recipe, lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups over EVERY parameter with a positive LR (a frozen phase only clears requires_grad): the trainer's
    decay rule (train.model_setup.param_groups: matrices decayed, norms/biases/embeddings not), split into gate and
    pretrained parameters with their own LR (group key "lr_mult" x the schedule's LR)."""
    from argparse import Namespace

    from gated_attention.train.model_setup import param_groups as decay_groups

    gate_ids = {id(p) for n, p in model.named_parameters() if is_gate_param(n)}
    saved = {id(p): p.requires_grad for p in model.parameters()}
    for n, p in model.named_parameters():  # the decay rule only sees trainable parameters: make all visible once
        p.requires_grad_(True)
    try:
        base = decay_groups(model, Namespace(weight_decay=weight_decay, wd_on_embeddings=False))
    finally:
        for p in model.parameters():
            p.requires_grad_(saved[id(p)])
    groups = []
    for g in base:
        for is_gate, mult in ((True, recipe.gate_lr), (False, recipe.rest_lr)):
            ps = [p for p in g["params"] if (id(p) in gate_ids) == is_gate]
            if ps and mult > 0:
                groups.append({"params": ps, "weight_decay": g["weight_decay"], "lr": lr * mult, "lr_mult": mult})
    return groups


# ---------------------------------------------------------------- extra loss terms

class GradTap:
    """A capture.py recorder that keeps q, k, scale and gate scores WITH their autograd graph (the analysis
    Recorder detaches), for the extra loss terms of one training forward. Reset per forward."""

    wants_probs = False
    NAMES = ("q", "k", "scale", "gate")

    def __init__(self):
        self.data: dict[tuple[int, str], object] = {}

    def wants(self, name: str) -> bool:
        return name in self.NAMES

    def __call__(self, layer: int, name: str, value) -> None:
        if name in self.NAMES:
            self.data[(layer, name)] = value

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.data})


def first_token_attention(tap: GradTap) -> torch.Tensor:
    """Differentiable mean attention on key 0 over layers, heads, rows and queries t >= 1 (a scalar)."""
    import torch

    from gated_attention.analysis.attention_sinks import key_probs_chunked

    per_layer = []
    for layer in tap.layers():
        q, k, scale = tap.data.get((layer, "q")), tap.data.get((layer, "k")), tap.data.get((layer, "scale"))
        if q is None or k is None:
            continue
        probs, _, _ = key_probs_chunked(q, k, scale, keys=(0,))  # (B, H, T, 1), causal
        per_layer.append(probs[:, :, 1:, 0].float().mean())
    if not per_layer:
        raise ValueError("the model emitted no q/k: the first-token penalty needs a gated_attention model")
    return torch.stack(per_layer).mean()


def mean_gate_score(tap: GradTap) -> torch.Tensor:
    """Differentiable mean gate score over layers (each layer's mean over rows, tokens, heads and channels)."""
    import torch

    per_layer = [tap.data[(layer, "gate")].float().mean() for layer in tap.layers() if (layer, "gate") in tap.data]
    if not per_layer:
        raise ValueError("the model emitted no gate score: gate_l1 needs a gate with a score")
    return torch.stack(per_layer).mean()


def extra_loss(recipe: Recipe, tap: GradTap | None, active: bool) -> tuple[torch.Tensor | None, dict]:
    """The recipe's extra loss terms for one forward (None when none applies) and their values for the log."""
    import torch

    if tap is None or not active:
        return None, {}
    terms, log = [], {}
    if recipe.bos_penalty > 0:
        a = first_token_attention(tap)
        terms.append(recipe.bos_penalty * a)
        log["first_token_attention"] = float(a.detach())
    if recipe.gate_l1 > 0:
        g = mean_gate_score(tap)
        terms.append(recipe.gate_l1 * g)
        log["gate_score"] = float(g.detach())
    return (torch.stack(terms).sum() if terms else None), log
