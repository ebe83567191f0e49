"""An independent forward of a GGUF file as llama.cpp's source defines the graph (src/models/qwen35.cpp, qwen3.cpp),
in numpy from the file's own tensors and keys only — no code of the exporter or the model. It checks what a file
means wherever llama-cpp-python is not installed; where it is, the tests also run the real engine.

qwen35 full-attention layer: x -> attn_norm -> attn_q (T, H, 2D) split per head into q = [:D], g = [D:]; q_norm(q),
k_norm(k); NEOX RoPE on the first rope.dimension_count dims (interleaved M-RoPE with equal t/h/w positions, see
interop/gguf_map.py); causal softmax(q k^T / sqrt(D)) v with query head h reading KV head h // (H / KV);
* sigmoid(g); attn_output; residual; post_attention_norm -> SwiGLU FFN; residual. qwen3: the same without g and with
ffn_norm. RMSNorm: w * x / sqrt(mean(x^2) + eps). Head: output_norm, then `output` or the tied token_embd.
A recurrent (gated delta net) layer is not computed: the reference takes only those whose two output projections
(ssm_out, ffn_down) are all zero, which add exactly nothing to the residual stream (the exporter's no-op layer).
"""
from __future__ import annotations

import numpy as np


def read_gguf(path) -> tuple[str, dict, dict]:
    """(architecture, {key: value}, {tensor name: fp32 array in PyTorch (out, in) order}), dequantizing any type."""
    import gguf

    r = gguf.GGUFReader(str(path))
    keys = {}
    for name, field in r.fields.items():
        if not field.data:
            continue
        if field.types[0] == gguf.GGUFValueType.STRING:
            keys[name] = bytes(field.parts[field.data[0]]).decode()
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[-1] != gguf.GGUFValueType.STRING:
                keys[name] = [field.parts[i][0].item() for i in field.data]
        else:
            keys[name] = field.parts[field.data[0]][0].item()
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF ne is (in, out): PyTorch order reversed
        tensors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return keys["general.architecture"], keys, tensors


def _rms(x, w, eps):
    return w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32)


def _rope_neox(x, pos, rot, base):
    """x (T, heads, D): pairs (i, i + rot/2) of the first rot dims turned by pos * base^(-2i/rot)."""
    half = rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2 / rot)
    ang = pos[:, None].astype(np.float64) * inv[None]  # (T, half)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:rot] = b * cos + a * sin
    return out


def forward(path, tokens) -> np.ndarray:
    """Logits (T, vocab) of the GGUF model at `path` for one sequence of token ids."""
    arch, kv, w = read_gguf(path)
    p = lambda k: kv[f"{arch}.{k}"]  # noqa: E731
    H, KV, D = p("attention.head_count"), p("attention.head_count_kv"), p("attention.key_length")
    eps, rot, base = p("attention.layer_norm_rms_epsilon"), p("rope.dimension_count"), p("rope.freq_base")
    T = len(tokens)
    pos = np.arange(T)
    x = w["token_embd.weight"][np.asarray(tokens)]  # (T, d)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    recurrent = kv.get(f"{arch}.attention.recurrent_layers") or [0] * p("block_count")
    for i in range(p("block_count")):
        b = lambda n: w[f"blk.{i}.{n}"]  # noqa: E731
        if recurrent[i]:
            if np.any(b("ssm_out.weight")) or np.any(b("ffn_down.weight")):
                raise NotImplementedError(f"layer {i} is a live recurrent layer; the reference has no delta net")
            continue
        bias = lambda n: w.get(f"blk.{i}.{n}.bias", 0.0)  # noqa: E731
        h = _rms(x, b("attn_norm.weight"), eps)
        qf = h @ b("attn_q.weight").T + bias("attn_q")
        if arch == "qwen35":
            qf = qf.reshape(T, H, 2 * D)
            q, g = qf[..., :D], qf[..., D:]  # per head [q_h | g_h]
        else:
            q, g = qf.reshape(T, H, D), None
        k = (h @ b("attn_k.weight").T + bias("attn_k")).reshape(T, KV, D)
        v = (h @ b("attn_v.weight").T + bias("attn_v")).reshape(T, KV, D)
        q, k = _rms(q, b("attn_q_norm.weight"), eps), _rms(k, b("attn_k_norm.weight"), eps)
        q, k = _rope_neox(q, pos, rot, base), _rope_neox(k, pos, rot, base)
        kh, vh = k[:, np.arange(H) // (H // KV)], v[:, np.arange(H) // (H // KV)]  # (T, H, D)
        s = np.einsum("thd,shd->hts", q, kh) / np.sqrt(D) + mask  # (H, T, T)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), vh)  # (T, H, D)
        if g is not None:
            a = a / (1.0 + np.exp(-g))
        x = x + a.reshape(T, H * D) @ b("attn_output.weight").T
        h = _rms(x, b("post_attention_norm.weight" if arch == "qwen35" else "ffn_norm.weight"), eps)
        gate, up = h @ b("ffn_gate.weight").T, h @ b("ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ b("ffn_down.weight").T
    x = _rms(x, w["output_norm.weight"], eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T
