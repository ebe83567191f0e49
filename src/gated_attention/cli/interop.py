"""Interop commands: `gattn convert` (checkpoint layouts), `gattn export` (a GGUF file for llama.cpp) and `gattn retrofit`
(add a gate to an ungated checkpoint)."""
from __future__ import annotations

from ..util import errors as E  # argparse types: numbers and paths checked where they enter

import argparse

from ..interop import FORMATS
from ..interop.gguf_map import OUTTYPES
from ..interop.retrofit import INITS, SOURCE_FORMATS


def configure_convert(parser) -> None:
    parser.add_argument("src", help="source checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("dst", type=E.out_dir, help="destination directory (written atomically; must not exist unless --overwrite)")
    parser.add_argument("--from", dest="src_format", required=True, choices=FORMATS,
                        help="layout of SRC: official (qiuzh20/gated_attention), qwen3 / qwen3-moe (stock HF "
                             "Qwen3 / Qwen3-MoE), qwen3-next (per-head [q|g] q_proj, zero-centred norms), llama / "
                             "mistral / qwen2 (stock HF Llama 2/3, Mistral, Qwen2/2.5; no QK-norm) or native")
    parser.add_argument("--to", dest="dst_format", default="native", choices=FORMATS,
                        help="layout to write (default: native, loadable with AutoModelForCausalLM after "
                             "`import gated_attention.modeling`); llama / mistral / qwen2 take ungated models only")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it already exists")


def run_convert(args) -> int:
    from ..interop import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, args.src_format, args.dst_format, overwrite=args.overwrite)
    print(f"wrote {args.dst_format} checkpoint to {out}")
    return 0


def configure_export(parser) -> None:
    parser.add_argument("--to", dest="target", required=True, choices=("gguf",),
                        help="file format to write: gguf (llama.cpp; G1 elementwise/headwise gates as the qwen35 "
                             "architecture with every layer full attention, ungated models as qwen3)")
    parser.add_argument("src", type=E.existing_dir, help="checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("out", type=E.out_file, help="the .gguf file to write (atomically; must not exist unless --overwrite)")
    parser.add_argument("--outtype", default="f32", choices=OUTTYPES,
                        help="type of the weight matrices (default f32; 1-D norms and biases are always f32). q8_0 "
                             "is gguf-py's Q8_0 (blocks of 32, one f16 scale); matrices whose rows are not a "
                             "multiple of 32 fall back to f16. For K-quants quantize the f32 file with llama.cpp")
    parser.add_argument("--gate-type", default=None, choices=OUTTYPES,
                        help="type of the tensors holding the gate rows (qwen35's fused attn_q), default: "
                             "--outtype; e.g. --outtype q8_0 --gate-type f32 keeps the gate in full precision")
    parser.add_argument("--from", dest="src_format", default="native", choices=FORMATS,
                        help="layout of SRC (default native; any layout `gattn convert` reads)")
    parser.add_argument("--tokenizer", default=None,
                        help="folder with the model's tokenizer.json (default: SRC; a prepared data dir works too)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it already exists")


def run_export(args) -> int:
    from ..interop.checkpoints import check_checkpoint_dir, load_model
    from ..interop.gguf_export import export_gguf
    from ..interop.gguf_vocab import find_tokenizer_json

    check_checkpoint_dir(args.src)  # a folder that is no model says so, not that its tokenizer is missing
    tokenizer = find_tokenizer_json(args.tokenizer or args.src)
    model = load_model(args.src, args.src_format)
    summary = export_gguf(model, args.out, tokenizer, args.outtype, args.gate_type, overwrite=args.overwrite)
    for line in summary["fallbacks"]:
        print(f"note: {line}")
    print(f"wrote {summary['file']} ({summary['architecture']}, {args.outtype}, gate tensors "
          f"{summary['gate_type'] if model.config.gate != 'none' else '-'}, {len(summary['tensors'])} tensors)")
    return 0


def configure_retrofit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", help="trained UNGATED checkpoint dir (native, e.g. RUN/final; or stock Qwen3 / "
                                     "Qwen3-MoE / Llama / Mistral / Qwen2 / ungated official), config.json + "
                                     "*.safetensors")
    parser.add_argument("--gate", required=True, help="gate to add (a name from `gattn gates`, e.g. sdpa_elementwise)")
    parser.add_argument("--init", required=True, choices=INITS,
                        help="identity: zero weights + 1/act(0) scale (2*sigmoid), logits unchanged at step 0 "
                             "(the official repository's issue #10 trick; the scale stays); random: official N(0, initializer_range) init")
    parser.add_argument("--out", type=E.out_dir, required=True, help="destination dir (native checkpoint, written atomically)")
    parser.add_argument("--from", dest="src_format", default="auto", choices=SOURCE_FORMATS,
                        help="layout of CKPT; auto reads config.json's model_type (qwen3 with official flags -> "
                             "official; llama, mistral, qwen2 -> those)")
    parser.add_argument("--seed", type=E.nonneg_int, default=0, help="seed of the random gate init (ignored by identity)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it already exists")


def run_retrofit(args) -> int:
    from ..interop.retrofit import retrofit_checkpoint

    out = retrofit_checkpoint(args.ckpt, args.out, args.gate, args.init, args.seed, args.src_format, args.overwrite)
    print(f"wrote {out} (gate {args.gate}, init {args.init}); continue training it on data in the model's own "
          f"vocabulary: gattn data prepare --data-dir DATA --tokenizer {out} --sources --extra YOUR_TEXT, then "
          f"gattn train --gate {args.gate} --set init_from={out} --data-dir DATA --out RUN "
          f"(add --set trainable=gates to train only the gate)")
    return 0
