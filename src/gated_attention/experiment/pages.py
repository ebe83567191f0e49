"""The one report renderer of every job (compare, longctx, each lab): a report is a title and a list of blocks,
written as report.md and a self-contained report.html (one CSS, PNGs inlined as base64 data URIs: one file to mail or
archive), plus the number formats and aligned text tables the commands print.

Blocks:
  ("h2", text) | ("h3", text)        headings
  ("p", text)                        a paragraph
  ("lead", text)                     the paragraph a report opens with (what it found), set a little larger
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

from ..util.io import atomic_write_text, save_png

# text reads from the left, figures line up on the right (a cell is a figure when it is made of numbers: NUMERIC)
CSS = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
       "th,td{border:1px solid #bbb;padding:3px 8px;text-align:left;vertical-align:top}th{background:#eee}"
       ".num{text-align:right}img{max-width:100%;border:1px solid #ddd}"
       "code{background:#f4f4f4;padding:0 3px}.lead{font-size:15px;line-height:1.45}")
# a number, a missing value or a figure with its interval / per-seed list / unit sign: no words in it
NUMERIC = re.compile(r"^\s*([–—-]|[+\-−]?[\d.,]+(e[+\-]?\d+)?([^A-Za-z]|e[+\-]?\d)*)\s*$")


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
    esc = lambda cells: " | ".join(str(c).replace("|", "\\|") for c in cells)  # noqa: E731  (a '|' in a cell)
    out = ["| " + esc(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + esc(r) + " |" for r in rows]
    return "\n".join(out)


def numeric_columns(rows: list[list[str]]) -> list[bool]:
    """Which columns hold figures only (right-aligned in html); text columns read from the left."""
    n = max((len(r) for r in rows), default=0)
    return [bool(rows) and all(NUMERIC.match(r[i]) for r in rows if i < len(r)) for i in range(n)]


def html_table(head: list[str], rows: list[list[str]]) -> str:
    num = numeric_columns(rows)
    cls = lambda i: ' class="num"' if i < len(num) and num[i] else ""  # noqa: E731
    th = "".join(f"<th{cls(i)}>{_inline(h)}</th>" for i, h in enumerate(head))
    trs = "".join("<tr>" + "".join(f"<td{cls(i)}>{_inline(c)}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows)
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
        elif kind in ("p", "lead"):
            md += [b[1], ""]
            cls = ' class="lead"' if kind == "lead" else ""
            body.append(f"<p{cls}>{_inline(b[1])}</p>")
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
            raise ValueError(f"unknown report block {kind!r}; valid: h2, h3, p, lead, ul, code, table, img")
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


def write_lab(out_dir: str | Path, title: str, blocks: list[tuple], plots: dict[str, str],
              caption: str | dict[str, str], footer: str) -> tuple[Path, Path]:
    """A lab's report (write): its blocks, its plots as figures (figures()), then a footer paragraph."""
    return write(out_dir, title, [*blocks, *figures(plots, caption), ("p", footer)])


# ---------------------------------------------------------------- figures

def subplots(*args, **kwargs):
    """matplotlib.pyplot.subplots on the headless Agg backend: (figure, axes) for a report's plot; write it with
    io.save_png (atomic, closes the figure). Constrained layout by default: every panel's titles, labels and ticks get
    their own room instead of running into the neighbouring panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kwargs.setdefault("layout", "constrained")
    return plt.subplots(*args, **kwargs)


def finish(fig, ax, path, legend: int = 8, **props) -> Path:
    """A one-panel plot's last steps: its axes' properties (ax.set, in order: scales, labels, title), its legend at
    `legend` points, and the PNG (io.save_png: atomic, closes the figure)."""
    ax.set(**props)
    ax.legend(fontsize=legend)
    return save_png(fig, path)


def integer_ticks(ax, axis: str = "x") -> None:
    """Whole-number ticks on an axis of counts (layers, seeds): no 'layer 0.4' on a 2-layer model."""
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def _axes_texts(ax) -> list:
    """The texts an axes draws: its titles, axis labels, the tick labels inside its view, legend and annotations."""
    out = [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
    for axis in (ax.xaxis, ax.yaxis):
        out += [lab for tick in axis._update_ticks() for lab in (tick.label1, tick.label2) if lab.get_visible()]
    leg = ax.get_legend()
    if leg is not None:
        out += [*leg.get_texts(), leg.get_title()]
    return out


def text_overlaps(fig) -> list[str]:
    """Every pair of a figure's drawn texts (titles, axis and tick labels, legends, annotations, the figure's title)
    whose boxes overlap, and every text drawn over another panel's plotting area, as 'a / b' lines; [] for a clean
    layout. The boxes are the renderer's own after layout: what is listed is what a reader sees collide."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    drawn = lambda t: t.get_visible() and t.get_text().strip()  # noqa: E731
    owned = [(ax, t, t.get_window_extent(r)) for ax in fig.axes if ax.get_visible() for t in _axes_texts(ax)
             if drawn(t)]
    figure_texts = {id(t): t for t in [fig._suptitle, *fig.texts] if t is not None}  # suptitle is in texts too
    owned += [(None, t, t.get_window_extent(r)) for t in figure_texts.values() if drawn(t)]
    out = []
    for i, (_, a, ba) in enumerate(owned):
        out += [f"{a.get_text()!r} / {b.get_text()!r}" for _, b, bb in owned[i + 1:] if ba.overlaps(bb)]
    for own, t, bb in owned:
        for ax in fig.axes:
            area = ax.get_window_extent(r)
            twin = own is not None and tuple(area.bounds) == tuple(own.get_window_extent(r).bounds)
            if ax is not own and not twin and ax.get_visible() and ax.axison and bb.overlaps(area):
                out.append(f"{t.get_text()!r} / the plotting area of {ax.get_title() or ax.get_label()!r}")
    return out
