"""gated-attention: gated softmax attention for LMs (Qiu et al. 2025, arXiv 2505.06708).

Importing the package registers `GatedQwen3Config` / `GatedQwen3ForCausalLM` (model_type "gated_qwen3") with the
transformers Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)` works on our checkpoints. The package's layers
(util, core model, interop, data, train, analysis, experiment, labs, jobs, cli) are described in ARCHITECTURE.md.
"""
import logging as _logging

# transformers imports torchao when it is installed (the `quant` extra): torchao then warns about its CUDA-only
# kernels and torch about its enum registrations, four lines on every import on a CPU machine. Errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from .configuration import GatedQwen3Config
from .gates import GATES, GateSpec, get_gate
from .modeling import GatedQwen3ForCausalLM, GatedQwen3Model

__version__ = "0.1.0"

AutoConfig.register(GatedQwen3Config.model_type, GatedQwen3Config, exist_ok=True)
AutoModel.register(GatedQwen3Config, GatedQwen3Model, exist_ok=True)
AutoModelForCausalLM.register(GatedQwen3Config, GatedQwen3ForCausalLM, exist_ok=True)

__all__ = ["GatedQwen3Config", "GatedQwen3Model", "GatedQwen3ForCausalLM", "GATES", "GateSpec", "get_gate"]
