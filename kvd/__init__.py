"""kvd: a host KV-cache daemon that stores shared prompt prefixes once.

Importing this package pulls in nothing heavy: the daemon's modules are imported
explicitly (``kvd.server``, ``kvd.cli``), and clients import only ``kvd.wire``.
"""
