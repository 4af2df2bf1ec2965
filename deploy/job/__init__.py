"""The job on a node: what runs (payload, plan), how (the runtimes: docker, host), its code
snapshot, secrets, stall policy, the run's record and kept runs, the launch phases, and the
job's lock held while the job is changed."""
