"""The hardware a plan (train/plan.py) assumes where it is not told: one 8 x H100-80GB node (the links between
GPUs: plan_comm.py), and the check of the figures a user gives. Its own module because `gattn plan`'s options show these defaults and the parser is built
without torch, which the planner imports."""
from __future__ import annotations

DEFAULTS = {"gpus": 8, "gpu_memory_gb": 80.0, "gpu_tflops": 989.0, "mfu": 0.4}  # one 8 x H100-80GB node, dense bf16


def assumed(**given) -> dict:
    """The hardware figures a plan assumes: each one given, else DEFAULTS', checked."""
    from ..util.errors import check_number

    hw = {k: DEFAULTS[k] if v is None else v for k, v in given.items()}
    check_number("gpus", hw["gpus"], kind=int, min=1)
    check_number("gpu_memory_gb", hw["gpu_memory_gb"], min=0.0, min_open=True)
    check_number("gpu_tflops", hw["gpu_tflops"], min=0.0, min_open=True)
    check_number("mfu", hw["mfu"], min=0.0, max=1.0, min_open=True)
    return hw
