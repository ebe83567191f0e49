"""How a scheme is applied to a built model: which linear layers, and whether the gate shares q's scales.

  all         every linear layer but the LM head, the G1 gate quantized TOGETHER with q_proj as one tensor: the
              fused [q | gate] projection of the official and Qwen3-Next layouts, as an engine holding that layout
              sees it (one per-tensor scale, one NVFP4 global scale, one set of AWQ smoothing scales for both)
  keep-gate   as all, but the gate's projection stays in full precision
  split-gate  as all, but the gate is quantized apart from q, with its own scales and its own AWQ smoothing (what a
              fused layout needs to do per its gate rows)
Row order inside the fused tensor does not matter to any scheme here (scales are per tensor, per row, or per block
of one row), so the fused tensor is simply cat([q rows, gate rows]).

The model itself is never changed: `quantize_model` returns a quantized deep copy whose weights are fake-quantized
(fp32 values on the scheme's grid) and, for W8A8, whose quantized layers fake-quantize their input in a pre-hook.
"""
from __future__ import annotations

import copy

# torch is imported inside the functions: the policy names (`gattn lab quant`'s options) load without it

from .schemes import SCHEMES, awq_scales, quantize_activation, quantize_weight

POLICIES = ("all", "keep-gate", "split-gate")
GATE_SUFFIX = ".self_attn.gate.proj"
Q_SUFFIX = ".self_attn.q_proj"


def _targets(model) -> dict[str, nn.Linear]:
    """Every nn.Linear but the LM head, by module name."""
    from torch import nn

    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("lm_head")}


def _calibration_inputs(model, names, batches) -> dict[str, torch.Tensor]:
    """The inputs each named linear sees on `batches` (token id tensors), stacked (N, in)."""
    import torch

    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    hooks = [modules[n].register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].reshape(-1, a[0].shape[-1])))
             for n in names]
    try:
        with torch.no_grad():
            for ids in batches:
                model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def quantize_model(model, scheme: str, policy: str = "all", calibration=None):
    """A fake-quantized copy of `model` under `scheme` and `policy`. `calibration`: token-id batches (awq-int4 only)."""
    import torch

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    if scheme == "awq-int4" and not calibration:
        raise ValueError("awq-int4 needs calibration batches (activation-aware scales); pass calibration=[ids, ...]")
    qmodel = copy.deepcopy(model).eval()
    targets = _targets(qmodel)
    if policy == "keep-gate":
        targets = {n: m for n, m in targets.items() if not n.endswith(GATE_SUFFIX)}
    calib = _calibration_inputs(qmodel, list(targets), calibration) if scheme == "awq-int4" else {}
    # groups quantized as one tensor: (q, gate) per layer under "all", every other layer alone
    groups: list[list[str]] = []
    for name in targets:
        if name.endswith(GATE_SUFFIX) and policy == "all":
            continue  # joins its layer's q_proj below
        gate = name[: -len(Q_SUFFIX)] + GATE_SUFFIX if name.endswith(Q_SUFFIX) else None
        groups.append([name, gate] if policy == "all" and gate in targets else [name])
    with torch.no_grad():
        for names in groups:
            mods = [targets[n] for n in names]
            w = torch.cat([m.weight.float() for m in mods], 0)  # (rows of all, in): one tensor to the scheme
            if scheme == "awq-int4":
                s, _ = awq_scales(w, calib[names[0]])  # the group shares its input, hence one set of scales
                wq = quantize_weight(w * s, scheme) / s  # = (x / s) Q(W diag(s))^T, folded back into W
            else:
                wq = quantize_weight(w, scheme)
            for m, part in zip(mods, wq.split([m.weight.shape[0] for m in mods], 0)):
                m.weight.copy_(part.to(m.weight.dtype))
                if scheme.startswith("w8a8"):
                    m.register_forward_pre_hook(lambda mod, a, sch=scheme: (quantize_activation(a[0], sch), *a[1:]))
    return qmodel
