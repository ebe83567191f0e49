"""Whole conversions: `convert_state_dict` (in memory, through the native hub) and `convert_checkpoint` (folder to
folder), with the checkpoint-folder reading (`load_dir`: safetensors only, pickles refused) and atomic writing
(`save_dir`) they use; retrofit.py reads and writes through the same two functions.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..util.errors import UserError
from ..util.io import PICKLE_SUFFIXES, atomic_dir, json_dumps, load_hf_state, read_json_object
from .configs import check_native_for, config_from_native, config_to_native
from .layouts import FORMATS, ConversionError
from .states import state_from_native, state_to_native

# Files copied verbatim from SRC to DST (tokenizer and generation settings); weights and config are rewritten.
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json")


def convert_state_dict(config: dict, state: dict, src_format: str, dst_format: str = "native") -> tuple[dict, dict]:
    """In memory: (config.json dict, state dict) of `src_format` -> the same pair in `dst_format`."""
    for f in (src_format, dst_format):
        if f not in FORMATS:
            raise ConversionError(f"unknown checkpoint format {f!r}; valid: {', '.join(FORMATS)}")
    ncfg = config_to_native(config, src_format, state)
    nstate = state_to_native(state, ncfg, src_format)
    check_native_for(ncfg, dst_format)
    return config_from_native(ncfg, dst_format), state_from_native(nstate, ncfg, dst_format)


def check_checkpoint_dir(path: str | os.PathLike) -> Path:
    """`path` as a checkpoint directory: it exists, is a folder and holds config.json; else one ConversionError line
    naming what is missing (a training run folder is pointed to its final/ model). Cheap: reads no weights, so a
    command checks it before anything else it needs (export's tokenizer)."""
    path = Path(path)
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise ConversionError(f"{path} is a pickle file; pickles can run arbitrary code and are never loaded. "
                                  "Re-save the weights as safetensors (save_pretrained(safe_serialization=True))")
        raise ConversionError(f"{path} is a file; pass the checkpoint directory (config.json + *.safetensors)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        if (path / "final" / "config.json").is_file():
            raise ConversionError(f"{path} has no config.json: it is a training run folder, not a model; pass its "
                                  f"model, {path / 'final'}")
        raise ConversionError(f"{path} has no config.json, so it is not a model checkpoint; pass a checkpoint folder "
                              "(config.json + *.safetensors, e.g. a run's final/)")
    return path


def load_dir(path: str | os.PathLike) -> tuple[dict, dict]:
    """(config.json dict, state dict) from a checkpoint directory; safetensors only, pickles refused."""
    path = check_checkpoint_dir(path)
    cfg_file = path / "config.json"
    try:
        config = read_json_object(cfg_file, "config", "pass a checkpoint folder written by save_pretrained")
        if (path / "state" / ".metadata").is_file():  # a sharded training checkpoint (dist=fsdp): DCP shards
            return config, load_dcp_model_state(path / "state")
        state = load_hf_state(path)  # model.safetensors or the index's shards (confined to the folder), verified
    except UserError as exc:
        raise ConversionError(str(exc)) from None
    return config, state


def load_dcp_model_state(folder: str | os.PathLike) -> dict:
    """The full model state dict of a torch.distributed.checkpoint folder written by the trainer under dist=fsdp (at
    any world size), read in this one process: tensors shaped from the checkpoint's metadata, filled by DCP (no
    pickled code is read: DCP's tensor files and its metadata only)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    md = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not state:
        raise ConversionError(f"{folder} holds no model tensors (not a gattn training checkpoint)")
    with warnings.catch_warnings():  # one process reading on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader)
    return {k[len("model."):]: v for k, v in state.items()}


def save_dir(dst: str | os.PathLike, config: dict, state: dict, src: str | os.PathLike | None = None,
             overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors (+ tokenizer/generation files from `src`) atomically: into a temporary
    sibling directory, then renamed into place, so DST is never half-written."""
    from safetensors.torch import save_file

    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    with atomic_dir(dst, overwrite=True) as tmp:  # DST is the old folder or the complete new one, never half
        (tmp / "config.json").write_text(json_dumps(config, indent=2, sort_keys=True) + "\n")
        # save_file refuses shared storage; tensors from permutations are fresh, others may alias: clone those
        seen, clean = set(), {}
        for k, v in state.items():
            ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
            clean[k] = v.contiguous().clone() if ptr in seen or not v.is_contiguous() else v
            seen.add(ptr)
        save_file(clean, tmp / "model.safetensors", metadata={"format": "pt"})
        if src is not None:
            for name in COPY_FILES:
                if (Path(src) / name).is_file():
                    shutil.copy2(Path(src) / name, tmp / name)
    return dst


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, src_format: str, dst_format: str = "native",
                       overwrite: bool = False) -> Path:
    """Convert the checkpoint directory SRC (format `src_format`) into DST (format `dst_format`)."""
    config, state = load_dir(src)
    out_config, out_state = convert_state_dict(config, state, src_format, dst_format)
    return save_dir(dst, out_config, out_state, src=src, overwrite=overwrite)



def load_model(src: str | os.PathLike, src_format: str = "native"):
    """A built fp32 GatedQwen3ForCausalLM (eval mode) from checkpoint directory SRC in `src_format`, through the
    native hub: what functions applied to a model (GGUF export) start from."""
    import torch

    from ..configuration import GatedQwen3Config
    from ..modeling import GatedQwen3ForCausalLM

    config, state = load_dir(src)
    ncfg, nstate = convert_state_dict(config, state, src_format, "native")
    model = GatedQwen3ForCausalLM(GatedQwen3Config(**{k: v for k, v in ncfg.items() if k != "model_type"}))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in nstate.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:  # convert_state_dict validated the shapes; this guards the model's own names
        raise ConversionError(f"{src}: missing {missing[:5]}, unexpected {unexpected[:5]} after conversion")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(torch.float32).eval()
