"""The registry: every known prefill and decode instance, its load and whether it is alive.

Instances either register over RegistryService and heartbeat, or are configured statically and
polled (`pdserve.gateway.fleet.poller`). An instance counts as *alive* while its last heartbeat (or
successful poll) is younger than the TTL and no call to it has failed since; expired instances
are dropped by `drop_expired`, which the server runs periodically.

An instance silent for longer than the TTL is *lost*: a registered one is dropped, a static one
stays known but stale. Either way the registry tells its lost-listeners once, so the
orchestrator can move requests off an instance that froze without closing its connections (a
SIGSTOPped process, a hung host), which no stream error would ever reveal.

Silence is measured on a clock that stands still while the gateway's own event loop is stalled
(`pdserve.gateway.fleet.liveness.LivenessClock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.protocol import check_compatible
from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole, LoadReport

log = structlog.get_logger("pdserve.gateway.fleet.registry")

Clock = Callable[[], float]


@dataclass
class InstanceEntry:
    """What the registry knows about one instance.

    Attributes:
        last_seen: Monotonic time of the last heartbeat, registration or successful poll.
        is_static: Configured with --prefill/--decode (polled) rather than registered.
        is_reachable: False after a call to the instance failed at the transport level, until
            its next heartbeat or successful poll.
        load_seq: Incremented with every new load report (lets the router reset its own
            estimates of work it sent since the report).
        is_lost: Silent past the TTL and announced to the lost-listeners (a registered entry
            is dropped at the same time; a static one stays until its next successful poll,
            which replaces it).
    """

    info: InstanceInfo
    load: LoadReport
    last_seen: float
    is_static: bool = False
    is_reachable: bool = True
    load_seq: int = 0
    is_lost: bool = False

    @property
    def instance_id(self) -> str:
        return self.info.instance_id


def validate_instance(info: InstanceInfo) -> None:
    """Checks what an instance must bring to join.

    Raises:
        PdserveError: INCOMPATIBLE_PEER for another protocol major (or a malformed version);
            INVALID_REQUEST for a missing id, address or model name, or a KV layout whose
            fingerprint does not match its fields.
    """
    check_compatible(info.protocol_version)
    missing = [
        name
        for name, value in (
            ("instance_id", info.instance_id),
            ("address", info.address),
            ("model_name", info.model_name),
        )
        if not value
    ]
    if missing:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            f"instance is missing {', '.join(missing)}",
            {"instanceId": info.instance_id},
        )
    if not info.kv_layout.is_fingerprint_valid:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            "kv_layout.fingerprint does not match the layout's fields",
            {"instanceId": info.instance_id},
        )


class Registry:
    """Instances by id.

    Args:
        ttl_s: Seconds without a heartbeat after which an instance is no longer alive.
        clock: Monotonic clock (injectable for tests).

    Attributes:
        version: Changes whenever the set of routable instances may have changed (one joins,
            leaves, is lost, turns unreachable or draining, or is heard from again after a
            silence); the router rebuilds its candidate lists only then. An instance going
            silent changes nothing here until `drop_expired` sees it: until then callers check
            `is_alive` on what they pick.
    """

    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, InstanceEntry] = {}
        self._listeners: list[Callable[[InstanceEntry], None]] = []
        self._lost_listeners: list[Callable[[InstanceEntry], None]] = []
        self._load_listeners: list[Callable[[InstanceEntry], None]] = []
        self.version = 0

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def add_listener(self, listener: Callable[[InstanceEntry], None]) -> None:
        """Calls `listener(entry)` whenever an instance joins (or re-joins)."""
        self._listeners.append(listener)

    def add_lost_listener(self, listener: Callable[[InstanceEntry], None]) -> None:
        """Calls `listener(entry)` once when an instance goes silent past the TTL."""
        self._lost_listeners.append(listener)

    def add_load_listener(self, listener: Callable[[InstanceEntry], None]) -> None:
        """Calls `listener(entry)` after every heartbeat (a new load report)."""
        self._load_listeners.append(listener)

    def register(
        self, info: InstanceInfo, load: LoadReport, *, is_static: bool = False
    ) -> InstanceEntry:
        """Adds an instance or replaces the one with the same id.

        Raises:
            PdserveError: See `validate_instance`.
        """
        validate_instance(info)
        previous = self._entries.get(info.instance_id)
        entry = InstanceEntry(
            info=info,
            load=load,
            last_seen=self._clock(),
            is_static=is_static,
            load_seq=previous.load_seq + 1 if previous else 0,
        )
        self._entries[info.instance_id] = entry
        self.version += 1
        if previous is None or previous.info != info or not previous.is_reachable:
            log.info(
                "instance_registered",
                instance_id=info.instance_id,
                role=info.role.value,
                address=info.address,
                model=info.model_name,
                protocol_version=info.protocol_version,
                is_static=is_static,
            )
            for listener in self._listeners:
                listener(entry)
        return entry

    def heartbeat(self, instance_id: str, load: LoadReport) -> InstanceEntry:
        """Records a heartbeat with the instance's load.

        Raises:
            PdserveError: INSTANCE_NOT_REGISTERED when the id is unknown (or was dropped); the
                instance should register again.
        """
        entry = self._entries.get(instance_id)
        if entry is None:
            raise PdserveError(
                ErrorReason.INSTANCE_NOT_REGISTERED,
                f"instance {instance_id!r} is not registered",
                {"instanceId": instance_id},
            )
        if not self.is_alive(entry) or entry.load.is_draining != load.is_draining:
            self.version += 1
        entry.load = load
        entry.load_seq += 1
        entry.last_seen = self._clock()
        if not entry.is_reachable:
            entry.is_reachable = True
            log.info("instance_reachable", instance_id=instance_id)
        for listener in self._load_listeners:
            listener(entry)
        return entry

    def touch(self, instance_ids: Iterable[str]) -> None:
        """Counts the known ones of `instance_ids` as heard from now, keeping their load and
        reachability (the etcd watcher holds its last view this way while etcd is away)."""
        now = self._clock()
        for instance_id in instance_ids:
            entry = self._entries.get(instance_id)
            if entry is not None:
                if not self.is_alive(entry):
                    self.version += 1
                entry.last_seen = now

    def deregister(self, instance_id: str) -> bool:
        """Removes an instance; returns whether it was known. Idempotent."""
        entry = self._entries.pop(instance_id, None)
        if entry is not None:
            self.version += 1
            log.info("instance_deregistered", instance_id=instance_id)
        return entry is not None

    def mark_unreachable(self, instance_id: str) -> None:
        """Takes an instance out of routing until its next heartbeat or successful poll."""
        entry = self._entries.get(instance_id)
        if entry is not None and entry.is_reachable:
            entry.is_reachable = False
            self.version += 1
            log.warning("instance_unreachable", instance_id=instance_id)

    def mark_draining(self, instance_id: str) -> None:
        """Takes an instance that said it is going away out of routing, until a heartbeat
        reports it admitting again (a draining one keeps reporting draining; one started
        again under the same id does not)."""
        entry = self._entries.get(instance_id)
        if entry is not None and not entry.load.is_draining:
            entry.load = replace(entry.load, is_draining=True)
            self.version += 1
            log.warning("instance_draining", instance_id=instance_id)

    def drop_expired(self) -> list[str]:
        """Removes registered instances whose heartbeat is older than the TTL.

        Static instances stay (they are configured); they simply stop being alive. Both kinds
        are announced to the lost-listeners, once per silence.

        Returns:
            The ids dropped.
        """
        now = self._clock()
        silent = [entry for entry in self._entries.values() if now - entry.last_seen > self._ttl_s]
        dropped = [entry.instance_id for entry in silent if not entry.is_static]
        if any(not entry.is_lost for entry in silent) or dropped:
            self.version += 1
        for instance_id in dropped:
            del self._entries[instance_id]
            log.warning("instance_expired", instance_id=instance_id, ttl_s=self._ttl_s)
        self._announce_lost(silent)
        return dropped

    def expire(self, instance_id: str) -> bool:
        """Removes an instance whose registration lapsed in a shared registry (its etcd lease):
        a loss, as on a TTL expiry, so the lost-listeners hear of it. Returns whether it was
        known."""
        entry = self._entries.pop(instance_id, None)
        if entry is not None:
            self.version += 1
            log.warning("instance_expired", instance_id=instance_id, registry="lease lapsed")
            self._announce_lost([entry])
        return entry is not None

    def _announce_lost(self, entries: list[InstanceEntry]) -> None:
        """Tells the lost-listeners of each entry, once per silence."""
        for entry in entries:
            if entry.is_lost:
                continue
            entry.is_lost = True
            if entry.is_static:
                log.warning("instance_lost", instance_id=entry.instance_id, ttl_s=self._ttl_s)
            for listener in self._lost_listeners:
                listener(entry)

    def is_alive(self, entry: InstanceEntry) -> bool:
        """Reachable and heard from within the TTL."""
        return entry.is_reachable and self._clock() - entry.last_seen <= self._ttl_s

    def get(self, instance_id: str) -> InstanceEntry | None:
        """The entry of an instance, if known."""
        return self._entries.get(instance_id)

    def entries(self) -> list[InstanceEntry]:
        """Every known instance, alive or not."""
        return list(self._entries.values())

    def alive(
        self, role: InstanceRole | None = None, model_name: str | None = None
    ) -> list[InstanceEntry]:
        """Alive instances, optionally of one role and model."""
        return [
            entry
            for entry in self._entries.values()
            if (role is None or entry.info.role is role)
            and (model_name is None or entry.info.model_name == model_name)
            and self.is_alive(entry)
        ]

    def model_names(self) -> set[str]:
        """Names of every model some known instance serves."""
        return {entry.info.model_name for entry in self._entries.values()}

    def remove_all(self, instance_ids: Iterable[str]) -> None:
        """Removes several instances at once (static instances whose id changed)."""
        for instance_id in instance_ids:
            if self._entries.pop(instance_id, None) is not None:
                self.version += 1
