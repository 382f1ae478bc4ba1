"""Validation cost of a posted task: pydantic (what the bridge uses) against jsonschema.

Both validate the same document against the same schema (jsonschema gets the JSON Schema that
pydantic generates from bridge.core.tes.TaskModel). Prints microseconds per task and writes
bench/results/validation.json.

    python bench/validation.py
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema

from bridge.core.tes import TaskModel, validate_task

TASK = {
    "name": "align sample 17",
    "inputs": [
        {"url": f"s3://bucket/sample/{i}.fastq.gz", "path": f"/data/in/{i}.fastq.gz"}
        for i in range(5)
    ]
    + [{"content": "x" * 2048, "path": "/data/params.json"}],
    "outputs": [{"url": "s3://bucket/out/", "path": "/data/out", "type": "DIRECTORY"}],
    "resources": {"cpu_cores": 4, "ram_gb": 8, "disk_gb": 20},
    "executors": [
        {
            "image": "quay.io/biocontainers/bwa:0.7.17",
            "command": ["bwa", "mem", "-t", "4"],
            "env": {"A": "1", "B": "2"},
            "stdout": "/data/out/bwa.sam",
        },
        {"image": "quay.io/biocontainers/samtools:1.19", "command": ["samtools", "sort"]},
    ],
    "tags": {"project": "p1", "sample": "17"},
}


def per_call_us(fn: Callable[[], object], rounds: int = 5, number: int = 2000) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main() -> None:
    schema = TaskModel.model_json_schema()
    validator = jsonschema.Draft202012Validator(schema)
    body = json.dumps(TASK)
    results = {
        "pydantic TaskModel.model_validate": per_call_us(lambda: TaskModel.model_validate(TASK)),
        "bridge.core.tes.validate_task (pydantic + nulls, limits, dump)": per_call_us(
            lambda: validate_task(TASK)
        ),
        "jsonschema Draft 2020-12, same schema": per_call_us(
            lambda: list(validator.iter_errors(TASK))
        ),
        "json.loads of the body (reference)": per_call_us(lambda: json.loads(body)),
    }
    print(f"{'validator':62} {'µs/task':>9}")
    for name, micros in results.items():
        print(f"{name:62} {micros:9.1f}")
    out = Path(__file__).parent / "results" / "validation.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "python": platform.python_version(),
                "microseconds_per_task": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
