"""The package's layout rules (docs/ARCHITECTURE.md): an acyclic import graph in which the runtime
never depends on the simulator, the policy never on torch, and the scheduler process starts
without torch or DeepSpeed."""
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


def test_the_checker_sees_edges():
    """The rules above are only worth something if the graph is real."""
    assert f"{PACKAGE}.scheduler.mailbox" in GRAPH[f"{PACKAGE}.scheduler.process"]
    assert f"{PACKAGE}.plan.policy" in GRAPH[f"{PACKAGE}.sim.policies"]
    assert "torch" in closure(f"{PACKAGE}.layer")
