"""The package's layers run one way, read from the sources with ast (nothing is imported).

A library module imports only from its own layer or the ones below it; the command lines
(every `__main__`, generate.py, plan.py, the configs and the benchmarks) sit on top and
may import anything. No function imports a module of this package: an import deferred
into a function to dodge a cycle hides the cycle instead of removing it, so the only
ones left are of modules that need an optional dependency (torch), which a caller
without it never reaches. Nor does `importlib` reach one, save the two lazy loaders
listed in LAZY_LOADERS.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fractus_jax"

# Lowest first. A module's layer is that of the longest name here equal to it or a package
# above it; "fractus_jax" itself (the public engine API) is matched exactly.
LAYERS = (
    # no engine: dtypes, the host's malloc, the Atom id stream (ids, encoder, features,
    # corpora), the lanes a stream is read in, a path argument that is a URL
    ("fractus_jax.dtypes", "fractus_jax.hostmem", "fractus_jax.atom", "fractus_jax.lanes", "fractus_jax.urls"),
    # pure functions of arrays
    ("fractus_jax.kernels",),
    # the engine: its config, parameters and forward, the mesh layout, the Flax modules,
    # decoding, the PyTorch reference, and the analytic FLOPs of a config
    ("fractus_jax", "fractus_jax.config", "fractus_jax.model", "fractus_jax.sharding", "fractus_jax.nn",
     "fractus_jax.decode", "fractus_jax.reference", "fractus_jax.flops"),
    # on the engine: held-out scoring, the bigram baseline, growth of the engine's arrays
    ("fractus_jax.scoring", "fractus_jax.bigram", "fractus_jax.growth"),
    # the trainer: run directories, the step, the loop, and what works on runs
    ("fractus_jax.train",),
    # on top: the shipped configs, the benchmarks, the command lines and what only they
    # use (the converter to and from PyTorch files, growing a run directory)
    ("fractus_jax.configs", "fractus_jax.bench", "fractus_jax.plan", "fractus_jax.generate", "fractus_jax.eval",
     "fractus_jax.grow", "fractus_jax.convert"),
)
TOP = len(LAYERS) - 1

# Library modules that sit above their package's layer, and why.
ABOVE_THEIR_LAYER = {}

# `importlib` reaching a module of this package, and why it stays.
LAZY_LOADERS = {
    # `fractus_jax.nn` on first use: Flax NNX takes about a second to import, which the
    # pure API and the command lines do not need (tests/test_nn.py checks the attribute).
    "fractus_jax",
    # `python -m fractus_jax.bench SUBCOMMAND` imports the one subcommand's module: the
    # attention benchmark does not import the trainer.
    "fractus_jax.bench.__main__",
}

# Optional third-party dependencies (pyproject's extras): a module that imports one, or
# imports a module that does, may be imported inside a function.
OPTIONAL = {"torch", "safetensors", "matplotlib"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_cli(name: str) -> bool:
    return name.endswith(".__main__") or layer_of(name) == TOP


def layer_of(name: str) -> int:
    if name in ABOVE_THEIR_LAYER:
        return ABOVE_THEIR_LAYER[name]
    best, layer = "", None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            exact = prefix == PACKAGE
            if (name == prefix or (not exact and name.startswith(prefix + "."))) and len(prefix) > len(best):
                best, layer = prefix, i
    assert layer is not None, f"{name} is in no layer: add it to LAYERS"
    return layer


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _targets(module: str, node) -> list[str]:
    """The modules an import statement in `module` reads: a.b.c for `import a.b.c`; for
    `from a.b import c`, a.b.c when that is a module, else a.b."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = _package_of(module).split(".")
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return list(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names))


def _own(target: str) -> bool:
    return target == PACKAGE or target.startswith(PACKAGE + ".")


def _imports(module: str, tree=None):
    """(target, line, inside a function) of every import statement of `module` (its
    source, or `tree` read as if it were its source)."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.extend((t, child.lineno, in_function) for t in _targets(module, child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(TREES[module] if tree is None else tree, False)
    return out


def _needs_optional() -> set[str]:
    """The modules whose import, at module level, reaches an optional dependency (their own
    imports, those of the modules they import and of the packages above them)."""
    edges = {}
    for name in MODULES:
        deps = set()
        for target, _, inner in _imports(name):
            if not inner:
                deps.add(target)
        parent = name.rsplit(".", 1)[0] if "." in name else None
        if parent in MODULES and parent != name:
            deps.add(parent)
        edges[name] = deps
    needs = set()
    changed = True
    while changed:
        changed = False
        for name, deps in edges.items():
            if name not in needs and any(d.split(".")[0] in OPTIONAL or d in needs for d in deps):
                needs.add(name)
                changed = True
    return needs


NEEDS_OPTIONAL = _needs_optional()


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)
    for name in ABOVE_THEIR_LAYER:
        assert name in MODULES, f"ABOVE_THEIR_LAYER names {name}, which is gone: drop it"


def upward_imports(name: str, tree=None) -> list[str]:
    """The imports of library module `name` from a layer above its own."""
    if is_cli(name):
        return []
    return [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} "
            f"(layer {layer_of(target)} over {layer_of(name)})"
            for target, line, _ in _imports(name, tree) if _own(target) and layer_of(target) > layer_of(name)]


def inner_imports(name: str, tree=None) -> list[str]:
    """The imports of a module of the package inside a function of `name`."""
    return [f"{MODULES[name].relative_to(ROOT)}:{line} imports {target} inside a function"
            for target, line, inner in _imports(name, tree)
            if inner and _own(target) and target not in NEEDS_OPTIONAL]


def test_library_modules_import_only_their_layer_or_below():
    wrong = [line for name in MODULES for line in upward_imports(name)]
    assert not wrong, "a library module imports from a higher layer:\n" + "\n".join(wrong)


def test_no_function_imports_a_module_of_the_package():
    wrong = [line for name in MODULES for line in inner_imports(name)]
    assert not wrong, "\n".join(wrong)


def test_importlib_reaches_no_module_of_the_package():
    wrong = []
    for name, tree in TREES.items():
        if name in LAZY_LOADERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                literal = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if called in ("import_module", "__import__") and (not literal or any(map(_own, literal))):
                    wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} calls {called}")
    assert not wrong, "\n".join(wrong)


def test_the_lazy_loaders_are_still_lazy_loaders():
    """LAZY_LOADERS stays short: an entry whose module no longer calls importlib goes."""
    for name in LAZY_LOADERS:
        calls = [n for n in ast.walk(TREES[name]) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"]
        assert calls, f"{name} no longer loads a module lazily: drop it from LAZY_LOADERS"


def _part(name: str) -> str:
    """The top-level part a module belongs to: fractus_jax.X (a package or a module)."""
    return ".".join(name.split(".")[:2])


def part_cycles(extra=()) -> list[list[str]]:
    """Cycles among the package's top-level parts, every import counted (command lines and
    imports inside functions too): a part that imports another which imports it back is an
    arrow pointing up in the package's top-level view. `extra`: (from, to) edges to add."""
    edges: dict[str, set] = {}
    for name in MODULES:
        for target, _, _ in _imports(name):
            if _own(target) and PACKAGE not in (_part(name), _part(target)) and _part(name) != _part(target):
                edges.setdefault(_part(name), set()).add(_part(target))
    for a, b in extra:
        edges.setdefault(a, set()).add(b)
    cycles, done = [], set()

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return cycles


def test_no_part_of_the_package_imports_one_that_imports_it():
    cycles = part_cycles()
    assert not cycles, "parts of the package import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)
    # Not vacuous: the trainer importing a command line's package would close a cycle.
    assert part_cycles(extra=[("fractus_jax.train", "fractus_jax.eval")])


BAD_SOURCE = """
from fractus_jax.train import config
import fractus_jax.train.step
from fractus_jax.model import init_state

def f():
    from fractus_jax import sharding
    import torch
    from fractus_jax.reference import FractusEngine
"""


@pytest.mark.parametrize("module", ["fractus_jax.scoring", "fractus_jax.growth", "fractus_jax.bigram"])
def test_the_checks_report_what_they_forbid(module):
    """Not vacuous: the source above, read as a library module's, fails both checks on
    exactly the lines it should (torch and the torch-only reference are allowed inside f)."""
    tree = ast.parse(BAD_SOURCE)
    assert [line.split(" ")[2] for line in upward_imports(module, tree)] == [
        "fractus_jax.train.config", "fractus_jax.train.step"]
    assert [line.split(" ")[2] for line in inner_imports(module, tree)] == ["fractus_jax.sharding"]
    assert not upward_imports("fractus_jax.train.__main__", tree)   # a command line imports anything


def test_torch_modules_are_the_ones_that_need_the_optional_dependency():
    """The inner-import exemption covers the torch side and nothing of the trainer."""
    assert {"fractus_jax.reference", "fractus_jax.convert.run", "fractus_jax.convert.optim"} <= NEEDS_OPTIONAL
    assert not {n for n in NEEDS_OPTIONAL if n.startswith(("fractus_jax.train", "fractus_jax.model",
                                                           "fractus_jax.scoring"))}


def _console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: name → "module:function"."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return {k.strip(): v.strip().strip('"') for k, v in
            (line.split("=", 1) for line in section.splitlines() if "=" in line and not line.startswith("#"))}


def test_every_command_line_has_a_console_script():
    """`python -m fractus_jax.X` and `fractus-X` run the same main(): each script names a
    module's top-level main, and every command line (each `__main__`, plan, generate) has one."""
    scripts = _console_scripts()
    for name, target in scripts.items():
        module, function = target.split(":")
        assert module in MODULES, f"{name} names {module}, which is not a module of the package"
        defined = {n.name for n in TREES[module].body if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{name}: {module} defines no top-level {function}()"
    commands = {n for n in MODULES if n.endswith(".__main__") and n != f"{PACKAGE}.__main__"}
    commands |= {f"{PACKAGE}.plan", f"{PACKAGE}.generate"}
    missing = commands - {t.split(":")[0] for t in scripts.values()}
    assert not missing, f"command lines without a console script in pyproject.toml: {sorted(missing)}"
