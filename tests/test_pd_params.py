"""The connector's ``kv_transfer_params`` (``kvguard.vllm.params``) and the
addresses a load's legs go to (``kvguard.vllm.ranks.Pairing``): no vLLM needed."""

from __future__ import annotations

import hashlib
import struct
import sys

import pytest
from structlog.testing import capture_logs

from kvguard.decode.control import tcp_address
from kvguard.proxy import protocol as proxy
from kvguard.vllm import params
from kvguard.vllm.params import LoadAsk, Source, load_ask, prefill_reply, wants_hold, wants_load
from kvguard.vllm.ranks import BadEndpoint, LegAsk, Pairing, RankHeads

EP = "tcp://10.0.0.1:17600"
LIMITS = {"deadline": 10.0, "max_deadline": 60.0, "hold": 30.0}
PROMPT = list(range(1000, 1100))  # the prefill's: 100 tokens


def reply(**over: object) -> dict[str, object]:
    out = prefill_reply(
        endpoint=EP, request_id="p1", deadline=5.0, hold=30.0, tp_size=2, prompt=PROMPT
    )
    out.update(over)
    return out


def test_what_the_prefill_returns_is_what_the_decode_reads() -> None:
    got = reply()
    assert wants_load(got) and not wants_hold(got)
    assert load_ask(got, **LIMITS) == LoadAsk(Source(EP, "p1", 2), 5.0, 10.0, 0)
    assert params.loaded_tokens(got, PROMPT) == 100
    assert params.loaded_tokens(got, [*PROMPT, 7]) == 100  # the prompt and the prefill's token
    params.loading_started(got)
    assert not wants_load(got)  # one load per request


@pytest.mark.usefixtures("all_levels")
def test_without_the_prefills_count_the_whole_prompt_is_loaded() -> None:
    got = reply()
    del got[params.TOKENS]
    with capture_logs() as logs:
        assert params.loaded_tokens(got, PROMPT) == 100
    assert logs == []


@pytest.mark.usefixtures("all_levels")
@pytest.mark.parametrize("tokens", [0, -1, 101, 50.0, "50", True, None])
def test_a_bad_token_count_is_logged_and_the_whole_prompt_asked_for(tokens: object) -> None:
    with capture_logs() as logs:
        assert params.loaded_tokens(reply(kvguard_tokens=tokens), PROMPT) == 100
    assert logs == [
        {
            "event": "kv_tokens_ignored",
            "log_level": "warning",
            "key": "kvguard_tokens",
            "value": repr(tokens),
            "want": "int in [1, 100]",
        }
    ]


@pytest.mark.usefixtures("all_levels")
@pytest.mark.parametrize(
    "prompt",
    [
        [*PROMPT[:-1], 5],  # the last token another
        [5, *PROMPT[1:]],  # the first
        PROMPT[::-1],  # the same tokens, in another order
        [*PROMPT[:-1], 5, PROMPT[-1]],  # one more inside: the count's tokens differ
    ],
)
def test_kv_of_another_prompt_is_not_loaded(prompt: list[int]) -> None:
    with capture_logs() as logs:
        assert params.loaded_tokens(reply(), prompt) == 0
    assert logs == [
        {
            "event": "kv_prompt_mismatch",
            "log_level": "warning",
            "key": "kvguard_prompt_digest",
            "value": repr(params.prompt_digest(PROMPT)),
            "tokens": 100,
        }
    ]


@pytest.mark.usefixtures("all_levels")
def test_a_prompt_of_embeddings_loads_nothing_by_token_and_says_nothing() -> None:
    with capture_logs() as logs:
        assert params.loaded_tokens(reply(), []) == 0
    assert logs == []


def test_the_prefill_says_whether_its_server_returns_text() -> None:
    assert reply()[params.TEXT] is True
    tokenless = prefill_reply(
        endpoint=EP, request_id="p1", deadline=5.0, hold=30.0, tp_size=2, prompt=[1], text=False
    )
    assert tokenless[params.TEXT] is False


@pytest.mark.usefixtures("all_levels")
def test_a_shorter_prompt_than_the_prefills_loads_nothing() -> None:
    with capture_logs() as logs:
        assert params.loaded_tokens(reply(), PROMPT[:99]) == 0
    assert [e["event"] for e in logs] == ["kv_tokens_ignored", "kv_prompt_mismatch"]


@pytest.mark.usefixtures("all_levels")
def test_a_prompt_of_one_token_and_the_prefills_token_loads_the_one() -> None:
    one = prefill_reply(
        endpoint=EP, request_id="p1", deadline=5.0, hold=30.0, tp_size=1, prompt=[42]
    )
    with capture_logs() as logs:
        assert params.loaded_tokens(one, [42, 7]) == 1
    assert logs == []


def test_a_big_endian_host_hashes_the_same_little_endian_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This host is little-endian: told it is big, the ids are swapped to big-endian.
    monkeypatch.setattr(sys, "byteorder", "big")  # params reads sys.byteorder
    swapped = hashlib.blake2b(struct.pack(">3q", 1, 2, 3), digest_size=16).hexdigest()
    assert params.prompt_digest([1, 2, 3]) == swapped


def test_the_prompts_digest_is_of_its_ids_in_order_and_fixed_across_hosts() -> None:
    # Pinned: a decode and a prefill of different versions or byte orders agree.
    assert params.prompt_digest([1, 2, 3]) == params.prompt_digest((1, 2, 3))
    assert params.prompt_digest([1, 2, 3]) == "abccad42d03c940bc2b249bf5a4e1e3d"
    assert params.prompt_digest([]) != params.prompt_digest([0])
    assert params.prompt_digest([1 << 40]) != params.prompt_digest([0])
    assert params.prompt_digest([-1]) != params.prompt_digest([1])  # any int64


def test_the_proxy_sets_the_keys_this_module_owns() -> None:
    assert proxy.KV_LOADS == params.LOADS == "kvguard_loads"
    assert proxy.PREFILL_KV_TRANSFER_PARAMS is params.PREFILL_KV_TRANSFER_PARAMS
    assert wants_hold(params.PREFILL_KV_TRANSFER_PARAMS)
    body = proxy.decode_request({"n": 3}, reply())
    assert load_ask(body["kv_transfer_params"], **LIMITS).declared == 3


@pytest.mark.parametrize(
    ("asked", "used"),
    [(5, 5.0), ("7.5", 7.5), (600, 60.0), (0, 10.0), (-3, 10.0), ("soon", 10.0), (None, 10.0)],
)
def test_a_clients_deadline_is_capped_and_junk_gets_the_default(asked: object, used: float) -> None:
    assert load_ask(reply(kvguard_deadline_s=asked), **LIMITS).deadline_s == used


@pytest.mark.parametrize(
    ("hold", "every"), [(30, 10.0), ("x", 10.0), (float("nan"), 10.0), (0, 0.1), (-1, 0.1)]
)
def test_a_queued_request_renews_every_third_of_the_hold(hold: object, every: float) -> None:
    assert load_ask(reply(kvguard_hold_s=hold), **LIMITS).renew_s == every


@pytest.mark.parametrize("tp", [0, -1, 1025, 2.0, "2", True, None])
def test_a_bad_tp_size_is_the_sources_problem_naming_key_and_value(tp: object) -> None:
    source = load_ask(reply(kvguard_tp_size=tp), **LIMITS).source
    assert (source.tp_size, source.key) == (0, (EP, "p1"))
    assert source.problem == (
        f"kvguard_tp_size from the prefill must be an int in [1, 1024], got {tp!r}"
    )
    with pytest.raises(ValueError, match="kvguard_tp_size"):
        Pairing(RankHeads(0, 1, 4), head_major=True).asks("d", source)


@pytest.mark.usefixtures("all_levels")
def test_a_bad_declared_size_is_logged_naming_key_and_value() -> None:
    with capture_logs() as logs:
        assert load_ask(reply(kvguard_loads="3"), **LIMITS).declared == 0
    assert logs == [
        {
            "event": "kv_loads_ignored",
            "key": "kvguard_loads",
            "value": "'3'",
            "want": "int in [1, 1024]",
            "log_level": "warning",
        }
    ]


def test_a_load_is_asked_of_each_prefill_rank_at_its_own_port() -> None:
    """Each leg with the part of this rank's blocks it writes (what its
    digest covers): 4 heads in 1024-byte blocks, 256 bytes a head."""
    two = Source(EP, "p1", 2)
    pairing = Pairing(RankHeads(0, 1, 4), head_major=True, block_bytes=1024)
    assert pairing.asks("d", two) == [
        LegAsk("d#0.0", "tcp://10.0.0.1:17600", 1, (0, 512)),
        LegAsk("d#0.1", "tcp://10.0.0.1:17601", 1, (512, 512)),
    ]
    # One leg no other decode rank shares: named as the request itself, whole blocks.
    assert pairing.asks("d", Source("10.0.0.1:17600", "p1", 1)) == [
        LegAsk("d", "tcp://10.0.0.1:17600", 1, None)
    ]
    # Prefill 1, decode 2: both decode ranks ask prefill rank 0, for all of their blocks.
    half = Pairing(RankHeads(1, 2, 4), head_major=True, block_bytes=512)
    assert half.asks("d", Source(EP, "p1", 1)) == [LegAsk("d#1.0", EP, 2, (0, 512))]
    # Prefill 4, decode 2: two legs, a head each.
    assert half.asks("d", Source(EP, "p1", 4)) == [
        LegAsk("d#1.2", "tcp://10.0.0.1:17602", 1, (0, 256)),
        LegAsk("d#1.3", "tcp://10.0.0.1:17603", 1, (256, 256)),
    ]
    assert pairing.urls(two) == ["tcp://10.0.0.1:17600", "tcp://10.0.0.1:17601"]


def test_an_mla_decode_tells_the_prefill_ranks_no_one_loads_from_to_let_go() -> None:
    # Prefill 4, decode 2, one latent head: decode rank 1 loads from prefill
    # rank 1 and tells rank 3 (renewing only what it loads).
    mla = Pairing(RankHeads(1, 2, 1), head_major=False, block_bytes=512)
    src = Source(EP, "p1", 4)
    assert mla.asks("d", src) == [LegAsk("d", "tcp://10.0.0.1:17601", 1, None)]
    assert mla.spare_urls(src) == ["tcp://10.0.0.1:17603"]
    assert mla.urls(src) == ["tcp://10.0.0.1:17601"]
    assert mla.ranks_of(src) == [("tcp://10.0.0.1:17601", 1), ("tcp://10.0.0.1:17603", 1)]
    # None for a source no load can use, or a rank whose port does not exist.
    assert mla.spare_urls(Source(EP, "p1", 0, "kvguard_tp_size: bad")) == []
    assert mla.ranks_of(Source("10.0.0.1:65533", "p1", 4)) == [("tcp://10.0.0.1:65534", 1)]
    # Heads split over the ranks: every prefill rank is loaded from, none spare.
    split = Pairing(RankHeads(1, 2, 4), head_major=True, block_bytes=512)
    assert split.spare_urls(src) == []


@pytest.mark.parametrize(
    "endpoint", ["ipc:///tmp/p", "inproc://p", "tcp://ipc://x", "tcp://h:x", "h", "::1:7000"]
)
def test_an_endpoint_the_one_parser_refuses_fails_the_load_naming_it(endpoint: str) -> None:
    with pytest.raises(ValueError):
        tcp_address(endpoint)
    pairing = Pairing(RankHeads(0, 1, 4), head_major=True)
    with pytest.raises(BadEndpoint, match="not a tcp://host:port endpoint for rank 0"):
        pairing.asks("d", Source(endpoint, "p1", 1))
    assert pairing.urls(Source(endpoint, "p1", 1)) == []


def test_sizes_that_cannot_pair_name_both() -> None:
    with pytest.raises(ValueError, match="prefill tensor parallel size 2 and decode size 1"):
        Pairing(RankHeads(0, 1, 4), head_major=False).asks("d", Source(EP, "p1", 2))
