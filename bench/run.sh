#!/bin/sh
# Run the benchmarks: bench/run.sh [NAME...] (create listing poll memory staging e2e validation
# slowloris engines containers arrays nemesis failover).
# Needs the local cluster (deploy/local-cluster.sh up) for poll, e2e, arrays, failover and nemesis
# (alone on it: it kills its daemons), and PostgreSQL's binaries (apt-get install postgresql) for
# create, listing and failover. Results: bench/results/*.json.
set -eu
cd "$(dirname "$0")/.."
if ! command -v wrk >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 install -y wrk >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -e '.[test,bench]'
export SLURM_CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
echo "queue: $(squeue -h 2>/dev/null | wc -l) jobs; load: $(cut -d' ' -f1-3 /proc/loadavg)"
exec .venv/bin/python -u -m bench "$@"
