"""``rollout.workflow`` to a workflow object: a built-in by name or your class by spec (``builtins.load``),
built with ``rollout.workflow_args``."""

from __future__ import annotations

from areal_hpc import builtins
from areal_hpc.errors import UserError


def build_workflow(rollout_cfg):
    name = rollout_cfg.workflow or builtins.POINTS["workflow"].default
    cls = builtins.load("workflow", name)
    try:
        workflow = cls(**rollout_cfg.workflow_args)
    except TypeError as exc:
        raise UserError(
            f"config key 'rollout.workflow_args': {dict(rollout_cfg.workflow_args)!r} do not build {name}: {exc}"
        ) from None
    if not callable(getattr(workflow, "arun_episode", None)):
        raise UserError(
            f"config key 'rollout.workflow': {name!r} has no `async def arun_episode(self, engine, example)`"
        )
    return workflow
