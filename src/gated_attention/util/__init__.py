"""The base layer: what every other layer may use, importing nothing of the model.

errors.py (the one user-error path: UserError, argparse validators, the CLI's one-line handler), io.py (atomic
writes, strict JSON and JSONL, folder locks, HF weight-folder reading), progress.py (the one progress reporter of
long loops), precision.py (the numerics chosen by the hardware: precision="auto").
"""
