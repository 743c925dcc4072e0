"""The load parsers on hostile numbers: a worker's report is a number we route on, or a ValueError.

``parse_loads`` (SGLang ``/v1/loads`` JSON) and ``parse_metrics`` (Prometheus text) must never raise anything
but ValueError, whatever the worker sends, and never return NaN, infinity, a negative or an absurd backlog:
such a report is rejected as a bad payload, not clamped into a number the policies would trust.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_router.fleet.load_monitor import BACKLOG_GAUGES, MAX_BACKLOG, parse_loads, parse_metrics

HOSTILE_NUMBERS = [
    "+Inf",
    "-Inf",
    "Inf",
    "NaN",
    "nan",
    "1e309",
    "-1e309",
    "-1",
    "-0.5",
    "1e10",
    str(MAX_BACKLOG + 1),
    "9223372036854775807",
    "1.8446744073709552e19",
]


def _loads(running: str, waiting: str = "0") -> bytes:
    return (
        b'{"timestamp": "2026-01-01T00:00:00Z", "dp_rank_count": 1, "loads": [{"dp_rank": 0, '
        b'"num_running_reqs": ' + running.encode() + b', "num_waiting_reqs": ' + waiting.encode() + b"}]}"
    )


def test_a_good_loads_report_sums_running_and_waiting_over_ranks() -> None:
    body = (
        b'{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 4},'
        b'{"dp_rank": 1, "num_running_reqs": 5.0}]}'
    )  # a missing counter is 0, a whole float is fine
    assert parse_loads(body) == 12
    assert parse_loads(b'{"loads": []}') == 0
    assert parse_loads(_loads(str(MAX_BACKLOG))) == MAX_BACKLOG  # the bound itself is still a report


@pytest.mark.parametrize("number", HOSTILE_NUMBERS)
def test_a_hostile_number_in_loads_is_a_bad_report(number: str) -> None:
    with pytest.raises(ValueError):
        parse_loads(_loads(number))
    with pytest.raises(ValueError):
        parse_loads(_loads("1", number))


@pytest.mark.parametrize("value", ["true", "null", '"3"', "[1]", "{}"])
def test_a_counter_that_is_not_a_number_is_a_bad_report(value: str) -> None:
    with pytest.raises(ValueError):
        parse_loads(_loads(value))


def test_ranks_that_add_up_to_an_absurd_backlog_are_a_bad_report() -> None:
    rank = f'{{"num_running_reqs": {MAX_BACKLOG // 2 + 1}}}'
    with pytest.raises(ValueError):
        parse_loads(f'{{"loads": [{rank}, {rank}]}}'.encode())


def test_a_good_metrics_exposition_sums_the_backlog_gauges() -> None:
    text = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 2.0\n'
        'sglang:num_queue_reqs{model_name="m"} 5 1700000000\nsglang:token_usage{model_name="m"} NaN\n'
    )
    assert parse_metrics(text) == 7  # a NaN in a gauge we do not read is not our business


@pytest.mark.parametrize("number", [*HOSTILE_NUMBERS, "abc", "0x10", ""])
@pytest.mark.parametrize("gauge", ["sglang:num_queue_reqs", "vllm:num_requests_waiting", "llamacpp:requests_deferred"])
def test_a_hostile_number_in_a_backlog_gauge_is_a_bad_report(gauge: str, number: str) -> None:
    for line in (f"{gauge} {number}", f'{gauge}{{model_name="m"}} {number}'):
        with pytest.raises(ValueError):
            parse_metrics(f"{line}\nvllm:num_requests_running 1\n")


def test_gauges_that_add_up_to_an_absurd_backlog_are_a_bad_report() -> None:
    half = MAX_BACKLOG // 2 + 1
    with pytest.raises(ValueError):
        parse_metrics(f"vllm:num_requests_running {half}\nvllm:num_requests_waiting {half}\n")


# Any JSON-like document, including the NaN / Infinity tokens Python's json writes, unbounded integers
# and the keys the parser looks for.
_KEYS = st.sampled_from(["loads", "num_running_reqs", "num_waiting_reqs", "dp_rank"]) | st.text(max_size=5)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=20,
)
_NUMBER_LITERAL = st.sampled_from(HOSTILE_NUMBERS) | st.from_regex(
    r"\A-?(0|[1-9][0-9]{0,400})(\.[0-9]+)?([eE][+-]?[0-9]{1,4})?\Z"
)


def _is_report_or_value_error(parse, raw) -> None:  # type: ignore[no-untyped-def]
    try:
        load = parse(raw)
    except ValueError:
        return
    assert type(load) is int and 0 <= load <= MAX_BACKLOG, load


@settings(max_examples=300, deadline=None)
@given(doc=_JSON)
def test_parse_loads_on_any_json_returns_a_bounded_count_or_raises_value_error(doc: object) -> None:
    _is_report_or_value_error(parse_loads, json.dumps(doc, allow_nan=True).encode())
    _is_report_or_value_error(parse_loads, json.dumps({"loads": [doc]}, allow_nan=True).encode())
    _is_report_or_value_error(parse_loads, json.dumps({"loads": [{"num_running_reqs": doc}]}, allow_nan=True).encode())


@settings(max_examples=300, deadline=None)
@given(running=_NUMBER_LITERAL, waiting=_NUMBER_LITERAL)
def test_parse_loads_on_any_number_literal_returns_a_bounded_count_or_raises_value_error(
    running: str, waiting: str
) -> None:
    _is_report_or_value_error(parse_loads, _loads(running, waiting))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_parse_loads_on_any_bytes_returns_a_bounded_count_or_raises_value_error(raw: bytes) -> None:
    _is_report_or_value_error(parse_loads, raw)


_LINE = st.tuples(
    st.sampled_from(sorted(BACKLOG_GAUGES)) | st.text(max_size=8),
    st.sampled_from(["", '{model_name="m"}', "{", "}", '{a="}"}']),
    st.sampled_from([" ", "\t", "  "]),
    _NUMBER_LITERAL | st.text(max_size=8) | st.floats().map(repr),
    st.sampled_from(["", " 1700000000", " x"]),
).map("".join)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(_LINE, max_size=6))
def test_parse_metrics_on_any_exposition_returns_a_bounded_count_or_raises_value_error(lines: list[str]) -> None:
    _is_report_or_value_error(parse_metrics, "\n".join(lines))


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_parse_metrics_on_any_text_returns_a_bounded_count_or_raises_value_error(text: str) -> None:
    _is_report_or_value_error(parse_metrics, text)


# -- the KV capacity a report carries (the tree's cap per worker) -------------------------------------------


def test_the_kv_capacity_comes_from_loads_and_from_sglang_or_vllm_metrics() -> None:
    from smg_router.fleet.load_monitor import parse_loads_report, parse_metrics_report

    two_ranks = {"loads": [{"num_running_reqs": 1, "max_total_num_tokens": 7000}, {"max_total_num_tokens": 5000}]}
    assert parse_loads_report(json.dumps(two_ranks).encode()) == (1, 12000, None)
    assert parse_loads_report(b'{"loads": [{"num_running_reqs": 2}]}') == (2, None, None)
    sglang = 'sglang:num_running_reqs 2\nsglang:max_total_num_tokens{model_name="m"} 7000\n'
    assert parse_metrics_report(sglang) == (2, 7000, None)
    vllm = (
        'vllm:num_requests_running{model_name="m"} 3\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1000"} 1.0\n'
    )
    assert parse_metrics_report(vllm) == (3, 16000, None)


def test_the_running_slots_are_what_the_engine_reports_else_what_it_ran_while_requests_waited() -> None:
    """The load gate's slots: SGLang reports them (``max_running_requests`` per rank, a gauge in /metrics); an
    engine that does not (vLLM) shows them when it holds requests back: it was running all it can."""
    from smg_router.fleet.load_monitor import parse_loads_report, parse_metrics_report

    ranks = {"loads": [{"num_running_reqs": 1, "max_running_requests": 16}, {"max_running_requests": 48}]}
    assert parse_loads_report(json.dumps(ranks).encode()).running_slots == 64
    one_silent = {"loads": [{"max_running_requests": 16}, {"num_running_reqs": 3}]}
    assert parse_loads_report(json.dumps(one_silent).encode()).running_slots is None  # a rank's slots unknown
    full = {"loads": [{"num_running_reqs": 8, "num_waiting_reqs": 5}]}
    assert parse_loads_report(json.dumps(full).encode()) == (13, None, 8)
    assert parse_metrics_report("sglang:num_running_reqs 2\nsglang:max_running_requests 32\n").running_slots == 32
    vllm = 'vllm:num_requests_running{model_name="m"} 7\nvllm:num_requests_waiting{model_name="m"} %d\n'
    assert parse_metrics_report(vllm % 2) == (9, None, 7)
    assert parse_metrics_report(vllm % 0).running_slots is None  # nothing waited: no limit shown
    llamacpp = "llamacpp:requests_processing 4\nllamacpp:requests_deferred 1\n"
    assert parse_metrics_report(llamacpp).running_slots == 4


@pytest.mark.parametrize("bad", [*HOSTILE_NUMBERS, '"7000"', "true", "null", "0", "[]"])
def test_a_kv_capacity_that_makes_no_sense_is_left_out_and_the_backlog_still_counts(bad: str) -> None:
    """The capacity is a hint for the tree: a bad one is ignored (no cap from it), never a failed poll."""
    from smg_router.fleet.load_monitor import parse_loads_report, parse_metrics_report

    body = f'{{"loads": [{{"num_running_reqs": 1, "max_total_num_tokens": {bad}}}]}}'
    try:
        report = parse_loads_report(body.encode())
    except ValueError:  # NaN, Infinity and overflowing numbers are not JSON at all
        assert bad.lower().lstrip("+-") in ("inf", "nan", "1e309")
    else:
        assert report.backlog == 1 and report.running_slots is None, report
        assert report.kv_tokens is None or 0 < report.kv_tokens <= 10**12, report
    slots = f'{{"loads": [{{"num_running_reqs": 1, "max_running_requests": {bad}}}]}}'
    with contextlib.suppress(ValueError):  # not JSON: as above
        report = parse_loads_report(slots.encode())
        assert report.running_slots is None or 0 < report.running_slots <= 10**9, report
    text = f"sglang:num_running_reqs 1\nsglang:max_total_num_tokens {bad}\n"
    report = parse_metrics_report(text)
    assert report.backlog == 1
    assert report.kv_tokens is None or 0 < report.kv_tokens <= 10**12, report
    report = parse_metrics_report(f"sglang:num_running_reqs 1\nsglang:max_running_requests {bad}\n")
    assert report.backlog == 1
    assert report.running_slots is None or 0 < report.running_slots <= 10**9, report


def test_a_llamacpp_servers_kv_capacity_is_its_slot_context_times_its_slots() -> None:
    from smg_router.fleet.load_monitor import parse_props

    props = {"default_generation_settings": {"n_ctx": 4096, "params": {}}, "total_slots": 2, "model_alias": "m"}
    assert parse_props(json.dumps(props).encode()) == (8192, 2)
    partial = [{"total_slots": 2}, {"default_generation_settings": {"n_ctx": 4096}}]
    partial.append({"default_generation_settings": []})
    for bad in partial:
        assert parse_props(json.dumps(bad).encode()) is None
    for n_ctx, slots in ((0, 2), (4096, 0), (-1, 2), (4096.5, 2), (True, 2), ("4096", 2), (10**12, 2)):
        doc = {"default_generation_settings": {"n_ctx": n_ctx}, "total_slots": slots}
        assert parse_props(json.dumps(doc).encode()) is None, (n_ctx, slots)
    for garbage in (b"[]", b"not json", b'"props"'):
        with pytest.raises(ValueError):
            parse_props(garbage)
