"""HTTP front of the embedded engine: SGLang's native routes and response shapes, on aiohttp.

    areal-hpc serve backend=embedded model.path=DIR port=30000

Bad requests get a 4xx JSON body ``{"error": {"message": ..., "code": ...}}`` and the server keeps
serving; a request the engine fails is a 500 for that request only. Flags are JSON booleans (the
string "no" is not false). The address is registered in name-resolve (``rollout/servers/<host:port>``,
its heartbeat refreshed in the background) while it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import reprlib
import sys
import uuid
from pathlib import Path

import torch
from aiohttp import web

from areal_hpc.models.hf import DTYPES
from areal_hpc.parallel.weight_group import WeightChannel, broadcast_tensor, join_update_group
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, RequestError, Result, SamplingParams

GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream"}
ENGINE = web.AppKey("engine", EmbeddedGenerator)
STATE = web.AppKey("state", dict)
TOKEN = web.AppKey("token", str)
DEFAULT_GROUP = "weight_update_group"  # SGLang's, for requests that name no update group
OPEN_ROUTES = {"/health", "/health_generate"}  # liveness probes need no token and reveal nothing
# Prompts one /generate call may carry: a larger batch is refused (400) rather than queued for minutes; the
# engine admits a call's prompts beside other callers' (embedded_engine), so a call at the limit delays no one.
MAX_PROMPTS_PER_CALL = 4096


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object (UTF-8, as JSON is; a declared charset is not trusted)."""
    try:
        body = json.loads(await request.read()) if request.can_read_body else {}
    except json.JSONDecodeError as exc:
        raise RequestError(f"body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise RequestError(f"body is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise RequestError(f"body is not valid JSON ({exc})") from None
    except RecursionError:
        raise RequestError(f"body nests arrays or objects too deeply (limit about {sys.getrecursionlimit()})") from None
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    return body


def flag(body: dict, name: str) -> bool:
    """A boolean field (default false): anything but true/false is refused, not read as truthy."""
    value = body.get(name, False)
    if type(value) is not bool:
        raise RequestError(f"{name} = {reprlib.repr(value)}; it must be true or false")
    return value


@web.middleware
async def token_required(request: web.Request, handler):
    """Every route but the health probes needs the run's token (rollout_token.py) when one is set."""
    expected = f"Bearer {request.app[TOKEN]}".encode()
    # the header's bytes as sent: aiohttp hands bytes that are not UTF-8 over as surrogates
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    if request.path not in OPEN_ROUTES and not hmac.compare_digest(given, expected):
        return error(
            401,
            "this server needs the run's rollout token: 'Authorization: Bearer <token>' (<run folder>/rollout_token)",
        )
    return await handler(request)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as exc:
        return error(400, str(exc))
    except web.HTTPException as exc:  # aiohttp's own 404/405/413: same JSON shape
        return error(exc.status, exc.reason)
    except Exception as exc:
        logging.getLogger(__name__).exception("%s failed", request.path)
        return error(500, f"{type(exc).__name__}: {exc}")


async def generate(request: web.Request) -> web.Response:
    """SGLang's /generate on token ids: ``input_ids`` (one prompt or a list), ``sampling_params`` (for a
    list of prompts: one object for all, or a list of one per prompt), ``return_logprob``, ``rid``. Each
    answer has ``output_ids``, ``meta_info.finish_reason``, ``cached_tokens`` (prompt tokens the prefix cache
    held), ``weight_version`` and
    ``output_token_versions`` (the weight version of each token) and, with
    return_logprob, ``output_token_logprobs`` as ``[logprob, token, null]``: the token's logprob under
    ``log_softmax(logits / temperature)``, the whole tempered distribution before top-p/top-k
    truncation; with temperature 0 (greedy) under ``log_softmax(logits)``, i.e. at temperature 1.
    With return_logprob and ``logprob_start_len`` k >= 0 (default -1: output logprobs only), also
    ``input_token_logprobs``: one ``[logprob, token, null]`` per prompt position k.., the first logprob
    null, the others ``log_softmax(logits)`` of the prompt's own tokens (SGLang's scoring path; with
    ``max_new_tokens`` 0 nothing is generated). A call carries at most ``MAX_PROMPTS_PER_CALL`` prompts,
    admitted in turn with other calls' (one source each), so other callers keep their latency."""
    body = await read_json(request)
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if "text" in body:
        raise RequestError("text prompts are not supported: send input_ids (tokenize on the client)")
    if unknown:
        raise RequestError(f"unknown fields {unknown}; /generate takes {sorted(GENERATE_FIELDS)}")
    if flag(body, "stream"):
        raise RequestError("stream=true is not supported by the embedded engine")
    return_logprob = flag(body, "return_logprob")
    prompts, batched = _prompts(body.get("input_ids"))
    start = _logprob_start(body.get("logprob_start_len", -1), prompts)
    params = _sampling_params(body.get("sampling_params"), len(prompts), batched)
    rids = body.get("rid") or [uuid.uuid4().hex for _ in prompts]
    rids = [rids] if isinstance(rids, str) else rids
    if not isinstance(rids, list) or len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
        raise RequestError("rid must be a string (or a list of strings, one per prompt)")
    engine = request.app[ENGINE]
    for prompt, sampling in zip(prompts, params):  # all or nothing: refuse the batch before any prompt is queued
        engine.check(prompt, sampling)
    source = uuid.uuid4().hex
    runs = [
        asyncio.ensure_future(engine.generate(rid, ids, sampling, source))
        for rid, ids, sampling in zip(rids, prompts, params)
    ]
    try:
        results = await asyncio.gather(*runs)
    finally:  # one prompt failed (or the client left): abort the batch's others, they have no reader
        for run in runs:
            run.cancel()
    scores = [None] * len(prompts)
    if return_logprob and start >= 0:
        scores = await asyncio.gather(*(asyncio.wrap_future(engine.score(p, start)) for p in prompts))
    out = [
        _sglang_response(r, request.app[STATE]["tokenizer"], return_logprob, prompt, start, score)
        for r, prompt, score in zip(results, prompts, scores)
    ]
    return web.json_response(out if batched else out[0])


def _prompts(input_ids) -> tuple[list[list[int]], bool]:
    if isinstance(input_ids, list) and input_ids and all(isinstance(p, list) for p in input_ids):
        prompts, batched = input_ids, True
    else:
        prompts, batched = [input_ids], False
    if len(prompts) > MAX_PROMPTS_PER_CALL:
        raise RequestError(
            f"input_ids holds {len(prompts)} prompts; one /generate call takes at most {MAX_PROMPTS_PER_CALL} "
            "(send the rest in further calls)"
        )
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(type(t) is int and t >= 0 for t in prompt):
            raise RequestError("input_ids must be a list of non-negative integers (or a list of such lists)")
    return prompts, batched


def _logprob_start(given, prompts: list[list[int]]) -> int:
    """``logprob_start_len``: -1 (output logprobs only) or a position inside every prompt."""
    shortest = min(len(p) for p in prompts)
    if type(given) is not int or not -1 <= given < shortest:
        raise RequestError(
            f"logprob_start_len = {reprlib.repr(given)}; it must be -1 (output logprobs only) or a "
            f"prompt position in [0, {shortest - 1}]"
        )
    return given


def _sampling_params(given, n: int, batched: bool) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: a batch may give one object for all, or a list (SGLang's forms)."""
    if not batched or not isinstance(given, list):
        return [SamplingParams.from_json(given)] * n
    if len(given) != n:
        raise RequestError(f"sampling_params is a list of {len(given)}; give one object, or one per prompt ({n})")
    return [SamplingParams.from_json(p) for p in given]


def _sglang_response(
    result: Result, tokenizer, return_logprob: bool, prompt: list[int], start: int, score: list[float | None] | None
) -> dict:
    finish = {"type": result.finish_reason}
    if result.finish_reason == "stop":
        finish["matched"] = result.matched_stop
    elif result.finish_reason == "length":
        finish["length"] = len(result.output_ids)
    meta = {
        "id": result.rid,
        "finish_reason": finish,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": str(result.weight_version),
        "output_token_versions": result.versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
    if score is not None:
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(score, prompt[start:])]
    text = tokenizer.decode(result.output_ids) if tokenizer is not None else ""
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


async def health(request: web.Request) -> web.Response:
    """200 while the engine generates; 503 with the error since its last generation failed (weights gone
    bad, a device fault), until a token is generated again: a probe then takes the server out of rotation."""
    failing = request.app[ENGINE].failing
    if failing is not None:
        return web.json_response({"status": "failing", "error": failing}, status=503)
    return web.json_response({"status": "ok"})


async def model_info(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE], request.app[STATE]
    return web.json_response(
        {
            "model_path": state["model_path"],
            "is_generation": True,
            "weight_version": str(engine.version),
            "context_length": engine.context_length,
            "max_running_requests": engine.decoder.slots,
            "paused": engine.paused,
            "running_requests": engine.running,
            "waiting_requests": engine.waiting,
            "forward_passes": engine.forward_passes,
            "prompt_tokens_prefilled": engine.prompt_tokens["prefilled"],
            "prompt_tokens_cached": engine.prompt_tokens["cached"],
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """SGLang's /get_server_info, the fields a trainer reads: one rank per server in an update group."""
    engine, state = request.app[ENGINE], request.app[STATE]
    return web.json_response(
        {
            "model_path": state["model_path"],
            "tp_size": 1,
            "dp_size": 1,
            "max_running_requests": engine.decoder.slots,
            "context_length": engine.context_length,
        }
    )


async def pause_generation(request: web.Request) -> web.Response:
    mode = (await read_json(request)).get("mode", "abort")
    if mode != "abort":
        raise RequestError(
            f"pause mode {reprlib.repr(mode)} is not supported; the embedded engine pauses with mode 'abort'"
        )
    await asyncio.wrap_future(request.app[ENGINE].pause())
    return web.json_response({"success": True})


async def continue_generation(request: web.Request) -> web.Response:
    await asyncio.wrap_future(request.app[ENGINE].resume())
    return web.json_response({"success": True})


async def abort_request(request: web.Request) -> web.Response:
    body = await read_json(request)
    abort_all = flag(body, "abort_all")
    if not abort_all and not isinstance(body.get("rid"), str):
        raise RequestError(f"rid = {reprlib.repr(body.get('rid'))}; give rid (a string) or abort_all=true")
    await asyncio.wrap_future(request.app[ENGINE].abort(None if abort_all else body["rid"]))
    return web.json_response({"success": True})


async def flush_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache (weight updates do it themselves)."""
    await asyncio.wrap_future(request.app[ENGINE].flush_cache())
    return web.json_response({"success": True})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """Load a safetensors checkpoint holding every tensor of the served model, all or nothing."""
    body = await read_json(request)
    path, version = body.get("model_path"), _version(body)
    if not isinstance(path, str) or not Path(path).is_dir():
        raise RequestError(f"model_path {reprlib.repr(path)} is not a folder")
    engine = request.app[ENGINE]
    await asyncio.wrap_future(await asyncio.to_thread(engine.update_weights_from_disk, path, version))
    return web.json_response({"success": True, "message": f"loaded {path}", "weight_version": str(engine.version)})


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's update group as rank ``rank_offset`` (one TP rank: ``rank_offset + 0``), set up
    as SGLang's ranks are (parallel/weight_group.py); a group joined before (a trainer since restarted,
    or one re-forming its group without a server that died) is closed first."""
    body = await read_json(request)
    args = dict(
        backend=body.get("backend", "gloo"),
        master_address=body.get("master_address"),
        master_port=body.get("master_port"),
        rank=body.get("rank_offset"),
        world_size=body.get("world_size"),
        group_name=body.get("group_name", DEFAULT_GROUP),
    )
    world = args["world_size"] if type(args["world_size"]) is int else 0
    checks = [
        ("master_address", "a host name", isinstance(args["master_address"], str)),
        (
            "master_port",
            "an integer in [1, 65535]",
            type(args["master_port"]) is int and 0 < args["master_port"] < 65536,
        ),
        ("world_size", "an integer >= 2", world >= 2),
        ("rank_offset", "an integer in [1, world_size)", type(args["rank"]) is int and 0 < args["rank"] < world),
        ("backend", "'gloo' or 'nccl'", args["backend"] in ("gloo", "nccl")),
        ("group_name", "a string", isinstance(args["group_name"], str)),
    ]
    for name, valid, ok in checks:
        if not ok:
            raise RequestError(f"{name} = {reprlib.repr(body.get(name))}; it must be {valid}")
    state = request.app[STATE]
    close_update_group(state)
    state["update_group"] = await asyncio.to_thread(join_update_group, **args)
    state["update_group_name"] = args["group_name"]
    return web.json_response({"success": True, "message": f"joined {args['group_name']} as rank {args['rank']}"})


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    """SGLang's /destroy_weights_update_group: leave the group ``group_name``."""
    name = (await read_json(request)).get("group_name", DEFAULT_GROUP)
    state = request.app[STATE]
    if state.get("update_group") is None or state["update_group_name"] != name:
        raise RequestError(f"group_name {reprlib.repr(name)} is not a group this server joined")
    close_update_group(state)
    return web.json_response({"success": True, "message": f"left {name}"})


def close_update_group(state: dict) -> None:
    if (previous := state.pop("update_group", None)) is not None:
        previous.close()
        del previous  # freed here: gloo closes its connections now


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Receive one bucket of tensors from the trainer's broadcast, then load it all or nothing. The
    tensors are received even when the bucket does not fit the model, so the trainer's broadcast
    completes and it gets the 400; a body too malformed to receive by closes the group instead."""
    body = await read_json(request)
    state = request.app[STATE]
    if state.get("update_group") is None:
        raise RequestError("call /init_weights_update_group first")
    try:
        names, dtypes, shapes = bucket_spec(body, state["update_group_name"])
        version = _version(body)
    except RequestError as exc:  # nothing to receive into: close the group, the trainer's broadcast fails fast
        close_update_group(state)
        raise RequestError(f"{exc}; the update group is closed (call /init_weights_update_group again)") from None
    engine = request.app[ENGINE]
    device = next(engine.model.parameters()).device
    received = await asyncio.to_thread(receive_state, state["update_group"], names, dtypes, shapes, device)
    await asyncio.wrap_future(engine.update_weights(received, version, complete=False))
    return web.json_response({"success": True, "weight_version": str(engine.version)})


def bucket_spec(body: dict, group_name: str) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """``names``, ``dtypes`` and ``shapes`` of one bucket: what the trainer is about to broadcast on
    the joined group ``group_name``. Declared dtypes are those of models.hf.DTYPES."""
    if body.get("group_name", group_name) != group_name:
        raise RequestError(f"group_name {reprlib.repr(body['group_name'])} is not the joined group {group_name!r}")
    names, dtypes, shapes = (body.get(key) for key in ("names", "dtypes", "shapes"))
    if not all(type(v) is list for v in (names, dtypes, shapes)) or not len(names) == len(dtypes) == len(shapes):
        raise RequestError(
            f"names, dtypes and shapes must be lists of one length, got "
            f"{reprlib.repr(names)}, {reprlib.repr(dtypes)}, {reprlib.repr(shapes)}"
        )
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise RequestError(f"tensor name {reprlib.repr(name)} is not a string")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise RequestError(f"{name}: dtype {reprlib.repr(dtype)} is not one of {sorted(DTYPES)}")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise RequestError(f"{name}: shape {reprlib.repr(shape)} is not a list of integers >= 0")
    return names, [DTYPES[d] for d in dtypes], shapes


def receive_state(
    group: WeightChannel, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Server side of one bucket: the tensors rank 0 broadcasts, in ``names`` order, as declared."""
    return {
        name: broadcast_tensor(group, torch.empty(shape, dtype=dtype, device=device))
        for name, dtype, shape in zip(names, dtypes, shapes)
    }


def _version(body: dict) -> int | None:
    """``weight_version``: an integer, or a string of one (SGLang's own type)."""
    version = body.get("weight_version")
    if version is None or type(version) is int:
        return version
    if isinstance(version, str):
        try:
            return int(version)
        except ValueError:
            pass
    raise RequestError(f"weight_version {reprlib.repr(version)} must be an integer")


def build_app(engine: EmbeddedGenerator, model_path: str, tokenizer=None, token: str | None = None) -> web.Application:
    """``token``: required on every route but the health probes (servers bound beyond loopback); its
    check runs inside the JSON error handler, as the routes do."""
    app = web.Application(middlewares=[errors_as_json] + ([token_required] if token else []), client_max_size=64 << 20)
    app[ENGINE], app[STATE] = engine, {"model_path": model_path, "tokenizer": tokenizer}
    if token:
        app[TOKEN] = token
    app.add_routes(
        [
            web.post("/generate", generate),
            web.get("/health", health),
            web.get("/health_generate", health),
            web.get("/get_model_info", model_info),
            web.get("/get_server_info", server_info),
            web.post("/pause_generation", pause_generation),
            web.post("/continue_generation", continue_generation),
            web.post("/abort_request", abort_request),
            web.post("/flush_cache", flush_cache),
            web.post("/update_weights_from_disk", update_weights_from_disk),
            web.post("/init_weights_update_group", init_weights_update_group),
            web.post("/destroy_weights_update_group", destroy_weights_update_group),
            web.post("/update_weights_from_distributed", update_weights_from_distributed),
        ]
    )
    return app


def serve_embedded(cfg) -> None:
    """Load the model, start the engine, listen, register in name-resolve; run until SIGINT/SIGTERM."""
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.parallel.device import resolve_device
    from areal_hpc.runtime.name_resolve import advertised_address, bind, registered_server
    from areal_hpc.runtime.rollout_token import server_token

    sock = bind(cfg.rollout.host, cfg.rollout.port)  # a taken port fails before minutes of model loading
    token = server_token(cfg.run_dir, cfg.rollout.host)
    model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.attn_impl, resolve_device(cfg.cluster.device))
    engine = EmbeddedGenerator(
        model,
        slots=cfg.rollout.max_running_requests,
        context_length=cfg.rollout.context_length or None,
        seed=cfg.experiment.seed,
        prefix_cache_mb=cfg.rollout.prefix_cache_mb,
        gather_s=cfg.rollout.gather_ms / 1e3,
    )
    address = advertised_address(cfg.rollout.host, sock.getsockname()[1], cfg.cluster.interface)
    print(
        f"embedded rollout server for {cfg.model.path} on http://{address} "
        f"({engine.decoder.slots} slots, context {engine.context_length})",
        flush=True,
    )
    try:
        with registered_server(cfg.run_dir, address):
            web.run_app(
                build_app(engine, str(cfg.model.path), load_tokenizer(cfg.model.path), token),
                sock=sock,
                print=None,
                handle_signals=True,
                handler_cancellation=True,
            )  # disconnect -> abort
    finally:
        engine.stop()
