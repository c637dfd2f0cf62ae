"""allhere's numbers on vLLM's ``/metrics`` (Prometheus text), beside vLLM's own ``vllm:`` metrics.

vLLM's API server answers ``/metrics``; the model, which counts the routing, runs in vLLM's engine process.
prometheus_client's multiprocess mode joins the two, as vLLM itself uses it when it runs several API servers:
where ``PROMETHEUS_MULTIPROC_DIR`` names a folder, every process writes its metrics to files there and the API
server's registry (vLLM's ``get_prometheus_registry``, a ``MultiProcessCollector``) reads them all. ``allhere
serve`` gives each server a new, empty folder and removes it when the server stops. Without that variable nothing
is exported here (metrics in the engine's own registry would reach no endpoint); the statistics file and
``routing_stats`` stay.

Gauges (``mostrecent``: the engine's last value), written with the statistics file (``model.StatsFile``), so
they carry the numbers of ``allhere serve``'s routing line:

- ``allhere_mechanism_info{mechanism="aha"}`` 1: the served folder's mechanism;
- ``allhere_kv_cache_bytes_per_token``, ``allhere_kv_cache_bytes_per_request``,
  ``allhere_kv_cache_unconverted_bytes_per_token``: ``model.kv_bytes``;
- AHA only: ``allhere_mu_f`` (the share of (token, head) pairs on full attention since the server was ready, NaN
  before its first token), ``allhere_layer_mu_f{layer="i"}`` (the same per AHA layer) and ``allhere_routed_tokens``
  (the tokens counted; vLLM's warm-up passes are not).
"""

from __future__ import annotations

import math
import os  # prometheus_client is imported where a gauge is made: allhere serve's launcher reads this module too

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: the folder every process writes its metrics to


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()):
    from prometheus_client import Gauge

    # registry=None: in multiprocess mode the values live in the folder's files whatever registers them, and a
    # second engine in one process (tests) must not collide in prometheus_client's default registry
    return Gauge(name, doc, labels, registry=None, multiprocess_mode="mostrecent")


class Metrics:
    """The gauges of one served model: ``kind`` its mechanism, ``kv`` its caches' bytes (``kv_bytes``), ``routed``
    whether it has AHA layers (mu_f)."""

    def __init__(self, kind: str, kv: dict | None, routed: bool) -> None:
        _gauge("allhere_mechanism_info", "The served model's allhere mechanism", ("mechanism",)).labels(kind).set(1)
        if kv:
            for key, name, doc in (
                    ("per_token", "bytes_per_token", "KV cache bytes per token of context (allhere serve's KV line)"),
                    ("per_request", "bytes_per_request",
                     "KV cache bytes per request: the keys of windows and sinks, DAR's near window included"),
                    ("plain_per_token", "unconverted_bytes_per_token",
                     "KV cache bytes per token of context of the unconverted model")):
                _gauge(f"allhere_kv_cache_{name}", doc).set(kv[key])
        self.routed = routed
        if routed:
            self.mu_f = _gauge("allhere_mu_f", "AHA: share of (token, head) pairs on full attention since the server "
                                               "was ready (NaN before its first token)")
            self.layer_mu_f = _gauge("allhere_layer_mu_f", "AHA: share of (token, head) pairs on full attention "
                                                           "in one layer since the server was ready", ("layer",))
            self.tokens = _gauge("allhere_routed_tokens", "AHA: tokens whose routing is counted since the server was "
                                                          "ready")
            self.mu_f.set(math.nan)
            self.tokens.set(0)

    def publish(self, stats: dict) -> None:
        """Set the routing gauges from ``model.routing_stats``."""
        if not self.routed:
            return
        mu_f = stats.get("mu_f")
        self.mu_f.set(math.nan if mu_f is None else mu_f)
        self.tokens.set(stats.get("tokens", 0))
        for layer, (g, n) in stats["layers"].items():
            self.layer_mu_f.labels(str(layer)).set(g / n if n else math.nan)


def metrics(kind: str, kv: dict | None, routed: bool) -> Metrics | None:
    """The model's gauges where this process writes to a multiprocess folder (``allhere serve``), else None."""
    if not os.environ.get(MULTIPROC_ENV):
        return None
    return Metrics(kind, kv, routed)
