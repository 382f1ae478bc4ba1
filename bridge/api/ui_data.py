"""The web page's private JSON, beside the TES API and behind the same authentication.

What TES has no place for and the page shows: how many of the caller's tasks are in each state
(for the list's filters), and, for admins only, each task's owner. The TES documents stay as the
spec has them (strict clients refuse unknown fields), so the owner is only ever answered here.
"""

from __future__ import annotations

from typing import Any

import falcon

from bridge.api.resources import _bad_request, _param, _tag_pairs
from bridge.config import Config
from bridge.core.tes import TaskValidationError
from bridge.store import Store, TaskFilter

PREFIX = "/ui-data"
#: The most ids one owners request may name (the page asks for one page of tasks at a time).
MAX_OWNER_IDS = 500


class Summary:
    """`GET /ui-data/summary`: who the caller is and their tasks by state (under the list's
    name and tag filters)."""

    def __init__(self, config: Config, store: Store):
        self.config = config
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        identity = req.context.identity
        try:
            task_filter = TaskFilter(
                name_prefix=_param(req, "name_prefix") or None,
                tags=_tag_pairs(req, self.config.limits.max_tags),
                owner=identity.owner_filter,
            )
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        resp.media = {
            "user": identity.user,
            "admin": identity.is_admin,
            "counts": self.store.count_states(task_filter),
        }


class Me:
    """`GET /ui-data/me`: who the caller is, and whether they are an admin (the page shows an
    owner column to admins)."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        identity = req.context.identity
        resp.media = {"user": identity.user, "admin": identity.is_admin}


class Owners:
    """`GET /ui-data/owners?id=...`: each task's owner, for admins only (an audit of who ran
    what); unknown ids are left out."""

    def __init__(self, store: Store):
        self.store = store

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not req.context.identity.is_admin:
            raise falcon.HTTPForbidden(description="task owners are for admins (auth.admin_users)")
        ids = req.get_param_as_list("id") or []
        if len(ids) > MAX_OWNER_IDS:
            raise falcon.HTTPBadRequest(description=f"at most {MAX_OWNER_IDS} ids at once")
        resp.media = {"owners": self.store.owners_of(ids) if ids else {}}


def add_routes(app: falcon.App[Any, Any], config: Config, store: Store) -> None:
    app.add_route(f"{PREFIX}/me", Me())
    app.add_route(f"{PREFIX}/summary", Summary(config, store))
    app.add_route(f"{PREFIX}/owners", Owners(store))
