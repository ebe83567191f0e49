"""gated-attention: gated softmax attention for LMs (Qiu et al. 2025, arXiv 2505.06708).

The public names below load on first use (util/lazy.py), so `import gated_attention` - and with it the `gattn`
command's parser - imports neither torch nor transformers. Importing the model (`from gated_attention import
GatedQwen3ForCausalLM`, or `import gated_attention.modeling`) registers `GatedQwen3Config` / `GatedQwen3ForCausalLM`
(model_type "gated_qwen3") with the transformers Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)` works on
our checkpoints. The package's layers (util, core model, interop, data, train, analysis, experiment, labs, jobs, cli)
are described in ARCHITECTURE.md.
"""
import logging as _logging

from .util.lazy import lazy_exports

# transformers imports torchao when it is installed (the `quant` extra): torchao then warns about its CUDA-only
# kernels and torch about its enum registrations, four lines on every import on a CPU machine. Errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"

HOMES = {"GatedQwen3Config": "configuration", "GatedQwen3Model": "modeling", "GatedQwen3ForCausalLM": "modeling",
         "GATES": "gates", "GateSpec": "gates", "get_gate": "gates"}
__all__ = list(HOMES)
__getattr__, __dir__ = lazy_exports(__name__, HOMES)
