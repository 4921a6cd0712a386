"""``areal-hpc sweep``: a grid of runs as one Slurm job array (submitit), and the grid's results.

    areal-hpc sweep --config configs/quickstart.yaml [--name NAME] [--parallel N] [--wait] [key=value ...] \\
        sweep.actor.lr=[1e-4,3e-4] sweep.rollout.max_head_offpolicyness=[0,2,4]
    areal-hpc sweep --status <cluster.fileroot>/<experiment.name>/<sweep name> [--wait]

Every point of the cartesian product of the ``sweep.KEY=[...]`` lists (plain ``key=value`` items apply to
every point) is validated before anything is submitted. Each point is its own trial,
``experiment.trial=<sweep name>/<point name>``, run by one array element: a ``SweepTrial`` (submitit
``Checkpointable``) that runs the local launcher in its allocation with ``--resume=auto``. On SIGUSR2
the launcher has the trainer save, then submitit requeues the same call, which resumes. The sweep
folder holds ``sweep.json``, submitit's logs (``submitit/``) and, once every point has finished,
``results.csv``, ``results.md`` and ``results.png``.

Simplifications: an element is one task on one node of ``slurm.trainer.partition`` (trainer ranks and
rollout servers side by side, CPUs for all of them: the most any point needs); ``slurm.*`` settings
are shared by the whole array, so they cannot be swept.

Modules, one job each: ``cli`` (the subcommand's arguments and what it runs), ``grid`` (``sweep.KEY=[...]``
items into validated, named points), ``submit`` (the points as one job array, ``sweep.json``) and
``results`` (each point's state, then the results table, CSV, Markdown and plot).
"""
