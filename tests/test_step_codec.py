"""The per-step message to the workers (``engine.executor.step_codec``), device-free.

The strongest check: random workloads (preemption, prefix hits, chunking, ``n > 1`` forks with
copy-on-write, sliding windows, aborts) run through the simulated engine loop with every step
encoded and decoded on its way to the "model", whose simulated KV cache then reads each
request's context back through the *decoded* block tables and tokens. A stale block id or token
on the worker's side is a wrong read-back, and the tokens must equal a run without the codec.
"""

from __future__ import annotations

import gc

import torch
from hypothesis import HealthCheck, given, settings
from test_scheduler_properties import build, must_reject, scenarios

from engine.config import CacheConfig, SchedulerConfig
from engine.executor.step_codec import StepDecoder, StepEncoder
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.request import PLACEHOLDER_TOKEN, Request
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.testing.scheduler_sim import SimRequest, run_simulation


class CodecScheduler:
    """A scheduler whose steps reach the caller as a worker would decode them."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.encoder = StepEncoder(scheduler.block_size)
        self.decoder = StepDecoder()
        self._last = None  # (engine-side step, decoded step)
        self.params = SamplingParams(temperature=0.0)
        self.bytes_sent = 0

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def schedule(self):
        if self._last is not None:
            self.decoder.after_step(self._last[1])
        out = self._scheduler.schedule()
        rows = {
            e.request.request_id: SamplingRow(
                self.params, e.request.prompt_token_ids, e.request.output_token_ids, [None]
            )
            for e in out.scheduled
            if e.samples
        }
        _, message = self.encoder.encode(out, rows)
        self.bytes_sent += len(message)
        decoded = self.decoder.decode(message)
        assert set(decoded.sampling_rows) == set(rows)
        self._last = (out, decoded)
        return decoded.sched_out

    def update_from_output(self, sched_out, sampled):
        engine_side, decoded = self._last
        assert sched_out is decoded.sched_out
        self._scheduler.update_from_output(engine_side, sampled)


CODEC_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@CODEC_SETTINGS
@given(scenarios())
def test_workers_see_every_step_as_the_engine_does(scenario):
    config, requests = scenario
    requests = [
        SimRequest(**{**r.__dict__, "abort_step": None})
        for r in requests
        if not must_reject(config, r)
    ]
    want = run_simulation(build(config), requests, max_steps=3000)
    through = CodecScheduler(build(config))
    got = run_simulation(through, requests, max_steps=3000)  # reads KV via decoded tables
    assert got.outputs == want.outputs
    # Finished requests are dropped by the workers too (one more, empty, step carries the
    # last finishes).
    through.schedule()
    through.decoder.after_step(through._last[1])
    assert through.decoder.requests == {}
    assert through.encoder.num_live_requests == 0


def test_a_decode_step_sends_one_token_and_no_table_per_request():
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=80_000),
        CacheConfig(block_size=16),
        4096,
        5000,
        [KVCacheGroupSpec()],
    )
    through = CodecScheduler(scheduler)
    for i in range(64):
        scheduler.add_request(Request(f"r{i}", list(range(1000 + i)), max_tokens=50))
    through.schedule()  # the prompts, once
    prefill_bytes = through.bytes_sent
    through.update_from_output(through._last[1].sched_out, {f"r{i}": [7] for i in range(64)})
    through.schedule()
    decode_bytes = through.bytes_sent - prefill_bytes
    assert prefill_bytes > 64 * 1000  # every prompt token went once
    assert decode_bytes < 64 * 40  # then about 30 bytes per request per decode step
    step = through._last[1]
    assert all(len(e.request.output_token_ids) == 1 for e in step.sched_out.scheduled)


def test_placeholders_are_sent_again_once_known():
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True),
        CacheConfig(block_size=4),
        256,
        64,
        [KVCacheGroupSpec()],
    )
    through = CodecScheduler(scheduler)
    scheduler.add_request(Request("a", [1, 2, 3], max_tokens=8))
    through.schedule()  # the prompt; it samples the first output token
    first = through._last[0]
    second = through.schedule()  # one step ahead: the decode's input is still a placeholder
    assert second.scheduled[0].request.output_token_ids == [PLACEHOLDER_TOKEN] * 2
    scheduler.update_from_output(first, {"a": [42]})
    scheduler.update_from_output(through._last[0], {"a": [43]})
    third = through.schedule()
    # The real tokens replaced the placeholders; the one of this step is still on its way.
    assert third.scheduled[0].request.output_token_ids == [42, 43, PLACEHOLDER_TOKEN]


def test_generators_are_created_from_the_seed_once_and_freed_with_the_engines():
    encoder, decoder = StepEncoder(4), StepDecoder()
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=4),
        256,
        64,
        [KVCacheGroupSpec()],
    )
    scheduler.add_request(Request("s", [1, 2, 3], max_tokens=8))
    params = SamplingParams(temperature=0.8, seed=1234)
    rows = {"s": SamplingRow(params, [1, 2, 3], [], [torch.Generator().manual_seed(1234)])}
    out = scheduler.schedule()
    decoded = decoder.decode(encoder.encode(out, rows)[1])
    worker_gen = decoded.sampling_rows["s"].generators[0]
    assert worker_gen.initial_seed() == 1234  # its own generator, from the engine's seed
    reference = torch.Generator().manual_seed(1234)
    assert torch.equal(torch.rand(4, generator=worker_gen), torch.rand(4, generator=reference))
    assert decoded.sampling_rows["s"].params == params
    scheduler.update_from_output(out, {"s": [9]})
    out = scheduler.schedule()
    step = decoder.decode(encoder.encode(out, rows)[1])
    assert step.sampling_rows["s"].generators[0] is worker_gen  # the same one, still drawing
    rows.clear()  # the engine drops its generator (the request finished)
    gc.collect()
    scheduler.update_from_output(out, {"s": [10]})
    step = decoder.decode(encoder.encode(scheduler.schedule(), {})[1])
    decoder.after_step(step)
    assert decoder.generators == {}  # so did the worker


def test_speculative_steps_carry_drafts_and_trimmed_tables():
    """A verification's drafts and proposal count reach the workers, and a step that rejects
    drafts (its look-ahead blocks trimmed) leaves the worker with the engine's tables."""
    from engine.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    )
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=2),
        256,
        64,
        [KVCacheGroupSpec()],
        speculative_config=spec,
    )
    through = CodecScheduler(scheduler)
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=20))
    out = through.schedule()
    assert through._last[0].scheduled[0].num_to_propose == 3
    assert out.scheduled[0].num_to_propose == 3
    through.update_from_output(out, {"a": [6]})
    scheduler.update_draft_token_ids({"a": [7, 8, 9]})
    out = through.schedule()
    engine_side = through._last[0].scheduled[0]
    worker_side = out.scheduled[0]
    assert list(worker_side.spec_token_ids) == [7, 8, 9] == list(engine_side.spec_token_ids)
    assert worker_side.num_new_tokens == 4 and worker_side.num_to_propose == 3
    assert worker_side.block_ids == engine_side.block_ids
    through.update_from_output(out, {"a": [7, 42]})  # one draft accepted, then its own token
    scheduler.update_draft_token_ids({"a": [1, 2]})
    out = through.schedule()
    engine_side = through._last[0].scheduled[0]
    assert out.scheduled[0].request.output_token_ids == [6, 7, 42]
    assert out.scheduled[0].block_ids == engine_side.block_ids  # the trim reached the worker
    assert list(out.scheduled[0].spec_token_ids) == [1, 2]


def test_a_bitmask_per_verified_position_keeps_its_rows():
    encoder, decoder = StepEncoder(4), StepDecoder()
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=4),
        256,
        64,
        [KVCacheGroupSpec()],
    )
    scheduler.add_request(Request("m", [1, 2, 3], max_tokens=8))
    mask = torch.arange(12, dtype=torch.int32).view(3, 4)  # 3 positions, 128-token vocabulary
    rows = {"m": SamplingRow(SamplingParams(), [1, 2, 3], [], [None], token_bitmask=mask)}
    decoded = decoder.decode(encoder.encode(scheduler.schedule(), rows)[1])
    assert torch.equal(decoded.sampling_rows["m"].token_bitmask, mask)


def test_a_new_request_carries_its_images_and_its_lora_adapter():
    """Workers mirror a request with images and a LoRA adapter with both: the images (for the
    tower every rank runs) and the adapter key (for each rank's slot of that adapter)."""
    import numpy as np

    from engine.lora.config import LoRAConfig
    from engine.multimodal.encoder_cache import EncoderBudget
    from engine.multimodal.inputs import MultiModalFeature

    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=4),
        256,
        64,
        [KVCacheGroupSpec()],
        encoder_budget=EncoderBudget(64, 1 << 20, 16),
        lora_config=LoRAConfig(max_loras=2),
    )
    through = CodecScheduler(scheduler)
    pixels = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    image = MultiModalFeature("img-1", offset=2, length=4, pixel_values=pixels)
    request = Request("a", [1, 2, 9, 9, 9, 9, 3], max_tokens=4, mm_features=[image])
    request.lora_id = 7
    scheduler.add_request(request)
    text = Request("b", [4, 5, 6], max_tokens=4)
    scheduler.add_request(text)
    through.schedule()
    mirrors = through.decoder.requests
    assert mirrors["a"].lora_id == 7 and mirrors["b"].lora_id == 0
    (got,) = mirrors["a"].mm_features
    assert (got.identifier, got.offset, got.length) == ("img-1", 2, 4)
    np.testing.assert_array_equal(got.pixel_values, pixels)
    assert mirrors["b"].mm_features == []
