"""A scraped Prometheus exposition, and the math `pagedserve top` does on it.

`histogram_quantile` follows Prometheus's function of that name: find the bucket the rank
falls in and interpolate linearly between its bounds (the first bucket starts at 0); a rank
in the +Inf bucket answers the largest finite bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]


@dataclass
class Scrape:
    """Every sample of one /metrics answer, by sample name (`x_total`, `x_bucket`, ...)."""

    time: float  # monotonic seconds when the answer arrived
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, time: float) -> Scrape:
        scrape = cls(time)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                scrape.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return scrape

    def series(self, name: str, /, **match: str) -> list[tuple[Labels, float]]:
        """The samples of `name` whose labels include `match`."""
        return [(lab, v) for lab, v in self.samples.get(name, [])
                if all(lab.get(k) == want for k, want in match.items())]

    def value(self, name: str, /, **match: str) -> float | None:
        """The sum of the matching samples, or None when there is none."""
        found = self.series(name, **match)
        return sum(v for _, v in found) if found else None

    def buckets(self, name: str, /, **match: str) -> list[tuple[float, float]]:
        """`name`_bucket as sorted (upper bound, cumulative count), summed over other labels."""
        sums: dict[float, float] = {}
        for lab, v in self.series(name + "_bucket", **match):
            le = float(lab["le"])
            sums[le] = sums.get(le, 0.0) + v
        return sorted(sums.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile (0..1) of a histogram's cumulative buckets; NaN when it has no data."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or not 0 <= q <= 1:
        return math.nan
    total = buckets[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[b]
    if b == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if b == 0 else buckets[b - 1]
    in_bucket = count - below
    return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket else 1.0)


def rate(prev: float | None, cur: float | None, seconds: float) -> float | None:
    """Per-second increase of a counter between two scrapes; a reset counts from zero."""
    if prev is None or cur is None or seconds <= 0:
        return None
    delta = cur - prev if cur >= prev else cur
    return delta / seconds
