"""The wire contract shared by the daemon and its clients.

Generated protobuf/gRPC stubs (from ``protos/kvd.proto``) and the page byte layout.
Nothing here imports the daemon, torch or numpy, so engine processes can import it
without pulling in the daemon.
"""
