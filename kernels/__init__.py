"""Triton kernels, each beside the plain-torch reference it is tested against. The library imports this
folder as ``areal_hpc._kernels`` (``areal_hpc/_kernels`` links here, and the wheel carries a copy), never
as a top-level ``kernels``; importing a kernel module needs triton, ``import areal_hpc`` does not."""
