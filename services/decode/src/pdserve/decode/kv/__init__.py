"""The decode's receiving side of KV: one transfer into a lease whatever carries it
(`transfers`), its verification into the leased blocks (`receiver`) and the TCP data port
(`tcp_server`).
"""
