"""The documents' promises, checked on their text: every `gattn` command line in README.md, docs/usage.md and the
newcomer's pages (docs/common_tasks.md, which tests/test_docs_tasks.py also runs, and docs/train_your_corpus.md) parses
with the command's real argument parser (each option exists, takes the values it is given, the subcommand exists) and
its `--help` runs; every relative link in README.md, and in the documents it links, reaches a file and, where it names
one, a heading there (so every section moved out of the README stays reachable from it)."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from gated_attention.cli import COMMANDS, command_parser, main
from gated_attention.util import errors as E

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/usage.md", "docs/common_tasks.md", "docs/train_your_corpus.md")
PATH_TYPES = (E.existing_dir, E.existing_file, E.out_dir, E.out_file)  # placeholders like DIR are not on this disk


def command_lines(text: str) -> list[tuple[str, bool]]:
    """The `gattn ...` invocations of a markdown text: (arguments after `gattn`, whether it is a whole command line).
    Whole: a line of a fenced code block (its comment, `&&` / ` | ` chains and `\\` continuations handled) that is
    not a synopsis (no [optional], {choice}, a|b, ... or PLACEHOLDER). Not whole: synopses, and mentions in inline
    code (`gattn compare --budget long` in a table: a fragment, its options are checked)."""
    found = []

    def add(text: str, block: bool):
        m = re.search(r"(?:^|[\s/])gattn\s+(\S.*)$", text)
        if m:
            line = " ".join(m.group(1).split())
            synopsis = re.search(r"[\[{|…]|\.\.\.|(^|\s)[A-Z][A-Z_]+(\s|$)", line)
            found.append((line, block and not synopsis))

    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", " " + line, maxsplit=1)[0]
            for part in re.split(r"&&|\|\||\s\|\s", line):
                add(part, True)
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        add(span, False)
    return found


def _subparsers(parser: argparse.ArgumentParser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def resolve(words: list[str]) -> tuple[list[str], argparse.ArgumentParser, list[str]]:
    """(command words, the parser of that (sub)command, the rest) of `gattn WORDS`, e.g. lab sinks --budget small."""
    _, parser = command_parser(words[0])
    cmd, rest = [words[0]], words[1:]
    while rest and (sub := _subparsers(parser)) is not None and rest[0] in sub.choices:
        parser = sub.choices[rest[0]]
        cmd, rest = cmd + [rest[0]], rest[1:]
    return cmd, parser, rest


def _documented() -> list[tuple[str, str, bool]]:
    return [(doc, line, whole) for doc in DOCS for line, whole in command_lines((REPO / doc).read_text("utf-8"))]


def test_the_extractor_finds_commands_in_blocks_and_spans():
    text = ("run `gattn gates --json` or `x`\n```bash\n.venv/bin/gattn lab sinks --budget small  # comment\n"
            "cd x && gattn compare \\\n  --out o | tee log\ngattn train --preset P [--gate G]\n```\n")
    assert command_lines(text) == [("lab sinks --budget small", True), ("compare --out o", True),
                                   ("train --preset P [--gate G]", False), ("gates --json", False)]


def test_the_documents_name_commands():
    seen = {line.split()[0] for _, line, _ in _documented()}
    assert {"compare", "lab", "longctx", "train", "convert", "retrofit"} <= seen, seen
    assert sum(whole for _, _, whole in _documented()) >= 10  # whole command lines (README's quick start, ...)


@pytest.mark.parametrize("doc,line,whole", _documented(),
                         ids=lambda x: x if isinstance(x, str) and len(x) < 60 else None)
def test_documented_command_parses(doc, line, whole, capsys):
    """A whole command line parses with the real parser (paths are not checked: they name places on the reader's
    disk); a synopsis or a mention names only subcommands and options that exist. Every one's --help runs."""
    words = line.replace("[", " ").replace("]", " ").split()
    if words[0] in ("-h", "--help"):
        return
    assert words[0] in COMMANDS, f"{doc}: `gattn {line}` names no command (valid: {', '.join(COMMANDS)})"
    cmd, parser, rest = resolve(words)
    with pytest.raises(SystemExit) as exc:  # --help of every documented (sub)command runs
        main(cmd + ["--help"])
    assert exc.value.code == 0
    if rest and _subparsers(parser) is not None and not re.fullmatch(r"[A-Z]+", rest[0]):
        pytest.fail(f"{doc}: `gattn {line}`: {rest[0]!r} is not a subcommand of `gattn {' '.join(cmd)}`")
    if whole:
        for action in parser._actions:
            if action.type in PATH_TYPES:
                action.type = None
        capsys.readouterr()
        try:
            parser.parse_args(shlex.split(" ".join(rest)))
        except SystemExit:
            pytest.fail(f"{doc}: `gattn {line}` does not parse: {capsys.readouterr().err.strip()}")
        return
    known = {o for a in parser._actions for o in a.option_strings}
    named = {o.split("=")[0] for w in rest for o in w.split("/") if o.startswith("--")}
    if not any(a.nargs == argparse.REMAINDER for a in parser._actions):  # lm-eval's options are lm-eval's
        assert named <= known, f"{doc}: `gattn {line}` names options `gattn {' '.join(cmd)}` lacks: {named - known}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    slugs: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        s = _slug(h)
        n = slugs.get(s, 0)
        slugs[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _links(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [(t, a) for t, a in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text) if not re.match(r"[a-z]+:", t)]


def test_every_link_from_the_readme_reaches_its_target():
    readme = REPO / "README.md"
    docs = [readme] + sorted({(readme.parent / t).resolve() for t, _ in _links(readme) if t.endswith(".md")})
    bad = []
    for doc in docs:
        for target, anchor in _links(doc):
            dest = (doc.parent / target).resolve() if target else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(REPO)}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.relative_to(REPO)}: {target}#{anchor} names no heading there")
    assert len(docs) > 5 and not bad, "\n".join(bad)


def test_every_test_the_documents_cite_exists():
    """docs/reliability.md and the others (results/ among them) name the test that holds each promise: each named
    test (a function or a file) exists."""
    defined = set()
    for path in (REPO / "tests").glob("*.py"):
        defined.add(path.stem)
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    docs = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "results").rglob("*.md"))]
    cited = {(d.relative_to(REPO), n) for d in docs for n in re.findall(r"\b(test_\w+)", d.read_text(encoding="utf-8"))}
    missing = sorted(f"{d}: {n}" for d, n in cited if n not in defined)
    assert len(cited) > 10 and not missing, "\n".join(missing)
