"""The import rules of docs/architecture.md, checked against the code's actual imports.

Every module of the product is parsed with `ast`; every `import` and `from ... import` counts,
at module level or inside a function or class (an import inside a function is still a
dependency, only a hidden one; one under `if TYPE_CHECKING:` is a dependency of the types),
relative imports resolved against the importing package. A module that loads modules by name
(`importlib.import_module`, `__import__`, `runpy.run_module`) imports every module its string
constants name (`pkg.mod` or `pkg.mod:function`): a name in a string is still a dependency, only
one `import` statements do not show. A failure names each offending import as `file:line`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "flight", "hil", "ground", "traces", "bench")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted name of the module (or package) imported
    path: str  # file, relative to the repository root
    line: int
    by_name: bool = False  # loaded through importlib (or runpy) from a string, not an import statement

    def __str__(self) -> str:
        how = " (by name)" if self.by_name else ""
        return f"{self.path}:{self.line}: {self.importer} imports {self.target}{how}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from` import names (PEP 328)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    """`name` or the nearest enclosing package that is one of our modules."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


#: Calls that load a module named by a string (a dotted attribute path's last two parts).
LOADERS = {("importlib", "import_module"), ("", "import_module"), ("", "__import__"), ("runpy", "run_module")}
MODULE_STRING = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_]*)?")


def _loads_by_name(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if (func.value.id, func.attr) in LOADERS:
                    return True
            elif isinstance(func, ast.Name) and ("", func.id) in LOADERS:
                return True
    return False


def _imports_of(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(ROOT))
    if _loads_by_name(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
                name = node.value.partition(":")[0]
                if name in MODULES:
                    yield Import(module, name, rel, node.lineno, by_name=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, rel, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.name == "__init__.py", node)
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod when there is one
                target = f"{base}.{alias.name}"
                yield Import(module, target if target in MODULES else base, rel, node.lineno)


# one entry per (file, line, target): `from a import x, y` is one import of `a`
IMPORTS = list(dict.fromkeys(imp for module, path in MODULES.items() for imp in _imports_of(module, path)))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(
    importers: str | tuple[str, ...],
    forbidden: tuple[str, ...],
    exempt: tuple[str, ...] = (),
    allowed: Callable[[Import], bool] | None = None,
) -> list[str]:
    importers = (importers,) if isinstance(importers, str) else importers
    return [
        str(imp)
        for imp in IMPORTS
        if any(_within(imp.importer, p) for p in importers)
        and not any(_within(imp.importer, p) for p in exempt)
        and any(_within(imp.target, f) for f in forbidden)
        and not (allowed and allowed(imp))
    ]


def _dispatcher_loads_a_cli(imp: Import) -> bool:
    """The `ow` dispatcher (common/cli.py) loads each component's command-line module by name, and
    nothing else of a component: `ow --help` stays fast and `common` holds no import of one."""
    leaf = imp.target.rpartition(".")[2]
    return imp.importer == "common.cli" and imp.by_name and (leaf == "cli" or leaf.endswith("_cli"))


#: Top-level names a module of tests/ can be imported as: `tests.x`, or `x` where pytest puts a
#: test folder on sys.path (testkit, bus_testkit, ...). Product code imports none of them.
TEST_NAMES = ("tests", *sorted({p.stem for p in (ROOT / "tests").rglob("*.py")} - {"__init__", *PACKAGES}))


def test_the_parser_sees_the_code():
    """The rules below would pass vacuously if nothing were found."""
    assert {"common.record", "flight.checkpoint.store", "hil.testbench", "ground.cli", "traces.model"} <= set(MODULES)
    assert any(imp.importer == "flight.checkpoint.store" and imp.target == "common.record" for imp in IMPORTS)
    # imports inside functions count too
    assert any(imp.importer == "flight.cli" and imp.target.startswith("flight.model") for imp in IMPORTS)
    # the simulator's shared pieces are used by the ground and by the testbench's simulator
    assert any(imp.importer == "ground.forecast" and imp.target == "common.sim.windows" for imp in IMPORTS)
    assert any(imp.importer == "hil.sim.lifecycle" and imp.target == "common.sim.windows" for imp in IMPORTS)
    # modules loaded by name: the dispatcher's components, the zygote's preload
    assert any(imp.importer == "common.cli" and imp.target == "flight.cli" and imp.by_name for imp in IMPORTS)
    assert any(imp.importer == "hil.bus.zygote" and imp.target == "flight.runtime.preload" for imp in IMPORTS)
    assert {"testkit", "bus_testkit", "tests"} <= set(TEST_NAMES)


@pytest.mark.parametrize(
    ("rule", "importers", "forbidden", "exempt", "allowed"),
    [
        (
            "common imports no flight, hil or ground (the dispatcher loads their CLI modules by name, nothing else)",
            "common",
            ("flight", "hil", "ground"),
            (),
            _dispatcher_loads_a_cli,
        ),
        ("ground reaches the payload only over the wire", "ground", ("flight", "hil"), (), None),
        ("flight never imports hil or ground", "flight", ("hil", "ground"), (), None),
        ("traces imports no flight, hil or ground", "traces", ("flight", "hil", "ground"), (), None),
        (
            "the shared simulator pieces (common/sim) are pure: ground, hil and bench all import them",
            "common.sim",
            ("flight", "hil", "ground", "traces", "bench"),
            (),
            None,
        ),
        (
            "the VLA scheduler is independent of the flight stack",
            "common.vla",
            ("flight", "hil", "ground", "traces"),
            (),
            None,
        ),
        (
            "the flight stack does not use the VLA scheduler",
            ("flight", "hil", "ground", "traces"),
            ("common.vla",),
            (),
            None,
        ),
        (
            "the bus (hil/bus) is one room: it uses nothing of the testbench around it",
            "hil.bus",
            ("hil",),
            (),
            lambda imp: _within(imp.target, "hil.bus"),
        ),
        ("the product, benchmarks included, imports no test code", PACKAGES, TEST_NAMES, (), None),
    ],
)
def test_import_rule(rule, importers, forbidden, exempt, allowed):
    bad = _violations(importers, forbidden, exempt, allowed)
    if bad:
        pytest.fail(f"{rule}; broken by:\n  " + "\n  ".join(bad), pytrace=False)


def test_flight_holds_no_module_only_the_benchmarks_use():
    """A module of flight/ that only bench/ imports is a benchmark's tool: it lives in bench/."""
    users: dict[str, set[str]] = {}
    for imp in IMPORTS:
        target = _known(imp.target)
        if target and _within(target, "flight") and target != imp.importer:
            users.setdefault(target, set()).add(imp.importer.partition(".")[0])
    bench_only = sorted(module for module, by in users.items() if by == {"bench"})
    if bench_only:
        pytest.fail("modules of flight/ imported only by bench/: " + ", ".join(bench_only), pytrace=False)


def _cycle_scope(module: str) -> bool:
    """Modules that must form no import cycle: common/, flight/, traces/ and every command-line module."""
    leaf = module.rpartition(".")[2]
    return any(_within(module, p) for p in ("common", "flight", "traces")) or leaf == "cli" or leaf.endswith("_cli")


def _strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_cycles() -> list[list[Import]]:
    """Each cycle among the scoped modules, as the imports that close it."""
    scoped = sorted(m for m in MODULES if _cycle_scope(m))
    edges: dict[str, set[str]] = {}
    sites: dict[tuple[str, str], list[Import]] = {}
    for imp in IMPORTS:
        target = _known(imp.target)
        if target is None or target == imp.importer or imp.importer not in scoped or target not in scoped:
            continue
        edges.setdefault(imp.importer, set()).add(target)
        sites.setdefault((imp.importer, target), []).append(imp)
    cycles = []
    for component in _strongly_connected(scoped, edges):
        members = set(component)
        cycles.append(
            [imp for (a, b), found in sorted(sites.items()) if a in members and b in members for imp in found]
        )
    return cycles


def test_no_import_cycles_in_common_flight_traces_and_the_clis():
    cycles = import_cycles()
    report = "\n".join("cycle:\n  " + "\n  ".join(str(imp) for imp in cycle) for cycle in cycles)
    if cycles:
        pytest.fail(f"import cycles (each listed with the imports that close it):\n{report}", pytrace=False)


DOC_PATH = re.compile(r"(?<![\w/.-])(?:common|flight|hil|ground|traces|bench|tests|docs)/[\w./-]*")


def test_the_architecture_page_names_only_paths_that_exist():
    """docs/architecture.md places things in rooms; a moved module must take the page with it."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = sorted(
        {
            name
            for name in (m.group(0).rstrip(".") for m in DOC_PATH.finditer(page))
            if not any((ROOT / candidate).exists() for candidate in (name, name + ".py"))
        }
    )
    if missing:
        pytest.fail("docs/architecture.md names paths that do not exist: " + ", ".join(missing), pytrace=False)


#: Functions still written as long runs of `add_argument` calls (none now: every component's command
#: line is declared as data, common/cliargs.py). The list may only shrink.
ADD_ARGUMENT_LIMIT = 25
LONG_REGISTRATIONS: set[str] = set()


def _add_argument_calls() -> dict[str, int]:
    counts = {}
    for path in MODULES.values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                calls = sum(
                    isinstance(inner, ast.Call)
                    and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr == "add_argument"
                    for inner in ast.walk(node)
                )
                counts[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = calls
    return counts


def test_command_lines_are_declared_not_written_as_long_functions():
    """A command line is a table of `Command`/`arg` declarations, not a function of hundreds of
    `add_argument` lines (docs/architecture.md "Habits")."""
    counts = _add_argument_calls()
    long = {name for name, calls in counts.items() if calls > ADD_ARGUMENT_LIMIT}
    new = sorted(long - LONG_REGISTRATIONS)
    assert not new, f"functions with more than {ADD_ARGUMENT_LIMIT} add_argument calls (declare them): {new}"
    gone = sorted(LONG_REGISTRATIONS - long)
    assert not gone, f"declared now: take them off LONG_REGISTRATIONS: {gone}"


#: The bus's parts and what they share (docs/bus.md "Where things are"): `Bus` (lifecycle.py) owns
#: one object per part and hands each what it uses; no part is built on another.
BUS_PARTS = (
    "hil.bus.base",
    "hil.bus.telemetry",
    "hil.bus.power_fdir",
    "hil.bus.timeline",
    "hil.bus.routing",
    "hil.bus.stations",
    "hil.bus.relay",
    "hil.bus.lifecycle",
)


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def composition_problems(modules: tuple[str, ...]) -> list[str]:
    """Where `modules` build one object by stacking classes instead of composing them: a class
    derived from a class of these modules; state read with `getattr(self, ...)` (an attribute
    that may not be there yet: every attribute is set in `__init__`); a host's interface declared
    for the type checker (`if TYPE_CHECKING:` in a class: a mixin); a private method or attribute
    of another object reached through `self` (`self.part._name`)."""
    trees = {module: ast.parse(MODULES[module].read_text(encoding="utf-8")) for module in modules}
    classes = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for module, tree in trees.items():
        path = MODULES[module]
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if _base_name(base) in classes:
                        found.append(f"{rel}:{node.lineno}: class {node.name} is built on {_base_name(base)}")
                for statement in node.body:
                    if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
                        found.append(
                            f"{rel}:{statement.lineno}: class {node.name} declares its host under TYPE_CHECKING"
                        )
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "self"
            ):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (set every attribute in __init__)")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"
            ):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} reaches into another object's private part")
    return found


def test_the_bus_is_composed_of_parts_not_stacked():
    problems = composition_problems(BUS_PARTS)
    if problems:
        pytest.fail(
            "the bus's parts are to be composed by Bus, not stacked:\n  " + "\n  ".join(problems), pytrace=False
        )


def test_the_composition_check_sees_a_stack(tmp_path, monkeypatch):
    """The check above is not vacuous: the old shape of the bus (a part built on another, state
    read with getattr, a mixin's TYPE_CHECKING block, a private method of another part) fails it."""
    stacked = tmp_path / "stacked.py"
    stacked.write_text(
        "from typing import TYPE_CHECKING\n"
        "class Routing:\n"
        "    def _confirm_stored(self): ...\n"
        "class Relay(Routing):\n"
        "    if TYPE_CHECKING:\n"
        "        store: object\n"
        "    def close(self):\n"
        "        log = getattr(self, 'buslog', None)\n"
        "        self.routing._confirm_stored()\n",
        encoding="utf-8",
    )
    monkeypatch.setitem(MODULES, "hil.bus.stacked", stacked)
    problems = "\n".join(composition_problems(("hil.bus.stacked",)))
    assert "class Relay is built on Routing" in problems
    assert "declares its host under TYPE_CHECKING" in problems
    assert "getattr(self, 'buslog', None)" in problems
    assert "self.routing._confirm_stored reaches into" in problems


#: The payload process (docs/flight.md "Where things are"): FlightApp (app.py) owns the state its
#: threads share and builds its parts -- dispatch, handlers, command jobs, worker, housekeeping,
#: reports, outbox, ... -- handing each what it uses. Every module of flight/runtime/ is one of
#: them or a piece they share, so every one obeys the parts' rules.
PAYLOAD_PARTS = tuple(sorted(module for module in MODULES if _within(module, "flight.runtime")))


def test_the_payload_is_composed_of_parts_not_stacked():
    assert {"flight.runtime.app", "flight.runtime.handlers", "flight.runtime.worker"} <= set(PAYLOAD_PARTS)
    problems = composition_problems(PAYLOAD_PARTS)
    if problems:
        report = "\n  ".join(problems)
        pytest.fail(f"the payload's parts are to be composed by FlightApp, not stacked:\n  {report}", pytrace=False)


#: The ground client's parts (docs/ground.md "Where things are"): `GroundClient` makes them and
#: hands each the parts it uses.
GROUND_CLIENT_PARTS = (
    "ground.client.session",
    "ground.client.upload",
    "ground.client.tasks",
    "ground.client.results",
    "ground.client.ground_client",
)


def test_the_ground_client_is_composed_not_stacked():
    problems = composition_problems(GROUND_CLIENT_PARTS)
    if problems:
        pytest.fail(
            "the ground client's parts are to be composed, not stacked:\n  " + "\n  ".join(problems), pytrace=False
        )


#: The three central objects are built from a settings object and a few collaborators, never
#: from a long list of loose settings (docs/architecture.md "Habits").
CENTRAL_CONSTRUCTORS = (
    ("flight.runtime.app", "FlightApp"),
    ("hil.bus.lifecycle", "Bus"),
    ("ground.client.ground_client", "GroundClient"),
)
MAX_CONSTRUCTOR_PARAMETERS = 3


def constructor_parameters(module: str, name: str) -> list[str]:
    """The parameters of `name.__init__` in `module` besides `self` (a `*args` or `**options`
    counts as one)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for statement in node.body:
                if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
                    a = statement.args
                    named = [arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs]
                    variadic = [f"*{a.vararg.arg}"] if a.vararg else []
                    variadic += [f"**{a.kwarg.arg}"] if a.kwarg else []
                    return named[1:] + variadic
            return []  # no __init__ of its own
    raise AssertionError(f"no class {name} in {module}")


def test_the_central_objects_take_at_most_three_constructor_parameters():
    long = {
        f"{MODULES[module].relative_to(ROOT)}: {name}({', '.join(params)})": len(params)
        for module, name in CENTRAL_CONSTRUCTORS
        if len(params := constructor_parameters(module, name)) > MAX_CONSTRUCTOR_PARAMETERS
    }
    if long:
        listing = "\n  ".join(f"{sig} -- {n} parameters" for sig, n in long.items())
        pytest.fail(
            f"constructors with more than {MAX_CONSTRUCTOR_PARAMETERS} parameters (take a frozen config):\n  {listing}",
            pytrace=False,
        )


def variadic_constructors(modules: tuple[str, ...]) -> list[str]:
    """Classes of `modules` whose `__init__` takes `*args` or `**kwargs`: settings that escape the
    type checker and the parameter count (a `**options` is one parameter however many it hides);
    a central object or one of its parts takes a frozen settings object instead."""
    found = []
    for module in modules:
        path = MODULES[module]
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
                        a = statement.args
                        variadic = ([f"*{a.vararg.arg}"] if a.vararg else []) + (
                            [f"**{a.kwarg.arg}"] if a.kwarg else []
                        )
                        if variadic:
                            found.append(f"{rel}:{statement.lineno}: {node.name}.__init__ takes {', '.join(variadic)}")
    return found


def test_the_central_objects_and_their_parts_take_no_variadic_settings():
    modules = tuple(sorted({*BUS_PARTS, *PAYLOAD_PARTS, *GROUND_CLIENT_PARTS, "ground.client.options"}))
    assert {module for module, _ in CENTRAL_CONSTRUCTORS} <= set(modules)
    problems = variadic_constructors(modules)
    if problems:
        report = "\n  ".join(problems)
        pytest.fail(f"constructors taking *args/**kwargs (take a frozen settings object):\n  {report}", pytrace=False)


def test_the_variadic_check_sees_loose_options(tmp_path, monkeypatch):
    """Not vacuous: the ground client's old constructor (three parameters by count, its settings
    untyped behind `**options`) fails it, and so does a part taking `*args`."""
    old = tmp_path / "old_client.py"
    old.write_text(
        "class GroundClient:\n"
        "    def __init__(self, keys_dir, **options):\n"
        "        self.session = CommandSession(keys_dir, **options)\n"
        "class CommandSession:\n"
        "    def __init__(self, *args):\n"
        "        pass\n",
        encoding="utf-8",
    )
    monkeypatch.setitem(MODULES, "ground.client.old_client", old)
    assert len(constructor_parameters("ground.client.old_client", "GroundClient")) <= MAX_CONSTRUCTOR_PARAMETERS
    problems = "\n".join(variadic_constructors(("ground.client.old_client",)))
    assert "GroundClient.__init__ takes **options" in problems
    assert "CommandSession.__init__ takes *args" in problems


def test_the_constructor_check_sees_a_long_list(tmp_path, monkeypatch):
    """Not vacuous: the payload's old constructor (its loose settings, one parameter each) is counted."""
    old = tmp_path / "old_app.py"
    old.write_text(
        "class FlightApp:\n"
        "    def __init__(self, data_dir, model_dir, keys_dir, endpoint, engine_options, device=None,\n"
        "                 dtype=None, fs=None, checkpoint_fs=None, weight_read_hook=None,\n"
        "                 results_budget_bytes=None, compact_after=None, cadence=None, storage_reserve_bytes=0):\n"
        "        pass\n",
        encoding="utf-8",
    )
    monkeypatch.setitem(MODULES, "flight.runtime.old_app", old)
    assert len(constructor_parameters("flight.runtime.old_app", "FlightApp")) == 14


# --- state shared between the payload's threads ------------------------------------------------------
#
# A part of flight/runtime that owns a lock (`self._lock = threading.Lock()`, RLock, Condition) keeps
# the state its threads share behind it: the attributes touched inside `with self.<lock>:`
# (CurrentWork's engine, progress and stop token, the image store's limits, the queue's tasks, the
# storage state, ...) are read and written only by its own methods, and no other part assigns
# anything into it (the worker setting `self.images.limits` from its thread while the main thread
# read them): another part calls a method that takes the lock and returns a copy or a computed
# value (`queue.live(task_id)`, `storage.condition()`), or holds the lock itself (`with
# self.state.lock:`). That holds for public attributes too (`self.queue.tasks`, `self.storage.state`
# read from another thread were such reads).

LOCK_TYPES = ("Lock", "RLock", "Condition")


@dataclass
class LockOwner:
    name: str
    lock: str  # the attribute holding the lock
    guarded: set[str]  # attributes its methods touch under the lock (the lock itself aside)


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _names_in(annotation: ast.AST | None) -> set[str]:
    """Class names an annotation mentions (`CurrentWork`, `Health | None`, "ImageStore", x.Latest[int])."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    return {_base_name(n) for n in ast.walk(annotation) if isinstance(n, (ast.Name, ast.Attribute))}


def lock_owners(trees: dict[str, ast.Module]) -> dict[str, LockOwner]:
    owners = {}
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            lock = next(
                (
                    _self_attribute(target)
                    for n in ast.walk(cls)
                    if isinstance(n, ast.Assign)
                    and isinstance(n.value, ast.Call)
                    and _base_name(n.value.func) in LOCK_TYPES
                    for target in n.targets
                    if _self_attribute(target)
                ),
                None,
            )
            if lock is None:
                continue
            guarded = set()
            for block in ast.walk(cls):
                if isinstance(block, ast.With) and any(_self_attribute(i.context_expr) == lock for i in block.items):
                    guarded |= {a for n in ast.walk(block) if (a := _self_attribute(n)) is not None}
            methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            owners[cls.name] = LockOwner(cls.name, lock, guarded - methods - {lock})
    return owners


def _owner_of(value: ast.AST | None, annotation: ast.AST | None, owners, params: dict[str, str]) -> str | None:
    """The lock owner a value is an instance of, as far as its annotation or its making shows."""
    for name in _names_in(annotation):
        if name in owners:
            return name
    for n in ast.walk(value) if value is not None else ():
        if isinstance(n, ast.Call) and _base_name(n.func) in owners:
            return _base_name(n.func)
        if isinstance(n, ast.Name) and n.id in params:
            return params[n.id]
    return None


def _function_types(
    function: ast.FunctionDef | ast.AsyncFunctionDef, owners, parts: dict[str, str] | None = None
) -> dict[str, str]:
    """A function's parameters and locals that hold a lock owner (`current: CurrentWork`,
    `storage = self.storage` where the class holds a Storage there)."""
    a = function.args
    found = {
        arg.arg: owner
        for arg in a.posonlyargs + a.args + a.kwonlyargs
        if (owner := _owner_of(None, arg.annotation, owners, {})) is not None
    }
    for n in ast.walk(function):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            if (attr := _self_attribute(n.value)) is not None and attr in (parts or {}):
                found[n.targets[0].id] = (parts or {})[attr]
            elif (owner := _owner_of(n.value, None, owners, found)) is not None:
                found[n.targets[0].id] = owner
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            if (owner := _owner_of(n.value, n.annotation, owners, found)) is not None:
                found[n.target.id] = owner
    return found


@dataclass
class _Scope:
    """What is known where a function's body is read for unlocked shared state."""

    cls: str  # the class the function is a method of
    parts: dict[str, str]  # self.<attribute> -> the lock owner it holds
    names: dict[str, str]  # parameter or local -> the lock owner it holds
    private: dict[str, set[str]]  # a private attribute kept under a lock -> the classes keeping it
    locks: set[str]  # the private attributes that hold an owner's lock (`_lock`)
    guarded: dict[str, set[str]]  # a lock owner -> the attributes its methods touch under its lock


def _holder_owner(holder: ast.AST, scope: _Scope) -> str | None:
    if (attr := _self_attribute(holder)) is not None:
        return scope.parts.get(attr)
    return scope.names.get(holder.id) if isinstance(holder, ast.Name) else None


def _unlocked(node: ast.AST, scope: _Scope, locked: frozenset[str]) -> Iterator[tuple[ast.Attribute, str]]:
    """(attribute, what is wrong) under `node`; `locked`: the holders whose lock is held here
    (`with x.lock:` or `with x._lock:` around the node: x, unparsed)."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        for item in node.items:  # the lock itself is reached from outside the block
            yield from _unlocked(item, scope, locked)
        # held: a part's public lock (`with self.state.lock:`); a private one is not the caller's
        held = {
            ast.unparse(i.context_expr.value)
            for i in node.items
            if isinstance(i.context_expr, ast.Attribute) and not i.context_expr.attr.startswith("_")
        }
        for statement in node.body:
            yield from _unlocked(statement, scope, locked | held)
        return
    elif isinstance(node, ast.Attribute) and _self_attribute(node) is None:
        holder, problem = node.value, None
        owner = _holder_owner(holder, scope)
        if node.attr in scope.locks:
            problem = "takes another part's private lock"
        elif node.attr in scope.private and scope.cls not in scope.private[node.attr]:
            problem = f"reaches into {' or '.join(sorted(scope.private[node.attr]))}'s state kept under its lock"
        elif owner is not None and owner != scope.cls and isinstance(node.ctx, (ast.Store, ast.Del)):
            problem = f"assigns into {owner}, whose state is kept under its lock"
        elif owner is not None and owner != scope.cls and node.attr in scope.guarded[owner]:
            problem = f"reads {owner}'s state kept under its lock"
        if problem and ast.unparse(holder) not in locked:
            yield node, problem
    for child in ast.iter_child_nodes(node):
        yield from _unlocked(child, scope, locked)


def unlocked_shared_state(modules: tuple[str, ...]) -> list[str]:
    """Where code outside a lock owner reaches the private state the owner keeps under its lock
    (`self.app.current._engine`, `current._progress`: through anything but `self`, whatever holds
    it), or assigns into a part known to be a lock owner (`self.images.limits = ...`), without
    holding that owner's lock."""
    trees = {module: ast.parse(MODULES[module].read_text(encoding="utf-8")) for module in modules}
    owners = lock_owners(trees)
    private: dict[str, set[str]] = {}
    for o in owners.values():
        for a in o.guarded | {o.lock}:
            if a.startswith("_"):
                private.setdefault(a, set()).add(o.name)
    found = []
    for module, tree in trees.items():
        path = MODULES[module]
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            functions = [n for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            # the parts a class holds: a dataclass field `state: PersistentState`, `self.current =
            # current` (current: CurrentWork), `self.images = ImageStore(...)`
            parts = {
                s.target.id: owner
                for s in cls.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                if (owner := _owner_of(None, s.annotation, owners, {})) is not None
            }
            for function in functions:
                names = _function_types(function, owners, parts)
                for n in ast.walk(function):
                    if isinstance(n, (ast.Assign, ast.AnnAssign)):
                        annotation = n.annotation if isinstance(n, ast.AnnAssign) else None
                        for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                            owner = _owner_of(n.value, annotation, owners, names)
                            if (attr := _self_attribute(target)) is not None and owner is not None:
                                parts[attr] = owner
            for function in functions:
                locks = {o.lock for o in owners.values() if o.lock.startswith("_")}
                guarded = {o.name: o.guarded for o in owners.values()}
                scope = _Scope(cls.name, parts, _function_types(function, owners, parts), private, locks, guarded)
                for statement in function.body:
                    for node, problem in _unlocked(statement, scope, frozenset()):
                        found.append(f"{rel}:{node.lineno}: {cls.name}.{function.name}: {ast.unparse(node)} {problem}")
    return sorted(set(found))


def test_the_payload_threads_share_state_only_through_its_owners_lock():
    owners = lock_owners({m: ast.parse(MODULES[m].read_text(encoding="utf-8")) for m in PAYLOAD_PARTS})
    assert {"_engine", "_progress", "_stop"} <= owners["CurrentWork"].guarded
    assert "_limits" in owners["ImageStore"].guarded
    assert {"_tasks", "_lost", "_damage"} <= owners["TaskQueue"].guarded
    assert {"_state", "_reason"} <= owners["Storage"].guarded
    problems = unlocked_shared_state(PAYLOAD_PARTS)
    if problems:
        report = "\n  ".join(problems)
        pytest.fail(
            f"state of a lock-owning part used from outside it without its lock (call its methods):\n  {report}",
            pytrace=False,
        )


def test_the_shared_state_check_sees_unlocked_access(tmp_path, monkeypatch):
    """Not vacuous: on the payload's own code, the worker assigning the image store's limits from
    its thread (the old shape), a handler reading the engine through CurrentWork's private
    attribute, or taking CurrentWork's private lock to do so, fails it; so do the old shape's reads
    of a lock owner's public state from another thread (a handler's `self.queue.tasks`, the
    housekeeping message's `storage.state` through a local); holding a part's public lock around
    a use of its state (the dispatcher's `with self.state.lock:` around the replay guard) passes."""
    fixed = MODULES["flight.runtime.worker"].read_text(encoding="utf-8")
    setter = "self.images.set_limits(ProcessorLimits.of_model_dir(config.model_dir))"
    assert setter in fixed
    worker = tmp_path / "worker.py"
    worker.write_text(fixed.replace(setter, "self.images.limits = ProcessorLimits.of_model_dir(config.model_dir)"))
    handlers_code = MODULES["flight.runtime.handlers"].read_text(encoding="utf-8")
    reader = "engine = self.current.engine()"
    assert reader in handlers_code
    live = "live = self.queue.live(msg.task_id)"
    assert live in handlers_code
    handlers = tmp_path / "handlers.py"
    handlers.write_text(
        handlers_code.replace(
            reader, "current = self.current\n        with current._lock:\n            engine = current._engine"
        ).replace(live, "live = self.queue.tasks.get(msg.task_id)")
    )
    housekeeping_code = MODULES["flight.runtime.housekeeping"].read_text(encoding="utf-8")
    condition = "storage_state=storage.condition().state"
    assert condition in housekeeping_code
    housekeeping = tmp_path / "housekeeping.py"
    housekeeping.write_text(housekeeping_code.replace(condition, "storage_state=storage.state"))
    # ... and the owners' state public again, as it was
    for module, private in (("queue", "_tasks"), ("storage", "_state")):
        code = MODULES[f"flight.runtime.{module}"].read_text(encoding="utf-8")
        assert f"self.{private} =" in code
        (tmp_path / f"{module}.py").write_text(re.sub(rf"\bself\.{private}\b", f"self.{private[1:]}", code))
        monkeypatch.setitem(MODULES, f"flight.runtime.{module}", tmp_path / f"{module}.py")
    monkeypatch.setitem(MODULES, "flight.runtime.worker", worker)
    monkeypatch.setitem(MODULES, "flight.runtime.handlers", handlers)
    monkeypatch.setitem(MODULES, "flight.runtime.housekeeping", housekeeping)
    problems = "\n".join(unlocked_shared_state(PAYLOAD_PARTS))
    assert "Worker.load_engine: self.images.limits assigns into ImageStore" in problems, problems
    assert "CommandHandlers.on_shutdown_warning: current._engine reaches into CurrentWork's state" in problems
    assert "current._lock takes another part's private lock" in problems
    assert "on_uplink_task: self.queue.tasks reads TaskQueue's state kept under its lock" in problems
    assert "on_downlink_result" in problems  # both handlers that read the live task directly
    assert "Housekeeping.message: storage.state reads Storage's state kept under its lock" in problems
    assert "self.state.guard" not in problems  # dispatch.py uses it inside `with self.state.lock:`
