"""The mod engine against a real installed vLLM 0.32.0 tree (a hard-linked copy of .venv's)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit.vllm_tree import mods, trees

pytestmark = pytest.mark.cpu

MOD = "fix-eagle-fine-prefix"
ROOT = Path(__file__).resolve().parents[2]


def digest(tree: Path, files: list[str]) -> dict[str, str]:
    return {f: hashlib.sha256((tree / f).read_bytes()).hexdigest() for f in files}


def replace_file(path: Path, text: str) -> None:
    """Write by rename so the venv's hard-linked original is never touched."""
    tmp = path.with_name(path.name + ".test-tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    dest = tmp_path / "site" / "vllm"
    # Hard links, for speed and disk (a full copy is ~520 MB a test): safe here
    # because the mod engine and replace_file both write by rename, never in place.
    shutil.copytree(trees.venv_vllm(), dest, copy_function=os.link)
    return dest


@pytest.fixture()
def mod() -> mods.Mod:
    return mods.load_mod(MOD)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kit.vllm_tree.mods", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def test_apply_revert_roundtrip(tree: Path, mod: mods.Mod) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    source_before = digest(trees.venv_vllm(), files)
    assert mods.state(mod, tree) is mods.State.APPLIES
    assert mods.apply(tree, [mod]) == [f"{MOD}: applied"]
    assert mods.state(mod, tree) is mods.State.APPLIED
    assert digest(tree, files) != before
    # The hard-linked source of the copy is untouched.
    assert digest(trees.venv_vllm(), files) == source_before
    record = json.loads(mods.mods_record_path(tree).read_text())
    assert record["vllm_version"] == "0.32.0"
    assert [(m["name"], m["patch_sha256"]) for m in record["mods"]] == [(MOD, mod.patch_sha256)]
    # Applying again is a no-op that says so.
    assert mods.apply(tree, [mod]) == [f"{MOD}: already applied, nothing to do"]
    assert mods.revert(tree, [mod]) == [f"{MOD}: reverted"]
    assert digest(tree, files) == before
    assert mods.read_mods_record(tree)["mods"] == []
    assert mods.revert(tree, [mod]) == [f"{MOD}: not applied, nothing to do"]


def test_patched_sources_compile(tree: Path, mod: mods.Mod) -> None:
    mods.apply(tree, [mod])
    for rel in mod.manifest["files"]:
        compile((tree / rel).read_text(), str(tree / rel), "exec")


def test_check_exit_codes(tree: Path) -> None:
    assert cli("check", MOD, "--tree", str(tree)).returncode == 0
    assert cli("apply", MOD, "--tree", str(tree)).returncode == 0
    done = cli("check", MOD, "--tree", str(tree))
    assert done.returncode == 10 and "already applied" in done.stdout
    listing = cli("list", "--tree", str(tree))
    assert listing.returncode == 0 and MOD in listing.stdout and "already applied" in listing.stdout


def test_drift_names_mod_file_and_hunk_and_changes_nothing(tree: Path, mod: mods.Mod) -> None:
    files = mod.manifest["files"]
    damaged = "v1/kv_cache_interface.py"
    assert files.index(damaged) > 0
    last = tree / damaged
    # Damage a file after the first, so earlier files would apply cleanly.
    text = last.read_text().replace(
        "def is_mamba_prefill_checkpoint_valid(", "def mamba_prefill_checkpoint_is_valid(", 1
    )
    replace_file(last, text)
    before = digest(tree, files)
    assert mods.state(mod, tree) is mods.State.DRIFT
    with pytest.raises(mods.ModError) as err:
        mods.apply(tree, [mod])
    message = str(err.value)
    assert MOD in message and damaged in message and "hunk #1" in message
    assert digest(tree, files) == before
    assert not mods.mods_record_path(tree).exists()
    out = cli("check", MOD, "--tree", str(tree))
    assert out.returncode == 20 and "drift" in out.stdout


def test_refuses_other_vllm_version_unless_forced(tree: Path, mod: mods.Mod) -> None:
    version_file = tree / "_version.py"
    replace_file(version_file, version_file.read_text().replace("'0.32.0'", "'0.33.0'"))
    with pytest.raises(mods.ModError, match=r"made for vLLM 0\.32\.0.*is vLLM 0\.33\.0"):
        mods.apply(tree, [mod])
    assert mods.state(mod, tree) is mods.State.APPLIES
    assert mods.apply(tree, [mod], force=True) == [f"{MOD}: applied"]


def test_unknown_mod(tree: Path) -> None:
    with pytest.raises(mods.ModError, match=f"unknown mod 'nope'; known mods: .*{MOD}"):
        mods.load_mod("nope")
    out = cli("apply", "nope", "--tree", str(tree))
    assert out.returncode == 2 and "unknown mod" in out.stderr


def test_not_a_vllm_tree(tmp_path: Path, mod: mods.Mod) -> None:
    (tmp_path / "__init__.py").write_text("")
    with pytest.raises(mods.ModError, match="is not a vLLM package directory"):
        mods.apply(tmp_path, [mod])
    assert cli("check", MOD, "--tree", str(tmp_path)).returncode == 2


def _copy_mod(tmp_path: Path) -> Path:
    mods_dir = tmp_path / "mods"
    shutil.copytree(ROOT / "mods" / MOD, mods_dir / MOD)
    return mods_dir


def test_malformed_manifest(tmp_path: Path) -> None:
    mods_dir = _copy_mod(tmp_path)
    (mods_dir / MOD / "mod.toml").write_text('name = "fix-eagle-fine-prefix"\nsummary = \n')
    with pytest.raises(mods.ModError, match=r"malformed manifest .*mod\.toml.*line 2"):
        mods.load_mod(MOD, mods_dir)


def test_manifest_missing_key_and_wrong_files(tmp_path: Path) -> None:
    mods_dir = _copy_mod(tmp_path)
    manifest = mods_dir / MOD / "mod.toml"
    text = manifest.read_text()
    manifest.write_text(text.replace('vllm_version = "0.32.0"\n', ""))
    with pytest.raises(mods.ModError, match="needs 'vllm_version'"):
        mods.load_mod(MOD, mods_dir)
    manifest.write_text(text.replace('  "config/cache.py",\n', ""))
    with pytest.raises(mods.ModError, match="manifest lists files"):
        mods.load_mod(MOD, mods_dir)


def test_a_switch_needs_its_flag_and_its_config_field(tmp_path: Path) -> None:
    mods_dir = _copy_mod(tmp_path)
    manifest = mods_dir / MOD / "mod.toml"
    text = manifest.read_text()
    field_line = 'cache_config_field = "enable_mamba_eagle_predecessor_checkpoint"\n'
    assert field_line in text
    manifest.write_text(text.replace(field_line, ""))
    with pytest.raises(mods.ModError, match="has 'enable_flag' but not 'cache_config_field'"):
        mods.load_mod(MOD, mods_dir)


def test_each_release_fix_is_switched_by_one_flag_and_field() -> None:
    flag = "--enable-mamba-eagle-predecessor-checkpoint"
    for release, fix in (("0.32.0", MOD), ("0.34.0", "fix-eagle-fine-prefix-lookahead")):
        switched = mods.switched_mods("strix", release)
        assert [m.name for m in switched] == [fix]
        assert switched[0].manifest["enable_flag"] == flag


def test_patch_that_breaks_syntax_is_refused(tmp_path: Path, tree: Path) -> None:
    mods_dir = _copy_mod(tmp_path)
    patch = mods_dir / MOD / "mod.patch"
    patch.write_text(
        patch.read_text().replace(
            "+        predecessor_boundary = get_mamba_eagle_predecessor_position(",
            "+        predecessor_boundary = get_mamba_eagle_predecessor_position((",
            1,
        )
    )
    broken = mods.load_mod(MOD, mods_dir)
    before = digest(tree, broken.manifest["files"])
    with pytest.raises(mods.ModError, match="does not compile"):
        mods.apply(tree, [broken])
    assert digest(tree, broken.manifest["files"]) == before


def test_second_apply_racing_the_first_is_refused(tree: Path, mod: mods.Mod) -> None:
    with open(tree / mods.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(mods.ModBusy, match="another mod apply/revert"):
            mods.apply(tree, [mod])
        out = cli("apply", MOD, "--tree", str(tree))
        assert out.returncode == 3
    assert mods.state(mod, tree) is mods.State.APPLIES


def test_read_only_target_changes_nothing(tree: Path, mod: mods.Mod) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    frozen = tree / files[-1]
    # Root ignores permission bits; the immutable attribute binds root too.
    locked = subprocess.run(["chattr", "+i", str(frozen.parent)], capture_output=True)
    if locked.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here: {locked.stderr.decode().strip()}")
    try:
        with pytest.raises(mods.ModError, match="read-only"):
            mods.apply(tree, [mod])
    finally:
        subprocess.run(["chattr", "-i", str(frozen.parent)], check=True)
    assert digest(tree, files) == before
    assert not list(tree.rglob("*.kit-tmp"))


def test_a_mod_for_later_releases_is_refused_on_the_pinned_tree(tree: Path) -> None:
    lookahead = mods.load_mod("fix-eagle-fine-prefix-lookahead")
    assert lookahead.releases == ["0.33.0", "0.34.0"]
    with pytest.raises(mods.ModError, match=r"made for vLLM 0\.33\.0, 0\.34\.0.*is vLLM 0\.32\.0"):
        mods.apply(tree, [lookahead])
    assert mods.state(lookahead, tree) is mods.State.DRIFT


def test_a_target_gets_the_mods_of_one_release() -> None:
    def names(release: str | None) -> list[str]:
        return [m.name for m in mods.mods_for_target("gb10", "patched", release=release)]

    # Correctness mods every release so far needs (internal checkpoints, multi-module MTP).
    every = [
        "fix-mamba-mid-block-resume-stop",
        "fix-mamba-transient-checkpoint-tail",
        "fix-mtp-prefill-lookahead-progress",
    ]
    assert names(None) == ["fix-cow-aliased-kv-copy", "fix-eagle-fine-prefix", *every]
    assert names("0.33.0") == [
        "fix-cow-aliased-kv-copy",
        "fix-eagle-fine-prefix-lookahead",
        *every,
    ]
    # 0.34.0 fixed the copy-on-write bug upstream (vllm#55112); its FlashInfer GDN
    # writes the fix's states in the forward pass (the worker side of the fix).
    assert names("0.34.0") == [
        "fix-eagle-fine-prefix-exports",
        "fix-eagle-fine-prefix-lookahead",
        *every,
    ]


def apply_killed_at(tree: Path, point: str, *argv: str) -> subprocess.CompletedProcess:
    """`kit.vllm_tree.mods apply` in a real process that SIGKILLs itself at ``point``."""
    return subprocess.run(
        [sys.executable, "-m", "kit.vllm_tree.mods", *argv, "--tree", str(tree)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, mods.KILL_AT_ENV: point},
    )


def test_an_apply_killed_after_the_first_rename_is_finished_by_the_next(
    tree: Path, mod: mods.Mod
) -> None:
    files = mod.manifest["files"]
    assert len(files) > 1  # so the kill lands between two renames
    before = digest(tree, files)
    killed = apply_killed_at(tree, "renamed:1", "apply", MOD)
    assert killed.returncode == -9
    half = digest(tree, files)
    assert half != before and sum(half[f] != before[f] for f in files) == 1
    # A half-applied tree is never taken at its record's word.
    with pytest.raises(mods.ModError, match="interrupted"):
        mods.verify_record(tree)
    assert mods.apply(tree, [mod]) == [
        "finished an interrupted apply/revert first",
        f"{MOD}: already applied, nothing to do",
    ]
    assert mods.state(mod, tree) is mods.State.APPLIED
    record = mods.verify_record(tree)
    assert [m["name"] for m in record["mods"]] == [MOD]
    assert record["files"] == digest(tree, files)
    assert mods.revert(tree, [mod]) == [f"{MOD}: reverted"]
    assert digest(tree, files) == before


def test_an_apply_killed_before_its_commit_point_changed_nothing(tree: Path, mod: mods.Mod) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    assert apply_killed_at(tree, "staged", "apply", MOD).returncode == -9
    assert digest(tree, files) == before
    assert mods.verify_record(tree)["mods"] == []
    assert mods.apply(tree, [mod]) == [f"{MOD}: applied"]


def test_a_revert_killed_midway_is_finished_by_list(tree: Path, mod: mods.Mod) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    mods.apply(tree, [mod])
    assert apply_killed_at(tree, "renamed:1", "revert", MOD).returncode == -9
    listed = cli("list", MOD, "--tree", str(tree))
    assert listed.returncode == 0 and "finished an interrupted apply/revert" in listed.stdout
    assert digest(tree, files) == before
    assert mods.verify_record(tree)["mods"] == []


def test_a_file_changed_behind_the_record_is_caught(tree: Path, mod: mods.Mod) -> None:
    mods.apply(tree, [mod])
    first = tree / mod.manifest["files"][0]
    replace_file(first, first.read_text() + "\n# edited by hand\n")
    with pytest.raises(mods.ModError, match="differ from its mods record"):
        mods.verify_record(tree)


def test_an_unreadable_record_stops_apply_before_any_file_changes(
    tree: Path, mod: mods.Mod
) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    mods.mods_record_path(tree).write_text('{"mods": [{"na')  # truncated
    with pytest.raises(mods.ModError, match="unreadable mods record"):
        mods.apply(tree, [mod])
    assert digest(tree, files) == before
    assert not list(tree.rglob("*.kit-tmp"))


def test_missing_pins_stop_apply_before_any_file_changes(
    tree: Path, mod: mods.Mod, tmp_path: Path, monkeypatch
) -> None:
    files = mod.manifest["files"]
    before = digest(tree, files)
    real = mods.pins.file_sha256
    monkeypatch.setattr(mods.pins, "file_sha256", lambda path=tmp_path / "pins.toml": real(path))
    with pytest.raises(mods.ModError, match="cannot read the pins.*Nothing was changed"):
        mods.apply(tree, [mod])
    assert digest(tree, files) == before
    assert mods.verify_record(tree)["mods"] == []


@pytest.mark.parametrize(
    "text,message",
    [
        ("[vllm\nversion = ", "not valid TOML"),
        ("[cpu]\ntorch = '1'\n", "no pin named 'vllm.version'"),
    ],
)
def test_a_malformed_or_incomplete_pins_file_is_one_line(
    tmp_path: Path, monkeypatch, capsys, text: str, message: str
) -> None:
    """`kit trees` (what make setup and make mods-list build the trees with) reads the
    pins to pick each tree's mods."""
    bad = tmp_path / "pins.toml"
    bad.write_text(text)
    real = mods.pins.load
    monkeypatch.setattr(mods.pins, "load", lambda path=bad: real(bad))
    assert trees.main([]) == 2
    assert message in capsys.readouterr().err
