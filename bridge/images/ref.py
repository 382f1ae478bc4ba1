"""Container image references: parsed, normalised to the full reference the runtime pulls, and
named in the image cache (entry key, content-addressed SIF name).

Pure (no I/O), so the cache, the CLI and the tests agree on one spelling of each image.
"""

from __future__ import annotations

import hashlib
import os
import re

DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?)"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"^(?P<name>{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{DIGEST}))?$"
)
_DOMAIN_RE = re.compile(rf"^{_DOMAIN}$")
_LIBRARY = re.compile(r"^[A-Za-z0-9._/:@-]+$")
#: A library:// reference pinned to an image by its hash (`...:sha256.<hex>`), as the Sylabs
#: library names them.
_LIBRARY_PIN = re.compile(r":sha256\.(?P<hex>[0-9a-f]{64})$")


class ImagePullError(Exception):
    """An image cannot be made available; the message says why (shown in system_logs)."""

    def __init__(self, image: str, message: str) -> None:
        # The poller prefixes "cannot pull image: ", so the message starts with the image.
        super().__init__(f"{image}: {message}")
        self.image = image
        self.reason = message


def normalize(image: str, default_registry: str) -> str:
    """The full reference the runtime pulls (or the absolute path of a local SIF)."""
    if not isinstance(image, str) or not image or image != image.strip():
        raise ImagePullError(repr(image), "empty or padded image name")
    if image.startswith("/"):
        if not image.endswith(".sif") or os.path.normpath(image) != image:
            raise ImagePullError(image, "a local image must be a normalised path to a .sif")
        return image
    scheme, sep, rest = image.partition("://")
    if not sep:
        scheme, rest = "docker", image
    scheme = scheme.lower()
    if scheme == "docker":
        domain, ref = _split_docker(rest, image, default_registry)
        return f"docker://{domain}/{ref}"
    if scheme == "oras":
        domain, ref = _split_docker(rest, image, "")
        if not domain:
            raise ImagePullError(image, "an oras:// reference needs a registry")
        return f"oras://{domain}/{ref}"
    if scheme == "library":
        if not _LIBRARY.fullmatch(rest):
            raise ImagePullError(image, "not a valid library:// reference")
        return f"library://{rest}"
    raise ImagePullError(image, f"unsupported image scheme {scheme}:// (docker, oras, library)")


def _split_docker(rest: str, image: str, default_registry: str) -> tuple[str, str]:
    """`[domain/]path[:tag][@digest]` -> (domain, `path:tag` or `path@digest`)."""
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        domain, path = first, remainder
        if not _DOMAIN_RE.fullmatch(domain):
            raise ImagePullError(image, f"invalid registry name {domain!r}")
    else:
        domain, path = default_registry, rest
    match = _REFERENCE.fullmatch(path)
    if not match:
        raise ImagePullError(image, "not a valid image reference (expected [registry/]name[:tag])")
    name, tag, digest = match.group("name"), match.group("tag"), match.group("digest")
    if "/" not in name and (domain in DOCKER_HUB or domain == default_registry):
        name = f"library/{name}"  # official images live under library/
    if digest:
        ref = f"{name}:{tag}@{digest}" if tag else f"{name}@{digest}"
    else:
        ref = f"{name}:{tag or 'latest'}"
    return domain, ref


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def key(ref: str) -> str:
    """Name of a normalised reference's entry in the cache (a hash of it)."""
    return sha(ref)[:32]


def sif_name(ref: str, digest: str | None) -> str:
    """Content-addressed file name: readable stem + the manifest digest."""
    path = ref.split("://", 1)[1].split("@", 1)[0]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.rsplit("/", 1)[-1].split(":", 1)[0])[:40]
    content = digest.split(":", 1)[-1] if digest else sha(ref)
    return f"{stem}-{content[:32]}.sif"


def digest_of(ref: str) -> str | None:
    """The digest a reference pins (`...@sha256:...`; a library's `...:sha256.<hex>`), if any."""
    if ref.startswith("library://"):
        pin = _LIBRARY_PIN.search(ref)
        return f"sha256:{pin['hex']}" if pin else None
    return ref.rsplit("@", 1)[1] if "@" in ref.split("://", 1)[1] else None


def is_registry(ref: str) -> bool:
    """Whether the reference names a manifest in an OCI registry (its digest can be checked)."""
    return ref.startswith(("docker://", "oras://"))


def pinned(ref: str, digest: str) -> str:
    """The reference with its tag replaced by the digest: exactly the image that was checked."""
    return ref if digest_of(ref) else ref.rsplit(":", 1)[0] + "@" + digest


def host(ref: str) -> str:
    return ref.split("://", 1)[1].split("/", 1)[0]
