"""What the test modules share (no test module imports another): the transport axis
(``transports``), rank processes (``procs``), test data and numpy references
(``collectives``, ``algorithms``, ``stress_plan``), a fake peer (``fakepeer``), certificates,
shared-memory leak checks, and the helpers of the store, CLI, bench, elastic and
network-namespace tests. Rank bodies that spawned processes import are in ``targets``."""
