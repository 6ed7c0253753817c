"""The documentation's own check (no mkdocs): README.md stays short, every relative link in README.md
and docs/*.md resolves (anchors included), every docs page is reachable from docs/index.md, and the
commands the pages show name experiments and subcommands that exist. Plain text only: no JAX import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
README_MAX_LINES = 250


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _page_id(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _outside_fences(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks (``` or ~~~)."""
    lines, fence = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            lines.append(line)
    return lines


def _code_blocks(text: str) -> list[str]:
    """The lines inside fenced code blocks."""
    lines, fence = [], None
    for line in text.split("\n"):
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is not None:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, drop every character that is not a letter, digit,
    underscore, hyphen or space, then spaces to hyphens (no collapsing)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[str]:
    """Every markdown link (and image) target outside fenced code blocks and inline code spans."""
    targets = []
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "``", line)
        targets += _LINK.findall(line) + _IMAGE.findall(line)
    return targets


def _is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None   # http:, https:, mailto:, ...


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if _is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            problems.append(f"{_page_id(path)}: {target} -> no such file or folder")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md":
            if anchor not in anchors(dest):
                problems.append(f"{_page_id(path)}: {target} -> no heading #{anchor} in {_page_id(dest)}")
    return problems


def test_github_slug_rule_on_known_headings():
    assert github_slug("What moejax refuses, and why") == "what-moejax-refuses-and-why"
    assert github_slug("Expert parallelism (`moejax/parallel/`, `moejax/moe/expert_parallel.py`)") == (
        "expert-parallelism-moejaxparallel-moejaxmoeexpert_parallelpy")
    assert github_slug("Checkpoint surgery (`moejax prune`, `inspect`, `plan`, `diff`)") == (
        "checkpoint-surgery-moejax-prune-inspect-plan-diff")
    assert github_slug("The skills model: abilities pruning can break (`experiment=train_skills`, "
                       "`experiment=eval_skills`)") == (
        "the-skills-model-abilities-pruning-can-break-experimenttrain_skills-experimenteval_skills")


def test_code_fences_are_not_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n```bash\n# a comment\n```\n\n## Title\n", encoding="utf-8")
    assert anchors(page) == {"title", "title-1"}


def test_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n", encoding="utf-8")
    page = tmp_path / "p.md"
    page.write_text("# Here\n[ok](other.md#other-page) [ok](#here) [web](https://example.com/x#y) "
                    "`[code](nowhere.md)`\n[bad](missing.md) [bad anchor](other.md#nope) [bad](#there)\n",
                    encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert any("missing.md" in p for p in problems)
    assert any("#nope" in p for p in problems)
    assert any("#there" in p for p in problems)


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (limit {README_MAX_LINES})"


@pytest.mark.parametrize("page", _pages(), ids=_page_id)
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_index():
    linked = {(INDEX.parent / t.partition("#")[0]).resolve() for t in links(INDEX)
              if not _is_external(t) and t.partition("#")[0]}
    missing = [p.name for p in DOCS.glob("*.md") if p != INDEX and p.resolve() not in linked]
    assert missing == [], f"docs pages not linked from docs/index.md: {missing}"


def test_readme_links_the_index():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if not _is_external(t)}
    assert INDEX.resolve() in linked


def _experiment_configs() -> set[str]:
    folder = ROOT / "conf" / "experiment"
    names = {p.stem for p in folder.glob("*.yaml")}
    assert names, f"no experiment configs in {folder}"
    return names


def test_named_experiments_exist():
    """Every `experiment=NAME` the pages show (commands and prose) is a config in conf/experiment/."""
    known = _experiment_configs()
    unknown = []
    for page in _pages():
        for name in re.findall(r"(?<![\w.+/])experiment=([A-Za-z_][\w]*)", page.read_text(encoding="utf-8")):
            if name not in known:
                unknown.append(f"{_page_id(page)}: experiment={name}")
    assert unknown == [], f"unknown experiments (known: {sorted(known)}): {unknown}"


def _cli_subcommands() -> set[str]:
    """The `moejax` subcommands, read from the parser's source text: moejax/cli.py's add_parser calls,
    and those of the modules whose `register_cli(sub)` it calls."""
    cli = (ROOT / "moejax" / "cli.py").read_text(encoding="utf-8")
    names = set(re.findall(r"\.add_parser\(\s*[\"']([\w-]+)[\"']", cli))
    imported = {}
    for package, modules in re.findall(r"from\s+([\w.]+)\s+import\s+([\w, ]+)", cli):
        for module in modules.split(","):
            imported[module.strip()] = f"{package}.{module.strip()}"
    for module in re.findall(r"(\w+)\.register_cli\(", cli):
        source = ROOT / Path(*imported[module].split(".")).with_suffix(".py")
        names |= set(re.findall(r"\.add_parser\(\s*[\"']([\w-]+)[\"']", source.read_text(encoding="utf-8")))
    assert {"score", "prune", "inspect", "plan", "diff"} <= names, names
    return names


def test_cli_subcommands_exist():
    """Every `moejax SUBCOMMAND` in a code block (a command line, or after `&&`, `;`, `|`) names a
    subcommand of moejax/cli.py's parser."""
    known = _cli_subcommands()
    unknown = []
    command = re.compile(r"(?:^|[;&|]|\$)\s*moejax\s+([A-Za-z][\w-]*)")
    for page in _pages():
        for line in _code_blocks(page.read_text(encoding="utf-8")):
            for name in command.findall(line.split(" #")[0]):
                if name not in known:
                    unknown.append(f"{_page_id(page)}: moejax {name}  ({line.strip()})")
    assert unknown == [], f"unknown subcommands (known: {sorted(known)}): {unknown}"
