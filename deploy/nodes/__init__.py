"""Talking to the nodes: the transports (SSH, local), one node's connection, and the fan-out that
runs a command on many nodes at once (``Remote``)."""
