"""Context windows: what a request needs of a window, whose window counts, and placement's
candidate filter (llmgw.core.context, llmgw.core.placement).

Properties (hypothesis):
- a need fits a window exactly when its tokens (prompt plus at least one output token, the
  whole requested output where the window holds it) are at most the window's;
- an estimate from bytes never exceeds the prompt's real tokens when the prompt has at most
  `BYTES_PER_TOKEN` bytes a token;
- a need known to exceed a window (an engine refused it) no longer fits that window, nor any
  of its size, and still fits every window its true size fits;
- placement never puts a request on an endpoint it does not fit, refuses
  CONTEXT_LENGTH_EXCEEDED exactly when no endpoint of a provider that serves the model fits,
  and never keeps a pinned session on a provider none of whose endpoints it fits;
- an interactive request never queues at an endpoint while another usable endpoint it fits
  has a free slot.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.affinity import HashRing
from llmgw.core.context import (
    BYTES_PER_TOKEN,
    ContextNeed,
    ContextWindow,
    effective_window,
    need_of,
    refused_window,
    requested_output,
)
from llmgw.core.ledger import Room
from llmgw.core.outcomes import Refusal
from llmgw.core.placement import (
    AffinityBreak,
    EndpointState,
    PinState,
    Placement,
    PlacementRequest,
    PlacementSettings,
    ProviderState,
    Route,
    Snapshot,
    place,
)

ROOMY = Room(True, True, True)
NOW = 1000.0
SESSION = "cd" * 16

# ---- what a request needs ----------------------------------------------------------------------


@given(
    prompt=st.integers(0, 10**6),
    output=st.integers(0, 10**5),
    size=st.integers(1, 10**6),
    hold=st.booleans(),
)
def test_a_need_fits_exactly_when_its_tokens_are_within_the_window(
    prompt: int, output: int, size: int, hold: bool
) -> None:
    need = ContextNeed(prompt, output)
    window = ContextWindow(size, hold)
    counted = prompt + max(1, output) if hold else prompt + 1
    assert need.tokens(window) == counted
    assert need.fits(window) is (counted <= size)
    assert need.fits(None)


def test_vllm_counts_the_requested_output_and_llama_cpp_only_the_prompt() -> None:
    """vLLM: prompt + max_tokens > max_model_len is refused, and a prompt alone reaching it
    without max_tokens; llama.cpp: a prompt that fills the slot's context."""
    vllm, llamacpp = ContextWindow(4096), ContextWindow(4096, hold_output=False)
    assert ContextNeed(4000, 96).fits(vllm)
    assert not ContextNeed(4000, 97).fits(vllm)
    assert ContextNeed(4095).fits(vllm) and not ContextNeed(4096).fits(vllm)
    assert ContextNeed(4000, 10_000).fits(llamacpp)
    assert ContextNeed(4095, 10_000).fits(llamacpp) and not ContextNeed(4096).fits(llamacpp)


@given(tokens=st.integers(0, 10**5), bytes_per_token=st.floats(0.5, BYTES_PER_TOKEN))
def test_an_estimate_from_bytes_is_a_lower_bound(tokens: int, bytes_per_token: float) -> None:
    """A prompt of `tokens` real tokens at up to BYTES_PER_TOKEN bytes each is never
    estimated above them: only a request that clearly does not fit is moved or refused."""
    length = int(tokens * bytes_per_token)
    estimate = need_of(0, length, 0)
    assert not estimate.exact
    assert estimate.prompt <= tokens


def test_exact_tokens_win_over_the_estimate() -> None:
    assert need_of(1234, 10**6, 5) == ContextNeed(1234, 5, exact=True)
    assert need_of(0, 6 * 100 + 5, 7) == ContextNeed(100, 7)
    assert not need_of(0, 0, 0).known


def test_the_requested_output_is_read_as_each_api_names_it() -> None:
    assert requested_output({"max_completion_tokens": 30, "max_tokens": 10}) == 30
    assert requested_output({"max_tokens": 10}) == 10  # chat, completions, Messages
    assert requested_output({"max_output_tokens": 20}) == 20  # Responses
    assert requested_output({"max_tokens": True}) == 0
    assert requested_output({"max_tokens": None, "messages": []}) == 0


@given(
    prompt=st.integers(0, 10**6),
    true_prompt=st.integers(0, 10**6),
    output=st.integers(0, 10**5),
    size=st.integers(1, 10**6),
    hold=st.booleans(),
    other=st.integers(1, 2 * 10**6),
    other_hold=st.booleans(),
)
def test_a_need_beyond_a_window_fits_no_window_of_its_size_and_every_window_the_truth_fits(
    prompt: int, true_prompt: int, output: int, size: int, hold: bool, other: int, other_hold: bool
) -> None:
    """An engine with `window` refused a request whose prompt is really `true_prompt` tokens
    (estimated at `prompt`): what the retry is placed with is still a lower bound of the truth,
    so it fits wherever the true request fits, and never a window like the one that refused it
    (so the retry is never sent where the same refusal awaits it)."""
    window = ContextWindow(size, hold)
    truth = ContextNeed(true_prompt, output)
    if truth.fits(window):
        return  # the engine would not have refused it
    learned = ContextNeed(min(prompt, true_prompt), output).beyond(window)
    assert not learned.fits(window)
    assert not learned.fits(ContextWindow(size))  # (a window that holds the output: no more)
    assert learned.prompt <= true_prompt
    elsewhere = ContextWindow(other, other_hold)
    assert learned.fits(elsewhere) or not truth.fits(elsewhere)


def test_vllms_refusal_of_a_prompt_with_max_tokens_asks_for_more_than_its_window() -> None:
    """8192 tokens, max_tokens 8: the prompt is at least 8185 tokens, the request needs 8193;
    an exact count the engine contradicts is exact no more; one above the bound stays."""
    vllm = ContextWindow(8192)
    assert ContextNeed(5100, 8).beyond(vllm) == ContextNeed(8185, 8)
    assert ContextNeed(5100, 8, exact=True).beyond(vllm) == ContextNeed(8185, 8)
    assert ContextNeed(9000, 8, exact=True).beyond(vllm) == ContextNeed(9000, 8, exact=True)
    assert ContextNeed(100).beyond(vllm).tokens() == 8193
    assert ContextNeed(100, 50).beyond(ContextWindow(8192, hold_output=False)).prompt == 8192


def _error(message: str, **fields: object) -> bytes:
    return json.dumps({"error": {"message": message, **fields}}).encode()


@pytest.mark.parametrize(
    ("body", "window"),
    [
        # vLLM's OpenAI server (serving_engine.py `_validate_input`): code is the status
        (
            _error(
                "This model's maximum context length is 8192 tokens. However, your request has "
                "8320 input tokens. Please reduce the length of the input messages.",
                type="BadRequestError",
                param="input_tokens",
                code=400,
            ),
            8192,
        ),
        (
            _error(
                "'max_tokens' or 'max_completion_tokens' is too large: 2000. This model's "
                "maximum context length is 8192 tokens and your request has 7000 input tokens "
                "(2000 > 8192 - 7000).",
                type="BadRequestError",
                code=400,
            ),
            8192,
        ),
        # older vLLM: the flat shape
        (
            json.dumps(
                {
                    "object": "error",
                    "message": "This model's maximum context length is 4096 tokens. However, you "
                    "requested 4200 tokens (4000 in the messages, 200 in the completion). Please "
                    "reduce the length of the messages or completion.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            ).encode(),
            4096,
        ),
        # vLLM's renderer, and its engine's own check
        (
            _error(
                "You passed 9000 input tokens and requested 8 output tokens. However, the "
                "model's context length is only 8192 tokens, resulting in a maximum input "
                "length of 8184 tokens. Please reduce the length of the input prompt.",
                code=400,
            ),
            8192,
        ),
        (
            _error(
                "The decoder prompt (length 9000) is longer than the maximum model length of "
                "8192. Make sure that `max_model_len` is no smaller than the number of text "
                "tokens.",
                code=400,
            ),
            8192,
        ),
        # SGLang
        (
            _error(
                "Requested token count exceeds the model's maximum context length of 32768 "
                "tokens. You requested a total of 33000 tokens: 32000 tokens from the input "
                "messages and 1000 tokens for the completion."
            ),
            32768,
        ),
        (
            _error(
                "The input (40000 tokens) is longer than the model's context length (32768 tokens)."
            ),
            32768,
        ),
        # llama.cpp: by its message, or by its type and n_ctx
        (
            _error(
                "request (9412 tokens) exceeds the available context size (8192 tokens), try "
                "increasing it",
                type="exceed_context_size_error",
                code=400,
                n_prompt_tokens=9412,
                n_ctx=8192,
            ),
            8192,
        ),
        (_error("too big", type="exceed_context_size_error", n_ctx=4096), 4096),
        # the simulator, in OpenAI's shape and Anthropic's (a Messages engine)
        (
            _error(
                "prompt too long: this model's maximum context length is 8192 tokens, the "
                "prompt has 8320 (the output needs at least one more)",
                code="context_length_exceeded",
            ),
            8192,
        ),
        (
            json.dumps(
                {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": "prompt too long: this model's maximum context length is "
                        "1024 tokens, the prompt has 2000",
                    },
                }
            ).encode(),
            1024,
        ),
        # OpenAI's code without a number: a refusal that names no window
        (_error("Your input is too long.", code="context_length_exceeded"), 0),
    ],
)
def test_an_engines_refusal_for_length_is_read_with_the_window_it_names(
    body: bytes, window: int
) -> None:
    assert refused_window(body) == window


@pytest.mark.parametrize(
    "body",
    [
        _error("temperature must be in [0, 2]", type="BadRequestError", code=400),
        _error("max_tokens must be at least 1, got 0.", param="max_tokens", code=400),
        _error("This model's maximum context length is many tokens.", code=400),
        _error("maximum context length is 12345678901234567890 tokens", code=400),
        b"not json",
        b"[1, 2]",
        b'{"error": "This model\'s maximum context length"}',
    ],
)
def test_any_other_400_is_not_a_refusal_for_length(body: bytes) -> None:
    assert refused_window(body) is None


def test_the_configured_endpoint_window_wins_then_the_engines_then_the_models() -> None:
    reported = ContextWindow(16384, hold_output=False)
    assert effective_window(8192, reported, 4096) == ContextWindow(8192, hold_output=False)
    assert effective_window(None, reported, 4096) == reported
    assert effective_window(None, None, 4096) == ContextWindow(4096)
    assert effective_window(None, None, None) is None


# ---- placement's candidate filter --------------------------------------------------------------


def managed(id_: str, endpoints: list[EndpointState], room: Room = ROOMY) -> ProviderState:
    ring = HashRing([e.id for e in endpoints]) if endpoints else None
    return ProviderState(id_, True, True, False, tuple(endpoints), room, "score", ring=ring)


def unlimited(id_: str, endpoints: list[EndpointState]) -> ProviderState:
    return ProviderState(id_, False, True, False, tuple(endpoints), ROOMY, "rate")


@st.composite
def fitted(draw: st.DrawFn, name: str, count: int) -> list[EndpointState]:
    return [
        EndpointState(
            f"{name}-e{i}",
            usable=draw(st.booleans()),
            inflight=draw(st.integers(0, 12)),
            capacity=draw(st.integers(1, 8)),
            saturation=draw(st.floats(0, 0.99)),
            cached=draw(st.floats(0, 1)),
            rate_weight=1.0,
            fits=draw(st.booleans()),
        )
        for i in range(count)
    ]


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    providers = [
        managed(name, draw(fitted(name, draw(st.integers(1, 3)))), draw(rooms))
        for name in ("iris", "iris2")
    ]
    if draw(st.booleans()):
        providers.append(unlimited("tx", draw(fitted("tx", 2))))
    pin = None
    if draw(st.booleans()):
        provider = draw(st.sampled_from(providers))
        home = draw(st.sampled_from([None, *(e.id for e in provider.endpoints)]))
        pin = PinState(provider.id, draw(st.booleans()), draw(st.floats(0, NOW)), home)
    settings = PlacementSettings(return_home=draw(st.booleans()))
    return Snapshot(tuple(providers), pin, NOW, settings)


rooms = st.builds(Room, st.booleans(), st.booleans(), st.booleans())
requests = st.builds(
    PlacementRequest,
    session=st.one_of(st.none(), st.just(SESSION)),
    interactive=st.booleans(),
    overflow=st.booleans(),
    draw=st.floats(0, 0.999),
)


def chosen(snapshot: Snapshot, placement: Placement) -> EndpointState:
    provider = next(p for p in snapshot.providers if p.id == placement.provider)
    return next(e for e in provider.endpoints if e.id == placement.endpoint)


@given(snapshot=snapshots(), request=requests)
def test_no_request_is_placed_on_an_endpoint_it_does_not_fit(
    snapshot: Snapshot, request: PlacementRequest
) -> None:
    outcome = place(snapshot, request)
    if isinstance(outcome, Placement):
        endpoint = chosen(snapshot, outcome)
        assert endpoint.fits and endpoint.usable, outcome


@given(snapshot=snapshots(), request=requests)
def test_it_is_refused_as_too_long_exactly_when_no_endpoint_fits(
    snapshot: Snapshot, request: PlacementRequest
) -> None:
    outcome = place(snapshot, request)
    fits_somewhere = any(e.fits for p in snapshot.providers for e in p.endpoints)
    assert (outcome is Refusal.CONTEXT_LENGTH_EXCEEDED) is (not fits_somewhere)


@given(snapshot=snapshots(), request=requests)
def test_a_pinned_session_that_outgrew_its_provider_moves_on(
    snapshot: Snapshot, request: PlacementRequest
) -> None:
    pin = snapshot.pin
    if pin is None or request.session is None:
        return
    current = next(p for p in snapshot.providers if p.id == pin.provider)
    if any(e.fits for e in current.endpoints):
        return
    outcome = place(snapshot, request)
    if isinstance(outcome, Placement):
        assert outcome.provider != pin.provider
        if not request.overflow:
            assert (outcome.route, outcome.reason) == (Route.REPINNED, "context_window")


@given(snapshot=snapshots(), request=requests)
def test_interactive_requests_never_queue_where_an_endpoint_they_fit_has_a_free_slot(
    snapshot: Snapshot, request: PlacementRequest
) -> None:
    outcome = place(snapshot, request)
    if not isinstance(outcome, Placement) or not request.interactive:
        return
    provider = next(p for p in snapshot.providers if p.id == outcome.provider)
    if not provider.managed:
        return
    endpoint = chosen(snapshot, outcome)
    others_free = any(e.usable and e.fits and e.free_slot for e in provider.endpoints)
    if not endpoint.free_slot and others_free:
        assert endpoint.cached >= 0.5, outcome


def test_a_session_that_outgrew_its_home_replica_moves_to_one_it_fits_on_its_provider() -> None:
    small = EndpointState("small", inflight=0, capacity=8, fits=False)
    large = EndpointState("large", inflight=5, capacity=8)
    snapshot = Snapshot(
        (managed("iris", [small, large]),), PinState("iris", False, NOW - 1, "small"), NOW
    )
    outcome = place(snapshot, PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.endpoint, outcome.route) == ("large", Route.PINNED)
    assert outcome.affinity_break is AffinityBreak.HOME_UNUSABLE


def test_a_session_that_outgrew_its_provider_is_repinned_where_it_fits() -> None:
    ours = managed("iris", [EndpointState("e1", fits=False), EndpointState("e2", fits=False)])
    theirs = unlimited("tx", [EndpointState("t1", rate_weight=1.0)])
    snapshot = Snapshot((ours, theirs), PinState("iris", False, NOW - 1, "e1"), NOW)
    outcome = place(snapshot, PlacementRequest(SESSION))
    assert isinstance(outcome, Placement)
    assert (outcome.provider, outcome.route, outcome.reason) == (
        "tx",
        Route.REPINNED,
        "context_window",
    )
    without = Snapshot((ours,), snapshot.pin, NOW)
    assert place(without, PlacementRequest(SESSION)) is Refusal.CONTEXT_LENGTH_EXCEEDED
