"""One error path for user-facing failures, and the validators that raise it where values enter.

`UserError` (a ValueError) means "the input or the environment is wrong, not the code": the `gattn` entry point
prints it as ONE line, `gattn CMD: error: <problem>; <fix>`, and exits with status 2 (GATTN_DEBUG=1 adds the
traceback); notes added to the exception (`exc.add_note`, e.g. what a failed run left in its folder) join that
line after a "; ". Library code raises it (or a plain ValueError, which the CLI treats the same) at the place a value
enters: config dataclasses' `validate()`, argparse `type=` functions below, file readers in `io.py`. Anything else
(TypeError, RuntimeError, ...) is a bug and still raises with its traceback.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import math
import os
import sys
from pathlib import Path


class UserError(ValueError):
    """Bad input or environment; the message names the problem and the fix (`problem; fix`)."""


class UserKeyError(UserError, KeyError):
    """A user error where callers historically expect KeyError (an unknown name looked up in a table)."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


# errno values that mean "the disk / quota / file-size limit is full", not a bug
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def user_message(exc: BaseException) -> str | None:
    """The one-line message for a user-facing exception, or None when `exc` is a bug that must keep its traceback."""
    for e in (exc.__cause__, exc.__context__):  # e.g. torch's RuntimeError wrapping the write's OSError
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS and not isinstance(exc, OSError):
            return user_message(e)
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        where = f" writing {exc.filename}" if exc.filename else ""
        return f"disk full{where} ({os.strerror(exc.errno)}); free space (or raise the file-size limit) and rerun"
    if isinstance(exc, FileExistsError):  # e.g. io.atomic_dir: "DST already exists; pass --overwrite"
        return str(exc) if not exc.filename else f"{exc.filename} already exists; choose another path or remove it"
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or exc} does not exist; check the path" if exc.filename else str(exc)
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename} is a folder where a file is expected; pass a file"
    if isinstance(exc, NotADirectoryError):
        return f"{exc.filename} is a file (or under one) where a folder is expected; pass a folder"
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename}; fix its permissions or choose another path"
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not valid UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8"
    if isinstance(exc, ValueError):  # includes UserError, json.JSONDecodeError, config validation
        return str(exc)
    if type(exc).__name__ == "SafetensorError":  # corrupt/truncated .safetensors outside io.load_safetensors
        return f"corrupt safetensors file ({exc}); re-save or re-download the checkpoint"
    return None


def handle(cmd: str, exc: BaseException) -> int:
    """Print `exc` as one line and return 2 when it is a user error; re-raise a bug."""
    msg = user_message(exc)
    if msg is None:
        raise exc
    if os.environ.get("GATTN_DEBUG") == "1":
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    notes = [str(n) for n in getattr(exc, "__notes__", ())]  # what the failure left behind (e.g. a run folder)
    msg = " ".join("; ".join([str(msg), *notes]).split())  # exactly one line
    print(f"gattn {cmd}: error: {msg}", file=sys.stderr)
    return 2


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (`gattn CMD: error: ...; see --help`) instead of usage + error, exit 2, and
    "did you mean" for a mistyped choice (a preset, a lab, any option with choices)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)

    def _check_value(self, action, value):  # argparse's one check of a value against `choices` (subcommands too)
        choices = action.choices
        if choices is None or value in choices or not isinstance(value, str):
            return super()._check_value(action, value)
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        if not close:
            return super()._check_value(action, value)
        raise argparse.ArgumentError(action, f"invalid choice {value!r} (did you mean `{close[0]}`?)")


# ------------------------------------------------------------------------------------------------ numbers

def check_number(name: str, value, *, kind: type = float, min: float | None = None, min_open: bool = False,
                 max: float | None = None, allow_none: bool = False):
    """`value` converted to `kind`, finite and within [min, max] (min exclusive when `min_open`); else UserError.

    Used by dataclass `validate()` methods and the argparse types below, so both entry points say the same thing."""
    if value is None:
        if allow_none:
            return None
        raise UserError(f"{name} is required; give a value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name}={value!r} is not a number; give a {kind.__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{name}={value} is not finite; give a finite {kind.__name__}")
    if kind is int and float(value) != int(value):
        raise UserError(f"{name}={value!r} is not an integer; give a whole number")
    value = kind(value)
    if min is not None and max is not None and not ((value > min if min_open else value >= min) and value <= max):
        lo = "(" if min_open else "["
        raise UserError(f"{name}={value} must be in {lo}{min:g}, {max:g}]; set {name} inside that range")
    if min is not None and (value <= min if min_open else value < min):
        rel = ">" if min_open else ">="
        raise UserError(f"{name}={value} must be {rel} {min:g}; set {name} to a value {rel} {min:g}")
    if max is not None and value > max:
        raise UserError(f"{name}={value} must be <= {max:g}; set {name} to a value <= {max:g}")
    return value


def _arg_type(kind: type, min: float | None, min_open: bool, what: str):
    def parse(text: str):
        try:
            raw = float(text) if kind is float else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        try:
            return check_number("value", raw, kind=kind, min=min, min_open=min_open)
        except UserError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None

    parse.__name__ = what
    return parse


# argparse `type=` functions: finite numbers with the obvious lower bound
positive_int = _arg_type(int, 0, True, "a positive integer")
nonneg_int = _arg_type(int, 0, False, "a non-negative integer")
positive_float = _arg_type(float, 0.0, True, "a positive finite number")
nonneg_float = _arg_type(float, 0.0, False, "a non-negative finite number")
finite_float = _arg_type(float, None, False, "a finite number")


# ------------------------------------------------------------------------------------------------ paths

def existing_dir(text: str) -> str:
    """argparse type: a folder that exists."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"folder {text!r} does not exist")
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text


def existing_file(text: str) -> str:
    """argparse type: a regular file that exists."""
    p = Path(text)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"file {text!r} does not exist")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    return text


def out_dir(text: str) -> str:
    """argparse type: an output folder — may not exist yet, but must not be a file (nor sit under one)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    p = Path(text)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise argparse.ArgumentTypeError(f"{str(q)!r} is a file; an output folder must be a folder")
            break
    return text


def out_file(text: str) -> str:
    """argparse type: an output file — must not be an existing folder, nor sit under a file."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    for q in p.parents:
        if q.exists():
            if not q.is_dir():
                raise argparse.ArgumentTypeError(f"{str(q)!r} is a file, so {text!r} cannot be created under it")
            break
    return text


__all__ = ["UserError", "UserKeyError", "DISK_FULL_ERRNOS", "user_message", "handle", "Parser", "check_number", "positive_int",
           "nonneg_int", "positive_float", "nonneg_float", "finite_float", "existing_dir", "existing_file",
           "out_dir", "out_file", "TRUE_WORDS", "FALSE_WORDS", "switch_choice"]


TRUE_WORDS = ("1", "true", "yes", "on")  # the spellings a boolean setting accepts (--set, JSON, bools)
FALSE_WORDS = ("0", "false", "no", "off")


def switch_choice(value, key: str, usage: str) -> str:
    """Normalise an auto / on / off setting (`compile`, `keep_gathered`) to 'auto' | 'true' | 'false': bools (an
    older or JSON train_config.json) and the usual spellings accepted; anything else fails naming `usage`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    low = str(value).strip().lower()
    if low == "auto":
        return "auto"
    if low in TRUE_WORDS:
        return "true"
    if low in FALSE_WORDS:
        return "false"
    raise ValueError(f"{key}={value!r}; use {usage}")
