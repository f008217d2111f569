"""``aiocollect bench``: collective latency and bus bandwidth, optionally against gloo and
Open MPI.

Modules:

- :mod:`~aiocollect.bench.spec` — sizes, cases, buffer shapes, bus-bandwidth factors and the
  closed-form correctness checks (pure, no event loop);
- :mod:`~aiocollect.bench.stats` — p50/p99, bus bandwidth and the progress line;
- :mod:`~aiocollect.bench.sweep` — the timing method shared by every backend;
- :mod:`~aiocollect.bench.backends` — aiocollect and torch.distributed/gloo backends;
- :mod:`~aiocollect.bench.worker` — the entry point of one spawned rank process;
- :mod:`~aiocollect.bench.mpi` — the Open MPI baseline: whether it runs here, ``mpirun``'s
  command; :mod:`~aiocollect.bench.mpi_rank` — one rank under ``mpirun`` (mpi4py);
- :mod:`~aiocollect.bench.runner` — spawning rank processes, rounds, cleanup;
- :mod:`~aiocollect.bench.report` — medians across rounds, the table, the JSON document;
- :mod:`~aiocollect.bench.machine` — the machine, its load while the run lasts, strict JSON;
- :mod:`~aiocollect.bench.plot` — bandwidth and latency versus size with matplotlib.
"""
