"""``engine generate`` and ``engine chat``: try a model from the terminal."""

from __future__ import annotations

import argparse
import sys

from engine.cli.args import (
    add_engine_args,
    add_log_level_arg,
    add_model_arg,
    configure_logging,
    engine_config_from_args,
)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=64, help="Tokens to generate (default: %(default)s)."
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)."
    )
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    group.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="Per-request seed for reproducible sampling.",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="Complete one or more prompts and print the results.",
        description="Complete prompts with a model (default: the embedded Gemma 3 270M).",
    )
    gen.add_argument("prompts", nargs="+", help="Prompt text(s).")
    add_model_arg(gen, positional=False)
    _add_sampling_args(gen)
    add_engine_args(gen)
    add_log_level_arg(gen)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser(
        "chat",
        help="Chat with a model in the terminal.",
        description="An interactive chat using the model's chat template. Empty line or "
        "Ctrl-D quits.",
    )
    add_model_arg(chat, positional=True)
    chat.add_argument("--system", default=None, help="A system message.")
    _add_sampling_args(chat)
    add_engine_args(chat)
    add_log_level_arg(chat)
    chat.set_defaults(func=run_chat)


def _build(args: argparse.Namespace):
    import logging

    from engine.cpu_kv_cache import ONE_SHOT_BUDGET_GIB
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    configure_logging(args.log_level)
    config = engine_config_from_args(args)
    if config.cache.cpu_kv_cache_gb is None:
        # A one-shot command runs a few requests: a server's default budget would be
        # resident memory held for nothing.
        config.cache.cpu_kv_cache_gb = ONE_SHOT_BUDGET_GIB
        logging.getLogger("engine.cli").info(
            "engine %s runs a few requests, so a CPU KV cache gets a %g GiB budget "
            "(--cpu-kv-cache-gb to change it)",
            args.command,
            ONE_SHOT_BUDGET_GIB,
        )
    llm = LLM.from_engine_config(config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        n=args.n,
        seed=args.sampling_seed,
    )
    return llm, params


def run_generate(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    for output in llm.generate(list(args.prompts), params, use_tqdm=False):
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print(f"  [{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm, params = _build(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(f"model> {reply}")
        sys.stdout.flush()
