"""gated-attention: gated softmax attention for LMs (Qiu et al. 2025, arXiv 2505.06708).

The public names below load on first use (PEP 562), so `import gated_attention` - and with it the `gattn` command's
parser - imports neither torch nor transformers. Importing the model (`from gated_attention import
GatedQwen3ForCausalLM`, or `import gated_attention.modeling`) registers `GatedQwen3Config` / `GatedQwen3ForCausalLM`
(model_type "gated_qwen3") with the transformers Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)` works on
our checkpoints. The package's layers (util, core model, interop, data, train, analysis, experiment, labs, jobs, cli)
are described in ARCHITECTURE.md.
"""
import importlib as _importlib
import logging as _logging

# transformers imports torchao when it is installed (the `quant` extra): torchao then warns about its CUDA-only
# kernels and torch about its enum registrations, four lines on every import on a CPU machine. Errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"

# public name -> the module that defines it (imported when the name is first read)
_HOMES = {"GatedQwen3Config": "configuration", "GatedQwen3Model": "modeling", "GatedQwen3ForCausalLM": "modeling",
          "GATES": "gates", "GateSpec": "gates", "get_gate": "gates"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
