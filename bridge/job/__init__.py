"""The compute-node side of a task: staging, running executors safely, and the job's records.

Runs inside a Slurm job on a node that has neither the database nor the API, so nothing here
imports the store, the API or the poller. Everything it needs comes from the task directory:
``task.json`` (the task document) and ``job-config.json`` (the settings the renderer copied from
the login node's configuration).
"""
