"""API discovery and OpenAPI documents, written the way kube-apiserver writes them.

kopf builds its resource table from /api, /apis and each group-version's
APIResourceList (subresources included: a "status" entry makes it patch
``/status``); kubectl maps kinds and short names from the same documents and
checks /openapi/v3 to decide how to validate.  kmock 0.8 writes the core
groupVersion as "/v1" (kubectl rejects it), picks preferred versions at random
and repeats shortNames on subresource entries ("ps" becomes ambiguous).
All functions read kmock's ``ResourcesArray`` (``ApiServer.resources``).
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import kmock

SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0+kube-emulator",
    "gitCommit": "0" * 40,
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_SUBRESOURCE_VERBS = {
    "status": ["get", "patch", "update"],
    "scale": ["get", "patch", "update"],
    "binding": ["create"],
    "eviction": ["create"],
    "token": ["create"],
    "exec": ["create", "get"],
    "attach": ["create", "get"],
    "portforward": ["create", "get"],
    "proxy": ["create", "delete", "get", "patch", "update"],
}


def version_priority(version: str) -> tuple[Any, ...]:
    """Kubernetes' version ordering as a sort key: GA, then beta, then alpha; higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, 0, 0, version)
    return ({None: 0, "beta": 1, "alpha": 2}[m[2]], -int(m[1]), -int(m[3] or 0), version)


def served_groups(resources: kmock.ResourcesArray) -> dict[str, list[str]]:
    """Named groups (not core) and their versions, preferred first."""
    versions: dict[str, set[str]] = {}
    for res in resources:
        if res.group:
            versions.setdefault(res.group, set()).add(res.version)
    return {g: sorted(vs, key=version_priority) for g, vs in versions.items()}


def group_doc(group: str, versions: list[str]) -> dict[str, Any]:
    docs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": docs, "preferredVersion": docs[0]}


def root_paths(resources: kmock.ResourcesArray) -> list[str]:
    groups = served_groups(resources)
    return sorted(
        {"/api", "/api/v1", "/apis", "/version", "/openapi/v3", "/healthz", "/livez", "/readyz"}
        | {f"/apis/{g}" for g in groups}
        | {f"/apis/{g}/{v}" for g, vs in groups.items() for v in vs}
    )


def resource_list(resources: kmock.ResourcesArray, group: str, version: str) -> dict[str, Any] | None:
    """The APIResourceList of a group-version; None when nothing is served there."""
    entries: list[dict[str, Any]] = []
    for res, info in sorted(resources.items(), key=lambda item: item[0].plural):
        if (res.group, res.version) != (group, version):
            continue
        entry = {
            "name": res.plural,
            "singularName": info.singular or "",
            "namespaced": bool(info.namespaced),
            "kind": info.kind,
            "verbs": sorted(info.verbs),
        }
        if info.shortnames:
            entry["shortNames"] = sorted(info.shortnames)
        if info.categories:
            entry["categories"] = sorted(info.categories)
        entries.append(entry)
        for sub in sorted(info.subresources):  # no shortNames here: kubectl would find "ps" ambiguous
            sub_entry = {
                "name": f"{res.plural}/{sub}",
                "singularName": "",
                "namespaced": bool(info.namespaced),
                "kind": "Scale" if sub == "scale" else info.kind,
                "verbs": _SUBRESOURCE_VERBS.get(sub, ["get"]),
            }
            if sub == "scale":
                sub_entry.update(group="autoscaling", version="v1")
            entries.append(sub_entry)
    if not entries and group:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": entries,
    }


def openapi_index(resources: kmock.ResourcesArray) -> dict[str, Any]:
    """/openapi/v3: one entry per group-version; the hash changes with its resources, refreshing kubectl's cache."""
    paths = {}
    for group, versions in {"": ["v1"], **served_groups(resources)}.items():
        for version in versions:
            key = f"apis/{group}/{version}" if group else "api/v1"
            served = sorted(
                (r.plural, str(i.kind), bool(i.namespaced))
                for r, i in resources.items()
                if (r.group, r.version) == (group, version)
            )
            paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={zlib.crc32(json.dumps(served).encode()):08x}"}
    return {"paths": paths}


def openapi_doc(resources: kmock.ResourcesArray, group: str, version: str) -> dict[str, Any] | None:
    """Per-group-version OpenAPI v3 stubs: PATCH paths declaring ``fieldValidation``, and no schemas.

    That is all kubectl's query-param verifier looks for: it then validates on the server
    (``?fieldValidation=Strict``) instead of downloading /openapi/v2 schemas to validate itself,
    so kubectl needs no ``--validate=false``.  Without schemas, kubectl's strategic merge for
    built-ins falls back to its compiled-in types.
    """
    paths: dict[str, Any] = {}
    prefix = f"/apis/{group}/{version}" if group else "/api/v1"
    for res, info in resources.items():
        if (res.group, res.version) == (group, version):
            scope = "/namespaces/{namespace}" if info.namespaced else ""
            paths[f"{prefix}{scope}/{res.plural}/{{name}}"] = {
                "patch": {
                    "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": info.kind},
                    "parameters": [
                        {"name": p, "in": "query", "schema": {"type": "string"}} for p in ("fieldValidation", "fieldManager")
                    ],
                    "responses": {"200": {"description": "OK"}},
                }
            }
    if not paths:
        return None
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes emulator", "version": SERVER_VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": {}},
    }
