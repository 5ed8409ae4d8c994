"""Check cognet's layering (DESIGN.md §1) and the tree-wide rules; `make lint` runs it.

    python tools/check_layout.py [--root DIR]

Reads every `.py` file of the folders that setup.py's PACKAGE_DIR installs (cognet/,
export/ as cognet.export, runtime/ as cognet.runtime, benchmarks/ as cognet.benchmarks),
collects its imports with `ast` (import-linter would miss the remapped folders), and checks:

- core: `cognet.core` imports no torch and nothing of cognet outside `cognet.core`;
- data: `cognet.data` imports no torch and nothing of cognet but `cognet.core`;
- runtime: `cognet.runtime` imports no torch and nothing of cognet but `cognet.core`
  (`cognet.core.commandline` included);
- commandline: `cognet.core.commandline` (the command lines' helpers, a layer of its own in
  core's namespace) imports no torch and nothing of cognet but the rest of `cognet.core`,
  and nothing of core imports it;
- click: the library (core but commandline, data, model, training, evaluation) imports no
  click: only the command lines and their helpers do;
- the folders of the torch side import downwards only (ALLOWED): model <- training <-
  evaluation <- cli;
- no-runtime: nothing but the runtime, export and the benchmarks imports the runtime;
- export: `cognet.export` imports the runtime only lazily (inside a function);
- benchmarks-on-top: nothing but `cognet.benchmarks` imports `cognet.benchmarks`.

Every import counts, lazy ones too, except where a rule says "at module level". Then the
rules over the whole tree (TREE_RULES, each a function of the root):

- test-imports: no test module (tests/test_*.py) imports another test module; shared
  fixtures live in tests/conftest.py, shared helpers in helper modules (tests/tiny.py);
- design-citations: every "DESIGN.md §N" cited in the tree (code, docs, Makefile, help
  texts) names a numbered heading ("## N. ...") of docs/DESIGN.md;
- compaction-once: the driver's compaction rule is written once;
- import-cycle: no two modules import each other, directly or through others.

Prints one line per violation (`FILE:LINE: rule: what`) and exits 1 when there is any.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

TORCH = "torch"
CLICK = "click"


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int
    lazy: bool  # inside a function: runs when called, not when the module is imported


def package_dirs(root: Path) -> dict[str, Path]:
    """setup.py's package_dir (PACKAGE_DIR): {package: folder}, the packages cognet installs."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id == "PACKAGE_DIR" for n in node.targets
        ):
            value = node.value
        elif isinstance(node, ast.keyword) and node.arg == "package_dir":
            value = node.value
        if isinstance(value, ast.Dict):
            mapping = ast.literal_eval(value)
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


COMMANDLINE = "cognet.core.commandline"  # the command lines' helpers: a layer of its own
LAYERS = (
    "core",
    "commandline",
    "data",
    "model",
    "training",
    "evaluation",
    "cli",
    "runtime",
    "export",
    "benchmarks",
)


def layer(module: str) -> str | None:
    """The layer of a module: a folder of LAYERS, root (the cognet package itself) or top
    (a module of cognet's own folder, such as `cognet.demo`); None outside cognet."""
    if module == "cognet":
        return "root"
    if not module.startswith("cognet."):
        return None
    if module == COMMANDLINE or module.startswith(COMMANDLINE + "."):
        return "commandline"  # in core's namespace, so the runtime may import it; not core
    second = module.split(".")[1]
    return second if second in LAYERS else "top"


def _is_torch(module: str) -> bool:
    return module == TORCH or module.startswith(TORCH + ".")


def _is_click(module: str) -> bool:
    return module == CLICK or module.startswith(CLICK + ".")


# layer -> the cognet layers it may import (None: any). Upwards: core <- data, model <- training
# <- evaluation <- cli; the runtime beside them on core alone; export on the model; the
# command lines' helpers (commandline, in core's namespace) on core, for every command line.
ALLOWED = {
    "core": {"root", "core"},
    "commandline": {"root", "core", "commandline"},
    "data": {"root", "core", "data"},
    "runtime": {"root", "core", "commandline", "runtime"},
    "model": {"root", "core", "model"},
    "training": {"root", "core", "data", "model", "training"},
    "evaluation": {"root", "core", "data", "model", "training", "evaluation"},
    "cli": {"root", "core", "commandline", "data", "model", "training", "evaluation", "cli"},
    "top": {"root", "core", "commandline", "data", "model", "training", "evaluation", "cli", "top"},
    "root": {"root", "core"},
    "export": {"root", "core", "commandline", "model", "export", "runtime"},
    "benchmarks": None,
}
TORCH_FREE = {"core": "core", "data": "data", "runtime": "runtime", "commandline": "commandline"}
CLICK_FREE = ("core", "data", "model", "training", "evaluation")  # the library: it raises


def violations(root: Path) -> list[str]:
    """Every violation in the tree at `root`: the layering rules, then TREE_RULES."""
    return [*layering(root), *(line for rule in TREE_RULES for line in rule(root))]


def layering(root: Path) -> list[str]:
    """The import rules over the installed packages."""
    found = modules(root)
    known = set(found)
    out = []
    for name, path in found.items():
        where = path.relative_to(root)
        mine = layer(name)
        for imp in imports(path, name, known):
            theirs = layer(imp.module)
            at = f"{where}:{imp.line}"
            package = COMMANDLINE if mine == "commandline" else f"cognet.{mine}"
            if _is_torch(imp.module) and mine in TORCH_FREE:
                out.append(f"{at}: {TORCH_FREE[mine]}: {package} imports {imp.module}")
            if _is_click(imp.module) and mine in CLICK_FREE:
                out.append(f"{at}: click: {package} imports {imp.module}")
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


# -- rules over the whole tree ---------------------------------------------------------------
# Each takes the root and returns violation lines (`FILE:LINE: rule: what`). A rule of the
# kind "written once" or "cited right" goes here: write the function, add it to TREE_RULES
# and test it in tests/test_layout.py.

TESTS = "tests"
DESIGN = Path("docs") / "DESIGN.md"
# "DESIGN.md §2", "DESIGN §4", "DESIGN.md §2 and §7", "DESIGN.md §1, §3": each § counts
CITATION = re.compile(r"DESIGN(?:\.md)?\s+(§\d+(?:(?:,\s*|\s+and\s+|\s+or\s+)§\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+)\.\s")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".sh", ".yml", ".yaml"}
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules", "demo", "bench"}


def test_imports(root: Path) -> list[str]:
    """test-imports: a test module importing another test module (lazy imports too)."""
    folder = root / TESTS
    if not folder.is_dir():
        return []
    modules = {p.stem for p in folder.rglob("test_*.py")}
    out = []
    for path in sorted(folder.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.ImportFrom):  # from . import test_x
                names = [a.name for a in node.names]
            else:
                continue
            hit = next((n for n in names if _test_module(n, modules)), None)
            if hit:
                out.append(
                    f"{path.relative_to(root)}:{node.lineno}: test-imports: imports test module "
                    f"{hit} (shared fixtures go to tests/conftest.py, helpers to tests/tiny.py)"
                )
    return out


def _test_module(name: str, modules: set[str]) -> bool:
    parts = name.split(".")
    if parts[0] == TESTS:
        parts = parts[1:]
    return bool(parts) and parts[0] in modules


def design_citations(root: Path) -> list[str]:
    """design-citations: a "DESIGN.md §N" whose N is no numbered heading of docs/DESIGN.md."""
    design = root / DESIGN
    headings = set()
    if design.is_file():
        headings = {m.group(1) for m in map(HEADING.match, design.read_text().splitlines()) if m}
    out = []
    for path in _text_files(root):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(lines, 1):
            for match in CITATION.finditer(line):
                for section in re.findall(r"§(\d+)", match.group(1)):
                    if section not in headings:
                        where = "no such heading" if design.is_file() else f"no {DESIGN}"
                        out.append(
                            f"{path.relative_to(root)}:{number}: design-citations: "
                            f"{match.group(0)!r} cites §{section}: {where} in {DESIGN}"
                        )
    return out


def _text_files(root: Path) -> Iterator[Path]:
    """The tree's text files (hidden folders such as .venv and .git, and build output left
    out)."""
    for path in sorted(root.iterdir()):
        if path.is_dir():
            if not path.name.startswith(".") and path.name not in SKIP_DIRS:
                if not path.name.endswith(".egg-info"):
                    yield from _text_files(path)
        elif path.suffix in TEXT_SUFFIXES or path.name == "Makefile":
            yield path


# The rule by which finished visits leave a decoding batch: written once, in the driver.
COMPACTION = re.compile(r"\bcompact_at\s*\*")
COMPACTION_HOME = Path("cognet") / "core" / "decoding" / "driver.py"


def compaction_once(root: Path) -> list[str]:
    """compaction-once: the compaction rule (`compact_at * ...`) anywhere in the installed
    packages but once, in cognet/core/driver.py."""
    hits = []
    for path in modules(root).values():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COMPACTION.search(line.split("#")[0]):
                hits.append((path.relative_to(root), number))
    home = [h for h in hits if h[0] == COMPACTION_HOME]
    out = [
        f"{where}:{number}: compaction-once: the compaction rule is written in "
        f"{COMPACTION_HOME} only (a selector's `keep` compacts its own state)"
        for where, number in hits
        if where != COMPACTION_HOME or len(home) > 1
    ]
    if not home and (root / COMPACTION_HOME).is_file():
        out.append(f"{COMPACTION_HOME}:1: compaction-once: the driver lost its compaction rule")
    return out


def import_cycles(root: Path) -> list[str]:
    """import-cycle: modules of the installed packages that import each other, directly or
    through others (lazy imports count: a circle is a tangle of ideas, even when Python can
    load it). One line per circle, at the import that closes it."""
    found = modules(root)
    known = set(found)
    graph: dict[str, dict[str, int]] = {}
    for name, path in found.items():
        edges = graph.setdefault(name, {})
        for imp in imports(path, name, known):
            target = imp.module if imp.module in known else None
            if target and target != name:
                edges.setdefault(target, imp.line)
    out = []
    for circle in _circles(graph):
        first, second = circle[0], circle[1 % len(circle)]
        where = f"{found[first].relative_to(root)}:{graph[first][second]}"
        path = " -> ".join([*circle, circle[0]])
        out.append(f"{where}: import-cycle: {path}")
    return out


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle through each strongly connected component of more than one module
    (Tarjan), starting at its smallest name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for component in components:
        members = set(component)
        start = min(component)
        # the shortest way back to `start` inside the component (breadth first)
        parents: dict[str, str] = {}
        queue = [start]
        while queue:
            v = queue.pop(0)
            nxt = sorted(w for w in graph[v] if w in members)
            if start in nxt:
                circle = [v]
                while circle[-1] != start:
                    circle.append(parents[circle[-1]])
                circles.append(circle[::-1])
                break
            for w in nxt:
                if w not in parents and w != start:
                    parents[w] = v
                    queue.append(w)
    return circles


TREE_RULES: list[Callable[[Path], list[str]]] = [
    test_imports,
    design_citations,
    compaction_once,
    import_cycles,
]


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
    print(
        f"layout: {n} modules keep the layering; the tree keeps "
        f"{', '.join(rule.__name__ for rule in TREE_RULES)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
