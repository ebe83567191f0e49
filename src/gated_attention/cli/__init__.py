"""The `gattn` command: a thin table of subcommands over library functions (the CLI layer, the top of the package).

Each entry names the module of its command group here in `cli/`, which defines `configure_<name>(parser)` (adds the
options, each with help text) and `run_<name>(args) -> int` (`-` in a command name becomes `_`). Group modules are
imported only when one of their subcommands runs, and the options are built without torch or transformers (the
package's public names load on first use, and the command modules import the heavy parts inside `run_<name>`): so
`gattn --help`, any `--help` and a mistyped name answer at once (bench/bench_cli.py measures it;
tests/test_cli_startup.py checks that building the parsers imports no torch). Nothing below the CLI layer imports
from this package (tests/test_architecture.py checks it).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

from ..util.errors import Parser, handle

# name -> (module, one-line help). Adding a subcommand = one row here + configure_<name>/run_<name> in the module.
COMMANDS: dict[str, tuple[str, str]] = {
    "gates": ("gated_attention.cli.model", "List every gate variant and baseline with the parameters it adds."),
    "demo": ("gated_attention.cli.model", "Build a tiny gated model and generate a few tokens (smoke demo)."),
    "data": ("gated_attention.cli.data", "Prepare the offline corpus + BPE tokenizer (prepare), show its manifest (info)."),
    "train": ("gated_attention.cli.train", "Train a model (preset + --set overrides); also under torchrun with DDP/FSDP2."),
    "settings": ("gated_attention.cli.settings", "Every training setting (`--set KEY=VALUE`) with its default, choices and meaning."),
    "plan": ("gated_attention.cli.plan", "Before renting GPUs: a preset's parameters, FLOPs/token, memory per GPU, fit, days."),
    "eval": ("gated_attention.cli.train", "Per-domain and average perplexity and loss-by-position of a trained model."),
    "convert": ("gated_attention.cli.interop", "Convert checkpoints between official / qwen3 / qwen3-next / native layouts."),
    "export": ("gated_attention.cli.interop", "Export a checkpoint to a llama.cpp GGUF file (qwen35 for gated models, qwen3 ungated)."),
    "retrofit": ("gated_attention.cli.interop", "Add a gate to a trained ungated checkpoint (identity or random init)."),
    "lm-eval": ("gated_attention.cli.lm_eval", "Run lm-evaluation-harness (`lm-eval run --model hf ...`) on our checkpoints."),
    "analyze": ("gated_attention.cli.analyze", "Measure attention sinks, massive activations and gate statistics of a model."),
    "compare": ("gated_attention.cli.compare", "Train baseline vs gated variants, analyse them, write a Table-4 style report."),
    "extend": ("gated_attention.cli.longctx", "Extend a checkpoint's context without training (linear / dynamic / YaRN RoPE)."),
    "ruler": ("gated_attention.cli.longctx", "RULER-style long-context scores by length: JSON, table and plot."),
    "longctx": ("gated_attention.cli.longctx", "Table 5 in small: train baseline/gated at L, YaRN x4, RULER + PPL to 4L."),
    "lab": ("gated_attention.cli.lab", "Science labs: one effect of gated attention measured in minutes (`gattn lab --help` lists them)."),
}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="gattn",
        description="Gated attention for LMs (Qiu et al. 2025): models, training, analysis, long context.",
        epilog="`gattn COMMAND --help` explains a command's options; `gattn settings` lists every training setting.",
    )
    parser.add_argument("--version", action="version", version=f"gattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str):
    """(group module, configured parser) of `gattn NAME`: what main parses with (tests check documented commands)."""
    module = importlib.import_module(COMMANDS[name][0])
    sub = Parser(prog=f"gattn {name}", description=COMMANDS[name][1])  # one-line argparse errors, exit 2
    getattr(module, f"configure_{name.replace('-', '_')}")(sub)
    return module, sub


def unknown_command(word: str) -> str:
    """The one line for `gattn WORD` where WORD is no command: the closest command, else the valid ones."""
    option = word.startswith("-")
    what = f"unknown option {word!r}" if option else f"unknown command {word!r}"
    close = difflib.get_close_matches(word, ("--help", "--version") if option else COMMANDS, n=1)
    if close:
        return f"gattn: error: {what}; did you mean `{close[0]}`? (`gattn --help` lists the commands)"
    return f"gattn: error: {what}; valid commands: {', '.join(COMMANDS)}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from .. import __version__

        print(f"gattn {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(unknown_command(name), file=sys.stderr)
        return 2
    module, sub = command_parser(name)
    args = sub.parse_args(argv[1:])  # --help prints and exits here, before anything heavy is imported
    from ..util.quiet import quiet_dependencies

    quiet_dependencies()  # dependencies' bars would drown our own progress lines (workers and ranks inherit it)
    try:
        code = int(getattr(module, f"run_{name.replace('-', '_')}")(args) or 0)
    except BrokenPipeError:  # `gattn settings | head`: the reader left early; that is no error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise again
        return 1
    except Exception as exc:  # user errors: one line `gattn CMD: error: ...`, exit 2; bugs re-raise (errors.handle)
        return handle(name, exc)
    if "torch.distributed" in sys.modules:  # a torchrun rank that ended its process group exits here (dist.py)
        from ..train.dist import exit_process

        exit_process(code)
    return code
