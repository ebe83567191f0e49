"""The one report renderer of every job (compare, longctx, each lab): a report is a title and a list of blocks,
written as report.md and a self-contained report.html (one CSS, PNGs inlined as base64 data URIs: one file to mail or
archive), plus the number formats and aligned text tables the commands print.

Blocks:
  ("h2", text) | ("h3", text)        headings
  ("p", text)                        a paragraph
  ("ul", [text, ...])                a bullet list
  ("code", text)                     a preformatted block
  ("table", head, rows)              a table of strings (head: [str], rows: [[str]])
  ("img", caption, path)             a figure: path relative to the report's folder (linked in the markdown,
                                     embedded in the html)
Text may use `code` and **bold**; the markdown keeps them, the html renders them (everything else is escaped).

    blocks = [("p", f"Budget `{name}`"), ("table", head, rows), ("img", "Loss", "plots/loss.png")]
    report.write(out, "gattn lab x: what it shows", blocks)
"""
from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path

from ..util.io import atomic_write_text

CSS = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
       "th,td{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}"
       "td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #ddd}"
       "code{background:#f4f4f4;padding:0 3px}")


# ---------------------------------------------------------------- numbers

def fmt(v, digits: int | None = 3) -> str:
    """A table cell: '–' for a missing value, thousands separators for counts, `digits` decimals for floats."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) and digits in (None, 0):
        return f"{v:,}"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}f}" if digits is not None else str(v)


def fmt_mean_std(mean: float | None, std: float | None, digits: int = 3) -> str:
    """'0.931 ± 0.012', '0.931' (one seed: no spread, stats.mean_std's None) or '–' (not measured)."""
    if mean is None:
        return "–"
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


# ---------------------------------------------------------------- tables

def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{_inline(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def text_table(head: list[str], rows: list[list[str]]) -> str:
    """Aligned plain text (what a command prints): first column left, the others right."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), "-" * len(line(head))] + [line(r) for r in rows])


# ---------------------------------------------------------------- pages

def _inline(text: str) -> str:
    """Escaped html with `code` and **bold** rendered."""
    out = html.escape(str(text), quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)


def render(title: str, blocks: list[tuple], out_dir: str | Path) -> tuple[str, str]:
    """(markdown, self-contained html) of a report (the block kinds are in the module docstring)."""
    out_dir = Path(out_dir)
    md, body = [f"# {title}", ""], [f"<h1>{_inline(title)}</h1>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h2", "h3"):
            md += [f"{'#' * int(kind[1])} {b[1]}", ""]
            body.append(f"<{kind}>{_inline(b[1])}</{kind}>")
        elif kind == "p":
            md += [b[1], ""]
            body.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "ul":
            md += [f"- {x}" for x in b[1]] + [""]
            body.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "code":
            md += ["```", b[1], "```", ""]
            body.append(f"<pre><code>{html.escape(b[1])}</code></pre>")
        elif kind == "table":
            md += [md_table(b[1], b[2]), ""]
            body.append(html_table(b[1], b[2]))
        elif kind == "img":
            rel = Path(b[2]).as_posix()
            md += [f"### {b[1]}", "", f"![{b[1]}]({rel})", ""]
            data = base64.b64encode((out_dir / rel).read_bytes()).decode("ascii")
            body += [f"<h3>{_inline(b[1])}</h3>",
                     f'<img alt="{html.escape(b[1])}" src="data:image/png;base64,{data}">']
        else:
            raise ValueError(f"unknown report block {kind!r}; valid: h2, h3, p, ul, code, table, img")
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>" + "\n".join(body)
            + "</body></html>\n")
    return "\n".join(md).rstrip("\n") + "\n", page


def figures(plots: dict[str, str], caption: str | dict[str, str]) -> list[tuple]:
    """The "img" blocks of a job's plots ({key: path relative to the report's folder}, in order); caption: one for
    every plot, or one per key (a key the dict lacks is its own caption)."""
    return [("img", caption if isinstance(caption, str) else caption.get(key, key), rel) for key, rel in plots.items()]


def write(out_dir: str | Path, title: str, blocks: list[tuple]) -> tuple[Path, Path]:
    """report.md and report.html into out_dir, atomically; returns their paths."""
    md, page = render(title, blocks, out_dir)
    paths = Path(out_dir) / "report.md", Path(out_dir) / "report.html"
    atomic_write_text(paths[0], md)
    atomic_write_text(paths[1], page)
    return paths


# ---------------------------------------------------------------- figures

def subplots(*args, **kwargs):
    """matplotlib.pyplot.subplots on the headless Agg backend: (figure, axes) for a report's plot; write it with
    io.save_png (atomic, closes the figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)

