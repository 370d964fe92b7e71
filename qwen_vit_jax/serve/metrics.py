"""The service's Prometheus metrics (`prometheus_client`), in a registry of the app's own: two apps
in one process (tests, a Ray replica per device) never share counters.

    qvj_requests_total{status}             requests answered, by HTTP status
    qvj_items_total{status}                items answered: ok, cached, and the failures' labels
                                           (statuses.py): bad_input, too_large, unsupported, busy,
                                           unavailable (a dead worker), timeout, cancelled, error
    qvj_queue_items                        items admitted and not yet answered (what --max-queue bounds)
    qvj_waiting_items{stage}               of those, waiting for a worker (prepare) or their batch (batch)
    qvj_batch_items / qvj_batch_fill       items per device call; its patches / the patch budget
    qvj_batch_padding                      padded rows / bucket rows of each device call
    qvj_cache_total{result}                memory / disk / inflight hits, and misses
    qvj_cache_bytes                        bytes of embeddings the in-memory LRU holds (<= --cache-mb)
    qvj_cache_errors_total{op}             disk cache reads / writes that failed (a full or read-only disk):
                                           the item is answered all the same
    qvj_stage_seconds{stage}               queue (admitted -> prepared or batched), prepare (in a worker),
                                           device (the encode call), respond (encoding and sending the answer)
    qvj_request_seconds                    whole requests
    qvj_workers_replaced_total             preparation workers replaced after dying
    qvj_connections                        open connections (what --max-connections bounds)
    qvj_connections_closed_total{reason}   connections the server closed, by deadline: header_timeout,
                                           body_timeout, drain_timeout (a body still arriving after its
                                           answer), send_timeout (an answer left unread), keep_alive; by
                                           bound: head_too_large (431), evicted (no request head when a
                                           request needed the slot), over_limit (every slot held a request:
                                           503), peer_bodies (the address's body slots taken: 429)
    qvj_items_resized_total                images resized down to --max-item-patches
    qvj_programs / qvj_compile_seconds     programs compiled (or loaded from the persistent compilation
                                           cache) so far, and the seconds that took: a new batch shape
                                           costs one such program, once
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The metrics of one app (see the module docstring); `render()` is the /metrics body."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qvj_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.items = Counter("qvj_items", "Items answered, by outcome", ["status"], registry=r)
        self.queue = Gauge("qvj_queue_items", "Items admitted and not yet answered", registry=r)
        self.waiting = Gauge(
            "qvj_waiting_items", "Items waiting for a worker or for their batch", ["stage"], registry=r
        )
        self.batch_items = Histogram("qvj_batch_items", "Items per device call", buckets=COUNT_BUCKETS, registry=r)
        self.batch_fill = Histogram(
            "qvj_batch_fill", "Patches of a device call / the patch budget", buckets=FRACTION_BUCKETS, registry=r
        )
        self.batch_padding = Histogram(
            "qvj_batch_padding", "Padded rows / bucket rows of a device call", buckets=FRACTION_BUCKETS, registry=r
        )
        self.cache = Counter(
            "qvj_cache", "Cache lookups: memory, disk, inflight hits and misses", ["result"], registry=r
        )
        self.stage = Histogram(
            "qvj_stage_seconds", "Seconds per stage of an item", ["stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "qvj_request_seconds", "Seconds per request", buckets=LATENCY_BUCKETS, registry=r
        )
        self.cache_errors = Counter(
            "qvj_cache_errors", "Disk cache reads or writes that failed (answered all the same)", ["op"], registry=r
        )
        self.cache_bytes = Gauge("qvj_cache_bytes", "Bytes of embeddings in the in-memory LRU", registry=r)
        self.programs = Gauge("qvj_programs", "Programs compiled or loaded so far", registry=r)
        self.compile_seconds = Gauge("qvj_compile_seconds", "Seconds spent compiling or loading programs", registry=r)
        self.replaced = Counter("qvj_workers_replaced", "Preparation workers replaced after dying", registry=r)
        self.connections = Gauge("qvj_connections", "Open connections", registry=r)
        self.connections_closed = Counter(
            "qvj_connections_closed", "Connections closed by the server, by reason", ["reason"], registry=r
        )
        self.resized = Counter("qvj_items_resized", "Images resized down to the per-item bound", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
