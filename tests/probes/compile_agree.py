"""Run under torchrun by tests/test_distributed.py: a 2-rank run with compile=auto where the ranks' step timings
disagree (faked: rank 0 sees 100 s steps, every other rank 0.01 s), so each rank's own rule would decide differently.
Writes RESULT_PREFIX.rankN.json: that rank's speed record (compiled or not, the decision line).

    torchrun --nproc_per_node=2 tests/probes/compile_agree.py OUT_DIR RESULT_PREFIX

The compile cost is taken as 30 s flat (COMPILE_COST_STEPS=0) so a 100 s step pays within the run's few steps, and
the layers compile with the aot_eager backend (the same tracing, no C++ build).
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from gated_attention.train import fastpath, trainer
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.overrides import apply_overrides

    out, prefix = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    fastpath.COMPILE_COST_STEPS = 0.0
    plans = []
    prepare, observe = fastpath.prepare, fastpath.SpeedPlan.observe

    def _prepare(*args, **kwargs):
        plan = prepare(*args, **kwargs)
        plan.backend = "aot_eager"
        plans.append(plan)
        return plan

    def _observe(self, step_s, steps_left, *args, **kwargs):
        return observe(self, 100.0 if rank == 0 else 0.01, steps_left, *args, **kwargs)

    fastpath.prepare = _prepare
    fastpath.SpeedPlan.observe = _observe
    cfg = apply_overrides(tiny(), ["steps=6", "precision=fp32", "compile=auto", "stats_every=0", "ckpt_every=0"])
    trainer.train(cfg, out)
    with open(f"{prefix}.rank{rank}.json", "w") as fh:
        json.dump(plans[0].describe(), fh)


if __name__ == "__main__":
    main()
    from gated_attention.train.dist import exit_process

    exit_process(0)  # a rank whose group ended: no interpreter finalization (train/dist.py says why)
