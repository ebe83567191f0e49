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
`Gate` is the module that applies a spec; the attention layer calls it at the spec's position, outside the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm


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


def get_gate(name: str) -> GateSpec | None:
    """The spec for a registry name (None for the baseline). Unknown names fail listing the valid ones."""
    return GATES[canonical_name(name)]


def _activate(logits: torch.Tensor, act: Activation) -> torch.Tensor:
    if act is Activation.SIGMOID:
        return torch.sigmoid(logits)
    if act is Activation.NS_SIGMOID:
        return 0.5 + 0.5 * torch.sigmoid(logits)
    if act is Activation.SILU:
        return F.silu(logits)
    return logits  # identity


def _act_at_zero(act: Activation) -> float:
    return {Activation.SIGMOID: 0.5, Activation.NS_SIGMOID: 0.75, Activation.SILU: 0.0, Activation.IDENTITY: 0.0}[act]


class Gate(nn.Module):
    """Applies one GateSpec. `forward(y, x)` returns (Y', score or None).

    y: (B, T, heads, D) for head positions, (B, T, d) for the dense position; x: (B, T, d) the pre-normed layer input.
    Parameters: `proj` (Linear d -> score width) for source=input, `theta` for source=constant, `norm.weight` for
    rmsnorm. `scale` is 1, or 1/act(0) with gate_init="identity" so the gate starts as an exact identity.
    """

    def __init__(self, spec: GateSpec, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, init: str = "normal", eps: float = 1e-6):
        super().__init__()
        if init not in GATE_INITS:
            raise ValueError(f"unknown gate_init {init!r}; valid: {', '.join(GATE_INITS)}")
        self.spec, self.init, self.head_dim = spec, init, head_dim
        self.width = spec.score_width(hidden_size, num_heads, num_kv_heads, head_dim)
        self.scale = 1.0
        if init == "identity" and spec.source is not Source.NONE:
            a0 = _act_at_zero(spec.activation)
            if spec.combine is Combine.MULTIPLY:
                if a0 == 0.0:
                    raise ValueError(f"gate_init='identity' needs act(0) != 0 for a multiplicative gate; "
                                     f"{spec.activation.value} gives 0: use gate_init='normal'")
                self.scale = 1.0 / a0
            elif a0 != 0.0:
                raise ValueError(f"gate_init='identity' for an additive gate needs act(0) == 0; "
                                 f"{spec.activation.value} gives {a0}: use gate_init='normal'")
        if spec.source is Source.INPUT:
            self.proj = nn.Linear(hidden_size, self.width, bias=bias)
            self.proj._zero_init = init == "identity"  # read by the model's _init_weights
        elif spec.source is Source.CONSTANT:
            per_head = head_dim if spec.granularity is Granularity.ELEMENTWISE else 1
            # zero-init per the paper; (heads, D or 1) before o_proj, (width,) after it (G5 acts on the hidden size)
            shape = (self.width,) if spec.position is Position.DENSE else (self.width // per_head, per_head)
            self.theta = nn.Parameter(torch.zeros(shape))
        elif spec.activation is Activation.RMSNORM:
            self.norm = RMSNorm(head_dim, eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activation scores X W (B, T, width) of an input-dependent gate; score() = scale * act(logits)."""
        if self.spec.source is not Source.INPUT:
            raise ValueError(f"gate {self.extra_repr()} has no input projection, hence no logits")
        return self.proj(x)

    def score(self, x: torch.Tensor, y_shape: torch.Size) -> torch.Tensor | None:
        spec = self.spec
        if spec.source is Source.NONE:
            return None
        if spec.source is Source.INPUT:
            logits = self.logits(x)  # (B, T, width)
            if spec.position is not Position.DENSE:
                logits = logits.view(*x.shape[:-1], y_shape[-2], -1)  # (B, T, heads, D or 1)
        else:
            logits = self.theta  # (heads, D or 1), broadcast over (B, T)
        s = _activate(logits, spec.activation)
        if spec.sharing is Sharing.HEAD_SHARED:
            s = s.mean(dim=-2, keepdim=True)  # (B, T, 1, D): averaged after the activation (the paper's "score")
        if self.scale != 1.0:
            s = s * self.scale
        return s

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = self.spec
        if spec.source is Source.NONE:
            if spec.activation is Activation.RMSNORM:
                return self.norm(y), None
            return _activate(y, spec.activation), None
        s = self.score(x, y.shape)
        if spec.combine is Combine.MULTIPLY:
            return y * s, s
        return y + s, s

    def extra_repr(self) -> str:
        return f"{self.spec.position.value}/{self.spec.granularity.value}/{self.spec.sharing.value}/" \
               f"{self.spec.combine.value}/{self.spec.activation.value}/{self.spec.source.value}, init={self.init}"


def build_gate(name: str, config) -> Gate | None:
    """The gate module for `config.gate` (or None for the baseline) sized from a model config."""
    spec = get_gate(name)
    if spec is None:
        return None
    return Gate(spec, config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                bias=config.attention_bias, init=config.gate_init, eps=config.rms_norm_eps)
