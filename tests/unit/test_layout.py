"""The layout of DESIGN §2 holds: one package per concept, imports in one direction.

The import graph is read from the source with ``ast``, so it sees what the interpreter
may not: imports inside functions and under ``if TYPE_CHECKING:`` count like any other.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = ("executor", "tasks", "orchestrator", "settings")
CALLERS = ("bench", "scripts", "tests")  # import the project, are imported by nothing in it
HOUSE = ("settings", "executor", "tasks", "orchestrator")  # the floors, lowest first

GROUND_FLOOR = ("errors", "results", "fileio", "workdir", "urls", "stopping", "tensorfile", "torchzip")
PACKAGES = ("transfer", "delta", "shards", "artifacts", "rounds", "sandbox", "session")

# Where each part of the engine stands: a module imports only parts of a lower rank (or its own).
RANKS = {
    "executor.errors": 0,
    "executor.fileio": 0,
    "executor.workdir": 0,
    "executor.urls": 0,
    "executor.results": 1,
    "executor.stopping": 1,
    "executor.tensorfile": 1,
    "executor.torchzip": 1,
    "executor.placement": 2,
    "executor.preprocess": 2,
    "executor.transfer": 3,
    "executor.delta": 4,
    "executor.artifacts": 4,
    "executor.shards": 4,
    "executor.rounds": 5,
    "executor.reduce": 5,
    "executor.sandbox": 6,
    "executor.session": 7,
    "executor.configs": 8,  # reads the settings, the only engine module besides the facade
    "executor.assembly": 9,
    "executor.core": 10,
    "executor": 11,  # the package: errors and results eagerly, Executor lazily
}
assert {f"executor.{name}" for name in GROUND_FLOOR} == {m for m, r in RANKS.items() if r <= 1}

# White-box tests of one private module each: what they reach into, and why.
WHITE_BOX = {
    ("tests.unit.test_transfer", "executor.transfer._ranged"),  # segment progress granularity
    ("tests.unit.test_transfer", "executor.transfer._follower"),  # the hash follower alone
    ("tests.unit.test_transfer", "executor.transfer._cancel"),  # Cancel, driven by hand
    ("tests.unit.test_transfer", "executor.transfer._local"),  # the second-pass hash, patched
    ("tests.unit.test_delta", "executor.delta._sync"),  # slice size, patched small
    ("tests.unit.test_delta", "executor.delta._apply"),  # slices patched small, the in-place add seen
    ("tests.unit.test_quant", "executor.delta._apply"),  # apply slices patched odd (int4 mid-byte)
    ("tests.unit.test_artifacts", "executor.artifacts._extract"),  # zip members, one by one
    ("tests.unit.test_artifacts", "executor.artifacts._bundle"),  # copy chunk size, patched small
    # Confinement kinds driven by hand: a v2 group without controllers, discovery from given texts.
    ("tests.sandbox.test_cgroup", "executor.sandbox._cgroup"),
    ("tests.sandbox.test_cgroup", "executor.sandbox._groups"),  # group names, reclaim, discovery
    # The runner's message for a result over the file bound (a real 1 GiB+ result is too heavy here).
    ("tests.unit.test_runner_result", "executor.sandbox._runner"),
    # A watchdog that breaks (its quota walk raising) must end the sandbox: the break is injected.
    ("tests.sandbox.test_deep_tree", "executor.sandbox._supervisor"),
    ("tests.unit.test_trees", "executor.sandbox._result"),  # the watchdog's quota walk, alone
    ("tests.unit.test_trees", "executor.session._model"),  # a bundle's chmod walk, on a deep tree
    # The seccomp programs of both architectures, run by hand; their numbers against libseccomp's.
    ("tests.sandbox.test_seccomp", "executor.sandbox._seccomp"),
    # The unshare launch where bwrap is the default: its probe, and the paths it must reach.
    ("tests.sandbox.test_limits", "executor.sandbox._launch"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(roots: tuple[str, ...]) -> dict[str, Path]:
    found = {}
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imported(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """Every project module ``path`` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # ``from pkg import module`` depends on the module, not on pkg's __init__.
                submodule = f"{base}.{alias.name}"
                yield from _resolve(submodule if submodule in known else base, known)


def _resolve(name: str, known: set[str]) -> Iterator[str]:
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name


def graph(roots: tuple[str, ...]) -> dict[str, set[str]]:
    modules = sources(roots)
    known = set(sources(PROJECT + CALLERS))
    return {name: set(imported(path, name, known)) - {name} for name, path in modules.items()}


def is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def owner(private: str) -> str:
    """The package a private module belongs to: everything before its first private part."""
    parts = private.split(".")
    first = next(i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__"))
    return ".".join(parts[:first])


def rank(module: str) -> int | None:
    while module:
        if module in RANKS:
            return RANKS[module]
        module = module.rpartition(".")[0]
    return None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_sees_hidden_imports() -> None:
    # The checker itself: an import inside a function and one under TYPE_CHECKING are edges.
    edges = graph(PROJECT)
    assert "executor.core" in edges["executor"], "executor/__init__ imports Executor lazily"
    assert "settings" in edges["tasks.events"], "Settings is imported for typing only"


def test_no_import_cycle() -> None:
    cycle = find_cycle(graph(PROJECT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_private_module_is_imported_only_inside_its_package() -> None:
    wrong = []
    for module, targets in graph(PROJECT + CALLERS).items():
        for target in targets:
            if not is_private(target) or (module + ".").startswith(owner(target) + "."):
                continue
            if (module, target) not in WHITE_BOX:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_white_box_exceptions_are_still_needed() -> None:
    edges = graph(CALLERS)
    stale = [pair for pair in WHITE_BOX if pair[1] not in edges.get(pair[0], set())]
    assert not stale, f"no longer imported, drop from WHITE_BOX: {stale}"


def test_the_engine_imports_downward_only() -> None:
    upward = []
    for module, targets in graph(("executor",)).items():
        here = rank(module)
        for target in targets:
            there = rank(target)
            same_part = there == here and (module + ".").startswith(_part(target) + ".")
            if there is not None and here is not None and there >= here and not same_part:
                upward.append(f"{module} (rank {here}) imports {target} (rank {there})")
    assert not upward, "\n".join(sorted(upward))


def test_the_house_imports_downward_only() -> None:
    # DESIGN §2's floors: settings is read by all, the engine knows no glue, the glue no
    # orchestrator (the `roundhouse` command that reaches both stands in orchestrator/cli.py).
    # The callers (bench, scripts, tests) stand above the house: nothing in it imports them.
    def floor(module: str) -> int:
        top = module.split(".")[0]
        return HOUSE.index(top) if top in HOUSE else len(HOUSE)

    upward = [
        f"{module} imports {target}"
        for module, targets in graph(HOUSE).items()
        for target in targets
        if floor(target) > floor(module)
    ]
    assert not upward, "\n".join(sorted(upward))


def _part(module: str) -> str:
    while module and module not in RANKS:
        module = module.rpartition(".")[0]
    return module


def test_the_engine_does_not_know_celery() -> None:
    # DESIGN §2: executor/ stays usable without Celery; tasks/ is the only glue.
    for module, path in sources(("executor",)).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        ]
        assert not [n for n in names if n.split(".")[0] in ("celery", "kombu", "billiard", "tasks")], module


def test_every_package_lists_its_public_surface() -> None:
    for name in PACKAGES:
        init = REPO / "executor" / name / "__init__.py"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"executor.{name} has no docstring"
        exported = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
        ]
        assert exported, f"executor.{name} has no __all__"
        names = ast.literal_eval(exported[0].value)
        bound = {
            alias.asname or alias.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert set(names) <= bound, f"executor.{name}.__all__ names what it does not import"


def test_modules_and_functions_stay_small() -> None:
    # DESIGN §10: modules of 100-500 lines, functions under ~70.
    too_long = []
    for module, path in sources(PROJECT).items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > 500:
            too_long.append(f"{module}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 70:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


# The names of the work dir's parts that say nothing else (a thread or a host may be "sandbox").
WORK_DIR_NAMES = {
    "session.json", "delta-residual.safetensors", "private-shards", "model-offload",
    "sandbox-spare", "incoming", "staging", "deltas", "results", "replay",
}  # fmt: skip


def test_the_work_dir_is_spelled_in_one_module() -> None:
    # executor/workdir.py names every path of a work dir; a second spelling drifts from it.
    spelled = []
    for module, path in sources(PROJECT).items():
        if module == "executor.workdir":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Constant) and node.value in WORK_DIR_NAMES):
                continue
            if not _is_label(node.value, module):
                spelled.append(f"{module}:{node.lineno} {node.value!r}")
    assert not spelled, "\n".join(spelled)


def _is_label(value: str, module: str) -> bool:
    """A word that names something else there: the replay store's refusal reason, the spare's
    thread name."""
    return (value, module) in {("replay", "tasks.trust.replay"), ("sandbox-spare", "executor.sandbox._spare")}


def test_each_package_docstring_names_each_of_its_modules() -> None:
    # A newcomer reads a package's modules from its docstring: one missing there is one nobody
    # finds. Named as ``name`` in the text, or first on a line of a listing (transfer's).
    missing = []
    for root in PROJECT:
        for init in sorted(Path(REPO, root).rglob("__init__.py")):
            package = init.parent
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
            members = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
            members += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
            for name in members:
                listed = re.search(rf"^\s+{re.escape(name)}\s", doc, re.MULTILINE)
                if f"``{name}``" not in doc and not listed:
                    missing.append(f"{package.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(sorted(missing))


def test_a_private_name_is_imported_only_inside_its_package() -> None:
    # ``from tasks.cli import _mask`` in a test: the test then pins a private name, which a
    # refactor may rename freely. What another package needs is public. (Private modules: above.)
    modules = sources(PROJECT + CALLERS)
    known = set(modules)
    wrong = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            owner = node.module if modules.get(node.module, Path()).name == "__init__.py" else None
            owner = owner or node.module.rpartition(".")[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if not private or f"{node.module}.{alias.name}" in known:
                    continue
                if not (module + ".").startswith(owner + "."):
                    wrong.append(f"{module} imports {node.module}.{alias.name}")
    assert not wrong, "\n".join(sorted(wrong))


# The session's room and the facade over it (issue 27): each well inside the rails, so that the
# next feature lands in a module with room for it rather than squeezed against a limit.
FACADE_MAX_LINES = 350
ROOM_FUNCTION_MAX_LINES = 60
ROOMY = ("executor.session", "executor.core", "executor.assembly", "executor.configs")


def test_the_facade_is_thin_and_the_session_has_room() -> None:
    crowded = []
    for module, path in sources(("executor",)).items():
        text = path.read_text(encoding="utf-8")
        if module == "executor.core" and text.count("\n") > FACADE_MAX_LINES:
            crowded.append(f"{module}: {text.count(chr(10))} lines (the facade: at most {FACADE_MAX_LINES})")
        if not any((module + ".").startswith(room + ".") for room in ROOMY):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > ROOM_FUNCTION_MAX_LINES:
                    crowded.append(f"{module}.{node.name}: {length} lines")
    assert not crowded, "\n".join(crowded)


def test_only_the_facade_reads_the_settings() -> None:
    # DESIGN §10: each part gets its config built once (executor.configs); none reads Settings.
    readers = sorted(
        module
        for module, targets in graph(("executor",)).items()
        if any(t == "settings" or t.startswith("settings.") for t in targets)
    )
    assert readers == ["executor", "executor.configs", "executor.core"], readers
