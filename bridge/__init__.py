"""tes-slurm-bridge: a GA4GH Task Execution Service (TES 1.1) server that runs tasks on Slurm."""

__version__ = "0.1.0"
