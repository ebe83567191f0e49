"""Training-step throughput (forward + backward + AdamW, in --precision): ungated vs G1 gates, ours vs transformers.

Every variant (config x implementation x eager/compile) and a square GEMM in the same precision (the machine's
measured peak: bf16 under bf16 autocast, fp32 in fp32) are timed
round-robin in one process; the JSON holds medians, tokens/s, gate overhead (gated / ungated step time, same
implementation and mode), speed-up over transformers (same config and mode) and MFU (model FLOP/s over the best
GEMM FLOP/s seen in the same run). `ours_fast` = what `gattn train` runs by default: fuse_qkv(separate_params=True)
+ fused sigmoid-mul + the chunked lm_head/cross-entropy, and in compile mode the trainer's compiled decoder-layer
graph (train/fastpath.py); `ours` = the plain reference layers and loss; transformers compiles the whole model.

`--ac none,full,selective,every:2`: `ours_fast` once per activation checkpointing mode (activation_checkpoint.
apply_activation_checkpointing, applied after the compile plan as train/parallelize.py orders them), all timed in the
same round-robin; each row then also holds the step time over the same config and mode without checkpointing and the
memory the forward leaves held for backward (`held_after_forward_mb`: glibc's bytes in use, mallinfo2, right after
the forward minus right before it, measured once after the timing: saved activations, the selective cache, the
loss's own tensors) next to the plan's count of what the layers keep plus the loss part (`plan_kept_mb`).
Run: python bench/bench_train.py [--precision auto|bf16|fp32 --batch 16 --seq 256 --reps 5 --modes eager,compile]
     python bench/bench_train.py --hidden 768 --heads 12 --kv-heads 4 --out train_d768   (MFU at a larger shape)
     python bench/bench_train.py --ac none,full,selective,every:2 --configs G1-elem-parity --impls ours_fast \
         --precision fp32 --threads 1 --hidden 384 --heads 6 --kv-heads 2 --layers 6 --batch 4 --seq 512 --out train_ac
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc

import common  # (also puts src/ on the path)
import torch

from gated_attention import GatedQwen3ForCausalLM
from gated_attention.fused import fuse_qkv
from gated_attention.gates import get_gate
from gated_attention.presets import model_config
from gated_attention.train import fastpath
from gated_attention.train import plan as PL
from gated_attention.train.activation_checkpoint import apply_activation_checkpointing
from gated_attention.train.monitors import decoder_layers
from hf_reference import hf_from_ours

CONFIGS = {  # label -> (gate, match_params)
    "ungated": ("baseline", True),
    "G1-elem-parity": ("sdpa_elementwise", True),
    "G1-head-parity": ("sdpa_headwise", True),
    "G1-elem-noparity": ("sdpa_elementwise", False),
    "G1-head-noparity": ("sdpa_headwise", False),
}
IMPLS = ("ours", "ours_fast", "hf", "ours_fast_pad16", "ours_fast_split")
DEFAULT_IMPLS = ("ours", "ours_fast", "hf")


def gate_projection_layout(model, layout: str):
    """Bench-only variants of the trainer's fused q/k/v/gate GEMM (fuse_qkv(separate_params=True)), to measure
    whether its width (H*D + 2*KV*D + gate width, 516 for the small preset's headwise gate) costs: `pad16` appends
    zero rows to the concatenated weight up to a multiple of 16 (their output columns are dropped), `split` runs the
    q/k/v GEMM alone and the gate's own (H or H*D wide) GEMM beside it."""
    import types

    import torch.nn.functional as F

    def project(self, x):
        b, t, _ = x.shape
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # (H*D + 2*KV*D, d)
        if layout == "split":
            parts = [*F.linear(x, w).split(self.splits[:3], dim=-1), self.gate.proj(x)]
        else:
            pad = -sum(self.splits) % 16
            g = self.gate.proj.weight
            parts = F.linear(x, torch.cat([w, g, g.new_zeros(pad, g.shape[1])])).split(self.splits + [pad], dim=-1)
        q = parts[0].view(b, t, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = parts[1].view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
        v = parts[2].view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, KV, D)
        return q, k, v, parts[3]

    for layer in model.modules():
        if getattr(layer, "fold_gate", False):
            assert layer.separate_params and layer.q_proj.bias is None, "bench layouts: the trainer's, no bias"
            layer._project = types.MethodType(project, layer)
    return model


def train_flops(cfg, batch: int, seq: int) -> float:
    """Model FLOPs of one train step (3x forward): every matmul incl. lm_head, causal attention (avg (T+1)/2 keys)."""
    d, H, KV, D, L, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.num_hidden_layers, cfg.vocab_size)
    spec = get_gate(cfg.gate)
    gate_w = spec.score_width(d, H, KV, D) if spec is not None and spec.source.value == "input" else 0
    per_layer = d * H * D + 2 * d * KV * D + H * D * d + d * gate_w + 3 * d * cfg.intermediate_size
    fwd_per_token = 2 * (L * per_layer + d * V) + L * 2 * 2 * H * D * (seq + 1) / 2
    return 3.0 * fwd_per_token * batch * seq


def make_step(model, ids, fused_loss: bool = False, forward_ctx=None, params=None, precision: str = "bf16"):
    """One train step in `precision` ('bf16' autocast | 'fp32'). forward_ctx: a context manager factory around the
    forward (the trainer's compiled layers)."""
    opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=1e-4)
    kw = {"fused_loss": True} if fused_loss else {}
    ctx = forward_ctx or contextlib.nullcontext

    def step():
        with common.autocast(precision), ctx():
            loss = model(input_ids=ids, labels=ids, use_cache=False, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out now (heap + mmap'd blocks: torch's CPU tensors), or None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def ac_step(m, ids, mode: str, ac: str, precision: str):
    """The trainer's model for one `--ac` variant: a copy of the fast-path model `m`, compiled as compile=true does
    (mode "compile") or eager, then checkpointed by `ac`; returns (step, model, speed plan)."""
    mc = copy.deepcopy(m)
    layers = decoder_layers(mc)
    plan = fastpath.SpeedPlan(True, "true" if mode == "compile" else "false", 0, True, layers, torch.device("cpu"))
    apply_activation_checkpointing(layers, ac)
    return make_step(mc, ids, fused_loss=True, forward_ctx=plan.training_forward, precision=precision), mc, plan


def held_after_forward(model, ids, plan, precision: str) -> int | None:
    """Bytes a training forward leaves held until its backward (malloc_in_use after minus before); runs the
    backward after, so the model's state is as before."""
    gc.collect()
    before = malloc_in_use()
    with common.autocast(precision), plan.training_forward():
        loss = model(input_ids=ids, labels=ids, use_cache=False, fused_loss=True).loss
    after = malloc_in_use()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return None if before is None else after - before


def plan_kept(cfg, tokens: int, precision: str, ac: str) -> int:
    """What `gattn plan` says the forward keeps: every layer's kept bytes and the final norm / loss part."""
    layers = sum(PL.layer_kept_bytes(cfg, i, tokens, precision, ac) for i in range(cfg.num_hidden_layers))
    return layers + PL.activation_bytes(cfg, tokens, precision, ac)["rest"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (presets.py)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--reps", type=int, default=5, help="timed round-robin rounds (median taken)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (compiles happen here)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {list(CONFIGS)}")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help="comma list: ours (plain reference layers), "
                    "ours_fast (fuse_qkv + fused sigmoid-mul + chunked loss), hf (transformers Qwen3 / official gate "
                    "layout), ours_fast_pad16 / ours_fast_split (ours_fast with the gate's GEMM padded / apart: "
                    "gate_projection_layout)")
    ap.add_argument("--modes", default="eager,compile", help="comma list: eager, compile")
    ap.add_argument("--compile-impls", default="ours_fast,hf", help="impls also run under torch.compile")
    ap.add_argument("--out", default="train", help="results/<out>.json")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default; 1 on a busy machine)")
    ap.add_argument("--hidden", type=int, default=0, help="override hidden_size (0 = preset's); FFN = 3x hidden")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0 = preset's)")
    ap.add_argument("--heads", type=int, default=0, help="override num_attention_heads (0 = preset's)")
    ap.add_argument("--kv-heads", type=int, default=0, help="override num_key_value_heads (0 = preset's)")
    ap.add_argument("--ac", default="none", help="comma list of activation_checkpointing modes ours_fast runs in "
                    "(none, full, selective, every:N); more than 'none' adds the memory columns")
    ap.add_argument("--ffn-multiple", default="0", help="comma list: each parity config once per ffn_multiple (the "
                    "parity rule's FFN alignment, presets.parity_width; 0 = the preset's own), labelled CONFIG@N")
    common.precision_arg(ap)
    args = ap.parse_args(argv)
    prec = common.resolve_precision(args.precision)
    shape = {}
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.heads:
        shape["num_attention_heads"] = args.heads
    if args.kv_heads:
        shape["num_key_value_heads"] = args.kv_heads
    if args.threads:
        torch.set_num_threads(args.threads)
    configs, impls, modes = args.configs.split(","), args.impls.split(","), args.modes.split(",")
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; valid: {', '.join(CONFIGS)}")
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"unknown impl {i!r}; valid: {', '.join(IMPLS)}")
    acs = args.ac.split(",")
    ac_rows = acs != ["none"]
    if ac_rows:
        torch._dynamo.config.recompile_limit = 64  # one compiled layer graph per checkpointing mode (and layer kind)
    torch.manual_seed(0)
    ids = torch.randint(0, model_config(args.preset, **shape).vocab_size, (args.batch, args.seq))
    fns, meta, probes = {}, {}, {}
    multiples = [int(n) for n in args.ffn_multiple.split(",")]
    shrunk = [c for c in configs if CONFIGS[c][1] and CONFIGS[c][0] != "baseline"]  # the configs an alignment changes
    runs = [(c, n) for c in configs for n in (multiples if c in shrunk else [0])]
    for base_label, multiple in runs:
        gate, parity = CONFIGS[base_label]
        label = f"{base_label}@{multiple}" if len(multiples) > 1 and base_label in shrunk else base_label
        torch.manual_seed(0)
        cfg = model_config(args.preset, gate, match_params=parity, ffn_multiple=multiple or None, **shape)
        ours = GatedQwen3ForCausalLM(cfg).train()
        models = {}
        for impl in impls:
            if impl == "ours":
                models[impl] = ours
            elif impl == "ours_fast":  # the trainer's layout: plain Parameters, one GEMM (train/fastpath.py)
                models[impl] = fuse_qkv(copy.deepcopy(ours), separate_params=True)
            elif impl.startswith("ours_fast_"):
                if gate == "baseline":
                    continue
                fast = fuse_qkv(copy.deepcopy(ours), separate_params=True)
                models[impl] = gate_projection_layout(fast, impl.removeprefix("ours_fast_").removesuffix("16"))
            else:
                models[impl] = hf_from_ours(ours).train()
        for impl, m in models.items():
            for mode in modes:
                if mode == "compile" and impl not in args.compile_impls.split(","):
                    continue
                name = f"{label}|{impl}|{mode}"
                info = {"config": label, "gate": gate, "match_params": parity, "impl": impl, "mode": mode,
                        "params": sum(p.numel() for p in m.parameters()), "intermediate_size": cfg.intermediate_size,
                        "flops": train_flops(cfg, args.batch, args.seq)}
                if impl == "ours_fast" and ac_rows:
                    for ac in acs:
                        step, model, plan = ac_step(m, ids, mode, ac, prec)
                        fns[f"{name}|{ac}"], probes[f"{name}|{ac}"] = step, (model, plan)
                        meta[f"{name}|{ac}"] = {**info, "activation_checkpointing": ac,
                                                "plan_kept_mb": plan_kept(cfg, ids.numel(), prec, ac) / 1e6}
                    continue
                if mode == "compile" and impl.startswith("ours_fast"):
                    # what the trainer compiles (train/fastpath.py): one decoder-layer graph shared by every layer
                    mc = copy.deepcopy(m)
                    plan = fastpath.SpeedPlan(True, "true", 0, True, decoder_layers(mc), torch.device("cpu"))
                    fns[name] = make_step(mc, ids, fused_loss=True, forward_ctx=plan.training_forward,
                                          precision=prec)
                else:
                    run = torch.compile(m) if mode == "compile" else m
                    fns[name] = make_step(run, ids, fused_loss=impl.startswith("ours_fast"), params=m.parameters(),
                                          precision=prec)
                meta[name] = info
    peak_fn, peak_flops = common.matmul_peak_fn(precision=prec)
    fns["peak_gemm"] = peak_fn
    times = common.interleaved(fns, args.reps, args.warmup)
    peak = max(peak_flops / t for t in times.pop("peak_gemm"))
    tokens = args.batch * args.seq
    rows = []
    for name, ts in times.items():
        m = meta[name]
        med = common.median(ts)
        rows.append({**m, "name": name, "median_s": med, "times_s": ts, "rel_iqr": common.rel_spread(ts),
                     "tokens_per_s": tokens / med,
                     "mfu": m["flops"] / med / peak})
    for r in rows:  # after the timing: every graph is compiled, the allocator warm
        if r["name"] in probes:
            model, plan = probes[r["name"]]
            held = held_after_forward(model, ids, plan, prec)
            r["held_after_forward_mb"] = None if held is None else held / 1e6
    by = {r["name"]: r for r in rows}
    for r in rows:
        if "activation_checkpointing" in r:
            base = by.get(f"{r['config']}|ours_fast|{r['mode']}|none")
            r["step_time_vs_none"] = r["median_s"] / base["median_s"] if base else None
        base = by.get(f"ungated|{r['impl']}|{r['mode']}")
        r["step_time_vs_ungated"] = r["median_s"] / base["median_s"] if base else None
        base_fast = by.get(f"ungated|ours_fast|{r['mode']}")  # the ratio the targets use: fast gated vs fast ungated
        r["step_time_vs_ungated_fast"] = r["median_s"] / base_fast["median_s"] if base_fast else None
        hf = by.get(f"{r['config']}|hf|{r['mode']}")
        r["speedup_vs_hf"] = hf["median_s"] / r["median_s"] if hf else None
    result = {"bench": "train", "machine": common.machine(), "preset": args.preset, "shape_overrides": shape,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers, "batch": args.batch,
              "seq": args.seq, "reps": args.reps, "resolved_precision": prec, "peak_flops": peak,
              "peak_precision": prec, "rows": rows}
    path = common.write_json(args.out, result)
    print(common.md_table(rows, ["config", "impl", "mode", "intermediate_size", "median_s", "rel_iqr", "tokens_per_s",
                                 "step_time_vs_ungated",
                                 "step_time_vs_ungated_fast", "speedup_vs_hf", "mfu"]))
    if ac_rows:
        print(common.md_table([r for r in rows if "activation_checkpointing" in r],
                              ["config", "mode", "activation_checkpointing", "median_s", "rel_iqr", "tokens_per_s",
                               "step_time_vs_none", "held_after_forward_mb", "plan_kept_mb"]))
    print(f"peak {prec} GEMM: {peak / 1e9:.1f} GFLOP/s; wrote {path}")
    return result


if __name__ == "__main__":
    main()
