"""What the generation endpoints share: model names, tokenization, limits, sampling params.

``ServingContext`` is built once the engine is loaded and lives on the app state. Tokenization
runs on one worker thread so that long prompts never stall the event loop (a single worker also
keeps the Rust tokenizer from being used by two HTTP threads at once).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.server.async_engine import AsyncEngine
from engine.server.errors import APIError, bad_request, context_length_error
from engine.server.protocol import ChatMessage, SamplingFields
from engine.server.tools.parser import ToolParser, tool_parser_from_flags
from engine.server.tools.request import prepare_tool_history

logger = logging.getLogger("engine.server.requests")


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
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    tool_parser: ToolParser | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.tool_parser = tool_parser_from_flags(
            self.enable_auto_tool_choice, self.tool_call_parser
        )


def random_id(prefix: str) -> str:
    """A request id like OpenAI's (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ServingContext:
    """The engine as the HTTP endpoints see it."""

    def __init__(self, async_engine: AsyncEngine, options: ServingOptions) -> None:
        self.async_engine = async_engine
        self.options = options
        self.tokenizer = async_engine.tokenizer
        engine_config = async_engine.config
        model_config = engine_config.model
        self.max_model_len: int = int(model_config.max_model_len)
        # Defaults from the model's generation_config.json for fields a request leaves unset.
        self.default_sampling: dict[str, Any] = dict(
            getattr(model_config, "default_sampling", None) or {}
        )
        self.model_path: str = str(model_config.model)
        self.model_names = list(options.served_model_names) or model_config.served_model_names
        self.max_logprobs = min(
            options.limits.max_logprobs, int(getattr(engine_config, "max_logprobs", 20))
        )
        self.chat_template = options.chat_template
        self._token_text: dict[int, str] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        """The first served name: what responses report as ``model``."""
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name to report; 404 if ``name`` is not one of ours (None: the default)."""
        if not name:
            return self.model_name
        if name not in self.model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Served models: {', '.join(self.model_names)}.",
                param="model",
                code="model_not_found",
            )
        return name

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

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached: the vocabulary bounds the cache)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def logprob_token(self, token_id: int, lp: Any, as_ids: bool = False) -> str:
        """How a token is shown in logprobs: its text, or ``token_id:<id>`` when asked."""
        if as_ids:
            return f"token_id:{token_id}"
        decoded = getattr(lp, "decoded_token", None) if lp is not None else None
        return decoded if decoded is not None else self.token_text(token_id)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        vocab = len(self.tokenizer)
        for t in ids:
            if t < 0 or t >= vocab:
                raise bad_request(
                    f"token id {t} is out of range for the vocabulary (size {vocab})", param
                )

    async def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Apply the chat template; a clear 400 when the model has none or it fails."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise bad_request(
                f"The model `{self.model_name}` has no chat template, so /v1/chat/completions "
                "cannot format messages. Use /v1/completions with a plain prompt, or start the "
                "server with --chat-template.",
                param="messages",
                code="chat_template_missing",
            )
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            return await self.run_tokenizer(
                self.tokenizer.apply_chat_template,
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception, bad roles...
            raise bad_request(f"the chat template failed: {e}", param="messages") from e

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
                raise bad_request(
                    f"{name} must be in [0, {self.max_logprobs}], got {value}",
                    "top_logprobs" if name == "logprobs" and _is_chat(req) else name,
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
        if req.logit_bias:
            vocab = len(self.tokenizer)
            bias = {}
            for key, value in req.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise bad_request(
                        f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                    ) from None
                if not 0 <= token < vocab:
                    raise bad_request(
                        f"logit_bias token id {token} is out of range (vocabulary size {vocab})",
                        "logit_bias",
                    )
                if not -100.0 <= value <= 100.0:
                    raise bad_request(
                        f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
                    )
                bias[token] = value
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


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A chat message as the template expects it; content parts joined into text."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            part_type = part.type if hasattr(part, "type") else part.get("type")
            if part_type != "text":
                raise bad_request(
                    f"messages[{index}].content: only text parts are supported, got {part_type!r}",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text if hasattr(part, "text") else str(part.get("text", "")))
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    prepare_tool_history(data, index)
    return data
