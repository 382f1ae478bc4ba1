#!/usr/bin/env bash
# Install tes-slurm-bridge on a Debian 12 machine, with a local Slurm cluster, Apptainer and an
# image registry, and start the service on 127.0.0.1:8000 with the embedded defaults (SQLite).
#
#   deploy/quickstart.sh [start|stop|status]     (as root; `start` is the default)
#
# Settings (environment):
#   TES_BRIDGE_PREFIX     where the virtual environment goes   (/opt/tes-bridge)
#   TES_BRIDGE_STATE_DIR  database, task directories, logs    (/var/lib/tes-bridge)
#   TES_BRIDGE_BIND       address:port of the API             (127.0.0.1:8000)
#   TES_BRIDGE_USER       the unprivileged account the service, and so every job and
#                         executor, runs as (tesbridge; created when missing)
# Running it again upgrades the installation from this checkout and restarts the service.
set -Eeuo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${TES_BRIDGE_PREFIX:-/opt/tes-bridge}
STATE_DIR=${TES_BRIDGE_STATE_DIR:-/var/lib/tes-bridge}
BIND=${TES_BRIDGE_BIND:-127.0.0.1:8000}
ACCOUNT=${TES_BRIDGE_USER:-tesbridge}
CONFIG=$STATE_DIR/tes-bridge.toml
PIDFILE=$STATE_DIR/serve.pid
LOG=$STATE_DIR/serve.log
URL=http://$BIND

say() { printf '== %s\n' "$*"; }
die() { printf 'quickstart: %s\n' "$*" >&2; exit 1; }

running_pid() {
  local pid
  [[ -f $PIDFILE ]] || return 1
  pid=$(<"$PIDFILE")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && grep -q tes-bridge "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

stop() {
  local pid
  if pid=$(running_pid); then
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    say "stopped tes-bridge (pid $pid)"
  fi
  rm -f "$PIDFILE"
}

write_config() {
  [[ -f $CONFIG ]] && return 0
  cat > "$CONFIG" <<TOML
# tes-slurm-bridge configuration written by deploy/quickstart.sh; every key is described in
# deploy/tes-bridge.example.toml. Edit and run deploy/quickstart.sh again to restart.
state_dir = "$STATE_DIR"
# In a directory of the service account's own: $STATE_DIR stays root's.
database = "sqlite:///$STATE_DIR/db/tes-bridge.db"

[server]
bind = "$BIND"

[container]
runtime = "apptainer"
# The local test cluster's registry serves the images for unqualified names such as "alpine".
default_registry = "127.0.0.1:5000"
insecure_registries = ["127.0.0.1:5000"]
# Apptainer cannot use its setuid path on these machines; user namespaces work.
extra_flags = ["--userns"]

[storage]
allowed_dirs = ["$STATE_DIR/data"]
# Bound read-write at its own path into every executor: workflow engines keep their working
# directories and job stores here (see docs/staging.md).
shared_dirs = ["$STATE_DIR/data"]
TOML
}

# A config written before shared directories existed gets the data directory shared, once.
share_data_dir() {
  grep -q '^shared_dirs' "$CONFIG" && return 0
  grep -q '^\[storage\]' "$CONFIG" || printf '\n[storage]\n' >> "$CONFIG"
  sed -i "s|^\[storage\]\$|&\nshared_dirs = [\"$STATE_DIR/data\"]|" "$CONFIG"
}

# The local cluster's preemptible partition (deploy/local-cluster.sh): a task that says
# resources.preemptible runs there, and Slurm may preempt it for the jobs of other partitions.
use_preemptible_partition() {
  grep -q '^preemptible_partition' "$CONFIG" && return 0
  grep -q '^\[slurm\]' "$CONFIG" || printf '\n[slurm]\n' >> "$CONFIG"
  sed -i "s|^\[slurm\]\$|&\npreemptible_partition = \"scavenger\"|" "$CONFIG"
}

# The service account: never root, so jobs and their executors never run as root.
make_account() {
  [[ $ACCOUNT != root ]] || die "TES_BRIDGE_USER must not be root"
  if ! id -u "$ACCOUNT" >/dev/null 2>&1; then
    say "service account $ACCOUNT"
    useradd --system --create-home --shell /usr/sbin/nologin "$ACCOUNT"
  fi
  [[ $(id -u "$ACCOUNT") -ne 0 ]] || die "$ACCOUNT has uid 0"
  # Slurm takes jobs only from users with an association.
  "$REPO/deploy/local-cluster.sh" add-user "$ACCOUNT"
}

# The state directory holds the local cluster's state too, which root's scripts use: it stays
# root's, and the account gets only its own subdirectories (and the poller's lock file).
own_state() {
  local group
  group=$(id -gn "$ACCOUNT")
  mkdir -p "$STATE_DIR/data" "$STATE_DIR/work" "$STATE_DIR/images" "$STATE_DIR/db" "$STATE_DIR/metrics"
  chown root:root "$STATE_DIR"
  chmod 0755 "$STATE_DIR"
  # An installation from before the account: its database moves into db/.
  if ! grep -q '^database' "$CONFIG"; then
    sed -i "s|^state_dir = .*|&\ndatabase = \"sqlite:///$STATE_DIR/db/tes-bridge.db\"|" "$CONFIG"
    local old
    for old in "$STATE_DIR"/tes-bridge.db*; do
      [[ -e $old && ! -e $STATE_DIR/db/${old##*/} ]] && mv "$old" "$STATE_DIR/db/"
    done
  fi
  touch "$STATE_DIR/poller.lock"
  chown -R "$ACCOUNT:$group" "$STATE_DIR/data" "$STATE_DIR/work" "$STATE_DIR/images" "$STATE_DIR/db"
  # The API's workers and the poller write their Prometheus metrics files here (private).
  chown "$ACCOUNT:$group" "$STATE_DIR/metrics"
  chmod 0700 "$STATE_DIR/metrics"
  chown "$ACCOUNT:$group" "$STATE_DIR/poller.lock"
  chown "root:$group" "$CONFIG"
  chmod 0640 "$CONFIG"
  # The service and its jobs run the virtual environment as the account.
  chmod -R go+rX "$PREFIX"
}

start() {
  [[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts Slurm)"
  export DEBIAN_FRONTEND=noninteractive
  if ! dpkg -s python3-venv curl >/dev/null 2>&1; then
    say "system packages"
    apt-get -o DPkg::Lock::Timeout=600 -y -q update
    apt-get -o DPkg::Lock::Timeout=600 -y -q install --no-install-recommends python3-venv curl
  fi
  say "local Slurm cluster, Apptainer and registry"
  "$REPO/deploy/local-cluster.sh" up
  say "tes-bridge into $PREFIX"
  # Debian's own Python (the one python3-venv is for): the service account must be able to run
  # it, which a Python under /root (pyenv) is not.
  [[ -x $PREFIX/bin/python ]] || /usr/bin/python3 -m venv "$PREFIX"
  "$PREFIX/bin/python" -m pip install -q --upgrade pip
  "$PREFIX/bin/python" -m pip install -q "$REPO[postgresql]"
  make_account
  mkdir -p "$STATE_DIR"
  write_config
  share_data_dir
  use_preemptible_partition
  stop
  touch "$LOG"
  own_state
  say "starting tes-bridge as $ACCOUNT on $URL (log: $LOG)"
  # setpriv execs (no process stays in between): the pid file names the service itself.
  (cd / && exec setsid setpriv --reuid="$ACCOUNT" --regid="$(id -g "$ACCOUNT")" --init-groups \
      --reset-env env TES_BRIDGE_CONFIG="$CONFIG" "$PREFIX/bin/tes-bridge" serve) \
    >>"$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 150); do
    curl -fsS "$URL/ga4gh/tes/v1/service-info" >/dev/null 2>&1 && break
    running_pid >/dev/null || { tail -n 30 "$LOG" >&2; die "tes-bridge exited; see $LOG"; }
    sleep 0.2
  done
  curl -fsS "$URL/ga4gh/tes/v1/service-info" >/dev/null || die "tes-bridge does not answer on $URL; see $LOG"
  cat <<MSG

tes-bridge is running as $ACCOUNT on $URL (pid $(<"$PIDFILE"); config $CONFIG; log $LOG).
Submit a first task and read its output:

  id=\$(curl -s -X POST $URL/ga4gh/tes/v1/tasks -H 'Content-Type: application/json' \\
        -d '{"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
  sleep 5; curl -s "$URL/ga4gh/tes/v1/tasks/\$id?view=FULL"

Stop it with: deploy/quickstart.sh stop
MSG
}

case ${1:-start} in
  start) start ;;
  stop) stop ;;
  status)
    if pid=$(running_pid); then echo "tes-bridge runs (pid $pid) on $URL; log $LOG"; else echo "tes-bridge is not running"; exit 3; fi ;;
  *) die "usage: deploy/quickstart.sh [start|stop|status]" ;;
esac
