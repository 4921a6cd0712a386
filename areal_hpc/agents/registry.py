"""``rollout.workflow`` to a workflow object: a built-in by name, or your class by spec, built with
``rollout.workflow_args``."""

from __future__ import annotations

from areal_hpc.errors import UserError
from areal_hpc.plugins import load_object

BUILT_IN = {
    "rlvr": "areal_hpc.agents.rlvr:RLVRWorkflow",
    "multi_turn_math": "areal_hpc.agents.multi_turn_math:MultiTurnMathWorkflow",
    "search": "areal_hpc.agents.search.workflow:SearchAgentWorkflow",
    "calculator": "areal_hpc.agents.calculator:CalculatorWorkflow",
    "python_tool": "areal_hpc.agents.python_tool:PythonToolWorkflow",
    "agents_sdk": "areal_hpc.agents.sdk_agent:AgentsSDKWorkflow",
}


def build_workflow(rollout_cfg):
    name = rollout_cfg.workflow or "rlvr"
    spec = BUILT_IN.get(name, name)
    if ":" not in spec:
        raise UserError(f"config key 'rollout.workflow': {name!r} is neither a built-in ({', '.join(BUILT_IN)}) nor "
                        "'package.module:Class' / 'path/to/file.py:Class'")
    cls = load_object(spec, "rollout.workflow")
    try:
        workflow = cls(**rollout_cfg.workflow_args)
    except TypeError as exc:
        raise UserError(f"config key 'rollout.workflow_args': {dict(rollout_cfg.workflow_args)!r} do not build "
                        f"{name}: {exc}") from None
    if not callable(getattr(workflow, "arun_episode", None)):
        raise UserError(f"config key 'rollout.workflow': {name!r} has no `async def arun_episode(self, engine, "
                        "example)`")
    return workflow
