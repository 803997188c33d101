"""Code that more than one Chorus service or tool needs, in rooms named for what they hold and who needs them.

``kernel`` (every service: messages, subjects, the bus, the service base), ``models`` (networks, tokenizers,
weights and their transport), ``results`` (tracking, plots, exporters), ``rlmath`` (pure RL formulas) and
``launcher`` (the ``chorus`` command). The arrows between them are import-linter contracts in
``pyproject.toml`` (``make lint``); the map is in docs/index.md.
"""
