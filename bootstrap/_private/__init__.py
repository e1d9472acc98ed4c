"""Internals of the bootstrap package; nothing outside `bootstrap` should import from here."""
