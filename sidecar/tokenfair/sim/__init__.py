"""The offline side: replay traces through policies on a virtual clock, and read the results.

:mod:`~tokenfair.sim.simulator` (the replay; its traces and records are read and written by
:mod:`tokenfair.records`, the format shared with the sidecar's writer and the load generator),
:mod:`~tokenfair.sim.scenarios` and :mod:`~tokenfair.sim.tracegen` (workloads),
:mod:`~tokenfair.sim.report` and :mod:`~tokenfair.sim.fairness` (summaries and fair shares),
:mod:`~tokenfair.sim.calibrate` (fitting the cost model) and :mod:`~tokenfair.sim.plot`.
Never imports the server (tests/test_layout.py).
"""
