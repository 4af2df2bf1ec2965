"""What is checked before a job starts: the preflight on every node (with the supported
versions) and the network check across them."""
