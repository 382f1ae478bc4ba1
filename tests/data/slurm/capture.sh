#!/usr/bin/env bash
# Captures real squeue/sacct/sbatch/scancel output from the local cluster into the directory of
# its Slurm release (e.g. 26.05/; the files directly in this directory are 22.05.8's, made
# before the releases had directories) and writes README there (one line per file: the exact
# command and its exit code). Needs a running `deploy/local-cluster.sh up` (any release,
# LOCAL_CLUSTER_SLURM; two nodes for the node failure); takes about four minutes (a job has to
# time out, a node to be declared down). It stops slurmctld, slurmdbd and a node's slurmd for a
# moment, then restarts them with `up`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
export TZ=UTC
version=$(sinfo -V | awk '{print $2}')
release=$(cut -d. -f1-2 <<<"$version")
mkdir -p "$here/$release"
cd "$here/$release"

# The formats bridge/slurm/ asks for (keep in step with SQUEUE_FORMAT in its squeue.py and
# SACCT_FIELDS in its sacct.py).
SQ_FMT='%i|%j|%T|%r|%N|%P|%S|%e|%M|%k'
SA_FMT='JobID,JobName,State,ExitCode,Reason,NodeList,Partition,Start,End,ElapsedRaw,MaxRSS,Comment'

rm -f ./*.txt ./*.stderr
{
  echo "Real output of Slurm $version on the local cluster, made by ../capture.sh with TZ=UTC."
  echo "Each line: file: \`exact command\` (exit code). A .stderr file holds that command's stderr."
  echo "Job ids are those of the run that made the files; other jobs shared the cluster then."
  echo "Seen but not kept as a file: without EnforcePartLimits=ALL in slurm.conf,"
  echo "'sbatch --cpus-per-task=64' on a 2-CPU node is accepted (exit 0) and the job pends for"
  echo "ever with Reason=PartitionConfig; the local cluster sets EnforcePartLimits=ALL."
  echo
} >README

# shellcheck disable=SC2016 # the backquotes are Markdown, not command substitution
cap() { # cap FILE CMD...
  local file=$1 rc=0
  shift
  "$@" >"$file" 2>"$file.stderr" || rc=$?
  [[ -s $file.stderr ]] || rm -f "$file.stderr"
  printf '%s: `%s` (exit %d)\n' "$file" "${*@Q}" "$rc" >>README
}

# cap_until PATTERN FILE CMD...: run CMD every 0.1 s (at most 100 times) until its output
# matches PATTERN, for output that only shows for a moment.
# shellcheck disable=SC2016
cap_until() {
  local pattern=$1 file=$2
  shift 2
  for _ in $(seq 1 100); do
    "$@" >"$file" 2>/dev/null || true
    grep -q -- "$pattern" "$file" && break
    sleep 0.1
  done
  printf '%s: `%s` (exit 0; the first of repeated runs whose output matched %s)\n' \
    "$file" "${*@Q}" "${pattern@Q}" >>README
}

# On the shared filesystem: with several nodes, the login node's /tmp is not theirs (22.05
# fails a job whose output file it cannot open: JobLaunchFailure, signal 53).
shared=$(sed -n 's/^LOCAL_CLUSTER_SHARED_DIR=//p' "${LOCAL_CLUSTER_DIR:-/var/lib/tes-bridge/local-cluster}/cluster.env")
work=$(mktemp -d -p "${shared:-/tmp}")
trap 'rm -rf "$work"; "$repo/deploy/local-cluster.sh" up --quiet' EXIT
sb() { sbatch --parsable -o "$work/%j.out" "$@"; }

# slurmdbd's placeholder record ("allocation", no partition) before the job's own arrives.
placeholder=$(sb -J tes-placeholder --mem=100 --wrap 'sleep 2')
cap_until '|allocation|' sacct-placeholder.txt sacct -P -n --jobs="$placeholder" --format="$SA_FMT"

ok=$(sb -J tes-ok --comment 'task=ok|tag=a b' --wrap 'echo hello')
fail=$(sb -J tes-fail --wrap 'exit 3')
# A script that exits 137 itself, as a shell does after a child killed by SIGKILL.
exit137=$(sb -J tes-exit137 --wrap 'exit 137')
signal=$(sb -J tes-signal --wrap 'kill -9 $$')
array=$(sb -J tes-array --array=0-2 --wrap 'exit $SLURM_ARRAY_TASK_ID')
running=$(sb -J tes-running --wrap 'sleep 300')
big=$(sb -J tes-bigmem --mem=20000 --wrap 'sleep 100')
sleep 1
pending=$(sb -J tes-pending --mem=20000 --wrap 'true')
held=$(sb -J tes-held --hold --wrap 'true')
oom=$(sb -J tes-oom --mem=100 --wrap '/usr/bin/python3 -c "a = bytearray(600 * 2**20); import time; time.sleep(30)"')
timeout=$(sb -J tes-timeout --time=1 --wrap 'sleep 300')
all="$ok,$fail,$exit137,$signal,$running,$big,$pending,$held,$oom,$timeout"
sleep 4

cap squeue-active.txt squeue -h --states=all --jobs="$all" -o "$SQ_FMT"
cap sacct-active.txt sacct -P -n --jobs="$all" --format="$SA_FMT"
cap squeue-default-states.txt squeue -h --jobs="$all" -o "$SQ_FMT"
cap squeue-version.txt squeue --version
if [[ $(squeue --help 2>&1) == *only-job-state* ]]; then
  cap squeue-only-job-state.txt squeue -h -r --only-job-state --states=all --jobs="$all" -o '%i|%T'
  # A held array's elements asked by id: each id is answered with every element of its array
  # (26.05), so the client asks for the array's id once.
  held_array=$(sb -J tes-held-array --hold --array=0-4 --wrap 'true')
  cap squeue-only-job-state-elements.txt squeue -h -r --only-job-state --states=all \
    --jobs="${held_array}_0,${held_array}_1,${held_array}_2" -o '%i|%T'
  cap squeue-only-job-state-array.txt squeue -h -r --only-job-state --states=all \
    --jobs="$held_array" -o '%i|%T'
  scancel "$held_array"
fi
cap scontrol-show-config.txt scontrol show config

scancel "$running" "$held"
sleep 2
cap squeue-cancelled.txt squeue -h --states=all --jobs="$running,$held" -o "$SQ_FMT"
cap sacct-cancelled.txt sacct -P -n --jobs="$running,$held" --format="$SA_FMT"

# The time-out needs its minute plus Slurm's check interval and KillWait.
for _ in $(seq 1 60); do
  [[ $(squeue -h --states=all --jobs="$timeout" -o %T) == TIMEOUT ]] && break
  sleep 3
done
sleep 3
scancel "$big"
for _ in $(seq 1 30); do
  [[ -z $(squeue -h --jobs="$all" -o %i) ]] && break
  sleep 1
done
sleep 3

cap squeue-ended.txt squeue -h --states=all --jobs="$all" -o "$SQ_FMT"
cap sacct-ended.txt sacct -P -n --jobs="$all" --format="$SA_FMT"
cap squeue-array.txt squeue -h -r --states=all --jobs="$array" -o "$SQ_FMT"
cap sacct-array.txt sacct -P -n --jobs="$array" --format="$SA_FMT"
cap squeue-by-name.txt squeue -h --states=all --name=tes-ok,tes-fail,tes-nosuch -o "$SQ_FMT"
cap sacct-by-name.txt sacct -P -n --name=tes-ok,tes-fail,tes-nosuch \
  --starttime="$(date -u -d '-7 days' +%Y-%m-%dT%H:%M:%S)" --format="$SA_FMT"

cap squeue-unknown-job.txt squeue -h --states=all --jobs=999999 -o "$SQ_FMT"
cap squeue-unknown-jobs.txt squeue -h --states=all --jobs="999999,$ok" -o "$SQ_FMT"
cap sacct-unknown-job.txt sacct -P -n --jobs=999999 --format="$SA_FMT"
cap scancel-unknown-job.txt scancel 999999
cap scancel-ended-job.txt scancel "$ok"

cap sbatch-ok.txt sbatch --parsable -o /dev/null -J tes-submit --wrap true
cap sbatch-too-much-memory.txt sbatch --parsable -o /dev/null --mem=999999 --wrap true
cap sbatch-too-many-cpus.txt sbatch --parsable -o /dev/null --cpus-per-task=64 --wrap true
cap sbatch-bad-partition.txt sbatch --parsable -o /dev/null --partition=nosuch --wrap true
cap sbatch-bad-time.txt sbatch --parsable -o /dev/null --time=bogus --wrap true
cap sbatch-missing-script.txt sbatch --parsable /nonexistent/job.sh
cap sbatch-too-much-tmp.txt sbatch --parsable -o /dev/null --tmp=99999999 --wrap true
cap sinfo-node-sizes.txt sinfo -h -a -o '%P|%d|%m'
cap sinfo-partitions.txt sinfo -h -a -N -o '%P|%N|%c|%m|%l|%G|%d|%a|%T'
cap sbatch-gres-and-gpus-per-node.txt sbatch --parsable -o /dev/null --gres=gpu:1 --gpus-per-node=1 --wrap true
scancel --name=tes-submit 2>/dev/null || true

# slurmctld's rate limit (SlurmctldParameters=rl_enable; root is exempt): a burst of squeue
# calls as an unprivileged user; the first call that was told to back off, at -v.
if [[ $(scontrol show config) == *rl_enable* ]]; then
  for i in $(seq 1 45); do
    setpriv --reuid=nobody --regid=nogroup --clear-groups squeue -v -h -j "$ok" >/dev/null 2>"$work/rl-$i.err" || true
  done
  limited=$(grep -l -i -E 'rate|limit|back.?off' "$work"/rl-*.err | head -n 1 || true)
  if [[ -n $limited ]]; then
    cp "$limited" squeue-rate-limited.txt.stderr
    : >squeue-rate-limited.txt
    printf '%s: `%s` (the stderr of the first of 45 calls in a row that slurmctld limited)\n' \
      squeue-rate-limited.txt "setpriv --reuid=nobody ... squeue -v -h -j $ok" >>README
  fi
fi

# A full cluster: each node's memory taken by a job with a time limit (the partition's
# OverSubscribe=FORCE overrides --exclusive; memory is never shared), so that a job behind them
# waits (Resources) and the backfill scheduler estimates its start (each bf_interval, 30 s by
# default); sbatch --test-only answers the same for a job it does not create.
full_cluster() {
  local fillers=() behind n memory
  for n in $(sinfo -h -N -o %N | sort -u); do
    memory=$(sinfo -h -N -n "$n" -o %m | head -n 1)
    fillers+=("$(sb -J tes-filler -w "$n" --mem="$memory" --time=10 --wrap 'sleep 600')")
  done
  sleep 2
  behind=$(sb -J tes-behind --time=5 --wrap true)
  for _ in $(seq 1 90); do
    [[ $(squeue -h --jobs="$behind" -o %S) != N/A ]] && break
    sleep 1
  done
  cap squeue-pending-estimate.txt squeue -h -r --states=all --jobs="$behind" -o "$SQ_FMT"
  cap squeue-start.txt squeue --start -h --jobs="$behind"
  cap sbatch-test-only.txt sbatch --parsable --test-only -o /dev/null --time=5 --wrap true
  cap sbatch-test-only-refused.txt sbatch --parsable --test-only -o /dev/null \
    --constraint=nosuch --wrap true
  scancel "${fillers[@]}" "$behind"
}
full_cluster

# A node whose slurmd dies under a running job: NODE_FAIL once slurmctld declares it down.
nodes=$(sinfo -h -N -o %N | sort -u)
if (($(wc -l <<<"$nodes") >= 2)); then
  lost_node=$(tail -n 1 <<<"$nodes")
  lost=$(sb -J tes-node-fail -w "$lost_node" --no-requeue --wrap 'sleep 300')
  sleep 3
  "$repo/deploy/local-cluster.sh" down "slurmd-$lost_node" >/dev/null
  for _ in $(seq 1 60); do
    [[ $(squeue -h --states=all --jobs="$lost" -o %T) == NODE_FAIL ]] && break
    sleep 2
  done
  sleep 2
  cap squeue-node-fail.txt squeue -h --states=all --jobs="$lost" -o "$SQ_FMT"
  cap sacct-node-fail.txt sacct -P -n --jobs="$lost" --format="$SA_FMT"
  "$repo/deploy/local-cluster.sh" up --quiet
fi

# A drained node: jobs stay pending with reason ReqNodeNotAvail.
node=$(sinfo -h -N -o %N | head -n 1)
scontrol update NodeName="$node" State=DRAIN Reason=capture
drained=$(sb -J tes-drained --wrap true)
sleep 2
cap squeue-node-drained.txt squeue -h --states=all --jobs="$drained" -o "$SQ_FMT"
scancel "$drained"
scontrol update NodeName="$node" State=RESUME
sleep 1
cap sacct-cancelled-while-pending.txt sacct -P -n --jobs="$drained" --format="$SA_FMT"

"$repo/deploy/local-cluster.sh" down slurmctld >/dev/null
cap sbatch-controller-down.txt sbatch --parsable -o /dev/null --wrap true
cap squeue-controller-down.txt squeue -h --states=all --jobs="$ok,$fail" -o "$SQ_FMT"
cap scancel-controller-down.txt scancel "$ok"
cap sacct-controller-down.txt sacct -P -n --jobs="$ok" --format="$SA_FMT"
"$repo/deploy/local-cluster.sh" down slurmdbd >/dev/null
cap sacct-dbd-down.txt sacct -P -n --jobs="$ok" --format="$SA_FMT"
"$repo/deploy/local-cluster.sh" up --quiet
