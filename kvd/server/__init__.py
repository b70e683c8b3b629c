"""The daemon's edge: the launcher (daemon.py: server options, health, signals, graceful
stop), the gRPC servicer that only translates (service.py) with its conversions
(messages.py), the offload thread for large requests (offload.py), message-size shapes
(shape.py), the tenant handshake (handshake.py), Prometheus metrics (metrics.py) and the
ZMQ KV-event publisher (event_publisher.py). The garbage collector's policy, which the
page core's extent supply uses too, is kvd/collector.py.
"""
