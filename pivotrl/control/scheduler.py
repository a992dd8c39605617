"""Request queues and dispatch.

The scheduler owns the rollout and judge queues. A device is given at most
``per_device`` requests in flight; the rest stay queued here, so a device
that becomes free (or newly takes a role) is fed from the queue, and
work is always handed to the least-loaded device first.

Once a queue is empty, requests run where they were sent while devices
finish theirs unevenly: one holds a big batch (each of its decode steps the
slower for it) while another empties. ``rebalance`` names the requests to
take back from the most loaded devices, so that, handed out again, every
device holds about an even share.

Judgments of a group whose responses are all generated go first
(``judge_first``): a group trains once all of its members are judged, so a
judge backlog drained group by group lets training start while the rollout's
tail still runs, where one drained in arrival order leaves most groups a
judgment short until the end. The rewards do not depend on the order.

A judgment's work is known when it is queued (``judge_weight``: the tokens it
reads), so judgments go to the judge device with the least work in flight,
not the fewest requests: a group's judgments, queued together, hold its
shortest and its longest response side by side, and handed out by count in
turn they would load a few devices with every group's longest.

A group's judgments begin alike (the judge's template, the question and the
reference come before the response), and an engine with a prefix cache reads
such a beginning once while it stays cached. So a judgment goes where its group
was last sent (``JudgeRequest.group``) if that device has room and holds at
most the judgment's own work more than the least loaded; otherwise to the least
loaded. Sent wherever their group went, a group's judgments would fill devices
group by group and leave the heaviest unspread: the bound reuses a cached
beginning only where that costs the spread at most one judgment's work.

Where the judge's KV cache is paged (``judge_kv``, tokens per device), a device
is handed no more than its cache holds: the count cap fits judgments of the
mean length, but the last of a step judge the longest responses, and a device
free when they come would take a count's worth, twice what it can run, while
the devices freeing up next find the queue empty.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from pivotrl.control.messages import Generate, GenRequest, Judge, JudgeRequest


class JudgeQueue:
    """Judge requests waiting for a device: those sent first (migrated ones, then whole groups'), then the
    rest in arrival order. Sending a group's requests first costs the group's size, not the queue's: the
    rest keeps each request's arrival number, and one sent first is only marked gone there."""

    def __init__(self) -> None:
        self.first: deque[JudgeRequest] = deque()
        self._rest: deque[tuple[int, JudgeRequest]] = deque()  # (arrival number, request), gone ones too
        self._waiting: dict[int, tuple[int, JudgeRequest]] = {}  # uid -> its entry in _rest, while there
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self.first) + len(self._waiting)

    def __iter__(self) -> Iterator[JudgeRequest]:
        yield from self.first
        waiting = self._waiting
        for entry in self._rest:
            if waiting.get(entry[1].uid) is entry:
                yield entry[1]

    def extend(self, reqs: Iterable[JudgeRequest]) -> None:
        for r in reqs:
            entry = (self._arrivals, r)
            self._arrivals += 1
            self._rest.append(entry)
            self._waiting[r.uid] = entry

    def push_front(self, reqs: list[JudgeRequest]) -> None:
        """``reqs`` before every other request, in their order."""
        self.first.extendleft(reversed(reqs))

    def send_first(self, uids: Iterable[int]) -> None:
        """The waiting requests of ``uids`` after those sent first already, in their arrival order."""
        entries = sorted(e for u in uids if (e := self._waiting.pop(u, None)) is not None)
        self.first.extend(r for _, r in entries)
        if not self._waiting:  # only entries marked gone are left there
            self._rest.clear()

    def popleft(self) -> JudgeRequest:
        if self.first:
            return self.first.popleft()
        waiting = self._waiting
        while True:
            entry = self._rest.popleft()  # (IndexError when empty, as a deque's)
            if waiting.get(entry[1].uid) is entry:
                del waiting[entry[1].uid]
                if not waiting:
                    self._rest.clear()
                return entry[1]


class Scheduler:
    def __init__(
        self,
        per_device: int,
        judge_per_device: int | None = None,
        judge_weight: Callable[[int], float] | None = None,
        judge_kv: float | None = None,
    ) -> None:
        for name, n in (("per_device", per_device), ("judge_per_device", judge_per_device or per_device)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        if judge_kv is not None and not judge_kv > 0:
            raise ValueError(f"judge_kv must be > 0 (tokens of KV cache a judge device holds) or None, got {judge_kv}")
        self.per_device = per_device
        self.judge_per_device = judge_per_device or per_device
        self.judge_kv = math.inf if judge_kv is None else float(judge_kv)  # the most judgment weight a device holds
        # the work of a judgment, from its uid: fixed once it is queued, since the queued work is counted
        # when it joins and taken off again at dispatch
        self.judge_weight = judge_weight or (lambda uid: 1.0)
        self._weights: dict[int, float] = {}  # judgment uid in flight -> its weight
        self._work: dict[int, float] = {}  # device -> weight of the judgments it runs
        self._queued_work = 0.0  # weight of the judgments queued
        self._home: dict[int, int] = {}  # a judgment group -> the device its last judgment was sent to
        self.gen_queue: deque[GenRequest] = deque()
        self.judge_queue = JudgeQueue()
        # device -> uids it is working on; a list, not a dict: the loads of a thousand devices are
        # read at every pump, and a list of sets gives them at C speed (grown as devices get work)
        self.inflight: list[set[int]] = []

    def load(self, device: int) -> int:
        return len(self.inflight[device]) if device < len(self.inflight) else 0

    def running(self, device: int) -> set[int]:
        """The uids ``device`` is working on (do not modify)."""
        return self.inflight[device] if device < len(self.inflight) else set()

    def loads(self, devices: int) -> tuple[int, ...]:
        """``load`` of devices 0 .. devices - 1."""
        inflight = self.inflight
        if len(inflight) == devices:  # (once every device had work: no slice, no padding)
            return tuple(map(len, inflight))
        out = list(map(len, inflight[:devices]))
        return tuple(out + [0] * (devices - len(out)))

    def _loads_of(self, devices: list[int]) -> list[int]:
        """``load`` of each of ``devices``, inlined: a thousand devices at every pump."""
        inflight, known = self.inflight, len(self.inflight)
        return [len(inflight[d]) if d < known else 0 for d in devices]

    def _holding(self, device: int) -> set[int]:
        while len(self.inflight) <= device:
            self.inflight.append(set())
        return self.inflight[device]

    def submit_gen(self, reqs: list[GenRequest], front: bool = False) -> None:
        if front:
            self.gen_queue.extendleft(reversed(reqs))
        else:
            self.gen_queue.extend(reqs)

    def submit_judge(self, reqs: list[JudgeRequest], front: bool = False) -> None:
        self._queued_work += sum(self.judge_weight(r.uid) for r in reqs)
        if front:  # (migrated requests: they ran before any still queued)
            self.judge_queue.push_front(reqs)
        else:
            self.judge_queue.extend(reqs)

    def judge_first(self, uids: set[int]) -> None:
        """The queued judge requests of ``uids`` (a group generated whole) go before every other one
        queued, after those already sent first; their order is kept."""
        self.judge_queue.send_first(uids)

    def finished(self, device: int, uid: int) -> None:
        self.inflight[device].discard(uid)
        weight = self._weights.pop(uid, None)
        if weight is not None:
            self._work[device] -= weight

    def forget(self, device: int) -> set[int]:
        """A lost device's requests are no longer in flight there; returns their uids (the caller queues them
        again)."""
        uids = set(self.running(device))
        for uid in uids:
            self.finished(device, uid)
        return uids

    def dispatch_gen(self, devices: list[int], version: int, joining: int = 0) -> list[Generate]:
        batches = self._spread(self.gen_queue, devices, self.per_device, joining)
        return [Generate(d, tuple(reqs), version) for d, reqs in batches.items()]

    def dispatch_judge(self, devices: list[int], joining: int = 0) -> list[Judge]:
        batches = self._spread(self.judge_queue, devices, self.judge_per_device, joining, weighed=True)
        return [Judge(d, tuple(reqs)) for d, reqs in batches.items()]

    def rebalance(self, devices: list[int], cost: Callable[[int], float]) -> dict[int, list[int]]:
        """Requests to take back (device -> uids) when the most loaded of ``devices`` holds more
        than twice the least loaded plus one: each device above an even share gives its excess,
        the requests cheapest to move first (lowest ``cost``, e.g. tokens to re-prefill).
        For a role whose queue is empty: queued requests go to the least loaded first anyway."""
        loads = self._loads_of(devices)
        if len(loads) < 2 or min(loads) * 2 + 1 >= max(loads):
            return {}
        share = -(-sum(loads) // len(loads))
        inflight = self.inflight
        return {
            d: sorted(inflight[d], key=lambda u: (cost(u), u))[: n - share]
            for n, d in zip(loads, devices, strict=True)
            if n > share
        }

    def _spread(
        self, queue: deque | JudgeQueue, devices: list[int], cap: int, joining: int = 0, weighed: bool = False
    ) -> dict[int, list]:
        """Hand queued requests one at a time to the least-loaded device with room: the fewest
        requests in flight, or (``weighed``, judgments) the least weight, then the fewest.

        ``joining`` devices are taking the role (shifting into it) and not ready yet: the
        ready ones get no more than an even share of the work, so the first device to
        arrive does not take the whole batch while the others find an empty queue.

        Judgments (``weighed``) also stop at an even share of the role's work, queued and in
        flight, over the ready and joining devices: at a step's end the last judgments are the
        longest responses' (a prefill several times a short one's), and devices that free up
        first would otherwise take all of them in full batches, one long pass each, while
        the devices freeing a few seconds later find the queue empty. The device with the
        least work is always below the share while anything is queued, so work never waits
        on the share alone; it waits where every device holds what its KV cache does (``judge_kv``)."""
        batches: dict[int, list] = {}
        if not queue or not devices:
            return batches
        loads = self._loads_of(devices)
        if joining:
            share = -(-(len(queue) + sum(loads)) // (len(devices) + joining))
            cap = min(cap, max(1, share))
        work = self._work
        limit = math.inf  # (judgments: the most work a device takes on)
        if weighed:
            limit = (self._queued_work + sum(work.get(d, 0.0) for d in devices)) / (len(devices) + joining)
            limit = min(limit, self.judge_kv)
        # least loaded first, ties to the lowest id; a device with no room leaves the heap. ``room``: the load of
        # each device with room, which its heap entry must match (an entry is left behind when a judgment goes
        # to its group's device, out of heap order)
        heap = [
            (w, n, d)
            for n, d in zip(loads, devices, strict=True)
            if n < cap and (w := work.get(d, 0.0) if weighed else n) < limit
        ]
        heapq.heapify(heap)
        room = {d: (w, n) for w, n, d in heap}
        if weighed:  # the requests that go now, in queue order; placed heaviest first (longest processing time)
            slots, room_work = sum(cap - n for _, n, _ in heap), sum(limit - w for w, _, _ in heap)
            going: list[JudgeRequest] = []
            weights: dict[int, float] = {}
            taken = 0.0
            while queue and len(going) < slots and taken < room_work:
                r = queue.popleft()
                going.append(r)
                weights[r.uid] = weight = self.judge_weight(r.uid)
                taken += weight
            self._queued_work = self._queued_work - taken if queue else 0.0
            order = list(going)
            going.sort(key=lambda r: -weights[r.uid])
            pending: deque | JudgeQueue = deque(going)
        else:
            pending = queue
        home = self._home
        while pending and room:
            req = pending.popleft()
            while room.get(heap[0][2]) != heap[0][:2]:  # (an entry left behind)
                heapq.heappop(heap)
            d = heap[0][2]
            h = home.get(req.group, -1) if weighed and req.group >= 0 else -1
            if h in room and room[h][0] <= room[d][0] + weights[req.uid]:  # its group's, a judgment's work more at most
                d = h
            w, n = room.pop(d)
            batches.setdefault(d, []).append(req)
            self._holding(d).add(req.uid)
            if weighed:
                weight = self._weights[req.uid] = weights[req.uid]
                work[d] = w = work.get(d, 0.0) + weight
                if req.group >= 0:
                    home[req.group] = d
            else:
                w += 1
            if n + 1 < cap and w < limit:
                room[d] = (w, n + 1)
                heapq.heappush(heap, (w, n + 1, d))
        if weighed and pending:  # past every device's share: back to the queue's front, in their order
            left = {r.uid for r in pending}
            back = [r for r in order if r.uid in left]
            queue.push_front(back)
            self._queued_work += sum(weights[r.uid] for r in back)
        return batches
