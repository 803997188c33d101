"""Chorus services: one package per service, one OS process each. Services never import each other."""
