"""A prefill and a decode chosen together for one attempt of a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole
from pdserve.gateway.routing.policy import RouteReason


@dataclass(frozen=True)
class Pair:
    """A prefill and a decode that can serve one attempt together.

    Attributes:
        prefill_reason: Why this prefill (its cached prefix, or its load).
        num_matched_blocks: Leading full blocks of the prompt the prefill is believed to hold.
        booked: The work the pick booked on each instance's estimated load and has not yet
            settled (`Router.settle`), by role: prompt tokens on the prefill, blocks on the
            decode.
    """

    prefill: InstanceInfo
    decode: InstanceInfo
    prefill_reason: RouteReason = RouteReason.LOAD
    num_matched_blocks: int = 0
    booked: dict[InstanceRole, int] = field(default_factory=dict, compare=False, repr=False)

    def instance(self, role: InstanceRole) -> InstanceInfo:
        return self.prefill if role is InstanceRole.PREFILL else self.decode
