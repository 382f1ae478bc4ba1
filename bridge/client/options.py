"""Options of `tes-bridge task` as Slurm users write them: sizes with sbatch's units (`4G`,
`500M`), and a "did you mean" for an option a command does not have (sbatch's own spellings
of what this client spells otherwise, or a near miss)."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Iterable, Sequence

_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)([KMGT]?)(?:I?B)?$")
#: sbatch's size units (`--mem`, `--tmp`) in GB as TES counts them: the bridge reads `ram_gb`
#: as GiB (`--mem` is ram_gb * 1024 MB), so 4G is 4 and 4096M is 4 too.
_GIGABYTES = {"K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}


def size_option(default_unit: str) -> Callable[[str], float]:
    """An argparse type: a size in GB from `4`, `1.5` (in `default_unit`: G for this client's
    own options, M for sbatch's spellings), or with a unit as sbatch takes it (`512M`, `4G`,
    `1.5T`, `4GB`; any case)."""

    def parse(value: str) -> float:
        match = _SIZE.fullmatch(value.strip().upper())
        if not match:
            raise argparse.ArgumentTypeError(
                f"{value!r}: expected a size: a number ({default_unit}B) or a number with a "
                "unit, K, M, G or T (512M, 4G)"
            )
        return float(match.group(1)) * _GIGABYTES[match.group(2) or default_unit]

    parse.__name__ = "size"  # argparse names the type in its error message
    return parse


#: sbatch's options that this client spells otherwise (`-c`, `--cpus-per-task`, `--mem`,
#: `--tmp`, `-t` and `-p` are its own).
SBATCH_SPELLINGS = {
    "--job-name": "--name",
    "-J": "--name",
    "--chdir": "--workdir",
    "-D": "--workdir",
    "--export": "--env",
    "--gpus-per-task": "--backend-parameter gpus_per_task=[TYPE:]N",
    "--gres": "--backend-parameter gres=GRES",
    "--qos": "--backend-parameter qos=QOS",
    "-q": "--backend-parameter qos=QOS",
    "--account": "--backend-parameter account=NAME",
    "-A": "--backend-parameter account=NAME",
    "--constraint": "--backend-parameter constraint=FEATURES",
    "-C": "--backend-parameter constraint=FEATURES",
    "--reservation": "--backend-parameter reservation=NAME",
    "--time-min": "--time",
}


def suggestion(word: str, options: Iterable[str]) -> str | None:
    """What an unknown option `word` (`--mme`, `--qos=long`) was likely meant to be among
    `options`, the command's own; None when nothing comes close."""
    flag = word.split("=", 1)[0]
    known = sorted(options)
    spelled = SBATCH_SPELLINGS.get(flag)
    if spelled and spelled.split()[0] in known:
        return spelled
    close = difflib.get_close_matches(flag, [o for o in known if o.startswith("--")], n=1)
    return close[0] if close else None


def unrecognized(words: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message for `parser`, with a "did you mean" for
    each unknown option that comes close to one of its own."""
    options = [o for action in parser._actions for o in action.option_strings]
    hints = [
        f"{hint} (for {word})"
        for word in words
        if word.startswith("-") and (hint := suggestion(word, options))
    ]
    message = f"unrecognized arguments: {' '.join(words)}"
    return f"{message}; did you mean {', '.join(hints)}?" if hints else message
