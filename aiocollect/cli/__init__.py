"""The ``aiocollect`` command line: ``run``, ``store``, ``info`` and ``bench``."""
