"""What a job runs on, as data: the SSH fleet's procedures and Python API (fleet/), Slurm's
commands (slurm.py) and its API (slurmjob.py), Kubernetes export (k8s.py); ``choose.api`` picks
an inventory's API. Nothing here prints: the CLI (deploy/cli/) renders what these return."""
