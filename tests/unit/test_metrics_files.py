"""The metrics files of prometheus_client's multiprocess mode: blocks allocated before they are
mapped, and values kept in memory where a full filesystem cannot hold them (a page it cannot
back would kill the process with SIGBUS)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import values

from bridge.system.metrics import AllocatedValues


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(directory: Path) -> None:
    with open(directory / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 4096)


def _keys(count: int) -> list[str]:
    return [
        f'["tes_bridge_x", "tes_bridge_x_total", {{"route": "/r{i}"}}, "help"]'
        for i in range(count)
    ]


def test_the_library_opens_its_files_through_the_allocating_class(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    value_class = values.MultiProcessValue()
    value = value_class("counter", "c", "c_total", [], [], "help")
    value.inc(1)
    files = list(tmp_path.glob("counter_*.db"))
    assert len(files) == 1
    assert isinstance(value._file, AllocatedValues)
    stat = files[0].stat()
    assert stat.st_size > 0 and stat.st_blocks * 512 >= stat.st_size  # no hole to fault in


def test_a_file_that_grows_is_allocated_before_it_is_mapped(tmp_path):
    values_file = AllocatedValues(str(tmp_path / "counter_1.db"))
    for i, key in enumerate(_keys(1000)):  # past 64 KiB: the file doubles
        values_file.write_value(key, float(i), 0.0)
    stat = (tmp_path / "counter_1.db").stat()
    assert stat.st_size > 1 << 16 and stat.st_blocks * 512 >= stat.st_size
    values_file.close()
    read = dict(
        (k, v)
        for k, v, _, _ in AllocatedValues.read_all_values_from_file(str(tmp_path / "counter_1.db"))
    )
    assert read[_keys(1000)[999]] == 999.0


def test_on_a_full_filesystem_values_stay_in_memory(small_disk, caplog):
    _fill(small_disk)
    values_file = AllocatedValues(str(small_disk / "counter_2.db"))
    for i, key in enumerate(_keys(1000)):
        values_file.write_value(key, float(i), 0.0)
    assert values_file.read_value(_keys(1000)[999]) == (999.0, 0.0)
    assert not (small_disk / "counter_2.db").exists()
    assert "cannot allocate the metrics file" in caplog.text
    values_file.close()


def test_a_file_that_cannot_grow_keeps_its_values_in_memory(small_disk):
    values_file = AllocatedValues(str(small_disk / "counter_3.db"))
    keys = _keys(1000)
    values_file.write_value(keys[0], 1.0, 0.0)
    _fill(small_disk)
    for i, key in enumerate(keys[1:], 1):
        values_file.write_value(key, float(i), 0.0)
    assert values_file.read_value(keys[0]) == (1.0, 0.0)
    assert values_file.read_value(keys[999]) == (999.0, 0.0)
    values_file.close()
    # The file keeps what it had before it could not grow.
    read = dict(
        (k, v)
        for k, v, _, _ in AllocatedValues.read_all_values_from_file(
            str(small_disk / "counter_3.db")
        )
    )
    assert read[keys[0]] == 1.0
