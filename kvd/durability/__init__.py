"""What survives a crash: checksums sealed off the event loop (integrity.py) and the warm
restart that re-attaches and verifies a dead daemon's extents (recovery.py). The records
both read and write are the page core's (kvd/core/records.py); the crash points tests kill
the daemon at are kvd/crashpoints.py.
"""
