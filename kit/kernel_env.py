"""The separate environment `make kernel-check` runs vLLM's Triton kernels in: .venv-triton.

It holds the CPU build of torch ([cpu] torch in pins.toml), Triton and numpy
([kernel_check] in pins.toml) and nothing else: no vLLM. It is kept apart from
the kit's .venv so that the pinned Triton (the release vLLM 0.32.0 names) and
Triton's interpreter never reach the vLLM trees the kit measures.

Sources: pip's configured index first; torch's CPU build ("+cpu") is not on
every index, so when pip cannot find it there it retries with the PyTorch CPU
index named in pins.toml ([kernel_check] torch_index, or KIT_TORCH_INDEX).
Triton is hash-locked (``--require-hashes`` against [kernel_check]
triton_sha256). Built under a file lock (two pytest runs or a pytest run and
``make kernel-check`` at once build it once); a stamp records the pins it was
made from, and a missing or stale stamp or an environment that cannot import
torch and Triton is rebuilt.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kit import pins

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-triton"
PY = VENV / "bin" / "python"
STAMP = VENV / ".kit-kernel-env.json"
LOCK = ROOT / ".cache" / "venv-triton.lock"


class KernelEnvError(RuntimeError):
    exit_code = 2


def wanted(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the environment must hold, from pins.toml (also its stamp)."""
    spec = spec if spec is not None else pins.load()
    section = spec.get("kernel_check")
    if not section:
        raise KernelEnvError("pins.toml has no [kernel_check] section; the kit needs it")
    return {
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        # The CPU build: PyTorch's CPU wheels carry the local version "+cpu".
        "torch": f"{spec['cpu']['torch']}+cpu",
        "triton": section["triton"],
        "triton_sha256": list(section["triton_sha256"]),
        "numpy": section["numpy"],
    }


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


def _install_torch(want: dict[str, Any]) -> None:
    requirement = f"torch=={want['torch']}"
    if not os.environ.get("KIT_TORCH_INDEX"):
        # pip's configured index (a mirror, a wheelhouse) may carry the CPU build.
        first = _run(_pip(requirement), capture_output=True)
        if first.returncode == 0:
            return
        print(
            f"pip's configured index has no {requirement}; trying the PyTorch CPU index",
            file=sys.stderr,
        )
    index = torch_index()
    second = _run(_pip("--extra-index-url", index, requirement), capture_output=True)
    if second.returncode != 0:
        raise KernelEnvError(
            f"cannot install {requirement} into {VENV} (pip's index, then {index}; "
            f"set KIT_TORCH_INDEX to another PyTorch CPU index):\n{second.stderr[-2000:]}"
        )


def _install_triton(want: dict[str, Any]) -> None:
    hashes = " ".join(f"--hash=sha256:{h}" for h in want["triton_sha256"])
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write(f"triton=={want['triton']} {hashes}\n")
    try:
        # Triton has no dependencies of its own; --no-deps keeps the hash lock to it.
        done = _run(_pip("--no-deps", "--require-hashes", "-r", req.name), capture_output=True)
    finally:
        os.unlink(req.name)
    if done.returncode != 0:
        raise KernelEnvError(
            f"cannot install triton=={want['triton']} with a pinned sha256 into {VENV} "
            "(a platform whose wheel hash is not in pins.toml [kernel_check] triton_sha256 "
            f"is refused):\n{done.stderr[-2000:]}"
        )


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
        # torch first and alone, so pip takes the CPU build and nothing pulls a CUDA one.
        _install_torch(want)
        _install_triton(want)
        numpy = _run(_pip(f"numpy=={want['numpy']}"), capture_output=True)
        if numpy.returncode != 0:
            raise KernelEnvError(f"cannot install numpy into {VENV}: {numpy.stderr[-2000:]}")
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
