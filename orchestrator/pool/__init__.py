"""The Ray-managed verifier pool (``ray_pool``) and session placement on its replicas (``placement``)."""
