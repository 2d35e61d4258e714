"""PATCH bodies applied the way kube-apiserver applies them, chosen by Content-Type.

kopf sends JSON merge patches and JSON patches that begin with
``test /metadata/resourceVersion``; kubectl sends strategic merge patches for
built-in kinds and merge patches for custom resources; Helm 4 and
``kubectl apply --server-side`` send apply patches.  Plain kmock merges dicts
for all of them.  JSON patches go through the ``jsonpatch`` library; the
strategic merge is an approximation (see ``strategic_merge_patch``).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import yaml

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
PATCH_TYPES = (MERGE, STRATEGIC, JSON_PATCH, APPLY)


class PatchError(ValueError):
    """A patch that cannot be applied; ``status`` is what kube-apiserver answers."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, ``null`` deletes, everything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Strategic merge keys of the built-in types (from the `patchMergeKey` tags of k8s.io/api):
# lists of objects under these field names merge element-wise by that key instead of replacing.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}
# Lists of scalars with `patchStrategy: merge`: the patch's items are added (a set union).
_MERGED_SCALAR_LISTS = {"finalizers"}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch without the OpenAPI schema: known list fields merge by their key.

    Handles ``$patch: replace|delete``, ``$deleteFromPrimitiveList/<field>`` and
    ignores ``$setElementOrder``/``$retainKeys``.  Lists not named in the table
    above replace wholesale, as a merge patch would; ``ports`` merge by
    ``containerPort`` or ``port``, whichever their items carry.
    """
    if not isinstance(patch, dict):
        return _strip_directives(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return _strip_directives({k: v for k, v in patch.items() if k != "$patch"})
    if directive == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in (value or [])]
        elif key.startswith("$"):
            continue
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = value
    return result


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    if field in _MERGED_SCALAR_LISTS and isinstance(current, list):
        return current + [item for item in patch if item not in current]
    merge_key = _MERGE_KEYS.get(field)
    items = [item for item in patch if isinstance(item, dict)]
    if field == "ports" and items:
        merge_key = "containerPort" if all("containerPort" in i for i in items) else "port"
    if not merge_key or not isinstance(current, list) or len(items) != len(patch):
        return [_strip_directives(item) for item in patch if not (isinstance(item, dict) and item.get("$patch") == "delete")]
    if not all(isinstance(c, dict) and merge_key in c for c in current) or not all(merge_key in i for i in items):
        return [_strip_directives(item) for item in patch]
    result = copy.deepcopy(current)
    for item in items:
        index = next((n for n, c in enumerate(result) if c.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return copy.deepcopy(value)


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch; a failed ``test`` op is 422 Invalid, which kopf takes as "retry later"."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", status=400)
    try:
        return jsonpatch.apply_patch(target, operations, in_place=False)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError, IndexError) as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}") from exc


def decode_patch(content_type: str, body: bytes) -> Any:
    """Parse a patch body: JSON for the JSON types, YAML (which includes JSON) for apply patches."""
    try:
        if content_type == APPLY:
            return yaml.safe_load(body.decode("utf-8")) if body else None
        return json.loads(body) if body else None
    except (ValueError, yaml.YAMLError) as exc:
        raise PatchError(f"the patch body is not valid {'YAML' if content_type == APPLY else 'JSON'}: {exc}", status=400) from exc


def apply_patch(content_type: str, target: dict[str, Any], patch: Any, *, custom: bool) -> Any:
    """Apply a decoded patch; ``custom`` resources refuse strategic merge as kube-apiserver does (415)."""
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        raise PatchError(f"a {content_type} patch must be a JSON object", status=400)
    if content_type == MERGE:
        return merge_patch(target, patch)
    if content_type == STRATEGIC:
        if custom:
            raise PatchError("strategic merge patch format is not supported for custom resources; use a merge patch", status=415)
        return strategic_merge_patch(target, patch)
    if content_type == APPLY:  # server-side apply, approximated: no field ownership, no conflicts
        return merge_patch(target, patch) if custom else strategic_merge_patch(target, patch)
    raise PatchError(f"the patch content type {content_type!r} is not supported; use one of {', '.join(PATCH_TYPES)}", status=415)
