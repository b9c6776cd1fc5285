"""The fault-injecting, WAN-emulating S3 proxy (miles_disagg/bench/s3_proxy.py) in front of moto in
server mode (tests/s3_server.py): boto3 through it sees the server unchanged, and each fault, the
bandwidth and the round trip do what they are set to. Timing bounds: lower bounds exact, upper
bounds scaled by the machine's load (tests/deadlines.py)."""

from __future__ import annotations

import http.client
import io
import os
import threading
import time

import pytest
from botocore.exceptions import ClientError
from deadlines import scaled
from s3_fixtures import s3_bucket, s3_server  # noqa: F401 - fixtures

from miles_disagg.bench.s3_proxy import Fault, S3Proxy

pytestmark = pytest.mark.timeout(60)
RETRIES = {"mode": "standard", "max_attempts": 5}


@pytest.fixture
def proxy(s3_server):  # noqa: F811 - the fixture
    with S3Proxy(s3_server.url).start() as running:
        yield running


@pytest.fixture
def through(s3_bucket, proxy):  # noqa: F811 - the fixture
    """``(client, bucket)``: a boto3 client whose endpoint is the proxy (standard retries, 5 attempts)."""
    server, bucket = s3_bucket
    return server.client(proxy.url, retries=RETRIES), bucket


def timed(call, *args, **kwargs) -> float:
    start_s = time.monotonic()
    call(*args, **kwargs)
    return time.monotonic() - start_s


def test_a_5_mb_object_round_trips_byte_identically_and_is_counted(through, proxy):
    client, bucket = through
    data = os.urandom(5_000_000)
    client.put_object(Bucket=bucket, Key="big", Body=io.BytesIO(data))  # a file body: Expect: 100-continue
    assert client.get_object(Bucket=bucket, Key="big")["Body"].read() == data
    assert proxy.requests >= 2
    assert proxy.bytes_from_client > len(data) and proxy.bytes_to_client > len(data)
    proxy.reset_counters()
    assert (proxy.requests, proxy.bytes_from_client, proxy.bytes_to_client) == (0, 0, 0)


def test_a_client_connection_carries_several_requests(s3_bucket, proxy):  # noqa: F811
    server, bucket = s3_bucket
    server.client().put_object(Bucket=bucket, Key="small", Body=b"x" * 1000)
    connection = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    sockets = []
    for _ in range(3):
        connection.request("GET", f"/{bucket}/small")
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b"x" * 1000 and not response.will_close
        sockets.append(connection.sock)
    connection.close()
    assert len(set(map(id, sockets))) == 1 and proxy.requests == 3


def test_a_chunked_request_body_is_streamed_through(s3_bucket, proxy):  # noqa: F811
    server, bucket = s3_bucket
    pieces = [os.urandom(100_000) for _ in range(5)]
    connection = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    connection.request("PUT", f"/{bucket}/chunked", body=iter(pieces), encode_chunked=True)
    assert connection.getresponse().status == 200
    connection.close()
    assert server.client().get_object(Bucket=bucket, Key="chunked")["Body"].read() == b"".join(pieces)


def test_slowdowns_and_500s_are_answered_by_the_proxy_and_retried(through, proxy):
    client, bucket = through
    client.put_object(Bucket=bucket, Key="k", Body=b"payload")
    proxy.add_fault(Fault(kind="slowdown", method="GET", times=2))
    proxy.add_fault(Fault(kind="error500", method="PUT", path_contains="/other", times=1))
    requests_before = proxy.requests
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"payload"
    client.put_object(Bucket=bucket, Key="other", Body=io.BytesIO(b"second"))  # a 500 before its 100-continue
    assert proxy.faults_fired() == {"slowdown": 2, "error500": 1}
    assert proxy.requests - requests_before == 5  # 3 attempts of the GET, 2 of the PUT
    assert client.get_object(Bucket=bucket, Key="other")["Body"].read() == b"second"  # the rules are spent


def test_without_retries_a_slowdown_reaches_the_client_as_s3_says_it(s3_bucket, proxy):  # noqa: F811
    server, bucket = s3_bucket
    proxy.add_fault(Fault(kind="slowdown", times=1))
    with pytest.raises(ClientError) as raised:
        server.client(proxy.url, retries={"mode": "standard", "max_attempts": 1}).list_objects_v2(Bucket=bucket)
    assert raised.value.response["Error"]["Code"] == "SlowDown"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503


def test_a_reset_mid_body_truncates_the_response_with_a_connection_error(s3_bucket, proxy):  # noqa: F811
    server, bucket = s3_bucket
    data = os.urandom(2_000_000)
    server.client().put_object(Bucket=bucket, Key="obj", Body=data)
    proxy.add_fault(Fault(kind="reset_mid_body", method="GET", path_contains="/obj", times=1))
    connection = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    connection.request("GET", f"/{bucket}/obj", headers={"Range": "bytes=0-999999"})
    response = connection.getresponse()
    assert response.status == 206 and response.getheader("Content-Length") == "1000000"
    received = bytearray()
    with pytest.raises((ConnectionError, http.client.IncompleteRead)):
        while len(received) < 1_000_000:
            piece = response.read1(65536)
            if not piece:
                raise http.client.IncompleteRead(bytes(received))
            received += piece
    connection.close()
    assert len(received) < 1_000_000 and bytes(received) == data[: len(received)]
    assert proxy.faults_fired() == {"reset_mid_body": 1}
    assert server.client(proxy.url).get_object(Bucket=bucket, Key="obj")["Body"].read() == data


def test_a_stall_delays_the_request_by_at_least_its_seconds(through, proxy):
    client, bucket = through
    client.put_object(Bucket=bucket, Key="k", Body=b"1")
    proxy.add_fault(Fault(kind="stall", method="HEAD", seconds=0.5, times=1))
    assert timed(client.head_object, Bucket=bucket, Key="k") >= 0.5
    assert proxy.faults_fired() == {"stall": 1}


def test_the_bandwidth_paces_a_download_and_is_one_pipe_for_all_connections(through, proxy):
    client, bucket = through
    client.put_object(Bucket=bucket, Key="two-mb", Body=os.urandom(2_000_000))
    proxy.set_link(4_000_000, rtt_s=0.0)
    elapsed_s = timed(lambda: client.get_object(Bucket=bucket, Key="two-mb")["Body"].read())
    assert 0.4 <= elapsed_s <= scaled(3.0)

    def half() -> None:
        client.get_object(Bucket=bucket, Key="two-mb", Range="bytes=0-999999")["Body"].read()

    threads = [threading.Thread(target=half) for _ in range(2)]
    start_s = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(scaled(10))
    assert time.monotonic() - start_s >= 0.4  # two 1 MB downloads share the 4 MB/s
    proxy.set_link(None, rtt_s=0.0)
    assert timed(lambda: client.get_object(Bucket=bucket, Key="two-mb")["Body"].read()) < elapsed_s


def test_the_round_trip_time_is_added_to_every_request(through, proxy):
    client, bucket = through
    client.put_object(Bucket=bucket, Key="k", Body=b"1")
    proxy.set_link(None, rtt_s=0.2)
    assert timed(lambda: [client.head_object(Bucket=bucket, Key="k") for _ in range(3)]) >= 3 * 0.2


def test_conditional_writes_are_refused_as_s3_does_through_the_proxy(through):
    client, bucket = through
    first = client.put_object(Bucket=bucket, Key="LATEST", Body=b"1", IfNoneMatch="*")
    second = client.put_object(Bucket=bucket, Key="LATEST", Body=b"2", IfMatch=first["ETag"])
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": first["ETag"]}):  # exists; stale etag
        with pytest.raises(ClientError) as raised:
            client.put_object(Bucket=bucket, Key="LATEST", Body=b"3", **condition)
        assert raised.value.response["Error"]["Code"] == "PreconditionFailed", condition
    assert client.get_object(Bucket=bucket, Key="LATEST")["ETag"] == second["ETag"]


def test_stop_closes_open_connections_and_ends_every_thread(s3_bucket, s3_server):  # noqa: F811
    _, bucket = s3_bucket
    proxy = S3Proxy(s3_server.url).start()
    proxy.set_link(None, rtt_s=30.0)  # a request waiting out a long round trip
    idle = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    idle.connect()
    waiting = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    waiting.request("GET", f"/{bucket}")
    while proxy.requests < 1:
        time.sleep(0.01)
    stop_s = timed(proxy.stop)
    assert stop_s <= scaled(1.5)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        waiting.getresponse()
    assert [t for t in threading.enumerate() if t.name == "s3-proxy"] == []
    with pytest.raises(ConnectionError):
        http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=2).request("GET", "/")
    idle.close()
