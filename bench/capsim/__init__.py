"""The capacity simulator behind ``python -m bench.capacity``: many edge clients and GPU verifier replicas on a
virtual clock (``events``), replaying recorded acceptance (``traces``) through the product's own decision code: the
edge's round loop and draft policy (``edge_client``), the verifier's batching rule and cross-request budget
(``replica``, which mirrors ``cloud/scheduler.py``), and the baselines served without an edge drafter
(``server_clients``)."""
