"""Parts of ``python -m bench.schedule``: the scenario, the origin and edge sides, the report.

* :mod:`.scenario`: the regions, dataset versions and ~20 jobs of the simulated day;
* :mod:`.origin`: runs on the origin side of the link; writes, uploads and publishes the data;
* :mod:`.edge`: runs on the edge side; the nodes, the calibration, the controller run and
  the naive run, with what was observed meanwhile;
* :mod:`.report`: the figures and targets from the raw observations, and their tables;
* :mod:`.chart`: the timeline chart (planned vs actual ready per job).
"""
