"""The analysis driver: stream token batches through a model and reduce everything paper map §5 measures on the fly.

`analyze_model(model, batches, config)` works on our models (through the capture API of capture.py: q/k, gate and
SDPA outputs, and the decoder's attn/ffn outputs and residuals) and on any HF transformer (through hooks.py: q/k from
the attention backend, layer/attention/FFN outputs from forward hooks; `output_attentions` maps as the fallback).
Nothing keeps a full tensor across batches: running maxima, sums, histograms and per-head sums are all that persist,
and attention-sink numbers come from q.k0 and chunked log-sum-exps (sink.py), never from T x T maps for all heads.

The returned dict is JSON-ready; its schema is documented in `analysis_schema()` and docs/usage.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F

from . import metrics as M
from .hooks import capture_activations, capture_qk, capture_sdpa_output, find_layers
from .attention_sinks import DEFAULT_CHUNK_BYTES, SinkAccumulator, head_mean_map, key_probs_chunked

ACT_NAMES = ("attn_output", "attn_residual", "ffn_output", "ffn_residual")


@dataclass
class AnalysisConfig:
    sink_eps: float = 0.3  # Gu et al.'s threshold for calling a head a sink head
    sink_key: int = 0  # key position for Sink_k^eps (F-Attn is always key 0)
    map_layers: tuple | None = None  # layers whose head-averaged map is kept; None = 0, ~L/4, ~3L/4, last (official demo)
    map_len: int = 64  # first n queries/keys of batch element 0 shown in maps; small so the JSON stays readable
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # per-chunk logits budget: bounds memory for long sequences
    gate_hist_range: tuple = (-0.5, 2.0)  # covers sigmoid, 2*sigmoid (identity init) and SiLU-like gates
    gate_hist_bins: int = 125  # 0.02-wide bins
    loss_by_position: bool = True  # causal LMs only: per-position next-token loss
    method: str = "auto"  # "auto" | "capture" (our models) | "qk-hooks" | "eager-probs" (full maps; slow, a cross-check)


def default_map_layers(num_layers: int) -> list[int]:
    return sorted({0, num_layers // 4, (3 * num_layers) // 4, num_layers - 1})


class _Collector:
    """All running reductions of one analysis run, fed by whichever capture path is active."""

    def __init__(self, num_layers: int, cfg: AnalysisConfig):
        self.L, self.cfg = num_layers, cfg
        keys = (0,) if cfg.sink_key == 0 else (0, cfg.sink_key)
        self.sink = SinkAccumulator(keys=keys)
        self.maps_wanted = set(cfg.map_layers if cfg.map_layers is not None else default_map_layers(num_layers))
        self.maps: dict[int, torch.Tensor] = {}
        self.act_max: dict[tuple[int, str], float] = {}
        self.gate = {}  # layer -> RunningStats (per head)
        self.gate_hist = {}  # layer -> Histogram
        self.y = {}  # (layer, "pre"/"post") -> dict(n, abs_sum, below{t: count})
        self.y_pre_log = {}  # layer -> LogHistogram of |y_pre_gate|
        self.query_mask: torch.Tensor | None = None
        self.first_batch = True

    # --- attention ---------------------------------------------------------------------------------------------
    def attention(self, layer, q, k, scale, mask=None, causal=True, softcap=None):
        probs, vis, nvis = key_probs_chunked(q, k, scale, self.sink.keys, mask, causal, softcap, self.cfg.chunk_bytes)
        self.sink.add(layer, probs, vis, nvis, self.query_mask)
        if self.first_batch and layer in self.maps_wanted and layer not in self.maps:
            self.maps[layer] = head_mean_map(q, k, scale, self.cfg.map_len, mask, causal, softcap).cpu()

    def attention_probs(self, layer, probs, causal, key_mask=None):
        """Fallback path from full (B, H, T, S) maps (eager output_attentions)."""
        B, H, T, S = probs.shape
        allowed = torch.ones(B, T, S, dtype=torch.bool, device=probs.device)
        if causal:
            allowed &= torch.ones(T, S, dtype=torch.bool, device=probs.device).tril(S - T)
        if key_mask is not None:
            allowed &= key_mask.bool()[:, None, :]
        keys = list(self.sink.keys)
        vis = allowed[:, None, :, keys].expand(B, H, T, len(keys))  # (B, H, T, K)
        nvis = allowed.sum(-1)[:, None, :].expand(B, H, T)  # (B, H, T)
        self.sink.add(layer, probs[..., keys].float(), vis, nvis, self.query_mask)
        if self.first_batch and layer in self.maps_wanted and layer not in self.maps:
            n = min(self.cfg.map_len, T, S)
            self.maps[layer] = probs[0, :, :n, :n].float().mean(0).cpu()  # (n, n)

    # --- activations, gates, SDPA outputs --------------------------------------------------------------------------
    def _masked(self, x):
        """Drop padded tokens (B, T, ...) so they do not set maxima or statistics."""
        if x.dim() < 2:
            return x
        if self.query_mask is None or x.shape[:2] != self.query_mask.shape:
            return x.reshape(-1, *x.shape[2:])  # (B*T, ...)
        return x[self.query_mask.bool().to(x.device)]  # (N, ...)

    def activation(self, layer, name, x):
        if name == "sdpa_output":
            return self.sdpa_output(layer, "out", x)
        x = self._masked(x)
        if x.numel():
            self.act_max[(layer, name)] = M.nanmax(self.act_max.get((layer, name), 0.0), M.max_abs(x))

    def gate_scores(self, layer, g):
        g = self._masked(g)  # (N, H, D|1) per head, or (N, d) for a gate with no head axis (G5)
        st = self.gate.setdefault(layer, M.RunningStats())
        st.update(g, dim=1 if g.dim() == 3 else None)
        lo, hi = self.cfg.gate_hist_range
        self.gate_hist.setdefault(layer, M.Histogram(lo, hi, self.cfg.gate_hist_bins)).update(g)

    def sdpa_output(self, layer, which, y):
        y = self._masked(y).float()
        d = self.y.setdefault((layer, which), {"n": 0, "abs_sum": 0.0, "below": {t: 0 for t in M.SPARSITY_THRESHOLDS}})
        a = y.abs()
        d["n"] += a.numel()
        d["abs_sum"] += float(a.sum(dtype=torch.float64))
        for t in M.SPARSITY_THRESHOLDS:
            d["below"][t] += int((a < t).sum())
        if which == "pre":
            self.y_pre_log.setdefault(layer, M.LogHistogram()).update(y)

    # --- results ------------------------------------------------------------------------------------------------
    def result(self) -> dict:
        layers = []
        for i in range(self.L):
            e: dict = {"layer": i}
            if i in self.sink.sums:
                ph = self.sink.per_head(i, 0)
                e["first_token_attention"] = float(ph.mean())
                e["first_token_attention_per_head"] = [round(float(v), 6) for v in ph]
                pk = self.sink.per_head(i, len(self.sink.keys) - 1)
                e["sink_rate"] = M.sink_rate(pk, self.cfg.sink_eps)
                e["uniform_first_token_attention"] = self.sink.uniform_reference(i)
            else:
                e["first_token_attention"] = e["sink_rate"] = e["uniform_first_token_attention"] = None
                e["first_token_attention_per_head"] = None
            hidden = self.act_max.get((i, "hidden"), self.act_max.get((i, "ffn_residual")))
            e["max_abs_hidden"] = hidden
            for n in ACT_NAMES:
                e[f"max_abs_{n}"] = self.act_max.get((i, n))
            st = self.gate.get(i)
            e["gate_mean"] = st.mean if st else None
            e["gate_std"] = st.std if st else None
            e["gate_min"] = st.min if st else None
            e["gate_max"] = st.max if st else None
            e["gate_per_head"] = st.per_slot() if st else None
            e["gate_histogram"] = self.gate_hist[i].to_dict() if i in self.gate_hist else None
            for which in ("pre", "post"):
                # no G1 gate emitted: pre = post = the SDPA output that reaches the output projection
                d = self.y.get((i, which), self.y.get((i, "out")))
                e[f"mean_abs_y_{which}_gate"] = d["abs_sum"] / d["n"] if d else None
                for t in M.SPARSITY_THRESHOLDS:
                    e[f"sparsity_{which}_gate_{t:g}"] = d["below"][t] / d["n"] if d else None
            for t in M.SPARSITY_THRESHOLDS:
                lh = self.y_pre_log.get(i)
                ok = lh is not None and st is not None and st.mean and st.mean > 0
                e[f"sparsity_pre_gate_x_mean_gate_{t:g}"] = lh.fraction_below(t / st.mean) if ok else None
            layers.append(e)

        def mean_of(key):
            vals = [e[key] for e in layers if e.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        gate_n = sum(s.n for s in self.gate.values())
        out = {
            "first_token_attention": mean_of("first_token_attention"),
            "uniform_first_token_attention": mean_of("uniform_first_token_attention"),
            "sink_rate": mean_of("sink_rate"),
            "sink_eps": self.cfg.sink_eps,
            "sink_key": self.cfg.sink_key,
            "max_abs_hidden": mean_of("max_abs_hidden"),
            **{f"max_abs_{n}": mean_of(f"max_abs_{n}") for n in ACT_NAMES},
            # entry-weighted over layers: "mean sigma over all entries, tokens and layers" (paper map §10 item 10)
            "gate_mean": sum(s.sum for s in self.gate.values()) / gate_n if gate_n else None,
            "gate_std": mean_of("gate_std"),
            "gate_min": _reduce(M.nanmin, (s.min for s in self.gate.values())),
            "gate_max": _reduce(M.nanmax, (s.max for s in self.gate.values())),
        }
        for which in ("pre", "post"):
            out[f"mean_abs_y_{which}_gate"] = mean_of(f"mean_abs_y_{which}_gate")
            for t in M.SPARSITY_THRESHOLDS:
                out[f"sparsity_{which}_gate_{t:g}"] = mean_of(f"sparsity_{which}_gate_{t:g}")
        for t in M.SPARSITY_THRESHOLDS:
            out[f"sparsity_pre_gate_x_mean_gate_{t:g}"] = mean_of(f"sparsity_pre_gate_x_mean_gate_{t:g}")
        out["layers"] = layers
        out["attention_maps"] = {str(k): [[round(float(v), 5) for v in row] for row in m]
                                 for k, m in sorted(self.maps.items())}
        return out


def _reduce(fn, values):
    """fn-fold of `values` (None when empty), NaN-propagating with nanmax/nanmin."""
    out = None
    for v in values:
        out = v if out is None else fn(out, v)
    return out


class CaptureRecorder:
    """A capture.py recorder that reduces on the fly instead of storing tensors (our models' path)."""

    wants_probs = False

    def __init__(self, collector: _Collector):
        self.c = collector
        self.pending: dict[int, dict] = {}

    def wants(self, name: str) -> bool:
        return name != "attn_probs"

    def __call__(self, layer: int, name: str, value) -> None:
        if name in ("q", "k", "scale"):
            p = self.pending.setdefault(layer, {})
            p[name] = value
            if len(p) == 3:  # q, k and scale may arrive in any order
                self.c.attention(layer, p["q"], p["k"], p["scale"], None, True, None)
                del self.pending[layer]
        elif name == "gate":
            self.c.gate_scores(layer, value)
        elif name == "y_pre_gate":
            self.c.sdpa_output(layer, "pre", value)
        elif name == "y_post_gate":
            self.c.sdpa_output(layer, "post", value)
        elif name in ACT_NAMES:
            self.c.activation(layer, name, value)
        elif name == "sdpa_output":
            self.c.sdpa_output(layer, "out", value)


def _is_ours(model) -> bool:
    return any(hasattr(m, "capture") for m in model.modules())


def model_kind(config) -> str:
    """"causal" for decoder LMs, "encoder" for bidirectional models (BERT family)."""
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or getattr(config, "is_decoder", False):
        return "causal"
    if archs or getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "electra", "deberta", "xlm-roberta"):
        return "encoder"
    return "causal"


def _token_loss(model, ids, mask, chunk_bytes):
    """Per-token next-token CE (B, T-1): base-model forward, then the LM head in position chunks (no B x T x V)."""
    base, head = getattr(model, "base_model", model), model.get_output_embeddings()
    if base is model or head is None:
        logits = model(input_ids=ids, attention_mask=mask).logits
        return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    h = base(input_ids=ids, attention_mask=mask)
    h = h.last_hidden_state if hasattr(h, "last_hidden_state") else h[0]  # (B, T, d)
    cap = getattr(model.config, "final_logit_softcapping", None)
    B, T, _ = h.shape
    tc = max(1, int(chunk_bytes // (4 * 4 * B * head.weight.shape[0])))
    out = []
    for t0 in range(0, T - 1, tc):
        t1 = min(T - 1, t0 + tc)
        logits = head(h[:, t0:t1]).float()  # (B, tc, V)
        if cap:
            logits = cap * torch.tanh(logits / cap)
        out.append(F.cross_entropy(logits.transpose(1, 2), ids[:, t0 + 1:t1 + 1], reduction="none"))
    return torch.cat(out, 1)  # (B, T-1)


def _as_batch(b, device):
    if isinstance(b, dict):
        ids, mask = b["input_ids"], b.get("attention_mask")
    else:
        ids, mask = b, None
    ids = ids.to(device)
    if mask is not None:
        mask = mask.to(device)
        if bool(mask.all()):
            mask = None
    return ids, mask


@torch.no_grad()
def analyze_model(model, batches: Iterable, config: AnalysisConfig | None = None, kind: str | None = None) -> dict:
    """Analyse `model` on token batches: LongTensor (B, T) or dicts with input_ids and attention_mask (1 = real).

    Returns the JSON-ready analysis dict (schema: `analysis_schema()`); `kind` is "causal" or "encoder"
    (default: from the config).
    """
    cfg = config or AnalysisConfig()
    kind = kind or model_kind(model.config)
    if kind not in ("causal", "encoder"):
        raise ValueError(f"kind must be 'causal' or 'encoder', got {kind!r}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    layers = find_layers(model)
    col = _Collector(len(layers), cfg)
    if cfg.method not in ("auto", "capture", "qk-hooks", "eager-probs"):
        raise ValueError(f"AnalysisConfig.method must be auto, capture, qk-hooks or eager-probs, got {cfg.method!r}")
    if cfg.method == "capture" and not _is_ours(model):
        raise ValueError(f"method 'capture' needs a gated_attention model; {type(model).__name__} has no capture points")
    method = cfg.method if cfg.method != "auto" else ("capture" if _is_ours(model) else "qk-hooks")
    loss_sum = loss_n = None
    n_tokens = 0
    n_batches = 0
    T_seen = None
    try:
        for b in batches:
            ids, mask = _as_batch(b, device)
            col.query_mask = mask
            want_loss = kind == "causal" and cfg.loss_by_position
            if method == "capture":
                from ..capture import capture
                rec = CaptureRecorder(col)
                with capture(model, rec), capture_sdpa_output(model, rec):
                    ce = _token_loss(model, ids, mask, cfg.chunk_bytes) if want_loss else model(input_ids=ids)
            elif method == "qk-hooks":
                with capture_activations(model, col.activation), capture_sdpa_output(model, col.activation), \
                        capture_qk(model, col.attention) as st:
                    ce = _token_loss(model, ids, mask, cfg.chunk_bytes) if want_loss else model(
                        input_ids=ids, attention_mask=mask)
                if st["calls"] == 0:  # attention does not dispatch through the table: use eager maps
                    method = "eager-probs"
                    col = _Collector(len(layers), cfg)
                    col.query_mask = mask
            if method == "eager-probs":
                ce = _eager_probs_batch(model, ids, mask, col, kind, want_loss, cfg)
            if want_loss:
                w = torch.ones_like(ce) if mask is None else mask[:, 1:].float()
                s, n = (ce * w).sum(0).double().cpu(), w.sum(0).double().cpu()
                if loss_sum is None or loss_sum.shape != s.shape:
                    if loss_sum is not None:
                        raise ValueError("loss_by_position needs every batch to have the same sequence length")
                    loss_sum, loss_n = s, n
                else:
                    loss_sum, loss_n = loss_sum + s, loss_n + n
            n_tokens += int(mask.sum()) if mask is not None else ids.numel()
            n_batches += 1
            T_seen = ids.shape[1]
            col.first_batch = False
    finally:
        model.train(was_training)
    if n_batches == 0:
        raise ValueError("analyze_model got no batches; give it at least one (B, T) token tensor")
    out = col.result()
    lbp = None if loss_sum is None else (loss_sum / loss_n.clamp_min(1)).tolist()
    head = {
        "model_type": getattr(model.config, "model_type", None),
        "kind": kind,
        "method": method,
        "num_layers": len(layers),
        "num_heads": len(out["layers"][0]["first_token_attention_per_head"] or []),
        "seq_len": T_seen,
        "batches": n_batches,
        "tokens": n_tokens,
        "loss": None if loss_sum is None else float(loss_sum.sum() / loss_n.sum().clamp_min(1)),
        "loss_by_position": None if lbp is None else [round(v, 5) for v in lbp],
    }
    maps = out.pop("attention_maps")
    return {**head, **out, "attention_maps": maps}


def _eager_probs_batch(model, ids, mask, col, kind, want_loss, cfg):
    """Fallback: full maps from output_attentions under eager attention, one sequence at a time (bounded memory)."""
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl != "eager":
        model.set_attn_implementation("eager")
    ces = []
    try:
        for r in range(ids.shape[0]):
            m = None if mask is None else mask[r:r + 1]
            col.query_mask = m
            with capture_activations(model, col.activation), capture_sdpa_output(model, col.activation):
                out = model(input_ids=ids[r:r + 1], attention_mask=m, output_attentions=True)
            for i, p in enumerate(out.attentions):
                col.attention_probs(i, p, kind == "causal", m)
            if want_loss:
                ces.append(F.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), ids[r:r + 1, 1:],
                                           reduction="none"))
    finally:
        col.query_mask = mask
        if impl != "eager":
            model.set_attn_implementation(impl)
    return torch.cat(ces, 0) if want_loss else None


# --- loading models and text --------------------------------------------------------------------------------------

def load_model(model_dir: str | os.PathLike, attn_implementation: str = "sdpa", dtype=torch.float32):
    """Load a local checkpoint (ours or any HF transformer) for analysis; returns (model, kind). Never downloads."""
    import transformers
    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)

    path = Path(model_dir)
    from gated_attention.util.io import check_hf_dir

    check_hf_dir(path, "model folder")  # folder, config.json parses, weights present and intact (else one line)
    conf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    kind = model_kind(conf)
    cls = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModel
    model = cls.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval(), kind


def load_tokenizer(model_dir, data_dir=None):
    """The model directory's own tokenizer, else the project corpus tokenizer from `data_dir`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # no tokenizer files next to the weights
        if data_dir is None:
            raise FileNotFoundError(f"{model_dir}: no tokenizer files; pass --data-dir with the corpus tokenizer") from exc
        from ..data import get_tokenizer
        return get_tokenizer(data_dir)


def bos_id(tokenizer) -> int | None:
    for name in ("bos_token_id", "cls_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return None


def token_batches(ids, seq_len: int, batch_size: int, batches: int, first_token: int | None = None):
    """Cut a 1-D token stream into `batches` batches of (batch_size, seq_len) windows; each window starts with
    `first_token` when given (a fixed first token, as in training windows), else is raw text."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    body = seq_len - (first_token is not None)
    need = batches * batch_size
    n = ids.numel() // body if body > 0 else 0
    if n < need:
        if n == 0:
            raise ValueError(f"text too short: {ids.numel()} tokens for one window of {seq_len}; "
                             "give more text or a smaller --seq-len")
        batches = max(1, n // batch_size) if n >= batch_size else 1
        batch_size = min(batch_size, n)
    w = ids[: batches * batch_size * body].view(batches, batch_size, body)  # (K, B, body)
    if first_token is not None:
        w = torch.cat([torch.full((batches, batch_size, 1), first_token, dtype=torch.long), w], -1)  # (K, B, T)
    return [w[i] for i in range(batches)]


def analysis_schema() -> str:
    """Human-readable description of analysis.json (docs/usage.md shows it)."""
    return SCHEMA


SCHEMA = """\
analysis.json (all numbers are floats; null = not measurable for this model, e.g. no gate):
  model, model_type, kind ("causal" | "encoder"), method ("capture" = our capture API, "qk-hooks" = q/k from the
    HF attention backend, "eager-probs" = output_attentions maps), num_layers, num_heads, seq_len, batches, tokens
  first_token_attention     F-Attn: attention on key 0, mean over batch, heads, queries, then over layers
  uniform_first_token_attention  what F-Attn would be if every query attended uniformly (reference for "no sink")
  sink_rate, sink_eps, sink_key  Sink_k^eps (Gu et al.): share of heads whose mean attention to key k exceeds eps
  max_abs_hidden            M-Act: per-layer max |layer output hidden state|, mean over layers
  max_abs_attn_output, max_abs_attn_residual, max_abs_ffn_output, max_abs_ffn_residual  same, per sub-block
  gate_mean                 mean gate score over all entries, tokens and layers (null without a gate);
  gate_std (mean of per-layer std), gate_min, gate_max
  mean_abs_y_pre_gate, mean_abs_y_post_gate   mean |SDPA output| before / after the gate (mean over layers)
  sparsity_{pre_gate,post_gate,pre_gate_x_mean_gate}_{0.01,0.001}  fraction of |Y| below the threshold; the last
    scales the pre-gate output by the layer's mean gate (uniform scaling, Fig. 5)
  loss, loss_by_position    next-token CE overall and at each position t (predicting token t+1); null for encoders
  layers: list, one entry per layer with "layer" and the same keys per layer, plus first_token_attention_per_head,
    gate_per_head {mean,std,min,max lists}, gate_histogram {edges, counts}
  attention_maps: {layer index: head-averaged n x n map of batch element 0} for the plotted layers
"""


def analyze_folder(model_dir, out, text: str | None = None, domain: str | None = None, data_dir: str | None = None,
                   seq_len: int = 512, batches: int = 4, batch_size: int = 2, bos: bool = True,
                   layers_to_plot=None, map_len: int = 64, sink_eps: float = 0.3,
                   attn_implementation: str = "sdpa") -> dict:
    """`gattn analyze DIR`: analyse a local model (ours or any HF transformer) on windows of a text file or of a
    corpus domain's validation tokens; writes OUT/analysis.json (strict JSON; non-finite metrics null, listed under
    "nonfinite_metrics") and the PNG plots; returns the result."""
    from pathlib import Path

    from ..util.io import atomic_write_json, nonfinite_paths
    from .plots import plot_all

    for name, v in (("seq_len", seq_len), ("batches", batches), ("batch_size", batch_size), ("map_len", map_len)):
        if v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model, kind = load_model(model_dir, attn_implementation=attn_implementation)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    n_layers = getattr(model.config, "num_hidden_layers", None)
    if layers_to_plot and n_layers and any(not 0 <= i < n_layers for i in layers_to_plot):
        raise ValueError(f"--layers-to-plot must be in 0..{n_layers - 1}")
    from ..data.tokenizer import check_vocab_fits

    rows = model.get_input_embeddings().num_embeddings
    tok = load_tokenizer(model_dir, data_dir)
    if text:
        check_vocab_fits(len(tok), rows, f"the tokenizer of {tok.name_or_path}", str(model_dir))
        ids = tok(Path(text).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    elif not data_dir:
        raise ValueError("--domain needs --data-dir (the prepared corpus directory)")
    else:
        from ..data import Corpus

        corpus = Corpus(data_dir)
        check_vocab_fits(corpus.vocab_size, rows, f"the corpus {data_dir}", str(model_dir))
        ids = corpus.tokens(domain, "val")
    windows = token_batches(ids, seq_len, batch_size, batches, bos_id(tok) if bos else None)
    cfg = AnalysisConfig(sink_eps=sink_eps, map_len=map_len, map_layers=tuple(layers_to_plot) if layers_to_plot else None)
    result = {"model": str(model_dir), **analyze_model(model, windows, cfg, kind)}
    bad = nonfinite_paths({k: v for k, v in result.items() if k != "attention_maps"})
    if bad:
        result["nonfinite_metrics"] = bad
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "analysis.json", result, indent=1)  # a NaN metric is null + "nonfinite", never bare NaN
    plot_all(result, out, label=Path(model_dir).name)
    return result
