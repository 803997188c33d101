"""Chorus services: one package per service, one OS process each. Services never import each other."""

from shared.kernel.logs import quiet_progress_bars

# Before any service module imports a library that brings tqdm in: its bars would be non-JSON lines in the logs.
quiet_progress_bars()
