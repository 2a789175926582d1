"""Building a loaded model: weights from any format onto the device, and the
forward path that will run it (``loader.load_model``)."""
