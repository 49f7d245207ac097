"""Where pdserve's time to first token goes, from the gateway's own histogram.

The gateway counts each request's phases in ``pdserve_gateway_ttft_phase_seconds{phase}``
(docs/observability.md). Scraping its ``/metrics`` before and after a round and subtracting
gives that round's sum and count per phase; their ratio is the mean per request. The phases
up to the first token add up to about the TTFT the load generator measured (which also holds
the client's own HTTP time); ``transfer_tail`` is not part of it (it delays the second token).
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

import httpx
from common import percentile
from loadgen import RequestResult
from prometheus_client.parser import text_string_to_metric_families

from pdserve.gateway.phases import PHASES

FAMILY = "pdserve_gateway_ttft_phase_seconds"
AFTER_FIRST_TOKEN = "transfer_tail"
# The phases up to the first token, in the order they happen.
TTFT_PHASES = tuple(phase for phase in PHASES if phase != AFTER_FIRST_TOKEN)

# phase -> (sum of seconds, count)
PhaseTotals = dict[str, tuple[float, float]]


class PhaseRound(NamedTuple):
    """What the gateway observed during one round, and what the load generator measured."""

    totals: PhaseTotals
    results: list[RequestResult]


def scrape(url: str) -> PhaseTotals | None:
    """The phase histogram's running sums and counts at ``url/metrics``; None when the
    endpoint exposes none (not a pdserve gateway, or one without phases)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    found = False
    for family in text_string_to_metric_families(response.text):
        if family.name != FAMILY:
            continue
        found = True
        for sample in family.samples:
            phase = sample.labels.get("phase", "")
            if sample.name == f"{FAMILY}_sum":
                sums[phase] = sample.value
            elif sample.name == f"{FAMILY}_count":
                counts[phase] = sample.value
    if not found:
        return None
    return {phase: (sums.get(phase, 0.0), count) for phase, count in counts.items()}


def difference(before: PhaseTotals, after: PhaseTotals) -> PhaseTotals:
    """What was observed between two scrapes."""
    return {
        phase: (total - before.get(phase, (0.0, 0.0))[0], count - before.get(phase, (0.0, 0.0))[1])
        for phase, (total, count) in after.items()
    }


def add(totals: list[PhaseTotals]) -> PhaseTotals:
    """Several rounds' differences as one."""
    merged: dict[str, tuple[float, float]] = {}
    for round_totals in totals:
        for phase, (total, count) in round_totals.items():
            old_total, old_count = merged.get(phase, (0.0, 0.0))
            merged[phase] = (old_total + total, old_count + count)
    return merged


def summarize_phases(
    totals: PhaseTotals, results: list[RequestResult], baseline: list[RequestResult] | None = None
) -> dict[str, Any]:
    """Mean milliseconds per phase, their sum, and the measured TTFT (pdserve's and, when
    given, the baseline's) for the JSON results and `print_breakdown`."""
    means = {
        phase: round(1000 * total / count, 3)
        for phase, (total, count) in totals.items()
        if count > 0
    }
    summary: dict[str, Any] = {
        "phases_mean_ms": {phase: means.get(phase) for phase in (*TTFT_PHASES, AFTER_FIRST_TOKEN)},
        "num_samples": {phase: int(count) for phase, (_, count) in totals.items()},
        "sum_of_ttft_phases_ms": round(sum(means.get(phase, 0.0) for phase in TTFT_PHASES), 3),
        **_ttft("ttft", results),
    }
    if summary["ttft_mean_ms"] is not None:
        # NOTE: what the gateway cannot see: the client, and HTTP before the request is parsed.
        rest = summary["ttft_mean_ms"] - summary["sum_of_ttft_phases_ms"]
        summary["rest_of_ttft_ms"] = round(rest, 3)
    if baseline is not None:
        summary |= _ttft("baseline_ttft", baseline)
    return summary


def report(
    rounds: list[PhaseRound],
    baseline: list[list[RequestResult]] | None = None,
    baseline_name: str | None = None,
) -> dict[str, Any]:
    """Prints the breakdown over all `rounds` (next to the baseline's TTFT) and returns it, with
    each round's own, for the JSON results."""
    results = [r for one in rounds for r in one.results]
    flat_baseline = None if baseline is None else [r for one in baseline for r in one]
    summary = summarize_phases(add([one.totals for one in rounds]), results, flat_baseline)
    print_breakdown(summary, baseline_name)
    summary["rounds"] = [summarize_phases(one.totals, one.results) for one in rounds]
    return summary


def print_breakdown(summary: dict[str, Any], baseline_name: str | None = None) -> None:
    """The breakdown as a table: pdserve's mean per phase, next to the baseline's TTFT."""
    columns = ["pdserve", "of TTFT", *([baseline_name] if baseline_name else [])]
    print(f"\n{'TTFT breakdown (mean ms)':<34}" + "".join(f"{c:>12}" for c in columns))
    total = summary["sum_of_ttft_phases_ms"]
    measured = summary["ttft_mean_ms"]
    rows: list[tuple[str, float | None]] = [
        *((phase, summary["phases_mean_ms"][phase]) for phase in TTFT_PHASES),
        ("sum of the phases", total),
        ("rest (client, HTTP parsing)", summary.get("rest_of_ttft_ms")),
    ]
    for title, value in rows:
        share = f"{100 * value / measured:.1f}%" if value is not None and measured else "-"
        print(f"  {title:<32}{_fmt(value):>12}{share:>12}")
    for title, key in (
        ("measured TTFT mean", "ttft_mean_ms"),
        ("measured TTFT p50", "ttft_p50_ms"),
    ):
        row = f"  {title:<32}{_fmt(summary[key]):>12}{'':>12}"
        if baseline_name:
            row += f"{_fmt(summary['baseline_' + key]):>12}"
        print(row)
    tail = summary["phases_mean_ms"][AFTER_FIRST_TOKEN]
    print(f"  {'transfer_tail (delays 2nd token)':<32}{_fmt(tail):>12}")


def _ttft(prefix: str, results: list[RequestResult]) -> dict[str, float | None]:
    values = [r.ttft_s for r in results if r.is_ok]
    if not values:
        return {f"{prefix}_mean_ms": None, f"{prefix}_p50_ms": None}
    return {
        f"{prefix}_mean_ms": round(1000 * statistics.fmean(values), 3),
        f"{prefix}_p50_ms": round(1000 * percentile(values, 50), 3),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"
