"""A simulated wide-area link between origin and edge, and edgecache measured across it.

edgecache exists for the cross-region case: origin data far away behind a
slow, lossy path, GPUs near an edge node. This package builds such a path on
one machine (:mod:`bench.wan.link`), shows that it behaves as specified
(:mod:`bench.wan.probe`), and measures staging, epochs and staging beside
training across it (:mod:`bench.wan.workload`). ``python -m bench.wan``.
"""
