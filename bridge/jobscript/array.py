"""The script of a job array: tasks whose job scripts ask Slurm for the same go to Slurm as one
`sbatch --array=0-N`. Each task keeps its own directory and job script (bridge.jobscript.render);
the array's script holds only their shared `#SBATCH` options and the manifest, the task
directories in element order, and runs element I's job script as the job `ARRAY_I`
(templates/array.sh.j2)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from bridge.config import Config
from bridge.core.naming import NO_RECORDS_EXIT_CODE
from bridge.job.layout import SLURM_OUTPUT
from bridge.jobscript.render import environment
from bridge.jobscript.task import RenderError

ARRAY_TEMPLATE = "array.sh.j2"
#: The directives that differ from task to task: each element sets them itself (its job
#: script's own name is left out: the array's name maps its elements back to their tasks).
PER_TASK_OPTIONS = ("--job-name=", "--output=", "--chdir=")
_DIRECTIVE = re.compile(r"#SBATCH (.*)")


def read_directives(script: Path) -> list[str]:
    """The `#SBATCH` options at the head of a rendered job script, in order."""
    directives: list[str] = []
    with script.open(encoding="utf-8") as lines:
        for line in lines:
            if line.startswith("#!"):
                continue
            match = _DIRECTIVE.fullmatch(line.rstrip("\n"))
            if match is None:
                break
            directives.append(match.group(1))
    return directives


def shape(directives: Sequence[str]) -> tuple[str, ...]:
    """What a job asks Slurm for, without what is its own: jobs of one shape may be one array."""
    return tuple(d for d in directives if not d.startswith(PER_TASK_OPTIONS))


def render_array_script(*, config: Config, shared: Sequence[str], task_dirs: Sequence[Path]) -> str:
    """The array's script for these task directories (element I runs the I-th)."""
    if not task_dirs:
        raise RenderError("an array needs at least one task")
    prefix, _, suffix = SLURM_OUTPUT.partition("%j")
    directives = [*shared, "--output=/dev/null"]
    template = environment(config).get_template(ARRAY_TEMPLATE)
    return template.render(
        directives=directives,
        task_dirs=[str(d) for d in task_dirs],
        output_prefix=prefix,
        output_suffix=suffix,
        no_records_exit_code=NO_RECORDS_EXIT_CODE,
    )
