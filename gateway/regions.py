"""Regions: where a request comes from, and how far each region is from another.

A request's region is, in order: an explicit region header (`x-edgeserve-region`),
else the edge's country header (`cf-ipcountry`) mapped through `countries`, else
the gateway's own region. Both headers are honoured only when `trust_headers` is
set (off by default; `edgeserve gateway --trust-region-headers`): they must be set by
our own edge, which strips what clients send, never taken from a client as is.
Distances are a table of round-trip latencies in ms (symmetric; a region is 0 from
itself; a pair missing from the table counts as `default_ms`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

__all__ = ["RegionMap", "REGION_HEADER", "COUNTRY_HEADER"]

REGION_HEADER = "x-edgeserve-region"
COUNTRY_HEADER = "cf-ipcountry"


class RegionMap(msgspec.Struct, frozen=True):
    latency_ms: dict[str, dict[str, float]] = {}
    countries: dict[str, str] = {}
    default_ms: float = 300.0
    trust_headers: bool = False  # only behind an edge that sets (and strips) these headers itself

    def distance(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        row = self.latency_ms.get(a, {})
        if b in row:
            return row[b]
        return self.latency_ms.get(b, {}).get(a, self.default_ms)

    def nearest_first(self, origin: str, regions: Iterable[str]) -> list[str]:
        """`regions` ordered by distance from `origin` (ties by name, so the order is stable)."""
        return sorted(set(regions), key=lambda r: (self.distance(origin, r), r))

    def request_region(self, headers: Mapping[str, str], own_region: str) -> tuple[str, str]:
        """(region, where it came from: "header" | "country" | "gateway")."""
        if self.trust_headers:
            explicit = headers.get(REGION_HEADER)
            if explicit:
                return explicit.strip(), "header"
            country = (headers.get(COUNTRY_HEADER) or "").strip().upper()
            if country in self.countries:
                return self.countries[country], "country"
        return own_region, "gateway"
