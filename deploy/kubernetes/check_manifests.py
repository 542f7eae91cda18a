"""Cross-checks of rendered ckptkeeper manifests that a schema validator cannot make.

``kubernetes-validate`` checks each object against the Kubernetes API schema; this checks that the
objects fit together and fit the daemon: the ConfigMap is a config ckptkeeper accepts (loaded by
ckptkeeper's own loader, from the environment alone, as in the pod), the probes ask the daemon's
real endpoints on the port it binds, the node and machine names come from the downward API, every tier of the
config that is a local path is mounted at that path, and a PodMonitor / ServiceMonitor (custom
resources: no schema in kubernetes-validate) selects the pods and names their port.

Usage: ``python check_manifests.py FILE...`` (each a multi-document YAML stream); exit 1 on any
problem, one line each. Needs PyYAML and ckptkeeper importable.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

PROBES = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}


def _objects(path: Path) -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all(path.read_text()):
        if isinstance(doc, dict):
            yield doc


def _config_problems(data: dict[str, str]) -> list[str]:
    """Load the ConfigMap's variables with ckptkeeper's loader, in a clean environment."""
    from ckptkeeper.config import ConfigError, load_settings

    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith("CKPTKEEPER_")]:
            del os.environ[key]
        os.environ.update(data)
        os.environ["CKPTKEEPER_NODE"] = "node-a"  # the downward API's spec.nodeName
        settings = load_settings(None)
    except ConfigError as exc:
        return [f"ConfigMap: ckptkeeper refuses it: {p}" for p in exc.problems]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    problems = []
    if settings.daemon.log_stream != "stdout":
        problems.append("ConfigMap: daemon.log_stream is not stdout (the container's log)")
    return problems


def check(objects: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj.get("kind", ""), []).append(obj)
    daemonsets = by_kind.get("DaemonSet", [])
    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    if len(daemonsets) != 1:
        return [f"expected one DaemonSet, found {len(daemonsets)}"]
    ds = daemonsets[0]
    pod = ds["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    if any(pod_labels.get(k) != v for k, v in ds["spec"]["selector"]["matchLabels"].items()):
        problems.append("DaemonSet: selector does not match the pod labels")
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "ckptkeeper"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    env = {e["name"]: e for e in container.get("env", [])}
    for name in ("CKPTKEEPER_NODE", "CKPTKEEPER_HOST"):
        if env.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
            problems.append(f"DaemonSet: {name} does not come from spec.nodeName")
    for probe, path in PROBES.items():
        get = container.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ports:
            problems.append(f"DaemonSet: {probe} is not GET {path} on a named container port")
    refs = [e["configMapRef"]["name"] for e in container.get("envFrom", []) if "configMapRef" in e]
    if len(refs) != 1 or refs[0] not in configmaps:
        return [*problems, "DaemonSet: envFrom does not name the rendered ConfigMap"]
    data = configmaps[refs[0]]["data"]
    problems += _config_problems(data)
    daemon = json.loads(data["CKPTKEEPER_DAEMON"])
    port = int(daemon["metrics_addr"].rpartition(":")[2])
    if ports.get("metrics") != port:
        problems.append(f"DaemonSet: port 'metrics' is not the daemon's metrics_addr port {port}")
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    for tier in json.loads(data["CKPTKEEPER_TIERS"]):
        if "://" not in tier["url"] and tier["url"] not in mounts:
            problems.append(f"DaemonSet: local tier {tier['name']!r} ({tier['url']}) is not mounted there")
    if "/var/lib/ckptkeeper" not in mounts or not data["CKPTKEEPER_INDEX"].startswith("/var/lib/ckptkeeper/"):
        problems.append("DaemonSet: the index directory is not mounted")
    problems += _monitor_problems(by_kind, pod_labels, ports)
    return problems


def _monitor_problems(
    by_kind: dict[str, list[dict[str, Any]]], pod_labels: dict[str, str], ports: dict[str, int]
) -> list[str]:
    problems = []
    for mon in by_kind.get("PodMonitor", []):
        if mon.get("apiVersion") != "monitoring.coreos.com/v1":
            problems.append("PodMonitor: apiVersion is not monitoring.coreos.com/v1")
        wanted = mon["spec"]["selector"]["matchLabels"]
        if any(pod_labels.get(k) != v for k, v in wanted.items()):
            problems.append("PodMonitor: selector does not match the pods")
        for ep in mon["spec"]["podMetricsEndpoints"]:
            if ep.get("port") not in ports or ep.get("path") != "/metrics":
                problems.append("PodMonitor: endpoint is not /metrics on a named container port")
    services = by_kind.get("Service", [])
    for mon in by_kind.get("ServiceMonitor", []):
        if mon.get("apiVersion") != "monitoring.coreos.com/v1":
            problems.append("ServiceMonitor: apiVersion is not monitoring.coreos.com/v1")
        wanted = mon["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if all(s["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
        if len(chosen) != 1:
            problems.append(f"ServiceMonitor: selects {len(chosen)} Services, not one")
            continue
        svc = chosen[0]
        if any(pod_labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
            problems.append("Service: selector does not match the pods")
        names = {p["name"]: p.get("targetPort") for p in svc["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            if ep.get("port") not in names or names[ep["port"]] not in ports:
                problems.append(
                    "ServiceMonitor: endpoint port is not a Service port aimed at a container port"
                )
    return problems


def main(argv: list[str]) -> int:
    failed = 0
    for name in argv:
        problems = check(list(_objects(Path(name))))
        for problem in problems:
            print(f"{name}: {problem}")
        failed += bool(problems)
        if not problems:
            print(f"{name}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
