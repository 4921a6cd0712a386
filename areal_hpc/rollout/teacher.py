"""The teacher of on-policy distillation: a server (``areal-hpc serve`` or SGLang) that scores the
student's sequences through SGLang's scoring path, ``/generate`` with ``max_new_tokens`` 0,
``return_logprob`` and ``logprob_start_len``: nothing is generated, and each requested position comes
back with ``log p_teacher(token | the tokens before it)`` at temperature 1.

A logprob is about a token id, so the teacher must share the student's tokenizer: ``check_tokenizer``
compares the two vocabularies (every token string and its id) before a run starts.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp

from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_tokenizer


class TeacherClient:
    """Scores sequences on one teacher server; ``async with`` opens and closes its connections."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 300.0, max_requests: int = 16):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_requests = max_requests
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> TeacherClient:
        self.session = aiohttp.ClientSession(
            headers=self.headers, timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self.max_requests)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def _request(self, method: str, route: str, body: dict | None = None):
        try:
            async with self.session.request(method, self.url + route, json=body) as response:
                reply = await response.json(content_type=None)
                if response.status != 200:
                    message = reply.get("error", {}).get("message", reply) if isinstance(reply, dict) else reply
                    raise UserError(f"the teacher at {self.url}{route} answered {response.status}: {message}")
                return reply
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UserError(
                f"the teacher at {self.url} cannot be reached ({type(exc).__name__}: {exc}); check distill.teacher_url"
            ) from None

    async def model_path(self) -> str:
        """The model folder the teacher's server reports (SGLang's and ours: /get_model_info)."""
        return (await self._request("GET", "/get_model_info"))["model_path"]

    async def score(self, sequence: list[int], start: int) -> list[float]:
        """The teacher's logprob of every token of ``sequence``: entry i is log p(token i | tokens < i)
        for i > ``start``, NaN up to ``start`` (not asked for; token 0 has none)."""
        reply = await self._request(
            "POST",
            "/generate",
            {
                "input_ids": sequence,
                "return_logprob": True,
                "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0},
            },
        )
        entries = reply["meta_info"]["input_token_logprobs"]
        if [token for _, token, _ in entries] != sequence[start:]:
            raise UserError(
                f"the teacher at {self.url} scored other tokens than it was sent: is it an SGLang-compatible /generate?"
            )
        return [math.nan] * (start + 1) + [float(lp) for lp, _, _ in entries[1:]]

    async def score_all(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        return list(await asyncio.gather(*(self.score(s, k) for s, k in zip(sequences, starts))))


def check_tokenizer(teacher_dir: str, student_tokenizer, where: str) -> None:
    """Refuse a teacher whose vocabulary differs from the student's, in one line naming ``where``."""
    try:
        teacher = load_tokenizer(teacher_dir)
    except (OSError, ValueError, UserError) as exc:
        raise UserError(
            f"cannot read the teacher's tokenizer at {teacher_dir} ({where}): "
            f"{str(exc).splitlines()[0]}; set distill.teacher_tokenizer to a local copy"
        ) from None
    theirs, ours = teacher.get_vocab(), student_tokenizer.get_vocab()
    if theirs != ours:
        differing = sorted(set(theirs.items()) ^ set(ours.items()))
        raise UserError(
            f"the teacher's tokenizer ({teacher_dir}) is not the student's: {len(theirs)} tokens against "
            f"{len(ours)}, {len(differing)} (token, id) pairs differ (e.g. {differing[0]!r}); its "
            "logprobs would not be of the student's tokens"
        )
