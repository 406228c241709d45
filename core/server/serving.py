"""What the generation endpoints share: model names, tokenization, limits, sampling params.

``ServingContext`` is built once the engine is loaded and lives on the app state. Tokenization
runs on one worker thread so that long prompts never stall the event loop (a single worker also
keeps the Rust tokenizer from being used by two HTTP threads at once).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.lora.request import LoRARequest
from engine.server.async_engine import AsyncEngine
from engine.server.chat_template import (
    ChatTemplates,
    conversation_of,
    has_image_parts,
    request_kwargs,
)
from engine.server.errors import bad_request, context_length_error
from engine.server.models import LoRAModulePath, ServingModels, lora_requests_for
from engine.server.protocol import ChatMessage, SamplingFields
from engine.server.reasoning import ReasoningParser, get_reasoning_parser
from engine.server.response_store import ResponseStore
from engine.server.tools.parser import ToolParser, tool_parser_from_flags
from engine.tokenizer import TokenIdRange

logger = logging.getLogger("engine.server.requests")

# A logit_bias key: a token id in canonical decimal (no sign, space or leading zero).
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,18}")


@dataclass
class ServerLimits:
    """Per-request limits of the server (beyond what ``SamplingParams`` checks)."""

    max_n: int = 128
    max_logprobs: int = 20
    max_prompts: int = 1024  # prompts in one /v1/completions request


@dataclass
class ServingOptions:
    """Server-side behaviour chosen on the command line.

    ``served_model_names`` overrides the engine config's names (empty: the config's).
    ``lora_modules`` are the ``--lora-modules`` adapters (``lora_requests``: theirs, ids 1..n),
    loaded before the server is ready.
    ``enable_auto_tool_choice`` with ``tool_call_parser`` (a name from
    ``engine.server.tools.TOOL_PARSERS`` or ``module:Class``) parses tool calls from chat
    output; one without the other is a ``ConfigError``, raised here so that ``engine serve``
    fails before it loads the model.
    """

    served_model_names: list[str] = field(default_factory=list)
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False  # run a request's own chat_template (vLLM's flag)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    # --reasoning-parser: a name from engine.server.reasoning.REASONING_PARSERS, or None.
    reasoning_parser: str | None = None
    # --max-stored-responses: the Responses API's in-memory store (engine.server.response_store).
    max_stored_responses: int = 1000
    tool_parser: ToolParser | None = field(init=False, default=None, repr=False)
    reasoning: ReasoningParser | None = field(init=False, default=None, repr=False)
    lora_requests: list[LoRARequest] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.tool_parser = tool_parser_from_flags(
            self.enable_auto_tool_choice, self.tool_call_parser
        )
        self.lora_requests = lora_requests_for(self.lora_modules)
        if self.reasoning_parser is not None:
            try:
                self.reasoning = get_reasoning_parser(self.reasoning_parser)
            except ValueError as e:
                from engine.config import ConfigError

                raise ConfigError(f"--reasoning-parser: {e}") from None


def random_id(prefix: str) -> str:
    """A request id like OpenAI's (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ServingContext:
    """The engine as the HTTP endpoints see it."""

    def __init__(self, async_engine: AsyncEngine, options: ServingOptions) -> None:
        self.async_engine = async_engine
        self.options = options
        self.tokenizer = async_engine.tokenizer  # None with --skip-tokenizer-init
        engine_config = async_engine.config
        model_config = engine_config.model
        self.max_model_len: int = int(model_config.max_model_len)
        # Defaults from the model's generation_config.json for fields a request leaves unset.
        self.default_sampling: dict[str, Any] = dict(
            getattr(model_config, "default_sampling", None) or {}
        )
        self.model_config = model_config
        self.model_path: str = str(model_config.model)
        self.model_names = list(options.served_model_names) or model_config.served_model_names
        self.models = ServingModels(
            self.model_names,
            self.model_path,
            self.max_model_len,
            options.lora_requests,
            lora_enabled=getattr(engine_config, "lora", None) is not None,
            client_index=int(getattr(async_engine.client, "client_index", 0)),
            num_clients=int(
                getattr(getattr(async_engine.client, "connection", None), "num_clients", 1)
            ),
        )
        self.response_store = ResponseStore(options.max_stored_responses)
        self.max_logprobs = min(
            options.limits.max_logprobs, int(getattr(engine_config, "max_logprobs", 20))
        )
        self.chat_template = options.chat_template
        self.templates = ChatTemplates(
            self.tokenizer, options.chat_template, options.trust_request_chat_template
        )
        # Token ids requests may name: below max(tokenizer size, model vocabulary) (vLLM's rule).
        self.token_ids = TokenIdRange.of(self.tokenizer, model_config.hf_config)
        self._token_text: dict[int, str] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Image inputs: (the model's processor, the URL loader), built on the first image.
        self._engine = async_engine
        self._images: Any = None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        """The first served name: what responses report as ``model``."""
        return self.model_names[0]

    async def check_model(self, name: str | None) -> str:
        """The served name to report; 404 if ``name`` is neither the model's nor a LoRA
        adapter's (None: the default), listing every served name. An adapter name this front
        end does not know is first looked up in the engine cores (loaded through another
        front end)."""
        await self.models.ensure(self._engine, name)
        return self.models.resolve(name)[0]

    @property
    def pooling_task(self) -> str | None:
        """A pooling model's task: "embed" (an embedding model) or "classify" (a
        sequence-classification model; one label: a cross-encoder); None for a generative
        model."""
        cfg = getattr(self.model_config, "pooler_config", None)
        return cfg.task if cfg is not None else None

    def require_runner(self, runner: str, route: str) -> None:
        """400 naming what the model supports when ``route`` needs the other runner
        (``generate`` for completions and chat, ``pooling`` for embeddings)."""
        model = getattr(getattr(self.async_engine, "config", None), "model", None)
        have = getattr(model, "runner_type", None) or "generate"
        if have == runner:
            return
        if have == "pooling":
            message = (
                f"The model `{self.model_name}` is an embedding (pooling) model: it supports "
                f"/v1/embeddings, /score and /rerank (or /classify), not generation ({route})."
            )
        else:
            message = (
                f"The model `{self.model_name}` is a generative model: it supports "
                f"/v1/completions and /v1/chat/completions, not embeddings ({route}); serve an "
                "embedding model, or this one with --runner pooling."
            )
        raise bad_request(message, "model")

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        return self.models.resolve(name)[1]

    # ------------------------------------------------------------ tokenization
    async def run_tokenizer(self, fn, *args, **kwargs) -> Any:
        """Run a tokenizer call on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        if len(text) < 256:  # a short prompt is cheaper to tokenize than to hand off
            return self._encode(text, add_special_tokens)
        return await self.run_tokenizer(self._encode, text, add_special_tokens)

    def require_tokenizer(self, what: str, param: str | None = "prompt") -> None:
        """400 when the server runs without a tokenizer (``--skip-tokenizer-init``)."""
        if self.tokenizer is None:
            raise bad_request(
                f"{what} needs a tokenizer, and this server was started with "
                "--skip-tokenizer-init: send prompts as token ids to /v1/completions",
                param,
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.require_tokenizer("a text prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``; empty without a tokenizer (``--skip-tokenizer-init``),
        as the engine's outputs are."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached: the vocabulary bounds the cache)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode([token_id])
            self._token_text[token_id] = text
        return text

    def logprob_token(self, token_id: int, lp: Any, as_ids: bool = False) -> str:
        """How a token is shown in logprobs: its text, or ``token_id:<id>`` when asked."""
        if as_ids:
            return f"token_id:{token_id}"
        decoded = getattr(lp, "decoded_token", None) if lp is not None else None
        return decoded if decoded is not None else self.token_text(token_id)

    def check_token_ids(self, ids: Any, param: str = "prompt", *, needs_row: bool = True) -> None:
        """400 naming ``param`` unless every id is a valid token id (``TokenIdRange``);
        ``needs_row``: the id indexes the model (a prompt's embedding, a logit)."""
        try:
            self.token_ids.check(ids, param, needs_row=needs_row)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info`` body: the tokenizer's init arguments (its
        ``tokenizer_config.json``) made JSON (special tokens as their text), without file
        paths, plus ``tokenizer_class`` and the chat template requests get by default."""
        info = {
            key: _jsonable(value)
            for key, value in dict(getattr(self.tokenizer, "init_kwargs", None) or {}).items()
            if key not in ("vocab_file", "merges_file", "tokenizer_file")
        }
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if info.get(name) is None:
                info[name] = getattr(self.tokenizer, name, None)
        info["tokenizer_class"] = type(self.tokenizer).__name__
        template = self.templates.default_template
        if template:
            info["chat_template"] = template
        return info

    async def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Apply the chat template (``engine.server.chat_template``): the request's when it
        brings one and the server trusts it, else the server's or the tokenizer's. A 400 when
        there is none, it fails, a message has no content, or it drops a message's role."""
        self.require_tokenizer("/v1/chat/completions (its chat template)", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        kwargs = request_kwargs(chat_template_kwargs, tools)
        template, param = self.templates.choose(chat_template, kwargs, self.model_name)
        conversation = conversation_of(messages)
        return await self.run_tokenizer(
            self.templates.render,
            conversation,
            template,
            param,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs=kwargs,
        )

    async def render_chat_prompt(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int], list[Any]]:
        """The chat prompt's text, token ids and images (``MultiModalFeature``s; empty for a
        text conversation). ``image_url`` parts are loaded (``engine.multimodal.media``),
        placed by the chat template and expanded by the model's processor; a bad image, too
        many images, or images for a model that takes none are 400s naming the part."""
        if not has_image_parts(messages):
            prompt = await self.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template already wrote the special tokens it wants (BOS...).
            return prompt, await self.encode(prompt, add_special_tokens=False), []
        from engine.multimodal.chat import render_with_images, take_image_parts
        from engine.multimodal.media import MediaError

        self.require_tokenizer("/v1/chat/completions (its chat template)", "messages")
        processor, media = self._image_inputs()
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        kwargs = request_kwargs(chat_template_kwargs, tools)
        template, param = self.templates.choose(chat_template, kwargs, self.model_name)
        try:
            conversation, urls = take_image_parts(conversation_of(messages, allow_images=True))
        except MediaError as e:
            raise bad_request(str(e), "messages") from None
        limit = self._engine.config.multimodal.limit("image")
        if len(urls) > limit:
            raise bad_request(
                f"the messages have {len(urls)} images; at most {limit} are allowed per prompt "
                "(--limit-mm-per-prompt)",
                urls[limit][1],
            )

        def build() -> tuple[str, list[int], list[Any]]:
            images = []
            for url, where in urls:
                try:
                    images.append(media.load_image(url))
                except MediaError as e:
                    raise bad_request(f"{where}: {e}", where) from None
            try:
                prompt = render_with_images(
                    lambda conv: self.templates.render(
                        conv,
                        template,
                        param,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        kwargs=kwargs,
                    ),
                    conversation,
                    len(images),
                    processor.image_placeholder,
                )
                ids, features = processor.process(prompt, images, add_special_tokens=False)
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
            return prompt, ids, features

        return await self.run_tokenizer(build)

    def _image_inputs(self) -> tuple[Any, Any]:
        """The model's image processor and the URL loader; 400 when the model takes none."""
        if self._images is None:
            spec = getattr(self._engine, "image_input_spec", None)
            if spec is None:
                raise bad_request(
                    "this model takes no image inputs (a text model, or one served with "
                    "--limit-mm-per-prompt '{\"image\": 0}'); send text content only",
                    "messages",
                )
            from engine.multimodal.media import MediaConnector
            from engine.multimodal.processing import MultiModalProcessor
            from engine.runtime import model_dir

            processor = MultiModalProcessor.from_model_dir(
                model_dir(self.model_config), self.tokenizer, spec
            )
            self._images = (processor, MediaConnector(self._engine.config.multimodal))
        return self._images

    def truncate_prompt(self, ids: list[int], req: SamplingFields) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the last N prompt tokens (-1: the last
        ``max_model_len``), or the first N with ``truncation_side: "right"``."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            if req.truncation_side is not None:
                raise bad_request(
                    "truncation_side only applies with truncate_prompt_tokens", "truncation_side"
                )
            return ids
        if keep == -1:
            keep = self.max_model_len
        elif keep > self.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({self.max_model_len}); request a smaller truncation size",
                "truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        return ids[:keep] if req.truncation_side == "right" else ids[len(ids) - keep :]

    def prompt_logprobs(
        self, entries: list[dict[int, Any] | None] | None, as_ids: bool = False
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` of a response: per prompt token (the first is null), its
        candidates' ``{"logprob", "rank", "decoded_token"}`` keyed by token id."""
        if entries is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            out.append(
                {
                    str(token): {
                        "logprob": max(float(lp.logprob), -9999.0),  # JSON has no -inf
                        "rank": lp.rank,
                        "decoded_token": self.logprob_token(token, lp, as_ids),
                    }
                    for token, lp in entry.items()
                }
            )
        return out

    # ------------------------------------------------------------ parameters
    def check_prompt_fits(
        self, num_prompt_tokens: int, max_tokens: int, param: str = "prompt"
    ) -> None:
        """400 when the prompt plus ``max_tokens`` exceed the model's context."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise context_length_error(
                self.max_model_len,
                total if num_prompt_tokens < self.max_model_len else num_prompt_tokens,
                prompt_tokens=num_prompt_tokens,
                param=param,
            )

    def sampling_params(
        self,
        req: SamplingFields,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> Any:
        """Build ``SamplingParams`` from the request; 400 naming the field when invalid."""
        from engine.sampling_params import SamplingParams, SamplingParamsError

        limits = self.options.limits
        if req.n < 1 or req.n > limits.max_n:
            raise bad_request(f"n must be in [1, {limits.max_n}], got {req.n}", "n")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= self.max_logprobs:
                # Chat asks for the alternatives with top_logprobs: name the field it sent.
                field = "top_logprobs" if name == "logprobs" and _is_chat(req) else name
                raise bad_request(
                    f"{field} must be in [0, {self.max_logprobs}], got {value}", field
                )
        default_max = self.default_sampling.get("max_tokens")
        client_max = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
        if default_max and not client_max:
            max_tokens = min(max_tokens, int(default_max))  # the model's max_new_tokens
        kwargs: dict[str, Any] = {
            "n": req.n,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "max_logprobs": self.max_logprobs,
        }
        # Only fields the client set override the defaults: the model's generation config's,
        # else SamplingParams'.
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(req, name)
            if value is None:
                value = self.default_sampling.get(name)
            if value is not None:
                kwargs[name] = value
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids", needs_row=False)
        if req.logit_bias:
            bias = {}
            for key, value in req.logit_bias.items():
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise bad_request(
                        f'logit_bias keys must be token ids written in decimal ("42"), got {key!r}',
                        "logit_bias",
                    )
                bias[int(key)] = value  # the values' range [-100, 100] is the protocol's
            self.check_token_ids(bias, "logit_bias")
            kwargs["logit_bias"] = bias
        from engine.server.structured import structured_outputs_from_request

        kwargs["structured_outputs"] = structured_outputs_from_request(req)
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from e
        except (TypeError, ValueError) as e:
            raise bad_request(str(e)) from e

    def log_request(self, request_id: str, prompt: Any, prompt_ids: list[int], params: Any) -> None:
        """Log an incoming request (with --enable-log-requests), prompt truncated."""
        if not self.options.log_requests or not logger.isEnabledFor(logging.INFO):
            return
        limit = self.options.max_log_len
        if not isinstance(prompt, str):
            prompt = None  # a token-id prompt: logged once, as prompt_token_ids (truncated)
        elif limit is not None:
            prompt = prompt[:limit]
        ids = prompt_ids if limit is None else prompt_ids[:limit]
        logger.info(
            "request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            prompt,
            params,
            ids,
        )


def _is_chat(req: SamplingFields) -> bool:
    return hasattr(req, "messages")


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it: an ``AddedToken`` as its text, containers recursively,
    anything else unknown as its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    return str(value)
