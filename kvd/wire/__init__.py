"""The wire contract shared by the daemon and its clients.

Generated protobuf/gRPC stubs (from ``protos/kvd.proto``), the page byte layout, the
token codec, the page key functions, the socket paths, the limits and the errors both
sides name. Nothing here imports the daemon or torch (the codec imports numpy), so
engine processes can import it without pulling in the daemon.
"""
