"""The pair an attempt runs on: the router's choice under the request's exclusions, in a
``gateway.route`` span, counted by the prefill's reason."""

from __future__ import annotations

import contextlib

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.routing.pair import Pair
from pdserve.gateway.routing.prompt_keys import PromptKeys
from pdserve.gateway.routing.queue_bounds import NoPairAlive, is_wait
from pdserve.gateway.routing.router import Router

CONSTRAINED = frozenset({"constraints"})  # what a constrained request needs of both instances
FILTERED = frozenset({"token-filters"})  # allowed_token_ids or bad_words

_tracer = telemetry.tracer("pdserve.gateway")


class PairChoice:
    """Chooses attempts' pairs with a `Router`.

    Args:
        router: Pair selection.
        metrics: Counts the routes by reason.
    """

    def __init__(self, router: Router, metrics: GatewayMetrics) -> None:
        self._router = router
        self._metrics = metrics

    def route(self, active: ActiveRequest, keys: PromptKeys) -> Pair:
        """Picks the attempt's pair, avoiding what the request's state avoids when another
        pair exists.

        Args:
            active: The request (its progress, state and deadline); the route's span becomes
                a child of its span.
            keys: The block keys of its continuation.

        Raises:
            PdserveError: No pair has room (a wait) or none can serve the request; when earlier
                attempts excluded every live instance, the last of their errors; when no pair is
                alive at all, `NoPairAlive` (NO_HEALTHY_INSTANCES).
        """
        with _tracer.start_as_current_span(
            "gateway.route",
            context=active.context,
            attributes={telemetry.REQUEST_ID: active.request_id},
        ) as span:
            active.remaining_s()
            state = active.state
            *preferred, required = state.exclusions()
            pair = None
            for prefill_ids, decode_ids in preferred:
                with contextlib.suppress(PdserveError):
                    pair = self._pick(active, keys, prefill_ids, decode_ids)
                    break
            try:
                pair = pair or self._pick(active, keys, *required)
            except PdserveError as error:
                # NOTE: when earlier attempts excluded every instance, their error explains
                # more (and carries its retry delay); no room is not a failure: it waits; no
                # pair alive at all is NO_HEALTHY_INSTANCES (the orchestrator may wait for one
                # to come back: `pdserve.gateway.peer_wait`).
                if is_wait(error):
                    raise
                if not self._router.has_pair(active.request.model):
                    raise NoPairAlive(
                        error.reason, error.message, error.metadata, error.retry_delay_s
                    ) from error
                if state.last_error is not None:
                    raise state.last_error from error
                raise
            span.set_attribute("pdserve.prefill.instance_id", pair.prefill.instance_id)
            span.set_attribute("pdserve.decode.instance_id", pair.decode.instance_id)
            span.set_attribute("pdserve.route.prefill_reason", pair.prefill_reason.value)
            span.set_attribute("pdserve.route.matched_blocks", pair.num_matched_blocks)
        self._metrics.routes.labels(reason=pair.prefill_reason.value).inc()
        return pair

    def _pick(
        self,
        active: ActiveRequest,
        keys: PromptKeys,
        prefill_ids: frozenset[str],
        decode_ids: frozenset[str],
    ) -> Pair:
        request, progress = active.request, active.progress
        return self._router.pick(
            request.model,
            progress.continuation_token_ids(),
            progress.num_remaining_tokens,
            exclude_prefill_ids=prefill_ids,
            exclude_decode_ids=decode_ids,
            prompt_keys=keys,
            require_room=True,
            required_features=(
                (CONSTRAINED if request.sampling.constraint is not None else frozenset())
                | (FILTERED if request.sampling.has_token_filters else frozenset())
            ),
            share_key=request.share_key,
            num_shared_tokens=len(request.prompt_token_ids),
        )
