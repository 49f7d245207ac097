"""KV movement and storage, for both ends: the block codec (`codec`), the data plane's rules
(`transfer`: pieces, checksums, the blocks of a lease a writer may touch), the transports
besides gRPC (`transports`: shared memory, TCP, CUDA IPC, NIXL), the storage tier (`store`:
the interface; `stores`: opening one from a spec; `file_store`, `redis_store`; `offload`: the
writer thread). The prefill keeps its sending side and the decode its receiving side in their
own packages (`pdserve.prefill.kv`, `pdserve.decode.kv`); an instance opens its store and
writer with `pdserve.serving.kv_tier`.
"""
