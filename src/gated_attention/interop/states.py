"""State-dict maps: a foreign checkpoint's tensors <-> native ones, validated against the shapes the native model
itself declares. What each format changes is data in layouts.py; the maps here apply it: fused [q | gate] q_proj
rows (index permutations), zero-centred norms, per-expert vs fused MoE keys, a tied LM head kept out.
"""
from __future__ import annotations

import torch

from ..gates import canonical_name
from . import llama
from .configs import check_native_for
from .layouts import EXPERT_KEY, GATE_KEY, NORM_KEY, Q_KEY, ConversionError, Layout, get_layout


# ----------------------------------------------------------------------------------------------- row permutations
def fused_q_rows(layout: str, num_heads: int, num_kv_heads: int, head_dim: int, gate_width: int) -> torch.Tensor:
    """Index `idx` with fused[r] = stacked[idx[r]], where stacked = cat([query rows (H*D, head-major),
    gate rows (H*gate_width, head-major)]) is the native order and fused is the format's q_proj.

    per_kv_group (official): for each KV group g, [query rows of its G heads | gate rows of the same G heads].
    per_head (Qwen3-Next):   for each head h, [q_h | g_h] (needs gate_width == head_dim)."""
    H, KV, D, W = num_heads, num_kv_heads, head_dim, gate_width
    G = H // KV
    q_rows = lambda h: list(range(h * D, h * D + D))  # noqa: E731 - head h's query rows in the stacked order
    g_rows = lambda h: list(range(H * D + h * W, H * D + h * W + W))  # noqa: E731
    idx: list[int] = []
    if layout == "per_kv_group":
        for g in range(KV):
            heads = range(g * G, g * G + G)
            idx += [r for h in heads for r in q_rows(h)] + [r for h in heads for r in g_rows(h)]
    elif layout == "per_head":
        if W != D:
            raise ConversionError(f"the per-head [q_h | g_h] layout needs an elementwise gate (width {D}); got {W}")
        for h in range(H):
            idx += q_rows(h) + g_rows(h)
    else:
        raise ConversionError(f"unknown fused q_proj layout {layout!r}; valid: per_kv_group, per_head")
    return torch.tensor(idx, dtype=torch.long)


def _fuse(q: torch.Tensor, g: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.cat([q, g], 0)[idx].contiguous()  # (H*D + H*W, ...) in the format's order


def _unfuse(fused: torch.Tensor, idx: torch.Tensor, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    stacked = torch.empty_like(fused)
    stacked[idx] = fused  # undo the permutation: stacked = native order
    return stacked[:n_q].contiguous(), stacked[n_q:].contiguous()


def _gate_width(ncfg: dict) -> int:
    return {"none": 0, "sdpa_elementwise": ncfg["head_dim"], "sdpa_headwise": 1}[canonical_name(ncfg.get("gate", "none"))]


def _fused_q_index(layout: Layout, ncfg: dict) -> torch.Tensor | None:
    """The q_proj row permutation between a fused [q | gate] layout and native, or None if nothing is fused."""
    width = _gate_width(ncfg)
    if layout.fused_q is None or not width:
        return None
    return fused_q_rows(layout.fused_q, ncfg["num_attention_heads"], ncfg["num_key_value_heads"], ncfg["head_dim"], width)


# ----------------------------------------------------------------------------------------------- state dicts
def native_shapes(ncfg: dict) -> dict[str, tuple[int, ...]]:
    """Expected native key -> shape, from the model itself built on the meta device (no memory, always in sync)."""
    from ..configuration import GatedQwen3Config
    from ..modeling import GatedQwen3ForCausalLM

    cfg = GatedQwen3Config(**ncfg)
    with torch.device("meta"):
        model = GatedQwen3ForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: saved once, as embed_tokens
    return shapes


def format_shapes(ncfg: dict, fmt: str) -> dict[str, tuple[int, ...]]:
    """Expected key -> shape of a `fmt` checkpoint for the model described by native kwargs `ncfg`."""
    shapes = native_shapes(ncfg)
    if fmt == "native" or get_layout(fmt).fused_q is None:
        return shapes
    for key in [k for k in shapes if ".self_attn.gate.proj." in k]:
        gate_shape = shapes.pop(key)
        q_key = key.replace(".gate.proj.", ".q_proj.")
        shapes[q_key] = (shapes[q_key][0] + gate_shape[0], *shapes[q_key][1:])
    return shapes


def validate_state(state: dict, expected: dict[str, tuple[int, ...]], fmt: str, tied: bool = False) -> None:
    """One error listing every missing key, unexpected key and wrong shape (key, expected, found)."""
    problems = []
    for key, shape in expected.items():
        if key not in state:
            problems.append(f"missing key {key} (expected shape {list(shape)})")
        elif tuple(state[key].shape) != shape:
            problems.append(f"wrong shape for {key}: expected {list(shape)}, found {list(state[key].shape)}")
    extra = [k for k in state if k not in expected and not (tied and k == "lm_head.weight")]
    problems += [f"unexpected key {k} (shape {list(state[k].shape)})" for k in extra]
    if problems:
        raise ConversionError(f"{fmt} checkpoint does not match its config: " + "; ".join(problems[:20])
                              + (f"; ... and {len(problems) - 20} more" if len(problems) > 20 else ""))


def _drop_tied_head(state: dict, tied: bool) -> dict:
    if tied and "lm_head.weight" in state:
        head, emb = state["lm_head.weight"], state.get("model.embed_tokens.weight")
        if emb is not None and not torch.equal(head, emb):
            raise ConversionError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
                                  "set tie_word_embeddings=false in config.json to keep both")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def _shift_norms(state: dict, delta: float) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = (v.float() + delta).to(v.dtype) if NORM_KEY.search(k) else v
    return out


def _stack_experts(state: dict) -> dict:
    """Per-expert Qwen3-MoE keys -> the fused native tensors; fused keys pass through unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in state.items():
        m = EXPERT_KEY.match(k)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        n = max(experts) + 1
        for e in range(n):
            missing = [p for p in ("gate_proj", "up_proj", "down_proj") if p not in experts.get(e, {})]
            if missing:
                raise ConversionError(f"{prefix}: expert {e} lacks {', '.join(missing)}.weight (experts 0..{n - 1} "
                                      "must each have gate_proj, up_proj and down_proj)")
        for name in ("gate_proj", "up_proj", "down_proj"):
            shapes = {tuple(experts[e][name].shape) for e in range(n)}
            if len(shapes) > 1:
                raise ConversionError(f"{prefix}.*.{name}.weight: experts disagree on shape {sorted(shapes)}")
        gate, up = experts[0]["gate_proj"], experts[0]["up_proj"]
        if gate.shape != up.shape:
            raise ConversionError(f"{prefix}: gate_proj {list(gate.shape)} and up_proj {list(up.shape)} differ")
        if f"{prefix}.gate_up_proj" in out or f"{prefix}.down_proj" in out:
            raise ConversionError(f"{prefix} has both per-expert and fused expert keys; keep one layout")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(n)])  # (E, 2I, d)
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])  # (E, d, I)
    return out


def _unstack_experts(state: dict) -> dict:
    """Fused native expert tensors -> per-expert Qwen3-MoE keys (what transformers' save_pretrained writes)."""
    out = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len(".gate_up_proj")]
            for e, w in enumerate(v):  # w (2I, d)
                gate, up = w.chunk(2, dim=0)  # (I, d) each
                # own storage per tensor: safetensors refuses to save views of one shared buffer
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k[: -len(".down_proj")]
            for e, w in enumerate(v):  # w (d, I)
                out[f"{prefix}.{e}.down_proj.weight"] = w.clone()
        else:
            out[k] = v
    return out


def state_to_native(state: dict, ncfg: dict, fmt: str) -> dict:
    """A `fmt` state dict -> native state dict (validated against the shapes `ncfg` implies)."""
    tied = bool(ncfg.get("tie_word_embeddings", False))
    if fmt != "native" and get_layout(fmt).moe:
        state = _stack_experts(state)  # validated below in the fused (native) names
    validate_state(state, format_shapes(ncfg, fmt), fmt, tied)
    state = _drop_tied_head(dict(state), tied)
    if fmt == "native":
        return state
    layout = get_layout(fmt)
    if layout.zero_centred_norms:
        state = _shift_norms(state, +1.0)
    idx = _fused_q_index(layout, ncfg)
    if idx is not None:
        n_q = ncfg["num_attention_heads"] * ncfg["head_dim"]
        for key in [k for k in state if Q_KEY.match(k)]:
            i, p = Q_KEY.match(key).groups()
            state[key], state[GATE_KEY.format(i=i, p=p)] = _unfuse(state[key], idx, n_q)
    return state


def state_from_native(state: dict, ncfg: dict, fmt: str) -> dict:
    """A native state dict -> `fmt` state dict. Tied models keep lm_head out, as save_pretrained does."""
    check_native_for(ncfg, fmt)
    tied = bool(ncfg.get("tie_word_embeddings", False))
    validate_state(state, native_shapes(ncfg), "native", tied)
    state = _drop_tied_head(dict(state), tied)
    if fmt == "native":
        return state
    layout = get_layout(fmt)
    if layout.llama_family:
        return llama.state_from_native(state, ncfg, fmt)
    idx = _fused_q_index(layout, ncfg)
    if idx is not None:
        for key in [k for k in state if Q_KEY.match(k)]:
            i, p = Q_KEY.match(key).groups()
            state[key] = _fuse(state[key], state.pop(GATE_KEY.format(i=i, p=p)), idx)
    if layout.zero_centred_norms:
        state = _shift_norms(state, -1.0)
    if layout.moe:
        state = _unstack_experts(state)
    return state

