"""Fleet stress mode: many node processes, one S3 server, kill -9 everywhere.

    python tests/stress_fleet.py --nodes 50 --rounds 4 --seed 1

N nodes, each with its own config (``node``, hot dir, index) and one ``shared = true`` cold tier
on one moto server (127.0.0.1), write HF-style checkpoints every round — the run ``exp`` on every
node at the same steps, ``job-<i % 5>`` on five nodes at a time — and run ``ckptkeeper prune``
passes concurrently. Each pass has a fate drawn from the seed: run to the end; SIGKILL at a crash
point of the executor (``CKPTKEEPER_TEST_CRASH_AFTER``: mid-copy, mid-delete); SIGKILL at a random
instant; or, for a few nodes, SIGKILL once their multipart upload is in flight and never again
restarted: those are the orphans whose litter the fleet lease holder must clean. While passes
run, a watcher stops (SIGSTOP) the process holding the fleet lease for longer than
``fleet.lease_ttl``, so the lease expires mid-cleanup and another node takes over, then lets it go
on (SIGCONT). Killed nodes are restarted (a clean pass) before the round ends.

The checker reads only the store's own listing (list_objects_v2 / list_multipart_uploads, and the
objects themselves) and what each node wrote, and counts violations of the Done-when of #14:

1. kept: each node's policy (hot ``keep_last=1``, cold ``keep_last=K`` with ``replicate``) keeps
   the newest K steps of each of its runs. Right after the kills every one of them is whole
   somewhere (hot bytes identical, or a complete cold copy); after the restart pass every one has a
   complete cold copy under the node's prefix: the manifest, every file of its size, and the bytes
   hashing to what the node wrote (every object below 1 MiB is downloaded and hashed).
2. owner-only deletes: a key under node X's prefix that vanished in a round where X ran no pass
   must be litter of X (a staging marker or uncommitted data) cleaned by the lease holder; a
   committed copy of X that vanished or changed then is a violation.
3. orphans: every staging marker and multipart upload an orphan left is gone at the end, and the
   fleet cleanup log lines (one per item, from every process's stderr, killed ones included) name
   it exactly once (an upload aborted with its marker counts with the marker).
4. same-name runs: every manifest under node X's prefix names node X and the run and step, and
   its file hashes are the ones X wrote; no data key is written outside ``<prefix>/<node>/``.
5. adoption: what the policy expires among an orphan's copies is deleted exactly once, what it
   keeps stays whole (``stress_fleet_adopt.py``); a key deleted so is no violation of 2.
6. cluster reality (docs/many-nodes-clocks.md): a third of the nodes run with a clock off by up to
   ``--skew`` seconds either way (``tests/clockshift``: their processes' ``time.time`` is shifted;
   the store's clock and the kernel's, which dates their hot dirs' files as an NFS server would,
   are not: file ages are judged by the filesystem's clock), and every invariant above holds for them
   too; one more keeper, from round 1 on, uses a live node's ``node`` name with its own hot dir and
   index: each of its passes must be refused (exit 2 naming ``node``) and change nothing.

Exit 0 when there is no violation; 1 with the violations listed. ``--json`` prints the figures.
``tests/test_fleet_stress.py`` runs a small version in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ``builders`` beside this file, and the checkout's ``ckptkeeper`` (the node processes get it too)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from builders import config_text, local_tier, s3_tier, write_text_config
from stress_fleet_adopt import adoption_split, check_adoption, kept_at_death
from stress_fleet_reality import check_duplicate, skew_and_twin

from ckptkeeper.core.model import MANIFEST_SUFFIX, Manifest
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.util import hashing

PREFIX = "ckpt"
FLEET = f"{PREFIX}/.ckptkeeper/"
KEEP_COLD = 3
MiB = 2**20
BIG = 40 * MiB
"""Above the S3 tier's 16 MiB part size: an orphan's last checkpoint goes up as a multipart upload
(three parts: a wide window for the driver to see it in flight and kill the node)."""
EXTRA = 4
"""Steps of ``exp`` an orphan writes below the big one in the round it dies; its own cold policy
keeps KEEP_COLD + EXTRA, so it copies them all: the fleet's rules expire some (stress_fleet_adopt)."""
HASH_BELOW = MiB
"""Objects below this are downloaded and hashed by the checker; bigger ones are checked by size."""
CLEANUP_EVENTS = (
    "fleet cleanup: discarded a gone node's staging marker",
    "fleet cleanup: aborted a gone node's upload",
)


@dataclass
class Node:
    name: str
    home: Path
    config: Path
    written: dict[str, dict[int, dict[str, tuple[int, str]]]] = field(default_factory=dict)
    """run -> step -> file -> (size, hash) of what this node wrote."""
    orphan_round: int | None = None
    """The round this node dies in for good (None: it lives)."""
    dead: bool = False
    passes: int = 0
    offset: float = 0.0
    """Seconds its clock is off (its processes' wall clock and its hot dir's mtimes)."""

    @property
    def hot(self) -> Path:
        return self.home / "hot"

    def kept(self) -> list[tuple[str, int]]:
        """(run, step) its policy keeps: the newest KEEP_COLD steps of each run."""
        return [(run, s) for run, steps in self.written.items() for s in sorted(steps)[-KEEP_COLD:]]


@dataclass
class Figures:
    nodes: int = 0
    rounds: int = 0
    passes: int = 0
    killed_crash_point: int = 0
    killed_timed: int = 0
    crash_point_not_reached: int = 0
    orphans: int = 0
    lease_stalls: int = 0
    checkpoints_written: int = 0
    kept_checked: int = 0
    objects_hashed: int = 0
    keys_diffed: int = 0
    orphan_litter: int = 0
    cleanup_events: int = 0
    adopt_expected: int = 0
    adopted_events: int = 0
    skewed: dict[str, float] = field(default_factory=dict)
    """node -> its clock offset in seconds."""
    duplicate_passes: int = 0
    duplicate_refused: int = 0
    exit_codes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)


class Store:
    """The checker's view: the store's own listings, through boto3 (never through ckptkeeper)."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        import boto3

        self.bucket = bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def objects(self) -> dict[str, tuple[str, int]]:
        out: dict[str, tuple[str, int]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for o in page.get("Contents", []):
                out[o["Key"]] = (o["ETag"], o["Size"])
        return out

    def uploads(self) -> dict[str, str]:
        """upload id -> key."""
        out: dict[str, str] = {}
        kw: dict[str, Any] = {"Bucket": self.bucket}
        while True:
            resp = self.client.list_multipart_uploads(**kw)
            out.update({u["UploadId"]: u["Key"] for u in resp.get("Uploads", [])})
            if not resp.get("IsTruncated"):
                return out
            kw["KeyMarker"], kw["UploadIdMarker"] = resp.get("NextKeyMarker"), resp.get("NextUploadIdMarker")

    def get(self, key: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return body

    def lease(self) -> dict[str, Any] | None:
        try:
            doc: Any = json.loads(self.get(FLEET + "lease"))
        except Exception:
            return None
        return doc if isinstance(doc, dict) else None


def _digest(data: bytes) -> str:
    h = hashing.new_hasher()
    h.update(data)
    return h.hexdigest()


def make_node(
    base: Path,
    name: str,
    endpoint: str,
    bucket: str,
    fleet: dict[str, str],
    keep: int = KEEP_COLD,
    home_name: str | None = None,
) -> Node:
    home = base / (home_name or name)
    (home / "hot").mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(exist_ok=True)
    cold = s3_tier("cold", bucket, endpoint, prefix=PREFIX, replicate=True, keep_last=keep, shared=True)
    text = config_text(
        index=home / "index.db",
        node=name,
        max_delete=100_000,
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
        tiers=[local_tier("hot", home / "hot", keep_last=1), cold],
    )
    text += "\n[fleet]\n" + "".join(f'{k} = "{v}"\n' for k, v in fleet.items())
    return Node(name, home, write_text_config(home / "config.toml", text))


def write_checkpoint(node: Node, run: str, step: int, size: int, rng: random.Random) -> None:
    """An HF-style checkpoint (``checkpoint-<step>/`` with ``trainer_state.json``), bytes unique to
    this node, run and step; mtimes in the past so it is settled (``trust_mtimes``)."""
    ckpt = node.hot / run / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    files = {
        "model.bin": rng.randbytes(size) + f"{node.name}/{run}/{step}".encode(),
        "trainer_state.json": json.dumps({"global_step": step, "node": node.name}).encode(),
    }
    # By the filesystem's clock (the kernel's here, the server's on NFS), which the node's keeper
    # reads with a probe file: a node's skewed clock never dates files (docs/many-nodes-clocks.md).
    when = time.time() - 600
    for rel, data in files.items():
        (ckpt / rel).write_bytes(data)
    for p in [*ckpt.iterdir(), ckpt]:
        os.utime(p, (when, when))
    node.written.setdefault(run, {})[step] = {rel: (len(d), _digest(d)) for rel, d in files.items()}


CLOCKSHIFT = Path(__file__).resolve().parent / "clockshift"


def _env(extra: dict[str, str], offset: float = 0.0) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    paths = [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    if offset:
        paths.insert(0, str(CLOCKSHIFT))
        env["CKPT_TEST_CLOCK_OFFSET"] = repr(offset)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return {**env, **extra}


@dataclass
class Pass:
    node: Node
    fate: str
    """clean | point | timed | orphan | duplicate"""
    arg: float = 0.0
    code: int | None = None
    stderr: Path | None = None


class Fleet:
    prefix = PREFIX

    def __init__(self, base: Path, endpoint: str, bucket: str, args: argparse.Namespace) -> None:
        self.base, self.endpoint, self.bucket = base, endpoint, bucket
        self.args = args
        self.rng = random.Random(args.seed)
        self.store = Store(endpoint, bucket)
        self.fig = Figures(nodes=args.nodes, rounds=args.rounds)
        fleet = {
            "lease_ttl": f"{args.lease_ttl}s",
            "heartbeat_ttl": f"{args.heartbeat_ttl}s",
            "orphan_after": f"{args.orphan_after}s",
        }
        self.nodes = [make_node(base, f"node-{i:02d}", endpoint, bucket, fleet) for i in range(args.nodes)]
        n_orphans = max(1, args.nodes // 10) if args.rounds >= 2 else 0
        for i, node in enumerate(self.rng.sample(self.nodes, n_orphans)):
            node.orphan_round = 1 + i % (args.rounds - 1)
            # its own cold policy keeps more than the fleet's: once gone, the holder's rules apply
            node.config = make_node(base, node.name, endpoint, bucket, fleet, KEEP_COLD + EXTRA).config
        self.fig.orphans = n_orphans
        self.duplicate: Node | None = skew_and_twin(self, make_node, base, endpoint, bucket, fleet)
        self.running: dict[int, Node] = {}
        self.lock = threading.Lock()
        self.orphan_litter: dict[str, set[str]] = {}
        """orphan -> its litter at death: staging marker keys and 'upload:<key>' of its uploads."""
        self.died_at: dict[str, float] = {}
        self._committed: dict[str, set[str]] = {}
        """orphan -> its committed manifest keys when it died (what it had in cold)."""
        self.stall_rng = random.Random(f"{args.seed}:stall")
        self.late: Counter[str] = Counter()
        """Cleaned items whose delete ended after the cleaner's lease had expired (it logs so)."""

    # ---- passes --------------------------------------------------------------------------------

    def _popen(self, p: Pass, env: dict[str, str]) -> subprocess.Popen[bytes]:
        p.node.passes += 1
        tag = f"{p.node.passes:03d}-{p.fate}"
        p.stderr = p.node.home / "logs" / f"{tag}.err"
        with open(p.node.home / "logs" / f"{tag}.out", "wb") as out, open(p.stderr, "wb") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "ckptkeeper.cli", "--config", str(p.node.config), "prune", "--json"],
                stdout=out,
                stderr=err,
                env=_env(env, p.node.offset),
            )

    def _run(self, p: Pass) -> Pass:
        env = {"CKPTKEEPER_TEST_CRASH_AFTER": str(int(p.arg))} if p.fate == "point" else {}
        proc = self._popen(p, env)
        with self.lock:
            self.running[proc.pid] = p.node
        try:
            if p.fate == "timed":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=p.arg)
            elif p.fate == "orphan":
                prefix = f"{PREFIX}/{p.node.name}/"
                while proc.poll() is None and not any(
                    k.startswith(prefix) for k in self.store.uploads().values()
                ):
                    time.sleep(0.05)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=self.args.pass_timeout)
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stalled lease holder dies too
                proc.kill()
            p.code = proc.wait(timeout=self.args.pass_timeout)
            if p.fate == "orphan":
                p.node.dead = True
                self.died_at[p.node.name] = time.time()
                self.record_orphan_litter(p.node)  # at once: it may already look gone to the others
        finally:
            with self.lock:
                self.running.pop(proc.pid, None)
        return p

    def run_passes(self, passes: list[Pass]) -> list[Pass]:
        stop = threading.Event()
        watcher = threading.Thread(target=self._stall_lease_holders, args=(stop,), daemon=True)
        watcher.start()
        try:
            with ThreadPoolExecutor(self.args.parallel) as pool:
                done = list(pool.map(self._run, passes))
        finally:
            stop.set()
            watcher.join()
        for p in done:
            self.fig.passes += 1
            code = str(p.code)
            self.fig.exit_codes[code] = self.fig.exit_codes.get(code, 0) + 1
            if p.fate == "point":
                if p.code == -signal.SIGKILL:
                    self.fig.killed_crash_point += 1
                else:
                    self.fig.crash_point_not_reached += 1
            elif p.fate == "timed" and p.code == -signal.SIGKILL:
                self.fig.killed_timed += 1
        return done

    def _stall_lease_holders(self, stop: threading.Event) -> None:
        """Lease expiry mid-delete: stop the process holding the lease past its TTL, then let it go on."""
        stalled: set[int] = set()
        while not stop.wait(0.1):
            lease = self.store.lease()
            if (
                not lease
                or not isinstance(lease.get("pid"), int)
                or float(lease.get("expires", 0)) <= time.time()
            ):
                continue
            pid = lease["pid"]
            with self.lock:
                ours = pid in self.running
            if not ours or pid in stalled or self.stall_rng.random() > self.args.stall_chance:
                continue
            stalled.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self.fig.lease_stalls += 1
                time.sleep(self.args.lease_ttl + 1.5)
                os.kill(pid, signal.SIGCONT)

    # ---- rounds --------------------------------------------------------------------------------

    def fate(self, node: Node, rnd: int) -> Pass:
        if node.orphan_round == rnd:
            return Pass(node, "orphan")
        if node.orphan_round is not None:  # a node about to die has a whole pass behind it (its heartbeat)
            return Pass(node, "clean")
        r = self.rng.random()
        if r < self.args.kill_chance / 2:
            return Pass(node, "point", float(self.rng.randint(1, 14)))
        if r < self.args.kill_chance:
            return Pass(node, "timed", self.rng.uniform(0.5, 4.0))
        return Pass(node, "clean")

    def round(self, rnd: int) -> None:
        live = [n for n in self.nodes if not n.dead]
        for node in live:
            step = (rnd + 1) * 100
            size = BIG if node.orphan_round == rnd else self.rng.randint(20_000, 200_000)
            for k in range(EXTRA, 0, -1) if node.orphan_round == rnd else ():
                write_checkpoint(node, "exp", step - 10 * k, self.rng.randint(20_000, 80_000), self.rng)
                self.fig.checkpoints_written += 1
            write_checkpoint(node, "exp", step, size, self.rng)
            self.fig.checkpoints_written += 1
            if self.rng.random() < 0.7:
                write_checkpoint(
                    node, f"job-{int(node.name[5:]) % 5}", step, self.rng.randint(20_000, 80_000), self.rng
                )
                self.fig.checkpoints_written += 1
        planned = [self.fate(n, rnd) for n in live]
        if self.duplicate is not None and rnd >= 1:
            write_checkpoint(self.duplicate, "exp", (rnd + 1) * 100 + 1, 30_000, self.rng)
            planned.append(Pass(self.duplicate, "duplicate"))
        before = self.store.objects()
        passes = self.run_passes(planned)
        check_duplicate(self, passes, f"round {rnd}")
        killed = [
            p.node for p in passes if p.code == -signal.SIGKILL and not p.node.dead and p.fate != "duplicate"
        ]
        self.check_kept_somewhere([n for n in self.nodes if not n.dead], f"round {rnd} after kills")
        self.run_passes([Pass(n, "clean") for n in killed])  # restart
        after = self.store.objects()
        ran = {p.node.name for p in passes if p.fate != "duplicate"}  # the duplicate must not count
        self.check_owner_deletes(before, after, ran=ran, where=f"round {rnd}")
        self.check_cold(f"round {rnd}")

    def finish(self) -> None:
        """Wait until every orphan is gone (orphan_after), then two passes of every live node: the
        lease holder cleans the orphans' litter; the second pass finds none left."""
        if self.died_at:
            wait = max(self.died_at.values()) + self.args.orphan_after + 1 - time.time()
            if wait > 0:
                time.sleep(wait)
        live = [n for n in self.nodes if not n.dead]
        for i in range(2):
            before = self.store.objects()
            self.run_passes([Pass(n, "clean") for n in live])
            self.check_owner_deletes(
                before, self.store.objects(), ran={n.name for n in live}, where=f"final pass {i}"
            )
        self.check_cold("end")
        self.check_orphans()
        check_adoption(self, KEEP_COLD)

    # ---- checks --------------------------------------------------------------------------------

    def violation(self, text: str) -> None:
        self.fig.violations.append(text)

    def record_orphan_litter(self, node: Node) -> None:
        objects, uploads = self.store.objects(), self.store.uploads()
        prefix = f"{PREFIX}/{node.name}/"
        items = {k for k in objects if k.startswith(prefix) and STAGING_MARK in k}
        items |= {f"upload:{k}" for k in uploads.values() if k.startswith(prefix)}
        committed = {k for k in objects if k.startswith(prefix) and k.endswith(MANIFEST_SUFFIX)}
        with self.lock:
            self._committed[node.name] = committed
            self.orphan_litter[node.name] = items
            self.fig.orphan_litter += len(items)

    def _cold_copy_problem(
        self, node: Node, run: str, step: int, objects: dict[str, tuple[str, int]]
    ) -> str | None:
        base = f"{PREFIX}/{node.name}/{run}/checkpoint-{step}"
        if base + MANIFEST_SUFFIX not in objects:
            return "no manifest"
        try:
            m = Manifest.from_json(self.store.get(base + MANIFEST_SUFFIX))
        except Exception as exc:
            return f"manifest unreadable: {exc}"
        if (m.node, m.run, m.step) != (node.name, run, step):
            return f"manifest names node {m.node!r} run {m.run!r} step {m.step} (same-name runs merged)"
        want = node.written[run][step]
        got = {f.path: (f.size, f.hash) for f in m.files}
        if got != want:
            return (
                f"manifest files {sorted(got.items())} are not what {node.name} wrote {sorted(want.items())}"
            )
        for rel, (size, digest) in want.items():
            key = f"{base}/{rel}"
            if key not in objects:
                return f"{key} missing"
            if objects[key][1] != size:
                return f"{key} is {objects[key][1]} bytes, the manifest says {size}"
            if size < HASH_BELOW:
                self.fig.objects_hashed += 1
                if _digest(self.store.get(key)) != digest:
                    return f"{key} bytes differ from what {node.name} wrote"
        return None

    def check_kept_somewhere(self, nodes: list[Node], where: str) -> None:
        """Right after kills: each kept checkpoint is whole in hot or has a complete cold copy."""
        objects = self.store.objects()
        for node in nodes:
            for run, step in node.kept():
                ckpt = node.hot / run / f"checkpoint-{step}"
                if all(
                    (ckpt / rel).is_file() and _digest((ckpt / rel).read_bytes()) == d
                    for rel, (_s, d) in node.written[run][step].items()
                ):
                    continue
                problem = self._cold_copy_problem(node, run, step, objects)
                if problem:
                    self.violation(
                        f"{where}: {node.name} {run}/checkpoint-{step} kept by policy is lost: hot incomplete, cold {problem}"
                    )

    def check_cold(self, where: str) -> None:
        """After a clean pass: each kept checkpoint of every node has a complete cold copy under its
        own prefix; invariant 4 throughout."""
        objects = self.store.objects()
        for node in self.nodes:
            # an orphan: the newest KEEP_COLD of what it had committed when it died (the fleet's
            # adoption keeps those); what it never copied stays in its hot dir, which no one prunes
            for run, step in kept_at_death(self, node, KEEP_COLD) if node.dead else node.kept():
                self.fig.kept_checked += 1
                problem = self._cold_copy_problem(node, run, step, objects)
                if problem:
                    self.violation(
                        f"{where}: {node.name} {run}/checkpoint-{step} kept by policy: cold copy {problem}"
                    )
        names = {n.name for n in self.nodes}
        for key in objects:
            if key.startswith(FLEET):
                continue
            owner = key[len(PREFIX) + 1 :].split("/", 1)[0]
            if owner not in names:
                self.violation(f"{where}: {key} written outside any node's prefix")
            elif key.endswith(MANIFEST_SUFFIX):
                doc = json.loads(self.store.get(key))
                if doc.get("node") != owner:
                    self.violation(f"{where}: {key} under {owner}'s prefix names node {doc.get('node')!r}")

    def orphan_committed(self, node: Node) -> set[str]:
        return self._committed.get(node.name, set())

    def check_owner_deletes(
        self, before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]], ran: set[str], where: str
    ) -> None:
        self.fig.keys_diffed += len(before)
        for node in self.nodes:
            if node.dead and node.name not in self._committed:
                self._committed[node.name] = {
                    k for k in after if k.startswith(f"{PREFIX}/{node.name}/") and k.endswith(MANIFEST_SUFFIX)
                }
        committed_before = {k[: -len(MANIFEST_SUFFIX)] for k in before if k.endswith(MANIFEST_SUFFIX)}
        expired = set().union(*(adoption_split(self, n, KEEP_COLD)[1] for n in self.nodes if n.dead))
        for key, (etag, _size) in before.items():
            if key.startswith(FLEET):
                continue
            owner = key[len(PREFIX) + 1 :].split("/", 1)[0]
            head = key.split(".ckptkeeper")[0]  # a copy's base (manifest, pin) or one of its files
            if owner in ran or head in expired or head.rsplit("/", 1)[0] in expired:
                continue  # its own pass; or a dead node's copy the policy expires (check_adoption)
            gone = key not in after
            changed = not gone and after[key][0] != etag
            if not gone and not changed:
                continue
            litter = STAGING_MARK in key or (
                not key.endswith(MANIFEST_SUFFIX)
                and not any(key.startswith(c + "/") for c in committed_before)
            )
            if gone and litter:
                continue  # the lease holder's cleanup; counted in check_orphans
            self.violation(
                f"{where}: {key} of {owner} {'deleted' if gone else 'overwritten'} while {owner} ran no pass"
            )

    def cleanup_log(self) -> tuple[Counter[str], Counter[str]]:
        """From every pass's stderr (killed passes included): (items cleaned: marker keys and
        ``upload:<key>``, upload ids aborted)."""
        items: Counter[str] = Counter()
        ids: Counter[str] = Counter()
        for node in self.nodes:
            for err in (node.home / "logs").glob("*.err"):
                for line in err.read_text(errors="replace").splitlines():
                    try:
                        doc = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(doc, dict) or doc.get("event") not in CLEANUP_EVENTS:
                        continue
                    key = f"{PREFIX}/{doc.get('gone')}/{doc.get('path')}"
                    if "aborted" in doc["event"]:
                        key = f"upload:{key}"
                        ids[str(doc.get("upload_id"))] += 1
                    items[key] += 1
                    if doc.get("late"):
                        self.late[key] += 1
        return items, ids

    def check_orphans(self) -> None:
        seen, ids = self.cleanup_log()
        self.fig.cleanup_events = sum(seen.values())
        # anywhere in the fleet (also a live node's litter while it looked gone): never twice
        for item, n in sorted(seen.items()):
            if STAGING_MARK in item and n > 1:
                self.violation(
                    f"{item} discarded {n} times by the fleet cleanup (want at most once){self._why(item)}"
                )
        for upload_id, n in sorted(ids.items()):
            if n > 1:
                self.violation(
                    f"upload {upload_id} aborted {n} times by the fleet cleanup (want at most once)"
                )
        objects, uploads = self.store.objects(), self.store.uploads()
        for node in self.nodes:
            if not node.dead:
                continue
            prefix = f"{PREFIX}/{node.name}/"
            left = [k for k in objects if k.startswith(prefix) and STAGING_MARK in k]
            left += [f"upload:{k}" for k in uploads.values() if k.startswith(prefix)]
            if left:
                self.violation(f"orphan {node.name}: litter left after cleanup: {sorted(left)}")
            for item in sorted(self.orphan_litter.get(node.name, set())):
                n = seen[item]
                if item.startswith("upload:"):  # a marker's discard aborts the uploads under its target
                    target = item[len("upload:") :]
                    n += sum(
                        c
                        for k, c in seen.items()
                        if STAGING_MARK in k and target.startswith(k.split(STAGING_MARK)[0] + "/")
                    )
                if n != 1:
                    self.violation(
                        f"orphan {node.name}: {item} cleaned {n} times (want exactly once){self._why(item)}"
                    )

    def _why(self, item: str) -> str:
        late = self.late[item] or sum(
            c for k, c in self.late.items() if STAGING_MARK in k and item.startswith("upload:")
        )
        return f" ({late} by a holder whose lease expired during the delete)" if late else ""


def _moto() -> tuple[Any, str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ[name] = value
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def run_stress(base: Path, endpoint: str, bucket: str, args: argparse.Namespace) -> Figures:
    """The whole stress run against ``endpoint`` (bucket created here); returns the figures."""
    started = time.time()
    fleet = Fleet(base, endpoint, bucket, args)
    fleet.store.client.create_bucket(Bucket=bucket)
    for rnd in range(args.rounds):
        fleet.round(rnd)
        if args.verbose:
            print(
                f"round {rnd}: {len(fleet.fig.violations)} violations, {time.time() - started:.0f} s",
                file=sys.stderr,
            )
    fleet.finish()
    fleet.fig.seconds = round(time.time() - started, 1)
    return fleet.fig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--parallel", type=int, default=16, help="node processes running at once")
    p.add_argument(
        "--kill-chance", type=float, default=0.3, help="share of passes killed (half at a crash point)"
    )
    p.add_argument(
        "--stall-chance", type=float, default=0.5, help="chance to stop a lease holder past its TTL"
    )
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument("--heartbeat-ttl", type=float, default=5.0)
    p.add_argument("--orphan-after", type=float, default=20.0)
    p.add_argument("--pass-timeout", type=float, default=300.0)
    p.add_argument(
        "--skew", type=float, default=86400.0, help="a third of the nodes' clocks are off by up to this (s)"
    )
    p.add_argument(
        "--no-duplicate",
        dest="duplicate",
        action="store_false",
        help="no second keeper with a live node's name",
    )
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptkeeper-fleet-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    server, endpoint = _moto()
    try:
        with _workdir(args.dir) as base:
            fig = run_stress(base, endpoint, "fleet-stress", args)
    finally:
        server.stop()
    doc = fig.__dict__
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        for k, v in doc.items():
            if k != "violations":
                print(f"{k:24} {v}")
        print(f"{'violations':24} {len(fig.violations)}")
        for v in fig.violations:
            print(f"  {v}")
    return 1 if fig.violations else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
