"""Tensor parallelism: one instance's model split over several ranks (processes).

* `group`: the ranks' process group (gloo on CPU, NCCL on CUDA) and the share of each rank.
* `layers`, `sharding`: the vocabulary-parallel embedding, the local sizes of a rank's share,
  and the cut of each checkpoint tensor at load time (the model code in
  `pdserve.engine.model` and `pdserve.engine.moe` takes the group).
* `shared_cache`: on CPU, one KV cache file of all heads that every rank maps.
* `runner` (rank 0, a drop-in `ModelRunner`), `ranks` (its handle on the others),
  `messages` and `worker` (ranks 1..N-1).
"""
