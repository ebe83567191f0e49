"""`gattn lab streaming`: does a model stream with a plain sliding KV window, or does it need sink tokens?

StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): a model that parks attention on its first token breaks when a
sliding window evicts that token, and keeping the first few tokens forever ("sink tokens") repairs it. A sink-free
model should not care. For each model this lab measures the next-token loss on held-out sequences three ways on
the same positions: full attention, and decoding through decode.py's rolling cache (`SinkWindowCache`: the first K
tokens + the last W, StreamingLLM cache positions) for each K in --sink-tokens (K = 0 = a plain window, the first
token evicted). Scored positions: query positions t >= W (predicting token t + 1), where a plain window has evicted
the first token; every setting is scored on the same positions.

Models (--models DIR ...): a sink-lab unit folder `OUT/runs/<variant>/seed<k>` (label `<variant>/seed<k>`; data: its
Bigram-Backcopy task's held-out sequences, with backcopy and bigram CE next to the loss), a whole sink-lab OUT (every
unit), a `gattn compare` OUT (every `runs/<variant>/final`, label `<variant>`; data: the corpus the run trained on),
a trainer run folder (its `final/`) or any model folder with config.json (corpus from --data-dir, or --text FILE).
A label that would repeat gets its parent folder's name in front.

Output: OUT/lab.json (`models.NAME.full.{loss, ppl}`, `models.NAME.window.{K}.{loss, ppl}` + per-position loss
curves and the task CEs; `verdicts.{sink_lab, text}`: verdict.py's rule on each kind of model, where a baseline and a
G1 model are both measured), report.md, report.html, plots/per_position_loss.png.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...experiment import cache
from ...experiment.runs import unique_labels
from ...experiment.study import begin, save_lab
from ...util.io import locks_output

DEFAULT_SINK_TOKENS = (0, 1, 4)


@dataclass
class StreamingConfig:
    """Settings of one `gattn lab streaming` run (one per CLI option)."""

    models: list  # model folders as given (DIR: sink-lab unit / sink-lab OUT / compare OUT / run / HF folder)
    window: int  # W: recent tokens kept by the rolling cache (the current one included)
    sink_tokens: list = field(default_factory=lambda: list(DEFAULT_SINK_TOKENS))  # K values; 0 = a plain window
    seq_len: int | None = None  # tokens per held-out sequence; default: the length the model was trained on
    sequences: int = 32  # held-out sequences per model
    text: str | None = None  # a UTF-8 text file to score instead of the task / corpus data (text models only)
    data_dir: str | None = None  # corpus of a model folder that does not name its own (train_config.json)

    def validate(self) -> "StreamingConfig":
        if not self.models:
            raise ValueError("--models needs at least one folder")
        if self.window < 1:
            raise ValueError(f"--window must be >= 1; got {self.window}")
        if not self.sink_tokens or any(k < 0 for k in self.sink_tokens) or len(set(self.sink_tokens)) != len(
                self.sink_tokens):
            raise ValueError(f"--sink-tokens must be distinct values >= 0; got {self.sink_tokens}")
        if self.sequences < 1:
            raise ValueError(f"--sequences must be >= 1; got {self.sequences}")
        if self.seq_len is not None and self.seq_len <= self.window + 1:
            raise ValueError(f"--seq-len {self.seq_len} leaves no position past the window {self.window}; use a "
                             f"longer sequence or a smaller --window")
        return self


@dataclass
class Entry:
    """One model to measure: where it is, what to call it, and where its held-out data comes from."""

    label: str
    path: Path  # the folder from_pretrained reads
    kind: str  # "sink_lab" | "text"
    variant: str
    data_dir: str | None = None  # text: the corpus it trained on
    train_len: int | None = None  # the sequence length it was trained on (the default --seq-len)


def _text_entry(model_dir: Path, label: str) -> Entry:
    """A trainer run's final/ (or any HF folder, checked: config.json, intact weights): its corpus and length from
    the run's train_config.json."""
    from gated_attention.util.io import check_hf_dir, read_json_object

    check_hf_dir(model_dir, "--models folder")  # before the lab starts: a broken folder is its one error line
    tc = next((p for p in (model_dir / "train_config.json", model_dir.parent / "train_config.json") if p.is_file()),
              None)
    conf = read_json_object(tc, "train config") if tc else {}
    variant = conf.get("gate") or label
    return Entry(label=label, path=model_dir, kind="text", variant=variant, data_dir=conf.get("data_dir"),
                 train_len=conf.get("seq_len"))


def resolve_models(paths: list) -> list[Entry]:
    """Every model the given folders hold, with unique labels (module docstring)."""
    from ..sinks import stored as sink_lab

    entries = []
    for raw in paths:
        p = Path(raw)
        if not p.is_dir():
            raise ValueError(f"--models: {p} is not a folder")
        if sink_lab.is_run_dir(p):
            units = [p]
        else:
            units = sorted(u for u in p.glob("runs/*/seed*") if sink_lab.is_run_dir(u))
        if units:
            for u in units:
                run = sink_lab.load_run_meta(u)
                entries.append(Entry(label=f"{run['variant']}/seed{run['seed']}", path=u, kind="sink_lab",
                                     variant=run["variant"], train_len=run["task"]["seq_len"]))
            continue
        finals = sorted(d for d in p.glob("runs/*/final") if (d / "config.json").is_file())
        if finals:  # a compare OUT
            entries += [_text_entry(d, d.parent.name) for d in finals]
        elif (p / "final" / "config.json").is_file():  # a trainer run folder
            entries.append(_text_entry(p / "final", p.name))
        elif (p / "config.json").is_file():
            entries.append(_text_entry(p, p.parent.name if p.name == "final" else p.name))
        else:
            raise ValueError(f"--models: {p} holds no model (expected a sink-lab run OUT/runs/<variant>/seed<k>, a "
                             f"sink-lab or compare output, a trainer run with final/, or a folder with config.json)")
    unique_labels(entries, lambda e: e.path.parent.parent.parent.name if e.kind == "sink_lab" else e.path.parent.name)
    return entries


# ---------------------------------------------------------------- data

def sink_lab_data(task, n: int, seq_len: int):
    """Held-out Bigram-Backcopy sequences (n, seq_len + 1) of the model's task at length seq_len."""
    from dataclasses import replace

    return replace(task, seq_len=seq_len).eval_set(n)


def corpus_data(data_dir: str, n: int, seq_len: int):
    """n held-out windows (n, seq_len + 1), <|bos|> first, taken round-robin over the corpus domains' val splits."""
    import torch

    from gated_attention import data

    corpus = data.Corpus(data_dir)
    per = {d: [row for b in data.eval_batches(corpus, d, seq_len, None, 8) for row in b] for d in corpus.domains}
    rows, i = [], 0
    while len(rows) < n and any(i < len(v) for v in per.values()):
        rows += [v[i] for v in per.values() if i < len(v)]
        i += 1
    if not rows:
        raise ValueError(f"no validation window of {seq_len} tokens in {data_dir}; lower --seq-len")
    return torch.stack(rows[:n])


def text_data(path: str, tokenizer, n: int, seq_len: int):
    """Windows (<= n, seq_len + 1) of a text file: the tokenizer's BOS (if any) then seq_len tokens each."""
    import torch

    ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    body = seq_len if bos is not None else seq_len + 1
    rows = [ids[s:s + body] for s in range(0, len(ids) - body + 1, body)][:n]
    if not rows:
        raise ValueError(f"--text {path}: {len(ids)} tokens, fewer than one window of {body}; lower --seq-len")
    t = torch.tensor(rows, dtype=torch.long)
    return torch.cat([torch.full((len(rows), 1), bos), t], 1) if bos is not None else t


# ---------------------------------------------------------------- measurement

def _summary(nll, first: int, masks: dict | None) -> dict:
    """loss/ppl over query positions >= first, per-position curve, and the task CEs when masks are given."""
    scored = nll[:, first:]  # (B, T - first)
    loss = float(scored.mean())
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)),
           "per_position": [round(float(x), 5) for x in nll.mean(0)]}
    for name, m in (masks or {}).items():
        sel = m[:, first:]
        out[name] = float(scored[sel].mean()) if bool(sel.any()) else None
    return out


def measure_model(model, seqs, window: int, sink_tokens: list[int], masks: dict | None = None) -> dict:
    """{"full": {...}, "window": {str(K): {...}}} for held-out seqs (B, T+1); positions >= window are scored."""
    from gated_attention.decode import stream_nll

    res = {"full": _summary(stream_nll(model, seqs, None), window, masks), "window": {}}
    for k in sink_tokens:
        res["window"][str(k)] = _summary(stream_nll(model, seqs, window, k), window, masks)
    return res


def _load(entry: Entry, cfg: StreamingConfig):
    """(model, held-out seqs (B, T+1), masks or None, seq_len) of one entry."""
    if entry.kind == "sink_lab":
        from ..sinks import stored as sink_lab

        if cfg.text:
            raise ValueError(f"--text applies to text models; {entry.path} is a Bigram-Backcopy model")
        run = sink_lab.load_run(entry.path)
        seq_len = cfg.seq_len or run.task.seq_len
        seqs = sink_lab_data(run.task, cfg.sequences, seq_len)
        m = run.task.masks(seqs[:, :-1])
        return run.model, seqs, {"backcopy_ce": m["active"], "bigram_ce": m["dormant"]}, seq_len
    from gated_attention.analysis import load_model

    model, kind = load_model(entry.path)
    if kind != "causal":
        raise ValueError(f"{entry.path} is not a causal LM")
    seq_len = cfg.seq_len or entry.train_len or model.config.max_position_embeddings
    data_dir = cfg.data_dir or entry.data_dir
    if cfg.text:
        from gated_attention.analysis.analyze import load_tokenizer

        seqs = text_data(cfg.text, load_tokenizer(entry.path, data_dir), cfg.sequences, seq_len)
    else:
        seqs = corpus_data(data_dir, cfg.sequences, seq_len)
    return model, seqs, None, seq_len


def _check_data(entry: Entry, cfg: StreamingConfig) -> None:
    """Before anything is measured: a text model's corpus (or tokenizer, with --text) is named and in its vocabulary
    (else one line naming both sizes)."""
    if entry.kind != "text":
        return
    from gated_attention.data.tokenizer import check_vocab_fits
    from gated_attention.util.io import read_json_object

    rows = read_json_object(entry.path / "config.json", "model config").get("vocab_size")
    data_dir = cfg.data_dir or entry.data_dir
    if cfg.text:
        from gated_attention.analysis.analyze import load_tokenizer

        tok = load_tokenizer(entry.path, data_dir)
        if rows:
            check_vocab_fits(len(tok), int(rows), f"the tokenizer of {tok.name_or_path}", str(entry.path))
        return
    if not data_dir:
        raise ValueError(f"{entry.path}: no train_config.json names its corpus; pass --data-dir or --text")
    if rows:
        from gated_attention.data import Corpus

        check_vocab_fits(Corpus(data_dir).vocab_size, int(rows), f"the corpus {data_dir}", str(entry.path))


def _measure_key(e: Entry, cfg: StreamingConfig) -> dict:
    """What one model's measurement depends on (experiment.cache): the window settings and the held-out data; its
    inputs are the model (its folder and its weights' modification time: a model copied or trained again since is
    measured again)."""
    from gated_attention.util.io import hf_weight_files

    return {"model": str(e.path), "kind": e.kind, "window": cfg.window, "sink_tokens": list(cfg.sink_tokens),
            "seq_len": cfg.seq_len, "sequences": cfg.sequences, "text": cfg.text,
            "data_dir": cfg.data_dir or e.data_dir,
            "model_mtime": max(f.stat().st_mtime for f in hf_weight_files(e.path))}


@locks_output("out", "gattn lab streaming")
def run_streaming(cfg: StreamingConfig, out: str | Path, log=print) -> dict:
    """Measure every model, write lab.json, report.md, report.html and the per-position plot into out."""
    import torch

    from . import streaming_report
    from .verdict import lab_verdicts

    out, clock = begin(cfg, out)
    entries = resolve_models(cfg.models)
    for e in entries:
        _check_data(e, cfg)
    log(f"[streaming] {len(entries)} model(s), window {cfg.window}, sink tokens {cfg.sink_tokens} -> {out}")
    models = {}
    for e in entries:
        def measure(e=e) -> dict:
            ts = time.process_time()
            model, seqs, masks, seq_len = _load(e, cfg)
            if seq_len <= cfg.window + 1:
                raise ValueError(f"{e.label}: sequences of {seq_len} tokens leave no position past the window "
                                 f"{cfg.window}; pass a longer --seq-len or a smaller --window")
            with torch.no_grad():
                res = measure_model(model, seqs, cfg.window, list(cfg.sink_tokens), masks)
            return {"path": str(e.path), "kind": e.kind, "variant": e.variant, "seq_len": seq_len,
                    "sequences": int(seqs.shape[0]), **res, "cpu_time_s": time.process_time() - ts}

        # one model's measurement, reused under the toolkit's rule (the settings it depends on, and the model file
        # as its input: a model trained again since is measured again)
        got = cache.cached(out / "models" / (e.label.replace("/", "__") + ".json"), _measure_key(e, cfg), measure,
                           log, "[streaming]", inputs=("model", "model_mtime"))
        models[e.label] = {k: v for k, v in got.items() if k != "key"}
        res = models[e.label]
        w = res["window"]
        log(f"[streaming] {e.label}: full loss {res['full']['loss']:.3f}; window " + ", ".join(
            f"K={k} {w[k]['loss']:.3f}" for k in w))
    lab = {"config": {**asdict(cfg), "models": [str(m) for m in cfg.models]},
           "scored_positions": f"query positions t >= {cfg.window} (targets t + 1), the same for every setting",
           "models": models, "by_variant": streaming_report.by_variant(models), "verdicts": lab_verdicts(models),
           **clock.times()}
    return save_lab(out, lab, lambda d: streaming_report.make_plots(d, lab), lambda: streaming_report.write(out, lab))
