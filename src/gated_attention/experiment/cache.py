"""The one rule for reusing a stored result, for every job (compare, each lab, longctx).

A result (a training run folder, a lab unit's result.json, an analysis or evaluation JSON, an extended checkpoint)
is stored together with its *key*: every setting that changes it, including the precision it computed in as resolved
on the machine (`resolved_precision`), and the identity of the inputs it was computed from (the model file it
measured: its modification time). The policy, the same everywhere:

  - no stored result (or an unreadable one: writes are atomic, so only a hand edit makes one): compute and store it;
  - the same key: reuse it (a training run that was interrupted resumes);
  - a different setting: stop before computing anything, with one message that names every differing setting (saved
    vs requested) and the two ways out, a new --out or deleting that result. Nothing is silently recomputed,
    overwritten or mixed;
  - only the inputs differ (the model it measured was trained again since): the stored result is obsolete, not in
    conflict; it is recomputed from the current input.

`check` applies the policy to two keys, `load` / `save` / `cached` to a JSON result file. A key is a JSON object;
its values compare as JSON values (tuples and lists alike); `inputs` names the key fields that identify inputs. A job
whose key gains a setting passes `defaults` (the value every older result was computed with), so results stored
before it stay reusable.

A unit that trains (a lab's model) is a trainer run folder: it resumes from the trainer's own checkpoints
(`experiment.train_or_reuse`, the one resume policy), its key checked here first.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..util.errors import UserError
from ..util.io import atomic_write_text, json_dumps, renamed, to_strict

Log = Callable[[str], Any]


class StaleResult(UserError):
    """A stored result was made with other settings than requested (the policy above: stop, name them, no rework)."""


def _canonical(v: Any) -> Any:
    return json.loads(json.dumps(to_strict(v), sort_keys=True))  # tuples -> lists, numpy -> numbers, NaN -> null


def differences(stored: dict, wanted: dict, defaults: dict | None = None) -> list[str]:
    """The settings whose stored and requested values differ, each as 'name: saved X vs requested Y'.

    A setting missing on one side counts as its value in `defaults` (else as absent: null)."""
    stored, wanted, defaults = _canonical(stored), _canonical(wanted), _canonical(defaults or {})
    out = []
    for k in sorted(set(stored) | set(wanted)):
        a = stored.get(k, defaults.get(k))
        b = wanted.get(k, defaults.get(k))
        if a != b:
            out.append(f"{k}: saved {_show(a)} vs requested {_show(b)}")
    return out


def _show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def stale_message(where: str | Path, diffs: list[str]) -> str:
    """The one message of a key mismatch: what differs, and the two ways out."""
    return (f"{where} holds a result made with other settings than requested - different settings "
            f"({'; '.join(diffs)}); use a new --out, or delete {where} to recompute it")


def check(where: str | Path, stored: dict, wanted: dict, defaults: dict | None = None,
          diffs: list[str] | None = None) -> None:
    """Raise StaleResult when the `stored` and `wanted` keys differ. diffs: the differences when the caller compares
    keys its own way (a training run's settings: train.resume_rule.describe_changes)."""
    diffs = differences(stored, wanted, defaults) if diffs is None else diffs
    if diffs:
        raise StaleResult(stale_message(where, diffs))


def load(path: str | Path, key: dict, key_field: str = "key", defaults: dict | None = None,
         inputs: tuple[str, ...] = (), diff: Callable[[dict, dict], list[str]] | None = None,
         renames: dict | None = None) -> dict | None:
    """The stored result at `path` if it was made with `key`; None when there is none, it is unreadable, or only its
    `inputs` fields differ (obsolete: recompute it); StaleResult when a setting differs. diff(stored, requested): the
    caller's own comparison of the settings, when a key has one (a TrainConfig: train.resume_rule.setting_differences).
    renames: the caller's settings stored under an older name (old -> new, util.io.renamed), read under today's."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # writes are atomic, so a file that does not parse was edited by hand: recompute it
    if not isinstance(old, dict) or key_field not in old:
        return None  # not one of our results (or written before it carried a key): recompute it
    stored = old[key_field] if isinstance(old[key_field], dict) else {}
    if renames:  # read (and returned) under today's names
        stored = old[key_field] = renamed(stored, renames)
    settings = [k for k in set(stored) | set(key) if k not in inputs]
    old_settings = {k: stored[k] for k in settings if k in stored}
    new_settings = {k: key[k] for k in settings if k in key}
    check(path, old_settings, new_settings, defaults, diff(old_settings, new_settings) if diff else None)
    if differences({k: stored.get(k) for k in inputs}, {k: key.get(k) for k in inputs}):
        return None  # computed from an earlier version of its input: obsolete
    return old


def save(path: str | Path, key: dict, result: dict, key_field: str = "key", indent: int | None = 1) -> dict:
    """Store `result` with its key (strict JSON, atomically); returns what was stored, exactly as `load` will read
    it back (tuples as lists, non-finite floats as null, dict keys as strings), so a fresh result and a reused one
    are the same object."""
    text = json_dumps({key_field: key, **{k: v for k, v in result.items() if k != key_field}}, indent=indent)
    atomic_write_text(path, text)
    return json.loads(text)


def cached(path: str | Path, key: dict, compute: Callable[[], dict], log: Log = print, tag: str = "[run]",
           key_field: str = "key", indent: int | None = 1, defaults: dict | None = None,
           inputs: tuple[str, ...] = ()) -> dict:
    """The result at `path` for `key`: reused when stored with that key, else `compute()`d and stored (the policy
    above: a result stored with other settings stops the job; one from an earlier input is recomputed)."""
    got = load(path, key, key_field, defaults, inputs)
    if got is not None:
        log(f"{tag} reuse {path}")
        return got
    if Path(path).is_file():
        log(f"{tag} recompute {path}: made from an earlier version of its input (or unreadable)")
    return save(path, key, compute(), key_field, indent)
