"""Tests of the benchmark scripts in ``bench/``: their dry runs and the claims they rest on."""
