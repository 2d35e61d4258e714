"""CustomResourceDefinitions: validation, status, and what each served version adds to the API.

When a CRD is stored, kube-apiserver validates it, reports ``Established``,
and starts serving its kinds -- with shortNames, categories, printer columns,
the status/scale subresources and a schema that prunes, defaults and
validates the objects.  Plain kmock stores the CRD as just another object, so
``kubectl apply -f crd.yaml`` followed by ``kubectl apply -f cr.yaml`` fails.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import kmock

from .kube_tables import check_jsonpath

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ScaleSpec:
    spec_path: str  # e.g. ".spec.replicas"
    status_path: str
    selector_path: str | None  # CRDs: a string field; built-ins render .spec.selector


BUILTIN_SCALE = ScaleSpec(".spec.replicas", ".status.replicas", None)


@dataclass(frozen=True)
class CustomKind:
    """What a served CRD version adds beyond kmock's ResourceInfo (which discovery reads)."""

    crd: str
    columns: list[dict[str, Any]]
    scale: ScaleSpec | None
    schema: dict[str, Any] | None


def crd_problems(crd: dict[str, Any]) -> list[str]:
    """Why kube-apiserver would reject this CRD (422 causes); empty when it is acceptable."""
    spec = crd.get("spec") if isinstance(crd.get("spec"), dict) else {}
    names = spec.get("names") if isinstance(spec.get("names"), dict) else {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    causes = [
        f"{path}: Required value"
        for path, value in (("spec.group", group), ("spec.names.plural", plural), ("spec.names.kind", kind))
        if not value
    ]
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(
            f'spec.scope: Unsupported value: {json.dumps(spec.get("scope"))}: supported values: "Cluster", "Namespaced"'
        )
    if group and plural and crd["metadata"]["name"] != f"{plural}.{group}":
        causes.append(f'metadata.name: Invalid value: "{crd["metadata"]["name"]}": must be spec.names.plural+"."+spec.group')
    versions = spec.get("versions") if isinstance(spec.get("versions"), list) else []
    if sum(1 for v in versions if isinstance(v, dict) and v.get("storage") is True) != 1:
        causes.append("spec.versions: Invalid value: must have exactly one version marked as storage version")
    for n, version in enumerate(versions):
        where = f"spec.versions[{n}]"
        if not isinstance(version, dict) or not version.get("name"):
            causes.append(f"{where}.name: Required value")
            continue
        causes += [f"{where}.{f}: Required value" for f in ("served", "storage") if not isinstance(version.get(f), bool)]
        if not isinstance((version.get("schema") or {}).get("openAPIV3Schema"), dict):
            causes.append(f"{where}.schema.openAPIV3Schema: Required value: schemas are required")
        for m, column in enumerate(version.get("additionalPrinterColumns") or []):
            if not column.get("name") or not column.get("jsonPath"):
                causes.append(f"{where}.additionalPrinterColumns[{m}]: Required value: name and jsonPath")
                continue
            if column.get("type") not in ("integer", "number", "string", "boolean", "date"):
                causes.append(f'{where}.additionalPrinterColumns[{m}].type: Unsupported value: {json.dumps(column.get("type"))}')
            try:
                check_jsonpath(column["jsonPath"])
            except ValueError as exc:
                causes.append(f"{where}.additionalPrinterColumns[{m}].jsonPath: Invalid value: {exc}")
        scale = (version.get("subresources") or {}).get("scale")
        if scale is not None:
            for f, prefix in (("specReplicasPath", ".spec."), ("statusReplicasPath", ".status.")):
                if not str(scale.get(f) or "").startswith(prefix):
                    causes.append(
                        f"{where}.subresources.scale.{f}: Invalid value: {json.dumps(scale.get(f))}: "
                        f"should be a json path under {prefix}"
                    )
    return causes


def crd_status(crd: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """The status the apiextensions controllers would write: names accepted, Established, stored versions."""
    names = dict(crd["spec"]["names"])
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    old_status = (old or {}).get("status") or {}
    since = (old_status.get("conditions") or [{}])[0].get("lastTransitionTime") or datetime.datetime.now(
        datetime.timezone.utc
    ).strftime("%Y-%m-%dT%H:%M:%SZ")
    storage = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
    return {
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "reason": "NoConflicts",
                "message": "no conflicts found",
                "lastTransitionTime": since,
            },
            {
                "type": "Established",
                "status": "True",
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
                "lastTransitionTime": since,
            },
        ],
        "acceptedNames": names,
        "storedVersions": sorted(set(old_status.get("storedVersions") or []) | {storage}),
    }


def served_kinds(crd: dict[str, Any]) -> list[tuple[kmock.resource, kmock.ResourceInfo, CustomKind]]:
    """One (resource, discovery info, extras) per served version of a valid CRD."""
    spec, names = crd["spec"], crd["spec"]["names"]
    served = []
    for version in spec["versions"]:
        if not version.get("served"):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        info = kmock.ResourceInfo(
            namespaced=spec["scope"] == "Namespaced",
            kind=names["kind"],
            singular=names.get("singular") or names["kind"].lower(),
            verbs=ALL_VERBS,
            shortnames=names.get("shortNames") or [],
            categories=names.get("categories") or [],
            subresources=[s for s in ("status", "scale") if s in subresources],
        )
        extras = CustomKind(
            crd=crd["metadata"]["name"],
            columns=list(version.get("additionalPrinterColumns") or []),
            scale=(
                ScaleSpec(scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
                if scale
                else None
            ),
            schema=(version.get("schema") or {}).get("openAPIV3Schema"),
        )
        served.append((kmock.resource(spec["group"], version["name"], names["plural"]), info, extras))
    return served
