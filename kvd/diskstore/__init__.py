"""The disk tier's storage engine: pages in one preallocated file, with no policy and no
daemon. It imports nothing of kvd but the page records' checksum and types
(kvd/core/records.py, kvd/core/types.py), so a test drives it alone (tests/test_disk_store.py).

``DiskStore`` (store.py) opens the file (recovering every valid page), writes pages from
shared-memory views, reads them back into host pages with their checksums checked, and frees
slots; all transfers on its own worker threads, results as futures (results.py: what each
call answers, and ``StoreCounters``). layout.py fixes the file's format (superblock, chunks
of slots of one size, slot headers), slots.py which slots are free, slot_file.py moves bytes
between the file and buffers (direct I/O where the file system allows it), recovery.py reads
the headers back when the file is opened, crashpoints.py the debug hooks crash tests kill
the process at. Which pages go to disk and which leave it is the disk tier's policy
(kvd/disk/): nothing here decides it.
"""
