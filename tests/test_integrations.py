"""Integrations exercised (CI installs their extras and sets GATTN_REQUIRE_EXTRAS=1, so these run there, not skip):
TensorBoard events written by our trainer, and transformers' own `Trainer` training a gated model and round-tripping
it through save_pretrained / from_pretrained."""
from __future__ import annotations

import json

import pytest
import torch
from _extras import need

import gated_attention.modeling  # noqa: F401  (registers the Auto classes)
from gated_attention import GatedQwen3ForCausalLM
from gated_attention.train.train_presets import tiny
from gated_attention.train.trainer import train
from harness import tiny_lm


def test_tensorboard_events_match_the_jsonl_log(tmp_path):
    need("tensorboard", "pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny()
    cfg.steps, cfg.ckpt_every, cfg.stats_every, cfg.tensorboard, cfg.precision = 5, 0, 0, True, "fp32"
    train(cfg, tmp_path / "run")
    log = [json.loads(l) for l in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert (tmp_path / "run" / "tb").is_dir(), "the trainer wrote no TensorBoard events"
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= tags
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in log] == list(range(5))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in log], rel=1e-6)
    assert [e.value for e in acc.Scalars("lr")] == pytest.approx([r["lr"] for r in log], rel=1e-6)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16, seq: int = 16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_hf_trainer_trains_a_gated_model_and_round_trips(tmp_path):
    need("accelerate", "transformers' Trainer needs accelerate: pip install -e '.[eval]'")
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = tiny_lm("sdpa_elementwise", backend=None, match_params=None, eval=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size))
    result = trainer.train()
    assert result.global_step == 4
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(l == l and 0 < l < 20 for l in losses)  # finite cross-entropies
    after = model.state_dict()
    gate_keys = [k for k in after if ".self_attn.gate.proj." in k]
    assert gate_keys and all(not torch.equal(before[k], after[k]) for k in gate_keys)  # the gate trained too
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert isinstance(loaded, GatedQwen3ForCausalLM) and loaded.config.gate == "sdpa_elementwise"
    ids = _Tokens(model.config.vocab_size).ids[:2]
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded.eval()(ids).logits)
    # and the reloaded model keeps training under Trainer (optimizer state is fresh, the weights carry over)
    trainer2 = Trainer(model=loaded, args=args, train_dataset=_Tokens(model.config.vocab_size))
    assert trainer2.train().global_step == 4
