"""Tests of the package's top-level modules: ``config.py``, ``resolve.py``, ``builtins.py``, ``cli.py``'s table, ..."""
