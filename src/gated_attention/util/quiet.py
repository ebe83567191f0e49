"""Dependencies' own console output off inside the project's commands: transformers' "Loading weights" /
"Writing model shards" bars and the hub's and datasets' bars would interleave with the project's progress lines.
Warnings stay on: a dependency's warning on a normal run is a bug to fix at its cause, not to hide.

The switches are environment variables as well as in-process state, so that worker processes (spawned pools,
torchrun ranks) started after the call inherit them; a variable the user set explicitly is left as it is.
"""
from __future__ import annotations

import os
import sys

_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's tqdm (transformers' bars follow it at import)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' map/save_to_disk bars (data preparation readers)
}


def quiet_dependencies() -> None:
    """Turn the dependencies' progress bars and chatter off for this process and the processes it starts."""
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules:  # an already-imported transformers read the variable at import only
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
