"""The comparison-mechanism registry: every mechanism the paper compares gating against (paper map §3.1, §3.6,
§6), selectable by name (config key `mechanism`).

Like gates.py for gates: a frozen `MechanismSpec` per mechanism, `MECHANISMS` maps a stable name to a spec, and
`presets.added_params(spec, config)` gives the parameters it adds to a whole model (sizing lives with the presets,
which import this registry, never the reverse). Two families:

  parameter expansion  (kind=expand)  a different model SHAPE, not a module: more KV heads (paper k=8), more query
                       heads (paper q=48), +4 experts total and activated. `expanded_config(config, name)` /
                       `presets.mechanism_config(preset, name)` derive the config; `config.mechanism` never holds these names.
  runtime mechanisms   stored in `config.mechanism`, built by `build_attention_mechanism` / `build_branch_transforms`:
    switch_{kv,v}_EtopK  Switch Heads (Csordás et al. 2024): the value (and key) projection of every KV head is a
                         mixture of E experts, top-k by non-competitive scores s = sigmoid(x W_S) computed from the
                         layer input; K and V share one selector (both are "source side"). Expert 0 is the stock
                         k_proj/v_proj, so "switch_v_1top1" is exactly a sigmoid headwise gate on V (paper map §6).
    sandwich_norm        RMSNorm on the attention and FFN outputs before the residual add (CogView).
    output_clip_C        clamp the attention and FFN outputs to [-C, C] before the residual add (paper App. A.6).
    bondarenko_gate      Bondarenko et al. 2023 conditional per-token gate: head h's output * sigmoid(w_h . x_h + b_h),
                         x_h = head h's d_head slice of the layer input, b_h initialised to logit(0.25).
    clipped_softmax      Bondarenko et al. 2023: p' = clip((zeta - gamma) softmax(z) + gamma, 0, 1).
    sink_logits          gpt-oss: one learned logit per head joins each softmax denominator (its value is zero).
    forgetting[_nope]    Forgetting Transformer: f_t = sigmoid(w_h . x_t + b_h) per head, logits += sum_{l=j+1..i}
                         log f_l; "_nope" also drops RoPE (FoX uses no positional embedding).

Kernel contract: mechanisms that change the softmax do it by transforming (k, v, mask) before the backend kernel
(an explicit float mask; sinks as one extra zero-value key column whose mask entry is the sink logit), so eager and
sdpa run the same maths. Clipped softmax acts on probabilities, which no fused kernel exposes: it always uses the
materialised path (`clipped_softmax_attention`), whatever the backend. FoX needs log f of every cached key: it is
stored as n_rep extra channels of k (B, KV, S, D + n_rep), so the KV cache (and its crop/reorder) carries it.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm


class Kind(str, Enum):
    NONE = "none"
    EXPAND = "expand"  # a different model shape (more heads / experts)
    SWITCH = "switch"
    SANDWICH_NORM = "sandwich_norm"
    OUTPUT_CLIP = "output_clip"
    HEAD_SLICE_GATE = "head_slice_gate"  # Bondarenko et al. conditional per-token gate
    CLIPPED_SOFTMAX = "clipped_softmax"
    SINK = "sink"
    FORGET = "forget"


@dataclass(frozen=True)
class MechanismSpec:
    kind: Kind = Kind.NONE
    experts: int = 0  # switch: experts per KV head (expert 0 = the stock projection)
    top_k: int = 0  # switch: experts used per token and head
    switch_keys: bool = False  # switch: keys are expert mixtures too ("switch kv")
    clip: float = 0.0  # output_clip: c in clamp(., -c, c)
    use_rope: bool = True  # forget: False = no positional embedding (as FoX)
    kv_heads_factor: float = 1.0  # expand: KV heads x this
    q_heads_factor: float = 1.0  # expand: query heads x this
    extra_experts: int = 0  # expand: experts added to both the total and the activated count
    paper: str = ""  # where the paper reports it
    paper_added_m: float | None = None  # the paper's "Added (M)" column for the 15A2B shape

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.kind is Kind.SWITCH and not (1 <= self.top_k <= self.experts):
            raise ValueError(f"switch heads need 1 <= top_k <= experts; got {self.top_k} of {self.experts}")
        if self.kind is Kind.OUTPUT_CLIP and not self.clip > 0:
            raise ValueError(f"output clipping needs c > 0; got {self.clip}")

    @property
    def runtime(self) -> bool:
        """True for mechanisms stored in config.mechanism (False for 'none' and the shape expansions)."""
        return self.kind not in (Kind.NONE, Kind.EXPAND)

    @property
    def in_attention(self) -> bool:
        return self.kind in (Kind.SWITCH, Kind.HEAD_SLICE_GATE, Kind.CLIPPED_SOFTMAX, Kind.SINK, Kind.FORGET)

    @property
    def on_branches(self) -> bool:
        return self.kind in (Kind.SANDWICH_NORM, Kind.OUTPUT_CLIP)


def _switch(experts: int, top_k: int, keys: bool, row: str, m: float | None = None) -> MechanismSpec:
    return MechanismSpec(Kind.SWITCH, experts=experts, top_k=top_k, switch_keys=keys, paper=row, paper_added_m=m)


# name -> spec. Names are stable: runtime ones are written to config.json.
MECHANISMS: dict[str, MechanismSpec] = {
    "none": MechanismSpec(),
    # Table 1 rows 2-4: parameter expansion of the 15A2B model
    "more_kv_heads": MechanismSpec(Kind.EXPAND, kv_heads_factor=2, paper="T1 row 2: k = 8 KV heads (x2)", paper_added_m=50),
    "more_q_heads": MechanismSpec(Kind.EXPAND, q_heads_factor=1.5, paper="T1 row 3: q = 48 query heads (x1.5)",
                                 paper_added_m=201),
    "more_experts": MechanismSpec(Kind.EXPAND, extra_experts=4, paper="T1 row 4: +4 experts, total and activated",
                                 paper_added_m=400),
    # Table 6: Switch Heads
    "switch_kv_8top8": _switch(8, 8, True, "T6 row 2: Switch kv 8top8", 38),
    "switch_kv_4top4": _switch(4, 4, True, "T6 row 3: Switch kv 4top4", 13),
    "switch_v_4top4": _switch(4, 4, False, "T6 row 4: Switch v 4top4", 13),
    "switch_v_8top2": _switch(8, 2, False, "T6 row 5: Switch v 8top2", 25),
    "switch_v_1top1": _switch(1, 1, False, "T6 row 6: Switch v 1top1 (= v headwise gate)", 3),
    # App. A.6 stability baselines and the related attend-to-nothing mechanisms (paper map §6)
    "sandwich_norm": MechanismSpec(Kind.SANDWICH_NORM, paper="paper map §6: sandwich norm (CogView)"),
    "output_clip_100": MechanismSpec(Kind.OUTPUT_CLIP, clip=100.0, paper="App. A.6: clip outputs to +-100"),
    "output_clip_300": MechanismSpec(Kind.OUTPUT_CLIP, clip=300.0, paper="App. A.6: clip outputs to +-300"),
    "bondarenko_gate": MechanismSpec(Kind.HEAD_SLICE_GATE, paper="paper map §6: Bondarenko et al. 2023 per-token gate"),
    "clipped_softmax": MechanismSpec(Kind.CLIPPED_SOFTMAX, paper="paper map §6: Bondarenko et al. 2023 clipped softmax"),
    "sink_logits": MechanismSpec(Kind.SINK, paper="paper map §6: gpt-oss learned per-head sinks"),
    "forgetting": MechanismSpec(Kind.FORGET, paper="paper map §6: Forgetting Transformer forget gate, with RoPE"),
    "forgetting_nope": MechanismSpec(Kind.FORGET, use_rope=False, paper="paper map §6: Forgetting Transformer, no RoPE"),
}

# Names outside the table that follow a pattern (other expert counts / clip values) are accepted as well.
_SWITCH_RE = re.compile(r"switch_(kv|v)_(\d+)top(\d+)")
_CLIP_RE = re.compile(r"output_clip_(\d+(?:\.\d+)?)")


def get_mechanism(name: str) -> MechanismSpec:
    """The spec for a name: a MECHANISMS entry or a pattern name (switch_v_16top4, output_clip_50)."""
    if name in MECHANISMS:
        return MECHANISMS[name]
    if m := _SWITCH_RE.fullmatch(name):
        return _switch(int(m[2]), int(m[3]), m[1] == "kv", f"Switch {m[1]} {m[2]}top{m[3]} (not a paper row)")
    if m := _CLIP_RE.fullmatch(name):
        return MechanismSpec(Kind.OUTPUT_CLIP, clip=float(m[1]), paper=f"clip outputs to +-{m[1]} (not a paper row)")
    raise ValueError(f"unknown mechanism {name!r}; valid names: {', '.join(MECHANISMS)} "
                     f"(or switch_{{kv,v}}_<E>top<k>, output_clip_<c>)")


def validate_config(config) -> None:
    """Config-time checks for `config.mechanism` and its numeric fields; one clear error per problem."""
    spec = get_mechanism(config.mechanism)
    if spec.kind is Kind.EXPAND:
        raise ValueError(f"baseline {config.mechanism!r} changes the model shape, it is not a module: build its config "
                         f"with gated_attention.mechanisms.expanded_config(config, {config.mechanism!r}) and keep "
                         f"mechanism='none'")
    if not config.softmax_zeta >= 1.0 or not config.softmax_gamma <= 0.0:
        raise ValueError(f"clipped softmax needs zeta >= 1 and gamma <= 0 (stretch beyond [0, 1] so exact 0/1 are "
                         f"reachable); got zeta={config.softmax_zeta}, gamma={config.softmax_gamma}")
    if spec.kind is not Kind.CLIPPED_SOFTMAX and (config.softmax_zeta, config.softmax_gamma) != (1.0, -0.03):
        raise ValueError(f"softmax_zeta/softmax_gamma are only used by mechanism='clipped_softmax' (this config has "
                         f"mechanism={config.mechanism!r}): set the mechanism or leave them at 1.0 / -0.03")
    if spec.kind is Kind.HEAD_SLICE_GATE and config.hidden_size != config.num_attention_heads * config.head_dim:
        raise ValueError(f"bondarenko_gate reads head h's d_head slice of the layer input, so it needs hidden_size == "
                         f"num_attention_heads * head_dim; got {config.hidden_size} != {config.num_attention_heads} * "
                         f"{config.head_dim}: use a shape with H*D == d or the sdpa_headwise gate")


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts and the shape expansions
# ---------------------------------------------------------------------------------------------------------------

def per_layer_params(spec: MechanismSpec, config) -> int:
    d, H, KV, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    b = int(config.attention_bias)
    if spec.kind is Kind.SWITCH:
        projections = 2 if spec.switch_keys else 1
        return projections * (spec.experts - 1) * KV * D * (d + b) + d * KV * spec.experts  # experts + one selector
    if spec.kind is Kind.SANDWICH_NORM:
        return 2 * d
    if spec.kind is Kind.HEAD_SLICE_GATE:
        return H * D + H
    if spec.kind is Kind.SINK:
        return H
    if spec.kind is Kind.FORGET:
        return d * H + H
    return 0  # none, clipping, clipped softmax


def expanded_config(config, name: MechanismSpec | str):
    """A copy of `config` with a parameter-expansion baseline applied (more KV heads / query heads / experts)."""
    spec = get_mechanism(name) if isinstance(name, str) else name
    if spec.kind is not Kind.EXPAND:
        raise ValueError(f"{name!r} is not a parameter-expansion baseline; set config.mechanism instead")
    H, KV = config.num_attention_heads, config.num_key_value_heads
    new = {}
    if spec.kv_heads_factor != 1:
        kv = round(KV * spec.kv_heads_factor)
        if H % kv:
            raise ValueError(f"more_kv_heads: {kv} KV heads do not divide {H} query heads; pick a shape where they do")
        new["num_key_value_heads"] = kv
    if spec.q_heads_factor != 1:
        h = round(H * spec.q_heads_factor)
        if h % KV:
            raise ValueError(f"more_q_heads: {h} query heads are not a multiple of {KV} KV heads; pick another shape")
        new["num_attention_heads"] = h
    if spec.extra_experts:
        if config.num_experts == 0:
            raise ValueError("more_experts needs an MoE model (num_experts > 0), e.g. preset '15a2b' or 'tiny-moe'")
        new["num_experts"] = config.num_experts + spec.extra_experts
        new["num_experts_per_tok"] = config.num_experts_per_tok + spec.extra_experts
    return type(config)(**{**config.to_dict(), **new})


# ---------------------------------------------------------------------------------------------------------------
# Runtime modules
# ---------------------------------------------------------------------------------------------------------------

def additive_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The attention mask as an additive float tensor (B or 1, 1, T, S) in q's dtype, from what transformers passes:
    None (T > 1: upper-left causal, the convention of attention.py's kernels; T == 1: every key), bool, or float."""
    t, s = q.shape[2], k.shape[2]
    if mask is None:
        if t == 1:
            return q.new_zeros(1, 1, 1, s)
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()[None, None]  # (1, 1, T, S)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    return mask.to(q.dtype)


class AttentionMechanism(nn.Module):
    """Hooks the attention layer calls at fixed points; the defaults change nothing. One subclass per mechanism."""

    use_rope = True

    def __init__(self, spec: MechanismSpec, config):
        super().__init__()
        self.spec = spec
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                           config.head_dim)

    def project_kv(self, x, k_proj, v_proj):
        """(B, T, d) -> k, v (B, T, KV, D); None = use the stock projections."""
        return None

    def extend_keys(self, k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """k (B, KV, T, D) after RoPE, before the cache: may append per-key channels the kernel step reads back."""
        return k

    def key_view(self, k: torch.Tensor) -> torch.Tensor:
        """The (B, KV, S, D) keys without appended channels (what analysis should see)."""
        return k

    changes_kernel = False  # True: the softmax itself changes, so only the eager and sdpa backends are supported

    def wrap(self, kernel, impl: str):
        """The backend kernel with this mechanism's attend() around it (same call contract)."""
        if not self.changes_kernel:
            return kernel
        if impl not in ("eager", "sdpa"):
            raise ValueError(f"baseline {self.spec.kind.value!r} changes the softmax and supports the eager and sdpa "
                             f"backends, not {impl!r}: call model.set_attn_implementation('sdpa')")
        return functools.partial(self.attend, kernel)

    def attend(self, kernel, module, q, k, v, mask, scaling, **kw):
        return kernel(module, q, k, v, mask, scaling, **kw)

    def gate_output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, T, H, D) per-head attention output, x (B, T, d) the layer input."""
        return y

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        """Initialise this module's own Parameters (its Linear children get the model's generic init)."""

    def extra_repr(self) -> str:
        return f"{self.spec.kind.value}"


class SwitchHeads(AttentionMechanism):
    """V (and K) of KV head g = sum over its top-k experts e of s_{g,e} x W^{g,e}, s = sigmoid(x W_S) (B, T, KV, E).
    Expert 0 is the stock projection; experts 1..E-1 live in `v_experts` / `k_experts`. Every expert is computed
    densely (E x the projection FLOPs): the plain form, fine at the sizes this is run at."""

    def __init__(self, spec, config):
        super().__init__(spec, config)
        d, KV, D, E = config.hidden_size, self.num_kv_heads, self.head_dim, spec.experts
        self.router = nn.Linear(d, KV * E, bias=False)
        self.v_experts = nn.Linear(d, (E - 1) * KV * D, bias=config.attention_bias) if E > 1 else None
        self.k_experts = nn.Linear(d, (E - 1) * KV * D, bias=config.attention_bias) if E > 1 and spec.switch_keys \
            else None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> non-competitive selection weights (B, T, KV, E), zero outside each head's top-k."""
        s = torch.sigmoid(self.router(x)).unflatten(-1, (self.num_kv_heads, self.spec.experts))  # (B, T, KV, E)
        if self.spec.top_k < self.spec.experts:
            keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(self.spec.top_k, dim=-1).indices, True)
            s = s * keep
        return s

    def _mix(self, x, stock: nn.Linear, extra: nn.Linear | None, s):
        outs = stock(x).unflatten(-1, (1, self.num_kv_heads, self.head_dim))  # (B, T, 1, KV, D)
        if extra is not None:
            more = extra(x).unflatten(-1, (self.spec.experts - 1, self.num_kv_heads, self.head_dim))  # (B, T, E-1, KV, D)
            outs = torch.cat([outs, more], dim=2)  # (B, T, E, KV, D)
        return torch.einsum("btegd,btge->btgd", outs, s)  # (B, T, KV, D)

    def project_kv(self, x, k_proj, v_proj):
        s = self.scores(x)
        v = self._mix(x, v_proj, self.v_experts, s)
        if self.spec.switch_keys:
            k = self._mix(x, k_proj, self.k_experts, s)
        else:
            k = k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))  # (B, T, KV, D)
        return k, v

    def extra_repr(self) -> str:
        return f"switch {'kv' if self.spec.switch_keys else 'v'} {self.spec.experts}top{self.spec.top_k}"


class HeadSliceGate(AttentionMechanism):
    """Bondarenko et al.: y_h * sigmoid(x_h . w_h + b_h), x_h = x[..., h*D:(h+1)*D]; b_h starts at logit(0.25)."""

    init_prob = 0.25  # Bondarenko et al.'s attn_gate_init: heads start mostly "attending to nothing"

    def __init__(self, spec, config):
        super().__init__(spec, config)
        if config.hidden_size != self.num_heads * self.head_dim:
            raise ValueError("bondarenko_gate needs hidden_size == num_attention_heads * head_dim")
        self.weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.bias = nn.Parameter(torch.empty(self.num_heads))
        self.init_parameters(config.initializer_range)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        xh = x.unflatten(-1, (self.num_heads, self.head_dim))  # (B, T, H, D)
        return torch.sigmoid((xh * self.weight).sum(-1) + self.bias)  # (B, T, H)

    def gate_output(self, y, x):
        return y * self.score(x).unsqueeze(-1).to(y.dtype)

    @torch.no_grad()
    def init_parameters(self, std):
        from transformers import initialization as init

        init.normal_(self.weight, mean=0.0, std=std)
        init.constant_(self.bias, math.log(self.init_prob / (1 - self.init_prob)))


def clipped_softmax_attention(module, q, k, v, mask, scaling, zeta, gamma, dropout=0.0):
    """Materialised attention with p' = clamp((zeta - gamma) * softmax + gamma, 0, 1). q (B, H, T, D), k/v (B, KV, S, D)
    -> ((B, T, H, D), p' (B, H, T, S)). Softmax in fp32, as the core kernels."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, H, S, D): head h reads h // n_rep
    logits = torch.matmul(q, k.transpose(2, 3)) * scaling + additive_mask(mask, q, k)  # (B, H, T, S)
    p = F.softmax(logits, dim=-1, dtype=torch.float32)
    p = ((zeta - gamma) * p + gamma).clamp(0.0, 1.0).to(q.dtype)
    p_used = F.dropout(p, p=dropout, training=module.training) if dropout else p
    return torch.matmul(p_used, v).transpose(1, 2).contiguous(), p  # (B, T, H, D)


class ClippedSoftmax(AttentionMechanism):
    changes_kernel = True

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.zeta, self.gamma = float(config.softmax_zeta), float(config.softmax_gamma)

    def attend(self, kernel, module, q, k, v, mask, scaling, dropout=0.0, **kw):
        return clipped_softmax_attention(module, q, k, v, mask, scaling, self.zeta, self.gamma, dropout)

    def extra_repr(self) -> str:
        return f"clipped softmax zeta={self.zeta}, gamma={self.gamma}"


class SinkLogits(AttentionMechanism):
    """softmax over [z_i1 .. z_iS, s_h], sink column dropped: rows sum to < 1. Done as an extra key k=0 with value 0
    whose additive mask entry is s_h, so the backend kernel (eager or sdpa) computes it unchanged."""

    changes_kernel = True

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.init_parameters(config.initializer_range)

    def attend(self, kernel, module, q, k, v, mask, scaling, **kw):
        b, h, t, _ = q.shape
        s = k.shape[2]
        k = torch.cat([k, k.new_zeros(b, k.shape[1], 1, k.shape[3])], dim=2)  # (B, KV, S+1, D)
        v = torch.cat([v, v.new_zeros(b, v.shape[1], 1, v.shape[3])], dim=2)  # (B, KV, S+1, D)
        m = additive_mask(mask, q, k[:, :, :s]).expand(b, h, t, s)  # (B, H, T, S)
        sink = self.sinks.to(q.dtype).view(1, h, 1, 1).expand(b, h, t, 1)  # (B, H, T, 1)
        y, probs = kernel(module, q, k, v, torch.cat([m, sink], dim=-1), scaling, **kw)
        return y, (probs[..., :s] if probs is not None else None)

    @torch.no_grad()
    def init_parameters(self, std):
        from transformers import initialization as init

        init.normal_(self.sinks, mean=0.0, std=std)


class ForgetGate(AttentionMechanism):
    """FoX: logits_ij += C_i - C_j, C_i = sum_{l<=i} log f_l, f = sigmoid(x W_f + b_f) per query head (B, T, H).
    log f of each key is appended to k as n_rep channels (B, KV, T, D + n_rep) so the cache keeps it."""

    changes_kernel = True

    def __init__(self, spec, config):
        super().__init__(spec, config)
        self.use_rope = spec.use_rope
        self.n_rep = self.num_heads // self.num_kv_heads
        self.proj = nn.Linear(config.hidden_size, self.num_heads, bias=True)  # weights N(0, std), bias 0: f = 0.5 at start

    def extend_keys(self, k, x):
        b, t = x.shape[:2]
        logf = F.logsigmoid(self.proj(x))  # (B, T, H)
        logf = logf.view(b, t, self.num_kv_heads, self.n_rep).transpose(1, 2)  # (B, KV, T, n_rep): head h = g*n_rep + r
        return torch.cat([k, logf.to(k.dtype)], dim=-1)  # (B, KV, T, D + n_rep)

    def key_view(self, k):
        return k[..., : self.head_dim]

    def decay_bias(self, k_ext: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, KV, S, D + n_rep) keys and the additive mask (B or 1, 1, T, S) -> D (B, H, T, S), fp32.
        D_ij = C_i - C_j with C = cumsum(log f) over the keys. C_i is taken as the smallest C_j the row may see
        (C never increases and a query sees itself), so no assumption on where the queries sit in the cache holds it
        (dynamic cache: the last T keys; static cache: anywhere). Fully masked rows get C_i = 0."""
        b, kv, s, _ = k_ext.shape
        logf = k_ext[..., self.head_dim:].float().permute(0, 1, 3, 2).reshape(b, kv * self.n_rep, s)  # (B, H, S)
        c = logf.cumsum(-1)[:, :, None, :]  # (B, H, 1, S)
        visible = mask > torch.finfo(mask.dtype).min / 2  # (B or 1, 1, T, S)
        c_row = torch.where(visible, c, torch.inf).amin(-1, keepdim=True)  # (B, H, T, 1)
        c_row = torch.where(torch.isinf(c_row), 0.0, c_row)
        return c_row - c  # (B, H, T, S)

    def attend(self, kernel, module, q, k, v, mask, scaling, **kw):
        k_ext, k = k, self.key_view(k)
        m = additive_mask(mask, q, k)
        return kernel(module, q, k, v, m + self.decay_bias(k_ext, m).to(q.dtype), scaling, **kw)


_ATTENTION_MODULES = {Kind.SWITCH: SwitchHeads, Kind.HEAD_SLICE_GATE: HeadSliceGate, Kind.CLIPPED_SOFTMAX: ClippedSoftmax,
                      Kind.SINK: SinkLogits, Kind.FORGET: ForgetGate}


def build_attention_mechanism(config) -> AttentionMechanism | None:
    spec = get_mechanism(getattr(config, "mechanism", "none"))
    return _ATTENTION_MODULES[spec.kind](spec, config) if spec.in_attention else None


class Clip(nn.Module):
    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x.clamp(-self.c, self.c)

    def extra_repr(self) -> str:
        return f"+-{self.c}"


def build_branch_transforms(config) -> tuple[nn.Module, nn.Module]:
    """(attention-output, FFN-output) transforms applied before each residual add: identity, RMSNorm (sandwich norm)
    or clamp to +-c (output clipping)."""
    spec = get_mechanism(getattr(config, "mechanism", "none"))
    if spec.kind is Kind.SANDWICH_NORM:
        return RMSNorm(config.hidden_size, config.rms_norm_eps), RMSNorm(config.hidden_size, config.rms_norm_eps)
    if spec.kind is Kind.OUTPUT_CLIP:
        return Clip(spec.clip), Clip(spec.clip)
    return nn.Identity(), nn.Identity()


__all__ = ["MECHANISMS", "MechanismSpec", "Kind", "get_mechanism", "per_layer_params", "expanded_config",
           "validate_config", "build_attention_mechanism", "build_branch_transforms",
           "clipped_softmax_attention", "additive_mask"]
