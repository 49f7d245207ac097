"""The instances behind the gateway: the registry (and its servicer, the etcd watcher, the
poller of static instances), what each instance is and serves, and the calls to them (the
`Backend` seam and its gRPC clients)."""
