"""The roll call of a multi-process run, on loopback sockets in threads (JAX never starts here)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fashionjax import rendezvous
from fashionjax.rendezvous import CoordinatorError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def roll_call(num_processes: int, callers: list[tuple[int, int]], timeout: float = 3.0, before_callers=None):
    """Process 0 gathers in a thread while each (process_id, their --num-processes) checks in from its
    own thread; returns {who: None or the error message}, process 0 under "leader"."""
    port = free_port()
    coordinator = f"127.0.0.1:{port}"
    outcomes: dict = {}

    def run(who, call):
        try:
            for connection in call().values():  # kept for the watch, which these tests do not start
                connection.close()
            outcomes[who] = None
        except CoordinatorError as err:
            outcomes[who] = str(err)

    threads = [threading.Thread(target=run, args=("leader", lambda: rendezvous.gather(
        coordinator, port, num_processes, timeout)))]
    threads[0].start()
    if before_callers:
        before_callers(port)
    for index, (process_id, count) in enumerate(callers):
        threads.append(threading.Thread(target=run, args=(index, lambda p=process_id, c=count: rendezvous.check_in(
            coordinator, ("127.0.0.1", port), p, c, timeout))))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout + 10)
    return outcomes, coordinator, port


def test_everyone_present_goes_and_the_port_is_free_for_jax_at_once():
    outcomes, _, port = roll_call(3, [(2, 3), (1, 3)])
    assert outcomes == {"leader": None, 0: None, 1: None}
    with socket.create_server(("", port)):  # what JAX's coordination service does next
        pass


def test_a_missing_process_is_named_by_process_0_and_the_others_hear_why():
    started = time.monotonic()
    outcomes, coordinator, _ = roll_call(3, [(2, 3)], timeout=1.0)
    assert time.monotonic() - started < 8
    problem = (f"only 2 of 3 processes arrived within 1 s (missing --process-id 1); start each with "
               f"--coordinator {coordinator} --num-processes 3")
    assert outcomes == {"leader": problem, 0: f"process 0 at {coordinator}: {problem}"}


@pytest.mark.parametrize("callers, problem", [
    ([(1, 3)], "process 1 was started with --num-processes 3, process 0 with 2"),
    ([(1, 3), (1, 3)], "two processes were started with --process-id 1"),
])
def test_processes_that_disagree_are_refused_everywhere(callers, problem):
    num_processes = 2 if len(callers) == 1 else 3
    outcomes, coordinator, _ = roll_call(num_processes, callers)
    assert outcomes["leader"] == problem
    assert all(outcomes[i] == f"process 0 at {coordinator}: {problem}" for i in range(len(callers)))


def test_a_stranger_on_the_port_is_ignored():
    def connect(port):
        deadline = time.monotonic() + 5
        while True:  # process 0's thread may not be listening yet
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=2)
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.02)

    def knock(port):
        with connect(port) as stranger:
            stranger.sendall(b"GET / HTTP/1.0\n")
        connect(port).close()  # a health check: connects, says nothing

    outcomes, _, _ = roll_call(2, [(1, 2)], before_callers=knock)
    assert outcomes == {"leader": None, 0: None}


def test_a_port_already_taken_is_one_line_naming_it():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CoordinatorError, match=f"cannot listen on port {port} of 127.0.0.1:{port}"):
            rendezvous.gather(f"127.0.0.1:{port}", port, 2, 1.0)


def watched(own_id: int, connections: dict) -> tuple[rendezvous.Watch, list, threading.Event]:
    heard: list[tuple[int, str, str]] = []
    told = threading.Event()

    def on_lost(process_id, kind, detail):
        heard.append((process_id, kind, detail))
        for connection in connections.values():  # as the process's exit would
            connection.close()
        told.set()

    return rendezvous.Watch(own_id, connections, on_lost), heard, told


def test_a_process_that_says_bye_is_let_go_and_one_that_vanishes_is_reported():
    # process 0's view: a connection to process 1 and one to process 2 (socket pairs stand in for TCP)
    ours_1, theirs_1 = socket.socketpair()
    ours_2, theirs_2 = socket.socketpair()
    watch, heard, told = watched(0, {1: ours_1, 2: ours_2})
    theirs_1.sendall(b"bye\n")  # process 1 finished and left
    theirs_1.close()
    assert not told.wait(0.5) and heard == []
    theirs_2.close()  # process 2 vanished: no bye
    assert told.wait(5) and heard == [(2, "lost", "")]


def test_process_0_passes_news_on_and_waits_for_the_others_to_act_before_it_acts():
    ours_1, theirs_1 = socket.socketpair()  # process 0's connection to process 1
    ours_2, theirs_2 = socket.socketpair()  # and to process 2
    _, heard, told = watched(0, {1: ours_1, 2: ours_2})
    _, peer_heard, peer_told = watched(2, {0: theirs_2})  # process 2's watch on process 0
    theirs_1.close()  # process 1 dies
    assert peer_told.wait(5) and peer_heard == [(1, "lost", "")]  # process 2 hears who, not that process 0 is gone
    assert told.wait(5) and heard == [(1, "lost", "")]


def test_a_failing_process_tells_everyone_why_and_process_0_acts_after_all_the_others_exit():
    ours_1, theirs_1 = socket.socketpair()
    ours_2, theirs_2 = socket.socketpair()
    _, heard, told = watched(0, {1: ours_1, 2: ours_2})
    _, peer_heard, peer_told = watched(2, {0: theirs_2})
    failing, _, _ = watched(1, {0: theirs_1})
    started = time.monotonic()
    failing.leave("failed", "runs/x: in use by another training (pid 7)")
    assert time.monotonic() - started < 0.5  # it goes at once: process 0 outlives it
    reason = "runs/x: in use by another training (pid 7)"
    assert peer_told.wait(5) and peer_heard == [(1, "failed", reason)]  # process 2 acted, and exited (its watch closed)
    assert not told.wait(0.5)  # process 0 waits: process 1 is still attached to JAX's service
    theirs_1.close()  # process 1 exits
    assert told.wait(5) and heard == [(1, "failed", reason)]


def test_a_process_stopped_alone_names_its_signal_to_the_others(no_watch):
    """A Ctrl-C in process 0's terminal during evaluation stops it alone: its followers, waiting for it
    in a collective, hear which signal stopped it (and so end as stopped, not failed)."""
    ours_1, theirs_1 = socket.socketpair()
    ours_2, theirs_2 = socket.socketpair()
    rendezvous.watch(0, {1: ours_1, 2: ours_2}, lambda *news: None)
    _, heard_1, told_1 = watched(1, {0: theirs_1})
    _, heard_2, told_2 = watched(2, {0: theirs_2})
    rendezvous.leave(stopped_by="SIGINT")
    assert told_1.wait(5) and told_2.wait(5) and heard_1 == heard_2 == [(0, "stopped", "SIGINT")]
    assert not rendezvous.failed_in_a_run
    ours_2, theirs_2 = socket.socketpair()  # and a follower stopped alone: process 0 passes it on
    ours_3, theirs_3 = socket.socketpair()
    _, heard_0, told_0 = watched(0, {2: ours_2, 3: ours_3})
    theirs_2.sendall(b"stopped 2 SIGTERM\n")
    theirs_2.close()
    assert rendezvous._read_line(theirs_3, time.monotonic() + 5) == "stopped 2 SIGTERM"
    theirs_3.close()
    assert told_0.wait(5) and heard_0 == [(2, "stopped", "SIGTERM")]


def test_a_failure_that_echoes_a_death_leaves_the_report_to_the_watch(monkeypatch):
    """Process 0 killed: a follower's collective fails too ("Connection reset by peer"), maybe before its
    watch has read the closed connection. The death, which names the cause, is what gets reported."""
    monkeypatch.setattr(rendezvous, "OUTLIVE_SECONDS", 0.1)
    ours, theirs = socket.socketpair()
    follower, heard, told = watched(1, {0: ours})
    theirs.close()  # process 0 died
    follower.leave("failed", "Gloo AllGather failed: Connection reset by peer")
    assert told.is_set() and heard == [(0, "lost", "")]  # reported while leave() waited
    ours, theirs = socket.socketpair()  # a failure of its own, the other process alive: said at once
    failing, heard, told = watched(1, {0: ours})
    failing.leave("failed", "disk full")
    assert rendezvous._read_line(theirs, time.monotonic() + 5) == "failed 1 disk full" and heard == []


def test_a_leaving_process_reports_nothing_more():
    ours, theirs = socket.socketpair()
    leaving, heard, told = watched(2, {0: ours})
    leaving.leave()  # this process is done: what happens to the others is no longer its concern
    theirs.close()
    assert not told.wait(0.5) and heard == []


@pytest.fixture
def no_watch(monkeypatch):
    """This test's own module-level watch, none left behind."""
    for name, value in (("_watch", None), ("_left", None), ("failed_in_a_run", False)):
        monkeypatch.setattr(rendezvous, name, value)


def outliving(seconds: float) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (rendezvous.outlive_the_others(seconds), done.set()), daemon=True).start()
    return done


def test_process_0_leaving_without_jax_outlives_the_others(no_watch):
    ours, theirs = socket.socketpair()  # process 0's connection to process 1, and process 1's to it
    rendezvous.watch(0, {1: ours}, lambda *news: None)
    follower, heard, _ = watched(1, {0: theirs})
    rendezvous.leave()  # process 0, after a stop every process agreed on
    done = outliving(10)
    assert not done.wait(0.5)  # process 1 has not left yet
    follower.leave()
    assert not done.wait(0.5)  # it said bye but has not exited: still attached to JAX's service
    theirs.close()  # its exit
    assert done.wait(5) and heard == []


def test_the_others_do_not_wait_and_process_0_waits_no_longer_than_its_bound(no_watch):
    ours, _ = socket.socketpair()
    rendezvous.watch(1, {0: ours}, lambda *news: None)
    rendezvous.leave()
    assert outliving(10).wait(0.5)  # process 1: nothing to outlive
    ours, _hung = socket.socketpair()
    rendezvous.watch(0, {1: ours}, lambda *news: None)
    rendezvous.leave()
    started = time.monotonic()
    assert outliving(0.5).wait(5) and time.monotonic() - started >= 0.45  # process 1 hangs: the bound holds
