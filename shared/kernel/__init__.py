"""The kernel every service imports: the run's config, the message schemas and their codec, subject and stream
names, the NATS bus (connection, streams, KV, credentials), the service base with its lifecycle, logs, events and
metrics, peer probes, sample validation, the run's state on the server and atomic file writes. It imports nothing from the other rooms
of ``shared`` and nothing from ``services``; a module that needs torch, a plot or the ``chorus`` command does not
belong here.
"""
