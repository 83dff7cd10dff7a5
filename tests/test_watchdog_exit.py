"""The peer watchdog at interpreter exit (multimesh/runtime/distributed.py), in one
process with a fake key-value store: ``leave`` stops its thread before jax's shutdown
(a daemon thread inside a jaxlib call when the interpreter finalizes aborts the
process) and marks this process as exiting, and a peer marked so is not judged dead
by its silence. The multi-process behaviour is tests/test_multiprocess.py's."""

from __future__ import annotations

import threading

from multimesh.runtime import distributed


class _Store:
    """jax's key-value store as the watchdog uses it."""

    def __init__(self, entries: dict[str, str]):
        self.entries = dict(entries)
        self.lock = threading.Lock()
        self.calls = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            self.entries[key] = value
            self.calls += 1

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.entries.items() if k.startswith(prefix)]


def _watchdog(monkeypatch, entries, silent_after=0.05):
    store = _Store(entries)
    w = distributed._Watchdog(store, silent_after, 0.01)
    w.n, w.me = 2, 0
    monkeypatch.setattr(distributed._Watchdog, "_alive", lambda self: True)
    stopped = []
    monkeypatch.setattr(distributed._Watchdog, "_stop",
                        lambda self, why, peers: stopped.append((why, peers)))
    return w, store, stopped


def test_leave_stops_the_thread_and_marks_this_process_exiting(monkeypatch):
    w, store, stopped = _watchdog(monkeypatch, {"multimesh/alive/1": "1"}, silent_after=60)
    w.thread.start()
    while store.calls < 3:  # it beats
        pass
    w.leave()
    assert not w.thread.is_alive() and w.exiting
    assert store.entries["multimesh/alive/0"] == "exiting"
    assert stopped == []


def test_a_silent_peer_is_judged_dead_unless_it_is_exiting(monkeypatch):
    w, _, stopped = _watchdog(monkeypatch, {"multimesh/alive/1": "7"})
    w._run()  # returns once it has judged peer 1, which never beats again
    assert len(stopped) == 1 and stopped[0][1] == [1], stopped
    assert "sent no heartbeat" in stopped[0][0]

    w, store, stopped = _watchdog(monkeypatch, {"multimesh/alive/1": "exiting"})
    w.thread.start()
    while store.calls < 20:  # well past the 0.05 s timeout: 20 beats of 0.01 s
        pass
    w.leave()
    assert stopped == []
