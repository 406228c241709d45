"""``LLM``: the offline batch API, in vLLM's shape so users switch by name.

from engine import LLM, SamplingParams
llm = LLM(model="path/to/model", dtype="float32")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outputs[0].outputs[0].text)

With LoRA adapters (PEFT format), as in vLLM::

    from engine.lora.request import LoRARequest
    llm = LLM(model="path/to/model", enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "path/to/sql-lora"))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from engine.beam_search import BeamSearchOutput, BeamSearchParams, logprob_dict
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]
Message = dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    Keyword arguments mirror vLLM's ``LLM``: ``model`` (None = the embedded default model; a
    Hugging Face Hub id is downloaded unless cached: ``engine.loader.hub``), ``tokenizer``,
    ``revision``, ``tokenizer_revision``, ``download_dir``, ``dtype``, ``max_model_len``, ``block_size``, ``max_num_seqs`` and
    ``max_num_batched_tokens`` (None: the platform's offline defaults, logged; 1024 and 16384
    on a GPU of 70 GiB or more, else 256 and 8192), ``enable_prefix_caching``,
    ``attention_backend``, ``platform``, ``seed``, ``gpu_memory_utilization``, ``num_gpu_blocks_override``, ``enforce_eager``,
    ``disable_cascade_attn`` (never attend a prefix many decodes share once for all of them),
    ``load_format``, ``model_loader_extra_config`` (``{"dummy_init": "uniform"}``: vLLM's
    dummy weights), ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``distributed_executor_backend`` (uni, mp, ray), ``enable_expert_parallel`` (MoE experts
    placed across the tensor-parallel ranks), ``served_model_name``, ``scheduling_policy``,
    ``cpu_kv_cache_gb``, ``max_logprobs``, ``async_scheduling`` (None: on for GPUs),
    ``generation_config`` ("auto": the model's generation_config.json gives EOS ids and default
    sampling parameters; "vllm": EOS ids only; or a directory), ``override_generation_config``
    (defaults over it, ``{"temperature": 0.6}``), ``hf_overrides`` (fields set on the
    transformers config), ``speculative_config`` (a dict
    of vLLM's ``--speculative-config`` keys, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}``), ``skip_tokenizer_init`` (load no tokenizer: prompts must be
    token ids, outputs carry token ids and empty text, stop strings and chat are refused),
    ``cpu_threads`` (threads of the CPU kernels; None: the physical cores available, see
    ``engine.cpu_threads``), ``data_parallel_size`` (N > 1: N engine-core processes, each with
    its own copy of the model, one device each on a GPU host; requests go to the least loaded,
    preferring the one that holds their prefix), ``quantization`` (a method name such as "fp8",
    "awq", "gptq", "compressed-tensors"; None: the checkpoint's quantization_config decides),
    ``kv_cache_dtype`` ("auto" or "fp8"), ``enable_lora``, ``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``, ``lora_fused_shrink`` (multi-LoRA serving, ``engine.lora``),
    ``model_impl`` ("auto": the native implementation when there is one, else the
    transformers modeling backend; "native"; "transformers"). Image inputs (multimodal models,
    ``engine.config.MultiModalConfig``): ``limit_mm_per_prompt`` (``{"image": N}``; 0 serves
    the model text-only), ``allowed_local_media_path`` (where ``file://`` image URLs in
    ``chat`` may point), ``allowed_media_domains`` (hosts ``http(s)://`` image URLs may be
    fetched from; none by default), ``mm_encoder_cache_gb``, ``max_num_encoder_input_tokens``,
    ``disable_chunked_mm_input``, ``max_image_bytes``, ``max_image_pixels``. Unknown keywords
    are an error that lists them.

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
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        platform: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        enforce_eager: bool = False,
        disable_cascade_attn: bool = False,
        load_format: str = "auto",
        model_loader_extra_config: dict[str, Any] | None = None,
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
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None,
        mm_encoder_cache_gb: float = 0.25,
        max_num_encoder_input_tokens: int | None = None,
        disable_chunked_mm_input: bool = False,
        max_image_bytes: int = MultiModalConfig.max_image_bytes,
        max_image_pixels: int = MultiModalConfig.max_image_pixels,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_fused_shrink: bool | None = None,
        model_impl: str = "auto",
        runner: str = "auto",
        task: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        override_generation_config: dict[str, Any] | None = None,
        hf_overrides: dict[str, Any] | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                revision=revision,
                tokenizer_revision=tokenizer_revision,
                download_dir=download_dir,
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=load_format,
                model_loader_extra_config=dict(model_loader_extra_config or {}),
                disable_cascade_attn=disable_cascade_attn,
                seed=seed,
                served_model_name=served_model_name,
                trust_remote_code=trust_remote_code,
                generation_config=generation_config,
                override_generation_config=dict(override_generation_config or {}),
                hf_overrides=dict(hf_overrides or {}),
                skip_tokenizer_init=skip_tokenizer_init,
                quantization=quantization,
                model_impl=model_impl,
                runner=runner,
                task=task,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_gpu_blocks=num_gpu_blocks_override,
                cpu_kv_cache_gb=cpu_kv_cache_gb,
                cache_dtype=kv_cache_dtype,
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
            multimodal=MultiModalConfig(
                limit_mm_per_prompt=limit_mm_per_prompt or {},
                allowed_local_media_path=allowed_local_media_path,
                allowed_media_domains=allowed_media_domains,
                mm_encoder_cache_gb=mm_encoder_cache_gb,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens,
                disable_chunked_mm_input=disable_chunked_mm_input,
                max_image_bytes=max_image_bytes,
                max_image_pixels=max_image_pixels,
            ),
            lora=_lora_config(
                enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_fused_shrink
            ),
        )
        from engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine.from_config(config)
        self._counter = itertools.count()
        self._images: Any = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, multiprocess: bool | None = None) -> LLM:
        """Build from a complete ``EngineConfig`` (what the CLI commands do); ``multiprocess``
        as in ``LLMEngine.from_config``."""
        from engine.llm_engine import LLMEngine

        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_config(config, multiprocess=multiprocess)
        llm._counter = itertools.count()
        llm._images = None
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the prompts' order.

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a list of
        token ids. A multimodal model takes ``{"prompt": str, "multi_modal_data": {"image":
        image or [images]}}`` (PIL images; the prompt writes the model's image placeholder,
        ``<start_of_image>`` for Gemma 3, where each goes). ``sampling_params`` is one
        ``SamplingParams`` for all prompts or one per prompt; ``lora_request`` one
        ``LoRARequest`` for all prompts or one (or None: the base model) per prompt. Every
        prompt is validated before any work starts.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _one_per_prompt(
            sampling_params, SamplingParams, len(prompts), "sampling_params"
        )
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError("priority needs one value per prompt", "priority")
        loras = _per_prompt_loras(lora_request, len(prompts))

        parsed = [self._with_images(*self._parse_prompt(p)) for p in prompts]
        return self._generate_parsed(parsed, params_list, use_tqdm, priority, loras)

    # ------------------------------------------------------------------ embed
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the prompts' order (a pooling model: ``runner=
        "pooling"``, or chosen automatically for embedding checkpoints; see docs/models.md).

        Prompts are as for ``generate`` (text or token ids; no images). ``pooling_params`` is
        one ``PoolingParams`` for all prompts or one per prompt (``dimensions``, ``normalize``).
        Every prompt is validated before any work starts.
        """
        if self._pooler_task() == "classify":
            raise InvalidRequestError(
                "this model is a sequence classifier: it classifies with LLM.classify (and, "
                "with one label, scores text pairs with LLM.score); it does not embed",
                "prompts",
            )
        return self._pool(prompts, pooling_params, use_tqdm, priority)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` on a sequence-classification model: each prompt's class
        probabilities (``outputs.probs``: the softmax of the head's logits, or with one label
        the sigmoid of its logit), in the prompts' order."""
        if self._pooler_task() != "classify":
            raise InvalidRequestError(
                "this model is not a sequence classifier (no *ForSequenceClassification "
                "head): it embeds (LLM.embed)",
                "prompts",
            )
        return [
            ClassificationRequestOutput(
                o.request_id,
                ClassificationOutput(list(o.outputs.embedding)),
                list(o.prompt_token_ids),
            )  # fmt: skip
            for o in self._pool(prompts, None, use_tqdm, priority)
        ]

    def _pooler_task(self) -> str | None:
        cfg = getattr(self.llm_engine.config.model, "pooler_config", None)
        return cfg.task if cfg is not None else None

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        prompts = _prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params_list = _one_per_prompt(pooling_params, PoolingParams, len(prompts), "pooling_params")
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError("priority needs one value per prompt", "priority")
        batch = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            text, ids, images = self._parse_prompt(prompt)
            if images:
                raise InvalidRequestError("embedding prompts take no images", "prompts")
            if ids is None and self.llm_engine.tokenizer is None:
                raise InvalidRequestError(
                    "text prompts need a tokenizer (skip_tokenizer_init=True); pass token ids",
                    "prompts",
                )
            prio = priority[i] if priority is not None else 0
            batch.append((str(next(self._counter)), text, params, ids, prio, None, True))
        self.llm_engine.add_requests(batch)  # all or none
        return self._run([r[0] for r in batch], use_tqdm)  # type: ignore[return-value]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one ``text_1`` against each ``text_2`` (1:N), or two lists of
        the same length pairwise (N:N); one output per pair, in pair order. A cross-encoder
        (``*ForSequenceClassification``) reads each pair as one prompt (its tokenizer's pair
        encoding) and scores it (the sigmoid of its logit); an embedding model embeds each
        distinct text once and scores the cosine similarity of the two embeddings."""
        from engine.scoring import cosine, score_pairs

        pairs = score_pairs(text_1, text_2)
        if self._pooler_task() == "classify":
            labels = self.llm_engine.config.model.pooler_config.labels or []
            if len(labels) != 1:
                raise InvalidRequestError(
                    f"this classifier has {len(labels)} labels: scoring text pairs takes a "
                    "cross-encoder (one label)",
                    "text_1",
                )
            tok = self.get_tokenizer()
            ids = [list(tok(a, b)["input_ids"]) for a, b in pairs]
            outs = self._pool([{"prompt_token_ids": i} for i in ids], pooling_params, use_tqdm)
            return [
                ScoringRequestOutput(
                    o.request_id,
                    ScoringOutput(float(o.outputs.embedding[0])),
                    list(o.prompt_token_ids),
                )  # fmt: skip
                for o in outs
            ]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self._pool(texts, pooling_params, use_tqdm), strict=True))
        out = []
        for a, b in pairs:
            ea, eb = embedded[a], embedded[b]
            out.append(
                ScoringRequestOutput(
                    request_id=f"{ea.request_id}_{eb.request_id}",
                    outputs=ScoringOutput(cosine(ea.outputs.embedding, eb.outputs.embedding)),
                    prompt_token_ids=list(ea.prompt_token_ids) + list(eb.prompt_token_ids),
                )
            )
        return out

    def _generate_parsed(
        self,
        parsed: list[tuple[str | None, list[int] | None, list[Any]]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate everything first: a bad prompt in the middle must not leave work queued.
        for (text, ids, _), params in zip(parsed, params_list, strict=True):
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
        for i, ((text, ids, images), params) in enumerate(zip(parsed, params_list, strict=True)):
            prio = priority[i] if priority is not None else 0
            request_id = str(next(self._counter))
            batch.append((request_id, text, params, ids, prio, None, True, images, loras[i]))
        engine.add_requests(batch)  # all or none
        return self._run([r[0] for r in batch], use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``); one ``BeamSearchOutput``
        per prompt, its ``beam_width`` sequences best first.

        The search runs above the engine (``engine.beam_search``): each step is one
        ``generate`` call with one single-token request per live beam of every prompt, and the
        beams' common prefixes are shared through the prefix cache. Prompts as in
        ``generate`` (images excepted)."""
        from engine.beam_search import BeamSearch, check_beam_width

        prompts = _prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("params must be a BeamSearchParams", "params")
        params.validate()
        engine = self.llm_engine
        eos = list(engine.eos_token_ids)
        check_beam_width(params, len(set(eos)), int(engine.config.max_logprobs))
        loras = _per_prompt_loras(lora_request, len(prompts))
        searches = []
        for prompt in prompts:
            text, ids, images = self._parse_prompt(prompt)
            if images:
                raise InvalidRequestError("beam search takes no image inputs", "prompts")
            if ids is None:
                if engine.tokenizer is None:
                    raise InvalidRequestError(
                        "text prompts need a tokenizer (skip_tokenizer_init=True)", "prompts"
                    )
                ids = list(engine.tokenizer(text).input_ids)
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise InvalidRequestError(
                    f"a prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds "
                    f"the model's context ({engine.max_model_len} tokens)",
                    "max_tokens",
                )
            searches.append(BeamSearch(ids, params, eos))
        max_logprobs = int(engine.config.max_logprobs)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=params.max_tokens, desc="Beam search steps", dynamic_ncols=True)
        try:
            while True:
                live = [(s, lora) for s, lora in zip(searches, loras, strict=True) if not s.done]
                if not live:
                    break
                batch, batch_params, batch_loras, owners = [], [], [], []
                for search, lora in live:
                    step = search.step_params(max_logprobs)
                    for seq in search.live_sequences():
                        batch.append((None, seq, []))
                        batch_params.append(step)
                        batch_loras.append(lora)
                    owners.append((search, len(search.live_sequences())))
                outputs = self._generate_parsed(batch, batch_params, False, None, batch_loras)
                at = 0
                for search, count in owners:
                    scored = outputs[at : at + count]
                    at += count
                    search.advance([logprob_dict(o.outputs[0].logprobs[0]) for o in scored])
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        tokenizer = engine.tokenizer
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids))
        return [search.results(decode) for search in searches]

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
        parsed: list[tuple[str | None, list[int] | None, list[Any]]] = []
        for conversation in conversations:
            from engine.multimodal.chat import take_image_parts

            try:
                conversation, image_urls = take_image_parts(list(conversation))
            except ValueError as e:
                raise InvalidRequestError(str(e), "messages") from None
            if image_urls:
                parsed.append(
                    self._chat_with_images(
                        conversation,
                        image_urls,
                        dict(
                            chat_template=chat_template,
                            add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message,
                            tools=tools,
                            **(chat_template_kwargs or {}),
                        ),
                    )
                )
                continue
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
            parsed.append((None, list(ids), []))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(parsed)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(parsed):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(parsed)} conversations; "
                    "pass one or one per conversation",
                    "sampling_params",
                )
        loras = _per_prompt_loras(lora_request, len(parsed))
        return self._generate_parsed(parsed, params_list, use_tqdm, None, loras)

    # ------------------------------------------------------------------ images
    def _image_processor(self) -> Any:
        """The model's processor for image inputs (built on first use)."""
        if self._images is None:
            engine = self.llm_engine
            spec = engine.image_input_spec
            if spec is None:
                raise InvalidRequestError(
                    "this model takes no image inputs (a text model, or one served with "
                    'limit_mm_per_prompt={"image": 0})',
                    "multi_modal_data",
                )
            from engine.multimodal.media import MediaConnector
            from engine.multimodal.processing import MultiModalProcessor
            from engine.runtime import model_dir

            directory = model_dir(engine.config.model)
            try:
                processor = MultiModalProcessor.from_model_dir(directory, engine.tokenizer, spec)
            except ValueError as e:
                raise InvalidRequestError(str(e), "multi_modal_data") from None
            self._images = (processor, MediaConnector(engine.config.multimodal))
        return self._images

    def _with_images(
        self, text: str | None, ids: list[int] | None, images: list[Any]
    ) -> tuple[str | None, list[int] | None, list[Any]]:
        """A parsed prompt with its images processed into token ids and features."""
        if not images:
            return text, ids, []
        if text is None:
            raise InvalidRequestError(
                "multi_modal_data needs a text prompt ({'prompt': ..., 'multi_modal_data': "
                "...}) that places the images; token-id prompts with images are not supported",
                "prompts",
            )
        processor, media = self._image_processor()
        self._check_image_count(len(images))
        try:
            images = [media.check_image(image) for image in images]
            ids, features = processor.process(text, images, add_special_tokens=True)
        except ValueError as e:
            raise InvalidRequestError(str(e), "multi_modal_data") from None
        return text, ids, features

    def _check_image_count(self, n: int) -> None:
        limit = self.llm_engine.config.multimodal.limit("image")
        if n > limit:
            raise InvalidRequestError(
                f"the prompt has {n} images; at most {limit} are allowed per prompt "
                "(limit_mm_per_prompt)",
                "multi_modal_data",
            )

    def _chat_with_images(
        self,
        conversation: list[Message],
        image_urls: list[tuple[str, str]],
        template_kwargs: dict[str, Any],
    ) -> tuple[str | None, list[int] | None, list[Any]]:
        from engine.multimodal.chat import render_with_images

        processor, media = self._image_processor()
        self._check_image_count(len(image_urls))
        tokenizer = self.get_tokenizer()
        images = []
        try:
            for url, where in image_urls:
                try:
                    images.append(media.load_image(url))
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            prompt = render_with_images(
                lambda conv: tokenizer.apply_chat_template(
                    conv, tokenize=False, return_dict=False, **template_kwargs
                ),
                conversation,
                len(images),
                processor.image_placeholder,
            )
            # The template wrote the special tokens it wants (BOS...).
            ids, features = processor.process(prompt, images, add_special_tokens=False)
        except ValueError as e:
            raise InvalidRequestError(str(e), "messages") from None
        return prompt, ids, features

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter ahead of the requests that use it (raises with the reason when
        it cannot be served)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter (False: not loaded)."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the loaded LoRA adapters."""
        return self.llm_engine.list_loras()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None, list[Any]]:
        """``(text, token ids, images)`` of a prompt."""
        if isinstance(prompt, str):
            return _encodable(prompt), None, []
        if isinstance(prompt, dict):
            images: list[Any] = []
            data = prompt.get("multi_modal_data")
            if data is not None:
                if not isinstance(data, dict) or set(data) - {"image"}:
                    raise InvalidRequestError(
                        'multi_modal_data must be {"image": image or [images]}', "prompts"
                    )
                value = data.get("image")
                images = list(value) if isinstance(value, (list, tuple)) else [value]
                images = [i for i in images if i is not None]
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), images
            if "prompt" in prompt:
                return _encodable(prompt["prompt"]), None, images
            raise InvalidRequestError(
                "a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompts"
            )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), []
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
                            if isinstance(output, RequestOutput):
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


def _lora_config(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    fused_shrink: bool | None,
) -> Any:
    if not enable_lora:
        return None
    from engine.lora.config import LoRAConfig

    return LoRAConfig(
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=max_cpu_loras,
        fused_shrink=fused_shrink,
    )


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, a prompt dict or a list of token ids) or a sequence of them, as a
    list of prompts."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def _one_per_prompt(params: Any, cls: type, num_prompts: int, field: str) -> list[Any]:
    """``params``: one ``cls`` for every prompt, or a sequence of one per prompt."""
    if isinstance(params, cls):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise InvalidRequestError(
            f"got {len(params_list)} {cls.__name__} for {num_prompts} prompts; pass one or one "
            "per prompt",
            field,
        )
    return params_list


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """``generate``'s ``lora_request``: one for every prompt, or one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise InvalidRequestError(
            f"got {len(loras)} LoRA requests for {num_prompts} prompts; pass one or one per prompt",
            "lora_request",
        )
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise InvalidRequestError(
                f"lora_request entries must be LoRARequest or None, got {type(lora).__name__}",
                "lora_request",
            )
    return loras
