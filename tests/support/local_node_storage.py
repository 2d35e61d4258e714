"""Volumes for the local node: a StorageClass, an external provisioner, and where a claim lives on disk.

The real PV controller (kube-controller-manager) binds claims to volumes and
never makes a directory; who makes the volume is a *provisioner*.  The node
plays the simplest faithful one, the way ``sig-storage-lib-external-provisioner``
based ones work:

* at start it makes the StorageClass ``local-node`` (``provisioner:
  STORAGE_PROVISIONER``, ``volumeBindingMode: Immediate``, ``reclaimPolicy:
  Delete``), marked the cluster's default, so the API server's
  DefaultStorageClass admission gives it to every claim that names no class
  (the operator's cache claim names none unless ``spec.storage.storageClassName``
  says so);
* the PV controller then annotates such a claim with
  ``volume.kubernetes.io/storage-provisioner: STORAGE_PROVISIONER`` and waits;
  the node creates one PersistentVolume ``pvc-<claim uid>`` for it: a ``local``
  volume (a directory under the node's root, shared by every pod that mounts
  the claim, whatever its access modes) with node affinity to this node,
  pre-bound to the claim through ``claimRef``, annotated
  ``pv.kubernetes.io/provisioned-by``; the PV controller binds the two;
* when the claim is deleted (after PVC protection let it go: no pod uses it),
  the PV controller marks the volume Released and, since it was provisioned
  by an external provisioner, leaves the ``Delete`` reclaim policy to it: the
  node removes the directory and the PersistentVolume.

* when a bound claim of ours asks for more than its volume holds (the API
  server let ``spec.resources.requests.storage`` grow because its class has
  ``allowVolumeExpansion: true``), the node plays the external resizer the
  expand controller waits for ("waiting for an external controller to expand
  this PVC"): it sets the PersistentVolume's capacity, then the claim's
  ``status.capacity``, as ``external-resizer`` does for a volume that needs no
  file-system step (a directory has no size to grow).

``storage_classes`` adds classes of other names served by the same
provisioner (not default): a sample that names ``nfs-client`` gets its class
on this cluster without editing the sample.  Claims of any other class are
left alone (Pending), as a cluster without their provisioner would.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import kubernetes.client

from .local_node_api import Api

log = logging.getLogger("local_node.storage")

STORAGE_CLASS = "local-node"
STORAGE_PROVISIONER = "local-node.tests.policyoperator.io/hostpath"
# well-known names, written by the API server's admission and the PV controller
ANN_DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
ANN_STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
LABEL_HOSTNAME = "kubernetes.io/hostname"


class VolumeError(RuntimeError):
    """A volume that cannot be set up yet (its claim unbound, its Secret or ConfigMap missing)."""


def storage_class(name: str = STORAGE_CLASS, *, default: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": name, "annotations": {ANN_DEFAULT_CLASS: str(default).lower()}},
        "provisioner": STORAGE_PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def volume_for(claim: dict[str, Any], node: str, path: Path) -> dict[str, Any]:
    meta, spec = claim["metadata"], claim.get("spec") or {}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {ANN_PROVISIONED_BY: STORAGE_PROVISIONER}},
        "spec": {
            "capacity": {"storage": ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": spec.get("storageClassName") or STORAGE_CLASS,
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "local": {"path": str(path)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": LABEL_HOSTNAME, "operator": "In", "values": [node]}]}
                    ]
                }
            },
        },
    }


class Provisioner:
    """Provision for pending claims of the class, delete released volumes of ours; ``path()`` for the pods."""

    def __init__(self, api: Api, node: str, root: Path, *, extra_classes: Iterable[str] = ()) -> None:
        self.api, self.node, self.root = api, node, root
        self.extra_classes = list(extra_classes)

    def ensure_storage_class(self) -> None:
        classes = [storage_class()] + [storage_class(name, default=False) for name in self.extra_classes]
        for body in classes:
            with contextlib.suppress(kubernetes.client.ApiException):  # 409: made by an earlier node
                self.api.create("storage.k8s.io/v1", "storageclasses", body)

    def sync(self, claims: Iterable[dict[str, Any]], volumes: Iterable[dict[str, Any]]) -> None:
        existing = {v["metadata"]["name"] for v in volumes}
        for claim in claims:
            meta, spec = claim["metadata"], claim.get("spec") or {}
            if (
                (meta.get("annotations") or {}).get(ANN_STORAGE_PROVISIONER) != STORAGE_PROVISIONER
                or spec.get("volumeName")
                or meta.get("deletionTimestamp")
                or (claim.get("status") or {}).get("phase") != "Pending"
                or f"pvc-{meta['uid']}" in existing
            ):
                continue
            path = self.root / "pv" / f"pvc-{meta['uid']}"
            path.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(kubernetes.client.ApiException):  # 409: created by the previous pass
                self.api.create("v1", "persistentvolumes", volume_for(claim, self.node, path))
                log.info("provisioned %s for %s/%s at %s", f"pvc-{meta['uid']}", meta["namespace"], meta["name"], path)
        by_name = {v["metadata"]["name"]: v for v in volumes}
        for claim in claims:
            self._resize(claim, by_name.get((claim.get("spec") or {}).get("volumeName") or ""))
        for volume in volumes:
            meta, spec = volume["metadata"], volume.get("spec") or {}
            if (
                (meta.get("annotations") or {}).get(ANN_PROVISIONED_BY) != STORAGE_PROVISIONER
                or spec.get("persistentVolumeReclaimPolicy") != "Delete"
                or meta.get("deletionTimestamp")
                or (volume.get("status") or {}).get("phase") not in ("Released", "Failed")
            ):
                continue
            self._delete(volume)

    def _resize(self, claim: dict[str, Any], volume: dict[str, Any] | None) -> None:
        """Grow our volume, then the claim's status, to what the bound claim now requests."""
        from kubernetes.utils import parse_quantity

        if (
            volume is None
            or ((volume["metadata"].get("annotations") or {}).get(ANN_PROVISIONED_BY) != STORAGE_PROVISIONER)
            or (claim.get("status") or {}).get("phase") != "Bound"
        ):
            return
        want = ((claim["spec"].get("resources") or {}).get("requests") or {}).get("storage")
        has = ((volume.get("spec") or {}).get("capacity") or {}).get("storage")
        shown = ((claim.get("status") or {}).get("capacity") or {}).get("storage")
        if want is None or has is None:
            return
        meta = claim["metadata"]
        with contextlib.suppress(kubernetes.client.ApiException):  # 409/404: the next pass retries
            if parse_quantity(want) > parse_quantity(has):
                self.api.patch(
                    "v1", "persistentvolumes", volume["metadata"]["name"], {"spec": {"capacity": {"storage": want}}}
                )
                log.info(
                    "resized %s to %s for %s/%s", volume["metadata"]["name"], want, meta["namespace"], meta["name"]
                )
                has = want
            if shown is None or parse_quantity(shown) < parse_quantity(has):
                self.api.patch_status(
                    "v1",
                    "persistentvolumeclaims",
                    meta["name"],
                    {"capacity": {"storage": has}},
                    meta["namespace"],
                    uid=meta["uid"],
                )

    def _delete(self, volume: dict[str, Any]) -> None:
        path = Path(((volume.get("spec") or {}).get("local") or {}).get("path") or "")
        if path.is_relative_to(self.root / "pv"):  # a volume of an earlier node's root is gone with that root
            shutil.rmtree(path, ignore_errors=True)
        self.api.delete("v1", "persistentvolumes", volume["metadata"]["name"])
        log.info("deleted released volume %s", volume["metadata"]["name"])

    def path(self, namespace: str, claim_name: str) -> Path:
        """The directory behind a bound claim, or the VolumeError the kubelet would report."""
        claim = self.api.get("v1", "persistentvolumeclaims", claim_name, namespace)
        if claim is None:
            raise VolumeError(f'persistentvolumeclaim "{claim_name}" not found')
        volume_name = (claim.get("spec") or {}).get("volumeName")
        if (claim.get("status") or {}).get("phase") != "Bound" or not volume_name:
            raise VolumeError(f'persistentvolumeclaim "{claim_name}" is not bound')
        volume = self.api.get("v1", "persistentvolumes", volume_name)
        spec = (volume or {}).get("spec") or {}
        source = spec.get("local") or spec.get("hostPath")
        if source is None:
            raise VolumeError(
                f"volume {volume_name!r} is neither a local nor a hostPath volume: the local node cannot mount it"
            )
        path = Path(source["path"])
        if not path.is_dir():
            raise VolumeError(
                f'MountVolume.NewMounter initialization failed for volume "{volume_name}": path "{path}" does not exist'
            )
        return path
