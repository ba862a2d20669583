"""Parse and apply unified diffs exactly (no fuzz, no offset guessing beyond a search)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchFormatError(ValueError):
    pass


class HunkFailed(RuntimeError):
    def __init__(self, path: str, index: int, header: str) -> None:
        super().__init__(f"{path}: hunk #{index} ({header}) does not match")
        self.path = path
        self.index = index
        self.header = header


@dataclass
class Hunk:
    header: str
    old_start: int
    lines: list[str] = field(default_factory=list)  # with their ' ', '-', '+' prefix

    def old(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " -"]

    def new(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[0] in " +"]

    def reversed(self) -> Hunk:
        flip = {"-": "+", "+": "-", " ": " "}
        return Hunk(self.header, self.old_start, [flip[ln[0]] + ln[1:] for ln in self.lines])


@dataclass
class FilePatch:
    path: str  # relative to the vllm package directory
    hunks: list[Hunk]

    def reversed(self) -> FilePatch:
        return FilePatch(self.path, [h.reversed() for h in self.hunks])


def _strip_prefix(raw: str) -> str:
    name = raw.split("\t", 1)[0].strip()
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return name


def parse(text: str) -> list[FilePatch]:
    lines = text.splitlines()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchFormatError(f"line {i + 1}: '---' without a following '+++'")
        path = _strip_prefix(lines[i + 1][4:])
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise PatchFormatError(f"line {i + 2}: unsafe or empty path {path!r}")
        current = FilePatch(path, [])
        patches.append(current)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise PatchFormatError(f"line {i + 1}: malformed hunk header {lines[i]!r}")
            old_len = int(m.group(2) or 1)
            new_len = int(m.group(4) or 1)
            hunk = Hunk(lines[i], int(m.group(1)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                body = lines[i]
                if body.startswith("\\"):
                    i += 1
                    continue
                tag = body[:1] or " "
                if tag not in " -+":
                    raise PatchFormatError(f"line {i + 1}: unexpected hunk line {body!r}")
                hunk.lines.append(tag + body[1:])
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchFormatError(f"hunk {hunk.header!r} in {path}: truncated")
            current.hunks.append(hunk)
        if not current.hunks:
            raise PatchFormatError(f"{path}: file header without hunks")
    if not patches:
        raise PatchFormatError("no file patches found")
    return patches


def apply_file(source: str, patch: FilePatch) -> str:
    """Return ``source`` with every hunk applied, or raise ``HunkFailed``."""
    lines = source.splitlines(keepends=True)
    plain = [ln.rstrip("\n") for ln in lines]
    out: list[str] = []
    cursor = 0
    for index, hunk in enumerate(patch.hunks, start=1):
        old = hunk.old()
        at = _find(plain, old, hunk.old_start - 1, cursor)
        if at is None:
            raise HunkFailed(patch.path, index, hunk.header)
        out.extend(lines[cursor:at])
        out.extend(ln + "\n" for ln in hunk.new())
        cursor = at + len(old)
    out.extend(lines[cursor:])
    return "".join(out)


def _find(plain: list[str], old: list[str], hint: int, floor: int) -> int | None:
    """Exact match of ``old`` nearest to ``hint``, never before ``floor``."""
    n = len(old)
    candidates = range(floor, len(plain) - n + 1)
    best = None
    for start in candidates:
        if plain[start : start + n] == old and (
            best is None or abs(start - hint) < abs(best - hint)
        ):
            best = start
    return best
