"""What one call to a replica may carry, and splitting larger ones: an Open of more sessions than
the replica's max_open_per_call, a batch (Reset, Step, CloseSessions) of more items than its
max_batch_items. A replica says both in every OpenResponse and ListEnvsResponse and its heartbeat
carries the first to the directory; until a client has heard them it assumes replicas' defaults.
The sync and async clients share these pieces; each makes its calls its own way."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from envserve.v1 import envserve_pb2 as pb

# Replicas' default for both limits (`--max-open-per-call`, `--max-batch-items`): what a client
# assumes of a replica that has not said its own (one older than the fields says 0).
ASSUMED_PER_CALL = 4096


@dataclass
class ReplicaLimits:
    """A replica's limits as it last said them (0: not said yet)."""
    max_open_per_call: int = 0
    max_batch_items: int = 0

    def note(self, reply) -> None:
        """Take the limits an OpenResponse or ListEnvsResponse carries (a replica restarted with other
        settings says new ones); 0 (an older replica) leaves them as they were."""
        if reply.max_open_per_call > 0:
            self.max_open_per_call = reply.max_open_per_call
        if reply.max_batch_items > 0:
            self.max_batch_items = reply.max_batch_items

    def open_size(self, own: int = 0, unit: int = 1) -> int:
        """Sessions per Open: the replica's limit (assumed while unknown), within the caller's own
        bound (0: none), in whole units of `unit` (a table's seats are opened together)."""
        size = self.max_open_per_call or ASSUMED_PER_CALL
        if own > 0:
            size = min(size, own)
        return max(unit, size - size % unit)

    def batch_size(self) -> int:
        return self.max_batch_items or ASSUMED_PER_CALL

    def unsaid(self, kind: str) -> bool:
        """Whether the replica has not yet said this limit ("open" or "batch")."""
        return not (self.max_open_per_call if kind == "open" else self.max_batch_items)

    def refused_as_too_many(self, kind: str, sent: int) -> bool:
        """After a ListEnvs taught the limits: whether `sent` exceeds the one said now, so that an
        INVALID_ARGUMENT for it was the count's and the call may go again in smaller parts."""
        limit = self.max_open_per_call if kind == "open" else self.max_batch_items
        return 0 < limit < sent


def parts(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def merged_open(replies: list[pb.OpenResponse]) -> pb.OpenResponse:
    """One OpenResponse for several Opens of one request: every id in order, the shortest lease, the
    replica's latest count and limits."""
    if len(replies) == 1:
        return replies[0]
    last = replies[-1]
    return pb.OpenResponse(session_ids=[sid for r in replies for sid in r.session_ids],
                           lease_seconds=min(r.lease_seconds for r in replies), system_prompt=replies[0].system_prompt,
                           live_sessions=last.live_sessions, counted_unix=last.counted_unix,
                           max_open_per_call=last.max_open_per_call, max_batch_items=last.max_batch_items)
