"""`gattn lm-eval`: EleutherAI's lm-evaluation-harness on our checkpoints (optional extra: `pip install -e .[eval]`).

Why a wrapper: `lm_eval --model hf` loads models through transformers' Auto classes, which know model_type
"gated_qwen3" only after `import gated_attention.modeling` has registered it; the stock `lm_eval` process never imports us,
and `trust_remote_code` would need modelling code shipped inside every checkpoint. This command imports the model
(registering the Auto classes) and then hands its arguments, unchanged, to lm-eval's own CLI in the same process.

    gattn lm-eval run --model hf --model_args pretrained=RUN/final,dtype=float32 --tasks TASK --device cpu
    python -m gated_attention.cli.lm_eval --model hf ...   # the same, with lm-eval's legacy form (no `run`)

(Under `gattn`, the first word must be an lm-eval subcommand, `run`, `ls` or `validate`: gattn's argument parser
would otherwise read `--model` as one of its own options.) From Python: `import gated_attention.modeling` first, then call
`lm_eval.simple_evaluate(model="hf", model_args="pretrained=DIR", ...)`. The exported checkpoint (`RUN/final`)
already holds the tokenizer. Local tasks: `--include_path DIR` with a task YAML whose `dataset_path: json` reads a
local JSONL file; set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 to guarantee nothing is fetched.
"""
from __future__ import annotations

import argparse
import sys

LM_EVAL_SUBCOMMANDS = ("run", "ls", "validate")


def configure_lm_eval(parser: argparse.ArgumentParser) -> None:
    parser.usage = "gattn lm-eval {run,ls,validate} [lm-eval options ...]"
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                        help="passed unchanged to lm-eval: a subcommand (run, ls, validate) then its options, e.g. "
                             "run --model hf --model_args pretrained=RUN/final --tasks TASK --include_path DIR")


def lm_eval_main(argv: list[str]) -> int:
    """Register our model with transformers, then run lm-eval's CLI on `argv` in this process."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        raise ValueError(f"lm-evaluation-harness is not installed ({exc}); install the extra: pip install -e '.[eval]'") \
            from None
    import gated_attention.modeling  # noqa: F401  (registers the Auto classes)

    old = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse --help / errors inside lm-eval
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old
    return 0


def run_lm_eval(args) -> int:
    argv = list(args.lm_eval_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] not in LM_EVAL_SUBCOMMANDS:
        raise ValueError("start with an lm-eval subcommand: gattn lm-eval run --model hf --model_args pretrained=DIR "
                         "--tasks TASK ... (or use: python -m gated_attention.cli.lm_eval --model hf ...)")
    check_local_model(argv)
    return lm_eval_main(argv)


def check_local_model(argv: list[str]) -> None:
    """`pretrained=DIR` in --model_args naming a local folder: checked as a model folder first (config.json, intact
    weights), so a wrong folder is one line here rather than lm-eval's traceback from the model hub."""
    from pathlib import Path

    from ..util.io import check_hf_dir

    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--model_args" and i + 1 < len(argv) else \
            arg.split("=", 1)[1] if arg.startswith("--model_args=") else None
        for item in (value or "").split(","):
            key, _, path = item.partition("=")
            if key.strip() == "pretrained" and Path(path).is_dir():
                check_hf_dir(path, "model folder (pretrained=)")


if __name__ == "__main__":
    sys.exit(lm_eval_main(sys.argv[1:]))
