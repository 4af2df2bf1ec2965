"""A regression example laid out as a package, run with `python -m regress.train`."""
