"""Who is calling: authenticators for the `[auth]` modes and the identity -> Unix user mapping.

No HTTP framework here: an authenticator takes the raw `Authorization` header and returns an
:class:`Identity` or raises :class:`AuthError`; the Falcon middleware in ``bridge.api.app`` turns
that into a 401. The reason in an AuthError is for the server log only, never for the client.

Modes:
- ``none``: everyone is anonymous (owner None); an `Authorization` header is ignored (py-tes
  0.4 sends ``Basic None:None``).
- ``basic``: an htpasswd file with bcrypt hashes (``htpasswd -B``), re-read when it changes.
- ``bearer``: JWTs signed by an OIDC issuer, verified with PyJWT against the issuer's JWKS
  (cached, refreshed in the background and when a token names an unknown key: see
  :class:`JwksKeys`); issuer, audience and expiry checked.

The identity (the htpasswd name, or the configured claim of a token) becomes a Unix user name
either through the mapping file or, without one, as it is (if it is a valid user name).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import bcrypt

from bridge.system.users import AdminPolicy, UnknownUser, UserMap

if TYPE_CHECKING:  # jwt is imported when bearer authentication is first used
    import jwt

    from bridge.config import Config

log = logging.getLogger("bridge.api.auth")

#: In the state directory: the last key set any worker fetched (:class:`SharedKeySet`).
SHARED_KEYS_FILE = "jwks.json"


class AuthError(Exception):
    """The request is not authenticated; the message is for the log, never for the client."""


class NoLocalUser(AuthError):
    """The credentials are good, but name no local Unix user to own tasks: a 403 whose
    message (`public`) says so, since the caller has proven who they are."""

    def __init__(self, message: str, public: str) -> None:
        super().__init__(message)
        self.public = public


@dataclass(frozen=True)
class Identity:
    #: The Unix user that owns the caller's tasks; None in mode `none` (no owner).
    user: str | None
    is_admin: bool = False

    @property
    def owner_filter(self) -> str | None:
        """What the store filters on: None (all tasks) for admins and in mode `none`."""
        return None if self.is_admin else self.user


ANONYMOUS = Identity(user=None, is_admin=True)


# ------------------------------------------------------------------------------ authenticators
class Authenticator(Protocol):
    # A read-only member: implementations narrow it to `str` or `None`.
    @property
    def challenge(self) -> str | None:
        """The `WWW-Authenticate` challenge of a 401 (None: authentication is off)."""

    def authenticate(self, authorization: str | None) -> Identity: ...


class NoAuth:
    challenge = None

    def authenticate(self, authorization: str | None) -> Identity:
        # Mode none: no owners, everything visible; a header (py-tes' `None:None`) is ignored.
        return ANONYMOUS


def _split_header(authorization: str | None, scheme: str) -> str:
    if not authorization:
        raise AuthError("no Authorization header")
    given, _, credentials = authorization.strip().partition(" ")
    if given.lower() != scheme.lower() or not credentials.strip():
        raise AuthError(f"Authorization is not a {scheme} credential")
    return credentials.strip()


class _Mapped:
    def __init__(self, users: UserMap, admins: AdminPolicy):
        self.users = users
        self.admins = admins

    def identity(self, name: str) -> Identity:
        try:
            user = self.users.resolve(name).user
        except UnknownUser as exc:
            raise NoLocalUser(
                str(exc),
                f"authenticated as {name!r}, but {exc}: every caller, an administrator too, "
                "must be a local Unix user (not root) on this host; ask the operator to add "
                "the user or map the identity (auth.user_map_file)",
            ) from None
        return Identity(user=user, is_admin=self.admins.is_admin(user))


class BasicAuth(_Mapped):
    """An htpasswd file of bcrypt hashes (`htpasswd -B -c FILE user`)."""

    #: Verified passwords are remembered this long (bcrypt is slow on purpose, and clients send
    #: the password with every request); keyed by a keyed hash, never the password itself.
    CACHE_SECONDS = 60.0

    def __init__(self, path: Path, users: UserMap, admins: AdminPolicy, realm: str):
        super().__init__(users, admins)
        self.path = path
        self.challenge = f'Basic realm="{realm}", charset="UTF-8"'
        self._hashes: dict[str, bytes] = {}
        self._stamp: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._cache: dict[bytes, float] = {}
        self._cache_key = secrets.token_bytes(32)
        self._dummy = b""
        self._load()

    def _load(self) -> None:
        stat = os.stat(self.path)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        hashes: dict[str, bytes] = {}
        for number, line in enumerate(self.path.read_text("utf-8").splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, hashed = line.partition(":")
            if not sep or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
                log.warning(
                    "%s:%d: not a bcrypt entry (use htpasswd -B); ignored", self.path, number
                )
                continue
            hashes[name] = hashed.encode()
        self._hashes, self._stamp = hashes, stamp
        # Unknown names are checked against a dummy hash of the file's own (most common) cost,
        # so that a refusal takes as long whether or not the name exists.
        costs = Counter(int(h[4:6]) for h in hashes.values() if h[4:6].isdigit())
        cost = costs.most_common(1)[0][0] if costs else 10
        if not self._dummy.startswith(b"$2b$%02d$" % cost):
            self._dummy = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=cost))

    def authenticate(self, authorization: str | None) -> Identity:
        try:
            decoded = base64.b64decode(_split_header(authorization, "Basic"), validate=True)
            name, sep, password = decoded.decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise AuthError("malformed Basic credentials") from None
        if not sep:
            raise AuthError("malformed Basic credentials")
        with self._lock:
            try:
                self._load()
            except OSError as exc:
                raise AuthError(f"cannot read the htpasswd file: {exc}") from None
            hashed = self._hashes.get(name)
            dummy = self._dummy
        key = hmac.new(self._cache_key, decoded + b"\0" + (hashed or b""), hashlib.sha256).digest()
        now = time.monotonic()
        if hashed is not None and self._cache.get(key, 0.0) > now:
            return self.identity(name)
        # bcrypt hashes only the first 72 bytes; htpasswd -B and Apache truncate longer passwords
        # silently, so the bridge does too (bcrypt 4.1+ raises instead).
        ok = bcrypt.checkpw(password.encode("utf-8")[:72], hashed or dummy)
        if hashed is None or not ok:
            raise AuthError(f"wrong password or unknown user {name!r}")
        if len(self._cache) > 1024:
            self._cache = {k: t for k, t in self._cache.items() if t > now}
        self._cache[key] = now + self.CACHE_SECONDS
        return self.identity(name)


class BearerAuth(_Mapped):
    """OIDC access tokens (JWTs) checked against the issuer's JWKS with PyJWT."""

    def __init__(
        self,
        *,
        issuer: str,
        audience: str,
        jwks_url: str | None,
        cache_seconds: float,
        refresh_cooldown: float,
        algorithms: list[str],
        leeway: float,
        user_claim: str,
        users: UserMap,
        admins: AdminPolicy,
        realm: str,
        shared_file: Path | None = None,
    ):
        super().__init__(users, admins)
        self.issuer = issuer
        self.audience = audience
        self.algorithms = algorithms
        self.leeway = leeway
        self.user_claim = user_claim
        self.cache_seconds = cache_seconds
        self.refresh_cooldown = refresh_cooldown
        self.challenge = f'Bearer realm="{realm}"'
        self._keys = JwksKeys(
            lambda: jwks_url or _discover_jwks_url(issuer),
            lifetime=cache_seconds,
            cooldown=refresh_cooldown,
            shared=SharedKeySet(shared_file, f"{issuer} {jwks_url or ''}") if shared_file else None,
        )

    def authenticate(self, authorization: str | None) -> Identity:
        import jwt

        token = _split_header(authorization, "Bearer")
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            if not isinstance(kid, str) or not kid:
                raise AuthError("token names no key (kid)")
            claims = jwt.decode(
                token,
                # The PyJWK, not its raw key: the token's `alg` must be the key's own, so an
                # ES256 token naming an RSA key is refused rather than tried with the wrong type.
                self._keys.key(kid),
                algorithms=self.algorithms,  # never "none", never the token's own choice
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": ["exp", "iss", "aud"]},
            )
        except (jwt.PyJWTError, ValueError) as exc:
            raise AuthError(f"token refused: {exc}") from None
        name = claims.get(self.user_claim)
        if not isinstance(name, str) or not name:
            raise AuthError(f"token has no {self.user_claim!r} claim")
        return self.identity(name)


class SharedKeySet:
    """The last key set any worker fetched, in a file of the state directory, so that a worker
    that has none in hand (new, or restarted) need not wait for an issuer that is away.

    Written by each successful fetch (a temporary file renamed over it: readers see a whole
    set), mode 0600. Read only when it is a regular file of this account that no one else may
    write, and only for the same issuer and key URL (`source`). It keeps the time of its
    fetch: a set read from it is as old as that fetch, so it is refreshed from the issuer as
    a set in hand would be, and never outlives the keys the issuer serves once it answers."""

    def __init__(self, path: Path, source: str) -> None:
        self.path = path
        self.source = source
        self._seen: tuple[int, int, int, int] | None = None

    def save(self, jwks: dict[str, Any], fetched_at: float) -> None:
        data = json.dumps({"source": self.source, "fetched_at": fetched_at, "jwks": jwks})
        try:
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as file:  # mkstemp: mode 0600
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as exc:
            log.warning("cannot share the issuer's keys in %s: %s", self.path, exc)

    def load_if_changed(self) -> tuple[dict[str, Any], float] | None:
        """(the JWKS, the wall-clock time of its fetch) when the file changed since the last
        look and may be trusted; None otherwise."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None  # none yet (or a link: never followed)
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            seen = (info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
            if seen == self._seen:
                return None
            self._seen = seen
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                log.warning("%s is not a file of this account; not used", self.path)
                return None
            if info.st_mode & 0o022:
                log.warning("%s may be written by others; not used", self.path)
                return None
            raw = file.read(JwksKeys.MAX_BYTES * 2)
        try:
            document = json.loads(raw)
            jwks, fetched_at = document["jwks"], float(document["fetched_at"])
        except (ValueError, TypeError, KeyError):
            log.warning("%s is not a key set written by this service; not used", self.path)
            return None
        if document.get("source") != self.source or not isinstance(jwks, dict):
            return None  # another issuer's (the configuration changed)
        return jwks, fetched_at


class JwksKeys:
    """The issuer's signing keys by `kid`, refreshed in the background, one fetch at a time.

    No request fetches keys itself: an identity provider that hangs or fails must not hold
    request threads (nor, through them, public requests) or refuse tokens whose key is known.
    - The set is fetched again once `lifetime` has passed. A request that finds it older waits
      for that refresh at most `STALE_WAIT` seconds after it started (so a key the issuer
      removed is refused at once when the issuer answers promptly), then uses the keys in hand.
    - A `kid` not in the set starts a refresh (at most one per `cooldown`) and waits for it
      at most `UNKNOWN_WAIT` seconds after it started.
    - A failed refresh keeps the keys in hand (said in the log) and is tried again after
      `cooldown`; a fetch gives up after `FETCH_SECONDS`.
    - With `shared`, the keys in hand are first those of the last fetch of any worker (a
      `SharedKeySet`), when it is newer than this worker's own, taken at the age of that fetch:
      a worker with no keys of its own yet refuses no token whose key another one fetched.
    """

    STALE_WAIT = 1.0
    UNKNOWN_WAIT = 5.0
    FETCH_SECONDS = 10.0
    #: A JWKS larger than this is refused (a few keys take a few KiB).
    MAX_BYTES = 1 << 20

    def __init__(
        self,
        locate: Callable[[], str],
        *,
        lifetime: float,
        cooldown: float,
        shared: SharedKeySet | None = None,
    ):
        self._locate = locate
        self.lifetime = lifetime
        self.cooldown = cooldown
        self.shared = shared
        self._url: str | None = None
        self._changed = threading.Condition()
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at: float | None = None
        #: The wall-clock time of the fetch the keys in hand come from.
        self._fetched_wall = float("-inf")
        self._started_at: float | None = None
        self._last_failed = False
        self._refreshing = False

    def key(self, kid: str) -> jwt.PyJWK:
        """The key `kid` names (AuthError when the issuer has none by that name)."""
        with self._changed:
            now = time.monotonic()
            if not (kid in self._keys and self._fresh(now)):
                self._adopt_shared(now)
            known = kid in self._keys
            fresh = self._fresh(now)
            if not (known and fresh):
                self._refresh_if_due(now, stale=not fresh)
                if self._refreshing and self._started_at is not None:
                    wait = self.STALE_WAIT if known else self.UNKNOWN_WAIT
                    timeout = self._started_at + wait - now
                    self._changed.wait_for(lambda: not self._refreshing, max(timeout, 0.0))
            key = self._keys.get(kid)
        if key is None:
            raise AuthError(f"the issuer's key set has no key {kid!r}")
        return key

    def _fresh(self, now: float) -> bool:
        return self._fetched_at is not None and now - self._fetched_at < self.lifetime

    def _adopt_shared(self, now: float) -> None:
        """Take the shared set when another worker fetched it after the keys in hand were."""
        found = self.shared.load_if_changed() if self.shared else None
        if found is None or found[1] <= self._fetched_wall:
            return
        jwks, fetched_wall = found
        try:
            keys = _signing_keys(jwks)
        except Exception as exc:  # PyJWT's errors, and a key it cannot load
            log.warning("the shared key set cannot be read (%s); not used", exc)
            return
        self._keys, self._fetched_wall = keys, fetched_wall
        self._fetched_at = now - max(time.time() - fetched_wall, 0.0)

    def _refresh_if_due(self, now: float, *, stale: bool) -> None:
        """Start the background refresh unless one runs, or one started within the cooldown
        (a set past its lifetime after a successful fetch is refreshed at once)."""
        if self._refreshing:
            return
        started = self._started_at
        cooling = started is not None and now - started < self.cooldown
        if cooling and not (stale and not self._last_failed):
            return
        self._refreshing = True
        self._started_at = now
        threading.Thread(target=self._refresh, name="jwks-refresh", daemon=True).start()

    def _refresh(self) -> None:
        keys: dict[str, jwt.PyJWK] | None = None
        fetched_wall = float("-inf")
        try:
            if self._url is None:
                self._url = self._locate()
            jwks = _fetch_jwks(self._url, self.FETCH_SECONDS, self.MAX_BYTES)
            keys, fetched_wall = _signing_keys(jwks), time.time()
            if self.shared is not None:
                self.shared.save(jwks, fetched_wall)
        except Exception as exc:  # a thread of its own: every failure keeps the keys in hand
            log.warning("cannot refresh the issuer's keys (%s); keeping those in hand", exc)
        with self._changed:
            if keys is not None:
                self._keys = keys
                self._fetched_at = time.monotonic()
                self._fetched_wall = fetched_wall
            self._last_failed = keys is None
            self._refreshing = False
            self._changed.notify_all()


def _fetch_jwks(url: str, seconds: float, max_bytes: int) -> dict[str, Any]:
    """The JWKS at `url`, read within `seconds`."""
    deadline = time.monotonic() + seconds
    data = b""
    with urllib.request.urlopen(url, timeout=seconds) as answer:
        while chunk := answer.read(65536):
            data += chunk
            if len(data) > max_bytes or time.monotonic() > deadline:
                raise OSError(f"{url} sent more than {max_bytes} bytes or took over {seconds} s")
    document = json.loads(data)
    if not isinstance(document, dict):
        raise ValueError(f"{url} sent no JWKS (a JSON object)")
    return document


def _signing_keys(jwks: dict[str, Any]) -> dict[str, jwt.PyJWK]:
    """The signing keys with a `kid` of a JWKS."""
    import jwt

    keys = jwt.PyJWKSet.from_dict(jwks).keys
    # As PyJWKClient: keys for signatures (or of no stated use) that have a kid.
    return {k.key_id: k for k in keys if k.key_id and k.public_key_use in ("sig", None)}


def _discover_jwks_url(issuer: str) -> str:
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    with urllib.request.urlopen(url, timeout=10) as answer:
        document = json.load(answer)
    jwks = document.get("jwks_uri")
    if not isinstance(jwks, str):
        raise AuthError(f"{url} names no jwks_uri")
    return jwks


def build_authenticator(config: Config) -> Authenticator:
    """The authenticator for a `bridge.config.Config` (its `auth` and `site` sections)."""
    auth = config.auth
    if auth.mode == "none":
        return NoAuth()
    users = UserMap.load(auth.user_map_file, require_local=config.site.run_as_owner)
    admins = AdminPolicy(auth.admin_users, auth.admin_group)
    # AuthConfig's validator has required each mode's settings.
    if auth.mode == "basic":
        assert auth.htpasswd_file is not None
        return BasicAuth(auth.htpasswd_file, users, admins, auth.realm)
    assert auth.issuer and auth.audience
    return BearerAuth(
        issuer=auth.issuer,
        audience=auth.audience,
        jwks_url=auth.jwks_url,
        cache_seconds=auth.jwks_cache_seconds,
        refresh_cooldown=auth.jwks_refresh_cooldown_seconds,
        algorithms=list(auth.algorithms),
        leeway=auth.leeway_seconds,
        user_claim=auth.user_claim,
        users=users,
        admins=admins,
        realm=auth.realm,
        shared_file=config.state_dir / SHARED_KEYS_FILE,
    )
