"""What survives a crash: per-page metadata records in shared memory (meta.py), checksums
sealed off the event loop (integrity.py), the warm restart that re-attaches and verifies a
dead daemon's extents (recovery.py), and the crash points tests kill the daemon at
(crashpoints.py).
"""
