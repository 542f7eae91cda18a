"""The systemd notification protocol (``sd_notify(3)``) in a few lines of stdlib.

No libsystemd binding: the protocol is one datagram per message on the ``AF_UNIX`` socket named by
``$NOTIFY_SOCKET``, and a dependency for that would be heavier than the code. Outside systemd the
variable is unset and every call is a cheap no-op, so the daemon runs the same in a terminal.

The watchdog is deliberately conditional: :class:`WatchdogPinger` pings only while a health check
passes. A daemon whose observer or scheduler thread died would otherwise keep telling systemd it is
fine while doing nothing; by going silent we let ``WatchdogSec=`` restart it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping

from ckptkeeper.util.logs import get_logger

__all__ = ["WatchdogPinger", "notify", "watchdog_interval"]

log = get_logger("ckptkeeper.daemon.sdnotify")


def _address(env: Mapping[str, str]) -> str | None:
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr.startswith("@"):
        return "\0" + addr[1:]  # abstract namespace socket
    return addr


SEND_TIMEOUT = 1.0
"""Seconds a message may wait for room in the manager's socket queue before it is dropped.

Linux queues only ``net.unix.max_dgram_qlen`` (default 10) unread datagrams per socket; past that a
blocking send waits until the receiver reads. systemd reads at once, so this bound is only ever
reached when the manager is not reading (stalled, re-executing, a test's fake): the daemon sends
from its job thread after every pass and from the main thread while stopping, and an unbounded
wait there stopped both (no further passes; SIGTERM never completed)."""


def notify(message: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``, ``"STATUS=..."``) to systemd; False if not sent.

    Never raises and never blocks longer than :data:`SEND_TIMEOUT`: losing a status line must not
    take the daemon down, nor hold up a job or a stop.
    """
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.connect(addr)
            sock.sendall(message.encode("utf-8", "replace"))
    except TimeoutError:
        log.warning(
            "sd_notify dropped: the service manager is not reading its socket",
            message=message.split("\n", 1)[0],
            waited=SEND_TIMEOUT,
        )
        return False
    except OSError as exc:
        log.debug("sd_notify failed", error=str(exc))
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or None if not asked for.

    ``$WATCHDOG_PID``, when set, must be ours: a child that inherited the environment must not ping
    on the parent's behalf.
    """
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000 / 2


class WatchdogPinger:
    """A small thread sending ``WATCHDOG=1`` every ``interval`` seconds while ``healthy()`` holds.

    ``extra()`` may return more lines to send with each ping (the daemon uses it during a long first
    scan to send ``EXTEND_TIMEOUT_USEC``).
    """

    def __init__(
        self,
        interval: float,
        healthy: Callable[[], bool],
        *,
        extra: Callable[[], str | None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.interval = interval
        self._healthy = healthy
        self._extra = extra
        self._env = env
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptkeeper-sd-watchdog", daemon=True)
        self.pings = 0
        self.skipped = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            try:
                ok = self._healthy()
            except Exception:  # a failing health check is an unhealthy daemon, not a dead pinger
                log.exception("watchdog health check raised")
                ok = False
            if ok:
                extra = self._extra() if self._extra is not None else None
                notify("WATCHDOG=1" + (f"\n{extra}" if extra else ""), env=self._env)
                self.pings += 1
            else:
                self.skipped += 1
                if self.skipped == 1 or self.skipped % 10 == 0:
                    log.warning(
                        "daemon unhealthy: withholding the systemd watchdog ping", skipped=self.skipped
                    )
            if self._stop.wait(self.interval):
                return
