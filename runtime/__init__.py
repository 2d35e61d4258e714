"""The runtime: the torchrun program that serves a policy, in the order a request meets it.

``serving/`` (rank 0: WebSocket + HTTP, wire format, ingress, router, metrics,
request errors) -> ``parallel/`` (process groups, the rank-0 <-> driver <->
cfg-peer dispatch protocol, heartbeats) -> ``policy/`` (the Policy interface,
the sampler, observation checks, the reference model).  ``checkpoint/`` is
torch-free: the format, the fetch Job's download and the init container's
verify.  ``worker.py`` is the torchrun program, ``serve_cli.py`` launches it;
``client.py``, ``probe.py`` and ``demo.py`` talk to a server like a robot does.
"""
