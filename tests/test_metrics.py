"""Per-step memory / TFLOP/s / MFU and profiler traces (train/metrics.py, issue 38 item 6).

Nothing here depends on a timing: MFU is checked as arithmetic against a fixed peak (`peak_tflops`), memory against
an allocation of known size, the profiler by the files it writes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gated_attention.train import metrics as M


def test_rss_peak_reflects_a_known_allocation():
    cur0, _ = M.rss_bytes()
    size = 600 * 2**20
    block = np.ones(size // 8)  # written: every page resident
    cur1, peak1 = M.rss_bytes()
    assert cur1 >= cur0 + 0.9 * size
    assert peak1 >= cur0 + 0.9 * size  # the high-water mark saw the block
    del block
    cur2, peak2 = M.rss_bytes()
    assert cur2 < cur1 - 0.5 * size and peak2 >= cur0 + 0.9 * size  # freed: current falls back, the peak stays
    rec = M.memory_record(torch.device("cpu"))
    assert set(rec) == {"rss_gb", "rss_peak_gb"} and rec["rss_peak_gb"] * 1e9 >= cur0 + 0.9 * size


def test_mfu_is_achieved_over_peak():
    meter = M.StepMeter(device=torch.device("cpu"), world_size=4, flops_per_token=3_000_000,
                        peak=(2.0, "set (peak_tflops)"))
    rec = meter.record({"step": 7, "tokens_per_s": 80_000.0})
    assert rec["tflops"] == pytest.approx(80_000 * 3e6 / 4 / 1e12)  # per device: the run's tokens over 4 ranks
    assert rec["mfu"] == pytest.approx(rec["tflops"] / 2.0)
    assert "mfu" not in M.StepMeter(device=torch.device("cpu"), world_size=1, flops_per_token=10,
                                    peak=(None, "unknown")).record({"step": 0, "tokens_per_s": 5.0})


def test_flops_per_token_is_the_planners(tiny_model):
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.model_setup import build_model
    from gated_attention.train.plan import plan

    cfg = tiny()
    model = build_model(cfg, 256)
    p = plan(cfg, vocab_size=256, gpus=1, device="cpu")
    assert M.model_flops_per_token(model, cfg.seq_len) == p["flops_per_token"]
    assert M.model_flops_per_token(torch.nn.Linear(3, 3), 16) is None  # not our LM: no MFU rather than a guess


def test_gpu_peak_comes_from_the_table_by_device_name(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, precision, want in (("NVIDIA H100 80GB HBM3", "bf16-params", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
                                  ("NVIDIA H200", "bf16", 989.4), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert M.device_peak_tflops(cuda, precision)[0] == want
    monkeypatch.setattr(M, "_tf32_allowed", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L4")
    assert M.device_peak_tflops(cuda, "fp32") == (30.3, "nominal L4 fp32 dense")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Future GPU")
    peak, why = M.device_peak_tflops(cuda, "bf16")
    assert peak is None and "peak_tflops" in why
    assert M.device_peak_tflops(cuda, "bf16", override=123.0)[0] == 123.0
    monkeypatch.setattr(M, "_tf32_allowed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-PCIE-40GB")
    assert M.device_peak_tflops(cuda, "fp32")[0] == 156.0  # fp32 matmuls that may run as TF32


def test_cpu_peak_is_measured_in_the_gemm_the_run_uses(monkeypatch):
    """Not a timing assertion: which GEMM is measured (a bf16 run whose GEMMs are emulated runs fp32 ones)."""
    calls = []
    monkeypatch.setattr(M, "measured_cpu_tflops", lambda kind, threads: calls.append(kind) or 1.0)
    monkeypatch.setenv("GATTN_BF16_GEMM", "emulated")
    assert "bf16 emulated" in M.device_peak_tflops(torch.device("cpu"), "bf16")[1]
    monkeypatch.setenv("GATTN_BF16_GEMM", "native")
    M.device_peak_tflops(torch.device("cpu"), "bf16-params")
    M.device_peak_tflops(torch.device("cpu"), "fp32")
    assert calls == ["fp32", "bf16", "fp32"]


def test_profile_steps_parse():
    assert M.parse_profile_steps("") is None and M.parse_profile_steps("3") == (3, 3)
    assert M.parse_profile_steps("2-5") == (2, 5)
    for bad in ("5-2", "a-b", "1-", "-3"):
        with pytest.raises(ValueError, match="profile_steps"):
            M.parse_profile_steps(bad)


def test_a_run_ending_inside_the_profile_window_keeps_its_trace(tmp_path):
    prof = M.StepProfiler((0, 10), tmp_path, rank=0, device=torch.device("cpu"))
    for step in range(2):
        prof.before(step)
        torch.ones(8, 8) @ torch.ones(8, 8)
        assert prof.after(step) is None  # inside the window: nothing written yet
    prof.close()
    summary = json.loads((tmp_path / "profile" / "rank0" / "summary.json").read_text())
    assert summary["steps"] == [0, 1] and (tmp_path / "profile" / "rank0" / "trace.json").stat().st_size > 0


def test_log_lines_carry_memory_tflops_mfu_and_the_profiler_writes_a_trace(tmp_path, monkeypatch):
    from gated_attention.train import logs
    from gated_attention.train.overrides import apply_overrides
    from gated_attention.train.train_presets import tiny
    from gated_attention.train.trainer import train

    scalars: dict[int, set] = {}
    monkeypatch.setattr(logs.TensorBoard, "log", lambda self, step, values: scalars.setdefault(step, set(values)))
    cfg = apply_overrides(tiny(), ["steps=4", "device=cpu", "precision=fp32", "compile=false", "peak_tflops=0.5",
                                   "profile_steps=1-2", "ckpt_every=0", "stats_every=0"])
    summary = train(cfg, tmp_path)
    lines = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    fpt = summary["throughput"]["flops_per_token"]
    assert fpt and summary["throughput"]["peak_tflops"] == 0.5
    for rec in lines:
        assert {"rss_gb", "rss_peak_gb", "tokens_per_s", "tflops", "mfu"} <= set(rec)
        assert rec["rss_peak_gb"] >= rec["rss_gb"] > 0.05
        assert rec["tflops"] == pytest.approx(rec["tokens_per_s"] * fpt / 1e12)
        assert rec["mfu"] == pytest.approx(rec["tflops"] / 0.5)
        assert {"rss_gb", "tflops", "mfu"} <= scalars[rec["step"]]  # the same figures go to TensorBoard
    assert [("comm_s" in r) for r in lines] == [False, False, True, False]  # at the window's last step
    trace = json.loads((tmp_path / "profile" / "rank0" / "trace.json").read_text())
    assert trace["traceEvents"]
    prof = json.loads((tmp_path / "profile" / "rank0" / "summary.json").read_text())
    assert prof["steps"] == [1, 2] and prof["comm_s_per_step"] == lines[2]["comm_s"] >= 0
    assert any("aten::" in k for k in prof["top_ops_self_cpu_s"])  # it recorded the steps' ops
