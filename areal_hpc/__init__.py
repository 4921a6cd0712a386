"""areal-hpc: asynchronous reinforcement learning of LLMs, packaged for Slurm clusters.

The library behind the ``areal-hpc`` command; see README.md for the tour and docs/architecture.md for the map
(the floors, what each package owns, which way imports go).
"""

__version__ = "0.1.0"
