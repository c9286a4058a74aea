"""Prometheus text read back by tests: :func:`scrape` (one sample) and :class:`Scrape` (a parsed
exposition)."""

from __future__ import annotations

from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

INSTANCE = "127.0.0.1:9300"
S = (INSTANCE, "0")  # the stream's (instance, dp_rank) label values


class Scrape:
    """One parsed exposition: ``value(name, **labels)`` and the label names of a family."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.label_names: dict[str, set[frozenset]] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value
                self.label_names.setdefault(s.name, set()).add(frozenset(s.labels))

    def value(self, name: str, **labels: str) -> Optional[float]:
        return self.samples.get((name, frozenset(labels.items())))

    def stream(self, name: str, **labels: str) -> Optional[float]:
        return self.value(name, instance=S[0], dp_rank=S[1], **labels)

    def labels(self, name: str) -> set[frozenset]:
        return self.label_names.get(name, set())


def scrape(client, headers: Optional[dict] = None) -> Scrape:
    response = client.get("/metrics", headers=headers or {})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    return Scrape(response.get_data(as_text=True))
