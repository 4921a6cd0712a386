"""Tests of the Triton kernels in ``kernels/`` against their plain-torch references."""
