"""Stores in object storage against a local S3 server (moto's server mode, in this process): convert to a URL,
stage / verify / info from it, a half-finished upload refused, faults injected between the client and the
server by a small HTTP proxy (a dropped connection and 5xx answers mid-range, retried and resumed; a hung server
waited for within the retry budget, then named in one line; a truncated, damaged or missing object named) with
nothing wrong delivered, and a loader streaming the store in shards through a cache smaller than the dataset: the
local store's batches in the same order, the budget kept; a record damaged in the bucket named, skipped and counted
as a local store's, a cached shard damaged on disk fetched again."""
from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from fastload.store import open_store
from fastload.store.base import Store, StoreError
from store_helpers import check_staged_copy_alone, run_cli

moto_server = pytest.importorskip("moto.server", reason="moto[server] (the dev extra) runs the local S3 server")
pytest.importorskip("boto3", reason="boto3 (the s3 extra) is the S3 client")

REPO = Path(__file__).resolve().parents[1]
BUCKET = "fastload-test"
SECRET = "s3cr3t-never-printed"


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A local S3 server and the AWS_* environment that points boto3 at it, for this module only (undone after)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           # no user configuration from this machine's files
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env
    server.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny synthetic dataset and its train split's lmdb, encoded and disk stores converted locally: (data.yaml,
    local stores' yaml)."""
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.convert import convert

    root = tmp_path_factory.mktemp("objds")
    yaml_path = make_synthetic_dataset(root / "ds", n_train=12, n_val=2, nc=3, seed=3, max_size=160)
    local = convert(yaml_path, "lmdb,encoded,disk", out=root / "local", imgsz=64, splits="train", workers=1, progress=False,
                    log=lambda *_: None)
    return yaml_path, local.yaml_path


@pytest.fixture(scope="module")
def uploaded(s3_env, dataset) -> str:
    """The dataset's train split converted to lmdb, encoded and disk by `fastload convert --out s3://...`; its URL."""
    url = f"s3://{BUCKET}/stores/synth"
    rc = run_cli(["convert", str(dataset[0]), "--to", "lmdb,encoded,disk", "--split", "train", "--imgsz", "64", "--workers",
                  "1", "--out", url, "--no-progress"])
    assert rc == 0
    return url


def _client():
    from fastload.store.objects.client import s3_client

    return s3_client()


def _keys(prefix: str) -> list[str]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _copy_prefix(src_url: str, dst: str) -> str:
    """Copy every object of the store at ``src_url`` under the prefix ``dst``; the copy's URL."""
    src = src_url.split(f"s3://{BUCKET}/", 1)[1]
    for key in _keys(src + "/"):
        _client().copy_object(Bucket=BUCKET, Key=dst + key[len(src):], CopySource={"Bucket": BUCKET, "Key": key})
    return f"s3://{BUCKET}/{dst}"


def _record_fetches(stored, monkeypatch) -> tuple[list[int], threading.Semaphore]:
    """The shards ``stored`` downloads from now on, in order, and a semaphore released once per download."""
    fetched: list[int] = []
    arrived = threading.Semaphore(0)
    real_fetch = stored._fetch_shard

    def recorded(shard: int, dest: Path, stop=None) -> None:
        real_fetch(shard, dest, stop)
        fetched.append(shard)
        arrived.release()

    monkeypatch.setattr(stored, "_fetch_shard", recorded)
    return fetched, arrived


def _assert_same_records(yaml_a: Path, yaml_b: Path) -> None:
    for kind in ("lmdb", "encoded", "disk"):
        with open_store(yaml_a, "train", kind=kind, imgsz=64) as a, open_store(yaml_b, "train", kind=kind, imgsz=64) as b:
            assert len(a) == len(b) > 0
            for i in range(len(a)):
                np.testing.assert_array_equal(np.asarray(a.read_image(i)), np.asarray(b.read_image(i)))
                np.testing.assert_array_equal(a.labels[i], b.labels[i])


def test_convert_to_url_uploads_a_build_and_the_manifest_last(uploaded):
    keys = _keys("stores/synth/")
    manifest = json.loads(_client().get_object(Bucket=BUCKET, Key="stores/synth/fastload-manifest.json")["Body"].read())
    build = f"stores/synth/builds/{manifest['build']}/"
    assert sorted(build + o["path"] for o in manifest["objects"]) == [k for k in keys if k.startswith(build)]
    assert keys == sorted([build + o["path"] for o in manifest["objects"]] + ["stores/synth/fastload-manifest.json"])
    assert {"data.yaml", "train.lmdb/data.mdb", "train-64.disk/pixels.bin", "train-64.disk/meta.json"} <= {
        o["path"] for o in manifest["objects"]}


def test_stage_from_url_equals_the_local_stores(uploaded, dataset, tmp_path, capsys):
    target = tmp_path / "staged"
    assert run_cli(["stage", uploaded, "--to", str(target), "--no-progress"]) == 0
    assert "every record verified" in capsys.readouterr().out
    _assert_same_records(target / "data.yaml", dataset[1])
    assert run_cli(["unstage", str(target)]) == 0 and not target.exists()


def test_a_store_staged_from_a_url_is_self_contained(s3_env, tmp_path, capsys):
    import yaml

    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.store.upload import convert_to_url

    data = make_synthetic_dataset(tmp_path / "ds", n_train=4, n_val=2, nc=3, seed=1, max_size=96)
    url = f"s3://{BUCKET}/stores/self-contained"
    convert_to_url(data, "lmdb", url, imgsz=64, splits="train", workers=1, progress=False, log=lambda *_: None)
    target = tmp_path / "staged"
    assert run_cli(["stage", url, "--to", str(target), "--no-progress"]) == 0
    assert yaml.safe_load((target / "data.yaml").read_text())["path"] == str(target)  # not the converting machine's
    check_staged_copy_alone(target, tmp_path / "ds", capsys)  # as on a node that never had the images
    assert run_cli(["info", str(target)]) == 0  # the val split, not converted, is named as absent
    assert "[val] no store of it here, and its images are not at " in capsys.readouterr().out


def test_info_and_verify_accept_the_url(uploaded, dataset, capsys):
    capsys.readouterr()
    assert run_cli(["info", uploaded, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == uploaded and info["uploaded"]["objects"] > 0
    with open_store(dataset[1], "train", kind="lmdb") as local:
        assert info["splits"]["train"]["images"] == len(local)
        assert info["splits"]["train"]["instances"] == sum(len(lb) for lb in local.labels)
    assert info["splits"]["train"]["stores"] == {"lmdb": "train.lmdb", "encoded": "train.encoded", "disk": "train-64.disk"}
    assert run_cli(["info", uploaded, "--split", "train"]) == 0
    assert "[train]" in capsys.readouterr().out
    assert run_cli(["info", uploaded, "--split", "val"]) == 2  # the upload holds the train split only
    assert run_cli(["verify", uploaded, "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"OK {uploaded}/") for line in lines), lines


def test_label_points_travel_through_an_upload_stage_and_stream(s3_env, tmp_path, capsys):
    """A segment dataset's points, uploaded in every uploadable kind: staged back, streamed (disk and encoded) and
    counted by info from the manifest, bit-exact; verify on the URL covers them."""
    from fastload.data.index import build_index
    from fastload.data.synthetic import make_synthetic_dataset

    y = make_synthetic_dataset(tmp_path / "seg", n_train=5, n_val=0, seed=6, max_size=120, task="segment")
    index = build_index(y, "train", progress=False)
    url = f"s3://{BUCKET}/stores/segment"
    assert run_cli(["convert", str(y), "--to", "lmdb,encoded,disk", "--split", "train", "--imgsz", "64", "--workers",
                    "1", "--out", url, "--no-progress"]) == 0
    assert run_cli(["stage", url, "--to", str(tmp_path / "staged"), "--no-progress"]) == 0
    opened = [open_store(tmp_path / "staged" / "data.yaml", "train", kind=kind, imgsz=64)
              for kind in ("lmdb", "encoded", "disk")]
    opened += [open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path / f"cache-{kind}", upload_kind=kind)
               for kind in ("encoded", "disk")]
    for store in opened:
        with store:
            assert store.labels.points.tobytes() == index.labels.points.tobytes(), store
            np.testing.assert_array_equal(store.labels.point_offsets, index.labels.point_offsets)
            store.read_image(len(store) - 1)  # its crc32 covers the points
    capsys.readouterr()
    assert run_cli(["info", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["splits"]["train"]
    assert stats["polygons"] == len(index.labels.rows) and stats["obb_shaped"] == int((index.labels.point_counts == 4).sum())
    assert run_cli(["verify", url, "--no-progress"]) == 0


def test_a_url_that_already_holds_a_store_is_refused_before_converting(uploaded, dataset, capsys):
    capsys.readouterr()
    assert run_cli(["convert", str(dataset[0]), "--to", "lmdb", "--out", uploaded, "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "already holds a fastload store" in captured.err and "--force" in captured.err
    assert "scanning" not in captured.out  # refused before any work
    assert run_cli(["convert", str(dataset[0]), "--to", "ram", "--out", uploaded + "-ram", "--no-progress"]) == 1
    assert "not uploaded" in capsys.readouterr().err


def test_a_half_uploaded_store_is_refused_and_cleaned_by_the_next_upload(s3_env, dataset, tmp_path, monkeypatch,
                                                                        capsys):
    from fastload.store.objects import manifest as manifest_mod
    from fastload.store.upload import convert_to_url
    from fastload.store.objects.manifest import publish

    real_upload = manifest_mod.upload

    def upload_then_die(*args, **kwargs):  # every object is uploaded, the manifest is never written
        real_upload(*args, **kwargs)
        raise KeyboardInterrupt

    url = f"s3://{BUCKET}/half"
    monkeypatch.setattr(manifest_mod, "upload", upload_then_die)
    with pytest.raises(KeyboardInterrupt):
        convert_to_url(dataset[0], "lmdb", url, imgsz=64, splits="train", workers=1, progress=False,
                       log=lambda *_: None)
    orphans = _keys("half/builds/")
    assert orphans and not _keys("half/fastload-manifest.json")
    capsys.readouterr()
    for argv in (["stage", url, "--to", str(tmp_path / "x"), "--no-progress"], ["info", url],
                 ["verify", url, "--no-progress"]):
        assert run_cli(argv) == 1
        text = " ".join(capsys.readouterr()[:2])
        assert f"{url} holds no finished fastload store" in text and "interrupted" in text, text
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(manifest_mod, "upload", real_upload)
    publish([(dataset[0], "data.yaml")], url, info={}, log=lambda *_: None)
    assert not set(orphans) & set(_keys("half/"))  # the interrupted upload's objects are gone
    assert len(_keys("half/")) == 2  # the new upload's one object and its manifest


def test_a_second_conversion_to_the_same_url_on_this_machine_refuses(s3_env, dataset, capsys):
    from fastload.store.shm import flock_current
    from fastload.store.upload import work_folder

    url = f"s3://{BUCKET}/stores/locked"
    work = work_folder(url)
    held = flock_current(work.with_name(work.name + ".lock"))  # a conversion to the URL running (its lock)
    os.pwrite(held, b"4242", 0)
    work.mkdir(exist_ok=True)
    (work / "being-built").write_text("the running conversion's")
    try:
        assert run_cli(["convert", str(dataset[0]), "--to", "lmdb", "--split", "train", "--workers", "1", "--out", url,
                        "--no-progress"]) == 1
        assert (work / "being-built").is_file()  # its work folder left alone
    finally:
        os.close(held)
        shutil.rmtree(work, ignore_errors=True)
    assert f"another `fastload convert --out {url}` (pid 4242) runs on this machine" in capsys.readouterr().err
    assert not _keys("stores/locked/")  # nothing uploaded


def test_an_interrupted_conversion_to_a_url_resumes_and_uploads(s3_env, dataset, monkeypatch, capsys):
    from fastload.store.lmdb_store import LmdbWriter
    from fastload.store.upload import work_folder

    url = f"s3://{BUCKET}/resumed"
    argv = ["convert", str(dataset[0]), "--to", "lmdb", "--split", "train", "--workers", "1", "--out", url,
            "--no-progress"]
    real_commit = LmdbWriter.commit

    def interrupted(self, *args, **kwargs):  # Ctrl-C once every record is written, before the store is sealed
        raise KeyboardInterrupt

    monkeypatch.setattr(LmdbWriter, "commit", interrupted)
    assert run_cli(argv) == 130
    err = capsys.readouterr().err
    assert f"nothing was uploaded to {url}" in err and "--resume" in err and not _keys("resumed/")
    monkeypatch.setattr(LmdbWriter, "commit", real_commit)
    assert run_cli(argv + ["--resume"]) == 0
    assert "resumed/fastload-manifest.json" in _keys("resumed/") and not work_folder(url).exists()


# ----------------------------------------------------------------------------- faults
class FaultyProxy:
    """An HTTP proxy in front of the S3 server that answers ranged GETs and PUTs of keys containing ``target``
    from a plan: ``"drop"`` sends the headers and half the body of a GET, then closes the connection (a PUT's
    connection is closed without an answer); ``"503"`` answers Service Unavailable. HEADs of paths containing
    ``target`` are answered from ``head_plan`` (``"503"``). Every ranged GET's path and Range header, every PUT's
    path and every such HEAD's path is recorded. :meth:`hang` makes it a hung server for the paths containing
    ``target`` (a stopped process: connections accepted, no request answered) until :meth:`resume`."""

    def __init__(self, upstream: str, target: str, plan: list[str], head_plan: tuple[str, ...] = ()) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.target, self.plan, self.ranges, self.puts, self.heads = target, list(plan), [], [], []
        self.head_plan = list(head_plan)
        self.answering = threading.Event()
        self.answering.set()
        self.unanswered = 0  # requests taken while hung
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                if self._hung():
                    return
                fault = None
                if proxy.target in self.path:
                    with threading.Lock():
                        proxy.heads.append(self.path)
                        fault = proxy.head_plan.pop(0) if proxy.head_plan else None
                if fault == "503":
                    self._unavailable(body=False)
                    return
                self._forward(body=False)

            def do_PUT(self) -> None:  # an upload: "drop" closes the connection without an answer
                if self._hung():
                    return
                payload = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fault = None
                if proxy.target in self.path:
                    with threading.Lock():
                        proxy.puts.append(self.path)
                        fault = proxy.plan.pop(0) if proxy.plan else None
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault == "503":
                    self._unavailable()
                    return
                self._forward(body=True, payload=payload)

            def do_GET(self) -> None:
                if self._hung():
                    return
                fault = None
                if "Range" in self.headers and proxy.target in self.path:
                    with threading.Lock():
                        proxy.ranges.append((self.path, self.headers["Range"]))
                        fault = proxy.plan.pop(0) if proxy.plan else None
                if fault == "503":
                    self._unavailable()
                    return
                self._forward(body=True, cut=fault == "drop")

            def _hung(self) -> bool:  # a hung server takes the request and never answers it
                if proxy.answering.is_set() or proxy.target not in self.path:
                    return False
                proxy.unanswered += 1
                proxy.answering.wait()
                self.close_connection = True
                return True

            def _unavailable(self, body: bool = True) -> None:
                payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _forward(self, *, body: bool, cut: bool = False, payload: bytes | None = None) -> None:
                conn = http.client.HTTPConnection(proxy.upstream, timeout=10)
                conn.request(self.command, self.path, body=payload, headers={k: v for k, v in self.headers.items()})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data[: len(data) // 2] if cut else data)
                if cut:
                    self.wfile.flush()
                    self.close_connection = True
                conn.close()

        class Server(http.server.ThreadingHTTPServer):
            request_queue_size = 128  # a burst of parallel connects waits in the backlog, as a real server's would

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def hang(self) -> None:
        self.answering.clear()

    def resume(self) -> None:
        self.answering.set()

    def close(self) -> None:
        self.resume()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy_for(s3_env, monkeypatch):
    proxies: list[FaultyProxy] = []

    def start(target: str, plan: list[str], head_plan: tuple[str, ...] = ()) -> FaultyProxy:
        proxy = FaultyProxy(s3_env["AWS_ENDPOINT_URL"], target, plan, head_plan)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


def test_a_dropped_connection_and_5xx_mid_range_are_retried_and_resumed(uploaded, dataset, proxy_for, tmp_path):
    from fastload.store.objects.client import RetryPolicy, s3_client
    from fastload.store.objects.manifest import read_manifest
    from fastload.store.objects.transfer import Download, download

    manifest = read_manifest(uploaded)
    rel = "train-64.disk/pixels.bin"
    size, crc = next((s, c) for path, s, c in manifest.objects if path == rel)
    part = 8 << 10
    assert size > 3 * part  # several ranges, so the faults land mid-object
    # the second range is cut halfway, then the third answered 503 twice
    proxy = proxy_for(rel, [None, "drop", None, "503", "503"])
    dest = tmp_path / "pixels.bin"
    stats = download(s3_client(), [Download(manifest.object_url(rel), size, crc, dest)], part_bytes=part, parallel=1,
                     policy=RetryPolicy(seconds=30, base_s=0.01))
    assert stats.retries == 3
    ranges = [r for _, r in proxy.ranges]
    # the dropped range resumed at the byte where the cut came, not at its start
    assert ranges[:4] == [f"bytes=0-{part - 1}", f"bytes={part}-{2 * part - 1}", f"bytes={part + part // 2}-{2 * part - 1}",
                          f"bytes={2 * part}-{3 * part - 1}"]
    assert dest.read_bytes() == (dataset[1].parent / rel).read_bytes()  # decoded pixels: the same in both conversions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pixels.bin"]  # no temporary file left


def test_an_upload_that_fails_midway_leaves_readers_the_old_store_or_none(uploaded, dataset, proxy_for, monkeypatch,
                                                                          capsys):
    from fastload.store.objects import client
    from fastload.store.objects.manifest import read_manifest

    monkeypatch.setattr(client, "WRITE_ATTEMPTS", 2)  # botocore's tries of a PUT
    monkeypatch.setenv("FASTLOAD_RETRY_SECONDS", "0")  # and no retry after them
    replaced = _copy_prefix(uploaded, "upload-fault")
    old = read_manifest(replaced)
    capsys.readouterr()
    for url, plan in ((replaced, ["drop", "503"]), (f"s3://{BUCKET}/upload-fault-new", ["503", "drop"])):
        proxy = proxy_for("pixels.bin", plan)  # the disk store's pixels: a dropped connection, then a 503
        argv = ["convert", str(dataset[0]), "--to", "disk", "--split", "train", "--imgsz", "64", "--workers", "1",
                "--out", url, "--no-progress", "--force"]
        assert run_cli(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(proxy.puts) == 2 and len(err) == 1, err  # tried twice, then one line naming the object
        assert err[0].startswith(f"fastload convert: {url}/builds/") and "pixels.bin: upload failed" in err[0], err
        assert f"nothing was published: readers of {url} still see what it held before" in err[0], err
        proxy.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.upstream}")
    # the replaced store is still what readers get, whole; the new prefix has nothing readers would take
    assert read_manifest(replaced) == old
    assert run_cli(["verify", replaced, "--no-progress"]) == 0
    assert run_cli(["info", f"s3://{BUCKET}/upload-fault-new"]) == 1
    assert "holds no finished fastload store" in capsys.readouterr().err


def test_an_upload_that_fails_past_botocores_tries_is_sent_again_within_the_budget(s3_env, dataset, proxy_for,
                                                                                    monkeypatch):
    from fastload.store.objects import client
    from fastload.store.objects.manifest import publish, read_manifest

    monkeypatch.setattr(client, "WRITE_ATTEMPTS", 1)  # botocore gives up at once: the budget's retries take over
    monkeypatch.setenv("FASTLOAD_RETRY_SECONDS", "30")
    url = f"s3://{BUCKET}/upload-retried"
    proxy = proxy_for("upload-retried/builds/", ["drop", "503"])  # a dropped connection, a 503, then through
    publish([(dataset[0], "data.yaml")], url, info={}, log=lambda *_: None)
    assert len(proxy.puts) == 3
    assert read_manifest(url).objects[0][0] == "data.yaml" and _client().get_object(
        Bucket=BUCKET, Key=f"upload-retried/builds/{read_manifest(url).build}/data.yaml")["Body"].read() == \
        dataset[0].read_bytes()


def test_a_range_that_keeps_failing_gives_up_naming_the_url(uploaded, proxy_for, tmp_path):
    from fastload.store.objects.client import RetryPolicy, s3_client
    from fastload.store.objects.manifest import read_manifest
    from fastload.store.objects.transfer import Download, download

    manifest = read_manifest(uploaded)
    items = [Download(manifest.object_url(rel), size, crc, tmp_path / rel) for rel, size, crc in manifest.objects
             if rel.startswith("train-64.disk/")]
    proxy = proxy_for("train-64.disk/pixels.bin", ["503"] * 1000)
    with pytest.raises(StoreError) as info:
        download(s3_client(), items, policy=RetryPolicy(seconds=0.3, base_s=0.01))
    message = str(info.value)
    assert str(manifest.object_url("train-64.disk/pixels.bin")) in message and "ServiceUnavailable" in message
    assert f"after {len(proxy.ranges)} tries in 0 s (retry budget: 0.3 s)" in message, message
    assert len(proxy.ranges) > 3  # retried until the budget was spent
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing half-downloaded, no temporary file left


@pytest.fixture
def short_timeouts(monkeypatch):
    """Timeouts of half a second (a hung server costs these tests little) and a wait reported from its first
    retry; the module :mod:`fastload.store.objects.client`."""
    from fastload.store.objects import client

    monkeypatch.setattr(client, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(client, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(client, "REPORT_AFTER_S", 0.0)
    monkeypatch.setattr(client, "_last_report", [-math.inf])  # no line said yet in this process
    monkeypatch.setattr(client, "_outage", [None, -math.inf])  # and no outage going on
    return client


def test_a_hung_server_is_retried_for_the_budget_then_one_line_names_the_url(uploaded, proxy_for, short_timeouts,
                                                                             monkeypatch, tmp_path, capsys):
    # the objects of the store hang (accepted, never answered); the manifest still answers
    proxy = proxy_for("/builds/", [])
    proxy.hang()
    monkeypatch.setenv("FASTLOAD_RETRY_SECONDS", "1")
    capsys.readouterr()
    began = time.monotonic()
    assert run_cli(["stage", uploaded, "--to", str(tmp_path / "x"), "--no-progress"]) == 1
    waited = time.monotonic() - began
    err = capsys.readouterr().err.strip().splitlines()
    # 16 requests in parallel, each retried: one line says the wait (once per REPORT_EVERY_S per process), one the end
    assert len(err) == 2 and proxy.unanswered > 16, (proxy.unanswered, err)
    # a hung server times out reads; one whose backlog is full (or a loaded machine) may time out the connect too
    wait_line = re.fullmatch(rf"fastload: ({re.escape(uploaded)}/builds/\S+) unavailable for 0 s \((Read|Connect)TimeoutError\); "
                             rf"retrying for up to 1 s more \(retry budget: FASTLOAD_RETRY_SECONDS=1\)", err[0])
    assert wait_line, err[0]
    assert re.fullmatch(rf"fastload stage: {re.escape(uploaded)}/builds/\S+: HEAD failed after \d+ tries in \d+ s "
                        rf"\(retry budget: FASTLOAD_RETRY_SECONDS=1\): (Read|Connect)TimeoutError: (Read|Connect) timeout on endpoint "
                        rf"URL: .*",
                        err[1]), err[1]
    assert 1 <= waited < 1 + 15  # the budget, then the last tries' timeouts: bounded, never botocore's 6 x 60 s
    assert SECRET not in "\n".join(err) and not (tmp_path / "x").exists()
    for budget, expected in (("0", f"{uploaded}/builds/"), ("ten", "FASTLOAD_RETRY_SECONDS='ten' in the environment: "
                                                                    "not a number of seconds >= 0")):
        monkeypatch.setenv("FASTLOAD_RETRY_SECONDS", budget)  # 0: one try, no retry; a bad value named
        assert run_cli(["stage", uploaded, "--to", str(tmp_path / "x"), "--no-progress"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and (budget != "0" or "after 1 try in 0 s" in err[0]), err
    with pytest.raises(ValueError, match="retry_seconds must be a number of seconds >= 0"):
        open_store(uploaded, kind="stream", retry_seconds=-1)


def test_an_outage_shorter_than_the_budget_is_only_a_wait_mid_epoch(uploaded, tmp_path, proxy_for, short_timeouts,
                                                                    capfd):
    import fastload

    def streamed(cache: Path):  # a shard per record, fetched one ahead of the loader
        return open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=cache, shard_bytes=1, read_ahead=1,
                          upload_kind="encoded", retry_seconds=30)

    with fastload.loader(streamed(tmp_path / "direct"), imgsz=64, batch_size=2, workers=0, seed=4) as uninterrupted:
        expected = list(uninterrupted)
    proxy = proxy_for("/builds/", [])
    store = streamed(tmp_path / "through-proxy")
    assert store.description["retry_seconds"] == 30  # what the Ray actors open it with
    got = []
    with fastload.loader(store, imgsz=64, batch_size=2, workers=0, seed=4) as ld:
        for batch in ld:
            got.append(batch)
            if len(got) == 1:  # the server hangs for 1 s in the middle of the epoch
                proxy.hang()
                threading.Timer(1.0, proxy.resume).start()
    assert proxy.unanswered > 0 and len(got) == len(expected) == 6
    for (imgs, targets, paths, _), (ref_imgs, ref_targets, ref_paths, _) in zip(got, expected):
        assert np.array_equal(np.asarray(imgs), np.asarray(ref_imgs))
        assert np.array_equal(np.asarray(targets), np.asarray(ref_targets)) and list(paths) == list(ref_paths)
    err = capfd.readouterr().err.strip().splitlines()
    records = str(store.records_url)
    assert err and all(re.fullmatch(rf"fastload: {re.escape(records)} unavailable for \d+ s \((Read|Connect)TimeoutError\); "
                                    rf"retrying for up to \d+ s more \(retry budget: retry_seconds=30\)", line)
                       for line in err), err


def test_a_read_ahead_stopped_during_an_outage_gives_up_its_retries(uploaded, tmp_path, proxy_for, short_timeouts):
    """A loader closed (or interrupted) while the server is down does not wait out the budget in its read-ahead."""
    store = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, shard_bytes=1, read_ahead=2,
                       upload_kind="encoded", retry_seconds=600)
    proxy = proxy_for("/builds/", [])
    proxy.hang()
    ahead = store.read_ahead(np.arange(len(store)))
    for _ in range(500):  # until the read-ahead's download is stuck on the hung server
        if proxy.unanswered:
            break
        time.sleep(0.01)
    assert proxy.unanswered
    stopping = threading.Thread(target=ahead.stop)
    stopping.start()
    stopping.join(timeout=60)  # the download's try in flight times out, then no retry: not the 600 s budget
    assert not stopping.is_alive() and store.cache.fetched == 0
    assert not [p for p in store.cache.folder.iterdir() if not p.name.endswith(".lock")]  # no partial shard left


def test_an_outage_past_the_budget_ends_the_read_ahead_and_the_reads_waiting_for_it(uploaded, tmp_path, proxy_for,
                                                                                     short_timeouts):
    """The read-ahead gives up on a shard after the budget and stops; the read that waited for that download raises
    its error rather than spend a budget of its own: the server is not asked again by either."""
    from fastload.store.objects.client import UnavailableError

    store = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, shard_bytes=1, read_ahead=2,
                       upload_kind="encoded", retry_seconds=1)
    proxy = proxy_for("/builds/", [])
    proxy.hang()
    ahead = store.read_ahead(np.arange(len(store)))  # downloads the shard of record 0 first
    for _ in range(500):
        if proxy.unanswered:
            break
        time.sleep(0.01)
    with pytest.raises(UnavailableError) as info:
        store.read_image(0)  # waits for the read-ahead's download of its shard, which gives up
    ahead._thread.join(timeout=30)
    assert not ahead._thread.is_alive()  # ended by itself: no other shard tried
    tries = re.search(rf"^{re.escape(str(store.records_url))}: HEAD failed after (\d+) tries in \d+ s", str(info.value))
    assert tries and proxy.unanswered == int(tries.group(1)), (proxy.unanswered, str(info.value))
    ahead.stop()


def test_a_missing_bucket_is_named_and_the_bucket_check_is_retried(s3_env, dataset, proxy_for, capsys):
    from fastload.store.objects.manifest import check_writable

    capsys.readouterr()
    argv = ["convert", str(dataset[0]), "--to", "encoded", "--out", "s3://nosuchbucket-fl/x", "--no-progress"]
    assert run_cli(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("fastload convert: s3://nosuchbucket-fl/x: the bucket nosuchbucket-fl does not exist (or these "
                   "credentials cannot see it)"), err
    proxy = proxy_for(f"/{BUCKET}", [], head_plan=("503", "503"))  # the bucket's HEAD answers 503 twice
    assert str(check_writable(f"s3://{BUCKET}/fresh")) == f"s3://{BUCKET}/fresh"
    assert proxy.heads == [f"/{BUCKET}"] * 3


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing"])
def test_a_damaged_object_is_one_error_naming_its_url(uploaded, tmp_path, damage, capsys):
    url = _copy_prefix(uploaded, f"damaged-{damage}")
    build = json.loads(_client().get_object(Bucket=BUCKET, Key=f"damaged-{damage}/fastload-manifest.json")["Body"]
                       .read())["build"]
    key = f"damaged-{damage}/builds/{build}/train-64.disk/pixels.bin"
    data = _client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    if damage == "missing":
        _client().delete_object(Bucket=BUCKET, Key=key)
    else:
        bad = data[:-100] if damage == "truncated" else data[:50] + bytes([data[50] ^ 1]) + data[51:]
        _client().put_object(Bucket=BUCKET, Key=key, Body=bad)
    expected = {"truncated": "truncated or replaced", "changed": "changed or damaged", "missing": "no such object"}
    capsys.readouterr()
    assert run_cli(["stage", url, "--to", str(tmp_path / "x"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"s3://{BUCKET}/{key}" in err and expected[damage] in err, err
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())  # nothing staged, no staging folder left
    assert run_cli(["verify", url, "--no-progress"]) == 1
    assert f"FAILED {url}: s3://{BUCKET}/{key}" in capsys.readouterr().out


def test_the_environment_configures_a_fresh_process_and_secrets_are_never_printed(uploaded, s3_env, capsys):
    code = "import sys; from fastload.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=str(REPO), **s3_env)
    ok = subprocess.run([sys.executable, "-c", code, "info", uploaded], env=env, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0 and "[train]" in ok.stdout, ok.stderr
    capsys.readouterr()
    assert run_cli(["verify", f"s3://{BUCKET}-absent/x", "--no-progress"]) == 1
    assert run_cli(["stage", f"s3://{BUCKET}/absent", "--to", "/nonexistent/x", "--no-progress"]) == 1
    bad = capsys.readouterr()
    assert "does not exist" in bad.out and "holds no finished fastload store" in bad.err
    assert SECRET not in ok.stdout + ok.stderr + bad.out + bad.err


def test_urls_are_checked_and_not_opened_as_paths(uploaded):
    from fastload.store.objects.urls import parse_url

    assert str(parse_url("s3://bkt/a/b/")) == "s3://bkt/a/b"
    for bad, why in (("gs://bkt/x", "only s3://"), ("s3:///x", "no bucket"), ("s3://bkt/a//b", "empty")):
        with pytest.raises(StoreError, match=why):
            parse_url(bad)
    with pytest.raises(StoreError, match="fastload stage"):
        open_store(uploaded + "/data.yaml", kind="lmdb")
    with pytest.raises(StoreError, match="not 640"):  # the upload's disk store was built at 64
        open_store(uploaded, kind="stream", imgsz=640, upload_kind="disk")
    with pytest.raises(ValueError, match="upload_kind must be one of auto, disk, encoded, got 'lmdb'"):
        open_store(uploaded, kind="stream", upload_kind="lmdb")


# ----------------------------------------------------------------------------- streaming
def test_a_streamed_loader_gives_the_local_batches_within_its_cache_budget(uploaded, dataset, tmp_path, monkeypatch):
    import fastload
    from fastload.store import stream

    with open_store(dataset[1], "train", kind="disk", imgsz=64) as local:
        record = int(np.diff(local.offsets).max())
        total = int(local.offsets[-1])
    # shards of at least two records, a cache of three of them beside the index files: well under the dataset
    shard_bytes = 2 * record
    options = dict(kind="stream", imgsz=64, cache_dir=tmp_path / "cache", shard_bytes=shard_bytes)
    with open_store(uploaded + "/data.yaml", "train", **options) as probe:
        resident = probe.cache.resident_bytes()
    budget = 3 * probe.cache.on_disk(shard_bytes) + resident
    assert budget - resident < total  # room for fewer shards than the dataset's
    with pytest.raises(StoreError, match=f"cache_bytes={budget - 1} cannot hold window \\+ 1 = 3 shards .*shard_bytes="
                                         f"{shard_bytes}.* in cache_dir {tmp_path / 'cache'}; raise cache_bytes"):
        open_store(uploaded + "/data.yaml", "train", cache_bytes=budget - 1, window=2, **options)
    stored = open_store(uploaded + "/data.yaml", "train", cache_bytes=budget, **options)
    cache = stored.cache
    shards = len(stored.bounds) - 1
    assert shards >= 4 and stored.read_ahead_shards == 2  # several shards; the default read-ahead fits the cache
    peak = []
    real_download = stream.download

    def measured(*args, **kwargs):  # the cache's bytes on disk while a shard downloads and once it is in
        peak.append(cache.used())
        real_download(*args, **kwargs)
        peak.append(cache.used())

    monkeypatch.setattr(stream, "download", measured)
    reached: list[int] = []
    real_reached = stream.ShardReadAhead.reached
    monkeypatch.setattr(stream.ShardReadAhead, "reached", lambda self, p: reached.append(p) or real_reached(self, p))
    streamed = fastload.loader(stored, imgsz=64, batch_size=2, workers=0, seed=5)
    assert streamed.engine.sampler.partners == "batch"  # the default for a streamed store
    batches = iter(streamed)
    got = [next(batches)]
    # the first batch arrived after the first shard (and those read ahead meanwhile), not the whole dataset
    assert 1 <= cache.fetched <= 1 + stored.read_ahead_shards < shards
    got += list(batches)
    # read ahead or on demand, every shard came once in the first epoch: none fetched ahead was pushed out
    assert cache.fetched == shards and cache.evicted > 0
    got += list(streamed)  # a second epoch: evicted shards are fetched again
    assert cache.fetched > shards
    assert reached == 2 * list(range(2, len(stored) + 1, 2))  # the loader told each epoch's read-ahead its place
    assert max(peak) <= budget and len(peak) == 2 * cache.fetched, peak
    # the local copy of the same store, read in the same shards
    reference = fastload.loader(open_store(dataset[1], "train", kind="disk", imgsz=64, shard_bytes=shard_bytes),
                                imgsz=64, batch_size=2, workers=0, seed=5)
    assert reference.engine.sampler.partners == "batch"
    expected = list(reference) + list(reference)
    assert len(got) == len(expected) == 2 * len(streamed)
    for (imgs, targets, paths, _), (ref_imgs, ref_targets, ref_paths, _) in zip(got, expected):
        assert np.array_equal(np.asarray(imgs), np.asarray(ref_imgs))
        assert np.array_equal(np.asarray(targets), np.asarray(ref_targets)) and list(paths) == list(ref_paths)
    streamed.close()
    reference.close()


def test_read_ahead_fetches_the_next_shards_of_the_order_as_the_consumer_moves(uploaded, tmp_path, monkeypatch):
    from fastload.order import shard_permutation

    with open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, read_ahead=0) as plain:
        record = int(np.diff(plain.offsets).max())
    stored = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, cache_bytes=1 << 20,
                        shard_bytes=2 * record, read_ahead=2)
    assert len(stored.bounds) - 1 >= 5
    fetched, arrived = _record_fetches(stored, monkeypatch)
    order = shard_permutation(stored.shards().ids, epoch=3, seed=1)
    need = list(dict.fromkeys(stored.shards().ids[order].tolist()))  # the shards in the order first needed
    starts = [int(np.flatnonzero(stored.shards().ids[order] == s)[0]) for s in need]
    size = [stored.cache.on_disk(n) for n in np.diff(stored.offsets[stored.bounds])]
    # room for the three shards the consumer needs once it reaches the second one, not for a fourth
    stored.cache.budget = (stored.cache.resident_bytes() + size[need[1]] + size[need[2]]
                           + max(size[need[0]], size[need[3]]))
    ahead = stored.read_ahead(order)
    for _ in range(3):  # the consumer at position 0: its shard and the next two
        assert arrived.acquire(timeout=30)
    stored.read_image(int(order[0]))  # the first shard is read after the others arrived: the most recently used
    stored.close()  # and let go (unmapped), as reading the second shard would: a shard a process maps is never removed
    ahead.reached(starts[1])  # the consumer reached the second shard: one more comes, in place of the first
    assert arrived.acquire(timeout=30)
    ahead.stop()
    assert fetched == need[:4]  # in the order's order, never beyond the depth
    # the first shard, behind the consumer, made room; the second, fetched ahead before the first's last read, stays
    assert [stored.cache.path(s).exists() for s in need[:4]] == [False, True, True, True]
    assert stored.read_image(int(order[starts[3]])).shape[2] == 3 and stored.cache.fetched == 4  # read from the cache
    assert open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, read_ahead=0).read_ahead(order) is None
    with pytest.raises(ValueError, match="read_ahead must be >= 0"):
        open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, read_ahead=-1)


def _damage_in_bucket(uploaded: str, prefix: str, records: str, at: int) -> str:
    """The URL of a copy of the upload under ``prefix`` whose records file (``records``, inside the build) has
    byte ``at`` flipped, same size: only the record checksums can tell."""
    url = _copy_prefix(uploaded, prefix)
    build = json.loads(_client().get_object(Bucket=BUCKET, Key=f"{prefix}/fastload-manifest.json")["Body"].read())["build"]
    key = f"{prefix}/builds/{build}/{records}"
    data = bytearray(_client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[at] ^= 0xFF
    _client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    return url


def _flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        byte = os.pread(f.fileno(), 1, at)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0xFF]), at)


RECORDS_OF = {"disk": "train-64.disk/pixels.bin", "encoded": "train.encoded/images.bin"}


@pytest.mark.parametrize("upload_kind", ["disk", "encoded"])
def test_a_record_damaged_in_the_bucket_is_named_never_served_and_its_shard_kept(uploaded, dataset, tmp_path,
                                                                                 upload_kind, monkeypatch):
    from fastload.store.base import DamagedRecordError

    url = _damage_in_bucket(uploaded, f"stream-damaged-{upload_kind}", RECORDS_OF[upload_kind], 10)
    with open_store(dataset[1], "train", kind=upload_kind, imgsz=64) as local:
        expected = [np.asarray(local.read_image(i)).copy() for i in range(len(local))]
        shard_bytes = int(local.offsets[3])  # records 0-2 in the first shard
    stored = open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path, cache_bytes=8 << 20,
                        shard_bytes=shard_bytes, upload_kind=upload_kind)
    assert stored.upload_kind == upload_kind and stored.decoded == (upload_kind == "disk")
    assert stored.bounds[1] == 3 < len(stored)  # record 0 shares its shard; other shards follow
    source_reads = []
    real_read = stored._record_at_source
    monkeypatch.setattr(stored, "_record_at_source", lambda i: source_reads.append(i) or real_read(i))
    for _ in range(2):
        with pytest.raises(DamagedRecordError) as err:
            stored.read_image(0)
        message = str(err.value)
        assert "\n" not in message and err.value.kind == "checksum"
        assert f"{stored.path}, record 0 ({stored.im_files[0]}): crc32 mismatch in the uploaded object" in message
    # read again from the bucket once when downloaded, once on the first read; then known in this process
    assert source_reads == [0, 0] and stored.cache.fetched == 1 and stored.refetched == 0
    assert stored.cache.path(0).is_file()  # the shard is kept: its other records are good
    for i in range(1, len(stored)):  # they, and the other shards, read as the local store's
        assert np.array_equal(np.asarray(stored.read_image(i)), expected[i])
    assert stored.refetched == 0 and source_reads == [0, 0]


def test_a_record_damaged_on_the_way_is_read_again_and_repaired_before_its_shard_is_kept(uploaded, dataset, tmp_path,
                                                                                          monkeypatch):
    import dataclasses

    from fastload.store import stream

    with open_store(dataset[1], "train", kind="disk", imgsz=64) as local:
        expected = [np.asarray(local.read_image(i)).copy() for i in range(2)]
    stored = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path, shard_bytes=int(expected[0].nbytes),
                        upload_kind="disk")
    real_download = stream.download
    downloads = []

    def first_one_damaged(client, items, **options):  # the shard's download: byte 10 of its first record flipped on the way
        downloads.append(items[0].size)
        if len(downloads) == 1:
            def damaged_then_checked(downloaded: Path, check=items[0].check) -> None:
                _flip_byte(downloaded, 10)
                check(downloaded)
            items = [dataclasses.replace(items[0], check=damaged_then_checked)]
        return real_download(client, items, **options)

    monkeypatch.setattr(stream, "download", first_one_damaged)
    source_reads = []
    real_read = stored._record_at_source
    monkeypatch.setattr(stored, "_record_at_source", lambda i: source_reads.append(i) or real_read(i))
    assert np.array_equal(np.asarray(stored.read_image(1)), expected[1])  # shard 1: record 1
    assert source_reads == [1] and stored.refetched == 0 and stored.cache.fetched == 1
    assert downloads[1] == stored.nbytes(1) and len(downloads) == 2  # the shard, then record 1 alone
    assert stored.record_ok(1)  # the cached shard holds the bucket's bytes


def _epoch_and_warnings(data, **kw) -> tuple[list, dict, list[str]]:
    """One epoch's batches of a loader on ``data``, its stats, and the damaged-record warnings it gave."""
    import warnings

    import fastload
    from fastload.engines.base import DamagedRecordWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastload.loader(data, imgsz=64, batch_size=2, seed=5, **kw) as ld:
            batches = [(np.asarray(imgs).copy(), np.asarray(targets).copy(), list(paths)) for imgs, targets, paths, _ in ld]
            stats = ld.stats()
    return batches, stats, [str(w.message) for w in caught if issubclass(w.category, DamagedRecordWarning)]


def test_a_streamed_loader_skips_a_record_damaged_in_the_bucket_as_a_local_store_does(uploaded, dataset, tmp_path):
    from fastload.store.base import DamagedRecordError
    from fastload.store.packed import PIXELS

    record = 3
    with open_store(dataset[1], "train", kind="disk", imgsz=64) as local:
        at = int(local.offsets[record]) + 10
        shard_bytes = 2 * int(np.diff(local.offsets).max())
        damaged_local = Path(shutil.copytree(local.path, tmp_path / "local.disk"))
    _flip_byte(damaged_local / PIXELS, at)  # the same byte of the same record, in a local copy
    url = _damage_in_bucket(uploaded, "stream-damaged-loader", RECORDS_OF["disk"], at)

    def streamed() -> Store:
        return open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path / "cache", shard_bytes=shard_bytes,
                          upload_kind="disk")

    # the damaged local copy, read in the same shards
    in_shards = open_store(damaged_local, kind="disk", imgsz=64, shard_bytes=shard_bytes)
    expected, local_stats, _ = _epoch_and_warnings(in_shards, workers=0)
    assert local_stats["damaged_record_ids"] == [record]
    for workers in (0, 2):
        store = streamed()
        got, stats, warned = _epoch_and_warnings(store, workers=workers)
        file = store.im_files[record]
        assert len(warned) == 1 and f"{store.path}, record {record} ({file}): crc32 mismatch in the uploaded" in warned[0]
        assert stats["damaged_records"] == 1 and stats["damaged_record_ids"] == [record]
        assert stats["damaged_by_kind"]["checksum"] == 1
        assert stats["replaced_samples"] == local_stats["replaced_samples"] >= 1
        assert all(file not in paths for _, _, paths in got)  # never delivered; every other record is
        assert {p for _, _, paths in got for p in paths} == set(store.im_files) - {file}
        assert len(got) == len(expected)  # the local copy's batches, the same record skipped the same way
        for (imgs, targets, paths), (ref_imgs, ref_targets, ref_paths) in zip(got, expected):
            assert np.array_equal(imgs, ref_imgs) and np.array_equal(targets, ref_targets) and paths == ref_paths
    with pytest.raises(DamagedRecordError) as err:
        _epoch_and_warnings(streamed(), workers=2, strict=True)
    message = str(err.value)
    assert "\n" not in message and f"record {record} ({file})" in message and url in message


def test_a_shard_damaged_on_the_nodes_disk_is_fetched_again(uploaded, dataset, tmp_path, monkeypatch):
    for upload_kind in ("disk", "encoded"):
        with open_store(dataset[1], "train", kind=upload_kind, imgsz=64) as local:
            expected = np.asarray(local.read_image(1)).copy()
            shard_bytes = int(local.offsets[3])  # records 0-2 in the first shard
        stored = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path / upload_kind,
                            shard_bytes=shard_bytes, upload_kind=upload_kind)
        cached = stored.cached_shard(0)
        assert stored.bounds[1] == 3 and stored.cache.fetched == 1
        _flip_byte(cached, int(stored.offsets[1]) + 10)  # record 1 flipped on this disk after the download
        fetched, _ = _record_fetches(stored, monkeypatch)
        assert np.array_equal(np.asarray(stored.read_image(1)), expected)  # the shard fetched again: intact
        assert fetched == [0] and stored.refetched == 1 and stored.cache.fetched == 2
        assert stored.record_ok(1) and stored.record_ok(0)  # the new copy in the cache
        stored.read_image(0)
        assert stored.refetched == 1 and stored.cache.fetched == 2


def test_a_streamed_encoded_store_gives_the_local_encoded_batches_with_workers(uploaded, dataset, tmp_path):
    import fastload

    # auto: the upload's disk store is at imgsz 64, so at 96 the encoded store (the JPEGs, any imgsz) is streamed
    stored = open_store(uploaded, "train", kind="stream", imgsz=96, cache_dir=tmp_path, cache_bytes=8 << 20,
                        shard_bytes=1, window=3)  # a shard per record, three shuffled together
    assert (stored.upload_kind, stored.decoded, stored.imgsz) == ("encoded", False, None)
    assert stored.description["upload_kind"] == "encoded" and len(stored.bounds) - 1 == len(stored)
    with open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path) as auto_at_64:
        assert auto_at_64.upload_kind == "disk"  # a disk store at the loader's imgsz: nothing to decode
    with open_store(dataset[1], "train", kind="encoded") as local:
        assert [stored.read_image(i) for i in range(len(local))] == [local.read_image(i) for i in range(len(local))]
        assert local.shards() is None  # a local store is visited in any order...
    # ...unless opened in the stream's shards: then its loader gives the stream's batches
    in_shards = open_store(dataset[1], "train", kind="encoded", shard_bytes=1, window=3)
    assert np.array_equal(in_shards.shards().ids, stored.shards().ids) and in_shards.shards().window == 3
    with pytest.raises(ValueError, match="window must be >= 1 shard, got 0"):
        open_store(dataset[1], "train", kind="encoded", shard_bytes=1, window=0)
    with fastload.loader(in_shards, imgsz=96, batch_size=3, workers=0, seed=2) as reference:
        expected = list(reference)
    with fastload.loader(stored, imgsz=96, batch_size=3, workers=2, seed=2) as streamed:
        assert streamed.engine.sampler.partners == "batch"
        got = list(streamed)
    assert len(got) == len(expected) > 0
    for (imgs, targets, paths, _), (ref_imgs, ref_targets, ref_paths, _) in zip(got, expected):
        assert np.array_equal(np.asarray(imgs), np.asarray(ref_imgs))
        assert np.array_equal(np.asarray(targets), np.asarray(ref_targets)) and list(paths) == list(ref_paths)


def _writes(nbytes: int):
    """A shard's download of ``nbytes``, as the stream does it: into the reserved partial file, then renamed."""
    from fastload.store.objects.transfer import partial_path

    def into(dest: Path) -> None:
        partial_path(dest).write_bytes(b"x" * nbytes)
        os.replace(partial_path(dest), dest)
    return into


def test_the_shard_cache_removes_the_least_recently_read_and_dead_downloads(tmp_path):
    from fastload.store.stream import ShardCache, hold_upload

    held = hold_upload(tmp_path, "url-", "build")  # the store's upload, open
    cache = ShardCache(tmp_path, "url-build", "store-shards-1", budget=0)
    block = cache.block
    cache.budget = cache.used() + 3 * block  # the folders, and three shards of a block
    for shard in range(3):
        cache.get(shard, block, _writes(block))
    for shard, when in ((0, 3), (1, 1), (2, 2)):  # shard 1 read longest ago
        os.utime(cache.path(shard), (when, when))
    cache.get(3, block, _writes(block))
    assert not cache.path(1).exists() and all(cache.path(s).exists() for s in (0, 2, 3))
    assert cache.used() == cache.budget and cache.evicted == 1 and cache.fetched == 4
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (cache.folder / f".shard-000009.bin.download-{dead.pid}").write_bytes(b"x" * 2 * block)  # killed midway
    cache.get(4, block, _writes(block))
    assert cache.used() <= cache.budget and not list(tmp_path.rglob(".shard-000009*"))
    with pytest.raises(StoreError, match=f"the stream cache {tmp_path} .* cannot hold a shard of .* raise cache_bytes"):
        cache.get(5, 4 * block, _writes(4 * block))
    os.close(held)


def test_one_budget_bounds_the_whole_cache_dir_unread_uploads_first_mapped_shards_never(tmp_path):
    from fastload.store.stream import ShardCache, hold_upload

    (tmp_path / "not-a-cache-folder").mkdir()  # counted, never removed: the cache removes only its own folders
    (tmp_path / "not-a-cache-folder" / "notes.txt").write_text("kept")
    old = hold_upload(tmp_path, "url-", "old")
    old_cache = ShardCache(tmp_path, "url-old", "store-shards-1", budget=1 << 30)
    other = hold_upload(tmp_path, "elsewhere-", "b")
    other_cache = ShardCache(tmp_path, "elsewhere-b", "store-shards-1", budget=1 << 30)
    block = old_cache.block
    for shard in range(2):
        other_cache.get(shard, block, _writes(block))
        old_cache.get(shard, block, _writes(block))  # read after the other upload's: more recently
    os.close(old)  # its reader ended: the old build is read by no process now
    new = hold_upload(tmp_path, "url-", "new")  # the same URL's new build, as a store opening it does
    # the replaced build is gone, folder and all, when the new one opens; the other upload is kept
    assert not (tmp_path / "url-old").exists() and other_cache.path(1).exists()
    cache = ShardCache(tmp_path, "url-new", "store-shards-1", budget=0)
    cache.budget = cache.used() + block  # one more shard: then the other upload's two make room, then its folder
    cache.get(0, block, _writes(block))
    assert cache.used() <= cache.budget
    os.close(other)  # the other upload's reader ended too
    os.utime(cache.path(0), (1, 1))  # this store's shard read longest ago: still removed after the unread upload's
    for shard in (1, 2):
        cache.get(shard, block, _writes(block))
        assert cache.used() <= cache.budget
    assert not (tmp_path / "elsewhere-b").exists()  # its shards went first, then its folder
    assert [cache.path(s).exists() for s in range(3)] == [True, True, True]
    # a mapped shard is never removed: the least recently read one goes instead; with every shard mapped, one
    # download passes the budget by its size, the next waits for room, then says so in one line
    mapped = cache.map(0)
    assert mapped is not None and len(mapped) == block
    os.utime(cache.path(0), (1, 1))  # and read longest ago
    for shard in (3, 4):
        cache.get(shard, block, _writes(block))
        assert cache.path(0).exists() and cache.used() <= cache.budget
    pinned = [cache.map(s) for s in (1, 2, 3, 4)]
    cache.budget = cache.used()
    cache.get(5, block, _writes(block))
    assert cache.used() == cache.budget + block and all(cache.path(s).exists() for s in range(6))
    pinned.append(cache.map(5))
    cache.wait_s = 0.2
    with pytest.raises(StoreError, match=f"the stream cache {tmp_path} .* found no room for a shard of {block} bytes "
                                         "in 0 s: .* being read .* raise cache_bytes"), \
            pytest.warns(UserWarning, match=f"the stream cache {tmp_path} .* has waited 0 s for room for a shard"):
        cache.get(6, block, _writes(block))
    assert not [line for line in Path("/proc/self/maps").read_text().splitlines()
                if str(tmp_path) in line and "(deleted)" in line]
    del mapped, pinned  # the readers moved on: their shards may go, back within the budget
    cache.get(6, block, _writes(block))
    assert cache.used() <= cache.budget and not cache.path(0).exists()
    mapped = cache.map(6)
    counted = cache.used()
    cache.discard(6)  # a copy found damaged: out of the readers' sight, its bytes counted while it is mapped
    assert not cache.path(6).exists() and cache.used() == counted
    del mapped
    cache.budget = counted
    kept = sorted(p.name for p in cache.folder.glob("shard-*.bin"))
    cache.get(7, block, _writes(block))  # the discarded copy, mapped no more, made the room: no shard went
    assert not list(cache.folder.glob(".shard-000006.bin.*")) and cache.used() <= cache.budget
    assert sorted(p.name for p in cache.folder.glob("shard-*.bin")) == sorted(kept + ["shard-000007.bin"])
    assert (tmp_path / "not-a-cache-folder" / "notes.txt").read_text() == "kept"
    os.close(new)


def _publish_again(url: str) -> str:
    """Publish the store at ``url`` again under a new build (its objects copied there), as a re-upload with
    ``--force`` does; the new build's id."""
    prefix = url.split(f"s3://{BUCKET}/", 1)[1]
    doc = json.loads(_client().get_object(Bucket=BUCKET, Key=f"{prefix}/fastload-manifest.json")["Body"].read())
    old, new = doc["build"], doc["build"] + "-again"
    for key in _keys(f"{prefix}/builds/{old}/"):
        _client().copy_object(Bucket=BUCKET, Key=key.replace(f"/builds/{old}/", f"/builds/{new}/"),
                              CopySource={"Bucket": BUCKET, "Key": key})
    _client().put_object(Bucket=BUCKET, Key=f"{prefix}/fastload-manifest.json", Body=json.dumps(dict(doc, build=new)))
    return new


def _mapped_deleted(pid: int, under: Path) -> list[str]:
    """The files under ``under`` removed while ``pid`` or a process it started maps them (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    pids, frontier = {pid}, {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - pids
        pids |= frontier
    found = []
    for p in pids:
        with contextlib.suppress(OSError):
            found += [line.split(None, 5)[-1].strip() for line in Path(f"/proc/{p}/maps").read_text().splitlines()
                      if str(under) in line and line.endswith("(deleted)")]
    return found


def test_two_builds_and_another_url_share_one_budget_with_forked_workers(uploaded, tmp_path, monkeypatch):
    """One cache_dir, one budget, read by a loader's two forked workers and its read-ahead while another URL's
    store is open and the URL's previous build was read before: at every download, in every process, the bytes
    under cache_dir stay within cache_bytes (plus one shard, when readers map every shard) and no process maps a
    shard removed from it."""
    import fastload
    from fastload.store import stream

    url, other_url = _copy_prefix(uploaded, "shared-cache"), _copy_prefix(uploaded, "shared-cache-other")
    cache_dir = tmp_path / "cache"
    options = dict(kind="stream", imgsz=64, cache_dir=cache_dir, upload_kind="disk")
    with open_store(url, "train", **options) as probe:
        shard_bytes = int(np.diff(probe.offsets).max())  # a shard per record
        room = probe.cache.on_disk(shard_bytes)
    other = open_store(other_url, "train", shard_bytes=shard_bytes, cache_bytes=1 << 20, **options)
    other.read_image(0)  # one shard of another URL's store, open for the whole test
    old = open_store(url, "train", shard_bytes=shard_bytes, cache_bytes=1 << 20, **options)
    budget = other.cache.used() + 4 * room  # the index files of two uploads, the other's shard, and 4 shards
    for i in range(len(old)):  # every shard of the build about to be replaced
        old.read_image(i)
    old_folder = old.cache.folder.parent
    old.close()
    monkeypatch.setattr(stream, "ROOM_WAIT_S", 10.0)  # a download that waits longer for room fails the test
    build = _publish_again(url)
    stored = open_store(url, "train", shard_bytes=shard_bytes, cache_bytes=budget, **options)
    assert stored.build == build and not old_folder.exists()  # the replaced build went when the new one opened
    assert other.cache.path(0).exists() and stored.cache.used() <= budget
    log = tmp_path / "downloads.log"
    loader_pid = os.getpid()
    real_download = stream.download

    def measured(*args, **kwargs):  # in the loader's read-ahead thread and in its workers (forked with it)
        real_download(*args, **kwargs)
        with open(log, "a") as f:
            f.write(json.dumps([stored.cache.used(), _mapped_deleted(loader_pid, cache_dir)]) + "\n")


    monkeypatch.setattr(stream, "download", measured)
    with fastload.loader(stored, imgsz=64, batch_size=2, workers=2, seed=4) as streamed:
        assert [sum(len(b[0]) for b in streamed) for _ in range(2)] == [len(stored)] * 2
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) > len(stored.bounds) - 1  # shards were removed and downloaded again
    assert max(used for used, _ in seen) <= budget + room and not [d for _, d in seen if d], seen
    other.close()
    stored.close()


def test_ray_actors_open_the_streamed_store_into_their_node_cache(dataset, s3_env, tmp_path, local_ray, monkeypatch):
    # a test that starts Ray (the local_ray fixture): under xdist it runs with the Ray tests, possibly beside this
    # module's other tests on another worker, so it uploads under a prefix (and a work folder) of its own
    import fastload
    from fastload.engines.ray_engine import RayEngine, RayOptions
    from fastload.store.upload import convert_to_url

    url = f"s3://{BUCKET}/stores/ray"
    convert_to_url(dataset[0], "disk,encoded", url, imgsz=64, splits="train", workers=1, progress=False,
                   log=lambda *_: None)
    # the actors' credentials and endpoint come from their environment, as on a node of a cluster
    options = RayOptions(actors=1, runtime_env={"env_vars": dict(s3_env)})
    for upload_kind in ("disk", "encoded"):  # decoded records, and JPEGs the actor decodes
        if upload_kind == "encoded":  # this process seen as on a node of its own: the actor's node reads ahead too
            monkeypatch.setattr(RayEngine, "_driver_node_id", lambda self: "the loader's node")
        stored = open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path / "cache", cache_bytes=8 << 20,
                            shard_bytes=4 << 10, upload_kind=upload_kind)
        assert stored.description["url"] == url and json.loads(json.dumps(stored.description)) == stored.description
        with fastload.loader(stored, imgsz=64, batch_size=4, engine="ray", seed=2, engine_options=options) as on_ray, \
                fastload.loader(stored, imgsz=64, batch_size=4, workers=0, seed=2) as reference:
            got, expected = list(on_ray), list(reference)
            assert on_ray.stats()["engine"] == "ray" and len(got) == len(expected) == len(on_ray)
            assert on_ray.engine.read_ahead_nodes == (1 if upload_kind == "encoded" else 0)
            for (imgs, targets, paths, _), (ref_imgs, ref_targets, ref_paths, _) in zip(got, expected):
                assert np.array_equal(np.asarray(imgs), np.asarray(ref_imgs)) and list(paths) == list(ref_paths)
                assert np.array_equal(np.asarray(targets), np.asarray(ref_targets))
        assert stored.cache.used() <= stored.cache.budget


def test_an_actor_asked_to_read_ahead_fetches_its_node_cache_ahead_of_the_loader(uploaded, tmp_path, monkeypatch):
    """The Ray engine asks one actor per node other than its own to read ahead (:meth:`RenderActor.read_ahead`): the
    actor's streamed store (opened from the loader's description, its read-ahead depth included) downloads the
    order's next shards into its node's cache as the loader's position moves. Run here in this process."""
    import fastload
    from fastload.engines.ray_actor import RenderActor, RenderSpec
    from fastload.engines.ray_engine import store_spec
    from fastload.order import shard_permutation

    stored = open_store(uploaded, "train", kind="stream", imgsz=64, cache_dir=tmp_path / "loader", cache_bytes=16 << 20,
                        shard_bytes=1, read_ahead=2, upload_kind="encoded")  # a shard per record
    assert stored.description["read_ahead"] == 2
    description = dict(stored.description, cache_dir=str(tmp_path / "actor-node"))  # that node's cache
    monkeypatch.setattr(stored, "description", description)
    with fastload.loader(stored, imgsz=64, batch_size=2, workers=0) as ld:
        sampler = ld.engine.sampler
    render = RenderSpec(hsv_in_worker=True, layout="nhwc", decode_scale="full", decode_cache_mb=0, axis_kernel="warp",
                        shrink="linear", max_batch_bytes=1 << 20, threads=1, strict=False)
    actor = RenderActor(store_spec(stored, None), sampler, render)
    assert actor.error is None
    view = actor.renderer.store  # the actor's view of its own streamed store: every record, in order
    node_store = view.base
    assert np.array_equal(view.base_indices, np.arange(len(node_store)))
    fetched, arrived = _record_fetches(node_store, monkeypatch)
    ids = node_store.shards().ids
    order = shard_permutation(ids, epoch=0, seed=3)
    need = list(dict.fromkeys(ids[order].tolist()))
    assert len(need) >= 5 and actor.read_ahead(order)
    for _ in range(3):  # the first shard and two ahead, while the loader has been handed nothing
        assert arrived.acquire(timeout=30)
    actor.reached(int(np.flatnonzero(ids[order] == need[1])[0]))  # the loader reached the second shard: one more
    assert arrived.acquire(timeout=30)
    actor.stop_read_ahead()
    assert fetched == need[:4] and all(node_store.cache.path(s).is_file() for s in need[1:4])
    assert node_store.cache.folder.is_relative_to(tmp_path / "actor-node") and stored.cache.fetched == 0
    actor.close()
    stored.close()


def test_loader_workers_forked_while_the_read_ahead_downloads_do_not_hang(uploaded, s3_env, tmp_path, preloaded_python):
    """The CPU engine forks its workers while the loader's read-ahead thread downloads the first shards: a fork
    waits for that download to end (before the fix, a worker inherited a lock held mid-download and the epoch
    never ended). In a process of its own: a hang is a timeout there, not here."""
    import preloaded

    code = ("import fastload\n"
            "from fastload.store import open_store\n"
            f"store = open_store({uploaded!r}, 'train', kind='stream', imgsz=64, cache_dir={str(tmp_path)!r}, "
            "shard_bytes=1 << 15, upload_kind='disk')\n"
            "assert store.read_ahead_shards == 2 and len(store.bounds) > 3\n"
            "with fastload.loader(store, imgsz=64, batch_size=2, workers=2, seed=0) as fl:\n"
            "    print([sum(len(b[0]) for b in fl) for _ in range(2)])\n")
    (tmp_path / "two_epochs.py").write_text(code)
    done = preloaded.run(preloaded_python, [str(tmp_path / "two_epochs.py")], tmp_path,
                         dict(preloaded.base_env(REPO), **s3_env), timeout=90)
    assert done.returncode == 0 and done.stdout.split() == ["[12,", "12]"], done.stderr[-2000:]


def test_a_process_forked_during_a_shard_download_does_not_keep_its_lock(tmp_path):
    import multiprocessing as mp

    from fastload.store.objects.transfer import partial_path
    from fastload.store.shm import flock_current
    from fastload.store.stream import ShardCache

    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    children = []

    def fork_while_downloading(dest: Path) -> None:  # as a loader's workers started while the read-ahead downloads
        child = ctx.Process(target=_started_then_wait, args=(started, release), daemon=True)
        child.start()
        children.append(child)
        partial_path(dest).write_bytes(b"x")
        os.replace(partial_path(dest), dest)

    cache = ShardCache(tmp_path, "upload", "store-shards-1", budget=1 << 20)
    cache.get(0, 1, fork_while_downloading)
    assert started.wait(timeout=30)  # the child runs (its fork handlers ran before its target)
    try:  # the child still lives: the shard's lock is free all the same
        os.close(flock_current(cache.folder / ".shard-000000.lock", wait=False))
    finally:
        release.set()
        children[0].join()


def _started_then_wait(started, release) -> None:
    started.set()
    release.wait()



def test_an_object_loader_workers_cannot_fetch_is_the_in_process_error_in_one_line(uploaded, tmp_path, capsys):
    """A records object gone after the store opened (issue 35): with workers the consumer raises what a loader
    rendering in-process raises, the same type and one line naming the URL, which a command prints alone; the
    worker's traceback is kept on it, and shown with --debug."""
    import traceback

    import fastload
    from fastload.cli.errors import run_reported

    url = _copy_prefix(uploaded, "gone-under-workers")
    stored = open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path, shard_bytes=1, read_ahead=0,
                        upload_kind="disk")
    _client().delete_object(Bucket=BUCKET, Key=stored.records_url.key)

    def first_batch(workers: int) -> None:
        with fastload.loader(stored, imgsz=64, batch_size=4, workers=workers, seed=0) as fl:
            next(iter(fl))

    with pytest.raises(StoreError) as in_process:
        first_batch(0)
    line = str(in_process.value)
    assert line == f"{stored.records_url}: no such object" and not hasattr(in_process.value, "worker_traceback")
    capsys.readouterr()
    assert run_reported("fastload cmd", lambda: first_batch(2)) == 1
    assert capsys.readouterr().err == f"fastload cmd: {line}\n"
    with pytest.raises(StoreError) as from_worker:
        run_reported("fastload cmd", lambda: first_batch(2), debug=True)
    assert type(from_worker.value) is type(in_process.value) and str(from_worker.value) == line
    assert f"{type(in_process.value).__name__}: {line}" in from_worker.value.worker_traceback
    shown = "".join(traceback.format_exception(from_worker.value))  # as --debug shows it
    assert "raised by fastload worker 0 (pid " in shown and "in _fetch_shard" in shown
    stored.close()


def test_an_object_a_ray_actor_cannot_fetch_is_the_in_process_error_in_one_line(dataset, s3_env, tmp_path, local_ray):
    """The Ray engine gives the error a loader rendering in-process gives (issue 35), as the CPU engine's workers
    do (above); its own upload, as the test above (a test that starts Ray may run on another xdist worker)."""
    import fastload
    from fastload.engines.ray_engine import RayOptions
    from fastload.store.upload import convert_to_url

    url = f"s3://{BUCKET}/stores/ray-gone"
    convert_to_url(dataset[0], "disk", url, imgsz=64, splits="train", workers=1, progress=False, log=lambda *_: None)
    stored = open_store(url, "train", kind="stream", imgsz=64, cache_dir=tmp_path, shard_bytes=1, read_ahead=0)
    on_ray = fastload.loader(stored, imgsz=64, batch_size=4, engine="ray", seed=0,
                             engine_options=RayOptions(actors=1, runtime_env={"env_vars": dict(s3_env)}))
    _client().delete_object(Bucket=BUCKET, Key=stored.records_url.key)  # gone once the actor has opened the store
    raised = []
    for fl in (fastload.loader(stored, imgsz=64, batch_size=4, workers=0, seed=0), on_ray):
        with fl, pytest.raises(StoreError) as info:
            next(iter(fl))
        raised.append(info.value)
    in_process, from_actor = raised
    assert type(from_actor) is type(in_process) and str(from_actor) == str(in_process)
    assert str(in_process) == f"{stored.records_url}: no such object"
    assert "in _fetch_shard" in from_actor.worker_traceback
    assert from_actor.__notes__[0].startswith("raised by engine 'ray': render actor 0 (node ")
    stored.close()
