from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from pdserve.common.config import add_arguments, from_args


@dataclass(frozen=True)
class _DemoConfig:
    num_blocks: int = field(default=64, metadata={"help": "KV blocks"})
    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    budget_bytes: int | None = field(default=None, metadata={"help": "KV memory budget"})
    is_verbose: bool = field(default=False, metadata={"help": "more logs"})
    peers: tuple[str, ...] = field(default=(), metadata={"help": "peer addresses"})

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


def _parse(argv: list[str]) -> _DemoConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _DemoConfig)
    return from_args(_DemoConfig, parser.parse_args(argv))


def test_defaults_come_from_the_dataclass() -> None:
    assert _parse([]) == _DemoConfig()


def test_flags_override_and_convert_types() -> None:
    argv = ["--num-blocks", "8", "--budget-bytes", "1024", "--is-verbose"]
    config = _parse([*argv, "--peers", "a", "--peers", "b"])
    assert config == _DemoConfig(8, "127.0.0.1", 1024, True, ("a", "b"))


def test_validation_runs_on_parsed_values() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        _parse(["--num-blocks", "0"])


def test_help_shows_text_and_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _DemoConfig)
    text = parser.format_help()
    assert "--num-blocks" in text and "KV blocks (default: 64)" in text
