"""A study: what every lab that trains models has in common, declared once, beneath the labs (it imports none).

A lab is a study plus its own science. The study part, here:

  Budget        one named size of a lab: its help line and its settings as changes over the lab's base (TrainConfig
                fields by their own names, the `--set` vocabulary, plus the lab's own axes)
  Option        one command-line option: flags, argparse keywords and its help, written in this one place; an option
                that a budget sets shows each budget's value in its help (read from the budgets, so it cannot go
                stale)
  options.*     the options every study shares (--out --budget --variants --seeds --set --jobs --report-only), each
                taking only what differs between labs
  Study         a lab's declaration for `gattn lab NAME`: its one-line help, its options and the function that runs
                it; cli/lab.py builds every lab's subcommand from these (without torch: a declaration imports nothing
                heavy)
  Recorder      the one step hook of a lab's unit (train.trainer.train): a curve point every `every` steps (and at
                the last), from step 0; trailing windows of per-step values; the unit's CPU and wall time over every
                process that trained it; its state rides in the trainer's checkpoints, so a killed unit resumes with
                its records
  Units         a study's planned units (finished ones read once), trained by Units.run or, several studies' at
                once, in one pool by the job that plans them (`gattn compare`)
  stored_settings / with_changes / with_stored
                a lab config that holds its own axes as fields, a TrainConfig as `train` (and model-config fields
                as a `model` dict): its settings under the names units' keys and lab.json store them, and a copy
                changed by where the settings live or by their stored names (one table per lab maps each stored
                name to where the setting lives)
  begin / Clock / save_lab
                an invocation's start (its config validated, OUT made, its wall and CPU clock started) and its end
                (plots, lab.json, report)
  finish_unit   a finished unit's result.json (its key and figures: cache.save, the "finished" marker, written
                last) and the removal of the trainer's checkpoints and final/ (the lab keeps figures, not optimizer
                state)

Beside these, a lab's own code is what it measures, its unit function (training through
experiment.runs.train_or_reuse, the one resume policy, with a Recorder as the step hook), how it aggregates, its
verdict and its report.
"""
from __future__ import annotations

import argparse
import copy
import shutil
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from . import cache
from .runs import run_units


@dataclass(frozen=True)
class Budget:
    """One named size of a lab: the help line `--budget` shows, and its settings over the lab's base."""

    help: str
    changes: dict = field(default_factory=dict)  # setting -> value over the lab's base preset


@dataclass(frozen=True)
class Option:
    """One option of a lab's command: flags, argparse keywords, help. `shown(budget)`: the value a budget gives this
    option, appended to the help as its default (one value: "(default X)"; several: "X with --budget NAME; ...")."""

    flags: tuple[str, ...]
    help: str
    kw: dict = field(default_factory=dict)  # argparse keywords besides help
    shown: Callable[[Any], Any] | None = None

    def add(self, parser: argparse.ArgumentParser, budgets: dict | None = None) -> None:
        parser.add_argument(*self.flags, help=self.help + budget_defaults(self.shown, budgets), **self.kw)


def show(v: Any) -> str:
    """A setting's value as a help text states it (on/off for flags, %g for floats, lists space-separated)."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (list, tuple)):
        return " ".join(map(show, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def budget_defaults(shown: Callable[[Any], Any] | None, budgets: dict | None) -> str:
    """The help suffix naming each budget's value of one option ('' when the option has none)."""
    if shown is None or not budgets:
        return ""
    vals = {name: show(shown(b)) for name, b in budgets.items()}
    if len(set(vals.values())) == 1:
        return f" (default {next(iter(vals.values()))})"
    return " (default: " + "; ".join(f"{v} with --budget {n}" for n, v in vals.items()) + ")"


class options:
    """The options every study shares; each call states only what differs between labs."""

    @staticmethod
    def out(default: str, layout: str, **kw) -> Option:
        return Option(("--out",), f"output folder: {layout} (default {default}; a re-run reuses finished units and "
                                  "continues killed ones)", {"default": default, **kw})

    @staticmethod
    def budget(budgets: dict, default: str = "default") -> Option:
        return Option(("--budget",), "; ".join(f"{k}: {v.help}" for k, v in budgets.items())
                      + f" (default: {default})", {"default": default, "choices": list(budgets)})

    @staticmethod
    def variants(what: str, default=None, shown=None) -> Option:
        note = f" (default: {' '.join(default)})" if default is not None else ""
        return Option(("--variants",), what + note,
                      {"nargs": "+", "default": list(default) if default is not None else None, "metavar": "NAME"},
                      shown)

    @staticmethod
    def seeds(what: str, shown=None, **kw) -> Option:
        return Option(("--seeds",), what, {"type": int, "default": None, **kw}, shown)

    @staticmethod
    def sets(note: str) -> Option:
        return Option(("--set",), "training / model.* settings over the budget's for every unit, as in `gattn train "
                                  f"--set` (e.g. --set beta2=0.99); repeatable. {note}",
                      {"dest": "sets", "action": "append", "default": [], "metavar": "KEY=VALUE"})

    @staticmethod
    def jobs(what: str = "units trained at once", **kw) -> Option:
        return Option(("--jobs",), f"{what}, one core each (default: min(2, available cores))",
                      {"type": int, "default": None, **kw})

    @staticmethod
    def precision(default: str | None, note: str = "", shown=None) -> Option:
        from ..util.precision import option_help

        choices, text = option_help(default, note=note)
        return Option(("--precision",), text, {"choices": choices, "default": default}, shown)

    @staticmethod
    def report_only(what: str) -> Option:
        return Option(("--report-only",), what, {"action": "store_true"})


@dataclass(frozen=True)
class Study:
    """A lab's declaration for `gattn lab NAME`: its help line, its options (a function: built when the parser is,
    from the lab's torch-free module), its budgets (for the options' stated defaults) and run(args) -> exit code."""

    name: str
    help: str
    options: Callable[[], list[Option]]
    run: Callable[[argparse.Namespace], int]
    budgets: Callable[[], dict] | None = None

    def configure(self, parser: argparse.ArgumentParser) -> None:
        budgets = self.budgets() if self.budgets else None
        for o in self.options():
            o.add(parser, budgets)


class Recorder:
    """The step hook of one unit (train.trainer.train's protocol: begin(model), hook(steps_done, model) -> stop
    reason or None, state_dict / load_state_dict). A subclass says what a curve point is (`point`) and what happens
    after every step besides (`after_step`); the curve, the trailing windows and the unit's CPU and wall time are
    kept here. every=0: no curve."""

    def __init__(self, every: int, steps: int, **state):
        self.every, self.steps = every, steps
        self.state: dict = {"curve": [], "wall": 0.0, "cpu": 0.0, **state}
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def point(self, step: int, model) -> dict | None:
        """The curve point at `step` (None: nothing to record)."""
        return None

    def after_step(self, steps_done: int, model) -> str | None:
        return None

    def trail(self, name: str, value, keep: int) -> None:
        """Append `value` to the trailing window `name`, keeping its last `keep` values."""
        self.state[name] = (self.state.get(name, []) + [value])[-keep:]

    def record(self, step: int, model) -> dict | None:
        pt = self.point(step, model)
        if pt is not None:
            self.state["curve"].append(pt)
        return pt

    def begin(self, model) -> None:
        if self.every:
            self.record(0, model)

    def __call__(self, steps_done: int, model) -> str | None:
        reason = self.after_step(steps_done, model)
        if self.every and (steps_done % self.every == 0 or steps_done == self.steps):
            self.record(steps_done, model)
        return reason

    def wall_s(self) -> float:
        return self.state["wall"] + time.perf_counter() - self._t0

    def cpu_s(self) -> float:
        return self.state["cpu"] + time.process_time() - self._c0

    def state_dict(self) -> dict:
        return {**self.state, "wall": self.wall_s(), "cpu": self.cpu_s()}

    def load_state_dict(self, st: dict) -> None:
        self.state = dict(st)
        self._t0, self._c0 = time.perf_counter(), time.process_time()


def _own(cfg) -> list:
    """A lab config's own axes: its fields besides `train` and `model`."""
    return [f.name for f in fields(cfg) if f.name not in ("train", "model")]


def stored_settings(cfg, table: dict) -> dict:
    """cfg's settings under their stored names, in `table`'s order. table: stored name -> where the setting lives:
    a field of cfg (a lab axis), "model.NAME" (an entry of cfg.model) or a TrainConfig field (of cfg.train)."""
    own, out = _own(cfg), {}
    for name, where in table.items():
        v = cfg.model[where[6:]] if where.startswith("model.") else getattr(cfg if where in own else cfg.train, where)
        out[name] = copy.deepcopy(v)
    return out


def with_changes(cfg, changes: dict, lab: str):
    """A copy of cfg with `changes`: lab axes (cfg's fields) by name, model-config fields as "model.NAME",
    TrainConfig fields by their own names (the `--set` vocabulary); an unknown name fails, naming the lab."""
    cfg, own, train = copy.deepcopy(cfg), _own(cfg), {}
    for k, v in changes.items():
        if k in own:
            setattr(cfg, k, copy.deepcopy(v))
        elif k.startswith("model.") and hasattr(cfg, "model"):
            cfg.model[k[6:]] = v
        elif k in {f.name for f in fields(cfg.train)}:
            train[k] = v
        else:
            raise ValueError(f"unknown {lab} setting {k!r}: a lab axis ({', '.join(own)}), "
                             f"{'model.NAME or ' if hasattr(cfg, 'model') else ''}a training setting "
                             "(`gattn settings`)")
    cfg.train = replace(cfg.train, **train)
    return cfg


def with_stored(cfg, stored: dict, table: dict, lab: str):
    """A copy of cfg with settings changed by their stored names (`table`'s keys, as stored_settings gives them); an
    unknown name fails, naming the valid ones."""
    unknown = sorted(set(stored) - set(table))
    if unknown:
        raise ValueError(f"unknown {lab} setting(s) {unknown}; valid: {', '.join(table)}")
    return with_changes(cfg, {table[k]: v for k, v in stored.items()}, lab)


class Clock:
    """This invocation's wall and CPU seconds since it began (lab.json's wall_time_s and cpu_time_s)."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def times(self) -> dict:
        return {"wall_time_s": time.perf_counter() - self.t0, "cpu_time_s": time.process_time() - self.c0}


def begin(cfg, out: str | Path) -> tuple[Path, Clock]:
    """A lab invocation's start: cfg validated (bad input fails before anything is written), OUT made, the clock
    started."""
    cfg.validate()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out, Clock()


def save_lab(out: Path, lab: dict, make_plots: Callable[[Path], dict], write_report: Callable[[], Any]) -> dict:
    """A lab's folder from its result: the plots (make_plots(OUT/plots) -> name -> path; lab.json's "plots", relative
    to OUT), lab.json, then the report (write_report()). Returns lab."""
    from ..util.io import atomic_write_json

    lab["plots"] = {k: str(p.relative_to(out)) for k, p in make_plots(out / "plots").items()}
    atomic_write_json(out / "lab.json", lab, indent=1)
    write_report()
    return lab


def finish_unit(unit_dir: str | Path, key: dict, result: dict) -> dict:
    """Store a trained unit's result with its key (the "finished" marker, written last) and remove the trainer's
    checkpoints and final/: a kill before leaves a finished run, reused with its recorder restored from the final
    checkpoint. Returns the result as stored (cache.save). A lab that keeps the model copies final/ out first."""
    unit_dir = Path(unit_dir)
    out = cache.save(unit_dir / "result.json", key, result)
    shutil.rmtree(unit_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(unit_dir / "final", ignore_errors=True)
    return out


@dataclass
class Units:
    """A study's planned units: fn(unit) trains (or reuses) one and returns its result; done[i] is unit i's stored
    result, None while it is still to train. A job that trains several studies' units in one pool (`gattn compare`)
    takes each study's pending() and hands its fresh results back through results()."""

    fn: Callable
    units: list
    done: list

    def pending(self) -> list:
        return [u for u, d in zip(self.units, self.done) if d is None]

    def results(self, fresh: list) -> list:
        """Every unit's result in unit order: the stored ones as they were, the pending ones from `fresh` (in the
        order pending() gave them)."""
        it = iter(fresh)
        out = [d if d is not None else next(it) for d in self.done]
        if next(it, None) is not None:
            raise ValueError("more fresh results than pending units")
        return out

    def run(self, jobs: int, log) -> list:
        """Train the pending units through run_units (`jobs` at a time, none for a finished one); every result."""
        return self.results(run_units(self.fn, self.pending(), jobs=jobs, log=log))
