"""The Compute client's session: requests' environment settings, looked up once per origin."""

from __future__ import annotations

import pytest
import requests
from gce_watchdog.lib.compute import env_cached_session_class

pytestmark = pytest.mark.pure

URLS = (
    "https://compute.googleapis.com/compute/v1/projects/p/zones/z/instances/a/serialPort",
    "https://compute.googleapis.com/compute/v1/projects/p/aggregated/instances",
    "http://127.0.0.1:8080/compute/v1/projects/p/zones/z/instances/a",
    "https://internal.example.com:8443/x",
)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"HTTPS_PROXY": "http://proxy:3128", "HTTP_PROXY": "http://proxy:3129"},
        {"https_proxy": "http://proxy:3128", "no_proxy": "127.0.0.1,.example.com"},
        {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "*"},
        {"REQUESTS_CA_BUNDLE": "/etc/ssl/bundle.pem"},
        {"CURL_CA_BUNDLE": "/etc/ssl/curl.pem", "ALL_PROXY": "socks5://s:1080"},
    ],
)
def test_the_same_settings_as_requests_for_every_url(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "REQUESTS_CA_BUNDLE",
              "CURL_CA_BUNDLE"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
        monkeypatch.delenv(k.lower(), raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    plain, cached = requests.Session(), env_cached_session_class(requests.Session)()
    for _ in range(2):  # the second time from the cache
        for url in URLS:
            for proxies, verify in (({}, None), ({"no_proxy": "googleapis.com"}, False)):
                want = plain.merge_environment_settings(url, dict(proxies), None, verify, None)
                got = cached.merge_environment_settings(url, dict(proxies), None, verify, None)
                assert got == want, url


def test_trust_env_off_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    s = env_cached_session_class(requests.Session)()
    s.trust_env = False
    assert s.merge_environment_settings(URLS[0], {}, None, None, None)["proxies"] == {}


def test_one_class_per_base() -> None:
    assert env_cached_session_class(requests.Session) is env_cached_session_class(requests.Session)
