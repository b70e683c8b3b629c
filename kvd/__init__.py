"""kvd: a host KV-cache daemon that stores shared prompt prefixes once.

Importing this package pulls in nothing heavy: the daemon's modules are imported
explicitly (``kvd.server.daemon``, ``kvd.cli``), and clients import only ``kvd.wire``.
"""

__version__ = "0.1.0"  # also the distribution's (pyproject.toml reads it from here)
