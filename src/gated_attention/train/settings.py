"""Every training setting described once, for `gattn settings` and `gattn train --dry-run`: each TrainConfig field
with its type, default, allowed values and meaning.

The meaning is the comment written beside the field in train/config.py (with its `#` continuation lines), and a
`# --- name` line there opens a group: the dataclass stays the one place a setting is declared and explained, and
this module reads its source once. The names are the dataclass's fields, which are also the `--set KEY=VALUE`
vocabulary of train/overrides.py. Imports no torch.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import tokenize
from dataclasses import dataclass
from typing import Any

from ..util.precision import PRECISIONS
from .config import ACTIVATION_CHECKPOINTING, CHOICES, TrainConfig

# settings whose values are checked by their own parsers rather than CHOICES, with the values those accept
_OTHER_CHOICES = {"precision": PRECISIONS, "activation_checkpointing": ACTIVATION_CHECKPOINTING,
                  "compile": ("auto", "true", "false"), "keep_gathered": ("false", "auto", "true")}


@dataclass(frozen=True)
class Setting:
    name: str
    type: str  # the annotation as written: "int", "str | None", "list[str] | None", ...
    default: Any
    choices: tuple[str, ...] | None  # the allowed values where they are a few names; None = any value of the type
    meaning: str
    group: str  # the `# --- group` the field sits under

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "choices": list(self.choices) if self.choices else None}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    if f.name in CHOICES:
        return tuple(CHOICES[f.name][0])
    if f.name in _OTHER_CHOICES:
        return tuple(_OTHER_CHOICES[f.name])
    return ("true", "false") if f.type == "bool" else None


def _comments(cls) -> tuple[dict[str, str], dict[str, str]]:
    """({field: its comment, continuation lines joined}, {field: its group}) read from the class's source."""
    source = inspect.getsource(cls)
    body = ast.parse(source).body[0].body
    fields = {node.target.id: (node.lineno, node.end_lineno) for node in body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    first_method = min((node.lineno for node in body if isinstance(node, ast.FunctionDef)), default=10**9)
    comments = {tok.start[0]: (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    meaning, group, current = {}, {}, ""
    starts = sorted((start, end, name) for name, (start, end) in fields.items())
    for i, (start, end, name) in enumerate(starts):
        for line in range(starts[i - 1][1] + 1 if i else 1, start):  # the lines above: a group header?
            text, alone = comments.get(line, ("", False))
            if alone and text.startswith("---"):
                current = text.lstrip("-").strip()
        stop = starts[i + 1][0] if i + 1 < len(starts) else first_method
        parts = [comments[end][0]] if end in comments and not comments[end][1] else []
        for line in range(end + 1, stop):  # comment-only lines below continue it, up to a group header
            text, alone = comments.get(line, ("", False))
            if not alone or text.startswith("---"):
                break
            parts.append(text)
        meaning[name], group[name] = " ".join(parts), current
    return meaning, group


@functools.lru_cache(maxsize=1)
def settings() -> tuple[Setting, ...]:
    """Every TrainConfig field, in declaration order."""
    meaning, group = _comments(TrainConfig)
    return tuple(Setting(f.name, str(f.type), _default(f), _choices(f), meaning[f.name], group[f.name])
                 for f in dataclasses.fields(TrainConfig))


def show(value) -> str:
    """A setting's value as `--set KEY=VALUE` takes it: true/false, none, comma lists, JSON objects, plain text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "[]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
