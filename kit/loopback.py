"""HTTP to servers on this machine's loopback (or a container network) without proxies.

``urllib``'s default opener follows ``http_proxy``/``https_proxy`` from the
environment; with a proxy set and no ``no_proxy``, a request to 127.0.0.1 would
go to the proxy: health waits hang on it and a TTFT would include it. Every
request the kit makes to its own servers goes through ``urlopen`` here, whose
opener has an empty ``ProxyHandler``: no proxy, whatever the environment says.
"""

from __future__ import annotations

import urllib.request
from http.client import HTTPResponse

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def urlopen(request: str | urllib.request.Request, timeout: float) -> HTTPResponse:
    """``urllib.request.urlopen`` that never uses a proxy."""
    return _OPENER.open(request, timeout=timeout)
