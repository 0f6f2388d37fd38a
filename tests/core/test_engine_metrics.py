"""Engine metrics parsing: both dialects, aggregation over label sets, clear errors, and the
names our own simulator emits."""

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


def simulated_engine_metrics(submitted: int) -> tuple[str, EngineModel]:
    """The metrics text our simulator serves, for an engine with ``submitted`` requests queued."""
    params = EngineParams.model_validate(
        dict(
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
