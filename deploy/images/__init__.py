"""The image: its build, the survey of what each node holds, the local cache and OCI layout,
and the three ways it travels to the nodes (star, chain, registry); ``deploy``'s steps."""
