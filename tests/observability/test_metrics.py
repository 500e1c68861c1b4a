from __future__ import annotations

import pytest

from decoding.params import BatchStep, FinishReason, RequestStats, StepOutput
from gateway.observability.metrics import OTHER, Metrics, batch_label, route_label


def test_step_counts_drafted_accepted_and_positions() -> None:
    m = Metrics(models=["tiny"])
    m.observe_step("tiny", StepOutput("r", [1, 2, 3], drafted=4, accepted=2))
    m.observe_step("tiny", StepOutput("r", [4], drafted=0, accepted=0))
    m.observe_step("tiny", StepOutput("r", [5, 6], drafted=2, accepted=2))
    assert m.value("specgate_engine_steps_total", model="tiny", kind="spec") == 2
    assert m.value("specgate_engine_steps_total", model="tiny", kind="plain") == 1
    assert m.value("specgate_spec_drafted_tokens_total", model="tiny") == 6
    assert m.value("specgate_spec_accepted_tokens_total", model="tiny") == 4
    drafted = [
        m.value("specgate_spec_position_drafted_total", model="tiny", position=str(i)) for i in (1, 2, 3, 4)
    ]
    accepted = [
        m.value("specgate_spec_position_accepted_total", model="tiny", position=str(i)) for i in (1, 2, 3, 4)
    ]
    assert drafted == [2, 2, 1, 1]
    assert accepted == [2, 2, 0, 0]
    assert m.value("specgate_spec_accepted_per_step_count", model="tiny") == 2
    assert m.value("specgate_spec_accepted_per_step_sum", model="tiny") == 4
    assert m.value("specgate_spec_k_count", model="tiny") == 3
    assert m.value("specgate_spec_k_bucket", model="tiny", le="0.0") == 1  # the plain step


def test_batch_steps_count_rows_tokens_and_k_by_batch_size() -> None:
    m = Metrics(models=["tiny"])
    m.observe_batch_step(BatchStep("tiny", rows=3, prefilling=1, tokens=9, drafted=4))
    m.observe_batch_step(BatchStep("tiny", rows=1, prefilling=0, tokens=1, drafted=0))
    m.observe_batch_step(BatchStep("tiny", rows=0, prefilling=2, tokens=0, drafted=0))  # prompts only
    assert m.value("specgate_engine_batch_rows_count", model="tiny") == 2
    assert m.value("specgate_engine_batch_rows_sum", model="tiny") == 4
    assert m.value("specgate_engine_step_tokens_sum", model="tiny") == 10
    assert m.value("specgate_engine_prefill_chunks_total", model="tiny") == 3
    assert m.value("specgate_engine_step_k_sum", model="tiny", batch="4") == 4
    assert m.value("specgate_engine_step_k_bucket", model="tiny", batch="1", le="0.0") == 1
    labels = [batch_label(n) for n in (1, 2, 3, 64, 65, 256, 257)]
    assert labels == ["1", "2", "4", "64", "128", "256", "256+"]


def test_closing_output_of_an_abort_is_not_a_step() -> None:
    m = Metrics()
    m.observe_step("tiny", StepOutput("r", [], finish_reason=FinishReason.ABORT))
    assert m.value("specgate_engine_steps_total", model="tiny", kind="plain") == 0


def test_generation_done_counts_switch_offs() -> None:
    m = Metrics()
    stats = RequestStats(spec_disabled_steps=5, drafter="draft-model", queue_s=0.5, prefill_s=0.1)
    m.observe_generation_done("tiny", stats, "stop")
    m.observe_generation_done("tiny", RequestStats(drafter="draft-model"), "length")
    assert m.value("specgate_spec_disabled_steps_total", model="tiny") == 5
    assert m.value("specgate_spec_switched_off_requests_total", model="tiny") == 1
    assert (
        m.value("specgate_generations_total", model="tiny", finish_reason="stop", drafter="draft-model") == 1
    )
    assert m.value("specgate_engine_queue_wait_seconds_sum", model="tiny") == pytest.approx(0.5)


def test_generation_done_counts_prefix_hits_and_cached_against_computed_prompt_tokens() -> None:
    m = Metrics(models=["tiny"])
    m.observe_generation_done("tiny", RequestStats(prompt_tokens=900, cached_tokens=832), "stop")
    m.observe_generation_done("tiny", RequestStats(prompt_tokens=100), "stop")
    assert m.value("specgate_prefix_cache_lookups_total", model="tiny", outcome="hit") == 1
    assert m.value("specgate_prefix_cache_lookups_total", model="tiny", outcome="miss") == 1
    assert m.value("specgate_engine_prompt_tokens_total", model="tiny", source="cached") == 832
    assert m.value("specgate_engine_prompt_tokens_total", model="tiny", source="computed") == 168


def test_request_done_latency_ttft_tpot_tokens() -> None:
    m = Metrics()
    m.observe_request_done(
        "/v1/chat/completions", "tiny", 200, 1.0, ttft_s=0.2, prompt_tokens=7, completion_tokens=5
    )
    assert m.value("specgate_requests_total", route="/v1/chat/completions", model="tiny", status="200") == 1
    assert m.value("specgate_prompt_tokens_total", model="tiny") == 7
    assert m.value("specgate_completion_tokens_total", model="tiny") == 5
    assert m.value("specgate_time_to_first_token_seconds_sum", model="tiny") == pytest.approx(0.2)
    assert m.value("specgate_time_per_output_token_seconds_sum", model="tiny") == pytest.approx(0.8 / 4)
    assert m.value("specgate_request_duration_seconds_count", route="/v1/chat/completions", model="tiny") == 1


def test_labels_stay_bounded() -> None:
    m = Metrics(models=["tiny"], cap=2)
    for i in range(10):
        m.observe_request_done(f"/probe/{i}", f"junk-{i}", 404, 0.01)
    m.observe_request_done("/v1/models/abc", "tiny", 200, 0.01)
    assert m.value("specgate_requests_total", route=OTHER, model=OTHER, status="404") == 8
    assert m.value("specgate_requests_total", route="/v1/models/{id}", model="tiny", status="200") == 1
    text = m.render().decode()
    assert "junk-9" not in text and "/probe/" not in text
    assert route_label("/v1/chat/completions") == "/v1/chat/completions"
    assert route_label("/v1/responses") == "/v1/responses"
    assert route_label("/v1/responses/resp_0123") == "/v1/responses/{id}"  # never an id as a label


def test_cache_router_upstream_and_circuit() -> None:
    m = Metrics(upstreams=["vllm-a"])
    m.observe_cache("exact", "miss", 0.001)
    m.observe_cache("semantic", "hit", 0.02)
    m.observe_cache("exact", "bogus")
    m.observe_redis_error("get")
    m.set_circuit_state("redis", "open")
    m.observe_route("large", "draft", 0.0002)
    m.observe_upstream("vllm-a", "ok", 0.5)
    m.observe_upstream_retry("vllm-a", "connect")
    m.observe_fallback("remote", "large")
    assert m.value("specgate_cache_lookups_total", tier="semantic", outcome="hit") == 1
    assert m.value("specgate_cache_lookups_total", tier="exact", outcome=OTHER) == 1
    assert m.value("specgate_cache_lookup_duration_seconds_count", tier="exact") == 1
    assert m.value("specgate_cache_redis_errors_total", op="get") == 1
    assert m.value("specgate_circuit_state", component="redis") == 2
    assert m.value("specgate_route_decisions_total", tier="large", strategy="draft") == 1
    assert m.value("specgate_upstream_requests_total", upstream="vllm-a", outcome="ok") == 1
    assert m.value("specgate_upstream_retries_total", upstream="vllm-a", reason="connect") == 1
    assert m.value("specgate_upstream_fallbacks_total", from_tier="remote", to_tier="large") == 1
    with pytest.raises(AssertionError, match="circuit state"):
        m.set_circuit_state("redis", "ajar")


def test_engine_gauges_read_at_scrape_time() -> None:
    class Engine:
        queue_depth = 3
        active = 2

    m, e = Metrics(), Engine()
    m.bind_engine(e)
    assert m.value("specgate_engine_queue_depth") == 3
    e.queue_depth = 5
    assert m.value("specgate_engine_queue_depth") == 5
    assert m.value("specgate_engine_active_requests") == 2


def test_two_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.observe_abort("/v1/completions", "decode")
    assert a.value("specgate_aborted_requests_total", route="/v1/completions", phase="decode") == 1
    assert b.value("specgate_aborted_requests_total", route="/v1/completions", phase="decode") == 0
