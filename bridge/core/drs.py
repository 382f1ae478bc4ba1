"""DRS URIs (GA4GH Data Repository Service 1.2 and later) and where their objects are served.

Two forms exist (the DRS specification, "DRS URIs"):
- hostname-based, `drs://<host>/<id>`: the object is `GET https://<host>/ga4gh/drs/v1/objects/<id>`.
  The specification allows no port; `drs://<host>:<port>/<id>` is accepted too (test and
  in-house servers use one).
- compact-identifier-based, `drs://[provider_code/]namespace:accession`: the prefix
  (`[provider_code/]namespace`) is looked up at a meta-resolver (identifiers.org, n2t.net),
  which needs the network and trusts an outside registry, so the bridge resolves only the
  prefixes a site maps to a host itself (`staging.drs_prefixes`).

The two are told apart as the specification says, by the `:` a hostname-based URI cannot hold;
the one exception taken for ports: `drs://name:NUMBER/...` (NUMBER up to 65535) reads as a host
and port.

Pure and dependency-free: the API refuses at create what no staging could resolve, and the job
side resolves the same way where staging runs.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

#: The DRS API below a server's root (DRS 1.x).
DRS_API = "/ga4gh/drs/v1"

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r"[0-9]{1,5}")
#: A compact identifier's prefix: letters, digits, `_` and `.`, one optional `provider/` first.
_PREFIX = re.compile(r"(?:[A-Za-z0-9._]+/)?[A-Za-z0-9._]+")
#: What no DRS id in a URI may hold (an id with other characters is percent-encoded).
_BAD_ID_CHARS = re.compile(r"[\x00-\x20\x7f?#]")
#: Characters an id keeps in a request path (RFC 3986 pchar less `/`, and `%` of escapes).
_PATH_SAFE = "%!$&'()*+,;=:@"


class DrsUriError(ValueError):
    """A `drs://` URI that cannot be resolved here; the message says why and what to do."""


@dataclass(frozen=True)
class DrsUri:
    """A parsed DRS URI: `host` and `object_id` (hostname-based), or `prefix` and `accession`
    (compact)."""

    url: str
    host: str | None = None
    object_id: str | None = None
    prefix: str | None = None
    accession: str | None = None

    @property
    def compact(self) -> bool:
        return self.prefix is not None


def is_drs_url(url: str) -> bool:
    return url[:6].lower() == "drs://"


def host_problem(value: str) -> str | None:
    """Why `value` is not `host` or `host:port` (None when it is)."""
    host, port = split_host(value)
    if host is None:
        return f"{value!r} is not a host name or `host:port`"
    if port is not None and not 0 < port < 65536:
        return f"{value!r} has a port outside 1-65535"
    return None


def split_host(value: str) -> tuple[str | None, int | None]:
    """(`host`, port or None) of `host`, `host:port`, `[v6]` or `[v6]:port`; host None when
    `value` is none of these."""
    port: str | None = None
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[: end + 1], value[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            return None, None
        port = rest[1:] if rest else None
    else:
        host, colon, after = value.partition(":")
        port = after if colon else None
    if port is not None and not _PORT.fullmatch(port):
        return None, None
    if not (_HOSTNAME.fullmatch(host) or _IPV6.fullmatch(host)):
        return None, None
    return host, int(port) if port is not None else None


def parse_drs_uri(url: str) -> DrsUri:
    """Read a `drs://` URI; DrsUriError when it is neither form."""
    if not is_drs_url(url):
        raise DrsUriError(f"{url!r} is not a drs:// URI")
    rest = url[6:]
    authority, slash, path = rest.partition("/")
    host, port = split_host(authority)
    if host is not None and slash and ":" not in path and (port is None or 0 < port < 65536):
        if not path:
            raise DrsUriError(f"{url!r} names no object: drs://HOST/ID")
        if _BAD_ID_CHARS.search(path):
            raise DrsUriError(
                f"{url!r}: a DRS id holds no spaces, control characters, `?` or `#` "
                "(percent-encode them)"
            )
        return DrsUri(url=url, host=authority.lower(), object_id=path)
    prefix, colon, accession = rest.partition(":")
    if colon and accession and _PREFIX.fullmatch(prefix):
        if _BAD_ID_CHARS.search(accession):
            raise DrsUriError(f"{url!r}: the accession holds spaces or control characters")
        return DrsUri(url=url, prefix=prefix.lower(), accession=accession)
    raise DrsUriError(
        f"{url!r} is neither drs://HOST/ID (a host name, optionally :PORT, then the id) "
        "nor a compact identifier drs://PREFIX:ACCESSION"
    )


def unmapped_prefix(uri: DrsUri) -> str:
    """The refusal of a compact identifier whose prefix the site does not map."""
    return (
        f"{uri.url!r} is a compact identifier (prefix {uri.prefix!r}): resolving it needs a "
        "meta-resolver on the network (identifiers.org, n2t.net), which this server does not "
        "ask; send the hostname-based drs://HOST/ID (the object's `self_uri`), or ask the "
        "site to map the prefix to its DRS host (staging.drs_prefixes)"
    )


def resolve(uri: DrsUri, prefixes: Mapping[str, str]) -> tuple[str, str]:
    """(`host[:port]`, object id for the request path) of `uri`; a compact identifier through
    the site's `prefixes` (prefix -> host), its accession percent-encoded as the
    specification asks. DrsUriError for a prefix the site does not map."""
    if uri.host is not None and uri.object_id is not None:
        return uri.host, uri.object_id
    host = prefixes.get(uri.prefix or "")
    if host is None or uri.accession is None:
        raise DrsUriError(unmapped_prefix(uri))
    return host.lower(), urllib.parse.quote(uri.accession, safe="")


def objects_url(host: str, object_id: str) -> str:
    """`https://HOST/ga4gh/drs/v1/objects/ID` (DRS is always HTTPS); a `/` in the id is
    percent-encoded, as the specification asks of ids in request paths."""
    return f"https://{host}{DRS_API}/objects/{urllib.parse.quote(object_id, safe=_PATH_SAFE)}"
