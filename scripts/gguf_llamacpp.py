"""Our model vs its GGUF export run in llama.cpp (llama-cpp-python, the `serve` extra), on real validation text:
max |Δlogits| and argmax agreement per file type, greedy generations compared, and the loss (nats/token) each file
gives in llama.cpp beside ours in fp32. Files: f32, f16, bf16, q8_0 (gguf-py), q8_0 with the gate kept f32, and
llama.cpp's own quantizer (llama_model_quantize) to Q8_0 and Q4_K_M from the f32 file.

Run: PYTHONPATH=src .venv/bin/python scripts/gguf_llamacpp.py --data-dir DATA RUN/final [RUN/final ...] [--windows 8]
(a checkpoint dir with its tokenizer, or pass --tokenizer). Prints one table; --json FILE writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from gated_attention.data import Corpus
from gated_attention.interop.checkpoints import load_model
from gated_attention.interop.gguf_export import export_gguf
from gated_attention.interop.gguf_vocab import find_tokenizer_json

FILES = [("f32", "f32", None), ("f16", "f16", None), ("bf16", "bf16", None), ("q8_0", "q8_0", None),
         ("q8_0 gate f32", "q8_0", "f32")]
# llama.cpp's quantizer: (label, LlamaFileType, GGML type of the gate-holding attn_q or None). 7 = MOSTLY_Q8_0,
# 15 = MOSTLY_Q4_K_M; ggml types 1 = F16, 8 = Q8_0 (the gate kept high through the quantizer's tensor-type overrides)
LLAMA_QUANT = [("llama.cpp Q8_0", 7, None), ("llama.cpp Q4_K_M", 15, None), ("llama.cpp Q4_K_M gate f16", 15, 1),
               ("llama.cpp Q4_K_M gate q8_0", 15, 8)]


def llama_quantize(src, dst, ftype, gate_type=None):
    """llama.cpp's own quantizer (llama_model_quantize) from the f32 file; gate_type: attn_q's ggml type override."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if gate_type is not None:
        over = (llama_cpp.llama_model_tensor_override * 2)()
        over[0].pattern, over[0].type = rb"attn_q\.weight", gate_type
        over[1].pattern = None  # the list ends at a null pattern
        params.tt_overrides = ctypes.cast(over, type(params.tt_overrides))
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)


def _windows(data_dir, n, seq):
    corpus = Corpus(data_dir)
    out = []
    for d in corpus.domains:
        toks = np.asarray(corpus.tokens(d, "val"))
        for k in range(n):
            start = k * (len(toks) - seq) // max(n, 1)
            out.append([corpus.bos_id] + toks[start:start + seq].tolist())
    return out


def _nll(logits, ids):
    lp = logits[:-1] - np.log(np.exp(logits[:-1] - logits[:-1].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits[:-1].max(-1, keepdims=True)
    return -lp[np.arange(len(ids) - 1), ids[1:]].mean()


def open_llama(path, n_ctx=1024):
    """llama-cpp-python's Llama with llama.cpp's extra CPU buffer types (AMX / repacked weights) off: on this Xeon
    (AMX) the AMX matmul of Q8_0 weights dies with SIGILL in 0.3.36's llama.cpp for every model, stock qwen3 too."""
    import llama_cpp
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=1,
                               verbose=False)
    finally:
        C.llama_model_default_params = default


def measure(model, path, windows, n_gen=32):
    llm = open_llama(path)
    dmax, agree, n, nll_t, nll_o = 0.0, 0, 0, [], []
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        theirs = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0].double().numpy()
        dmax = max(dmax, float(np.abs(theirs - ours).max()))
        agree += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
        n += len(ids)
        nll_t.append(_nll(theirs, ids))
        nll_o.append(_nll(ours, ids))
    prompt = windows[0][:32]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    gen = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        gen.append(tok)
        if len(gen) == n_gen:
            break
    llm.close()
    same = next((i for i, (a, b) in enumerate(zip(gen, greedy)) if a != b), n_gen)
    return dict(max_abs_dlogits=dmax, argmax_agreement=agree / n, loss_llamacpp=float(np.mean(nll_t)),
                loss_ours=float(np.mean(nll_o)), greedy_identical_tokens=same, greedy_tokens=n_gen,
                size_bytes=os.path.getsize(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--windows", type=int, default=4, help="validation windows per domain")
    ap.add_argument("--seq-len", type=int, default=255)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    windows = _windows(args.data_dir, args.windows, args.seq_len)
    rows = []
    for src in args.models:
        model = load_model(src)
        tok = find_tokenizer_json(args.tokenizer or args.data_dir)
        with tempfile.TemporaryDirectory() as d:
            for label, outtype, gate_type in FILES:
                if gate_type and model.config.gate == "none":
                    continue
                path = Path(d) / f"{outtype}-{gate_type}.gguf"
                export_gguf(model, path, tok, outtype, gate_type)
                rows.append(dict(model=src, gate=model.config.gate, file=label, **measure(model, path, windows)))
                print(f"measured {src} {label}", file=sys.stderr, flush=True)
            for label, ftype, gate_type in LLAMA_QUANT:
                if gate_type is not None and model.config.gate == "none":
                    continue
                path = Path(d) / f"lq{ftype}-{gate_type}.gguf"
                rc = llama_quantize(Path(d) / "f32-None.gguf", path, ftype, gate_type)
                if rc != 0:
                    rows.append(dict(model=src, gate=model.config.gate, file=label, error=f"quantize rc {rc}"))
                    continue
                rows.append(dict(model=src, gate=model.config.gate, file=label, **measure(model, path, windows)))
    print(f"{'gate':18s} {'file':18s} {'max|dlogit|':>11s} {'argmax':>7s} {'loss llama.cpp':>14s} {'loss ours':>9s} "
          f"{'greedy same':>11s} {'MiB':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['gate']:18s} {r['file']:18s} {r['error']}")
            continue
        print(f"{r['gate']:18s} {r['file']:18s} {r['max_abs_dlogits']:11.2e} {r['argmax_agreement']:7.4f} "
              f"{r['loss_llamacpp']:14.4f} {r['loss_ours']:9.4f} {r['greedy_identical_tokens']:>5d}/{r['greedy_tokens']:<5d}"
              f" {r['size_bytes'] / 2**20:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
