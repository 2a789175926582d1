"""KV connectors: KV cache beyond the engine's own memory (vLLM's ``--kv-transfer-config``).

A connector has two sides. The scheduler side (``base.KVConnectorBase``,
torch-free, below ``core`` in the layers) tells the scheduler how many of a
new request's tokens an external store holds, decides what the workers load
and save each step, and may hold a finished request's blocks while they are
sent. The worker side (``tokenloom.worker.kv_connector``) moves the bytes
between the KV cache tensors and the store, off the step's critical path, and
reports what finished and which blocks failed.

Connectors: ``OffloadingConnector`` (``offloading.py``: a persistent disk
tier of full blocks, content-addressed by their chained hash) and
``TcpConnector`` (``tcp.py``: prefill/decode disaggregation, the decode engine
pulls a finished prefill's KV from the prefill engine). ``factory`` builds the
scheduler side named by the configuration. See docs/kv_connectors.md.
"""
