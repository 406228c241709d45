"""The server's ``use_beam_search`` extension (vLLM's), for completions and chat.

``n`` is the beam width and the number of sequences returned; ``length_penalty`` and
``early_stopping`` are transformers'; ``max_tokens``, ``temperature``, ``ignore_eos`` and
``include_stop_str_in_output`` apply, other sampling fields do not (as in vLLM). The search is
``engine.beam_search.BeamSearch``, the one ``LLM.beam_search`` runs: each step sends one
single-token request per live beam of every prompt through this front end's ``AsyncEngine``,
all in one ``add_requests`` (a core takes them between two steps and, within its token
budget, scores them in one step; its prefix cache shares the beams' common blocks), and waits
for all of them. A client that goes away aborts every request in flight. Not with ``stream``
(400), nor with ``logprobs`` (400).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchParamsError,
    check_beam_width,
    logprob_dict,
)
from engine.server.errors import APIError, bad_request, from_engine_error
from engine.server.serving import ServingContext
from engine.server.streaming import ClientDisconnected, unless_disconnected


def beam_search_params(ctx: ServingContext, req: Any, max_tokens: int) -> BeamSearchParams:
    """The request's ``BeamSearchParams``; 400 naming the field when it cannot be served."""
    if req.stream:
        raise bad_request("use_beam_search is not supported with stream=true", "stream")
    if req.logprobs or getattr(req, "top_logprobs", None) is not None:
        raise bad_request("logprobs are not supported with use_beam_search", "logprobs")
    if req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs are not supported with use_beam_search", "prompt_logprobs"
        )
    limit = ctx.options.limits.max_n
    if req.n > limit:
        raise bad_request(f"n must be in [1, {limit}], got {req.n}", "n")
    temperature = req.temperature if req.temperature is not None else 0.0
    params = BeamSearchParams(
        beam_width=req.n,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        temperature=temperature,
        length_penalty=req.length_penalty,
        include_stop_str_in_output=req.include_stop_str_in_output,
        early_stopping=req.early_stopping,
    )
    engine = ctx.async_engine
    try:
        params.validate()
        check_beam_width(params, _num_eos(engine), _engine_max_logprobs(ctx))
    except BeamSearchParamsError as e:
        # The HTTP name of the beam width is n.
        message = str(e).replace("beam_width", "n (the beam width with use_beam_search)", 1)
        raise bad_request(message, "n" if e.param == "beam_width" else e.param) from None
    return params


async def run_beam_search(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: BeamSearchParams,
    lora_request: Any = None,
    priority: int = 0,
) -> list[BeamSearchOutput]:
    """Run one search per prompt, all in step; their results in the prompts' order."""
    engine = ctx.async_engine
    eos = list(getattr(engine.client, "eos_token_ids", []))
    searches = [BeamSearch(ids, params, eos) for ids in prompts]
    max_logprobs = _engine_max_logprobs(ctx)
    step = 0
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            break
        channel = engine.open_channel(stream=False)
        owners: list[tuple[BeamSearch, list[str]]] = []
        batch: list[dict[str, Any]] = []
        for i, search in enumerate(live):
            step_params = search.step_params(max_logprobs)
            rids = []
            for j, seq in enumerate(search.live_sequences()):
                rid = f"{request_id}-s{step}-{i}-{j}"
                batch.append(
                    dict(
                        request_id=rid,
                        prompt=None,
                        params=step_params,
                        prompt_token_ids=seq,
                        priority=priority,
                        lora_request=lora_request,
                    )
                )
                rids.append(rid)
            owners.append((search, rids))
        try:
            # All at once, so the core runs them in one step (as LLM.beam_search's one
            # generate call): added one by one, each could start a step of its own.
            await engine.add_requests(channel, batch)
            finals = await channel.collect_final()
        finally:
            channel.abort()  # a no-op when all finished; frees their blocks on cancellation
        for search, rids in owners:
            search.advance([logprob_dict(finals[r].outputs[0].logprobs[0]) for r in rids])
        step += 1
    decode = None if ctx.tokenizer is None else ctx.decode
    return [search.results(decode) for search in searches]


async def serve_beam_search(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: BeamSearchParams,
    raw: Request,
    lora_request: Any = None,
    priority: int = 0,
) -> list[BeamSearchOutput] | None:
    """``run_beam_search`` for a route: None when the client went away (the route answers
    499), an engine error as its API error."""
    try:
        return await unless_disconnected(
            run_beam_search(ctx, request_id, prompts, params, lora_request, priority), raw
        )
    except ClientDisconnected:
        return None
    except APIError:
        raise
    except Exception as e:
        raise from_engine_error(e) from e


def _num_eos(engine: Any) -> int:
    return len(set(getattr(engine.client, "eos_token_ids", []) or []))


def _engine_max_logprobs(ctx: ServingContext) -> int:
    return int(getattr(ctx.async_engine.config, "max_logprobs", 20))
