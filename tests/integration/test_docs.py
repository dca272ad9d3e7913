"""The README and docs/: every relative link and #anchor resolves, every file path in backticks
exists, no internal history in the text, and the README's Python snippets run as they are.
docs/design/architecture.md against the code: its options table lists exactly the options of
options.py, its NOTE index exactly the NOTE blocks of the package (and where each is), its
module-level state exactly what tests/core/test_structure.py finds."""

import ast
import os
import re
import subprocess
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "paddlefleet", "cudagraph")
DOCS = ["README.md"] + sorted(os.path.relpath(os.path.join(d, n), REPO) for d, _, names in os.walk(os.path.join(REPO, "docs")) for n in names if n.endswith(".md"))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A file path: a name with an extension we ship, optionally under folders (no spaces, no globs).
PATH = re.compile(r"^(?:\.?[\w-]+/)*[\w.-]+\.(?:py|md|txt|json|png|pth|sh|cfg|toml)$")
# Folders a repository path starts with (anything else, e.g. paddleformers/..., is another project's).
REPO_DIRS = ("paddlefleet/", "tools/", "tests/", "testkit/", "docs/", ".ci/", "core/", "io/", "block/", "grads/",
             "step/", "demo/", "backends/", "guards/", "chains/")
PATHS_UNCHECKED = ()
ARCHITECTURE = "docs/design/architecture.md"
MODULE = re.compile(r"^paddlefleet\.cudagraph(?:\.\w+)+$")
HISTORY = re.compile(r"\b(?:issue \d+|run \d+|round \d+|seed \d{3}|the lent (?:H100|GPU|Hopper)\w*|"
                     r"an earlier round|earlier run)\b", re.IGNORECASE)


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return fh.read()


def prose(text):
    """The text outside fenced code blocks (code output is not checked for links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose(read(path)), re.M)}


def path_exists(ref, doc):
    candidates = [os.path.join(REPO, ref), os.path.join(REPO, os.path.dirname(doc), ref), os.path.join(PACKAGE, ref)]
    return any(os.path.exists(c) for c in candidates)


def module_exists(name):
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):  # the longest prefix that is a module; the rest are attributes
        base = os.path.join(REPO, *parts[:cut])
        if os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__init__.py")):
            return True
    return False


class DocsTest(unittest.TestCase):
    maxDiff = None

    def test_relative_links_and_anchors_resolve(self):
        broken = []
        for doc in DOCS:
            for m in LINK.finditer(prose(read(doc))):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z]+://|^mailto:", target):
                    continue
                path, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                if not os.path.exists(os.path.join(REPO, resolved)):
                    broken.append(f"{doc}: {target} (no {resolved})")
                elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                    broken.append(f"{doc}: {target} (no heading #{anchor} in {resolved})")
        self.assertEqual(broken, [])

    def test_file_paths_and_modules_in_backticks_exist(self):
        missing = []
        for doc in DOCS:
            for m in CODE_SPAN.finditer(prose(read(doc))):
                ref = m.group(1).strip()
                if doc in PATHS_UNCHECKED:
                    continue
                if PATH.match(ref) and (ref.startswith(REPO_DIRS) or "/" not in ref):
                    if not path_exists(ref, doc):
                        missing.append(f"{doc}: `{ref}`")
                elif MODULE.match(ref) and not module_exists(ref):
                    missing.append(f"{doc}: `{ref}` (no such module)")
        self.assertEqual(missing, [])

    def test_user_guides_read_without_the_sources(self):
        # The README and docs/guides say what a user needs; the design notes of the sources (NOTE blocks) are
        # for docs/design.
        user_docs = [doc for doc in DOCS if doc == "README.md" or doc.startswith(os.path.join("docs", "guides"))]
        self.assertGreater(len(user_docs), 5, user_docs)
        found = [f"{doc}:{read(doc)[:m.start()].count(chr(10)) + 1}: {m.group(0)!r}" for doc in user_docs
                 for m in re.finditer(r"\bNOTE\b.{0,40}", read(doc))]
        self.assertEqual(found, [])

    def test_no_internal_history_in_the_text(self):
        code = [os.path.relpath(os.path.join(d, n), REPO) for top in ("paddlefleet", "testkit", "tools", "tests")
                for d, _, names in os.walk(os.path.join(REPO, top)) for n in names if n.endswith(".py")]
        texts = DOCS + [c for c in code if c != os.path.join("tests", "integration", "test_docs.py")]
        found = [f"{path}: {m.group(0)!r}" for path in texts for m in HISTORY.finditer(read(path))]
        self.assertEqual(found, [])


def section(text, heading):
    """The text under ``## heading`` up to the next ``## ``."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(text):
    """The cells of each row of the markdown tables in ``text`` (header and rule rows left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line)]
    return rows[1:] if rows else rows


def options_of_options_py():
    """The options every wrapper takes: the annotated fields of the option classes in options.py."""
    tree = ast.parse(read(os.path.join("paddlefleet", "cudagraph", "options.py")))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith(("Options", "OptionsCore"))]
    return {s.target.id for c in classes for s in c.body if isinstance(s, ast.AnnAssign)}


def note_blocks():
    """``{NOTE name: module}``: the NOTE blocks of the package, with the module each is written in: a
    line that is only ``NOTE [ name ]`` (in a docstring or a comment), a docstring that opens with it,
    or a NOTE written inline (``# NOTE [ name ]: text``) that no block of its own names. A NOTE that is
    only referred to (``see NOTE [ name ]``) and written nowhere is a block of no module (``[]``)."""
    found, starts, referred = {}, {}, set()
    for d, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(d, n)
                module = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                for line in read(path).splitlines():
                    m = re.match(r'^\s*(?:#\s*|"""|r""")?NOTE \[ (.+?) \]\s*$', line)
                    if m:
                        found.setdefault(m.group(1), []).append(module)
                        continue
                    m = re.match(r"^\s*#\s*NOTE \[ (.+?) \]", line)
                    if m:
                        starts.setdefault(m.group(1), [])
                        if module not in starts[m.group(1)]:
                            starts[m.group(1)].append(module)
                    referred.update(re.findall(r"NOTE \[ (.+?) \]", line))
    for name in referred - set(found):
        found[name] = starts.get(name, [])[:1]
    return found


class ArchitectureDocTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.text = read(ARCHITECTURE)

    def test_the_options_table_lists_exactly_the_options(self):
        rows = table_rows(section(self.text, "Where each option is read"))
        listed = [re.match(r"`(\w+)`", cells[0]).group(1) for cells in rows]
        options = options_of_options_py()
        self.assertGreaterEqual(options, {"warmup_steps", "max_inflight", "chain_calls"})
        self.assertEqual(sorted(listed), sorted(set(listed)), "an option listed twice")
        self.assertEqual(sorted(set(listed) - options), [], "listed, but not an option of options.py")
        self.assertEqual(sorted(options - set(listed)), [], "options of options.py missing from the table "
                                                           "'Where each option is read' of " + ARCHITECTURE)

    def test_the_note_index_is_the_note_blocks_of_the_code(self):
        index = {}
        for cells in table_rows(section(self.text, "NOTE index")):
            module = cells[1].strip("`")
            for name in cells[0].split("; "):
                index.setdefault(name.strip(), []).append(module)
        blocks = note_blocks()
        self.assertGreater(len(blocks), 0)
        self.assertEqual({n: m for n, m in blocks.items() if len(m) > 1}, {}, "a NOTE written twice")
        self.assertEqual(sorted(n for n, m in blocks.items() if not m), [], "a NOTE referred to and written nowhere")
        self.assertEqual(sorted(set(blocks) - set(index)), [], "NOTE blocks missing from the NOTE index")
        self.assertEqual(sorted(set(index) - set(blocks)), [], "NOTE index rows with no such NOTE block")
        self.assertEqual({n: index[n] for n in blocks if index[n] != blocks[n]}, {},
                         "NOTE index rows naming the wrong module")

    def test_the_module_state_rows_are_what_the_structure_test_finds(self):
        from tests.core.test_structure import listed_state, module_state, _modules

        self.assertEqual(sorted(listed_state(self.text) ^ module_state(_modules())), [])

    def test_every_repo_path_it_names_exists(self):
        self.assertNotIn(ARCHITECTURE, PATHS_UNCHECKED)
        named = [m.group(1).strip() for m in CODE_SPAN.finditer(prose(self.text))]
        paths = [ref for ref in named if PATH.match(ref) and (ref.startswith(REPO_DIRS) or "/" not in ref)]
        self.assertGreater(len(paths), 50)
        self.assertEqual([ref for ref in paths if not path_exists(ref, ARCHITECTURE)], [])

    def test_the_walkthroughs_name_functions_the_code_has(self):
        """The walks of one call through the dispatcher, one call phase by phase, one capture through the
        session and the chains' record name modules, functions, classes and their members that exist: a
        renamed or moved function makes this fail, so the walkthrough cannot go stale silently."""
        modules, classes, names = code_index()
        stale = {}
        for title in WALKTHROUGHS:
            text = section(self.text, title)
            self.assertGreater(len(walk_refs(text)), 5, title)
            bad = [ref for ref in walk_refs(text) if not ref_exists(ref, modules, classes, names)]
            if bad:
                stale[title] = bad
        self.assertEqual(stale, {}, "names in the walkthroughs of " + ARCHITECTURE + " that the code lacks")

    def test_the_walkthrough_check_sees_a_stale_name(self):
        modules, classes, names = code_index()
        for ref in (("path", "core/dispatch", "dispatch_call"), ("path", "core/gone", None), ("class", "Runner", "_replays"),
                    ("class", "NoSuchBody", "claim"), ("call", "start_chains"), ("attr", "links", "observes")):
            self.assertFalse(ref_exists(ref, modules, classes, names), ref)
        self.assertTrue(ref_exists(("class", "Lifecycle", "_replay"), modules, classes, names))  # inherited


#: The sections of architecture.md whose names test_the_walkthroughs_name_functions_the_code_has checks.
WALKTHROUGHS = ("One call through the dispatcher", "One call, phase by phase", "One capture through the session",
                "Chains (layer-by-layer graphing)")
PATH_REF = re.compile(r"(?<![\w/])((?:[a-z_]+/)+[a-z_]+)(?:\.py\b|\.(\w+))")
CLASS_REF = re.compile(r"(?<![\w./])([A-Z]\w*[a-z]\w*)\.(\w+)")
ATTR_REF = re.compile(r"(?<![\w./])([a-z_]\w*)\.([a-z_]\w*)(?![\w/(])")
CALL_REF = re.compile(r"(?<![\w.])([a-z_]\w*)\(")
#: Names a walkthrough uses for the user's code and Paddle's, not the package's.
NOT_OURS = {"wrapped", "layer", "paddle", "p", "args", "kwargs"}
#: What a class of the package inherits from Paddle's (PyLayer).
INHERITED = {"apply"}


def walk_refs(text):
    """The references of a walkthrough: ``("path", module, attribute or None)``, ``("class", Class,
    member)``, ``("attr", name, attribute)``, ``("call", function)``."""
    refs = [("path", m.group(1), m.group(2)) for m in PATH_REF.finditer(text)]
    refs += [("class",) + m.groups() for m in CLASS_REF.finditer(text)]
    refs += [("attr",) + m.groups() for m in ATTR_REF.finditer(text) if m.group(1) not in NOT_OURS]
    refs += [("call", m.group(1)) for m in CALL_REF.finditer(text) if m.group(1) not in NOT_OURS]
    return refs


def ref_exists(ref, modules, classes, names):
    kind = ref[0]
    if kind == "path":
        _, module, attribute = ref
        if module.startswith(("tests/", "tools/", "testkit/")):
            return os.path.exists(os.path.join(REPO, module + ".py"))
        if module not in modules:
            return module + "/__init__" in modules and attribute is None
        return attribute is None or attribute in modules[module]
    if kind == "class":
        return ref[2] in class_members(ref[1], classes) or (ref[1] in classes and ref[2] in INHERITED)
    if kind == "attr":
        return ref[2] in names
    return ref[1] in names


def class_members(name, classes, seen=()):
    """The members of the package's class ``name``, with those of its bases in the package."""
    if name not in classes or name in seen:
        return set()
    members, bases = classes[name]
    out = set(members)
    for base in bases:
        out |= class_members(base, classes, seen + (name,))
    return out


def code_index():
    """``(modules, classes, names)`` of the package: each module's (path under the package, no
    ``.py``) top-level names; each class's ``(members, base names)``; every name defined anywhere."""
    modules, classes, names = {}, {}, set()
    for folder, _, files in os.walk(PACKAGE):
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            tree = ast.parse(read(path))
            top = _defined(tree.body)
            modules[os.path.relpath(path, PACKAGE)[:-3]] = top
            names |= top
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    members = _class_fields(node)
                    classes[node.name] = (members, [b.id for b in node.bases if isinstance(b, ast.Name)])
                    names |= members
    return modules, classes, names


def _defined(body):
    """The names the statements ``body`` define: functions, classes, assigned and imported names."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _class_fields(cls):
    members = _defined(cls.body)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and getattr(node.value, "id", "") == "self":
            members.add(node.attr)
    return members


if __name__ == "__main__":
    unittest.main()


def readme_snippets():
    return re.findall(r"^```python\n(.*?)^```", read("README.md"), flags=re.S | re.M)


class ReadmeSnippetsTest(unittest.TestCase):
    """Every Python snippet of the README runs as it is, in a fresh process, on this CPU."""

    def run_snippet(self, code):
        env = {k: v for k, v in os.environ.items() if k != "PADDLEFLEET_CUDAGRAPH_BACKEND"}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                              text=True, timeout=300, env=env, cwd=REPO)
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-3000:])
        return proc.stdout

    def test_there_are_two_snippets(self):
        self.assertEqual(len(readme_snippets()), 2)

    def test_usage_snippet_graphs_and_replays(self):
        out = self.run_snippet(readme_snippets()[0])
        self.assertIn("'captures': 1, 'replays': 2", out)  # block: 1 warmup, 1 capture, 2 replays
        self.assertIn("graphed; 2 warmup calls, 1 capture, 1 replay on simulate", out)  # ffn.forward
        self.assertIn("autocudagraph(Linear.forward): graphed: 2 of 4 calls replayed a graph", out)  # layer.explain()

    def test_whole_step_snippet_graphs_and_replays(self):
        out = self.run_snippet(readme_snippets()[1])
        self.assertIn("graphed; 2 warmup calls, 1 capture, 3 replays on simulate", out)
        self.assertNotIn("eager calls", out)
