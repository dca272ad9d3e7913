"""The package's shape, measured from its source (no import, no Paddle): size limits, folders,
no test kit inside, no import cycles, backends that import nothing above them, and every Paddle
patch through backends/paddle_patches.py."""

import ast
import pathlib
import unittest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "paddlefleet" / "cudagraph"
NAME = "paddlefleet.cudagraph"
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
TEST_KIT_IMPORTS = {"unittest", "pytest", "parameterized", "testkit"}
PATCHES = f"{NAME}.backends.paddle_patches"


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

    def test_backends_import_nothing_above_them(self):
        allowed = (f"{NAME}.backends", f"{NAME}.errors")
        above = []
        for name, (path, tree) in self.modules.items():
            if not name.startswith(f"{NAME}.backends"):
                continue
            for dep in _imports(name, path, tree, self.modules):
                if not dep.startswith(allowed):
                    above.append(f"{name} imports {dep}")
        self.assertEqual(above, [], "backends sit at the bottom: they may import only backends/ and errors")

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
        self.assertEqual(sites, [], "replace Paddle attributes through backends/paddle_patches.py (Patches, patched)")


if __name__ == "__main__":
    unittest.main()
