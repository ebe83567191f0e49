"""The retrofit lab's starting points, their data, and every measurement (before, along the way, after).

A starting point is a trained UNGATED model folder, of one of two kinds:
  sink  a sink-lab unit `OUT/runs/<variant>/seed<k>` of `gattn lab sinks` (its result.json names the Bigram-Backcopy
        task and the steps it was trained for; the model is the HF folder the unit keeps: the unit folder itself, or
        its model/ or final/ subfolder). Data: that task's batches; skill = its CE.
  text  a training run of `gattn train` / `gattn compare` (RUN or RUN/final; train_config.json says the corpus, the
        window length and the steps), or any HF checkpoint folder the project reads (native, stock Qwen3 /
        Qwen3-MoE / Llama / Mistral / Qwen2, ungated official) with a corpus in ITS vocabulary (`gattn data prepare
        --tokenizer DIR --data-dir D`, then `--data-dir D`). Skill = held-out perplexity per domain.

Measurements (all in fp32, eval mode, on a fixed held-out set):
  sink          sink task: attention on BOS from dormant (non-trigger) queries at the backcopy head (the sink lab's
                headline); text: F-Attn (mean attention on the first token, analysis.analyze_model)
  sink_rate     share of heads whose mean attention on the first token exceeds Gu et al.'s 0.3 (both kinds)
  skill         sink task: CE over every backcopy and bigram position (backcopy_ce, bigram_ce separately);
                text: the paper's Avg PPL (mean over domains of each domain's PPL; ppl per domain kept)
  m_act         max |hidden state| (analysis' M-Act, mean over layers); residual_peak (sink task: ||h_BOS|| / median)
  gate_dormant / gate_active
                mean gate score on dormant vs active queries: sink task = non-trigger vs trigger queries at the
                backcopy head; text = the (layer, head, query) triples where the STARTING model put >= 0.3 of its
                attention on the first token (it parked there) vs the others, over the queries t >= 3 (where
                uniform attention, 1/(t+1), stays below 0.3)
  streaming_loss  next-token CE decoded through a rolling KV window of the last W tokens with the first token
                evicted (no sink tokens), over the positions t >= W; `streaming_loss_kept` keeps the first token
                (StreamingLLM's fix), `window_full_loss` is full attention on the same positions (`gattn lab
                streaming`'s measure_model: decode.py's SinkWindowCache, StreamingLLM cache positions).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DATA_SEED = 7919  # retrofit batches: a stream no pretraining run used (sink lab / compare train on seeds 0..n)
SINK_QUERY = 0.3  # text: a (layer, head, query) of the starting model "parks" when >= this much goes to token 0


@dataclass
class Start:
    """A resolved starting point (JSON-ready: it travels to worker processes as a dict)."""

    label: str  # unique name in this lab (folder name under OUT/runs/)
    path: str  # what the user gave
    model_dir: str  # the HF folder read
    kind: str  # "sink" | "text"
    source: str  # "sink-lab run" | "training run" | "HF checkpoint"
    trained_steps: int | None = None  # steps the model was trained for (None: unknown)
    train_lr: float | None = None  # its peak LR (the lab's default --lr)
    batch_size: int | None = None  # its batch size (the lab's default)
    train_wd: float | None = None  # its weight decay (the lab's default: decay changes the sink by itself)
    task: dict | None = None  # sink: BackcopyTask fields
    data_dir: str | None = None  # text: the corpus
    seq_len: int | None = None  # text: window length
    fingerprint: list | None = None  # [name, size, mtime_ns] of each weight file: a changed model is a new start

    def to_dict(self) -> dict:
        return asdict(self)


def _fingerprint(model_dir: Path) -> list:
    from gated_attention.util.io import hf_weight_files

    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in hf_weight_files(model_dir)]


def _ungated(model_dir: Path) -> bool:
    """config.json names no gate and no attention mechanism (foreign formats: retrofit's own checks decide)."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    if c.get("model_type") != "gated_qwen3":
        return True
    return c.get("gate") in (None, "none", "baseline") and c.get("mechanism") in (None, "none")


def _start(entry, data_dir: str | None, seq_len: int | None) -> Start:
    """A Start from one model of `gattn lab streaming`'s resolver (labs.streaming.resolve_models)."""
    from gated_attention.util.io import read_json_object

    from ..sinks import stored as sink_lab

    path = Path(entry.path)
    label = entry.label.replace("/", "_").replace(":", "_")
    if entry.kind == "sink_lab":
        if not (path / "config.json").is_file():
            raise ValueError(f"--from {path}: this sink-lab unit kept no model (trained before the lab kept its "
                             "models); re-run `gattn lab sinks` into a new --out")
        key = read_json_object(path / "result.json", "sink-lab result").get("key") or {}
        return Start(label=label, path=str(path), model_dir=str(path), kind="sink", source="sink-lab run",
                     trained_steps=key.get("steps"), train_lr=key.get("lr"), batch_size=key.get("batch_size"),
                     train_wd=key.get("weight_decay"), task=dict(sink_lab.load_run_meta(path)["task"]),
                     fingerprint=_fingerprint(path))
    run = next((d for d in (path, path.parent) if (d / "train_config.json").is_file()), None)
    tc = read_json_object(run / "train_config.json", "training settings") if run is not None else {}
    if run is not None and tc.get("data") not in (None, "corpus") and data_dir is None:
        raise ValueError(f"--from {path}: that run trained on {tc.get('data')!r} data; give --data-dir")
    named = data_dir is None and (tc.get("data_dir") or entry.data_dir)
    data_dir = data_dir or tc.get("data_dir") or entry.data_dir
    if not data_dir:
        raise ValueError(f"--from {path}: an HF checkpoint needs --data-dir, a corpus in its vocabulary "
                         f"(gattn data prepare --tokenizer {path} --data-dir D)")
    if named and not (Path(data_dir) / "manifest.json").is_file():
        raise ValueError(f"--from {path}: its train_config.json names the corpus {data_dir!r}, which is not a prepared "
                         "corpus from here (a relative path is read from the current folder); pass --data-dir")
    return Start(label=label, path=str(path), model_dir=str(path), kind="text",
                 source="training run" if run is not None else "HF checkpoint", trained_steps=tc.get("steps"),
                 train_lr=tc.get("lr"), batch_size=tc.get("batch_size"), train_wd=tc.get("weight_decay"),
                 data_dir=str(data_dir),
                 seq_len=seq_len or tc.get("seq_len") or 256, fingerprint=_fingerprint(path))


def resolve_starts(paths: list, data_dir: str | None = None, seq_len: int | None = None,
                   log=lambda m: None) -> list[Start]:
    """Every starting model the --from folders hold (the streaming lab's resolver: a sink-lab unit, a whole sink-lab
    or compare OUT, a trainer run, an HF folder); a folder that holds several models contributes its UNGATED ones
    (a sink-lab OUT its baseline seeds, a compare OUT its baseline). All of one kind and, for sink runs, one task."""
    from ..streaming.streaming_lab import resolve_models

    starts = []
    for p in paths:
        if not Path(p).is_dir():
            raise ValueError(f"--from {p}: not a folder (give a sink-lab run OUT/runs/baseline/seed0 or a sink-lab "
                             "OUT, a training run or its final/ folder, a compare OUT, or an HF checkpoint folder)")
        entries = resolve_models([p])
        if len(entries) > 1:
            keep = [e for e in entries if _ungated(Path(e.path))]
            if not keep:
                raise ValueError(f"--from {p}: none of its {len(entries)} models is ungated; the retrofit lab starts "
                                 "from an ungated model")
            if len(keep) < len(entries):
                log(f"--from {p}: {len(keep)} ungated model(s) of {len(entries)} ({', '.join(e.label for e in keep)})")
            entries = keep
        starts += [_start(e, data_dir, seq_len) for e in entries]
    kinds = {s.kind for s in starts}
    if len(kinds) > 1:
        raise ValueError("--from mixes sink-lab runs and text models; their measurements differ (sink task vs "
                         "text): run one lab per kind")
    if starts[0].kind == "sink" and len({str(sorted(s.task.items())) for s in starts}) > 1:
        raise ValueError("--from sink-lab runs of different tasks; run one lab per task")
    seen: dict[str, int] = {}
    for s in starts:
        n = seen.get(s.label, 0)
        seen[s.label] = n + 1
        if n:
            s.label = f"{s.label}-{n + 1}"
    return starts


# ---------------------------------------------------------------- models

def load_native(model_dir: str) -> tuple[dict, dict]:
    """(native config kwargs, native state dict) of an UNGATED checkpoint folder of any format retrofit reads."""
    from gated_attention.interop import config_to_native, load_dir, state_to_native
    from gated_attention.gates import canonical_name
    from gated_attention.interop.retrofit import detect_format

    config, state = load_dir(model_dir)
    fmt = detect_format(config)
    ncfg = config_to_native(config, fmt, state)
    if canonical_name(ncfg.get("gate", "none")) != "none":
        raise ValueError(f"{model_dir} already has gate {ncfg['gate']!r}; the retrofit lab starts from an UNGATED "
                         "model")
    return ncfg, state_to_native(state, ncfg, fmt)


def build_model(model_dir: str, gate: str | None, init: str, seed: int):
    """The starting model as fp32 GatedQwen3ForCausalLM, with `gate` added by `gattn retrofit`'s code (None: as is)."""
    from gated_attention.configuration import GatedQwen3Config
    from gated_attention.interop import config_to_native, load_dir
    from gated_attention.modeling import GatedQwen3ForCausalLM
    from gated_attention.interop.retrofit import retrofit_state

    if gate is None:
        ncfg, state = load_native(model_dir)
    else:
        config, state = load_dir(model_dir)
        out_config, state = retrofit_state(config, state, gate, init, seed)
        ncfg = config_to_native(out_config, "native")
    ncfg.pop("dtype", None)  # train in fp32 master weights whatever the file's dtype
    model = GatedQwen3ForCausalLM(GatedQwen3Config(**ncfg))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the model ({sorted(set(missing) - tied)[:3]} missing, "
                         f"{list(unexpected)[:3]} unexpected)")
    return model.float().train()


# ---------------------------------------------------------------- data

class SinkData:
    """The Bigram-Backcopy task of a sink-lab start: training batches and the sink lab's held-out set."""

    kind = "sink"

    def __init__(self, start: Start, batch_size: int, eval_size: int):
        from ..sinks.backcopy import BackcopyTask

        self.task = BackcopyTask(**start.task)
        self.batch_size = batch_size
        self.eval_seqs = self.task.eval_set(eval_size)  # (N, T+1): the sink lab's own held-out sequences

    def train_batch(self, seed: int, step: int) -> torch.Tensor:
        return self.task.train_batch(self.batch_size, DATA_SEED + seed, step)  # (B, T+1)

    def eval_batches(self) -> list[tuple[str, torch.Tensor]]:
        return [("backcopy", self.eval_seqs)]


class TextData:
    """A prepared corpus: training windows and fixed validation windows per domain (<|bos|> first, as in training)."""

    kind = "text"

    def __init__(self, start: Start, batch_size: int, eval_batches: int, vocab_size: int):
        from gated_attention.train.data_source import CorpusSource

        self.source = CorpusSource(start.data_dir, None)
        if self.source.vocab_size > vocab_size:
            raise ValueError(f"{start.data_dir} has a {self.source.vocab_size}-token vocabulary, more than the model's "
                             f"{vocab_size}: prepare data in the model's vocabulary (gattn data prepare --tokenizer "
                             f"{start.model_dir} --data-dir NEW) and pass --data-dir NEW")
        self.batch_size, self.seq_len = batch_size, start.seq_len
        self._eval = [(d, b) for d in self.source.domains
                      for b in self.source.eval_batches(d, self.seq_len, eval_batches, 8)]
        if not self._eval:
            raise ValueError(f"{start.data_dir}: no validation window of {self.seq_len} tokens; lower --seq-len")

    def train_batch(self, seed: int, step: int) -> torch.Tensor:
        return self.source.train_batch(self.batch_size, self.seq_len, DATA_SEED + seed, step)  # (B, T+1)

    def eval_batches(self) -> list[tuple[str, torch.Tensor]]:
        return self._eval


def make_data(start: Start, batch_size: int, eval_size: int, vocab_size: int):
    if start.kind == "sink":
        return SinkData(start, batch_size, eval_size)
    return TextData(start, batch_size, max(1, eval_size // 32), vocab_size)


# ---------------------------------------------------------------- measurement

def streaming_losses(model, seqs: torch.Tensor, window: int) -> dict:
    """The streaming measurement (`gattn lab streaming`'s measure_model, decode.stream_nll's rolling KV cache): loss
    with the first token evicted (K=0), with it kept (K=1) and with full attention, on the positions t >= window."""
    from ..streaming.streaming_lab import measure_model

    m = measure_model(model, seqs, window, [0, 1])
    return {"streaming_loss": m["window"]["0"]["loss"], "streaming_loss_kept": m["window"]["1"]["loss"],
            "window_full_loss": m["full"]["loss"]}


def start_masks(model, batches: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Text: per eval batch, (L, B, H, T) int8 over (layer, head, query): 1 where `model` puts >= SINK_QUERY of its
    attention on token 0 (it parks there: dormant), 0 where it does not (active), -1 for queries left out (those
    where even uniform attention, 1/(t+1), would reach SINK_QUERY: t < 3 for 0.3)."""
    from gated_attention.analysis.attention_sinks import key_probs_chunked
    from gated_attention.capture import Recorder, capture

    out = []
    model.eval()
    with torch.no_grad():
        for _, b in batches:
            rec = Recorder(names={"q", "k", "scale"})
            with capture(model, rec):
                model(input_ids=b[:, :-1])
            per = []
            for i in range(model.config.num_hidden_layers):
                p, _, _ = key_probs_chunked(rec.get(i, "q"), rec.get(i, "k"), rec.get(i, "scale"), keys=(0,))
                m = (p[..., 0] >= SINK_QUERY).to(torch.int8)  # (B, H, T)
                t = torch.arange(m.shape[-1])
                m[..., 1.0 / (t + 1) >= SINK_QUERY] = -1
                per.append(m)
            out.append(torch.stack(per))  # (L, B, H, T)
    return out


def _gate_split(gates: list, masks: list) -> tuple[float | None, float | None]:
    """Mean gate score over the dormant (mask 1) vs active (mask 0) (layer, head, query) triples."""
    sd = nd = sa = na = 0.0
    for g, m in zip(gates, masks):  # g (L, B, T, H) per batch, m (L, B, H, T)
        m = m.transpose(2, 3)  # (L, B, T, H)
        dor, act = m == 1, m == 0
        sd, nd = sd + float(g[dor].sum()), nd + int(dor.sum())
        sa, na = sa + float(g[act].sum()), na + int(act.sum())
    return (sd / nd if nd else None), (sa / na if na else None)


@torch.no_grad()
def measure(model, data, masks=None, window: int | None = None, full: bool = True) -> dict:
    """The lab's metrics of `model` on `data`'s held-out set (curve points use full=False: no analysis pass and no
    streaming)."""
    from gated_attention.analysis import AnalysisConfig, analyze_model
    from gated_attention.capture import Recorder, capture

    was_training = model.training
    model.eval()
    try:
        out: dict = {}
        if data.kind == "sink":
            from ..sinks import measure as sink_measure

            seqs = data.eval_seqs
            m = sink_measure(model, data.task, seqs)
            masks_ = data.task.masks(seqs[:, :-1])
            n_a, n_d = int(masks_["active"].sum()), int(masks_["dormant"].sum())
            out.update(sink=m["bos_attention_dormant"], backcopy_ce=m["backcopy_ce"], bigram_ce=m["bigram_ce"],
                       skill=(m["backcopy_ce"] * n_a + m["bigram_ce"] * n_d) / (n_a + n_d),
                       gate_dormant=m["gate_dormant"], gate_active=m["gate_active"],
                       residual_peak=m["residual_peak_ratio"], prev_attention_active=m["prev_attention_active"])
        else:
            losses: dict[str, list] = {}
            gates, has_gate = [], model.config.gate not in (None, "none")
            for domain, b in data.eval_batches():
                rec = Recorder(names={"gate"})
                with capture(model, rec):
                    logits = model(input_ids=b[:, :-1]).logits  # (b, T, V)
                ce = F.cross_entropy(logits.float().transpose(1, 2), b[:, 1:], reduction="none")  # (b, T)
                s = losses.setdefault(domain, [0.0, 0])
                s[0], s[1] = s[0] + float(ce.double().sum()), s[1] + ce.numel()
                if has_gate:
                    L = model.config.num_hidden_layers
                    g = [rec.get(i, "gate") for i in range(L)]
                    gates.append(torch.stack([x.float().mean(-1) if x.dim() == 4 else x.float() for x in g]))
            ppl = {d: math.exp(s / n) for d, (s, n) in losses.items()}
            out.update(ppl=ppl, skill=sum(ppl.values()) / len(ppl),
                       val_loss=sum(s for s, _ in losses.values()) / sum(n for _, n in losses.values()))
            gd, ga = _gate_split(gates, masks) if (has_gate and masks is not None) else (None, None)
            out.update(gate_dormant=gd, gate_active=ga)
        if full or data.kind == "text":
            a = analyze_model(model, [b[:, :-1] for _, b in data.eval_batches()],
                              AnalysisConfig(map_len=16, loss_by_position=False))
            out.update(f_attn=a["first_token_attention"], sink_rate=a["sink_rate"], m_act=a["max_abs_hidden"],
                       gate_mean=a["gate_mean"],
                       f_attn_per_layer=[e["first_token_attention"] for e in a["layers"]])
            if data.kind == "text":
                out["sink"] = out["f_attn"]
        if full and window:
            seqs = torch.cat([b for _, b in data.eval_batches()]) if data.kind == "text" else data.eval_seqs
            out.update(streaming_losses(model, seqs, window))
        return out
    finally:
        model.train(was_training)
