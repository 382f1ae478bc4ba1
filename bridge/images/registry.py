"""The registry's side of the cache: the manifest digest a reference's tag names now (one HEAD
request, through python-dxf, with the runtime's own credential variables). An image or tag that
does not exist, or that the registry will not show, is an `ImagePullError`; a registry that is
down, refuses, answers 5xx or stalls is `Transient`.
"""

from __future__ import annotations

import hashlib
import os
import re

import requests
from dxf import DXF, DXFBase

from bridge.config import Config
from bridge.images.failures import Transient, short_text
from bridge.images.ref import DIGEST, DOCKER_HUB, ImagePullError

#: A registry's answer to one manifest check takes at most this long (or the pull timeout).
REGISTRY_TIMEOUT = 30.0


#: Words of urllib3's and the resolver's messages -> what a user is told.
_CONNECTION_PROBLEMS = (
    (("nameresolution", "name or service not known", "name resolution", "getaddrinfo",
      "nodename nor servname", "no address associated"), "host name not found"),
    (("refused",), "connection refused"),
    (("no route to host",), "no route to host"),
    (("network is unreachable",), "network unreachable"),
)  # fmt: skip


def connection_problem(exc: BaseException) -> str:
    """A connection error in a few words, not urllib3's nested text."""
    text = str(exc).lower()
    for words, problem in _CONNECTION_PROBLEMS:
        if any(word in text for word in words):
            return problem
    reason = exc.args[0] if exc.args else exc
    return short_text(reason)


class Registry:
    """The registry side: the manifest digest a reference's tag names now."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def resolve_digest(self, ref: str) -> str:
        """The manifest digest the registry gives the reference's tag now."""
        host, _, rest = ref.split("://", 1)[1].partition("/")
        name, _, tag = rest.rpartition(":")
        api_host = "registry-1.docker.io" if host in DOCKER_HUB else host
        insecure = host in self.config.container.insecure_registries
        timeout = min(REGISTRY_TIMEOUT, self.config.container.pull_timeout_seconds)
        client = DXF(api_host, name, auth=self._authenticate, insecure=insecure, timeout=timeout)
        try:
            digest, response = client.head_manifest_and_response(tag)
            if not digest:  # some registries leave the header out of HEAD answers
                _, response = client.get_manifest_and_response(tag)
                digest = "sha256:" + hashlib.sha256(response.content).hexdigest()
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            where = f"{host}/{name}:{tag}"
            if status in (404, 400):
                raise ImagePullError(
                    ref, f"{where} does not exist (registry answered {status})"
                ) from None
            if status in (401, 403):
                raise ImagePullError(
                    ref, f"{where}: access denied or no such repository ({status})"
                ) from None
            raise Transient(f"registry {host} answered {status}") from None
        except requests.Timeout:
            raise Transient(
                f"registry {host} did not answer within {timeout:.0f} s "
                "(container.pull_timeout_seconds)"
            ) from None
        except (requests.ConnectionError, OSError) as exc:
            reason = connection_problem(exc)
            raise Transient(f"registry {host} unreachable ({reason})", unreachable=True) from None
        if not re.fullmatch(DIGEST, digest):
            raise Transient(f"registry {host} gave no usable digest for {name}:{tag}")
        return digest

    def _authenticate(self, client: DXFBase, response: requests.Response) -> None:
        """Token or basic authentication, with the runtime's own credential variables."""
        user = os.environ.get("APPTAINER_DOCKER_USERNAME") or os.environ.get(
            "SINGULARITY_DOCKER_USERNAME"
        )
        password = os.environ.get("APPTAINER_DOCKER_PASSWORD") or os.environ.get(
            "SINGULARITY_DOCKER_PASSWORD"
        )
        client.authenticate(user, password, response=response)
