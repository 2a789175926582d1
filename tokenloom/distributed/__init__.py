"""Running one engine core over several processes (tensor parallelism).

``shard`` decides which heads, MLP columns and vocabulary rows each rank
holds and slices checkpoint tensors to them; ``parallel_state`` and
``communication`` wrap ``torch.distributed``; ``parallel_layers`` turns a
loaded model into its rank's share; ``broadcast`` carries each step from the
engine core to the workers; ``worker`` is a rank's process and ``executor``
the engine core's handle on all of them.
"""
