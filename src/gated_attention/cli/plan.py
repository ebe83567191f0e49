"""`gattn plan`: a training preset's size, FLOPs, memory per GPU, fit and days, before a GPU is rented
(train/plan.py does the work; the model is built on the meta device, so any size plans in seconds)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..util import errors as E
from ..util import precision as P


def checkpointing_arg(text: str) -> str:
    """argparse type of --activation-checkpointing: a value config.checkpointing_mode accepts."""
    from ..train.config import checkpointing_mode

    try:
        checkpointing_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def configure_plan(parser: argparse.ArgumentParser) -> None:
    from ..train.config import ACTIVATION_CHECKPOINTING
    from ..train.train_presets import TRAIN_PRESETS
    from ..train.plan_hardware import DEFAULTS
    from ..train.plan_comm import DEFAULT_TOPOLOGY

    parser.add_argument("--preset", required=True, choices=list(TRAIN_PRESETS),
                        help="training preset to plan (the paper's: paper-dense-28l, paper-dense-48l, paper-moe-15a2b)")
    parser.add_argument("--gate", default=None, help="gate variant (see `gattn gates`); default: the preset's")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training setting (`gattn settings` lists them) or a model.* field as `gattn "
                             "train --set` does; repeatable")
    parser.add_argument("--gpus", type=E.positive_int, default=DEFAULTS["gpus"],
                        help=f"GPUs (ranks) the run uses (default {DEFAULTS['gpus']})")
    parser.add_argument("--gpu-memory", type=E.positive_float, default=DEFAULTS["gpu_memory_gb"], metavar="GB",
                        help=f"memory of one GPU in GB (default {DEFAULTS['gpu_memory_gb']:g}: H100 80GB)")
    parser.add_argument("--gpu-tflops", type=E.positive_float, default=DEFAULTS["gpu_tflops"], metavar="T",
                        help=f"peak dense bf16 TFLOP/s of one GPU (default {DEFAULTS['gpu_tflops']:g}: H100 SXM)")
    parser.add_argument("--mfu", type=E.positive_float, default=DEFAULTS["mfu"], metavar="F",
                        help=f"model FLOPs utilisation to assume, in (0, 1] (default {DEFAULTS['mfu']:g})")
    t = DEFAULT_TOPOLOGY
    parser.add_argument("--gpus-per-node", type=E.positive_int, default=t.gpus_per_node, metavar="G",
                        help=f"GPUs in one node (default {t.gpus_per_node}): collectives among them use NVLink, "
                             "the rest the network")
    parser.add_argument("--nvlink-gbs", type=E.positive_float, default=t.nvlink_gbs, metavar="GB/S",
                        help=f"NVLink bandwidth per GPU per direction inside a node (default {t.nvlink_gbs:g}: H100 "
                             "SXM's NVLink 4, 900 GB/s both ways)")
    parser.add_argument("--network-gbs", type=E.positive_float, default=t.network_gbs, metavar="GB/S",
                        help=f"network bandwidth per GPU per direction across nodes (default {t.network_gbs:g}: "
                             "one InfiniBand NDR 400 Gb/s NIC per GPU)")
    parser.add_argument("--nvlink-latency-us", type=E.nonneg_float, default=t.nvlink_us, metavar="US",
                        help=f"latency of one collective step over NVLink, µs (default {t.nvlink_us:g})")
    parser.add_argument("--network-latency-us", type=E.nonneg_float, default=t.network_us, metavar="US",
                        help=f"latency of one collective step across nodes, µs (default {t.network_us:g})")
    parser.add_argument("--recommend", action="store_true",
                        help="also search the layouts (dist fsdp/hsdp/ddp, dp_replicate, expert_parallel, "
                             "accum_grads, keep_gathered, activation checkpointing, micro-batch; same global batch) "
                             "and print the one with the least planned step time that fits with the memory margin "
                             "free, as --set settings (--json: the `recommended` object)")
    parser.add_argument("--dist", choices=("ddp", "fsdp"), default=None, help="default: the preset's")
    parser.add_argument("--activation-checkpointing", type=checkpointing_arg, default=None,
                        metavar="|".join(ACTIVATION_CHECKPOINTING),
                        help="none; full (each layer keeps only its input, recomputes itself in backward); selective "
                             "(each layer keeps its GEMM and attention outputs, recomputes norms, RoPE, gates and "
                             "activations); every:N (full on layers 0, N, 2N, ...); default: the preset's")
    parser.add_argument("--seq-len", type=E.positive_int, default=None, metavar="L", help="default: the preset's")
    parser.add_argument("--micro-batch", type=E.positive_int, default=None, metavar="B",
                        help="sequences per GPU per forward (grad_accum follows); default: the preset's")
    P.add_argument(parser, default=None, what="training numerics on the GPUs",
                   note="; auto plans CUDA's choice (bf16-params under fsdp, else bf16)")
    parser.add_argument("--json", action="store_true",
                        help="print only the JSON object (params_total, params_activated, flops_per_token, "
                             "memory_per_gpu_gb, fits, tokens_per_s, days, then the settings assumed)")


def run_plan(args) -> int:
    from ..train.overrides import config_from_args
    from ..train.plan import format_plan, model_shapes, plan
    from ..train.plan_comm import topology
    from ..train.recommend import format_recommendation, recommend
    from ..util.io import json_dumps

    cfg = config_from_args(args.preset, args.gate, args.sets, None)
    topo = topology(gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, network_gbs=args.network_gbs,
                    nvlink_us=args.nvlink_latency_us, network_us=args.network_latency_us)
    machine = dict(gpu_memory_gb=args.gpu_memory, gpu_tflops=args.gpu_tflops, mfu=args.mfu, topo=topo,
                   precision=args.precision)
    shapes = model_shapes(cfg)
    result = plan(cfg, gpus=args.gpus, dist=args.dist, activation_checkpointing=args.activation_checkpointing,
                  seq_len=args.seq_len, micro_batch=args.micro_batch, shapes=shapes, **machine)
    text = format_plan(result, args.preset)
    if args.recommend:
        base = cfg if args.seq_len is None else replace(cfg, seq_len=args.seq_len)
        result["recommended"] = recommend(base, gpus=args.gpus, shapes=shapes if args.seq_len is None else None,
                                          **machine)
        text += "\n" + format_recommendation(result["recommended"], result)
    print(json_dumps(result, indent=1) if args.json else text)
    return 0
