"""This machine's name, as keepers on shared tiers compare it."""

from __future__ import annotations

import os
import socket

__all__ = ["HOST_ENV", "machine_name"]

HOST_ENV = "CKPTKEEPER_HOST"
"""Names the machine when its hostname is not stable: a Kubernetes pod's hostname is the pod's
name, new at every restart, so the chart sets this to the node's name (the downward API's
``spec.nodeName``). Otherwise a restarted pod would look like a second keeper using this node's
name on a shared tier (docs/design.md, "Many nodes") and be refused until ``fleet.orphan_after``."""


def machine_name() -> str:
    """``$CKPTKEEPER_HOST`` when set, else the hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()
