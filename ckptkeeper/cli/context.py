"""What every command module shares: the invocation's :class:`Context`, :func:`fail`, JSON output
and the exit codes of docs/design.md, "Contracts".

Imported at start-up by every command module, so it imports click and the standard library only:
the config (pydantic) and the index are loaded on first use, which keeps ``ckptkeeper --help`` fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn, cast

import click

from ckptkeeper.actions.errors import (
    EXIT_ACTION_FAILED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_POLICY_HELD,
    EXIT_REFUSED,
    EXIT_USAGE,
)

if TYPE_CHECKING:
    from ckptkeeper.config import Settings
    from ckptkeeper.index import Index

__all__ = [
    "EXIT_ACTION_FAILED",
    "EXIT_LOCKED",
    "EXIT_OK",
    "EXIT_POLICY_HELD",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "Context",
    "emit_json",
    "fail",
    "out_width",
    "pass_ctx",
]


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"ckptkeeper: {message}", err=True)
    sys.exit(code)


def out_width() -> int:
    """Columns human output fits in: the terminal's, or 100 when stdout is a pipe or a file."""
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def emit_json(doc: object) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


class Context:
    """Lazily loaded settings and index shared by the commands of one invocation."""

    def __init__(self, config_path: str | None) -> None:
        self.config_path = config_path
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        """The config; a bad one exits 2 with one line per problem."""
        if self._settings is None:
            # Imported here, not at the top: pydantic costs ~0.5 s, which --help must not pay.
            from ckptkeeper.config import ConfigError, load_settings_and_source
            from ckptkeeper.config_cache import remember

            try:
                settings, source = load_settings_and_source(self.config_path)
            except ConfigError as exc:
                for line in exc.problems:
                    click.echo(f"config error: {line}", err=True)
                sys.exit(EXIT_USAGE)
            if source is not None:
                remember(*source, settings)
            return self._use(settings)
        return self._settings

    def settings_to_read(self) -> Settings:
        """The config for a command that only reads its values (``restore``): the values a
        previous command validated when nothing they depend on changed, without loading pydantic
        (:mod:`ckptkeeper.config_cache`); else :attr:`settings`, which also remembers them."""
        if self._settings is None:
            from ckptkeeper.config_cache import load_view

            view = load_view(self.config_path)
            if view is not None:
                # The view has every value and method of Settings that reading commands use.
                self._use(cast("Settings", view))
        return self.settings

    def _use(self, settings: Settings) -> Settings:
        from ckptkeeper.cli.standalone import configure

        self._settings = settings
        configure(settings)
        return settings

    @contextmanager
    def index(self, *, rebuild: bool = False) -> Iterator[Index]:
        """``rebuild`` (scan, prune): check the index and rebuild a corrupt one from the tiers."""
        from ckptkeeper.cli.standalone import IndexOpenFailed, opened_index

        try:
            with opened_index(self.settings, rebuild=rebuild) as ix:
                yield ix
        except IndexOpenFailed as exc:
            fail(str(exc), exc.code)


pass_ctx = click.make_pass_decorator(Context)
