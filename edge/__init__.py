"""The edge node: settings, node logic, staging gate, gRPC service, metrics, server lifecycle.

``config`` (settings), ``node`` (resolve, fetch, single-flight, stage),
``staging_gate`` (staging's byte rate and slots), ``service`` (gRPC handlers
and status codes, tokens), ``metrics`` (Prometheus) and ``server`` (ports,
health, drain). Preprocessing, the codec and the LMDB store that the node
builds on live in ``edgecache.cache``.
"""
