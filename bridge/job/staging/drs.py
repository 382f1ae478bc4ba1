"""`drs://` inputs (GA4GH Data Repository Service 1.2 and later), resolved where staging runs.

1. The URI names the server and the object id (`bridge.core.drs`; a compact identifier through
   the site's `staging.drs_prefixes`, never a meta-resolver on the network).
2. `GET https://HOST/ga4gh/drs/v1/objects/ID`, with the bearer token the site gives that host
   in `staging.drs_tokens_file` (sent to that host alone: requests drops it on a redirect
   elsewhere). A `202 Accepted` is asked again after its `Retry-After`.
3. A blob: the access methods this node can use, `file` ones first (no network; only inside the
   allowed and shared directories), then in the server's order; a method whose scheme is not
   enabled here (`staging.protocols`) or that is not `available` is passed over. An `access_id`
   without an `access_url` is exchanged at `/objects/ID/access/ACCESS_ID` for a URL and its
   headers. The bytes come through the protocol module of that URL (http, s3, ftp, file); when
   one method fails the next is tried.
4. The bytes are checked against the object's `size` and checksum (sha-256, else md5; an
   object with neither is staged with a note that it was not verified).
5. A bundle (an object with `contents`) becomes a directory: each content under its `name`,
   fetched by its `id` (else its first resolvable `drs_uri`), nested bundles as
   subdirectories; its checksum is checked as the specification computes it, over the
   checksums of its top-level contents.

GA4GH Passports (the POST forms) are not sent: a site gives bearer tokens. DRS is read-only:
outputs cannot go to `drs://`. Nothing here depends on where the stage-in runs, only on the
`StagingContext` it is given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from bridge.core.drs import DrsUriError, objects_url, parse_drs_uri, resolve
from bridge.job.staging import (
    FileKind,
    StagingContext,
    StagingError,
    backend_for,
    can_stage,
    http,
    redact,
    safe_relative,
    scheme_of,
)

#: Checksum types verified, in order of preference: hashlib's name and the spellings servers use.
DIGESTS = (("sha256", ("sha-256", "sha256")), ("md5", ("md5",)))
#: How deep bundles may nest (a bundle that contains itself is refused before).
MAX_DEPTH = 16
#: A `202 Accepted` is asked again this many times, after its Retry-After (at most the cap).
ACCEPTED_TRIES = 10
ACCEPTED_WAIT_CAP = 60.0
#: An access method's `type` -> the scheme of the URL its `/access` call will give.
_TYPE_SCHEMES = {"https": "https", "s3": "s3", "file": "file", "ftp": "ftp"}


def download(url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
    try:
        host, object_id = resolve(parse_drs_uri(url), dict(ctx.options.drs_prefixes))
    except DrsUriError as exc:
        raise StagingError(str(exc)) from None
    with _Client(ctx) as client:
        _Fetch(client, ctx).place(client.object(host, object_id), dest, kind)


def upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
    raise StagingError(f"{redact(url)}: DRS is read-only; outputs cannot go to drs:// URIs")


def ensure_directory(url: str, ctx: StagingContext) -> None:
    raise StagingError(f"{redact(url)}: DRS is read-only; outputs cannot go to drs:// URIs")


def digest_name(checksum_type: str) -> str | None:
    """hashlib's name for a DRS checksum `type` this module verifies, else None."""
    spelled = checksum_type.strip().lower()
    return next((name for name, spellings in DIGESTS if spelled in spellings), None)


@dataclass(frozen=True)
class DrsObject:
    """A DRS object as its server answered it, and where it was asked."""

    host: str
    id: str
    doc: dict[str, Any]

    @property
    def label(self) -> str:
        return f"drs://{self.host}/{self.id}"

    @property
    def is_bundle(self) -> bool:
        return isinstance(self.doc.get("contents"), list)

    @property
    def contents(self) -> list[Any]:
        return list(self.doc.get("contents") or [])

    @property
    def access_methods(self) -> list[dict[str, Any]]:
        methods = self.doc.get("access_methods") or []
        return [m for m in methods if isinstance(m, dict)] if isinstance(methods, list) else []

    @property
    def size(self) -> int | None:
        size = self.doc.get("size")
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def checksums(self) -> dict[str, str]:
        """hashlib name -> lower-case hex, for the types this module verifies."""
        found: dict[str, str] = {}
        for entry in self.doc.get("checksums") or []:
            if isinstance(entry, dict) and isinstance(entry.get("checksum"), str):
                name = digest_name(str(entry.get("type", "")))
                if name:
                    found.setdefault(name, entry["checksum"].strip().lower())
        return found

    def checksum(self) -> tuple[str, str] | None:
        """(hashlib name, hex) of the preferred checksum, or None."""
        found = self.checksums()
        return next(((name, found[name]) for name, _ in DIGESTS if name in found), None)

    def checksum_types(self) -> str:
        types = [str(e.get("type")) for e in self.doc.get("checksums") or [] if isinstance(e, dict)]
        return ", ".join(types) or "none"


class _Client:
    """The DRS API calls of one input, on one HTTP session (retries, the site's CA bundle)."""

    def __init__(self, ctx: StagingContext) -> None:
        self.ctx = ctx
        self.session = http.session(ctx)
        self._tokens: dict[str, str] | None = None

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def object(self, host: str, object_id: str) -> DrsObject:
        what = f"drs://{host}/{object_id}"
        doc = self._get_json(host, objects_url(host, object_id), what, "no such DRS object")
        if not isinstance(doc.get("checksums"), list):
            raise StagingError(f"{what}: the server's answer is not a DRS object (no checksums)")
        return DrsObject(host=host, id=object_id, doc=doc)

    def access(self, obj: DrsObject, access_id: str) -> tuple[str, dict[str, str]]:
        """The URL and headers `/access/ACCESS_ID` gives for `obj`."""
        url = f"{objects_url(obj.host, obj.id)}/access/{urllib.parse.quote(access_id, safe='')}"
        what = f"{obj.label} access {access_id!r}"
        doc = self._get_json(obj.host, url, what, "no such access id")
        if not isinstance(doc.get("url"), str):
            raise StagingError(f"{what}: the server's answer holds no `url`")
        return doc["url"], access_headers(doc.get("headers"), what)

    def token(self, host: str) -> str | None:
        if self._tokens is None:
            path = self.ctx.options.drs_tokens_file
            self._tokens = read_tokens(path) if path else {}
        return self._tokens.get(host.lower())

    def _get_json(self, host: str, url: str, what: str, missing: str) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        token = self.token(host)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        timeout = self.ctx.options.timeout
        for _ in range(ACCEPTED_TRIES):
            try:
                response = self.session.get(url, headers=headers, timeout=(timeout, timeout))
            except requests.RequestException as exc:
                raise StagingError(f"{what}: {http.describe(exc)}") from None
            with response:
                if response.status_code == 202:
                    time.sleep(_retry_after(response))
                    continue
                _check_status(response, host, what, missing, has_token=token is not None)
                try:
                    doc = response.json()
                except ValueError:
                    raise StagingError(f"{what}: the server's answer is not JSON") from None
                if not isinstance(doc, dict):
                    raise StagingError(f"{what}: the server's answer is not a JSON object")
                return doc
        raise StagingError(
            f"{what}: still being prepared after {ACCEPTED_TRIES} tries (202 Accepted); "
            "try again later"
        )


def _retry_after(response: requests.Response) -> float:
    value = response.headers.get("Retry-After", "")
    seconds = float(value) if value.isdigit() else 5.0
    return min(seconds, ACCEPTED_WAIT_CAP)


def _check_status(
    response: requests.Response, host: str, what: str, missing: str, *, has_token: bool
) -> None:
    status = response.status_code
    if status < 400:
        return
    if status in (401, 403) and has_token:
        raise StagingError(
            f"{what}: the DRS server refused the bearer token for {host} from "
            f"staging.drs_tokens_file (HTTP {status})"
        )
    if status in (401, 403):
        raise StagingError(
            f"{what}: the DRS server asks for authorisation (HTTP {status}); the site can give "
            f"this deployment a bearer token for {host} in staging.drs_tokens_file"
        )
    if status == 404:
        raise StagingError(f"{what}: {missing} (HTTP 404)")
    detail = ""
    try:
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("msg"), str):
            detail = ": " + redact(body["msg"][:200])
    except ValueError:
        pass
    raise StagingError(f"{what}: HTTP {status} {response.reason or ''}".rstrip() + detail)


def read_tokens(path: str) -> dict[str, str]:
    """`host` (or `host:port`) -> bearer token, from the site's TOML file. Messages never show
    its content."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise StagingError(f"cannot read the DRS tokens file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError:
        raise StagingError(f"the DRS tokens file {path} is not valid TOML") from None
    tokens = {}
    for host, token in data.items():
        if not isinstance(token, str):
            raise StagingError(f'the DRS tokens file {path}: {host!r} is not `"host" = "token"`')
        tokens[host.lower()] = token
    return tokens


def access_headers(headers: object, what: str) -> dict[str, str]:
    """An AccessURL's `headers` (`["Name: value", ...]`) as a dict; messages never show a
    value (they carry credentials)."""
    if headers is None:
        return {}
    if not isinstance(headers, list):
        raise StagingError(f"{what}: the access URL's headers are not a list")
    parsed = {}
    for header in headers:
        name, colon, value = str(header).partition(":")
        name, value = name.strip(), value.strip()
        text = str(header)
        if not colon or not name or not text.isascii() or not text.isprintable():
            raise StagingError(f"{what}: an access URL header is not `Name: value`")
        parsed[name] = value
    return parsed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


class _Fetch:
    """Places DRS objects (blobs as files, bundles as directories) and checks what arrived.

    Messages name an object by `where`: nothing for the input itself (the input's label comes
    first), `PATH (drs://...): ` for a content of a bundle, PATH below the input's path."""

    def __init__(self, client: _Client, ctx: StagingContext) -> None:
        self.client = client
        self.ctx = ctx

    def place(
        self,
        obj: DrsObject,
        dest: Path,
        kind: FileKind,
        path: str = "",
        ancestors: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        """Place `obj` at `dest`; `path`: where it lies in the input's bundle ("" for the input
        itself), `ancestors`: the bundles it lies in."""
        where = f"{path} ({obj.label}): " if path else ""
        if obj.is_bundle and kind != "DIRECTORY":
            raise StagingError(
                f"{where}a bundle of {len(obj.contents)} objects: declare the input "
                "`type: DIRECTORY`"
            )
        if not obj.is_bundle and kind == "DIRECTORY":
            raise StagingError(
                f"{where}a single blob, not a bundle: declare the input `type: FILE`"
            )
        if obj.is_bundle:
            self._bundle(obj, dest, path, ancestors)
        else:
            self._blob(obj, dest, where)

    # -------------------------------------------------------------------- blobs

    def usable_methods(self, obj: DrsObject, where: str) -> list[dict[str, Any]]:
        """The access methods this node can use, `file` ones first."""
        usable, passed = [], []
        for method in obj.access_methods:
            scheme = self._scheme(method)
            if method.get("available") is False:
                passed.append(f"{method.get('type')} (not available)")
            elif scheme is None or scheme == "drs" or not can_stage(scheme, self.ctx):
                passed.append(str(method.get("type")))
            else:
                usable.append(method)
        if not usable:
            enabled = ", ".join(s for s in self.ctx.options.enabled if s != "drs")
            raise StagingError(
                f"{where}no access method this node can use (the object offers: "
                f"{', '.join(passed) or 'none'}; enabled here: {enabled}, staging.protocols)"
            )
        return sorted(usable, key=lambda m: self._scheme(m) != "file")

    @staticmethod
    def _scheme(method: dict[str, Any]) -> str | None:
        access_url = method.get("access_url")
        if isinstance(access_url, dict) and isinstance(access_url.get("url"), str):
            try:
                return scheme_of(access_url["url"])
            except StagingError:
                return None
        if isinstance(method.get("access_id"), str):
            return _TYPE_SCHEMES.get(str(method.get("type")))
        return None

    def _blob(self, obj: DrsObject, dest: Path, where: str) -> None:
        failures = []
        for method in self.usable_methods(obj, where):
            try:
                url, headers = self._access(obj, method)
                self._get(url, headers, dest)
            except StagingError as exc:
                failures.append(f"{method.get('type')}: {exc}")
                _remove(dest)
                continue
            self.verify_blob(obj, dest, where)
            return
        raise StagingError(f"{where}no access method worked: " + "; ".join(failures))

    def _access(self, obj: DrsObject, method: dict[str, Any]) -> tuple[str, dict[str, str]]:
        access_url = method.get("access_url")
        if isinstance(access_url, dict) and isinstance(access_url.get("url"), str):
            return access_url["url"], access_headers(access_url.get("headers"), obj.label)
        return self.client.access(obj, str(method["access_id"]))

    def _get(self, url: str, headers: dict[str, str], dest: Path) -> None:
        scheme = scheme_of(url)
        if scheme == "drs" or not can_stage(scheme, self.ctx):
            raise StagingError(f"{redact(url)}: {scheme}:// cannot be staged here")
        if headers and scheme in ("http", "https"):
            http.get_file(url, dest, self.ctx, headers)
            return
        # A local copy, never a link to the source: the bytes are checked after.
        ctx = dataclasses.replace(self.ctx, file_input_mode="copy")
        backend_for(url, ctx).download(url, dest, "FILE", ctx)

    def verify_blob(self, obj: DrsObject, dest: Path, where: str) -> None:
        size = dest.stat().st_size
        if obj.size is not None and size != obj.size:
            raise StagingError(f"{where}{size} bytes arrived; the DRS object has {obj.size}")
        expected = obj.checksum()
        if expected is None:
            self.ctx.log(
                f"{where or obj.label + ': '}no sha-256 or md5 checksum (the object has "
                f"{obj.checksum_types()}); the bytes were not verified"
            )
            return
        name, value = expected
        with open(dest, "rb") as handle:
            actual = hashlib.file_digest(handle, name).hexdigest()
        if actual != value:
            raise StagingError(
                f"{where}checksum mismatch: the DRS object's {_spelled(name)} is {value}, "
                f"the bytes fetched have {actual}"
            )

    # -------------------------------------------------------------------- bundles

    def _bundle(
        self, obj: DrsObject, dest: Path, path: str, ancestors: frozenset[tuple[str, str]]
    ) -> None:
        where = f"{path} ({obj.label}): " if path else ""
        ancestors = ancestors | {(obj.host, obj.id)}
        if len(ancestors) > MAX_DEPTH:
            raise StagingError(f"{where}bundles nested more than {MAX_DEPTH} deep")
        dest.mkdir(mode=0o755)
        names: set[str] = set()
        children = []
        for item in obj.contents:
            name = item.get("name") if isinstance(item, dict) else None
            parts = safe_relative(name, f"{where}a content") if isinstance(name, str) else ()
            if len(parts) != 1 or parts[0] in names:
                raise StagingError(f"{where}the content name {name!r} cannot be placed safely")
            names.add(parts[0])
            child = self._content(obj, item, where)
            if (child.host, child.id) in ancestors:
                raise StagingError(f"{where}{parts[0]} is {child.label}, which contains it")
            kind: FileKind = "DIRECTORY" if child.is_bundle else "FILE"
            child_path = f"{path}/{parts[0]}" if path else parts[0]
            self.place(child, dest / parts[0], kind, child_path, ancestors)
            children.append(child)
        self.verify_bundle(obj, children, where)

    def _content(self, bundle: DrsObject, item: dict[str, Any], where: str) -> DrsObject:
        """A content's object: by its `id` on the bundle's server, else its first `drs_uri`
        this node can resolve."""
        content_id = item.get("id")
        if isinstance(content_id, str) and content_id:
            return self.client.object(bundle.host, content_id)
        prefixes = dict(self.ctx.options.drs_prefixes)
        for uri in item.get("drs_uri") or []:
            try:
                host, object_id = resolve(parse_drs_uri(str(uri)), prefixes)
            except DrsUriError:
                continue
            return self.client.object(host, object_id)
        raise StagingError(
            f"{where}the content {item.get('name')!r} has neither an id nor a drs_uri this "
            "node can resolve"
        )

    def verify_bundle(self, obj: DrsObject, children: list[DrsObject], where: str) -> None:
        """The specification's bundle checksum: the digest of its top-level contents'
        checksums (of the same type), sorted and concatenated."""
        expected = obj.checksum()
        if expected is None:
            self.ctx.log(
                f"{where or obj.label + ': '}no sha-256 or md5 checksum on the bundle (it has "
                f"{obj.checksum_types()}); its listing was not verified"
            )
            return
        name, value = expected
        parts = [child.checksums().get(name) for child in children]
        if any(part is None for part in parts):
            self.ctx.log(
                f"{where or obj.label + ': '}a content has no {_spelled(name)} checksum; the "
                "bundle's own checksum was not verified (each file's was)"
            )
            return
        actual = hashlib.new(name, "".join(sorted(p for p in parts if p)).encode()).hexdigest()
        if actual != value:
            raise StagingError(
                f"{where}checksum mismatch: the bundle's {_spelled(name)} is {value}; its "
                f"contents' checksums give {actual}"
            )


def _spelled(name: str) -> str:
    return "sha-256" if name == "sha256" else name
