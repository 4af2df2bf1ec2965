"""Observing a job: each node's state as a view, its first failure, every rank's stack when it
hangs (doctor), and the metrics plot."""
