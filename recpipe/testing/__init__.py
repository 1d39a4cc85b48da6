"""Test and benchmark tooling that ships with the package (standard library only).

:mod:`recpipe.testing.cluster` emulates a cluster of hosts on one Linux machine (network
namespaces joined by shaped veth links) and starts processes inside its hosts.
"""

from __future__ import annotations
