"""Sparse Mixture-of-Experts feed-forward block (Qwen3-MoE style) with a global-batch load-balancing loss.

The block replaces the dense SwiGLU FFN in MoE layers of the paper's 15A2B model (paper map §4): fine-grained SwiGLU experts,
a softmax router over all experts followed by top-k (as HF Qwen3-MoE), optional renormalisation of the top-k weights,
and an optional always-on shared expert scaled by its own sigmoid gate (as HF Qwen2-MoE).

Parameter names and shapes equal HF transformers 5.x `Qwen3MoeSparseMoeBlock`, so a stock checkpoint loads unchanged:
    gate.weight                      (E, d)        router
    experts.gate_up_proj             (E, 2*I, d)   rows [0, I) = gate_proj, rows [I, 2I) = up_proj of each expert
    experts.down_proj                (E, d, I)
    shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight (d -> 1)   only with a shared expert (Qwen2-MoE)

Losses (stored on the block after each forward, collected by `collect_aux_loss(model)`):
  * load balancing, LBL = E * sum_i f_i * P_i, where f_i = (routing slots that chose expert i) / (k * tokens) and
    P_i = mean router probability of expert i. Balanced routing gives LBL = 1. (HF's `load_balancing_loss_func` does not
    divide by k, so its value is k times ours.) Following Qiu et al. 2025 ("Demons in the detail"), f_i is GLOBAL-batch:
    in training mode the expert counts are summed across ranks (all_reduce, when torch.distributed is initialised) and
    accumulated across the micro-batches of one optimizer step in `MoEBalanceState`; P_i stays local and carries the
    gradient. The micro-batch m of M therefore uses the counts of micro-batches 1..m (the last one sees the full global
    batch), which is what Megatron's global aux loss does too: the exact global f is unknown before all micro-batches
    have run. The trainer calls `reset_moe_balance(model)` after each optimizer step. The statistics stay on the device
    (no host sync in the forward, which would stall FSDP2's prefetch): they are read only when logged.
  * Activation-checkpoint recompute replays the forward exactly: the checkpointed layer's forward records each MoE
    block's routing (expert indices and the global counts its loss used) and the recompute inside backward reuses
    them (`routing_record` / `routing_replay`, driven by `modeling.exact_checkpoint`) instead of deciding again
    (under expert parallelism each dispatch's exchanged counts and split sizes too: `recorded`). So
    the recomputed graph is the forward's even where a GEMM rounds differently on a second run, a micro-batch is
    never counted twice, and the stored loss is not overwritten.
  * router z-loss = mean over tokens of logsumexp(router logits)^2 (ST-MoE), local.
  aux_loss = router_aux_loss_coef * LBL + router_z_loss_coef * z_loss.
The router GEMM runs in fp32 whatever the autocast or parameter dtype (its logits feed a softmax, a top-k choice and
the z-loss's square: bf16 rounding would flip near-tied experts), as Megatron's and torchtitan's routers do.

Two implementations of the expert computation, selected by `config.moe_impl`:
  * "loop": a plain loop over experts (the reference);
  * "grouped": one sort of the (token, slot) pairs by expert, then grouped matmuls (torch._grouped_mm when its layout
    rules hold, with a hand-written backward because its CPU autograd rejects inputs; otherwise one mm per contiguous
    expert segment). No tokens are ever dropped (no capacity factor).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

MOE_IMPLS = ("loop", "grouped")


# ------------------------------------------------------------------------------------------------------------------
# Global-batch statistics
# ------------------------------------------------------------------------------------------------------------------
class MoEBalanceState:
    """Expert-selection counts of one MoE layer summed over ranks and over the micro-batches of one optimizer step.

    Stored in float64 so integer counts stay exact (up to 2**53) and one all_reduce carries counts, token count and
    router-probability sums together.
    """

    def __init__(self, num_experts: int, process_group=None):
        self.num_experts = num_experts
        self.process_group = process_group  # None = the default group (all ranks)
        self.reset()

    def reset(self) -> None:
        """Start a new global batch (call after every optimizer step)."""
        self.counts: torch.Tensor | None = None  # (E,) routing slots per expert
        self.tokens: torch.Tensor | None = None  # () tokens routed (each takes k slots), on the device: no host sync
        self.prob_sum: torch.Tensor | None = None  # (E,) summed router probabilities (detached, for logging)
        self.micro_batches: int = 0

    def update(self, counts: torch.Tensor, tokens: int, prob_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one micro-batch's local statistics (all-reduced over ranks); return the running (counts, tokens), both
        device tensors (nothing here reads a value on the host)."""
        packed = torch.cat([counts.double(), prob_sum.detach().double(), counts.new_full((1,), tokens).double()])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.process_group)
        E = self.num_experts
        if self.counts is None:
            self.counts, self.prob_sum, self.tokens = packed[:E].clone(), packed[E:2 * E].clone(), packed[2 * E].clone()
        else:
            self.counts += packed[:E]
            self.prob_sum += packed[E:2 * E]
            self.tokens += packed[2 * E]
        self.micro_batches += 1
        return self.counts, self.tokens

    def lb_loss(self, top_k: int) -> float | None:
        """The load-balancing loss of the whole global batch so far (f and P both global), for logging (reads it on the
        host: call it only when logging)."""
        if self.counts is None or float(self.tokens) == 0:
            return None
        f = self.counts / (top_k * self.tokens)  # (E,)
        p = self.prob_sum / self.tokens  # (E,)
        return float(self.num_experts * (f * p).sum())


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a forward run there is a recomputation). False while torch.compile
    traces: the check guards eager recomputation (a traced graph replays no Python), and its int result would break
    the graph."""
    if torch.compiler.is_compiling():
        return False
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class RoutingRecord(list):
    """One checkpointed call's record: an entry (top_i, global counts, global tokens) per MoE block call, in call
    order, and in `exchanges` what each expert-parallel dispatch exchanged before its all-to-all (`recorded`).
    `keeps_collectives`: the checkpoint keeps collectives' outputs itself (`selective`), so only host reads are kept
    here (a skipped collective would shift the recompute's place in the checkpoint's own record of op outputs)."""

    def __init__(self, keeps_collectives: bool = False):
        super().__init__()
        self.exchanges: list = []
        self.keeps_collectives = keeps_collectives


class _Routing(threading.local):
    """What the MoE blocks of the running checkpointed forward record, or its recompute replays (per thread: a CUDA
    backward runs on autograd's device thread, and the record is set and read within one call there)."""
    mode: str | None = None  # None | "record" | "replay"
    entries: list | None = None  # a RoutingRecord (or a plain list: no exchanges kept)
    next: int = 0
    next_exchange: int = 0


_ROUTING = _Routing()


@contextmanager
def _routing(mode: str, entries: list):
    saved = (_ROUTING.mode, _ROUTING.entries, _ROUTING.next, _ROUTING.next_exchange)
    _ROUTING.mode, _ROUTING.entries, _ROUTING.next, _ROUTING.next_exchange = mode, entries, 0, 0
    try:
        yield
    finally:
        _ROUTING.mode, _ROUTING.entries, _ROUTING.next, _ROUTING.next_exchange = saved


def recorded(compute, collective: bool = False):
    """`compute()` (an expert-parallel dispatch's exchange of counts, `collective`, or its host read of the split
    sizes), kept in a recorded forward's RoutingRecord and taken from it in the recompute, which so exchanges and
    reads nothing again. A collective under a checkpoint that keeps collectives' outputs itself runs in the recompute
    too: it is handed the forward's output there, without communicating."""
    mode, entries = _ROUTING.mode, _ROUTING.entries
    exchanges = getattr(entries, "exchanges", None)
    if collective and getattr(entries, "keeps_collectives", False):
        exchanges = None
    if mode == "replay" and exchanges is not None:
        _ROUTING.next_exchange += 1
        return exchanges[_ROUTING.next_exchange - 1]
    value = compute()
    if mode == "record" and exchanges is not None:
        exchanges.append(value)
    return value


def routing_record(entries: list):
    """Context of a checkpointed forward: every MoE block appends its routing decisions to `entries`."""
    return _routing("record", entries)


def routing_replay(entries: list):
    """Context of its recomputation: the MoE blocks take their routing from `entries`, in the same order."""
    return _routing("replay", entries)


def load_balancing_loss(counts: torch.Tensor, tokens, top_k: int, mean_probs: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i * P_i with f_i = counts_i / (k * tokens) (no gradient) and P_i = mean_probs_i (gradient)."""
    num_experts = mean_probs.shape[-1]
    f = (counts.to(mean_probs.dtype) / (top_k * tokens)).detach()  # (E,)
    return num_experts * (f * mean_probs).sum()


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64 routing slots per expert. A scatter-add, not torch.bincount: CUDA's bincount reads the input's max
    on the host (a device sync in every MoE layer)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of logsumexp(logits)^2, in fp32 so bf16 logits do not overflow the square."""
    return torch.logsumexp(router_logits.float(), dim=-1).square().mean()


# ------------------------------------------------------------------------------------------------------------------
# Grouped matmul (fast path kernel)
# ------------------------------------------------------------------------------------------------------------------
class _GroupedMM(torch.autograd.Function):
    """out[rows of group g] = x[rows of group g] @ w[g]; groups are contiguous row ranges ending at `offs`."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad_out):
        # In the output's dtype, each gradient returned in its input's: under bf16 autocast the forward's GEMM ran on
        # bf16 casts of fp32 x and w (the CPU emulation casts them), so grad_out is bf16 while x and w are fp32.
        x, w, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dt = grad_out.dtype
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_out, w.to(dt).transpose(1, 2), offs=offs).to(x.dtype)  # (N, K)
        if ctx.needs_input_grad[1]:
            # 2-D x 2-D form: the shared (row) dimension is split by offs, giving one (K, M) block per group.
            grad_w = torch._grouped_mm(x.to(dt).t(), grad_out, offs=offs).to(w.dtype)  # (G, K, M)
        return grad_x, grad_w, None


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned row strides; on CUDA it is documented for bf16 only."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # torch.compile's shape check of _grouped_mm (its meta kernel) accepts bf16 only, CPU included
    esz = x.element_size()
    return all((n * esz) % 16 == 0 for n in (x.shape[-1], w.shape[-1], w.shape[-2]))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, use_grouped_mm: bool | None = None):
    """Rows of x sorted by group, `counts[g]` rows per group; w (G, K, M) -> (N, M). One mm per group as fallback
    (it reads the group sizes on the host: a sync, and a graph break under torch.compile)."""
    if use_grouped_mm is None:
        dev = x.device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16:
            # the GEMM runs in bf16 under autocast anyway; cast here so the grouped kernel (bf16-only on CUDA and
            # under torch.compile) takes fp32 weights and activations instead of the host-synced fallback
            x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        use_grouped_mm = _grouped_mm_usable(x, w)
    if use_grouped_mm:
        offs = counts.cumsum(0).to(torch.int32)  # (G,) end row of each group
        return _GroupedMM.apply(x.contiguous(), w, offs)
    return _per_group_mm(x, w, counts)


@torch.compiler.disable  # inductor cannot lower the split at unbacked sizes (its backward guards on them): eager
def _per_group_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """grouped_matmul's fallback: one mm per contiguous group of rows."""
    segments = x.split(counts.tolist())  # one host sync; each segment is a contiguous view
    return torch.cat([seg @ w[g] for g, seg in enumerate(segments)], dim=0)  # (N, M)


# ------------------------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------------------------
class MoeRouter(nn.Module):
    """Softmax over all experts, then top-k; optional renormalisation of the k weights (HF Qwen3MoeTopKRouter math)."""

    # Its weight stays fp32 under bf16-params too (FSDP2 gathers it in fp32: train/dist.py; the one-process bf16 twin
    # keeps it: train/mixed_precision.py): the fp32 GEMM below would otherwise multiply bf16-rounded weights, and a
    # rounded router flips near-tied top-k choices. The weight is (E, d): 1 MB per layer of the 15A2B model in fp32.
    keeps_fp32_params = True

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))  # (E, d)

    def forward(self, h: torch.Tensor, top_i: torch.Tensor | None = None):
        """h (N, d) -> logits (N, E) fp32, probs (N, E) fp32, top_w (N, k) in h.dtype, top_i (N, k).

        The GEMM runs in fp32 (module docstring). `top_i` given (a recompute replaying its forward's routing): the
        weights are read at those experts instead of choosing again; both ways take them with one gather from probs,
        so the forward and its replay build the same graph."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.weight.float())  # (N, E) fp32
        probs = torch.softmax(logits, dim=-1)  # (N, E)
        if top_i is None:
            top_i = torch.topk(probs.detach(), self.top_k, dim=-1).indices  # (N, k): the choice carries no gradient
        top_w = probs.gather(-1, top_i)  # (N, k)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return logits, probs, top_w.to(h.dtype), top_i


class MoeExperts(nn.Module):
    """E SwiGLU experts stored fused as 3-D tensors, like HF Qwen3MoeExperts."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # (E, 2I, d)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # (E, d, I)
        self.act_fn = ACT2FN[hidden_act]

    def forward_loop(self, h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Reference: for each expert, gather its tokens, run its SwiGLU, scale by the router weight, scatter-add."""
        out = torch.zeros_like(h)  # (N, d)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_i == e)  # tokens that chose e, and in which of their k slots
            if rows.numel() == 0:
                continue
            gate, up = F.linear(h[rows], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n_e, I) each
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # (n_e, d)
            out.index_add_(0, rows, y * top_w[rows, slot, None])
        return out

    def forward_grouped(self, h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                        use_grouped_mm: bool | None = None) -> torch.Tensor:
        """Fast path: sort the N*k (token, slot) pairs by expert once, run two grouped matmuls, unsort, sum the k."""
        N, k = top_i.shape
        flat_e = top_i.reshape(-1)  # (N*k,) expert of each (token, slot), token-major
        order = torch.argsort(flat_e, stable=True)  # (N*k,) sorted position -> flat (token, slot) index
        counts = expert_counts(flat_e, self.num_experts)  # (E,)
        xs = h[order // k]  # (N*k, d) token rows grouped by expert
        gu = grouped_matmul(xs, self.gate_up_proj.transpose(1, 2), counts, use_grouped_mm)  # (N*k, 2I)
        gate, up = gu.chunk(2, dim=-1)  # (N*k, I) each
        ys = grouped_matmul(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), counts, use_grouped_mm)  # (N*k, d)
        # Unsort with the inverse permutation rather than index_add: deterministic, and the k-sum is a plain reduction.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        ys = ys[inverse].view(N, k, -1)  # (N, k, d)
        return (ys * top_w.unsqueeze(-1)).sum(dim=1)  # (N, d)


class SharedExpert(nn.Module):
    """A dense SwiGLU FFN applied to every token (HF Qwen2MoeMLP names: gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """MoE feed-forward: forward(x (B, T, d)) -> (B, T, d); sets self.aux_loss and per-layer load statistics."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.aux_loss_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.z_loss_coef = float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
        self.moe_impl = getattr(config, "moe_impl", "grouped")
        # Kernel of the grouped path: None = torch._grouped_mm when its layout rules hold, else per-segment mm;
        # True/False force one (benchmarks and tests compare them).
        self.use_grouped_mm: bool | None = None
        shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if self.num_experts < 1:
            raise ValueError(f"SparseMoeBlock needs num_experts >= 1, got {self.num_experts}; use the dense MLP instead")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"unknown moe_impl {self.moe_impl!r}; set config.moe_impl to one of {MOE_IMPLS}")

        self.gate = MoeRouter(config.hidden_size, self.num_experts, self.top_k, bool(config.norm_topk_prob))
        self.experts = MoeExperts(config.hidden_size, self.num_experts, config.moe_intermediate_size,
                                  config.hidden_act)
        if shared_size > 0:
            self.shared_expert = SharedExpert(config.hidden_size, shared_size, config.hidden_act)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.reset_parameters(float(getattr(config, "initializer_range", 0.02)))

        self.balance = MoEBalanceState(self.num_experts)
        self.aux_loss: torch.Tensor | None = None  # coef-weighted LBL + z-loss of the last forward (with grad)
        self.lb_loss: torch.Tensor | None = None  # unweighted, detached, for logging
        self.z_loss: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None  # (E,) routing slots per expert in the last forward

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """N(0, std) everywhere, as HF Qwen3-MoE's _init_weights does for the router and the fused experts."""
        for p in self.parameters():
            p.normal_(0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = x.reshape(B * T, d)  # (N, d)
        mode = _ROUTING.mode
        replayed = None
        if mode == "replay":
            replayed = _ROUTING.entries[_ROUTING.next]  # (top_i, global counts, global tokens) of the forward
            _ROUTING.next += 1
        elif _in_backward() and self.training and torch.is_grad_enabled():
            raise RuntimeError("an MoE block was recomputed inside backward by a checkpoint function that does not "
                               "replay its routing; enable checkpointing with model.activation_checkpointing_enable() "
                               "or the trainer's activation_checkpointing (they wrap it in modeling.exact_checkpoint)")
        logits, probs, top_w, top_i = self.gate(h, None if replayed is None else replayed[0])  # (N, E) x2, (N, k) x2
        if self.moe_impl == "loop":
            out = self.experts.forward_loop(h, top_i, top_w)
        else:
            out = self.experts.forward_grouped(h, top_i, top_w, self.use_grouped_mm)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)  # gate (N, 1)
        self._update_losses(logits, probs, top_i, replayed, record=mode == "record")
        return out.view(B, T, d)  # (B, T, d)

    def _update_losses(self, logits: torch.Tensor, probs: torch.Tensor, top_i: torch.Tensor, replayed, record: bool
                       ) -> None:
        N = probs.shape[0]
        counts = expert_counts(top_i, self.num_experts)  # (E,)
        prob_sum = probs.sum(dim=0)  # (E,) fp32, with grad
        if replayed is not None:
            # the recompute of a checkpointed forward: this micro-batch is already counted; use the f it used
            g_counts, g_tokens = replayed[1], replayed[2]
        elif self.training:
            # Eval forwards must not leak into the training step's global batch, so only training accumulates.
            g_counts, g_tokens = self.balance.update(counts, N, prob_sum)
            g_counts, g_tokens = g_counts.clone(), g_tokens.clone()  # the running sums change with later micro-batches
        else:
            g_counts, g_tokens = counts, N
        if record:
            _ROUTING.entries.append((top_i.detach(), g_counts, g_tokens))
        lbl = load_balancing_loss(g_counts, g_tokens, self.top_k, prob_sum / N)
        zl = router_z_loss(logits)
        aux = self.aux_loss_coef * lbl + self.z_loss_coef * zl
        if replayed is not None:
            return  # the trainer already collected the original forward's loss and statistics
        self.aux_loss = aux
        self.lb_loss, self.z_loss = lbl.detach(), zl.detach()
        self.expert_load = counts.detach()

    def load_stats(self) -> dict:
        """Expert load of the global batch so far (training) or of the last forward (eval): counts, max/mean, dropped."""
        if self.balance.counts is not None:
            counts = self.balance.counts
            lbl = self.balance.lb_loss(self.top_k)
        elif self.expert_load is not None:
            counts = self.expert_load.double()
            lbl = None if self.lb_loss is None else float(self.lb_loss)
        else:
            return {}
        mean = counts.mean().clamp_min(1e-12)
        return {
            "expert_load": [int(c) for c in counts.tolist()],
            "max_load_over_mean": float(counts.max() / mean),
            "min_load_over_mean": float(counts.min() / mean),
            "dropped": 0,  # no capacity factor: every routed token is computed
            "lb_loss": lbl,
            "z_loss": None if self.z_loss is None else float(self.z_loss),
        }


# ------------------------------------------------------------------------------------------------------------------
# Model-level helpers for the trainer
# ------------------------------------------------------------------------------------------------------------------
def moe_blocks(model: nn.Module) -> list[tuple[str, SparseMoeBlock]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of every MoE block's aux_loss from its last forward; None for a model without MoE blocks that ran."""
    losses = [m.aux_loss for _, m in moe_blocks(model) if m.aux_loss is not None]
    if not losses:
        return None
    return torch.stack([loss.float() for loss in losses]).sum()


def reset_moe_balance(model: nn.Module) -> None:
    """Start a new global batch in every MoE block (call once per optimizer step, after step())."""
    for _, m in moe_blocks(model):
        m.balance.reset()


def moe_stats(model: nn.Module) -> dict:
    """Per-layer load statistics '<layer>/<stat>' plus means over layers under 'moe/<stat>' (scalars only there)."""
    stats: dict = {}
    per_layer = [(name or "block", m.load_stats()) for name, m in moe_blocks(model)]
    per_layer = [(n, s) for n, s in per_layer if s]
    for name, s in per_layer:
        for key, value in s.items():
            stats[f"{name}/{key}"] = value
    for key in ("max_load_over_mean", "min_load_over_mean", "lb_loss", "z_loss"):
        values = [s[key] for _, s in per_layer if s.get(key) is not None]
        if values:
            stats[f"moe/{key}"] = sum(values) / len(values)
    if per_layer:
        stats["moe/dropped"] = 0
    return stats
