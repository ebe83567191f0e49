"""Verdicts and the thresholds behind them: the one shape in which every verdict rule (compare's "Paper claims vs this
run" table, the labs' own verdict lines, `gattn longctx`'s claim) states each number it compares against and where
that number comes from.

A threshold is fixed before anything is measured and never fitted to this project's runs. Its `kind` says which of
three places it comes from:

  paper      the paper's own figure, cited by its table, figure or equation (e.g. "the paper's Table 4": Qiu et al.
             2025; docs/paper_map.md says where each is in the code)
  published  another published result, cited by paper and figure or table (e.g. StreamingLLM, Xiao et al. 2023)
  chosen     an effect size chosen in advance for what a user would notice (the reason is in `source`)

Rules keep their thresholds in a tuple of `Threshold`s next to the rule; the report renders them (`cells`) and
docs/usage.md lists them (tests/test_compare_claims.py checks that every one is there).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

REPRODUCED, PARTLY, NOT_AT_SCALE, NOT_RUN = "reproduced", "partly", "not at this scale", "not run here"
VERDICTS = (REPRODUCED, PARTLY, NOT_AT_SCALE, NOT_RUN)
GATED = ("sdpa_elementwise", "sdpa_headwise")  # the paper's G1 variants, judged against the baseline
KINDS = ("paper", "published", "chosen")


@dataclass(frozen=True)
class Threshold:
    """One number a verdict rule compares a measured figure with, and where the number comes from."""

    name: str  # what it bounds, in the words of the rule (e.g. "noticeable cost")
    value: float
    unit: str  # "nats", "× uniform", "share of the baseline's", ...
    kind: str  # one of KINDS
    source: str  # the citation (paper: its table or figure; published: authors, year, figure/table) or the reason it was chosen

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"threshold {self.name!r}: kind must be one of {KINDS}; got {self.kind!r}")
        if not self.source.strip():
            raise ValueError(f"threshold {self.name!r} needs a source")

    def text(self) -> str:
        """'name = value unit' as the rule line shows it."""
        return f"{self.name} = {self.value:g} {self.unit}".rstrip()

    def to_dict(self) -> dict:
        return asdict(self)


def cells(rules: dict[str, tuple[Threshold, ...]]) -> tuple[list[str], list[list[str]]]:
    """(head, rows) of a thresholds table: one row per threshold of every rule (rule name, threshold, value, kind,
    source)."""
    head = ["Rule", "Threshold", "Value", "Kind", "Source"]
    rows = [[rule, t.name, f"{t.value:g} {t.unit}".rstrip(), t.kind, t.source]
            for rule, ts in rules.items() for t in ts]
    return head, rows
