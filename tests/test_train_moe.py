"""Trainer x MoE: expert-load statistics land in log.jsonl, and the global-batch counts restart every optimizer step."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from gated_attention.moe import moe_blocks
from gated_attention.train.train_presets import tiny
from gated_attention.train.model_setup import build_model
from gated_attention.train.trainer import train


def test_tiny_moe_training_logs_load_stats_and_resets_balance_per_step(tmp_path):
    cfg = replace(tiny(), model="tiny-moe", steps=4, batch_size=4, seq_len=16, grad_accum=2, stats_every=2,
                  ckpt_every=0, eval_batches=1, eval_batch_size=2)
    built = []

    def factory(c, vocab_size):
        model = build_model(c, vocab_size)
        built.append(model)
        return model

    train(cfg, tmp_path / "run", model_factory=factory)
    recs = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    moe_layers = [f"model.layers.{i}.mlp" for i in range(built[0].config.num_hidden_layers)]
    for r in recs:
        assert ("moe" in r) == (r["step"] % 2 == 0)  # every stats_every steps
        assert r["aux_loss"] > 0
        if "moe" not in r:
            continue
        m = r["moe"]
        assert m["layers"] == moe_layers
        assert len(m["max_over_mean"]) == len(m["lb_loss"]) == len(m["z_loss"]) == len(moe_layers)
        assert all(x >= 1.0 for x in m["max_over_mean"])
        assert all(math.isfinite(x) and x > 0 for x in m["lb_loss"] + m["z_loss"])
        # the counts describe exactly this step's global batch (both micro-batches, nothing from earlier steps)
        assert m["tokens"] == cfg.batch_size * cfg.seq_len
    # after the last optimizer step the state was reset (the final eval runs in eval mode and adds nothing)
    assert all(block.balance.counts is None and block.balance.micro_batches == 0 for _, block in moe_blocks(built[0]))
