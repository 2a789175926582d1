"""Data parallel serving: N engine cores, each with its own scheduler and KV cache,
behind one front end.

``router`` picks a core per request (prefix-aware from the cores' KV cache
events, round robin, or least load); ``client`` presents the N cores to
``AsyncLLM`` as one core client; ``ray_backend`` runs the cores as Ray actors.
"""
