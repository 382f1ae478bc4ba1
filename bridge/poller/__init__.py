"""The poller: the one process that talks to Slurm.

Each cycle it
1. finds again the jobs of submissions that were interrupted (a crash between `sbatch` and the
   database write, or an `sbatch` that failed without an answer) by their job name, so a task
   is never submitted twice;
2. submits QUEUED tasks whose images are in the cache (pulls run in the background);
3. asks Slurm about every active job with one `squeue` call, and one `sacct` call for the jobs
   that left the queue, reads each job's own records, and moves tasks to their TES state;
4. carries out cancels recorded by the API (one `scancel` for all of them);
5. now and then removes old task directories.

Every Slurm command spends the client's budget of calls (`SlurmClient.budget`): a step that
finds it low leaves its work for a later cycle (submissions, the follow's reads, the
capabilities' sinfo) and a command waits for its tokens; nothing fails for it.

One poller acts per store: with SQLite it holds a lock file in the state directory (one node);
with PostgreSQL every node may run one, and the one holding the lease leads (``lease``).

Modules: ``attempt`` (a task's logs: the typed attempt log and the conditions it states while
they last), ``decisions`` (pure: the TES state and logs from Slurm and the job's records),
``watch`` (what Slurm and the jobs said, read once per cycle), ``recover``, ``submit``,
``follow``, ``cancel`` and ``cleanup`` (the steps above, each a small collaborator), ``owners``
(site mode's commands as each task's owner), ``context`` (what they share), ``lease`` (the
election on PostgreSQL) and ``loop`` (the cycle, the lock, the factory and the process loop).
"""

from __future__ import annotations

from bridge.core.naming import job_name
from bridge.poller.context import CycleStats
from bridge.poller.decisions import Decision, decide
from bridge.poller.loop import Poller, PollerLock, build_poller, run_poller

__all__ = [
    "CycleStats",
    "Decision",
    "Poller",
    "PollerLock",
    "build_poller",
    "decide",
    "job_name",
    "run_poller",
]
