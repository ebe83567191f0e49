"""Precision "bf16-params" in one process: a bf16 copy of the model computes, an fp32 master copy is what AdamW steps.

The numerics are those of Megatron's --bf16 and of FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
(the multi-rank path, train/dist.py): forward and backward run on bf16 parameters and bf16 activations — so the
residual stream is bf16 and an update smaller than half a bf16 ulp of the value it is added to is lost — while the
weights that accumulate the updates, the gradient accumulation over micro-batches, the clipping norm and the optimizer
state stay fp32 (a bf16 weight could not absorb an lr * update below its own half ulp either). Modules marked
`keeps_fp32_params` (the MoE routers) keep fp32 weights in the twin too, as FSDP2 gathers them in fp32.

    mp = MasterWeights(model)   # model: the fp32 model as built; mp.compute is its bf16 twin (same names, ties kept)
    ... forward/backward on mp.compute ...  # each bf16 gradient is added into the master's fp32 .grad as it arrives
    clip / optimizer.step() on mp.master.parameters()
    mp.sync()                   # master -> compute, rounded to bf16

The master is an ordinary module with the model's parameter names, so state dicts, checkpoints (exact resume keeps
the fp32 masters), the optimizer's param groups and `final/` are those of an fp32 run; the compute twin is derived
from it (`sync`) and never saved.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .dist import fp32_modules


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())  # tied parameters appear once (named_parameters deduplicates)


class MasterWeights:
    def __init__(self, model: nn.Module):
        self.master = model
        self.compute = copy.deepcopy(model)  # deepcopy keeps tied weights tied
        keep = {id(p) for m in fp32_modules(self.compute) for p in m.parameters()}  # the MoE routers: fp32 weights
        with torch.no_grad():  # parameters only: buffers such as RoPE's inverse frequencies stay fp32
            for p in self.compute.parameters():
                if id(p) not in keep:
                    p.data = p.data.to(torch.bfloat16)
        masters, computes = _unique_params(self.master), _unique_params(self.compute)
        if [n for n, _ in masters] != [n for n, _ in computes]:
            raise RuntimeError("bf16 copy of the model has other parameter names than the model")
        self.pairs = [(c, m) for (_, m), (_, c) in zip(masters, computes)]
        for c, m in self.pairs:  # every parameter gets the hook: a phase may make a frozen one trainable later
            c.requires_grad_(m.requires_grad)
            c.register_post_accumulate_grad_hook(self._make_hook(m))

    @staticmethod
    def _make_hook(master: nn.Parameter):
        def hook(p: torch.Tensor) -> None:  # fp32 accumulation: micro-batch gradients add up in the master's .grad
            g = p.grad.float()
            master.grad = g if master.grad is None else master.grad.add_(g)
            p.grad = None
        return hook

    @torch.no_grad()
    def sync(self) -> None:
        """Round the fp32 masters into the bf16 compute parameters (after an optimizer step or a restore)."""
        torch._foreach_copy_([c for c, _ in self.pairs], [m for _, m in self.pairs])
