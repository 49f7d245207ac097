"""The KV transports besides gRPC SyncCache, one module each, for both ends: what a decode
offers (`offer`), the shared-memory segment (`shm`), the TCP data port's framing (`tcp`), the
exported CUDA cache (`cuda_ipc`, its writer `cuda_ipc_window`) and the NIXL agents (`nixl`, its
writer `nixl_window`). How KV is cut into pieces, checksummed, and which blocks of a lease a
writer may touch is `pdserve.kv.transfer`, the same for all of them. The prefill's channels
over them are `pdserve.prefill.kv`; the decode's receiving end is `pdserve.decode.kv`.
"""
