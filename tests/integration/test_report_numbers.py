"""What the README and the guides claim is what the committed reports say.

* The README's "Results on a GPU" block is what tools/readme_table.py writes from docs/reports/benchmarks.json.
* Every measured number a user reads in README.md or docs/guides/ (us, ms, MiB, a ratio like 1.84x, "89 of 89",
  "21 skipped") sits in a paragraph that cites a report under docs/reports/ (or follows one, in the same
  section), and that report has it, within the rounding the text uses.
* Every repository path named in README.md, docs/, the requirements files and the tools' help (their
  docstrings and argparse help) exists.
"""

import ast
import importlib.util
import json
import math
import os
import re
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "paddlefleet", "cudagraph")
REPORTS = os.path.join(REPO, "docs", "reports")
GUIDES = ["README.md"] + sorted(os.path.join("docs", "guides", n) for n in os.listdir(os.path.join(REPO, "docs", "guides"))
                                if n.endswith(".md"))

CITED = re.compile(r"(?:docs/)?reports/([\w.-]+\.(?:md|json))")
# A measured number: 1,613 us / 0.78 ms / 1,512.2 MiB / 1.84x / 89 of 89 / 21 skipped.
UNIT = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)\s?(us|µs|ms|MiB|GiB|x)(?![\w])")
COUNT = re.compile(r"\b(\d+) of (\d+)\b(?= (?:matmul-only )?cases| passed| checks)|\b(\d+) skipped\b")
TIME_UNITS = ("us", "µs", "ms")
TABLE_NUMBER = re.compile(r"^(\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?: / (\d{1,3}(?:,\d{3})+|\d+))?$")


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        return fh.read()


def readme_table_tool():
    spec = importlib.util.spec_from_file_location("readme_table", os.path.join(REPO, "tools", "readme_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- reports
def _json_numbers(value, out):
    """Every number in a JSON value; bytes also in MiB; per object, the ratios of its times (``*_us``)."""
    if isinstance(value, dict):
        times = []
        for key, item in value.items():
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                out.add(float(item))
                if key.endswith("bytes"):
                    out.add(item / 2 ** 20)
                if key.endswith("us") or key in ("us",):
                    times.append(float(item))
            _json_numbers(item, out)
        return times
    if isinstance(value, list):
        for item in value:
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                out.add(float(item))
            _json_numbers(item, out)
    return []


def _times(value):
    """All ``*_us`` / ``us`` numbers anywhere under ``value``."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (int, float)) and not isinstance(item, bool) and (key.endswith("_us") or key == "us"):
                found.append(float(item))
            elif isinstance(item, (dict, list)):
                found += _times(item)
    elif isinstance(value, list):
        for item in value:
            found += _times(item)
    return found


class Report:
    """The numbers one report holds: those of its text, and for a JSON report every value, bytes in MiB
    and the ratios of any two times of one row."""

    def __init__(self, name):
        self.name = name
        self.text = read(os.path.join("docs", "reports", name))
        self.numbers = {float(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?",
                                                                        self.text)}
        self.ratios = set()
        if name.endswith(".json"):
            data = json.loads(self.text)
            _json_numbers(data, self.numbers)
            for row in data if isinstance(data, list) else [data]:
                times = [t for t in _times(row) if t > 0]
                self.ratios.update(a / b for a in times for b in times)

    def has(self, text, ratio=False):
        value = float(text.replace(",", ""))
        decimals = len(text.split(".")[1]) if "." in text else 0
        tolerance = 0.5 * 10 ** -decimals + 1e-9
        pool = self.numbers | self.ratios if ratio else self.numbers
        return any(abs(v - value) <= tolerance for v in pool if math.isfinite(v))


_REPORTS = {}


def report(name):
    if name not in _REPORTS:
        _REPORTS[name] = Report(name)
    return _REPORTS[name]


def cited_reports(text):
    """The reports a paragraph cites; a markdown report brings its JSON twin (the tool wrote both)."""
    names = set()
    for name in CITED.findall(text):
        if os.path.exists(os.path.join(REPORTS, name)):
            names.add(name)
            twin = name[:-3] + ".json" if name.endswith(".md") else None
            if twin and os.path.exists(os.path.join(REPORTS, twin)):
                names.add(twin)
    return sorted(names)


# ---------------------------------------------------------------------------- claims
def prose(text):
    """The text outside fenced code blocks (examples of output are not claims)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def without_code(text):
    """``text`` without its inline code (an example like `captured in 12.3 ms` is not a claim)."""
    return re.sub(r"`[^`\n]*`", "``", text)


def paragraphs(text):
    """``(section, paragraph)`` pairs; a table is one paragraph."""
    section = ""
    for block in re.split(r"\n\s*\n", text):
        heading = re.match(r"^#{1,3} (.*)$", block.strip().splitlines()[0]) if block.strip() else None
        if heading:
            section = heading.group(1)
        yield section, block


def claims(block):
    """``[(number text, is a ratio, unit)]`` and ``[count phrase]`` of one paragraph."""
    block = without_code(block)
    numbers = [(m.group(1), m.group(2) == "x", m.group(2)) for m in UNIT.finditer(block)]
    for line in block.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            for cell in line.strip().strip("|").split("|"):
                m = TABLE_NUMBER.match(cell.strip())
                if m and "," in cell:  # a table of timings (plain small integers are counts of something else)
                    numbers += [(n, False, "us") for n in cell.strip().split(" / ")]
    counts = [m.group(0) for m in COUNT.finditer(block)]
    return numbers, counts


def check_doc(doc):
    """What ``doc`` claims that its cited reports do not have (or that cites no report)."""
    problems = []
    cites, cites_section = [], None
    for section, block in paragraphs(prose(read(doc))):
        own = cited_reports(block)
        if own:
            cites, cites_section = own, section
        elif section != cites_section:
            cites = []
        numbers, counts = claims(block)
        line = block.strip().splitlines()[0][:70] if block.strip() else ""
        if not cites:
            # A size or a ratio may be a constant of the code (at most 4 MiB, a 1.4x target); a time or a test
            # count is a measurement, and a measurement comes from a report.
            measured = [n for n, _, unit in numbers if unit in TIME_UNITS] + counts
            if measured:
                problems.append(f"{doc}: {measured} in a paragraph citing no report under docs/reports/: {line!r}")
            continue
        for text, ratio, _ in numbers:
            if not any(report(name).has(text, ratio) for name in cites):
                problems.append(f"{doc}: {text}{'x' if ratio else ''} is in none of {cites}: {line!r}")
        for phrase in counts:
            if not any(phrase in report(name).text for name in cites):
                problems.append(f"{doc}: {phrase!r} is in none of {cites}: {line!r}")
    return problems


class ReportNumbersTest(unittest.TestCase):
    maxDiff = None

    def test_the_readme_results_block_is_what_the_tool_writes(self):
        tool = readme_table_tool()
        text = read("README.md")
        self.assertIn(tool.BEGIN, text)
        self.assertEqual(tool.rewrite(text, tool.render(*tool.load(REPO))), text,
                         "README.md's results block is out of date: run python tools/readme_table.py")

    def test_the_results_block_has_the_realistic_rows_and_says_what_was_not_measured(self):
        tool = readme_table_tool()
        block = tool.render(*tool.load(REPO))
        self.assertIn("24 transformer-like layers (6 matmuls each) x 1024, batch 32", block)
        # The row's eager and autocudagraph numbers and their ratio, as docs/reports/benchmarks.json has them.
        [row] = [r for r in json.loads(read("docs/reports/benchmarks.json"))
                 if r["config"] == "xformer24x1024_b32_perlayer" and r["mode"] == "throughput"]
        eager, graphed = row["paddle_eager_us"], row["autocudagraph_us"]
        self.assertIn(f"| {eager:,.0f} | {graphed:,.0f} | {eager / graphed:.2f}x |", block)
        self.assertIn("**What was not measured**: a real model", block)
        self.assertIn("Paddle 3.x", block)

    def test_every_number_in_the_readme_and_guides_is_in_the_report_it_cites(self):
        problems = [p for doc in GUIDES for p in check_doc(doc)]
        self.assertEqual(problems, [])

    def test_a_number_the_report_does_not_have_is_found(self):
        # The check itself, on numbers taken from the report and numbers it cannot have.
        bench = report("benchmarks.json")
        [row] = [r for r in json.loads(read("docs/reports/benchmarks.json"))
                 if r["config"] == "xformer24x1024_b32_perlayer" and r["mode"] == "throughput"]
        eager, graphed = row["paddle_eager_us"], row["autocudagraph_us"]
        self.assertTrue(bench.has(f"{eager:,.0f}"))
        self.assertTrue(bench.has(f"{eager / graphed:.2f}", ratio=True))
        self.assertFalse(bench.has("2,145,000"))
        self.assertFalse(bench.has("-271.9", ratio=True))  # no ratio of two timings is negative
        numbers, counts = claims("backend on the H100 (75 of 75 matmul-only cases bitwise), 2,145 us and 1.9x")
        self.assertEqual((numbers, counts), ([("2,145", False, "us"), ("1.9", True, "x")], ["75 of 75"]))
        self.assertNotIn("75 of 75", report("gpu_check.md").text)


class InstallSectionTest(unittest.TestCase):
    """README's install advice: Paddle 3.x wherever a build exists, 2.6.2 the fallback, the differences linked."""

    def test_paddle_3_is_recommended_and_2_6_2_is_the_fallback_with_the_differences_linked(self):
        text = read("README.md")
        install = text.split("\n## Install on a GPU\n", 1)[1].split("\n## ", 1)[0]
        self.assertIn("**Use Paddle 3.x on any GPU it has a build for**", install)
        rows = [line for line in install.splitlines() if line.startswith("| recommended") or line.startswith("| fallback")]
        self.assertEqual(len(rows), 2, install)
        self.assertIn("Paddle 3.x GPU build", rows[0])
        self.assertIn("paddlepaddle-gpu==2.6.2", rows[1])
        self.assertLess(install.index("Paddle 3.x GPU build"), install.index("paddlepaddle-gpu==2.6.2"))
        self.assertIn("[docs/guides/compat.md](docs/guides/compat.md) lists every\ndifference", install)
        for difference in ("PaddleFormers 1.2 does not import", "cannot share one memory pool", "tracker"):
            self.assertIn(difference, install.replace("\n", " "))

    def test_the_readme_says_how_long_the_suite_takes(self):
        try_it = read("README.md").split("\n## Try it", 1)[1].split("\n## ", 1)[0]
        self.assertIn("<!-- suite time: measured on the current suite", try_it)
        said = re.search(r"The tests take (\d+ min \d+ s) on two CPU cores with Paddle 3\.\d\.\d and 2\.6\.2 run at once",
                         try_it)
        self.assertIsNotNone(said, "README says how long the suite takes, with both Paddles at once")
        self.assertIn(f"| {said.group(1)} |", read(os.path.join("docs", "reports", "suite_time.md")),
                      "the README's suite time is the one docs/reports/suite_time.md measured")

    def test_the_doctor_gives_the_same_advice(self):
        from paddlefleet.cudagraph.doctor import INSTALL_HINT

        self.assertLess(INSTALL_HINT.index("Paddle 3.x GPU build"), INSTALL_HINT.index("2.6.2"))
        self.assertIn("is the fallback", INSTALL_HINT)


# ---------------------------------------------------------------------------- paths
PATH = re.compile(r"(?<![\w./-])((?:\.ci|docs|tools|tests|testkit|paddlefleet|core|io|block|chains|grads|step|backends|"
                  r"guards|integrations|demo)/[\w./-]*\w|requirements[\w-]*\.txt|setup\.py|README\.md)")
# Paths that are not this repository's: the module of that name in Paddle's own PaddleFleet sources.
NOT_REPO = re.compile(r"^paddlefleet/cudagraph\.py$")
EXTENSIONS = (".py", ".md", ".txt", ".json", ".png", ".pth", ".sh", ".cfg", ".toml")


def named_paths(text):
    return [p for p in PATH.findall(text) if not NOT_REPO.match(p) and "*" not in p]


def path_exists(ref, doc_dir):
    """``ref`` relative to the repository, the naming file's folder or the package; ``core/budgets.budget_allows``
    (a module and a name in it) names core/budgets.py."""
    refs = [ref]
    folder, _, leaf = ref.rpartition("/")
    if "." in leaf and not ref.endswith(EXTENSIONS):  # core/budgets.Places.admit: the module core/budgets.py
        refs.append((folder + "/" if folder else "") + leaf.split(".")[0] + ".py")
    return any(os.path.exists(os.path.join(base, r)) for r in refs
               for base in (REPO, os.path.join(REPO, doc_dir), PACKAGE))


def tool_help(path):
    """The strings of a tool: its docstring and every argparse help."""
    tree = ast.parse(read(path))
    return "\n".join(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


class RepositoryPathsTest(unittest.TestCase):
    maxDiff = None

    def sources(self):
        docs = ["README.md"] + sorted(os.path.relpath(os.path.join(d, n), REPO)
                                      for d, _, names in os.walk(os.path.join(REPO, "docs")) for n in names
                                      if n.endswith(".md"))
        requirements = sorted(n for n in os.listdir(REPO) if n.startswith("requirements") and n.endswith(".txt"))
        tools = sorted(os.path.join("tools", n) for n in os.listdir(os.path.join(REPO, "tools")) if n.endswith(".py"))
        return [(d, read(d)) for d in docs + requirements] + [(t, tool_help(t)) for t in tools]

    def test_every_path_named_in_docs_requirements_and_tool_help_exists(self):
        missing = []
        for source, text in self.sources():
            for ref in named_paths(text):
                if not path_exists(ref, os.path.dirname(source)):
                    missing.append(f"{source}: {ref}")
        self.assertEqual(sorted(set(missing)), [])

    def test_a_missing_path_is_found(self):
        self.assertEqual(named_paths("numpy 2 ... fails): docs/compat.md. On a GPU"), ["docs/compat.md"])
        self.assertFalse(path_exists("docs/compat.md", ""))
        self.assertTrue(path_exists("docs/guides/compat.md", ""))
        self.assertTrue(path_exists("core/budgets.py", "docs/design"))  # a module named inside the package


if __name__ == "__main__":
    unittest.main()
