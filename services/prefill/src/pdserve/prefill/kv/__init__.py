"""The prefill's sending side of KV: which blocks a pass exports and their pieces (`export`),
one request's sender (`sender`) and its traced transfer (`transfers`), the channels it may use
(`transports`) and one module per channel: gRPC SyncCache and the in-place base (`channels`),
shared memory (`shm`), CUDA IPC (`cuda_ipc`), NIXL (`nixl`), TCP (`tcp`).
"""
