"""The disk tier's storage engine (issue 30): pages kept in one preallocated file below host RAM.

``DiskStore`` (store.py) is what a tier calls: open (recovering every valid page), write
pages from shared-memory views, read them back into host pages with their checksums
checked, free slots; all transfers on its own worker threads, results as futures.
layout.py fixes the file's format (superblock, chunks of slots of one size, slot headers),
slot_file.py moves bytes between the file and buffers (direct I/O where the file system
allows it), recovery.py reads the headers back when the file is opened, crashpoints.py the
debug hooks crash tests kill the process at. Which pages go to disk and which are evicted
from it is the tier's policy: nothing here decides it.
"""
