"""`POST /tasks:test-only`: where and when Slurm would start a task, without creating it. The
API checks the task and asks the poller over its relay socket; the poller renders the job
script and hands it to sbatch --test-only (a fake Slurm here; the real one in
tests/cluster/test_client_cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from falcon import testing

from bridge.api.app import create_app
from bridge.config import Config, load_config
from bridge.poller.loop import relay_handler
from bridge.store import Store, TaskFilter
from bridge.system.budget import CallBudget
from bridge.system.relay import RelayServer
from tests.fakes.slurm import FakeSlurm

TASK = {
    "name": "shape",
    "executors": [{"image": "alpine", "command": ["true"]}],
    "resources": {"cpu_cores": 2, "backend_parameters": {"time": "30", "qos": "long"}},
}
#: What sbatch --test-only prints on Slurm 25.11 and later (src/api/allocate.c, its format
#: string: " on cluster C" and a stray " a"), with the line of jobs it would preempt.
LATER_FORM = (
    "sbatch: Job 7 to start at 2026-11-29T14:05:00 on cluster c1 a using 2 processors on "
    "nodes node[1-2] in partition main\nsbatch:   Preempts: 41,42_3\n"
)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})


@pytest.fixture
def slurm() -> FakeSlurm:
    return FakeSlurm()


@pytest.fixture
def poller_relay(config: Config, sqlite_store: Store, slurm: FakeSlurm) -> Iterator[None]:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    relay = RelayServer(config.state_dir, relay_handler(config, sqlite_store, slurm))
    assert relay.start()
    try:
        yield
    finally:
        relay.close()


@pytest.fixture
def client(config: Config, sqlite_store: Store) -> testing.TestClient:
    return testing.TestClient(create_app(config, store=sqlite_store))


def ask_test_only(client: testing.TestClient, body: Any, prefix: str = "/ga4gh/tes/v1") -> Any:
    return client.simulate_post(f"{prefix}/tasks:test-only", json=body)


@pytest.mark.usefixtures("poller_relay")
def test_slurm_says_where_and_when_the_task_would_start_and_nothing_is_created(
    client: testing.TestClient, slurm: FakeSlurm, sqlite_store: Store
) -> None:
    for prefix in ("/ga4gh/tes/v1", "/v1"):
        answer = ask_test_only(client, TASK, prefix)
        assert answer.status_code == 200, answer.text
        assert answer.json == {
            "start_time": "2026-11-29T10:00:00.000000Z",
            "nodes": "n1",
            "processors": 1,
            "partition": "main",
            "slurm": "sbatch: Job 99 to start at 2026-11-29T10:00:00 using 1 processors on "
            "nodes n1 in partition main",
        }
    # The job script the task would get, read by sbatch from stdin, for an id no task has.
    script, extra, user = slurm.tested[-1]
    assert "#SBATCH --cpus-per-task=2" in script and "#SBATCH --time=30" in script
    assert "#SBATCH --qos=long" in script and "#SBATCH --job-name=shape-tes-" in script
    assert (extra, user) == ([], None)
    assert sqlite_store.list_tasks(TaskFilter(), page_size=10)[0] == []
    assert slurm.jobs == {} and slurm.calls == ["sbatch", "sbatch"]

    slurm.test_only_stderr = LATER_FORM
    answer = ask_test_only(client, TASK).json
    assert answer["start_time"] == "2026-11-29T14:05:00.000000Z"
    assert (answer["nodes"], answer["processors"], answer["cluster"]) == ("node[1-2]", 2, "c1")
    assert answer["preempts"] == ["41", "42_3"]


@pytest.mark.usefixtures("poller_relay")
def test_a_task_slurm_would_refuse_is_said_so_and_a_bad_one_is_a_400(
    client: testing.TestClient, slurm: FakeSlurm
) -> None:
    slurm.sbatch_error = (
        "sbatch: error: Batch job submission failed: Requested node configuration is not available"
    )
    answer = ask_test_only(client, TASK)
    assert answer.status_code == 200
    assert "Requested node configuration is not available" in answer.json["refused"]
    bad = ask_test_only(client, {**TASK, "resources": {"backend_parameters": {"time": "soon"}}})
    assert bad.status_code == 400
    assert bad.json["errors"][0]["field"] == "resources.backend_parameters.time"
    assert ask_test_only(client, {"executors": []}).status_code == 400
    assert slurm.tested == []


@pytest.mark.usefixtures("poller_relay")
def test_slurm_is_not_asked_when_the_budget_of_calls_is_spent(
    client: testing.TestClient, slurm: FakeSlurm
) -> None:
    slurm.budget = CallBudget(0.01, 8)
    slurm.budget.take("squeue", 4)  # the poller's own cycle has spent half
    answer = ask_test_only(client, TASK)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "10"
    assert "budget of Slurm calls" in answer.json["message"] and slurm.tested == []


def test_without_a_poller_the_answer_is_a_503_saying_so(client: testing.TestClient) -> None:
    """The poller's absence is no fault of the client's: a documented 503 with Retry-After
    (tests/api/test_fuzz.py accepts it there alone), and only for a task a create would
    accept: a bad one is the create's 400 naming the field, poller or not."""
    answer = ask_test_only(client, TASK)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "10"
    assert "cannot ask Slurm now: the poller does not answer" in answer.json["message"]
    for bad, field in [
        ({**TASK, "resources": {"backend_parameters": {"time": "soon"}}}, "time"),
        ({"executors": [{"image": "alpine", "command": []}]}, "executors[0].command"),
        ({**TASK, "inputs": [{"path": "relative", "content": "x"}]}, "inputs[0].path"),
    ]:
        refused = ask_test_only(client, bad)
        assert refused.status_code == 400, refused.text
        assert refused.json["errors"][0]["field"].endswith(field), refused.json
        assert client.simulate_post("/ga4gh/tes/v1/tasks", json=bad).json == refused.json
    document = client.simulate_get("/ga4gh/tes/v1/openapi.json").json
    documented = document["paths"]["/tasks:test-only"]["post"]["responses"]["503"]
    assert documented["headers"]["Retry-After"]["required"] is True
    assert documented["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


def test_in_site_mode_slurm_is_asked_as_the_owner_with_the_owners_account(
    tmp_path: Path, sqlite_store: Store, slurm: FakeSlurm
) -> None:
    from bridge.poller.context import PollerContext
    from bridge.poller.estimate import StartEstimates
    from bridge.poller.owners import OwnerRunner

    htpasswd = tmp_path / "htpasswd"
    htpasswd.touch()
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
            "site.run_as_owner": True,
            "site.default_account": "lab",
        },
    )
    estimates = StartEstimates(PollerContext(config, sqlite_store, slurm), OwnerRunner(config))
    assert "estimate" in estimates.answer({"kind": "test-only", "task": TASK, "owner": "alice"})
    assert slurm.tested[-1][1:] == (["--account=lab"], "alice")
    ownerless = estimates.answer({"kind": "test-only", "task": TASK, "owner": None})
    assert ownerless["error"] == "bad-request" and len(slurm.tested) == 1
