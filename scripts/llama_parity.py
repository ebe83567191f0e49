"""Max |Δlogits| in fp32 (eager and sdpa, with and without left padding) per family and direction, over the tiny
random configs of tests/test_convert_llama.py (which asserts <= 1e-5). Run: .venv/bin/python scripts/llama_parity.py"""
import collections
import pathlib
import sys
import tempfile

import torch

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "support")]  # the test module and the harness it imports
import test_convert_llama as T
from gated_attention.interop import convert_checkpoint
torch.set_num_threads(1)
res = collections.defaultdict(float)
for fmt, kw in T.STOCK_CASES:
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        stock, src = T._stock(fmt, kw, d)
        convert_checkpoint(src, d / "n", fmt, "native")
        nat = T._load(d / "n")
        ids = torch.randint(0, 128, (2, T.SEQ)); mask = torch.ones_like(ids); mask[1, :3] = 0
        res[(fmt, "stock->native")] = max(res[(fmt, "stock->native")], T._max_diff(stock, nat, ids), T._max_diff(stock, nat, ids, mask))
for fmt, kw in T.NATIVE_CASES:
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        cfg, nat = T._native_model(**kw)
        nat.save_pretrained(d / "n")
        convert_checkpoint(d / "n", d / "s", "native", fmt)
        stock = T._load(d / "s")
        ids = torch.randint(0, 128, (2, T.SEQ)); mask = torch.ones_like(ids); mask[1, :3] = 0
        res[(fmt, "native->stock")] = max(res[(fmt, "native->stock")], T._max_diff(nat, stock, ids), T._max_diff(nat, stock, ids, mask))
for k, v in sorted(res.items()):
    print(f"{k[0]:8s} {k[1]:14s} max|dlogits| = {v:.3g}")
