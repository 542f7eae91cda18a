"""The manual stays true to the code: every setting and option is described (the references are
generated from those descriptions), the README is a short front door that still holds the command
CI runs, code and docs cite only pages and sections that exist, and the alert rules and the
dashboard query only metrics ckptkeeper exports."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest
from builders import local_tier, write_config
from layout_fixtures import make_hf

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PROMETHEUS = ROOT / "deploy" / "prometheus"

CI_TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test,lightning,hf]' "
    "&& .venv/bin/python -m pytest"
)


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text_files() -> list[Path]:
    """What users and contributors read: the package, the README, the manual, the changelog."""
    files = [README, ROOT / "CHANGELOG.md"]
    files += sorted(p for p in (ROOT / "ckptkeeper").rglob("*.py"))
    files += sorted(p for p in DOCS.rglob("*.md") if "reference" not in p.relative_to(DOCS).parts)
    return files


# --------------------------------------------------------------------------------------------
# every setting and option is described


def test_every_setting_has_a_description() -> None:
    missing = [
        f"{section}.{key}" if section else key
        for section, key, field in _gen().settings_fields()
        if not (field.description or "").strip()
    ]
    assert missing == [], f"settings without a description (an attribute docstring in config.py): {missing}"


def test_every_command_has_help_and_every_option_a_description() -> None:
    problems = []
    for name, cmd in _gen().cli_commands():
        if not (cmd.help or "").strip():
            problems.append(f"{name}: no docstring")
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name != "help" and not (param.help or "").strip():
                problems.append(f"{name} {'/'.join(param.opts)}: no help text")
    assert problems == []


def test_reference_pages_are_generated_from_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _gen()
    monkeypatch.setattr(gen, "OUT", tmp_path)
    assert gen.main() == 0
    config = (tmp_path / "configuration.md").read_text()
    sections = {section for section, _, _ in gen.settings_fields() if section}
    for section, key, field in gen.settings_fields():
        if not section and key in sections:
            continue  # a table: its own heading, with its description under it
        assert f"| `{key}` |" in config, key
        assert gen._one_line(field.description) in config, key
    cli = (tmp_path / "cli.md").read_text()
    for name, cmd in gen.cli_commands():
        assert f"## `{name}`" in cli or cmd.name == "main"
        for param in cmd.params:
            if isinstance(param, click.Option) and param.help:
                assert gen._one_line(param.help) in cli, (name, param.opts)
    metrics = (tmp_path / "metrics.md").read_text()
    for fam in gen.metric_families():
        assert f"`{fam['series'][0]}`" in metrics
    bench = (tmp_path / "bench-table.md").read_text()
    for row in json.loads(gen.BENCH_JSON.read_text())["rows"]:
        assert f"| {row['metric']} " in bench


# --------------------------------------------------------------------------------------------
# the README


def test_readme_is_a_short_front_door_holding_the_ci_test_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert CI_TEST_COMMAND in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv" in ci
    assert ".venv/bin/pip install torch==2.13.0 -e '.[test,lightning,hf]'" in ci
    assert ".venv/bin/python -m pytest" in ci


def test_every_relative_link_of_the_readme_exists() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in relative)
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert missing == []


# --------------------------------------------------------------------------------------------
# citations


_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_no_design_sections_issue_numbers_or_commit_hashes() -> None:
    problems = []
    for path in _text_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if "DESIGN §" in line or "DESIGN.md" in line:
                problems.append(f"{where}: cites an unpublished DESIGN page")
            if re.search(r"\bissues?\s*#?\d+", line, re.IGNORECASE) or re.search(
                r"(?<![\w/])#\d{1,2}\b", line
            ):
                problems.append(f"{where}: cites an issue number: {line.strip()}")
            if _COMMIT.search(line):
                problems.append(f"{where}: cites a commit: {line.strip()}")
    assert problems == []


def _headings(page: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,4} (.+)$", page.read_text(), re.MULTILINE)}


def test_every_page_and_section_the_code_cites_exists() -> None:
    """``docs/design.md, "Many nodes"`` in a comment must name a heading of that page."""
    cited = re.compile(r"docs/([\w./-]+\.md)(?:,\s*\"([^\"]+)\")?")
    invariants = re.compile(r"safety invariants? (\d+)", re.IGNORECASE)
    design = (DOCS / "design.md").read_text()
    n_invariants = len(re.findall(r"^\d+\. ", design.split("## Safety invariants", 1)[1], re.MULTILINE))
    problems = []
    sources = [*_text_files(), ROOT / "pyproject.toml", ROOT / "config.example.toml"]
    for path in sources:
        text = path.read_text()
        for page, section in cited.findall(text):
            if page.startswith("reference/"):
                continue  # generated by docs/gen_reference.py
            target = DOCS / page
            if not target.exists():
                problems.append(f"{path.relative_to(ROOT)}: docs/{page} does not exist")
            elif section and section not in _headings(target):
                problems.append(f'{path.relative_to(ROOT)}: docs/{page} has no section "{section}"')
        for number in invariants.findall(text):
            if not 1 <= int(number) <= n_invariants:
                problems.append(f"{path.relative_to(ROOT)}: safety invariant {number} does not exist")
        if path.suffix == ".py" and re.search(r"README\s+\"", text):
            problems.append(f"{path.relative_to(ROOT)}: cites a README section (the manual is docs/)")
    assert n_invariants == 10
    assert problems == []


# --------------------------------------------------------------------------------------------
# monitoring


def _queried_metrics(text: str) -> set[str]:
    return set(re.findall(r"\b((?:ckptkeeper|process)_[a-z_]+)\b", text))


def test_alerts_and_dashboard_query_only_exported_metrics() -> None:
    exported = _gen().exported_series()
    alerts = (PROMETHEUS / "alerts.yml").read_text()
    rule_tests = (PROMETHEUS / "alerts.test.yml").read_text()
    dashboard = json.loads((PROMETHEUS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    queried = _queried_metrics(alerts) | _queried_metrics(rule_tests) | _queried_metrics("\n".join(exprs))
    assert len(queried) >= 15
    assert sorted(queried - exported) == []


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_each_tier_exports_its_watermarks_for_the_alert(tmp_path: Path) -> None:
    """The watermark alert compares usage with the tier's own threshold: a one-shot prune's
    textfile (the daemon's scrape serves the same collector) carries both watermarks of a tier that
    sets them, and none for a tier that does not."""
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    prom = tmp_path / "ckptkeeper.prom"
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "0s", "textfile": str(prom)},
        tiers=[
            local_tier("hot", hot, keep_last=1, high_watermark=0.9, low_watermark=0.6),
            local_tier("warm", warm, keep_last=5),
        ],
    )
    make_hf(hot / "run-a", 10, eval_loss=0.5)
    pruned = _cli(config, "prune")
    assert pruned.returncode == 0, pruned.stderr
    lines = prom.read_text().splitlines()
    assert 'ckptkeeper_tier_high_watermark_ratio{tier="hot"} 0.9' in lines
    assert 'ckptkeeper_tier_low_watermark_ratio{tier="hot"} 0.6' in lines
    assert not any(line.startswith('ckptkeeper_tier_high_watermark_ratio{tier="warm"') for line in lines)
    assert any(line.startswith('ckptkeeper_tier_used_ratio{tier="hot"}') for line in lines)


# --------------------------------------------------------------------------------------------
# the site


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    """What .ci/docs.sh runs: a broken link or anchor, or a page missing from the nav, fails."""
    gen = subprocess.run([sys.executable, str(DOCS / "gen_reference.py")], capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


@pytest.mark.parametrize("page", ["README.md", "docs/concepts.md"])
def test_the_configs_shown_are_valid(page: str) -> None:
    """The minimal config of the README and the worked example's policy load as they are shown."""
    import tomllib

    from ckptkeeper.config import settings_from_mapping

    block = re.search(r"```toml\n(.*?)```", (ROOT / page).read_text(), re.DOTALL)
    assert block is not None
    settings = settings_from_mapping(tomllib.loads(block.group(1)))
    assert [t.name for t in settings.tiers] == ["hot", "warm", "cold"]


def test_the_readme_pictures_the_pass_as_the_code_runs_it() -> None:
    """The Architecture picture (participants x phases) is the code's: a participant added, moved
    or given another phase changes the picture, or this fails."""
    import inspect

    from ckptkeeper.actions.pruning import participants as chosen
    from ckptkeeper.actions.pruning.state import PHASES, Participant

    hooks = {phase: phase for phase in PHASES if phase not in ("lock", "execute")} | {"execute": "guard"}
    classes = [
        c
        for c in vars(chosen).values()
        if inspect.isclass(c) and issubclass(c, Participant) and c is not Participant
    ]
    readme = (ROOT / "README.md").read_text()
    header = " " * 17 + "  ".join(PHASES)
    assert header in readme
    for cls in classes:
        marks = []
        for phase in PHASES:
            hook = hooks.get(phase)
            took_part = hook is not None and getattr(cls, hook) is not getattr(Participant, hook)
            marks.append(("●" if took_part else "·").center(len(phase)))
        assert f"{cls.__name__:<17}" + "  ".join(marks).rstrip() in readme, cls.__name__
