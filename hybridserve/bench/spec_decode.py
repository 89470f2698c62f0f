"""Speculative-decoding acceptance over a benchmark run, from the server's Prometheus counters.

Counters are read before and after the run; the difference gives vLLM's figures: the draft acceptance
rate (accepted / draft tokens) and the mean acceptance length (1 + accepted / drafts, tokens per step of
one request). Reads hybridserve's names and vLLM's, so it works against either server.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

_NAMES = {
    "drafts": ("hybridserve_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "draft_tokens": (
        "hybridserve_spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    "accepted": (
        "hybridserve_spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
}


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts, self.draft_tokens - other.draft_tokens, self.accepted - other.accepted
        )

    def summary(self) -> dict[str, float] | None:
        """Acceptance figures, or None when nothing was drafted."""
        if self.draft_tokens <= 0 or self.drafts <= 0:
            return None
        return {
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.draft_tokens,
            "mean_acceptance_length": 1 + self.accepted / self.drafts,
        }


def parse_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition; None if the server exports none of them."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.partition(" ")
        for key, names in _NAMES.items():
            if name in names:
                values[key] = float(value.split()[0])
    return SpecCounters(**values) if values else None


def scrape_counters(base_url: str, api_key: str | None) -> SpecCounters | None:
    """The server's counters now; None when it has no /metrics or exports none of them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    return parse_counters(r.text) if r.status_code == 200 else None
