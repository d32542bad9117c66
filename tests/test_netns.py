"""Two hosts on one machine: prefill and decode in their own network namespaces.

Both sides are child processes inside a namespace of their own, joined by a
veth pair (``tests/netns_helpers.py``), talking real Mooncake over TCP:

* the link is cut mid-run, at the decode end (packets from the prefill side
  vanish silently) and at the prefill end (connects fail at once) -- every
  request ends terminal by its deadline with PEER_LOST or TIMEOUT, and
  nothing is released before the engine let go of it;
* the link is restored -- the scheduler's prober revives the peer and new
  requests succeed, nothing restarted;
* the decode process is killed and restarted at the same address -- new
  requests against its new PeerInfo succeed, in P2P mode (new port, new
  session id) and through an HTTP metadata server under the very same
  session name (the stale cached descriptor case).

Namespaces, veths and every process inside them are removed even when a test
fails. Needs root and ``ip netns``; skipped elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mooncake_helpers import requires_mooncake, wait_until
from netns_helpers import (
    IP,
    NetnsPair,
    PrefillDriver,
    metadata_delete,
    netns_list,
    netns_metadata_server,
    netns_pids,
    netns_receiver,
    netns_unavailable,
    sweep_stale,
)

from kvguard.decode.service import ReceiverProcess
from transfer import KVLayout
from transfer.peer_protocol import peer_info_to_message

UNAVAILABLE = netns_unavailable()
IP_NETNS = [IP, "netns"]
pytestmark = [
    pytest.mark.netns,
    pytest.mark.mooncake,
    requires_mooncake,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

# 2 layers x K/V = 4 buffers of 4 MiB a side; a request moves 8 blocks (512 KiB).
LAYOUT = KVLayout(num_layers=2, num_blocks=256, block_bytes=16384)
DEADLINE_S = 3.0  # below the prefill engine's MC_TRANSFER_TIMEOUT (5 s), as deployed
TOLERANCE_S = 0.5  # a loaded 2-core machine: watchdog and observer wake-up latency
CUT_GRACE_S = 0.25  # a transfer whose bytes were all sent before the cut may still end DONE
PEER_GONE = {"PEER_LOST", "TIMEOUT"}


def _verify(driver: PrefillDriver, rx: ReceiverProcess, records: list[dict[str, Any]]) -> None:
    """Every DONE record's destination blocks equal its source blocks (I7)."""
    for rec in records:
        if rec["state"] == "DONE":
            want = driver.request("digests", blocks=rec["src"])["digests"]
            assert rx.checksums(rec["dst"]) == want, f"{rec['rid']}: destination blocks differ"


def _run_batch(
    driver: PrefillDriver, rx: ReceiverProcess, prefix: str, count: int = 8
) -> list[dict[str, Any]]:
    """Submit ``count`` requests, wait until every one is terminal, verify the DONE ones."""
    driver.request(
        "batch", prefix=prefix, peer=rx.peer.session_id, count=count, deadline_s=DEADLINE_S
    )
    assert driver.request("wait_terminal", timeout=DEADLINE_S + 5)["terminal"]
    records: list[dict[str, Any]] = driver.request("records", prefix=prefix)["records"]
    assert len(records) == count
    _verify(driver, rx, records)
    return records


def _wait_alive(driver: PrefillDriver, session_id: str, timeout: float) -> float | None:
    """Seconds until the scheduler sees ``session_id`` alive again; None if it never does."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if driver.request("peer_alive", peer=session_id)["alive"]:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _assert_quiet(driver: PrefillDriver, submitted: int) -> dict[str, Any]:
    """After a drain: nothing live, nothing quarantined, every request released once,
    never before quiesce."""
    assert driver.request("drain", timeout=30.0)["drained"], driver.request("metrics")
    m = driver.request("metrics")
    assert m["live_by_state"] == {"PENDING": 0, "TRANSFERRING": 0}, m
    assert m["quarantined"] == 0 and m["backend_in_flight"] == 0, m
    assert m["released"] == submitted, m
    assert m["released_before_quiesce"] == 0 and m["double_releases"] == 0, m
    return m


@pytest.fixture(scope="module")
def pair() -> Iterator[NetnsPair]:
    with NetnsPair() as p:
        yield p
    # Cleanup happened even if a test failed; prove nothing is left behind.
    left = {p.prefill.netns, p.decode.netns} & set(netns_list())
    assert not left, f"namespaces left behind: {left}"


# -- link cut, then restore ------------------------------------------------------------


@pytest.fixture(scope="module", params=["decode-end", "prefill-end"])
def partition(pair: NetnsPair, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """One run: steady load, a cut, then the link restored. Returns what happened.

    decode-end: the far end goes down, packets from the prefill side vanish
    (a partition behind a switch; only timeouts and silent probes tell).
    prefill-end: the local end goes down, connects fail at once (ENETUNREACH).
    """
    side = pair.decode if request.param == "decode-end" else pair.prefill
    out: dict[str, Any] = {"side": request.param}
    with (
        netns_receiver(pair, LAYOUT) as rx,
        PrefillDriver(pair, LAYOUT, probe_interval_s=0.25) as driver,
    ):
        sid = rx.peer.session_id
        out["pids"] = (rx.pid, driver.pid)
        driver.request("add_peer", message=peer_info_to_message(rx.peer).hex())
        out["warm"] = _run_batch(driver, rx, "warm-")

        driver.request("start_load", prefix="cut-", peer=sid, window=4, deadline_s=DEADLINE_S)
        time.sleep(1.0)
        cut_start = time.monotonic()
        pair.set_link(False, side)
        cut = time.monotonic()  # `ip` returned: the link is down from here on
        try:
            time.sleep(DEADLINE_S + TOLERANCE_S)
            assert driver.request("stop_load")["error"] is None
            out["terminal"] = driver.request("wait_terminal", timeout=10.0)["terminal"]
            both = driver.request("records_and_metrics", prefix="cut-", timeout=10.0)
            out["records"], out["metrics_cut"] = both["records"], both["metrics"]
        finally:
            restored = time.monotonic()
            pair.set_link(True, side)
        out["cut"], out["cut_start"] = cut, cut_start
        out["alive_after_s"] = _wait_alive(driver, sid, 30.0)
        out["restored"] = restored
        submitted = len(out["warm"]) + len(out["records"])
        out["quiet"] = _assert_quiet(driver, submitted)
        out["after"] = _run_batch(driver, rx, "after-")
        out["quiet_after"] = _assert_quiet(driver, submitted + 8)
        out["pids_after"] = (rx.pid, driver.pid)
    yield out


def test_link_cut_every_request_ends_terminal_by_its_deadline(partition: dict[str, Any]) -> None:
    assert all(r["state"] == "DONE" for r in partition["warm"])
    cut: float = partition["cut"]  # the link is down from here on
    cut_start: float = partition["cut_start"]  # `ip link set down` started here
    records: list[dict[str, Any]] = partition["records"]
    assert partition["terminal"], "some request never ended terminal after the cut"
    assert all(r["terminal_at"] is not None for r in records)
    live_at_cut = [r for r in records if r["submitted_at"] < cut and r["terminal_at"] > cut_start]
    after_cut = [r for r in records if r["submitted_at"] >= cut]
    assert live_at_cut, "no request was in flight when the link went down"
    assert after_cut, "no request was submitted while the link was down"
    for r in records:
        assert r["state"] in ("DONE", "FAILED"), r
        assert r["terminal_at"] <= r["deadline_at"] + TOLERANCE_S, (
            f"{r['rid']} ended {r['terminal_at'] - r['deadline_at']:.3f}s past its deadline"
        )
        if r["terminal_at"] > cut + CUT_GRACE_S:
            assert r["state"] == "FAILED" and r["reason"] in PEER_GONE, r
    surfaced = [
        (r["rid"], round(r["terminal_at"] - cut, 3), r["state"], r["reason"])
        for r in sorted(live_at_cut, key=lambda r: r["terminal_at"])
    ]
    # Shown with -s; the closing note quotes these figures.
    print(
        f"\nlink cut at the {partition['side']} ({1000 * (cut - cut_start):.1f} ms to take the "
        "link down): requests in "
        "flight at the cut (rid, s after the cut, state, reason):"
    )
    for row in surfaced:
        print("  ", row)
    waited = max(r["terminal_at"] - r["submitted_at"] for r in after_cut)
    print(
        f"  {len(after_cut)} submitted after the cut: "
        f"{sorted({str(r['reason']) for r in after_cut})}, each within {waited:.3f}s"
    )
    assert all(r["state"] == "FAILED" and r["reason"] in PEER_GONE for r in after_cut), [
        r for r in after_cut if r["state"] != "FAILED"
    ]


def test_link_cut_keeps_blocks_quarantined_until_the_engine_returns(
    partition: dict[str, Any],
) -> None:
    # At the end of the cut phase, calls stuck on the dead link still hold
    # their blocks: requests terminal, not released.
    m = partition["metrics_cut"]
    assert m["live_by_state"] == {"PENDING": 0, "TRANSFERRING": 0}, m
    assert m["released_before_quiesce"] == 0 and m["double_releases"] == 0, m
    stuck = [r for r in partition["records"] if r["released_at"] is None and r["state"] == "FAILED"]
    # A cut with nothing left quarantined proves nothing about I6: require it.
    assert stuck, "nothing was quarantined at the end of the cut"
    assert m["quarantined"] == len(stuck), (m, len(stuck))
    for r in partition["records"]:
        if r["released_at"] is not None:
            assert r["released_at"] >= r["terminal_at"], r


def test_link_restore_revives_the_peer_and_new_requests_succeed(
    partition: dict[str, Any],
) -> None:
    assert partition["alive_after_s"] is not None, "the prober never revived the peer"
    print(f"\nlink restored: peer alive again after {partition['alive_after_s']:.3f}s")
    assert partition["alive_after_s"] < 20.0
    after = partition["after"]
    assert [r["state"] for r in after] == ["DONE"] * len(after), after
    # Nothing was restarted: the same two processes served before and after.
    assert partition["pids"] == partition["pids_after"]
    assert partition["quiet_after"]["done"] >= len(partition["warm"]) + len(after)


# -- decode restart ---------------------------------------------------------------------


def test_decode_restart_at_the_same_address_p2p(pair: NetnsPair) -> None:
    with PrefillDriver(pair, LAYOUT) as driver:
        with netns_receiver(pair, LAYOUT) as old:
            old_sid = old.peer.session_id
            driver.request("add_peer", message=peer_info_to_message(old.peer).hex())
            _run_batch(driver, old, "before-")
            driver.request(
                "start_load", prefix="kill-", peer=old_sid, window=4, deadline_s=DEADLINE_S
            )
            time.sleep(0.5)
            killed = time.monotonic()
            old.kill()
        time.sleep(0.5)
        assert driver.request("stop_load")["error"] is None
        assert driver.request("wait_terminal", timeout=DEADLINE_S + 5)["terminal"]
        records = driver.request("records", prefix="kill-")["records"]
        late = [r for r in records if r["terminal_at"] > killed + CUT_GRACE_S]
        assert late and all(r["reason"] in PEER_GONE for r in late), late
        assert all(r["terminal_at"] <= r["deadline_at"] + TOLERANCE_S for r in records)

        with netns_receiver(pair, LAYOUT) as new:
            new_sid = new.peer.session_id
            assert new_sid.split(":")[0] == old_sid.split(":")[0] == pair.decode.addr
            driver.request("add_peer", message=peer_info_to_message(new.peer).hex())
            after = _run_batch(driver, new, "after-")
            assert [r["state"] for r in after] == ["DONE"] * len(after), after
            assert not driver.request("peer_alive", peer=old_sid)["alive"]
        _assert_quiet(driver, 8 + len(records) + 8)


def test_decode_restart_under_the_same_name_through_a_metadata_server(pair: NetnsPair) -> None:
    pytest.importorskip("aiohttp")  # the wheel's HTTP metadata server needs it
    name = f"{pair.decode.addr}:17777"
    # The engine caches a peer's segment descriptor forever unless told to
    # refresh it; a peer restarted under the same name is then written at its
    # old transport port. docs/deployment.md makes this setting part of
    # metadata-server deployments.
    env = {"MC_TE_METADATA_REFRESH_INTERVAL_SECONDS": "1"}
    with (
        netns_metadata_server(pair, pair.prefill) as url,
        PrefillDriver(
            pair, LAYOUT, metadata=url, local_ip=f"{pair.prefill.addr}:17778", env=env
        ) as driver,
    ):
        with netns_receiver(pair, LAYOUT, ip=name, metadata=url) as old:
            assert old.peer.session_id == name
            driver.request("add_peer", message=peer_info_to_message(old.peer).hex())
            before = _run_batch(driver, old, "before-")
            assert [r["state"] for r in before] == ["DONE"] * 8
            old_bases = old.peer.block_base
            old.kill()
        # A SIGKILLed engine never removes its rpc_meta key, and the server
        # refuses the name while it exists: the supervisor clears it.
        assert metadata_delete(pair, pair.prefill, url, f"mooncake/rpc_meta/{name}") == 200
        with netns_receiver(pair, LAYOUT, ip=name, metadata=url) as new:
            assert new.peer.session_id == name
            assert new.peer.block_base != old_bases  # a new process: new buffers
            restarted = time.monotonic()
            driver.request("add_peer", message=peer_info_to_message(new.peer).hex())
            attempts = 0
            while True:
                attempts += 1
                batch = _run_batch(driver, new, f"after-{attempts}-")
                states = [r["state"] for r in batch]
                if states == ["DONE"] * len(batch):
                    break
                # Until the refresh, the stale descriptor fails calls fast and typed.
                assert all(
                    r["reason"] in {"TRANSFER_ERROR", "TIMEOUT"}
                    for r in batch
                    if r["state"] == "FAILED"
                ), batch
                assert time.monotonic() - restarted < 15.0, "stale metadata wedged the prefill"
            print(
                f"\nmetadata restart: new requests succeed {time.monotonic() - restarted:.2f}s "
                f"after the restart ({attempts} batch(es))"
            )
        _assert_quiet(driver, 8 + 8 * attempts)


# -- cleanup ------------------------------------------------------------------------------


def test_cleanup_kills_every_process_and_deletes_the_namespaces_on_failure() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    names: tuple[str, str] = ("", "")
    try:
        with pytest.raises(RuntimeError, match="boom"), NetnsPair() as p:
            names = (p.prefill.netns, p.decode.netns)
            for side in (p.prefill, p.decode):  # owned by nobody but the namespace
                procs.append(subprocess.Popen([*p.exec_argv(side), "sleep", "600"]))

            def inside() -> set[int]:
                return set(netns_pids(p.prefill.netns) + netns_pids(p.decode.netns))

            assert wait_until(lambda: {q.pid for q in procs} <= inside(), 10.0, 0.02)
            raise RuntimeError("boom")
        assert not set(names) & set(netns_list())
        for proc in procs:  # killed by the cleanup, found through `ip netns pids`
            assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_namespaces_of_a_dead_run_are_swept() -> None:
    # pid_max is at most 2**22: this creator can never be alive.
    name = f"kvg{2**22 + 1}x{os.getpid() % 0x10000:04x}p"
    subprocess.run([*IP_NETNS, "add", name], check=True)
    try:
        assert name in sweep_stale()
        assert name not in netns_list()
    finally:
        subprocess.run([*IP_NETNS, "del", name], capture_output=True)
