"""The package's shape, measured from its source (no import, no Paddle): size limits, folders,
no test kit inside, no import cycles, guards at the bottom and backends above them only, every Paddle
patch through guards/paddle_patches.py, and every module-level mutable object listed in
docs/design/architecture.md ("Module-level state")."""

import ast
import pathlib
import re
import unittest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "paddlefleet" / "cudagraph"
NAME = "paddlefleet.cudagraph"
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
ARCHITECTURE = PACKAGE.parents[1] / "docs" / "design" / "architecture.md"
TEST_KIT_IMPORTS = {"unittest", "pytest", "parameterized", "testkit"}
PATCHES = f"{NAME}.guards.paddle_patches"


def _modules():
    """``{dotted module name: (path, ast)}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([NAME] + parts)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _imports(name, path, tree, modules):
    """The package modules ``name`` imports (at any depth of its code), resolved to modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(NAME):
                continue
            for alias in node.names:  # ``from . import state`` imports the module state
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found.discard(name)
    return found


# Calls whose result never changes (or is a logger): a module-level name bound to anything else is
# module state (NOTE-free rule: a new kind of immutable value is added here, with its reason).
IMMUTABLE_CALLS = {"frozenset", "tuple", "object", "getattr", "hasattr", "isinstance", "attrgetter", "itemgetter",
                   "getLogger", "MappingProxyType", "namedtuple", "TypeVar", "str", "int", "float", "bool", "bytes",
                   "is_compiled_with_cuda", "compile"}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _module_level(tree):
    """Top-level statements, with those inside top-level if/try blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            stack[:0] = node.body + node.orelse + node.__dict__.get("finalbody", []) + [
                s for h in node.__dict__.get("handlers", []) for s in h.body]
        else:
            yield node


def _is_mutable(value):
    if isinstance(value, ast.Call):
        func = value.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) not in IMMUTABLE_CALLS
    return isinstance(value, MUTABLE_LITERALS)


def module_state(modules):
    """``{(module path relative to the package, name)}`` of every module-level mutable object: a
    container literal, a call that may return a mutable object (any but IMMUTABLE_CALLS), or a name
    a function rebinds with ``global``."""
    found = set()
    for path, tree in modules.values():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in _module_level(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if _is_mutable(value):
                found.update((rel, t.id) for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
        found.update((rel, name) for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names)
    return found


def listed_state(text):
    """``{(module, name)}`` of the rows of the "Module-level state" section of architecture.md."""
    section = text.split("## Module-level state", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+\.py)` \| ([^|]+) \|", section, re.M)
    return {(module, name) for module, names in rows for name in re.findall(r"`(\w+)`", names)}


class StructureTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.modules = _modules()

    def test_no_class_or_function_over_the_size_limits(self):
        over = []
        for name, (path, tree) in self.modules.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    limit = MAX_CLASS_LINES
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    limit = MAX_FUNCTION_LINES
                else:
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    over.append(f"{path.relative_to(PACKAGE)}: {node.name} has {lines} lines (limit {limit})")
        self.assertEqual(over, [], "split these:\n" + "\n".join(over))

    def test_no_module_over_the_size_limit(self):
        over = [f"{path.relative_to(PACKAGE)}: {n} lines" for path, _ in self.modules.values()
                if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
        self.assertEqual(over, [], f"split these by concern (limit {MAX_MODULE_LINES} lines):\n" + "\n".join(over))

    def test_module_level_state_is_listed_in_the_design_doc(self):
        found = module_state(self.modules)
        listed = listed_state(ARCHITECTURE.read_text())
        self.assertGreater(len(found), 0)
        missing = sorted(f"{m}: {n}" for m, n in found - listed)
        gone = sorted(f"{m}: {n}" for m, n in listed - found)
        self.assertEqual(missing, [], "module-level mutable objects missing from docs/design/architecture.md, "
                                      "section 'Module-level state' (add a row: module, object, what it holds "
                                      "and who writes it; or make the object immutable)")
        self.assertEqual(gone, [], "rows of 'Module-level state' in docs/design/architecture.md whose object "
                                   "no longer exists (or is no longer mutable): remove them")

    def test_the_state_scan_finds_each_kind_of_mutable_object(self):
        tree = ast.parse("import threading, weakref, types\n"
                         "A = {}\nB = [0]\nC = weakref.WeakSet()\nD = threading.local()\nE = object()\n"
                         "F = types.MappingProxyType({})\nG = frozenset()\nH = 3\n__all__ = []\n"
                         "try:\n    I = set()\nexcept ImportError:\n    I = None\n"
                         "def f():\n    global J\n    J = 1\n")
        found = module_state({"m": (PACKAGE / "m.py", tree)})
        self.assertEqual(found, {("m.py", n) for n in ("A", "B", "C", "D", "I", "J")})


    def test_folders_carry_the_architecture(self):
        subpackages = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
        self.assertGreaterEqual(len(subpackages), 4, subpackages)
        top = sorted(p.name for p in PACKAGE.glob("*.py"))
        self.assertLessEqual(len(top), 8, f"modules at the top of the package: {top}")

    def test_no_test_kit_inside_the_package(self):
        kit = []
        for name, (path, tree) in self.modules.items():
            if path.stem in ("testing", "harness", "step_gpu", "conftest") or path.stem.startswith("test_"):
                kit.append(name)
            for node in ast.walk(tree):
                roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                         [(node.module or "").split(".")[0]] if isinstance(node, ast.ImportFrom) and not node.level
                         else [])
                kit.extend(f"{name} imports {r}" for r in roots if r in TEST_KIT_IMPORTS)
        self.assertEqual(kit, [], "the test kit belongs in testkit/")

    def test_no_import_cycles(self):
        graph = {name: _imports(name, path, tree, self.modules) for name, (path, tree) in self.modules.items()}
        # A package's __init__ re-exporting its children is not a cycle with them: a child importing
        # a sibling through the package is. So only edges child -> own package are dropped.
        for name, deps in graph.items():
            deps.difference_update({d for d in deps if name.startswith(d + ".")})
        cycles, state = [], {}

        def visit(node, stack):
            state[node] = "open"
            stack.append(node)
            for dep in sorted(graph[node]):
                if state.get(dep) == "open":
                    cycles.append(stack[stack.index(dep):] + [dep])
                elif dep not in state:
                    visit(dep, stack)
            stack.pop()
            state[node] = "done"

        for node in sorted(graph):
            if node not in state:
                visit(node, [])
        self.assertEqual(cycles, [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles))

    def _above(self, room, allowed):
        above = []
        for name, (path, tree) in self.modules.items():
            if not name.startswith(f"{NAME}.{room}"):
                continue
            for dep in _imports(name, path, tree, self.modules):
                if not dep.startswith(tuple(f"{NAME}.{a}" for a in allowed)):
                    above.append(f"{name} imports {dep}")
        return above

    def test_backends_import_nothing_above_them(self):
        self.assertEqual(self._above("backends", ("backends", "guards", "errors")), [],
                         "backends sit above guards only: they may import backends/, guards/ and errors")

    def test_guards_sit_at_the_bottom(self):
        self.assertEqual(self._above("guards", ("guards", "errors")), [],
                         "guards (what a capture intercepts) sit at the bottom: they may import only guards/ and errors")

    def test_rooms_above_the_backends_ask_the_backend_not_its_name(self):
        """A backend's difference is the backend's: outside backends/, no module reads the backend's
        ``capture_executes`` flag nor compares a ``.name`` with a backend's name; they ask
        ``Backend.replays_python``, ``cpu_is_host``, ``guard`` or ``release_error``."""
        names = {"cuda", "simulate", "eager"}
        sites = []
        for name, (path, tree) in self.modules.items():
            if name.startswith(f"{NAME}.backends"):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "capture_executes":
                    sites.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .capture_executes")
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name":
                    if any(isinstance(c, ast.Constant) and c.value in names for c in node.comparators):
                        sites.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
        self.assertEqual(sites, [], "ask the backend (backends/base.py Backend), not its flag or its name")

    def test_chains_sit_between_block_and_step_and_the_api(self):
        """chains/ is built above block/ (which reaches it only through block/hooks.py's interface, filled
        by the API) and below the API: nothing but the API and the package's __init__ imports it, and it
        imports neither of them."""
        chains = f"{NAME}.chains"
        top = (f"{NAME}.api", NAME)
        wrong = []
        for name, (path, tree) in self.modules.items():
            deps = _imports(name, path, tree, self.modules)
            if name.startswith(chains + ".") or name == chains:
                wrong += [f"{name} imports {d}" for d in deps if d in top]
            elif name not in top:
                wrong += [f"{name} imports {d}" for d in deps if d == chains or d.startswith(chains + ".")]
        self.assertEqual(wrong, [], "chains sit between block/, step/ and the API")

    def test_paddle_is_patched_only_through_paddle_patches(self):
        """NOTE [ Paddle patches ]: no setattr() nor assignment to an attribute of paddle (or of
        Paddle's ``core``) elsewhere; paddle_patches itself imports nothing from the package."""
        path, tree = self.modules[PATCHES]
        self.assertEqual(_imports(PATCHES, path, tree, self.modules), set())
        sites = []
        for name, (path, tree) in self.modules.items():
            if name == PATCHES:
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"):
                    sites.append(f"{path.relative_to(PACKAGE)}:{node.lineno} setattr")
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in targets:
                    root = target
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if target is not root and isinstance(root, ast.Name) and root.id in ("paddle", "core"):
                        sites.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(target)} =")
        self.assertEqual(sites, [], "replace Paddle attributes through guards/paddle_patches.py (Patches, patched)")

    def test_chain_state_lives_in_chains(self):
        """Chains own their state: outside chains/, no class has a field about chains but the entry's one
        record (GraphEntry.chain, a chains/record.py ChainRecord), the option and the public counter of chained calls;
        the bridge's token has one watch hook (and the verdict's backward timer), not the chains' fields."""
        allowed = {("core/entry.py", "GraphEntry", "chain"), ("core/stats.py", "Counters", "chained_calls"),
                   ("options.py", "GraphOptions", "chain_calls")}
        found = set()
        for name, (path, tree) in self.modules.items():
            rel = path.relative_to(PACKAGE).as_posix()
            if rel.startswith("chains/"):
                continue
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
                found.update((rel, cls.name, field) for field in _fields(cls) if "chain" in field.lower())
        self.assertEqual(sorted(found - allowed), [], "keep a key's chain state in its chains/record.py ChainRecord")
        path, tree = self.modules[f"{NAME}.block.bridge"]
        [token] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Token"]
        self.assertEqual(set(_fields(token)), {"__weakref__", "done", "hooked", "watch", "timer"})

    def test_chain_predicates_and_invalidation_have_one_place_each(self):
        """Whether a call or key may chain is decided in chains/eligible.py alone (the only chains module
        that asks a replay's preconditions); a key's cached chain is dropped by ChainRecord.forget alone."""
        asks, drops = [], []
        for name, (path, tree) in self.modules.items():
            rel = path.relative_to(PACKAGE).as_posix()
            for node in ast.walk(tree):
                if (rel.startswith("chains/") and rel != "chains/eligible.py" and isinstance(node, ast.ImportFrom)
                        and any(a.name == "replay_blocker" for a in node.names)):
                    asks.append(rel)
                if isinstance(node, ast.Assign) and rel != "chains/record.py":
                    drops += [f"{rel}:{node.lineno}" for t in node.targets if isinstance(t, ast.Attribute)
                              and t.attr in ("chain", "version") and isinstance(node.value, ast.Constant)
                              and node.value.value is None]
        self.assertEqual(asks, [], "ask chains/eligible.py whether a call may chain")
        self.assertEqual(drops, [], "drop a key's chain through ChainRecord.forget (chains/record.py)")


def _fields(cls):
    """The fields a class declares: annotated class attributes, ``__slots__`` and ``self.x = ...`` in its methods."""
    fields = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.add(node.target.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            fields.update(e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            fields.add(node.attr)
    return fields


if __name__ == "__main__":
    unittest.main()
