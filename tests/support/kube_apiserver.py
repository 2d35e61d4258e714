"""kube-apiserver object semantics on top of kmock's ``KubernetesEmulator``.

kmock 0.8 stores what clients send and streams watch events, but treats
objects as plain JSON dicts (the measured gaps are listed in docs/testing.md).
``ApiServer`` keeps kmock's machinery -- the reaction DSL (a test can still
inject ``kube.api['get /api/v1/pods'] << 500``), the object store with its
history (``kube.api.objects``), the bundled list of built-in resources, the
``Status`` error rendering -- and replaces the object semantics with the
apiserver's: server-filled metadata, a global resourceVersion, patches by
Content-Type, status/scale subresources, selectors, finalizers, garbage
collection, CRD registration, tables and resumable watches.

kmock's docstring invites subclassing for "special" field treatment; the
subclass overrides ``_handle`` (to skip kmock's plain-dict bookkeeping, done
before reactions run) and ``__call__`` (kmock's path parser fails on
``/api/v1/namespaces``), and serves everything from one low-priority reaction.
It runs on one event loop (``kube_emulator.KubeEmulator`` owns it); every
mutation is synchronous between awaits, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import datetime
import json
import random
import re
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal.rendering import StreamingError  # kmock 0.8 does not re-export it; RawHandler.__call__ unwraps it

from . import kube_crds as crds
from . import kube_discovery as discovery
from . import kube_patches as patches
from . import kube_protobuf
from . import kube_schema
from .kube_selectors import SelectorError, fields_match, label_selector_to_string, labels_match, metadata_problems
from .kube_selectors import parse_field_selector, parse_label_selector
from .kube_tables import AGE_COLUMN, jsonpath_values, table

Key = tuple[kmock.resource, "str | None", str]

CORE_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PODS = kmock.resource("", "v1", "pods")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
FOREGROUND = "foregroundDeletion"

# Groups in kmock's bundled (K3s) list that are CRDs or aggregated/virtual APIs elsewhere: not served here.
_UNSERVED_GROUPS = {"metrics.k8s.io", "gateway.networking.k8s.io", "authentication.k8s.io", "authorization.k8s.io"}
_UNSERVED = {("", "bindings")}
_SERVED_SUBRESOURCES = {"status", "scale", "binding"}
_SYSTEM_METADATA = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
_BUILTIN_COLUMNS = {
    ("", "pods"): [{"name": "Status", "type": "string", "jsonPath": ".status.phase"}, AGE_COLUMN],
    ("", "namespaces"): [{"name": "Status", "type": "string", "jsonPath": ".status.phase"}, AGE_COLUMN],
    ("", "events"): [
        {"name": "Type", "type": "string", "jsonPath": ".type"},
        {"name": "Reason", "type": "string", "jsonPath": ".reason"},
        {"name": "Object", "type": "string", "jsonPath": ".involvedObject.name"},
        {"name": "Message", "type": "string", "jsonPath": ".message"},
        AGE_COLUMN,
    ],
}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class ApiPath:
    """A request path in kube-apiserver's grammar: /api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]] (and /apis/G/V/...)."""

    group: str
    version: str
    plural: str | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:  # how error messages name a resource: "pods", "policyservers.policyoperator.io"
        return f"{self.plural}.{self.group}" if self.group else str(self.plural)


def parse_api_path(path: str) -> ApiPath | None:
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    # /api/v1/namespaces/NAME/status and /finalize are the Namespace's own subresources, not a namespace prefix.
    if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and group == "" and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    return ApiPath(
        group, version, rest[0] if rest else None, namespace, rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None
    )


@dataclass(frozen=True)
class Change:
    rv: int
    key: Key
    type: str  # ADDED / MODIFIED / DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


def _error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {"source": "kube-emulator"})


def _not_found(t: ApiPath, name: str | None) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{t.qualified} "{name}" not found', name=name, group=t.group, kind=t.plural)


def _invalid(kind: str, name: str | None, causes: list[str]) -> kmock.KubernetesError:
    return _error(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {", ".join(causes)}',
        name=name,
        kind=kind,
        causes=[{"message": c} for c in causes],
    )


def _bad_request(message: str) -> kmock.KubernetesError:
    return _error(400, "BadRequest", message)


_NO_RESOURCE = "the server could not find the requested resource"
_REASONS = {400: "BadRequest", 409: "Conflict", 415: "UnsupportedMediaType", 422: "Invalid"}


def _now(offset_s: float = 0) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset_s)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name.lower()), "")


def _respond(result: Any, status: int = 200) -> kmock.Response:
    """Always an explicit Response: kmock copies a returned Response's status and headers onto the reaction's
    own (shared) Response, so one 201 would otherwise stick to every later answer of this reaction."""
    if isinstance(result, kmock.Response):
        return result
    return kmock.Response(status=status, headers={"Content-Type": "application/json"}, payload=result)


def _strict(request: kmock.Request) -> bool:
    return request.params.get("fieldValidation") == "Strict"


def _first(obj: Any, path: str | None) -> Any:
    values = jsonpath_values(obj, path) if path else []
    return values[0] if values else None


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[leaf] = value


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """A KubernetesEmulator that behaves like kube-apiserver for kopf, kubectl and the kubernetes client."""

    history_limit: int = 10_000  # watch events kept for resumption by resourceVersion; older ones get 410 Gone

    _rv: int = attrs.field(default=0, init=False)
    _log: list[Change] = attrs.field(factory=list, init=False)
    _floor: int = attrs.field(default=0, init=False)  # watches may resume from any rv >= this
    _tick: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _custom: dict[kmock.resource, crds.CustomKind] = attrs.field(factory=dict, init=False)
    _next_ip: int = attrs.field(default=1, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundled file with a deprecated importlib call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        for res in list(self.resources):
            if res.group in _UNSERVED_GROUPS or (res.group, res.plural) in _UNSERVED:
                del self.resources[res]
        # Below user reactions (priority 0), above kmock's own fallbacks (-inf, 0): tests can still intercept.
        (self.fallback**1) << self._serve
        for name in CORE_NAMESPACES:
            self._create(ApiPath("", "v1", "namespaces"), self.resources[NAMESPACES], NAMESPACES, {"metadata": {"name": name}})

    def close(self) -> None:
        """End all watch streams (they would otherwise keep the HTTP server from shutting down)."""
        self._closing = True
        self._tick.set()

    @property
    def resource_version(self) -> int:
        return self._rv

    # --- kmock integration ----------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # RawHandler.__call__, but with kube-apiserver's path grammar: kmock 0.8's parser raises on a path
        # ending in /namespaces (500 for GET /api/v1/namespaces) before any reaction can run.
        raw_response = None
        try:
            request = await self._parse(raw_request)
            self._requests.append(request)
            try:
                return await self._handle(request)
            except StreamingError as exc:
                raw_response = exc.args[0]
                raise (exc.__cause__ or exc) from None
        except Exception as exc:
            if not self._errors:
                raise
            self._errors[-1].append(exc)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(exc)
            await self._stream_error(exc, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _parse(self, raw: aiohttp.web.BaseRequest) -> kmock.Request:
        body = await raw.read()
        try:
            if "protobuf" in raw.headers.get("Content-Type", ""):  # kubectl's typed generators (create namespace, ...)
                data = kube_protobuf.decode(body)
            else:
                data = json.loads(body) if body else None
        except ValueError:
            data = None
        t = parse_api_path(raw.path)
        return kmock.Request(
            id=len(self._requests),
            raw_request=raw,
            url=raw.url,
            method=raw.method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            body=body,
            text=body.decode("utf-8", "replace"),
            data=data,
            action=self._action(raw.method, t, raw.query.get("watch")),
            resource=kmock.resource(t.group, t.version, t.plural) if t and t.plural else None,
            namespace=t.namespace if t else None,
            name=t.name if t else None,
            subresource=t.subresource if t else None,
        )

    @staticmethod
    def _action(method: str, t: ApiPath | None, watch: str | None) -> kmock.action | None:
        if t is None or t.plural is None:
            return None
        if method == "GET":
            return kmock.action.WATCH if watch in ("true", "1") else kmock.action.LIST if t.name is None else kmock.action.FETCH
        if method == "POST" and t.name is None:
            return kmock.action.CREATE
        if method in ("PATCH", "PUT") and t.name is not None:
            return kmock.action.UPDATE
        return kmock.action.DELETE if method == "DELETE" else None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: it applies creations/patches/deletions as plain dict merges
        # before any reaction runs. Here the state changes in self._serve, with the apiserver's rules.
        return await super(kmock.KubernetesEmulator, self)._handle(request)

    async def _serve(self, request: kmock.Request) -> Any:
        method = request.method.value
        path = "/" + request.url.path.strip("/")
        if method == "GET" and path in ("/healthz", "/livez", "/readyz"):
            return kmock.Response(status=200, headers={"Content-Type": "text/plain"}, payload=b"ok")
        if method == "GET":
            found = self._serve_discovery(path, request)
            if found is not None:
                return _respond(found)
        t = parse_api_path(path)
        if t is None or t.plural is None:
            raise NotImplementedError  # not an API path: kmock's own fallback answers 404
        result = self._serve_resource(method, t, request)
        if method != "GET":
            self._collect_garbage()
        return _respond(result)

    # --- discovery --------------------------------------------------------------------------

    def _serve_discovery(self, path: str, request: kmock.Request) -> dict[str, Any] | None:
        if path == "/":
            return {"paths": discovery.root_paths(self.resources)}
        if path == "/version":
            return discovery.SERVER_VERSION
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{request.url.host}:{request.url.port}"}
                ],
            }
        groups = discovery.served_groups(self.resources)
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [discovery.group_doc(g, groups[g]) for g in sorted(groups)],
            }
        if path == "/openapi/v3":
            return discovery.openapi_index(self.resources)
        found: dict[str, Any] | None
        if m := re.fullmatch(r"/openapi/v3/api/(v1)|/openapi/v3/apis/([^/]+)/([^/]+)", path):
            found = discovery.openapi_doc(self.resources, *((m[2], m[3]) if m[2] else ("", m[1])))
        elif path.startswith("/openapi/"):
            raise _error(404, "NotFound", "the emulator serves OpenAPI v3 path stubs only (no schemas, no v2)")
        elif m := re.fullmatch(r"/apis/([^/]+)", path):
            found = (
                {"kind": "APIGroup", "apiVersion": "v1", **discovery.group_doc(m[1], groups[m[1]])} if m[1] in groups else None
            )
        elif m := re.fullmatch(r"/api/(v1)|/apis/([^/]+)/([^/]+)", path):
            found = discovery.resource_list(self.resources, *((m[2], m[3]) if m[2] else ("", m[1])))
        else:
            return None
        if found is None:
            raise _error(404, "NotFound", _NO_RESOURCE)
        return found

    # --- resource requests --------------------------------------------------------------------

    def _serve_resource(self, method: str, t: ApiPath, request: kmock.Request) -> Any:
        res = kmock.resource(t.group, t.version, t.plural)
        if res not in self.resources:
            raise _error(
                404,
                "NotFound",
                f"{_NO_RESOURCE} ({t.qualified} is not served: a CRD not applied yet, or an API the emulator leaves out)",
            )
        info = self.resources[res]
        if (t.namespace is not None and not info.namespaced) or (
            info.namespaced and t.namespace is None and (t.name or method == "POST")
        ):
            raise _error(404, "NotFound", f"{_NO_RESOURCE} ({t.qualified} is {'' if info.namespaced else 'not '}namespaced)")
        if t.subresource is not None and (t.subresource not in info.subresources or t.subresource not in _SERVED_SUBRESOURCES):
            served = t.subresource in info.subresources
            raise _error(
                404,
                "NotFound",
                f"{_NO_RESOURCE} ({t.plural}/{t.subresource}"
                + (" is not emulated; add a kmock reaction for it)" if served else " does not exist)"),
            )
        if "protobuf" in _header(request, "Content-Type") and request.data is None:
            raise _error(
                415,
                "UnsupportedMediaType",
                "the emulator decodes protobuf bodies of Namespace, ConfigMap, Secret and "
                "ServiceAccount only; send JSON (kubectl apply -f / create -f)",
            )
        if request.params.get("dryRun"):
            raise _bad_request("dryRun is not supported by the Kubernetes emulator")
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                return self._watch(t, info, res, request)
            if t.name is None:
                return self._list(t, info, res, request)
            obj = self._require(t, info, res)
            return self._scale_view(res, obj) if t.subresource == "scale" else self._presenter(request, res)(obj)
        if method == "POST" and t.name is None:
            return _respond(status=201, result=self._create(t, info, res, request.data, strict=_strict(request)))
        if method == "POST" and t.subresource == "binding":
            return _respond(status=201, result=self._bind(t, info, res, request.data))
        if method == "DELETE" and t.name is None:
            return self._delete_collection(t, info, res, request)
        if method == "PUT" and t.name is not None:
            return self._replace(t, info, res, request.data, strict=_strict(request))
        if method == "PATCH" and t.name is not None:
            return self._patch(t, info, res, request)
        if method == "DELETE" and t.name is not None:
            return self._delete(t, info, res, request)
        raise _error(
            405, "MethodNotAllowed", f"the server does not allow this method on the requested resource ({method} {t.qualified})"
        )

    def _key(self, info: kmock.ResourceInfo, res: kmock.resource, namespace: str | None, name: str) -> Key:
        return (res, namespace if info.namespaced else None, name)

    def _stored(self, key: Key) -> kmock.Object | None:
        return self.objects[key] if key in self.objects else None

    def _peek(self, key: Key) -> dict[str, Any] | None:
        obj = self._stored(key)
        return None if obj is None or obj.deleted else obj.raw

    def _require(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource) -> dict[str, Any]:
        obj = self._peek(self._key(info, res, t.namespace, str(t.name)))
        if obj is None:
            raise _not_found(t, t.name)
        return copy.deepcopy(obj)

    def _live(self, res: kmock.resource | None = None) -> list[tuple[Key, dict[str, Any]]]:
        return [(key, obj.raw) for key, obj in self.objects.items() if not obj.deleted and (res is None or key[0] == res)]

    def _commit(self, key: Key, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        """The one place state changes: a new global resourceVersion, the store, the watch log, CRD registration."""
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        stored = self._stored(key)
        if kind == "DELETED":
            if stored is not None:
                stored.delete()
        elif stored is None:
            self.objects[key] = new
        else:
            stored.history.append(new)
        self._log.append(Change(self._rv, key, kind, old, new))
        if len(self._log) > 2 * self.history_limit:
            drop = len(self._log) - self.history_limit
            self._floor = self._log[drop - 1].rv
            del self._log[:drop]
        self._tick.set()
        self._tick = asyncio.Event()
        if key[0] == CRDS:  # (re)register the kinds a CRD serves as soon as it is stored; drop them once it is gone
            for res in [r for r, custom in self._custom.items() if custom.crd == key[2]]:
                del self._custom[res]
                del self.resources[res]
            if kind != "DELETED":
                for res, info, custom in crds.served_kinds(new):
                    self.resources[res] = info
                    self._custom[res] = custom
        return new

    # --- create ----------------------------------------------------------------------------

    def _create(
        self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, body: Any, *, strict: bool = False
    ) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise _bad_request("the request body must be a JSON object with an object in metadata")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if obj.get("apiVersion") not in (None, "", t.group_version):
            raise _bad_request(
                f"the API version in the data ({obj['apiVersion']}) does not match the expected API version ({t.group_version})"
            )
        if obj.get("kind") not in (None, "", info.kind):
            raise _bad_request(f"the kind in the data ({obj['kind']}) does not match the expected kind ({info.kind})")
        obj["apiVersion"], obj["kind"] = t.group_version, info.kind
        if info.namespaced:
            if meta.get("namespace") not in (None, "", t.namespace):
                raise _bad_request("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = t.namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _invalid(info.kind, "", ["metadata.name: Required value: name or generateName is required"])
            meta["name"] = meta["generateName"] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        name = meta["name"]
        self._check_name(t, info, name)
        key = self._key(info, res, t.namespace, name)
        if self._peek(key) is not None:
            raise _error(409, "AlreadyExists", f'{t.qualified} "{name}" already exists', name=name, group=t.group, kind=t.plural)
        if info.namespaced:
            namespace = self._peek((NAMESPACES, None, str(t.namespace)))
            if namespace is None:
                raise _error(404, "NotFound", f'namespaces "{t.namespace}" not found', name=t.namespace, kind="namespaces")
            if namespace["metadata"].get("deletionTimestamp"):
                raise _error(
                    403,
                    "Forbidden",
                    f'{t.qualified} "{name}" is forbidden: unable to create new content in '
                    f"namespace {t.namespace} because it is being terminated",
                )
        for field in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "managedFields",
            "selfLink",
        ):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if "status" in info.subresources:
            obj.pop("status", None)  # status is written through /status only, as on a real server
        self._defaults_on_create(res, obj)
        self._conform(t, info, res, obj, None, strict=strict)
        return self._commit(key, "ADDED", None, obj)

    def _check_name(self, t: ApiPath, info: kmock.ResourceInfo, name: str) -> None:
        label_named = not t.group and t.plural in ("namespaces", "services")
        if t.group == "rbac.authorization.k8s.io":  # RBAC names are path segments (":" is common there)
            ok = name not in (".", "..") and not re.search(r"[/%]", name)
        elif label_named:
            ok = len(name) <= 63 and bool(_DNS_LABEL.match(name)) and (t.plural != "services" or name[0].isalpha())
        else:
            ok = len(name) <= 253 and bool(_DNS_SUBDOMAIN.match(name))
        if not ok:
            rule = (
                "an RFC 1123 label (at most 63 lowercase alphanumerics or '-')"
                if label_named
                else "a lowercase RFC 1123 subdomain (lowercase alphanumerics, '-' or '.', at most 253)"
            )
            raise _invalid(info.kind, name, [f'metadata.name: Invalid value: "{name}": must be {rule}'])

    def _defaults_on_create(self, res: kmock.resource, obj: dict[str, Any]) -> None:
        """The few fields kube-apiserver itself fills on create and that clients read back."""
        meta = obj["metadata"]
        if res == PODS:
            obj["status"] = {"phase": "Pending"}
        elif res == NAMESPACES:
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
            obj["status"] = {"phase": "Active"}
        elif (res.group, res.plural) == ("", "secrets"):
            obj.setdefault("type", "Opaque")
        elif (res.group, res.plural) == ("", "services") and isinstance(obj.get("spec"), dict):
            spec = obj["spec"]
            spec.setdefault("type", "ClusterIP")
            if spec["type"] != "ExternalName" and not spec.get("clusterIP"):
                spec["clusterIP"] = f"10.96.{self._next_ip // 250}.{self._next_ip % 250 + 1}"
                self._next_ip += 1
            if spec.get("clusterIP"):
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
        elif (
            (res.group, res.plural) == ("batch", "jobs")
            and isinstance(obj.get("spec"), dict)
            and not obj["spec"].get("manualSelector")
        ):
            uid, name = meta["uid"], meta["name"]
            obj["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            template = obj["spec"].setdefault("template", {})
            if isinstance(template, dict):
                template.setdefault("metadata", {}).setdefault("labels", {}).update(
                    {
                        "batch.kubernetes.io/controller-uid": uid,
                        "batch.kubernetes.io/job-name": name,
                        "controller-uid": uid,
                        "job-name": name,
                    }
                )

    def _conform(
        self,
        t: ApiPath,
        info: kmock.ResourceInfo,
        res: kmock.resource,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
        *,
        strict: bool = False,
    ) -> None:
        """Validate metadata, then prune/default/validate custom resources by their CRD schema (422 on failure).

        ``strict`` is ``?fieldValidation=Strict`` (kubectl's default): pruned fields are then a 400, as on a
        real server; otherwise they are dropped silently.  Built-in kinds are not checked for unknown fields.
        """
        meta, name = obj["metadata"], obj["metadata"].get("name")
        causes = metadata_problems(meta)
        for n, ref in enumerate(meta.get("ownerReferences") or []):
            missing = [f for f in ("apiVersion", "kind", "name", "uid") if not (isinstance(ref, dict) and ref.get(f))]
            causes += [f"metadata.ownerReferences[{n}].{f}: Required value" for f in missing]
        if old is not None and old["metadata"].get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
            if added:
                causes.append(
                    "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, "
                    f"found new finalizers {sorted(added)}"
                )
        if res == CRDS and not causes:
            causes += crds.crd_problems(obj)
            if not causes:
                obj["status"] = crds.crd_status(obj, old)
        custom = self._custom.get(res)
        if custom is not None and custom.schema and not causes:
            dropped = kube_schema.prune(obj, custom.schema)
            if strict and dropped:
                raise _bad_request(
                    f'{info.kind} in version "{t.version}" cannot be handled as a {info.kind}: strict decoding error: '
                    + ", ".join(f'unknown field "{path}"' for path in dropped)
                )
            kube_schema.apply_defaults(obj, custom.schema)
            causes += kube_schema.validate(obj, custom.schema)
        if causes:
            raise _invalid(f"{info.kind}.{t.group}" if t.group else info.kind, name, causes)

    # --- update: PUT, PATCH, subresources -------------------------------------------------------

    def _replace(
        self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, body: Any, *, strict: bool = False
    ) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise _bad_request("the request body must be a JSON object with an object in metadata")
        old = self._require(t, info, res)
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, t.name):
            raise _bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({t.name})")
        rv = meta.get("resourceVersion")
        if rv is None and res in self._custom and t.subresource is None:
            raise _invalid(
                f"{info.kind}.{t.group}", t.name, ["metadata.resourceVersion: Invalid value: 0: must be specified for an update"]
            )
        if rv is not None and rv != old["metadata"]["resourceVersion"]:
            raise self._conflict(t)
        if t.subresource == "scale":
            return self._write_scale(t, info, res, old, copy.deepcopy(body))
        return self._update(t, info, res, old, copy.deepcopy(body), strict=strict)

    def _patch(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, request: kmock.Request) -> Any:
        content_type = _header(request, "Content-Type").split(";")[0].strip().lower()
        try:
            if content_type not in patches.PATCH_TYPES:
                raise patches.PatchError(
                    f"the patch content type {content_type!r} is not supported; use one of {', '.join(patches.PATCH_TYPES)}", 415
                )
            body = patches.decode_patch(content_type, request.body)
            key = self._key(info, res, t.namespace, str(t.name))
            if self._peek(key) is None and content_type == patches.APPLY and t.subresource is None and isinstance(body, dict):
                body.setdefault("metadata", {}).setdefault("name", t.name)  # server-side apply creates what is missing
                return _respond(status=201, result=self._create(t, info, res, body, strict=_strict(request)))
            old = self._require(t, info, res)
            base = self._scale_view(res, old) if t.subresource == "scale" else old
            patched = patches.apply_patch(content_type, base, body, custom=res in self._custom)
        except patches.PatchError as exc:
            raise _error(exc.status, _REASONS.get(exc.status, "Invalid"), str(exc)) from exc
        if not isinstance(patched, dict) or not isinstance(patched.get("metadata", {}), dict):
            raise _error(422, "Invalid", "the patched object must be a JSON object with an object in metadata")
        rv = (patched.get("metadata") or {}).get("resourceVersion")
        if rv is not None and rv != old["metadata"]["resourceVersion"]:
            raise self._conflict(t)  # a patch that carries a resourceVersion is a precondition, as on a real server
        if t.subresource == "scale":
            return self._write_scale(t, info, res, old, patched)
        return self._update(t, info, res, old, patched, strict=_strict(request))

    def _conflict(self, t: ApiPath) -> kmock.KubernetesError:
        return _error(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {t.qualified} "{t.name}": the object has been modified; '
            "please apply your changes to the latest version and try again",
            name=t.name,
            group=t.group,
            kind=t.plural,
        )

    def _update(
        self,
        t: ApiPath,
        info: kmock.ResourceInfo,
        res: kmock.resource,
        old: dict[str, Any],
        candidate: dict[str, Any],
        *,
        strict: bool = False,
    ) -> dict[str, Any]:
        """Turn a client's full new state into the stored one: status split, system metadata, generation, no-op detection."""
        status_sub = "status" in info.subresources
        if t.subresource == "status":  # the status strategy: everything from the old object but .status
            new = copy.deepcopy(old)
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
        else:
            new = candidate
            new.setdefault("metadata", {})
            if status_sub:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        meta, old_meta = new["metadata"], old["metadata"]
        for field in _SYSTEM_METADATA:
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        meta.pop("managedFields", None)
        self._conform(t, info, res, new, old, strict=strict)
        ignored = ("metadata", "status") if status_sub else ("metadata",)
        if {k: v for k, v in new.items() if k not in ignored} != {k: v for k, v in old.items() if k not in ignored}:
            meta["generation"] = int(old_meta.get("generation") or 0) + 1
        if new == old:
            return old  # a no-op write: no new resourceVersion, no watch event
        return self._save(self._key(info, res, t.namespace, str(t.name)), old, new)

    def _save(self, key: Key, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        meta = new["metadata"]
        releasing = meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds")
        if releasing and key[0] not in (NAMESPACES, CRDS):  # those two wait for their content: see _collect_garbage
            return self._commit(key, "DELETED", old, new)
        return self._commit(key, "MODIFIED", old, new)

    def _scale_spec(self, res: kmock.resource) -> crds.ScaleSpec | None:
        if res in self._custom:
            return self._custom[res].scale
        return crds.BUILTIN_SCALE

    def _scale_view(self, res: kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        spec = self._scale_spec(res)
        assert spec is not None  # only resources whose discovery lists "scale" get here
        meta = obj["metadata"]
        selector = (
            _first(obj, spec.selector_path)
            if spec.selector_path
            else label_selector_to_string((obj.get("spec") or {}).get("selector"))
        )
        status: dict[str, Any] = {"replicas": int(_first(obj, spec.status_path) or 0)}
        if selector:
            status["selector"] = str(selector)
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
            "spec": {"replicas": int(_first(obj, spec.spec_path) or 0)},
            "status": status,
        }

    def _write_scale(
        self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, old: dict[str, Any], scale: dict[str, Any]
    ) -> dict[str, Any]:
        spec = self._scale_spec(res)
        assert spec is not None
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _invalid(
                "Scale.autoscaling", t.name, [f"spec.replicas: Invalid value: {json.dumps(replicas)}: must be an integer >= 0"]
            )
        new = copy.deepcopy(old)
        _set_path(new, spec.spec_path, replicas)
        main = ApiPath(t.group, t.version, t.plural, t.namespace, t.name)
        return self._scale_view(res, self._update(main, info, res, old, new))

    def _bind(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, body: Any) -> dict[str, Any]:
        """POST pods/NAME/binding, which a scheduler (or the local node) uses to place a pod on a node."""
        node = ((body or {}).get("target") or {}).get("name") if isinstance(body, dict) else None
        if not node:
            raise _invalid("Binding", t.name, ["target.name: Required value"])
        old = self._require(t, info, res)
        if (old.get("spec") or {}).get("nodeName"):
            raise _error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on pods/binding "{t.name}": '
                f'pod {t.name} is already assigned to node "{old["spec"]["nodeName"]}"',
            )
        new = copy.deepcopy(old)
        new.setdefault("spec", {})["nodeName"] = node
        conditions = [c for c in new.setdefault("status", {}).get("conditions", []) if c.get("type") != "PodScheduled"]
        new["status"]["conditions"] = conditions + [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]
        self._save(self._key(info, res, t.namespace, str(t.name)), old, new)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    # --- delete and garbage collection --------------------------------------------------------

    def _delete(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, request: kmock.Request) -> dict[str, Any]:
        old = self._require(t, info, res)
        policy, grace, preconditions = self._delete_options(request)
        meta = old["metadata"]
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != meta.get(field):
                raise _error(
                    409,
                    "Conflict",
                    f"Precondition failed: {field} in precondition: {preconditions[field]}, "
                    f"{field} in object meta: {meta.get(field)}",
                )
        return self._delete_object(self._key(info, res, t.namespace, str(t.name)), old, policy, grace)

    def _delete_collection(
        self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, request: kmock.Request
    ) -> dict[str, Any]:
        policy, grace, _ = self._delete_options(request)
        victims = self._select(t, res, request)
        items = [
            self._delete_object(
                self._key(info, res, o["metadata"].get("namespace"), o["metadata"]["name"]), copy.deepcopy(o), policy, grace
            )
            for o in victims
        ]
        return {
            "kind": f"{info.kind}List",
            "apiVersion": t.group_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    @staticmethod
    def _delete_options(request: kmock.Request) -> tuple[str, int | None, dict[str, Any]]:
        options = request.data if isinstance(request.data, dict) else {}
        params = request.params
        policy = options.get("propagationPolicy") or params.get("propagationPolicy") or "Background"
        if options.get("orphanDependents") is True or params.get("orphanDependents") == "true":
            policy = "Orphan"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise _bad_request(f"propagationPolicy {policy!r} is not one of Background, Foreground, Orphan")
        grace = options.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
        try:
            grace = None if grace is None else int(grace)
        except ValueError:
            raise _bad_request(f"gracePeriodSeconds must be an integer, got {grace!r}") from None
        return policy, grace, options.get("preconditions") or {}

    def _delete_object(
        self, key: Key, old: dict[str, Any], policy: str = "Background", grace: int | None = None
    ) -> dict[str, Any]:
        """Delete now, or mark for deletion (deletionTimestamp) while finalizers, a kubelet or content hold it."""
        res, meta = key[0], old["metadata"]
        if meta.get("deletionTimestamp"):
            if res == PODS and grace == 0 and meta.get("deletionGracePeriodSeconds"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionGracePeriodSeconds"] = 0  # the kubelet's final delete
                return self._save(key, old, new)
            return old
        new = copy.deepcopy(old)
        new_meta = new["metadata"]
        if policy == "Orphan":
            self._orphan(meta["uid"])
        elif policy == "Foreground" and self._dependents(meta["uid"]) and FOREGROUND not in (meta.get("finalizers") or []):
            new_meta["finalizers"] = [*(meta.get("finalizers") or []), FOREGROUND]
        if res == PODS and (old.get("spec") or {}).get("nodeName"):
            period = grace if grace is not None else int((old.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
            if period > 0:  # a pod on a node is gone only once its kubelet confirms (DELETE with gracePeriodSeconds=0)
                new_meta.update(deletionTimestamp=_now(period), deletionGracePeriodSeconds=period)
                return self._commit(key, "MODIFIED", old, new)
        if new_meta.get("finalizers") or res in (NAMESPACES, CRDS):
            new_meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            if res == NAMESPACES:
                new.setdefault("status", {})["phase"] = "Terminating"
            return self._commit(key, "MODIFIED", old, new)
        return self._commit(key, "DELETED", old, new)

    def _dependents(self, uid: str) -> list[tuple[Key, dict[str, Any]]]:
        return [(k, o) for k, o in self._live() if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]

    def _orphan(self, uid: str) -> None:
        for key, obj in self._dependents(uid):
            new = copy.deepcopy(obj)
            new["metadata"]["ownerReferences"] = [r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid]
            self._commit(key, "MODIFIED", obj, new)

    def _content(self, key: Key) -> list[tuple[Key, dict[str, Any]]] | None:
        """What a deleted Namespace or CRD must see gone before it goes (None for other kinds)."""
        if key[0] == NAMESPACES:
            return [(k, o) for k, o in self._live() if k[1] == key[2] and k[0] != NAMESPACES]
        if key[0] == CRDS:
            served = {res for res, custom in self._custom.items() if custom.crd == key[2]}
            return [(k, o) for k, o in self._live() if k[0] in served]
        return None

    def _collect_garbage(self) -> None:
        """The garbage collector, namespace and CRD-cleanup controllers, run to a fixed point after each write."""
        for _ in range(100_000):  # each step deletes or releases something; the bound only guards against a bug
            if not self._collect_step():
                return
        raise RuntimeError("garbage collection did not settle")

    def _collect_step(self) -> bool:
        live = self._live()
        uids = {o["metadata"].get("uid") for _, o in live}
        for key, obj in live:
            meta = obj["metadata"]
            refs = meta.get("ownerReferences") or []
            if refs and not meta.get("deletionTimestamp") and not any(r.get("uid") in uids for r in refs):
                self._delete_object(key, copy.deepcopy(obj))  # all owners are gone
                return True
            if not meta.get("deletionTimestamp"):
                continue
            finalizers = meta.get("finalizers") or []
            if FOREGROUND in finalizers:
                dependents = self._dependents(meta["uid"])
                pending = [(k, o) for k, o in dependents if not o["metadata"].get("deletionTimestamp")]
                for k, o in pending:
                    self._delete_object(k, copy.deepcopy(o))
                if not dependents:
                    new = copy.deepcopy(obj)
                    new["metadata"]["finalizers"] = [f for f in finalizers if f != FOREGROUND]
                    self._save(key, obj, new)
                if pending or not dependents:
                    return True
            content = self._content(key)
            if content is not None:
                pending = [(k, o) for k, o in content if not o["metadata"].get("deletionTimestamp")]
                for k, o in pending:
                    self._delete_object(k, copy.deepcopy(o))
                if pending:
                    return True
                if not content and not finalizers:
                    self._commit(key, "DELETED", obj, copy.deepcopy(obj))
                    return True
        return False

    # --- list and watch ---------------------------------------------------------------------

    def _select(self, t: ApiPath, res: kmock.resource, request: kmock.Request) -> list[dict[str, Any]]:
        try:
            labels = parse_label_selector(request.params.get("labelSelector"))
            fields = parse_field_selector(request.params.get("fieldSelector"))
        except SelectorError as exc:
            raise _bad_request(str(exc)) from exc
        objs = [
            o
            for k, o in self._live(res)
            if (t.namespace is None or k[1] == t.namespace)
            and (t.name is None or k[2] == t.name)
            and labels_match(labels, o)
            and fields_match(fields, o)
        ]
        return sorted(objs, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _list(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, request: kmock.Request) -> dict[str, Any]:
        objs = self._select(t, res, request)
        try:
            limit = int(request.params.get("limit") or 0)
            start = (
                int(json.loads(base64.urlsafe_b64decode(request.params["continue"]))["start"])
                if request.params.get("continue")
                else 0
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad_request(f"invalid limit or continue token: {exc}") from exc
        page = objs[start : start + limit] if limit > 0 else objs[start:]
        meta: dict[str, Any] = {"resourceVersion": str(self._rv)}
        if limit > 0 and start + limit < len(objs):
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"start": start + limit}).encode()).decode()
            meta["remainingItemCount"] = len(objs) - start - limit
        if "as=Table" in _header(request, "Accept"):
            return {
                **table(page, self._columns(res), str(self._rv), request.params.get("includeObject", "Metadata")),
                "metadata": meta,
            }
        return {"kind": f"{info.kind}List", "apiVersion": t.group_version, "metadata": meta, "items": page}

    def _columns(self, res: kmock.resource) -> list[dict[str, Any]]:
        if res in self._custom:
            return self._custom[res].columns
        return _BUILTIN_COLUMNS.get((res.group, res.plural), [])

    def _presenter(self, request: kmock.Request, res: kmock.resource) -> Callable[[dict[str, Any]], dict[str, Any]]:
        if "as=Table" not in _header(request, "Accept"):
            return lambda obj: obj
        columns, include = self._columns(res), request.params.get("includeObject", "Metadata")
        return lambda obj: table([obj], columns, obj["metadata"].get("resourceVersion", ""), include)

    def _watch(self, t: ApiPath, info: kmock.ResourceInfo, res: kmock.resource, request: kmock.Request) -> kmock.Response:
        params = request.params
        try:
            labels = parse_label_selector(params.get("labelSelector"))
            fields = parse_field_selector(params.get("fieldSelector"))
        except SelectorError as exc:
            raise _bad_request(str(exc)) from exc
        try:
            since = int(params["resourceVersion"]) if params.get("resourceVersion") not in (None, "", "0") else None
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        except ValueError as exc:
            raise _bad_request(f"invalid resourceVersion or timeoutSeconds: {exc}") from exc

        def matches(obj: dict[str, Any] | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            return (
                (t.namespace is None or meta.get("namespace") == t.namespace)
                and (t.name is None or meta["name"] == t.name)
                and labels_match(labels, obj)
                and fields_match(fields, obj)
            )

        bookmark = (
            {"kind": info.kind, "apiVersion": t.group_version, "metadata": {"annotations": {"k8s.io/initial-events-end": "true"}}}
            if params.get("sendInitialEvents") == "true"
            else None
        )
        stream = self._watch_stream(res, matches, since, timeout, self._presenter(request, res), bookmark)
        return kmock.Response(status=200, headers={"Content-Type": "application/json"}, payload=stream)

    async def _watch_stream(
        self,
        res: kmock.resource,
        matches: Callable[[dict[str, Any] | None], bool],
        since: int | None,
        timeout: float | None,
        present: Callable[[dict[str, Any]], dict[str, Any]],
        bookmark: dict[str, Any] | None,
    ) -> AsyncIterator[Any]:
        yield b""  # send the headers now: clients wait for them even when nothing happens
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if since is None:  # no resourceVersion: the current state as ADDED events, then what follows
            position = self._rv
            initial = [o for _, o in sorted(self._live(res), key=lambda item: (item[0][1] or "", item[0][2])) if matches(o)]
            for obj in initial:
                yield {"type": "ADDED", "object": present(obj)}
            if bookmark is not None:
                bookmark["metadata"]["resourceVersion"] = str(position)
                yield {"type": "BOOKMARK", "object": bookmark}
        elif since < self._floor:
            yield _expired(f"too old resource version: {since} ({self._floor})")
            return
        else:
            position = since
        while not self._closing:
            if position < self._floor:  # fell behind by more than history_limit events while streaming
                yield _expired(f"too old resource version: {position}")
                return
            tick = self._tick
            changes = self._log[bisect.bisect_right(self._log, position, key=lambda c: c.rv) :]
            for change in changes:
                position = change.rv
                event = self._watch_event(change, res, matches)
                if event is not None:
                    yield {"type": event[0], "object": present(event[1])}
            if changes:
                continue
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(tick.wait(), remaining)
            except TimeoutError:
                return

    @staticmethod
    def _watch_event(
        change: Change, res: kmock.resource, matches: Callable[[dict[str, Any] | None], bool]
    ) -> tuple[str, dict[str, Any]] | None:
        """The event a filtered watch sees: objects entering/leaving a selector arrive as ADDED/DELETED."""
        if change.key[0] != res:
            return None
        was, now = matches(change.old), matches(change.new)
        if change.type == "DELETED":
            return ("DELETED", change.new) if was or now else None
        if now:
            return ("MODIFIED" if was else "ADDED", change.new)
        return ("DELETED", change.new) if was else None


def _expired(message: str) -> dict[str, Any]:
    """The 410 Gone watch event a kube-apiserver sends when a resourceVersion fell out of its history."""
    return {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                        "reason": "Expired", "code": 410, "message": message}}
