"""Probes of a user's attention code: the kernel protocol, the module check, and what both share."""
