"""Checkpoint directories: format and manifest, the verified resumable fetch, the completion marker.

torch-free on purpose: the fetch Job, the init container (``policyserver
checkpoint verify``) and the operator image import it without torch.
"""
