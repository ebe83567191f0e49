"""Stability tooling: loss-spike detector, gradient norm, update/weight ratio, and the per-layer probe of the
residual stream (max |activation| and the share of updates lost to bf16 rounding; `residual_stream_stats`), and the
trainer's stats step (`monitoring`: the STATS_MONITORS, each a function adding fields to the step's log record).

Loss-spike default (W=50, delta=0.1 nats) follows paper map §1.8, which counted 125 points of the official 1.7B baseline
curve above a 50-point rolling median by more than 0.1 nats and 0 for the gated run. The median here is TRAILING
(the W losses before the step, so the detector works online) and needs a full window before it fires; early in
training the loss falls fast, so the trailing median sits above it and nothing fires.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from . import dist as D
from ..moe import moe_stats
from ..util.precision import numerics


class SpikeDetector:
    """Flags a step whose loss exceeds the median of the previous `window` finite losses by more than
    max(delta, noise_k * 1.4826 * MAD) nats.

    delta = 0.1 nats is the rule that counts 125 spikes in the official baseline curve and 0 in the gated one
    (paper map §1.8); those curves come from 4M-token batches, whose step-to-step noise is far below 0.1. At CPU batch
    sizes the noise alone exceeds 0.1, so the threshold also scales with the robust spread of the window (MAD);
    noise_k = 0 gives the plain 0.1-nat rule.
    """

    def __init__(self, window: int = 50, delta: float = 0.1, noise_k: float = 6.0):
        self.window = window
        self.delta = delta
        self.noise_k = noise_k
        self.history: deque[float] = deque(maxlen=window)
        self.spikes: list[dict] = []

    def threshold(self) -> tuple[float, float]:
        """(median, margin) of the current window."""
        median = statistics.median(self.history)
        mad = statistics.median(abs(x - median) for x in self.history)
        return median, max(self.delta, self.noise_k * 1.4826 * mad)

    def update(self, step: int, loss: float) -> bool:
        if not math.isfinite(loss):
            return False  # non-finite steps are counted as skipped steps, not spikes
        spike = False
        if len(self.history) == self.window:
            median, margin = self.threshold()
            if loss > median + margin:
                spike = True
                self.spikes.append({"step": step, "loss": loss, "median": median, "margin": margin})
        self.history.append(loss)
        return spike

    def state_dict(self) -> dict:
        return {"window": self.window, "delta": self.delta, "noise_k": self.noise_k, "history": list(self.history),
                "spikes": list(self.spikes)}

    def load_state_dict(self, sd: dict) -> None:
        self.window, self.delta = sd["window"], sd["delta"]
        self.noise_k = sd.get("noise_k", 0.0)  # checkpoints from before the noise term used the plain rule
        self.history = deque(sd["history"], maxlen=self.window)
        self.spikes = list(sd["spikes"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sum_sq(tensors, sharded: bool) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total += _local(t).detach().double().pow(2).sum().cpu()
    if sharded and torch.distributed.is_initialized():
        total = total.to(_device_for_reduce())
        torch.distributed.all_reduce(total)
        total = total.cpu()
    return float(total)


def _device_for_reduce() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def snapshot_params(model: nn.Module) -> list[torch.Tensor]:
    """A copy of the (local shards of the) trainable parameters, to measure the next update against."""
    return [_local(p).detach().clone() for p in model.parameters() if p.requires_grad]


def update_weight_ratio(model: nn.Module, before: list[torch.Tensor], sharded: bool) -> float:
    """||theta_after - theta_before|| / ||theta_before|| over all parameters (global when sharded)."""
    params = [_local(p).detach() for p in model.parameters() if p.requires_grad]
    diff = _sum_sq([a - b for a, b in zip(params, before)], sharded)
    norm = _sum_sq(before, sharded)
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (model.model.layers of an HF causal LM), unwrapping DDP/compile wrappers."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    base = getattr(inner, "model", inner)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def bf16_half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half a bf16 ulp of each value, in fp32: the ulp of x in bf16 (8 significant bits) is 2^(floor(log2|x|) - 7),
    so half of it is 2^(floor(log2|x|) - 8); 0 where x is 0 or not finite (no update to it is lost)."""
    x = x.detach().float()
    _, e = torch.frexp(x)  # x = m * 2^e with 0.5 <= |m| < 1: floor(log2|x|) = e - 1 (exact, also for subnormals)
    half = torch.ldexp(torch.ones_like(x), e - 9)
    return torch.where((x != 0) & torch.isfinite(x), half, torch.zeros_like(x))


def lost_update_counts(stream: torch.Tensor, update: torch.Tensor) -> tuple[int, int]:
    """(lost, counted) for the residual add `stream + update` (same shape): an element's update is lost to bf16
    rounding when it is non-zero and smaller in magnitude than half a bf16 ulp of the stream value it is added to
    (exactly half is a tie, not counted: round-to-nearest-even may keep it). A zero update counts as not lost (it
    carries nothing); pairs with a non-finite value are not counted."""
    s, u = stream.detach().float(), update.detach().float()
    ok = torch.isfinite(s) & torch.isfinite(u)
    lost = ok & (u != 0) & (u.abs() < bf16_half_ulp(s))
    return int(lost.sum()), int(ok.sum())


def lost_update_share(stream: torch.Tensor, update: torch.Tensor) -> float:
    """The share of the updates in `stream + update` smaller than half a bf16 ulp of the value they are added to
    (lost_update_counts); NaN when no pair is finite. In an fp32 stream it is the share that WOULD be lost in bf16,
    in a bf16 stream the share that is."""
    lost, counted = lost_update_counts(stream, update)
    return lost / counted if counted else math.nan


@torch.no_grad()
def residual_stream_stats(layers: list[nn.Module], run_forward) -> dict:
    """Per decoder layer, from forward hooks during `run_forward()`:
      max_act           max |hidden state| at the layer's output;
      lost_update_share the share of both residual adds' updates (the attention output added to the stream, then
                        the FFN output) smaller than half a bf16 ulp of the stream value (lost_update_counts, pooled
                        over the two adds); None for a layer without the pre-norm block's parts (a stand-in model).
    The stream before each add is read where the layer reads it (the layer's input, the post-attention norm's
    input) and each update where it is made (the attention / FFN output transform), so nothing is recomputed."""
    found = [0.0] * len(layers)
    counts = [[0, 0] for _ in layers]
    handles, pending = [], {}

    def out_hook(i):
        def hook(_mod, _inp, out):
            h = out[0] if isinstance(out, (tuple, list)) else out
            found[i] = max(found[i], float(_local(h).detach().abs().max()))
        return hook

    def stream_hook(key):
        def hook(_mod, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("hidden_states")
            pending[key] = _local(x)
        return hook

    def update_hook(key, i):
        def hook(_mod, _inp, out):
            stream = pending.pop(key, None)
            if stream is not None:
                lost, n = lost_update_counts(stream, _local(out))
                counts[i][0] += lost
                counts[i][1] += n
        return hook

    parts = ("attn_output_transform", "post_attention_layernorm", "ffn_output_transform")
    measured = [all(isinstance(getattr(layer, p, None), nn.Module) for p in parts) for layer in layers]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(out_hook(i)))
        if measured[i]:
            handles.append(layer.register_forward_pre_hook(stream_hook((i, "attn")), with_kwargs=True))
            handles.append(layer.attn_output_transform.register_forward_hook(update_hook((i, "attn"), i)))
            handles.append(layer.post_attention_layernorm.register_forward_pre_hook(stream_hook((i, "ffn"))))
            handles.append(layer.ffn_output_transform.register_forward_hook(update_hook((i, "ffn"), i)))
    try:
        run_forward()
    finally:
        for h in handles:
            h.remove()
    share = [(c[0] / c[1] if c[1] else math.nan) if m else None for c, m in zip(counts, measured)]
    return {"max_act": found, "lost_update_share": share}


# ---------------------------------------------------------------- the trainer's stats step

def monitoring(run, batch: torch.Tensor, before: dict, moe: bool) -> dict:
    """What a stats step (every `stats_every` steps, after the update) adds to its log record: the fields of each of
    STATS_MONITORS, in order. A new metric is one more function `fn(probe: Probe) -> dict` in that tuple; `run` is
    the trainer's run (its model, parallelized model `par`, ranks `info`, precision, micro-batch size)."""
    probe = Probe(run=run, batch=batch, before=before, moe=moe)
    out = {}
    for fn in STATS_MONITORS:
        out.update(fn(probe))
    return out


@dataclass(frozen=True)
class Probe:
    """What a stats monitor reads: the run, this rank's batch (B/N, T+1), the parameters before the update."""

    run: object  # trainer._Run
    batch: torch.Tensor
    before: dict
    moe: bool  # the model returned an aux loss (MoE): its per-layer expert load is recorded


def _moe_monitor(p: Probe) -> dict:
    return {"moe": moe_record(p.run.model)} if p.moe else {}  # before the probe forward below adds to the counts


def _update_ratio_monitor(p: Probe) -> dict:
    info = p.run.info
    return {"update_ratio": update_weight_ratio(p.run.par.master, p.before,
                                                sharded=info.mode == "fsdp" and info.distributed)}


def _activation_monitor(p: Probe) -> dict:
    """Max |activation| and the lost-update share per layer, from a probe forward on the first micro-batch."""
    run, info = p.run, p.run.info
    if not run.par.layers:
        return {}
    x0 = p.batch[:run.micro, :-1]  # (b, T)
    with numerics(run.precision, info.device):
        res = residual_stream_stats(run.par.layers, lambda: run.model(input_ids=x0))
    out = {"max_act": D.reduce_max(res["max_act"], info)}
    if all(v is not None for v in res["lost_update_share"]):  # our decoder layers (not a stand-in model)
        out["lost_update_share"] = D.mean_over_ranks(res["lost_update_share"], info)
    return out


STATS_MONITORS = (_moe_monitor, _update_ratio_monitor, _activation_monitor)  # in this order: the MoE counts first


def moe_record(model: nn.Module) -> dict | None:
    """Compact per-layer expert load of this step's global batch: layer names, max/mean load, LB loss, z-loss
    (counts and LB loss are global over ranks and micro-batches; z-loss is this rank's last micro-batch)."""
    stats = moe_stats(model)
    layers = [k[: -len("/expert_load")] for k in stats if k.endswith("/expert_load")]
    if not layers:
        return None
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return {"layers": layers, "max_over_mean": [stats[f"{n}/max_load_over_mean"] for n in layers],
            "lb_loss": [stats[f"{n}/lb_loss"] for n in layers], "z_loss": [stats[f"{n}/z_loss"] for n in layers],
            # tokens the counts describe: the step's global batch, or more if the per-step reset were missing
            "tokens": sum(stats[f"{layers[0]}/expert_load"]) // top_k if top_k else None}
