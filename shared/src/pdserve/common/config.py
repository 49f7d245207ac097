"""The configuration pattern: frozen dataclasses that validate themselves and drive the CLI.

A service declares its settings once, as a frozen dataclass whose fields (`setting`) carry
their default, their help text, their choices and their range: ``min`` (inclusive), ``gt``
(exclusive) and ``max`` (inclusive), kept in the field's metadata. `check_ranges` checks
every range at once (`ServiceConfig` does in its ``__post_init__``, which also holds the checks
that span several fields and raises `ValueError` for bad values). `add_arguments` turns the
fields into ``--kebab-case`` flags with the dataclass defaults, and `from_args` builds the
config back from parsed arguments, so defaults and validation live in one place.

A settings group that is a dataclass of its own (a service's request limits, say) carries its
fields' defaults and help text itself; a config mirrors each of them with `mirror_field` and
builds the group back with `settings_of`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.common.logging import LEVELS

T = TypeVar("T")


RANGE_KEYS = ("min", "gt", "max")


def setting(
    default: Any,
    help_text: str = "",
    *,
    choices: typing.Collection[str] | None = None,
    min: float | None = None,
    gt: float | None = None,
    max: float | None = None,
) -> Any:
    """A config field: its default, its help text (the flag's ``--help``), its choices and its
    range (``min`` inclusive, ``gt`` exclusive, ``max`` inclusive; `check_ranges`)."""
    metadata: dict[str, Any] = {"help": help_text} if help_text else {}
    given = {"choices": choices, "min": min, "gt": gt, "max": max}
    metadata.update({key: value for key, value in given.items() if value is not None})
    return dataclasses.field(default=default, metadata=metadata)


def port_setting(default: int | None, help_text: str) -> Any:
    """A port's config field: 0 to 65535, where 0 picks a free port (`setting`)."""
    return setting(default, help_text, min=0, max=65535)


def describe_range(metadata: typing.Mapping[str, Any]) -> str:
    """A field's range in words: ``positive``, ``>= 1``, ``in (0, 1]``, ``in [0, 65535]``."""
    low, above, high = (metadata.get(key) for key in RANGE_KEYS)
    if high is not None:
        left = f"[{low:g}" if low is not None else f"({above:g}"
        return f"in {left}, {high:g}]"
    if above == 0:
        return "positive"
    return f"> {above:g}" if above is not None else f">= {low:g}"


def check_ranges(config: Any) -> None:
    """Checks each field of the dataclass `config` against its metadata: its ``choices``, and
    its range (a number in range, and finite). Unset fields (None) are not checked.

    Raises:
        ValueError: ``"<field> must be <range>, got <value>"`` (or ``one of ...``) for the
            first field that is not.
    """
    for field in dataclasses.fields(config):
        metadata = field.metadata
        value = getattr(config, field.name)
        if value is None:
            continue
        choices = metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{field.name} must be one of {', '.join(choices)}, got {value!r}")
        if not any(key in metadata for key in RANGE_KEYS):
            continue
        low, above, high = (metadata.get(key) for key in RANGE_KEYS)
        if not math.isfinite(value):
            raise ValueError(f"{field.name} must be a finite number, got {value}")
        if (
            (low is not None and value < low)
            or (above is not None and value <= above)
            or (high is not None and value > high)
        ):
            raise ValueError(f"{field.name} must be {describe_range(metadata)}, got {value}")


MIRRORS = "mirrors"
"""The metadata key of a config field that mirrors a settings group's field: (class, name)."""


def mirror_field(settings_cls: type, name: str) -> Any:
    """A config field that mirrors the field `name` of the dataclass `settings_cls`: its
    default and its metadata (help text, range) are that field's, so they are written once.

    Raises:
        TypeError: `settings_cls` has no field `name` with a plain default.
    """
    source = {f.name: f for f in dataclasses.fields(settings_cls)}.get(name)
    if source is None or source.default is dataclasses.MISSING:
        raise TypeError(f"{settings_cls.__name__} has no field {name!r} with a default")
    metadata = {**source.metadata, MIRRORS: (settings_cls, name)}
    return dataclasses.field(default=source.default, metadata=metadata)


def settings_of(config: Any, settings_cls: type[T]) -> T:
    """`settings_cls` made of the values of `config`'s fields that mirror it (`mirror_field`).

    Raises:
        ValueError: From the settings class's own validation.
    """
    values = {}
    for field in dataclasses.fields(config):
        mirrored = field.metadata.get(MIRRORS)
        if mirrored is not None and mirrored[0] is settings_cls:
            values[mirrored[1]] = getattr(config, field.name)
    return settings_cls(**values)


def flag_name(field_name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def _scalar_type(annotation: Any) -> Any:
    """The argparse type for a field annotation (``int | None`` -> int)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else str
    return annotation


def add_arguments(
    parser: argparse.ArgumentParser, config_cls: type, *, exclude: Iterable[str] = ()
) -> None:
    """Adds one flag per dataclass field of `config_cls` (except `exclude`) to `parser`.

    Fields typed ``bool`` become ``--flag/--no-flag``; tuples of strings become repeatable
    flags. The help text comes from ``field.metadata["help"]`` and shows the default.
    """
    hints = typing.get_type_hints(config_cls)
    skipped = set(exclude)
    # NOTE: the settings every service shares (logging, tracing) go last in --help.
    common = {f.name for f in dataclasses.fields(ServiceConfig)}
    ordered = sorted(dataclasses.fields(config_cls), key=lambda f: f.name in common)
    for field in ordered:
        if field.name in skipped or not field.init:
            continue
        annotation = hints[field.name]
        default = (
            field.default
            if field.default is not dataclasses.MISSING
            else field.default_factory()
            if field.default_factory is not dataclasses.MISSING
            else None
        )
        help_text = field.metadata.get("help", "")
        kwargs: dict[str, Any] = {"default": default, "dest": field.name}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is tuple:
            kwargs["action"] = "append"
            kwargs["type"] = typing.get_args(annotation)[0]
            kwargs["default"] = None
        else:
            kwargs["type"] = _scalar_type(annotation)
            choices = field.metadata.get("choices")
            if choices:
                kwargs["choices"] = choices
        parser.add_argument(
            flag_name(field.name), help=f"{help_text} (default: {default!r})", **kwargs
        )


def from_args(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Builds `config_cls` from parsed arguments; `overrides` win over the namespace.

    Raises:
        ValueError: From the config's own validation.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_cls):  # type: ignore[arg-type]
        if not field.init or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if isinstance(value, list):
            value = tuple(value)
        if value is None:
            continue  # not given on the command line: the dataclass default applies
        values[field.name] = value
    values.update(overrides)
    return config_cls(**values)


@dataclass(frozen=True)
class ServiceConfig:
    """Settings every pdserve service has: logging, tracing and internal-plane security."""

    log_level: str = setting("info", "log level", choices=LEVELS)
    otlp_endpoint: str | None = setting(
        None,
        "OTLP/gRPC collector for traces, e.g. localhost:4317 (Jaeger); the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_TRACES_EXPORTER variables also work; off if unset",
    )
    trace_sample_ratio: float | None = setting(
        None, "fraction of new traces kept (parent-based); all when unset", min=0, max=1
    )
    tls_ca: str | None = setting(
        None, "cluster CA certificate (PEM) every internal peer must be signed by"
    )
    tls_cert: str | None = setting(
        None,
        "this service's certificate (PEM, from `pdserve certs issue`); its role and "
        "instance id are the service's identity",
    )
    tls_key: str | None = setting(None, "private key of --tls-cert (PEM)")
    insecure: bool = setting(
        False,
        "run the internal gRPC plane in plaintext, trusting any caller that reaches "
        "its ports (logs a warning; shown in GetInstanceStatus and /health)",
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        tls = (self.tls_ca, self.tls_cert, self.tls_key)
        if self.insecure and any(tls):
            raise ValueError("--insecure and --tls-ca/--tls-cert/--tls-key exclude each other")
        if not self.insecure and not all(tls):
            raise ValueError(
                "the internal gRPC plane needs mutual TLS: pass --tls-ca, --tls-cert and "
                "--tls-key (make them with `pdserve certs`), or --insecure for plaintext"
            )
