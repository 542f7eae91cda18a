#!/usr/bin/env bash
# The manual and the monitoring rules, on a fresh Debian machine (idempotent):
#   - the reference pages generated from the code (docs/gen_reference.py; not committed),
#   - `mkdocs build --strict`: a broken link or anchor, or a page left out of the nav, fails,
#   - `promtool check rules` and `promtool test rules` on deploy/prometheus/.
# Run from anywhere: bash .ci/docs.sh. The site is built into site/ (gitignored).
set -euo pipefail
cd "$(dirname "$0")/.."

# Its own venv with the package and the `docs` extra (mkdocs, mkdocs-material from PyPI): the
# generator imports ckptkeeper's config and click commands.
python3 -m venv .venv-docs
.venv-docs/bin/pip install --quiet -e '.[docs]'

.venv-docs/bin/python docs/gen_reference.py
NO_MKDOCS_2_WARNING=1 .venv-docs/bin/mkdocs build --strict --site-dir site

# promtool ships in Debian's prometheus package.
if ! command -v promtool >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool check rules deploy/prometheus/alerts.yml
(cd deploy/prometheus && promtool test rules alerts.test.yml)
