"""The launcher: what only the ``chorus`` command and the developer tools need. The CLI, the supervisor of
``chorus up`` (processes, restarts), the tables the commands print (``views``: ``chorus up``'s report, ``plot``,
``eval``, ``status``), the embedded nats-server, the live progress and monitor views, deployment helpers (run ids,
health probes), the generated NATS permissions, the install's dependency check and the generated reference docs. It
may import every other room; nothing imports it (services are started as processes, never imported).
"""
