"""``restore`` and ``prefetch`` served by the running daemon over its local socket.

A real daemon process and the real CLI (subprocesses) on moto S3: the daemon's answer is the one a
restore run alone gives (files, ``--json``, messages, exit codes); with the daemon gone the command
runs alone; a bad request gets an error and the daemon goes on serving; a client killed mid-restore
leaves nothing in the destination; a daemon running another config is not asked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pty
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from faultproxy import FaultProxy, Request
from test_daemon import wait_for

from ckptkeeper.daemon.wire import SOCKET_SUFFIX

REPO = Path(__file__).resolve().parent.parent
RUN = "run-a"
STEP = 100
CKPT = f"checkpoint-{STEP}"
_CLI = (sys.executable, "-X", "importtime", "-m", "ckptkeeper.cli")
FILES = {"model.bin": 300_000, "optimizer.bin": 200_000, "shard/extra.bin": 1000}


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "NOTIFY_SOCKET", "WATCHDOG_"))
    }


class Node:
    """A hot tier keeping nothing, a cold S3 tier keeping all; one checkpoint pruned to cold."""

    def __init__(self, tmp: Path, bucket: str, endpoint: str) -> None:
        self.tmp = tmp
        self.bucket = bucket
        self.hot = tmp / "hot"
        self.index = tmp / "state" / "index.db"
        self.socket = Path(str(self.index) + SOCKET_SUFFIX)
        ckpt = self.hot / RUN / CKPT
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": STEP, "log_history": []}))
        for rel, size in FILES.items():
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(os.urandom(size))
        when = time.time() - 3600
        for p in [*ckpt.rglob("*"), ckpt]:
            os.utime(p, (when, when))
        self.original = _tree(ckpt)
        self.config = self.write_config(tmp / "config.toml", endpoint)
        self.procs: list[subprocess.Popen[bytes]] = []
        res = self.cli("prune")
        assert res.returncode == 0, res.stderr
        assert not ckpt.exists()

    def write_config(self, path: Path, endpoint: str, **top: Any) -> Path:
        return write_config(
            path,
            index=self.index,
            daemon={
                "settle_seconds": "1s",
                "trust_mtimes": True,
                "metrics_addr": "",
                "retention_interval": "1h",
                "reap_interval": "1h",
            },
            tiers=[local_tier("hot", self.hot, keep_last=0), s3_tier("cold", self.bucket, endpoint)],
            **top,
        )

    def cli(self, *args: str, config: Path | None = None, env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config or self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.tmp,
            env=env or _env(),
        )

    def start(self) -> subprocess.Popen[bytes]:
        before = len(self.events("ready"))
        log = (self.tmp / "daemon.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), "daemon"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
        )
        log.close()
        self.procs.append(proc)
        assert wait_for(lambda: len(self.events("ready")) > before or proc.poll() is not None, 60), self.log()
        assert proc.poll() is None, self.log()
        assert self.socket.is_socket()
        return proc

    def log(self) -> str:
        path = self.tmp / "daemon.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("event") == name:
                out.append(doc)
        return out

    def event(self, name: str) -> bool:
        return bool(self.events(name))

    def served(self) -> list[dict[str, Any]]:
        return self.events("restore socket: served")

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def node(tmp_path: Path, s3_bucket: str, s3_reset: str) -> Iterator[Node]:
    n = Node(tmp_path, s3_bucket, s3_reset)
    try:
        yield n
    finally:
        n.kill_all()


def _messages(stderr: str) -> list[str]:
    """The command's own lines on stderr (log lines go to the daemon's log when it serves)."""
    return [line for line in stderr.splitlines() if line.startswith("ckptkeeper:")]


def test_restore_by_the_daemon_is_the_restore_run_alone(node: Node) -> None:
    node.start()
    runs: dict[str, Any] = {}
    for how in ("daemon", "alone"):
        extra = () if how == "daemon" else ("--no-daemon",)
        got = node.cli("restore", RUN, "--to", "out", "--json", *extra)  # relative: our cwd, not the daemon's
        assert got.returncode == 0, got.stderr
        text = node.cli("restore", RUN, "--step", str(STEP), "--to", "out-text", *extra)
        again = node.cli("restore", RUN, "--to", "out", *extra)  # refuses to overwrite
        missing = node.cli("restore", "no-such-run", "--to", "out", *extra)
        runs[how] = (got.stdout, _tree(node.tmp / "out" / CKPT), text.stdout, again, missing)
        assert len(node.served()) == 4, node.log()  # the daemon served its four, none of the others
        for d in ("out", "out-text"):
            subprocess.run(["rm", "-rf", str(node.tmp / d)], check=True)
    daemon, alone = runs["daemon"], runs["alone"]
    assert daemon[0] == alone[0]  # --json byte-identical
    assert json.loads(daemon[0])["path"] == f"out/{CKPT}"
    assert daemon[1] == alone[1] == node.original
    assert daemon[2] == alone[2] == f"out-text/{CKPT}\n"
    for served, local in ((daemon[3], alone[3]), (daemon[4], alone[4])):
        assert (served.returncode, _messages(served.stderr)) == (local.returncode, _messages(local.stderr))
        assert served.returncode == 1 and _messages(served.stderr)
    assert "already exists" in daemon[3].stderr
    assert [e["exit"] for e in node.served()] == [0, 0, 1, 1]


def test_prefetch_by_the_daemon_and_its_client_imports_little(node: Node) -> None:
    node.start()
    got = node.cli("prefetch", RUN, "--json")
    assert got.returncode == 0, got.stderr
    assert len(node.served()) == 1
    assert _tree(node.hot / RUN / CKPT) == node.original
    doc = json.loads(got.stdout)
    assert doc["from_tier"] == "cold" and doc["step"] == STEP
    again = node.cli("prefetch", RUN, "--json", "--no-daemon")  # now in hot: kept as it is
    assert json.loads(again.stdout)["from_tier"] is None
    subprocess.run(["rm", "-rf", str(node.hot / RUN)], check=True)
    alone = node.cli("prefetch", RUN, "--json", "--no-daemon")
    assert alone.returncode == 0, alone.stderr
    assert {**json.loads(alone.stdout), "seconds": 0} == {**doc, "seconds": 0}  # all but the timing
    assert list(json.loads(alone.stdout)) == list(doc)
    # The thin client: a restore served by the daemon never loads the heavy libraries.
    timed = subprocess.run(
        [*_CLI, "--config", str(node.config), "restore", RUN, "--to", str(node.tmp / "thin")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert timed.returncode == 0, timed.stderr
    assert len(node.served()) == 2
    modules = {line.split("|")[-1].strip() for line in timed.stderr.splitlines() if "import time:" in line}
    assert not {
        m
        for m in modules
        if m.split(".")[0] in ("s3fs", "fsspec", "pydantic", "structlog", "botocore", "click")
    }
    assert "ckptkeeper.cli.app" not in modules  # nor the command group: the restore line is read alone


def test_command_lines_the_thin_client_does_not_read_go_to_the_full_cli(node: Node) -> None:
    node.start()
    (node.tmp / "a-file").write_text("")
    for args, why in (
        (("--step", "-1", "--to", "out"), "a non-negative number"),
        (("--step", "soon", "--to", "out"), "is not a step number"),
        (("--to", "a-file"), "is a file"),
        (("--to", "out", "--metric", "loss"), "only apply to --step best"),
        (("--to", "out", "--bogus"), "No such option"),
    ):
        got = node.cli("restore", RUN, *args)
        assert (got.returncode, why in got.stderr) == (2, True), (args, got.stderr)
    assert not node.served()
    missing = node.cli("restore", "--to", "out")
    assert missing.returncode == 2 and "Missing argument" in missing.stderr
    # Read alone: both option spellings; the output is the click command's.
    got = node.cli("restore", f"--step={STEP}", f"--to={node.tmp / 'eq'}", RUN, "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["path"] == str(node.tmp / "eq" / CKPT)
    assert _tree(node.tmp / "eq" / CKPT) == node.original


def test_on_a_terminal_the_daemon_s_progress_is_drawn(node: Node) -> None:
    node.start()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    argv = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "restore", RUN]
    dest = node.tmp / "tty"
    proc = subprocess.Popen([*argv, "--to", str(dest)], stdin=slave, stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    out = b"".join(chunks).decode()
    lines = out.replace("\r\n", "\n").split("\n")
    screen = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line.split("\r")[-1]) for line in lines]
    assert any(line.startswith(f"restore {RUN}@latest: ") and "(100%)" in line for line in screen), out
    assert str(dest / CKPT) in screen
    assert len(node.served()) == 1


def test_the_prologs_prestage_is_served_by_the_daemon(node: Node) -> None:
    node.start()
    bin_dir = node.tmp / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"  # the job's controller record: it resumes RUN
    stub.write_text(
        "#!/bin/sh\n"
        f'[ "$1 $2 $3" = "-o show job" ] && echo "JobId=$4 JobState=RUNNING Comment=ckptkeeper:resume={RUN}"\n'
    )
    stub.chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1"}
    got = node.cli("job", "start", "--json", env=env)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["errors"] == [] and [(p["run"], p["from_tier"]) for p in doc["prestaged"]] == [(RUN, "cold")]
    assert [(e["op"], e["exit"]) for e in node.served()] == [("prefetch", 0)]
    assert _tree(node.hot / RUN / CKPT) == node.original


@pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) for a mount namespace",
)
def test_a_client_in_another_mount_namespace_is_served_only_where_both_see_the_same_directory(
    node: Node,
) -> None:
    node.start()
    private = node.tmp / "private"  # a tmpfs only the client's namespace has
    private.mkdir()
    cli = f"{sys.executable} -m ckptkeeper.cli --config {node.config} restore {RUN} --json"
    script = (
        f"mount -t tmpfs none {private} && {cli} --to {private}/r > {node.tmp}/private.json && "
        f"test -f {private}/r/{CKPT}/model.bin && {cli} --to {node.tmp}/shared > {node.tmp}/shared.json"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr
    assert not (private / "r").exists()  # it went to the client's tmpfs, restored by the client itself
    assert [e["reason"] for e in node.events("restore socket: declined")] == [
        "the destination is another directory in the daemon's mount namespace"
    ]
    assert [e["to"] for e in node.served()] == [f"{node.tmp}/shared"]
    assert _tree(node.tmp / "shared" / CKPT) == node.original
    private_doc = json.loads((node.tmp / "private.json").read_text())
    shared_doc = json.loads((node.tmp / "shared.json").read_text())
    assert {**private_doc, "path": None} == {**shared_doc, "path": None}


def test_prefetch_after_the_hot_copy_was_removed_behind_the_index_fetches_it_again(node: Node) -> None:
    assert node.cli("prefetch", RUN, "--no-daemon").returncode == 0
    subprocess.run(["rm", "-rf", str(node.hot / RUN)], check=True)  # the index still lists it in hot
    got = node.cli("prefetch", RUN, "--json", "--no-daemon")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["from_tier"] == "cold"
    assert _tree(node.hot / RUN / CKPT) == node.original


def test_with_the_daemon_gone_the_command_runs_alone(node: Node) -> None:
    proc = node.start()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, node.log()
    assert not node.socket.exists()  # removed at a clean stop
    got = node.cli("restore", RUN, "--to", "a", "--json")
    assert got.returncode == 0, got.stderr
    assert _tree(node.tmp / "a" / CKPT) == node.original

    proc = node.start()
    proc.kill()  # kill -9: its socket stays behind, nobody answers it
    proc.wait(timeout=10)
    assert node.socket.is_socket()
    got = node.cli("restore", RUN, "--to", "b", "--json")
    assert got.returncode == 0, got.stderr
    assert _tree(node.tmp / "b" / CKPT) == node.original
    assert node.served() == []


def _ask(path: Path, payload: bytes) -> dict[str, Any] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        # Answered (and closed) before all of it was read: the answer is queued all the same.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(payload)
        data = b""
        while b"\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data.split(b"\n")[0]) if data else None


def _request(**args: Any) -> dict[str, Any]:
    from ckptkeeper import __version__

    return {"v": 1, "op": "restore", "version": __version__, "config": "0" * 64, "umask": 0o22, "args": args}


def test_bad_requests_get_an_error_and_the_daemon_goes_on_serving(node: Node) -> None:
    node.start()
    good = {"run": RUN, "step": "latest", "to": str(node.tmp / "x")}
    bad: list[bytes] = [
        b"not json\n",
        b"[1, 2]\n",
        b'{"v": 1}\n',
        b"{" + b" " * 70_000 + b"\n",  # longer than a message may be
        json.dumps({**_request(**good), "v": 99}).encode() + b"\n",
        json.dumps({**_request(**good), "op": "prune"}).encode() + b"\n",
        json.dumps(_request(**{**good, "step": -1})).encode() + b"\n",
        json.dumps(_request(**{**good, "step": 2**70})).encode() + b"\n",
        json.dumps(_request(**{**good, "to": "relative/dir"})).encode() + b"\n",
        json.dumps(_request(**{**good, "run": "a\0b"})).encode() + b"\n",
        json.dumps(_request(**{**good, "metric": "loss"})).encode() + b"\n",
        json.dumps(_request(**{**good, "extra": 1})).encode() + b"\n",
        json.dumps({**_request(**good), "umask": "022"}).encode() + b"\n",
    ]
    for payload in bad:
        answer = _ask(node.socket, payload)
        assert answer is not None and answer["event"] == "error", (payload[:80], answer)
        assert answer["message"].startswith("bad request: ")
    # Well formed, but for another config: declined, the client runs it itself.
    assert _ask(node.socket, json.dumps(_request(**good)).encode() + b"\n") == {
        "event": "declined",
        "reason": "the daemon runs another config",
    }
    got = node.cli("restore", RUN, "--to", "after", "--json")
    assert got.returncode == 0, got.stderr
    assert [e["exit"] for e in node.served()] == [0]
    assert _tree(node.tmp / "after" / CKPT) == node.original


def test_a_daemon_running_another_config_is_not_used(node: Node, s3_reset: str) -> None:
    proc = node.start()
    other = node.write_config(node.tmp / "other.toml", s3_reset)  # the same text, another file
    assert other.read_text() == node.config.read_text()
    got = node.cli("restore", RUN, "--to", "a", "--json", config=other)
    assert got.returncode == 0, got.stderr
    env = {**_env(), "CKPTKEEPER_LOG_LEVEL": "warning"}  # the same file, another environment
    got = node.cli("restore", RUN, "--to", "b", "--json", env=env)
    assert got.returncode == 0, got.stderr
    assert node.served() == []
    assert [e["reason"] for e in node.events("restore socket: declined")] == [
        "the daemon runs another config"
    ] * 2
    assert _tree(node.tmp / "a" / CKPT) == _tree(node.tmp / "b" / CKPT) == node.original
    # Its own file, edited but not reloaded yet: not what the daemon runs. Reloaded: served again.
    with node.config.open("a") as f:
        f.write("# edited\n")
    assert node.cli("restore", RUN, "--to", "c", "--json").returncode == 0
    assert node.served() == [] and len(node.events("restore socket: declined")) == 3
    proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: node.event("config reloaded: nothing changed"), 60), node.log()
    assert node.cli("restore", RUN, "--to", "d", "--json").returncode == 0
    assert [e["exit"] for e in node.served()] == [0]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_refused_even_through_an_open_socket(node: Node) -> None:
    node.start()
    node.socket.chmod(0o666)  # only SO_PEERCRED stands in the way now
    dirfd = os.open(node.socket.parent, os.O_RDONLY | os.O_DIRECTORY)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, connect (SO_PEERCRED records who connected), read the answer
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(f"/proc/self/fd/{dirfd}/{node.socket.name}")
                os.write(write_end, s.recv(4096))
            code = 0
        except BaseException as exc:
            os.write(write_end, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    os.close(dirfd)
    answer = b""
    while chunk := os.read(read_end, 4096):
        answer += chunk
    os.close(read_end)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, answer
    assert json.loads(answer) == {"event": "error", "message": "refused: only the daemon's user and group"}
    assert node.event("restore socket: refused another user")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_client_killed_mid_restore_leaves_nothing_behind(
    tmp_path: Path, s3_bucket: str, s3_reset: str, sig: signal.Signals
) -> None:
    """kill -9: the daemon sees the connection close and cleans up. Ctrl-C: the client also waits
    for that before it exits (1, "Aborted!", as a restore run alone does)."""
    entered, release = threading.Event(), threading.Event()

    def hold(data: bytes) -> bytes:
        entered.set()
        release.wait(60)
        return data

    def rule(request: Request) -> Any:
        held = request.method == "GET" and request.path.endswith("/optimizer.bin") and not release.is_set()
        return hold if held else None

    node = Node(tmp_path, s3_bucket, s3_reset)
    with FaultProxy(s3_reset, rate=0.0, rules=[rule]) as proxy:
        node.config = node.write_config(node.config, proxy.url)
        node.start()
        try:
            dest = tmp_path / "dest"
            argv = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "restore", RUN]
            client = subprocess.Popen(
                [*argv, "--to", str(dest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
            )
            assert entered.wait(60), node.log()
            assert node.event("restore socket: serving")
            client.send_signal(sig)
            assert wait_for(lambda: node.event("restore socket: client went away; cancelling"), 30), (
                node.log()
            )
            release.set()
            _out, err = client.communicate(timeout=60)
            if sig == signal.SIGINT:
                assert client.returncode == 1 and b"Aborted!" in err
                assert node.served() and node.served()[0]["cancelled"] is True  # before it exited
            assert wait_for(lambda: bool(node.served()), 60), node.log()
            assert node.served()[0]["cancelled"] is True
            assert not dest.exists() or os.listdir(dest) == []  # no checkpoint, no staging
            # The daemon goes on serving.
            got = node.cli("restore", RUN, "--to", str(dest), "--json")
            assert got.returncode == 0, got.stderr
            assert [e["exit"] for e in node.served()] == [None, 0]
            assert _tree(dest / CKPT) == node.original
        finally:
            release.set()
            node.kill_all()


def test_the_thin_clients_defaults_are_the_configs() -> None:
    """The client finds the socket without loading the config module (pydantic): its copies of
    the defaults must be the config's."""
    from ckptkeeper import config, config_checks
    from ckptkeeper.daemon import wire

    assert str(config.DEFAULT_CONFIG_PATH) == wire.DEFAULT_CONFIG_PATH
    assert wire.CONFIG_ENV == config.CONFIG_ENV
    assert wire.ENV_PREFIX == config_checks.ENV_PREFIX
    assert config.Settings.model_fields["index"].default == wire.DEFAULT_INDEX


@pytest.mark.parametrize(
    "text",
    [
        'index = "/srv/ck/index.db"\n',
        "index='/srv/ck/index.db'   # the catalog\r\nrun_depth = 1\n",
        '# index = "/old.db"\nlog_level = "info"\n[daemon]\nindex = "/not/top/level.db"\n',
        'max_delete = 5\n\n[[tiers]]\nname = "hot"\nurl = "/nvme"\n',
        'index = "/a.db"\nindex = "/b.db"\n',
        '"index" = "/quoted.db"\n',
        'index."x" = 1\n',
        'index = "/esc\\u0061ped.db"\n',
        'index = "/a.db" junk\n',
        'note = """\nindex = "/inside/a/string.db"\n"""\nindex = "/real.db"\n',
        "index = 'C:\\\\literal.db'\n",
        'index = ""\n',
        "index = 42\n",
        'index = "/nul\\u0000.db"\n',
        'index = "/caf\u00e9.db"\n',
        "\ufeffnot toml at all = = =\n",
    ],
)
def test_the_thin_client_reads_the_index_path_as_the_config_does(text: str) -> None:
    """The client reads a plainly written ``index`` line itself and leaves anything else to the
    TOML parser: the path it finds the socket beside is the one the config names (None: no usable
    path). A file that does not parse may name any socket: no daemon runs it, so none serves it."""
    import tomllib

    from ckptkeeper.daemon import wire

    try:
        value = tomllib.loads(text).get("index", wire.DEFAULT_INDEX)
    except tomllib.TOMLDecodeError:
        assert wire.index_of(text.encode()) in (None, wire.DEFAULT_INDEX)
        return
    expected = value if isinstance(value, str) and value and "\0" not in value else None
    assert wire.index_of(text.encode()) == expected


def test_a_client_closing_between_poll_and_a_heartbeat_cancels_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race a loaded box showed: the client's end closes after the daemon's poll reported
    nothing and before its heartbeat is sent. The failed send is the client going away, as a poll
    seeing it would be: the job is cancelled and its connection thread waits for the worker."""
    import select as select_module

    from ckptkeeper.daemon import restore_server
    from ckptkeeper.daemon.wire import Request as WireRequest

    real_poll = select_module.poll

    class LateToSee:
        """A poller whose first answer misses what already happened (as if asked just before)."""

        def __init__(self) -> None:
            self.inner, self.first = real_poll(), True

        def register(self, fd: int, mask: int) -> None:
            self.inner.register(fd, mask)

        def unregister(self, fd: int) -> None:
            self.inner.unregister(fd)

        def poll(self, timeout: float) -> list[tuple[int, int]]:
            if self.first:
                self.first = False
                return []
            return self.inner.poll(timeout)

    monkeypatch.setattr(restore_server.select, "poll", LateToSee)
    monkeypatch.setattr(restore_server, "HEARTBEAT_SECONDS", 0.0)
    daemon_end, client_end = socket.socketpair()
    client_end.close()
    request = WireRequest("restore", "v", "c", 0o22, False, "run", "latest", "/tmp/x")
    job = restore_server._Job(request)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def worker() -> None:  # ends once cancelled, as a fetch does at its next chunk
        job.cancel.wait(30)
        os.write(wake_w, b"x")

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        server = restore_server.RestoreServer(str(Path("unused")), lambda _config: None)  # not listening
        server._follow(daemon_end, job, wake_r)  # old code: BrokenPipeError, the job left running
        assert job.cancel.is_set()
    finally:
        job.cancel.set()
        thread.join()
        daemon_end.close()
        os.close(wake_r)
        os.close(wake_w)
