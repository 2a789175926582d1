"""Crash recovery: what an in-flight request needs to survive its engine core.

The front end's ``OutputProcessor`` already keeps, for every unfinished
sequence, the ``EngineCoreRequest`` it sent (prompt and parameters) and every
token the core streamed back. When a core dies, each such sequence becomes a
*resumed request*: the same request carrying those tokens as
``prior_output_token_ids``. The new core recomputes prompt + prior output like
a preemption, counts the prior tokens as output (``max_tokens``,
``min_tokens``, stop ids, penalties), and continues a seeded request's random
stream after their draws, so it produces what the dead core would have.

Detokenizer and stop-string state stay in the front end, so a stream goes on
from its last token: nothing is repeated or dropped.

Hook for data parallelism: when core ``i`` of several dies, a data-parallel
client hands the ids it had routed there to ``AsyncLLM.resumable_requests``
and routes the result to the surviving cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tokenloom.engine.messages import EngineCoreRequest


@dataclass(frozen=True)
class InFlight:
    """One unfinished sequence: the request the core was given, and its output so far."""

    request: EngineCoreRequest
    output_token_ids: list[int]


def resumed_request(in_flight: InFlight) -> EngineCoreRequest:
    """The request to send a new core so that it continues after the output so far.

    Always built from the original request: the output list holds every token
    since the user's request began, through any number of earlier crashes.
    """
    return msgspec.structs.replace(
        in_flight.request, prior_output_token_ids=list(in_flight.output_token_ids)
    )
