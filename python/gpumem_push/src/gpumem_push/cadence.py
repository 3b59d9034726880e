"""How often the pusher reads a memory snapshot between out-of-memory errors: as often as the
pushes go, but never at more than SHARE of the job's wall time.

A snapshot's real cost is PyTorch's, in C++ under the allocator's lock (every segment and
block copied, with their frames where the job records stacks), then its conversion to Python
objects under the GIL; no stand-in shows it, so the pusher times each of its snapshots (the
call and its summary) and this module spaces them by what the last one took.

# Invariants
- After a snapshot of d seconds, no periodic one starts for d * (1/SHARE - 1) seconds: from
  the start of one snapshot to the start of the next periodic one, snapshots take at most
  SHARE of the time. Out-of-memory snapshots are taken whatever the cadence says (they are
  what explains the error), and count: the periodic one after them waits as long.
- Once off (the job's PyTorch cannot leave the allocation history out of a snapshot, and the
  history is recorded), no periodic snapshot is taken again in this process: each would copy
  the whole history.
- Thread-safe: the pusher's thread and a failing training thread both report to it.
"""

import math
import threading

SHARE = 0.005  # of the job's wall time, at most, in periodic snapshots


class Cadence:
    """When the next periodic snapshot may start, from what the snapshots took."""

    def __init__(self, share=SHARE):
        self._lock = threading.Lock()
        self._wait_per_second = 1.0 / share - 1.0
        self._not_before = -math.inf
        self._off = None  # why periodic snapshots are off, once they are
        self._taken = {"periodic": 0, "oom": 0}
        self._seconds = 0.0
        self._last_seconds = None

    def due(self, now):
        """Whether a periodic snapshot may start at `now` (monotonic seconds)."""
        with self._lock:
            return self._off is None and now >= self._not_before

    def took(self, kind, seconds, end):
        """A snapshot of `kind` ("periodic" or "oom") took `seconds`, ending at `end`."""
        seconds = max(seconds, 0.0)
        with self._lock:
            self._taken[kind] += 1
            self._seconds += seconds
            self._last_seconds = seconds
            self._not_before = max(self._not_before, end + seconds * self._wait_per_second)

    def turn_off(self, why):
        """No periodic snapshot from now on, for `why`."""
        with self._lock:
            if self._off is None:
                self._off = why

    def stats(self):
        """Snapshots taken (periodic, at out-of-memory errors), their seconds in all and the
        last one's, and why periodic ones are off (None while they are not)."""
        with self._lock:
            return dict(self._taken, seconds=self._seconds, last_seconds=self._last_seconds,
                        off=self._off)
