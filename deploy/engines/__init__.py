"""The engines a job runs on, behind one interface (engine.py): the SSH fleet (engine_fleet.py,
its procedures and Python API in fleet/) and Slurm (engine_slurm.py, its commands in
slurm.py); Kubernetes export (k8s.py); ``choose`` picks the engine of an inventory; render.py
shows what the verbs return, as text."""
