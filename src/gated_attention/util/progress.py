"""Progress of long commands: a tqdm bar on a terminal, a plain line at a steady interval everywhere else.

A run launched without a terminal (nohup, CI, a scheduler writing to a file) gets no usable tqdm output: carriage
returns pile up or nothing is flushed for minutes. So when the stream is not a TTY, `Progress` prints one line every
`interval` seconds (and at the first update and at the end):

    [train run1] step 120/2000 (6.0%) | loss 3.412 | 5,230 tok/s | 1m02s elapsed | ETA 16m10s

The interval is `GATTN_PROGRESS_INTERVAL` seconds (default 30; 0 prints every update). On a terminal the tqdm bar
stays, with the same metrics in its postfix.

Usage (every long loop of the package: train, compare, longctx, data prepare, ruler; a lab does the same):

    from gated_attention.util.progress import Progress

    with Progress(total=steps, desc="lab sinks", unit="step") as prog:
        for step in range(steps):
            loss = ...
            prog.update(1, tokens=batch_tokens, loss=loss)   # tokens -> tok/s; any other keyword is shown as-is

`enabled=False` makes every call a no-op (rank != 0, quiet presets). Numbers are formatted compactly (floats with 4
significant digits), so metrics can be passed raw. `heartbeat=True` (off a terminal) also prints the line from a
background thread when a single unit takes longer than the interval (training a tokenizer, one long generation), so
the log never goes quiet for more than `interval` seconds.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref

DEFAULT_INTERVAL_S = 30.0


def _interval_from_env() -> float:
    raw = os.environ.get("GATTN_PROGRESS_INTERVAL")
    if raw is None or raw == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"GATTN_PROGRESS_INTERVAL={raw!r} is not a number of seconds; unset it or use e.g. 30")
    if value < 0:
        raise ValueError(f"GATTN_PROGRESS_INTERVAL={raw!r} must be >= 0 seconds")
    return value


def format_duration(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """Counts `total` units; `update(n, tokens=..., **metrics)` after each. See the module docstring."""

    def __init__(self, total: int | None, desc: str, unit: str = "step", *, initial: int = 0, enabled: bool = True,
                 stream=None, interval: float | None = None, tty: bool | None = None, heartbeat: bool = False,
                 clock=time.monotonic):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.n = self.start_n = initial
        self.stream = stream if stream is not None else sys.stderr
        self.interval = _interval_from_env() if interval is None else interval
        self.clock = clock
        self.t0 = clock()
        self.last_print = None  # clock time of the last line (None: nothing printed yet)
        self.printed_n = None
        self.tokens = 0
        self.metrics: dict = {}
        self.bar = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if not enabled:
            return
        if tty is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=False,
                            file=self.stream)
        elif heartbeat and self.interval > 0:
            # the thread holds only a weak reference: a Progress dropped without close() (an exception) stops it
            self._thread = threading.Thread(target=_beat, args=(weakref.ref(self), self._stop, self.interval),
                                            name=f"progress-{desc}", daemon=True)
            self._thread.start()

    # --- the public calls
    def update(self, n: int = 1, *, tokens: int = 0, **metrics) -> None:
        if not self.enabled:
            return
        with self._lock:  # the heartbeat thread reads these
            self.n += n
            self.tokens += tokens
            self.metrics.update(metrics)
        if self.bar is not None:
            post = {k: _fmt(v) for k, v in self.metrics.items()}
            if self.tokens:
                post["tok/s"] = f"{self.tokens_per_s():,.0f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(n)
            return
        with self._lock:
            now = self.clock()
            if self.last_print is None or now - self.last_print >= self.interval:
                self._print(now)

    def set(self, **metrics) -> None:
        """Change the shown metrics without counting a unit (e.g. the stage a multi-part command is in)."""
        if self.enabled:
            with self._lock:
                self.metrics.update(metrics)

    def close(self) -> None:
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.printed_n != self.n:  # the final state, unless that exact line was the last one printed
            with self._lock:
                self._print(self.clock())
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the line
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.clock() - self.t0, 1e-9)

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = now - self.t0
        done = self.n - self.start_n
        parts = []
        if self.total:
            parts.append(f"{self.unit} {self.n}/{self.total} ({100.0 * self.n / self.total:.1f}%)")
        else:
            parts.append(f"{self.unit} {self.n}")
        parts += [f"{k} {_fmt(v)}" for k, v in self.metrics.items()]
        if self.tokens:
            parts.append(f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s")
        parts.append(f"{format_duration(elapsed)} elapsed")
        if self.total and done > 0 and self.n < self.total:
            parts.append(f"ETA {format_duration(elapsed / done * (self.total - self.n))}")
        return f"[{self.desc}] " + " | ".join(parts)

    def _heartbeat(self) -> None:
        with self._lock:
            now = self.clock()
            if self.last_print is None or now - self.last_print >= self.interval:
                self._print(now)

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self.last_print, self.printed_n = now, self.n


def _beat(ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        prog = ref()
        if prog is None:
            return
        prog._heartbeat()
        del prog


__all__ = ["Progress", "format_duration", "DEFAULT_INTERVAL_S"]
