"""Pick the vLLM tree under test before anything imports vLLM, and gate tests by need.

``KIT_TREE=unpatched|patched`` (default ``patched``; ``<release>/<stage>``, e.g.
``0.34.0/patched``: a later release's tree from its sdist) puts the tree first
on ``sys.path``; ``KIT_TREE=installed`` (the images) uses the installed vllm
(``kit.vllm_tree.releases.select``).
Markers: ``cpu`` (runs here), ``container`` (needs buildah and the cpu images;
skipped with the command that builds them, a failure under
``KIT_REQUIRE_CONTAINERS=1`` as in CI).
``fixed_by_mod`` marks cases that encode the measured regression: on the
unpatched tree they are strict expected failures, so a regression that starts
passing unpatched fails the run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import results_guard  # tests/, beside this file (pytest puts its folder on sys.path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REQUIRE_CONTAINERS = os.environ.get("KIT_REQUIRE_CONTAINERS") == "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _select_tree():
    from kit.vllm_tree import releases, trees

    try:
        tree = releases.select()
        # Its search path and environment (a tree from an sdist: vLLM's CPU platform),
        # then, for such a tree, the plugin that lets its scheduler run without triton-cpu.
        tree.activate()
        trees.prepare(tree.from_sdist)
    except Exception as exc:  # noqa: BLE001 - reported at collection, not hidden
        sys.stderr.write(f"kit: cannot prepare the vLLM tree under test: {exc}\n")
        return None
    return tree


# The tree under test (kit.vllm_tree.trees.Tree), chosen before anything imports vllm.
TREE = _select_tree()
TREE_PATH = TREE.package if TREE else None

# results/ holds the committed record; the targets named for it write there, a test
# run never (tests/results_guard.py). Checked once per session, by stat: cheap.
_COMMITTED = pytest.StashKey[dict]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_COMMITTED] = results_guard.committed(ROOT)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_COMMITTED, {})
    touched = results_guard.changed(before, results_guard.committed(ROOT)) if before else []
    if touched:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = (
            f"this test run rewrote or removed committed results ({', '.join(touched[:5])}"
            f"{' ...' if len(touched) > 5 else ''}): a test must write under tmp_path or "
            ".cache/ (or another job wrote them meanwhile); git diff results/ shows what"
        )
        if reporter is not None:
            reporter.write_line(f"ERROR: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def carries_the_fix() -> bool:
    return bool(TREE and TREE.patched)


def pytest_report_header(config: pytest.Config) -> str:
    mods = ", ".join(TREE.mods) if TREE else "none"
    return f"kit tree: {TREE or 'none'}; mods: {mods or 'none'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patched = carries_the_fix()
    for item in items:
        if item.get_closest_marker("container") and shutil.which("buildah") is None:
            if REQUIRE_CONTAINERS:
                item.add_marker(pytest.mark.xfail(strict=True, run=False, reason="no buildah"))
            else:
                item.add_marker(pytest.mark.skip(reason="needs buildah (apt install buildah)"))
        if item.get_closest_marker("fixed_by_mod") and not patched:
            item.add_marker(
                pytest.mark.xfail(
                    strict=True, reason="regression measured on unpatched vLLM 0.32.0"
                )
            )


# CI builds .venv-triton or fails; elsewhere a machine that cannot skips the kernel tests.
KERNEL_CHECK_REQUIRED = (
    os.environ.get("CI") == "true" or os.environ.get("KIT_REQUIRE_KERNEL_CHECK") == "1"
)


@pytest.fixture(scope="session")
def triton_env() -> Path:
    """.venv-triton, where vLLM's Triton kernels run (kit/kernels/triton_env.py)."""
    from kit.kernels import triton_env

    try:
        return triton_env.ensure()
    except triton_env.KernelEnvError as exc:
        if KERNEL_CHECK_REQUIRED:
            pytest.fail(f".venv-triton cannot be built: {exc}")
        pytest.skip(f".venv-triton cannot be built here: {exc}")


@pytest.fixture(scope="session")
def tree_is_patched() -> bool:
    return carries_the_fix()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kit.weights.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def tiny_multi_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config with three NEXTN layers: multi-module MTP for k = 3."""
    from kit.weights.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-next-mtp3"), mtp_modules=3)


@pytest.fixture(scope="session")
def cpu_images() -> dict[str, str]:
    """The cpu image refs in buildah's storage, by stage."""
    from kit.images import build as images
    from kit.images import orchestrate
    from kit.images.containers import BuildahEngine

    engine = BuildahEngine()
    refs = {s: orchestrate.image_ref("buildah", "cpu", s) for s in images.STAGES}
    missing = [r for r in refs.values() if not engine.image_info(r)]
    if missing:
        message = f"{missing} not built here: make bench-cpu-image ENGINE=buildah"
        if REQUIRE_CONTAINERS:
            pytest.fail(message)
        pytest.skip(message)
    return refs
