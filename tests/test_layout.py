"""kit/ is organised by layer: each layer imports only from the layers before it, and no
module imports another that (directly or through others) imports it back. Imports inside
functions count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "kit"
# The order docs/architecture.md "Where things live" gives: the repository's paths at the
# bottom, then the shared modules in kit/ itself (""), the packages, and the one command on
# top, which reaches every layer.
LAYERS = (
    "paths",
    "",
    "geometry",
    "vllm_tree",
    "weights",
    "pins",
    "rig",
    "kernels",
    "bench",
    "images",
    "cli",
)
# The modules in kit/ itself that are a layer of their own.
OWN_LAYER = {"kit.paths": "paths", "kit.cli": "cli"}
SHARED = {
    "__init__",
    "bundle",
    "schema",
    "results_index",
    "plot",
    "loopback",
    "process_group",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(KIT.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module in OWN_LAYER:
        return OWN_LAYER[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The kit modules ``path`` imports anywhere in it (module-level or in a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from kit.bench import run`` imports kit.bench.run; ``from kit.bench.run
            # import main`` imports kit.bench.run.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("kit.") or name == "kit":
                found.add(name)
    return found


def jobs_of(path: Path, known: set[str]) -> set[str]:
    """The kit modules a dispatcher names as strings (cli.py's JOBS) and imports by name."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in known and node.value != "kit"
    }


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # A package's __init__ is imported on the way to any of its modules: not an edge.
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    edges = {m: imports_of(p, known) - packages - {m} for m, p in mods.items()}
    edges["kit.cli"] |= jobs_of(mods["kit.cli"], known)  # importlib.import_module(JOBS[job])
    return edges


def test_every_module_sits_in_a_layer() -> None:
    stray = [
        m
        for m, p in modules().items()
        if p.parent == KIT
        and p.stem not in SHARED
        and m not in OWN_LAYER
        or p.parent != KIT
        and p.parent.name not in LAYERS
    ]
    assert not stray, f"modules outside the layers {LAYERS}: {stray} (move them, or add the layer)"


def test_layers_import_only_the_layers_before_them() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [
        f"{m} ({layer_of(m) or 'shared'}) imports {d} ({layer_of(d) or 'shared'})"
        for m, deps in graph().items()
        for d in deps
        if rank[layer_of(d)] > rank[layer_of(m)]
    ]
    assert not upward, "\n".join(upward)


def test_the_paths_are_the_bottom_and_the_one_command_the_top() -> None:
    # kit/paths.py is what every layer may take its paths from: it imports nothing of
    # the kit. cli.py imports every job's module by name (importlib): counted with the
    # shared bottom, any module could import it and its reach to the top would not show.
    edges = graph()
    assert layer_of("kit.paths") == LAYERS[0] and not edges["kit.paths"]
    assert layer_of("kit.cli") == LAYERS[-1]
    assert {"vllm_tree", "weights", "rig", "bench", "images"} <= {
        layer_of(d) for d in edges["kit.cli"]
    }


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import kit.rig.stress\n", {"kit.rig.stress"}),
        ("def f():\n    from kit.bench import run\n", {"kit.bench.run"}),
        ("from kit.bench.run import main\n", {"kit.bench.run"}),
        ("from kit import bundle\n", {"kit.bundle"}),
    ],
)
def test_the_checker_sees_every_import_form(tmp_path: Path, source: str, expected: set) -> None:
    # A layout test that misses lazy or ``from kit import x`` imports would pass vacuously.
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert imports_of(probe, set(modules())) - {"kit", "kit.bench", "kit.rig"} == expected


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kit.images import orchestrate\n")
    deps = imports_of(probe, set(modules()))
    rank = {name: i for i, name in enumerate(LAYERS)}
    assert any(rank[layer_of(d)] > rank["rig"] for d in deps)


def test_the_gpu_hosts_flow_imports_without_vllm_or_the_bench_clients_dependencies() -> None:
    """The container flow runs on a GPU host's light .venv (make setup-host): no vLLM,
    torch or transformers, and not the bench client's prometheus_client or tqdm. An
    import of a measuring module on its way fails there, so it must fail here too."""
    import subprocess
    import sys

    blocked = ("vllm", "torch", "transformers", "prometheus_client", "tqdm")
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import kit.images.orchestrate, kit.pins.lock, kit.images.hostcheck\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
