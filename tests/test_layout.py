"""The package's layout rules (docs/ARCHITECTURE.md): an acyclic import graph in which the runtime
never depends on the simulator, the core never on the integration with DeepSpeed's engines and
modules, the policy never on torch, and the scheduler process starts without torch or DeepSpeed;
DeepSpeed's private names are reached in `integration/seams.py` only."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "deepspeed_feplb"
PACKAGE = "deepspeed_feplb"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str:
    """The package module an import of ``name`` executes last (``a.b.C`` -> ``a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> set:
    """Every module (ours or third-party, top-level name) that ``module`` imports, at any depth of its code."""
    path = MODULES[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[:len(base) - node.level + (path.name == "__init__.py")]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            for alias in node.names:
                found.add(f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix)
    return {_resolve(n) if n.startswith(PACKAGE) else n.split(".")[0] for n in found} - {module}


GRAPH = {m: {n for n in imports_of(m) if n in MODULES} for m in MODULES}


def closure(module: str) -> set:
    """Every module ``module`` may import, ours and third-party, through our modules."""
    seen, todo, third = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for n in imports_of(m):
            (todo.append(n) if n in MODULES else third.add(n))
    return seen | third


def test_the_import_graph_has_no_cycle():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(f"{PACKAGE}.sim")
                                          and m != f"{PACKAGE}.__main__"))
def test_runtime_does_not_depend_on_the_simulator(module):
    assert not {m for m in GRAPH[module] if m.startswith(f"{PACKAGE}.sim")}, f"{module} imports the simulator"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.plan")))
def test_the_policy_needs_no_torch(module):
    assert not closure(module) & {"torch", "deepspeed"}


def test_the_scheduler_process_starts_without_torch():
    reach = closure(f"{PACKAGE}.scheduler.process")
    assert not reach & {"torch", "deepspeed"}, sorted(reach)


# The core: the micro-batch's path and its policy, usable without a DeepSpeed engine. Outside it:
# the integration with DeepSpeed (its layers, engines, seams), the simulator, the test harness and
# the command-line entry points.
OUTSIDE_CORE = (f"{PACKAGE}.integration", f"{PACKAGE}.sim", f"{PACKAGE}.testing")
CORE = sorted(m for m in MODULES if not m.startswith(OUTSIDE_CORE)
              and m not in {PACKAGE, f"{PACKAGE}.__main__", f"{PACKAGE}.report"})
SEAMS = f"{PACKAGE}.integration.seams"


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_imports_the_integration(module):
    assert not {m for m in GRAPH[module] if m.startswith(f"{PACKAGE}.integration")}, \
        f"{module} imports the integration package"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_deepspeed_names(source: str) -> list[str]:
    """Private DeepSpeed names ``source`` reaches: imported from a ``deepspeed`` module, or read as
    an attribute of a name bound by such an import (``groups._get_data_parallel_group``)."""
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "deepspeed")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deepspeed":
            found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            bound.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != SEAMS))
def test_private_deepspeed_names_only_in_seams(module):
    assert not private_deepspeed_names(MODULES[module].read_text()), \
        f"{module} reaches DeepSpeed internals outside integration/seams.py"


# private names a probe may touch outside seams.py: torch's (on ``torch...``, or a module's own
# tables) and our own marks (``_feplb...``)
TORCH_MODULE_TABLES = {"_parameters", "_buffers", "_modules"}


def private_probes(source: str) -> list[str]:
    """``hasattr`` / ``getattr`` / ``setattr`` / ``delattr`` of a literal private name that is
    neither ours nor torch's: a reach into another library's internals (``hasattr(p, "_hp_mapping")``)
    that an import check cannot see."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
                and node.func.id in ("hasattr", "getattr", "setattr", "delattr")):
            continue
        name, target = node.args[1], node.args[0]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value)):
            continue
        root = target
        while isinstance(root, ast.Attribute):
            root = root.value
        if name.value.startswith("_feplb") or name.value in TORCH_MODULE_TABLES or (
                isinstance(root, ast.Name) and root.id == "torch"):
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != SEAMS))
def test_no_probe_of_another_librarys_private_attributes_outside_seams(module):
    probes = private_probes(MODULES[module].read_text())
    assert not probes, f"{module} probes private attributes outside integration/seams.py: {probes}"


def class_swaps(source: str) -> list[str]:
    """Assignments to an object's ``__class__``: a DeepSpeed object changed in place, which only
    seams.py may do (`seams.become`, `seams.back_to`)."""
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                   for t in node.targets)]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != SEAMS))
def test_no_class_swap_outside_seams(module):
    swaps = class_swaps(MODULES[module].read_text())
    assert not swaps, f"{module} changes an object's class outside integration/seams.py: {swaps}"


def test_the_checker_sees_edges():
    """The rules above are only worth something if the graph and the name check are real."""
    assert f"{PACKAGE}.scheduler.mailbox" in GRAPH[f"{PACKAGE}.scheduler.process"]
    assert f"{PACKAGE}.plan.policy" in GRAPH[f"{PACKAGE}.sim.policies"]
    assert "torch" in closure(f"{PACKAGE}.integration.deepspeed_moe")
    assert f"{PACKAGE}.expert_stage" in CORE and f"{PACKAGE}.integration.autoep" not in CORE
    assert private_deepspeed_names(MODULES[SEAMS].read_text())  # seams does reach them
    assert class_swaps(MODULES[SEAMS].read_text()) and class_swaps("gate.__class__ = TopKGate")
    assert private_deepspeed_names("from deepspeed.utils import groups\ngroups._get_data_parallel_group()")
    assert private_deepspeed_names("from deepspeed.moe.sharded_moe import _capacity")
    assert not private_deepspeed_names("import torch\ntorch._C._get_tracing_state()")
    assert private_probes("if hasattr(p, '_hp_mapping'): pass")
    assert not private_probes("hasattr(torch, '_grouped_mm') and getattr(m, '_feplb_ready', 0) and hasattr(p, 'grad')")


# The code every balanced micro-batch runs: short functions, each one step of the path.
HOT_PATH = [f"{PACKAGE}.expert_stage", f"{PACKAGE}.balanced", f"{PACKAGE}.experts", f"{PACKAGE}.migrate.phase2",
            *sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.dispatch."))]
LONGEST_HOT_FUNCTION = 60  # lines, docstring included


@pytest.mark.parametrize("module", HOT_PATH)
def test_the_hot_path_is_made_of_short_functions(module):
    tree = ast.parse(MODULES[module].read_text())
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST_HOT_FUNCTION]
    assert not long, f"{module}: {long}"
