"""Images in prompts, from the request to the engine core.

``inputs`` holds what crosses into the core and the scheduler (torch-free,
msgspec-serialisable: placeholder ranges, feature specs, their arrays); the
other modules serve the front end: loading images from URLs and files
(``media``), hashing them (``hasher``), running the model's transformers
image processor (``processing``), expanding a prompt's placeholders
(``prompt``). Nothing here imports torch at import time; the image processor
runs where torch may be imported (a helper process when the front end must
stay torch-free). The vision towers themselves are in ``model/vision/``.
"""
