"""`Gate`: the module that applies a GateSpec (gates.py, the registry); the attention layer calls it at the spec's
position, outside the kernel. `build_gate` sizes one from a model config.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gates import GATE_INITS, Activation, Combine, GateSpec, Granularity, Position, Sharing, Source, get_gate
from .norm import RMSNorm


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
