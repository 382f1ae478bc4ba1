#!/usr/bin/env bash
# A real Slurm cluster (munge, slurmctld, slurmd, slurmdbd + MariaDB), Apptainer and a local OCI
# registry with test images, on one machine, for development and CI of tes-slurm-bridge.
#
#   deploy/local-cluster.sh up [--quiet] [--nodes N]  install what is missing, start what is not
#                                            running; N compute nodes (default: as last time, else 1)
#   deploy/local-cluster.sh status           what runs (pids), every node, where the logs are
#   deploy/local-cluster.sh down [DAEMON..]  stop what `up` started (all, or the named daemons,
#                                            e.g. slurmd or slurmd-node2)
#   deploy/local-cluster.sh add-user NAME..  give users made after `up` an association (Slurm
#                                            refuses jobs of users without one, as at a site)
#
# Slurm release (LOCAL_CLUSTER_SLURM): 22.05 is Debian 12's own packages. 24.11 (Debian 13) and
# 26.05 (Debian unstable; its release then, if unstable has moved on) are unpacked from Debian's
# binary packages into STATE/cache/slurm/<release> (mmdebstrap --variant=extract through a private
# apt list: the machine's apt sources are not touched), their programs pointed at the glibc and
# libraries unpacked with them (patchelf), so the daemons and commands of that release run on this
# Debian 12 while jobs run on the nodes as before. The first `up` of a release downloads about
# 90 MB and takes 15-30 s; later ones reuse the cache. Each release keeps its own controller
# state, slurmd spool and accounting database (a release never reads another's), and its client
# commands are linked into /usr/local/bin (removed again on a switch back to 22.05). On 24.11 and
# later, slurmctld limits each user's RPC rate (SlurmctldParameters=rl_enable, its defaults), as a
# careful site's does; root and SlurmUser are exempt.
#
# With one node, this machine is the login node and the compute node (node name: the host name).
# With N >= 2, nodes node1..nodeN are each their own slurmd (Slurm's multiple-slurmd mode, one
# port per node) in its own mount namespace, seeing what a site's compute node sees: its own /tmp
# and /var/tmp (STATE/nodes/<node>/), node-local scratch, /usr, /opt and this checkout read-only,
# and the shared filesystem STATE/shared read-write. The login node's /tmp and /var/tmp (where
# the tests keep the bridge's database and config) are not visible there. Slurm jobs inherit the
# namespace of their node's slurmd.
#
# With N >= 2 there is one more node, node<N+1> (node3 with --nodes 2), network-less as a site's
# compute nodes that reach only the shared filesystem: its slurmd (and so every job on it) also
# runs in a network namespace of its own (tesb-<node>), linked to this machine by a veth pair
# (<net>.1 here, <net>.2 on the node) over which it reaches slurmctld's port and nothing else
# (nftables on this side rejects the rest: the registry, servers on this machine's loopback, any
# other host). Inside, its 127.0.0.1:<slurmctld port> is translated to <net>.1, so every node
# reads the same slurm.conf. Partition 'offline' is that node alone; 'xfer' (transfer: node1)
# holds nodes that reach the network; 'main' and 'scavenger' keep node1..nodeN.
#
# Run as root on Debian 12. Daemons are started directly (no systemd) and tracked by the pid files
# in one state directory, so `down` stops exactly what `up` started. Settings (environment):
#   LOCAL_CLUSTER_SLURM      Slurm release: 22.05, 24.11 or 26.05 (as last time, else 22.05)
#   LOCAL_CLUSTER_DIR        state, logs, pid files, caches   (/var/lib/tes-bridge/local-cluster)
#   LOCAL_CLUSTER_SLURM_ETC  where slurm.conf/slurmdbd.conf go (/etc/slurm; other paths need
#                            SLURM_CONF=<dir>/slurm.conf for the Slurm commands)
#   LOCAL_CLUSTER_REGISTRY   registry address                  (127.0.0.1:5000)
#   LOCAL_CLUSTER_MYSQL_PORT MariaDB port on 127.0.0.1          (13306)
#   LOCAL_CLUSTER_OVERSUBSCRIBE  jobs that may share one core   (4)
#   LOCAL_CLUSTER_APPTAINER_LIBDIR  private glibc for Apptainer (/opt/tes-bridge/apptainer-libc)
#   LOCAL_CLUSTER_DEBIAN_MIRROR  Debian mirror (default: the one in the machine's apt sources)
#   LOCAL_CLUSTER_SLURMCTLD_PORT, LOCAL_CLUSTER_SLURMDBD_PORT  (6817, 6819)
#   LOCAL_CLUSTER_SLURMD_PORT  slurmd's port with one node; node I of several listens on this
#                              + 20 + I                       (6818)
#   LOCAL_CLUSTER_NODE_READONLY  read-only on compute nodes (/usr /opt and this checkout)
#   LOCAL_CLUSTER_CGROUP     how Slurm confines jobs: auto (cgroup v1 where the host mounts its
#                            memory controller, else none), v1, v2 (needs the memory controller
#                            delegated to slurmd) or none (memory enforced by the accounting
#                            sampler; no OUT_OF_MEMORY state)                            (auto)
#   LOCAL_CLUSTER_GPUS       fake GPUs per node, type "fake" (device nodes under the state
#                            directory, so Slurm schedules them and sets CUDA_VISIBLE_DEVICES)  (2)
#   LOCAL_CLUSTER_OFFLINE    1: with N >= 2 nodes, the network-less node<N+1>; 0: none
#                            (as last time, else 1)
#   LOCAL_CLUSTER_OFFLINE_NET  the network-less node's link, a /30: <net>.1 on this machine,
#                            <net>.2 on the node                                   (10.250.17)
set -Eeuo pipefail

STATE_DIR=${LOCAL_CLUSTER_DIR:-/var/lib/tes-bridge/local-cluster}
SLURM_ETC=${LOCAL_CLUSTER_SLURM_ETC:-/etc/slurm}
REGISTRY=${LOCAL_CLUSTER_REGISTRY:-127.0.0.1:5000}
MYSQL_PORT=${LOCAL_CLUSTER_MYSQL_PORT:-13306}
OVERSUBSCRIBE=${LOCAL_CLUSTER_OVERSUBSCRIBE:-4}
APPTAINER_LIBDIR=${LOCAL_CLUSTER_APPTAINER_LIBDIR:-/opt/tes-bridge/apptainer-libc}
APPTAINER_SUITE=${LOCAL_CLUSTER_APPTAINER_SUITE:-sid}
SLURMCTLD_PORT=${LOCAL_CLUSTER_SLURMCTLD_PORT:-6817}
SLURMDBD_PORT=${LOCAL_CLUSTER_SLURMDBD_PORT:-6819}
SLURMD_PORT=${LOCAL_CLUSTER_SLURMD_PORT:-6818}
CLUSTER_NAME=local
PARTITION=main
# A low-tier partition over the same nodes whose jobs a job of PARTITION preempts (resources.
# preemptible tasks go there with slurm.preemptible_partition).
PREEMPTIBLE_PARTITION=scavenger
SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SCRIPT")/.." && pwd)
IMAGES_SRC=$REPO/deploy/images
NODE_READONLY=${LOCAL_CLUSTER_NODE_READONLY:-/usr /opt $REPO}
CGROUP_WANTED=${LOCAL_CLUSTER_CGROUP:-auto}
FAKE_GPUS=${LOCAL_CLUSTER_GPUS:-2}
OFFLINE_WANTED=${LOCAL_CLUSTER_OFFLINE:-}
OFFLINE_NET=${LOCAL_CLUSTER_OFFLINE_NET:-10.250.17}
OFFLINE_HOST_ADDR=$OFFLINE_NET.1
OFFLINE_NODE_ADDR=$OFFLINE_NET.2
# Partitions of the network-less node, and of nodes that reach the network (where a site runs
# stage-in and stage-out as jobs of their own).
OFFLINE_PARTITION=offline
TRANSFER_PARTITION=xfer
# The network-less node's namespace and host-side veth are <prefix><node>; its nftables table
# here is tesb_<node>. Whatever carries the prefix is this script's (down removes it all).
NETNS_PREFIX=tesb-
# The Slurm releases this script can run, and the Debian suite whose binary packages have each
# (22.05: this machine's own Debian 12).
declare -A SLURM_SUITE=([22.05]=bookworm [24.11]=trixie [26.05]=sid)
# Bump when the way a release's programs are unpacked or patched changes, so caches are rebuilt.
SLURM_TREE_RECIPE=1
# Client commands of an unpacked release linked into this directory (before /usr/bin on PATH).
SLURM_LINK_DIR=/usr/local/bin
SLURM_CLIENT_COMMANDS=(sacct sacctmgr salloc sattach sbatch sbcast scancel scontrol scrontab sdiag
  sinfo sprio squeue sreport srun sshare sstat strigger)
# Bump when the way images are built changes, so cached images are rebuilt.
IMAGE_RECIPE_VERSION=1

# Every file this script writes outside its state directory starts with this line; a file
# without it belongs to someone else and is never overwritten.
MARKER="# Written by tes-slurm-bridge deploy/local-cluster.sh (local test cluster); it may rewrite this file."

RUN=$STATE_DIR/run
LOGS=$STATE_DIR/log
CACHE=$STATE_DIR/cache
SLURM_CONF_FILE=$SLURM_ETC/slurm.conf
SLURMDBD_CONF_FILE=$SLURM_ETC/slurmdbd.conf
CGROUP_CONF_FILE=$SLURM_ETC/cgroup.conf
GRES_CONF_FILE=$SLURM_ETC/gres.conf
# Character devices standing in for GPUs (no GPU on this machine): STATE/gpus/<node>/fake<i>.
GPU_DEV_DIR=$STATE_DIR/gpus
MUNGE_SOCKET=$RUN/munge/munge.socket
MYSQL_SOCKET=$RUN/mysqld/mysqld.sock
# The compute nodes' shared filesystem: work directories, image caches and data that jobs read
# and write go here; with several nodes, everything else of the login node's stays private.
SHARED=$STATE_DIR/shared
NODES_DIR=$STATE_DIR/nodes
NODE_COUNT_FILE=$STATE_DIR/nodes.count
NODE_OFFLINE_FILE=$STATE_DIR/nodes.offline
SLURM_RELEASE_FILE=$STATE_DIR/slurm.release
# The daemons live in sbin, which a non-login root shell (CI, cron) may lack on its PATH.
export PATH=$PATH:/usr/local/sbin:/usr/sbin:/sbin
export SLURM_CONF=$SLURM_CONF_FILE
export APPTAINER_CACHEDIR=$CACHE/apptainer
APT_GET=(apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -y -q)

PACKAGES=(munge slurm-wlm slurmdbd slurm-client mariadb-server docker-registry skopeo umoci
  mmdebstrap patchelf squashfs-tools squashfuse fuse2fs uidmap curl ca-certificates iproute2 nftables)

# Slurm enforces associations, limits and QOS here, as at a site: a user needs an association
# (account ACCOUNT) to submit; QOS LIMITED_QOS (at most 2 jobs in the queue per user) lets tests
# meet sbatch's refusals for a limit.
ACCOUNT=tes
LIMITED_QOS=tes-limited
LIMITED_QOS_MAX_SUBMIT=2

# Stop order; `up` starts them in reverse. With several nodes, slurmd is slurmd-<node> each.
DAEMONS=(slurmd slurmctld slurmdbd mysqld munged registry)
declare -A PIDFILE=(
  [munged]=$RUN/munge/munged.pid [mysqld]=$RUN/mysqld/mysqld.pid [slurmdbd]=$RUN/slurmdbd.pid
  [slurmctld]=$RUN/slurmctld.pid [slurmd]=$RUN/slurmd.pid [registry]=$RUN/registry.pid)
# Executable behind each pid, checked so that a recycled pid is never taken for a daemon.
declare -A EXE=([munged]=munged [mysqld]=mariadbd [slurmdbd]=slurmdbd [slurmctld]=slurmctld
  [slurmd]=slurmd [registry]=docker-registry)
declare -A LOGFILE=(
  [munged]=$LOGS/munged.log [mysqld]=$LOGS/mysqld.log [slurmdbd]=$LOGS/slurmdbd.log
  [slurmctld]=$LOGS/slurmctld.log [slurmd]=$LOGS/slurmd.log [registry]=$LOGS/registry.log)

QUIET=0
WANT_NODES=""
T0=$SECONDS
NODE_COUNT=1
# Every compute node (the network-less one last), and those of the partition PARTITION.
NODES=()
MAIN_NODES=()
OFFLINE_NODE=""

# Several compute nodes: one slurmd daemon entry per node, in place of the single slurmd.
use_nodes() {
  NODE_COUNT=$1
  NODES=() MAIN_NODES=()
  OFFLINE_NODE=""
  if ((NODE_COUNT < 2)); then
    NODES=("$(hostname -s)")
    MAIN_NODES=("${NODES[@]}")
    return 0
  fi
  [[ $OFFLINE_WANTED == [01] ]] || die "LOCAL_CLUSTER_OFFLINE must be 0 or 1 (not '$OFFLINE_WANTED')"
  ((OFFLINE_WANTED)) && OFFLINE_NODE=node$((NODE_COUNT + 1))
  local i name
  DAEMONS=()
  for ((i = 1; i <= NODE_COUNT + OFFLINE_WANTED; i++)); do
    name=node$i
    NODES+=("$name")
    ((i <= NODE_COUNT)) && MAIN_NODES+=("$name")
    DAEMONS+=("slurmd-$name")
    PIDFILE[slurmd-$name]=$RUN/slurmd-$name.pid
    EXE[slurmd-$name]=slurmd
    LOGFILE[slurmd-$name]=$LOGS/slurmd-$name.log
  done
  DAEMONS+=(slurmctld slurmdbd mysqld munged registry)
}

# The node count of the running configuration (1 when none was chosen yet).
configured_nodes() {
  local n=1
  [[ -s $NODE_COUNT_FILE ]] && n=$(<"$NODE_COUNT_FILE")
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1)) || n=1
  echo "$n"
}

# Whether the running configuration has a network-less node (0 or 1; 1 when none was chosen yet).
configured_offline() {
  local want=1
  [[ -s $NODE_OFFLINE_FILE ]] && want=$(<"$NODE_OFFLINE_FILE")
  [[ $want == [01] ]] || want=1
  echo "$want"
}

# The Slurm release of the running configuration (22.05 when none was chosen yet).
configured_release() {
  local release=22.05
  [[ -s $SLURM_RELEASE_FILE ]] && release=$(<"$SLURM_RELEASE_FILE")
  [[ -n ${SLURM_SUITE[$release]:-} ]] || release=22.05
  echo "$release"
}

# Chooses Slurm release $1: where its programs are, and the paths of its own state. Exported, so
# that the compute nodes' namespaces (`_node`) run the same release.
use_release() {
  SLURM_RELEASE=$1
  [[ -n ${SLURM_SUITE[$SLURM_RELEASE]:-} ]] ||
    die "LOCAL_CLUSTER_SLURM must be one of: ${!SLURM_SUITE[*]} (not '$SLURM_RELEASE')"
  export LOCAL_CLUSTER_SLURM=$SLURM_RELEASE
  if [[ $SLURM_RELEASE == 22.05 ]]; then
    SLURM_TREE="" SLURM_BIN="" SLURM_PLUGIN_DIR="" SLURMSTEPD=""
    SLURMCTLD_STATE=$STATE_DIR/slurmctld SLURMD_SPOOL=$STATE_DIR/slurmd ACCOUNTING_DB=slurm_acct_db
    # Debian's own commands, whatever another release left linked in $SLURM_LINK_DIR.
    export PATH=/usr/bin:/usr/sbin:$PATH
    return 0
  fi
  SLURM_TREE=$CACHE/slurm/$SLURM_RELEASE
  SLURM_BIN=$SLURM_TREE/bin
  SLURM_PLUGIN_DIR=$SLURM_TREE/root/usr/lib/x86_64-linux-gnu/slurm-wlm
  # slurmd runs the slurmstepd of its own build's prefix (/usr/sbin) unless told otherwise.
  SLURMSTEPD=$SLURM_BIN/slurmstepd
  SLURMCTLD_STATE=$STATE_DIR/slurmctld-$SLURM_RELEASE
  SLURMD_SPOOL=$STATE_DIR/slurmd-$SLURM_RELEASE
  ACCOUNTING_DB=slurm_acct_db_${SLURM_RELEASE/./_}
  export PATH=$SLURM_BIN:$PATH
}

log() { ((QUIET)) || printf '[%3ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() {
  printf 'local-cluster: error: %s\n' "$*" >&2
  exit 1
}
on_error() {
  printf 'local-cluster: error: command failed (exit %s) at line %s: %s\n' "$1" "$2" "$3" >&2
}
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR

# A daemon did not come up: say which, show the end of its log, stop.
daemon_failed() {
  local name=$1 why=$2 file=${LOGFILE[$1]}
  {
    printf 'local-cluster: error: %s %s\n' "$name" "$why"
    if [[ -s $file ]]; then
      printf -- '--- last lines of %s ---\n' "$file"
      tail -n 25 "$file"
      printf -- '---\n'
    else
      printf '(its log %s is empty)\n' "$file"
    fi
    [[ -s $LOGS/$name.out ]] && { printf -- '--- %s ---\n' "$LOGS/$name.out"; tail -n 10 "$LOGS/$name.out"; }
  } >&2
  exit 1
}

# Run "$@" until it succeeds or $1 seconds pass.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# --- pid files ----------------------------------------------------------------------------------

daemon_pid() {
  local file=${PIDFILE[$1]} pid exe
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  exe=${exe% (deleted)}
  exe=${exe##*/}
  # Debian installs some Slurm daemons as NAME-wlm behind an alternatives link.
  [[ $exe == "${EXE[$1]}" || $exe == "${EXE[$1]}-wlm" ]] || return 1
  echo "$pid"
}

running() { daemon_pid "$1" >/dev/null; }

# A process that has exited but not yet been reaped (a zombie) counts as gone.
alive() {
  local stat
  stat=$(<"/proc/$1/stat") 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

stop_daemon() {
  local name=$1 pid i
  if ! pid=$(daemon_pid "$name"); then
    rm -f "${PIDFILE[$name]}"
    return 0
  fi
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    alive "$pid" || break
    sleep 0.1
  done
  if alive "$pid"; then
    log "$name (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
  rm -f "${PIDFILE[$name]}"
}

# --- checks before touching anything ------------------------------------------------------------

ours_or_absent() {
  [[ ! -e $1 ]] || grep -qxF "$MARKER" "$1"
}

preflight() {
  [[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts daemons)"
  local f
  for f in "$SLURM_CONF_FILE" "$SLURMDBD_CONF_FILE"; do
    ours_or_absent "$f" || die "$f exists and was not written by this script (no marker line);" \
      "refusing to overwrite another Slurm configuration. This machine seems to have its own" \
      "Slurm: use it instead, or move the file away, or set LOCAL_CLUSTER_SLURM_ETC to another" \
      "directory (then export SLURM_CONF=<that directory>/slurm.conf)."
  done
  [[ $STATE_DIR == /* ]] || die "LOCAL_CLUSTER_DIR must be an absolute path (got $STATE_DIR)"
}

# --- Debian packages ----------------------------------------------------------------------------

debian_mirror() {
  if [[ -n ${LOCAL_CLUSTER_DEBIAN_MIRROR:-} ]]; then
    echo "$LOCAL_CLUSTER_DEBIAN_MIRROR"
    return
  fi
  local uri
  uri=$({
    awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' /etc/apt/sources.list.d/*.sources 2>/dev/null
    sed -nE 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null
  } | grep -E '/debian/?$' | grep -v security | head -n 1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

install_packages() {
  local missing
  # dpkg-query prints one "name status" line per known package; unknown ones go to stderr.
  missing=$(comm -23 <(printf '%s\n' "${PACKAGES[@]}" | sort) \
    <({ dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null || true; } |
      awk '$2 == "installed" {print $1}' | sort))
  [[ -z $missing ]] && return 0
  log "installing Debian packages: ${missing//$'\n'/ }"
  # shellcheck disable=SC2086 # $missing is a word list
  if ! DEBIAN_FRONTEND=noninteractive "${APT_GET[@]}" install --no-install-recommends $missing \
    >>"$LOGS/apt.log" 2>&1; then
    log "apt-get install failed; refreshing the package lists and trying again"
    DEBIAN_FRONTEND=noninteractive "${APT_GET[@]}" update >>"$LOGS/apt.log" 2>&1 ||
      { tail -n 20 "$LOGS/apt.log" >&2; die "apt-get update failed (log: $LOGS/apt.log)"; }
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive "${APT_GET[@]}" install --no-install-recommends $missing \
      >>"$LOGS/apt.log" 2>&1 ||
      { tail -n 20 "$LOGS/apt.log" >&2; die "apt-get install failed (log: $LOGS/apt.log)"; }
  fi
  log "Debian packages installed"
}

# --- Slurm releases other than Debian 12's -----------------------------------------------------

# The programs of Slurm $SLURM_RELEASE with the libraries they need, unpacked once into
# $SLURM_TREE/root from Debian's binary packages (see the head of this file); $SLURM_BIN holds
# them under their plain names.
install_slurm_release() {
  [[ -n $SLURM_TREE ]] || return 0
  local stamp=$SLURM_TREE/installed
  [[ -s $stamp && $(head -n 1 "$stamp") == "recipe $SLURM_TREE_RECIPE" ]] && return 0
  local suite=${SLURM_SUITE[$SLURM_RELEASE]} started=$SECONDS new=$SLURM_TREE.new
  local logfile=$LOGS/slurm-$SLURM_RELEASE-install.log
  log "unpacking Slurm $SLURM_RELEASE from Debian $suite into $SLURM_TREE"
  rm -rf "$new"
  mkdir -p "$new/bin"
  # extract: the packages and their dependencies unpacked, nothing configured or run. The
  # mirror may be a snapshot whose Release file is past its Valid-Until date.
  mmdebstrap --variant=extract --include=slurmctld,slurmd,slurmdbd,slurm-client \
    --aptopt='Acquire::Check-Valid-Until "false"' --aptopt='Acquire::Retries "3"' \
    --skip=check/signed-by "$suite" "$new/root" "$(debian_mirror)" >"$logfile" 2>&1 ||
    { tail -n 20 "$logfile" >&2; die "could not unpack Slurm from Debian $suite (log: $logfile)"; }
  # The programs load the unpacked glibc and libraries (their final paths, after the move below);
  # --force-rpath: an RPATH, unlike a RUNPATH, also serves the libraries' and plugins' own needs.
  local lib=$SLURM_TREE/root/usr/lib/x86_64-linux-gnu new_lib=$new/root/usr/lib/x86_64-linux-gnu
  local rpath=$lib/slurm-wlm:$lib name file
  for name in "${SLURM_CLIENT_COMMANDS[@]}" slurmctld slurmd slurmstepd slurmdbd; do
    for file in "$new/root/usr/bin/$name" "$new/root/usr/sbin/$name-wlm" "$new/root/usr/sbin/$name" ""; do
      [[ -f $file ]] && break
    done
    [[ -n $file ]] || continue
    patchelf --force-rpath --set-interpreter "$lib/ld-linux-x86-64.so.2" --set-rpath "$rpath" "$file"
    ln -s "$SLURM_TREE/root${file#"$new/root"}" "$new/bin/$name"
  done
  for file in "$new_lib"/slurm-wlm/*.so; do
    patchelf --force-rpath --set-rpath "$rpath" "$file"
  done
  [[ -L $new/bin/slurmctld && -L $new/bin/slurmstepd && -L $new/bin/sbatch ]] ||
    die "the packages of Debian $suite lack Slurm's programs (see $logfile)"
  rm -rf "$SLURM_TREE"
  mv "$new" "$SLURM_TREE"
  local version
  version=$("$SLURM_BIN/slurmctld" -V 2>&1) ||
    die "the unpacked slurmctld does not run: $version"
  [[ $version == *" $SLURM_RELEASE."* ]] ||
    log "note: Debian $suite now has $version, not $SLURM_RELEASE; using it as release $SLURM_RELEASE"
  printf 'recipe %s\n%s\n' "$SLURM_TREE_RECIPE" "$version" >"$stamp"
  log "Slurm $SLURM_RELEASE ($version) unpacked in $((SECONDS - started)) s"
}

# The client commands of an unpacked release, linked into $SLURM_LINK_DIR for users, services
# and tests; on 22.05, the links an unpacked release left there are removed. A file there that
# is not such a link is never touched.
link_client_commands() {
  local name link
  for name in "${SLURM_CLIENT_COMMANDS[@]}"; do
    link=$SLURM_LINK_DIR/$name
    if [[ -e $link || -L $link ]] && ! [[ -L $link && $(readlink "$link") == "$CACHE/slurm/"* ]]; then
      [[ -z $SLURM_TREE ]] || log "warning: $link is not this script's link; left as it is"
      continue
    fi
    if [[ -n $SLURM_TREE && -e $SLURM_BIN/$name ]]; then
      ln -sfn "$SLURM_BIN/$name" "$link"
    else
      rm -f "$link"
    fi
  done
}

# slurm.conf lines of an unpacked release: its plugins, and each user's RPC rate limited with
# slurmctld's defaults (a bucket of 30, 2 more a second), as at a careful site.
release_lines() {
  [[ -n $SLURM_TREE ]] || return 0
  printf '%s\n' "PluginDir=$SLURM_PLUGIN_DIR" "SlurmctldParameters=rl_enable"
}

# --- configuration files ------------------------------------------------------------------------

# write_if_changed FILE MODE CONTENT: returns 0 when the file changed.
write_if_changed() {
  local file=$1 mode=$2 content=$3
  if [[ -f $file ]] && [[ $(<"$file") == "$content" ]]; then
    return 1
  fi
  ours_or_absent "$file" || die "refusing to overwrite $file (not written by this script)"
  mkdir -p "$(dirname "$file")"
  printf '%s\n' "$content" >"$file.tmp"
  chmod "$mode" "$file.tmp"
  mv -f "$file.tmp" "$file"
  return 0
}

node_hardware() {
  # slurmd -C prints this machine as slurmd sees it, so the node line always matches.
  local line
  line=$(slurmd -C 2>/dev/null | head -n 1) || true
  NODE=$(hostname -s)
  CPUS=$(sed -nE 's/.* CPUs=([0-9]+).*/\1/p' <<<"$line")
  SOCKETS=$(sed -nE 's/.* SocketsPerBoard=([0-9]+).*/\1/p' <<<"$line")
  CORES=$(sed -nE 's/.* CoresPerSocket=([0-9]+).*/\1/p' <<<"$line")
  THREADS=$(sed -nE 's/.* ThreadsPerCore=([0-9]+).*/\1/p' <<<"$line")
  local total_mb
  total_mb=$(sed -nE 's/.* RealMemory=([0-9]+).*/\1/p' <<<"$line")
  [[ -n $CPUS ]] || CPUS=$(nproc --all)
  [[ -n $total_mb ]] || total_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
  # Leave memory for the OS and the daemons: an eighth, at most 1 GiB.
  local reserve=$((total_mb / 8))
  ((reserve > 1024)) && reserve=1024
  REAL_MEMORY=$((total_mb - reserve))
  # Node-local scratch as a real node declares it: TmpFS is where `sbatch --tmp` space lives,
  # TmpDisk what a job may ask for there (half the filesystem, at most 100 GiB). slurmd drains a
  # node whose TmpFS is smaller than its TmpDisk, so it is derived from the disk, never guessed.
  NODE_TMPFS=/tmp
  local tmp_mb
  tmp_mb=$(df -Pm "$NODE_TMPFS" | awk 'NR == 2 {print $2}')
  if ((NODE_COUNT >= 2)); then
    # The nodes' /tmp are directories under the state directory.
    local nodes_mb
    nodes_mb=$(df -Pm "$STATE_DIR" | awk 'NR == 2 {print $2}')
    ((nodes_mb < tmp_mb)) && tmp_mb=$nodes_mb
  fi
  TMP_DISK=$((tmp_mb / 2))
  ((TMP_DISK > 102400)) && TMP_DISK=102400
  # Jobs without --mem get a share small enough that OVERSUBSCRIBE jobs per CPU fit.
  DEF_MEM_PER_CPU=$((REAL_MEMORY / (CPUS * OVERSUBSCRIBE)))
}

slurmd_paths() {
  if ((NODE_COUNT == 1)); then
    printf '%s\n' "SlurmdPort=$SLURMD_PORT" "SlurmdSpoolDir=$SLURMD_SPOOL" \
      "SlurmdPidFile=${PIDFILE[slurmd]}" "SlurmdLogFile=${LOGFILE[slurmd]}"
  else
    # %n: the node's name; each slurmd keeps its own spool, pid file and log.
    printf '%s\n' "SlurmdSpoolDir=$SLURMD_SPOOL/%n" "SlurmdPidFile=$RUN/slurmd-%n.pid" \
      "SlurmdLogFile=$LOGS/slurmd-%n.log"
    # Notice a killed slurmd within seconds (default 300 s): its jobs end NODE_FAIL and requeue.
    printf '%s\n' "SlurmdTimeout=10"
  fi
}

node_lines() {
  local topo=$1 i
  ((FAKE_GPUS > 0)) && topo+=" Gres=gpu:fake:$FAKE_GPUS"
  if ((NODE_COUNT == 1)); then
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS$topo RealMemory=$REAL_MEMORY TmpDisk=$TMP_DISK State=UNKNOWN"
    return
  fi
  # Every node declares the machine's CPUs and memory (over-committed: they share one machine);
  # the network-less one is reached at its own address.
  local addr
  for ((i = 1; i <= ${#NODES[@]}; i++)); do
    addr=127.0.0.1
    [[ node$i == "$OFFLINE_NODE" ]] && addr=$OFFLINE_NODE_ADDR
    echo "NodeName=node$i NodeHostname=$NODE NodeAddr=$addr Port=$((SLURMD_PORT + 20 + i)) CPUs=$CPUS$topo RealMemory=$REAL_MEMORY TmpDisk=$TMP_DISK State=UNKNOWN"
  done
}

# The nodes of PARTITION and PREEMPTIBLE_PARTITION: all but the network-less one.
main_partition_nodes() {
  if [[ -n $OFFLINE_NODE ]]; then
    (IFS=,; echo "${MAIN_NODES[*]}")
  else
    echo ALL
  fi
}

# The partitions of the network-less node and of the transfer nodes.
partition_lines() {
  [[ -n $OFFLINE_NODE ]] || return 0
  # As $PARTITION's: the same tier (a job of $PARTITION never preempts them), cores shared.
  local same="MaxTime=INFINITE State=UP OverSubscribe=FORCE:$OVERSUBSCRIBE PriorityTier=2 PreemptMode=REQUEUE"
  cat <<EOF
# $OFFLINE_NODE reaches slurmctld and nothing else (a network namespace of its own); ${MAIN_NODES[0]} reaches
# the network, as a site's transfer nodes do.
PartitionName=$OFFLINE_PARTITION Nodes=$OFFLINE_NODE $same
PartitionName=$TRANSFER_PARTITION Nodes=${MAIN_NODES[0]} $same
EOF
}

slurm_conf() {
  local topo=""
  [[ -n $SOCKETS && -n $CORES && -n $THREADS ]] &&
    topo=" SocketsPerBoard=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS"
  cat <<EOF
$MARKER
# Test cluster with $NODE_COUNT compute node(s), Slurm $SLURM_RELEASE; state, logs and pid files
# live in $STATE_DIR.
ClusterName=$CLUSTER_NAME
$(release_lines)
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$SLURMCTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
MpiDefault=none
$(confinement_lines)
ReturnToService=2
StateSaveLocation=$SLURMCTLD_STATE
SlurmctldPidFile=${PIDFILE[slurmctld]}
SlurmctldLogFile=${LOGFILE[slurmctld]}
$(slurmd_paths)
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
# Reject at submission a job no partition can ever run (else it pends with Reason=PartitionConfig).
EnforcePartLimits=ALL
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job without --mem asks for the whole node and jobs run one at a time.
DefMemPerCPU=$DEF_MEM_PER_CPU
# Send SIGKILL 10 s after SIGTERM on cancel or time-out (default 30 s).
KillWait=10
# Preemption by partition PriorityTier (see the partitions below); a partition's PreemptMode wins.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$(accounting_gather_lines)
$(gres_lines)
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$SLURMDBD_PORT
# For auth/munge this "password" is the munge socket used to talk to slurmdbd (AuthInfo is not).
AccountingStoragePass=$MUNGE_SOCKET
AccountingStorageEnforce=associations,limits,qos
# Room for benchmarks that keep 10,000 jobs in the queue (default 10,000).
MaxJobCount=20000
# Keep --comment in the accounting database, so sacct can show it after the job ends.
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
TmpFS=$NODE_TMPFS
$(node_lines "$topo")
# Cores are shared by up to $OVERSUBSCRIBE jobs, so several test jobs run at once on a small machine.
# A job of $PARTITION (the higher PriorityTier) that finds no room preempts jobs of
# $PREEMPTIBLE_PARTITION: REQUEUE requeues a job that allows it (--requeue) and cancels one that
# does not (--no-requeue, as the bridge submits), its state PREEMPTED. $PARTITION's own jobs are
# never preempted (no partition has a higher tier), yet its PreemptMode must not be OFF: Slurm
# 22.05's select/cons_tres then takes the cores of its running jobs away from every other job of
# it, and no core is ever shared (4 jobs at once on the two nodes instead of 16).
PartitionName=$PARTITION Nodes=$(main_partition_nodes) Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:$OVERSUBSCRIBE PriorityTier=2 PreemptMode=REQUEUE
PartitionName=$PREEMPTIBLE_PARTITION Nodes=$(main_partition_nodes) MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
$(partition_lines)
EOF
}

# The cgroup plugin Slurm uses here: v1, v2 or none (see LOCAL_CLUSTER_CGROUP).
cgroup_version() {
  case $CGROUP_WANTED in
  v1 | v2 | none) echo "$CGROUP_WANTED" ;;
  auto)
    # A cgroup v1 memory controller (the hybrid layout of many VMs and older distributions)
    # can be used by slurmd as is. Under pure cgroup v2, slurmd 22.05 wants systemd to
    # delegate it a subtree; this script starts daemons without systemd, so that is opt-in.
    if [[ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]]; then
      echo v1
    else
      echo none
    fi
    ;;
  *) die "LOCAL_CLUSTER_CGROUP must be auto, v1, v2 or none (not '$CGROUP_WANTED')" ;;
  esac
}

# How jobs are tracked and confined: with cgroups, a job's processes (its containers included)
# are charged to its own cgroup, and one over its --mem is OOM-killed (Slurm: OUT_OF_MEMORY).
confinement_lines() {
  if [[ $CGROUP != none ]]; then
    printf '%s\n' "ProctrackType=proctrack/cgroup" "TaskPlugin=task/cgroup"
  else
    printf '%s\n' "ProctrackType=proctrack/linuxproc" "TaskPlugin=task/none"
  fi
}

accounting_gather_lines() {
  if [[ $CGROUP != none ]]; then
    # MaxRSS from the cgroup: also for jobs shorter than a sampling period.
    printf '%s\n' "JobAcctGatherType=jobacct_gather/cgroup" "JobAcctGatherFrequency=task=5"
  else
    echo "# Memory requests are enforced by the accounting sampler (no cgroups here)."
    printf '%s\n' "JobAcctGatherType=jobacct_gather/linux" "JobAcctGatherFrequency=task=5" \
      "JobAcctGatherParams=OverMemoryKill"
  fi
}

gres_lines() {
  ((FAKE_GPUS > 0)) || return 0
  # gres/gpu:fake is accounted per type too, so sacct AllocTRES shows both.
  printf '%s\n' "GresTypes=gpu" "AccountingStorageTRES=gres/gpu,gres/gpu:fake"
}

cgroup_conf() {
  cat <<EOF
$MARKER
CgroupPlugin=cgroup/$CGROUP
# A job may use the memory it asked for (--mem, else DefMemPerCPU), no more; no swap here.
ConstrainRAMSpace=yes
AllowedRAMSpace=100
ConstrainSwapSpace=yes
AllowedSwapSpace=0
# Jobs share cores (OverSubscribe) and see no real devices: neither is confined.
ConstrainCores=no
ConstrainDevices=no
EOF
  if [[ $CGROUP == v2 ]]; then
    echo "IgnoreSystemd=yes"
  fi
}

gres_conf() {
  local node last=$((FAKE_GPUS - 1))
  echo "$MARKER"
  for node in "${NODES[@]}"; do
    if ((FAKE_GPUS == 1)); then
      echo "NodeName=$node Name=gpu Type=fake File=$GPU_DEV_DIR/$node/fake0"
    else
      echo "NodeName=$node Name=gpu Type=fake File=$GPU_DEV_DIR/$node/fake[0-$last]"
    fi
  done
}

# Device nodes for the fake GPUs: copies of /dev/null, which Slurm accepts as a GPU's File.
make_fake_gpus() {
  local node i
  for node in "${NODES[@]}"; do
    install -d -m 755 "$GPU_DEV_DIR/$node"
    for ((i = 0; i < FAKE_GPUS; i++)); do
      [[ -c $GPU_DEV_DIR/$node/fake$i ]] || mknod -m 666 "$GPU_DEV_DIR/$node/fake$i" c 1 3
    done
  done
}

slurmdbd_conf() {
  cat <<EOF
$MARKER
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$SLURMDBD_PORT
SlurmUser=root
PidFile=${PIDFILE[slurmdbd]}
LogFile=${LOGFILE[slurmdbd]}
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$(<"$STATE_DIR/mysql/slurm.password")
StorageLoc=$ACCOUNTING_DB
$([[ -z $SLURM_TREE ]] || echo "PluginDir=$SLURM_PLUGIN_DIR")
EOF
}

mysql_conf() {
  cat <<EOF
$MARKER
[mysqld]
user=mysql
datadir=$STATE_DIR/mysql/data
socket=$MYSQL_SOCKET
pid-file=${PIDFILE[mysqld]}
log-error=${LOGFILE[mysqld]}
port=$MYSQL_PORT
bind-address=127.0.0.1
skip-name-resolve
innodb_buffer_pool_size=256M
innodb_lock_wait_timeout=900
EOF
}

registry_conf() {
  cat <<EOF
$MARKER
version: 0.1
log:
  level: info
  formatter: text
storage:
  filesystem:
    rootdirectory: $STATE_DIR/registry/data
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
}

prepare_dirs() {
  mkdir -p "$STATE_DIR" "$RUN" "$LOGS" "$CACHE" "$SLURMCTLD_STATE" "$SLURMD_SPOOL" \
    "$STATE_DIR/mysql" "$STATE_DIR/registry/data" "$APPTAINER_CACHEDIR"
  chmod 755 "$STATE_DIR" "$RUN" "$LOGS"
  install -d -m 755 -o munge -g munge "$RUN/munge" "$STATE_DIR/munge"
  install -d -m 755 -o mysql -g mysql "$RUN/mysqld"
  local f
  for f in "${LOGFILE[munged]}:munge" "${LOGFILE[mysqld]}:mysql"; do
    [[ -e ${f%:*} ]] || install -m 640 -o "${f#*:}" -g "${f#*:}" /dev/null "${f%:*}"
  done
  # Sticky and world-writable, as a site's scratch: service accounts make their own dirs.
  install -d -m 1777 "$SHARED"
  if ((NODE_COUNT >= 2)); then
    local node
    for node in "${NODES[@]}"; do
      install -d -m 755 "$NODES_DIR/$node" "$SLURMD_SPOOL/$node"
      install -d -m 1777 "$NODES_DIR/$node/tmp" "$NODES_DIR/$node/var-tmp" "$NODES_DIR/$node/scratch"
    done
  fi
  if [[ ! -s $STATE_DIR/mysql/slurm.password ]]; then
    (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$STATE_DIR/mysql/slurm.password")
  fi
}

# Writes the config files; sets CONF_CHANGED to the daemons that must restart.
write_configs() {
  CONF_CHANGED=""
  node_hardware
  CGROUP=$(cgroup_version)
  [[ $FAKE_GPUS =~ ^[0-9]$ ]] || die "LOCAL_CLUSTER_GPUS must be 0-9 (not '$FAKE_GPUS')"
  local slurm_files_changed=0
  if [[ $CGROUP != none ]] && write_if_changed "$CGROUP_CONF_FILE" 644 "$(cgroup_conf)"; then
    slurm_files_changed=1
  fi
  if ((FAKE_GPUS > 0)); then
    make_fake_gpus
    write_if_changed "$GRES_CONF_FILE" 644 "$(gres_conf)" && slurm_files_changed=1
  fi
  if write_if_changed "$SLURM_CONF_FILE" 644 "$(slurm_conf)" || ((slurm_files_changed)); then
    CONF_CHANGED+=" slurmctld"
    local name
    for name in "${DAEMONS[@]}"; do
      [[ $name == slurmd || $name == slurmd-* ]] && CONF_CHANGED+=" $name"
    done
  fi
  if write_if_changed "$SLURMDBD_CONF_FILE" 600 "$(slurmdbd_conf)"; then
    CONF_CHANGED+=" slurmdbd"
  fi
  if write_if_changed "$STATE_DIR/mysql/my.cnf" 644 "$(mysql_conf)"; then
    CONF_CHANGED+=" mysqld"
  fi
  if write_if_changed "$STATE_DIR/registry/config.yml" 644 "$(registry_conf)"; then
    CONF_CHANGED+=" registry"
  fi
  if [[ ! -s $STATE_DIR/munge/munge.key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$STATE_DIR/munge/munge.key")
    chown munge:munge "$STATE_DIR/munge/munge.key"
    CONF_CHANGED+=" munged"
  fi
}

# --- daemons ------------------------------------------------------------------------------------

munge_works() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }

start_munged() {
  # Our own key and socket: a site's munged (if any) is left alone.
  runuser -u munge -- /usr/sbin/munged --key-file="$STATE_DIR/munge/munge.key" \
    --seed-file="$STATE_DIR/munge/munged.seed" --socket="$MUNGE_SOCKET" \
    --pid-file="${PIDFILE[munged]}" --log-file="${LOGFILE[munged]}" \
    </dev/null >>"$LOGS/munged.out" 2>&1 || daemon_failed munged "exited at start"
  wait_for 10 munge_works || daemon_failed munged "does not answer on $MUNGE_SOCKET"
}

start_mysqld() {
  local datadir=$STATE_DIR/mysql/data
  if [[ ! -d $datadir/mysql ]]; then
    log "initialising the MariaDB data directory"
    mariadb-install-db --defaults-file="$STATE_DIR/mysql/my.cnf" --skip-test-db \
      --auth-root-authentication-method=socket >>"$LOGS/mysqld.out" 2>&1 ||
      daemon_failed mysqld "could not initialise $datadir"
  fi
  # setsid: own session, so the daemon outlives this script and its terminal.
  setsid /usr/sbin/mariadbd --defaults-file="$STATE_DIR/mysql/my.cnf" \
    </dev/null >>"$LOGS/mysqld.out" 2>&1 &
  wait_for 60 mysqladmin --socket="$MYSQL_SOCKET" ping || daemon_failed mysqld "did not start"
}

# The release's accounting database (each release has its own: slurmdbd converts a database to
# its own schema, and an older release cannot read it back) and slurmdbd's account for it.
ensure_accounting_db() {
  local pw
  pw=$(<"$STATE_DIR/mysql/slurm.password")
  local sql="CREATE DATABASE IF NOT EXISTS $ACCOUNTING_DB;" host
  for host in 127.0.0.1 localhost; do
    sql+=" CREATE USER IF NOT EXISTS 'slurm'@'$host' IDENTIFIED BY '$pw';"
    sql+=" ALTER USER 'slurm'@'$host' IDENTIFIED BY '$pw';"
    sql+=" GRANT ALL ON $ACCOUNTING_DB.* TO 'slurm'@'$host';"
  done
  mariadb --socket="$MYSQL_SOCKET" -uroot <<<"$sql" >>"$LOGS/mysqld.out" 2>&1 ||
    daemon_failed mysqld "could not create the accounting database $ACCOUNTING_DB"
}

cluster_registered() {
  [[ $(sacctmgr -n -P show cluster format=cluster 2>/dev/null) == *"$CLUSTER_NAME"* ]]
}

start_slurmdbd() {
  ensure_accounting_db
  slurmdbd </dev/null >>"$LOGS/slurmdbd.out" 2>&1 || daemon_failed slurmdbd "exited at start"
  wait_for 30 sacctmgr -n show cluster || daemon_failed slurmdbd "does not answer sacctmgr"
  if ! cluster_registered; then
    sacctmgr -i add cluster "$CLUSTER_NAME" >>"$LOGS/slurmdbd.out" 2>&1 ||
      daemon_failed slurmdbd "refused 'sacctmgr add cluster $CLUSTER_NAME'"
  fi
}

# The account, the QOS and an association for every user of this machine (idempotent).
ensure_accounting() {
  if [[ -z $(sacctmgr -n -P show account "$ACCOUNT" format=account 2>/dev/null) ]]; then
    sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER_NAME" Description="local test cluster users" \
      Organization=local >>"$LOGS/slurmdbd.out" 2>&1 || daemon_failed slurmdbd "refused 'sacctmgr add account $ACCOUNT'"
  fi
  if [[ -z $(sacctmgr -n -P show qos "$LIMITED_QOS" format=name 2>/dev/null) ]]; then
    sacctmgr -i add qos "$LIMITED_QOS" >>"$LOGS/slurmdbd.out" 2>&1 ||
      daemon_failed slurmdbd "refused 'sacctmgr add qos $LIMITED_QOS'"
  fi
  sacctmgr -i modify qos where name="$LIMITED_QOS" set MaxSubmitJobsPerUser="$LIMITED_QOS_MAX_SUBMIT" \
    >>"$LOGS/slurmdbd.out" 2>&1 || true # "Nothing modified" when it is set already
  # Users (root's own association included) inherit the QOS of their account.
  sacctmgr -i modify account where name=root,"$ACCOUNT" set QOS=normal,"$LIMITED_QOS" DefaultQOS=normal \
    >>"$LOGS/slurmdbd.out" 2>&1 || true
  # shellcheck disable=SC2046
  add_users $(getent passwd | cut -d: -f1)
}

# Associations in ACCOUNT for the named users that lack one.
add_users() {
  local have missing=() name
  have=" $(sacctmgr -n -P show assoc where account="$ACCOUNT" format=user 2>/dev/null | xargs) "
  for name in "$@"; do
    [[ $name =~ ^[a-z_][a-z0-9_.-]*[$]?$ ]] || die "not a user name: '$name'"
    [[ $have == *" $name "* ]] || missing+=("$name")
  done
  ((${#missing[@]})) || return 0
  sacctmgr -i add user "$(IFS=,; echo "${missing[*]}")" Account="$ACCOUNT" Cluster="$CLUSTER_NAME" \
    >>"$LOGS/slurmdbd.out" 2>&1 || die "sacctmgr refused to add users ${missing[*]} (see $LOGS/slurmdbd.out)"
}

cmd_add_user() {
  (($#)) || die "add-user needs at least one user name"
  if ! running slurmdbd; then
    log "slurmdbd is not running; 'up' gives every user of this machine an association"
    return 0
  fi
  add_users "$@"
}

start_slurmctld() {
  slurmctld </dev/null >>"$LOGS/slurmctld.out" 2>&1 || daemon_failed slurmctld "exited at start"
  wait_for 30 scontrol ping || daemon_failed slurmctld "does not answer 'scontrol ping'"
}

start_slurmd() {
  slurmd ${SLURMSTEPD:+-d "$SLURMSTEPD"} </dev/null >>"$LOGS/slurmd.out" 2>&1 ||
    daemon_failed slurmd "exited at start"
}

# The shared filesystem as a mount of its own, shared: what is mounted under it later (as an
# NFS server's export would show it) appears on every compute node too.
share_shared_dir() {
  if ! mountpoint -q "$SHARED"; then
    mount --bind "$SHARED" "$SHARED"
  fi
  mount --make-shared "$SHARED"
}

# A compute node: its slurmd in a mount namespace of its own (see node_namespace). Slave
# propagation: mounts on the login node under the shared directory reach the node, nothing the
# node mounts reaches the login node (the root filesystem here is private anyway).
start_node() {
  local node=$1 net=()
  share_shared_dir
  # The network-less node joins its network namespace first (nsenter, not `ip netns exec`,
  # which would mount a new /sys and hide the cgroup hierarchies slurmd confines jobs with).
  [[ $node == "$OFFLINE_NODE" ]] && net=(nsenter --net="/run/netns/$NETNS_PREFIX$node" --)
  "${net[@]}" unshare --mount --propagation slave -- "$SCRIPT" _node "$node" \
    </dev/null >>"$LOGS/slurmd-$node.out" 2>&1 || daemon_failed "slurmd-$node" "exited at start"
}

# A node of the running configuration whose slurmd is away (killed), started again as `up` does:
# in its mount namespace, the network-less one in its network namespace too.
start_one_node() {
  local node=$1
  OFFLINE_WANTED=$(configured_offline)
  use_nodes "$(configured_nodes)"
  [[ " ${NODES[*]} " == *" $node "* ]] || die "no compute node '$node' in this configuration"
  [[ $node != "$OFFLINE_NODE" ]] || offline_network_up
  start_node "$node"
}

# --- the network-less node ----------------------------------------------------------------------

# The rules on this side of the network-less node's link (device $1): what comes in from the node
# reaches slurmctld's port and nothing else; replies to what slurmctld (or srun) sent it pass.
# Rejected rather than dropped, so that a job's connection fails at once ("No route to host").
host_side_rules() {
  local dev=$1 table=${1//-/_}
  cat <<EOF
table inet $table
delete table inet $table
table inet $table {
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "$dev" ct state established,related accept
    iifname "$dev" ip daddr $OFFLINE_HOST_ADDR tcp dport $SLURMCTLD_PORT accept
    iifname "$dev" reject with icmpx type admin-prohibited
  }
  chain forward {
    type filter hook forward priority filter; policy accept;
    iifname "$dev" reject with icmpx type admin-prohibited
    oifname "$dev" reject with icmpx type admin-prohibited
  }
}
EOF
}

# Inside the node's namespace: its 127.0.0.1:SLURMCTLD_PORT (slurm.conf's SlurmctldHost address,
# the same on every node) goes to slurmctld over the link, from the node's own address.
node_side_rules() {
  cat <<EOF
table ip tesb_node
delete table ip tesb_node
table ip tesb_node {
  chain output {
    type nat hook output priority -100; policy accept;
    ip daddr 127.0.0.1 tcp dport $SLURMCTLD_PORT dnat to $OFFLINE_HOST_ADDR:$SLURMCTLD_PORT
  }
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "eth0" ip saddr 127.0.0.0/8 snat to $OFFLINE_NODE_ADDR
  }
}
EOF
}

offline_link_ready() {
  local ns=$1
  [[ -e /run/netns/$ns ]] &&
    [[ $(ip -o -4 addr show dev "$ns" 2>/dev/null) == *" $OFFLINE_HOST_ADDR/30 "* ]] &&
    [[ $(ip -n "$ns" -o -4 addr show dev eth0 2>/dev/null) == *" $OFFLINE_NODE_ADDR/30 "* ]]
}

# The network-less node's namespace, link and rules (made once; the rules are loaded again on
# every `up`, each set replacing itself whole).
offline_network_up() {
  local ns=$NETNS_PREFIX$OFFLINE_NODE
  if ! offline_link_ready "$ns"; then
    offline_network_remove "$ns"
    log "$OFFLINE_NODE: network namespace $ns, $OFFLINE_NODE_ADDR, linked to $OFFLINE_HOST_ADDR here"
    ip netns add "$ns"
    ip link add "$ns" type veth peer name eth0 netns "$ns"
    ip addr add "$OFFLINE_HOST_ADDR/30" dev "$ns"
    ip -n "$ns" addr add "$OFFLINE_NODE_ADDR/30" dev eth0
    ip link set "$ns" up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  fi
  # No IPv6 on the link (its link-local addresses would be a way around the rules' addresses);
  # route_localnet lets the node's loopback-addressed packets to slurmctld leave through eth0.
  if [[ -d /proc/sys/net/ipv6 ]]; then
    sysctl -qw "net.ipv6.conf.$ns.disable_ipv6=1"
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.eth0.disable_ipv6=1
  fi
  ip netns exec "$ns" sysctl -qw net.ipv4.conf.all.route_localnet=1
  host_side_rules "$ns" | nft -f -
  node_side_rules | ip netns exec "$ns" nft -f -
}

# What network-less nodes have here, by name: namespaces, host-side links, nftables tables.
offline_names() {
  local names
  names=$({
    ls /run/netns || true
    ip -o link show type veth | awk -F': ' '{sub(/@.*/, "", $2); print $2}' || true
    nft list tables inet | awk '{print $3}' | tr _ - || true
  } 2>/dev/null)
  grep "^$NETNS_PREFIX" <<<"$names" | sort -u || true
}

# Removes the network-less nodes' namespaces, links and rules: the one named $1, or all.
offline_network_remove() {
  local only=${1:-} ns
  for ns in $(offline_names); do
    [[ -z $only || $ns == "$only" ]] || continue
    # The link goes with either end, even while a process keeps the namespace alive.
    ip link del "$ns" 2>/dev/null || true
    [[ ! -e /run/netns/$ns ]] || ip netns del "$ns"
    nft delete table inet "${ns//-/_}" 2>/dev/null || true
    log "removed network namespace $ns, its link and rules"
  done
}

# Only the configured network-less node's network exists.
offline_networks() {
  local ns
  for ns in $(offline_names); do
    [[ $ns == "$NETNS_PREFIX$OFFLINE_NODE" ]] || offline_network_remove "$ns"
  done
  [[ -z $OFFLINE_NODE ]] || offline_network_up
}

# Whether the running slurmd of the network-less node is in its namespace (one made anew since
# it started is not).
node_in_its_network() {
  local pid
  pid=$(daemon_pid "slurmd-$1") || return 1
  [[ $(stat -L -c %i "/proc/$pid/ns/net") == $(stat -L -c %i "/run/netns/$NETNS_PREFIX$1" 2>/dev/null) ]]
}

# Inside the new mount namespace of compute node $1: give it its own /tmp and /var/tmp, make
# the software read-only, hide the state directory's private parts, then become its slurmd.
node_namespace() {
  local node=$1 dir=$NODES_DIR/$1 path held=()
  [[ -d $dir/tmp ]] || die "no directory $dir/tmp (run 'up')"
  # A checkout under /tmp or /var/tmp (a `mktemp -d` clone) would vanish under the node's own:
  # hold it aside, and put it back at its path once they are mounted.
  for path in $NODE_READONLY; do
    case $path in
      /tmp/* | /var/tmp/*)
        [[ -d $path ]] || continue
        mkdir -p "$dir/held$path"
        mount --bind "$path" "$dir/held$path"
        held+=("$path")
        ;;
    esac
  done
  mount --bind "$dir/tmp" /tmp
  mount --bind "$dir/var-tmp" /var/tmp
  for path in "${held[@]}"; do
    mkdir -p "$path"
    mount --bind "$dir/held$path" "$path"
  done
  for path in $NODE_READONLY; do
    [[ -d $path ]] || continue
    mount --bind "$path" "$path"
    mount -o remount,bind,ro "$path"
  done
  # The controller's state, the accounting database, the munge key and the other nodes'
  # directories are the login node's (or another host's) own.
  for path in "$SLURMCTLD_STATE" "$STATE_DIR/mysql" "$STATE_DIR/munge" "$STATE_DIR/registry"; do
    [[ -d $path ]] && mount -t tmpfs -o size=1m,mode=700 tmpfs "$path"
  done
  for path in "$NODES_DIR"/*; do
    [[ $path == "$dir" ]] || mount -t tmpfs -o size=1m,mode=700 tmpfs "$path"
  done
  exec slurmd ${SLURMSTEPD:+-d "$SLURMSTEPD"} -N "$node"
}

start_registry() {
  setsid docker-registry serve "$STATE_DIR/registry/config.yml" \
    </dev/null >>"${LOGFILE[registry]}" 2>&1 &
  echo $! >"${PIDFILE[registry]}"
  wait_for 20 curl -fsS "http://$REGISTRY/v2/" || daemon_failed registry "does not answer on $REGISTRY"
}

# Sets OTHER_SLURMDS to the slurmd daemons (by pid file) that are not part of this
# configuration, e.g. the single node's after a switch to several nodes.
find_other_slurmds() {
  local file name
  OTHER_SLURMDS=()
  for file in "$RUN"/slurmd.pid "$RUN"/slurmd-*.pid; do
    [[ -e $file ]] || continue
    name=$(basename "$file" .pid)
    [[ " ${DAEMONS[*]} " == *" $name "* ]] && continue
    PIDFILE[$name]=$file
    EXE[$name]=slurmd
    LOGFILE[$name]=$LOGS/$name.log
    OTHER_SLURMDS+=("$name")
  done
}

# Whether the running slurmd $1 sees this checkout, whose Python its jobs run. A node started
# from another checkout holds only that one's /tmp path aside (node_namespace): a `mktemp -d`
# clone used with a cluster another checkout brought up would be missing on the node.
node_sees_checkout() {
  local pid
  pid=$(daemon_pid "$1") || return 1
  command -v nsenter >/dev/null || return 0
  nsenter --mount --target "$pid" -- test -e "$REPO/setup.py"
}

start_daemons() {
  local name i
  find_other_slurmds
  for name in "${OTHER_SLURMDS[@]}"; do
    stop_daemon "$name"
  done
  for name in $CONF_CHANGED; do
    running "$name" && { log "configuration of $name changed; restarting it"; stop_daemon "$name"; }
  done
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    if running "$name"; then
      if [[ $name == slurmd-* ]] && ! node_sees_checkout "$name"; then
        log "$name was started from another checkout and does not see this one; restarting it"
        stop_daemon "$name"
      elif [[ $name == "slurmd-$OFFLINE_NODE" ]] && ! node_in_its_network "$OFFLINE_NODE"; then
        log "$name is not in the network namespace $NETNS_PREFIX$OFFLINE_NODE; restarting it"
        stop_daemon "$name"
      else
        continue
      fi
    fi
    rm -f "${PIDFILE[$name]}"
    log "starting $name"
    # The daemons must not inherit the lock.
    if [[ $name == slurmd-* ]]; then
      start_node "${name#slurmd-}" 9>&-
    else
      "start_$name" 9>&-
    fi
    wait_for 10 running "$name" || daemon_failed "$name" "is not running after start (pid file ${PIDFILE[$name]})"
  done
}

# sacct exits 0 on some errors; an answer without anything on stderr is a real answer.
sacct_works() { [[ -z $(sacct -n -X -S now 2>&1 >/dev/null) ]]; }

node_state() { sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n 1; }

wait_for_node() {
  local node=$1 daemon=slurmd state deadline=$((SECONDS + 60)) resumed=0
  ((NODE_COUNT == 1)) || daemon=slurmd-$node
  while :; do
    state=$(node_state "$node" || true)
    case $state in
    idle | mixed | allocated | completing) break ;;
    esac
    if ((SECONDS > deadline)); then
      running "$daemon" || daemon_failed "$daemon" "died"
      daemon_failed "$daemon" "node $node is '${state:-unknown}', not idle, after 60 s ($(
        scontrol show node "$node" 2>/dev/null | grep -o 'Reason=.*' || true))"
    fi
    # A node left DOWN/DRAINED by an earlier run is put back once its slurmd answers.
    if ((!resumed)) && [[ $state == down* || $state == drain* ]] && [[ $state != *'*' ]]; then
      scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
      resumed=1
    fi
    sleep 0.3
  done
}

wait_for_nodes() {
  local node
  for node in "${NODES[@]}"; do
    wait_for_node "$node"
  done
  wait_for 30 sacct_works || daemon_failed slurmdbd "does not answer sacct: $(sacct -n -X -S now 2>&1 | head -n 3)"
}

# --- Apptainer ----------------------------------------------------------------------------------

find_apptainer() {
  local b
  for b in apptainer singularity; do
    if command -v "$b" >/dev/null && "$b" version >/dev/null 2>&1; then
      command -v "$b"
      return 0
    fi
  done
  return 1
}

install_apptainer() {
  if APPTAINER=$(find_apptainer); then
    return 0
  fi
  log "installing Apptainer from Debian $APPTAINER_SUITE (unpacked, with its own glibc in $APPTAINER_LIBDIR)"
  local work=$CACHE/apptainer-debs mirror
  mirror=$(debian_mirror)
  mkdir -p "$work/lists/partial" "$work/apt/archives/partial" "$work/debs"
  rm -rf "$work/root"
  # A private source list, used only to download: the machine's apt sources are not touched.
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $APPTAINER_SUITE main" \
    >"$work/sources.list"
  local opts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
    -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/apt"
    -o Acquire::Check-Valid-Until=false -o APT::Sandbox::User=root)
  if ! ls "$work/debs"/apptainer_*.deb >/dev/null 2>&1; then
    "${APT_GET[@]}" "${opts[@]}" update >>"$LOGS/apptainer-install.log" 2>&1 ||
      die "could not read Debian $APPTAINER_SUITE from $mirror (log: $LOGS/apptainer-install.log)"
    (cd "$work/debs" && "${APT_GET[@]}" "${opts[@]}" download apptainer libc6 libseccomp2 \
      libsqlite3-0 >>"$LOGS/apptainer-install.log" 2>&1) ||
      die "could not download Apptainer (log: $LOGS/apptainer-install.log)"
  fi
  local deb
  for deb in "$work/debs"/*.deb; do
    dpkg-deb -x "$deb" "$work/root"
  done
  local src=$work/root/usr/lib/x86_64-linux-gnu
  mkdir -p "$APPTAINER_LIBDIR"
  (cd "$src" && cp -a ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 \
    librt.so.1 libresolv.so.2 libseccomp.so.2* libsqlite3.so* "$APPTAINER_LIBDIR/")
  rm -rf /usr/lib/x86_64-linux-gnu/apptainer
  cp -a "$src/apptainer" /usr/lib/x86_64-linux-gnu/apptainer
  mkdir -p /etc/apptainer
  cp -a "$work/root/etc/apptainer/." /etc/apptainer/
  install -m 755 "$work/root/usr/bin/apptainer" /usr/bin/apptainer
  # --force-rpath: an RPATH (unlike RUNPATH) also serves libsqlite's own dependencies.
  local f
  for f in /usr/bin/apptainer /usr/lib/x86_64-linux-gnu/apptainer/bin/starter; do
    patchelf --force-rpath --set-interpreter "$APPTAINER_LIBDIR/ld-linux-x86-64.so.2" \
      --set-rpath "$APPTAINER_LIBDIR" "$f"
  done
  mkdir -p /var/lib/apptainer/mnt/session
  rm -rf "$work/root"
  APPTAINER=$(find_apptainer) || die "Apptainer was unpacked but '/usr/bin/apptainer version'" \
    "fails: $(/usr/bin/apptainer version 2>&1 | head -n 3)"
  log "Apptainer $("$APPTAINER" version) installed at $APPTAINER"
}

# Finds the exec flags this machine needs (plain exec fails as root on VMs that withhold a
# capability; --userns works there) and checks that a container really runs.
# Unprivileged Apptainer mounts SIF images with squashfuse, which opens /dev/fuse. A Debian host
# with udev makes it 0666 (udev's own rule); some virtual machines and containers leave it 0600,
# and then only root could run containers. Jobs here run as unprivileged users, as at a site.
open_fuse() {
  if [[ -c /dev/fuse ]] && [[ $(stat -c %a /dev/fuse) != 666 ]]; then
    chmod 0666 /dev/fuse
  fi
}

verify_apptainer() {
  local sif=$CACHE/images/alpine.sif
  if [[ ! -s $sif ]]; then
    mkdir -p "$CACHE/images"
    "$APPTAINER" pull --no-https "$sif.tmp" "docker://$REGISTRY/library/alpine:latest" \
      >>"$LOGS/apptainer.log" 2>&1 ||
      { tail -n 15 "$LOGS/apptainer.log" >&2; die "apptainer pull of the alpine test image failed"; }
    mv -f "$sif.tmp" "$sif"
  fi
  local flags_file=$STATE_DIR/apptainer.flags candidates=() flags
  [[ -f $flags_file ]] && candidates+=("$(<"$flags_file")")
  candidates+=("" "--userns" "--no-privs")
  for flags in "${candidates[@]}"; do
    # shellcheck disable=SC2086 # flags is a word list
    if "$APPTAINER" exec $flags "$sif" sh -c 'exit 7' >>"$LOGS/apptainer.log" 2>&1; then
      die "apptainer exec${flags:+ $flags} returned 0 for 'exit 7': exit codes do not pass through"
    elif (($? == 7)); then
      APPTAINER_FLAGS=$flags
      [[ -f $flags_file && $(<"$flags_file") == "$flags" ]] || printf '%s' "$flags" >"$flags_file"
      return 0
    fi
  done
  tail -n 15 "$LOGS/apptainer.log" >&2
  die "apptainer cannot run a container here, with or without --userns (log: $LOGS/apptainer.log)"
}

# --- images -------------------------------------------------------------------------------------

registry_has() {
  curl -fsS -o /dev/null -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
    "http://$REGISTRY/v2/$1/manifests/$2"
}

# A key for an image's build inputs: its files under deploy/images and this recipe's version.
image_key() {
  {
    echo "recipe=$IMAGE_RECIPE_VERSION $*"
    (cd "$IMAGES_SRC/$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

busybox_static() {
  local dir=$CACHE/busybox
  if [[ ! -x $dir/bin/busybox ]]; then
    mkdir -p "$dir/deb"
    # Downloaded and unpacked, not installed: busybox-static conflicts with busybox.
    (cd "$dir/deb" && "${APT_GET[@]}" -o APT::Sandbox::User=root download busybox-static \
      >>"$LOGS/images.log" 2>&1) || die "could not download busybox-static (log: $LOGS/images.log)"
    dpkg-deb -x "$dir"/deb/busybox-static_*.deb "$dir/root"
    install -D -m 755 "$dir/root/bin/busybox" "$dir/bin/busybox"
    rm -rf "$dir/root" "$dir/deb"
  fi
  echo "$dir/bin/busybox"
}

fill_alpine_rootfs() {
  local rootfs=$1 busybox applet
  busybox=$(busybox_static)
  install -D -m 755 "$busybox" "$rootfs/bin/busybox"
  # --list-full names each applet with its usual directory (bin/sh, usr/bin/env, ...).
  while read -r applet; do
    [[ -n $applet && ! -e $rootfs/$applet ]] || continue
    mkdir -p "$rootfs/$(dirname "$applet")"
    ln -s /bin/busybox "$rootfs/$applet"
  done < <("$busybox" --list-full)
  cp -a "$IMAGES_SRC/alpine/rootfs/." "$rootfs/"
  mkdir -p "$rootfs"/{dev,proc,sys,root,home,var/tmp,tmp}
  chmod 1777 "$rootfs/tmp" "$rootfs/var/tmp"
}

fill_python_rootfs() {
  local rootfs=$1 mirror packages
  mirror=$(debian_mirror)
  packages=$(grep -v '^#' "$IMAGES_SRC/python/packages" | xargs | tr ' ' ',')
  # shellcheck disable=SC2016 # "$1" is expanded by mmdebstrap's hook shell
  local hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*'
  rmdir "$rootfs"
  mmdebstrap --quiet --mode=root --variant=minbase --include="$packages" \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook="$hook" \
    bookworm "$rootfs" \
    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm main" \
    >>"$LOGS/images.log" 2>&1 || die "mmdebstrap of the python image failed (log: $LOGS/images.log)"
}

# build_image NAME REPO TAG: build (or take from the cache) and push to the registry.
publish_image() {
  local name=$1 repo=$2 tag=$3 key layout bundle
  key=$(image_key "$name")
  layout=$CACHE/images/$name-oci-$key
  if [[ ! -f $layout/.complete ]]; then
    local t=$SECONDS
    log "building image $repo:$tag"
    rm -rf "$CACHE/images/$name-oci-"* "$CACHE/images/$name-bundle"
    bundle=$CACHE/images/$name-bundle
    {
      umoci init --layout "$layout"
      umoci new --image "$layout:latest"
      umoci unpack --image "$layout:latest" "$bundle"
      "fill_${name}_rootfs" "$bundle/rootfs"
      umoci repack --image "$layout:latest" "$bundle"
      umoci config --image "$layout:latest" --config.cmd=/bin/sh \
        --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --architecture=amd64 --os=linux
      umoci gc --layout "$layout"
    } >>"$LOGS/images.log" 2>&1
    rm -rf "$bundle"
    touch "$layout/.complete"
    log "built image $repo:$tag in $((SECONDS - t)) s (cached in $layout)"
  fi
  local pushed=$STATE_DIR/registry/pushed-$name
  if [[ -f $pushed && $(<"$pushed") == "$key" ]] && registry_has "$repo" "$tag"; then
    return 0
  fi
  log "pushing $repo:$tag to $REGISTRY"
  skopeo copy --quiet --insecure-policy --dest-tls-verify=false "oci:$layout:latest" \
    "docker://$REGISTRY/$repo:$tag" >>"$LOGS/images.log" 2>&1 ||
    { tail -n 10 "$LOGS/images.log" >&2; die "skopeo could not push $repo:$tag to $REGISTRY"; }
  echo "$key" >"$pushed"
  # The verification SIF is made from the image just pushed.
  [[ $name != alpine ]] || rm -f "$CACHE/images/alpine.sif"
}

# --- subcommands --------------------------------------------------------------------------------

write_env_file() {
  cat >"$STATE_DIR/cluster.env.tmp" <<EOF
LOCAL_CLUSTER_DIR=$STATE_DIR
SLURM_CONF=$SLURM_CONF_FILE
LOCAL_CLUSTER_SLURM=$SLURM_RELEASE
LOCAL_CLUSTER_SLURM_VERSION=$(sinfo -V | awk '{print $2}')
LOCAL_CLUSTER_PARTITION=$PARTITION
LOCAL_CLUSTER_PREEMPTIBLE_PARTITION=$PREEMPTIBLE_PARTITION
LOCAL_CLUSTER_NODE=${NODES[0]}
LOCAL_CLUSTER_NODES=$(IFS=,; echo "${MAIN_NODES[*]}")
LOCAL_CLUSTER_OFFLINE_PARTITION=${OFFLINE_NODE:+$OFFLINE_PARTITION}
LOCAL_CLUSTER_OFFLINE_NODE=$OFFLINE_NODE
LOCAL_CLUSTER_TRANSFER_PARTITION=${OFFLINE_NODE:+$TRANSFER_PARTITION}
LOCAL_CLUSTER_SHARED_DIR=$SHARED
LOCAL_CLUSTER_REGISTRY=$REGISTRY
LOCAL_CLUSTER_APPTAINER=$APPTAINER
LOCAL_CLUSTER_APPTAINER_FLAGS=$APPTAINER_FLAGS
EOF
  mv -f "$STATE_DIR/cluster.env.tmp" "$STATE_DIR/cluster.env"
}

# One `up` or `down` at a time (tests in parallel sessions may call `up` together).
take_lock() {
  exec 9>"$STATE_DIR/.lock"
  if ! flock -n 9; then
    log "waiting for another local-cluster.sh run to finish ($STATE_DIR/.lock)"
    flock -w 900 9 || die "another local-cluster.sh still holds $STATE_DIR/.lock after 15 min"
  fi
}

cmd_up() {
  preflight
  mkdir -p "$STATE_DIR"
  take_lock
  mkdir -p "$LOGS"
  OFFLINE_WANTED=${OFFLINE_WANTED:-$(configured_offline)}
  use_nodes "${WANT_NODES:-$(configured_nodes)}"
  install_packages
  install_slurm_release
  prepare_dirs
  write_configs
  offline_networks
  # From here on the daemons are this release's: `down` and `status` use its commands.
  echo "$SLURM_RELEASE" >"$SLURM_RELEASE_FILE"
  link_client_commands
  start_daemons
  ensure_accounting
  install_apptainer
  open_fuse
  publish_image alpine library/alpine latest
  publish_image python library/python 3-slim
  verify_apptainer
  wait_for_nodes
  echo "$NODE_COUNT" >"$NODE_COUNT_FILE"
  echo "$OFFLINE_WANTED" >"$NODE_OFFLINE_FILE"
  write_env_file
  local extra=""
  [[ $SLURM_CONF_FILE == /etc/slurm/slurm.conf ]] || extra="   export SLURM_CONF=$SLURM_CONF_FILE"
  ((QUIET)) && return 0
  cat <<EOF
[$(printf '%3d' $((SECONDS - T0)))s] local cluster is up ($STATE_DIR; logs in $LOGS)
  Slurm:     $(sinfo -V) ($SLURM_RELEASE): $(describe_nodes) ($CPUS CPUs, ${REAL_MEMORY} MB each), partition '$PARTITION' (preemptible: '$PREEMPTIBLE_PARTITION')$extra
             memory confined by cgroups: $CGROUP; fake GPUs per node: $FAKE_GPUS (gpu:fake)$(describe_offline)
  Apptainer: $APPTAINER; exec flags needed here: '${APPTAINER_FLAGS:-none}'
             e.g. $APPTAINER exec ${APPTAINER_FLAGS:+$APPTAINER_FLAGS }IMAGE.sif CMD
  Registry:  $REGISTRY (plain HTTP: apptainer pull --no-https, or APPTAINER_NOHTTPS=1)
             docker://$REGISTRY/library/alpine:latest  docker://$REGISTRY/library/python:3-slim
  Settings for programs and tests: $STATE_DIR/cluster.env
EOF
}

describe_nodes() {
  if ((NODE_COUNT == 1)); then
    echo "node $NODE (this machine)"
  else
    echo "nodes ${MAIN_NODES[*]} (own mount namespaces; shared filesystem $SHARED)"
  fi
}

describe_offline() {
  [[ -n $OFFLINE_NODE ]] || return 0
  printf '\n             %s' \
    "network-less: partition '$OFFLINE_PARTITION' ($OFFLINE_NODE, network namespace $NETNS_PREFIX$OFFLINE_NODE, $OFFLINE_NODE_ADDR: reaches only slurmctld at $OFFLINE_HOST_ADDR:$SLURMCTLD_PORT)" \
    "transfer: partition '$TRANSFER_PARTITION' (${MAIN_NODES[0]}, reaches the network)"
}

no_running_jobs() { [[ -z $(squeue -h -t running,completing -o %A 2>/dev/null) ]]; }

cmd_down() {
  [[ $(id -u) == 0 ]] || die "run as root"
  [[ -d $STATE_DIR ]] || { log "nothing to stop: $STATE_DIR does not exist"; return 0; }
  take_lock
  OFFLINE_WANTED=$(configured_offline)
  use_nodes "$(configured_nodes)"
  local names=("$@") name
  find_other_slurmds
  DAEMONS=("${OTHER_SLURMDS[@]}" "${DAEMONS[@]}")
  if ((${#names[@]} == 0)); then
    names=("${DAEMONS[@]}")
    # Cancel jobs first: their slurmstepd processes would otherwise outlive slurmd.
    if running slurmctld; then
      local jobs
      jobs=$(squeue -h -o %A 2>/dev/null | xargs) || true
      if [[ -n $jobs ]]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        wait_for 20 no_running_jobs || log "some jobs are still ending; stopping anyway"
      fi
    fi
  fi
  # `down slurmd` with several nodes: every node's slurmd.
  if [[ " ${names[*]} " == *" slurmd "* ]] && ((NODE_COUNT >= 2)); then
    for name in "${NODES[@]}"; do names+=("slurmd-$name"); done
  fi
  for name in "${names[@]}"; do
    [[ -n ${PIDFILE[$name]:-} ]] || die "unknown daemon '$name' (known: ${DAEMONS[*]})"
  done
  # Stop in dependency order whatever the order given.
  for name in "${DAEMONS[@]}"; do
    [[ " ${names[*]} " == *" $name "* ]] && stop_daemon "$name"
  done
  log "stopped: ${names[*]}"
  # All of it: the network-less node's network too (a slurmd stopped alone comes back into it).
  (($#)) || offline_network_remove
}

cmd_status() {
  local name pid all=0
  OFFLINE_WANTED=$(configured_offline)
  use_nodes "$(configured_nodes)"
  echo "state directory: $STATE_DIR"
  for name in "${DAEMONS[@]}"; do
    if pid=$(daemon_pid "$name"); then
      printf '  %-10s running  pid %-7s log %s\n' "$name" "$pid" "${LOGFILE[$name]}"
    else
      printf '  %-10s stopped               log %s\n' "$name" "${LOGFILE[$name]}"
      all=3
    fi
  done
  if running slurmctld; then
    echo "nodes:"
    sinfo -h -N -o '  %N %T cpus=%c mem=%mMB' 2>/dev/null || true
    echo "partitions:"
    sinfo -h -o '  %P %N' 2>/dev/null || true
    echo "jobs in queue: $(squeue -h 2>/dev/null | wc -l)"
  fi
  if [[ -n $OFFLINE_NODE ]]; then
    local ns=$NETNS_PREFIX$OFFLINE_NODE
    if offline_link_ready "$ns"; then
      echo "network-less node $OFFLINE_NODE: namespace $ns, $OFFLINE_NODE_ADDR; reaches only slurmctld at $OFFLINE_HOST_ADDR:$SLURMCTLD_PORT"
    else
      echo "network-less node $OFFLINE_NODE: no network namespace $ns (run 'up')"
      all=3
    fi
  fi
  [[ -f $STATE_DIR/cluster.env ]] && { echo "settings ($STATE_DIR/cluster.env):"; sed 's/^/  /' "$STATE_DIR/cluster.env"; }
  return $all
}

usage() {
  sed -n '2,/^set -Eeuo/p' "${BASH_SOURCE[0]}" | sed -e '/^set -Eeuo/d' -e 's/^# \{0,1\}//'
}

main() {
  local cmd=${1:-}
  shift || true
  # `up` (and a node it starts) runs the release asked for; the other commands the running one.
  case $cmd in
  up | _node) use_release "${LOCAL_CLUSTER_SLURM:-$(configured_release)}" ;;
  *) use_release "$(configured_release)" ;;
  esac
  case $cmd in
  up)
    while (($#)); do
      case $1 in
      --quiet) QUIET=1 ;;
      --nodes)
        [[ ${2:-} =~ ^[1-9][0-9]?$ ]] || die "--nodes needs a number of nodes (1-99)"
        WANT_NODES=$2
        shift
        ;;
      --nodes=*)
        WANT_NODES=${1#--nodes=}
        [[ $WANT_NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes needs a number of nodes (1-99)"
        ;;
      *) die "up: unknown option '$1'" ;;
      esac
      shift
    done
    cmd_up
    ;;
  _node) node_namespace "$1" ;;
  # slurmctld alone, of the running release (a fault's undoing: `up` would start the nodes too).
  _slurmctld) start_slurmctld ;;
  # One compute node's slurmd, started as `up` starts it (a fault's undoing).
  _slurmd) start_one_node "${1:-}" ;;
  down) cmd_down "$@" ;;
  add-user) cmd_add_user "$@" ;;
  status)
    # Exit 3 (as LSB status does) when a daemon is not running.
    cmd_status || exit 3
    ;;
  -h | --help | help) usage ;;
  *)
    usage >&2
    exit 2
    ;;
  esac
}

main "$@"
