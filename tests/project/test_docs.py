"""The Sphinx site builds with warnings as errors and offline, and its
API reference covers every public name."""

from __future__ import annotations

import html
import inspect
import itertools
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import ROOT

import trio_redis_finalize

DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    proc = subprocess.run(  # about 10 s; the timeout is a bound a loaded machine keeps
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # -q: only warnings would print, and -W fails them
    return out


def text(site: Path, page: str) -> str:
    raw = (site / f"{page}.html").read_text()
    raw = re.sub(r"<script.*?</script>|<style.*?</style>", "", raw, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_build_needs_no_network() -> None:
    """No intersphinx (or any extension that fetches): the build runs offline."""
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert set(conf["extensions"]) <= {"sphinx.ext.autodoc", "sphinx.ext.napoleon"}
    assert not conf.get("intersphinx_mapping")


def test_api_reference_documents_every_public_name(site: Path) -> None:
    api = text(site, "api")
    for name in trio_redis_finalize.__all__:
        assert f"trio_redis_finalize.{name}" in api, name
    for name in ("trio_redis_finalize.prometheus.register",
                 "trio_redis_finalize.otel.instrument_handler",
                 "trio_redis_finalize.pytest_plugin.consume_until",
                 "trio_redis_finalize.testing.RedisServer"):
        assert name in api, name
    # docstrings, not only names: a sentence of open_consumer's and of Delivery's
    assert "lets in-flight handlers finish within" in api
    assert "an idempotency key" in api


def test_the_api_page_and_the_examples_use_public_names_only(site: Path) -> None:
    """The API page documents no private module or class (it documented
    ``_stats.MountStats``, ``_scheduler.Scheduler``, ``_transport.Client``,
    ``_transport._cluster.ClusterClient``), and no example outside the
    architecture page (written for maintainers) imports a private module
    (the Sentinel example imported ``trio_redis_finalize._transport``)."""
    api = text(site, "api")
    assert not re.findall(r"trio_redis_finalize\._\w+", api)
    assert not re.findall(r"\b_(?:stats|scheduler|transport|cluster|sentinel|url)\b", api)
    for name in ("open_client", "Client", "sentinel_params", "ConnectionParams"):
        assert f"trio_redis_finalize.{name}" in api, name
    pages = [ROOT / "README.rst", *(p for p in DOCS.glob("*.rst") if p.stem != "architecture")]
    imports = re.compile(r"(?:from|import)\s+trio_redis_finalize\._")
    for page in pages:
        assert not imports.search(page.read_text()), page.name
    operations = text(site, "operations")
    assert "from trio_redis_finalize import open_client, open_consumer, sentinel_params" in operations


def test_every_page_is_in_the_table_of_contents(site: Path) -> None:
    index = (site / "index.html").read_text()
    pages = [p.stem for p in DOCS.glob("*.rst") if p.stem != "index" and not p.stem.startswith("_")]
    assert {"guide", "guarantees", "crash_costs", "operations", "scaling_out", "servers",
            "performance", "developing", "architecture", "api", "changelog"} <= set(pages)
    for page in pages:
        assert f'href="{page}.html"' in index, page


def test_the_index_is_the_readme_and_no_page_slices_it(site: Path) -> None:
    """The site's front page is the README, whole; every other page holds its
    own text (none includes a part of the README: the README is short and the
    rest lives in the pages), and the README keeps no slicing markers."""
    readme = (ROOT / "README.rst").read_text()
    index = (DOCS / "index.rst").read_text()
    assert index.startswith(".. include:: ../README.rst\n\n"), index[:80]
    for page in DOCS.glob("*.rst"):
        source = page.read_text()
        assert ":start-after:" not in source and ":end-before:" not in source, page.name
        if page.stem != "index":
            assert "README.rst" not in source or ".. include::" not in source, page.name
    assert ".. docs:" not in readme
    front = _body(site, "index")
    for title in _titles(readme):
        assert title in front, f"README section {title!r} is not on the front page"
    assert "Comparison with other libraries" in _titles((DOCS / "performance.rst").read_text())
    assert "0.1.0" in text(site, "changelog")


def test_every_cross_reference_resolves(site: Path) -> None:
    """Every name the docs point at (``see Scheduler`` on the architecture
    page, ``Client`` in open_consumer's signature) is documented: no
    reference left unlinked but the builtins' (no intersphinx)."""
    import builtins

    unresolved = []
    for page in DOCS.glob("*.rst"):
        raw = (site / f"{page.stem}.html").read_text()
        for m in re.finditer(r'<code class="xref py[^"]*"><span class="pre">([^<]*)</span>', raw):
            before = raw[max(0, m.start() - 400):m.start()]
            if re.search(r'<a class="reference internal"[^>]*>$', before):
                continue
            if hasattr(builtins, m.group(1).rstrip("()")):
                continue
            unresolved.append(f"{page.stem}: {m.group(1)}")
    assert unresolved == []
    api = (site / "api.html").read_text()
    for target in ("trio_redis_finalize.Client", "trio_redis_finalize.open_client",
                   "trio_redis_finalize.sentinel_params", "trio_redis_finalize.open_publisher"):
        assert f'id="{target}"' in api, target
    sig = api[api.index('id="trio_redis_finalize.open_consumer"'):]
    sig = sig[:sig.index("</dt>")]
    assert 'href="#trio_redis_finalize.Client"' in sig  # Client in the signature, linked
    # the maintainers' page documents the private Scheduler its _shutdown text points at
    architecture = (site / "architecture.html").read_text()
    assert 'id="trio_redis_finalize._scheduler.Scheduler"' in architecture


def _guide_signatures() -> dict[str, str]:
    guide = (DOCS / "guide.rst").read_text()
    out = {}
    for block in re.findall(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", guide):
        text = " ".join(block.split())
        for name in ("StreamSubscription", "ReliableListSubscription", "ListSubscription",
                     "ChannelSubscription", "PatternSubscription", "open_publisher"):
            m = re.match(rf".*?\b{name}(\((?:[^()]|\([^()]*\))*\))(?: |$)", text)
            if m and "=" in m.group(1) and name not in out and re.search(r"\w+=\w", m.group(1)):
                out[name] = m.group(1)
    return out


def _shown(sig: inspect.Signature) -> str:
    parts: list[str] = []
    star = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        default = p.default
        if default is inspect.Parameter.empty:
            parts.append(p.name)
        elif hasattr(default, "__class__") and default.__class__.__name__ in ("Mode", "DelayedRetry"):
            parts.append(f"{p.name}={type(default).__name__}.{default.name}")
        else:
            parts.append(f"{p.name}={default!r}".replace("'", '"'))
    return "(" + ", ".join(parts) + ")"


def test_the_guides_signatures_match_the_code() -> None:
    """The signatures the user guide shows are the code's, keyword-only where shown with ``*``."""
    shown = _guide_signatures()
    assert set(shown) == {"StreamSubscription", "ReliableListSubscription", "ListSubscription",
                          "ChannelSubscription", "PatternSubscription", "open_publisher"}, shown
    for name, text in shown.items():
        sig = inspect.signature(getattr(trio_redis_finalize, name))
        assert text == _shown(sig), name


def test_every_parameter_is_documented() -> None:
    """Each constructor and entry point names every parameter in its docstring."""
    objects = [trio_redis_finalize.StreamSubscription, trio_redis_finalize.ReliableListSubscription,
               trio_redis_finalize.ListSubscription, trio_redis_finalize.ChannelSubscription,
               trio_redis_finalize.PatternSubscription, trio_redis_finalize.open_consumer,
               trio_redis_finalize.open_publisher, trio_redis_finalize.Consumer.mount]
    for obj in objects:
        doc = inspect.getdoc(obj) or ""
        for p in inspect.signature(obj).parameters.values():
            if p.name in ("self", "_"):
                continue
            assert re.search(rf"^\s*\*?{p.name}:", doc, flags=re.M), f"{obj.__qualname__}: {p.name}"


def test_the_package_cites_no_file_it_does_not_ship() -> None:
    """No reference to the project's design notes (not in the wheel) in what users see:
    the demo's and the command line's output, the public modules, README and docs."""
    package = ROOT / "trio_redis_finalize"
    public = [*package.glob("_cli/*.py"), *package.glob("testing/*.py"), *(
        package / f for f in ("__init__.py", "prometheus.py", "otel.py", "_otel.py", "_publisher.py",
                              "pytest_plugin.py"))]
    assert len(public) > 8, public
    for path in [*public, ROOT / "README.rst", *DOCS.glob("*.rst")]:
        assert "DESIGN" not in path.read_text(), path


# -- what users read names nothing outside the repository ---------------------------------------

INTERNAL = {
    "an issue number of the project's tracker": r"\bissues?\s*#?\s*\d+",
    "a work stop": r"\bstops?\s+#?\d+\b",
    "a work session": r"\b(?:this|that|previous|earlier|later|last|next)\s+session\b"
                      r"|\bthe\s+session(?:'s)?\b(?![ -](?:scope|fixture))|\bbetween\s+sessions\b",
    "the lead": r"\bthe\s+lead\b",
    "the project's private tooling": r"\.\./shared\b|/work/|\bshared research\b|\bresearch/|\bseed/",
    "the design notes": r"\bDESIGN\b",
}
FILE_NAME = re.compile(r"(?<![\w/.{}-])((?:\.\.?/)?(?:[\w-]+/)*[\w-]+\.(?:py|md|rst|toml|txt|lua|cfg|ini|"
                       r"json|ya?ml|sh|html))\b|(?<![\w/.-])(\.ci/run)\b")
EXAMPLES = {"test_billing.py", "args.json", "ca.pem"}
"""File names the docs use as the reader's own (an example's test module, a CA file)."""


def _user_facing() -> dict[str, str]:
    """What users read: README, CHANGELOG, the docs pages, every docstring and
    message of the package (the API page shows the docstrings), the command
    line's help, and the tools the README sends them to (``dev.py``, the
    benchmarks, whose output it quotes)."""
    paths = [ROOT / "README.rst", ROOT / "CHANGELOG.rst", ROOT / "dev.py", ROOT / "pyproject.toml",
             *sorted(DOCS.glob("*.rst")), DOCS / "conf.py",
             *sorted((ROOT / "trio_redis_finalize").rglob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    out = {str(p.relative_to(ROOT)): p.read_text() for p in paths}
    for command in ([], ["demo"], ["run"], ["inspect"], ["requeue"]):
        proc = subprocess.run([sys.executable, "-m", "trio_redis_finalize", *command, "--help"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        out[" ".join(["trio-redis-finalize", *command, "--help"])] = proc.stdout
    return out


def test_no_project_internal_references() -> None:
    """No issue numbers ("issue #16"), work sessions ("this session"), the
    lead, stops, the project's private notes (``../shared/...``, the design
    notes, research notes): none of it means anything to a reader of the
    repository."""
    found = []
    for where, content in _user_facing().items():
        for what, pattern in INTERNAL.items():
            for m in re.finditer(pattern, content, flags=re.I if what != "the design notes" else 0):
                line = content.count("\n", 0, m.start()) + 1
                found.append(f"{where}:{line}: {what}: {m.group(0)!r}")
    assert found == []


def test_every_file_named_is_in_the_repository() -> None:
    """A file the docs, a docstring or a help text names (``tests/faults/test_soak.py``,
    ``.ci/run``, ``../README.rst`` from ``docs/``, ``_forms/_port.py`` in the package) is a
    file of the repository."""
    tracked = set(subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True,
                                 cwd=ROOT).stdout.split())
    names = {Path(t).name for t in tracked}
    missing = []
    for where, content in _user_facing().items():
        here = (ROOT / where).parent if (ROOT / where).exists() else ROOT
        for m in FILE_NAME.finditer(content):
            name = m.group(1) or m.group(2)
            resolved = (here / name).resolve() if name.startswith(".") and name != ".ci/run" else ROOT / name
            rel = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else name
            in_package = f"trio_redis_finalize/{name}"  # a docstring's path inside the package
            beside = (here / name).resolve()  # ... or from its own folder (``stream/cells.py``)
            near = str(beside.relative_to(ROOT)) if beside.is_relative_to(ROOT) else name
            if rel in tracked or in_package in tracked or near in tracked \
                    or ("/" not in name and name in names) or name in EXAMPLES:
                continue
            missing.append(f"{where}: {name}")
    assert missing == []


# -- getting started -----------------------------------------------------------------------------


def _titles(text: str) -> list[str]:
    return re.findall(r"^(\S[^\n]*)\n-{3,}$", text, flags=re.M)


def _body(site: Path, page: str) -> str:
    """A page's text without the sidebar and the navigation."""
    raw = (site / f"{page}.html").read_text()
    raw = raw[raw.index('<div class="body"'):raw.index('<div class="sphinxsidebar"')]
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


README_SECTIONS = ["Install", "Quick start", "Quick start with asyncio", "Forms and outcomes",
                   "Guarantees and their limits", "Handler errors and dead letters",
                   "Command line", "Testing your own code", "Production checklist", "Developing",
                   "Links"]
"""What a newcomer reads, in this order (other sections may stand between them)."""


def _section(text: str, title: str) -> str:
    part = text.split(f"\n{title}\n{'-' * len(title)}\n", 1)[1]
    return re.split(r"\n\S[^\n]*\n-{3,}\n", part, maxsplit=1)[0]


def test_the_readme_is_short_and_in_a_newcomers_order(site: Path) -> None:
    """At most 400 lines: what it is, install, the quick starts, the forms and
    outcomes table, the guarantees with their limits, handler errors and dead
    letters, the command line, testing, a production checklist, developing and
    links; the developer notes (``dev.py``, CI) only at the end.  The front
    page of the site shows them in that order."""
    readme = (ROOT / "README.rst").read_text()
    assert len(readme.splitlines()) <= 400, len(readme.splitlines())
    titles = _titles(readme)
    assert [s for s in titles if s in README_SECTIONS] == README_SECTIONS, titles
    assert titles[0] == "Install" and "finalizes" in readme[:readme.index("\nInstall\n")]
    forms = _section(readme, "Forms and outcomes")
    table = re.search(r"^=+  =+.*\n^form .*\n^=+.*\n((?:.*\n)+?)^=+", forms, flags=re.M)
    assert table is not None, "the forms and outcomes table"
    rows = {line.split("  ")[0] for line in table.group(1).splitlines() if line and line[0] != " "}
    assert rows == {"stream", "claiming stream", "reliable list", "simple list", "channel / pattern"}
    guarantees = _section(readme, "Guarantees and their limits")
    for words in ("at-least-once", "at-most-once", "origin_id", "retry_after", "DURABLE_ZSET",
                  "heartbeat", "shutdown_grace"):
        assert words in guarantees, words
    assert re.search(r"^\* \*\*", guarantees, flags=re.M), "one list, a bold lead per item"
    developing = readme.index("\nDeveloping\n----------\n")
    assert "dev.py" not in readme[:developing] and ".ci/" not in readme[:developing]
    assert "python3 dev.py test" in readme[developing:] and ".ci/run" in readme[developing:]

    front = _body(site, "index")
    at = [front.index(title) for title in README_SECTIONS]
    assert at == sorted(at), at
    assert "python3 dev.py test" in _body(site, "developing")
    assert "python3 dev.py" not in _body(site, "operations")


def test_the_readmes_command_line_shows_every_option() -> None:
    """Each command's synopsis in the README names every option its ``--help``
    has, ``run``'s ``--name`` first (and ``--workers`` next to it)."""
    readme = (ROOT / "README.rst").read_text()
    cli = _section(readme, "Command line")
    synopsis = cli[cli.index("::\n") + 3:]
    synopsis = synopsis[:re.search(r"\n\S", synopsis).start()]
    lines = re.split(r"\n    (?=\w)", "\n" + synopsis)
    commands = {line.split()[0]: line for line in lines if line.strip()}
    assert {"run", "inspect", "requeue", "demo"} <= set(commands), commands
    for command, shown in commands.items():
        proc = subprocess.run([sys.executable, "-m", "trio_redis_finalize", command, "--help"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        usage = proc.stdout.split("\n\n", 1)[0]  # every option, as argparse lists them
        options = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage)) - {"-h"}
        missing = [o for o in options if not re.search(rf"\[{re.escape(o)}\b|\s{re.escape(o)}\s", shown)]
        assert missing == [], (command, missing)
    run_options = re.findall(r"\[(--[\w-]+)", commands["run"])
    assert run_options[:2] == ["--name", "--workers"], run_options


# -- one figure per workload ----------------------------------------------------------------------
#
# Every measured figure (a rate, a ratio, a time or cost per message, a share, a size) lives in one
# table marked with an RST comment ``.. figures: <kind>`` just above the note that says what
# measured it.  The rest of the text reads the tables and repeats no figure, so two places cannot
# give a workload two numbers (the README had stream ACK at 341,543/s in one table and 90,587/s
# in another, Pub/Sub at 0.86, 0.78-0.85 and 0.82-0.83 of its floor, FastStream at 3,000-3,700
# and about 4,000/s).

UNIT = r"(?:k?/s\b|[a-z]+/s\b|\u00d7|x\b|µs\b|ms\b|%|KiB\b|k\b|instructions\b|bytecodes\b)"
FIGURE = re.compile(rf"(?<![\w.\-])\d[\d,.]*(?:\s?[\u2013-]\s?\d[\d,.]*)?\s?{UNIT}")
MARKER = re.compile(r"^(\s*)\.\. figures: (\S+)\s*$")
BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")
PROSE_SOURCES = [ROOT / "README.rst", ROOT / "CHANGELOG.rst", *sorted(DOCS.glob("*.rst"))]


class Figures:
    """One ``.. figures:`` table: its kind, the note above it, its rows' first cells."""

    def __init__(self, kind: str, where: str, note: str, rows: list[str]) -> None:
        self.kind, self.where, self.note, self.rows = kind, where, note, rows


def _read_rst(path: Path, *, keep_literals: bool = False
              ) -> tuple[list[tuple[int, str]], list[Figures], list[list[str]]]:
    """``(prose lines, marked tables, unmarked simple tables)`` of one RST file.  Prose is what a
    reader reads as text: no code or literal blocks, no comments, no inline literals, no table
    marked ``.. figures:`` (nor the note above it)."""
    lines = path.read_text().splitlines()
    prose: list[tuple[int, str]] = []
    marked: list[Figures] = []
    unmarked: list[list[str]] = []
    i = 0

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    def skip_block(i: int, base: int) -> int:  # the indented block after line i - 1
        while i < len(lines) and (not lines[i].strip() or indent(lines[i]) > base):
            i += 1
        return i

    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        if m:
            start, i = i, i + 1
            note: list[str] = []
            while i < len(lines) and not BORDER.match(lines[i]):
                note.append(lines[i])
                i += 1
            table_start, borders = i, 0
            while i < len(lines) and borders < 3:
                borders += bool(BORDER.match(lines[i]))
                i += 1
            table = lines[table_start:i]
            body = table[[n for n, t in enumerate(table) if BORDER.match(t)][1] + 1:-1] if table else []
            left = indent(table[0]) if table else 0
            right = left + len(table[0].split()[0]) if table else 0
            rows = [r for r in (t[left:right].strip() for t in body) if r]  # blank: a continuation
            marked.append(Figures(m.group(2), f"{path.name}:{start + 1}", " ".join(note), rows))
            continue
        if BORDER.match(line):  # an unmarked simple table
            start, borders = i, 0
            while i < len(lines) and borders < 3:
                borders += bool(BORDER.match(lines[i]))
                i += 1
            unmarked.append(lines[start:i])
            continue
        stripped = line.strip()
        if stripped.startswith(".. ") or stripped == "..":
            directive = re.match(r"\.\. ([\w-]+)::", stripped)
            i += 1
            if directive and directive.group(1) == "list-table":
                continue  # its cells are prose
            i = skip_block(i, indent(line))
            continue
        text = line
        if stripped.endswith("::"):
            text = line.rstrip()[:-2]
            prose.append((i + 1, text))
            i = skip_block(i + 1, indent(line))
            continue
        prose.append((i + 1, text))
        i += 1
    if keep_literals:
        return prose, marked, unmarked
    cleaned = [(n, re.sub(r"``.*?``", "``lit``", t)) for n, t in prose]
    return cleaned, marked, unmarked


def _all_figures() -> list[Figures]:
    return [f for path in PROSE_SOURCES for f in _read_rst(path)[1]]


def test_every_measured_figure_is_in_one_marked_table() -> None:
    repeated = []
    for path in PROSE_SOURCES:
        prose, _, unmarked = _read_rst(path)
        text = "\n".join(t for _, t in prose)
        numbers = [n for n, _ in prose]
        for m in FIGURE.finditer(text):
            line = numbers[text.count("\n", 0, m.start())]
            repeated.append(f"{path.name}:{line}: {m.group(0)!r} outside a marked table")
        for table in unmarked:
            for m in FIGURE.finditer("\n".join(table)):
                repeated.append(f"{path.name}: {m.group(0)!r} in a table not marked '.. figures:'")
    assert repeated == []


def test_each_figures_table_is_one_measurement_that_says_how_and_when() -> None:
    """One table per measurement kind, one row per workload in it, and a note
    that names the command (or says it was measured by hand), the server, the
    machine and the date."""
    tables = _all_figures()
    kinds = [t.kind for t in tables]
    assert {"workloads", "instructions-client", "instructions-server", "peers", "scale-out"} <= set(kinds)
    assert len(kinds) == len(set(kinds)), kinds
    for t in tables:
        assert t.rows and len(t.rows) == len(set(t.rows)), (t.where, t.rows)
        for what, pattern in {"a command": r"``[^`]*(?:dev\.py bench|-m benchmarks|tests/[\w/]*test_\w+\.py)"
                                           r"[^`]*``|\bby hand\b",
                              "a server": r"\b(?:Redis|Valkey|redis-server) \d+\.\d+",
                              "a machine": r"\b\d-core\b|\b\d CPUs?\b|\*\*\d CPUs\*\*",
                              "a date": r"\b20\d\d-\d\d-\d\d\b"}.items():
            assert re.search(pattern, t.note), f"{t.where} ({t.kind}): the note names no {what}"


# -- one "supported and tested servers" line ------------------------------------------------------

SERVER_NAME = re.compile(r"\b(Redis|Valkey) (\d+(?:\.\d+)*)(\+?)"
                         r"((?:(?:\s*,\s*(?:and\s+)?|\s+and\s+|\s+or\s+|\s*/\s*)\d+\.\d+(?:\.\d+)?\+?)*)")
LATER = {("Redis", "8.4"), ("Redis", "8.6"), ("Redis", "8.8")}
"""Later Redis versions the docs name for what they will bring (capabilities not used yet)."""


def _servers_named(text: str) -> list[tuple[str, str, bool, int]]:
    """``(product, major.minor, is a threshold like 6.2+, where)`` of every server version in
    ``text``; a list goes on (``Redis 6.2, 7.0 and 8.2``)."""
    out = []
    for m in SERVER_NAME.finditer(text):
        versions = [(m.group(2) + m.group(3), m.start(2))]
        versions += [(v.group(0), m.start(4) + v.start())
                     for v in re.finditer(r"\d+\.\d+(?:\.\d+)?\+?", m.group(4))]
        for version, at in versions:
            out.append((m.group(1), ".".join(version.rstrip("+").split(".")[:2]), version.endswith("+"), at))
    return out


def _supported_line() -> tuple[str, set[tuple[str, str]]]:
    readme = (ROOT / "README.rst").read_text()
    lines = [p for p in re.split(r"\n\s*\n", readme) if p.startswith("**Supported and tested servers:**")]
    assert len(lines) == 1, lines
    first = re.split(r"(?<=[.;])\s|\(", lines[0])[0]
    return lines[0], {(p, v) for p, v, _, _ in _servers_named(first)}


def _servers_table() -> dict[tuple[str, str], str]:
    section = (DOCS / "servers.rst").read_text()
    rows = re.findall(r"^\s*\* - ((?:Redis|Valkey) \d+\.\d+)\n\s*- (.+)$", section, flags=re.M)
    return {(name.split()[0], name.split()[1]): binary for name, binary in rows}


def _wheel_words() -> dict[str, str]:
    from trio_redis_finalize import testing

    return dict(testing._WHEELS)


def test_one_supported_and_tested_servers_line_agrees_with_the_table_and_testing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The line near the top, the servers page's table and ``trio_redis_finalize.testing`` say the same:
    which servers, which binary each test run uses (``TRF_REDIS_SERVER``'s words, the wheels,
    ``PATH``), and the version each binary really is."""
    import shutil

    from trio_redis_finalize import testing

    readme = (ROOT / "README.rst").read_text()
    line, supported = _supported_line()
    assert readme.index(line) < readme.index("Quick start\n-----------\n")  # near the top
    table = _servers_table()
    assert set(table) == supported, (sorted(table), sorted(supported))
    oldest = min(tuple(map(int, v.split("."))) for p, v in supported if p == "Redis")
    assert oldest == testing._MIN_VERSION
    words = _wheel_words()
    by_word = {}
    for server, binary in table.items():
        word = re.search(r"TRF_REDIS_SERVER=(\w+)", binary)
        if word is None:
            assert "on ``PATH``" in binary, (server, binary)
            on_path = shutil.which("redis-server")
            if on_path and testing.redis_server_version(on_path)[:2] == tuple(map(int, server[1].split("."))):
                assert re.search(r"\d+\.\d+\.\d+", binary) is None or ".".join(
                    map(str, testing.redis_server_version(on_path))) in binary
            continue
        by_word[word.group(1)] = server
        assert f"``{words[word.group(1)]}`` wheel" in binary, (server, binary)
    assert set(by_word) == set(words), "every TRF_REDIS_SERVER word is in the table, and no other"
    assert sum("on ``PATH``" in b for b in table.values()) == 1
    for word, (product, version) in by_word.items():
        monkeypatch.setenv("TRF_REDIS_SERVER", word)
        binary = testing.find_redis_server()
        assert binary == testing._wheel_binary(word)
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
        assert said.startswith(f"{product} server v={version}."), (word, said)


def _sentences(text: str) -> list[str]:
    return [s for para in re.split(r"\n\s*\n", text)
            for s in re.split(r"(?<=[.;:])\s+(?=[A-Z*(`\d])", " ".join(para.split()))]


def test_no_other_place_lists_servers_differently() -> None:
    """Every server version named in the docs, the changelog and the API page's docstrings is
    one of the line's (or a later Redis named for what it will bring, or a threshold such as
    ``6.2+``); a version named beside a wheel is that wheel's; and a sentence that lists three
    or more servers lists them all (else it should refer to the line)."""
    import trio_redis_finalize.otel
    import trio_redis_finalize.prometheus
    import trio_redis_finalize.pytest_plugin
    from trio_redis_finalize import testing

    _, supported = _supported_line()
    table = _servers_table()
    words = _wheel_words()
    wheel_of = {}
    for server, binary in table.items():
        for word, wheel in words.items():
            if f"TRF_REDIS_SERVER={word}" in binary:
                wheel_of[word] = wheel_of[wheel] = server
    texts = {}
    for path in PROSE_SOURCES:
        prose, _, _ = _read_rst(path, keep_literals=True)
        texts[path.name] = "\n".join(t for _, t in prose)
    objects = [testing, trio_redis_finalize.pytest_plugin, trio_redis_finalize.prometheus,
               trio_redis_finalize.otel, trio_redis_finalize,
               *(getattr(trio_redis_finalize, n) for n in trio_redis_finalize.__all__),
               *(getattr(testing, n) for n in testing.__all__)]
    for obj in objects:
        docs = [inspect.getdoc(obj) or ""]
        if inspect.isclass(obj):
            docs += [inspect.getdoc(v) or "" for k, v in vars(obj).items() if not k.startswith("_")]
        texts[getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))] = "\n\n".join(docs)
    wrong = []
    for where, text in texts.items():
        for sentence in _sentences(text):
            listed = set()
            cuts = [0, *(m.end() for m in re.finditer(r"[,;()]", sentence)), len(sentence) + 1]
            for product, version, threshold, at in _servers_named(sentence):
                clause = next(sentence[a:b] for a, b in itertools.pairwise(cuts) if a <= at < b)
                near = [w for w in wheel_of if re.search(rf"``{re.escape(w)}``|={re.escape(w)}\b", clause)]
                if threshold:
                    if not any(p == product and v.split(".")[0] == version.split(".")[0]
                               for p, v in supported):
                        wrong.append(f"{where}: {product} {version}+ in {sentence!r}")
                elif (product, version) not in supported | LATER:
                    wrong.append(f"{where}: {product} {version} is not in the line: {sentence!r}")
                elif near and all(wheel_of[w] != (product, version) for w in near):
                    wrong.append(f"{where}: {product} {version} beside {near}: {sentence!r}")
                elif not near:
                    listed.add((product, version))
            if len(listed & supported) >= 3 and listed & supported != supported:
                wrong.append(f"{where}: lists {sorted(listed)}, not the line: {sentence!r}")
    assert wrong == [], "\n".join(wrong)
