"""OpenAI's request and response shapes: what a chat or completion request may hold (checked, with
OpenAI-style errors naming the parameter), the sampling parameters sent to ``/generate``, and the
replies: whole, or as server-sent events (``stream: true``).
"""

from __future__ import annotations

import json
import re
import reprlib
import secrets
import time

from areal_hpc.algo.temperature import requested_temperature
from areal_hpc.models.chat_families import DEFAULT_FAMILY, FAMILIES, ChatFamily

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error the client caused (or a server one), answered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, value, valid: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param} = {reprlib.repr(value)}; it must be {valid}", param=param, code=code)


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's escape of a UTF-16 surrogate


def check_unicode(raw: bytes, body) -> None:
    """A 400 naming the first field whose text holds a lone UTF-16 surrogate (JSON lets ``"\\ud800"`` through;
    it is no Unicode character, and would fail later, when the text is tokenised or written)."""
    if not SURROGATE_ESCAPE.search(raw):  # UTF-8 bytes cannot hold a surrogate: only an escape makes one
        return
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                text = where or "body"
                raise APIError(
                    400,
                    f"{text} holds a lone UTF-16 surrogate ({value[exc.start]!a}); text must be valid Unicode "
                    "(in JSON, a \\ud800-\\udfff escape only as half of a pair)",
                    param=text,
                    code="invalid_value",
                ) from None
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                todo += [(f"{where}.{key}" if where else key, item), (f"a key of {where or 'body'}", key)]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value)))]


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = (int,) if integer else (int, float)
    if not isinstance(value, kind) or isinstance(value, bool) or not low <= value <= high:
        raise bad(
            name,
            value,
            f"{'an integer' if integer else 'a number'} in [{low}, {high}]",
            "invalid_value" if isinstance(value, kind) and not isinstance(value, bool) else "invalid_type",
        )
    return value


def sampling_params(body: dict, default_max_tokens: int, max_tokens_cap: int, stop_ids: list[int]) -> dict:
    """``/generate``'s sampling_params from an OpenAI request (n=1; stop strings are not supported: the
    model's end-of-turn token ends a reply)."""
    number(body, "n", 1, 1, 1, integer=True)  # one choice per request
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise APIError(
            400,
            f"stop = {reprlib.repr(stop)}: stop strings are not supported (replies end at the "
            "model's end-of-turn token or max_tokens)",
            param="stop",
            code="unsupported_parameter",
        )
    check_unapplied(body)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    temperature = requested_temperature(number(body, "temperature", 1.0, 0.0, 2.0))
    return {
        "max_new_tokens": number(body, limit, default_max_tokens, 1, max_tokens_cap, integer=True),
        "temperature": float(temperature),
        "top_p": float(number(body, "top_p", 1.0, 1e-9, 1.0)),
        "stop_token_ids": stop_ids,
    }


def check_unapplied(body: dict) -> None:
    """OpenAI's fields that would change how tokens are sampled, which the proxy does not apply: each is
    checked as OpenAI checks it (400, invalid), and taken only at its neutral value (400, unsupported)
    otherwise, never ignored: a trajectory's logprobs must be those of the distribution that sampled it."""
    for penalty in ("presence_penalty", "frequency_penalty"):
        if number(body, penalty, 0, -2.0, 2.0):
            raise unapplied(penalty, body[penalty], "0")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias", bias, "an object mapping token ids to numbers in [-100, 100]", "invalid_type")
        for token, value in bias.items():
            if (
                not (token.isascii() and token.isdigit())
                or not isinstance(value, int | float)
                or isinstance(value, bool)
            ):
                raise bad("logit_bias", bias, "an object mapping token ids to numbers in [-100, 100]", "invalid_type")
            if not -100 <= value <= 100:
                raise bad("logit_bias", bias, "an object mapping token ids to numbers in [-100, 100]")
        if bias:
            raise unapplied("logit_bias", bias, "{} or absent")
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise bad(
                "response_format",
                response_format,
                'an object {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", ...}',
                "invalid_type" if not isinstance(response_format, dict) else "invalid_value",
            )
        if kind != "text":
            raise unapplied("response_format", response_format, '{"type": "text"} or absent')


def unapplied(param: str, value, neutral: str) -> APIError:
    return APIError(
        400,
        f"{param} = {reprlib.repr(value)}: not applied here (the proxy samples the model as it is, so that a "
        f"trajectory's logprobs are those of the distribution that sampled it); use {neutral}",
        param=param,
        code="unsupported_parameter",
    )


def messages_of(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", messages, "a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", message, "an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad(f"messages[{i}].content", content, "a string or a list of text parts")
            message["content"] = "".join(p["text"] for p in content)
        elif content is None:
            message["content"] = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", content, "a string or a list of text parts")
    return messages


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description"?: ..., "parameters"?: {...}}}'


def chat_of(body: dict) -> tuple[list[dict], list[dict] | None, dict]:
    """A chat request's messages, the tools the model is offered (None for none, and with tool_choice
    'none') and its chat template's arguments, every field of the request checked (``sampling_params``
    checks the sampling ones)."""
    messages, tools = messages_of(body), tools_of(body)
    choice = tool_choice_of(body, tools)
    flag(body, "parallel_tool_calls")
    number(body, "top_logprobs", 0, 0, 20, integer=True)
    check_common(body)
    return messages, None if choice == "none" else tools, template_args_of(body)


TEMPLATE_INPUTS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"}


def template_args_of(body: dict) -> dict:
    """``chat_template_kwargs`` (vLLM's and SGLang's field): variables the chat template reads, such as
    Qwen3's ``enable_thinking``; never the inputs the proxy gives it."""
    args = body.get("chat_template_kwargs")
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise bad(
            "chat_template_kwargs",
            args,
            'an object of template variables, e.g. {"enable_thinking": false}',
            "invalid_type",
        )
    if TEMPLATE_INPUTS & set(args):
        given = ", ".join(sorted(TEMPLATE_INPUTS & set(args)))
        raise bad("chat_template_kwargs", args, f"an object without {given} (the request's own fields give those)")
    return args


def tools_of(body: dict) -> list[dict] | None:
    """``tools`` as OpenAI takes them: a non-empty list of functions, each named (1-64 letters, digits,
    '_' or '-'), its description a string and its parameters a JSON Schema object when given."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise bad(
            "tools",
            tools,
            f"a non-empty list of tools {TOOL_SHAPE}",
            "invalid_value" if isinstance(tools, list) else "invalid_type",
        )
    named: dict[str, int] = {}  # function name -> the first tool that has it
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, tool, f"an object {TOOL_SHAPE}", "invalid_type")
        if tool.get("type") != "function":
            raise bad(f"{where}.type", tool.get("type"), "'function' (the only kind of tool served here)")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(
                f"{where}.function",
                function,
                "an object with a 'name' (and optionally 'description', 'parameters')",
                "invalid_type",
            )
        if function.get("name") is None:
            raise bad(
                f"{where}.function.name", None, "given: 1-64 letters, digits, '_' or '-'", "missing_required_parameter"
            )
        if not isinstance(function["name"], str) or not TOOL_NAME.fullmatch(function["name"]):
            raise bad(f"{where}.function.name", function["name"], "1-64 letters, digits, '_' or '-'")
        if function["name"] in named:
            raise bad(
                f"{where}.function.name", function["name"], f"unique: tools[{named[function['name']]}] has that name"
            )
        named[function["name"]] = i
        if not isinstance(function.get("description", ""), str):
            raise bad(f"{where}.function.description", function["description"], "a string", "invalid_type")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad(f"{where}.function.parameters", function["parameters"], "a JSON Schema object", "invalid_type")
        if function.get("strict") is not None and type(function["strict"]) is not bool:
            raise bad(f"{where}.function.strict", function["strict"], "true or false", "invalid_type")
    return tools


def tool_choice_of(body: dict, tools: list[dict] | None) -> str:
    """'auto' (the default) or 'none' (the model is not offered the tools). 'required' and a named
    function are refused: the proxy samples the model as it is and cannot force a call."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    named = (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )
    if choice != "required" and not named:
        raise bad(
            "tool_choice", choice, '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
        )
    if tools is None:
        raise bad("tool_choice", choice, "given only with tools (it names how the model uses them)")
    if named and choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
        raise bad("tool_choice", choice, "a function among tools")
    raise APIError(
        400,
        f"tool_choice = {reprlib.repr(choice)}: forcing a tool call is not supported (the proxy "
        "samples the model as it is); use 'auto' or 'none'",
        param="tool_choice",
        code="unsupported_parameter",
    )


def check_common(body: dict) -> None:
    """The fields chats and completions share that change nothing here but must be well formed: seed
    (taken, as OpenAI takes it, without a promise of determinism: the servers do not seed requests),
    user, stream_options."""
    number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", body["user"], "a string", "invalid_type")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or type(options.get("include_usage", False)) is not bool):
        raise bad("stream_options", options, 'an object {"include_usage": true or false}', "invalid_type")


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if type(value) is not bool:
        raise bad(name, value, "true or false", "invalid_type")
    return value


def reply_message(text: str, tools_offered: bool, family: ChatFamily = FAMILIES[DEFAULT_FAMILY]) -> dict:
    """The assistant message of a reply written in ``family``'s format: its reasoning apart as
    ``reasoning_content`` (Qwen3's ``<think>``), and, with tools offered, its calls as ``tool_calls``
    (``<tool_call>`` JSON blocks for ChatML and Qwen; a call the format does not parse stays text)."""
    reasoning, text = family.reasoning(text)
    kept, calls = family.parse_calls(text) if tools_offered else (text, [])
    message: dict = {"role": "assistant", "content": (kept.strip() or None) if calls else text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
            for call in calls
        ]
    return message


def finish_reason(server_reason: str) -> str:
    """OpenAI's finish reason for a rollout server's (an aborted turn is one that ran out of budget)."""
    return "length" if server_reason in ("length", "abort") else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the rollout server's prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_content(token_texts: list[str], logprobs: list[float]) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(token_texts, logprobs)
        ]
    }


def chat_reply(
    interaction_id: str, model: str, message: dict, finish: str, usage_: dict, logprobs: dict | None
) -> dict:
    if message.get("tool_calls") and finish == "stop":
        finish = "tool_calls"
    return {
        "id": interaction_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage_,
    }


def completion_reply(
    interaction_id: str,
    model: str,
    text: str,
    finish: str,
    usage_: dict,
    logprobs: list[float] | None,
    token_texts: list[str],
) -> dict:
    lp = (
        None
        if logprobs is None
        else {"tokens": token_texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}
    )
    return {
        "id": interaction_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        "usage": usage_,
    }


def chat_chunks(
    interaction_id: str,
    model: str,
    pieces: list[str],
    finish: str,
    usage_: dict | None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
):
    """The events of a streamed chat reply: the role, the reasoning (when the reply has it), one chunk per
    piece of text (or, for a reply that calls tools, its text then the calls), the finish reason, then (when
    the client asked for it with stream_options.include_usage) the usage."""
    created = int(time.time())

    def chunk(delta: dict, reason: str | None = None, **extra) -> bytes:
        event = {
            "id": interaction_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
            **extra,
        }
        return sse(event)

    yield chunk({"role": "assistant", "content": ""})
    if reasoning is not None:
        yield chunk({"reasoning_content": reasoning})
    for piece in pieces:
        if piece:
            yield chunk({"content": piece})
    if tool_calls:
        yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
        finish = "tool_calls" if finish == "stop" else finish
    yield chunk({}, finish)
    if usage_ is not None:
        yield sse(
            {
                "id": interaction_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_,
            }
        )
    yield b"data: [DONE]\n\n"


def completion_chunks(interaction_id: str, model: str, pieces: list[str], finish: str):
    created = int(time.time())
    for i, piece in enumerate(pieces + [""]):
        last = i == len(pieces)
        if piece or last:
            yield sse(
                {
                    "id": interaction_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish if last else None}
                    ],
                }
            )
    yield b"data: [DONE]\n\n"


def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def include_usage(body: dict) -> bool:
    return (body.get("stream_options") or {}).get("include_usage") is True
