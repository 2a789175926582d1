"""The worker side of KV connectors (``tokenloom.kv_transfer`` holds the scheduler side).

The model runner builds one with ``factory.create_worker_connector`` and calls
it around each step (``base.KVConnectorWorker``): loads start before the
forward pass, saves are queued after it, and what finished is reported in the
step's ``ModelRunnerOutput.kv_connector_output``. ``block_io`` copies whole
blocks between the KV cache tensors and flat bytes; ``spec`` fingerprints the
KV cache so no connector ever loads KV computed for another model or dtype.
"""
