"""Running one engine core's model over several processes (tensor parallelism).

``multiproc.MultiprocExecutor`` is the engine core's handle on its workers (a
``ModelRunnerProtocol``); ``worker_proc`` is one rank's process, running a
``ModelRunner`` shard; ``broadcast`` carries each step from the core to every
worker; ``messages`` are the typed messages between them. How the model is
split (``distributed``) lives below the runner.
"""
