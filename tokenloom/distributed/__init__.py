"""How a model is split over tensor-parallel ranks, and how the ranks talk.

``shard`` decides which heads, MLP columns and vocabulary rows each rank
holds and slices checkpoint tensors to them; ``parallel_state`` and
``communication`` wrap ``torch.distributed``; ``parallel_layers`` turns a
loaded model into its rank's share. The processes that run the ranks are
``tokenloom.executor``'s.
"""
