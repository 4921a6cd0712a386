"""What a launcher tells every role it starts, through the environment: which run the process belongs
to and when the run and its trainer ranks were launched (the driver reports its first rollout
against those times). Read by roles, written by launchers; nothing here imports either side."""

RUN_MARKER = "AREAL_HPC_RUN"  # in every child's environment: which run a process belongs to
LAUNCHED_AT = "AREAL_HPC_LAUNCHED_AT"  # wall-clock time of the launch
TRAINERS_AT = "AREAL_HPC_TRAINERS_AT"  # wall-clock start of the trainer ranks (after any SFT warm-up)
