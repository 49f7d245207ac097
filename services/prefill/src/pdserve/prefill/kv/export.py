"""Which KV blocks a prefill pass exports, and their pieces per layer.

A pass exports, for each request that ships KV, the logical blocks it completes
(`plan_export`): the blocks the pass fills completely, plus the partial last block once the
prompt is complete; a block a later chunk of the same prompt still writes to waits for that
chunk, so no block is sent twice. A request's first export starts at its first unsent block,
which includes blocks found in the prefix cache or loaded from the KV store. As each layer
finishes, `export_layer` cuts that layer of every planned range into pieces for the requests'
senders; a sliding-window layer's range starts no earlier than the lease's
``num_window_skipped_blocks`` (the decode keeps only those layers' window).
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.common.generation import num_blocks_for
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import layer_pieces
from pdserve.prefill.request import Request


class Export(NamedTuple):
    """The logical blocks [first_block, end_block) of one request that a pass completes."""

    request: Request
    first_block: int
    end_block: int


def plan_export(chunk: ScheduledChunk[Request], block_size: int) -> Export | None:
    """The blocks `chunk`'s pass completes for its request's sender; None when the request
    ships no KV or the pass completes no unsent block."""
    request = chunk.request
    if not request.is_sending_kv:
        return None
    end_token = chunk.num_computed_tokens + chunk.num_new_tokens
    # NOTE: only blocks this pass fills completely, plus the partial last block once the
    # prompt is complete; a block a later chunk still writes to waits for that chunk.
    if chunk.completes_prompt:
        end_block = num_blocks_for(end_token, block_size)
    else:
        end_block = end_token // block_size
    if end_block <= request.num_sent_blocks:
        return None
    return Export(request, request.num_sent_blocks, end_block)


def export_layer(
    kv_cache: KVCache,
    exports: list[Export],
    layer_index: int,
    blocks_per_piece: int,
    window_layers: frozenset[int] = frozenset(),
) -> None:
    """Hands layer `layer_index` of every export to its request's sink, in pieces of at most
    `blocks_per_piece` blocks (on the engine thread, from ``on_layer_done``); `window_layers`
    are the model's sliding-window layers."""
    for request, first_block, end_block in exports:
        if layer_index in window_layers and request.lease is not None:
            first_block = max(first_block, request.lease.num_window_skipped_blocks)
            if first_block >= end_block:
                continue
        for piece in layer_pieces(
            kv_cache,
            layer_index,
            request.block_ids,
            blocks_per_piece,
            first_block,
            end_block,
        ):
            request.sink(piece)
