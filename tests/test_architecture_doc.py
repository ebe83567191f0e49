"""ARCHITECTURE.md matches the tree: every file path, module, function and class it cites in backticks exists.

- a path (`train/config.py`, `tests/probes/kill_hooks.py`, `labs/`): a file or folder of the repository or of
  src/gated_attention/; in the layer table a bare file name (`config.py` in the train row) must be in that row's
  folders;
- a dotted name (`presets.model_config`, `train.resume_rule.changed_settings`, `cli/__init__.main`): a module of the
  package (by its path from gated_attention/, or a unique tail of it) and the attributes after it;
- a bare identifier (`UserError`, `save_png`, `o_proj`): a word of the source (src/ or tests/);
- a dotted name that no module starts (`Plugins.source`): each part a word of the source.
Command lines, values and shapes (anything with a space, `=`, quotes, or not a Python name), run outputs
(`report.html`, `models/NAME.json`) and templates (`<name>_lab.py`) are not names of the tree."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "gated_attention"
DOC = REPO / "ARCHITECTURE.md"
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def _modules() -> dict[str, str]:
    """'train.config' -> 'gated_attention.train.config' for every module (and package) of the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ".".join(("gated_attention",) + parts)
    return out


MODULES = _modules()


def _module_for(dotted: str) -> tuple[str | None, list[str]]:
    """The module a dotted name starts with (longest match, by full path or by a unique tail) and the rest."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in MODULES:
            return MODULES[head], parts[n:]
        tails = [full for key, full in MODULES.items() if key == head or key.endswith("." + head)]
        if len(tails) == 1:
            return tails[0], parts[n:]
    return None, parts


def _defined() -> set[str]:
    """Every word of the source (src/ and tests/)."""
    names = set()
    for root in (REPO / "src", REPO / "tests"):
        for p in root.rglob("*.py"):
            names |= set(re.findall(IDENT, p.read_text(encoding="utf-8")))
    return names


def _path_exists(token: str, row_dirs: list[Path] | None) -> bool:
    """A path from the repository or the package; a bare file name in the layer table: in the row's folders (at any
    depth); elsewhere: anywhere in the repository's src/, tests/, scripts/, bench/, docs/ or results/."""
    token = token.rstrip("/")
    if any((base / token).exists() for base in (REPO, PKG)):
        return True
    if "/" in token:
        return False
    trees = ("src", "tests", "scripts", "bench", "docs", "results")
    roots = row_dirs if row_dirs is not None else [REPO / d for d in trees]
    return any(next(d.rglob(token), None) is not None for d in roots if d.is_dir())


def _check(token: str, row_dirs: list[Path] | None, defined: set[str]) -> str | None:
    """Why `token` names nothing in the tree (None when it exists or is not a name)."""
    token = re.sub(r"\(.*\)$", "", token.strip())  # `run_lab(...)`, `decide()`
    if token.startswith("@"):
        token = token[1:]
    if "::" in token:  # tests/FILE.py::test_name
        path, _, name = token.partition("::")
        f = REPO / path
        ok = f.exists() and re.search(rf"^def {name}\(", f.read_text(encoding="utf-8"), re.M)
        return None if ok else f"`{token}`: no such test"
    output = re.search(r"\.(json|jsonl|html|png|pt|safetensors)$", token)
    if "<" in token or output or re.search(r"\b[A-Z]{3,}\b", token):
        return None  # a template, a run's output, a placeholder
    if re.search(r"\.(py|md|sh|toml)$", token) or token.endswith("/"):
        return None if _path_exists(token, row_dirs) else f"`{token}`: no such file or folder"
    if "/" in token:  # cli/__init__.main
        path, _, rest = token.partition(".")
        if not rest:
            return None  # alternatives (atomic_write_text/json/bytes), not a path
        if not (PKG / (path + ".py")).exists():
            return f"`{token}`: no module {path}.py"
        mod = "gated_attention." + path.replace("/", ".").removesuffix(".__init__")
        return _attrs(token, mod, rest.split(".") if rest else [])
    if not re.fullmatch(rf"{IDENT}(\.{IDENT})*", token):
        return None  # a value, a shape, a command line
    if "." in token:
        mod, rest = _module_for(token)
        if mod is not None:
            return _attrs(token, mod, rest)
        top = token.split(".")[0]
        if top not in defined and top in ("dataclasses", "torch", "transformers"):
            return None
        missing = [p for p in token.split(".") if p not in defined]
        return f"`{token}`: {', '.join(missing)} in no source file" if missing else None
    if token in MODULES or token in defined:
        return None
    return f"`{token}`: in no source file"


def _attrs(token: str, module: str, rest: list[str]) -> str | None:
    obj = importlib.import_module(module)
    for name in rest:
        if not hasattr(obj, name):
            sub = f"{obj.__name__}.{name}" if hasattr(obj, "__path__") else None
            try:
                obj = importlib.import_module(sub) if sub else None
            except ImportError:
                obj = None
            if obj is None:
                return f"`{token}`: {module} has no {'.'.join(rest)}"
            continue
        obj = getattr(obj, name)
    return None


def layer_sections(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """{layer: (its `where` paths from the layer table, the lines under its heading `### layer` in "Modules, layer by
    layer")}: the table says where a layer lives, its section names each of its modules on a line of its own."""
    wheres, sections, current = {}, {}, None
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("| **") and len(cells) > 3:  # a layer-table row: | **layer** | where | what it is |
            wheres[re.search(r"\*\*(.+?)\*\*", cells[1]).group(1)] = re.findall(r"`([^`]+)`", cells[2])
        elif line.startswith("#"):
            name = re.fullmatch(r"###\s+(\S+)\s*", line)
            current = name.group(1) if name and name.group(1) in wheres else None
            if current:
                sections[current] = []
        elif current:
            sections[current].append(line)
    return {layer: (paths, sections.get(layer, [])) for layer, paths in wheres.items()}


def _dirs(wheres: list[str]) -> list[Path]:
    """The folders a bare file name of a layer may live in: the layer's folders, and the package's top."""
    return ([PKG / w.rstrip("/") for w in wheres if w.endswith("/")] or [PKG]) + [PKG]


def _cited() -> list[tuple[str, list[Path] | None]]:
    """(token, the folders of the layer whose table row or `### layer` section cites it, or None elsewhere) for every
    backticked span of ARCHITECTURE.md."""
    wheres, section = {}, None
    out = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        row_dirs = section
        if line.startswith("| **") and len(cells) > 3:  # a layer-table row: | **layer** | where | what it is |
            paths = re.findall(r"`([^`]+)`", cells[2])
            wheres[re.search(r"\*\*(.+?)\*\*", cells[1]).group(1)] = paths
            row_dirs = _dirs(paths)
        elif line.startswith("#"):
            name = re.fullmatch(r"###\s+(\S+)\s*", line)
            section = _dirs(wheres[name.group(1)]) if name and name.group(1) in wheres else None
        for span in re.findall(r"`([^`\n]+)`", line):
            out.append((span, row_dirs))
    return out


def test_the_checker_tells_names_from_values():
    defined = _defined()
    assert _check("train/config.py", None, defined) is None
    assert _check("tests/probes/kill_hooks.py", None, defined) is None
    assert _check("train/lab.py", None, defined) and _check("report.py", [PKG / "labs"], defined)
    assert _check("backcopy.py", [PKG / "labs"], defined) is None and _check("kill_hooks.py", None, defined) is None
    assert _check("presets.model_config", None, defined) is None
    assert _check("presets.no_such_function", None, defined)
    assert _check("cli/__init__.main", None, defined) is None and _check("cli/__init__.nope", None, defined)
    assert _check("gattn compare --budget long", None, defined) is None
    assert _check("(B, T, H, D)", None, defined) is None
    assert _check("UserError", None, defined) is None and _check("NoSuch" + "ClassHere", None, defined)
    assert _check("tests/test_docs.py::test_every_link_from_the_readme_reaches_its_target", None, defined) is None
    assert _check("tests/test_docs.py::test_no_such_" + "test", None, defined)


def test_every_name_architecture_md_cites_exists():
    defined = _defined()
    cited = _cited()
    bad = sorted({why for token, rows in cited if (why := _check(token, rows, defined))})
    assert len(cited) > 100 and not bad, "\n".join(bad)


def _names(token: str, name: str, rel: str) -> bool:
    """Whether a cited `token` names the file `name` at `rel` (`<name>_lab.py`: the labs' template)."""
    if "<name>" in token:
        return re.fullmatch(re.escape(token).replace("<name>", r"\w+"), name) is not None
    return token in (name, rel) or token.endswith("/" + name)


def test_every_source_file_is_named_in_its_layer_row():
    """Each module of the package is named (its file name in backticks) under the heading of the layer that owns it
    (the longest `where` path containing it; the labs' `<name>_lab.py` template counts), or is a package's
    `__init__` / `__main__`."""
    layers = layer_sections(DOC.read_text(encoding="utf-8"))
    named = {layer: set(re.findall(r"`([^`]+)`", "\n".join(lines))) for layer, (_, lines) in layers.items()}
    missing = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if p.name in ("__init__.py", "__main__.py"):
            continue
        owner = max(((w, layer) for layer, (wheres, _) in layers.items() for w in wheres
                     if rel == w or (w.endswith("/") and rel.startswith(w))), key=lambda t: len(t[0]), default=None)
        if owner is None:
            missing.append(f"{rel}: no row")
        elif not any(_names(n, p.name, rel) for n in named[owner[1]]):
            missing.append(f"{rel}: not named under ### {owner[1]}")
    assert not missing, "\n".join(missing)


def test_the_module_lists_are_read_per_layer():
    """The checker's positive control: a module named only under another layer's heading is not named in its own."""
    text = ("| layer | where | what it is |\n|---|---|---|\n| **util** | `util/` | x |\n| **data** | `data/` | y |\n"
            "## Modules\n### util\n- `io.py`: files\n### data\n- `corpus.py`: `Corpus`\n## Next\n- `epoch.py`\n")
    layers = layer_sections(text)
    assert layers["util"] == (["util/"], ["- `io.py`: files"])
    assert layers["data"] == (["data/"], ["- `corpus.py`: `Corpus`"])  # the next ## heading ends the section
