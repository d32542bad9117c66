"""The suite's host-stall evidence (tests/stalls.py): a CPU that
runs nothing shows as a late wake of its monitor (a stopped monitor stands
for it here), of that length, at that time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.stalls import GAP_S, Stall, StallWatch

STOP_S = GAP_S + 1.0


def _stalls_of(watch: StallWatch, cpu: int, near: float, within_s: float) -> list[Stall]:
    """``cpu``'s stalls that began within 0.1 s of ``near`` (a real host
    stall meanwhile would add others), once there is one."""
    until = time.monotonic() + within_s
    while True:
        found = [s for s in watch.stalls() if s.cpu == cpu and abs(s.start - near) <= 0.1]
        if found or time.monotonic() > until:
            return found
        time.sleep(0.05)


def test_a_monitor_that_cannot_run_records_one_stall_of_that_length(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path / "stalls.log")
    try:
        time.sleep(0.3)  # each monitor has started its loop
        victim = watch._procs[0]  # stands for a CPU that runs nothing
        t0 = time.time()
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(STOP_S)
        os.kill(victim.pid, signal.SIGCONT)
        t1 = time.time()
        cpu = min(os.sched_getaffinity(0))
        (stall,) = _stalls_of(watch, cpu, t0, 5.0)
        assert STOP_S - 0.2 <= stall.seconds <= STOP_S + 1.0, stall
        assert stall in watch.during(t0, t1)
        assert stall not in watch.during(stall.end + 0.01, stall.end + 5)
        assert stall not in watch.during(stall.start - 5, stall.start - 0.01)
        assert str(stall) == f"cpu {cpu} ran nothing for {stall.seconds:.1f} s"
    finally:
        watch.close()
    assert all(p.poll() == -signal.SIGKILL for p in watch._procs)


def test_a_line_still_being_written_is_not_read(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path / "stalls.log")
    try:
        with watch.path.open("a") as f:
            f.write("1 1000.000 3.500\n0 2000.0")
        assert watch.stalls() == [Stall(1, 1000.0, 3.5)]
        assert watch.stalls()[0].end == 1003.5
    finally:
        watch.close()


def test_monitors_end_with_a_test_process_that_was_killed(tmp_path: Path) -> None:
    """A killed test process never closes its watch: its monitors must not
    outlive it (hundreds were left waking 20 times a second after mutation
    runs killed their tests)."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tests.stalls import StallWatch; "
            "w = StallWatch(Path(sys.argv[1])); print(*w.pids, flush=True); time.sleep(60)",
            str(tmp_path / "stalls.log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert child.stdout is not None
    pids = [int(p) for p in child.stdout.readline().split()]
    try:
        assert pids, "no monitor started"
        child.kill()
        child.wait(10)
        until = time.monotonic() + 10  # a hang guard, not a speed figure
        alive = list(pids)
        while alive and time.monotonic() < until:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.05)
        assert alive == []
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie ran its course
    except FileNotFoundError:
        return False
