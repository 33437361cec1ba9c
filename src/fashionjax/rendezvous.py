"""The roll call before jax.distributed starts: every process of a multi-process run checks in with
process 0 on the coordinator's own port, and JAX starts only once all of them are there.

Without it a missing process, or one started with another --num-processes, is found by JAX's own
start-up barrier, which aborts every process from C++ after its timeout (a stack trace, exit 134, no
JSON). With it, each process says what is wrong in one line and exits 1. Process 0 lets the port go
before JAX binds it; the connections it accepted may stay open (both sides allow address reuse).

The roll call's connections then stay open as a watch. A process that fails says so on them
("failed", with its one-line error); one stopped by a signal that the others did not agree on (a
Ctrl-C in one terminal during evaluation) says "stopped", with the signal; one that leaves otherwise
says "bye". A connection that closes with none of these means a process died hard (kill -9, a
crash). Process 0 passes the news on, and the others stop at once, each with one line naming the
process and why, where they would wait in a collective for JAX's own timeout or heartbeat (20-30 s)
and end with its message or an abort from C++.

Process 0 also hosts JAX's coordination service, and when it exits, JAX aborts from C++ every
process still attached to it (seen: a process slow to leave after an agreed Ctrl-C ended with
SIGABRT or exit 1, its one-line error and JSON lost). A run that ends through JAX's shutdown is safe:
its barrier holds process 0 back. Every other way out (an agreed stop, a failure, news of one) is
os._exit, and there process 0 goes last: each process keeps its connection open until it exits, and
process 0 waits for them all to close (up to OUTLIVE_SECONDS).
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable

GREETING = "fashionjax-roll-call"
POLL_SECONDS = 0.2  # how often a wait looks at its deadline (and lets a signal through)
REPLY_GRACE_SECONDS = 5.0  # process 0 gives up at its own deadline: waiting a little longer hears its reason
OUTLIVE_SECONDS = 10.0  # how long process 0, leaving without JAX's shutdown, waits for the others to exit
NEWS = ("lost", "failed", "stopped")  # what a watch reports: died without a word, failed, stopped alone


class CoordinatorError(RuntimeError):
    """The processes of a multi-process run did not all arrive, or do not agree, in time."""


def gather(coordinator: str, port: int, num_processes: int, timeout: float) -> dict[int, socket.socket]:
    """Process 0: wait for processes 1..N-1 to check in, then release them all (or refuse them all);
    returns the connection of each, by process id."""
    deadline = time.monotonic() + timeout
    try:
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port))
    except OSError as err:
        raise CoordinatorError(f"cannot listen on port {port} of {coordinator} for the other processes "
                               f"({err.strerror or err}); is another run using it?") from None
    peers: dict[int, socket.socket] = {}
    with server:
        server.settimeout(POLL_SECONDS)
        try:
            while len(peers) < num_processes - 1:
                if time.monotonic() >= deadline:
                    missing = ", ".join(str(i) for i in range(1, num_processes) if i not in peers)
                    raise CoordinatorError(f"only {len(peers) + 1} of {num_processes} processes arrived within "
                                           f"{timeout:g} s (missing --process-id {missing}); start each with "
                                           f"--coordinator {coordinator} --num-processes {num_processes}")
                _admit(server, peers, num_processes, deadline)
        except BaseException as err:  # a Ctrl-C too: nobody waits for a word that will not come
            for peer in peers.values():
                with peer:
                    _tell(peer, f"stop {err}" if isinstance(err, CoordinatorError) else
                          "stop process 0 was stopped before every process arrived")
            raise
        for peer in peers.values():
            _tell(peer, "go")
    return peers


def _admit(server: socket.socket, peers: dict[int, socket.socket], num_processes: int, deadline: float) -> None:
    """Take one caller if one is waiting; a stranger is dropped, a process that disagrees stops all."""
    try:
        connection, _ = server.accept()
    except TimeoutError:
        return
    words = _read_line(connection, min(deadline, time.monotonic() + 5.0)).split()
    if len(words) != 3 or words[0] != GREETING or not words[1].isdigit() or not words[2].isdigit():
        connection.close()  # not one of ours (a port scan, a health check)
        return
    process_id, their_count = int(words[1]), int(words[2])
    if their_count != num_processes:
        problem = f"process {process_id} was started with --num-processes {their_count}, process 0 with {num_processes}"
    elif process_id in peers or not 0 < process_id < num_processes:
        problem = f"two processes were started with --process-id {process_id}"
    else:
        peers[process_id] = connection
        return
    _tell(connection, f"stop {problem}")
    connection.close()
    raise CoordinatorError(problem)  # gather tells the others


def check_in(coordinator: str, address: tuple[str, int], process_id: int, num_processes: int,
             timeout: float) -> dict[int, socket.socket]:
    """Process 1..N-1: report to process 0 and wait for its word that every process is there; returns
    the connection to process 0."""
    deadline = time.monotonic() + timeout
    connection = _connect(coordinator, address, deadline, timeout)
    connection.sendall(f"{GREETING} {process_id} {num_processes}\n".encode())
    answer = _read_line(connection, deadline + REPLY_GRACE_SECONDS)
    if answer == "go":
        return {0: connection}
    connection.close()
    if answer.startswith("stop "):
        raise CoordinatorError(f"process 0 at {coordinator}: {answer[5:]}")
    raise CoordinatorError(f"process 0 at {coordinator} did not report all {num_processes} processes present within "
                           f"{timeout:g} s; start each with --coordinator {coordinator} --num-processes {num_processes}")


class Watch:
    """The roll call's connections, watched until this process leaves (see the module's docstring)."""

    def __init__(self, own_id: int, connections: dict[int, socket.socket], on_lost: Callable[[int, str, str], None]):
        self.own_id = own_id
        self.connections = connections  # the other end's process id -> its connection
        self.on_lost = on_lost  # (process id, a kind in NEWS, its detail: the error, the signal's name or "")
        self.leaving = False
        self._decided = threading.Lock()  # the first news, or this process's own leaving, wins
        self.said_bye: set[int] = set()  # the processes that left as planned
        self.acting = threading.Event()  # a watch thread took news and will end this process
        self.threads = {process_id: threading.Thread(target=self._watch, args=(process_id, connection), daemon=True,
                                                     name=f"fashionjax-watch-{process_id}")
                        for process_id, connection in connections.items()}
        for thread in self.threads.values():
            thread.start()

    def _watch(self, process_id: int, connection: socket.socket) -> None:
        """Ends when that process has exited (its connection closed), or once this one acted on news."""
        line = _read_line(connection, math.inf)
        with self._decided:
            news = line != "bye" and not self.leaving
            self.leaving = self.leaving or news
        if not news:
            if line == "bye":  # it is leaving: its exit closes the connection
                self.said_bye.add(process_id)
                _read_line(connection, math.inf)
            return
        self.acting.set()
        kind, _, rest = line.partition(" ")
        who, _, reason = rest.partition(" ")
        if kind in NEWS and who.isdigit():
            process_id = int(who)  # its own news, or process 0 passing on another's
        else:
            kind, reason = "lost", ""
        if self.own_id == 0:  # process 0 tells the rest, and outlives them all, the one with the news too
            for other, peer in self.connections.items():
                if other != process_id:
                    _tell(peer, f"{kind} {process_id} {reason}".rstrip())
            deadline = time.monotonic() + OUTLIVE_SECONDS
            _read_line(connection, deadline)
            self.await_exits(deadline)
        self.on_lost(process_id, kind, reason)

    def _news_on_its_way(self) -> bool:
        """Whether a watch thread took news, or a connection holds some unread (its process closed it
        without "bye", or sent a line): looked at without reading it."""
        return self.acting.is_set() or any(
            process_id not in self.said_bye and _closed_or_telling(connection)
            for process_id, connection in self.connections.items())

    def await_exits(self, deadline: float) -> None:
        """Until the other processes have exited (their connections closed), or the deadline passes."""
        for thread in self.threads.values():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def leave(self, news: str | None = None, detail: str = "") -> None:
        """Say "bye", or a NEWS kind and its detail; the connections stay open until the process exits.

        A failure while another process's news is already on its way (seen: a collective that failed
        with "Connection reset by peer" because the other process had been killed) is most likely its
        echo: the watch reports that news, which names the cause, and ends the process meanwhile."""
        if news == "failed" and self._news_on_its_way() and self.acting.wait(REPLY_GRACE_SECONDS):
            time.sleep(OUTLIVE_SECONDS + REPLY_GRACE_SECONDS)  # the watch exits the process before this ends
        with self._decided:
            self.leaving = True
        for connection in self.connections.values():
            _tell(connection, "bye" if news is None else f"{news} {self.own_id} {detail}".rstrip())


_watch: Watch | None = None
_left: Watch | None = None  # the watch that leave() ended, until the process exits
failed_in_a_run = False  # this process told the others of its run that it failed (see cli.run)


def watch(own_id: int, connections: dict[int, socket.socket], on_lost: Callable[[int, str, str], None]) -> None:
    """Watch the roll call's connections: on_lost(process id, kind, detail) runs (in a thread) when
    another process fails, is stopped alone or dies (the kinds in NEWS). Call leave() when this process
    is done."""
    global _watch
    _watch = Watch(own_id, connections, on_lost)


def leave(failure: str | None = None, stopped_by: str | None = None) -> None:
    """Tell the processes this one watches that it is done: "bye"; or its one-line error when it
    failed; or the name of the signal that stopped it alone (nothing when it watches none)."""
    global _watch, _left, failed_in_a_run
    if _watch is not None:
        if failure is not None:
            _watch.leave("failed", " ".join(failure.split()))
        else:
            _watch.leave("stopped" if stopped_by else None, stopped_by or "")
        _watch, _left = None, _watch
        failed_in_a_run = failure is not None


def outlive_the_others(seconds: float = OUTLIVE_SECONDS) -> None:
    """Process 0, leaving without JAX's shutdown (after leave()): wait until the others have exited,
    or `seconds`. The others return at once."""
    if _left is not None and _left.own_id == 0:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C here: leave now
            _left.await_exits(time.monotonic() + seconds)


def _connect(coordinator: str, address: tuple[str, int], deadline: float, timeout: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection(address, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError as err:
            if time.monotonic() >= deadline:
                raise CoordinatorError(f"cannot reach the coordinator at {coordinator} within {timeout:g} s "
                                       f"({err.strerror or err}); is process 0 running there?") from None
        time.sleep(POLL_SECONDS)


def _read_line(connection: socket.socket, deadline: float) -> str:
    """One line (up to 4 kB), or '' when the other side hangs up or the deadline passes first."""
    received = b""
    while b"\n" not in received and len(received) < 4096:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return ""
        try:
            connection.settimeout(min(POLL_SECONDS, remaining))
            chunk = connection.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return ""
        if not chunk:
            return ""
        received += chunk
    return received.decode("utf-8", "replace").split("\n")[0].strip()


def _closed_or_telling(connection: socket.socket) -> bool:
    """Whether the other end has closed the connection or sent something not yet read (a peek)."""
    try:
        return not connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT).startswith(b"b")  # b"bye"
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:  # reset: the other process died
        return True


def _tell(connection: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # it has gone: it will say so itself
        connection.sendall(f"{line}\n".encode())
