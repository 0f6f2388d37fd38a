"""What an engine states about its batch capacity: each engine's answer, shaped as its source
writes it (SGLang's server info, TGI's /info, llama.cpp's /props), and anything else states
nothing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.engine_capacity import CAPACITY_PATHS, parse_capacity
from llmgw.core.engine_metrics import EngineDialect

# SGLang's /server_info: the server arguments, the scheduler's info, one internal state per
# data-parallel rank (fields as its docs' example prints them; most arguments left out here).
SGLANG = {
    "model_path": "qwen/qwen2.5-0.5b-instruct",
    "mem_fraction_static": 0.83,
    "max_running_requests": None,
    "max_total_tokens": None,
    "chunked_prefill_size": 8192,
    "dp_size": 2,
    "max_total_num_tokens": 20480,
    "max_req_input_len": 20474,
    "internal_states": [
        {
            "last_gen_throughput": 129.3,
            "memory_usage": {"weight": 0.98, "kvcache": 0.23, "token_capacity": 20480},
            "effective_max_running_requests_per_dp": 128,
        },
        {
            "last_gen_throughput": 131.0,
            "memory_usage": {"weight": 0.98, "kvcache": 0.23, "token_capacity": 20480},
            "effective_max_running_requests_per_dp": 128,
        },
    ],
    "version": "0.5.4",
}
# TGI's /info (router/src/lib.rs, Info).
TGI = {
    "model_id": "bigscience/bloom-560m",
    "model_sha": None,
    "model_pipeline_tag": "text-generation",
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_input_tokens": 1024,
    "max_total_tokens": 2048,
    "validation_workers": 2,
    "max_client_batch_size": 4,
    "router": "text-generation-router",
    "version": "3.3.6",
    "sha": None,
    "docker_label": None,
}
# llama-server's /props (tools/server).
LLAMACPP = {
    "default_generation_settings": {"params": {"temperature": 0.8}, "n_ctx": 4096},
    "total_slots": 4,
    "model_alias": "qwen",
    "model_path": "/models/qwen2.5-0.5b-instruct-q4_k_m.gguf",
    "modalities": {"vision": False, "audio": False},
    "endpoint_slots": True,
    "endpoint_props": False,
    "endpoint_metrics": True,
    "build_info": "b6000-abcdef",
}


@pytest.mark.parametrize(
    ("dialect", "document", "expected"),
    [
        (EngineDialect.SGLANG, SGLANG, 256),  # two data-parallel ranks of 128
        (EngineDialect.SGLANG, {**SGLANG, "internal_states": SGLANG["internal_states"][:1]}, 128),
        # a release without the per-rank figure: the configured argument, when set
        (EngineDialect.SGLANG, {"max_running_requests": 48, "internal_states": [{}]}, 48),
        (EngineDialect.SGLANG, {**SGLANG, "internal_states": [{}]}, None),  # sized by itself
        (EngineDialect.TGI, TGI, 128),
        (EngineDialect.LLAMACPP, LLAMACPP, 4),
        (EngineDialect.VLLM, {"max_num_seqs": 256}, None),  # vLLM states none
        (EngineDialect.TGI, {**TGI, "max_concurrent_requests": 0}, None),
        (EngineDialect.TGI, {**TGI, "max_concurrent_requests": True}, None),
        (EngineDialect.TGI, {**TGI, "max_concurrent_requests": "128"}, None),
        (EngineDialect.LLAMACPP, {**LLAMACPP, "total_slots": 2.5}, None),
        (EngineDialect.LLAMACPP, {**LLAMACPP, "total_slots": 4.0}, 4),
    ],
    ids=[
        "sglang-dp2",
        "sglang",
        "sglang-old",
        "sglang-auto",
        "tgi",
        "llamacpp",
        "vllm",
        "zero",
        "bool",
        "string",
        "fraction",
        "integral-float",
    ],
)
def test_each_engine_states_its_capacity_where_its_source_puts_it(dialect, document, expected):
    assert parse_capacity(dialect, json.dumps(document)) == expected


def test_only_engines_that_state_a_capacity_are_asked():
    assert set(CAPACITY_PATHS) == {EngineDialect.SGLANG, EngineDialect.TGI, EngineDialect.LLAMACPP}
    assert CAPACITY_PATHS[EngineDialect.SGLANG][0] == "/server_info"  # the current name first


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=40), children, max_size=4)
    ),
    max_leaves=12,
)
capacity_keys = st.sampled_from(
    [
        "total_slots",
        "max_concurrent_requests",
        "max_running_requests",
        "internal_states",
        "effective_max_running_requests_per_dp",
    ]
)


@given(
    dialect=st.sampled_from(list(EngineDialect)),
    document=st.dictionaries(capacity_keys | st.text(max_size=8), json_values, max_size=5)
    | json_values,
)
def test_any_answer_states_a_positive_count_or_nothing(dialect, document):
    stated = parse_capacity(dialect, json.dumps(document))
    assert stated is None or (type(stated) is int and stated >= 1)


@given(dialect=st.sampled_from(list(EngineDialect)), body=st.text(max_size=50))
def test_a_body_that_is_not_json_states_nothing(dialect, body):
    try:
        json.loads(body)
    except ValueError:
        assert parse_capacity(dialect, body) is None
