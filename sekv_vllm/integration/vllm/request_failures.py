"""Requests that failed while being served, so that one request's failure does not stop the engine.

The worker side (runner bridge, backend, the runner's step guard) files a request with its cause;
the scheduler finishes it with an error at the end of that step, before its output is read, frees
its pages as for any finished request, and the front end answers it with HTTP 500 naming the
cause (integration/vllm/v0_32/shims.py). Scheduler and worker share the engine-core process on CPU (one worker,
in-process executor), as the page plans of kv_pages.py do.
"""
from __future__ import annotations

from collections import OrderedDict

# Prefix of every cause: the front end names only causes that sekv filed.
CAUSE_PREFIX = "sekv: "
# Causes the front end keeps for requests whose error it has not answered yet.
_MAX_CAUSES = 4096

_failed: dict[str, str] = {}
_causes: OrderedDict[str, str] = OrderedDict()
# Requests failed in this process so far (a metric, and what the tests read).
failed_total = 0


def fail(req_id: str, cause: str) -> None:
    """File the engine request `req_id` to be finished with an error naming `cause`."""
    global failed_total
    if req_id not in _failed:
        failed_total += 1
        _failed[req_id] = CAUSE_PREFIX + cause


def take() -> dict[str, str]:
    """The requests filed since the last call, with their causes."""
    failed = dict(_failed)
    _failed.clear()
    return failed


def remember_cause(external_req_id: str, cause: str) -> None:
    """Front end: keep the cause of a failed request until its error is answered."""
    _causes[external_req_id] = cause
    while len(_causes) > _MAX_CAUSES:
        _causes.popitem(last=False)


def pop_cause(external_req_id: str) -> str | None:
    return _causes.pop(external_req_id, None)
