"""Engine metrics parsing: every dialect (vLLM current and older, SGLang, llama.cpp, TGI) from
expositions shaped as those engines write them, aggregation over label sets, partial metrics,
clear errors, and the names our own simulator emits."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.engine_metrics import (
    EngineDialect,
    EngineSample,
    MetricsFormatError,
    Series,
    parse_engine_metrics,
    parse_exposition,
)
from llmgw.services.sim.engine_model import EngineModel
from llmgw.services.sim.metrics import EngineMetrics
from llmgw.services.sim.params import EngineParams

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 2.0
vllm:kv_cache_usage_perc{model_name="llama"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="4096"} 1.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 1
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.5
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM, EngineSample(EngineDialect.VLLM, 3, 2, 0.25, 16, 4096)),
        (SGLANG, EngineSample(EngineDialect.SGLANG, 7, 1, 0.5)),
        (  # older vLLM: only the gpu_ name for KV usage, no cache info
            "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            "vllm:gpu_cache_usage_perc 0.75\n",
            EngineSample(EngineDialect.VLLM, 1, 0, 0.75),
        ),
        (  # both KV names: the current one wins
            "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n",
            EngineSample(EngineDialect.VLLM, 1, 0, 0.1),
        ),
        (  # several label sets: counts summed, KV usage is the worst cache
            'vllm:num_requests_running{model_name="a"} 2\n'
            'vllm:num_requests_running{model_name="b"} 5\n'
            'vllm:num_requests_waiting{model_name="a"} 1\n'
            'vllm:num_requests_waiting{model_name="b"} 4\n'
            'vllm:kv_cache_usage_perc{model_name="a"} 0.2\n'
            'vllm:kv_cache_usage_perc{model_name="b"} 0.6\n',
            EngineSample(EngineDialect.VLLM, 7, 5, 0.6),
        ),
        (  # cache info series that disagree leave the description unknown
            VLLM + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1\n',
            EngineSample(EngineDialect.VLLM, 3, 2, 0.25, 16, None),
        ),
        (  # both dialects complete: vLLM wins
            SGLANG + VLLM,
            EngineSample(EngineDialect.VLLM, 3, 2, 0.25, 16, 4096),
        ),
        (  # timestamps, exemplars, blank lines, spaces inside braces, float noise above 1
            '\n  vllm:num_requests_running{ model_name = "x" , } 1 1712345678000\n'
            'vllm:num_requests_waiting{} 0e0 # {trace_id="abc"} 1.0\n'
            "vllm:kv_cache_usage_perc 1.0000000001\n# EOF\n",
            EngineSample(EngineDialect.VLLM, 1, 0, 1.0),
        ),
        (  # label values holding the characters that end a label block or a line
            'vllm:num_requests_running{model_name="a}b,c=\\"d\\"#e\\\\"} 2\n'
            "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n",
            EngineSample(EngineDialect.VLLM, 2, 0, 0.0),
        ),
        (  # metrics with a matching prefix are not the gauge
            "vllm:num_requests_running_total 99\nvllm:num_requests_running 1\n"
            "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n",
            EngineSample(EngineDialect.VLLM, 1, 0, 0.5),
        ),
    ],
    ids=[
        "vllm",
        "sglang",
        "vllm-old-kv-name",
        "vllm-kv-name-preference",
        "sum-over-labels",
        "cache-info-disagrees",
        "both-dialects",
        "format-extras",
        "escaped-labels",
        "prefix-names",
    ],
)
def test_parses_engine_load(text: str, expected: EngineSample) -> None:
    assert parse_engine_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("# only comments\n", None),
        ("process_cpu_seconds_total 1.5\nhttp_requests_total 3\n", None),
        (  # no KV usage (e.g. an engine that does not report it)
            "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n",
            EngineSample(EngineDialect.VLLM, 1, 0, None),
        ),
        (  # SGLang without a queue gauge
            "sglang:num_running_reqs 1\nsglang:token_usage 0.1\n",
            EngineSample(EngineDialect.SGLANG, 1, None, 0.1),
        ),
        ("vllm:num_requests_running 4\n", EngineSample(EngineDialect.VLLM, 4, None, None)),
        (  # the dialect with more gauges wins
            "vllm:num_requests_running 4\nsglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n",
            EngineSample(EngineDialect.SGLANG, 1, 2, None),
        ),
    ],
    ids=[
        "empty",
        "comments-only",
        "no-engine-gauges",
        "vllm-no-kv",
        "sglang-no-queue",
        "running-only",
        "more-gauges-wins",
    ],
)
def test_reads_partial_or_no_engine_load(text: str, expected: EngineSample | None) -> None:
    """Engines that expose only some of the gauges, or none, are usable: what is missing is
    None (the gateway's own accounting carries it), and no gauge at all is no sample."""
    assert parse_engine_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            VLLM.replace("0.25", "25"),
            "vllm:kv_cache_usage_perc must be a fraction within 0..1, got 25",
        ),
        (VLLM.replace("0.25", "NaN"), "must be a fraction within 0..1, got nan"),
        (VLLM.replace("0.25", "-0.1"), "must be a fraction within 0..1"),
        (
            VLLM.replace("3.0", "2.5"),
            "vllm:num_requests_running must be a non-negative whole number",
        ),
        (
            VLLM.replace("2.0", "-1"),
            "vllm:num_requests_waiting must be a non-negative whole number",
        ),
        (VLLM.replace("3.0", "+Inf"), "must be a non-negative whole number, got inf"),
        (VLLM + "vllm:num_requests_running 1 2 3\n", "line 8: expected a value and at most a"),
        (VLLM + "vllm:num_requests_running\n", "line 8: expected whitespace before the value"),
        (VLLM + "vllm:num_requests_running one\n", "line 8: invalid sample value 'one'"),
        (VLLM + "vllm:num_requests_running 1_000\n", "invalid sample value '1_000'"),
        (VLLM + '{model_name="x"} 1\n', "line 8: expected a metric name"),
        (VLLM + 'm{model_name="x} 1\n', "unterminated label value"),
        (VLLM + "m{model_name=x} 1\n", "after label model_name"),
        (VLLM + 'm{model_name "x"} 1\n', "after label model_name"),
        (VLLM + 'm{a="1" b="2"} 1\n', "expected , or } after a label"),
        (VLLM + 'm{a="\\t"} 1\n', "invalid escape"),
        (VLLM + 'm{1a="x"} 1\n', "expected a label name"),
    ],
    ids=[
        "kv-percent",
        "kv-nan",
        "kv-negative",
        "running-fraction",
        "waiting-negative",
        "running-inf",
        "extra-fields",
        "no-value",
        "bad-value",
        "digit-separator",
        "no-name",
        "unterminated-label",
        "unquoted-label",
        "no-equals",
        "missing-comma",
        "bad-escape",
        "bad-label-name",
    ],
)
def test_rejects_what_it_cannot_read(text: str, message: str) -> None:
    with pytest.raises(MetricsFormatError) as error:
        parse_engine_metrics(text)
    assert message in str(error.value)


# Expositions as each engine writes them: the load gauges among the other series it exports,
# its labels, its number formatting.
VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.3125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1024.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="27000"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.84
"""

VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama-2-7b"} 6.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="llama-2-7b"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama-2-7b"} 3.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama-2-7b"} 0.97
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="llama-2-7b"} 0.05
# HELP vllm:cache_config_info information of cache_config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="7000",swap_space_bytes="4294967296"} 1.0
"""

SGLANG_DP = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 12.0
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 0.0
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 0.41
sglang:token_usage{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 0.63
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 0.12
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="Qwen/Qwen3-8B"} 8.128902e+06
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 235.743
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 7801
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 402.1
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 5217
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 1.49531
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 140.26
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 19.4007
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""

# A 2024 build: it also reported KV usage (used cells over the context size).
LLAMACPP_2024 = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 512
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.203125
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 832
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

TGI = """\
# TYPE tgi_request_count counter
tgi_request_count 1385
# TYPE tgi_request_success counter
tgi_request_success 1380
# TYPE tgi_queue_size gauge
tgi_queue_size 5
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 41210
# TYPE tgi_batch_inference_duration histogram
tgi_batch_inference_duration_bucket{method="decode",le="0.005"} 0
tgi_batch_inference_duration_bucket{method="decode",le="+Inf"} 88412
tgi_batch_inference_duration_sum{method="decode"} 2210.3
tgi_batch_inference_duration_count{method="decode"} 88412
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_V1, EngineSample(EngineDialect.VLLM, 4, 1, 0.3125, 16, 27000)),
        # Swapped-out requests wait to run again: they count as waiting.
        (VLLM_V0, EngineSample(EngineDialect.VLLM, 6, 5, 0.97, 16, 7000)),
        (SGLANG_DP, EngineSample(EngineDialect.SGLANG, 21, 3, 0.63)),
        (LLAMACPP, EngineSample(EngineDialect.LLAMACPP, 4, 2, None)),
        (LLAMACPP_2024, EngineSample(EngineDialect.LLAMACPP, 1, 0, 0.203125)),
        (TGI, EngineSample(EngineDialect.TGI, 32, 5, None)),
        (
            "# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n",
            EngineSample(EngineDialect.TGI, None, 0, None),
        ),
    ],
    ids=["vllm-v1", "vllm-v0", "sglang-dp", "llamacpp", "llamacpp-2024", "tgi", "tgi-queue-only"],
)
def test_reads_each_engines_own_exposition(text: str, expected: EngineSample) -> None:
    assert parse_engine_metrics(text) == expected


_GAUGES = {  # dialect: (running, waiting, kv usage or None)
    EngineDialect.VLLM: (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ),
    EngineDialect.SGLANG: (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
    ),
    EngineDialect.LLAMACPP: (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:kv_cache_usage_ratio",
    ),
    EngineDialect.TGI: ("tgi_batch_current_size", "tgi_queue_size", None),
}


@given(
    dialect=st.sampled_from(list(_GAUGES)),
    ranks=st.lists(
        st.tuples(st.integers(0, 512), st.integers(0, 512), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=4,
    ),
    shown=st.sets(st.sampled_from(["running", "waiting", "kv"]), min_size=1),
    noise=st.lists(
        st.tuples(st.sampled_from(["process_", "http_", "python_gc_"]), st.floats(0, 1e9))
    ),
)
def test_any_dialect_with_any_subset_of_its_gauges_reads_back(
    dialect: EngineDialect,
    ranks: list[tuple[int, int, float]],
    shown: set[str],
    noise: list[tuple[str, float]],
) -> None:
    """Whatever subset of its load gauges an engine shows, over however many ranks (label sets),
    amid other series: counts are summed, KV usage is the worst rank's, what is not shown is
    None, and nothing raises; with no load gauge at all there is no sample."""
    running_name, waiting_name, kv_name = _GAUGES[dialect]
    names = {"running": running_name, "waiting": waiting_name, "kv": kv_name}
    lines = [f"{prefix}metric_{i} {value!r}" for i, (prefix, value) in enumerate(noise)]
    for rank, (running, waiting, kv) in enumerate(ranks):
        values = {"running": float(running), "waiting": float(waiting), "kv": kv}
        for gauge in sorted(shown):
            if names[gauge] is not None:
                lines.append(f'{names[gauge]}{{dp_rank="{rank}"}} {values[gauge]!r}')
    sample = parse_engine_metrics("\n".join(lines) + "\n")
    if all(names[gauge] is None for gauge in shown):
        assert sample is None
        return
    assert sample is not None and sample.dialect == dialect
    total_running = sum(r for r, _, _ in ranks)
    total_waiting = sum(w for _, w, _ in ranks)
    assert sample.running == (total_running if "running" in shown else None)
    assert sample.waiting == (total_waiting if "waiting" in shown else None)
    has_kv = "kv" in shown and kv_name is not None
    assert sample.kv_usage == (max(k for _, _, k in ranks) if has_kv else None)
    assert sample.complete == (set(shown) == {"running", "waiting", "kv"} and kv_name is not None)


def test_format_error_is_a_value_error() -> None:
    assert issubclass(MetricsFormatError, ValueError)


label_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


@given(
    labels=st.dictionaries(
        st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True), label_values, max_size=4
    ),
    value=st.floats(allow_nan=False),
)
def test_label_values_round_trip_through_escaping(labels: dict[str, str], value: float) -> None:
    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    body = ",".join(f'{name}="{escape(text)}"' for name, text in labels.items())
    line = f"ns:metric{{{body}}} {value!r}"
    assert parse_exposition(line) == [Series("ns:metric", labels, value)]


def simulated_engine_metrics(submitted: int, dialect: str = "vllm") -> tuple[str, EngineModel]:
    """The metrics text our simulator serves, for an engine with ``submitted`` requests queued."""
    params = EngineParams.model_validate(
        dict(
            metrics_dialect=dialect,
            max_num_seqs=3,
            num_gpu_blocks=64,
            block_size=4,
            max_model_len=200,
            prefill_base=0.01,
            prefill_per_token=0.001,
            itl_base=0.005,
            itl_per_running_seq=0.001,
        )
    )
    exporter = EngineMetrics(params, "sim-model")
    model = EngineModel(
        params,
        random.Random(7),
        on_first_token=exporter.observe_first_token,
        on_finish=exporter.observe_finish,
    )
    exporter.bind(model)
    for index in range(submitted):
        model.submit(0.0, list(range(index * 10, index * 10 + 10)), max_tokens=20)
    model.advance(0.05)  # first tokens out, nobody finished
    body, _content_type = exporter.render()
    return body.decode(), model


@pytest.mark.parametrize("submitted", [0, 2, 5])
def test_reads_the_names_our_simulator_emits(submitted: int) -> None:
    text, model = simulated_engine_metrics(submitted)
    sample = parse_engine_metrics(text)
    assert sample == EngineSample(
        dialect=EngineDialect.VLLM,
        running=len(model.running),
        waiting=len(model.waiting),
        kv_usage=model.kv.usage,
        block_size=4,
        num_gpu_blocks=64,
    )
    if submitted == 5:  # the case is a real load: a full batch and a queue behind it
        assert (sample.running, sample.waiting) == (3, 2) and sample.kv_usage > 0


@pytest.mark.parametrize(
    ("dialect", "expected", "kv", "cache_info"),
    [
        ("vllm-legacy", EngineDialect.VLLM, True, True),
        ("sglang", EngineDialect.SGLANG, True, False),
        ("llamacpp", EngineDialect.LLAMACPP, False, False),
        ("tgi", EngineDialect.TGI, False, False),
        ("partial", EngineDialect.VLLM, False, False),
    ],
)
def test_reads_every_dialect_our_simulator_speaks(
    dialect: str, expected: EngineDialect, kv: bool, cache_info: bool
) -> None:
    text, model = simulated_engine_metrics(5, dialect)
    sample = parse_engine_metrics(text)
    assert sample == EngineSample(
        dialect=expected,
        running=len(model.running),
        waiting=len(model.waiting),
        kv_usage=model.kv.usage if kv else None,
        block_size=4 if cache_info else None,
        num_gpu_blocks=64 if cache_info else None,
    )
    assert (sample.running, sample.waiting) == (3, 2)
