"""The policy being served: the ``Policy`` interface, the sampler, observation checks, the reference model.

A model plugs in by import path (``--policy pkg.module:Class``); what it needs
from the server is exported here, so a plugin imports from one place::

    from policy_operator.runtime.policy import Branch, InvalidObservation, Policy, Sample
"""

from policy_operator.runtime.errors import InvalidObservation
from policy_operator.runtime.policy.interface import Branch, Policy, Preprocessor, Sample, collate

__all__ = ["Branch", "InvalidObservation", "Policy", "Preprocessor", "Sample", "collate"]
