"""`lagom patch megatron [--path DIR] [--revert]`: apply or undo lagom_megatron/patches/megatron-training.patch.

The patch is a plain unified diff (``patch -p1`` takes it too). Each hunk is placed by its exact
lines wherever they are in the file, so one patch fits megatron/training as shipped in several
releases; a file whose lines do not match is refused as a whole, naming the hunk. Applying twice
changes nothing, and reverting removes exactly the added lines, so the files come back byte for byte.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from lagom.errors import ConfigError
from lagom.resources import megatron_patch

PATCH_FILE = megatron_patch()
FITS = "megatron-core 0.18, 0.19 and Megatron-LM main (0.20 dev)"
LAUNCHER = "python -m lagom_megatron.run pretrain_gpt.py <megatron args> --lagom ..."


@dataclass
class Hunk:
    old: list[str] = field(default_factory=list)  # context and removed lines, without line endings
    new: list[str] = field(default_factory=list)  # context and added lines
    added: set[int] = field(default_factory=set)  # indices into ``new`` of the added lines
    removed: set[int] = field(default_factory=set)  # indices into ``old`` of the removed lines


@dataclass
class FilePatch:
    path: str  # relative to the directory holding megatron/
    hunks: list[Hunk]


def parse_patch(text: str) -> list[FilePatch]:
    """The files and hunks of a unified diff (text before the first ``---`` is a comment).

    A hunk takes exactly the line counts its ``@@ -a,b +c,d @@`` header states, so blank lines an
    editor stripped of their leading space still count as context.
    """
    files: list[FilePatch] = []
    hunk: Hunk | None = None
    left = (0, 0)  # old and new lines the current hunk still expects
    for line in text.splitlines():
        if hunk is not None and left != (0, 0):
            tag, body = (line[0], line[1:]) if line else (" ", "")
            if tag in (" ", "-"):
                if tag == "-":
                    hunk.removed.add(len(hunk.old))
                hunk.old.append(body)
            if tag in (" ", "+"):
                if tag == "+":
                    hunk.added.add(len(hunk.new))
                hunk.new.append(body)
            left = (left[0] - (tag != "+"), left[1] - (tag != "-"))
        elif line.startswith("+++ "):
            files.append(FilePatch(line[4:].split("\t")[0].removeprefix("b/"), []))
        elif line.startswith("@@") and files:
            m = re.match(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", line)
            if m is None:
                raise ValueError(f"malformed hunk header: {line}")
            hunk = Hunk()
            files[-1].hunks.append(hunk)
            left = (int(m.group(1) or 1), int(m.group(2) or 1))
    return files


def _find(lines: list[str], block: list[str]) -> list[int]:
    bare = [line.rstrip("\r\n") for line in lines]
    n = len(block)
    return [i for i in range(len(bare) - n + 1) if bare[i:i + n] == block]


def _replace(lines: list[str], at: int, keep: list[str], put: list[str], fresh: set[int], kept_fresh: set[int]) -> list[str]:
    """Swap ``lines[at:at+len(keep)]`` for ``put``; lines shared by both keep their own line endings."""
    ending = "\r\n" if lines[at].endswith("\r\n") else "\n"
    shared = iter(line for i, line in enumerate(lines[at:at + len(keep)]) if i not in kept_fresh)
    block = [body + ending if i in fresh else next(shared) for i, body in enumerate(put)]
    return lines[:at] + block + lines[at + len(keep):]


def megatron_root(path: str | Path | None) -> Path:
    """The directory that holds ``megatron/training`` (a site-packages dir or a Megatron-LM checkout)."""
    if path is None:
        spec = importlib.util.find_spec("megatron")
        locations = list(spec.submodule_search_locations or []) if spec else []
        found = [Path(loc).parent for loc in locations if (Path(loc) / "training" / "arguments.py").exists()]
        if not found:
            raise ConfigError("--path", "no installed megatron/training found", "pass --path to a Megatron-LM checkout")
        return found[0]
    root = Path(path)
    for candidate in (root, root.parent, root.parent.parent):
        if (candidate / "megatron" / "training" / "arguments.py").exists():
            return candidate
    raise ConfigError("--path", f"{root} holds no megatron/training/arguments.py",
                      "pass the directory that contains megatron/ (site-packages or a Megatron-LM checkout)")


def megatron_version(root: Path) -> str:
    """The version in megatron/core/package_info.py, read without importing megatron."""
    info = root / "megatron" / "core" / "package_info.py"
    if not info.exists():
        return "unknown version"
    text = info.read_text()
    parts = [re.search(rf"^{key}\s*=\s*(\d+)", text, re.M) for key in ("MAJOR", "MINOR", "PATCH")]
    return "megatron-core " + ".".join(m.group(1) for m in parts if m) if all(parts) else "unknown version"


def _state(lines: list[str], fp: FilePatch, where: str) -> str:
    """'applied' or 'pending'; anything else is refused with the hunk that does not fit."""
    states = []
    for n, hunk in enumerate(fp.hunks, 1):
        old, new = len(_find(lines, hunk.old)), len(_find(lines, hunk.new))
        if new == 1:
            states.append("applied")
        elif old == 1 and new == 0:
            states.append("pending")
        else:
            anchor = next((line.strip() for line in hunk.old if line.strip()), "")
            seen = "not found" if old == 0 else f"found {old} times"
            raise ConfigError("--path", f"{where} does not fit the Lagom patch: hunk {n} (at '{anchor}') {seen}",
                              f"the patch fits {FITS}; otherwise use the launcher: {LAUNCHER}")
    if len(set(states)) > 1:
        raise ConfigError("--path", f"{where} is partly patched ({', '.join(states)})",
                          "restore the original file (reinstall megatron-core) and patch again")
    return states[0]


def patch_megatron(path: str | Path | None = None, revert: bool = False, patch_file: Path = PATCH_FILE) -> str:
    """Apply (or revert) the patch under ``path``; returns what happened, in words.

    Every file is checked before any is written, so a refusal leaves the install untouched.
    """
    root = megatron_root(path)
    version = megatron_version(root)
    planned: list[tuple[Path, list[str], FilePatch, str]] = []
    for fp in parse_patch(patch_file.read_text()):
        target = root / fp.path
        lines = target.read_bytes().decode("utf-8").splitlines(keepends=True)
        planned.append((target, lines, fp, _state(lines, fp, f"{fp.path} in {root} ({version})")))
    wanted = "applied" if revert else "pending"
    todo = [p for p in planned if p[3] == wanted]
    for target, lines, fp, _ in todo:
        for hunk in fp.hunks:
            if revert:
                lines = _replace(lines, _find(lines, hunk.new)[0], hunk.new, hunk.old, hunk.removed, hunk.added)
            else:
                lines = _replace(lines, _find(lines, hunk.old)[0], hunk.old, hunk.new, hunk.added, hunk.removed)
        try:
            target.write_bytes("".join(lines).encode("utf-8"))
        except OSError as err:
            raise ConfigError("--path", f"cannot write {target}: {err.strerror}",
                              "run with write access to the megatron install, or patch a copy with --path") from None
    files = ", ".join(fp.path for _, _, fp, _ in planned)
    if not todo:
        return f"{'not patched, nothing to revert' if revert else 'already patched, nothing to do'}: {files} in {root} ({version})"
    return f"{'reverted' if revert else 'patched'} {files} in {root} ({version})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``lagom patch``: the target framework, where it is installed, and --revert."""
    parser.add_argument("target", choices=("megatron",), help="framework to patch")
    parser.add_argument("--path", metavar="DIR", help="directory holding megatron/ (default: the installed one)")
    parser.add_argument("--revert", action="store_true", help="remove the patch, restoring the files byte for byte")


def run(args: argparse.Namespace) -> int:
    print(patch_megatron(args.path, revert=args.revert))
    return 0
