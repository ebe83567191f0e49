"""Price a scaling ladder on the slow CPU kind: retrain one stored unit per size with the CPU kernels limited to AVX2
and compare its CPU seconds and final loss with the stored run.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/scaling_avx2_cost.py --units results/scaling_confirm/units --data-dir DATA --out OUT

The environment variables must be set before Python starts (the kernels are chosen at import); the script refuses to
run without them. --data-dir: the corpus the units were trained on (its path is part of each unit's key, so give the
same folder, prepared with `gattn data prepare` if missing). Writes OUT/avx2_cost.json: per unit the stored and the
AVX2-kernel CPU seconds, their ratio, both final losses and the load before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", required=True, help="a ladder's units folder (one sub-folder with result.json per unit)")
    ap.add_argument("--data-dir", required=True, help="the corpus the units were trained on (same path as stored)")
    ap.add_argument("--out", required=True, help="where the retrained units and avx2_cost.json go")
    ap.add_argument("--seed", type=int, default=101, help="the confirm seed whose baseline unit is retrained per size")
    ap.add_argument("--heldout", nargs="*", default=["/usr/share/common-licenses/GPL-3"],
                    help="the held-out files the ladder used (part of the unit's key)")
    args = ap.parse_args(argv)
    if any(not os.environ.get(k) for k in KERNEL_ENV):
        print(f"scaling_avx2_cost: set {', '.join(KERNEL_ENV)} (e.g. avx2 / AVX2 / AVX2) before starting Python",
              file=sys.stderr)
        return 2
    from gated_attention.labs.scaling import scaling_lab as sl

    units = sorted(Path(args.units).glob(f"baseline_*_s{args.seed}*"))
    if not units:
        print(f"scaling_avx2_cost: no baseline unit of seed {args.seed} in {args.units}", file=sys.stderr)
        return 2
    rows = []
    for unit in units:
        stored = json.loads((unit / "result.json").read_text())
        key = {k: v for k, v in stored["key"].items() if k not in ("heldout", "code")}
        key["data_dir"] = args.data_dir
        out = Path(args.out) / "runs" / unit.name
        shutil.rmtree(out, ignore_errors=True)
        load0 = os.getloadavg()[0]
        r = sl.train_unit((key, str(out), args.heldout, 16, False))
        rows.append({"unit": unit.name, "cpu_s_stored": stored["cpu_s_this_process"],
                     "cpu_s_avx2": r["cpu_s_this_process"],
                     "ratio": r["cpu_s_this_process"] / stored["cpu_s_this_process"],
                     "val_loss_stored": stored["val_loss"], "val_loss_avx2": r["val_loss"],
                     "load_before": load0, "load_after": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "avx2_cost.json").write_text(json.dumps(
        {"rows": rows, "env": {k: os.environ[k] for k in KERNEL_ENV}, "cpu": platform.processor(), "threads": 1,
         "precision": "fp32", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
