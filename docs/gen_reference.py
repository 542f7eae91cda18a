"""Generate the reference pages of the manual from the code: one source, never hand-copied.

    python docs/gen_reference.py     # writes docs/reference/{configuration,cli,metrics,bench-table}.md

- configuration: the pydantic settings models of :mod:`ckptkeeper.config` (every key, its type,
  default, environment variable and description: the attribute docstring under the field);
- cli: the click commands registered on :data:`ckptkeeper.cli.app.main` (usage, help, options);
- metrics: every metric family the daemon defines (read from the source of ``ckptkeeper/`` with
  :mod:`ast`, so a metric added anywhere appears here and in the dashboard/alert checks);
- bench-table: the table of the latest full ``python -m bench`` run, from its ``--json`` document
  ``docs/bench/latest.json``, included by ``docs/performance.md``.

The generated pages are not committed (``.gitignore``); ``.ci/docs.sh`` runs this before
``mkdocs build --strict``. ``tests/test_docs.py`` imports the same functions.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ---------------------------------------------------------------------------------------------
# Configuration


def _validator_names(annotation: Any) -> set[str]:
    """Names of the BeforeValidator functions inside an annotation (Duration, ByteRate, ...)."""
    names: set[str] = set()
    for meta in getattr(annotation, "__metadata__", ()):
        func = getattr(meta, "func", None)
        if func is not None:
            names.add(func.__name__)
    for arg in typing.get_args(annotation):
        names |= _validator_names(arg)
    return names


def _type_text(field: Any) -> str:
    """A reader's name for a field's type."""
    from pydantic import BaseModel

    validators = {m.func.__name__ for m in field.metadata if getattr(m, "func", None) is not None}
    validators |= _validator_names(field.annotation)
    if "parse_duration" in validators:
        return "duration"
    if "_optional_interval" in validators:
        return 'duration or "off"'
    if "_rate" in validators:
        return "size per second"
    if "_price" in validators:
        return "number"
    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
        ann = args[0]
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(f'`"{v}"`' for v in typing.get_args(ann))
    if typing.get_origin(ann) is list:
        (inner,) = typing.get_args(ann)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return "array of tables"
    if typing.get_origin(ann) is dict:
        return "table"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "table"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(ann, str(ann))


def _default_text(name: str, field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from ckptkeeper.util.fmt import format_duration

    if field.default_factory is not None:
        if name == "node":
            return "the hostname"
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`" if value else "empty"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    kind = _type_text(field)
    if kind.startswith("duration") and isinstance(field.default, float):
        return f'`"{format_duration(field.default)}"`' if field.default else "`0`"
    if kind == "size per second":
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if field.default % size == 0:
                return f'`"{field.default // size}{unit}"`'
        return f"`{field.default}`"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    if isinstance(field.default, str):
        return f'`"{field.default}"`'
    return f"`{field.default}`"


def _one_line(text: str | None) -> str:
    """One Markdown table cell from a docstring (reST literals and roles become Markdown)."""
    text = re.sub(r":(?:mod|func|class|attr|meth|data):`([^`]+)`", r"`\1`", text or "")
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def attribute_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of ``cls``: the string right under each field, cleaned as pydantic's
    ``use_attribute_docstrings`` would. Read here, not by the models: parsing config.py's source
    at every start cost each ``ckptkeeper`` command ~10 % of its CPU."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _described(model: type[Any]) -> Iterator[tuple[str, Any]]:
    """(key, field) of ``model``, each field's description its attribute docstring."""
    docs = attribute_docs(model)
    for key, field in model.model_fields.items():
        described = copy.copy(field)
        described.description = docs.get(key)
        yield key, described


def settings_fields() -> Iterator[tuple[str, str, Any]]:
    """(section, key, field) for every setting; section "" is the top level."""
    from pydantic import BaseModel

    from ckptkeeper.config import Settings, TierConfig

    for name, field in _described(Settings):
        yield "", name, field
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        model = None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif typing.get_origin(ann) is list:
            model = TierConfig
        if model is None:
            continue
        for key, sub in _described(model):
            yield name, key, sub


def _env_name(section: str, key: str) -> str:
    if section == "tiers":
        return "—"
    return "`CKPTKEEPER_" + (f"{section}__{key}" if section else key).upper() + "`"


def config_page() -> str:
    from ckptkeeper.config import Settings

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_reference.py from ckptkeeper/config.py: edit the attribute",
        "     docstrings there, not this page. -->",
        "",
        "The config is TOML: `/etc/ckptkeeper/config.toml`, or `--config PATH`, or `$CKPTKEEPER_CONFIG`.",
        "Every key outside `[[tiers]]` can be overridden from the environment (the column *env*);",
        "the environment wins over the file. Unknown keys are errors, and a file that group or others",
        "may write is refused: it decides what gets deleted. A bad config exits 2 with one line per",
        "problem naming the key, e.g. `config error: tiers[0].keep_lsat: unknown key`.",
        "",
        'Durations are a number of seconds or a string such as `"90s"`, `"5m"`, `"2h"`, `"7d"`,',
        '`"1w"`, `"1h30m"`. Sizes use binary units: `"50MiB"`, `"40GiB"`.',
        "",
        "A complete example with every key is [`config.example.toml`](#example).",
        "",
    ]
    fields = list(settings_fields())
    named = {section for section, _, _ in fields if section}  # every table of the settings model
    sections: dict[str, list[tuple[str, Any]]] = {}
    for section, key, field in fields:
        if section == "" and key in named:
            continue
        sections.setdefault(section, []).append((key, field))
    titles = {name: f"`[{name}]`" for name in named} | {"": "Top level", "tiers": "`[[tiers]]`"}
    first = ["", "tiers", "reaper", "daemon", "fleet"]
    for section in [s for s in first if s in sections] + sorted(set(sections) - set(first)):
        lines += [f"## {titles[section]}", ""]
        if section:
            lines += [_one_line(attribute_docs(Settings).get(section)), ""]
        lines += ["| key | type | default | env | description |", "|---|---|---|---|---|"]
        for key, field in sections[section]:
            lines.append(
                f"| `{key}` | {_type_text(field)} | {_default_text(key, field)} | {_env_name(section, key)} | "
                f"{_one_line(field.description)} |"
            )
        lines.append("")
    lines += [
        "## Example",
        "",
        "`config.example.toml`, shipped with the source:",
        "",
        "```toml",
        (ROOT / "config.example.toml").read_text().rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI


def cli_commands() -> list[tuple[str, Any]]:
    """(name, command) of every command, the group itself first as ``ckptkeeper``."""
    from ckptkeeper.cli.app import main

    return [("ckptkeeper", main), *sorted(main.commands.items())]


def _param_type(param: Any) -> str:
    import click

    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    return (param.type.name.upper() if param.type.name else "").replace("|", "\\|")


def _option_default(opt: Any) -> str:
    if opt.required:
        return "required"
    default = opt.default
    # click 8.2+ marks "no default" with a sentinel object of its own
    if opt.is_flag or default is None or default == () or type(default).__name__ == "Sentinel":
        return ""
    return f"`{default}`"


def cli_page() -> str:
    import click

    from ckptkeeper.cli.app import main

    lines = [
        "# CLI reference",
        "",
        "<!-- Generated by docs/gen_reference.py from the click commands in ckptkeeper/cli/:",
        "     edit the help texts there, not this page. -->",
        "",
        "`ckptkeeper [--config PATH] COMMAND [ARGS]...`. Every command accepts `-h` / `--help`.",
        "Exit codes are listed on [Exit codes](../exit-codes.md), JSON output on",
        "[JSON output](../json.md).",
        "",
    ]
    for name, cmd in cli_commands():
        title = "ckptkeeper" if cmd is main else f"ckptkeeper {name}"
        ctx = click.Context(cmd, info_name=title)
        lines += [f"## `{name}`" if cmd is not main else "## Global options", ""]
        lines += ["```", cmd.get_usage(ctx).strip(), "```", ""]
        help_text = (cmd.help or "").strip()
        if help_text:
            lines += [inspect.cleandoc(click.unstyle(help_text)).replace("\b\n", ""), ""]
        params = [p for p in cmd.params if p.name != "help"]
        args = [p for p in params if isinstance(p, click.Argument)]
        opts = [p for p in params if isinstance(p, click.Option)]
        if args:
            lines.append(
                "Arguments: "
                + ", ".join(
                    f"`{p.human_readable_name}`" + ("" if p.required else " (optional)") for p in args
                )
                + "."
            )
            lines.append("")
        if opts:
            lines += ["| option | type | default | description |", "|---|---|---|---|"]
            for opt in opts:
                names = ", ".join(f"`{n}`" for n in [*opt.opts, *opt.secondary_opts])
                lines.append(
                    f"| {names} | {_param_type(opt)} | {_option_default(opt)} | {_one_line(opt.help)} |"
                )
            lines.append("")
    lines += [
        "## Shell completion",
        "",
        "click's completion: add one line to your shell's start-up file.",
        "",
        "```sh",
        'eval "$(_CKPTKEEPER_COMPLETE=bash_source ckptkeeper)"          # ~/.bashrc',
        'eval "$(_CKPTKEEPER_COMPLETE=zsh_source ckptkeeper)"           # ~/.zshrc',
        "_CKPTKEEPER_COMPLETE=fish_source ckptkeeper | source           # ~/.config/fish/completions/ckptkeeper.fish",
        "```",
        "",
        "Writing the script to a file once, instead of `eval` at every shell start, saves the ~0.1 s",
        "of a `ckptkeeper` start.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Metrics

_FAMILY_SUFFIX = {
    "CounterMetricFamily": ("counter", ["_total"]),
    "Counter": ("counter", ["_total"]),
    "GaugeMetricFamily": ("gauge", [""]),
    "Gauge": ("gauge", [""]),
    "InfoMetricFamily": ("info", ["_info"]),
    "Info": ("info", ["_info"]),
    "HistogramMetricFamily": ("histogram", ["_bucket", "_sum", "_count"]),
    "Histogram": ("histogram", ["_bucket", "_sum", "_count"]),
    "SummaryMetricFamily": ("summary", ["_sum", "_count"]),
    "Summary": ("summary", ["_sum", "_count"]),
}

PROCESS_METRICS = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)
"""prometheus_client's ProcessCollector, registered by the daemon."""


def metric_families(package: Path | None = None) -> list[dict[str, Any]]:
    """Every metric family defined in ``ckptkeeper/``: name, kind, help, labels, source file."""
    package = package or ROOT / "ckptkeeper"
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname not in _FAMILY_SUFFIX or len(node.args) < 2:
                continue
            name, doc = node.args[0], node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if not name.value.startswith("ckptkeeper_"):
                continue
            labels: list[str] = []
            for kw in node.keywords:
                if kw.arg in ("labels", "labelnames") and isinstance(kw.value, ast.List | ast.Tuple):
                    labels = [str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant)]
            kind, suffixes = _FAMILY_SUFFIX[fname]
            base = name.value.removesuffix("_total") if kind == "counter" else name.value
            found[base] = {
                "family": base,
                "kind": kind,
                "series": [base + s for s in suffixes],
                "help": doc.value if isinstance(doc, ast.Constant) else "",
                "labels": labels,
                "source": str(path.relative_to(package.parent)),
            }
    return [found[k] for k in sorted(found)]


def exported_series() -> set[str]:
    """Every series name a scrape of the daemon (or a textfile) can show."""
    names = set(PROCESS_METRICS)
    for fam in metric_families():
        names.update(fam["series"])
    return names


def metrics_page() -> str:
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated by docs/gen_reference.py from the metric families defined in ckptkeeper/. -->",
        "",
        "The daemon serves these on `daemon.metrics_addr` (default `127.0.0.1:9464`, path `/metrics`);",
        "a one-shot `prune` with `daemon.textfile` set writes them (plus the `ckptkeeper_prune_last_*`",
        "gauges) for node_exporter's textfile collector. Most are read from the index at scrape time,",
        "so they agree with `ckptkeeper status`. See [Operating](../operating.md) for alerts and the",
        "dashboard.",
        "",
        "| series | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for fam in metric_families():
        series = ", ".join(f"`{s}`" for s in fam["series"])
        labels = ", ".join(f"`{x}`" for x in fam["labels"])
        lines.append(f"| {series} | {fam['kind']} | {labels} | {_one_line(fam['help'])} |")
    lines += [
        f"| {', '.join(f'`{m}`' for m in PROCESS_METRICS)} | | | the daemon process itself "
        "(prometheus_client's process collector) |",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Benchmarks

BENCH_JSON = ROOT / "docs" / "bench" / "latest.json"
"""``python -m bench --json docs/bench/latest.json`` after a full run replaces it."""


def bench_table(path: Path = BENCH_JSON) -> str:
    """The table ``python -m bench`` prints, rendered from its ``--json`` document by the same
    function (:func:`bench._harness.table`), with the run's machine on top."""
    from bench._harness import Row
    from bench._harness import table as render

    doc = json.loads(path.read_text())
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in row.items() if k in fields}) for row in doc["rows"]]
    m = doc["machine"]
    minutes = f", {doc['seconds'] / 60:.0f} minutes" if doc.get("seconds") else ""
    head = (
        f"`python -m bench`, {doc['mode']} run{minutes}: {m['nproc']} x {m['cpu']}, Linux {m['kernel']}, "
        f"Python {m['python']}, load {m['loadavg_at_start']}."
    )
    return head + "\n\n" + render(rows) + "\n"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    pages = {
        "configuration.md": config_page(),
        "cli.md": cli_page(),
        "metrics.md": metrics_page(),
        "bench-table.md": bench_table(),
    }
    for name, text in pages.items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
