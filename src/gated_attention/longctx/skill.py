"""Train-until-skill for `gattn longctx`: a held-out retrieval check run during training, and the stopping rule on it.

Table 5 compares how much retrieval survives a training-free context extension, so every model must first have the
skill at its training length L; a fixed step count does not give that (copying appears suddenly, at a different step
per model and seed). `SkillStop` scores the model every `every` steps on held-out samples at L and stops training the
first time the score reaches the threshold; the step it was reached is recorded (OUT/runs/<model>/skill.jsonl) and is
itself a measurement (how fast each gate variant learns to copy).

The check is teacher-forced: one forward over prompt + answer, a sample counts when every answer token is the argmax.
That is exactly the condition under which greedy decoding writes the answer first (and string match scores it), at
the cost of one forward per sample instead of a decoding loop.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..util.io import append_jsonl, read_json_object, read_jsonl
from . import ruler

# held-out samples: a seed namespace of their own, so the check never sees the final evaluation's samples (seed)
# nor the training rows (ruler.training_samples' "train" namespace)
HELDOUT_SALT = 7_770_000


class PasskeyScorer:
    """Teacher-forced exact match (fraction in [0, 1]) and answer NLL of `task` at `length` on `samples` samples."""

    def __init__(self, tokenizer, length: int, samples: int, seed: int, task: str = "passkey"):
        self.items = []
        for i in range(samples):
            s = ruler.generate_sample(task, tokenizer, length, HELDOUT_SALT + seed, i)
            prompt = ruler.encode(tokenizer, s["prompt"])
            # the answer without the closing period: the tokens greedy decoding must produce for a string match
            answer = list(tokenizer.tokenizer.encode(" " + ", ".join(s["answers"]), add_special_tokens=False))
            self.items.append((prompt, answer))

    @torch.no_grad()
    def __call__(self, model) -> dict:
        was_training = model.training
        model.eval()
        hits, nll = 0, 0.0
        device = next(model.parameters()).device
        for prompt, answer in self.items:
            ids = torch.tensor([prompt + answer], device=device)  # (1, T)
            logits = model(input_ids=ids[:, :-1], logits_to_keep=len(answer)).logits[0].float()  # (A, V)
            target = ids[0, -len(answer):]  # (A,)
            hits += int(bool((logits.argmax(-1) == target).all()))
            nll += float(torch.nn.functional.cross_entropy(logits, target))
        model.train(was_training)
        return {"exact_match": hits / len(self.items), "answer_nll": nll / len(self.items)}


class SkillStop:
    """A trainer step_hook: every `every` steps score the model; stop once exact_match >= threshold.

    Every check is appended to `log_path` (one JSON object per line: step, exact_match, answer_nll); a resumed run
    appends again from its checkpoint, and `read_skill_log` keeps the last record per step.
    """

    def __init__(self, scorer, every: int, threshold: float, log_path: Path | None = None, log=print):
        if every < 1:
            raise ValueError(f"skill check interval {every} must be >= 1 step")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"--until-skill {threshold} must be a fraction in (0, 1], e.g. 0.9")
        self.scorer, self.every, self.threshold = scorer, int(every), float(threshold)
        self.log_path = Path(log_path) if log_path is not None else None
        self.log = log

    def __call__(self, step: int, model) -> str | None:
        if step % self.every:
            return None
        res = self.scorer(model)
        rec = {"step": int(step), "exact_match": float(res["exact_match"]),
               "answer_nll": None if res.get("answer_nll") is None else float(res["answer_nll"])}
        if self.log_path is not None:
            append_jsonl(self.log_path, rec)
        nll = "" if rec["answer_nll"] is None else f", answer NLL {rec['answer_nll']:.3f}"
        self.log(f"[longctx] step {step}: held-out skill {100 * rec['exact_match']:.0f}%{nll}")
        if rec["exact_match"] >= self.threshold:
            return f"skill reached: held-out exact match {rec['exact_match']:.3f} >= {self.threshold} at step {step}"
        return None


def read_skill_log(path: Path) -> list[dict]:
    """The checks of one run in step order (the last record wins for a step checked twice across a resume; a line cut
    by a kill mid-write is skipped)."""
    by_step = {rec["step"]: rec for rec in read_jsonl(path)}
    return [by_step[k] for k in sorted(by_step)]


def steps_to_skill(checks: list[dict], threshold: float, steps_run: int | None = None) -> int | None:
    """First checked step with exact_match >= threshold (None: not reached), ignoring checks past `steps_run`."""
    for rec in checks:
        if steps_run is not None and rec["step"] > steps_run:
            break
        if rec["exact_match"] >= threshold - 1e-12:
            return int(rec["step"])
    return None


def training_outcome(run_dir: Path, skill: dict | None) -> dict:
    """steps_run, the held-out checks and steps_to_skill (None: not reached, or no stopping rule) of a finished run."""
    summary = read_json_object(run_dir / "summary.json", "run summary", "delete that run folder to retrain it")
    checks = read_skill_log(run_dir / "skill.jsonl")
    steps_run = int(summary["steps"])
    reached = steps_to_skill(checks, skill["until_skill"], steps_run) if skill else None
    return dict(steps_run=steps_run, until_skill=skill["until_skill"] if skill else None, steps_to_skill=reached,
                checks=[c for c in checks if c["step"] <= steps_run], wall_time_s=summary.get("wall_time_s"))


def training_progress(run_dir: Path, skill: dict | None) -> dict | None:
    """An unfinished run's state for a partial report: steps logged so far and its held-out checks (None: not begun)."""
    log_path = run_dir / "log.jsonl"
    if not log_path.exists():
        return None
    steps = sum(1 for line in log_path.read_text().splitlines() if line.strip())
    return dict(steps_run=steps, until_skill=skill["until_skill"] if skill else None, steps_to_skill=None,
                checks=read_skill_log(run_dir / "skill.jsonl"), wall_time_s=None, finished=False)
