"""Render a report.html (any job's: `gattn compare`, a lab, `gattn longctx`) in headless Chromium at a desktop width
and check what a reader sees: no horizontal overflow, every figure loaded and inside the page, the text of each table
read from the left and its figures on the right, and (for `gattn compare`'s report) the findings, the setup and the
start of the claims table on the first screen. Writes two PNGs: the first screen and the whole page.

    python scripts/check_report_render.py runs/compare/report.html [--out DIR] [--width 1400] [--screen 900]

Needs Debian's chromium (`apt-get install chromium`, or GATTN_BROWSER=1 scripts/install_debian_deps.sh). Exit 0
when every check passes, 1 with one line per failure, 2 when there is no browser or no such file.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# measures the page after layout and writes the figures into the DOM, which --dump-dom prints
PROBE = """<script>
window.addEventListener('load', () => {
  const rect = e => e.getBoundingClientRect();
  const doc = document.documentElement, body = document.body;
  const imgs = [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0,
    right: rect(i).right, left: rect(i).left}));
  const tables = [...document.querySelectorAll('table')].map(t => {
    const cells = [...t.querySelectorAll('tbody td')];
    return {right: rect(t).right, num: cells.filter(c => c.classList.contains('num'))
                                            .map(c => getComputedStyle(c).textAlign),
            text: cells.filter(c => !c.classList.contains('num')).map(c => getComputedStyle(c).textAlign)};
  });
  const leads = [...document.querySelectorAll('p.lead')].map(p => rect(p).bottom);
  const h2 = [...document.querySelectorAll('h2')].map(h => ({text: h.textContent, top: rect(h).top}));
  const out = {scroll_width: doc.scrollWidth, client_width: doc.clientWidth, height: doc.scrollHeight,
               content_right: rect(body).right, imgs, tables, leads, h2};
  const pre = document.createElement('pre');
  pre.id = 'render-check';
  pre.textContent = JSON.stringify(out);
  body.appendChild(pre);
});
</script>"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(browser: str, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=timeout)


def measure(browser: str, html: Path, width: int, screen: int) -> dict:
    """The probe's figures of the page laid out at width x screen pixels."""
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.html"
        page.write_text(html.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
        out = _run(browser, [f"--window-size={width},{screen}", "--virtual-time-budget=5000", "--dump-dom",
                             page.as_uri()])
    text = out.stdout
    start = text.find('<pre id="render-check">')
    if start < 0:
        raise RuntimeError(f"the browser printed no measurements (rc {out.returncode}): {out.stderr[-300:]}")
    import html as h

    return json.loads(h.unescape(text[start + len('<pre id="render-check">'):text.index("</pre>", start)]))


def problems(m: dict, width: int, screen: int) -> list[str]:
    """Every check the measurements fail, one line each."""
    out = []
    if m["scroll_width"] > m["client_width"]:
        out.append(f"the page scrolls sideways: {m['scroll_width']} px wide in a {m['client_width']} px window")
    for i in m["imgs"]:
        if not i["ok"]:
            out.append(f"figure {i['alt']!r} did not load")
        if i["right"] > m["content_right"] + 1:
            out.append(f"figure {i['alt']!r} runs past the page ({i['right']:.0f} > {m['content_right']:.0f} px)")
    for k, t in enumerate(m["tables"]):
        if t["right"] > width:
            out.append(f"table {k + 1} runs past the window ({t['right']:.0f} > {width} px)")
        if any(a != "right" for a in t["num"]):
            out.append(f"table {k + 1}: a figure column is not right-aligned")
        if any(a not in ("left", "start") for a in t["text"]):
            out.append(f"table {k + 1}: a text column is not left-aligned")
    claims = next((x for x in m["h2"] if x["text"] == "Paper claims vs this run"), None)
    if claims is not None:  # gattn compare's report: it leads with what was found
        if len(m["leads"]) < 2 or max(m["leads"]) > screen:
            out.append(f"the findings and the setup do not fit the first {screen} px (they end at "
                       f"{max(m['leads'], default=0):.0f} px)")
        if claims["top"] > screen:
            out.append(f"the claims table starts below the first screen ({claims['top']:.0f} > {screen} px)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="folder of the PNGs (default: beside the report)")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--screen", type=int, default=900, help="the first screen's height in px")
    a = ap.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("check_report_render: no chromium on PATH; install Debian's (apt-get install chromium)", file=sys.stderr)
        return 2
    if not a.html.is_file():
        print(f"check_report_render: no file {a.html}", file=sys.stderr)
        return 2
    m = measure(browser, a.html.resolve(), a.width, a.screen)
    out = a.out or a.html.parent
    out.mkdir(parents=True, exist_ok=True)
    shots = {"render_first_screen.png": a.screen, "render_page.png": min(m["height"], 16000)}
    for name, height in shots.items():
        _run(browser, [f"--window-size={a.width},{height}", f"--screenshot={out / name}", a.html.resolve().as_uri()])
    bad = problems(m, a.width, a.screen)
    for line in bad:
        print(f"check_report_render: {line}")
    print(f"check_report_render: {a.html} at {a.width} px: {len(m['imgs'])} figures, {len(m['tables'])} tables, "
          f"{m['height']} px tall; {'ok' if not bad else f'{len(bad)} problem(s)'}; PNGs in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
