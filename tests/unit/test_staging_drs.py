"""`drs://` inputs: the URI forms (bridge.core.drs), what the API refuses at create, the
`[staging]` keys, and the job side's resolution (bridge.job.staging.drs) against the DRS test
server on loopback (tests/fixtures/drs.py), whose blobs also lie on the loopback S3 server and
in an allowed directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from falcon import testing

from bridge.config import ConfigError, load_config
from bridge.core.drs import DrsUriError, objects_url, parse_drs_uri, resolve
from bridge.job.records import read_records
from bridge.job.settings import read_settings
from bridge.job.stage import STAGE_FAILED, STAGE_OK, stage_in
from bridge.job.staging import StagingContext, StagingError, StagingOptions, backend_for
from bridge.jobscript.render import prepare_task_dir
from tests.fixtures.drs import DrsServer, sha256
from tests.fixtures.storage import BUCKET, StorageServers
from tests.unit.test_staging_config import make_client
from tests.unit.test_staging_protocols import TaskDir

ECHO = {"executors": [{"image": "alpine", "command": ["true"]}]}

# --------------------------------------------------------------------------- URIs


@pytest.mark.parametrize(
    ("url", "host", "object_id"),
    [
        ("drs://drs.example.org/314159", "drs.example.org", "314159"),
        ("DRS://Drs.Example.org/abc-DEF_1.2~x", "drs.example.org", "abc-DEF_1.2~x"),
        ("drs://127.0.0.1:8443/obj", "127.0.0.1:8443", "obj"),
        ("drs://drs.example.org:443/a%2Fb", "drs.example.org:443", "a%2Fb"),
        ("drs://[::1]:8443/obj", "[::1]:8443", "obj"),
    ],
)
def test_hostname_based_uris_name_the_server_and_the_id(url, host, object_id):
    uri = parse_drs_uri(url)
    assert not uri.compact
    assert resolve(uri, {}) == (host, object_id)


@pytest.mark.parametrize(
    ("url", "prefix", "accession", "encoded"),
    [
        ("drs://drs.42:314159", "drs.42", "314159", "314159"),
        ("drs://dg.4503:5f1d3a-ab", "dg.4503", "5f1d3a-ab", "5f1d3a-ab"),
        ("drs://doi:10.5072/FK2805660V", "doi", "10.5072/FK2805660V", "10.5072%2FFK2805660V"),
        ("drs://mirror/Dg.4503:x:y", "mirror/dg.4503", "x:y", "x%3Ay"),
    ],
)
def test_compact_identifiers_resolve_only_through_the_sites_prefixes(
    url, prefix, accession, encoded
):
    uri = parse_drs_uri(url)
    assert (uri.prefix, uri.accession) == (prefix, accession)
    with pytest.raises(DrsUriError, match=r"compact identifier.*staging\.drs_prefixes"):
        resolve(uri, {})
    # The specification: the accession is percent-encoded into the DRS id.
    assert resolve(uri, {prefix: "drs.example.org"}) == ("drs.example.org", encoded)


@pytest.mark.parametrize(
    "url",
    [
        "drs://",
        "drs://host.example.org",
        "drs://host.example.org/",
        "drs://host.example.org/a b",
        "drs://host.example.org/a?x=1",
        "drs://bad_host!/x",
        "drs://:123",
        "drs://prefix:",
        "drs://pre fix:acc",
        "https://host/x",
    ],
)
def test_malformed_drs_uris_are_refused(url):
    with pytest.raises(DrsUriError):
        parse_drs_uri(url)


def test_an_id_is_percent_encoded_in_the_request_path():
    assert objects_url("h.org", "a/b c") == "https://h.org/ga4gh/drs/v1/objects/a%2Fb%20c"
    assert objects_url("h.org:8443", "a%2Fb") == "https://h.org:8443/ga4gh/drs/v1/objects/a%2Fb"


# --------------------------------------------------------------------------- the API


def post(client: testing.TestClient, **task: Any):  # type: ignore[no-untyped-def]
    return client.simulate_post("/ga4gh/tes/v1/tasks", json={**ECHO, **task})


def test_hostname_based_drs_inputs_are_accepted(tmp_path, sqlite_store):
    client = make_client(tmp_path, sqlite_store)
    inputs = [
        {"path": "/in/a", "url": "drs://drs.example.org/314159"},
        {"path": "/in/b", "url": "drs://127.0.0.1:8443/b", "type": "DIRECTORY"},
    ]
    assert post(client, inputs=inputs).status_code == 200


def test_a_compact_identifier_is_a_400_unless_the_site_maps_its_prefix(tmp_path, sqlite_store):
    inputs = [{"path": "/in/a", "url": "https://x/a"}, {"path": "/in/b", "url": "drs://dg.4503:b"}]
    result = post(make_client(tmp_path, sqlite_store), inputs=inputs)
    assert result.status_code == 400
    [error] = result.json["errors"]
    assert error["field"] == "inputs[1].url"
    assert "compact identifier" in error["message"] and "resolver" in error["message"]
    assert "staging.drs_prefixes" in error["message"]

    mapped = make_client(
        tmp_path, sqlite_store, '[staging.drs_prefixes]\n"dg.4503" = "gen3.example.org"\n'
    )
    assert post(mapped, inputs=inputs).status_code == 200


def test_malformed_drs_inputs_and_drs_outputs_are_a_400(tmp_path, sqlite_store):
    result = post(
        make_client(tmp_path, sqlite_store),
        inputs=[{"path": "/in/a", "url": "drs://host.example.org"}],
        outputs=[{"path": "/out/a", "url": "drs://host.example.org/out"}],
    )
    assert result.status_code == 400
    errors = {e["field"]: e["message"] for e in result.json["errors"]}
    assert set(errors) == {"inputs[0].url", "outputs[0].url"}
    assert "is neither drs://HOST/ID" in errors["inputs[0].url"]
    assert "read-only" in errors["outputs[0].url"]


def test_service_info_lists_drs_with_the_other_protocols(tmp_path, sqlite_store):
    storage = make_client(tmp_path, sqlite_store).simulate_get("/ga4gh/tes/v1/service-info")
    assert "drs://" in storage.json["storage"]


@pytest.mark.parametrize(
    ("toml", "why"),
    [
        ('[staging.drs_prefixes]\n"dg 4503" = "h.org"\n', "not a compact identifier prefix"),
        ('[staging.drs_prefixes]\n"dg.4503" = "https://h.org"\n', "not a host name"),
        ('[staging.drs_prefixes]\n"dg.4503" = "h.org:99999"\n', "outside 1-65535"),
    ],
)
def test_bad_drs_prefixes_are_config_errors(tmp_path, toml, why):
    (tmp_path / "c.toml").write_text(toml)
    with pytest.raises(ConfigError, match=f"staging.drs_prefixes.*{why}"):
        load_config(tmp_path / "c.toml", environ={})


def test_job_config_carries_the_tokens_file_path_never_a_token(tmp_path):
    tokens = tmp_path / "drs-tokens.toml"
    tokens.write_text('"drs.example.org" = "drs-secret-token-value"\n')
    (tmp_path / "c.toml").write_text(
        f'[staging]\ndrs_tokens_file = "{tokens}"\nca_bundle = "/etc/site-ca.pem"\n'
        '[staging.drs_prefixes]\n"DG.4503" = "Gen3.example.org"\n'
    )
    config = load_config(tmp_path / "c.toml", environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
    task = {"id": "t1", **ECHO, "inputs": [{"path": "/in/x", "url": "drs://dg.4503:abc"}]}
    script = prepare_task_dir(task, config=config, image_paths={"alpine": "/img.sif"})
    options = StagingOptions.from_dict(read_settings(script.parent / "job-config.json").staging)
    assert options.drs_tokens_file == str(tokens)
    assert options.ca_bundle == "/etc/site-ca.pem"
    assert options.drs_prefixes == (("dg.4503", "gen3.example.org"),)
    assert "drs" in options.enabled
    for name in ("job-config.json", "job.sh", "task.json"):
        assert "drs-secret-token-value" not in (script.parent / name).read_text()


# --------------------------------------------------------------------------- the job side


@pytest.fixture
def drs(drs_server: DrsServer, storage_servers: StorageServers, tmp_path: Path) -> DrsServer:
    """The DRS server, with the bearer tokens file a site would write for it."""
    (tmp_path / "drs-tokens.toml").write_text(drs_server.tokens_toml())
    return drs_server


def context(
    servers: StorageServers,
    drs: DrsServer,
    tmp_path: Path,
    notes: list[str] | None = None,
    **overrides: Any,
) -> StagingContext:
    options = {
        "ca_bundle": str(drs.ca),
        "drs_tokens_file": str(tmp_path / "drs-tokens.toml"),
        **overrides,
    }
    allowed = tmp_path / "allowed"
    allowed.mkdir(exist_ok=True)
    return StagingContext(
        allowed_dirs=[allowed],
        options=StagingOptions.from_dict(servers.staging_options(**options)),
        log=notes.append if notes is not None else print,
    )


def fetch(ctx: StagingContext, url: str, dest: Path, kind: str = "FILE") -> None:
    backend_for(url, ctx).download(url, dest, kind, ctx)  # type: ignore[arg-type]


def test_a_blob_over_https_arrives_whole_and_verified(drs, storage_servers, tmp_path):
    data = b"over https\n" * 1000
    drs.blob("u-https", data)
    fetch(context(storage_servers, drs, tmp_path), drs.uri("u-https"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data


def test_a_blob_from_s3_is_verified_by_md5_when_it_has_no_sha256(drs, storage_servers, tmp_path):
    data = b"s3 blob\n" * 999
    storage_servers.put("s3", "drs/u-s3.bin", data)
    md5 = hashlib.md5(data).hexdigest()
    drs.blob("u-s3", data, urls=[f"s3://{BUCKET}/drs/u-s3.bin"], checksums={"md5": md5})
    notes: list[str] = []
    fetch(context(storage_servers, drs, tmp_path, notes), drs.uri("u-s3"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data and notes == []

    drs.blob("u-s3-bad", data, urls=[f"s3://{BUCKET}/drs/u-s3.bin"], checksums={"md5": "0" * 32})
    with pytest.raises(StagingError, match=f"md5 is {'0' * 32}, the bytes fetched have {md5}"):
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-s3-bad"), tmp_path / "y")


def test_a_file_access_in_an_allowed_directory_comes_first(drs, storage_servers, tmp_path):
    data = b"on the shared filesystem\n"
    ctx = context(storage_servers, drs, tmp_path)
    (tmp_path / "allowed" / "f.txt").write_bytes(data)
    # The server lists HTTPS first, whose bytes would fail the checksum: only the file method,
    # taken first, stages the input.
    stale = drs.put_blob("u-file-stale", b"a stale copy\n")
    drs.blob("u-file", data, urls=[stale, f"file://{tmp_path}/allowed/f.txt"])
    fetch(ctx, drs.uri("u-file"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data


def test_when_one_access_method_fails_the_next_is_tried(drs, storage_servers, tmp_path):
    data = b"second method\n"
    outside = tmp_path / "outside.txt"
    outside.write_bytes(data)
    drs.blob("u-next", data, urls=[f"file://{outside}", drs.put_blob("u-next", data)])
    fetch(context(storage_servers, drs, tmp_path), drs.uri("u-next"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data

    drs.blob("u-none-works", data, urls=[f"file://{outside}", f"https://{drs.host}/blobs/gone"])
    with pytest.raises(StagingError) as failed:
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-none-works"), tmp_path / "y")
    message = str(failed.value)
    assert "no access method worked" in message and "outside the allowed directories" in message
    assert "HTTP 404" in message and not (tmp_path / "y").exists()


def test_an_access_id_is_exchanged_for_a_url_and_its_headers(drs, storage_servers, tmp_path):
    data = b"behind /access\n"
    drs.access_only("u-access", data)
    fetch(context(storage_servers, drs, tmp_path), drs.uri("u-access"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data


def test_a_bundle_becomes_a_directory_with_its_nested_bundles(drs, storage_servers, tmp_path):
    drs.blob("u-b1", b"one\n")
    drs.access_only("u-b2", b"two\n")
    drs.bundle("u-inner", {"two.txt": "u-b2"})
    drs.bundle("u-bundle", {"one.txt": "u-b1", "sub": "u-inner"})
    ctx = context(storage_servers, drs, tmp_path)
    fetch(ctx, drs.uri("u-bundle"), tmp_path / "tree", "DIRECTORY")
    assert (tmp_path / "tree" / "one.txt").read_bytes() == b"one\n"
    assert (tmp_path / "tree" / "sub" / "two.txt").read_bytes() == b"two\n"

    with pytest.raises(
        StagingError, match="bundle of 2 objects: declare the input `type: DIRECTORY`"
    ):
        fetch(ctx, drs.uri("u-bundle"), tmp_path / "file")
    with pytest.raises(
        StagingError, match="single blob, not a bundle: declare the input `type: FILE`"
    ):
        fetch(ctx, drs.uri("u-b1"), tmp_path / "dir", "DIRECTORY")


def test_a_bundle_whose_listing_disagrees_with_its_checksum_fails(drs, storage_servers, tmp_path):
    drs.blob("u-c1", b"c1\n")
    drs.blob("u-c2", b"c2\n")
    doc = drs.bundle("u-cb", {"c1": "u-c1"})
    # The listing gained a content after the checksum was computed.
    doc["contents"].append({"name": "c2", "id": "u-c2"})
    drs.put_object("u-cb", {k: v for k, v in doc.items() if k not in ("id", "self_uri")})
    with pytest.raises(StagingError, match=r"the bundle's sha-256 is \w+; its contents' checksums"):
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-cb"), tmp_path / "t", "DIRECTORY")


@pytest.mark.parametrize("name", ["..", "a/b", ""])
def test_a_bundle_content_name_that_would_climb_out_is_refused(
    drs, storage_servers, tmp_path, name
):
    drs.blob("u-n1", b"n\n")
    drs.put_object(
        "u-evil",
        {"size": 2, "checksums": [{"type": "sha-256", "checksum": "0"}],
         "contents": [{"name": name, "id": "u-n1"}]},
    )  # fmt: skip
    with pytest.raises(StagingError, match="cannot be placed safely"):
        fetch(
            context(storage_servers, drs, tmp_path), drs.uri("u-evil"), tmp_path / "t", "DIRECTORY"
        )
    assert not (tmp_path / "n").exists()


def test_a_bundle_that_contains_itself_is_refused(drs, storage_servers, tmp_path):
    drs.put_object(
        "u-loop",
        {"size": 0, "checksums": [{"type": "sha-256", "checksum": "0"}],
         "contents": [{"name": "again", "id": "u-loop"}]},
    )  # fmt: skip
    with pytest.raises(StagingError, match="which contains it"):
        fetch(
            context(storage_servers, drs, tmp_path), drs.uri("u-loop"), tmp_path / "t", "DIRECTORY"
        )


def test_bearer_tokens_come_from_the_sites_tokens_file(drs, storage_servers, tmp_path):
    data = b"private\n"
    drs.access_only("u-private", data, auth="bearer")
    fetch(context(storage_servers, drs, tmp_path), drs.uri("u-private"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data

    without = context(storage_servers, drs, tmp_path, drs_tokens_file=None)
    with pytest.raises(
        StagingError, match=f"bearer token for {drs.host} in staging.drs_tokens_file"
    ):
        fetch(without, drs.uri("u-private"), tmp_path / "y")
    (tmp_path / "wrong.toml").write_text(f'"{drs.host}" = "not-the-token"\n')
    wrong = context(storage_servers, drs, tmp_path, drs_tokens_file=str(tmp_path / "wrong.toml"))
    with pytest.raises(StagingError, match="refused the bearer token") as refused:
        fetch(wrong, drs.uri("u-private"), tmp_path / "z")
    assert "not-the-token" not in str(refused.value)


def test_an_unreadable_tokens_file_is_named_without_its_content(drs, storage_servers, tmp_path):
    (tmp_path / "bad.toml").write_text(f'"{drs.host}" = secret-without-quotes\n')
    drs.blob("u-tok", b"t\n")
    ctx = context(storage_servers, drs, tmp_path, drs_tokens_file=str(tmp_path / "bad.toml"))
    with pytest.raises(StagingError, match="is not valid TOML") as failed:
        fetch(ctx, drs.uri("u-tok"), tmp_path / "x")
    assert "secret-without-quotes" not in str(failed.value)


def test_an_object_being_prepared_is_asked_again(drs, storage_servers, tmp_path):
    drs.blob("u-202", b"ready now\n", accepted_once=True)
    fetch(context(storage_servers, drs, tmp_path), drs.uri("u-202"), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == b"ready now\n"


def test_no_usable_access_method_names_what_was_offered(drs, storage_servers, tmp_path):
    drs.blob("u-gs", b"g\n", urls=[], methods=[{"type": "gs", "access_url": {"url": "gs://b/k"}}])
    with pytest.raises(StagingError, match=r"offers: gs; enabled here: file, http, https, s3, ftp"):
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-gs"), tmp_path / "x")
    # A disabled protocol is passed over like an unknown one.
    drs.blob("u-s3-off", b"s\n", urls=[f"s3://{BUCKET}/drs/off"])
    off = context(storage_servers, drs, tmp_path, enabled=["file", "https", "drs"])
    with pytest.raises(StagingError, match=r"offers: s3; enabled here: file, https"):
        fetch(off, drs.uri("u-s3-off"), tmp_path / "y")


def test_a_missing_object_and_an_untrusted_certificate_are_clear(drs, storage_servers, tmp_path):
    with pytest.raises(StagingError, match="no such DRS object \\(HTTP 404\\)"):
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-absent"), tmp_path / "x")
    drs.blob("u-tls", b"t\n")
    untrusted = context(storage_servers, drs, tmp_path, ca_bundle=None)
    with pytest.raises(StagingError, match=r"TLS failed.*staging\.ca_bundle"):
        fetch(untrusted, drs.uri("u-tls"), tmp_path / "y")


def test_a_mapped_compact_identifier_reaches_its_server(drs, storage_servers, tmp_path):
    drs.blob("u-compact", b"compact\n")
    ctx = context(storage_servers, drs, tmp_path, drs_prefixes={"drs.test": drs.host})
    fetch(ctx, "drs://drs.test:u-compact", tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == b"compact\n"


def test_an_object_without_sha256_or_md5_is_staged_with_a_note(drs, storage_servers, tmp_path):
    drs.blob("u-crc", b"crc\n", checksums={"crc32c": "abcd"})
    notes: list[str] = []
    fetch(context(storage_servers, drs, tmp_path, notes), drs.uri("u-crc"), tmp_path / "x")
    assert notes == [
        f"{drs.uri('u-crc')}: no sha-256 or md5 checksum (the object has crc32c); "
        "the bytes were not verified"
    ]


def test_a_size_that_disagrees_fails(drs, storage_servers, tmp_path):
    doc = drs.blob("u-size", b"four")
    drs.put_object(
        "u-size", {**{k: v for k, v in doc.items() if k not in ("id", "self_uri")}, "size": 5}
    )
    with pytest.raises(StagingError, match="4 bytes arrived; the DRS object has 5"):
        fetch(context(storage_servers, drs, tmp_path), drs.uri("u-size"), tmp_path / "x")


def test_stage_in_with_a_wrong_checksum_fails_saying_so_and_leaks_no_token(
    drs, storage_servers, tmp_path
):
    good, bad, original = b"good\n", b"tampered\n", b"original\n"
    drs.access_only("si-good", good, auth="bearer")
    drs.blob("si-bad", bad, checksums={"sha-256": sha256(original)})
    task = TaskDir(
        tmp_path,
        storage_servers,
        {
            "inputs": [
                {"path": "/in/good.txt", "url": drs.uri("si-good")},
                {"path": "/in/bad.txt", "url": drs.uri("si-bad")},
            ]
        },
    )
    settings = json.loads(task.layout.job_config.read_text())
    settings["staging"].update(
        ca_bundle=str(drs.ca), drs_tokens_file=str(tmp_path / "drs-tokens.toml")
    )
    task.layout.job_config.write_text(json.dumps(settings))
    assert stage_in(task.layout.task_dir, task.records) == STAGE_FAILED
    [line] = read_records(task.layout.task_dir, "1", keep_bytes=1024).system_logs
    assert line.startswith(f"input 1 {drs.uri('si-bad')} -> /in/bad.txt: checksum mismatch: ")
    assert f"sha-256 is {sha256(original)}, the bytes fetched have {sha256(bad)}" in line
    assert task.host("/in/good.txt").read_bytes() == good
    everything = line + task.layout.job_config.read_text()
    for secret in drs.secrets:
        assert secret not in everything

    task.layout.task_json.write_text(
        json.dumps(
            {"id": "t1", **ECHO, "inputs": [{"path": "/in/good.txt", "url": drs.uri("si-good")}]}
        )
    )
    assert stage_in(task.layout.task_dir, task.records) == STAGE_OK


def test_outputs_to_drs_are_refused_by_the_job_side_too(drs, storage_servers, tmp_path):
    ctx = context(storage_servers, drs, tmp_path)
    with pytest.raises(StagingError, match="DRS is read-only"):
        backend_for(drs.uri("out"), ctx).ensure_directory(drs.uri("out"), ctx)
