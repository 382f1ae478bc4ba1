#!/usr/bin/env bash
# Install everything the test suite needs on a Debian 12 machine and run the whole suite.
#
#   deploy/test.sh [PYTEST ARGS...]     (as root)
#
# Without arguments it runs the whole suite, tests/cluster and the rest side by side (below);
# with arguments, one pytest with them (e.g. `deploy/test.sh tests/cluster/test_hpc.py -x`).
#
# Slurm releases: the local cluster runs LOCAL_CLUSTER_SLURM (22.05, 24.11 or 26.05; as last
# time, else 22.05), e.g. `LOCAL_CLUSTER_SLURM=26.05 deploy/test.sh`. With TEST_ALSO_ON_SLURM
# (e.g. "24.11 26.05"), the whole suite is followed, on each of those releases in turn, by the
# release subset of the cluster tests (`pytest -m releases tests/cluster`: tests/cluster/
# conftest.py names it); the cluster is left on the first release at the end. CI sets it.
#
# It installs the system packages (PostgreSQL for the store tests; curl; nginx, logrotate and
# systemd-analyze for the deploy/ files), brings up the local Slurm cluster with two compute
# nodes, Apptainer and an image registry (deploy/local-cluster.sh up --nodes 2), creates a
# virtual environment in .venv with the package and its test dependencies, checks the code with
# ruff (lint, format, complexity) and mypy --strict, and runs pytest. Nothing is skipped: tests
# that need the cluster or PostgreSQL fail when those are missing.
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

[[ $(id -u) -eq 0 ]] || { echo "deploy/test.sh: run as root (it installs packages and starts Slurm)" >&2; exit 1; }

step() { printf '\n== %s\n' "$*"; }

step "system packages"
export DEBIAN_FRONTEND=noninteractive
apt_get=(apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -y -q)
# nginx-light, logrotate, systemd (for systemd-analyze; PID 1 may be anything) and prometheus
# (for promtool; its daemon is kept from starting like the others): the deploy/ files are
# tested with the real tools.
packages=(postgresql curl python3-venv sudo nginx-light logrotate systemd prometheus)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  "${apt_get[@]}" update
  # policy-rc.d keeps the packages from starting a system-wide PostgreSQL, nginx or
  # Prometheus: the tests start their own private servers on free ports.
  own_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  "${apt_get[@]}" install --no-install-recommends "${packages[@]}"  # sudo: site mode
  ((own_policy)) && rm -f /usr/sbin/policy-rc.d
fi
dpkg -s chromium chromium-driver >/dev/null 2>&1 || { "${apt_get[@]}" update && "${apt_get[@]}" install --no-install-recommends chromium chromium-driver; }  # the web page's browser test

step "local Slurm cluster, Apptainer and registry"
# Two compute nodes, each in its own mount namespace: tasks run as on separate hosts.
deploy/local-cluster.sh up --nodes 2
# The release it runs now (LOCAL_CLUSTER_SLURM, or the one it ran before).
first_release=$(<"${LOCAL_CLUSTER_DIR:-/var/lib/tes-bridge/local-cluster}/slurm.release")
export LOCAL_CLUSTER_SLURM=$first_release

step "Python environment (.venv)"
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'

step "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "import rules"
# The wings of ARCHITECTURE.md and their walls ([tool.importlinter] in pyproject.toml).
.venv/bin/lint-imports

step "mypy"
# Strict, over bridge/ and the tests' fakes, which it checks against the protocols they stand
# in for (the files, settings and stub packages: [tool.mypy] in pyproject.toml, setup.py).
.venv/bin/mypy

step "pytest"
if (($#)); then
  exec .venv/bin/python -m pytest "$@"
fi
# The whole suite as two runs side by side: the cluster tests in order (they share one Slurm
# cluster, and some restart its daemons or take a node away), and beside them everything that
# needs no cluster, whose report follows the cluster tests' report.
others_log=$(mktemp)
# The slowest tests of each run are listed at its end: where the suite's time goes.
.venv/bin/python -m pytest --durations=15 tests/unit tests/api >"$others_log" 2>&1 &
others=$!
cluster_status=0
.venv/bin/python -m pytest --durations=30 tests/cluster || cluster_status=$?
others_status=0
wait "$others" || others_status=$?
step "pytest tests/unit tests/api (ran beside tests/cluster)"
cat "$others_log"
rm -f "$others_log"
printf '\npytest: tests/cluster exit %d, tests/unit tests/api exit %d\n' "$cluster_status" "$others_status"
summary="Slurm $first_release: tests/cluster exit $cluster_status, tests/unit tests/api exit $others_status"
failed=$((cluster_status != 0 || others_status != 0))
for release in ${TEST_ALSO_ON_SLURM:-}; do
  [[ $release == "$first_release" ]] && continue
  step "Slurm $release: the release subset of tests/cluster"
  started=$SECONDS
  release_status=0
  LOCAL_CLUSTER_SLURM=$release deploy/local-cluster.sh up --nodes 2 || release_status=$?
  if ((release_status == 0)); then
    LOCAL_CLUSTER_SLURM=$release .venv/bin/python -m pytest --durations=10 -m releases \
      tests/cluster || release_status=$?
  fi
  summary+=$'\n'"Slurm $release: release subset exit $release_status ($((SECONDS - started)) s)"
  ((release_status == 0)) || failed=1
done
if [[ -n ${TEST_ALSO_ON_SLURM:-} ]]; then
  deploy/local-cluster.sh up --quiet --nodes 2 || true  # back to $first_release (exported)
  printf '\n%s\n' "$summary"
fi
((failed == 0))
