"""The cluster tests' release subset: what CI runs again on every other Slurm release.

CI runs the whole suite on one Slurm release and, on each of the others the local cluster offers
(``LOCAL_CLUSTER_SLURM``), the tests named here (``pytest -m releases tests/cluster``): every state
and exit-code path on the real cluster, arrays, the cancel record, preemption, a lost node, the
crash window, Slurm's own rate limit, the Nextflow replay and Snakemake 7. A whole module is
named by its file name, a test by ``file::name``.
"""

from __future__ import annotations

import pytest

RELEASE_SUBSET: frozenset[str] = frozenset(
    {
        # The Slurm client against each release's real commands.
        "test_local_cluster.py::test_job_shows_in_squeue_then_sacct_reports_state_and_exit_code",
        "test_local_cluster.py::test_client_submit_queue_accounting_and_find_by_names",
        "test_local_cluster.py::test_client_cancel",
        "test_local_cluster.py::test_client_rejects_a_job_no_node_can_run",
        "test_local_cluster.py::test_client_reports_slurmctld_down_as_unavailable",
        "test_local_cluster.py::test_client_reports_slurmdbd_down_as_unavailable",
        "test_local_cluster.py::test_many_ids_are_looked_up_by_user_with_the_same_answer",
        # States and exit codes.
        "test_slurm_releases.py",
        "test_execution.py::test_echo_hello_completes_with_its_output",
        "test_execution.py::test_missing_command_is_an_executor_error",
        "test_execution.py::test_first_executor_failing_stops_unless_ignore_error",
        "test_hpc.py::test_a_task_over_its_time_limit_ends_naming_the_limit",
        "test_hpc.py::test_an_executor_over_its_memory_is_killed_naming_the_limit_and_peak",
        "test_hpc.py::test_a_gpu_task_gets_its_gpus_from_slurm",
        "test_hpc.py::test_a_qos_submit_limit_keeps_tasks_queued_not_failed",
        "test_hpc.py::test_capabilities_show_the_clusters_partitions",
        "test_reliability.py::test_finished_tasks_carry_the_final_slurm_facts",
        "test_reliability.py::test_a_job_whose_script_is_killed_from_outside_runs_again",
        # Cancel and its record.
        "test_execution.py::test_a_task_canceled_while_its_executor_runs_gets_its_jobs_final_record",
        "test_execution.py::test_a_job_cancelled_in_slurm_by_an_operator_ends_its_task_canceled",
        # Arrays.
        "test_arrays_cluster.py::test_fifty_tasks_of_one_shape_are_one_array_each_with_its_own_outputs",
        "test_arrays_cluster.py::test_canceling_one_element_cancels_only_its_task",
        # Preemption.
        "test_preemption.py",
        # A lost node (under an array: its elements run again elsewhere, the others go on).
        "test_arrays_cluster.py::test_a_node_lost_under_an_array_retries_only_its_elements_elsewhere",
        # The crash window, and Slurm away.
        "test_execution.py::test_poller_killed_while_tasks_run_loses_nothing_and_submits_nothing_twice",
        "test_reliability.py::test_poller_killed_anywhere_in_a_slow_sbatch_submits_each_attempt_once",
        # Engines.
        "test_nextflow_wire.py::test_the_body_is_what_the_plugin_posts_and_the_server_keeps_it",
        "test_nextflow_wire.py::test_a_failing_script_is_read_as_its_exit_code",
        "test_nextflow_wire.py::test_a_task_nextflow_kills_is_canceled",
        "test_engines.py::test_snakemake7_with_its_tes_executor",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "releases: the subset CI runs on every Slurm release (tests/cluster/conftest.py)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # That every name here is a test is checked in tests/unit/test_release_subset.py.
    for item in items:
        module = item.path.name
        test = f"{module}::{getattr(item, 'originalname', item.name)}"
        if module in RELEASE_SUBSET or test in RELEASE_SUBSET:
            item.add_marker(pytest.mark.releases)
