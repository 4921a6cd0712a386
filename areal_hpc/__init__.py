"""areal-hpc: asynchronous reinforcement learning of LLMs, packaged for Slurm clusters.

The library behind the ``areal-hpc`` command; see README.md for the tour and DESIGN.md for the map.
"""

__version__ = "0.1.0"
