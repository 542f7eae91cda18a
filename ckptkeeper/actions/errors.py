"""What an action can end in besides success: the exceptions it raises and the exit codes of §7.

Standard library only: the CLI imports this module at start-up (``ckptkeeper --help`` stays fast),
the daemon and the Python API catch the same classes.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ACTION_FAILED = 1
"""An action failed; the rest was still done."""
EXIT_USAGE = 2
"""Bad arguments or configuration."""
EXIT_REFUSED = 3
"""Refused by a guard (``max_delete``, an empty policy)."""
EXIT_POLICY_HELD = 4
"""The policy could not be fully applied: a tier it needs is unavailable (its listing failed), so
copies to it and deletes that depend on it are held. Nothing was lost; the rest was done."""
EXIT_LOCKED = 11
"""Another process holds the executor lock."""


class Locked(Exception):
    """Another process holds the executor lock."""


class IndexUnusable(Exception):
    """The index is corrupt and was not rebuilt (the message says how to rebuild it)."""
