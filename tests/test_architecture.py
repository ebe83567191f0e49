"""The package's layering, checked on its source (ast): every import, including those inside functions, points at the
same layer or a lower one; the module import graph has no cycle (a package's __init__ and its own submodules
included); nothing below the CLI imports the CLI; no shim answers an old name (renames go in CHANGELOG.md); source
files stay small. The layers are read from the one table in ARCHITECTURE.md, so the document and the check cannot drift."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "gated_attention"
ROOT = "gated_attention"


def read_layer_table(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """[(layer, module-name prefixes)] from ARCHITECTURE.md's table `| layer | where | what it is |`: the layer is the
    bold word of the first cell, the second cell lists paths under src/gated_attention/ in backticks (`x.py`,
    `folder/`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*layer\s*\|\s*where\s*\|", line))
    layers = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first, where, _ = line.strip().strip("|").split("|", 2)
        name = re.search(r"\*\*(.+?)\*\*", first).group(1)
        prefixes = []
        for path in re.findall(r"`([^`]+)`", where):
            assert path.endswith((".py", "/")), f"ARCHITECTURE.md layer {name}: {path!r} is not a file.py or a folder/"
            assert (PKG / path).exists(), f"ARCHITECTURE.md layer {name} lists {path}, which does not exist"
            mod = path[:-1] if path.endswith("/") else path[:-3]
            prefixes.append("" if mod == "__init__" else mod.replace("/", "."))
        layers.append((name, tuple(prefixes)))
    return layers


# layer -> module-name prefixes (after "gated_attention."); a module belongs to the longest matching prefix
LAYERS = read_layer_table((REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"))
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
MAX_LINES = 620  # "files under ~600 lines"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [ROOT, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(mod: str) -> str:
    short = mod[len(ROOT) + 1:] if mod != ROOT else ""
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for pre in prefixes:
            hit = short == pre or (pre and short.startswith(pre + "."))
            if hit and len(pre) > best_len:
                best, best_len = name, len(pre)
    if best is None:
        raise AssertionError(f"{mod} is in no layer: add its file or folder to the layer table in ARCHITECTURE.md")
    return best


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str) -> set[str]:
    """Package modules `mod` imports anywhere in its source (module level or inside functions)."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path.name == "__init__.py", node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            if t == ROOT or t.startswith(ROOT + "."):
                while t not in MODULES:  # `import gated_attention.x.y` of an attribute: its module
                    t = t.rsplit(".", 1)[0]
                if t != mod:
                    out.add(t)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_no_import_points_upward():
    bad = [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})"
           for m, ts in GRAPH.items() for t in sorted(ts) if RANK[layer_of(t)] > RANK[layer_of(m)]]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_library_never_imports_the_cli():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if layer_of(m) != "cli"
           for t in ts if layer_of(t) == "cli"]
    assert not bad, "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> imported modules) as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    """No cycle at all, including a package's __init__ <-> its own submodule: the __init__ that re-exports a submodule
    which imports the package back runs half-initialised (the convert <-> convert.llama cycle hid there)."""
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_rule_counts_package_submodule_cycles():
    pkg, sub = f"{ROOT}.pkg", f"{ROOT}.pkg.sub"
    assert find_cycle({pkg: {sub}, sub: {pkg}}) == [pkg, sub, pkg]
    assert find_cycle({pkg: {sub}, sub: set()}) is None


def test_training_does_not_depend_on_long_context():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith(f"{ROOT}.train") for t in ts
           if t.startswith(f"{ROOT}.longctx")]
    assert not bad, "\n".join(bad)


def test_cli_table_points_at_cli_modules():
    from gated_attention.cli import COMMANDS

    for name, (module, _) in COMMANDS.items():
        assert module.startswith(f"{ROOT}.cli.") and module in MODULES, (name, module)


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_source_files_are_small(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PKG)} has {n} lines; split it (ARCHITECTURE.md says where)"


def test_checker_sees_function_local_imports():
    """The walk must see imports inside functions (the cycles that started this test hid there)."""
    assert f"{ROOT}.mechanisms" in GRAPH[f"{ROOT}.configuration"]  # imported inside __post_init__
    assert f"{ROOT}.train.retrieval_mix" in GRAPH[f"{ROOT}.train.data_source"]  # inside make_source


def test_layer_table_is_read_from_architecture_md():
    names = [name for name, _ in LAYERS]
    assert names[0] == "util" and names[-1] == "cli" and "core" in names and "experiment" in names, names
    table = "| layer | where | what it is |\n|---|---|---|\n| **core** (the model) | `gates.py`, `data/` | text |\n"
    assert read_layer_table(table) == [("core", ("gates", "data"))]
    with pytest.raises(AssertionError, match="does not exist"):
        read_layer_table(table.replace("gates.py", "no_such_module.py"))


def _lazy_homes(tree: ast.Module) -> dict | None:
    """{name: submodule} of a package __init__ that loads its names on first use (`__getattr__, __dir__ =
    lazy_exports(__name__, HOMES)`, util/lazy.py), else None."""
    lazy = any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") ==
               "lazy_exports" for n in tree.body)
    homes = next((n.value for n in tree.body if isinstance(n, ast.Assign) and
                  any(isinstance(t, ast.Name) and t.id == "HOMES" for t in n.targets)), None)
    return ast.literal_eval(_plain_dict(homes)) if lazy and homes is not None else None


def _plain_dict(node: ast.expr) -> ast.expr:
    """HOMES written with `**dict.fromkeys((names), "module")` entries, as one literal dict node."""
    keys, values = [], []
    for k, v in zip(node.keys, node.values):
        if k is None:  # **dict.fromkeys(names, module)
            names, module = v.args
            keys += names.elts
            values += [module] * len(names.elts)
        else:
            keys.append(k)
            values.append(v)
    return ast.Dict(keys=keys, values=values)


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def test_no_shim_answers_an_old_name():
    """Renames ship with an entry in CHANGELOG.md, never a shim: no module answers names it does not define (a
    module-level __getattr__, except a package's lazy exports of the names its own submodules define - checked
    name by name), nothing issues a DeprecationWarning, no import hook redirects old module paths."""
    bad = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        homes = _lazy_homes(tree) if path.name == "__init__.py" else None
        for name, sub in (homes or {}).items():
            if not _defines(path.parent / f"{sub}.py", name):
                bad.append(f"{mod}: lazy export {name!r} is not defined in {mod}.{sub}")
        for node in tree.body:
            targets = [node.name] if isinstance(node, ast.FunctionDef) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] + \
                [e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)] \
                if isinstance(node, ast.Assign) else []
            bad += [f"{mod}: module-level __getattr__" for t in targets if t == "__getattr__" and homes is None]
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "DeprecationWarning":
                bad.append(f"{mod}:{node.lineno}: DeprecationWarning")
            if isinstance(node, ast.Attribute) and node.attr == "meta_path":
                bad.append(f"{mod}:{node.lineno}: sys.meta_path hook")
    assert not bad, "a rename gets a CHANGELOG.md entry instead of a shim:\n" + "\n".join(bad)
    assert "## 0.1.0" in (REPO / "CHANGELOG.md").read_text(encoding="utf-8")


def read_reuse_table(text: str) -> dict[str, list[str]]:
    """{job: [test ids]} from ARCHITECTURE.md's table `| job | stored under the rule | changed-setting test |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*job\s*\|.*\|\s*changed-setting test\s*\|", line))
    jobs = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        job, _, tests = line.strip().strip("|").split("|")
        jobs[re.search(r"`(gattn [^`]+)`", job).group(1)] = re.findall(r"`(tests/[^`]+::\w+)`", tests)
    return jobs


def test_every_job_names_its_changed_setting_test():
    """ARCHITECTURE.md's reuse section lists every multi-run job and every lab, each with a test that exists (a test
    that changes a setting of a stored result and checks the stated policy)."""
    from gated_attention.cli.lab import LABS

    jobs = read_reuse_table((REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    want = {"gattn compare", "gattn longctx", *(f"gattn lab {name}" for name in LABS)}
    missing = sorted(want - set(jobs))
    assert not missing, f"ARCHITECTURE.md's reuse table has no row for {missing}: add the job and its test"
    for job, tests in jobs.items():
        assert tests, f"ARCHITECTURE.md's reuse table names no test for {job}"
        for t in tests:
            path, name = t.split("::")
            assert (REPO / path).exists() and re.search(rf"^def {name}\(", (REPO / path).read_text(encoding="utf-8"),
                                                        re.M), f"{job}: {t} does not exist"


def test_tests_build_models_and_processes_through_the_harness():
    """No test constructs a causal LM itself (ours or a stock transformers one) or spells a `gattn` / torchrun command
    line: tests/support/harness.py's build_lm / tiny_lm / stock_lm and run_gattn / gattn_argv / torchrun_argv do,
    seeded, perturbed and launched the one way (loading a model with from_pretrained is fine)."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):  # the test files, tests/support/ and tests/probes/
        if path in (REPO / "tests" / "support" / "harness.py", Path(__file__).resolve()):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name.endswith(("ForCausalLM", "LMHeadModel")) or name == "from_config":
                    bad.append(f"{path.name}:{node.lineno} {name}(...)")
            elif isinstance(node, ast.Constant) and node.value in ("gated_attention.cli", "torch.distributed.run"):
                bad.append(f"{path.name}:{node.lineno} a command line of its own ({node.value})")
    assert not bad, ("build a model with harness.build_lm / tiny_lm / stock_lm, a CLI process with harness.run_gattn /"
                     " gattn_argv / torchrun_argv:\n" + "\n".join(bad))


def test_a_converter_format_is_one_layout_row():
    """ARCHITECTURE.md 'Where to add a converter format': the Layout row is the only list to edit; the CLI choices of
    `gattn convert` and `gattn retrofit --from` follow it."""
    from gated_attention.cli import command_parser
    from gated_attention.interop import layouts
    from gated_attention.interop.retrofit import SOURCE_FORMATS

    assert layouts.FORMATS == ("native", *layouts.LAYOUTS)
    ungated = {name for name, layout in layouts.LAYOUTS.items() if "none" in layout.gates}
    assert set(SOURCE_FORMATS) == {"auto", "native"} | ungated and "qwen3-next" not in SOURCE_FORMATS
    for cmd, dest, want in (("convert", "src_format", layouts.FORMATS), ("retrofit", "src_format", SOURCE_FORMATS)):
        _, parser = command_parser(cmd)
        action = next(a for a in parser._actions if a.dest == dest)
        assert tuple(action.choices) == tuple(want)


def _lab_of(mod: str) -> str | None:
    """The lab a module belongs to (gated_attention.labs.<lab>...), else None."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "labs" else None


def private_lab_imports(mod: str, source: str, is_pkg: bool = False) -> list[str]:
    """`from <another lab's module> import _name` in a module's source (anywhere: module level or in a function)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve(mod, is_pkg, node)
        lab = _lab_of(target)
        if lab is None or lab == _lab_of(mod):
            continue
        bad += [f"{mod}:{node.lineno} imports {a.name} from {target}" for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_lab_imports_another_labs_private_names():
    """A lab's `_private` names are its own: what another lab (or any module outside it) needs is a public name in a
    shared home (experiment/stats.py's seed_curves, say), never an import of `_name` across labs."""
    bad = [b for mod, path in MODULES.items()
           for b in private_lab_imports(mod, path.read_text(encoding="utf-8"), path.name == "__init__.py")]
    assert not bad, "move the name to a shared module (experiment/, util/) or make it public:\n" + "\n".join(bad)
    # the check sees what it must: a retrofit module reaching into the sink lab, in a function, relatively
    src = "def f():\n    from ..sinks.sink_report import _curves, table_cells\n"
    assert private_lab_imports("gated_attention.labs.retrofit.retrofit_report", src) == [
        "gated_attention.labs.retrofit.retrofit_report:2 imports _curves from gated_attention.labs.sinks.sink_report"]
    assert private_lab_imports("gated_attention.labs.sinks.sink_lab", "from .metrics import _x\n") == []


def _budget_tables() -> dict[str, dict]:
    """{module: its BUDGETS} for every module of the package that defines a module-level BUDGETS table."""
    import importlib

    found = {}
    for mod, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            target = node.target if isinstance(node, ast.AnnAssign) else \
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id == "BUDGETS":
                found[mod] = importlib.import_module(mod).BUDGETS
    return found


def test_one_budget_shape_and_one_table_of_default_variants():
    """Every job's budgets are one shape: a frozen dataclass per job (budgets derived from each other with
    dataclasses.replace), never a tuple or a dict of changes; and gates.DEFAULT_VARIANTS is the one table of default
    variants (the jobs import it; no other module defines its own)."""
    import dataclasses

    from gated_attention import gates

    tables = _budget_tables()
    assert {"gated_attention.compare.job", "gated_attention.longctx.pipeline", "gated_attention.labs.sinks.sink_lab",
            "gated_attention.labs.stability.stability_lab"} <= set(tables), sorted(tables)
    for mod, budgets in tables.items():
        assert isinstance(budgets, dict) and budgets, mod
        for name, b in budgets.items():
            assert dataclasses.is_dataclass(b) and not isinstance(b, type), f"{mod}.BUDGETS[{name!r}] is {type(b)}"
            assert type(b).__dataclass_params__.frozen, f"{mod}.BUDGETS[{name!r}]: {type(b).__name__} is not frozen"
        assert len({type(b) for b in budgets.values()}) == 1, f"{mod}.BUDGETS mixes budget types"
    defined = []
    for mod, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else \
                node.targets if isinstance(node, ast.Assign) else []
            defined += [mod for t in targets if isinstance(t, ast.Name) and t.id == "DEFAULT_VARIANTS"]
    assert defined == ["gated_attention.gates"], f"DEFAULT_VARIANTS defined in {defined}; import gates.DEFAULT_VARIANTS"
    from gated_attention import compare
    from gated_attention.labs import sinks, stability

    for default in (compare.DEFAULT_VARIANTS, sinks.DEFAULT_VARIANTS, stability.DEFAULT_VARIANTS,
                    tuple(sinks.SinkLabConfig().variants), stability.LabConfig().variants):
        assert tuple(default) == gates.DEFAULT_VARIANTS


def optimizer_use(mod: str, src: str) -> list[str]:
    """Where module `mod` builds an optimizer (anything under torch.optim), steps one (`<...opt...>.step()`) or
    backpropagates (`.backward(`): what only the one training loop, train/, may do."""
    bad = []
    for node in sorted((n for n in ast.walk(ast.parse(src)) if hasattr(n, "lineno")), key=lambda n: n.lineno):
        where = f"{mod}:{node.lineno}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.optim"):
            bad.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr == "optim" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            bad.append(f"{where} uses torch.optim")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            recv = ast.unparse(node.func.value)
            if node.func.attr == "backward":
                bad.append(f"{where} calls {recv}.backward()")
            elif node.func.attr == "step" and not node.args and "opt" in recv.lower():
                bad.append(f"{where} calls {recv}.step()")
    return bad


def test_no_optimizer_step_outside_the_training_loop():
    """One loop (issue 27): every model any command trains goes through train.trainer.train; a lab's needs are its
    plug-ins (train/plugins.py), never an optimizer or a backward pass of its own."""
    bad = [b for mod, path in MODULES.items() if not mod.startswith(f"{ROOT}.train.")
           for b in optimizer_use(mod, path.read_text(encoding="utf-8"))]
    assert not bad, "train through train.trainer.train (with plug-ins) instead:\n" + "\n".join(bad)
    # the check sees a lab loop of the old kind, also inside a function
    loop = ("def f(model, loss):\n    import torch\n    opt = torch.optim.AdamW(model.parameters())\n"
            "    loss.backward()\n    opt.step()\n")
    assert [b.split(" ", 1)[1] for b in optimizer_use("m", loop)] == [
        "uses torch.optim", "calls loss.backward()", "calls opt.step()"]
    assert optimizer_use("m", "from torch.optim import AdamW\nscheduler.step(3)\n") == [
        "m:1 imports from torch.optim"]
