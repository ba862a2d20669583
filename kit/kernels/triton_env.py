"""The separate environment `make kernel-check` runs vLLM's Triton kernels in: .venv-triton.

It holds the CPU build of torch ([cpu] torch in pins.toml), Triton and numpy
([kernel_check] in pins.toml) and nothing else: no vLLM. It is kept apart from
the kit's .venv so that the pinned Triton (the release vLLM 0.32.0 names) and
Triton's interpreter never reach the vLLM trees the kit measures.

Hash-locked: torch and its dependencies and numpy with the hashes of the kit's
own CPU lock (``locks/cpu-venv-<machine>.txt``, the same builds as .venv), and
Triton with [kernel_check] triton_sha256, all in one ``pip install
--require-hashes --no-deps``. On a machine without such a lock, torch and numpy
are pinned by version only (said when it happens); Triton stays hash-locked.
Sources: pip's configured index first; torch's CPU build ("+cpu") is not on
every index, so when pip cannot find it there it retries with the PyTorch CPU
index named in pins.toml ([kernel_check] torch_index, or KIT_TORCH_INDEX).
Built under a file lock (two pytest runs or a pytest run and ``make
kernel-check`` at once build it once); a stamp records what it was made from,
and a missing or stale stamp or an environment that cannot import torch and
Triton is rebuilt.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kit.paths import CACHE, LOCKS, ROOT
from kit.vllm_tree import pins

VENV = ROOT / ".venv-triton"
PY = VENV / "bin" / "python"
STAMP = VENV / ".kit-kernel-env.json"
LOCK = CACHE / "venv-triton.lock"
# torch's dependencies (for Python 3.11) and numpy (Triton's interpreter computes with it).
LOCKED = (
    "torch",
    "filelock",
    "typing-extensions",
    "setuptools",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "numpy",
)


class KernelEnvError(RuntimeError):
    exit_code = 2


def wanted(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the environment must hold, from pins.toml (also its stamp)."""
    spec = spec if spec is not None else pins.load()
    section = spec.get("kernel_check")
    if not section:
        raise KernelEnvError("pins.toml has no [kernel_check] section; the kit needs it")
    want = {
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        # The CPU build: PyTorch's CPU wheels carry the local version "+cpu".
        "torch": f"{spec['cpu']['torch']}+cpu",
        "triton": section["triton"],
        "triton_sha256": list(section["triton_sha256"]),
        "numpy": section["numpy"],
    }
    locked = locked_requirements(want)
    want["lock"] = (
        None
        if locked is None
        else {"file": str(locked[0].relative_to(ROOT)), "sha256": _sha256(locked[1])}
    )
    return want


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def lock_file() -> Path:
    return LOCKS / f"cpu-venv-{platform.machine()}.txt"


def locked_requirements(want: dict[str, Any]) -> tuple[Path, str] | None:
    """The LOCKED packages' entries (``name==version`` and its ``--hash`` lines) from
    the kit's CPU lock for this machine, or None where the kit has no such lock."""
    path = lock_file()
    if not path.is_file():
        return None
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and "==" in line:
            name = line.split("==", 1)[0].strip().lower().replace("_", "-")
            current = entries.setdefault(name, []) if name in LOCKED else None
            if current is not None:
                current.append(line)
        elif current is not None and line.strip().startswith("--hash="):
            current.append(line)
        else:
            current = None
    missing = [n for n in LOCKED if not entries.get(n)]
    if missing:
        raise KernelEnvError(f"{path}: no entry for {', '.join(missing)}; regenerate the lock")
    for name, version in (("torch", want["torch"]), ("numpy", want["numpy"])):
        pinned = entries[name][0].split("==", 1)[1].split()[0]
        if pinned != version:
            raise KernelEnvError(
                f"{path} locks {name}=={pinned}, pins.toml wants {version}; make them agree"
            )
    body = "\n".join(
        line.rstrip(" \\") + " \\" if "==" in line else line for n in LOCKED for line in entries[n]
    )
    return path, body + "\n"


def torch_index(spec: dict[str, Any] | None = None) -> str:
    """The PyTorch CPU index: KIT_TORCH_INDEX, else pins.toml [kernel_check] torch_index."""
    override = os.environ.get("KIT_TORCH_INDEX")
    if override:
        return override
    spec = spec if spec is not None else pins.load()
    return str(spec["kernel_check"]["torch_index"])


def healthy(want: dict[str, Any]) -> bool:
    if not PY.exists() or not STAMP.is_file():
        return False
    try:
        if json.loads(STAMP.read_text()) != want:
            return False
    except json.JSONDecodeError:
        return False
    probe = subprocess.run(
        [
            str(PY),
            "-c",
            "import torch, triton, numpy; import importlib.util as u; "
            "assert u.find_spec('vllm') is None; print(torch.__version__, triton.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0 and probe.stdout.split() == [want["torch"], want["triton"]]


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, text=True, **kwargs)


def _pip(*args: str) -> list[str]:
    cmd = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    wheelhouse = os.environ.get("KIT_WHEELHOUSE")
    if wheelhouse:
        cmd += ["--find-links", wheelhouse]
    return cmd


def _install(requirements: str, what: str, *extra: str) -> None:
    """One pip install of ``requirements``: pip's configured index first, then with
    the PyTorch CPU index added (torch's "+cpu" build is not on every index)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(requirements)
    try:
        if not os.environ.get("KIT_TORCH_INDEX"):
            first = _run(_pip(*extra, "-r", req.name), capture_output=True)
            if first.returncode == 0:
                return
            print(
                f"pip's configured index could not supply {what}; trying the PyTorch CPU index",
                file=sys.stderr,
            )
        index = torch_index()
        second = _run(_pip(*extra, "--extra-index-url", index, "-r", req.name), capture_output=True)
    finally:
        os.unlink(req.name)
    if second.returncode != 0:
        raise KernelEnvError(
            f"cannot install {what} into {VENV} (pip's index, then {index}; set "
            f"KIT_TORCH_INDEX to another PyTorch CPU index; a wheel whose sha256 is not "
            f"locked is refused):\n{second.stderr[-2000:]}"
        )


def _triton_requirement(want: dict[str, Any]) -> str:
    hashes = " ".join(f"--hash=sha256:{h}" for h in want["triton_sha256"])
    return f"triton=={want['triton']} {hashes}\n"


def ensure(force: bool = False) -> Path:
    """Build .venv-triton if it is missing, stale or broken; return its python."""
    want = wanted()
    LOCK.parent.mkdir(exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and healthy(want):
            return PY
        if VENV.exists():
            print(f"{VENV}: missing, stale or broken; rebuilding", file=sys.stderr)
            shutil.rmtree(VENV)
        made = _run([sys.executable, "-m", "venv", str(VENV)], capture_output=True)
        if made.returncode != 0:
            raise KernelEnvError(f"cannot create {VENV}: {made.stderr[-2000:]}")
        locked = locked_requirements(want)
        if locked is not None:
            # Every package named with its hashes: nothing resolved, nothing unlocked.
            _install(
                locked[1] + _triton_requirement(want),
                f"the locked torch, numpy and triton ({locked[0].name})",
                "--require-hashes",
                "--no-deps",
            )
        else:
            print(
                f"{lock_file()}: no lock for this machine; torch and numpy pinned by version only",
                file=sys.stderr,
            )
            # torch first and alone, so pip takes the CPU build and nothing pulls a CUDA one.
            _install(f"torch=={want['torch']}\n", f"torch=={want['torch']}")
            _install(_triton_requirement(want), "triton", "--require-hashes", "--no-deps")
            _install(f"numpy=={want['numpy']}\n", "numpy")
        STAMP.write_text(json.dumps(want, indent=1) + "\n")
        if not healthy(want):
            raise KernelEnvError(f"{VENV} was built but cannot import torch and triton as pinned")
    return PY


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if it looks fine")
    args = parser.parse_args(argv)
    try:
        print(ensure(force=args.force))
    except (KernelEnvError, pins.PinError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
