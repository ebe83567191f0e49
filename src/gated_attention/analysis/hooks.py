"""Capturing what the analysis needs from any HF transformer through hooks, without editing the model.

Two mechanisms, both undone when the `with` block ends:
  * `capture_qk(model, callback)`: wraps the attention backend the model already uses (sdpa or eager) in the
    transformers AttentionInterface table, so every attention call reports its q (B, H, T, D, after RoPE / norms),
    k (B, KV, S, D), scale, mask, causality and soft-cap, then runs the original backend unchanged. This is the cheap,
    backend-agnostic path for Llama, Qwen2/3, Mistral, GPT-2, BERT and every model that dispatches through the table.
  * `capture_activations(model, callback)`: forward hooks on each transformer layer (its output hidden state), its
    attention module (attention output) and its FFN module where one is found by name.

Models whose attention does not dispatch through the table are analysed from `output_attentions` maps instead
(see analyze.py); `capture_qk` reports through `calls` whether it saw anything.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")
_FFN_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
_OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "wo")  # the projection after the per-head SDPA output


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer layers: the longest ModuleList of same-class blocks that contain attention."""
    best = None
    for mod in model.modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        if not any("attention" in type(s).__name__.lower() or "attn" in type(s).__name__.lower()
                   for s in mod[0].modules()):
            continue
        if best is None or len(mod) > len(best):
            best = mod
    if best is None:
        raise ValueError(f"{type(model).__name__}: found no list of attention layers to analyse; this tool needs a "
                         "transformer whose layers sit in an nn.ModuleList (e.g. model.layers, encoder.layer, h)")
    return best


def _child(layer: nn.Module, names) -> nn.Module | None:
    for n in names:
        m = getattr(layer, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return None


@contextmanager
def capture_activations(model: nn.Module, callback: Callable[[int, str, torch.Tensor], None]):
    """Report each layer's output hidden state ("hidden"), attention output ("attn_output") and FFN output
    ("ffn_output", when an FFN child is found by name) as callback(layer_idx, name, tensor)."""
    handles = []

    def hook(idx, name):
        def fn(_mod, _inp, out):
            t = _first_tensor(out)
            if t is not None:
                callback(idx, name, t.detach())
        return fn

    try:
        for i, layer in enumerate(find_layers(model)):
            handles.append(layer.register_forward_hook(hook(i, "hidden")))
            attn = _child(layer, _ATTN_NAMES)
            if attn is not None:
                handles.append(attn.register_forward_hook(hook(i, "attn_output")))
            ffn = _child(layer, _FFN_NAMES)
            if ffn is not None:
                handles.append(ffn.register_forward_hook(hook(i, "ffn_output")))
        yield
    finally:
        for h in handles:
            h.remove()


def _out_proj(attn: nn.Module) -> nn.Module | None:
    for n in _OUT_PROJ_NAMES:
        for name, m in attn.named_modules():
            if name.split(".")[-1] == n:
                return m
    return None


@contextmanager
def capture_sdpa_output(model: nn.Module, callback: Callable[[int, str, torch.Tensor], None]):
    """Report the input of each attention's output projection (the concatenated per-head SDPA output, after any
    G1 gate) as callback(layer_idx, "sdpa_output", (B, T, H*D))."""
    handles = []

    def hook(idx):
        def fn(_mod, args):
            if args and isinstance(args[0], torch.Tensor):
                callback(idx, "sdpa_output", args[0].detach())
        return fn

    try:
        for i, layer in enumerate(find_layers(model)):
            attn = _child(layer, _ATTN_NAMES)
            proj = _out_proj(attn) if attn is not None else None
            if proj is not None:
                handles.append(proj.register_forward_pre_hook(hook(i)))
        yield
    finally:
        for h in handles:
            h.remove()


def _layer_index_map(model: nn.Module) -> dict[int, int]:
    """id(submodule) -> index of the layer that contains it, to name attention calls by layer."""
    idx = {}
    for i, layer in enumerate(find_layers(model)):
        for m in layer.modules():
            idx[id(m)] = i
    return idx


@contextmanager
def capture_qk(model: nn.Module, callback: Callable):
    """Report q, k, scale, mask, causal, softcap of every attention call as callback(layer_idx, q, k, scale, mask,
    causal, softcap); the model's outputs are unchanged. Yields a dict whose "calls" counts the reports.

    Only the sdpa and eager backends are wrapped (others would need their own kernels' semantics); pick one with
    `from_pretrained(..., attn_implementation="sdpa")`.
    """
    from transformers.modeling_utils import AttentionInterface

    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"analysis hooks support the 'sdpa' and 'eager' attention backends, the model uses {impl!r}; "
                         "load it with attn_implementation='sdpa'")
    table = AttentionInterface._global_mapping
    had, saved = impl in table, table.get(impl)
    layer_of = _layer_index_map(model)
    state = {"calls": 0}

    def original(module):
        if impl == "sdpa":
            return saved
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__}: no eager_attention_forward in its module; use sdpa")
        return fn

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        out = original(module)(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        if id(module) in layer_of:
            state["calls"] += 1
            callback(layer_of[id(module)], query.detach(), key.detach(), float(scaling), attention_mask,
                     bool(causal) and query.shape[2] > 1, kwargs.get("softcap"))
        return out

    table[impl] = wrapper
    try:
        yield state
    finally:
        if had:
            table[impl] = saved
        else:
            table.pop(impl, None)
