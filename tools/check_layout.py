"""Check cognet's layering (DESIGN.md §1) and its file-size rule; `make lint` runs it.

    python tools/check_layout.py [--root DIR]

Reads every `.py` file of the folders that setup.py's `package_dir` installs (cognet/,
export/ as cognet.export, runtime/ as cognet.runtime, benchmarks/ as cognet.benchmarks),
collects its imports with `ast` (import-linter would miss the remapped folders), and checks:

- core: `cognet.core` imports no torch and nothing of cognet outside `cognet.core`;
- data: `cognet.data` imports no torch and nothing of cognet but `cognet.core`;
- runtime: `cognet.runtime` imports no torch and nothing of cognet but `cognet.core`;
- no-runtime: the rest of cognet (core, data, model and training) never imports the runtime;
- export: `cognet.export` imports the runtime only lazily (inside a function);
- benchmarks-on-top: nothing but `cognet.benchmarks` imports `cognet.benchmarks`;
- size: no source file is over MAX_LINES lines.

Every import counts, lazy ones too, except where a rule says "at module level". Prints one
line per violation (`FILE:LINE: rule: what`) and exits 1 when there is any.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 450
TORCH = "torch"


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int
    lazy: bool  # inside a function: runs when called, not when the module is imported


def package_dirs(root: Path) -> dict[str, Path]:
    """setup.py's package_dir: {package: folder}, the packages cognet installs."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_dir":
            mapping = ast.literal_eval(node.value)
            return {pkg: root / folder for pkg, folder in mapping.items()}
    raise SystemExit(f"{root / 'setup.py'}: no package_dir")


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every source file, subpackages included. A folder that
    is itself mapped to a package (runtime/ for cognet.runtime) belongs to that package."""
    dirs = package_dirs(root)
    out: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == max((p for p in dirs if name == p or name.startswith(p + ".")), key=len):
                out[name] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> list[Import]:
    """The modules `name` (at `path`) imports; `from X import y` counts as X.y when X.y is
    a known module."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy = True
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, lazy) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, node.lineno, lazy))
        for child in ast.iter_child_nodes(node):
            visit(child, lazy)

    visit(tree, False)
    return found


def layer(module: str) -> str | None:
    """core, data, runtime, export, benchmarks, root (the cognet package itself) or model (the
    rest of cognet: model, training, evaluation, CLIs); None outside cognet."""
    if module == "cognet":
        return "root"
    if not module.startswith("cognet."):
        return None
    second = module.split(".")[1]
    return second if second in ("core", "data", "runtime", "export", "benchmarks") else "model"


def _is_torch(module: str) -> bool:
    return module == TORCH or module.startswith(TORCH + ".")


# layer -> the cognet layers it may import (None: any)
ALLOWED = {
    "core": {"root", "core"},
    "data": {"root", "core", "data"},
    "runtime": {"root", "core", "runtime"},
    "model": {"root", "core", "data", "model"},
    "root": {"root", "core"},
    "export": {"root", "core", "data", "model", "export", "runtime"},
    "benchmarks": None,
}
TORCH_FREE = {"core": "core", "data": "data", "runtime": "runtime"}


def violations(root: Path) -> list[str]:
    found = modules(root)
    known = set(found)
    out = []
    for name, path in found.items():
        where = path.relative_to(root)
        mine = layer(name)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out.append(f"{where}:1: size: {lines} lines (at most {MAX_LINES})")
        for imp in imports(path, name, known):
            theirs = layer(imp.module)
            at = f"{where}:{imp.line}"
            if _is_torch(imp.module) and mine in TORCH_FREE:
                out.append(f"{at}: {TORCH_FREE[mine]}: cognet.{mine} imports {imp.module}")
            if theirs is None:
                continue
            if theirs == "benchmarks" and mine != "benchmarks":
                out.append(f"{at}: benchmarks-on-top: {name} imports {imp.module}")
            elif theirs == "runtime" and mine == "export":
                if not imp.lazy:
                    out.append(f"{at}: export: {name} imports {imp.module} at module level")
            elif theirs == "runtime" and mine not in ("runtime", "benchmarks"):
                out.append(f"{at}: no-runtime: {name} imports {imp.module}")
            elif ALLOWED[mine] is not None and theirs not in ALLOWED[mine]:
                out.append(f"{at}: {mine}: {name} imports {imp.module}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    found = violations(args.root)
    for line in found:
        print(line)
    n = len(modules(args.root))
    if found:
        print(f"layout: {len(found)} violation(s) in {n} modules", file=sys.stderr)
        return 1
    print(f"layout: {n} modules keep the layering and the {MAX_LINES}-line rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
