"""``LLM``: the offline batch API, in vLLM's shape so users switch by name.

from engine import LLM, SamplingParams
llm = LLM(model="path/to/model", dtype="float32")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]
Message = dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    Keyword arguments mirror vLLM's ``LLM``: ``model`` (None = the embedded default model),
    ``tokenizer``, ``dtype``, ``max_model_len``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``attention_backend``, ``platform``,
    ``seed``, ``gpu_memory_utilization``, ``num_gpu_blocks_override``, ``enforce_eager``,
    ``load_format``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``distributed_executor_backend`` (uni, mp, ray), ``enable_expert_parallel`` (MoE experts
    placed across the tensor-parallel ranks), ``served_model_name``, ``scheduling_policy``,
    ``cpu_kv_cache_gb``, ``max_logprobs``, ``async_scheduling`` (None: on for GPUs),
    ``generation_config`` ("auto": the model's generation_config.json gives EOS ids and default
    sampling parameters; "vllm": EOS ids only; or a directory), ``speculative_config`` (a dict
    of vLLM's ``--speculative-config`` keys, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}``), ``skip_tokenizer_init`` (load no tokenizer: prompts must be
    token ids, outputs carry token ids and empty text, stop strings and chat are refused),
    ``cpu_threads`` (threads of the CPU kernels; None: the physical cores available, see
    ``engine.cpu_threads``), ``data_parallel_size`` (N > 1: N engine-core processes, each with
    its own copy of the model, one device each on a GPU host; requests go to the least loaded,
    preferring the one that holds their prefix). Unknown keywords are an error that lists them.

    With one data-parallel rank the engine core runs in this process (``llm.llm_engine.core``);
    call ``shutdown()`` (or use ``with LLM(...) as llm``) to stop engine-core processes early,
    else they stop when the interpreter exits.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        platform: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        enforce_eager: bool = False,
        load_format: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        enable_expert_parallel: bool = False,
        served_model_name: str | list[str] | None = None,
        scheduling_policy: str = "fcfs",
        cpu_kv_cache_gb: float | None = None,
        max_logprobs: int = 20,
        async_scheduling: bool | None = None,
        trust_remote_code: bool = False,
        generation_config: str = "auto",
        data_parallel_size: int = 1,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        skip_tokenizer_init: bool = False,
        cpu_threads: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=load_format,
                seed=seed,
                served_model_name=served_model_name,
                trust_remote_code=trust_remote_code,
                generation_config=generation_config,
                skip_tokenizer_init=skip_tokenizer_init,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_gpu_blocks=num_gpu_blocks_override,
                cpu_kv_cache_gb=cpu_kv_cache_gb,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                distributed_executor_backend=distributed_executor_backend,
                enable_expert_parallel=enable_expert_parallel,
                data_parallel_size=data_parallel_size,
            ),
            platform=platform,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            max_logprobs=max_logprobs,
            speculative=(
                SpeculativeConfig.from_dict(speculative_config)
                if speculative_config is not None
                else None
            ),
            cpu_threads=cpu_threads,
        )
        from engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine.from_config(config)
        self._counter = itertools.count()

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, multiprocess: bool | None = None) -> LLM:
        """Build from a complete ``EngineConfig`` (what the CLI commands do); ``multiprocess``
        as in ``LLMEngine.from_config``."""
        from engine.llm_engine import LLMEngine

        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_config(config, multiprocess=multiprocess)
        llm._counter = itertools.count()
        return llm

    def shutdown(self) -> None:
        """Stop the engine-core processes, if any (idempotent; the engine is unusable then)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    def get_tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (None with ``skip_tokenizer_init=True``)."""
        return self.llm_engine.tokenizer

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the prompts' order.

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a list of
        token ids. ``sampling_params`` is one ``SamplingParams`` for all prompts or one per
        prompt. Every prompt is validated before any work starts.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one "
                    "or one per prompt",
                    "sampling_params",
                )
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError("priority needs one value per prompt", "priority")

        engine = self.llm_engine
        parsed = [self._parse_prompt(p) for p in prompts]
        # Validate everything first: a bad prompt in the middle must not leave work queued.
        for (text, ids), params in zip(parsed, params_list, strict=True):
            if ids is None and engine.tokenizer is None:
                raise InvalidRequestError(
                    "text prompts cannot be used with skip_tokenizer_init=True (no tokenizer is "
                    'loaded); pass token ids: {"prompt_token_ids": [...]} or a list of ints',
                    "prompts",
                )
            n = len(ids) if ids is not None else len(engine.tokenizer(text).input_ids)
            if n >= engine.max_model_len:
                from engine.errors import PromptTooLongError

                raise PromptTooLongError(n, engine.max_model_len)
            params.validate()
        batch = []
        for i, ((text, ids), params) in enumerate(zip(parsed, params_list, strict=True)):
            prio = priority[i] if priority is not None else 0
            batch.append((str(next(self._counter)), text, params, ids, prio, None, True))
        engine.add_requests(batch)  # all or none
        return self._run([r[0] for r in batch], use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's recommended defaults from its
        ``generation_config.json`` (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens), as vLLM's; plain defaults without one or with
        ``generation_config="vllm"``. ``generate`` and ``chat`` use it when given none."""
        return SamplingParams(**self.llm_engine.config.model.default_sampling)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and
        generate a reply for each.

        As vLLM's ``LLM.chat``: ``tools`` (OpenAI function definitions) and
        ``chat_template_kwargs`` go to the template; ``continue_final_message`` continues the
        last (assistant) message instead of opening a new turn. Tool calls in the replies are
        not parsed offline: the server's ``--tool-call-parser`` does that.
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message=True needs add_generation_prompt=False (the reply "
                "continues the last message instead of opening a new turn)",
                "continue_final_message",
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError(
                "chat() needs a tokenizer for the chat template, and this LLM was built with "
                "skip_tokenizer_init=True; render the conversation to token ids yourself and "
                "use generate()",
                "messages",
            )
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; pass "
                "chat_template=... or use generate()",
                "messages",
            )
        prompts: list[PromptType] = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return _encodable(prompt), None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return _encodable(prompt["prompt"]), None
            raise InvalidRequestError(
                "a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompts"
            )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"unsupported prompt type {type(prompt).__name__}; pass a "
            "string, a list of token ids or a dict",
            "prompts",
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, unit="req"
            )
        start = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            in_toks += len(output.prompt_token_ids)
                            out_toks += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(
                                f"input: {in_toks / elapsed:.1f} toks/s, "
                                f"output: {out_toks / elapsed:.1f} toks/s"
                            )
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(request_ids))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]


def _encodable(text: str) -> str:
    """``text`` if a tokenizer can take it; a lone UTF-16 surrogate (``"a\\ud800"``, which
    Python strings may hold but UTF-8 cannot encode) is the caller's mistake, said as such
    rather than as the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"prompt contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at index "
            f"{exc.start}); prompts must be valid Unicode text",
            "prompts",
        ) from None
    except AttributeError:  # not a string: the type check downstream says what is allowed
        pass
    return text
