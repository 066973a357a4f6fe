"""Placements of the worker roles: in-process (local) or as Ray actors on resource pools (ray)."""
