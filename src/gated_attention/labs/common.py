"""Plumbing every lab shares: per-seed aggregation, cached resumable unit results, parallel jobs, report pages.

A lab is a grid of *units* (one trained model each: a variant x seed, or a variant x LR x seed). Each unit writes its
result JSON atomically into its own folder together with the settings that produced it (`key`); a re-run reuses a
unit whose key matches, and refuses to mix settings silently when it does not (the folder must be removed or a new
--out chosen). Units that checkpoint themselves continue where a killed run stopped.

`run_units` (experiment.run_units, re-exported) runs units in-process (`jobs=1`) or in a pool of `jobs` worker
processes, each limited to one torch thread (the labs' models are tiny: one core per model is faster than sharing
threads between models).
"""
from __future__ import annotations

import base64
import html
import json
import math
import statistics
from pathlib import Path
from typing import Callable, Iterable

# run_units / default_jobs are experiment plumbing (longctx uses them too); re-exported for the labs
from gated_attention.experiment import default_jobs, run_units  # noqa: F401
from gated_attention.util.io import atomic_write_json, atomic_write_text


# ---------------------------------------------------------------- aggregation over seeds

def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def mean_std(per_seed: list[dict], keys: Iterable[str]) -> tuple[dict, dict]:
    """Mean and sample standard deviation (n-1) of each scalar key over seeds, skipping seeds where it is null.

    A key that no seed measured is null in both; the std of a single value is null (one seed says nothing about the
    spread). Returned as two dicts keyed like `keys`, the `mean` / `std` objects of a lab.json variant."""
    mean, std = {}, {}
    for k in keys:
        vals = [float(r[k]) for r in per_seed if _finite(r.get(k))]
        mean[k] = statistics.fmean(vals) if vals else None
        std[k] = statistics.stdev(vals) if len(vals) > 1 else None
    return mean, std


def fmt_mean_std(mean: float | None, std: float | None, digits: int = 3) -> str:
    """'0.931 ± 0.012', '0.931' (one seed) or '–' (not measured)."""
    if mean is None:
        return "–"
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


# ---------------------------------------------------------------- cached units

def load_unit(path: Path, key: dict) -> dict | None:
    """The cached result at `path` if it was produced with `key`; None if absent. A different key fails loudly."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a half-written file cannot exist (atomic writes), but a hand-edited one can: redo the unit
    if old.get("key") != key:
        diff = sorted(k for k in set(key) | set(old.get("key") or {}) if (old.get("key") or {}).get(k) != key.get(k))
        raise ValueError(f"{path.parent} holds a result made with different settings ({', '.join(diff) or 'format'}); "
                         f"use a new --out or delete that folder")
    return old


def save_unit(path: Path, key: dict, result: dict) -> dict:
    out = {"key": key, **result}
    atomic_write_json(path, out)
    return out


# ---------------------------------------------------------------- report pages

def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


CSS = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
       "th,td{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}"
       "td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #ddd}"
       "code{background:#f4f4f4;padding:0 3px}")


def render_report(title: str, blocks: list[tuple], out_dir: Path) -> tuple[str, str]:
    """(markdown, self-contained html) of a report made of blocks:
    ("h2", text) | ("p", text) | ("table", head, rows) | ("img", caption, path relative to out_dir) | ("code", text).
    Images are linked in the markdown and inlined as base64 data URIs in the html (one file to mail or archive)."""
    out_dir = Path(out_dir)
    md, body = [f"# {title}", ""], [f"<h1>{html.escape(title)}</h1>"]
    for b in blocks:
        kind = b[0]
        if kind == "h2":
            md += [f"## {b[1]}", ""]
            body.append(f"<h2>{html.escape(b[1])}</h2>")
        elif kind == "p":
            md += [b[1], ""]
            body.append(f"<p>{html.escape(b[1])}</p>")
        elif kind == "code":
            md += ["```", b[1], "```", ""]
            body.append(f"<pre><code>{html.escape(b[1])}</code></pre>")
        elif kind == "table":
            md += [md_table(b[1], b[2]), ""]
            body.append(html_table(b[1], b[2]))
        elif kind == "img":
            rel = str(b[2])
            md += [f"### {b[1]}", "", f"![{b[1]}]({rel})", ""]
            data = base64.b64encode((out_dir / rel).read_bytes()).decode("ascii")
            body += [f"<h3>{html.escape(b[1])}</h3>", f'<img alt="{html.escape(b[1])}" src="data:image/png;base64,{data}">']
        else:
            raise ValueError(f"unknown report block {kind!r}")
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")
    return "\n".join(md), page


def write_report(out_dir: Path, title: str, blocks: list[tuple]) -> None:
    """report.md and report.html into out_dir, atomically."""
    md, page = render_report(title, blocks, out_dir)
    atomic_write_text(Path(out_dir) / "report.md", md)
    atomic_write_text(Path(out_dir) / "report.html", page)
