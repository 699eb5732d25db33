"""The shared core: what both the edge and the cloud need, and nothing that depends on either.

Imports flow one way: ``protos`` <- ``core`` <- ``edge`` / ``cloud`` <- ``orchestrator``. Modules here never import
``edge``, ``cloud`` or ``orchestrator``.
"""
