"""Checks before work: what `cognet-batch score` refuses before it reads the input, loads the
model or writes anything (an InputError naming the path: exit 2).

- An output that is an input, holds one, or that a later run would read as one: OUT (or its
  rejects file, its work folder `OUT.parts/`, the summary) equal to an input file, inside an
  input directory, matched by an input glob, or a folder that holds an input.
- An output that cannot be written: OUT or the rejects file an existing directory (local
  engine), the work folder an existing file, a folder on the way that is a file or not
  writable, `--summary-json` in a missing folder or an existing directory.
- An output that names no file (`.`, `/`, empty), or a device, FIFO or socket
  (`cognet.core.sinks`); `--summary-json /dev/null` is written in place, `--out /dev/null`
  refused (its rejects file and work folder would go to /dev).
- INPUT that the local engine cannot read: a directory or a glob (`--engine ray` reads
  them), a missing file.

`check_local` runs in the command's process; `check_overlap` also runs where the Ray engine
lists INPUT (a Ray task: its paths are the cluster's).
"""

from __future__ import annotations

import glob
import os
from fnmatch import fnmatchcase
from pathlib import Path

from cognet.core.errors import InputError
from cognet.core.files import writable_folder
from cognet.core.sinks import check_output
from cognet.runtime import writer

GLOB_CHARS = "*?["


def check_local(input_path: str, out: str, summary_json: str | None) -> None:
    """The checks of the module docstring for `--engine local`."""
    source = Path(input_path)
    if source.is_dir():
        raise InputError(
            f"{source}: is a directory; the local engine reads one Parquet file "
            "(--engine ray reads every *.parquet under a directory)"
        )
    if not source.exists():
        if any(c in input_path for c in GLOB_CHARS):
            raise InputError(
                f"{source}: file not found (a glob? the local engine reads one Parquet file; "
                "--engine ray expands globs)"
            )
        raise InputError(f"{source}: file not found")
    outputs = outputs_of(out)
    check_overlap(input_path, outputs)
    for label, path in outputs.items():
        if check_output(path, label):  # OUT names files beside it: none may go to /dev
            raise InputError(
                f"{path}: {label} is the null device; the rejects file and the work folder "
                "are written beside OUT: name a file in a folder (use --summary-json alone "
                "for the counts)"
            )
    for label in ("--out", "rejects file"):
        if Path(outputs[label]).is_dir():
            raise InputError(
                f"{outputs[label]}: is a directory; --out names the Parquet file to write "
                "(the rejects go beside it)"
            )
    work = Path(outputs["work folder"])
    if work.exists() and not work.is_dir():
        raise InputError(f"{work}: exists and is not a directory (the run's work folder)")
    writable_folder(Path(out).parent, out)
    check_summary(summary_json, input_path, outputs)


def outputs_of(out: str) -> dict[str, str]:
    """What a run on OUT writes: {label: path}."""
    return {
        "--out": str(out),
        "rejects file": str(writer.rejects_path(out)),
        "work folder": str(writer.work_dir(out)),
    }


def check_summary(summary_json: str | None, input_path: str, outputs: dict[str, str]) -> None:
    """--summary-json: not an input nor another output, in an existing, writable folder."""
    if not summary_json:
        return
    path = Path(summary_json)
    if check_output(path, "--summary-json"):
        return  # the null device: written in place
    check_overlap(input_path, {"--summary-json": summary_json})
    for label, other in outputs.items():
        if _same(path, Path(other)) or _inside(path, Path(other)):
            raise InputError(f"{path}: --summary-json would overwrite the {label}")
    if path.is_dir():
        raise InputError(f"{path}: --summary-json is a directory")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{path}: --summary-json folder {folder} does not exist")
    writable_folder(folder, summary_json)


def check_overlap(source: str, outputs: dict[str, str]) -> None:
    """InputError when an output would overwrite or be read as INPUT (a file, a directory
    or a glob; see the module docstring). Reads no file: it lists a glob at most."""
    for label, out in outputs.items():
        why = _overlap(source, out)
        if why:
            raise InputError(f"{out}: {label} {why}; choose another --out")


def _overlap(source: str, out: str) -> str | None:
    out_path = Path(os.path.realpath(out))
    if any(c in source for c in GLOB_CHARS):
        pattern = os.path.abspath(source)
        for candidate in (os.path.abspath(out), str(out_path)):
            # a directory output holds Parquet files that the glob may reach
            for path in (candidate, os.path.join(candidate, "part-0.parquet")):
                if glob_match(path, pattern):
                    return f"is matched by the input glob {source}"
        files = [Path(os.path.realpath(p)) for p in glob.glob(pattern, recursive=True)]
    else:
        src = Path(os.path.realpath(source))
        if src.is_dir():
            if _same(out_path, src) or _inside(out_path, src):
                return f"is inside the input directory {source}"
            if _inside(src, out_path):
                return f"holds the input directory {source}"
            return None
        files = [src]
    for file in files:
        if _same(out_path, file):
            return f"is the input file {file}"
        if _inside(file, out_path):
            return f"holds the input file {file}"
    return None


def glob_match(path: str, pattern: str) -> bool:
    """Whether `glob.glob(pattern, recursive=True)` would list `path` were it a file: `*`,
    `?` and `[...]` within one path component, `**` across any number of them."""
    return _match(Path(path).parts, Path(pattern).parts)


def _match(parts: tuple[str, ...], pats: tuple[str, ...]) -> bool:
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pats[0]) and _match(parts[1:], pats[1:])


def _same(a: Path, b: Path) -> bool:
    a, b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    """`path` lies strictly under `folder` (both resolved)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return folder != path and folder in path.parents
