"""The script of a job array: tasks whose job scripts ask Slurm for the same go to Slurm as one
`sbatch --array=0-N`. Each task keeps its own directory and job script (bridge.jobscript.render);
the array's script holds only their shared `#SBATCH` options and the manifest, the task
directories by element, and runs element I's job script as the job `ARRAY_I`
(templates/array.sh.j2). Staged tasks (bridge.jobscript.parts) go as three arrays, one per
part, each element running its task's script of that part."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from bridge.config import Config
from bridge.core.naming import AFTER_ARG, NO_RECORDS_EXIT_CODE
from bridge.job.layout import SCRIPT, SLURM_OUTPUT
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


def render_array_script(
    *,
    config: Config,
    shared: Sequence[str],
    task_dirs: Sequence[Path],
    indexes: Sequence[int] | None = None,
    script: str = SCRIPT,
) -> str:
    """The array's script for these task directories: element I runs the I-th's `script` (a
    staged task's part: bridge.jobscript.parts.PART_SCRIPTS), or with `indexes`, element
    `indexes[n]` the n-th's (the later arrays of staged tasks submitted again after a crash
    keep their elements' indexes, which `aftercorr` pairs with the first array's)."""
    if not task_dirs:
        raise RenderError("an array needs at least one task")
    numbers = list(range(len(task_dirs)) if indexes is None else indexes)
    if len(numbers) != len(task_dirs) or len(set(numbers)) != len(numbers):
        raise RenderError("an array needs one distinct index per task")
    prefix, _, suffix = SLURM_OUTPUT.partition("%j")
    directives = [*shared, "--output=/dev/null"]
    template = environment(config).get_template(ARRAY_TEMPLATE)
    return template.render(
        directives=directives,
        task_dirs=[(n, str(d)) for n, d in zip(numbers, task_dirs, strict=True)],
        script=script,
        after_arg=AFTER_ARG,
        output_prefix=prefix,
        output_suffix=suffix,
        no_records_exit_code=NO_RECORDS_EXIT_CODE,
    )
