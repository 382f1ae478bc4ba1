"""The typed attempt log: the conditions it states are kept by kind, and its stored and wire
forms are the TES task log they always were."""

from __future__ import annotations

from typing import Any

from bridge.core.tes import View, render_task
from bridge.poller.attempt import AttemptLog, Condition, ConditionKind, TaskLogs, failure_logs

PENDING = Condition(ConditionKind.SLURM_PENDING, "Slurm job 7 is pending (Priority)")
ADMISSION = Condition(ConditionKind.ADMISSION, "waiting: 2 jobs of this service are in Slurm")


def wire(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    task = render_task(
        task_id="t", state="QUEUED", document={}, creation_time=None, logs=logs, view=View.FULL
    )
    rendered: list[dict[str, Any]] = task["logs"]
    return rendered


def test_a_condition_is_a_system_logs_line_whose_kind_never_reaches_the_wire():
    entry = AttemptLog()
    entry.add_system_logs(["dropped backend parameter x"])
    entry.set_condition(PENDING)
    stored = entry.to_json()
    assert stored["system_logs"] == ["dropped backend parameter x", PENDING.text]
    assert wire([stored]) == [
        {"logs": [], "outputs": [], "system_logs": ["dropped backend parameter x", PENDING.text]}
    ]
    # Read back, it is the same attempt: an unchanged task is not written again.
    again = AttemptLog.from_json(stored)
    assert again == entry and again.to_json() == stored


def test_a_new_condition_replaces_the_last_whatever_their_wording():
    entry = AttemptLog.from_json(TaskLogs(None).attempt(1).to_json())
    for _ in range(3):
        entry.set_condition(ADMISSION)
        entry.set_condition(PENDING)
        entry = AttemptLog.from_json(entry.to_json())
    assert entry.to_json()["system_logs"] == [PENDING.text]
    tmp_disk = Condition(ConditionKind.TMP_DISK_UNKNOWN, "cannot read the nodes' TmpDisk")
    entry.set_condition(tmp_disk)
    entry.set_condition(tmp_disk)
    assert entry.to_json()["system_logs"] == [tmp_disk.text]
    entry.set_condition(None)
    assert entry.to_json()["system_logs"] == []  # said once, the list stays (empty)


def test_image_notes_are_replaced_beside_the_condition_and_leave_no_empty_list():
    entry = AttemptLog()
    assert entry.set_image_notes(["pulling image a: registry down"])
    entry.set_condition(ADMISSION)
    assert not entry.set_image_notes(["pulling image a: registry down"])
    assert entry.set_image_notes(["pulling image a: retrying in 4 s"])
    assert entry.to_json()["system_logs"] == [ADMISSION.text, "pulling image a: retrying in 4 s"]
    entry.set_condition(None)
    assert entry.set_image_notes([])
    assert "system_logs" not in entry.to_json()


def test_an_attempt_stored_before_the_kinds_has_its_condition_replaced_not_piled_up():
    logs = [{"logs": [], "outputs": [], "system_logs": ["warning", "waiting: for a slot"]}]
    task_logs = TaskLogs(logs)
    task_logs.attempt(1).set_condition(PENDING)
    assert task_logs.to_json()[0]["system_logs"] == ["warning", PENDING.text]
    assert logs[0]["system_logs"] == ["warning", "waiting: for a slot"]  # never changed in place


def test_a_failed_attempt_no_longer_says_what_it_waited_for():
    task_logs = TaskLogs(None)
    task_logs.attempt(1).set_condition(ADMISSION)
    failed = failure_logs(task_logs.to_json(), 1, "Slurm refused the job", "2026-01-01T00:00:00Z")
    assert failed == [
        {
            "logs": [],
            "outputs": [],
            "system_logs": ["Slurm refused the job"],
            "end_time": "2026-01-01T00:00:00Z",
        }
    ]


def test_a_job_that_replaces_a_lost_one_continues_its_entry():
    task_logs = TaskLogs([{"logs": [], "outputs": [], "metadata": {"slurm_job_id": "12"}}])
    assert task_logs.attempt(2) is task_logs.attempt(1)
    assert len(task_logs) == 1
    # Logs stored with one entry per job keep it: attempt 2 is the second entry there.
    earlier = TaskLogs([{"logs": [], "outputs": []}, {"logs": [], "outputs": []}])
    assert earlier.attempt(2) is not earlier.attempt(1)


def test_a_lost_job_leaves_its_id_and_node_and_nothing_else_of_its_own():
    entry = AttemptLog.from_json(
        {
            "logs": [{"exit_code": 0}],
            "outputs": [{"url": "file:///x", "path": "/x", "size_bytes": "1"}],
            "start_time": "2026-01-01T00:00:00Z",
            "end_time": "2026-01-01T00:01:00Z",
            "system_logs": ["Slurm job 12 ended in state NODE_FAIL; submitting it again"],
            "metadata": {"slurm_job_id": "12", "slurm_node": "n1", "slurm_state": "NODE_FAIL"},
        }
    )
    entry.lose_job()
    entry.metadata = {**(entry.metadata or {}), "slurm_job_id": "13", "slurm_node": "n2"}
    entry.lose_job()
    assert entry.to_json() == {
        "logs": [],
        "outputs": [],
        "system_logs": [
            "Slurm job 12 ended in state NODE_FAIL; submitting it again",
            "Slurm job 12 ran on node n1",
            "Slurm job 13 ran on node n2",
        ],
        "metadata": {"slurm_lost_job_ids": "12,13"},
    }


def test_the_job_s_cgroup_cpu_time_and_peak_enter_the_attempt_metadata(tmp_path) -> None:
    """The cgroup's CPU time (for the web page's efficiency) and memory peak, read from the
    job's records, become the attempt's metadata beside sacct's facts."""
    from bridge.job.layout import TaskLayout
    from bridge.job.records import read_records
    from bridge.poller.decisions import fill_attempt_log

    layout = TaskLayout(tmp_path)
    records_dir = layout.records_dir("42")
    records_dir.mkdir(parents=True)
    (records_dir / "memory_peak_bytes").write_text("5242880\n")
    (records_dir / "cpu_usage_usec").write_text("1500000\n")
    records = read_records(tmp_path, "42", keep_bytes=1024)
    assert (records.memory_peak_bytes, records.cpu_usage_usec) == (5242880, 1500000)
    entry = AttemptLog({})
    fill_attempt_log(entry, records, None, final=False)
    metadata = entry.to_json()["metadata"]
    assert metadata["cpu_time_seconds"] == "1.500"
    assert metadata["memory_peak_bytes"] == "5242880"
