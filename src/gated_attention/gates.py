"""The gate registry: the one home of every gating variant the paper compares (Qiu et al. 2025, §2.2, Tables 1/3/4).

A variant is a frozen `GateSpec`, a point on six axes:
  position     G1 SDPA output | G2 value | G3 key | G4 query | G5 after o_proj            (where Y is taken)
  granularity  elementwise (score has Y's shape) | headwise (one scalar per head)
  sharing      head-specific | head-shared (score averaged over the head axis after the activation)
  combine      multiply (Y' = Y * s) | add (Y' = Y + s)
  activation   sigmoid | silu | ns_sigmoid (0.5 + 0.5 sigmoid) | identity | rmsnorm
  source       input (s = act(X W), query-dependent) | constant (s = act(theta), theta zero-initialised)
               | none (no score: Y' = act(Y), the parameter-free non-linearity analyses)
`GATES` maps a stable name (used in config.json and on the command line) to a spec; adding a variant = one entry.
`Gate`, the module that applies a spec, is in gate_layer.py (this registry imports no torch: command-line parsers read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Position(str, Enum):
    SDPA = "sdpa"  # G1: per-head SDPA output, before o_proj (the paper's best)
    VALUE = "value"  # G2: after v_proj
    KEY = "key"  # G3: after k_proj (before QK-norm and RoPE)
    QUERY = "query"  # G4: after q_proj (before QK-norm and RoPE)
    DENSE = "dense"  # G5: after o_proj (no heads there)


class Granularity(str, Enum):
    ELEMENTWISE = "elementwise"  # one score per element of the head's output (H*D scores)
    HEADWISE = "headwise"  # one score per head, broadcast over head_dim (H scores)


class Sharing(str, Enum):
    """Whether each head has its own gate projection, or all heads share one."""
    HEAD_SPECIFIC = "head_specific"
    HEAD_SHARED = "head_shared"


class Combine(str, Enum):
    MULTIPLY = "multiply"  # y * score (the paper's gates)
    ADD = "add"  # y + score (the additive variant)


class Activation(str, Enum):
    SIGMOID = "sigmoid"
    SILU = "silu"
    NS_SIGMOID = "ns_sigmoid"
    IDENTITY = "identity"
    RMSNORM = "rmsnorm"  # only with source=none: per-head RMSNorm of Y (the paper's "SDPA GroupNorm")


class Source(str, Enum):
    INPUT = "input"
    CONSTANT = "constant"
    NONE = "none"


GATE_INITS = ("normal", "identity")  # official N(0, std) (gate ~0.5 at start) | zero weights, score == 1 at start


@dataclass(frozen=True)
class GateSpec:
    position: Position = Position.SDPA
    granularity: Granularity = Granularity.ELEMENTWISE
    sharing: Sharing = Sharing.HEAD_SPECIFIC
    combine: Combine = Combine.MULTIPLY
    activation: Activation = Activation.SIGMOID
    source: Source = Source.INPUT
    paper: str = ""  # where the paper reports it

    def __post_init__(self):
        for axis, enum in (("position", Position), ("granularity", Granularity), ("sharing", Sharing),
                           ("combine", Combine), ("activation", Activation), ("source", Source)):
            object.__setattr__(self, axis, enum(getattr(self, axis)))
        problems = []
        if self.position is Position.DENSE and (self.granularity is Granularity.HEADWISE or self.sharing is Sharing.HEAD_SHARED):
            problems.append("the dense-output position (G5) has no heads: use granularity=elementwise, sharing=head_specific")
        if self.sharing is Sharing.HEAD_SHARED and self.granularity is Granularity.HEADWISE:
            problems.append("a head-shared headwise gate is one scalar for all heads: use elementwise with head_shared")
        if self.activation is Activation.RMSNORM and self.source is not Source.NONE:
            problems.append("rmsnorm is a transform of Y itself: use source=none")
        if self.source is Source.NONE and (self.position is not Position.SDPA or self.combine is not Combine.MULTIPLY):
            problems.append("parameter-free transforms (source=none) are defined on the SDPA output only")
        if self.source is Source.NONE and self.activation in (Activation.SIGMOID, Activation.NS_SIGMOID):
            problems.append("sigmoid(Y) as the output is not a paper variant; use silu, identity or rmsnorm with source=none")
        if problems:
            raise ValueError("invalid gate spec: " + "; ".join(problems))

    @property
    def fusable_in_kernel(self) -> bool:
        """Y * sigmoid(X W) per head at the SDPA output (G1 elementwise or headwise, the paper's gates): what an
        attention kernel can apply in its epilogue from the gate logits (the `triton_gated` backend)."""
        return (self.position is Position.SDPA and self.combine is Combine.MULTIPLY and self.source is Source.INPUT
                and self.activation is Activation.SIGMOID and self.sharing is Sharing.HEAD_SPECIFIC)

    @property
    def heads_axis(self) -> str:
        """Which head count the gated tensor has: 'q' (H), 'kv' (KV) or 'model' (no heads)."""
        return {Position.SDPA: "q", Position.QUERY: "q", Position.VALUE: "kv", Position.KEY: "kv", Position.DENSE: "model"}[self.position]

    def added_params(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False) -> int:
        """Parameters this gate adds to ONE attention layer."""
        width = self.score_width(hidden_size, num_heads, num_kv_heads, head_dim)
        if self.source is Source.INPUT:
            return hidden_size * width + (width if bias else 0)
        if self.source is Source.CONSTANT:
            return width
        return head_dim if self.activation is Activation.RMSNORM else 0

    def score_width(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
        """Number of gate logits per token (before any head sharing)."""
        if self.position is Position.DENSE:
            return hidden_size
        heads = num_heads if self.heads_axis == "q" else num_kv_heads
        return heads * (head_dim if self.granularity is Granularity.ELEMENTWISE else 1)


def _spec(position="sdpa", granularity="elementwise", sharing="head_specific", combine="multiply",
          activation="sigmoid", source="input", paper="") -> GateSpec:
    return GateSpec(Position(position), Granularity(granularity), Sharing(sharing), Combine(combine),
                    Activation(activation), Source(source), paper)


# name -> spec. `None` = no gate ("none", the ungated model the paper calls the baseline). Names are stable: they are
# written to config.json.
GATES: dict[str, GateSpec | None] = {
    "none": None,
    # Table 1
    "sdpa_elementwise": _spec(paper="T1 row 5 / T4 row 2: G1 elementwise sigmoid (the recommended gate)"),
    "value_elementwise": _spec("value", paper="T1 row 6: G2 elementwise"),
    "key_elementwise": _spec("key", paper="T1 row 7: G3 elementwise"),
    "query_elementwise": _spec("query", paper="T1 row 8: G4 elementwise"),
    "dense_elementwise": _spec("dense", paper="T1 row 9: G5 after o_proj"),
    "sdpa_headwise": _spec(granularity="headwise", paper="T1 row 10 / T4 row 3: G1 headwise"),
    "value_headwise": _spec("value", "headwise", paper="T1 row 11: G2 headwise (= Switch v 1top1)"),
    "sdpa_headshared": _spec(sharing="head_shared", paper="T1 row 12 / T4 row 4: G1 elementwise head-shared"),
    "value_headshared": _spec("value", sharing="head_shared", paper="T1 row 13: G2 elementwise head-shared"),
    "sdpa_additive_silu": _spec(combine="add", activation="silu", paper="T1 row 14 / T3 row 4: Y + SiLU(XW)"),
    "sdpa_elementwise_silu": _spec(activation="silu", paper="T1 row 15: Y * SiLU(XW)"),
    # Table 3 (non-linearity analysis)
    "sdpa_rmsnorm": _spec(activation="rmsnorm", source="none", paper="T3 row 5: per-head RMSNorm of Y ('SDPA GroupNorm')"),
    "sdpa_silu": _spec(activation="silu", source="none", paper="T3 row 6: SiLU(Y), no parameters"),
    "sdpa_additive_identity": _spec(combine="add", activation="identity", paper="T3 row 7: Y + XW"),
    # Table 4 (sparsity analysis)
    "sdpa_input_independent": _spec(source="constant", paper="T4 row 6: Y * sigmoid(theta), theta zero-init"),
    "sdpa_elementwise_nssigmoid": _spec(activation="ns_sigmoid", paper="T4 row 7: NS-sigmoid = 0.5 + 0.5 sigmoid"),
}

# Aliases accepted everywhere a gate is named (never written to config.json: names are canonicalised). "baseline" is
# the ungated model's name before it became "none"; old config.json files and run folders still use it.
ALIASES = {"baseline": "none", "g1": "sdpa_elementwise", "elementwise": "sdpa_elementwise", "headwise": "sdpa_headwise",
           "g2": "value_elementwise", "g3": "key_elementwise", "g4": "query_elementwise", "g5": "dense_elementwise"}


# The one table of default variants: what every multi-variant job (`gattn compare`, `gattn lab sinks`, `gattn lab
# stability`) trains unless told otherwise: the ungated model and the paper's two G1 gates (Table 4 rows 1-3). Names
# as users type them ("baseline" is the alias of "none"): they name the run folders and the rows of the reports.
DEFAULT_VARIANTS = ("baseline", "sdpa_elementwise", "sdpa_headwise")


def canonical_name(name: str) -> str:
    key = ALIASES.get(name, name)
    if key not in GATES:
        raise ValueError(f"unknown gate {name!r}; valid names: {', '.join(GATES)} (aliases: {', '.join(ALIASES)})")
    return key


def check_variants(variants, flag: str = "--variants") -> list[str]:
    """The canonical names of a job's gate variants; an unknown name, a repeat (aliases included) or none at all fails
    in one line naming `flag`."""
    bad = [v for v in variants if ALIASES.get(v, v) not in GATES]
    if bad:
        raise ValueError(f"unknown variant(s) {bad} in {flag}; valid: {', '.join(GATES)} (see `gattn gates`)")
    names = [canonical_name(v) for v in variants]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{flag} must list distinct gate names, got {list(variants)}")
    return names


def get_gate(name: str) -> GateSpec | None:
    """The spec for a registry name (None for the baseline). Unknown names fail listing the valid ones."""
    return GATES[canonical_name(name)]
