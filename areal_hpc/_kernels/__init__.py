"""Triton kernels, each beside the plain-torch reference it is tested against. The sources live in the
checkout's ``kernels/`` folder (this package's modules link there, and the wheel carries copies); that
folder has no ``__init__.py``, so it never shadows an installed distribution named ``kernels`` (the Hub's
compute-kernels package, which transformers imports when present). Importing a kernel module needs triton;
``import areal_hpc`` does not."""
