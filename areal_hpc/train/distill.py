"""On-policy distillation in an RL run (``distill.teacher_url``): the student samples as in RL; before
each update the teacher's server scores the batch's sequences from their first trained token;
``trajectory_batch.build_batch`` carries the scores in the batch and the policy loss (``PPOActor``)
adds ``kl_weight`` x (teacher - proximal logprob) to each trained token's advantage.

The teacher is checked before the run's processes start (``check_teacher``, in the launcher) and again
when the run opens it: reachable, and with the student's tokenizer. Its scores
are logged as ``distill/reverse_kl``: the mean over trained tokens of the sampler's log p minus the
teacher's, the sampled estimate of the per-token reverse KL that distillation pulls down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from areal_hpc import builtins
from areal_hpc.algo.advantages import distillation_advantages
from areal_hpc.config import RunConfig
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.teacher import TeacherClient, check_tokenizer
from areal_hpc.train.trajectory_batch import next_token_values, trajectory_sequence


class Teacher:
    def __init__(self, client: TeacherClient):
        self.client = client

    async def score(
        self, trajectories: list[Trajectory], run_temperature: float
    ) -> tuple[list[list[float]], dict[str, float]]:
        """Per trajectory, the teacher's logprob of each token (entry i: token i; NaN where not asked
        for), and the batch's ``distill/reverse_kl``."""
        sequences = [trajectory_sequence(t, run_temperature) for t in trajectories]
        starts = [
            max(0, next((i for i, m in enumerate(mask) if m), len(tokens) - 1) - 1) for tokens, mask, _, _ in sequences
        ]
        scores = await self.client.score_all([tokens for tokens, _, _, _ in sequences], starts)
        kl_sum, n = 0.0, 0
        for (_, mask, behaviour, _), teacher in zip(sequences, scores):
            targets = next_token_values(mask).bool()
            kl_sum -= float(distillation_advantages(next_token_values(teacher), behaviour, targets).sum())
            n += int(targets.sum())
        return scores, {"distill/reverse_kl": kl_sum / max(n, 1)}


@contextlib.asynccontextmanager
async def open_teacher(cfg: RunConfig, student_tokenizer) -> AsyncIterator[Teacher | None]:
    """The run's teacher, checked (None when distillation is off)."""
    if not cfg.distill.teacher_url:
        yield None
        return
    async with _checked_client(cfg, student_tokenizer) as client:
        yield Teacher(client)


def check_teacher(cfg: RunConfig, reach: bool = True) -> None:
    """Before a distilling run's processes start: the teacher's settings, and with ``reach`` (a local launch; a
    Slurm job's nodes may reach what the login node cannot) the teacher itself, with the student's
    tokenizer when ``model.path`` holds it (a preset model is built later: the run checks it then)."""
    if not reach:
        _checked_token(cfg)
        return
    student = load_tokenizer(cfg.model.path) if cfg.model.path else None

    async def connect() -> None:
        async with _checked_client(cfg, student):
            pass

    asyncio.run(connect())


def _checked_token(cfg: RunConfig) -> str | None:
    """The token the teacher's server asks for (None: none), once the run's settings allow a teacher."""
    if builtins.uses_critic(cfg.actor.adv_estimator):
        raise UserError(
            "distill.teacher_url needs a sequence advantage estimator (one without a critic); "
            f"actor.adv_estimator={cfg.actor.adv_estimator} learns a critic of the reward alone"
        )
    if not cfg.distill.teacher_token_file:
        return None
    try:
        return Path(cfg.distill.teacher_token_file).read_text().strip()
    except OSError as exc:
        raise UserError(f"distill.teacher_token_file={cfg.distill.teacher_token_file}: {exc.strerror}") from None


@contextlib.asynccontextmanager
async def _checked_client(cfg: RunConfig, student_tokenizer) -> AsyncIterator[TeacherClient]:
    """A client of the teacher once it has answered and, given the student's tokenizer, shown the same one."""
    settings = cfg.distill
    async with TeacherClient(settings.teacher_url, _checked_token(cfg), settings.timeout_s) as client:
        reported = await client.model_path()  # it answers
        if student_tokenizer is not None:
            check_tokenizer(
                settings.teacher_tokenizer or reported,
                student_tokenizer,
                "distill.teacher_tokenizer"
                if settings.teacher_tokenizer
                else f"the model_path {settings.teacher_url} reports",
            )
        yield client
