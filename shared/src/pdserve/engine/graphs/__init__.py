"""Decode steps replayed from captured graphs (CUDA graphs on a GPU).

`buckets` plans the batch sizes captured, `buffers` holds the static inputs a captured step
reads, `capture` records and replays a step (a `torch.cuda.CUDAGraph`, or a stand-in that
calls the step again on CPU), and `runner.GraphRunner` ties them to the model: a decode-only
batch that fits a bucket is copied into the buffers, padded, and replayed.
"""
