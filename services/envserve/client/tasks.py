"""Walking a split's tasks page by page (ListTasks), with any of envserve's synchronous clients."""
from __future__ import annotations

from typing import Iterator

from envserve.v1 import envserve_pb2 as pb


def iter_tasks(client, env_id: str, split: str = "", limit: int | None = None,
               page_size: int = 0) -> Iterator[pb.Task]:
    """The tasks of `split` in order, at most `limit`; pages are asked for as the caller reads."""
    token, given = "", 0
    while limit is None or given < limit:
        want = page_size if limit is None else min(page_size or limit - given, limit - given)
        page = client.list_tasks(env_id, split, want, token)
        for task in page.tasks[:None if limit is None else limit - given]:
            yield task
            given += 1
        token = page.next_page_token
        if not token:
            return
