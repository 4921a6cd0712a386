"""The run's plumbing that every role shares (trainer ranks, rollout servers, the proxy, the launchers):
who and where a process is (bootstrap), rendezvous stores, name-resolve on the shared filesystem, the run
token, supervised child processes, and the run state launchers read (exit codes, latest checkpoint).
Imports nothing above ``errors``/``fsio``; see docs/architecture.md."""
